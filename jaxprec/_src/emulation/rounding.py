"""Bit-exact rounding of float32 values to bfloat16, TF32 and float16.

Everything here is built from ``lax.reduce_precision`` and integer operations
on the float32 bit pattern (``lax.bitcast_convert_type``), never from a
``float32 -> bfloat16 -> float32`` convert pair, which XLA's simplifier may
remove (XLA's dot_algorithm_rewriter.cc, openxla/xla). The results are float32
arrays that hold values of the narrower format, so they can be fed to float32
arithmetic.

It also holds the operand splits of XLA's multi-pass matmuls,
:func:`split_bf16` and :func:`split_tf32` (openxla/xla
``xla/service/gpu/transforms/dot_algorithm_rewriter.cc`` and
``xla/backends/gpu/codegen/triton/dot_algorithms.cc``; triton-lang/triton
``lib/Dialect/TritonGPU/Transforms/F32DotTC.cpp``).
"""

from __future__ import annotations

import functools

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprec._src.core import names

# Canonical format name -> (exponent bits, explicit mantissa bits).
FORMATS: dict[str, tuple[int, int]] = {
    "bfloat16": (8, 7),
    "tensorfloat32": (8, 10),
    "float16": (5, 10),
}
_FORMAT_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "tensorfloat32": "tensorfloat32", "tf32": "tensorfloat32",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
}
MODES = ("nearest", "nearest_away", "truncate", "stochastic")

# NumPy constants: no JAX array is created when this module is imported.
_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_EXP_ALL_ONES = np.uint32(0x7F800000)  # +inf
_QUIET = np.uint32(0x00400000)
_BF16_MASK = np.uint32(0xFFFF0000)
_F16_MIN_NORMAL = np.uint32(0x38800000)  # 2**-14
_F16_MAX = np.uint32(0x477FE000)  # 65504
_TWO_M24 = np.float32(2.0**-24)  # float16's subnormal spacing


def canonical_format(fmt: Any) -> str:
  """The canonical name of a format spelling ('bf16' -> 'bfloat16').

  Raises:
    ValueError: unknown format; the message lists the valid names.
  """
  key = fmt.strip().lower() if isinstance(fmt, str) else None
  canon = _FORMAT_ALIASES.get(key) if key else None
  if canon is None:
    raise names.unknown("format", fmt, ("bfloat16", "tensorfloat32", "float16"),
                        hint=" (aliases 'bf16', 'tf32', 'f16', 'fp16', 'half')",
                        near=_FORMAT_ALIASES)
  return canon


def _bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, jnp.uint32)


def _float(u: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(u, jnp.float32)


def _drop_low_bits(a: jax.Array, drop: int, mode: str,
                   rnd: jax.Array | None) -> jax.Array:
  """Rounds the magnitude bits ``a`` (sign cleared) to ``23 - drop`` mantissa bits.

  Works across the subnormal/normal boundary and rounds the largest finite
  values up to +inf, because positive floats are ordered like their bit
  patterns. The caller handles NaN.
  """
  mask = np.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
  if mode == "truncate":
    return a & mask
  if mode == "nearest":
    odd = jnp.right_shift(a, np.uint32(drop)) & np.uint32(1)
    return (a + np.uint32((1 << (drop - 1)) - 1) + odd) & mask
  if mode == "nearest_away":
    return (a + np.uint32(1 << (drop - 1))) & mask
  # stochastic: add `drop` uniform random bits, then truncate. The carry into
  # the kept bits happens with probability (discarded part) / (spacing).
  return (a + jnp.right_shift(rnd, np.uint32(32 - drop))) & mask


def _f16_subnormal(a: jax.Array, mode: str, rnd: jax.Array | None) -> jax.Array:
  """Rounds magnitudes below 2**-14 to float16's subnormal grid k * 2**-24.

  Returns the float32 bit pattern of the rounded magnitude.
  """
  e = jnp.right_shift(a, np.uint32(23))
  frac = a & np.uint32(0x7FFFFF)
  # value = mant * 2**(e - 150) = mant * 2**-s in units of 2**-24.
  mant = jnp.where(e == 0, frac, frac | np.uint32(0x800000))
  s = jnp.where(e == 0, np.uint32(125), np.uint32(126) - e)  # s >= 14 here
  # mant < 2**24: a shift by 31 already gives 0
  s31 = jnp.minimum(s, np.uint32(31))
  if mode == "truncate":
    k = jnp.right_shift(mant, s31)
  elif mode == "nearest":
    half_m1 = jnp.left_shift(np.uint32(1), s31 - np.uint32(1)) - np.uint32(1)
    odd = jnp.right_shift(mant, s31) & np.uint32(1)
    k = jnp.right_shift(mant + half_m1 + odd, s31)
  elif mode == "nearest_away":
    half = jnp.left_shift(np.uint32(1), s31 - np.uint32(1))
    k = jnp.right_shift(mant + half, s31)
  else:
    # s <= 31: add s uniform random bits (mant + r < 2**24 + 2**31 fits).
    # s > 31 (|x| < 2**-32): round up with probability floor(mant / 2**(s-32))
    # / 2**32, within 2**-32 of the exact probability mant / 2**s.
    r = jnp.right_shift(rnd, np.uint32(32) - s31)
    k_small = jnp.right_shift(mant + r, s31)
    thresh = jnp.right_shift(mant,
                             jnp.minimum(s - np.uint32(32), np.uint32(31)))
    k_tiny = (rnd < thresh).astype(jnp.uint32)
    k = jnp.where(s <= np.uint32(31), k_small, k_tiny)
  # k <= 1024 converts exactly; k * 2**-24 >= 2**-24 is a normal float32.
  return _bits(k.astype(jnp.float32) * _TWO_M24)


def _quiet_nan(x: jax.Array) -> jax.Array:
  """The bit pattern a narrowing convert makes of a NaN: high payload, quiet."""
  return (_bits(x) & _BF16_MASK) | _QUIET


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _rounded(x: jax.Array, key: Any, fmt: str, mode: str) -> jax.Array:
  """:func:`round_to` of float32 ``x``, arguments checked."""
  if fmt in ("bfloat16", "tensorfloat32") and mode == "nearest":
    # XLA's reduce-precision rounds to nearest even and handles subnormals,
    # overflow and inf exactly (XLA's dot_algorithm_rewriter.cc,
    # openxla/xla; tested bit for bit against ml_dtypes), and survives XLA's
    # simplifier, which a convert pair may not. It keeps a NaN's low payload
    # bits: only NaN needs a select.
    exp_bits, man_bits = FORMATS[fmt]
    r = lax.reduce_precision(x, exponent_bits=exp_bits, mantissa_bits=man_bits)
    return jnp.where(jnp.isnan(x), _float(_quiet_nan(x)), r)
  u = _bits(x)
  sign = u & _SIGN
  a = u & _ABS
  rnd = (jax.random.bits(key, x.shape, jnp.uint32) if mode == "stochastic"
         else None)
  r = _drop_low_bits(a, 23 - FORMATS[fmt][1], mode, rnd)
  if fmt == "float16":  # exponent range [2**-24, 65504]
    if mode == "truncate":
      r = jnp.minimum(r, _F16_MAX)  # toward zero never overflows
    else:
      r = jnp.where(r > _F16_MAX, _EXP_ALL_ONES, r)
    r = jnp.where(a < _F16_MIN_NORMAL, _f16_subnormal(a, mode, rnd), r)
    r = jnp.where(a == _EXP_ALL_ONES, a, r)  # +-inf stays inf
  is_nan = a > _EXP_ALL_ONES
  # A NaN stays a NaN that the narrow format can hold: keep the high payload
  # bits and set the quiet bit (as a float32 -> bfloat16 convert does).
  return _float(jnp.where(is_nan, _quiet_nan(x), r | sign))


def round_to(x: jax.typing.ArrayLike, fmt: str, mode: str = "nearest", *,
             key: Any = None) -> jax.Array:
  """Rounds float32 values to the values of a narrower float format.

  The result is a float32 array (same shape) holding values representable in
  ``fmt``. It is bit-exact: ``'nearest'`` to bfloat16 equals
  ``x.astype(ml_dtypes.bfloat16)``, to float16 equals NumPy's
  ``x.astype(np.float16)``, both widened back to float32, including subnormals
  of the narrow format, overflow to infinity and infinities. NaN stays NaN
  (a quiet NaN whose high payload bits are kept; payload bits are not compared
  bit for bit with other libraries).

  The arithmetic is integer and ``lax.reduce_precision`` only, so XLA cannot
  simplify it away and the host's flush-to-zero mode does not affect it: a
  float32 subnormal input is rounded like any other value.

  Args:
    x: a float32 array. A bfloat16 array with ``fmt`` 'bfloat16' or
      'tensorfloat32', or a float16 array with 'float16' or 'tensorfloat32',
      already holds such values and is returned unchanged.
    fmt: ``'bfloat16'`` (8 exponent, 7 mantissa bits), ``'tensorfloat32'``
      (8, 10) or ``'float16'`` (5, 10; range 2**-24 to 65504); aliases
      ``'bf16'``, ``'tf32'``, ``'f16'``, ``'fp16'``, ``'half'``.
    mode: ``'nearest'`` (ties to even), ``'nearest_away'`` (ties away from
      zero, as NVIDIA's ``cvt.rna.tf32.f32`` that XLA's TF32 matmuls use),
      ``'truncate'`` (toward zero: drop the low bits; float16 values beyond
      65504 become 65504) or ``'stochastic'`` (round up with probability
      equal to the discarded fraction of the spacing, so the result is
      unbiased; values beyond the largest finite value can round to inf).
    key: a ``jax.random`` key, required for ``'stochastic'`` and not allowed
      otherwise. A fixed key gives a fixed result.

  Differentiable in both modes: the derivative is a convert's, the tangent
  (or cotangent) rounded to ``fmt`` to nearest (``lax.reduce_precision``).

  Returns:
    A float32 array of ``x``'s shape (``x``'s dtype for the unchanged cases).

  Raises:
    ValueError: unknown ``fmt`` or ``mode``; ``'stochastic'`` without ``key``
      or ``key`` with another mode; a dtype that is not float32 (other than
      the unchanged cases above; Python floats and lists are converted to
      float32 first).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec
    >>> x = jnp.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-10])
    >>> jaxprec.round_to(x, "bf16").tolist()          # ties go to even
    [1.0, 1.015625, 1.0]
    >>> jaxprec.round_to(x, "tf32").tolist()
    [1.00390625, 1.01171875, 1.0009765625]
    >>> jaxprec.round_to(jnp.array([-1.99]), "bf16", "truncate").tolist()
    [-1.984375]
    >>> y = jaxprec.round_to(x, "bf16", "stochastic", key=jax.random.key(0))
    >>> bool(jnp.all((y == 1.0) | (y >= 1.0078125)))  # one of the two neighbours
    True
  """
  fmt = canonical_format(fmt)
  if mode not in MODES:
    raise names.unknown("rounding mode", mode, MODES)
  if mode == "stochastic" and key is None:
    raise ValueError("round_to(mode='stochastic') needs key=, a jax.random key "
                     "(for example jax.random.key(0)).")
  if mode != "stochastic" and key is not None:
    raise ValueError(f"round_to(mode={mode!r}) takes no key; key= is only for "
                     "mode='stochastic'.")
  if np.dtype(getattr(x, "dtype", np.float32)) == np.float64:
    # jnp.asarray would round a float64 NumPy array to float32 first (without
    # x64), and rounding twice is not rounding once.
    raise ValueError(
        "round_to expects a float32 array, got float64; cast to float32 first "
        "if the values are float32 values (x.astype(np.float32)).")
  x = jnp.asarray(x)
  if (x.dtype == jnp.bfloat16 and fmt in ("bfloat16", "tensorfloat32")) or (
      x.dtype == jnp.float16 and fmt in ("float16", "tensorfloat32")):
    return x  # every value of x's dtype is a value of fmt
  if x.dtype != jnp.float32:
    raise ValueError(
        f"round_to expects a float32 array, got {x.dtype}; cast to float32 "
        f"first (x.astype(jnp.float32)), which is exact for "
        f"{'any bfloat16 or float16 value' if x.dtype in (jnp.bfloat16, jnp.float16) else 'values in float32 range'}.")
  return _rounded(x, key, fmt, mode)


@_rounded.defjvp
def _rounded_jvp(fmt, mode, primals, tangents):
  # The derivative of a convert to the format, as JAX gives a convert's and a
  # reduce_precision's: the tangent rounded to the format (a linear op, its
  # own transpose). The bit arithmetic of the value itself has none.
  x, key = primals
  exp_bits, man_bits = FORMATS[fmt]
  return _rounded(x, key, fmt, mode), lax.reduce_precision(
      tangents[0], exponent_bits=exp_bits, mantissa_bits=man_bits)


# ---------------------------------------------------------------------------
# Operand splits for multi-pass matmuls.


def _truncate_bf16_raw(x: jax.Array) -> jax.Array:
  """XLA's ``Truncate``: a raw bit mask, float32 in and out.

  Unlike ``round_to(..., 'truncate')`` it does not protect NaN: a NaN whose
  payload sits in the low 16 bits becomes inf, exactly as XLA computes.
  """
  return _float(_bits(x) & _BF16_MASK)


def _rne_bf16(x: jax.Array) -> jax.Array:
  """XLA's ``RoundToBF16`` on float32: one ``reduce_precision``.

  Unlike :func:`round_to` it leaves a NaN's payload alone (a NaN stays a NaN;
  the parts only feed matmuls).
  """
  return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def split_bf16(x: jax.Array, n: int, *, dtype: Any = jnp.bfloat16
               ) -> tuple[jax.Array, ...]:
  """Splits float32 ``x`` into ``n`` bfloat16 parts as XLA's multi-pass dots do.

  ``n == 2`` (``BF16_BF16_F32_X3``, ``Split2xToBF16`` in XLA's
  ``dot_algorithm_rewriter.cc``): ``hi = truncate(x)`` (bit mask
  ``0xFFFF0000``), ``lo = rne_bf16(x - hi)``.
  ``n == 3`` (``X6`` and ``X9``, ``Split3xToBF16``): ``hi = truncate(x)``,
  ``mid = truncate(x - hi)``, ``lo = rne_bf16(x - hi - mid)``.
  ``n == 1``: ``(rne_bf16(x),)``, the single-pass ``BF16_BF16_F32`` operand.

  The subtractions are float32 operations and see the host's flush-to-zero
  mode (XLA:CPU flushes subnormals). For a finite normal ``x`` the parts add
  up to ``x`` exactly for ``n == 3`` and to ``x`` within 2**-16 relative for
  ``n == 2``. For ``x = inf`` the parts after ``hi`` are NaN (inf - inf), as
  in XLA; the matmul's NaN replacement then restores the right result.

  Args:
    x: a float32 array.
    n: 1, 2 or 3.
    dtype: ``jnp.bfloat16`` (default) or ``jnp.float32`` for float32 arrays
      holding the same bfloat16 values.

  Returns:
    A tuple of ``n`` arrays of ``dtype``, most significant first.

  Examples:
    >>> import jax.numpy as jnp, jaxprec._src.emulation.rounding as r
    >>> hi, lo = r.split_bf16(jnp.array([1 + 2.0**-9 + 2.0**-20]), 2)
    >>> float(hi[0]), float(lo[0])
    (1.0, 0.001953125)
  """
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    raise ValueError(f"split_bf16 expects a float32 array, got {x.dtype}.")
  if n not in (1, 2, 3):
    raise ValueError(f"split_bf16: n must be 1, 2 or 3, got {n!r}.")
  if np.dtype(dtype) == np.float32:
    out = lambda v: v  # noqa: E731
  elif np.dtype(dtype) == jnp.bfloat16:
    # One convert of bfloat16 values (or NaN): it cannot round. Folded with
    # a widening convert after it, the values are the same.
    out = lambda v: v.astype(jnp.bfloat16)  # noqa: E731
  else:
    raise ValueError(f"split_bf16: dtype must be bfloat16 or float32, got {dtype}.")
  if n == 1:
    return (out(_rne_bf16(x)),)
  hi = _truncate_bf16_raw(x)
  rest = x - hi
  if n == 2:
    return out(hi), out(_rne_bf16(rest))
  mid = _truncate_bf16_raw(rest)
  return out(hi), out(mid), out(_rne_bf16(rest - mid))


def split_tf32(x: jax.Array, mode: str = "nearest") -> tuple[jax.Array, jax.Array]:
  """Splits float32 ``x`` into (big, small) TF32 values for ``TF32_TF32_F32_X3``.

  As Triton's ``TF32x3`` rewrite (``F32DotTC.cpp``, used by XLA for this
  preset): ``big = tf32(x)``, ``small = x - big``; a TF32 matmul then reads
  ``small`` as TF32 too, so here ``small = tf32(x - big)``. Both roundings use
  ``mode`` (Triton's ``cvt.rna`` is ``'nearest_away'``).

  Args:
    x: a float32 array.
    mode: ``'nearest'``, ``'nearest_away'`` or ``'truncate'``.

  Returns:
    ``(big, small)``, float32 arrays holding TF32 values.
  """
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    raise ValueError(f"split_tf32 expects a float32 array, got {x.dtype}.")
  if mode not in ("nearest", "nearest_away", "truncate"):
    raise names.unknown("TF32 rounding", mode,
                        ("nearest", "nearest_away", "truncate"))
  big = round_to(x, "tensorfloat32", mode)
  return big, round_to(x - big, "tensorfloat32", mode)
