"""The Flax side: one source of module paths; NNX policies under emulate and cost."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxprec
from jaxprec._src.core import numerics
from jaxprec._src.core.precision import resolve

import models

# Precisions whose recorded form differs from each other's (for dots).
_COLORS = ("bfloat16", "tensorfloat32", "float32", "BF16_BF16_F32",
           "BF16_BF16_F32_X3", "BF16_BF16_F32_X6", "BF16_BF16_F32_X9",
           "TF32_TF32_F32", "TF32_TF32_F32_X3", "F16_F16_F32", "F32_F32_F32")


def _recorded_name(precision: str, primitive: str) -> str:
  """What jaxprec.audit shows for an op run at ``precision``."""
  kind = numerics.op_kind(primitive)
  value = numerics.per_op(resolve(precision), kind)
  if isinstance(value, tuple):
    value = value[0] if value[0] == value[1] else value
  return value.name


def assert_audit_paths_are_interceptor_paths(model, fn_of, *args):
  """Each op's audit ``module_path`` is the path the policy interceptor gave it.

  Two colourings of the audit's paths with distinct precisions (a path rule
  each, by ``re.escape``) are swapped in; every op must then record the colour
  of its audit path, and every rule must be used.
  """
  paths = sorted({r.module_path for r in jaxprec.audit(fn_of(model), *args)})
  assert len(paths) >= 4, paths
  n = len(_COLORS)
  for color in (lambda i: i % n, lambda i: (i // n + i) % n):
    colors = {p: _COLORS[color(i)] for i, p in enumerate(paths)}
    policy = jaxprec.Policy(rules=[jaxprec.Rule(path=re.escape(p), precision=c)
                                   for p, c in colors.items()])
    swapped = jaxprec.swap(model, policy)
    with warnings.catch_warnings():
      warnings.simplefilter("error", jaxprec.UnusedRuleWarning)
      got = jaxprec.audit(fn_of(swapped), *args).rows
    assert {r.module_path for r in got} == set(paths)
    for r in got:
      assert r.precision_name == _recorded_name(colors[r.module_path], r.primitive), (
          r.module_path, r.primitive)
    assert not jaxprec.policy_report(swapped).unused_rules
  return paths


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name="fc")(x)
    return nn.remat(nn.Dense)(4, name="rem")(x) + x @ x.T @ x  # own op: "block"


class Nested(nn.Module):
  """Nested modules, ``nn.remat``, ``nn.scan`` and ops in a module's own body."""

  @nn.compact
  def __call__(self, x):
    x = Block(name="block")(x)
    x = nn.remat(Block)(name="remat_block")(x)
    x, _ = nn.scan(models.Cell, variable_broadcast="params", split_rngs={"params": False},
                   length=3)(name="scan")(x, jnp.ones((3, *x.shape)))
    x = nn.Conv(4, (1,), name="conv")(x[..., None, :])[..., 0, :]
    return nn.Dense(2, name="head")(x) + x @ x.T @ x[:, :2]  # own op: ""


def test_audit_and_interceptor_paths_agree_on_a_nested_linen_model():
  model, x = Nested(), jnp.ones((2, 4))
  params = jax.jit(model.init)(jax.random.key(0), x)
  paths = assert_audit_paths_are_interceptor_paths(
      model, lambda m: m.apply, params, x)
  assert {"", "block", "block/fc", "block/rem", "remat_block", "remat_block/fc",
          "remat_block/rem", "scan/inner", "conv", "head"} == set(paths)


def test_audit_and_interceptor_paths_agree_on_hugging_face_bert():
  transformers = pytest.importorskip("transformers")
  config = transformers.BertConfig(
      vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
      intermediate_size=32, max_position_embeddings=16)
  model = transformers.FlaxBertModel(config, input_shape=(1, 8), _do_init=False)
  ids = (jnp.arange(16).reshape(2, 8) * 7) % 64
  params = jax.jit(model.init_weights, static_argnums=1)(jax.random.key(0), ids.shape)

  def call(m):
    return lambda params, ids: m(ids, params=params).last_hidden_state

  paths = assert_audit_paths_are_interceptor_paths(model, call, params, ids)
  assert "encoder/layer/1/attention/self" in paths and "pooler/dense" in paths
  assert len(paths) >= 13


# -- NNX path rules under emulate and cost -------------------------------------------


class TwoLayers(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(16, 32, rngs=rngs)
    self.fc2 = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.relu(self.fc1(x)))

  def hidden(self, x):
    return nnx.relu(self.fc1(x))


def _bf16(a):
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _reference(model, x, fc1_bf16: bool, fc2_bf16: bool):
  """NumPy in float64: a layer at bfloat16 rounds its operands to bfloat16 once
  (a TPU's one pass), a layer at float32 is exact (a TPU's six passes are
  within float32 rounding of it)."""
  def layer(lin, h, low):
    w = np.asarray(lin.kernel[...], np.float64)
    h = np.asarray(h, np.float64)
    out = (_bf16(h) @ _bf16(w)) if low else h @ w
    return (out + np.asarray(lin.bias[...], np.float64)).astype(np.float32)
  h = np.maximum(layer(model.fc1, x, fc1_bf16), 0)
  return layer(model.fc2, h, fc2_bf16)


@pytest.fixture(scope="module")
def two_layers():
  model = TwoLayers(rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 16), jnp.float32)
  return model, x


def test_emulate_applies_nnx_path_rules(two_layers):
  # Issue 12 item 2: fc2=float32 was ignored (the output was all-bfloat16).
  model, x = two_layers
  mixed = _reference(model, x, fc1_bf16=True, fc2_bf16=False)
  low = _reference(model, x, fc1_bf16=True, fc2_bf16=True)
  assert np.abs(mixed - low).max() > 1e-3  # the two answers are far apart
  policy = "default=bfloat16,fc2=float32"
  for fn in (model, model.__call__):
    with warnings.catch_warnings():
      warnings.simplefilter("error", jaxprec.UnusedRuleWarning)
      emulated = jaxprec.emulate(fn, policy)
      for got in (emulated(x), jax.jit(emulated)(x)):
        np.testing.assert_allclose(np.asarray(got), mixed, rtol=0, atol=2e-6)
    report = jaxprec.policy_report(emulated)
    assert {(m.path, m.precision.name) for m in report.matches} >= {
        ("fc1", "bfloat16"), ("fc2", "float32")}
    assert not report.unused_rules
  np.testing.assert_allclose(np.asarray(jaxprec.emulate(model, "bfloat16")(x)),
                             low, rtol=0, atol=2e-6)
  # A bound method other than __call__, and the user's model is untouched.
  hidden = jaxprec.emulate(model.hidden, "default=float32,fc1=bf16")(x)
  w, b = np.asarray(model.fc1.kernel[...], np.float64), np.asarray(model.fc1.bias[...])
  np.testing.assert_allclose(
      np.asarray(hidden), np.maximum(_bf16(x) @ _bf16(w) + b, 0), rtol=0, atol=2e-6)
  assert model.fc1.precision is None and model.fc2.precision is None


@pytest.mark.parametrize("policy", ["bfloat16", "default=bfloat16,fc2=float32"])
def test_emulate_of_an_nnx_model_sees_weights_changed_in_place(policy):
  # A cached trace baked the module's parameters in: after an in-place update
  # (an optimizer step) the emulated model answered with the old weights.
  model = TwoLayers(rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(4), (4, 16), jnp.float32)
  emulated = jaxprec.emulate(model, policy)
  before = np.asarray(emulated(x))
  model.fc2.kernel[...] = model.fc2.kernel[...] * 2
  model.fc2.bias[...] = model.fc2.bias[...] + 1
  after = np.asarray(emulated(x))
  fc2_low = policy == "bfloat16"
  np.testing.assert_allclose(
      after, _reference(model, x, fc1_bf16=True, fc2_bf16=fc2_low),
      rtol=0, atol=4e-6)
  assert not np.allclose(after, before)
  # The same module under jit, and the user's module is not modified.
  np.testing.assert_array_equal(np.asarray(jax.jit(emulated)(x)), after)
  assert model.fc2.precision is None


def test_cost_counts_nnx_path_rules(two_layers):
  model, x = two_layers
  flops1, flops2 = 2 * 4 * 16 * 32, 2 * 4 * 32 * 8
  r = jaxprec.cost(model, x, policy="default=bfloat16,fc2=float32")
  assert r.by_algorithm == {"bf16x1": flops1, "bf16x6": flops2}
  assert r.cost == flops1 * 1 + flops2 * 6 and r.float32_cost == 6 * (flops1 + flops2)
  assert jaxprec.cost(model, x, policy="bfloat16").by_algorithm == {
      "bf16x1": flops1 + flops2}


# -- NNX module paths in the audit ---------------


class _Block(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
    self.mlp = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return self.mlp(nnx.relu(self.attn(x)))


class _Nested(nnx.Module):
  """Nested modules, a list of layers, a convolution and an einsum."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.layers = nnx.List([_Block(rngs=rngs) for _ in range(2)])
    self.conv = nnx.Conv(8, 8, (3,), rngs=rngs)
    self.head = nnx.Einsum("btd,dk->btk", (8, 4), rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(self.conv(x))

  def body(self, x):
    return self.layers[1](x)


_NESTED_PATHS = [
    f"layers/{i}/{p}" for i in range(2)
    for p in ("attn/query", "attn/key", "attn/value", "attn", "attn", "attn/out",
              "mlp")] + ["conv", "head"]


def test_audit_gives_nnx_module_paths_as_swap_names_them():
  # Before: every op of an NNX model had module_path '' (one search unit).
  model = _Nested(rngs=nnx.Rngs(0))
  x = jax.ShapeDtypeStruct((2, 5, 8), jnp.float32)
  report = jaxprec.audit(model, x)
  assert [r.module_path for r in report.rows] == _NESTED_PATHS
  assert report.function == "_Nested"
  # The paths are those swap and policy_report give the same modules (and
  # the blocks around them, as linen's report lists every module called).
  swapped = jaxprec.policy_report(jaxprec.swap(model, "bfloat16"))
  assert {m.path for m in swapped.matches} == set(_NESTED_PATHS) | {
      "", "layers/0", "layers/1"}
  # Each op's name stack names its module; FLOPs of the two attention
  # einsums (2*B*N*T*S*H each) are the attention module's own.
  for r in report.rows:
    assert r.name_stack.startswith(r.module_path), r
  attn = [r.flops for r in report.rows if r.module_path == "layers/0/attn"]
  assert attn == [2 * 2 * 2 * 5 * 5 * 4] * 2
  assert [r.flops for r in report.rows if r.module_path == "conv"] == [
      2 * 2 * 5 * 8 * 3 * 8]
  # A bound method other than __call__: paths from the module it is bound to.
  body = jaxprec.audit(model.body, x)
  assert [r.module_path for r in body.rows] == _NESTED_PATHS[7:14]
  # The user's modules are untouched (no class swapped, no precision set).
  assert type(model.layers[0].attn) is nnx.MultiHeadAttention
  assert type(model.conv) is nnx.Conv and model.conv.precision is None


class _ScannedBlock(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.fc = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.fc(x))


class _Scanned(nnx.Module):
  """Three stacked blocks run by nnx.scan, then a head."""

  def __init__(self, *, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _ScannedBlock(rngs=rngs)
    self.blocks = make(rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, h):
      return block(h)
    return self.out(body(self.blocks, x))


def test_audit_paths_of_nnx_layers_run_by_scan():
  # nnx.scan runs a copy of the stacked blocks: the path goes with it.
  model = _Scanned(rngs=nnx.Rngs(0))
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  rows = jaxprec.audit(model, x).rows
  assert [(r.module_path, r.scope, r.trip_count, r.flops) for r in rows] == [
      ("blocks/fc", ("scan",), 3, 3 * 2 * 4 * 8 * 8), ("out", (), 1, 2 * 4 * 8 * 2)]
  swapped = jaxprec.policy_report(jaxprec.swap(model, "bfloat16"))
  assert {m.path for m in swapped.matches} == {"", "blocks", "blocks/fc", "out"}
  r = jaxprec.cost(model, x, policy="default=bfloat16,blocks/fc=float32")
  assert [(row.path, row.algorithms) for row in r.rows] == [
      ("blocks/fc", ("bf16x6",)), ("out", ("bf16x1",))]
  assert type(model.blocks.fc) is nnx.Linear


class _WithStats(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.fc = nnx.Linear(4, 4, rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)

  def __call__(self, x):
    return self.bn(self.fc(x))


def test_audit_of_an_nnx_model_that_updates_its_state():
  # Before: tracing wrote batch statistics into the user's module and failed
  # (flax TraceContextError, "Cannot mutate BatchStat from a different trace").
  model = _WithStats(rngs=nnx.Rngs(0))
  rows = jaxprec.audit(model, jnp.ones((2, 4), jnp.float32)).rows
  assert [(r.module_path, r.flops) for r in rows] == [("fc", 2 * 2 * 4 * 4)]
  assert isinstance(model.bn.mean[...], jax.Array)  # not a leaked tracer
  np.testing.assert_array_equal(np.asarray(model.bn.mean[...]), np.zeros(4))


def test_cost_rows_per_nnx_path(two_layers):
  # Before: one "(top)" row for the whole NNX model.
  model, x = two_layers
  flops1, flops2 = 2 * 4 * 16 * 32, 2 * 4 * 32 * 8
  r = jaxprec.cost(model, x, policy="default=bfloat16,fc2=float32")
  assert [(row.path, row.flops, row.algorithms, row.cost) for row in r.rows] == [
      ("fc1", flops1, ("bf16x1",), flops1), ("fc2", flops2, ("bf16x6",), 6 * flops2)]
  assert [row.path for row in jaxprec.cost(model.__call__, x).rows] == ["fc1", "fc2"]
