"""NVIDIA tensor-core arithmetic per chip: what an MMA instruction computes.

jaxprec's default GPU model is the algorithm's definition: operands rounded
to TF32, bfloat16 or float16, exact products, an IEEE float32 sum rounded to
nearest. A tensor core computes something else. MMA-Sim (Microsoft Research,
"MMA-Sim: Bit-Accurate Reference Model of Tensor Cores and Matrix Cores",
arXiv 2511.10909; source: the ``mmasim`` package on PyPI, 2.1.1,
``mmasim/arithmetic/fdpa.py`` ``MMA_T_FDPA``/``t_fdpa`` and
``mmasim/nv_ptx/sim.py``), validated bitwise against the hardware, models one
instruction as a *truncated fused dot-product-add*:

1. The operands of one group of ``L`` products (:attr:`Accumulation.group`:
   16 bytes of operands per group on Ampere, 32 on Hopper and Blackwell) are
   split into significand ``s`` (``1 <= |s| < 2``; subnormals keep the
   format's smallest exponent and ``|s| < 1``) and exponent ``e``. The
   products ``s_a * s_b`` are exact; their exponents are ``e_a + e_b``. The
   accumulator ``c`` (float32) is one more term. A zero term has exponent
   :attr:`Accumulation.e_zero`.
2. Every term is aligned to the largest exponent ``e_max`` of the group and
   truncated to ``F`` fraction bits below it
   (:attr:`Accumulation.fraction_bits`:
   24 on Ampere, 25 on Hopper and Blackwell, 13 for Hopper's float8), then
   the terms are summed exactly.
3. The sum is rounded toward zero into float32 (``RZ-FP32``), or, for
   Hopper's float8 ``wgmma``, into 13 fraction bits with float32's exponent
   range (``RZ-E8M13``). An exact zero is ``+0``. A sum past float32's range
   is infinite. A NaN anywhere, ``inf * 0`` or ``inf - inf`` give the NaN
   ``0x7FFFFFFF``.

A dot of contraction length ``K`` chains the groups in instruction order,
``c`` starting at ``+0``; ``K`` is padded with zeros to a whole group, as the
instruction's ``k`` is (a group of zero products leaves ``c`` unchanged).

Everything here is integer arithmetic on the float32 bit patterns (the
aligned terms are integers below ``2**27``, their sums below ``2**32``): no
float operation runs, so a CPU that flushes subnormals (XLA:CPU does) still
computes the model bit for bit. It is vectorized over the output and runs
the groups in a ``lax.scan``; it composes with ``jax.jit`` and ``jax.vmap``
(the emulated op that calls it has its own derivative and batching rules).

What is not modelled: how a library splits ``K`` over thread blocks (split-K
or stream-K sums partial results in float32 at the end), and the order in
which a convolution's implicit GEMM walks its filter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprec._src.core import algorithms
from jaxprec._src.core import names

# The chips jaxprec models, and the architecture MMA-Sim names for each.
CHIPS: Mapping[str, str] = {"a100": "Ampere", "h100": "Hopper",
                            "b200": "Blackwell"}
# Operand formats: (fraction bits, exponent of the smallest normal, i.e. the
# exponent subnormals keep) as MMA-Sim's frexp_and_normalize reads them
# (mmasim/arithmetic/helper.py, dtype_subnormal_exponent; TF32 as float32).
FORMATS: Mapping[str, tuple[int, int]] = {
    "tf32": (10, -126), "bf16": (7, -126), "f16": (10, -14),
    "e4m3": (3, -6), "e5m2": (2, -14),
}
# Bytes per operand element, for the group size (16 or 32 bytes).
_BYTES = {"tf32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e5m2": 1}
# The float8 dtypes the model takes, by JAX dtype name.
FLOAT8_FORMATS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
# The float8 presets' promotion interval (contraction elements accumulated in
# the tensor core before they are added to a float32 sum) when no
# fp8_promotion_interval is given: 4 wgmma instructions of k = 32, the
# interval of the DeepSeek-V3 technical report (arXiv 2412.19437, section
# 3.3.2, "N_C = 128 elements, equivalent to 4 WGMMAs") and CUTLASS's
# default mma_promotion_interval of 4.
FP8_PROMOTION_INTERVAL = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accumulation:
  """How one chip's tensor cores multiply one operand format (MMA-Sim's
  ``MMA_T_FDPA`` parameters, ``mmasim/nv_ptx/sim.py``).

  Attributes:
    chip: ``'a100'``, ``'h100'`` or ``'b200'``.
    fmt: the operand format (``'tf32'``, ``'bf16'``, ``'f16'``, ``'e4m3'``,
      ``'e5m2'``; float8 operands may mix the two).
    instruction: the PTX instruction the chip runs it with.
    k: the instruction's contraction length.
    group: products fused per addition (MMA-Sim's ``L_max``).
    fraction_bits: bits kept below the largest exponent (MMA-Sim's ``F``).
    result_bits: fraction bits of the rounded sum: 23 (``RZ-FP32``) or 13
      (``RZ-E8M13``).
    e_zero: the exponent a zero term takes.
  """

  chip: str
  fmt: str
  instruction: str
  k: int
  group: int
  fraction_bits: int
  result_bits: int
  e_zero: int

  @property
  def narrow(self) -> bool:
    """Whether the accumulator is narrower than float32 (Hopper's float8)."""
    return self.result_bits < 23


# The instruction's k per format (the PTX ISA's mma and wgmma shapes).
_K = {"tf32": 8, "bf16": 16, "f16": 16, "e4m3": 32, "e5m2": 32}


def check_chip(chip: object, *, kind: str = "chip") -> str:
  """The one of :data:`CHIPS` that ``chip`` names (any letter case, spaces
  stripped, as a target); a ValueError naming them else (``Unknown {kind}
  ...``)."""
  return names.check_choice(chip, tuple(CHIPS), kind)


def accumulation(chip: str, fmt: str) -> Accumulation:
  """The :class:`Accumulation` of ``chip`` for operands of format ``fmt``.

  From MMA-Sim's ``mmasim/nv_ptx/sim.py``: ``MMA`` on Ampere (``F = 24``,
  16 bytes per group, zero exponent -132), ``WGMMA`` on Hopper (``F = 25``,
  32 bytes, -133; float8: ``F = 13`` into ``RZ-E8M13``), ``TCGen05MMA`` on
  Blackwell (``F = 25``, 32 bytes, -133, float8 included).

  Raises:
    ValueError: unknown chip or format.
    NotImplementedError: the chip has no tensor-core instruction for the
      format (float8 on an A100).
  """
  check_chip(chip)
  if fmt not in FORMATS:
    raise names.unknown("tensor-core operand format", fmt, FORMATS)
  fp8 = fmt in ("e4m3", "e5m2")
  k = _K[fmt]
  if chip == "a100":
    if fp8:
      raise NotImplementedError(
          "An A100 (Ampere) has no float8 tensor-core instruction; float8 "
          "operands run on chip='h100' or chip='b200'.")
    what = {"tf32": "m16n8k8.f32.tf32.tf32.f32",
            "bf16": "m16n8k16.f32.bf16.bf16.f32",
            "f16": "m16n8k16.f32.f16.f16.f32"}[fmt]
    return Accumulation(chip=chip, fmt=fmt, instruction=f"mma.sync {what}",
                        k=k, group=16 // _BYTES[fmt], fraction_bits=24,
                        result_bits=23, e_zero=-132)
  group = 32 // _BYTES[fmt]
  if chip == "h100":
    return Accumulation(chip=chip, fmt=fmt,
                        instruction=f"wgmma m64nNk{k}.f32.{fmt}.{fmt}", k=k,
                        group=group, fraction_bits=13 if fp8 else 25,
                        result_bits=13 if fp8 else 23, e_zero=-133)
  kind = "tf32" if fmt == "tf32" else ("f8f6f4" if fp8 else "f16")
  return Accumulation(chip=chip, fmt=fmt,
                      instruction=f"tcgen05.mma m128nNk{k}.kind::{kind}",
                      k=k, group=group, fraction_bits=25, result_bits=23,
                      e_zero=-133)


# ---------------------------------------------------------------------------
# Bit-level pieces (uint32 / int32 arithmetic only).

_U = jnp.uint32
_I = jnp.int32


def _shr(x: jax.Array, n: jax.Array) -> jax.Array:
  """``x >> n`` for uint32 ``x`` and any int32 ``n >= 0`` (0 past 31)."""
  big = n > 31
  return jnp.where(big, _U(0),
                   lax.shift_right_logical(x, jnp.clip(n, 0, 31).astype(_U)))


def _shl(x: jax.Array, n: jax.Array) -> jax.Array:
  """``x << n`` for uint32 ``x`` and ``0 <= n <= 31``."""
  return lax.shift_left(x, jnp.clip(n, 0, 31).astype(_U))


def _shift(x: jax.Array, n: jax.Array) -> jax.Array:
  """``trunc(x * 2**-n)``: right by ``n`` where ``n >= 0``, else left."""
  return jnp.where(n >= 0, _shr(x, n), _shl(x, -n))


@dataclasses.dataclass(frozen=True)
class _Decoded:
  """float32 values as ``(-1)**sign * sig * 2**(exp - frac)``, the format's
  subnormals at its smallest exponent; special values flagged (their
  ``sig`` is 0)."""

  sign: jax.Array  # uint32, 0 or 1
  sig: jax.Array  # uint32
  exp: jax.Array  # int32
  nan: jax.Array  # bool
  inf: jax.Array  # bool


def _decode(bits: jax.Array, frac: int, e_min: int) -> _Decoded:
  """float32 bit patterns read as a format with ``frac`` fraction bits and
  smallest normal exponent ``e_min`` (lower bits truncated, as a tensor
  core reads unrounded TF32)."""
  sign = lax.shift_right_logical(bits, _U(31))
  be = (lax.shift_right_logical(bits, _U(23)) & _U(0xFF)).astype(_I)
  m = bits & _U(0x7FFFFF)
  special = be == 255
  e_true = jnp.maximum(be, 1) - 127
  sig24 = jnp.where(be == 0, m, m | _U(0x800000))
  exp = jnp.maximum(e_true, e_min)
  sig = _shr(sig24, (23 - frac) + (exp - e_true))
  sig = jnp.where(special, _U(0), sig)
  return _Decoded(sign, sig, exp, special & (m != 0), special & (m == 0))


def _encode(mag: jax.Array, q: jax.Array, sign: jax.Array,
            result_bits: int) -> jax.Array:
  """float32 bits of ``(-1)**sign * mag * 2**q`` rounded toward zero to
  ``result_bits`` fraction bits (float32's exponent range, its subnormals at
  ``2**(-126 - result_bits)``), infinite past float32's range, ``+0`` for 0
  (MMA-Sim's ``ldexp_and_normalize``, ``RZ-FP32`` and ``RZ-E8M13``)."""
  p = 31 - lax.clz(mag).astype(_I)  # the leading bit
  e = p + q
  mant = _shift(mag, p - 23) & _U(0x7FFFFF)
  normal = lax.shift_left((e + 127).astype(_U), _U(23)) | mant
  sub = _shift(mag, -(q + 149))
  out = jnp.where(e >= -126, normal, sub)
  out = out & _U((0xFFFFFFFF << (23 - result_bits)) & 0xFFFFFFFF)
  out = jnp.where(e > 127, _U(0x7F800000), out)
  out = out | lax.shift_left(sign, _U(31))
  return jnp.where(mag == 0, _U(0), out)


def _fdpa_step(acc: Accumulation, fa: int, fb: int,
               c: jax.Array, a: _Decoded, b: _Decoded) -> jax.Array:
  """One truncated fused dot-product-add: ``c`` (float32 bits, ``[..., M,
  N]``) plus the products of ``a`` (``[..., M, L]``) and ``b`` (``[..., N,
  L]``); MMA-Sim's ``t_fdpa``."""
  F = acc.fraction_bits
  ex = lambda x, ax: jnp.expand_dims(x, ax)  # noqa: E731
  sig = ex(a.sig, -2) * ex(b.sig, -3)  # [..., M, N, L], below 2**22
  exp = ex(a.exp, -2) + ex(b.exp, -3)
  sign = ex(a.sign, -2) ^ ex(b.sign, -3)
  a_zero = (a.sig == 0) & ~a.nan & ~a.inf
  b_zero = (b.sig == 0) & ~b.nan & ~b.inf
  nan = (ex(a.nan, -2) | ex(b.nan, -3) | (ex(a.inf, -2) & ex(b_zero, -3))
         | (ex(a_zero, -2) & ex(b.inf, -3)))
  inf = (ex(a.inf, -2) | ex(b.inf, -3)) & ~nan
  exp = jnp.where(sig == 0, acc.e_zero, exp)

  cd = _decode(c, 23, -126)
  c_exp = jnp.where(cd.sig == 0, acc.e_zero, cd.exp)
  e_max = jnp.maximum(jnp.max(exp, axis=-1), c_exp)
  terms = _shift(sig, ex(e_max, -1) - exp + (fa + fb) - F)
  c_term = _shift(cd.sig, e_max - c_exp + 23 - F)
  # Positive and negative sums apart: each below 2**32 (a term is below
  # 2**(F + 2), at most 32 of them, and float8's products below 3.6 * 2**F).
  pos = jnp.sum(jnp.where(sign == 0, terms, _U(0)), axis=-1, dtype=_U)
  neg = jnp.sum(jnp.where(sign == 0, _U(0), terms), axis=-1, dtype=_U)
  pos = pos + jnp.where(cd.sign == 0, c_term, _U(0))
  neg = neg + jnp.where(cd.sign == 0, _U(0), c_term)
  mag = jnp.where(pos >= neg, pos - neg, neg - pos)
  out = _encode(mag, e_max - F, (pos < neg).astype(_U), acc.result_bits)

  pos_inf = jnp.any(inf & (sign == 0), axis=-1) | (cd.inf & (cd.sign == 0))
  neg_inf = jnp.any(inf & (sign == 1), axis=-1) | (cd.inf & (cd.sign == 1))
  nan_out = jnp.any(nan, axis=-1) | cd.nan | (pos_inf & neg_inf)
  out = jnp.where(pos_inf, _U(0x7F800000), out)
  out = jnp.where(neg_inf, _U(0xFF800000), out)
  return jnp.where(nan_out, _U(0x7FFFFFFF), out)


def _bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x.astype(jnp.float32), _U)


def _fmt_of(fmt: str | tuple[str, str]) -> tuple[str, str]:
  return (fmt, fmt) if isinstance(fmt, str) else tuple(fmt)


def chip_dot(lhs: jax.Array, rhs: jax.Array, chip: str,
             fmt: str | tuple[str, str], *, interval: int = 0) -> jax.Array:
  """``lhs @ rhs`` (``[..., M, K] x [..., K, N]``, float32 holding values of
  ``fmt``) as ``chip``'s tensor cores compute it, float32 result.

  Args:
    lhs, rhs: the operands, any real dtype whose values ``fmt`` holds (other
      values are truncated to it, as a tensor core reads them).
    chip: one of :data:`CHIPS`.
    fmt: the operand format, or ``(lhs format, rhs format)`` for mixed
      float8 (``('e4m3', 'e5m2')``).
    interval: 0 to chain the whole ``K`` in the tensor core's accumulator;
      otherwise the accumulator is promoted every ``interval`` contraction
      elements (a multiple of the group): each chunk is accumulated from
      ``+0`` and added to a float32 sum with round to nearest (the
      non-``FAST_ACCUM`` float8 presets).

  Returns:
    float32 ``[..., M, N]``.
  """
  fl, fr = _fmt_of(fmt)
  acc = accumulation(chip, fl)
  if fl != fr:
    acc_r = accumulation(chip, fr)
    if (acc_r.group, acc_r.fraction_bits) != (acc.group, acc.fraction_bits):
      raise ValueError(f"Operand formats {fl} and {fr} do not share a "
                       f"tensor-core instruction on {chip}.")
  (fa, ea), (fb, eb) = FORMATS[fl], FORMATS[fr]
  *batch, m, k = lhs.shape
  n = rhs.shape[-1]
  L = acc.group
  if interval and interval % L:
    raise ValueError(f"fp8_promotion_interval={interval} is not a multiple "
                     f"of {chip}'s group of {L} products.")
  chunk = interval or max(k, 1)
  chunks = -(-k // chunk) if k else 1
  pad = chunks * chunk
  pad = -(-pad // L) * L
  a = _bits(lhs)
  b = _bits(jnp.swapaxes(rhs, -1, -2))  # [..., N, K]
  if pad != k:
    widths = [(0, 0)] * len(batch) + [(0, 0), (0, pad - k)]
    a, b = jnp.pad(a, widths), jnp.pad(b, widths)
  groups = pad // L

  def split(x):  # [..., R, pad] -> [groups, ..., R, L]
    x = x.reshape(*x.shape[:-1], groups, L)
    return jnp.moveaxis(x, -2, 0)

  per_chunk = max(chunk // L, 1) if interval else groups
  zero = jnp.zeros((*batch, m, n), _U)

  def step(state, xs):
    c, total, i = state
    ga, gb = xs
    c = _fdpa_step(acc, fa, fb, c, _decode(ga, fa, ea), _decode(gb, fb, eb))
    if interval:
      done = (i + 1) % per_chunk == 0
      total = jnp.where(done, total + lax.bitcast_convert_type(c, jnp.float32),
                        total)
      c = jnp.where(done, _U(0), c)
    return (c, total, i + 1), None

  total0 = jnp.zeros((*batch, m, n), jnp.float32)
  (c, total, _), _ = lax.scan(step, (zero, total0, jnp.int32(0)),
                              (split(a), split(b)))
  if interval:
    return total
  return lax.bitcast_convert_type(c, jnp.float32)


# The tensor-core format of each pass format of jaxprec's algorithm table
# (jaxprec._src.core.algorithms, Numerics.pass_format).
_PASS_FORMATS = {"tensorfloat32": "tf32", "bfloat16": "bf16", "float16": "f16"}


def operand_formats(algorithm: str, lhs_dtype, rhs_dtype
                    ) -> tuple[str, str] | None:
  """The tensor-core operand formats of one pass of ``algorithm`` on
  operands of these dtypes: the algorithm's pass format, or for ``'f8'``
  each float8 operand's own (None where an operand is not float8: a float8
  preset's transposed dot, which no float8 instruction reads).

  Raises:
    NotImplementedError: an algorithm or float8 type no tensor core runs
      (``'f32'`` runs on CUDA cores; the float8 types other than
      ``float8_e4m3fn`` and ``float8_e5m2``).
  """
  if algorithm == "f8":
    got = [np.dtype(d).name for d in (lhs_dtype, rhs_dtype)]
    if not all(g.startswith("float8") for g in got):
      return None
    bad = [g for g in got if g not in FLOAT8_FORMATS]
    if bad:
      raise NotImplementedError(
          f"No tensor-core model for {bad[0]} operands: the chip models take "
          f"{' and '.join(FLOAT8_FORMATS)} (MMA-Sim's e4m3 and e5m2).")
    return FLOAT8_FORMATS[got[0]], FLOAT8_FORMATS[got[1]]
  fmt = _PASS_FORMATS.get(algorithms.record(algorithm).pass_format)
  if fmt is None:
    raise NotImplementedError(
        f"Algorithm {algorithm!r} does not run on tensor cores; the chip "
        f"models take the algorithms whose passes multiply TF32, bfloat16, "
        f"float16 or float8 values ({', '.join(chip_algorithms())}).")
  return fmt, fmt


def chip_algorithms() -> tuple[str, ...]:
  """The algorithms whose passes a chip model computes."""
  return tuple(a for a, r in algorithms.RECORDS.items()
               if r.pass_format in _PASS_FORMATS or a == "f8")
