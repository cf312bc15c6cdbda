"""`jaxprec check --policy`, the re-check a search's summary promises, and
the messages around a model the audit cannot see into."""

import textwrap
import warnings

import pytest

import jaxprec
from conftest import run_cli as run, unfolded

MODEL = textwrap.dedent("""\
    import jax
    from flax import nnx

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)
      def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))

    X = jax.random.normal(jax.random.key(1), (4, 16))

    def model():
      return Net(nnx.Rngs(0)), (X,)

    def as_argument():
      return (lambda m, x: m(x)), (Net(nnx.Rngs(0)), X)
    """)


@pytest.fixture
def project(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("JAXPREC_CACHE_DIR", str(tmp_path / "cache"))
  (tmp_path / "policyrows_model.py").write_text(MODEL)
  return tmp_path


def test_policy_rows_alone_and_after_precisions(project, capsys):
  policy = "default=bfloat16,down=float32"
  rc, out, err = run(capsys, "check", "policyrows_model.py:model", "--modules",
                     "--policy", policy, "--out", "r1")
  assert rc == 0, err
  assert f"P1: {policy}" in out and "bfloat16_3x" not in out
  rc, out, err = run(capsys, "check", "policyrows_model.py:model", "--modules",
                     "--precisions", "bfloat16", "--policy", policy,
                     "--policy", "default=float32", "--out", "r2")
  assert rc == 0, err
  assert "P1: " + policy in out and "P2: default=float32" in out
  header = next(l for l in out.splitlines() if "bfloat16" in l and "P1" in l)
  assert header.index("bfloat16") < header.index("P1") < header.index("P2")


def test_a_policy_row_gates_the_exit_status(project, capsys):
  # All float32 stays within 1e-4 of the float32 reference; a bfloat16 module
  # does not.
  rc, _, err = run(capsys, "check", "policyrows_model.py:model", "--modules",
                   "--policy", "default=float32", "--atol", "1e-4", "--rtol",
                   "0", "--out", "r3")
  assert rc == 0, err
  rc, _, err = run(capsys, "check", "policyrows_model.py:model", "--modules",
                   "--policy", "default=float32,up=bfloat16", "--atol", "1e-4",
                   "--rtol", "0", "--out", "r4")
  assert rc == 1, err
  assert "default=float32,up=bfloat16: up needs atol >= " in err, err


def test_a_bad_policy_is_one_line_exit_2(project, capsys):
  rc, out, err = run(capsys, "check", "policyrows_model.py:model",
                     "--policy", "default=bfloat61")
  assert rc == 2 and not out
  (line,) = unfolded(err).splitlines()
  assert line.startswith("jaxprec: error: ") and "bfloat61" in line
  assert "Did you mean 'bfloat16'" in line


def test_the_warning_names_a_model_passed_as_an_argument(project, capsys):
  rc, _, err = run(capsys, "audit", "policyrows_model.py:as_argument")
  assert rc == 0, err
  err = unfolded(err)
  assert "passed to it as an argument" in err and "fn = model" in err


def test_policy_from_env_takes_what_run_policy_takes():
  # run --policy accepts one precision as a policy; so does the reader.
  assert str(jaxprec.policy_from_env({"JAXPREC_POLICY": "bf16"})) == \
      str(jaxprec.Policy.parse("default=bfloat16"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(ValueError, match="JAXPREC_POLICY='bfloat61'"):
      jaxprec.policy_from_env({"JAXPREC_POLICY": "bfloat61"})


def test_check_module_checks_a_model_that_flaxs_own_capture_fails_on():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  class Heads(nnx.Module):
    def __init__(self, rngs):
      self.heads = nnx.Dict({"left": nnx.Linear(8, 4, rngs=rngs),
                             "right": nnx.Linear(8, 4, rngs=rngs)})

    def __call__(self, x):
      return {k: m(x) for k, m in self.heads.items()}

  model, x = Heads(nnx.Rngs(0)), jax.numpy.ones((2, 8))
  # Flax 0.12.8's nnx.capture(..., method_outputs=nnx.Intermediate) fails
  # on nnx.Dict.items(); check_module sees the calls through its own hook.
  report = jaxprec.check_module(model, x, precisions=["bfloat16"])
  assert [l.name for l in report.layers] == [
      "heads/left", "heads/right", "output.left", "output.right"]
  left = report.layer("heads/left").metrics["bfloat16"]
  assert 0 < left.rel_rms < 1e-2  # a bfloat16 pass, against float32
  fresh = nnx.state(Heads(nnx.Rngs(0)))  # the model is not mutated
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()),
                                   nnx.state(model), fresh))
  assert type(model.heads["left"]) is nnx.Linear  # pylint: disable=unidiomatic-typecheck
  # The model's own errors stay its own.
  with pytest.raises(TypeError, match="dot_general requires contracting"):
    jaxprec.check_module(model, jax.numpy.ones((2, 5)), precisions=["bfloat16"])


def test_a_reference_of_submodules_without_modules_names_the_flag(project,
                                                                 capsys):
  import numpy as np  # pylint: disable=import-outside-toplevel
  np.savez(project / "ref.npz", up=np.zeros((4, 32), np.float32),
           down=np.zeros((4, 16), np.float32))
  rc, _, err = run(capsys, "check", "policyrows_model.py:model",
                   "--reference", "ref.npz", "--out", "r5")
  assert rc == 2, err
  (line,) = [l for l in unfolded(err).splitlines()
              if l.startswith("jaxprec: error:")]
  assert "is checked with --modules" in line


def test_a_reader_of_stderr_that_leaves_ends_the_command_as_sigpipe(project):
  # The first phase line is read, then the pipe closes: a later line finds
  # no reader. The command ends as a shell says SIGPIPE ended it, not as a
  # failure of the checked code (exit 1).
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  read, write = os.pipe()
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_DEFAULT_MATMUL_PRECISION", "JAXPREC_POLICY")}
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxprec", "check", "policyrows_model.py:model",
       "--precisions", "bfloat16", "--out", "r6"],
      cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=write)
  os.close(write)
  with os.fdopen(read) as stderr:
    first = stderr.readline()
  assert proc.wait(timeout=300) == 128 + 13, first
  assert first.startswith("jaxprec check: importing policyrows_model.py")


def test_a_negative_zero_tolerance_is_zero(project, capsys):
  import math  # pylint: disable=import-outside-toplevel
  from jaxprec._src.checker.metrics import check_tolerance  # pylint: disable=import-outside-toplevel
  assert math.copysign(1, check_tolerance("rtol", -0.0)) == 1
  rc, out, err = run(capsys, "check", "policyrows_model.py:model", "--modules",
                     "--precisions", "float32", "--atol", "1e-4", "--rtol",
                     "-0.0", "--out", "r7")
  assert rc == 0, err
  assert "rtol=0)" in out and "rtol=-0" not in out + err


def test_an_unknown_search_candidate_is_named_once():
  with pytest.raises(ValueError) as e:
    jaxprec.search_policy(lambda x: x @ x, jaxprec_ones(), tolerance=1e-3,
                          candidates=("bf17",))
  assert str(e.value).count("bf17") == 1, str(e.value)
  assert str(e.value).startswith("Unknown candidate 'bf17': unknown name. "
                                 "Did you mean")


def jaxprec_ones():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return jnp.ones((4, 4))
