"""Divergence metrics (jaxprec._src.checker.metrics) against NumPy float64 computations."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprec._src.checker import metrics as S
from jaxprec._src.checker import metrics as M

RNG = np.random.default_rng(0)


def ordered(x):
  """float32 -> int64 ordered like the floats, +0 == -0 (NumPy reference)."""
  i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
  return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def ulp_np(a, b):
  return np.abs(ordered(a) - ordered(b))


def reference_metrics(c, r, atol, rtol):
  """The module docstring's definitions, in float64, all elements finite."""
  c64, r64 = np.ravel(c).astype(np.float64), np.ravel(r).astype(np.float64)
  e = c64 - r64
  rms = np.sqrt(np.mean(r64 ** 2))
  floor = max(S.REL_FLOOR * rms, np.finfo(np.float32).tiny)
  u = ulp_np(np.ravel(c), np.ravel(r).astype(np.float32))
  return {
      "max_abs": np.abs(e).max(),
      "max_rel": (np.abs(e) / np.maximum(np.abs(r64), floor)).max(),
      "rel_rms": np.sqrt((e ** 2).sum() / (r64 ** 2).sum()),
      "cosine": (c64 @ r64) / np.sqrt((c64 @ c64) * (r64 @ r64)),
      "sqnr_db": 10 * np.log10((r64 ** 2).sum() / (e ** 2).sum()),
      "ulp_median": float(np.median(u)),
      "ulp_max": float(u.max()),
      "frac_outside": float(np.mean(np.abs(e) > atol + rtol * np.abs(r64))),
      "required_atol": max(0.0, (np.abs(e) - rtol * np.abs(r64)).max()),
  }


def compare_as_float64(c, r, atol, rtol):
  """``(M.compare(c, r), reference_metrics(c, r))``, checked to agree: each
  metric to 1e-5, 1 - cosine to 1e-3, the counts and ulp_max exactly."""
  got = M.compare(c, r, atol=atol, rtol=rtol)
  want = reference_metrics(c, r, atol, rtol)
  for k in ("max_abs", "max_rel", "required_atol", "rel_rms", "sqnr_db"):
    assert getattr(got, k) == pytest.approx(want[k], rel=1e-5), k
  assert 1 - got.cosine == pytest.approx(1 - want["cosine"], rel=1e-3)
  assert got.frac_outside == want["frac_outside"]
  assert got.ulp_max == want["ulp_max"]
  return got, want


@pytest.mark.parametrize("shape", [(7,), (3, 40, 10), (1200,)])
@pytest.mark.parametrize("scale", [1e-3, 1.0])
def test_metrics_match_numpy_float64(shape, scale):
  r = RNG.standard_normal(shape).astype(np.float32)
  c = (r + scale * 1e-2 * RNG.standard_normal(shape)).astype(np.float32)
  got = M.compare(c, r, atol=1e-3 * scale, rtol=1e-3)
  want = reference_metrics(c, r, 1e-3 * scale, 1e-3)
  for k in ("max_abs", "max_rel", "required_atol"):
    assert getattr(got, k) == pytest.approx(want[k], rel=1e-6), k
  for k in ("rel_rms", "sqnr_db"):
    assert getattr(got, k) == pytest.approx(want[k], rel=1e-5), k
  assert got.cosine == pytest.approx(want["cosine"], abs=1e-9)
  assert 1 - got.cosine == pytest.approx(1 - want["cosine"], rel=1e-3)
  assert got.frac_outside == want["frac_outside"]
  assert got.ulp_max == want["ulp_max"]
  # The median comes from a 64-bucket-per-octave histogram: within 1.6%.
  assert got.ulp_median == pytest.approx(want["ulp_median"], rel=0.016)
  assert got.nan == got.inf == 0
  assert got.size == int(np.prod(shape))
  assert got.ref_rms == pytest.approx(np.sqrt(np.mean(r.astype(np.float64) ** 2)),
                                      rel=1e-6)


def test_ulp_median_is_exact_for_small_distances():
  r = RNG.standard_normal(1199).astype(np.float32)
  steps = RNG.integers(-40, 41, size=1199)
  c = r.copy()
  for i, s in enumerate(steps):  # move each element by s float32 steps
    for _ in range(abs(int(s))):
      c[i] = np.nextafter(c[i], np.float32(np.inf if s > 0 else -np.inf))
  got = M.compare(c, r)
  assert got.ulp_median == np.median(np.abs(steps))
  assert got.ulp_max == np.abs(steps).max()


def test_ulp_distance_bits():
  a = np.float32([0.0, -0.0, 1.0, 1.0, -1e-45, 1e-45, 1.0, np.float32(3.0)])
  b = np.float32([-0.0, 0.0, np.nextafter(np.float32(1), np.float32(2)),
                  1.0, 1e-45, -1e-45, -1.0, 3.0])
  got = np.asarray(S._ulp_distance(jnp.asarray(a), jnp.asarray(b)))
  np.testing.assert_array_equal(got, ulp_np(a, b))
  assert got[:4].tolist() == [0, 0, 1, 0]
  assert got[4] == 2  # across zero: -1e-45 -> 0 -> 1e-45


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                min_size=2, max_size=2))
def test_ulp_distance_matches_numpy(pair):
  a, b = np.float32(pair[0]), np.float32(pair[1])
  got = int(S._ulp_distance(jnp.float32(a), jnp.float32(b)))
  assert got == int(ulp_np(a, b))


def test_bucket_values_exact_below_64_then_within_bucket():
  d = np.array([0, 1, 2, 5, 63, 64, 1000, 2**20 + 12345, 2**31 + 5], np.uint64)
  b = np.asarray(S._ulp_bucket(jnp.asarray(d.astype(np.uint32))))
  v = S.bucket_value(b)
  np.testing.assert_array_equal(v[:5], d[:5])
  np.testing.assert_allclose(v, d.astype(np.float64), rtol=0.016)


def test_nan_and_inf_are_counted_not_crashed_on():
  r = np.float32([1, 2, np.inf, np.nan, 5, -np.inf, 7])
  c = np.float32([1, np.nan, np.inf, np.nan, np.inf, np.inf, 7.5])
  m = M.compare(c, r, atol=0.1)
  assert (m.nan, m.inf) == (2, 3)
  assert (m.ref_nan, m.ref_inf) == (1, 2)
  # Valid: elements 0 and 6 only. Same non-finite (inf/inf, nan/nan) passes;
  # nan where 2, inf where 5, inf where -inf are outside; 7.5 vs 7 too.
  assert m.max_abs == 0.5
  assert m.frac_outside == pytest.approx(4 / 7)
  assert math.isinf(m.required_atol)
  assert m.ulp_max == ulp_np(np.float32(7.5), np.float32(7))


def test_same_nonfinite_values_pass():
  r = np.float32([1, np.nan, np.inf, -np.inf, 0, 2, 3])
  m = M.compare(r.copy(), r, atol=0)
  assert m.frac_outside == 0 and m.required_atol == 0 and m.max_abs == 0


def test_all_invalid_layer_gives_nan_metrics():
  m = M.compare(np.full(7, np.nan, np.float32), np.arange(7, dtype=np.float32))
  assert math.isnan(m.max_abs) and math.isnan(m.rel_rms)
  assert m.nan == 7 and m.frac_outside == 1.0


def test_float64_reference_is_kept_beyond_float32():
  r = RNG.standard_normal(1200) * (1 + 1e-9)  # float64 values between floats
  c = r.astype(np.float32)
  m = M.compare(c, r)
  e = np.abs(c.astype(np.float64) - r)
  assert m.max_abs == pytest.approx(e.max(), rel=1e-6)
  assert m.max_abs > 0  # a float32 reference would see no error at all
  assert M.compare(c, r.astype(np.float32)).max_abs == 0


def test_zero_reference_and_exact_match():
  m = M.compare(np.zeros(7, np.float32), np.zeros(7, np.float32))
  assert (m.rel_rms, m.cosine, m.sqnr_db, m.max_rel) == (0.0, 1.0, math.inf, 0.0)
  m = M.compare(np.ones(7, np.float32), np.zeros(7, np.float32))
  assert m.rel_rms == math.inf and m.cosine == 0.0


def test_relative_floor_is_documented_fraction_of_rms():
  r = np.float32([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1e-9])
  c = r + np.float32([0, 0, 0, 0, 0, 0, 1e-4])
  m = M.compare(c, r)
  floor = S.REL_FLOOR * np.sqrt(np.mean(r.astype(np.float64) ** 2))
  assert m.max_rel == pytest.approx(1e-4 / floor, rel=1e-4)


def test_many_layers_packed_together_match_one_by_one():
  sizes = [0, 7, 513, 1200, 1]
  cands = [RNG.standard_normal(s).astype(np.float32) for s in sizes]
  refs = [(x + 0.01 * RNG.standard_normal(x.shape)).astype(np.float32)
          for x in cands]
  cands[2][7] = np.nan
  layout = M.Layout(tuple(sizes))
  hi = M.pack_numpy(refs, layout)

  @jax.jit
  def run(cs, hi):
    ref = M.reference_stats(hi, None, layout)
    return M.layer_stats(cs, hi, None, ref, layout, atol=1e-3, rtol=1e-3)
  together = M.finish(jax.device_get(run(cands, hi)), layout)
  # an empty layer compares nothing: no error (not NaN), as compare() says
  empty = together[0]
  assert empty.size == 0 and (empty.max_abs, empty.rel_rms, empty.cosine) == (
      0.0, 0.0, 1.0)
  assert vars(empty) == vars(M.compare(cands[0], refs[0], atol=1e-3,
                                       rtol=1e-3))
  for s, c, r, m in zip(sizes[1:], cands[1:], refs[1:], together[1:]):
    one = M.compare(c, r, atol=1e-3, rtol=1e-3)
    for k, v in vars(one).items():  # sums may round differently: 1e-6
      assert getattr(m, k) == pytest.approx(v, rel=1e-6, nan_ok=True), (s, k)


def test_pack_pads_with_zeros_in_chunks():
  layout = M.Layout((3, S.CHUNK + 1))
  assert layout.n_chunks == 3
  assert layout.chunk_layer.tolist() == [0, 1, 1]
  assert layout.chunk_count.tolist() == [3, S.CHUNK, 1]
  p = np.asarray(S.pack([jnp.ones(3), jnp.full((S.CHUNK + 1,), 2.0)], layout))
  assert p.shape == (3, S.CHUNK)
  assert p[0, :3].tolist() == [1, 1, 1] and not p[0, 3:].any()
  np.testing.assert_array_equal(p, M.pack_numpy([np.ones(3), np.full(S.CHUNK + 1, 2.0)],
                                                layout))


def test_a_grouped_layout_stacks_each_devices_share_and_measures_the_same():
  """Layout(groups=G): group k of every layer, then group k + 1. The rows of
  group k are element block k of each layer (a batch shard on device k);
  the metrics are those of one group (sums in another order: 1e-6)."""
  sizes = (0, 7, 3 * 2 * S.CHUNK, 1200, 1)
  one, grouped = M.Layout(sizes), M.Layout(sizes, groups=3)
  assert grouped.chunks.tolist() == [0, 3, 6, 3, 3]
  assert grouped.chunk_layer.tolist() == [1, 2, 2, 3, 4] * 3
  for lay in (one, grouped):
    counts = np.bincount(lay.chunk_layer, lay.chunk_count, len(sizes))
    assert counts.tolist() == list(sizes)
  cands = [RNG.standard_normal(s).astype(np.float32) for s in sizes]
  refs = [(x + 0.01 * RNG.standard_normal(x.shape)).astype(np.float32)
          for x in cands]
  cands[3][1100] = np.nan  # the masked path too
  packed = np.asarray(S.pack(cands, grouped))
  np.testing.assert_array_equal(packed, M.pack_numpy(cands, grouped))
  for k in range(3):  # group k's rows of the aligned layer: its block k
    rows = packed[k * 5 + 1:k * 5 + 3].ravel()
    np.testing.assert_array_equal(rows, cands[2].reshape(3, -1)[k])

  def run(layout):
    hi = M.pack_numpy(refs, layout)
    ref = M.reference_stats(hi, None, layout)
    out = M.layer_stats(cands, hi, None, ref, layout, atol=1e-3, rtol=1e-3)
    return M.finish(jax.device_get(out), layout)
  for a, b in zip(run(one), run(grouped), strict=True):
    for k, v in vars(a).items():
      assert getattr(b, k) == pytest.approx(v, rel=1e-6, nan_ok=True), k
  with pytest.raises(ValueError, match="groups must be an integer >= 1; got 0"):
    M.Layout(sizes, groups=0)


def test_growth_per_layer():
  assert M.growth_per_layer([1e-4, 2e-4, 4e-4]) == pytest.approx(2.0)
  assert M.growth_per_layer([1e-3, 0.0, 1e-3 * 9]) == pytest.approx(3.0)
  assert math.isnan(M.growth_per_layer([1e-3]))


def test_shape_mismatch_raises():
  with pytest.raises(ValueError, match=r"\(3,\).*\(4,\)"):
    M.compare(np.zeros(3), np.zeros(4))


# -- Scale: squares must neither overflow nor underflow float32 ---------------

F32_MAX = float(np.finfo(np.float32).max)
SCALES = [1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e18, 1e30, F32_MAX / 5]


def bf16_round(x):
  import ml_dtypes
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def scaled_pair(scale, n=3000, seed=1):
  """A float32 reference of magnitude ``scale`` and its bfloat16 rounding."""
  rng = np.random.default_rng(seed)
  r = np.clip(rng.standard_normal(n), -4.5, 4.5) * scale
  r = r.astype(np.float32)
  assert np.isfinite(r).all() and np.abs(r).max() > 0
  return bf16_round(r), r


@pytest.mark.parametrize("scale", SCALES)
def test_every_metric_matches_float64_at_any_magnitude(scale):
  c, r = scaled_pair(scale)
  assert np.isfinite(c).all()
  atol, rtol = 1e-3 * scale, 1e-3
  got, want = compare_as_float64(c, r, atol, rtol)
  assert got.ulp_median == pytest.approx(want["ulp_median"], rel=0.016)
  r64 = r.astype(np.float64)
  assert got.ref_rms == pytest.approx(np.sqrt(np.mean(r64 ** 2)), rel=1e-5)
  assert got.ref_max_abs == np.abs(r64).max()
  assert (got.nan, got.inf) == (0, 0)
  assert 1e-3 < got.rel_rms < 1e-2  # bfloat16 rounding: about 2**-9


@pytest.mark.parametrize("scale", SCALES)
def test_nan_and_inf_are_counted_not_propagated_at_any_magnitude(scale):
  c, r = scaled_pair(scale)
  c[[3, 10]] = np.nan
  c[20] = np.inf
  c[30] = -np.inf
  got = M.compare(c, r)
  keep = np.isfinite(c)
  want = reference_metrics(c[keep], r[keep], 0.0, 0.0)
  assert (got.nan, got.inf) == (2, 2)
  for k in ("max_abs", "max_rel", "rel_rms", "sqnr_db"):
    assert getattr(got, k) == pytest.approx(want[k], rel=1e-5), k
  assert math.isfinite(got.cosine) and 1 - got.cosine == pytest.approx(
      1 - want["cosine"], rel=1e-3)
  assert math.isinf(got.required_atol)


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**-33, 2.0**33, 2.0**120])
def test_metrics_are_exactly_scale_invariant_under_powers_of_two(scale):
  c, r = scaled_pair(1.0)
  one = M.compare(c, r)
  m = M.compare(c * np.float32(scale), r * np.float32(scale))
  assert (m.rel_rms, m.cosine, m.sqnr_db, m.max_rel) == (
      one.rel_rms, one.cosine, one.sqnr_db, one.max_rel)
  assert m.max_abs == one.max_abs * scale
  assert m.ulp_max == one.ulp_max


def test_rel_rms_of_bfloat16_is_the_same_at_1e10_as_at_1():
  _, r = scaled_pair(1.0, n=20000)
  at1 = M.compare(bf16_round(r), r).rel_rms
  r10 = (r.astype(np.float64) * 1e10).astype(np.float32)
  at10 = M.compare(bf16_round(r10), r10).rel_rms
  assert at10 == pytest.approx(at1, rel=0.05)
  assert 1e-3 < at1 < 3e-3


def test_large_error_relative_to_reference_is_rescaled():
  # The error is 2**60 times the reference: its squares overflow float32
  # unless it is scaled by its own magnitude.
  r = RNG.standard_normal(1000).astype(np.float32)
  c = (r + 2.0**60 * RNG.standard_normal(1000)).astype(np.float32)
  got = M.compare(c, r)
  want = reference_metrics(c, r, 0.0, 0.0)
  for k in ("max_abs", "rel_rms", "sqnr_db", "max_rel"):
    assert getattr(got, k) == pytest.approx(want[k], rel=1e-5), k
  assert got.cosine == pytest.approx(want["cosine"], abs=1e-6)


def test_tiny_error_relative_to_reference_is_rescaled():
  r = np.ones(1000, np.float32) * np.float32(2.0**60)
  c = r.copy()
  r64 = r.astype(np.float64) + RNG.standard_normal(1000) * 2.0**5  # 2**-55 rel
  got = M.compare(c, r64)
  want = np.sqrt(((c - r64) ** 2).sum() / (r64 ** 2).sum())
  assert got.rel_rms == pytest.approx(want, rel=1e-5)


def test_error_beyond_float32_max_is_reported_from_halves():
  r = np.float32([3e38, -1.0, 2.0])
  c = np.float32([-3e38, -1.0, 2.0])
  got = M.compare(c, r)
  assert got.max_abs == pytest.approx(6e38, rel=1e-6)
  assert got.rel_rms == pytest.approx(2.0, rel=1e-6)
  assert got.cosine == pytest.approx(-1.0, abs=1e-6)
  assert (got.nan, got.inf) == (0, 0)


@pytest.mark.parametrize("sa,sb", [(1e-20, 1.0), (1e10, 1e10)])
def test_check_end_to_end_is_right_at_any_magnitude(sa, sb):
  # Outputs of magnitude 1e-20 and 1e20: squares underflow and overflow
  # float32 without scaling.
  import jaxprec
  a = jax.random.normal(jax.random.key(0), (32, 32), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (32, 32), jnp.float32)
  scale = sa * sb
  base = jaxprec.check(lambda a, b: a @ b, a, b, precisions="bfloat16",
                       mode="emulate").layers[0].metrics["bfloat16"]
  rep = jaxprec.check(lambda a, b: a @ b, a * sa, b * sb,
                      precisions="bfloat16", mode="emulate",
                      atol=1e-3 * scale, rtol=0)
  m = rep.layers[0].metrics["bfloat16"]
  assert 1e-3 < m.rel_rms < 1e-2
  assert m.rel_rms == pytest.approx(base.rel_rms, rel=0.1)
  assert 1 - m.cosine == pytest.approx(1 - base.cosine, rel=0.2)
  assert m.sqnr_db == pytest.approx(base.sqnr_db, abs=1.0)
  assert not rep.passes()
  # The same numbers from NumPy on the arrays the check compared.
  c = np.asarray(jaxprec.emulate(lambda a, b: a @ b, "bfloat16")(a * sa, b * sb))
  r = np.asarray((a * sa) @ (b * sb))
  want = reference_metrics(c, r, 1e-3 * scale, 0.0)
  for k in ("max_abs", "max_rel", "rel_rms", "sqnr_db", "required_atol"):
    assert getattr(m, k) == pytest.approx(want[k], rel=1e-5), k
  assert 1 - m.cosine == pytest.approx(1 - want["cosine"], rel=1e-3)


def test_check_of_the_issue_reproducer_at_1e10():
  # Before the fix: rel_rms=0.0, cosine=0.0, sqnr_db=inf before the fix.
  import jaxprec
  a = jax.random.normal(jax.random.key(0), (32, 32), jnp.float32)
  at1 = jaxprec.check(lambda a: a @ a, a, precisions="bfloat16",
                      mode="emulate").layers[0].metrics["bfloat16"]
  m = jaxprec.check(lambda a: a @ a, a * 1e10, precisions="bfloat16",
                    mode="emulate").layers[0].metrics["bfloat16"]
  assert m.rel_rms == pytest.approx(at1.rel_rms, rel=0.15)
  assert m.cosine == pytest.approx(at1.cosine, abs=1e-5)
  assert m.sqnr_db == pytest.approx(at1.sqnr_db, abs=1.5)
  assert m.ref_rms == pytest.approx(at1.ref_rms * 1e20, rel=1e-5)


def normal_pair(scale, n=3000, seed=1):
  """Like :func:`scaled_pair`, every element a normal float32 (>= 0.1 scale)."""
  rng = np.random.default_rng(seed)
  z = rng.standard_normal(n)
  r = (np.sign(z) * np.clip(np.abs(z), 0.1, 4.5) * scale).astype(np.float32)
  assert np.abs(r).min() >= 2.0**-126
  return bf16_round(r), r


@pytest.mark.parametrize("scale", [2.0**-110, 2.0**-118, 1e-36])
def test_subnormal_errors_are_not_flushed_to_zero(scale):
  # The reference is normal but its bfloat16 error is below float32's
  # smallest normal (2**-126): CPUs flush such differences to zero, which
  # reported an exact match (rel_rms 0, sqnr inf). Scaled before subtracting.
  c, r = normal_pair(scale)
  atol, rtol = 0.0, 1e-3
  got, _ = compare_as_float64(c, r, atol, rtol)
  assert 1e-3 < got.rel_rms < 1e-2


def test_tiny_reference_with_a_huge_candidate_stays_finite():
  # Scaling a tiny reference up must not overflow a large candidate.
  c, r = normal_pair(1e-36, n=500)
  c = r.copy()
  c[7] = np.float32(1e3)
  got = M.compare(c, r)
  want = reference_metrics(c, r, 0.0, 0.0)
  assert got.max_rel == np.inf  # 1.7e39: beyond float32, where it is kept
  for k in ("max_abs", "required_atol", "rel_rms", "sqnr_db"):
    assert getattr(got, k) == pytest.approx(want[k], rel=1e-5), k
  assert (got.nan, got.inf) == (0, 0)


def test_check_end_to_end_at_1e_minus_36():
  import jaxprec
  rng = np.random.default_rng(3)
  z = rng.standard_normal((16, 16))
  x = (np.sign(z) * np.clip(np.abs(z), 0.5, 4) * 1e-36).astype(np.float32)
  m = jaxprec.check(lambda p: (p @ jnp.eye(16)) * 0.5, x,
                    precisions="bfloat16").layers[0].metrics["bfloat16"]
  want = reference_metrics(bf16_round(x) * np.float32(0.5),
                           x * np.float32(0.5), 0.0, 0.0)
  assert m.rel_rms == pytest.approx(want["rel_rms"], rel=1e-5)
  assert m.max_abs == pytest.approx(want["max_abs"], rel=1e-5)


def _bits(tree):
  return {k: np.asarray(v).view(np.uint8) for k, v in tree.items()}


@functools.cache
def _layer_stats_jit(finite_only):
  return jax.jit(
      lambda c, hi, lo, ref, layout, atol, rtol: M.layer_stats(
          c, hi, lo, ref, layout, atol=atol, rtol=rtol,
          finite_only=finite_only), static_argnums=(4,))


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30, 1e-36])
@pytest.mark.parametrize("f64", [False, True])
def test_finite_only_is_bit_identical_to_the_cond_path(scale, f64):
  # check's candidate programs compile the all-finite path alone
  # (finite_only=True); where it holds, every number equals the default's.
  sizes = (3000, 700, 1, 512, 0, 1025)
  layout = M.Layout(sizes)
  rng = np.random.default_rng(1)
  refs = [rng.standard_normal(s) * scale for s in sizes]
  refs[1][::7] = 0.0
  cands = [(r * (1 + 1e-3 * rng.standard_normal(r.shape))).astype(np.float32)
           for r in refs]
  cands[3] = -cands[3] * 3  # a large error: the rescaled path
  pairs = [M.split_reference(r if f64 else r.astype(np.float32)) for r in refs]
  hi = jnp.asarray(M.pack_numpy([h for h, _ in pairs], layout))
  lo = (jnp.asarray(M.pack_numpy([l for _, l in pairs], layout)) if f64
        else None)
  ref = jax.jit(M.reference_stats, static_argnums=(2,))(hi, lo, layout)

  def run(finite_only):
    # One jitted function per path (the scale is an argument): the four
    # scales run the same two compiled programs, as check's do.
    return jax.device_get(_layer_stats_jit(finite_only)(
        cands, hi, lo, ref, layout, np.float32(1e-3 * scale),
        np.float32(1e-3)))
  fast, full = run(True), run(False)
  assert bool(fast.pop("finite"))
  assert fast.keys() == full.keys()
  for k in full:
    np.testing.assert_array_equal(_bits(fast)[k], _bits(full)[k], err_msg=k)
  # repr: exact for floats, and NaN reads like NaN.
  assert repr(M.finish(fast, layout)) == repr(M.finish(full, layout))


@pytest.mark.parametrize("where", ["candidate", "reference"])
def test_finite_only_says_when_it_does_not_hold(where):
  layout = M.Layout((100, 30))
  c = [np.ones(100, np.float32), np.ones(30, np.float32)]
  r = [np.ones(100, np.float32), np.ones(30, np.float32)]
  (c if where == "candidate" else r)[1][3] = np.nan
  hi = jnp.asarray(M.pack_numpy(r, layout))
  ref = jax.jit(M.reference_stats, static_argnums=(2,))(hi, None, layout)
  zero = np.float32(0.0)
  out = _layer_stats_jit(True)(c, hi, None, ref, layout, zero, zero)
  assert not bool(out["finite"])
  assert "finite" not in _layer_stats_jit(False)(c, hi, None, ref, layout,
                                                 zero, zero)

