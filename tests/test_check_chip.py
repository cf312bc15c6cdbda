"""``chip=`` in the checker: every GPU row on one chip's tensor cores.

``jaxprec.check(..., target='gpu', chip='h100')`` computes each row emulated
with GPU numerics as ``jaxprec.emulate(..., chip='h100')`` computes it (bit
for bit: its metrics are those of that function's output against the same
reference), the chip is part of every compiled program's key (a second
check with another chip, or none, computes its own numbers), the report
names it, and a bad chip is refused as ``jaxprec.emulate`` refuses it.
"""

import json
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprec
from conftest import one_line_error, run_cli as run

TF32 = ("tensorfloat32",)
GPU = dict(target="gpu", mode="emulate", precisions=TF32)


def _weights():
  k1, k2 = jax.random.split(jax.random.key(0))
  w1 = jax.random.normal(k1, (96, 64), jnp.float32) / 8  # K = 96
  w2 = jax.random.normal(k2, (64, 32), jnp.float32) / 8  # K = 64
  x = jax.random.normal(jax.random.key(1), (8, 96), jnp.float32)
  return w1, w2, x


def mlp(w1, w2, x):
  h = jnp.tanh(x @ w1)
  return {"h": h, "out": h @ w2}


def _max_abs(report, label="tensorfloat32"):
  return {l.name: l.metrics[label].max_abs for l in report.layers}


def _own_max_abs(fn, args, **emulate):
  """Each layer's max |emulated - float32| from jaxprec.emulate itself."""
  ref = jax.jit(fn)(*args)
  got = jax.jit(jaxprec.emulate(fn, "tensorfloat32", **emulate))(*args)
  return {k: float(np.max(np.abs(np.asarray(got[k], np.float32)
                                 - np.asarray(ref[k], np.float32))))
          for k in ref}


def test_chip_rows_are_emulates_own_and_differ_from_the_default_model():
  w1, w2, x = _weights()
  plain = jaxprec.check(mlp, w1, w2, x, **GPU)
  h100 = jaxprec.check(mlp, w1, w2, x, **GPU, chip="h100")
  assert _max_abs(h100) != _max_abs(plain)
  assert _max_abs(h100) == _own_max_abs(mlp, (w1, w2, x), target="gpu",
                                        chip="h100")
  assert _max_abs(plain) == _own_max_abs(mlp, (w1, w2, x), target="gpu")
  assert h100.chip == "h100" and plain.chip is None
  assert h100.numerics["tensorfloat32"] == (
      "tf32 (gpu, emulated, h100 tensor cores)")


def test_a_second_check_with_another_chip_or_none_computes_its_own_program():
  """The same function object: chip, then no chip, then another chip. Each
  check's numbers are those of a fresh computation (no program reused)."""
  w1, w2, x = _weights()

  def same(w1, w2, x):
    return mlp(w1, w2, x)

  first = jaxprec.check(same, w1, w2, x, **GPU, chip="h100")
  then_none = jaxprec.check(same, w1, w2, x, **GPU)
  then_a100 = jaxprec.check(same, w1, w2, x, **GPU, chip="A100")
  assert _max_abs(first) == _own_max_abs(mlp, (w1, w2, x), target="gpu",
                                         chip="h100")
  assert _max_abs(then_none) == _own_max_abs(mlp, (w1, w2, x), target="gpu")
  assert _max_abs(then_a100) == _own_max_abs(mlp, (w1, w2, x), target="gpu",
                                             chip="a100")
  assert len({tuple(_max_abs(r).values())
              for r in (first, then_none, then_a100)}) == 3
  assert then_a100.chip == "a100"


def test_the_plan_key_holds_the_chip():
  from jaxprec._src.checker import rows
  keys = {rows.plan("tensorfloat32", "gpu", "emulate", chip=c).key
          for c in (None, "a100", "h100")}
  assert len(keys) == 3
  # Every name on a GPU is a GPU's numerics: the chip computes it.
  assert rows.plan("bfloat16", "gpu", "emulate", chip="h100").options == (
      ("chip", "h100"),)


def test_the_report_names_the_chip_in_text_json_and_markdown():
  w1, w2, x = _weights()
  r = jaxprec.check(mlp, w1, w2, x, **GPU, chip="h100")
  assert "target gpu (h100 tensor cores)" in str(r)
  assert "target gpu (h100 tensor cores)" in r.to_markdown()
  d = json.loads(r.to_json())
  assert d["chip"] == "h100"
  assert jaxprec.DivergenceReport.from_json(r.to_json()).chip == "h100"
  assert json.loads(jaxprec.check(mlp, w1, w2, x, **GPU).to_json())[
      "chip"] is None


@pytest.mark.parametrize("kw", [dict(target="tpu", chip="h100"),
                                dict(target="gpu", chip="h10"),
                                dict(target="gpu", chip="v100")])
def test_a_bad_chip_raises_what_emulate_raises(kw):
  w1, w2, x = _weights()
  with pytest.raises(ValueError) as emulate_error:
    jaxprec.emulate(mlp, "tensorfloat32", **kw)
  with pytest.raises(ValueError) as check_error:
    jaxprec.check(mlp, w1, w2, x, precisions=TF32, **kw)
  assert str(check_error.value) == str(emulate_error.value)
  assert repr(kw["chip"].lower()) in str(check_error.value)
  with pytest.raises(ValueError) as module_error:
    jaxprec.check_module(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), jnp.ones((1, 4)),
                         precisions=TF32, **kw)
  assert str(module_error.value) == str(emulate_error.value)


class NnxNet(nnx.Module):

  def __init__(self, rngs):
    self.a = nnx.Linear(96, 64, rngs=rngs)
    self.b = nnx.Linear(64, 16, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


class LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, name="b")(jnp.tanh(nn.Dense(64, name="a")(x)))


def _module_check(kind, **kw):
  x = jax.random.normal(jax.random.key(2), (4, 96), jnp.float32)
  if kind == "nnx":
    model = NnxNet(nnx.Rngs(0))
    return jaxprec.check_module(model, x, **GPU, **kw), model, x
  model = LinenNet()
  variables = model.init(jax.random.key(0), x)
  return jaxprec.check_module(model, variables, x, **GPU, **kw), (
      model, variables), x


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_check_module_on_a_chip(kind):
  plain, model, x = _module_check(kind)
  h100, _, _ = _module_check(kind, chip="h100")
  assert h100.chip == "h100"
  assert _max_abs(h100) != _max_abs(plain)
  # The model's output on the chip, computed by jaxprec.emulate itself.
  if kind == "nnx":
    ref, got = model(x), jaxprec.emulate(model, "tensorfloat32",
                                         target="gpu", chip="h100")(x)
  else:
    module, variables = model
    ref = module.apply(variables, x)
    got = jaxprec.emulate(module.apply, "tensorfloat32", target="gpu",
                          chip="h100")(variables, x)
  want = float(np.max(np.abs(np.asarray(got) - np.asarray(ref))))
  assert _max_abs(h100)["output"] == want


MODEL = textwrap.dedent("""\
    import jax, jax.numpy as jnp

    W = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32) / 8
    X = jax.random.normal(jax.random.key(1), (4, 64), jnp.float32)

    def net(w, x):
      return {"h": jnp.tanh(x @ w)}

    def make():
      return net, (W, X)
    """)


@pytest.fixture
def project(tmp_path, monkeypatch):
  (tmp_path / "clichip_model.py").write_text(MODEL)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("JAXPREC_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
  yield tmp_path
  sys.modules.pop("clichip_model", None)


@pytest.mark.parametrize("argv, fragments", [
    (("--chip", "h100", "--target", "tpu"), ("--chip", "target='gpu'")),
    (("--chip", "h10", "--target", "gpu"), ("--chip", "'h10'", "'h100'")),
])
def test_cli_bad_chip_exits_2_with_one_line(project, capsys, argv, fragments):
  rc, out, err = run(capsys, "check", "clichip_model:make", *argv)
  one_line_error(rc, err, 2, *fragments)
  assert out == ""


def test_cli_check_on_a_chip(project, capsys):
  rc, out, err = run(capsys, "check", "clichip_model:make", "--target", "gpu",
                     "--chip", "H100", "--precisions", "tensorfloat32",
                     "--json")
  assert rc == 0, err
  d = json.loads(out)
  assert d["chip"] == "h100"
  assert d["numerics"]["tensorfloat32"] == (
      "tf32 (gpu, emulated, h100 tensor cores)")


# ---------------------------------------------------------------------------
# search_policy(tensor_cores=): the evaluations on one chip's tensor cores.


class TwoDense(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(64, name="a")(x))
    return {"h": h, "out": nn.Dense(32, name="b")(h)}


@pytest.mark.parametrize("compile_once", [True, False])
def test_search_on_tensor_cores_reports_what_check_on_the_chip_reports(
    compile_once):
  model = TwoDense()
  x = jax.random.normal(jax.random.key(1), (8, 96), jnp.float32)
  variables = model.init(jax.random.key(0), x)
  kw = dict(target="gpu", mode="emulate", verbose=False,
            candidates=("tensorfloat32", "float32"), tolerance=1e-3,
            metric="max_abs", compile_once=compile_once)
  found = jaxprec.search_policy(model.apply, variables, x,
                                tensor_cores="h100", **kw)
  assert found.report.chip == "h100"
  checked = jaxprec.check(model.apply, variables, x, target="gpu",
                          mode="emulate", precisions=(found.policy,),
                          chip="h100")
  label = str(found.policy)
  assert ({l.name: l.metrics["policy"].max_abs for l in found.report.layers}
          == {l.name: l.metrics[label].max_abs for l in checked.layers})
  plain = jaxprec.check(model.apply, variables, x, target="gpu",
                        mode="emulate", precisions=(found.policy,))
  if "tensorfloat32" in label:  # a TF32 layer: the chip changes its figures
    assert _max_abs(checked, label) != _max_abs(plain, label)


def test_search_tensor_cores_needs_a_gpu_target_and_keeps_chip_for_costs():
  model = TwoDense()
  x = jnp.ones((2, 96))
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="target='gpu'"):
    jaxprec.search_policy(model.apply, variables, x, tolerance=1e-2,
                          target="tpu", tensor_cores="h100", verbose=False)
  with pytest.raises(ValueError, match="Did you mean 'h100'"):
    jaxprec.search_policy(model.apply, variables, x, tolerance=1e-2,
                          target="gpu", tensor_cores="h10", verbose=False)
  # chip= is still the dtype axis's roofline chip only.
  with pytest.raises(ValueError, match="dtype axis"):
    jaxprec.search_policy(model.apply, variables, x, tolerance=1e-2,
                          target="gpu", chip="h100", verbose=False)
