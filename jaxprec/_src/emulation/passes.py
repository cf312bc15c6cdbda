"""The emulated algorithms as passes of a matmul or convolution, per kernel.

Each function takes ``op(lhs, rhs)``, one pass (the lax op with its other
arguments bound, a float32 result, precision picked from the operand dtype),
the float32 operands, the TF32 rounding mode and the dtype of bfloat16 parts.

:data:`BF16` (the ``bf16`` kernel) runs one pass per pair of parts, combined as
XLA combines them: bit for bit XLA at contraction length 1.

:data:`F32` (the ``f32`` kernel) runs float32 passes on parts rounded in
float32 and merges passes (XLA's dot_algorithm_rewriter.cc, openxla/xla). With ``h, m,
l`` the bfloat16 parts of ``split_bf16``, ``hm = h + m`` and ``all = h + m +
l`` (exact sums: at most 16 and 24 significant bits):

* X3 (XLA: ``(l*h + h*l)``, NaN -> 0, ``+ h*h``): ``a_h*(b_h + b_l)`` then
  ``+ a_l*b_h``, 2 dots; every product is exact (8 x 16 bits), so only the
  order of the float32 additions differs.
* X6 (XLA: ``h*l + l*h + m*m + h*m + m*h``, NaN -> 0, ``+ h*h``):
  ``a_h*b_all + a_m*b_hm + a_l*b_h``, 3 dots, the same six products; the
  first (8 x 24 bits) rounds once, to float32 (at most 2**-24 relative), the
  others are exact.
* X9 (Triton: all nine products, non-finite -> 0, ``+ h*h``):
  ``a_h*b_all + a_m*b_all + a_l*b_all``, 3 dots, each product rounded once.
* TF32x3 (Triton: ``(s*b + b*s)``, NaN -> 0, ``+ b*b``): ``a_b*(b_b + b_s)
  + a_s*b_b``, 2 dots, the first product (11 x 22 bits) rounded once.
* One-pass algorithms: one float32 dot on pre-rounded operands (products
  exact, as in the ``bf16`` kernel).

So the ``f32`` kernel's result is within ``(k + passes) * 2**-24 *
sum|products|`` of the exact sum of the algorithm's products, the bound the
``bf16`` kernel has for contraction length ``k > 1``; it is not bit-exact.

NaN cleaning. XLA zeroes NaN (X9: every non-finite value) in the sum of the
small products before adding ``h*h``. Those NaN come from an operand that is
inf or NaN (its lower parts are ``inf - inf``), or from ``0 * inf`` between a
zero lower part and an infinite high part. The ``f32`` kernel cleans the
operands instead: an operand element that is not finite keeps only its high
part, ``h`` (``truncate``: inf, or the inf that XLA's mask makes of a NaN with
a low payload), in the products where XLA has ``h*h``, and is zero in the
products XLA counts among the small ones. The result then equals XLA's
wherever XLA's ``h*h`` sum is infinite or NaN. It differs only where a sum of
small products itself overflows with both signs while ``h*h`` stays finite
(magnitudes near the float32 maximum), which XLA turns into a zero and the
``f32`` kernel into a NaN. A finite operand whose parts sum past float32's
maximum (X3's ``h + l`` for the top 128 values: float32's maximum instead,
one rounding; TF32x3's ``b`` for the top 4096) is cleaned in the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxprec._src.emulation.rounding import round_to, split_bf16, split_tf32

_Op = Callable[[jax.Array, jax.Array], jax.Array]
_ZERO = np.float32(0)
_INF = np.float32(np.inf)
_MAX = np.finfo(np.float32).max


def _last(small: jax.Array, big: jax.Array) -> jax.Array:
  """``small + big``, computed where nothing that reads it is fused in.

  The last addition of a multi-pass algorithm. As a plain ``add``, XLA fuses
  it into the ops that read the result (a LayerNorm's sums, say) and may then
  sum those in another order than where the result is read from memory, as
  it is across the search's ``lax.switch`` (:mod:`jaxprec._src.search.switch`;
  measured: a few ulps after a LayerNorm, which later bfloat16 roundings
  amplify). XLA does not fuse a scatter into the ops that read it, so the sum
  is stored through one: its first element written back to itself, an
  identity on every bit that costs one element (a reduction over the sum
  and a padded ``-0.0`` also works, at about half a float32 matmul more per
  1024 x 1024 result; measured). ``tests/test_switch.py`` fails if a later
  XLA sees through it.
  """
  return stored(small + big)


def stored(total: jax.Array) -> jax.Array:
  """``total``, bit for bit, computed where nothing that reads it is fused
  in (see :func:`_last`): its first element written back to itself.

  Also the result of a one-pass float32 dot: XLA would otherwise choose that
  dot's operand order and layout for the op that reads it (a three-operand
  einsum's second dot), which sums in another order than where the result is
  read from memory, as it is across the search's ``lax.switch``.
  """
  if total.size == 0:
    return total
  first = (0,) * total.ndim
  return total.at[first].set(total[first])


def _zero_nan(x: jax.Array) -> jax.Array:
  # XLA's ReplaceNaNWithZeros: select(compare(inf >= |x|), x, 0).
  return jnp.where(jnp.abs(x) <= _INF, x, _ZERO)


def _zero_nonfinite(x: jax.Array) -> jax.Array:
  # XLA's Triton ZeroNaNs: select(compare(inf > |x|), x, 0).
  return jnp.where(jnp.abs(x) < _INF, x, _ZERO)


# ---------------------------------------------------------------------------
# Operands and their parts.


class Operand:
  """A float32 operand of a pass function: ``get(key)`` returns
  :func:`compute`'s parts of it for ``key``."""

  __slots__ = ("value",)

  def __init__(self, value: jax.Array):
    self.value = value

  def get(self, key: str) -> tuple[jax.Array, ...]:
    return compute(key, self.value)


def move(x: jax.Array, how: tuple[tuple[int, ...], tuple[int, ...]] | None
         ) -> jax.Array:
  """``x`` transposed by ``how[0]`` and reshaped to ``how[1]`` (None: ``x``)."""
  if how is None:
    return x
  perm, shape = how
  return jnp.transpose(x, perm).reshape(shape)


def _clean(x: jax.Array, n: int):
  """(finite mask, high part, lower parts zero where x is not finite), float32."""
  fin = jnp.abs(x) < _INF
  hi, *rest = split_bf16(x, n, dtype=jnp.float32)
  return (fin, hi, *(jnp.where(fin, p, _ZERO) for p in rest))


def _f32x3_lhs(x):
  _, h, l = _clean(x, 2)
  return h, l


def _f32x3_rhs(x):
  fin, h, l = _clean(x, 2)
  # h + l is x rounded to 16 bits: 2**128 for the top 128 float32 values,
  # which float32 cannot hold; its maximum is within 2**-24 (one rounding).
  b_all = jnp.where(fin, jnp.clip(h + l, -_MAX, _MAX), h)
  return jnp.where(fin, h, _ZERO), b_all


def _f32x6_lhs(x):
  return _clean(x, 3)[1:]


def _f32x6_rhs(x):
  fin, h, m, l = _clean(x, 3)
  h0 = jnp.where(fin, h, _ZERO)
  return h0, h0 + m, (h + m) + l


def _f32x9_rhs(x):
  fin, h, m, l = _clean(x, 3)
  b_all = (h + m) + l
  return jnp.where(fin, b_all, _ZERO), b_all


def _f32_tf32x3(x, mode):
  big, small = split_tf32(x, mode)
  fin = jnp.abs(big) < _INF  # also where x rounds to TF32 past float32's max
  return big, jnp.where(fin, small, _ZERO), jnp.where(fin, big, _ZERO)


_COMPUTE: dict[str, Callable[..., tuple[jax.Array, ...]]] = {
    "bf16": lambda x, n, dtype: split_bf16(x, int(n), dtype=jnp.dtype(dtype)),
    "tf32": lambda x, mode: (round_to(x, "tensorfloat32", mode),),
    "tf32x3": split_tf32,
    "f16": lambda x: (round_to(x, "float16"),),
    "f32x3_lhs": _f32x3_lhs, "f32x3_rhs": _f32x3_rhs,
    "f32x6_lhs": _f32x6_lhs, "f32x6_rhs": _f32x6_rhs, "f32x9_rhs": _f32x9_rhs,
    "f32tf32x3": _f32_tf32x3,
}


def compute(key: str, x: jax.Array) -> tuple[jax.Array, ...]:
  """The parts of float32 ``x`` that ``key`` names, e.g. ``'bf16/2/bfloat16'``
  (:func:`split_bf16` in 2 bfloat16 parts) or ``'tf32/nearest'``.

  Every part is computed by bit operations and exact float32 sums, so it is
  the same bit for bit in whatever program computes it.
  """
  kind, *args = key.split("/")
  return tuple(_COMPUTE[kind](x, *args))


def _bf16(n: int, dtype) -> str:
  return f"bf16/{n}/{np.dtype(dtype).name}"


# ---------------------------------------------------------------------------
# The bf16 kernel: one pass per pair of parts, in XLA's order.


def _bf16x1(op: _Op, lhs: Operand, rhs: Operand, _, parts) -> jax.Array:
  (l,), (r,) = lhs.get(_bf16(1, parts)), rhs.get(_bf16(1, parts))
  return op(l, r)


def _bf16x3(op: _Op, lhs: Operand, rhs: Operand, _, parts) -> jax.Array:
  lh, ll = lhs.get(_bf16(2, parts))
  rh, rl = rhs.get(_bf16(2, parts))
  low_sum = _zero_nan(op(ll, rh) + op(lh, rl))
  return _last(low_sum, op(lh, rh))


def _bf16x6(op: _Op, lhs: Operand, rhs: Operand, _, parts) -> jax.Array:
  lh, lm, ll = lhs.get(_bf16(3, parts))
  rh, rm, rl = rhs.get(_bf16(3, parts))
  s = op(lm, rm) + op(lh, rl)
  s = s + op(ll, rh)
  s = s + op(lh, rm)
  s = s + op(lm, rh)
  return _last(_zero_nan(s), op(lh, rh))


def _bf16x9(op: _Op, lhs: Operand, rhs: Operand, _, parts) -> jax.Array:
  lh, lm, ll = lhs.get(_bf16(3, parts))
  rh, rm, rl = rhs.get(_bf16(3, parts))
  s = op(ll, rl)
  for a, b in ((lm, rl), (ll, rm), (lm, rm), (ll, rh), (lh, rl), (lm, rh),
               (lh, rm)):
    s = s + op(a, b)
  return _last(_zero_nonfinite(s), op(lh, rh))


def _tf32(op: _Op, lhs: Operand, rhs: Operand, rounding, _) -> jax.Array:
  (l,), (r,) = lhs.get(f"tf32/{rounding}"), rhs.get(f"tf32/{rounding}")
  return op(l, r)


def _tf32x3(op: _Op, lhs: Operand, rhs: Operand, rounding, _) -> jax.Array:
  lb, ls = lhs.get(f"tf32x3/{rounding}")
  rb, rs = rhs.get(f"tf32x3/{rounding}")
  small = _zero_nan(op(ls, rb) + op(lb, rs))
  return _last(small, op(lb, rb))


def _f16(op: _Op, lhs: Operand, rhs: Operand, _, __) -> jax.Array:
  (l,), (r,) = lhs.get("f16"), rhs.get("f16")
  return op(l, r)


def _bf16_out(op: _Op, lhs, rhs, r, parts) -> jax.Array:
  return round_to(_bf16x1(op, lhs, rhs, r, parts), "bfloat16")


def _f16_out(op: _Op, lhs, rhs, r, parts) -> jax.Array:
  return round_to(_f16(op, lhs, rhs, r, parts), "float16")


BF16 = {
    "bf16x1": _bf16x1, "bf16x3": _bf16x3, "bf16x6": _bf16x6,
    "bf16x9": _bf16x9, "tf32": _tf32, "tf32x3": _tf32x3, "f16": _f16,
    "bf16_bf16_bf16": _bf16_out, "f16_f16_f16": _f16_out,
}

# ---------------------------------------------------------------------------
# The f32 kernel: merged float32 passes on operands cleaned of non-finite
# values (see the module docstring). Each operand's parts, and the exact sums
# of them that the merged passes read, are one key (so they are prepared
# together).


def _f32x3(op: _Op, lhs: Operand, rhs: Operand, _, __) -> jax.Array:
  ah, al = lhs.get("f32x3_lhs")
  bh0, b_all = rhs.get("f32x3_rhs")
  return _last(op(al, bh0), op(ah, b_all))


def _f32x6(op: _Op, lhs: Operand, rhs: Operand, _, __) -> jax.Array:
  ah, am, al = lhs.get("f32x6_lhs")
  bh0, bhm, b_all = rhs.get("f32x6_rhs")
  s = op(al, bh0) + op(am, bhm)
  return _last(s, op(ah, b_all))


def _f32x9(op: _Op, lhs: Operand, rhs: Operand, _, __) -> jax.Array:
  ah, am, al = lhs.get("f32x6_lhs")
  b_all0, b_all = rhs.get("f32x9_rhs")
  s = op(al, b_all0) + op(am, b_all0)
  return _last(s, op(ah, b_all))


def _f32_tf32x3_pass(op: _Op, lhs: Operand, rhs: Operand, rounding, _
                     ) -> jax.Array:
  lb, ls0, _ = lhs.get(f"f32tf32x3/{rounding}")
  rb, rs0, rb0 = rhs.get(f"f32tf32x3/{rounding}")
  small = op(ls0, rb0)
  return _last(small, op(lb, rb + rs0))


F32 = dict(BF16, bf16x3=_f32x3, bf16x6=_f32x6, bf16x9=_f32x9,
           tf32x3=_f32_tf32x3_pass)
