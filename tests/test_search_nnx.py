"""jaxprec.search_policy on a Flax NNX model: one unit per module path.

The model is tests/test_search.py's ill-conditioned MLP written in NNX: six
``nnx.Linear`` layers in an ``nnx.List``; layer 3's input carries a common
offset of 100 that the next step removes (``y - mean(y)`` over the batch), so
rounding its operands to bfloat16 once destroys the signal while three
bfloat16 passes keep it. Every other layer is fine in bfloat16 at a 2%
tolerance. Before NNX paths reached the audit, every op had path ``''``: the
search could only choose one precision for the whole model.
"""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxprec

from conftest import assert_same_figures

TOL = 2e-2
OFFSET = 100.0
BAD = 3


class OffsetMLP(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs, layers: int = 6):
    self.layers = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(layers)])

  def __call__(self, x):
    out = {}
    h = x
    for i, layer in enumerate(self.layers):
      if i == BAD:
        y = layer(h + OFFSET)
        y = y - y.mean(axis=0, keepdims=True)
      else:
        y = layer(h)
      h = jnp.tanh(y)
      out[f"layer_{i}"] = h
    return out


@pytest.fixture(scope="module")
def model_x():
  model = OffsetMLP(rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (16, 32), jnp.float32)
  return model, x


@pytest.fixture(scope="module")
def result(model_x):
  model, x = model_x
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.UnusedRuleWarning)
    return jaxprec.search_policy(model, x, tolerance=TOL, verbose=False)


def _bf16(a):
  return np.asarray(a, np.float64).astype(np.float32).astype(
      ml_dtypes.bfloat16).astype(np.float64)


def _truncate_bf16(a):
  bits = np.asarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
  return bits.view(np.float32).astype(np.float64)


def _numpy_layer(layer, i: int, h, level: str = "float32"):
  """Layer ``i``'s output for input ``h``, in float64 NumPy. At
  ``'bfloat16'`` the layer rounds its operands to bfloat16 once (one TPU
  pass); at ``'bfloat16_3x'`` it splits each float32 operand into a high part
  (truncated to bfloat16) and a low part (the rest, rounded to bfloat16) and
  sums hi*hi + hi*lo + lo*hi (XLA's three passes, XLA's dot_algorithm_rewriter.cc, openxla/xla); at
  ``'float32'`` it is exact (six passes are within float32 rounding of it)."""
  w = np.asarray(layer.kernel[...], np.float64)
  b = np.asarray(layer.bias[...], np.float64)
  h = np.asarray(h, np.float32)
  a = (h + np.float32(OFFSET) if i == BAD else h).astype(np.float64)
  if level == "bfloat16":
    y = _bf16(a) @ _bf16(w)
  elif level == "bfloat16_3x":
    a_hi, w_hi = _truncate_bf16(a), _truncate_bf16(w)
    a_lo, w_lo = _bf16(a - a_hi), _bf16(w - w_hi)
    y = a_hi @ w_hi + a_hi @ w_lo + a_lo @ w_hi
  else:
    y = a @ w
  y = y + b
  if i == BAD:
    y = y - y.mean(axis=0, keepdims=True)
  return np.tanh(y)


def _numpy_forward(model, x, levels: dict[int, str] | None = None):
  """Each layer's output (:func:`_numpy_layer` at ``levels``, float32 by
  default), the model run end to end."""
  levels = levels or {}
  out, h = {}, x
  for i, layer in enumerate(model.layers):
    h = _numpy_layer(layer, i, h, levels.get(i, "float32"))
    out[f"layer_{i}"] = h
  return out


def _rel_rms(got, want):
  return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def test_the_model_has_one_fragile_layer(model_x):
  # Independent of jaxprec: bfloat16 everywhere fails at layer 3, bfloat16
  # everywhere but layer 3 passes.
  model, x = model_x
  exact = _numpy_forward(model, x)
  low = _numpy_forward(model, x, dict.fromkeys(range(6), "bfloat16"))
  assert _rel_rms(low["layer_3"], exact["layer_3"]) > 10 * TOL
  mixed = _numpy_forward(model, x, {**dict.fromkeys(range(6), "bfloat16"),
                                    BAD: "bfloat16_3x"})
  assert max(_rel_rms(mixed[k], exact[k]) for k in exact) < TOL


def test_search_keeps_the_fragile_nnx_layer_higher(result):
  by_path = result.precision_by_path()
  assert set(by_path) == {f"layers/{i}" for i in range(6)}
  assert by_path.pop(f"layers/{BAD}") in ("bfloat16_3x", "float32")
  assert set(by_path.values()) == {"bfloat16"}
  assert result.meets_tolerance and max(result.values.values()) <= TOL
  assert result.units == tuple(f"layers/{i}" for i in range(6))


def test_check_reproduces_the_search_figures(model_x, result):
  model, x = model_x
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.UnusedRuleWarning)
    report = jaxprec.check(model, x, precisions=[result.policy])
  assert_same_figures(report, result)


def test_searched_policy_against_numpy(model_x, result):
  # The searched policy under emulate, against the float64 NumPy forward pass
  # (bfloat16 layers rounded once, the fragile layer at higher precision).
  model, x = model_x
  got = jaxprec.emulate(model, result.policy)(x)
  by_path = result.precision_by_path()
  exact = _numpy_forward(model, x)
  h = x
  for i, layer in enumerate(model.layers):
    k = f"layer_{i}"
    g = np.asarray(got[k], np.float64)
    # Each layer at its searched precision, on the emulated input: within
    # float32 accumulation. In the cancellation of layer 3 that is rel_rms
    # ~2e-5, where exact float32 would be 1.6e-3 away.
    want = _numpy_layer(layer, i, h, by_path[f"layers/{i}"])
    if i == BAD:
      assert _rel_rms(g, want) < 2e-4, (k, str(result.policy))
    else:
      np.testing.assert_allclose(g, want, rtol=0, atol=1e-6,
                                 err_msg=f"{k} {result.policy}")
    # Far from float32 everywhere (rel_rms 2e-3 to 6e-3 here), within the
    # tolerance of it.
    assert 1e-3 < _rel_rms(g, exact[k]) <= TOL, (k, str(result.policy))
    h = got[k]
  assert type(model.layers[BAD]) is nnx.Linear and model.layers[BAD].precision is None
