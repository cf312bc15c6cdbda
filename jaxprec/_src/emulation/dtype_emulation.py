"""bfloat16 and float16 compute under ``jaxprec.emulate``: one rounding per op.

XLA:CPU (jax 0.10.2) rounds bfloat16 compute once per HLO instruction, so a
jaxpr op that lowers to several instructions rounds several times, and where
the program widens a bfloat16 result its algebraic simplifier drops the
rounding under ``xla_allow_excess_precision`` (default true): the consumer
reads the unrounded float32 value (``docs/fidelity.md``, measured).

:func:`rewrite` makes one rounding per jaxpr op explicit, so that it holds on
every backend, every XLA build and every setting of the flag: an op of
:data:`ROUNDING_PRIMITIVES` or a ``convert_element_type`` from float32 with a
bfloat16/float16 result is computed in float32 and rounded once
(:func:`round_result`); a dot or convolution on such operands sums exact
products in float32 (a dot as the emulated ``BF16_BF16_F32`` /
``F16_F16_F32`` pass, on the kernel in force) and rounds once, as a TPU's MXU
or a GPU's tensor cores; a ``reduce_sum`` sums in float32 (as a TPU; XLA:CPU
would add in bfloat16). Ops that cannot round (``max``, ``neg``,
``select_n``, reshapes, ...) and other ops run as written. The table:
``docs/fidelity.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprec._src.emulation import emulated_ops
from jaxprec._src.emulation import rounding

# The low-precision compute dtypes, by numpy dtype: their rounding format.
LOW_DTYPES: dict[np.dtype, str] = {
    np.dtype(jnp.bfloat16): "bfloat16",
    np.dtype(jnp.float16): "float16",
}

# The one-pass dot algorithm of each low-precision operand dtype: exact
# products (8 x 8 or 11 x 11 significant bits fit in float32's 24), float32
# accumulation (numerics: 'bf16x1' and 'f16' on both targets).
DOT_PRESETS: dict[str, str] = {
    "bfloat16": "BF16_BF16_F32",
    "float16": "F16_F16_F32",
}

# Elementwise and reduction primitives whose result can round. Each is
# computed in float32 and rounded once when its result is bfloat16/float16.
ROUNDING_PRIMITIVES = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "integer_pow",
    "square", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "expm1", "log", "log1p",
    "logistic", "tanh", "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
    "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv",
    "lgamma", "digamma", "reduce_sum",
    # jax 0.12.1: the pi-scaled trigonometry, exp2m1 and log2p1, and
    # fmuladd, which a TPU computes for bfloat16 as a float32 fma rounded once
    # (jax.lax.fmuladd's docstring): what widening gives. Not fma: a float32
    # fma rounded again to bfloat16 rounds twice where fma rounds once, so it
    # runs as written (XLA:CPU rejects a bfloat16 or float16 fma, as JAX
    # says).
    "acospi", "asinpi", "atan2pi", "atanpi", "cospi", "sinpi", "tanpi",
    "exp2m1", "log2p1", "fmuladd",
})

_F32 = np.dtype(np.float32)
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def _np_dtype(dtype: Any) -> np.dtype | None:
  """``dtype`` as a NumPy dtype; None for JAX's extended dtypes (PRNG keys)."""
  try:
    return np.dtype(dtype)
  except TypeError:
    return None


def _low(x: Any) -> str | None:
  """The rounding format of ``x``'s dtype when it is bfloat16/float16."""
  return LOW_DTYPES.get(_np_dtype(getattr(x, "dtype", np.float32)))


def _out_dtypes(eqn) -> list[np.dtype] | None:
  """The result dtypes of ``eqn``; None when one is weakly typed (kept as is)."""
  avals = [v.aval for v in eqn.outvars]
  if any(getattr(a, "weak_type", False) for a in avals):
    return None
  dtypes = [_np_dtype(a.dtype) for a in avals]
  return None if any(d is None for d in dtypes) else dtypes


def _widen(x: Any) -> Any:
  """``x`` as float32 when it is bfloat16/float16 (exact), else unchanged."""
  return lax.convert_element_type(x, _F32) if _low(x) else x


def round_result(y: Any, dtype: Any) -> Any:
  """Float32 ``y`` rounded once to ``dtype`` (bfloat16 or float16).

  The rounding is ``lax.reduce_precision`` (bfloat16: round to nearest even,
  identical to a convert) or :func:`rounding.round_to` (float16, subnormals
  and overflow included), which XLA keeps under excess precision; the final
  convert is exact.
  """
  fmt = LOW_DTYPES[np.dtype(dtype)]
  if fmt == "bfloat16":
    y = lax.reduce_precision(y, exponent_bits=8, mantissa_bits=7)
  else:
    y = rounding.round_to(y, fmt)
  return lax.convert_element_type(y, dtype)


def rewrite(eqn, invals: Sequence[Any], *, target: str,
            **options: Any) -> list[Any] | None:
  """One rounding per op for ``eqn`` when it computes in bfloat16/float16.

  A :data:`walker.Rule <jaxprec._src.jaxpr.walker.Rule>` body for
  :func:`jaxprec.emulate`'s rule (see the module docstring for what each op
  becomes).

  Args:
    eqn: a jaxpr equation.
    invals: its input values.
    target: the emulated target ('tpu' or 'gpu').
    **options: passed to the emulated dot (``tf32_rounding``).

  Returns:
    The outputs, or None when ``eqn`` is not low-precision compute (the
    caller then handles it).
  """
  name = eqn.primitive.name
  if name in ("dot_general", "conv_general_dilated"):
    return _dot_or_conv(eqn, invals, target, options)
  outs = _out_dtypes(eqn)
  if not outs or not all(d in LOW_DTYPES for d in outs):
    return None
  if name == "convert_element_type":
    (x,) = invals
    if np.dtype(getattr(x, "dtype", None) or _F32) != _F32:
      return None  # bfloat16 <-> float16, float64: as written
    return [round_result(x, outs[0])]
  if name not in ROUNDING_PRIMITIVES:
    return None
  wide = [_widen(x) for x in invals]
  res = eqn.primitive.bind(*wide, **eqn.params)
  res = list(res) if eqn.primitive.multiple_results else [res]
  return [round_result(y, d) for y, d in zip(res, outs)]


def _dot_or_conv(eqn, invals, target: str, options: dict) -> list[Any] | None:
  """A dot or conv on two operands of one narrow format with a narrow or
  float32 result, as exact products summed in float32, rounded once; None
  for anything else."""
  lhs, rhs = invals
  fmt, outs = _low(lhs), _out_dtypes(eqn)
  if fmt is None or _low(rhs) != fmt or not outs or (
      outs[0] not in LOW_DTYPES and outs[0] != _F32):
    return None
  wide = _widen(lhs), _widen(rhs)
  if eqn.primitive.name == "dot_general":
    acc = emulated_ops.emulated_dot_general(
        *wide, eqn.params["dimension_numbers"], precision=DOT_PRESETS[fmt],
        preferred_element_type=_F32, target=target, **options)
  else:
    params = dict(eqn.params, precision=_HIGHEST, preferred_element_type=_F32)
    acc = eqn.primitive.bind(*wide, **params)
  return [acc if outs[0] == _F32 else round_result(acc, outs[0])]
