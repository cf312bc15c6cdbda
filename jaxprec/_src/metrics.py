"""Divergence metrics: how far one array (a layer's output) is from a reference.

Three parts, so that only scalars leave the device:

* :func:`reference_stats` (once per check) and :func:`layer_stats` (once per
  precision) run inside ``jax.jit``: all layers, packed into one array (see
  :class:`Layout`), are reduced to a few numbers per layer (sums, maxima,
  counts, a histogram for the ULP median) next to the computation that
  produced them;
* :func:`finish` turns those numbers into :class:`LayerMetrics` on the host,
  in float64.

Definitions (``c``: candidate, ``r``: reference, ``e = c - r``; all sums and
maxima are over the elements where both are finite, called *valid*; a float64
reference is carried as a float32 pair ``r = hi + lo`` and ``e = (c - hi) - lo``):

``max_abs``
  ``max |e|``.
``max_rel``
  ``max |e| / max(|r|, floor)`` with ``floor = REL_FLOOR * rms(r)``
  (``REL_FLOOR = 1e-3``): elements a thousand times smaller than the layer's
  typical magnitude are measured against that magnitude, so a near-zero
  reference element cannot blow the ratio up.
``rel_rms``
  ``sqrt(sum e**2 / sum r**2)``: the RMS error over the RMS of the reference.
``cosine``
  ``sum c*r / sqrt(sum c**2 * sum r**2)`` (1 for two zero arrays, 0 when only
  one is zero), computed as ``(R + S) / sqrt(R * (R + 2 S + E))`` from
  ``R = sum r**2``, ``S = sum e*r`` and ``E = sum e**2`` (no cancellation
  between two large sums, so it stays accurate when the error is small).
``sqnr_db``
  ``10 * log10(sum r**2 / sum e**2)``, signal to quantization-noise ratio in
  decibels; ``inf`` when ``e`` is zero.
``ulp_median``, ``ulp_max``
  distance in float32 units in the last place between ``c`` and ``r`` rounded
  to float32: the number of float32 values between them (``+0`` and ``-0`` are
  one value), median and maximum over valid elements. The maximum is exact;
  the median is read from a per-layer histogram of ``log2(1 + distance)`` with
  64 buckets per octave (one pass, no sort): exact below 64 ULPs and within
  1.6% above (the middle of its bucket).
``frac_outside``
  the fraction of all elements with ``|e| > atol + rtol * |r|`` (NumPy's
  ``allclose`` test), counting a non-finite candidate element as outside unless
  the reference holds the same value there (NaN and NaN, or the same infinity).
``nan``, ``inf``
  the number of NaN and infinite elements in the candidate.
``required_atol``
  the smallest ``atol`` with which every element passes at the check's
  ``rtol``: ``max(0, max(|e| - rtol * |r|))``; ``inf`` when non-finite values
  differ.

Summaries over layers (depth = the order of the layers): :func:`first_exceeding`
and :func:`growth_per_layer` (a least-squares slope of ``log10`` of a metric
against depth).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["CHUNK", "LayerMetrics", "Layout", "METRICS", "REL_FLOOR", "compare",
           "finish", "first_exceeding", "growth_per_layer", "layer_stats",
           "pack", "pack_numpy", "reference_stats"]

REL_FLOOR = 1e-3
# The metrics of the JSON schema, in its order (`required_atol` comes after).
METRICS = ("max_abs", "max_rel", "rel_rms", "cosine", "sqnr_db", "ulp_median",
           "ulp_max", "frac_outside", "nan", "inf")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerMetrics:
  """The divergence of one layer at one precision (see the module docstring).

  Attributes:
    max_abs, max_rel, rel_rms, cosine, sqnr_db: as defined above (floats;
      ``nan`` when no element is valid).
    ulp_median, ulp_max: float32 ULP distance (``nan`` when nothing is valid).
    frac_outside: fraction of elements outside ``atol + rtol * |ref|``.
    nan, inf: counts of NaN and infinite candidate elements.
    required_atol: the smallest passing ``atol`` at the check's ``rtol``.
    size: number of elements.
    ref_rms, ref_max_abs: RMS and max ``|r|`` over valid elements.
    ref_nan, ref_inf: non-finite counts of the reference.
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

  def passes(self, atol: float) -> bool:
    """Whether every element is within ``atol + rtol * |ref|`` (check's rtol)."""
    return self.required_atol <= atol

  def to_dict(self) -> dict[str, Any]:
    """The schema's metrics plus ``required_atol``, in schema order."""
    d = {k: getattr(self, k) for k in METRICS}
    d["required_atol"] = self.required_atol
    return d


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
  """Where each layer's elements sit in the stacked ``(n_chunks, CHUNK)`` array."""

  sizes: tuple[int, ...]

  @functools.cached_property
  def chunks(self) -> np.ndarray:
    return np.array([-(-s // CHUNK) for s in self.sizes], np.int64)

  @property
  def n_chunks(self) -> int:
    return int(self.chunks.sum())

  @functools.cached_property
  def chunk_layer(self) -> np.ndarray:
    return np.repeat(np.arange(len(self.sizes)), self.chunks).astype(np.int32)

  @functools.cached_property
  def chunk_count(self) -> np.ndarray:
    """Real (not padding) elements in each chunk."""
    out = []
    for s, n in zip(self.sizes, self.chunks):
      full = [CHUNK] * int(n)
      if n:
        full[-1] = s - CHUNK * (int(n) - 1)
      out += full
    return np.array(out, np.int32)


def pack(arrays: Sequence[Any], layout: Layout) -> jax.Array:
  """Flattens, pads and stacks layers into ``(n_chunks, CHUNK)`` float32."""
  parts = []
  for a, s, n in zip(arrays, layout.sizes, layout.chunks):
    if n:
      flat = jnp.ravel(jnp.asarray(a)).astype(jnp.float32)
      parts.append(jnp.pad(flat, (0, int(n) * CHUNK - s)))
  if not parts:
    return jnp.zeros((0, CHUNK), jnp.float32)
  return jnp.concatenate(parts).reshape(layout.n_chunks, CHUNK)


def pack_numpy(arrays: Sequence[np.ndarray], layout: Layout) -> np.ndarray:
  """:func:`pack` on the host (for references loaded from files)."""
  out = np.zeros((layout.n_chunks * CHUNK,), np.float32)
  at = 0
  for a, s, n in zip(arrays, layout.sizes, layout.chunks):
    out[at:at + s] = np.ravel(a).astype(np.float32)
    at += int(n) * CHUNK
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


def _bucket_value(b: np.ndarray) -> np.ndarray:
  """The ULP distance a histogram bucket stands for (exact below 2**_SUB)."""
  b = np.asarray(b, np.int64)
  lo = ((b + (127 << _SUB)) << (23 - _SUB)).astype(np.uint32).view(np.float32)
  hi = ((b + 1 + (127 << _SUB)) << (23 - _SUB)).astype(np.uint32).view(np.float32)
  lo, hi = lo.astype(np.float64), hi.astype(np.float64)
  return np.where(hi - lo <= 1, lo, (lo + hi) / 2) - 1


def _real_mask(layout: Layout) -> jax.Array:
  return (jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
          < jnp.asarray(layout.chunk_count)[:, None])


def _per_layer(xs: Sequence[jax.Array], layout: Layout, op: str) -> jax.Array:
  """Reduces each ``(n_chunks, CHUNK)`` array per chunk, then per layer.

  One reduction per array: XLA:CPU runs separate row reductions faster than
  one over stacked or variadic operands (measured).
  """
  n_layers = len(layout.sizes)
  seg = jnp.asarray(layout.chunk_layer)
  if op == "sum":
    part = jnp.stack([jnp.sum(x, axis=-1, dtype=x.dtype) for x in xs], axis=1)
    out = jax.ops.segment_sum(part, seg, num_segments=n_layers,
                              indices_are_sorted=True)
  else:
    part = jnp.stack([jnp.max(x, axis=-1, initial=0) for x in xs], axis=1)
    out = jax.ops.segment_max(part, seg, num_segments=n_layers,
                              indices_are_sorted=True)
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
    Per-layer ``sum_r2``, ``max_abs``, ``nan``, ``inf``, ``floor`` (the
    ``max_rel`` floor), and ``finite`` (a scalar: no non-finite element).
  """
  del ref_lo  # the low part changes none of these beyond float32 rounding
  hi = jnp.asarray(ref_hi, jnp.float32)
  i32 = jnp.int32
  sizes = jnp.asarray(np.array(layout.sizes, np.int32))
  finite = jnp.all(jnp.isfinite(hi))

  def fast(hi):
    zeros = jnp.zeros((len(layout.sizes),), i32)
    return hi, zeros, zeros, sizes

  def masked(hi):
    real = _real_mask(layout)
    fin = jnp.isfinite(hi)
    counts = _per_layer([(jnp.isnan(hi) & real).astype(i32),
                         (jnp.isinf(hi) & real).astype(i32),
                         (fin & real).astype(i32)], layout, "sum")
    return jnp.where(fin, hi, np.float32(0)), counts[0], counts[1], counts[2]

  r0, nan, inf, n_finite = lax.cond(finite, fast, masked, hi)
  sum_r2 = _per_layer([r0 * r0], layout, "sum")[0]
  max_abs = _per_layer([jnp.abs(r0)], layout, "max")[0]
  rms = jnp.sqrt(sum_r2 / jnp.maximum(n_finite, 1).astype(jnp.float32))
  return {
      "sum_r2": sum_r2, "max_abs": max_abs, "nan": nan, "inf": inf,
      "floor": jnp.maximum(np.float32(REL_FLOOR) * rms,
                           np.float32(np.finfo(np.float32).tiny)),
      "finite": finite,
  }


# layer_stats returns three arrays (few transfers): these rows, then ulp_max.
_INT_ROWS = ("n_valid", "nan", "inf", "mismatch", "outside", "ulp_lo",
             "ulp_hi", "ref_nan", "ref_inf")
_FLOAT_ROWS = ("sum_e2", "sum_er", "max_abs", "max_rel", "required", "sum_r2",
               "ref_max_abs")


def layer_stats(candidates: Sequence[Any], ref_hi: jax.Array,
                ref_lo: jax.Array | None, ref: Mapping[str, jax.Array],
                layout: Layout, *, atol: Any, rtol: Any) -> dict[str, jax.Array]:
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

  Returns:
    Arrays for :func:`finish`: ``int`` and ``float`` (one row per statistic,
    one column per layer) and ``ulp_max``.
  """
  f32, i32 = jnp.float32, jnp.int32
  n_layers = len(layout.sizes)
  c = pack(candidates, layout)
  hi = jnp.asarray(ref_hi, f32)
  lo = None if ref_lo is None else jnp.asarray(ref_lo, f32)
  atol, rtol = jnp.asarray(atol, f32), jnp.asarray(rtol, f32)
  seg = jnp.asarray(layout.chunk_layer)
  floor = ref["floor"][seg][:, None]
  sizes = jnp.asarray(np.array(layout.sizes, np.int32))
  zeros = jnp.zeros((n_layers,), i32)

  def error(c, hi):
    e = c - hi
    return e if lo is None else e - lo

  def common(c0, r0, e, valid, mismatch):
    ae, ar = jnp.abs(e), jnp.abs(r0)
    outside = (ae > atol + rtol * ar) | mismatch
    sums = _per_layer([e * e, e * r0], layout, "sum")
    maxes = _per_layer([ae, ae / jnp.maximum(ar, floor),
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
        "outside": _per_layer([outside.astype(i32)], layout, "sum")[0],
        "sum_e2": sums[0], "sum_er": sums[1], "max_abs": maxes[0],
        "max_rel": maxes[1], "required": maxes[2],
        "ulp_max": _per_layer([ulp], layout, "max")[0],
        "hist": hist.reshape(-1, _BUCKETS)[:n_layers],
    }

  def fast(c):
    # Padding is zero in both arrays, so it adds nothing and passes.
    out = common(c, hi, error(c, hi), None, False)
    pad = jnp.asarray(layout.chunks.astype(np.int32)) * CHUNK - sizes
    out["hist"] = out["hist"].at[:, 0].add(-pad)  # padding: distance 0
    out.update(n_valid=sizes, nan=zeros, inf=zeros, mismatch=zeros)
    return out

  def masked(c):
    real = _real_mask(layout)
    fin_c, fin_r = jnp.isfinite(c), jnp.isfinite(hi)
    valid = real & fin_c & fin_r
    same = (jnp.isnan(c) & jnp.isnan(hi)) | (
        jnp.isinf(c) & jnp.isinf(hi) & (c == hi))
    mismatch = real & ~(fin_c & fin_r) & ~same
    zero = f32(0)
    c0 = jnp.where(valid, c, zero)
    r0 = jnp.where(valid, hi, zero)
    e = jnp.where(valid, error(c0, r0), zero)
    out = common(c0, r0, e, valid, mismatch)
    counts = _per_layer([valid.astype(i32), (real & jnp.isnan(c)).astype(i32),
                         (real & jnp.isinf(c)).astype(i32),
                         mismatch.astype(i32)], layout, "sum")
    out.update(n_valid=counts[0], nan=counts[1], inf=counts[2],
               mismatch=counts[3])
    return out

  finite = ref["finite"] & jnp.all(jnp.isfinite(c))
  out = lax.cond(finite, fast, masked, c)
  out["required"] = jnp.where(out["mismatch"] > 0, f32(np.inf), out["required"])
  cum = jnp.cumsum(out.pop("hist"), axis=1)
  n_valid = out["n_valid"]
  out["ulp_lo"] = jnp.argmax(cum > jnp.maximum((n_valid - 1) // 2, 0)[:, None],
                             axis=1)
  out["ulp_hi"] = jnp.argmax(cum > (n_valid // 2)[:, None], axis=1)
  out.update(sum_r2=ref["sum_r2"], ref_max_abs=ref["max_abs"],
             ref_nan=ref["nan"], ref_inf=ref["inf"])
  return {"int": jnp.stack([out[k].astype(i32) for k in _INT_ROWS]),
          "float": jnp.stack([out[k].astype(f32) for k in _FLOAT_ROWS]),
          "ulp_max": out["ulp_max"]}


# ---------------------------------------------------------------------------
# On the host.


def finish(stats: Mapping[str, Any], layout: Layout) -> list[LayerMetrics]:
  """Turns :func:`layer_stats` output (fetched to the host) into metrics."""
  s = {k: v for k, v in zip(_INT_ROWS, np.asarray(stats["int"]))}
  s.update(zip(_FLOAT_ROWS, np.asarray(stats["float"])))
  s["ulp_max"] = np.asarray(stats["ulp_max"])
  ulp_lo = _bucket_value(s["ulp_lo"])
  ulp_hi = _bucket_value(s["ulp_hi"])
  return [_finish_one({k: v[i] for k, v in s.items()}, size, ulp_lo[i], ulp_hi[i])
          for i, size in enumerate(layout.sizes)]


def _finish_one(s: Mapping[str, Any], size: int, ulp_lo: float,
                ulp_hi: float) -> LayerMetrics:
  n_valid = int(s["n_valid"])
  nan = float("nan")
  sum_e2, sum_r2 = float(s["sum_e2"]), float(s["sum_r2"])
  sum_er = float(s["sum_er"])
  if n_valid == 0:
    max_abs = max_rel = rel_rms = cosine = sqnr = ulp_med = ulp_max = nan
    ref_rms = ref_max = nan
  else:
    max_abs, max_rel = float(s["max_abs"]), float(s["max_rel"])
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
    ulp_med = (float(ulp_lo) + float(ulp_hi)) / 2.0
    ulp_max = float(int(s["ulp_max"]))
    ref_rms = math.sqrt(sum_r2 / n_valid)
    ref_max = float(s["ref_max_abs"])
  return LayerMetrics(
      max_abs=max_abs, max_rel=max_rel, rel_rms=rel_rms, cosine=cosine,
      sqnr_db=sqnr, ulp_median=ulp_med, ulp_max=ulp_max,
      frac_outside=int(s["outside"]) / size if size else 0.0,
      nan=int(s["nan"]), inf=int(s["inf"]),
      required_atol=float(s["required"]), size=int(size), ref_rms=ref_rms,
      ref_max_abs=ref_max, ref_nan=int(s["ref_nan"]), ref_inf=int(s["ref_inf"]))


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
    >>> from jaxprec._src.metrics import compare
    >>> m = compare(np.float32([1, 2, 4]), np.array([1, 2, 4.5]), atol=0.1)
    >>> m.max_abs, m.frac_outside, m.required_atol
    (0.5, 0.3333333333333333, 0.5)
  """
  c = np.asarray(candidate)
  hi, lo = split_reference(np.asarray(reference))
  if c.shape != hi.shape:
    raise ValueError(f"candidate shape {c.shape} != reference shape {hi.shape}")
  c = c.ravel()  # one compilation per size, whatever the shape
  layout = Layout((int(c.size),))
  hi_p = pack_numpy([hi], layout)
  lo_p = None if lo is None else pack_numpy([lo], layout)
  stats = jax.device_get(_compare(c, hi_p, lo_p, layout, np.float32(atol),
                                  np.float32(rtol)))
  return finish(stats, layout)[0]


def split_reference(ref: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
  """A float64 array as a float32 pair ``(hi, lo)`` with ``hi + lo ~ ref``.

  Other dtypes return ``(ref, None)``.
  """
  if ref.dtype == np.float64:
    with np.errstate(over="ignore", invalid="ignore"):
      hi = ref.astype(np.float32)
      lo = np.where(np.isfinite(hi), ref - hi.astype(np.float64), 0.0)
    return hi, lo.astype(np.float32)
  return ref, None


def split_reference_jax(ref: jax.Array) -> tuple[jax.Array, jax.Array | None]:
  """:func:`split_reference` inside a jitted float64 computation."""
  if ref.dtype == jnp.float64:
    hi = ref.astype(jnp.float32)
    lo = jnp.where(jnp.isfinite(hi), ref - hi.astype(jnp.float64), 0.0)
    return hi, lo.astype(jnp.float32)
  return ref, None


# ---------------------------------------------------------------------------
# Summaries over layers.


def first_exceeding(required: Sequence[float], atol: float) -> int | None:
  """Index of the first layer whose ``required_atol`` exceeds ``atol``."""
  for i, r in enumerate(required):
    if not r <= atol:  # NaN counts as exceeding
      return i
  return None


def growth_per_layer(values: Sequence[float]) -> float:
  """How fast a positive metric grows with depth: ``10**slope`` per layer.

  ``slope`` is the least-squares slope of ``log10(value)`` against the layer
  index, over the layers where the value is positive and finite; 2.0 means the
  error doubles from one layer to the next. ``nan`` with fewer than two such
  layers.

  Examples:
    >>> from jaxprec._src.metrics import growth_per_layer
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
