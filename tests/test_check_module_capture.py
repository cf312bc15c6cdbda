"""check_module's capture: linen and NNX through the one hook's observers.

Twin models (the same modules, the same weights) give the same layer names
in both APIs: a submodule named ``output`` beside the root's own output,
linen modules inside ``nnx.bridge.ToNNX``, a linen module applied inside
another's method, a ``capture=`` filter; and the table of marked output
structures stays bounded.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprec
from jaxprec._src.checker import check as check_lib

X = jax.random.normal(jax.random.key(1), (2, 8))
ROW = dict(precisions=["bf16"], mode="emulate")


def _names(report):
  return [layer.name for layer in report.layers]


def _outputs(module, *args):
  fn, _, args = check_lib.module_outputs(module, args, {})
  return {k: np.asarray(v, np.float64) for k, v in fn(*args).items()}


def _dense(p, x):
  """A Dense/Linear layer in float64 NumPy."""
  return (np.asarray(x, np.float64) @ np.asarray(p["kernel"], np.float64)
          + np.asarray(p["bias"], np.float64))


# ---------------------------------------------------------------------------
# A submodule named 'output'.


class _LinenHeadNamedOutput(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="output")(jnp.tanh(nn.Dense(8, name="a")(x)))


class _NnxHeadNamedOutput(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(8, 8, rngs=rngs)
    self.output = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return self.output(jnp.tanh(self.a(x)))


def _head_twins():
  lin = _LinenHeadNamedOutput()
  v = lin.init(jax.random.key(0), X)
  net = _NnxHeadNamedOutput(nnx.Rngs(0))
  for name in ("a", "output"):
    getattr(net, name).kernel[...] = v["params"][name]["kernel"]
    getattr(net, name).bias[...] = v["params"][name]["bias"]
  return lin, v, net


def test_a_submodule_named_output_keeps_its_path_and_the_root_is_root():
  lin, v, net = _head_twins()
  p = v["params"]
  head = _dense(p["output"], np.tanh(_dense(p["a"], X)))
  for out in (_outputs(lin, v, X), _outputs(net, X)):
    assert list(out) == ["a", "output", "(root)"]
    np.testing.assert_allclose(out["output"], head, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["(root)"], head, rtol=1e-5, atol=1e-6)
  r = jaxprec.check_module(net, X, **ROW)
  assert _names(r) == ["a", "output", "(root)"]
  assert r.layers[1].metrics["bf16"].rel_rms > 0


class _NnxNestedOutput(nnx.Module):
  """A module named 'output' below the top: the root keeps 'output'."""

  def __init__(self, rngs):
    self.block = _NnxHeadNamedOutput(rngs)

  def __call__(self, x):
    return jnp.tanh(self.block(x))


def test_a_nested_module_named_output_leaves_the_roots_name():
  out = _outputs(_NnxNestedOutput(nnx.Rngs(0)), X)
  assert list(out) == ["block/a", "block/output", "block", "output"]


# ---------------------------------------------------------------------------
# Linen inside NNX (nnx.bridge.ToNNX), and a linen module applied inside
# another's method.


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(8, name="fc")(x))


class _Bridged(nnx.Module):
  def __init__(self, rngs):
    self.blk = nnx.bridge.ToNNX(_LinenBlock(), rngs=rngs)
    self.head = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return self.head(self.blk(x))


class _LinenTwin(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="head")(_LinenBlock(name="blk")(x))


def test_linen_layers_inside_to_nnx_are_listed_under_its_path():
  model = _Bridged(nnx.Rngs(0))
  nnx.bridge.lazy_init(model.blk, X)
  fc = {k: model.blk.fc[k][...] for k in ("kernel", "bias")}
  out = _outputs(model, X)
  assert list(out) == ["blk/fc", "blk", "head", "output"]
  np.testing.assert_allclose(out["blk/fc"], _dense(fc, X), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(out["blk"], np.tanh(_dense(fc, X)), rtol=1e-5,
                             atol=1e-6)
  twin = _LinenTwin()
  assert list(_outputs(twin, twin.init(jax.random.key(0), X), X)) == list(out)
  r = jaxprec.check_module(model, X, **ROW)
  assert _names(r) == list(out)
  assert r.layers[0].metrics["bf16"].rel_rms > 0


class _WeightNormed(nn.Module):
  """Applies its Dense with weights it computes, as Hugging Face's
  FlaxConvWithWeightNorm applies its convolution."""

  def setup(self):
    self.dense = nn.Dense(8)
    self.w = self.param("w", nn.initializers.lecun_normal(), (8, 8))

  def __call__(self, x):
    w = self.w / jnp.linalg.norm(self.w, axis=0)
    return self.dense.apply({"params": {"kernel": w, "bias": jnp.zeros(8)}},
                            x)


class _WeightNormedNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="head")(jnp.tanh(_WeightNormed(name="wn")(x)))


def test_a_linen_module_applied_inside_another_is_named_by_its_path():
  net = _WeightNormedNet()
  v = net.init(jax.random.key(0), X)
  out = _outputs(net, v, X)
  assert list(out) == ["wn/dense", "wn", "head", "output"]
  w = np.asarray(v["params"]["wn"]["w"], np.float64)
  w = w / np.linalg.norm(w, axis=0)
  np.testing.assert_allclose(out["wn/dense"], np.asarray(X, np.float64) @ w,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out["wn"], out["wn/dense"])


# ---------------------------------------------------------------------------
# capture=: a filter of the calls to check, on linen (every method) and on
# NNX (each __call__).


class _LinenEncoder(nn.Module):
  @nn.compact
  def encode(self, x):
    return jnp.tanh(nn.Dense(8, name="d")(x))


class _LinenEncoded(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="head")(_LinenEncoder(name="enc").encode(x))


def test_a_capture_filter_picks_the_calls_on_linen_and_on_nnx():
  net = _LinenEncoded()
  v = net.init(jax.random.key(0), X)
  r = jaxprec.check_module(net, v, X, **ROW, capture=lambda m, name: (
      name == "encode" or isinstance(m, nn.Dense)))
  assert _names(r) == ["enc/d", "enc.encode", "head"]
  r = jaxprec.check_module(net, v, X, **ROW)
  assert _names(r) == ["enc/d", "head", "output"]
  model = _NnxHeadNamedOutput(nnx.Rngs(0))
  r = jaxprec.check_module(model, X, **ROW,
                           capture=lambda m, name: isinstance(m, nnx.Linear))
  assert _names(r) == ["a", "output"]
  assert r.layers[0].metrics["bf16"].rel_rms > 0


# ---------------------------------------------------------------------------
# The numbered output structures that marks carry.


class _DictOut(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return {"only_here": jnp.tanh(self.lin(x))}


class _JitBody(nnx.Module):
  def __init__(self, rngs):
    self.inner = _DictOut(rngs)

  @nnx.jit
  def __call__(self, x):
    return self.inner(x)["only_here"]


class _JitNet(nnx.Module):
  def __init__(self, rngs):
    self.body = _JitBody(rngs)

  def __call__(self, x):
    return self.body(x)


def test_the_table_of_output_structures_is_bounded(monkeypatch):
  monkeypatch.setattr(check_lib, "_KEPT", 4)
  r = jaxprec.check_module(_JitNet(nnx.Rngs(0)), X, **ROW)
  assert _names(r) == ["body/inner/lin", "body/inner.only_here", "body",
                       "output"]
  for k in range(10):  # ten other structures: the table keeps the last 4
    check_lib._marked("x", {f"k{k}": jnp.ones(2)}, {})
  assert len(check_lib._TREES) == len(check_lib._TREEDEFS) == 4
  # A body that nnx.jit traced once and reuses, its structures dropped
  # since: its layers are named in a warning, not checked wrongly.
  with pytest.warns(UserWarning, match="'body/inner'"):
    r = jaxprec.check_module(_JitNet(nnx.Rngs(0)), X, **ROW)
  assert _names(r) == ["body", "output"]


class _NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.fc(x))


class _LinenWithToLinen(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nnx.bridge.ToLinen(_NnxBlock, name="blk")(x)
    return nn.Dense(8, name="head")(h)


def test_nnx_layers_inside_to_linen_are_not_listed_under_any_row():
  """A policy row gives them the hook, the reference does not: neither
  lists them, and the rule for the block reaches its matmul."""
  net = _LinenWithToLinen()
  v = net.init(jax.random.key(0), X)
  policy = "default=bfloat16,blk(/.*)?=float32"
  r = jaxprec.check_module(net, v, X, precisions=["bf16", policy],
                           mode="emulate")
  assert _names(r) == ["blk", "head", "output"]
  assert r.layers[0].metrics[policy].rel_rms < 1e-6 < (
      r.layers[0].metrics["bf16"].rel_rms)


class _Same(nnx.Module):
  def __call__(self, x):
    return x


class _NnxIdentityOutput(nnx.Module):
  """Its submodule 'output' returns its input: the same figures as 'a'."""

  def __init__(self, rngs):
    self.a = nnx.Linear(8, 8, rngs=rngs)
    self.output = _Same()

  def __call__(self, x):
    return self.output(self.a(x))


def test_the_table_folds_the_root_not_a_submodule_named_output():
  from jaxprec._src.checker import render
  r = jaxprec.check_module(_NnxIdentityOutput(nnx.Rngs(0)), X, **ROW)
  assert _names(r) == ["a", "output", "(root)"]
  assert r.layers[0].metrics == r.layers[1].metrics == r.layers[2].metrics
  # The root returns its child's output: one row; 'output' holds no 'a'.
  assert render.folded(r) == {2: 1}


@pytest.mark.parametrize("capture", [False, "__call__", None])
def test_a_capture_that_is_not_a_filter_is_refused(capture):
  with pytest.raises(TypeError, match=r"capture must be True or a filter "
                     r"\(module, method_name\) -> bool; got " + repr(capture)
                     .replace("(", r"\(")):
    jaxprec.check_module(_NnxHeadNamedOutput(nnx.Rngs(0)), X, capture=capture)


def test_a_capture_filter_that_picks_no_call_is_named():
  # The error blamed the method (it "calls no submodule"), which does.
  net = _LinenEncoded()
  v = net.init(jax.random.key(0), X)
  for model, args in ((net, (v, X)), (_NnxHeadNamedOutput(nnx.Rngs(0)), (X,))):
    with pytest.raises(ValueError, match=(
        rf"{type(model).__name__}.__call__ gave no output to check: the "
        r"capture= filter <function .*> picked none of its module calls")):
      jaxprec.check_module(model, *args, capture=lambda m, name: False)


class _SowsAndReturns(nn.Module):
  """Sows 'h' and returns {'h': ...}: both are layer 's.h'."""

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(8, name="d")(x)
    self.sow("intermediates", "h", y * 2)
    return {"h": y * 3}


class _SowsInside(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _SowsAndReturns(name="s")(x)["h"]


def test_a_sown_name_that_is_also_an_output_key_is_named_as_such():
  # The error asked to rename "the keys of the returned pytree", which
  # check_module builds, not the user.
  net = _SowsInside()
  v = net.init(jax.random.key(0), X)
  with pytest.raises(ValueError, match=(
      r"same name 's\.h'.*a value a module sows \(Module\.sow\) is named "
      r"as a key of its output")):
    jaxprec.check_module(net, v, X, **ROW)
