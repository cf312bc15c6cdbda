"""Divergence metrics: how far one array (a layer's output) is from a reference.

Two parts, so that only scalars leave the device:

* :func:`reference_stats` (once per check) and :func:`layer_stats` (once per
  precision) run inside ``jax.jit``: all layers, packed into one array (see
  :class:`Layout`), are reduced to a few numbers per layer (sums, maxima,
  counts, a histogram for the ULP median) next to the computation that
  produced them;
* :func:`finish` turns those numbers into :class:`LayerMetrics` on the host,
  in float64.

The metrics are defined in ``docs/checker.md`` ("Metrics"), with ``c`` the
candidate, ``r`` the reference and ``e = c - r``, over the *valid* elements
(where both are finite); a float64 reference is carried as a float32 pair
``r = hi + lo`` and ``e = (c - hi) - lo``. A float64 reference value beyond
float32's range (above 3.4e38 in magnitude: its ``hi`` is infinite) is one
a float32 candidate cannot hold: its ``lo`` is NaN, it never matches (not even
an infinite candidate of its sign), so its layer fails (``required_atol =
inf``), and :attr:`LayerMetrics.ref_overflow` counts it.

Scale. Every metric is right for layers of any magnitude float32 holds, from
its smallest normal number (1.2e-38) to its largest (3.4e38): before
squaring, each layer's reference and error are multiplied by powers of two
(exact) that bring their largest magnitude near 1, and the host undoes the
scaling in float64. Without it, squares overflow float32 from magnitudes near
1e19 and underflow below 1e-19. A float32 reference is what the device computed:
values below 1.2e-38 are flushed to zero on CPU and TPU, in the reference as in
the candidate. An error that itself exceeds the float32 maximum (a candidate
of the opposite sign near the maximum) gives ``max_abs`` from a halved
computation and ``required_atol = inf``.

:func:`growth_per_layer` summarises a metric over depth (the layers' order).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The metrics of the JSON schema, in its order (`required_atol` comes after).
METRICS = ("max_abs", "max_rel", "rel_rms", "cosine", "sqnr_db", "ulp_median",
           "ulp_max", "frac_outside", "nan", "inf")


# The largest tolerance: the metrics run in float32, where a larger one is inf.
MAX_TOLERANCE = float(np.finfo(np.float32).max)


def check_tolerance(name: str, value: Any) -> float:
  """``value`` as a float: an ``atol`` or ``rtol`` must be a finite number >= 0.

  At most float32's largest value (about 3.4e38): the metrics compare in
  float32, where a larger tolerance is infinite and ``rtol * |ref|`` is NaN
  at zero. NaN, infinities, negative values, bools and non-numbers are
  refused, with one message.

  Raises:
    TypeError: ``value`` is not a real number (or is a bool).
    ValueError: ``value`` is negative, NaN, infinite or beyond float32.

  Examples:
    >>> from jaxprec._src.checker.metrics import check_tolerance
    >>> check_tolerance("atol", 1e-3)
    0.001
    >>> check_tolerance("rtol", None)
    Traceback (most recent call last):
    ...
    TypeError: rtol must be a finite number >= 0, e.g. rtol=1e-3; got None of type NoneType.
    >>> check_tolerance("rtol", float("inf"))
    Traceback (most recent call last):
    ...
    ValueError: rtol must be a finite number >= 0, e.g. rtol=1e-3, at most float32's largest (3.4e+38); got inf.
  """
  what = f"{name} must be a finite number >= 0, e.g. {name}=1e-3"
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{what}; got {value!r} of type {type(value).__name__}.")
  v = float(value)
  if not 0 <= v <= MAX_TOLERANCE:  # False for NaN
    raise ValueError(f"{what}, at most float32's largest "
                     f"({MAX_TOLERANCE:.2g}); got {value!r}.")
  return abs(v)  # -0.0 is 0, and is said so


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerMetrics:
  """The divergence of one layer at one precision.

  The metrics are defined in ``docs/checker.md`` ("Metrics").

  A layer without elements (a dimension of size 0) compares nothing: its
  figures are those of no error (0, ``cosine`` 1, ``sqnr_db`` inf), and the
  reports leave it out of every query and name it in a note.

  Attributes:
    max_abs, max_rel, rel_rms, cosine, sqnr_db: floats (``nan`` when no
      element is valid: finite in both).
    ulp_median, ulp_max: float32 ULP distance (``nan`` when nothing is valid).
    frac_outside: fraction of elements outside ``atol + rtol * |ref|``.
    nan, inf: counts of NaN and infinite candidate elements.
    required_atol: the smallest passing ``atol`` at the check's ``rtol``.
    size: number of elements.
    ref_rms, ref_max_abs: RMS and max ``|r|`` over valid elements.
    ref_nan, ref_inf: non-finite counts of the reference.
    ref_overflow: elements of a float64 reference that are finite but beyond
      float32's range; each is outside any tolerance (no float32 candidate
      holds it).
  """

  max_abs: float
  max_rel: float
  rel_rms: float
  cosine: float
  sqnr_db: float
  ulp_median: float
  ulp_max: float
  frac_outside: float
  nan: int
  inf: int
  required_atol: float
  size: int = 0
  ref_rms: float = 0.0
  ref_max_abs: float = 0.0
  ref_nan: int = 0
  ref_inf: int = 0
  ref_overflow: int = 0

  def passes(self, atol: float) -> bool:
    """Whether every element is within ``atol + rtol * |ref|`` (check's rtol)."""
    return self.required_atol <= atol

  def to_dict(self) -> dict[str, Any]:
    """The schema's metrics plus ``required_atol``, in schema order."""
    d = {k: getattr(self, k) for k in METRICS}
    d["required_atol"] = self.required_atol
    return d


# max_rel measures an element against at least REL_FLOOR * rms(reference).
REL_FLOOR = 1e-3

# ---------------------------------------------------------------------------
# On the device. All layers are reduced together, so that the compiled program
# does not grow with the number of layers: each layer is flattened and padded
# to whole chunks of CHUNK elements, the chunks of all layers are stacked into
# one (n_chunks, CHUNK) array, every metric is reduced per chunk and then per
# layer (a segment reduction over the chunks' layer ids).

CHUNK = 512
# ULP medians come from a per-layer histogram of log2(1 + distance) with
# 2**_SUB buckets per octave: exact below 2**_SUB, within 2**-_SUB above.
_SUB = 6
_BUCKETS = 33 << _SUB


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each layer's elements sit in the stacked ``(n_chunks, CHUNK)`` array.

  With ``groups == 1`` each layer's chunks follow the previous layer's. With
  ``groups = G > 1`` (a program whose arrays span G devices) every layer is
  padded to a whole number of chunks per group and cut into G equal parts,
  and the stacked array holds group 0 of every layer, then group 1 of every
  layer, and so on. A layer whose elements are split evenly over the devices
  along its leading axis (a batch-sharded hidden state whose shards hold
  whole chunks) then packs into rows that stay on the device that holds them:
  stacking the layers moves no data between devices, where stacking them
  one after another would gather them.
  """

  sizes: tuple[int, ...]
  groups: int = 1

  def __post_init__(self):
    if isinstance(self.groups, bool) or not isinstance(self.groups, int) \
        or self.groups < 1:
      raise ValueError(f"Layout groups must be an integer >= 1; got "
                       f"{self.groups!r}")

  @functools.cached_property
  def chunks(self) -> np.ndarray:
    """Chunks per layer (whole groups: a multiple of ``groups``)."""
    g = self.groups
    return np.array([-(-s // (CHUNK * g)) * g for s in self.sizes], np.int64)

  @property
  def n_chunks(self) -> int:
    return int(self.chunks.sum())

  @functools.cached_property
  def _order(self) -> tuple[np.ndarray, np.ndarray]:
    """Per stacked chunk: its layer and its index within the layer."""
    per_group = [int(n) // self.groups for n in self.chunks]
    layer, index = [np.zeros((0,), np.int64)], [np.zeros((0,), np.int64)]
    for k in range(self.groups):
      for i, q in enumerate(per_group):
        layer.append(np.full((q,), i, np.int64))
        index.append(k * q + np.arange(q, dtype=np.int64))
    return np.concatenate(layer).astype(np.int32), np.concatenate(index)

  @functools.cached_property
  def chunk_layer(self) -> np.ndarray:
    """The layer of each stacked chunk."""
    return self._order[0]

  @functools.cached_property
  def chunk_count(self) -> np.ndarray:
    """Real (not padding) elements in each chunk."""
    layer, index = self._order
    sizes = np.array(self.sizes, np.int64).reshape(-1)[layer]
    return np.clip(sizes - index * CHUNK, 0, CHUNK).astype(np.int32)


def pack(arrays: Sequence[Any], layout: Layout) -> jax.Array:
  """Flattens, pads and stacks layers into ``(n_chunks, CHUNK)`` float32."""
  g = layout.groups
  parts = []
  for a, s, n in zip(arrays, layout.sizes, layout.chunks):
    if n:
      flat = jnp.ravel(jnp.asarray(a)).astype(jnp.float32)
      flat = jnp.pad(flat, (0, int(n) * CHUNK - s))
      parts.append(flat if g == 1 else flat.reshape(g, int(n) // g, CHUNK))
  if not parts:
    return jnp.zeros((0, CHUNK), jnp.float32)
  return jnp.concatenate(parts, axis=0 if g == 1 else 1).reshape(
      layout.n_chunks, CHUNK)


def pack_numpy(arrays: Sequence[np.ndarray], layout: Layout) -> np.ndarray:
  """:func:`pack` on the host (for references loaded from files)."""
  g = layout.groups
  out = np.zeros((g, layout.n_chunks // g, CHUNK), np.float32)
  at = 0
  for a, n in zip(arrays, layout.chunks):
    q = int(n) // g  # the layer's chunks in each group
    flat = np.ravel(a).astype(np.float32, copy=False)
    for k in range(g):
      part = flat[k * q * CHUNK:(k + 1) * q * CHUNK]
      out[k, at:at + q].reshape(-1)[:part.size] = part  # a view of out
    at += q
  return out.reshape(layout.n_chunks, CHUNK)


def _ordered(x: jax.Array) -> jax.Array:
  """float32 -> int32 that orders like the floats (+0 and -0 both map to 0)."""
  i = lax.bitcast_convert_type(x, jnp.int32)
  mag = i & np.int32(0x7FFFFFFF)
  return jnp.where(i < 0, -mag, mag)


def _ulp_distance(a: jax.Array, b: jax.Array) -> jax.Array:
  """|ordered(a) - ordered(b)| as uint32 (exact: the difference is < 2**32)."""
  oa, ob = _ordered(a), _ordered(b)
  ua, ub = oa.astype(jnp.uint32), ob.astype(jnp.uint32)  # two's complement
  return jnp.where(oa >= ob, ua - ub, ub - ua)


def _ulp_bucket(d: jax.Array) -> jax.Array:
  f = d.astype(jnp.float32) + np.float32(1)
  bits = lax.bitcast_convert_type(f, jnp.int32)
  return (bits >> (23 - _SUB)) - np.int32(127 << _SUB)


def bucket_value(b: np.ndarray) -> np.ndarray:
  """The ULP distance a histogram bucket stands for (exact below 2**_SUB)."""
  b = np.asarray(b, np.int64)
  lo = ((b + (127 << _SUB)) << (23 - _SUB)).astype(np.uint32).view(np.float32)
  hi = ((b + 1 + (127 << _SUB)) << (23 - _SUB)).astype(np.uint32).view(np.float32)
  lo, hi = lo.astype(np.float64), hi.astype(np.float64)
  return np.where(hi - lo <= 1, lo, (lo + hi) / 2) - 1


# Layers whose reference lies below 2**-_TINY may have subnormal errors.
_TINY = 64


def _up_exp(c: jax.Array, r_exp: jax.Array, layout: Layout) -> jax.Array:
  """Per layer, ``u >= 0`` with the reference and ``c`` times ``2**u`` below 1."""
  c_abs = jnp.where(jnp.isfinite(c), jnp.abs(c), np.float32(0))
  c_exp = _scale_exp(_per_layer([c_abs], layout, "max")[0])
  return jnp.maximum(jnp.minimum(r_exp, c_exp), 0)


def _pow2(k: jax.Array) -> jax.Array:
  """``2.0 ** k`` in float32, exactly, for integer ``k`` in [-126, 127]."""
  return lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)


def _scale_exp(max_abs: jax.Array) -> jax.Array:
  """``k`` with ``max_abs * 2**k`` in [0.5, 1), clipped to [-126, 126].

  ``2**k`` is then a normal float32, and scaling by it is exact (the device
  may flush subnormal numbers to zero: none is used).
  """
  _, e = jnp.frexp(max_abs)
  return jnp.clip(-e, -126, 126).astype(jnp.int32)


def _real_mask(layout: Layout) -> jax.Array:
  return (jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
          < jnp.asarray(layout.chunk_count)[:, None])


def _per_layer(xs: Sequence[jax.Array], layout: Layout, op: str) -> jax.Array:
  """Reduces each ``(n_chunks, CHUNK)`` array per chunk, then per layer.

  One reduction per array: XLA:CPU runs separate row reductions faster than
  one over stacked or variadic operands.
  """
  n_layers = len(layout.sizes)
  seg = jnp.asarray(layout.chunk_layer)
  if op == "sum":
    part = jnp.stack([jnp.sum(x, axis=-1, dtype=x.dtype) for x in xs], axis=1)
    out = jax.ops.segment_sum(part, seg, num_segments=n_layers,
                              indices_are_sorted=layout.groups == 1)
  else:
    part = jnp.stack([jnp.max(x, axis=-1, initial=0) for x in xs], axis=1)
    out = jax.ops.segment_max(part, seg, num_segments=n_layers,
                              indices_are_sorted=layout.groups == 1)
    out = jnp.maximum(out, jnp.zeros((), out.dtype))  # empty layers: -inf
  return out.T


def reference_stats(ref_hi: jax.Array, ref_lo: jax.Array | None,
                    layout: Layout) -> dict[str, jax.Array]:
  """What :func:`layer_stats` needs of the reference, computed once per check.

  Args:
    ref_hi: the packed reference (see :func:`pack`).
    ref_lo: the packed low part of a float64 reference, or None.
    layout: the layers' sizes.

  Returns:
    Per-layer ``max_abs``, ``r_exp`` (the scaling exponent: the reference's
    magnitudes times ``2**r_exp`` lie below 1), ``sum_r2`` (of the scaled
    reference), ``nan``, ``inf``, ``overflow`` (finite float64 values beyond
    float32's range, marked by :func:`split_reference`), ``floor`` (the
    ``max_rel`` floor), and ``finite`` (a scalar: no non-finite element).
  """
  # Beyond the overflow mark, the low part changes none of these beyond
  # float32 rounding.
  hi = jnp.asarray(ref_hi, jnp.float32)
  lo = None if ref_lo is None else jnp.asarray(ref_lo, jnp.float32)
  i32 = jnp.int32
  sizes = jnp.asarray(np.array(layout.sizes, np.int32))
  zeros = jnp.zeros((len(layout.sizes),), i32)
  finite = jnp.all(jnp.isfinite(hi))

  def fast(hi):
    return hi, zeros, zeros, zeros, sizes

  def masked(hi):
    real = _real_mask(layout)
    fin = jnp.isfinite(hi)
    over = _overflow(hi, lo) & real
    counts = _per_layer([(jnp.isnan(hi) & real).astype(i32),
                         (jnp.isinf(hi) & real & ~over).astype(i32),
                         over.astype(i32), (fin & real).astype(i32)],
                        layout, "sum")
    return (jnp.where(fin, hi, np.float32(0)), counts[0], counts[1],
            counts[2], counts[3])

  r0, nan, inf, overflow, n_finite = lax.cond(finite, fast, masked, hi)
  max_abs = _per_layer([jnp.abs(r0)], layout, "max")[0]
  r_exp = _scale_exp(max_abs)
  r_s = r0 * _pow2(r_exp)[jnp.asarray(layout.chunk_layer)][:, None]
  sum_r2 = _per_layer([r_s * r_s], layout, "sum")[0]
  rms = (jnp.sqrt(sum_r2 / jnp.maximum(n_finite, 1).astype(jnp.float32))
         * _pow2(-r_exp))
  return {
      "sum_r2": sum_r2, "r_exp": r_exp, "max_abs": max_abs, "nan": nan,
      "inf": inf, "overflow": overflow,
      "floor": jnp.maximum(np.float32(REL_FLOOR) * rms,
                           np.float32(np.finfo(np.float32).tiny)),
      "finite": finite,
  }


# layer_stats returns three arrays (few transfers): these rows, then ulp_max.
# Sums are of scaled values: sum_r2 of r * 2**r_exp, sum_e2 of e * 2**e_exp,
# sum_er of both; max_half is max |e| / 2 (finite when max_abs overflows).
INT_ROWS = ("n_valid", "nan", "inf", "mismatch", "outside", "ulp_lo",
             "ulp_hi", "ref_nan", "ref_inf", "ref_overflow", "r_exp", "e_exp",
             "u_exp")
FLOAT_ROWS = ("sum_e2", "sum_er", "max_abs", "max_rel", "required", "sum_r2",
               "ref_max_abs", "max_half")
# max_abs, required and max_half are of errors computed on values scaled by
# 2**u_exp >= 1 (u_exp > 0 for a tiny layer only: its differences would
# otherwise fall below float32's smallest normal and flush to zero on CPU).
# The error is scaled like the reference unless that leaves its largest
# magnitude outside [2**-40, 2**40] (squares could then overflow, or lose
# the error to underflow): then a second pass scales it by its own maximum.
_SAFE = 2.0 ** 40


def layer_stats(candidates: Sequence[Any], ref_hi: jax.Array,
                ref_lo: jax.Array | None, ref: Mapping[str, jax.Array],
                layout: Layout, *, atol: Any, rtol: Any,
                finite_only: bool = False) -> dict[str, jax.Array]:
  """Reduces candidate layers against their packed reference to per-layer scalars.

  Call it under ``jax.jit``; only its outputs (a few numbers per layer) need
  to leave the device. When every element of both is finite (the common
  case) it makes eight passes over the data; otherwise a masked path that
  also counts NaNs and infinities runs instead (``lax.cond``).

  Args:
    candidates: the layers computed at the precision under test.
    ref_hi: the reference, :func:`pack`-ed.
    ref_lo: for a float64 reference, the packed ``ref - ref_hi``; else None.
    ref: :func:`reference_stats` of the reference.
    layout: the layers' sizes.
    atol, rtol: the tolerance (scalars; may be traced).
    finite_only: compute the all-finite path only, without the ``lax.cond``
      (XLA:CPU runs the same reductions several times slower inside a
      conditional branch). The output then holds ``finite``: where it is
      False, its numbers are wrong and the caller must compute them again
      with ``finite_only=False`` (:mod:`jaxprec._src.checker.harness` does);
      where it is True, they are those of ``finite_only=False``.

  Returns:
    Arrays for :func:`finish`: ``int`` and ``float`` (one row per statistic,
    one column per layer) and ``ulp_max``; with ``finite_only``, also
    ``finite`` (a scalar).
  """
  f32, i32 = jnp.float32, jnp.int32
  n_layers = len(layout.sizes)
  c = pack(candidates, layout)
  hi = jnp.asarray(ref_hi, f32)
  lo = None if ref_lo is None else jnp.asarray(ref_lo, f32)
  atol, rtol = jnp.asarray(atol, f32), jnp.asarray(rtol, f32)
  seg = jnp.asarray(layout.chunk_layer)
  sizes = jnp.asarray(np.array(layout.sizes, np.int32))
  zeros = jnp.zeros((n_layers,), i32)

  def scaling(r_exp, floor):
    # The reference's magnitudes times 2**r_exp lie below 1, and floor is
    # max_rel's, both of the elements compared: an element left out must not
    # set them, or the squares of the others could underflow to zero.
    u_exp = lax.cond(jnp.any(r_exp > _TINY),
                     lambda: _up_exp(c, r_exp, layout), lambda: zeros)
    return {"r_exp": r_exp, "u_exp": u_exp, "floor": floor[seg][:, None],
            "up": _pow2(u_exp)[seg][:, None],  # exact; c * up cannot overflow
            "rest": _pow2(r_exp - u_exp)[seg][:, None],
            "scale": _pow2(r_exp)[seg][:, None]}

  def error(c, hi, up):
    e = c * up - hi * up
    return e if lo is None else e - lo * up

  def common(c0, r0, e, valid, mismatch, sc):
    up, rest, scale, floor = sc["up"], sc["rest"], sc["scale"], sc["floor"]
    # e is scaled by up; so are ae, ar and the tolerance.
    ae, ar = jnp.abs(e), jnp.abs(r0 * up)
    outside = (ae > atol * up + rtol * ar) | mismatch
    floor_up = floor * up
    e_s, r_s = e * rest, r0 * scale
    if valid is None:
      sums = _per_layer([e_s * e_s, e_s * r_s], layout, "sum")
      sums = [sums[0], sums[1], ref["sum_r2"]]
    else:  # the reference's sum too, over the valid elements only
      sums = _per_layer([e_s * e_s, e_s * r_s, r_s * r_s], layout, "sum")
    maxes = _per_layer([ae, ae / jnp.maximum(ar, floor_up),
                        ae - rtol * ar], layout, "max")
    ulp = _ulp_distance(c0, r0)
    if valid is not None:
      ulp = jnp.where(valid, ulp, np.uint32(0))
    bucket = seg[:, None] * _BUCKETS + _ulp_bucket(ulp)
    weight = (jnp.ones(c0.shape, i32) if valid is None
              else valid.astype(i32))
    hist = jnp.zeros((max(n_layers, 1) * _BUCKETS,), i32).at[
        bucket.ravel()].add(weight.ravel(), mode="drop")
    return {
        "r_exp": sc["r_exp"], "u_exp": sc["u_exp"],
        "outside": _per_layer([outside.astype(i32)], layout, "sum")[0],
        "sum_e2": sums[0], "sum_er": sums[1], "sum_r2": sums[2],
        "max_abs": maxes[0],
        "max_rel": maxes[1], "required": maxes[2],
        "ulp_max": _per_layer([ulp], layout, "max")[0],
        "hist": hist.reshape(-1, _BUCKETS)[:n_layers],
    }

  def fast(c):
    # Padding is zero in both arrays, so it adds nothing and passes.
    sc = scaling(ref["r_exp"], ref["floor"])
    out = common(c, hi, error(c, hi, sc["up"]), None, False, sc)
    pad = jnp.asarray(layout.chunks.astype(np.int32)) * CHUNK - sizes
    out["hist"] = out["hist"].at[:, 0].add(-pad)  # padding: distance 0
    out.update(n_valid=sizes, nan=zeros, inf=zeros, mismatch=zeros)
    return out

  def masked(c):
    real = _real_mask(layout)
    fin_c, fin_r = jnp.isfinite(c), jnp.isfinite(hi)
    valid = real & fin_c & fin_r
    # A reference beyond float32's range matches nothing, an infinity
    # included: the candidate overflowed where the true value is finite.
    same = ((jnp.isnan(c) & jnp.isnan(hi)) | (
        jnp.isinf(c) & jnp.isinf(hi) & (c == hi))) & ~_overflow(hi, lo)
    mismatch = real & ~(fin_c & fin_r) & ~same
    zero = f32(0)
    c0 = jnp.where(valid, c, zero)
    r0 = jnp.where(valid, hi, zero)
    counts = _per_layer([valid.astype(i32), (real & jnp.isnan(c)).astype(i32),
                         (real & jnp.isinf(c)).astype(i32),
                         mismatch.astype(i32)], layout, "sum")
    r_exp = _scale_exp(_per_layer([jnp.abs(r0)], layout, "max")[0])
    r_s = r0 * _pow2(r_exp)[seg][:, None]
    rms = (jnp.sqrt(_per_layer([r_s * r_s], layout, "sum")[0]
                    / jnp.maximum(counts[0], 1).astype(f32)) * _pow2(-r_exp))
    sc = scaling(r_exp, jnp.maximum(f32(REL_FLOOR) * rms,
                                    f32(np.finfo(np.float32).tiny)))
    e = jnp.where(valid, error(c0, r0, sc["up"]), zero)
    out = common(c0, r0, e, valid, mismatch, sc)
    out.update(n_valid=counts[0], nan=counts[1], inf=counts[2],
               mismatch=counts[3])
    return out

  def rescaled(out):
    # The error, halved so that c - r cannot overflow, scaled per layer by
    # its own largest magnitude.
    u_exp = out["u_exp"]
    up = _pow2(u_exp)[seg][:, None]
    scale = _pow2(out["r_exp"])[seg][:, None]
    fin = jnp.isfinite(c) & jnp.isfinite(hi)
    half = f32(0.5)
    e_h = (c * up * half - hi * up * half)
    if lo is not None:
      e_h = e_h - lo * up * half
    e_h = jnp.where(fin, e_h, f32(0))
    max_half = _per_layer([jnp.abs(e_h)], layout, "max")[0]
    k = _scale_exp(max_half)
    e_s = e_h * _pow2(k)[seg][:, None]
    r_s = jnp.where(fin, hi, f32(0)) * scale
    sums = _per_layer([e_s * e_s, e_s * r_s], layout, "sum")
    return dict(out, sum_e2=sums[0], sum_er=sums[1], e_exp=k - 1 + u_exp,
                max_half=max_half)

  finite = ref["finite"] & jnp.all(jnp.isfinite(c))
  out = fast(c) if finite_only else lax.cond(finite, fast, masked, c)
  out.update(e_exp=out["r_exp"], max_half=out["max_abs"] * f32(0.5))
  m_s = out["max_abs"] * _pow2(out["r_exp"] - out["u_exp"])
  unsafe = (m_s > _SAFE) | ((m_s < 1 / _SAFE) & (m_s > 0))
  out = lax.cond(jnp.any(unsafe), rescaled, lambda out: out, out)
  out["required"] = jnp.where(out["mismatch"] > 0, f32(np.inf), out["required"])
  cum = jnp.cumsum(out.pop("hist"), axis=1)
  n_valid = out["n_valid"]
  out["ulp_lo"] = jnp.argmax(cum > jnp.maximum((n_valid - 1) // 2, 0)[:, None],
                             axis=1)
  out["ulp_hi"] = jnp.argmax(cum > (n_valid // 2)[:, None], axis=1)
  out.update(ref_max_abs=ref["max_abs"], ref_nan=ref["nan"],
             ref_inf=ref["inf"], ref_overflow=ref["overflow"])
  result = {"int": jnp.stack([out[k].astype(i32) for k in INT_ROWS]),
            "float": jnp.stack([out[k].astype(f32) for k in FLOAT_ROWS]),
            "ulp_max": out["ulp_max"]}
  if finite_only:
    result["finite"] = finite
  return result


def _overflow(hi: jax.Array, lo: jax.Array | None) -> jax.Array:
  """Where a packed float64 reference is finite beyond float32's range."""
  if lo is None:
    return jnp.zeros(hi.shape, bool)
  return jnp.isinf(hi) & jnp.isnan(lo)


def split_reference(ref: Any, xp: Any = np) -> tuple[Any, Any]:
  """A float64 array as a float32 pair ``(hi, lo)`` with ``hi + lo ~ ref``.

  Where ``ref`` is finite but beyond float32's range (``hi`` is infinite),
  ``lo`` is NaN: the mark :func:`reference_stats` and :func:`layer_stats`
  read as a value no float32 candidate holds. Elsewhere a non-finite ``hi``
  has ``lo = 0``. Other dtypes return ``(ref, None)``. ``xp``: ``np``, or
  ``jnp`` inside a jitted float64 computation.
  """
  if ref.dtype != xp.float64:
    return ref, None
  with np.errstate(over="ignore", invalid="ignore"):
    hi = ref.astype(xp.float32)
    lo = xp.where(xp.isfinite(hi), ref - hi.astype(xp.float64),
                  xp.where(xp.isfinite(ref), xp.nan, 0.0))
  return hi, lo.astype(xp.float32)


def pack_reference(values: Sequence[Any], layout: Layout, xp: Any = np
                   ) -> tuple[Any, Any]:
  """``(hi, lo)``: the reference layers :func:`split_reference` and packed
  (:func:`pack_numpy` for ``xp=np``, else :func:`pack`); ``lo`` is None
  when no layer is float64."""
  pack_ = pack_numpy if xp is np else pack
  pairs = [split_reference(v, xp) for v in values]
  hi = pack_([h for h, _ in pairs], layout)
  if all(l is None for _, l in pairs):
    return hi, None
  return hi, pack_([xp.zeros(xp.shape(h), xp.float32) if l is None else l
                    for h, l in pairs], layout)


# ---------------------------------------------------------------------------
# On the host.


def finish(stats: Mapping[str, Any], layout: Layout) -> list[LayerMetrics]:
  """Turns :func:`layer_stats` output (fetched to the host) into metrics."""
  s = {k: v for k, v in zip(INT_ROWS, np.asarray(stats["int"]))}
  s.update(zip(FLOAT_ROWS, np.asarray(stats["float"])))
  s["ulp_max"] = np.asarray(stats["ulp_max"])
  ulp_lo = bucket_value(s["ulp_lo"])
  ulp_hi = bucket_value(s["ulp_hi"])
  return [_finish_one({k: v[i] for k, v in s.items()}, size, ulp_lo[i], ulp_hi[i])
          for i, size in enumerate(layout.sizes)]


def _finish_one(s: Mapping[str, Any], size: int, ulp_lo: float,
                ulp_hi: float) -> LayerMetrics:
  if not size:  # nothing to compare: no error, and no NaN to rank
    return LayerMetrics(max_abs=0.0, max_rel=0.0, rel_rms=0.0, cosine=1.0,
                        sqnr_db=math.inf, ulp_median=0.0, ulp_max=0.0,
                        frac_outside=0.0, nan=0, inf=0, required_atol=0.0)
  n_valid = int(s["n_valid"])
  nan = float("nan")
  # Undo the scaling in float64 (whose range holds every square of float32).
  # Errors were computed on values scaled by 2**u_exp (tiny layers).
  r_exp, e_exp, u_exp = int(s["r_exp"]), int(s["e_exp"]), int(s["u_exp"])
  sum_r2 = math.ldexp(float(s["sum_r2"]), -2 * r_exp)
  sum_e2 = math.ldexp(float(s["sum_e2"]), -2 * e_exp)
  sum_er = math.ldexp(float(s["sum_er"]), -(r_exp + e_exp))
  if n_valid == 0:
    max_abs = max_rel = rel_rms = cosine = sqnr = ulp_med = ulp_max = nan
    ref_rms = ref_max = nan
  else:
    max_abs = math.ldexp(float(s["max_abs"]), -u_exp)
    max_rel = float(s["max_rel"])
    if math.isinf(max_abs) and not int(s["mismatch"]):  # c - r overflowed
      max_abs = 2.0 * math.ldexp(float(s["max_half"]), -u_exp)
    if sum_r2 > 0:
      rel_rms = math.sqrt(sum_e2 / sum_r2)
    else:
      rel_rms = 0.0 if sum_e2 == 0 else math.inf
    # c = r + e: sum c*r = R + S_er and sum c*c = R + 2 S_er + S_ee, in float64
    # (no cancellation between two large float32 sums).
    sum_cr = sum_r2 + sum_er
    sum_c2 = max(sum_r2 + 2 * sum_er + sum_e2, 0.0)
    if sum_c2 > 0 and sum_r2 > 0:
      cosine = max(-1.0, min(1.0, sum_cr / math.sqrt(sum_c2 * sum_r2)))
    else:
      cosine = 1.0 if sum_c2 == sum_r2 == 0 else 0.0
    if sum_e2 == 0:
      sqnr = math.inf
    elif sum_r2 == 0:
      sqnr = -math.inf
    else:
      sqnr = 10.0 * math.log10(sum_r2 / sum_e2)
    ulp_max = float(int(s["ulp_max"]))
    # The median's bucket midpoint may pass the exact maximum: clamp it.
    ulp_med = min((float(ulp_lo) + float(ulp_hi)) / 2.0, ulp_max)
    ref_rms = math.sqrt(sum_r2 / n_valid)
    ref_max = float(s["ref_max_abs"])
  return LayerMetrics(
      max_abs=max_abs, max_rel=max_rel, rel_rms=rel_rms, cosine=cosine,
      sqnr_db=sqnr, ulp_median=ulp_med, ulp_max=ulp_max,
      frac_outside=int(s["outside"]) / size,
      nan=int(s["nan"]), inf=int(s["inf"]),
      required_atol=math.ldexp(float(s["required"]), -u_exp), size=int(size),
      ref_rms=ref_rms,
      ref_max_abs=ref_max, ref_nan=int(s["ref_nan"]), ref_inf=int(s["ref_inf"]),
      ref_overflow=int(s["ref_overflow"]))


@functools.partial(jax.jit, static_argnums=(3,))
def _compare(c, hi, lo, layout, atol, rtol):
  ref = reference_stats(hi, lo, layout)
  return layer_stats([c], hi, lo, ref, layout, atol=atol, rtol=rtol)


def compare(candidate: jax.typing.ArrayLike, reference: jax.typing.ArrayLike, *,
            atol: float = 0.0, rtol: float = 0.0) -> LayerMetrics:
  """The metrics of one array against a reference (a float64 one is kept exact).

  Args:
    candidate: the array under test.
    reference: the reference, same shape; float64 NumPy arrays keep their
      precision (carried as a float32 pair).
    atol, rtol: the tolerance for ``frac_outside`` and ``required_atol``.

  Returns:
    The :class:`LayerMetrics`.

  Examples:
    >>> import numpy as np
    >>> from jaxprec._src.checker.metrics import compare
    >>> m = compare(np.float32([1, 2, 4]), np.array([1, 2, 4.5]), atol=0.1)
    >>> m.max_abs, m.frac_outside, m.required_atol
    (0.5, 0.3333333333333333, 0.5)
  """
  atol, rtol = check_tolerance("atol", atol), check_tolerance("rtol", rtol)
  c, reference = np.asarray(candidate), np.asarray(reference)
  if c.shape != reference.shape:
    raise ValueError(f"candidate shape {c.shape} != reference shape "
                     f"{reference.shape}")
  c = c.ravel()  # one compilation per size, whatever the shape
  layout = Layout((int(c.size),))
  hi_p, lo_p = pack_reference([reference], layout)
  stats = jax.device_get(_compare(c, hi_p, lo_p, layout, np.float32(atol),
                                  np.float32(rtol)))
  return finish(stats, layout)[0]


# ---------------------------------------------------------------------------
# Summaries over layers.


def growth_per_layer(values: Sequence[float]) -> float:
  """How fast a positive metric grows with depth: ``10**slope`` per layer.

  ``slope`` is the least-squares slope of ``log10(value)`` against the layer
  index, over the layers where the value is positive and finite; 2.0 means the
  error doubles from one layer to the next. ``nan`` with fewer than two such
  layers.

  Examples:
    >>> from jaxprec._src.checker.metrics import growth_per_layer
    >>> round(growth_per_layer([1e-4, 2e-4, 4e-4, 8e-4]), 6)
    2.0
  """
  pts = [(i, math.log10(v)) for i, v in enumerate(values)
         if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
  if len(pts) < 2:
    return float("nan")
  xs, ys = np.array(pts).T
  xm, ym = xs.mean(), ys.mean()
  den = float(((xs - xm) ** 2).sum())
  slope = float(((xs - xm) * (ys - ym)).sum()) / den
  return 10.0 ** slope
