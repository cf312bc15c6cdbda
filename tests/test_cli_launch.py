"""The ``jaxprec`` command's entry point (``_jaxprec_main``): on a terminal
its name is on screen before JAX starts importing, and the line is gone
before the command prints anything; elsewhere it prints nothing of its own."""

import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
from conftest import read_terminal

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Marks on stderr the moment Python starts importing JAX.
HOOK = """\
import importlib.abc, sys
class _Mark(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == "jax":
      sys.stderr.write("<jax import starts>")
      sys.stderr.flush()
      sys.meta_path.remove(self)
    return None
sys.meta_path.insert(0, _Mark())
"""
LAUNCH = "import sys, _jaxprec_main; sys.exit(_jaxprec_main.main())"


def _env(tmp_path):
  (tmp_path / "sitecustomize.py").write_text(HOOK)
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_DEFAULT_MATMUL_PRECISION", "JAXPREC_POLICY")}
  env.update(JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
  return env


def _in_terminal(argv, env, cwd, columns=None):
  """``(exit status, screen)`` of ``argv`` run with stdout and stderr on a
  pseudo-terminal: of ``columns`` columns, or of no known size."""
  pty = pytest.importorskip("pty")
  leader, follower = pty.openpty()
  if columns is not None:
    import fcntl, struct, termios  # noqa: E401, PLC0415
    fcntl.ioctl(follower, termios.TIOCSWINSZ,
                struct.pack("HHHH", 40, columns, 0, 0))
  proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=follower,
                          stderr=follower)
  os.close(follower)
  try:
    screen = read_terminal(leader, timeout=300)
  finally:
    proc.wait(timeout=300)
  return proc.returncode, screen.decode(errors="replace")


def test_the_command_is_named_before_jax_imports_on_a_terminal(tmp_path):
  rc, text = _in_terminal([sys.executable, "-c", LAUNCH, "info"],
                          _env(tmp_path), tmp_path)
  assert rc == 0, text
  start = text.index("jaxprec info: starting...")
  assert start < text.index("<jax import starts>"), text[:300]
  # Cleared before the command's own output.
  cleared = text.index("\r\x1b[K", start)
  assert cleared < text.index("jaxprec 0.") < text.index("precision in force")
  assert "starting..." not in text[cleared:]


def test_usage_errors_stay_one_line_on_a_terminal(tmp_path):
  rc, text = _in_terminal([sys.executable, "-c", LAUNCH, "check",
                           "--precisions", "bfloat61", "--model", "bert"],
                          _env(tmp_path), tmp_path)
  assert rc == 2, text
  visible = text.split("\r\x1b[K")[-1]  # what is left on screen
  assert "starting..." not in visible
  assert visible.strip().startswith("jaxprec: error:"), text


def test_python_m_jaxprec_names_the_command_before_jax_imports(tmp_path):
  """`python -m jaxprec` imports the package (and JAX) before its __main__:
  the package shows the launcher's line first, and __main__ clears it."""
  argv = [sys.executable, "-m", "jaxprec", "check", "--model", "bert",
          "--precisions", "bfloat61"]
  rc, text = _in_terminal(argv, _env(tmp_path), tmp_path)
  assert rc == 2, text
  start = text.index("jaxprec check: starting...")
  assert start < text.index("<jax import starts>"), text[:300]
  assert text.count("starting...") == 1, text
  cleared = text.index("\r\x1b[K", start)
  assert cleared < text.index("jaxprec: error:"), text
  visible = text.split("\r\x1b[K")[-1]
  assert "starting" not in visible
  # Piped, and a program that imports jaxprec on a terminal: no such line.
  piped = subprocess.run(argv, cwd=tmp_path, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=300,
                         check=False)
  assert "starting" not in piped.stderr and "\x1b" not in piped.stderr
  rc, text = _in_terminal([sys.executable, "-c", "import jaxprec"],
                          _env(tmp_path), tmp_path)
  assert rc == 0 and "starting" not in text, text


@pytest.mark.parametrize("columns, width", [(90, 90), (None, 100)])
def test_an_error_is_folded_at_spaces_to_the_terminal(tmp_path, columns,
                                                      width):
  """A long error is folded at the terminal's width (100 where the terminal
  has no size), at spaces; a pipe keeps it on one line."""
  env = {k: v for k, v in _env(tmp_path).items() if k != "COLUMNS"}
  argv = ["check", "--model", "bert", "--reference", "bfloat61"]
  rc, text = _in_terminal([sys.executable, "-c", LAUNCH, *argv], env,
                          tmp_path, columns)
  assert rc == 2, text
  visible = text.split("\r\x1b[K")[-1].replace("\r\n", "\n").strip()
  lines = visible.splitlines()
  assert lines[0].startswith("jaxprec: error: --reference: Invalid "
                             "precision 'bfloat61'"), text
  assert len(lines) > 1 and max(map(len, lines)) <= width, lines
  assert max(map(len, lines)) > width - 20, lines  # the width is used
  assert all(l.startswith("  ") for l in lines[1:]), lines
  piped = subprocess.run([sys.executable, "-c", LAUNCH, *argv], cwd=tmp_path,
                         env=env, capture_output=True, text=True,
                         timeout=300, check=False)
  (line,) = [l for l in piped.stderr.splitlines() if "error" in l]
  # (after the import mark of HOOK)
  assert " ".join(l.strip() for l in lines) == line.split(">", 1)[-1]


def test_nothing_of_its_own_when_stderr_is_not_a_terminal(tmp_path):
  proc = subprocess.run([sys.executable, "-c", LAUNCH, "info"], cwd=tmp_path,
                        env=_env(tmp_path), capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "starting" not in proc.stderr and "\x1b" not in proc.stderr
  assert proc.stderr.startswith("<jax import starts>")


def test_the_console_script_is_the_launcher():
  meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert meta["project"]["scripts"]["jaxprec"] == "_jaxprec_main:main"
  assert "_jaxprec_main" in meta["tool"]["setuptools"]["py-modules"]
  assert (ROOT / "_jaxprec_main.py").is_file()
