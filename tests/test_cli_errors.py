"""The command line's exit codes and one-line errors.

* ``sys.exit`` in the user's module or function exits as Python would.
* ``--out``, ``--precisions`` and ``--reference`` are validated before the
  model runs: one line, exit 2, no traceback.
* A bad ``JAX_DEFAULT_MATMUL_PRECISION`` stops the command (exit 2) but not
  ``--help``/``--version``, and never another application's ``python -m``.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxprec._src.cli.cli import main
from jaxprec._src.core import names
from conftest import one_line_error, run_cli as run, run_cli_json as run_json, unfolded

MODEL = textwrap.dedent("""\
    import sys
    import jax, jax.numpy as jnp
    import numpy as np

    W = jax.random.normal(jax.random.key(0), (32, 32), jnp.float32) / 6
    X = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)

    def net(w, x):
      return {"h": jnp.tanh(x @ w)}

    def make():
      return net, (W, X)

    def numpy64():
      rng = np.random.default_rng(0)
      return net, (rng.standard_normal((32, 32)) / 6, rng.standard_normal((4, 32)))

    def exits_message():
      sys.exit("boom")

    def exits_3():
      sys.exit(3)

    def exits_0():
      sys.exit(0)

    def exits_none():
      sys.exit()

    def exits_inside():
      def fn(x):
        sys.exit("inside fn")
      return fn, (X,)

    def interrupted():
      def fn(x):
        raise KeyboardInterrupt  # Ctrl-C while the check runs
      return fn, (X,)
    """)

EXITS_AT_IMPORT = "import sys\nsys.exit('exit at import')\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
  """The current directory holds the model files and can import them."""
  (tmp_path / "clierr_model.py").write_text(MODEL)
  (tmp_path / "clierr_exits.py").write_text(EXITS_AT_IMPORT)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
  yield tmp_path
  for name in list(sys.modules):
    if name.startswith(("clierr_", "_jaxprec_audit_clierr_")):
      del sys.modules[name]


# ---------------------------------------------------------------------------
# Item 6: sys.exit in the user's code.


@pytest.mark.parametrize("command", ["audit", "check", "search"])
@pytest.mark.parametrize("function, code, message", [
    ("exits_message", 1, "boom"),
    ("exits_3", 3, None),
    ("exits_0", 0, None),
    ("exits_none", 0, None),
])
def test_sys_exit_in_function_exits_as_python_does(project, capsys, command,
                                                   function, code, message):
  extra = ["--tolerance", "1e-3"] if command == "search" else []
  rc, out, err = run(capsys, command, f"clierr_model:{function}", *extra)
  assert rc == code, err
  assert out == ""
  # Without a terminal, the command's phase lines come first ("jaxprec
  # check: importing ..."); then the message alone.
  rest = "".join(l for l in err.splitlines(keepends=True)
                 if not l.startswith(f"jaxprec {command}: "))
  assert rest == (f"{message}\n" if message else ""), err


@pytest.mark.parametrize("target", ["clierr_exits:make", "clierr_exits.py:make"])
def test_sys_exit_at_module_import_exits_1_with_the_message(project, capsys,
                                                            target):
  rc, out, err = run(capsys, "audit", target)
  assert (rc, out, err) == (1, "", "exit at import\n")


def test_sys_exit_inside_the_checked_function(project, capsys):
  rc, out, err = run(capsys, "check", "clierr_model:exits_inside", "--out",
                     str(project / "r"))
  assert rc == 1
  assert err.strip().splitlines()[-1] == "inside fn"
  assert not (project / "r").exists()


def test_sys_exit_in_a_console_script_subprocess(project):
  proc = subprocess.run(
      [sys.executable, "-m", "jaxprec", "audit", "clierr_model:exits_message"],
      capture_output=True, text=True, cwd=project, timeout=120)
  assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "boom\n")


# ---------------------------------------------------------------------------
# Item 10: arguments checked before the model runs.


def test_out_that_is_a_file_exits_2_before_the_check(project, capsys):
  (project / "taken").write_text("not a directory")
  rc, out, err = run(capsys, "check", "clierr_model:make", "--out", "taken",
                     "--json")
  one_line_error(rc, err, 2, "--out 'taken'", "not a directory")
  assert out == ""  # Nothing was checked, nothing printed.


def test_out_below_a_file_exits_2_before_the_check(project, capsys):
  (project / "taken").write_text("not a directory")
  rc, out, err = run(capsys, "check", "clierr_model:make", "--out",
                     os.path.join("taken", "sub", "dir"))
  one_line_error(rc, err, 2, "cannot be created", "is not a directory")
  assert out == ""


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True,
                    reason="root may write anywhere")
def test_out_in_a_read_only_directory_exits_2(project, capsys):
  locked = project / "locked"
  locked.mkdir()
  locked.chmod(0o500)
  try:
    rc, out, err = run(capsys, "check", "clierr_model:make", "--out",
                       str(locked / "rep"))
  finally:
    locked.chmod(0o700)
  one_line_error(rc, err, 2, "not writable")
  assert out == ""


def test_ctrl_c_during_check_is_one_line_and_exit_130(project, capsys):
  rc, out, err = run(capsys, "check", "clierr_model:interrupted")
  assert rc == 130  # after the phase line that was printed when it began
  assert err.splitlines()[-1:] == ["jaxprec: interrupted"], err
  assert "Traceback" not in err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc")
def test_out_where_nothing_can_be_created_exits_2_before_the_check(
    project, capsys):
  """Permissions say root may write in ``/proc``; creating fails."""
  rc, out, err = run(capsys, "check", "clierr_model:make", "--out", "/proc/x")
  one_line_error(rc, err, 2, "--out '/proc/x' is not writable", "'/proc'")
  assert out == ""


@pytest.mark.parametrize("name", ["divergence.png", "report.json"])
def test_out_holding_a_directory_named_as_an_output_exits_2(project, capsys,
                                                            name):
  (project / "rep" / name).mkdir(parents=True)
  rc, out, err = run(capsys, "check", "clierr_model:make", "--out", "rep")
  one_line_error(rc, err, 2, f"holds a directory named {name!r}")
  assert out == "" and (project / "rep" / name).is_dir()


def test_out_is_created_when_usable(project, capsys):
  rc, out, err = run(capsys, "check", "clierr_model:make", "--precisions",
                     "bf16", "--out", os.path.join("new", "deeper"))
  assert rc == 0, err
  assert (project / "new" / "deeper" / "report.json").is_file()


@pytest.mark.parametrize("precisions, repeated", [
    ("bf16,bf16", "bfloat16 (as bf16)"),
    ("bfloat16,float32,bfloat16", "bfloat16"),
    # Two spellings of one precision are the same row twice.
    ("bf16,bfloat16", "bfloat16 (as bf16 and bfloat16)"),
    ("fp32,highest,bf16", "float32 (as fp32 and highest)"),
])
def test_repeated_precision_exits_2(project, capsys, precisions, repeated):
  rc, out, err = run(capsys, "check", "clierr_model:make", "--precisions",
                     precisions)
  one_line_error(rc, err, 2, f"--precisions repeats {repeated}")


@pytest.mark.parametrize("command", ["check", "search"])
@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**64 + 1), "1.5", "x"])
def test_a_seed_out_of_range_exits_2_with_one_line(capsys, command, seed):
  extra = ["--tolerance", "1e-3"] if command == "search" else []
  rc = main([command, "--model", "bert", "--seed", seed, *extra])
  _, err = capsys.readouterr()
  err = unfolded(err)
  assert rc == 2 and "Traceback" not in err and err.count("\n") == 1
  assert f"argument --seed: invalid seed {seed!r}: an integer from 0 to " \
      f"{2**32 - 1}" in err


def test_the_largest_seed_builds_the_model():
  import jax  # noqa: PLC0415
  import jaxprec.models as models  # noqa: PLC0415
  fn, args = models.MODELS["bert"]("tiny", 2**32 - 1)
  assert jax.tree_util.tree_leaves(jax.eval_shape(fn, *args))


def python(*argv, env_value=None, cwd=None):
  env = dict(os.environ)
  env.pop(names.ENV_VAR, None)
  if env_value is not None:
    env[names.ENV_VAR] = env_value
  return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                        env=env, cwd=cwd, timeout=120)


@pytest.mark.parametrize("argv", [
    ["--help"], ["-h"], ["--version"], ["check", "--help"], ["run", "--help"],
])
def test_help_and_version_work_with_a_bad_env_var(argv):
  proc = python("-m", "jaxprec", *argv, env_value="bogus")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(("usage: jaxprec", "jaxprec 0."))
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxprec: warning: ignoring "
                                                 "JAX_DEFAULT_MATMUL_PRECISION")
  assert "'bogus'" in lines[0]


@pytest.mark.parametrize("argv", [
    ["info"], ["check", "--model", "bert"],
    ["run", "-p", "f32", "--", "python", "--help"],
])
def test_commands_exit_2_with_one_line_on_a_bad_env_var(argv):
  proc = python("-m", "jaxprec", *argv, env_value="bogus")
  assert proc.returncode == 2
  assert proc.stdout == ""
  lines = proc.stderr.splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("jaxprec: error: JAX_DEFAULT_MATMUL_PRECISION")
  assert "'bogus'" in lines[0] and "Traceback" not in proc.stderr


def test_another_python_m_application_gets_the_value_error(tmp_path):
  pkg = tmp_path / "someapp"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "__main__.py").write_text(textwrap.dedent("""\
      try:
        import jaxprec
      except ValueError as e:
        print("caught ValueError:", str(e)[:40])
      """))
  proc = python("-m", "someapp", env_value="bogus", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("caught ValueError: JAX_DEFAULT_MATMUL_PRECISION")
  # Imported from the package's __init__ (argv[0] is still '-m') too.
  (pkg / "__init__.py").write_text("import jaxprec\n")
  proc = python("-m", "someapp", env_value="bogus", cwd=tmp_path)
  assert proc.returncode == 1
  assert "ValueError: JAX_DEFAULT_MATMUL_PRECISION" in proc.stderr
  assert "jaxprec: error" not in proc.stderr


@pytest.mark.parametrize("argv, orig_argv, expected", [
    (["/venv/bin/jaxprec", "info"], ["/venv/bin/python", "/venv/bin/jaxprec"], True),
    (["C:\\venv\\Scripts\\jaxprec.exe"], [], True),
    (["-m", "info"], ["python", "-m", "jaxprec", "info"], True),
    (["-m", "info"], ["python", "-X", "dev", "-mjaxprec", "info"], True),
    (["-m", "info"], ["python", "-W", "error", "-m", "jaxprec.__main__"], True),
    (["-m", "info"], ["python", "-m", "someapp", "info"], False),
    (["/src/someapp/__main__.py"], ["python", "-m", "someapp"], False),
    (["/src/jaxprec/__main__.py"], ["python", "-m", "jaxprec"], True),
    (["train.py", "-m", "jaxprec"], ["python", "train.py", "-m", "jaxprec"], False),
    (["-c"], ["python", "-c", "import jaxprec", "-m", "jaxprec"], False),
    (["/usr/bin/jaxprecx"], ["python", "/usr/bin/jaxprecx"], False),
    ([], [], False),
])
def test_running_as_cli_is_jaxprecs_own_command_only(argv, orig_argv, expected):
  assert names.running_as_cli(argv, orig_argv) is expected


# ---------------------------------------------------------------------------
# Items 8 and 9 on the command line.


def test_numpy_float64_arguments_are_accepted(project, capsys):
  rc, out, err = run(capsys, "check", "clierr_model:numpy64", "--precisions",
                     "bf16", "--out", "r64")
  assert rc == 0, err
  assert "Traceback" not in err and "KeyError" not in err


@pytest.mark.parametrize("reference, fragments", [
    ("ref.txt", ["'ref.txt'", ".npz", ".npy", ".safetensors"]),
    ("ref.h5", ["'ref.h5'", ".npz", ".npy", ".safetensors"]),
    ("missing.npz", ["'missing.npz'", "no such reference file"]),
    ("sub/missing.safetensors", ["'sub/missing.safetensors'", "no such"]),
    ("corrupt.npz", ["'corrupt.npz'", ".npz", ".safetensors"]),
    ("CORRUPT.NPZ", ["'CORRUPT.NPZ'", ".npz", ".safetensors"]),
    ("pickled.npz", ["'pickled.npz'"]),
])
def test_bad_reference_files_exit_2_naming_the_file(project, capsys, reference,
                                                    fragments):
  (project / "ref.txt").write_text("0 1 2")
  (project / "corrupt.npz").write_bytes(b"PK\x03\x04 this is not a zip file")
  (project / "CORRUPT.NPZ").write_bytes(b"garbage")
  np.savez(project / "pickled.npz", h=np.array([{"a": 1}], dtype=object))
  rc, out, err = run(capsys, "check", "clierr_model:make", "--reference",
                     reference, "--out", "rr")
  one_line_error(rc, err, 2, *fragments)
  assert out == ""


def test_upper_case_npz_reference_is_read(project, capsys):
  rng = np.random.default_rng(0)
  np.savez(project / "good.npz", h=rng.standard_normal((4, 32)))
  os.rename(project / "good.npz", project / "GOOD.NPZ")
  rc, out, err = run(capsys, "check", "clierr_model:make", "--reference",
                     "GOOD.NPZ", "--precisions", "bf16", "--out", "rg")
  # The file is read (no "Invalid precision"); its numbers are unrelated to
  # the model's, so this only checks that the check ran against the file.
  assert rc == 0, err


def test_npy_reference_is_read_as_the_one_layer(project, capsys):
  np.save(project / "ref.npy", np.zeros((4, 32), np.float32))
  d = run_json(capsys, "check", "clierr_model:make", "--reference",
               "ref.npy", "--precisions", "bf16", "--out", "rn", "--json")
  assert d["reference"] == "file:ref.npy"


def test_console_script_with_a_bad_env_var():
  script = os.path.join(os.path.dirname(sys.executable), "jaxprec")
  if not os.path.exists(script):
    pytest.skip("the jaxprec console script is not installed next to python")
  env = dict(os.environ, **{names.ENV_VAR: "bogus"})
  help_ = subprocess.run([script, "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
  assert help_.returncode == 0 and help_.stdout.startswith("usage: jaxprec")
  assert help_.stderr.startswith("jaxprec: warning: ignoring ")
  info = subprocess.run([script, "info"], capture_output=True, text=True,
                        env=env, timeout=120)
  assert info.returncode == 2 and info.stdout == ""
  assert unfolded(info.stderr).count("\n") == 1 and info.stderr.startswith(
      "jaxprec: error: JAX_DEFAULT_MATMUL_PRECISION")
