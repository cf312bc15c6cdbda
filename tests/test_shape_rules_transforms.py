"""XLA's shape rules under jax.vmap and jax.grad: decided on the shapes the
target's compiler sees.

A matrix·vector product is exact float32 on a TPU at DEFAULT (as JAX's
maintainers state) and on a GPU below XLA's strength-reduction bound
(``numerics.shape_rule``); ``jax.vmap`` over its vector makes it a matrix
product, which the target computes at the precision's algorithm. So
``jax.vmap(jaxprec.emulate(f))`` computes what ``jaxprec.emulate(jax.vmap(f))``
computes, and a gradient what the emulated gradient computes, bit for bit.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxprec

RNG = np.random.default_rng(7)
W = RNG.standard_normal((16, 32)).astype(np.float32)
V = RNG.standard_normal((8, 32)).astype(np.float32)


def matvec(w, v):
  return w @ v


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _one_pass(a, b, fmt):
  """float64 sum of the operands rounded to ``fmt`` (a bound, not the bits)."""
  if fmt == "bf16":
    r = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
  else:  # TF32: 10 explicit mantissa bits, round to nearest even
    r = lambda x: _tf32(x).astype(np.float64)  # noqa: E731
  return r(a) @ r(b)


def _tf32(x):
  u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  u = (u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000
  return u.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("target,fmt", [("tpu", "bf16"), ("gpu", "tf32")])
def test_vmap_of_an_emulated_matvec_is_the_emulated_matrix_product(target,
                                                                   fmt):
  em = jaxprec.emulate(matvec, "default", target=target)
  one = em(W, V[0])
  exact = W.astype(np.float64) @ V[0].astype(np.float64)
  np.testing.assert_allclose(one, exact, rtol=1e-6, atol=1e-6)  # float32
  outer = jax.vmap(em, in_axes=(None, 0))(W, V)
  inner = jaxprec.emulate(jax.vmap(matvec, in_axes=(None, 0)), "default",
                          target=target)(W, V)
  np.testing.assert_array_equal(_bits(outer), _bits(inner))
  # A matrix product at one pass: the rounding shows.
  rounded = _one_pass(V, W.T, fmt)
  assert np.abs(np.asarray(outer) - V.astype(np.float64) @ W.T.astype(
      np.float64)).max() > 1e-4
  np.testing.assert_allclose(outer, rounded, rtol=1e-5, atol=1e-5)
  # jax.jit around it changes nothing.
  np.testing.assert_array_equal(
      _bits(jax.jit(jax.vmap(em, in_axes=(None, 0)))(W, V)), _bits(outer))


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_vmap_over_the_matrix_keeps_the_rule(target):
  # Batched matrices times one vector: a batched matrix·vector, float32.
  ws = np.stack([W, W * 0.5])
  em = jaxprec.emulate(matvec, "default", target=target)
  got = jax.vmap(em, in_axes=(0, None))(ws, V[0])
  exact = ws.astype(np.float64) @ V[0].astype(np.float64)
  np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_gradients_of_a_matvec_decide_on_their_own_shapes(target):
  # d/dW of W @ v is an outer product (a matrix product with no
  # contraction: one pass), d/dv a matrix·vector product (float32): as
  # emulating the gradient's own program computes them.
  def loss(w, v):
    return jnp.sum(jnp.sin(matvec(w, v)))

  em = jaxprec.emulate(loss, "default", target=target)
  got = jax.grad(em, argnums=(0, 1))(W, V[0])
  want = jaxprec.emulate(jax.grad(loss, argnums=(0, 1)), "default",
                         target=target)(W, V[0])
  for a, b in zip(got, want):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_the_option_off_keeps_one_pass_under_vmap():
  em = jaxprec.emulate(matvec, "default", target="tpu", tpu_matvec_f32=False)
  outer = jax.vmap(em, in_axes=(None, 0))(W, V)
  inner = jaxprec.emulate(jax.vmap(matvec, in_axes=(None, 0)), "default",
                          target="tpu", tpu_matvec_f32=False)(W, V)
  np.testing.assert_array_equal(_bits(outer), _bits(inner))
  single = em(W, V[0])
  assert np.abs(np.asarray(single) - W.astype(np.float64) @ V[0]).max() > 1e-4
