"""A NumPy + ml_dtypes reference for jaxprec's rounding and emulated matmuls.

Independent of JAX and of jaxprec's implementation: rounding is computed on
float64 values and an explicit grid (not on bit patterns), checked against
``ml_dtypes`` and NumPy's float16 where those exist; products and sums are
float64 and every float32 operation is modelled as "compute in float64, round
once to float32" (correct for +, -, *, as 53 >= 2 * 24 + 2).

XLA:CPU runs float arithmetic with subnormals flushed to zero (inputs treated
as zero, results flushed); ``ftz=True`` models that. It applies to the
arithmetic only: bit masks and rounding see subnormals as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

F32_MIN_NORMAL = 2.0**-126

# (explicit mantissa bits, minimum normal exponent, largest finite value)
FORMATS = {
    "bfloat16": (7, -126, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)),
    "tensorfloat32": (10, -126, (2 - 2.0**-10) * 2.0**127),
    "float16": (10, -14, 65504.0),
}


def bits(x) -> np.ndarray:
  return np.asarray(x, np.float32).view(np.uint32)


def from_bits(u) -> np.ndarray:
  return np.asarray(u, np.uint32).view(np.float32)


# ---------------------------------------------------------------------------
# Rounding on an explicit grid, in float64.


def spacing(a: np.ndarray, fmt: str) -> np.ndarray:
  """Spacing of ``fmt``'s values around magnitudes ``a`` (float64, finite)."""
  mant, emin, _ = FORMATS[fmt]
  with np.errstate(divide="ignore"):
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
  # log2 of a float64 can be off by one ulp at powers of two: fix exactly.
  e = np.where(np.exp2(e) > a, e - 1, e)
  e = np.where(np.exp2(e + 1) <= a, e + 1, e)
  e = np.where(a > 0, e, emin)  # zero: the smallest spacing
  return np.exp2(np.maximum(e, emin) - mant)


def round_ref(x, fmt: str, mode: str = "nearest") -> np.ndarray:
  """``x`` (float32) rounded to ``fmt``; float32 result. NaN -> NaN."""
  x = np.asarray(x, np.float32)
  _, _, fmax = FORMATS[fmt]
  with np.errstate(invalid="ignore"):  # signalling NaNs
    xd = x.astype(np.float64)
  a = np.abs(xd)
  finite = np.isfinite(a)
  af = np.where(finite, a, 1.0)
  ulp = spacing(af, fmt)
  q = af / ulp  # exact: division by a power of two
  n = np.floor(q)
  frac = q - n
  if mode == "nearest":
    n = n + ((frac > 0.5) | ((frac == 0.5) & (np.mod(n, 2) == 1)))
  elif mode == "nearest_away":
    n = n + (frac >= 0.5)
  elif mode != "truncate":
    raise ValueError(mode)
  r = n * ulp
  if mode == "truncate":
    r = np.minimum(r, fmax)
  else:
    r = np.where(r > fmax, np.inf, r)
  r = np.where(finite, r, a)  # inf stays inf, NaN stays NaN
  return np.copysign(r, xd).astype(np.float32)


def round_bf16(x) -> np.ndarray:
  """Nearest-even to bfloat16 via ml_dtypes."""
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def round_f16(x) -> np.ndarray:
  """Nearest-even to float16 via NumPy."""
  with np.errstate(over="ignore"):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def neighbours(x, fmt: str) -> tuple[np.ndarray, np.ndarray]:
  """(toward zero, away from zero) neighbours of float32 ``x`` in ``fmt``."""
  lo = round_ref(x, fmt, "truncate")
  with np.errstate(invalid="ignore"):
    xd = np.asarray(x, np.float64)
  a = np.abs(lo.astype(np.float64))
  _, _, fmax = FORMATS[fmt]
  up = np.where(a >= fmax, np.inf, a + spacing(np.where(np.isfinite(a), a, 1.0), fmt))
  hi = np.where(lo.astype(np.float64) == xd, a, up)
  return lo, np.copysign(hi, xd).astype(np.float32)


# ---------------------------------------------------------------------------
# float32 arithmetic with flush-to-zero, and XLA's splits.


def flush(x, ftz: bool = True) -> np.ndarray:
  x = np.asarray(x, np.float32)
  if not ftz:
    return x
  return np.where(np.abs(x) < F32_MIN_NORMAL, np.copysign(np.float32(0), x), x)


def f32(x64, ftz: bool = True) -> np.ndarray:
  """A float64 result rounded once to float32, then flushed."""
  with np.errstate(over="ignore", invalid="ignore"):
    return flush(np.asarray(x64).astype(np.float32), ftz)


def add(a, b, ftz=True):
  a, b = flush(a, ftz), flush(b, ftz)
  with np.errstate(invalid="ignore"):
    return f32(a.astype(np.float64) + b.astype(np.float64), ftz)


def sub(a, b, ftz=True):
  a, b = flush(a, ftz), flush(b, ftz)
  with np.errstate(invalid="ignore"):
    return f32(a.astype(np.float64) - b.astype(np.float64), ftz)


def truncate_raw(x) -> np.ndarray:
  """XLA's Truncate: the bit mask 0xFFFF0000, NaN not protected."""
  return from_bits(bits(x) & np.uint32(0xFFFF0000))


def split_bf16(x, n: int, ftz: bool = True) -> list[np.ndarray]:
  """XLA's Split2xToBF16 / Split3xToBF16 (float32 arrays of bfloat16 values)."""
  x = np.asarray(x, np.float32)
  if n == 1:
    return [round_bf16(x)]
  hi = truncate_raw(x)
  rest = sub(x, hi, ftz)
  if n == 2:
    return [hi, round_bf16(rest)]
  mid = truncate_raw(rest)
  return [hi, mid, round_bf16(sub(rest, mid, ftz))]


def split_tf32(x, mode: str, ftz: bool = True) -> list[np.ndarray]:
  big = round_ref(x, "tensorfloat32", mode)
  return [big, round_ref(sub(x, big, ftz), "tensorfloat32", mode)]


# ---------------------------------------------------------------------------
# The algorithms, on any bilinear contraction (a matmul or a convolution).

# (parts of each operand, pass list [(lhs part, rhs part)], small-sum rule)
# Order of the small passes is XLA's summation order; the last pass is hi*hi.
_PASSES = {
    "bf16x3": [(1, 0), (0, 1)],
    "bf16x6": [(1, 1), (0, 2), (2, 0), (0, 1), (1, 0)],
    "bf16x9": [(2, 2), (1, 2), (2, 1), (1, 1), (2, 0), (0, 2), (1, 0), (0, 1)],
    "tf32x3": [(1, 0), (0, 1)],
}


def operand_parts(x, algorithm: str, tf32_rounding: str = "nearest",
                  ftz: bool = True) -> list[np.ndarray]:
  x = np.asarray(x, np.float32)
  if algorithm in ("bf16x1", "bf16_bf16_bf16"):
    return split_bf16(x, 1, ftz)
  if algorithm == "bf16x3":
    return split_bf16(x, 2, ftz)
  if algorithm in ("bf16x6", "bf16x9"):
    return split_bf16(x, 3, ftz)
  if algorithm == "tf32":
    return [round_ref(x, "tensorfloat32", tf32_rounding)]
  if algorithm == "tf32x3":
    return split_tf32(x, tf32_rounding, ftz)
  if algorithm in ("f16", "f16_f16_f16"):
    return [round_f16(x)]
  if algorithm == "f32":
    return [x]
  raise ValueError(algorithm)


def passes(algorithm: str) -> list[tuple[int, int]]:
  """All (lhs part, rhs part) passes, in summation order, hi*hi last."""
  return _PASSES.get(algorithm, []) + [(0, 0)]


Contract = Callable[[np.ndarray, np.ndarray], np.ndarray]


def emulate(lhs, rhs, algorithm: str, contract: Contract, *,
            tf32_rounding: str = "nearest", ftz: bool = True) -> np.ndarray:
  """What XLA computes, with each pass's matmul rounded once to float32.

  ``contract(a, b)`` is the exact bilinear op (float64 in, float64 out). With
  a contraction of length 1 every pass is a single product and this is
  bit-exact; otherwise each pass is the correctly rounded sum (real hardware
  accumulates in float32 and may differ within the bound of
  :func:`error_bound`).
  """
  lp = [flush(p, ftz).astype(np.float64)
        for p in operand_parts(lhs, algorithm, tf32_rounding, ftz)]
  rp = [flush(p, ftz).astype(np.float64)
        for p in operand_parts(rhs, algorithm, tf32_rounding, ftz)]
  with np.errstate(invalid="ignore", over="ignore"):
    vals = [f32(contract(lp[i], rp[j]), ftz) for i, j in passes(algorithm)]
  *small, hh = vals
  if small:
    s = small[0]
    for v in small[1:]:
      s = add(s, v, ftz)
    if algorithm == "bf16x9":  # Triton's ZeroNaNs: inf > |x|
      s = np.where(np.abs(s) < np.inf, s, np.float32(0))
    else:  # ReplaceNaNWithZeros: inf >= |x|
      s = np.where(np.abs(s) <= np.inf, s, np.float32(0))
    out = add(s, hh, ftz)
  else:
    out = hh
  if algorithm == "bf16_bf16_bf16":
    out = round_bf16(out)
  elif algorithm == "f16_f16_f16":
    out = round_f16(out)
  return out.astype(np.float32)


def exact(lhs, rhs, algorithm: str, contract: Contract, *,
          tf32_rounding: str = "nearest") -> tuple[np.ndarray, np.ndarray]:
  """(sum of all the algorithm's products, sum of their magnitudes), float64."""
  lp = [p.astype(np.float64) for p in operand_parts(lhs, algorithm, tf32_rounding)]
  rp = [p.astype(np.float64) for p in operand_parts(rhs, algorithm, tf32_rounding)]
  total = sum(contract(lp[i], rp[j]) for i, j in passes(algorithm))
  mag = sum(contract(np.abs(lp[i]), np.abs(rp[j])) for i, j in passes(algorithm))
  return total, mag


def error_bound(k: int, algorithm: str, magnitude: np.ndarray) -> np.ndarray:
  """Bound on |float32 result - exact sum of the same products|.

  Each pass is a float32 sum of ``k`` exact products: whatever the order
  (any binary tree of additions), its error is at most ``gamma_(k-1) * A_j``
  with ``gamma_n = n u / (1 - n u)``, ``u = 2**-24`` and ``A_j`` the sum of
  that pass's |products| (Higham, Accuracy and Stability, 2nd ed., eq. 4.4).
  Combining ``n`` passes takes ``n - 1`` more float32 additions, each off by
  at most ``u`` times a partial sum bounded by ``A = sum_j A_j`` (plus the
  errors so far). So ``|err| <= (gamma_(k-1) + (n-1) u (1 + gamma)) A``, which
  is below ``(k + n) u A`` whenever ``(k + n) u < 2**-10``; we use that, plus
  one flushed subnormal (< 2**-126) per addition.

  The same bound holds for jaxprec's ``f32`` kernel (``jaxprec/_src/emulation/passes.py``),
  which merges the ``n`` passes into at most ``n`` float32 dots of ``k``
  products each: where a merged product is not exact it rounds once (``u`` of
  itself, at most ``u A`` in all), and fewer passes mean fewer combining
  additions, so its error stays below ``(k - 1 + 1 + n - 1) u A`` < ``(k + n) u A``.
  """
  n = len(passes(algorithm))
  u = 2.0**-24
  assert (k + n) * u < 2.0**-10
  return (k + n) * u * magnitude + (k + n) * F32_MIN_NORMAL


# ---------------------------------------------------------------------------
# Exact contractions in float64.


def dot_general(dimension_numbers) -> Contract:
  """``lax.dot_general`` semantics in float64 (batch, lhs free, rhs free)."""
  (lc, rc), (lb, rb) = dimension_numbers

  def contract(a, b):
    lf = [d for d in range(a.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(b.ndim) if d not in rc and d not in rb]
    a2 = np.transpose(a, [*lb, *lf, *lc])
    b2 = np.transpose(b, [*rb, *rc, *rf])
    nb = [a.shape[d] for d in lb]
    af = [a.shape[d] for d in lf]
    bf = [b.shape[d] for d in rf]
    k = int(np.prod([a.shape[d] for d in lc], dtype=np.int64))
    a3 = a2.reshape(int(np.prod(nb, dtype=np.int64)), int(np.prod(af, dtype=np.int64)), k)
    b3 = b2.reshape(int(np.prod(nb, dtype=np.int64)), k, int(np.prod(bf, dtype=np.int64)))
    return np.matmul(a3, b3).reshape(tuple(nb + af + bf))

  return contract


def conv2d_nchw(strides, padding, lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                feature_group_count: int = 1) -> Contract:
  """``lax.conv_general_dilated`` for NCHW x OIHW -> NCHW, by explicit im2col.

  ``padding`` is a pair of (low, high) pairs; negative padding is not needed.
  """
  (pt, pb), (pl, pr) = padding

  def contract(x, w):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    g = feature_group_count
    # lhs dilation: insert (d - 1) zeros between input pixels.
    dh, dw = lhs_dilation
    xd = np.zeros((n, c, (h - 1) * dh + 1, (wd - 1) * dw + 1))
    xd[:, :, ::dh, ::dw] = x
    xp = np.pad(xd, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    rh, rw = rhs_dilation
    sh, sw = strides
    ekh, ekw = (kh - 1) * rh + 1, (kw - 1) * rw + 1
    oh = (xp.shape[2] - ekh) // sh + 1
    ow = (xp.shape[3] - ekw) // sw + 1
    # patches[n, c, i, j, y, x] = xp[n, c, y*sh + i*rh, x*sw + j*rw]
    patches = np.empty((n, c, kh, kw, oh, ow))
    for i in range(kh):
      for j in range(kw):
        patches[:, :, i, j] = xp[:, :, i * rh: i * rh + sh * (oh - 1) + 1: sh,
                                 j * rw: j * rw + sw * (ow - 1) + 1: sw]
    out = np.empty((n, o, oh, ow))
    og = o // g
    for gi in range(g):
      p = patches[:, gi * cg:(gi + 1) * cg].reshape(n, cg * kh * kw, oh * ow)
      wg = w[gi * og:(gi + 1) * og].reshape(og, cg * kh * kw)
      out[:, gi * og:(gi + 1) * og] = np.einsum("ok,nkp->nop", wg, p).reshape(
          n, og, oh, ow)
    return out

  return contract
