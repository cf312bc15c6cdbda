"""jaxprec.round_to and the XLA operand splits, bit for bit against tests/reference.py."""

import functools
import re

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxprec
from jaxprec._src.emulation import rounding

import reference as ref

FMTS = ("bfloat16", "tensorfloat32", "float16")
DETERMINISTIC = ("nearest", "nearest_away", "truncate")
N = 64  # fixed array length in property tests: one compilation per variant

# Values every rounding must get right: signed zeros, infinities, NaNs (also
# with the payload in the low bits only), extremes, subnormals, and ties.
_SPECIAL = [
    0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0,
    3.4028235e38, -3.4028235e38, 2.0**-126, 2.0**-149, -2.0**-149,
    2.0**-130 * 1.5, 2.0**-133 * 1.5, 2.0**-136 * 1.5,   # subnormal ties
    1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8),        # bfloat16 ties
    1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 3 * 2.0**-11),  # TF32/float16 ties
    1 + 2.0**-8 + 2.0**-23, 1 + 2.0**-11 - 2.0**-23,      # just off the ties
    65504.0, 65519.996, 65520.0, 65536.0, 1e6,            # float16 top
    2.0**-14, 2.0**-14 - 2.0**-26, 2.0**-24, 2.0**-25, 3 * 2.0**-25,
    2.0**-25 + 2.0**-40, 1e-8, -6e-8,                     # float16 bottom
    3.3961776e38, 3.3895314e38,  # around bfloat16's largest finite value
]
SPECIAL_BITS = np.concatenate([
    ref.bits(np.array(_SPECIAL, np.float32)),
    np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F810000], np.uint32),
])

_bit_patterns = st.one_of(
    st.integers(0, 2**32 - 1),
    st.sampled_from([int(b) for b in SPECIAL_BITS]),
    st.floats(width=32, allow_nan=False, allow_subnormal=True).map(
        lambda v: int(ref.bits(np.float32(v)))),
    # magnitudes around float16's range and bfloat16's subnormals
    st.tuples(st.floats(1, 2, width=32), st.integers(-150, 20)).map(
        lambda t: int(ref.bits(np.float32(t[0] * 2.0**t[1])))),
)
float32_arrays = hnp.arrays(np.uint32, N, elements=_bit_patterns).map(
    lambda u: u.view(np.float32))

SETTINGS = hypothesis.settings(max_examples=25, deadline=None, derandomize=True)


@functools.cache
def host_flushes_subnormals() -> bool:
  """XLA:CPU float arithmetic flushes subnormals to zero."""
  return float(jax.jit(lambda a: a * a)(np.float32(2.0**-70))) == 0.0


def assert_same(actual, expected):
  """Bit-identical, except that any NaN matches any NaN."""
  a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  assert a.shape == e.shape and a.dtype == e.dtype
  nan_a, nan_e = np.isnan(a), np.isnan(e)
  np.testing.assert_array_equal(nan_a, nan_e, err_msg="NaN positions differ")
  bad = ~nan_a & (ref.bits(a) != ref.bits(e))
  if bad.any():
    i = np.flatnonzero(bad)[:5]
    raise AssertionError(
        f"{bad.sum()} mismatches, e.g. x -> got {a.ravel()[i]!r} "
        f"({[hex(v) for v in ref.bits(a).ravel()[i]]}) expected {e.ravel()[i]!r} "
        f"({[hex(v) for v in ref.bits(e).ravel()[i]]})")


def rounder(jit: bool):
  if jit:
    return jax.jit(jaxprec.round_to, static_argnames=("fmt", "mode"))
  return jaxprec.round_to


@pytest.fixture(scope="module")
def random_bits():
  """200k uniformly random bit patterns: every class of float32, NaNs included."""
  u = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64)
  return np.concatenate([u.astype(np.uint32), SPECIAL_BITS]).view(np.float32)


# ---------------------------------------------------------------------------
# Deterministic modes.


@pytest.mark.parametrize("jit", [False, True])
def test_bfloat16_nearest_is_ml_dtypes(jit, random_bits):
  x = random_bits
  with np.errstate(invalid="ignore"):
    assert_same(rounder(jit)(x, "bfloat16"), ref.round_bf16(x))


@pytest.mark.parametrize("jit", [False, True])
def test_float16_nearest_is_numpy(jit, random_bits):
  assert_same(rounder(jit)(random_bits, "float16"), ref.round_f16(random_bits))


def test_reference_agrees_with_ml_dtypes_and_numpy(random_bits):
  # The grid reference used for the other formats and modes is itself right.
  with np.errstate(invalid="ignore"):
    assert_same(ref.round_ref(random_bits, "bfloat16"), ref.round_bf16(random_bits))
  assert_same(ref.round_ref(random_bits, "float16"), ref.round_f16(random_bits))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_all_formats_and_modes_on_random_bits(fmt, mode, random_bits):
  assert_same(jaxprec.round_to(random_bits, fmt, mode),
              ref.round_ref(random_bits, fmt, mode))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", DETERMINISTIC)
@SETTINGS
@hypothesis.given(x=float32_arrays)
def test_property_matches_reference(jit, fmt, mode, x):
  assert_same(rounder(jit)(x, fmt, mode), ref.round_ref(x, fmt, mode))


@pytest.mark.parametrize("fmt,mask", [("bfloat16", 0xFFFF0000),
                                      ("tensorfloat32", 0xFFFFE000)])
@SETTINGS
@hypothesis.given(x=float32_arrays)
def test_truncate_is_a_bit_mask_and_keeps_nan(fmt, mask, x):
  r = np.asarray(jaxprec.round_to(x, fmt, "truncate"))
  nan = np.isnan(x)
  assert np.isnan(r[nan]).all()  # 0x7F800001 & mask would be inf
  np.testing.assert_array_equal(ref.bits(r)[~nan], ref.bits(x)[~nan] & np.uint32(mask))


def test_known_values():
  x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 65520, 2.0**-25, 3 * 2.0**-25,
                -(1 + 2.0**-11)], np.float32)
  np.testing.assert_array_equal(jaxprec.round_to(x, "bf16"),
                                [1, 1 + 2.0**-6, 65536, 2.0**-25, 3 * 2.0**-25,
                                 -1])
  np.testing.assert_array_equal(jaxprec.round_to(x, "f16"),
                                [1 + 2.0**-8, 1 + 3 * 2.0**-8, np.inf, 0,
                                 2.0**-23, -1])
  np.testing.assert_array_equal(jaxprec.round_to(x, "tf32", "nearest_away"),
                                [1 + 2.0**-8, 1 + 3 * 2.0**-8, 65536, 2.0**-25,
                                 3 * 2.0**-25, -(1 + 2.0**-10)])
  np.testing.assert_array_equal(jaxprec.round_to(x, "f16", "truncate")[2], 65504)


def test_result_dtype_and_passthrough():
  x = jnp.ones((2, 3), jnp.float32)
  assert jaxprec.round_to(x, "bf16").dtype == jnp.float32
  b = jnp.ones(3, jnp.bfloat16)
  assert jaxprec.round_to(b, "bf16") is b
  assert jaxprec.round_to(b, "tf32") is b
  h = jnp.ones(3, jnp.float16)
  assert jaxprec.round_to(h, "f16", "truncate") is h


def test_flush_to_zero_does_not_touch_rounding():
  # The host flushes subnormal arithmetic, but rounding is integer work.
  x = np.array([2.0**-130 * 1.3, -2.0**-131 * 1.7, 2.0**-149], np.float32)
  assert_same(jaxprec.round_to(x, "bf16"), ref.round_bf16(x))
  assert (np.asarray(jaxprec.round_to(x, "bf16"))[:2] != 0).all()


# ---------------------------------------------------------------------------
# Stochastic rounding.


@pytest.mark.parametrize("fmt", FMTS)
@SETTINGS
@hypothesis.given(x=float32_arrays, seed=st.integers(0, 2**31 - 1))
def test_stochastic_gives_a_neighbour(fmt, x, seed):
  r = np.asarray(jaxprec.round_to(x, fmt, "stochastic", key=jax.random.key(seed)))
  lo, hi = ref.neighbours(x, fmt)
  nan = np.isnan(x)
  assert np.isnan(r[nan]).all()
  ok = (ref.bits(r) == ref.bits(lo)) | (ref.bits(r) == ref.bits(hi))
  assert ok[~nan].all(), (x[~nan & ~ok], r[~nan & ~ok], lo[~nan & ~ok], hi[~nan & ~ok])


def test_stochastic_is_deterministic_for_a_key():
  x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
  a = jaxprec.round_to(x, "bf16", "stochastic", key=jax.random.key(7))
  b = jax.jit(lambda v: jaxprec.round_to(v, "bf16", "stochastic",
                                         key=jax.random.key(7)))(x)
  c = jaxprec.round_to(x, "bf16", "stochastic", key=jax.random.key(8))
  np.testing.assert_array_equal(a, b)
  assert (np.asarray(a) != np.asarray(c)).any()
  legacy = jaxprec.round_to(x, "bf16", "stochastic", key=jax.random.PRNGKey(7))
  assert legacy.shape == x.shape


@pytest.mark.parametrize("fmt,values", [
    ("bfloat16", [1 + 2.0**-10, 1 + 0.3 * 2.0**-7, -(3 + 0.9 * 2.0**-6), 1e-20]),
    ("tensorfloat32", [1 + 0.1 * 2.0**-10, -(1 + 0.5 * 2.0**-10), 7e-30]),
    ("float16", [1 + 0.3 * 2.0**-10, 0.7 * 2.0**-24, 2.0**-14 + 0.2 * 2.0**-24,
                 0.3 * 2.0**-33]),
])
def test_stochastic_is_unbiased(fmt, values):
  # Each sample rounds up with probability p = (|x| - |lo|) / (|hi| - |lo|);
  # the discarded bits are at most 13-16 (or, for float16 subnormals, s <= 31)
  # and the random bits as many, so p is exact. The mean of n Bernoulli(p)
  # draws has standard deviation sqrt(p (1 - p) / n) <= 0.5 / sqrt(n); five
  # of those (false alarm < 1e-6, and the key is fixed, so the test is
  # deterministic) is 0.0079 at n = 10**5.
  n = 100_000
  x = np.array(values, np.float32)
  lo, hi = ref.neighbours(x, fmt)
  p = (np.abs(x.astype(np.float64)) - np.abs(lo.astype(np.float64))) / (
      np.abs(hi.astype(np.float64)) - np.abs(lo.astype(np.float64)))
  xs = np.broadcast_to(x, (n, x.size))
  r = np.asarray(jaxprec.round_to(xs, fmt, "stochastic", key=jax.random.key(0)))
  up = (r == hi).mean(axis=0)
  assert ((r == lo) | (r == hi)).all()
  tol = 5 * np.sqrt(p * (1 - p) / n) + 1e-12
  assert (np.abs(up - p) <= tol).all(), (up, p, tol)
  # and so the mean of the rounded values is x
  assert (np.abs(r.astype(np.float64).mean(axis=0) - x) <=
          tol * np.abs(hi.astype(np.float64) - lo)).all()


def test_stochastic_past_the_largest_value_can_overflow():
  # 65512 lies a quarter of the way from float16's 65504 to the next grid
  # point, 65536, which is out of range: it becomes inf a quarter of the time.
  r = np.asarray(jaxprec.round_to(np.full(4000, 65512, np.float32), "f16",
                                  "stochastic", key=jax.random.key(1)))
  assert set(np.unique(r)) == {65504, np.inf}
  assert abs(np.isinf(r).mean() - 0.25) < 5 * np.sqrt(0.25 * 0.75 / r.size)


# ---------------------------------------------------------------------------
# What XLA sees.


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", rounding.MODES)
def test_lowering_is_reduce_precision_or_bit_ops_never_a_convert_pair(fmt, mode):
  key = jax.random.key(0) if mode == "stochastic" else None
  x = np.ones(8, np.float32)
  txt = jax.jit(lambda v: jaxprec.round_to(v, fmt, mode, key=key)).lower(x).as_text()
  assert "reduce_precision" in txt or "bitcast_convert" in txt
  # No narrow float type anywhere, so no float32 -> narrow -> float32 pair
  # that XLA's simplifier could remove.
  assert not re.search(r"[<x]b?f16>", txt), txt


def _compiled_ops(fn, x) -> tuple[int, str]:
  """(instructions in XLA's optimized HLO, its text)."""
  txt = jax.jit(fn).lower(x).compile().as_text()
  return len(re.findall(r"^\s+\S+ = ", txt, re.MULTILINE)), txt


@pytest.mark.parametrize("what,limit", [
    ("split1_bf16", 4), ("split1_f32", 3), ("split2_bf16", 20),
    ("split3_bf16", 36), ("round_bf16", 14), ("round_tf32", 14)])
def test_compiled_rounding_is_small_and_keeps_reduce_precision(what, limit):
  # Before the rounding was rewritten these compiled to 31, 23, 56, 84, 23 and 23 instructions.
  x = np.ones(64, np.float32)
  fns = {
      "split1_bf16": lambda v: rounding.split_bf16(v, 1),
      "split1_f32": lambda v: rounding.split_bf16(v, 1, dtype=jnp.float32),
      "split2_bf16": lambda v: rounding.split_bf16(v, 2),
      "split3_bf16": lambda v: rounding.split_bf16(v, 3),
      "round_bf16": lambda v: jaxprec.round_to(v, "bf16"),
      "round_tf32": lambda v: jaxprec.round_to(v, "tf32"),
  }
  n, txt = _compiled_ops(fns[what], x)
  assert n <= limit, txt
  # The rounding survives XLA's optimizations as a reduce-precision.
  assert "reduce-precision(" in txt, txt


def test_bf16_operand_is_ml_dtypes_on_a_million_random_bit_patterns():
  u = np.random.default_rng(11).integers(0, 2**32, 1_000_000, dtype=np.uint64)
  x = np.concatenate([u.astype(np.uint32), SPECIAL_BITS]).view(np.float32)
  (got,) = jax.jit(rounding.split_bf16, static_argnums=1)(x, 1)
  with np.errstate(invalid="ignore"):
    want = x.astype(ml_dtypes.bfloat16)
  got, want = np.asarray(got), np.asarray(want)
  nan = np.isnan(want.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
  np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
  with np.errstate(invalid="ignore"):
    assert_same(jax.jit(lambda v: jaxprec.round_to(v, "bf16"))(x),
                want.astype(np.float32))
    assert_same(jax.jit(lambda v: jaxprec.round_to(v, "tf32"))(x),
                ref.round_ref(x, "tensorfloat32"))


# ---------------------------------------------------------------------------
# The splits used by the multi-pass matmuls.


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("jit", [False, True])
@SETTINGS
@hypothesis.given(x=float32_arrays)
def test_split_bf16_matches_xla_algorithm(n, jit, x):
  fn = jax.jit(rounding.split_bf16, static_argnums=1) if jit else rounding.split_bf16
  parts = fn(x, n)
  assert len(parts) == n and all(p.dtype == jnp.bfloat16 for p in parts)
  with np.errstate(invalid="ignore"):
    expected = ref.split_bf16(x, n, ftz=host_flushes_subnormals())
  for got, want in zip(parts, expected):
    assert_same(np.asarray(got).astype(np.float32), want)


def test_split_bf16_parts_add_up():
  x = np.random.default_rng(2).standard_normal(10_000).astype(np.float32)
  hi, mid, lo = (np.asarray(p).astype(np.float64) for p in rounding.split_bf16(x, 3))
  np.testing.assert_array_equal(hi + mid + lo, x)  # exact for normal x
  hi, lo = (np.asarray(p).astype(np.float64) for p in rounding.split_bf16(x, 2))
  assert (np.abs(hi + lo - x) <= 2.0**-16 * np.abs(x)).all()
  assert (np.abs(hi + lo - x) > 0).any()  # ... but not exact: 16 bits, not 24


def test_split_bf16_of_inf_and_nan_is_xlas():
  x = np.array([np.inf, -np.inf, np.nan], np.float32)
  hi, lo = (np.asarray(p).astype(np.float32) for p in rounding.split_bf16(x, 2))
  np.testing.assert_array_equal(hi[:2], [np.inf, -np.inf])
  assert np.isnan(lo).all() and np.isnan(hi[2])  # inf - inf


@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_split_tf32(mode):
  x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
  big, small = rounding.split_tf32(x, mode)
  want_big, want_small = ref.split_tf32(x, mode, ftz=host_flushes_subnormals())
  assert_same(big, want_big)
  assert_same(small, want_small)


# ---------------------------------------------------------------------------
# Bad input.


def test_unknown_format():
  with pytest.raises(ValueError, match=r"Unknown format 'bfloat61'.*'bfloat16', "
                     r"'tensorfloat32', 'float16'.*Did you mean 'bfloat16'"):
    jaxprec.round_to(np.ones(2, np.float32), "bfloat61")
  with pytest.raises(ValueError, match=r"Unknown format 3"):
    jaxprec.round_to(np.ones(2, np.float32), 3)


def test_unknown_mode():
  with pytest.raises(ValueError, match=r"Unknown rounding mode 'nearst'; valid "
                     r"choices: 'nearest', 'nearest_away', 'truncate', "
                     r"'stochastic'\. Did you mean 'nearest'"):
    jaxprec.round_to(np.ones(2, np.float32), "bf16", "nearst")


def test_key_rules():
  x = np.ones(2, np.float32)
  with pytest.raises(ValueError, match=r"stochastic.*needs key="):
    jaxprec.round_to(x, "bf16", "stochastic")
  with pytest.raises(ValueError, match=r"mode='nearest'.*takes no key"):
    jaxprec.round_to(x, "bf16", key=jax.random.key(0))


def test_wrong_dtypes():
  with pytest.raises(ValueError, match=r"expects a float32 array, got int32"):
    jaxprec.round_to(jnp.ones(2, jnp.int32), "bf16")
  with pytest.raises(ValueError, match=r"expects a float32 array, got float16"):
    jaxprec.round_to(jnp.ones(2, jnp.float16), "bf16")
  with pytest.raises(ValueError, match=r"expects a float32 array, got float64"):
    jaxprec.round_to(np.ones(2, np.float64), "bf16")  # no silent double rounding
  with pytest.raises(ValueError, match=r"n must be 1, 2 or 3"):
    rounding.split_bf16(jnp.ones(2), 4)


@pytest.mark.parametrize("fmt,bits", [("bfloat16", (8, 7)),
                                      ("tensorfloat32", (8, 10)),
                                      ("float16", (5, 10))])
@pytest.mark.parametrize("mode", ["nearest", "truncate"])
def test_round_to_has_a_converts_derivative(fmt, bits, mode):
  # Not the zero derivative of its bit arithmetic: the tangent (and the
  # cotangent) rounded to the format, as a convert's derivative is.
  x = jnp.asarray([0.1, -3.0, 1 + 2.0**-12, 7e3], jnp.float32)
  t = jnp.asarray([1 + 2.0**-12, 0.3, -2.0, 1e-3], jnp.float32)
  want = jax.lax.reduce_precision(t, exponent_bits=bits[0],
                                  mantissa_bits=bits[1])
  f = lambda v: jaxprec.round_to(v, fmt, mode)  # noqa: E731
  np.testing.assert_array_equal(jax.jvp(f, (x,), (t,))[1], want)
  np.testing.assert_array_equal(jax.vjp(f, x)[1](t)[0], want)
  np.testing.assert_array_equal(jax.jit(jax.grad(lambda v: f(v).sum()))(x),
                                np.ones(4, np.float32))
