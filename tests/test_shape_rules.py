"""Shape rules: dots a target computes in exact float32 because of their shapes.

* TPU: a matrix-vector product at ``DEFAULT`` is float32, as a JAX maintainer
  states (https://github.com/jax-ml/jax/issues/16349); ``tpu_matvec_f32``
  switches it off.
* GPU: XLA's dot strength reduction (``dot_strength_reduction.cc``): every
  vector·vector dot, and a matrix·vector dot whose ``(m + n) * k`` is below
  10,000,000 (``IsMatrixMultiplicationTooSmallForRewriting``).

The operands are chosen so that every sum is exact in float32 and none of
the operands is a bfloat16 (or TF32) value: exact float32 and the one-pass
algorithms give different, known numbers. Random operands are compared with
a float64 NumPy reference and an ml_dtypes bfloat16 one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxprec
from jaxprec._src.core import numerics

MV = (((1,), (0,)), ((), ()))        # (m, k) . (k,)
VM = (((0,), (0,)), ((), ()))        # (k,) . (k, n)
MM = (((1,), (0,)), ((), ()))        # (m, k) . (k, n)
BMV = (((2,), (1,)), ((0,), (0,)))   # (b, m, k) . (b, k)
VALUE = 1 + 2.0**-11                 # neither bfloat16 nor TF32 (a tie)


def _exact(a, b, dn):
  """float64 NumPy dot_general of the float32 operands (2-D and batched)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  (lc, rc), (lb, rb) = dn
  if lb:
    return np.einsum("bmk,bk->bm", a, b)
  return np.tensordot(a, b, (lc, rc))


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(
      np.float64)


# ---------------------------------------------------------------------------
# TPU matrix-vector products.


@pytest.mark.parametrize("dn, lhs_shape, rhs_shape", [
    (MV, (4, 64), (64,)), (VM, (64,), (64, 4)), (BMV, (2, 4, 64), (2, 64)),
    ((((0,), (0,)), ((), ())), (64,), (64,)),  # vector . vector
])
@pytest.mark.parametrize("jit", [False, True])
def test_tpu_matvec_at_default_is_exact_float32(dn, lhs_shape, rhs_shape, jit):
  a = jnp.full(lhs_shape, VALUE, jnp.float32)
  b = jnp.ones(rhs_shape, jnp.float32)

  def f(a, b, **kw):
    return jaxprec.emulated_dot_general(a, b, dn, target="tpu", **kw)
  f = jax.jit(f, static_argnames="tpu_matvec_f32") if jit else f
  on, off = f(a, b), f(a, b, tpu_matvec_f32=False)
  np.testing.assert_array_equal(np.asarray(on), _exact(a, b, dn))  # 64 * VALUE
  np.testing.assert_array_equal(np.asarray(off), _exact(_bf16(a), b, dn))
  assert not np.array_equal(np.asarray(on), np.asarray(off))


def test_tpu_matvec_random_operands_against_float64_and_bfloat16():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((32, 256)).astype(np.float32)
  x = rng.standard_normal(256).astype(np.float32)
  exact = _exact(w, x, MV)
  bound = 256 * 2.0**-24 * np.abs(w.astype(np.float64)) @ np.abs(x)
  on = np.asarray(jaxprec.emulated_dot_general(w, x, MV, target="tpu"))
  assert np.all(np.abs(on - exact) <= bound)
  off = np.asarray(jaxprec.emulated_dot_general(w, x, MV, target="tpu",
                                                tpu_matvec_f32=False))
  one_pass = _exact(_bf16(w), _bf16(x), MV)
  assert np.all(np.abs(off - one_pass) <= bound)
  assert np.max(np.abs(off - exact)) > 100 * np.max(np.abs(on - exact))


@pytest.mark.parametrize("precision, algorithm", [
    ("high", "bf16x3"), ("BF16_BF16_F32", "bf16x1"), ("highest", "bf16x6")])
def test_tpu_matvec_rule_is_for_default_only(precision, algorithm):
  assert numerics.tpu_matvec(precision, "tpu", (4, 64), (64,), MV) is None
  w = jnp.full((4, 64), VALUE)
  x = jnp.ones(64)
  got = jaxprec.emulated_dot_general(w, x, MV, precision, target="tpu")
  if algorithm == "bf16x1":  # the preset names bfloat16 operands
    np.testing.assert_array_equal(np.asarray(got), _exact(_bf16(w), x, MV))


def test_tpu_matrix_matrix_and_other_targets_keep_their_algorithms():
  assert numerics.tpu_matvec(None, "tpu", (4, 64), (64, 2), MM) is None
  # A free dimension of size 1 is a free dimension (not squeezed).
  assert numerics.tpu_matvec(None, "tpu", (1, 64), (64, 2), MM) is None
  assert numerics.tpu_matvec(None, "gpu", (4, 64), (64,), MV) is None
  w, x = jnp.full((4, 64), VALUE), jnp.ones((64, 2))
  got = jaxprec.emulated_dot_general(w, x, MM, target="tpu")
  np.testing.assert_array_equal(np.asarray(got), _exact(_bf16(w), x, MM))


class NnxHead(nnx.Module):
  """A matrix-matrix layer, then a matrix-vector product with a parameter."""

  def __init__(self, rngs):
    self.dense = nnx.Linear(64, 64, rngs=rngs)
    self.v = nnx.Param(jnp.full((64,), VALUE))

  def __call__(self, x):
    h = self.dense(x)
    return {"h": h, "score": h @ self.v}


class LinenHead(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64)(x)
    v = self.param("v", lambda k: jnp.full((64,), VALUE))
    return {"h": h, "score": h @ v}


def _models():
  x = jnp.full((4, 64), VALUE)
  nnx_model = NnxHead(nnx.Rngs(0))
  linen = LinenHead()
  variables = linen.init(jax.random.key(0), x)
  return {"nnx": (nnx_model, (x,)),
          "linen": (linen.apply, (variables, x))}


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_emulate_applies_the_rule_and_the_option_turns_it_off(kind):
  fn, args = _models()[kind]
  on = jaxprec.emulate(fn, target="tpu")(*args)
  off = jaxprec.emulate(fn, target="tpu", tpu_matvec_f32=False)(*args)
  np.testing.assert_array_equal(np.asarray(on["h"]), np.asarray(off["h"]))
  h = np.asarray(on["h"])
  np.testing.assert_allclose(np.asarray(on["score"]), h @ np.full(64, VALUE),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(off["score"]),
                             _bf16(h) @ _bf16(np.full(64, VALUE)), rtol=1e-6)
  assert not np.array_equal(np.asarray(on["score"]), np.asarray(off["score"]))
  with pytest.raises(TypeError, match="tpu_matvec_f32 must be True or False"):
    jaxprec.emulate(fn, target="tpu", tpu_matvec_f32="no")


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_check_keys_programs_on_the_option(kind):
  """The same function checked with the rule, without it, then with it: each
  check computes its own numbers (the option is part of the programs' key)."""
  fn, args = _models()[kind]
  kw = dict(target="tpu", mode="emulate", precisions=("bfloat16",))
  first = jaxprec.check(fn, *args, **kw)
  off = jaxprec.check(fn, *args, **kw, tpu_matvec_f32=False)
  again = jaxprec.check(fn, *args, **kw)
  score = lambda r: r.layer("score").metrics["bfloat16"].max_abs  # noqa: E731
  assert score(first) == score(again) < score(off)
  assert any("tpu_matvec_f32=False" in n for n in off.notes)


def test_audit_shows_the_tpu_rule():
  r = jaxprec.audit(lambda m, v, w: (m @ v, m @ w), jnp.ones((4, 8)),
                    jnp.ones(8), jnp.ones((8, 2)))
  mv, mm = r.rows
  assert (mv.tpu, mv.tpu_shape_rule) == ("f32", numerics.TPU_MATVEC_RULE)
  assert (mm.tpu, mm.tpu_shape_rule) == ("bf16x1", "")
  assert not mv.risky and mm.risky
  assert numerics.TPU_MATVEC_RULE in str(r)


# ---------------------------------------------------------------------------
# XLA:GPU strength reduction of small matrix-vector dots.


@pytest.mark.parametrize("lhs_shape, rhs_shape, dn, reduced", [
    ((9998, 1000), (1000,), MV, True),      # (9998 + 1) * 1000 < 1e7
    ((9999, 1000), (1000,), MV, False),     # (9999 + 1) * 1000 == 1e7
    ((10000, 1000), (1000,), MV, False),
    ((100,), (100, 99998), VM, True),       # (1 + 99998) * 100 < 1e7
    ((100,), (100, 99999), VM, False),
    ((64, 9998, 1000), (64, 1000), BMV, True),   # batch not counted
    ((64, 9999, 1000), (64, 1000), BMV, False),
    ((4, 8), (8, 4), MM, False),            # matrix . matrix: not modelled
    ((1, 8), (8, 4), MM, False),            # a free dimension of size 1
])
def test_gpu_strength_reduction_size_bound(lhs_shape, rhs_shape, dn, reduced):
  got = numerics.strength_reduced("default", "gpu", lhs_shape, rhs_shape, dn)
  assert got == (numerics.MATVEC_RULE if reduced else None)
  assert numerics.strength_reduced("TF32_TF32_F32", "gpu", lhs_shape,
                                   rhs_shape, dn) is None
  assert numerics.strength_reduced("default", "tpu", lhs_shape, rhs_shape,
                                   dn) is None


@pytest.mark.parametrize("n, reduced", [(99998, True), (99999, False)])
def test_gpu_emulation_at_the_size_bound(n, reduced):
  """x (100,) . W (100, n): exact float32 just below the bound, TF32 at it
  (VALUE rounds to 1 as TF32, ties to even). Every sum is exact."""
  x = jnp.ones(100, jnp.float32)
  w = jnp.full((100, n), VALUE, jnp.float32)
  for chip in (None, "h100"):
    if chip is not None and not reduced:
      continue  # the chip model of a 1e7-element TF32 dot is slow on CPU
    got = np.asarray(jaxprec.emulated_dot_general(x, w, VM, target="gpu",
                                                  chip=chip))
    want = 100 * VALUE if reduced else 100.0
    assert np.all(got == want), (got[:3], want)


@pytest.mark.parametrize("preset", ["TF32_TF32_F32", "BF16_BF16_F32",
                                    "TF32_TF32_F32_X3"])
def test_a_strength_reduced_preset_dot_does_not_run_on_the_chip(preset):
  # XLA:GPU rewrites a vector or small matrix-vector dot into a multiply of
  # the algorithm's rounded operands and a float32 reduce: no tensor core,
  # so with chip= the algorithm's own model, as without. A matrix product
  # keeps the chip's model (different bits: truncated group sums).
  rng = np.random.default_rng(0)
  a = rng.standard_normal((64, 512)).astype(np.float32)
  v = rng.standard_normal(512).astype(np.float32)
  for x, y, dn in ((a, v, MV), (v, v, (((0,), (0,)), ((), ()))),
                   (v, a.T, VM)):
    chip = jaxprec.emulated_dot_general(x, y, dn, preset, target="gpu",
                                        chip="h100")
    plain = jaxprec.emulated_dot_general(x, y, dn, preset, target="gpu")
    np.testing.assert_array_equal(np.asarray(chip).view(np.uint32),
                                  np.asarray(plain).view(np.uint32))
  b = rng.standard_normal((512, 64)).astype(np.float32)
  chip = jaxprec.emulated_dot_general(a, b, MM, preset, target="gpu",
                                      chip="h100")
  plain = jaxprec.emulated_dot_general(a, b, MM, preset, target="gpu")
  assert not np.array_equal(np.asarray(chip), np.asarray(plain))
  assert numerics.reduced_by_shape(a.shape, v.shape, MV) == numerics.MATVEC_RULE
  assert numerics.reduced_by_shape(a.shape, b.shape, MM) is None


def test_audit_shows_the_gpu_matvec_rule_at_the_bound():
  f = lambda x, small, big: (x @ small, x @ big)  # noqa: E731
  x = jax.ShapeDtypeStruct((100,), jnp.float32)
  r = jaxprec.audit(f, x, jax.ShapeDtypeStruct((100, 99998), jnp.float32),
                    jax.ShapeDtypeStruct((100, 99999), jnp.float32))
  small, big = r.rows
  assert (small.gpu, small.shape_rule) == ("f32", numerics.MATVEC_RULE)
  assert (big.gpu, big.shape_rule) == ("tf32", "")
  assert numerics.MATVEC_RULE in str(r)
