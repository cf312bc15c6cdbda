"""Tests for the jaxprec command line (jaxprec._src.cli.cli.main and python -m jaxprec)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import jaxprec
from jaxprec._src.cli.cli import main
from conftest import run_cli as run, unfolded

MODEL = textwrap.dedent("""\
    import jax, jax.numpy as jnp

    def layer(x, w1, w2):
      return jnp.tanh(x @ w1) @ w2

    def target():
      f32 = jnp.float32
      x = jax.ShapeDtypeStruct((4, 8), f32)
      w1 = jax.ShapeDtypeStruct((8, 16), f32)
      return jax.jit(layer), (x, w1), {"w2": jax.ShapeDtypeStruct((16, 2), f32)}

    def two():
      return layer, [jnp.ones((1, 8)), jnp.ones((8, 3)), jnp.ones((3, 2))]

    def empty():
      return (lambda x: x + 1), (jnp.ones(3),)

    def wrong():
      return layer

    def raises():
      raise RuntimeError("no data here")

    def broken():
      return layer, (jnp.ones((2, 3)), jnp.ones((4, 5)), jnp.ones((5, 6)))

    def conv():
      x = jax.ShapeDtypeStruct((1, 2, 8, 8), jnp.float32)
      k = jax.ShapeDtypeStruct((4, 2, 3, 3), jnp.float32)
      return (lambda x, k: jax.lax.conv(x, k, (1, 1), "SAME")), (x, k)

    not_a_function = 3
    """)


@pytest.fixture
def project(tmp_path, monkeypatch):
  """A directory with model.py and pkg/fails.py, as the current directory."""
  (tmp_path / "model_cli_test.py").write_text(MODEL)
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "fails_cli_test.py").write_text("import not_a_module_xyz\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  before = set(sys.modules)
  yield tmp_path
  for name in set(sys.modules) - before:
    if name.endswith("_cli_test"):
      del sys.modules[name]


def assert_usage_error(rc, err, *fragments):
  assert rc == 2
  err = unfolded(err)  # one line, folded to the width
  assert err.count("\n") == 1 and err.startswith("jaxprec: error: "), err
  assert "Traceback" not in err
  for f in fragments:
    assert f in err


# ---------------------------------------------------------------------------
# Top level.


def test_version(capsys):
  rc, out, _ = run(capsys, "--version")
  assert (rc, out) == (0, f"jaxprec {jaxprec.__version__}\n")


def test_help(capsys):
  rc, out, _ = run(capsys, "--help")
  assert rc == 0
  assert all(c in out for c in ("info", "audit", "run"))


def test_no_command(capsys):
  rc, _, err = run(capsys)
  assert_usage_error(rc, err, "missing command")


def test_unknown_command(capsys):
  rc, _, err = run(capsys, "frobnicate")
  assert_usage_error(rc, err, "invalid choice: 'frobnicate'")


# ---------------------------------------------------------------------------
# info.


def test_info(capsys):
  with jaxprec.precision("float32"):
    rc, out, _ = run(capsys, "info")
  assert rc == 0
  assert out.splitlines()[2].startswith("precision in force: float32 (source: context")
  assert "pitfalls:" in out


def test_info_json(capsys):
  with jaxprec.precision("bf16"):
    rc, out, _ = run(capsys, "info", "--json")
  d = json.loads(out)
  assert rc == 0 and d["precision"]["name"] == "bfloat16"
  assert d["numerics"]["tpu"]["algorithm"] == "bf16x1"


# ---------------------------------------------------------------------------
# run.

CHECK_ENV = ("import os, sys; v = os.environ.get('JAX_DEFAULT_MATMUL_PRECISION'); "
             "print(v); sys.exit(int(sys.argv[1]))")


@pytest.mark.parametrize("spelling, value", [
    ("fp32", "float32"), ("BF16", "bfloat16"), ("bfloat16_3x", "tensorfloat32"),
    ("f32_f32_f32", "F32_F32_F32"), ("none", "None")])
def test_run_sets_the_env_in_jax_spelling(capfd, spelling, value):
  rc = main(["run", "-p", spelling, "--", sys.executable, "-c", CHECK_ENV, "0"])
  assert (rc, capfd.readouterr().out) == (0, f"{value}\n")


def test_run_propagates_the_exit_code(capfd):
  assert main(["run", "-p", "float32", "--", sys.executable, "-c", CHECK_ENV,
               "7"]) == 7


def test_run_without_double_dash(capfd):
  assert main(["run", "-p", "tf32", sys.executable, "-c", CHECK_ENV, "0"]) == 0
  assert capfd.readouterr().out == "tensorfloat32\n"


def test_run_signal_exit_code(capfd):
  cmd = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
  assert main(["run", "-p", "float32", "--", sys.executable, "-c", cmd]) == 128 + 15


def test_run_unknown_precision(capsys):
  rc, _, err = run(capsys, "run", "-p", "flaot32", "--", "true")
  assert_usage_error(rc, err, "Invalid precision 'flaot32'", "Did you mean 'float32'?")


@pytest.mark.parametrize("argv, flag", [
    (["check", "--model", "bert", "--reference", "bfloat61"], "--reference"),
    (["check", "--model", "bert", "--precisions", "bf16,bfloat61"],
     "--precisions"),
    (["check", "--model", "bert", "--policy", "default=bfloat61"], "--policy"),
    (["run", "-p", "bfloat61", "--", "true"], "--precision"),
    (["audit", "m:f", "-p", "bfloat61"], "--precision"),
])
def test_an_invalid_precision_names_its_option_and_fits(capsys, argv, flag):
  """The library's message lists every name (~480 characters on one line):
  the command line names the option, says "Did you mean" first, lists the
  common names and says where the rest are."""
  rc, _, err = run(capsys, *argv)
  err = unfolded(err)
  assert_usage_error(rc, err, f"jaxprec: error: {flag}: Invalid ",
                     "'bfloat61'", "Did you mean 'bfloat16'?",
                     "Common names: bfloat16 (bf16), bfloat16_3x (bf16_3x), "
                     "tensorfloat32 (tf32), float32 (f32), backend-default",
                     "docs/precision.md ('Spellings') or "
                     "jaxprec.valid_names()")
  assert err.index("Did you mean") < 120 and len(err) < 360, err
  assert "the levels" not in err and "BF16_BF16_F32_X3" not in err


@pytest.mark.parametrize("name", ["nonsense", "xyz"])
def test_an_unknown_precision_suggests_only_a_close_name(capsys, name):
  """'nonsense' was offered 'none' as "did you mean"."""
  rc, _, err = run(capsys, "run", "-p", name, "--", "true")
  assert_usage_error(rc, err, f"Invalid precision {name!r}")
  assert "Did you mean" not in err


def test_run_missing_command(capsys):
  rc, _, err = run(capsys, "run", "-p", "float32", "--")
  assert_usage_error(rc, err, "run needs a command")


def test_run_missing_precision(capsys):
  rc, _, err = run(capsys, "run", "--", "true")
  assert_usage_error(rc, err, "-p/--precision")


def test_run_command_not_found(capsys):
  rc, _, err = run(capsys, "run", "-p", "float32", "--", "no-such-command-xyz")
  assert rc == 127
  assert err == "jaxprec: error: command not found: no-such-command-xyz\n"


# ---------------------------------------------------------------------------
# audit.


def test_audit_module_function(project, capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "200")  # one table (tests/test_cli_width.py: narrower)
  rc, out, err = run(capsys, "audit", "model_cli_test:target")
  assert (rc, err) == (0, "")
  lines = out.splitlines()
  assert lines[0] == ("jaxprec audit of layer, traced at precision "
                      f"{jaxprec.current().name} ({jaxprec.current().source})")
  assert "jit(layer)" in lines[3] and "f32[4,8] x f32[8,16]" in lines[3]
  assert "f32[4,16] x f32[16,2]" in lines[4]
  assert "model_cli_test.py:4" in lines[3]


def test_audit_path_json_and_precision(project, capsys):
  rc, out, _ = run(capsys, "audit", "--json", "-p", "float32",
                   str(project / "model_cli_test.py") + ":target")
  d = json.loads(out)
  assert rc == 0 and d["num_ops"] == 2 and d["num_risky"] == 0
  assert [r["flops"] for r in d["rows"]] == [2 * 4 * 8 * 16, 2 * 4 * 16 * 2]
  assert {r["precision"] for r in d["rows"]} == {"HIGHEST"}
  assert d["precision_in_force"] == "float32 (context)"


def test_audit_preset_shows_the_conv_downgrade(project, capsys):
  rc, out, err = run(capsys, "audit", "--json", "-p", "f32_f32_f32",
                     "model_cli_test:conv")
  (row,) = json.loads(out)["rows"]
  assert (rc, err) == (0, "")
  assert (row["precision"], row["tpu"], row["risky"]) == ("F32_F32_F32", "bf16x1",
                                                          True)
  assert row["flops"] == 2 * (4 * 8 * 8) * (3 * 3) * 2


def test_audit_relative_path_and_two_tuple(project, capsys):
  rc, out, _ = run(capsys, "audit", "--json", "./model_cli_test.py:two")
  assert rc == 0 and json.loads(out)["num_ops"] == 2


def test_audit_empty(project, capsys):
  rc, out, _ = run(capsys, "audit", "model_cli_test:empty")
  assert rc == 0 and "no matmuls or convolutions" in out


@pytest.mark.parametrize("target, fragment", [
    ("model_cli_test", "expected MODULE:FUNCTION"),
    ("model_cli_test:", "expected MODULE:FUNCTION"),
    ("model_cli_test:1x", "expected MODULE:FUNCTION"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz': "
                             "ModuleNotFoundError"),
    ("pkg/fails_cli_test.py:f", "cannot import 'pkg/fails_cli_test.py': "
                                "ModuleNotFoundError: No module named "
                                "'not_a_module_xyz'"),
    ("missing.py:f", "no such file"),
    ("model_cli_test:nope", "'model_cli_test' has no attribute 'nope'"),
    ("model_cli_test:not_a_function", "is not callable"),
    ("model_cli_test:wrong", "must return (fn, args) or (fn, args, kwargs)"),
])
def test_audit_usage_errors(project, capsys, target, fragment):
  rc, _, err = run(capsys, "audit", target)
  assert_usage_error(rc, err, fragment)


def test_audit_target_raises(project, capsys):
  rc, _, err = run(capsys, "audit", "model_cli_test:raises")
  assert rc == 1
  err = unfolded(err)
  assert err.startswith("jaxprec: error: model_cli_test:raises() raised "
                        "RuntimeError: no data here (at ")
  assert err.endswith("model_cli_test.py:" + err.split(".py:")[1].split()[0]
                      + " in raises); JAXPREC_TRACEBACK=1 shows the "
                      "traceback\n") and err.count("\n") == 1


def test_audit_tracing_fails(project, capsys):
  rc, _, err = run(capsys, "audit", "model_cli_test:broken")
  err = unfolded(err)
  assert rc == 1 and err.count("\n") == 1
  assert err.startswith("jaxprec: error: jaxprec.audit: tracing layer failed: "
                        "TypeError")


# ---------------------------------------------------------------------------
# As a program.


def test_python_m_jaxprec(tmp_path):
  env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="float32",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "jaxprec", "info", "--json"],
                        capture_output=True, text=True, env=env, cwd=tmp_path,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  d = json.loads(proc.stdout)
  assert (d["precision"]["name"], d["precision"]["source"]) == ("float32", "env")
  assert d["env"]["value"] == "float32"

  proc = subprocess.run([sys.executable, "-m", "jaxprec", "run", "-p", "bogus",
                         "--", "true"], capture_output=True, text=True, env=env,
                        cwd=tmp_path, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.startswith("jaxprec: error: --precision: Invalid "
                                "precision 'bogus'")
  assert unfolded(proc.stderr).count("\n") == 1 and proc.stdout == ""


_SLEEPER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def stop(signum, frame):
  (out / "got").write_text(signal.Signals(signum).name)
  sys.exit(3)
signal.signal(signal.SIGTERM, stop)
(out / "ready").write_text("")
time.sleep(60)
"""


def test_run_forwards_sigterm_to_the_command(tmp_path):
  """A scheduler stops the job: ``jaxprec run`` passes SIGTERM on, waits,
  and exits with the command's status (before: it died at once and the
  command ran on, orphaned)."""
  cmd = [sys.executable, "-m", "jaxprec", "run", "-p", "float32", "--",
         sys.executable, "-c", _SLEEPER, str(tmp_path)]
  proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": os.pathsep.join(
      [os.path.dirname(os.path.dirname(jaxprec.__file__)),
       os.environ.get("PYTHONPATH", "")])})
  try:
    deadline = time.monotonic() + 60
    while not ((tmp_path / "ready").exists() or proc.poll() is not None
               or time.monotonic() > deadline):
      time.sleep(0.01)
    assert (tmp_path / "ready").exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 3  # the command's status
  finally:
    proc.kill()
  assert (tmp_path / "got").read_text() == "SIGTERM"


# The child prints both variables `jaxprec run` sets, and exits with argv[1].
SHOW_BOTH = ("import os, sys; e = os.environ; "
             "print(e.get('JAX_DEFAULT_MATMUL_PRECISION'), "
             "e.get('JAXPREC_POLICY'), sep='|'); sys.exit(int(sys.argv[1]))")


def _jaxprec_run(*argv, env, code=0):
  """``python -m jaxprec run ARGV -- python -c SHOW_BOTH CODE`` in a fresh
  process with ``env`` on top of this one's: ``(status, (flag, policy))``."""
  cmd = [sys.executable, "-m", "jaxprec", "run", *argv, "--",
         sys.executable, "-c", SHOW_BOTH, str(code)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
  return proc.returncode, tuple(proc.stdout.strip().split("|"))


STALE = {"JAXPREC_POLICY": "default=float32,conv=bfloat16",
         "JAX_DEFAULT_MATMUL_PRECISION": "float32"}


def test_run_precision_clears_an_inherited_policy():
  """-p bfloat16 under a leftover JAXPREC_POLICY: the command applied the
  old policy against -p (it was passed through)."""
  assert _jaxprec_run("-p", "bfloat16", env=STALE, code=5) == (
      5, ("bfloat16", "None"))
  # backend-default removes JAX's flag, and the policy too.
  assert _jaxprec_run("-p", "backend-default", env=STALE) == (0, ("None", "None"))


def test_run_policy_clears_an_inherited_flag():
  """--policy with rules under a leftover JAX_DEFAULT_MATMUL_PRECISION: every
  op outside the policy's reach kept the old flag."""
  assert _jaxprec_run("--policy", "default=bf16,conv=tf32", env=STALE,
                      code=3) == (3, ("None", "default=bfloat16,conv=tensorfloat32"))
  assert _jaxprec_run("--policy", "default=tf32", env=STALE) == (
      0, ("tensorfloat32", "default=tensorfloat32"))


def test_nested_runs_apply_the_inner_form():
  inner = [sys.executable, "-m", "jaxprec", "run", "-p", "float32", "--",
           sys.executable, "-c", SHOW_BOTH, "4"]
  cmd = [sys.executable, "-m", "jaxprec", "run", "--policy",
         "default=bf16,conv=tf32", "--", *inner]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 4, proc.stderr
  assert proc.stdout.strip() == "float32|None"
