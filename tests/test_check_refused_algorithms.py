"""A model whose code names a dot algorithm the CPU refuses still has a
float32 (or float64) reference on CPU: those dots run exactly there, and the
report says so. Checked against NumPy in float64 and ml_dtypes' bfloat16."""

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
import jax.numpy as jnp
from jax import lax

import jaxprec
from jaxprec._src.core.precision import cpu_refuses

BF16_ALGORITHM = lax.DotAlgorithm(lhs_precision_type=jnp.bfloat16,
                                  rhs_precision_type=jnp.bfloat16,
                                  accumulation_type=jnp.float32)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 32)).astype(np.float32)
W = RNG.normal(size=(32, 6)).astype(np.float32)


def with_algorithm(x, w):
  return {"h": jnp.tanh(jnp.dot(x, w, precision=BF16_ALGORITHM))}


def _bf16(a):
  return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def test_the_cpu_refuses_the_algorithm_object():
  assert cpu_refuses(BF16_ALGORITHM)  # what made the reference fail


@pytest.mark.parametrize("reference", ["float32", "float64"])
def test_a_dot_algorithm_object_gets_an_exact_reference(reference):
  report = jaxprec.check(with_algorithm, X, W, precisions=("bfloat16",),
                         reference=reference)
  # The row computes the algorithm (operands rounded to bfloat16, exact
  # products, float32 sums); the reference the exact product.
  row = np.tanh(_bf16(X) @ _bf16(W))
  exact = np.tanh(X.astype(np.float64) @ W.astype(np.float64))
  want = np.abs(row - exact).max()
  got = report.layers[0].metrics["bfloat16"].max_abs
  np.testing.assert_allclose(got, want, rtol=1e-3)
  (note,) = [n for n in report.notes if "lax.DotAlgorithm" in n]
  assert f"at exact {reference}" in note and "refuses" in note


def test_a_preset_the_cpu_refuses_gets_the_same_reference_as_plain_code():
  preset = lax.DotAlgorithmPreset.TF32_TF32_F32
  assert cpu_refuses(preset)

  def named(x, w):
    return {"h": jnp.tanh(jnp.dot(x, w, precision=preset))}

  def plain(x, w):
    return {"h": jnp.tanh(jnp.dot(x, w))}
  kw = dict(precisions=("tensorfloat32",), target="gpu")
  got, want = (jaxprec.check(f, X, W, **kw) for f in (named, plain))
  assert (got.layers[0].metrics["tensorfloat32"].max_abs
          == want.layers[0].metrics["tensorfloat32"].max_abs)
  assert any("TF32_TF32_F32 at exact float32" in n for n in got.notes)
  assert not any("refuses" in n for n in want.notes)


def test_an_nnx_layer_with_the_algorithm_is_checked():
  layer = nnx.Linear(32, 6, precision=BF16_ALGORITHM, rngs=nnx.Rngs(0))
  layer.kernel[...] = W
  layer.bias[...] = np.zeros(6, np.float32)
  report = jaxprec.check(layer, X, precisions=("bfloat16",))
  want = np.abs(_bf16(X) @ _bf16(W) - X.astype(np.float64) @ W).max()
  np.testing.assert_allclose(report.layers[0].metrics["bfloat16"].max_abs,
                             want, rtol=1e-3)
  assert any("lax.DotAlgorithm" in n for n in report.notes)
