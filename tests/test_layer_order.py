"""Layers in execution order inside every Flax transform; typed keys and
nnx.Rngs through every entry point; unused-rule reports under nn.jit.

The models name their layers so that alphabetical order is NOT execution
order (``z_first`` runs before ``a_second``).
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprec

X = jax.random.normal(jax.random.key(1), (2, 8))
ROW = dict(precisions=["bf16"], mode="emulate")


def _names(report):
  return [layer.name for layer in report.layers]


def _first(report):
  return report.first_divergence(1e-6, 0)["bf16"].layer


# ---------------------------------------------------------------------------
# linen


class _Pair(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(8, name="z_first")(x))
    return jnp.tanh(nn.Dense(8, name="a_second")(x))


@pytest.mark.parametrize("transform", [nn.jit, nn.remat])
def test_linen_layers_in_execution_order_under_transform(transform):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return transform(_Pair)(name="body")(x)
  net = Net()
  variables = net.init(jax.random.key(0), X)
  r = jaxprec.check_module(net, variables, X, **ROW)
  assert _names(r) == ["body/z_first", "body/a_second", "body", "output"]
  assert _first(r) == "body/z_first"


class _Step(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return jnp.tanh(nn.Dense(8, name="d")(c)), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="z_in")(x)
    x, _ = nn.scan(_Step, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=3)(name="stack")(x, None)
    return nn.Dense(8, name="a_out")(x)


def test_linen_scan_layers_are_reported_stacked():
  net = _Scanned()
  variables = net.init(jax.random.key(0), X)
  r = jaxprec.check_module(net, variables, X, **ROW)
  assert _names(r) == ["z_in", "stack/d", "stack[0]", "a_out", "output"]
  shapes = {layer.name: layer.shape for layer in r.layers}
  assert shapes["stack/d"] == shapes["stack[0]"] == (3, 2, 8)
  assert _first(r) == "z_in"
  # The stacked outputs are each iteration's, computed independently.
  from jaxprec._src.checker import check as check_lib
  fn, _, args = check_lib.module_outputs(net, (variables, X), {})
  out = fn(*args)
  p = variables["params"]
  h = np.asarray(X) @ np.asarray(p["z_in"]["kernel"]) + np.asarray(
      p["z_in"]["bias"])
  for i in range(3):
    k = np.asarray(p["stack"]["d"]["kernel"][i])
    b = np.asarray(p["stack"]["d"]["bias"][i])
    pre = h @ k + b
    np.testing.assert_allclose(out["stack/d"][i], pre, rtol=1e-5, atol=1e-5)
    h = np.tanh(pre)
    np.testing.assert_allclose(out["stack"][0][i], h, rtol=1e-5, atol=1e-5)


def test_linen_layers_lost_in_while_loop_are_said_out_loud():
  class Looped(nn.Module):
    @nn.compact
    def __call__(self, x):
      inner = nn.Dense(8, name="inner")
      x = inner(x)  # creates the parameters the loop reads
      return nn.while_loop(lambda mdl, c: jnp.sum(c) > 1e9,
                           lambda mdl, c: mdl(c), inner, x,
                           broadcast_variables="params")
  net = Looped()
  variables = net.init(jax.random.key(0), X)
  with pytest.warns(UserWarning, match="'inner'.*while_loop or cond"):
    r = jaxprec.check_module(net, variables, X, **ROW)
  assert _names(r) == ["inner", "output"]


# ---------------------------------------------------------------------------
# NNX


class _NnxPair(nnx.Module):
  def __init__(self, rngs):
    self.z_first = nnx.Linear(8, 8, rngs=rngs)
    self.a_second = nnx.Linear(8, 8, rngs=rngs)


class _NnxPlain(_NnxPair):
  def __call__(self, x):
    return self.a_second(jnp.tanh(self.z_first(x)))


class _NnxRemat(_NnxPair):
  def __call__(self, x):
    f = nnx.remat(lambda m, x: m(x))
    return f(self.a_second, jnp.tanh(f(self.z_first, x)))


class _NnxJit(_NnxPair):
  def __call__(self, x):
    f = nnx.jit(lambda m, x: m(x))
    return f(self.a_second, jnp.tanh(f(self.z_first, x)))


class _NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(x))


class _NnxScan(nnx.Module):
  def __init__(self, rngs):
    self.z_in = nnx.Linear(8, 8, rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _NnxBlock(rngs)
    self.layers = make(rngs)
    self.a_out = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)
    return self.a_out(body(self.z_in(x), self.layers))


@pytest.mark.parametrize("cls", [_NnxPlain, _NnxRemat, _NnxJit])
def test_nnx_layers_in_execution_order(cls):
  model = cls(nnx.Rngs(0))
  r = jaxprec.check_module(model, X, **ROW)
  assert _names(r) == ["z_first", "a_second", "output"]
  assert _first(r) == "z_first"
  # check runs the model itself (a copy made in each trace), also under the
  # transform, and agrees with check_module on the model's output.
  full = jaxprec.check(model, X, **ROW)
  assert full.metric("rel_rms", "bf16") == [r.layers[-1].metrics["bf16"].rel_rms]


def test_nnx_scan_layers_in_execution_order():
  model = _NnxScan(nnx.Rngs(0))
  r = jaxprec.check_module(model, X, **ROW)
  assert _names(r) == ["z_in", "layers/lin", "layers", "a_out", "output"]
  assert r.layers[1].shape == (3, 2, 8)
  assert _first(r) == "z_in"


def test_nnx_scan_model_through_check_and_search():
  model = _NnxScan(nnx.Rngs(0))
  before = jax.tree_util.tree_leaves(nnx.state(model))
  full = jaxprec.check(model, X, **ROW)
  assert _names(full) == ["output"]
  assert full.layers[0].metrics["bf16"].rel_rms > 0
  result = jaxprec.search_policy(model, X, tolerance=1.0, budget=2,
                                 verbose=False, mode="emulate")
  assert result.meets_tolerance and result.evaluations == 1
  after = jax.tree_util.tree_leaves(nnx.state(model))
  assert all(a is b for a, b in zip(before, after))  # the model is untouched


# ---------------------------------------------------------------------------
# Typed PRNG keys and nnx.Rngs among the arguments.


def _w():
  return jax.random.normal(jax.random.key(2), (8, 8)) / 3


def _with_key(w, x, key):
  return {"h": jnp.tanh(x @ w) + 0.0 * jax.random.normal(key, x.shape)}


def _with_rngs(w, x, rngs):
  return {"h": jnp.tanh(x @ w) + 0.0 * jax.random.normal(rngs.params(),
                                                         x.shape)}


@pytest.mark.parametrize("fn,extra", [
    (_with_key, lambda: jax.random.key(0)),
    (_with_rngs, lambda: nnx.Rngs(0)),
], ids=["key", "rngs"])
def test_entry_points_take_typed_keys_and_rngs(fn, extra):
  w = _w()
  rows = jaxprec.audit(fn, w, X, extra()).rows
  assert [row.primitive for row in rows] == ["dot_general"]
  assert jaxprec.cost(fn, w, X, extra()).flops == 2 * 2 * 8 * 8
  r = jaxprec.check(fn, w, X, extra(), **ROW)
  assert _names(r) == ["h"] and r.layers[0].metrics["bf16"].rel_rms > 0
  result = jaxprec.search_policy(fn, w, X, extra(), tolerance=1.0, budget=2,
                                 verbose=False, mode="emulate")
  assert result.meets_tolerance


def test_check_module_takes_typed_keys_and_rngs():
  class Drop(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dropout(0.5, deterministic=False)(nn.Dense(8, name="d")(x))
  net = Drop()
  variables = net.init(jax.random.key(0), X)
  r = jaxprec.check_module(net, variables, X, rngs={"dropout": jax.random.key(3)},
                           **ROW)
  assert _names(r) == ["d", "Dropout_0", "output"]

  class NnxDrop(nnx.Module):
    def __init__(self, rngs):
      self.d = nnx.Linear(8, 8, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.d(x))
  model = NnxDrop(nnx.Rngs(0, dropout=1))
  r = jaxprec.check_module(model, X, **ROW)
  assert _names(r) == ["d", "drop", "output"]


# ---------------------------------------------------------------------------
# Unused-rule reports under nn.jit.


class _Jitted(nn.Module):
  @nn.jit
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="a_second")(nn.Dense(8, name="z_first")(x))


def _unused(fn):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn()
  return [str(w.message) for w in caught
          if issubclass(w.category, jaxprec.UnusedRuleWarning)]


def test_no_false_unused_rule_warning_under_nn_jit():
  net = _Jitted()
  variables = net.init(jax.random.key(0), X)
  policy = "default=bfloat16,z_first=float32"
  for _ in range(2):  # the second wrapper with the same policy too
    assert _unused(lambda: jaxprec.emulate(net.apply, policy)(variables, X)) == []
    assert _unused(lambda: jaxprec.check(net.apply, variables, X,
                                         precisions=[policy],
                                         mode="emulate")) == []
  # A rule that matches nothing still warns, on every new wrapper.
  typo = "default=bfloat16,z_frist=float32"
  for _ in range(2):
    found = _unused(lambda: jaxprec.emulate(net.apply, typo)(variables, X))
    assert len(found) == 1 and "z_frist" in found[0]


# ---------------------------------------------------------------------------
# What a module returns besides floating arrays, and classes the hook must
# subclass: check_module on NNX as on linen.


class _NnxIds(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    h = self.lin(x)
    return h, {"ids": jnp.argmax(h, -1), "n": 3}


class _NnxIdsNet(nnx.Module):
  def __init__(self, rngs):
    self.step = _NnxIds(rngs)

  def __call__(self, x):
    h, _ = self.step(x)
    return jnp.tanh(h)


class _LinenIds(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, name="lin")(x)
    return h, {"ids": jnp.argmax(h, -1), "n": 3}


class _LinenIdsNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h, _ = _LinenIds(name="step")(x)
    return jnp.tanh(h)


def test_outputs_that_are_not_compared_are_named_on_nnx_as_on_linen():
  net = _LinenIdsNet()
  linen = jaxprec.check_module(net, net.init(jax.random.key(0), X), X, **ROW)
  nnx_ = jaxprec.check_module(_NnxIdsNet(nnx.Rngs(0)), X, **ROW)
  for r in (linen, nnx_):
    assert _names(r) == ["step/lin", "step[0]", "output"]
    said = [n for n in r.notes if n.startswith("not compared")]
    assert len(said) == 1, r.notes
    assert "'step[1].ids' (int32)" in said[0] and "'step[1].n' (int" in said[0]


class _Tagged(nnx.Module):
  """Its subclasses name a tag: subclassing it needs an argument."""

  def __init_subclass__(cls, *, tag, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.tag = tag


class _TaggedBlock(_Tagged, tag="block"):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):  # a matmul of its own too
    return jnp.tanh(self.lin(x) @ self.lin.kernel[...])


class _TaggedNet(nnx.Module):
  block = _TaggedBlock

  def __init__(self, rngs):
    self.z_block = self.block(rngs)
    self.a_head = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return self.a_head(self.z_block(x))


class _PlainBlock(nnx.Module):
  __init__, __call__ = _TaggedBlock.__init__, _TaggedBlock.__call__


class _PlainNet(_TaggedNet):
  block = _PlainBlock


def test_a_module_whose_class_takes_subclass_arguments_is_checked_and_policed():
  model = _TaggedNet(nnx.Rngs(0))
  classes = [type(m) for _, m in nnx.iter_modules(model)]
  policy = "default=float32,z_block=bfloat16"
  rows = dict(precisions=["bf16", policy], mode="emulate")
  r = jaxprec.check_module(model, X, **rows)
  assert _names(r) == ["z_block/lin", "z_block", "a_head", "output"]
  # The same figures as its twin of a plain class (the same weights): its
  # output, and a rule for its path reaching the ops inside it.
  twin = jaxprec.check_module(_PlainNet(nnx.Rngs(0)), X, **rows)
  for row in rows["precisions"]:
    assert r.metric("rel_rms", row) == twin.metric("rel_rms", row)
  # The rule reaches its own matmul, not its Linear's (a path of its own).
  at = {l.name: l.metrics[policy].rel_rms for l in r.layers}
  assert at["z_block/lin"] < 1e-6 < 1e-3 < at["z_block"]
  assert [type(m) for _, m in nnx.iter_modules(model)] == classes
  assert _TaggedBlock.tag == "block" and type(model.z_block) is _TaggedBlock


class _NnxTable(nnx.Module):
  """Returns NumPy constants: a table and its length."""

  def __call__(self, n):
    pos = np.arange(n, dtype=np.float32)[:, None]
    return np.sin(pos / 10 ** (np.arange(8) / 8)).astype(np.float32), np.int64(n)


class _NnxTableNet(nnx.Module):
  def __init__(self, rngs):
    self.table = _NnxTable()
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    table, n = self.table(x.shape[0])
    return self.lin(x + np.concatenate([table[:n // 2], table[n // 2:]]))


def test_a_modules_numpy_outputs_reach_its_caller_as_numpy():
  model = _NnxTableNet(nnx.Rngs(0))
  r = jaxprec.check_module(model, X, **ROW)
  assert _names(r) == ["table[0]", "lin", "output"]
  got = r.layers[0].metrics["bf16"]
  assert got.rel_rms == 0 and got.max_abs == 0  # a constant: the same anywhere
  assert any("'table[1]' (int64)" in n for n in r.notes)
  full = jaxprec.check(model, X, **ROW)
  assert full.metric("rel_rms", "bf16") == [r.layers[-1].metrics["bf16"].rel_rms]


class _NnxJitCall(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  @nnx.jit
  def __call__(self, x):
    return jnp.tanh(self.lin(x))


class _NnxJitCallNet(nnx.Module):
  def __init__(self, rngs):
    self.z_block = _NnxJitCall(rngs)
    self.a_head = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return self.a_head(self.z_block(x))


def test_a_jitted_call_traced_once_keeps_its_layers_in_every_check():
  """nnx.jit traces the body once; later traces reuse it (its marks)."""
  for rows in (ROW, dict(precisions=["bf16_3x"], mode="emulate")):
    r = jaxprec.check_module(_NnxJitCallNet(nnx.Rngs(0)), X, **rows)
    assert _names(r) == ["z_block/lin", "z_block", "a_head", "output"]
  # The figures of the same model without the jit.
  plain = jaxprec.check_module(_NnxPlainCallNet(nnx.Rngs(0)), X,
                               precisions=["bf16_3x"], mode="emulate")
  assert r.metric("rel_rms", "bf16_3x") == plain.metric("rel_rms", "bf16_3x")


class _NnxPlainCall(_NnxJitCall):
  __call__ = _NnxJitCall.__call__.__wrapped__


class _NnxPlainCallNet(_NnxJitCallNet):
  def __init__(self, rngs):
    self.z_block = _NnxPlainCall(rngs)
    self.a_head = nnx.Linear(8, 8, rngs=rngs)


class _NnxSows(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.lin(x))
    self.sow(nnx.Intermediate, "twice", 2 * h)
    return h


class _NnxSowsNet(nnx.Module):
  def __init__(self, rngs):
    self.block = _NnxSows(rngs)

  def __call__(self, x):
    return jnp.tanh(self.block(x))


class _LinenSows(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(8, name="lin")(x))
    self.sow("intermediates", "twice", 2 * h)
    return h


class _LinenSowsNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(_LinenSows(name="block")(x))


def test_values_a_model_sows_are_layers_on_nnx_as_on_linen():
  net = _LinenSowsNet()
  linen = jaxprec.check_module(net, net.init(jax.random.key(0), X), X, **ROW)
  with warnings.catch_warnings():  # Flax's, on sow outside nnx.capture
    warnings.simplefilter("ignore", DeprecationWarning)
    model = _NnxSowsNet(nnx.Rngs(0))
    nnx_ = jaxprec.check_module(model, X, **ROW)
  for r in (linen, nnx_):
    assert _names(r) == ["block/lin", "block", "block.twice", "output"]
    rms = r.metric("rel_rms", "bf16")
    assert rms[1] == rms[2] > 0  # twice the block's output: the same error
  assert not hasattr(model.block, "twice")  # the user's model is untouched
