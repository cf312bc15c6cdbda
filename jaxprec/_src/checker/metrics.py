"""Divergence metrics: how far one array (a layer's output) is from a reference.

Three parts, so that only scalars leave the device:

* :func:`reference_stats` (once per check) and :func:`layer_stats` (once per
  precision), in :mod:`jaxprec._src.checker.metric_stats` and importable from here,
  run inside ``jax.jit``: all layers, packed into one array (see
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

Summaries over layers (depth = the order of the layers): :func:`first_exceeding`
and :func:`growth_per_layer` (a least-squares slope of ``log10`` of a metric
against depth).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxprec._src.checker import metric_stats as stats_lib
from jaxprec._src.checker.metric_stats import (Layout, layer_stats, pack_numpy,
                                               reference_stats, split_reference)

# The metrics of the JSON schema, in its order (`required_atol` comes after).
METRICS = ("max_abs", "max_rel", "rel_rms", "cosine", "sqnr_db", "ulp_median",
           "ulp_max", "frac_outside", "nan", "inf")


def check_tolerance(name: str, value: Any) -> float:
  """``value`` as a float: an ``atol`` or ``rtol`` must be a number >= 0.

  ``inf`` is allowed (everything passes); NaN, negative values, bools and
  non-numbers are not.

  Raises:
    TypeError: ``value`` is not a real number (or is a bool).
    ValueError: ``value`` is negative or NaN.

  Examples:
    >>> from jaxprec._src.checker.metrics import check_tolerance
    >>> check_tolerance("atol", 1e-3)
    0.001
    >>> check_tolerance("rtol", None)
    Traceback (most recent call last):
    ...
    TypeError: rtol must be a number >= 0, e.g. rtol=1e-3; got None of type NoneType.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a number >= 0, e.g. {name}=1e-3; got "
                    f"{value!r} of type {type(value).__name__}.")
  v = float(value)
  if math.isnan(v) or v < 0:
    raise ValueError(f"{name} must be a number >= 0, e.g. {name}=1e-3; got "
                     f"{value!r}.")
  return v


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
# On the host.


def finish(stats: Mapping[str, Any], layout: Layout) -> list[LayerMetrics]:
  """Turns :func:`layer_stats` output (fetched to the host) into metrics."""
  s = {k: v for k, v in zip(stats_lib.INT_ROWS, np.asarray(stats["int"]))}
  s.update(zip(stats_lib.FLOAT_ROWS, np.asarray(stats["float"])))
  s["ulp_max"] = np.asarray(stats["ulp_max"])
  ulp_lo = stats_lib.bucket_value(s["ulp_lo"])
  ulp_hi = stats_lib.bucket_value(s["ulp_hi"])
  return [_finish_one({k: v[i] for k, v in s.items()}, size, ulp_lo[i], ulp_hi[i])
          for i, size in enumerate(layout.sizes)]


def _finish_one(s: Mapping[str, Any], size: int, ulp_lo: float,
                ulp_hi: float) -> LayerMetrics:
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
      frac_outside=int(s["outside"]) / size if size else 0.0,
      nan=int(s["nan"]), inf=int(s["inf"]),
      required_atol=math.ldexp(float(s["required"]), -u_exp), size=int(size),
      ref_rms=ref_rms,
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
    >>> from jaxprec._src.checker.metrics import compare
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
