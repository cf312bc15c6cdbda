"""docs/cli.md as written: its commands run and say what the page shows.

Every ```python block that starts with ``# NAME.py`` is written to a working
directory as that file; every ```console block is run there, command by
command (``$ jaxprec ...``, ``$ python ...``, ``VAR=value`` prefixes), in the
order of the page: a ``jaxprec`` command through the CLI's ``main`` in this
process (what ``python -m jaxprec`` runs, without starting an interpreter),
its output and that of the programs it starts read from the file descriptors
as a terminal shows them; a ``python`` command, and one that sets a variable
JAX reads when it starts (``JAX_...=``), as a process of its own. A command
must exit 0, or with the status that a following ``$ echo $?`` shows; the
lines shown under it must appear in its output (stdout and stderr) in that
order, where ``...`` is any text (a line of its own: any lines). The page's
own version numbers and the kernel lines of ``jaxprec info``, which name this
machine's CPU, are the only text read loosely. The page also names every
command and option of the parser.
"""

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

from jaxprec._src.cli.cli import _parser, main

PAGE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "cli.md")
TEXT = open(PAGE, encoding="utf-8").read()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", TEXT, re.M | re.S)

# Commands the page shows that run what it does not give (a test suite): not
# run, and each must still be on the page.
NOT_RUN = {"jaxprec run -p bf16 -- pytest tests/": "runs the reader's test suite"}
# A training script of the reader's own, which the page does not list.
TRAIN = "import os, sys\nprint('train', sys.argv[1:], os.environ.get('JAX_DEFAULT_MATMUL_PRECISION'))\n"
# Lines that describe this machine: only their text up to the value is read.
MACHINE = ("emulation kernel: auto (source: default): ",
           "  why: chosen from the CPU's feature flags, not timed: ")
VERSION = re.compile(r"\b\d+\.\d+\.\d+(\.?dev\d+)?\b")


def files() -> dict[str, str]:
  """The page's files: ``{name: text}`` of each ```python block headed ``# NAME.py``."""
  out = {}
  for lang, body in BLOCKS:
    first = body.splitlines()[0] if body else ""
    m = re.match(r"# (\w+\.py)\b", first)
    if lang == "python" and m:
      out[m.group(1)] = body
  return out


def sessions() -> list[list[tuple[str, list[str]]]]:
  """Each ```console block as ``[(command, shown lines), ...]``."""
  out = []
  for lang, body in BLOCKS:
    if lang != "console":
      continue
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
      if line.startswith("$ "):
        steps.append((line[2:], []))
      else:
        assert steps, f"console block starts with output: {line!r}"
        steps[-1][1].append(line)
    out.append(steps)
  return out


SESSIONS = sessions()


def test_the_page_has_runnable_sessions_and_files():
  assert len(SESSIONS) >= 6
  assert {"model.py", "mymodel.py", "torch_ref.py", "serve.py"} <= set(files())
  commands = [c for s in SESSIONS for c, _ in s]
  for skipped in NOT_RUN:
    assert skipped in commands, f"{skipped!r} is no longer on the page"


def _line_pattern(shown: str) -> re.Pattern:
  shown = VERSION.sub("V", shown)
  for prefix in MACHINE:
    if shown.startswith(prefix):
      return re.compile(re.escape(prefix) + ".*")
  return re.compile(".*".join(re.escape(p) for p in shown.split("...")))


def assert_shows(shown: list[str], output: str, command: str) -> None:
  """The shown lines appear in ``output``, in order (``...``: any text)."""
  lines = [VERSION.sub("V", l) for l in output.splitlines()]
  at = 0
  for want in shown:
    if want.strip() == "...":
      continue
    pattern = _line_pattern(want)
    while at < len(lines) and not pattern.fullmatch(lines[at]):
      at += 1
    assert at < len(lines), (
        f"`{command}` did not print {want!r} (in order); it printed:\n{output}")
    at += 1


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("cli-page")
  for name, text in files().items():
    (path / name).write_text(text, encoding="utf-8")
  (path / "train.py").write_text(TRAIN, encoding="utf-8")
  return path


def _argv(command: str) -> tuple[dict[str, str], list[str]]:
  words = shlex.split(command)
  env = {}
  while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
    k, _, v = words.pop(0).partition("=")
    env[k] = v
  if words[0] == "python":
    words = [sys.executable, *words[1:]]
  return env, words


@contextlib.contextmanager
def _one_output():
  """stdout and stderr, Python's and the file descriptors a started program
  inherits, into one file in the order written (as a terminal shows them);
  yields a function that reads it."""
  with tempfile.TemporaryFile() as f:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    stream = io.TextIOWrapper(io.FileIO(1, "w", closefd=False),
                              encoding="utf-8", write_through=True)
    try:
      os.dup2(f.fileno(), 1)
      os.dup2(f.fileno(), 2)

      def read() -> str:
        stream.flush()
        f.seek(0)
        return f.read().decode("utf-8", "replace")

      with contextlib.redirect_stdout(stream), \
           contextlib.redirect_stderr(stream):
        yield read
    finally:
      stream.flush()
      for fd, old in zip((1, 2), saved):
        os.dup2(old, fd)
        os.close(old)


def _run(command: str, cwd, monkeypatch) -> tuple[int, str]:
  """``(exit status, output)`` of ``command`` run in ``cwd``."""
  extra, argv = _argv(command)
  with monkeypatch.context() as m:
    for k in ("JAX_DEFAULT_MATMUL_PRECISION", "JAXPREC_POLICY",
              "JAXPREC_KERNEL"):  # the page assumes none is set
      m.delenv(k, raising=False)
    for k, v in dict(
        JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", COLUMNS="100",
        PYTHONPATH=os.pathsep.join([str(cwd),
                                    os.environ.get("PYTHONPATH", "")]),
        # `python` in a command is this interpreter, as in the reader's venv
        PATH=os.pathsep.join([os.path.dirname(sys.executable),
                              os.environ.get("PATH", "")]),
        **extra).items():
      m.setenv(k, v)
    if argv[0] != "jaxprec" or any(k.startswith("JAX_") for k in extra):
      # A program of the reader's, or a variable JAX reads when it starts.
      if argv[0] == "jaxprec":
        argv = [sys.executable, "-m", "jaxprec", *argv[1:]]
      done = subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=600)
      return done.returncode, done.stdout
    m.chdir(cwd)
    m.syspath_prepend(str(cwd))
    # A module of the same name another test of this process imported (a
    # `model`) would stand for the page's file: set aside, then put back.
    aside = {p.stem: sys.modules.pop(p.stem) for p in cwd.glob("*.py")
             if p.stem in sys.modules}
    before = set(sys.modules)
    try:
      with _one_output() as read:
        rc = main(argv[1:])
        return rc, read()
    finally:  # the page's files are imported afresh by the next command
      for name in set(sys.modules) - before:
        if str(getattr(sys.modules[name], "__file__", None) or "").startswith(
            str(cwd)):
          del sys.modules[name]
      sys.modules.update(aside)


@pytest.mark.parametrize("session", SESSIONS,
                         ids=[s[0][0][:60] for s in SESSIONS])
def test_console_session_runs_as_written(session, workdir, monkeypatch):
  if any("torch_ref.py" in c for c, _ in session):
    pytest.importorskip("torch", reason="the PyTorch reference needs torch")
  last = None
  for i, (command, shown) in enumerate(session):
    if command == "echo $?":
      assert last is not None and last[0] == int(shown[0]), (
          f"exit status {last[0]}, the page says {shown[0]}:\n{last[1]}")
      continue
    if command in NOT_RUN:
      last = None
      continue
    last = rc, output = _run(command, workdir, monkeypatch)
    said = session[i + 1] if i + 1 < len(session) else None
    if said is None or said[0] != "echo $?":
      assert rc == 0, f"`{command}` exited {rc}:\n{output}"
    assert_shows(shown, output, command)


def test_the_page_names_every_command_and_option():
  parser = _parser()
  sub = next(a for a in parser._actions  # pylint: disable=protected-access
             if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  table = TEXT[:TEXT.index("\n## ")]
  for name, command in sub.choices.items():
    assert f"| `jaxprec {name}" in table, f"the command table lacks {name}"
    for action in command._actions:  # pylint: disable=protected-access
      if action.help == argparse.SUPPRESS:
        continue
      if not action.option_strings or "--help" in action.option_strings:
        continue
      assert any(re.search(r"(?<![\w-])" + re.escape(o) + r"\b", TEXT)
                 for o in action.option_strings), (
          f"docs/cli.md never names {name} {'/'.join(action.option_strings)}")


def test_assert_shows_fails_on_a_missing_or_misordered_line():
  assert_shows(["a", "...", "c ... e"], "a\nb\nc d e\n", "x")
  with pytest.raises(AssertionError):
    assert_shows(["c d e", "a"], "a\nb\nc d e\n", "x")
  with pytest.raises(AssertionError):
    assert_shows(["model.py:7"], "model.py:8\n", "x")
  assert_shows(["jaxprec 0.1.0.dev0, jax 0.10.2"], "jaxprec 0.2.1, jax 0.12.0\n", "x")
