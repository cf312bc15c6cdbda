"""Module paths across Flax's bridges: full paths from the model called.

A linen block inside ``nnx.bridge.ToNNX`` at ``blk`` has its layers at
``blk/dense``, as an NNX block's would be, and the NNX block that
``nnx.bridge.ToLinen`` named ``blk`` makes has its layers at ``blk/dense``:
in the audit's rows, in the policy's decisions (emulate, swap) and in the
unused-rule warnings.
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

import jaxprec

from test_flax import assert_audit_paths_are_interceptor_paths

_X = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
_BLOCK_FLOAT32 = "default=bfloat16,blk(/.*)?=float32"


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="proj")(jnp.tanh(nn.Dense(4, name="dense")(x)))


class _NNXModel(nnx.Module):
  """An NNX model holding a linen block through ``nnx.bridge.ToNNX``."""

  def __init__(self, rngs):
    self.blk = bridge.ToNNX(_LinenBlock(), rngs=rngs).lazy_init(_X)
    self.head = nnx.Linear(4, 4, rngs=rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.head(jnp.tanh(self.blk(x)))))


class _NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(3, 4, rngs=rngs)
    self.proj = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return self.proj(jnp.tanh(self.dense(x)))


class _LinenModel(nn.Module):
  """A linen model holding an NNX block through ``nnx.bridge.ToLinen``."""

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(bridge.ToLinen(_NNXBlock, name="blk")(x))
    return nn.Dense(2, name="out")(jnp.tanh(nn.Dense(4, name="head")(x)))


_PATHS = ["blk/dense", "blk/proj", "head", "out"]


def _bf16(a) -> np.ndarray:
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(
      np.float64)


def _head(h, layers) -> np.ndarray:
  """The model's head on the block's output ``h``, in float64 on bfloat16
  operands (the TPU's one-pass bfloat16 matmul, in exact sums)."""
  for w, b in layers:
    h = _bf16(np.tanh(h)) @ _bf16(w) + np.asarray(b, np.float64)
  return h


def _rows(report):
  return [(r.module_path, r.precision_name) for r in report.rows]


def _nnx_parts():
  m = _NNXModel(nnx.Rngs(0))
  layers = [(m.head.kernel[...], m.head.bias[...]),
            (m.out.kernel[...], m.out.bias[...])]
  return m, m.blk(_X), layers


def _linen_parts():
  model = _LinenModel()
  params = model.init(jax.random.key(0), _X)
  block = bridge.ToLinen(_NNXBlock)
  h = block.apply({"params": params["params"]["blk"]}, _X)
  p = params["params"]
  layers = [(p["head"]["kernel"], p["head"]["bias"]),
            (p["out"]["kernel"], p["out"]["bias"])]
  return model, params, h, layers


# ---------------------------------------------------------------------------
# NNX model, linen block inside nnx.bridge.ToNNX.


def test_audit_paths_of_a_linen_block_inside_an_nnx_model():
  m, _, _ = _nnx_parts()
  assert [p for p, _ in _rows(jaxprec.audit(m, _X))] == _PATHS
  # The policy hook gives each op the path the audit shows.
  assert assert_audit_paths_are_interceptor_paths(
      m, lambda model: model, _X) == _PATHS


def test_block_rule_keeps_a_tonnx_block_at_float32_under_emulate():
  m, h, layers = _nnx_parts()
  got = np.asarray(jaxprec.emulate(m, _BLOCK_FLOAT32, target="tpu")(_X),
                   np.float64)
  want = _head(h, layers)  # block at float32 (exact on CPU), head at bf16
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The block at bfloat16 gives other numbers: the rule changed something.
  all_bf16 = jaxprec.emulate(m, "bfloat16", target="tpu")(_X)
  assert np.abs(all_bf16 - got).max() > 1e-4


def test_block_rule_on_a_swapped_nnx_model_lowers_the_block_at_highest():
  m, _, _ = _nnx_parts()
  swapped = jaxprec.swap(m, _BLOCK_FLOAT32)
  assert _rows(jaxprec.audit(swapped, _X)) == [
      ("blk/dense", "HIGHEST"), ("blk/proj", "HIGHEST"),
      ("head", "DEFAULT"), ("out", "DEFAULT")]
  graphdef, state = nnx.split(swapped)
  text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(
      state, _X).as_text()
  dots = re.findall(r"stablehlo\.dot_general.*", text)
  assert len(dots) == 4, text
  assert [("HIGHEST" in d) for d in dots] == [True, True, False, False]


def test_unused_rule_warning_for_a_linen_root_path_inside_tonnx():
  m, _, _ = _nnx_parts()
  # The linen layers are decided when the bridge runs: the warning comes
  # after the first call (an NNX model without bridges warns at swap).
  swapped = jaxprec.swap(m, "default=bfloat16,dense=float32")
  with pytest.warns(jaxprec.UnusedRuleWarning, match="'dense=float32'"):
    swapped(_X)
  swapped = jaxprec.emulate(m, "default=bfloat16,blk/dense=float32")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.UnusedRuleWarning)
    swapped(_X)
    jaxprec.swap(m, "default=bfloat16,blk/dense=float32")(_X)
  used = {e.path for e in jaxprec.policy_report(swapped).matches
          if e.rule is not None and str(e.rule) == "blk/dense=float32"}
  assert used == {"blk/dense"}


# ---------------------------------------------------------------------------
# linen model, NNX block inside nnx.bridge.ToLinen.


def test_audit_paths_of_an_nnx_block_inside_a_linen_model():
  model, params, _, _ = _linen_parts()
  assert [p for p, _ in _rows(jaxprec.audit(model.apply, params, _X))] == (
      _PATHS)
  assert assert_audit_paths_are_interceptor_paths(
      model, lambda mod: lambda x: mod.apply(params, x), _X) == _PATHS


def test_block_rule_keeps_a_tolinen_block_at_float32():
  model, params, h, layers = _linen_parts()
  want = _head(h, layers)
  got = jaxprec.emulate(model.apply, _BLOCK_FLOAT32, target="tpu")(params, _X)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5,
                             atol=1e-6)
  swapped = jaxprec.swap(model, _BLOCK_FLOAT32, emulate=True)
  np.testing.assert_array_equal(swapped.apply(params, _X), got)
  all_bf16 = jaxprec.emulate(model.apply, "bfloat16", target="tpu")(params, _X)
  assert np.abs(all_bf16 - got).max() > 1e-4
  text = jax.jit(jaxprec.swap(model, _BLOCK_FLOAT32).apply).lower(
      params, _X).as_text()
  dots = re.findall(r"stablehlo\.dot_general.*", text)
  assert [("HIGHEST" in d) for d in dots] == [True, True, False, False], text


def test_unused_rule_warning_for_a_wrapper_path_inside_tolinen():
  model, params, _, _ = _linen_parts()
  f = jaxprec.emulate(model.apply, "default=bfloat16,dense=float32")
  with pytest.warns(jaxprec.UnusedRuleWarning, match="'dense=float32'"):
    f(params, _X)
  f = jaxprec.emulate(model.apply, "default=bfloat16,blk/proj=float32")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.UnusedRuleWarning)
    f(params, _X)
  decided = {e.path: e.precision.name for e in jaxprec.policy_report(f).matches
             if e.path.startswith("blk/")}
  assert decided == {"blk/dense": "bfloat16", "blk/proj": "float32"}, decided


def test_tolinen_leaves_a_module_the_user_holds_as_it_was():
  # nnx_class may be any function that returns a module, one the user holds.
  held = _NNXBlock(nnx.Rngs(1))
  cls = {n: type(m) for n, m in (("top", held), ("dense", held.dense))}
  wrapper = bridge.ToLinen(lambda rngs: held)
  params = wrapper.init(jax.random.key(0), _X)
  # Run eagerly (Flax refuses to write a held module's state in a trace).
  swapped = jaxprec.swap(wrapper, "default=bfloat16,dense=float32")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.UnusedRuleWarning)
    swapped.apply(params, _X)
  assert {"top": type(held), "dense": type(held.dense)} == cls
