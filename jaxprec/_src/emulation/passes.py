"""The emulated algorithms as passes of a matmul or convolution, per kernel.

Each function takes ``ops(pairs)``, which runs one pass per ``(lhs, rhs)``
pair of parts (the lax op with its other arguments bound, a float32 result,
precision picked from the operand dtype) and returns the results in the order
of the pairs, the float32 operands, the TF32 rounding mode and the dtype of
bfloat16 parts. Each function asks for all its passes in one call, so that
the caller may run them as one batched matmul (one compiled kernel where
separate passes compile one each); the results are combined here, in XLA's
order, whatever ran them.

:data:`BF16` (the ``bf16`` kernel) runs one pass per pair of parts, combined as
XLA combines them: bit for bit XLA at contraction length 1.

:data:`F32` (the ``f32`` kernel) runs float32 passes on parts rounded in
float32 and merges passes (XLA's dot_algorithm_rewriter.cc, openxla/xla): X3
and TF32x3 in 2 dots, X6 and X9 in 3, each product exact or rounded once. So
its result is within ``(k + passes) * 2**-24 * sum|products|`` of the exact
sum of the algorithm's products, the bound the ``bf16`` kernel has for
contraction length ``k > 1``; it is not bit-exact.

NaN cleaning. XLA zeroes NaN (X9: every non-finite value) in the sum of the
small products before adding ``h*h``. The ``f32`` kernel cleans the operands
instead: an operand element that is not finite keeps only its high part in
the products where XLA has ``h*h``, and is zero in the small ones, so the
result equals XLA's wherever XLA's ``h*h`` sum is infinite or NaN. The terms
of each merged pass and the few differences: ``docs/emulation.md``, "The
``f32`` kernel".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprec._src.emulation.rounding import round_to, split_bf16, split_tf32

_Ops = Callable[[Sequence[tuple[jax.Array, jax.Array]]], list[jax.Array]]
_ZERO = np.float32(0)
_INF = np.float32(np.inf)
_MAX = np.finfo(np.float32).max


def _last(small: jax.Array, big: jax.Array) -> jax.Array:
  """``small + big``, the last addition of a multi-pass algorithm, stored
  (:func:`stored`), its first element added again from the addends'."""
  return stored(small + big, parts=(small, big))


def stored(total: jax.Array,
           parts: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
  """``total``, bit for bit, computed where nothing that reads it is fused in.

  As a plain op, XLA fuses a multi-pass result (or a one-pass float32 dot)
  into the ops that read it (a LayerNorm's sums, a three-operand einsum's
  second dot) and may then sum those in another order than where the result
  is read from memory, as it is across the search's ``lax.switch``
  (:mod:`jaxprec._src.search.switch`). So the result is stored through a
  dynamic-update-slice: its first element written back to itself, an
  identity on every bit that costs one element. (It is what XLA:CPU makes of
  the one-element scatter ``total.at[0].set(total[0])`` before it fuses;
  written as a dynamic-update-slice, XLA's scatter expansion and the
  simplification passes it reruns over the whole module are not needed,
  about a quarter of the HLO pass time of a multi-pass BERT-base.)
  ``tests/test_switch.py`` fails if a later XLA sees through it.

  Where ``total`` is ``parts[0] + parts[1]``, the element written back is
  that sum again, from the parts' first elements: the same float32 addition
  of the same values, so the same bits. The dynamic-update-slice then reads
  nothing of the array it updates, and XLA fuses the sum into it and updates
  in place; reading ``total``'s own first element, it wrote the sum, copied it
  and updated the copy in a fusion of its own (a copy and a fusion more per
  multi-pass op, 72 of BERT-base's 940 compiled ops at three passes, and a
  tenth of its XLA compile time; ``benchmarks/bench_emulate_bert.py``).

  Args:
    total: the result to store.
    parts: None, or the two arrays whose sum ``total`` is.
  """
  if total.size == 0:
    return total
  if total.ndim == 0:  # a scalar's scatter is the scalar itself
    return total.at[()].set(total[()])
  first = (0,) * total.ndim
  one = lambda x: lax.slice(x, first, (1,) * x.ndim)  # noqa: E731
  update = one(total) if parts is None else one(parts[0]) + one(parts[1])
  return lax.dynamic_update_slice(total, update, first)


def _where(pred: jax.Array, x: jax.Array, y: jax.Array | np.float32
           ) -> jax.Array:
  """``jnp.where(pred, x, y)`` for a float32 ``x`` and a ``y`` of its shape
  or a scalar, as one select. (``jnp.where`` lowers as a function call of
  its own, which XLA clones and inlines in every emulated op.)"""
  if np.ndim(y) == 0:
    y = lax.full_like(x, y)
  return lax.select(pred, x, y)


def _zero_nan(x: jax.Array) -> jax.Array:
  # XLA's ReplaceNaNWithZeros: select(compare(inf >= |x|), x, 0).
  return _where(lax.abs(x) <= _INF, x, _ZERO)


def _zero_nonfinite(x: jax.Array) -> jax.Array:
  # XLA's Triton ZeroNaNs: select(compare(inf > |x|), x, 0).
  return _where(lax.abs(x) < _INF, x, _ZERO)


def move(x: jax.Array, how: tuple[tuple[int, ...], tuple[int, ...]] | None
         ) -> jax.Array:
  """``x`` transposed by ``how[0]`` and reshaped to ``how[1]`` (None: ``x``)."""
  if how is None:
    return x
  perm, shape = how
  return jnp.transpose(x, perm).reshape(shape)


# ---------------------------------------------------------------------------
# The bf16 kernel: one pass per pair of parts, in XLA's order.


def _split(lhs: jax.Array, rhs: jax.Array, n: int, parts):
  return split_bf16(lhs, n, dtype=parts), split_bf16(rhs, n, dtype=parts)


def _bf16x1(ops: _Ops, lhs, rhs, _, parts) -> jax.Array:
  (l,), (r,) = _split(lhs, rhs, 1, parts)
  return ops([(l, r)])[0]


def _bf16x3(ops: _Ops, lhs, rhs, _, parts) -> jax.Array:
  (lh, ll), (rh, rl) = _split(lhs, rhs, 2, parts)
  lr, hl, hh = ops([(ll, rh), (lh, rl), (lh, rh)])
  return _last(_zero_nan(lr + hl), hh)


def _bf16x6(ops: _Ops, lhs, rhs, _, parts) -> jax.Array:
  (lh, lm, ll), (rh, rm, rl) = _split(lhs, rhs, 3, parts)
  s, *rest, hh = ops([(lm, rm), (lh, rl), (ll, rh), (lh, rm), (lm, rh),
                      (lh, rh)])
  for d in rest:
    s = s + d
  return _last(_zero_nan(s), hh)


def _bf16x9(ops: _Ops, lhs, rhs, _, parts) -> jax.Array:
  (lh, lm, ll), (rh, rm, rl) = _split(lhs, rhs, 3, parts)
  s, *rest, hh = ops([(ll, rl), (lm, rl), (ll, rm), (lm, rm), (ll, rh),
                      (lh, rl), (lm, rh), (lh, rm), (lh, rh)])
  for d in rest:
    s = s + d
  return _last(_zero_nonfinite(s), hh)


def _tf32(ops: _Ops, lhs, rhs, rounding, _) -> jax.Array:
  return ops([(round_to(lhs, "tensorfloat32", rounding),
               round_to(rhs, "tensorfloat32", rounding))])[0]


def _tf32x3(ops: _Ops, lhs, rhs, rounding, _) -> jax.Array:
  lb, ls = split_tf32(lhs, rounding)
  rb, rs = split_tf32(rhs, rounding)
  sb, bs, bb = ops([(ls, rb), (lb, rs), (lb, rb)])
  return _last(_zero_nan(sb + bs), bb)


def _f16(ops: _Ops, lhs, rhs, _, __) -> jax.Array:
  return ops([(round_to(lhs, "float16"), round_to(rhs, "float16"))])[0]


def _result_rounded(one_pass, fmt: str):
  """``one_pass`` with its result rounded to ``fmt`` (the ``*_BF16`` and
  ``*_F16`` presets)."""
  return lambda *args: round_to(one_pass(*args), fmt)


BF16 = {
    "bf16x1": _bf16x1, "bf16x3": _bf16x3, "bf16x6": _bf16x6,
    "bf16x9": _bf16x9, "tf32": _tf32, "tf32x3": _tf32x3, "f16": _f16,
    "bf16_bf16_bf16": _result_rounded(_bf16x1, "bfloat16"),
    "f16_f16_f16": _result_rounded(_f16, "float16"),
}

# ---------------------------------------------------------------------------
# The f32 kernel: merged float32 passes on operands cleaned of non-finite
# values (see the module docstring).


def _clean(x: jax.Array, n: int):
  """(finite mask, high part, lower parts zero where x is not finite), float32."""
  fin = lax.abs(x) < _INF
  hi, *rest = split_bf16(x, n, dtype=jnp.float32)
  return (fin, hi, *(_where(fin, p, _ZERO) for p in rest))


def _f32x3(ops: _Ops, lhs, rhs, _, __) -> jax.Array:
  ah, al = _clean(lhs, 2)[1:]
  fin, h, l = _clean(rhs, 2)
  # h + l is x rounded to 16 bits: 2**128 for the top 128 float32 values,
  # which float32 cannot hold; its maximum is within 2**-24 (one rounding).
  b_all = _where(fin, lax.clamp(-_MAX, h + l, _MAX), h)
  bh0 = _where(fin, h, _ZERO)
  small, big = ops([(al, bh0), (ah, b_all)])
  return _last(small, big)


def _f32x6(ops: _Ops, lhs, rhs, _, __) -> jax.Array:
  ah, am, al = _clean(lhs, 3)[1:]
  fin, h, m, l = _clean(rhs, 3)
  bh0 = _where(fin, h, _ZERO)
  bhm, b_all = bh0 + m, (h + m) + l
  lo, mid, big = ops([(al, bh0), (am, bhm), (ah, b_all)])
  return _last(lo + mid, big)


def _f32x9(ops: _Ops, lhs, rhs, _, __) -> jax.Array:
  ah, am, al = _clean(lhs, 3)[1:]
  fin, h, m, l = _clean(rhs, 3)
  b_all = (h + m) + l
  b_all0 = _where(fin, b_all, _ZERO)
  lo, mid, big = ops([(al, b_all0), (am, b_all0), (ah, b_all)])
  return _last(lo + mid, big)


def _f32_tf32x3(x: jax.Array, mode: str):
  big, small = split_tf32(x, mode)
  fin = lax.abs(big) < _INF  # also where x rounds to TF32 past float32's max
  return big, _where(fin, small, _ZERO), _where(fin, big, _ZERO)


def _f32_tf32x3_pass(ops: _Ops, lhs, rhs, rounding, _) -> jax.Array:
  lb, ls0, _ = _f32_tf32x3(lhs, rounding)
  rb, rs0, rb0 = _f32_tf32x3(rhs, rounding)
  small, big = ops([(ls0, rb0), (lb, rb + rs0)])
  return _last(small, big)


F32 = dict(BF16, bf16x3=_f32x3, bf16x6=_f32x6, bf16x9=_f32x9,
           tf32x3=_f32_tf32x3_pass)
