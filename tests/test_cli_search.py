"""`jaxprec search` and `jaxprec run --policy`: output, exit codes, the env var."""

import os
import subprocess
import sys
import textwrap

import pytest

import jaxprec
from jaxprec._src.cli.cli import main
from conftest import one_line_error, run_cli as run, run_cli_json as run_json, unfolded

MODEL = textwrap.dedent("""\
    import jax, jax.numpy as jnp
    import flax.linen as nn

    class OffsetMLP(nn.Module):
      # dense_2's input has a large common offset: bfloat16 loses the signal.
      @nn.compact
      def __call__(self, x):
        out = {}
        for i in range(4):
          if i == 2:
            y = nn.Dense(16, name=f"dense_{i}")(x + 100.0)
            y = y - y.mean(axis=0, keepdims=True)
          else:
            y = nn.Dense(16, name=f"dense_{i}")(x)
          x = out[f"layer_{i}"] = jnp.tanh(y)
        return out

    def make():
      model = OffsetMLP()
      x = jax.random.normal(jax.random.key(1), (16, 16))
      return model.apply, (model.init(jax.random.key(0), x), x)

    def not_fn():
      return 3, ()
    """)

CHECK_ENV = ("import os; print(os.environ.get('JAXPREC_POLICY')); "
             "print(os.environ.get('JAX_DEFAULT_MATMUL_PRECISION'))")


@pytest.fixture(autouse=True, scope="module")
def _compilation_cache_dir(tmp_path_factory):
  """The CLI's compilation cache goes to a temporary directory, not ~/.cache."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("JAXPREC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield


@pytest.fixture
def project(tmp_path, monkeypatch):
  (tmp_path / "clisearch_model.py").write_text(MODEL)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  yield tmp_path
  sys.modules.pop("clisearch_model", None)


def field(out, name):
  return next(l for l in out.splitlines() if l.startswith(f"{name}: "))[
      len(name) + 2:]


# -- search --------------------------------------------------------------------


def test_search_builtin_model(capsys):
  rc, out, err = run(capsys, "search", "--model", "wav2vec2", "--tolerance", "0.05")
  assert rc == 0, err
  assert field(out, "model") == "wav2vec2 (tiny, seed 0)"
  assert field(out, "policy") == "default=bfloat16"
  assert field(out, "cost").startswith("0.167 of float32 on tpu")
  assert field(out, "evaluations").startswith("1 (budget 24")
  lines = err.splitlines()  # the phases, then a line per evaluation
  assert lines[0] == "jaxprec search: building model wav2vec2 (tiny)"
  steps = [l for l in lines if l.startswith("jaxprec search [")]
  assert steps[0].startswith("jaxprec search [1/24] all bfloat16 (bfloat16 23): pass")


def test_search_module_function_finds_the_layer_and_run_takes_it(project, capfd):
  rc = main(["search", "clisearch_model:make", "--tolerance", "0.02"])
  out, err = capfd.readouterr()
  assert rc == 0, err
  policy = field(out, "policy")
  assert policy == "default=bfloat16,dense_2=bfloat16_3x"
  assert jaxprec.Policy.parse(policy) == jaxprec.Policy.parse(
      "default=bf16,dense_2=bf16_3x")
  steps = [l for l in err.splitlines() if l.startswith("jaxprec search [")]
  assert len(steps) == int(field(out, "evaluations").split()[0])
  # The printed policy is what `jaxprec run --policy` takes.
  rc = main(["run", "--policy", policy, "--", sys.executable, "-c", CHECK_ENV])
  assert rc == 0
  assert capfd.readouterr().out.splitlines()[0] == policy


def test_search_json_and_options(project, capsys):
  d = run_json(capsys, "search", "clisearch_model:make", "--tolerance",
               "1e-3", "--metric", "max_abs", "--candidates",
               "float32,bfloat16", "--budget", "6", "--json")
  assert d["metric"] == "max_abs" and d["tolerance"] == 1e-3
  assert d["candidates"] == ["bfloat16", "float32"]  # cheapest first
  assert d["budget"] == 6 and d["evaluations"] <= 6
  assert d["meets_tolerance"] and d["relative_cost"] <= 1.0
  assert d["precision_by_path"]["dense_2"] == "float32"
  assert jaxprec.Policy.parse(d["policy"])


def test_search_gpu_target(project, capsys):
  rc, out, err = run(capsys, "search", "clisearch_model:make", "--tolerance",
                     "0.02", "--target", "gpu")
  assert rc == 0, err
  assert "target gpu" in out
  assert "candidates tensorfloat32, TF32_TF32_F32_X3, float32" in unfolded(out)


def test_search_nothing_meets_the_tolerance_exits_1(project, capsys):
  rc, out, err = run(capsys, "search", "clisearch_model:make", "--tolerance",
                     "0", "--candidates", "bfloat16,float32")
  one_line_error(rc, err, 1, "no policy met the tolerance (rel_rms 0)")
  assert "jaxprec: warning: jaxprec.search_policy: no policy of the candidates" in err
  assert field(out, "policy") == "default=float32"


@pytest.mark.parametrize("argv,fragment", [
    (["--model", "wav2vec2"], "the following arguments are required: --tolerance"),
    (["--tolerance", "1e-3"],
     "search needs a model: --model NAME (one of wav2vec2, bert, llama) or "
     "MODULE:FUNCTION"),
    (["clisearch_model:make", "--model", "bert", "--tolerance", "1"],
     "search takes one model: --model bert or clisearch_model:make, not both"),
    (["clisearch_model:make", "--size", "tiny", "--tolerance", "1"],
     "--size applies to --model only"),
    (["--model", "wav2vec2", "--tolerance", "-1"],
     "tolerance must be a finite number >= 0"),
    (["--model", "wav2vec2", "--tolerance", "x"], "--tolerance 'x' is not a number"),
    (["--model", "wav2vec2", "--tolerance", "1e400"],
     "--tolerance 1e400 overflows to inf"),
    (["--model", "wav2vec2", "--tolerance", "-inf"], "--tolerance -inf is infinite"),
    (["--model", "wav2vec2", "--tolerance", "1", "--metric", "rms"],
     "Unknown metric 'rms'; valid choices: 'rel_rms'"),
    (["--model", "wav2vec2", "--tolerance", "1", "--candidates", "bf16,bf17"],
     "Unknown candidate 'bf17'"),
    (["--model", "wav2vec2", "--tolerance", "1", "--candidates", " , "],
     "--candidates is empty"),
    (["--model", "wav2vec2", "--tolerance", "1", "--budget", "0"],
     "budget must be >= 1"),
    (["--model", "wav2vec2", "--tolerance", "1", "--target", "cpu"],
     "invalid choice: 'cpu'"),
    (["clisearch_model:not_fn", "--tolerance", "1"], "not a callable"),
    (["nomodule_xyz:make", "--tolerance", "1"], "cannot import 'nomodule_xyz'"),
])
def test_search_usage_errors(project, capsys, argv, fragment):
  rc, out, err = run(capsys, "search", *argv)
  one_line_error(rc, err, 2, fragment)
  assert out == ""


# -- run --policy -----------------------------------------------------------------


def test_run_policy_with_rules_sets_only_the_policy(capfd, monkeypatch):
  monkeypatch.delenv("JAX_DEFAULT_MATMUL_PRECISION", raising=False)
  rc = main(["run", "--policy", "default=bf16, .*attention.*=fp32,conv=tf32",
             "--", sys.executable, "-c", CHECK_ENV])
  assert rc == 0
  assert capfd.readouterr().out.splitlines() == [
      "default=bfloat16,.*attention.*=float32,conv=tensorfloat32", "None"]


@pytest.mark.parametrize("text,flag", [
    ("default=bf16_3x", "tensorfloat32"), ("fp32", "float32"),
    ("default=F32_F32_F32", "F32_F32_F32")])
def test_run_policy_of_one_precision_also_sets_the_flag(capfd, text, flag):
  rc = main(["run", "--policy", text, sys.executable, "-c", CHECK_ENV])
  assert rc == 0
  policy, value = capfd.readouterr().out.splitlines()
  assert jaxprec.Policy.parse(policy).default == jaxprec.resolve(text.split("=")[-1])
  assert value == flag


@pytest.mark.parametrize("argv,fragment", [
    (["--policy", "default=bf16,dense=bogus", "--", "true"],
     "Invalid policy entry 'dense=bogus': Invalid precision 'bogus'"),
    (["--policy", "conv=tf32,attention", "--", "true"],
     "Invalid policy entry 'attention': expected SELECTOR=PRECISION"),
    (["--policy", "", "--", "true"], "empty string"),
    (["--policy", "bf16", "-p", "fp32", "--", "true"],
     "argument -p/--precision: not allowed with argument --policy"),
    (["--policy", "bf16", "--"], "run needs a command"),
])
def test_run_policy_usage_errors(capsys, argv, fragment):
  rc, out, err = run(capsys, "run", *argv)
  one_line_error(rc, err, 2, fragment)


def test_python_m_jaxprec_run_bad_policy(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "jaxprec", "run", "--policy",
                         "default=bogus", "--", "true"], capture_output=True,
                        text=True, env=env, cwd=tmp_path, timeout=120)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.startswith(
      "jaxprec: error: --policy: Invalid policy entry 'default=bogus'")
  assert unfolded(proc.stderr).count("\n") == 1
