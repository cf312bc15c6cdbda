"""Matmuls and convolutions computed as a TPU or an NVIDIA GPU computes them.

:func:`emulated_dot_general` and :func:`emulated_conv_general_dilated` take the
arguments of ``lax.dot_general`` and ``lax.conv_general_dilated`` (so they can
be passed to Flax as ``dot_general=`` / ``conv_general_dilated=``) and compute,
on any backend, what the target computes for float32 operands at the given
precision. Each is one JAX primitive that lowers to ordinary lax operations,
so it composes with ``jax.jit``, ``jax.vmap`` and differentiation in either
mode; its tangent and transposed matmuls are emulated at the same algorithm
(the transposed matmuls of a TPU carry the forward's precision).

The algorithms, by the name :func:`algorithm_for` returns (``'bf16x1'``,
``'bf16x3'``, ``'bf16x6'``, ``'bf16x9'``, ``'tf32'``, ``'tf32x3'``, ``'f16'``,
``'f16_f16_f16'``, ``'bf16_bf16_bf16'``, ``'f32'``, and ``'native'``: the lax
op unchanged), follow their primary sources: the ``jax.lax.Precision`` docs
and JAX's ``tests/lax_test.py``; XLA's ``RewriteF32ToBF16X3``/``X6``
(openxla/xla, ``xla/service/gpu/transforms/dot_algorithm_rewriter.cc``) and
``EmitBF16x9Matmul`` (``xla/backends/gpu/codegen/triton/dot_algorithms.cc``);
Triton's ``TF32x3`` (``F32DotTC.cpp``); NVIDIA's TF32 documentation, as XLA
rounds it. Each pass, its order and its NaN handling are in
:mod:`jaxprec._src.emulation.passes`; the table of what each target runs is
``docs/semantics.md``, and how the passes run is ``docs/emulation.md``.

Faithfulness. Every pass is a real matmul whose products are exact (a product
of two bfloat16 values has at most 16 significant bits; of two TF32 or float16
values at most 22) and whose sums are float32, combined as XLA combines them
(the bound: :func:`emulated_dot_general`). Arithmetic runs in the host's
float32 mode: XLA:CPU flushes subnormal inputs and results to zero (as TPUs
do).

Two GPU models. Without a chip (the default), ``target='gpu'`` computes the
algorithm's definition: exact products of the rounded operands summed in
float32 with round to nearest, the same on every chip. With ``chip='a100'``,
``'h100'`` or ``'b200'`` each pass is computed as that chip's tensor cores
compute it (:mod:`jaxprec._src.emulation.tensor_cores`, after MMA-Sim, arXiv
2511.10909): truncated fused dot-products in instruction order, rounded
toward zero; the chip is part of the op's static spec, so every cache keys
on it (``docs/gpu.md``).

Kernels. All the above holds on the ``bf16`` kernel; the ``f32`` kernel
merges passes into float32 dots, within the same bound at every contraction
length but not bit-exact (:mod:`jaxprec._src.emulation.kernels`,
:mod:`jaxprec._src.emulation.passes`, ``docs/emulation.md``). The kernel in
force is read when the op is traced and is part of ``jax.jit``'s key.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from jaxprec._src.emulation import kernels
from jaxprec._src.emulation import passes
from jaxprec._src.emulation import tensor_cores
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import walker
from jaxprec._src.core import numerics
from jaxprec._src.core.numerics import (PASSES, algorithm_for,
                                        check_target, emulatable, is_float8,
                                        shape_rule)
from jaxprec._src.core import names
from jaxprec._src.core.precision import PrecisionLike, resolve

TF32_ROUNDINGS = ("nearest", "nearest_away", "truncate")
# The name of jaxprec's own emulated op, a JAX primitive (see
# :func:`is_emulated_call`), and of the name scope it is bound in (it shows in
# profiles). ``jaxprec.emulate`` binds such ops unchanged, never twice.
MARKER = "jaxprec_emulated"

_P = lax.Precision
# Inner passes: bfloat16 operands at DEFAULT; float32 operands holding TF32 or
# float16 values at HIGHEST, so that no backend rounds them again.
_LOW = (_P.DEFAULT, _P.DEFAULT)
_EXACT = (_P.HIGHEST, _P.HIGHEST)


# ---------------------------------------------------------------------------
# What is static about one emulated op.


def _hashable(x: Any) -> bool:
  """False for a spec holding a parameter JAX itself would not take as static:
  it is then neither cached nor a ``jax.jit`` static argument."""
  try:
    hash(x)
  except TypeError:
    return False
  return True


def _freeze(x: Any) -> Any:
  if isinstance(x, list):
    x = tuple(x)
  if isinstance(x, tuple) and not hasattr(x, "_fields"):
    return tuple(_freeze(v) for v in x)
  return x


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one emulated op (hashable: a nondiff argument)."""

  op: str  # 'dot_general' or 'conv_general_dilated'
  params: tuple[tuple[str, Any], ...]  # the lax op's other arguments
  preferred_element_type: Any
  out_dtype: np.dtype
  algorithm: str
  tf32_rounding: str
  contraction: int = 0  # products summed per output element
  kernel: str = "bf16"  # 'bf16' or 'f32' (jaxprec._src.emulation.kernels)
  # (lhs, rhs): read behind an optimization barrier (a transpose made it).
  guard: tuple[bool, bool] = (False, False)
  # The GPU chip whose tensor cores compute each pass (None: the
  # algorithm's definition, float32 sums rounded to nearest;
  # jaxprec._src.emulation.tensor_cores), and for float8 operands the
  # contraction elements between promotions to float32 (0: none).
  chip: str | None = None
  fp8_interval: int = 0
  # A dot's (algorithm, precision, target, tpu_matvec_f32) where XLA's shape
  # rules may make its target compute it in float32
  # (jaxprec._src.core.numerics.shape_rule): its batched and transposed dots
  # decide again on their own shapes, as the target's compiler sees them
  # (jax.vmap of a matrix·vector product is a matrix product). ``algorithm``
  # is then ``'f32'`` where the rule holds for this dot's shapes.
  rule: tuple[str, Any, str, bool] | None = None

  def lax_op(self) -> Callable[..., jax.Array]:
    fn = lax.dot_general if self.op == "dot_general" else lax.conv_general_dilated
    return functools.partial(fn, **dict(self.params))


def _make_spec(op: str, params: Mapping[str, Any], lhs, rhs,
               preferred_element_type, algorithm: str,
               tf32_rounding: str, kernel: str,
               guard: tuple[bool, bool] = (False, False),
               chip: str | None = None, fp8_interval: int = 0,
               rule: tuple[str, Any, str, bool] | None = None) -> _Spec:
  params = tuple(sorted((k, _freeze(v)) for k, v in params.items()))
  if chip is not None:
    kernel = "bf16"  # the chip's passes run on neither kernel
  spec = _Spec(op, params, preferred_element_type, np.dtype(np.float32),
               algorithm, tf32_rounding, kernel=kernel,
               guard=(bool(guard[0]), bool(guard[1])), chip=chip,
               fp8_interval=int(fp8_interval), rule=rule)
  complete = _complete if _hashable(spec) else _complete.__wrapped__
  return complete(spec, tuple(lhs.shape), np.dtype(lhs.dtype),
                  tuple(rhs.shape), np.dtype(rhs.dtype))


@functools.lru_cache(maxsize=4096)
def _complete(spec: _Spec, lhs_shape, lhs_dtype, rhs_shape, rhs_dtype) -> _Spec:
  """``spec`` with its result dtype and contraction length (cached: a model
  repeats the same op signature in every layer, and tracing it is slow)."""
  # The native op's result type (and its shape checks, with lax's messages).
  out = jax.eval_shape(
      _native(spec), jax.ShapeDtypeStruct(lhs_shape, lhs_dtype),
      jax.ShapeDtypeStruct(rhs_shape, rhs_dtype))
  return dataclasses.replace(spec, out_dtype=np.dtype(out.dtype),
                             contraction=_contraction(spec, lhs_shape, rhs_shape))


def _contraction(spec: _Spec, lhs_shape, rhs_shape) -> int:
  """How many products each output element sums."""
  params = dict(spec.params)
  if spec.op == "dot_general":
    (lc, _), _ = params["dimension_numbers"]
    return int(np.prod([lhs_shape[d] for d in lc], dtype=np.int64))
  dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape,
                                  params["dimension_numbers"])
  rhs_spec = dn.rhs_spec  # (out feature, in feature, *spatial)
  return int(np.prod([rhs_shape[d] for d in rhs_spec[1:]], dtype=np.int64))


def _canonical_dot(lhs_shape, rhs_shape, dimension_numbers):
  """Any dot_general as (B,) M x K times (B,) K x N.

  Returns ``(lhs_move, rhs_move, dimension_numbers, out_shape)``: each
  operand's data movement into that form (:func:`passes.move`), the form's
  dimension numbers and the result's shape. XLA:CPU runs a bfloat16 x
  bfloat16 -> float32 dot only in some layouts (it rejects, e.g., a lhs
  contracted on its first axis times a rhs with two free axes: "Unsupported
  element type for DotThunk"); this form, and what ``jax.vmap`` makes of it,
  always runs (tested).
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  size = lambda shape, dims: int(np.prod([shape[d] for d in dims], dtype=np.int64))  # noqa: E731
  b, m = size(lhs_shape, lb), size(lhs_shape, lf)
  k, n = size(lhs_shape, lc), size(rhs_shape, rf)
  out_shape = tuple([lhs_shape[d] for d in lb] + [lhs_shape[d] for d in lf] +
                    [rhs_shape[d] for d in rf])
  lhs_form, rhs_form = ((b, m, k), (b, k, n)) if lb else ((m, k), (k, n))
  dn = (((2,), (1,)), ((0,), (0,))) if lb else (((1,), (0,)), ((), ()))
  return (((*lb, *lf, *lc), lhs_form), ((*rb, *rc, *rf), rhs_form), dn,
          out_shape)


# On the f32 kernel the passes of one emulated dot of at most BATCH_MACS
# multiply-adds run as one batched dot: each pass is one batch element, the
# same float32 dot on the same parts (the same bits, tested), and XLA
# compiles one library call and one fusion per operand that writes every
# part, where separate passes compile one each. Compile time is what a small
# dot costs: BERT-base at batch 1 x 128 tokens (dots of up to 3.0e8
# multiply-adds) compiles 95 fusions at 6 passes where it had 189
# (benchmarks/bench_emulate_bert.py). A larger dot keeps its passes apart:
# there run time is what counts, and XLA:CPU ran three separate 1024^3 passes
# in 0.8x the time of the stacked parts and one batched dot
# (benchmarks/bench_emulated_matmul.py). The bf16 kernel keeps its passes
# apart at every size: batched, its bfloat16 dots compiled no faster, and
# their gradients took another XLA:CPU dot whose sums differ in the last bits.
BATCH_MACS = 2**29


def _macs(spec: _Spec, lhs: jax.Array, rhs: jax.Array) -> int:
  """The multiply-adds of one pass of the dot ``spec`` on ``lhs``, ``rhs``."""
  out_shape = _canonical_dot(lhs.shape, rhs.shape,
                             dict(spec.params)["dimension_numbers"])[3]
  return int(np.prod(out_shape, dtype=np.int64)) * spec.contraction


def _batched_passes(pairs, dimension_numbers) -> list[jax.Array]:
  """The float32 dots of ``pairs`` (float32 parts) as one batched
  ``dot_general`` over a new leading axis, one result per pair."""
  (lc, rc), (lb, rb) = dimension_numbers
  up = lambda dims: tuple(d + 1 for d in dims)  # noqa: E731
  out = lax.dot_general(jnp.stack([l for l, _ in pairs]),
                        jnp.stack([r for _, r in pairs]),
                        ((up(lc), up(rc)), ((0, *up(lb)), (0, *up(rb)))),
                        precision=_EXACT, preferred_element_type=jnp.float32)
  return list(out)


# On the bf16 kernel the passes of a multi-pass dot of at most BATCH_MACS
# multiply-adds per pass run as one bfloat16 dot per rhs part, of the lhs
# parts it pairs with stacked along M: X3's three passes in two dots
# ([l; h]·h and h·l), X6's six in three (h·[h; m; l], m·[h; m], l·h as rows),
# X9's nine in three; each pass's result a block of one of them, and no block
# computed that no pass needs. Each block is the dot the pass runs on its
# own, element for element: its N and K are the pass's own, and stacking
# along M keeps the sums of XLA:CPU's library dot (jaxlib 0.10.2: none of 462
# shapes differ, M and N from 2 to 128, K from 8 to 3072;
# tests/test_emulate_compile.py compares both with each pass run alone).
# Side by side along N they would not: XLA:CPU blocks K by N, and for K over
# 2048 and a narrow N a wider N sums in another order. On jaxlib 0.12.1,
# whose bfloat16 dots sum in an order that depends on the whole shape, X3 run
# as one dot per pass gave a transposed operand's dot other bits jitted than
# eager; grouped, one program's bits hold (tested). Matrix-vector products
# and dots whose M and N are both under 4 or whose dimensions are all under 8
# keep one dot per pass (XLA computes those in its own loops, where a stacked
# dot would change their path), as do contractions of length 1 (see
# ``finish`` in _forward), dots of more than BATCH_MACS multiply-adds per
# pass, and dots whose passes' results would hold more than GROUPED_ELEMENTS
# float32 values (128 MiB).
GROUPED = ("bf16x3", "bf16x6", "bf16x9")
GROUPED_ELEMENTS = 2**25


def _grouped_ok(spec: _Spec, lhs_form, rhs_form) -> bool:
  """Whether ``spec``'s passes on the canonical forms run grouped."""
  if spec.algorithm not in GROUPED or spec.contraction <= 1:
    return False
  m, k, n = lhs_form[-2], lhs_form[-1], rhs_form[-1]
  out = int(np.prod(lhs_form[:-1], dtype=np.int64)) * n  # (B,) M x N
  return (m > 1 and n > 1 and max(m, n) >= 4 and max(m, k, n) >= 8 and
          out * k <= BATCH_MACS and
          PASSES[spec.algorithm] * out <= GROUPED_ELEMENTS)


def _index(parts: list, x) -> int:
  """The index of ``x`` (by identity) in ``parts``, appended if new."""
  for i, y in enumerate(parts):
    if y is x:
      return i
  parts.append(x)
  return len(parts) - 1


def _grouped_passes(pairs, one_pass) -> list[jax.Array]:
  """The bfloat16 dots of ``pairs`` (float32 arrays holding bfloat16 parts,
  canonical forms ``(B,) M x K`` and ``(B,) K x N``) as one dot per distinct
  rhs part, of the lhs parts it pairs with stacked along M (a concatenate
  that XLA fuses with the parts into one kernel), each converted to bfloat16
  once; one block of a product per pair, in the order of the pairs."""
  m_axis = pairs[0][0].ndim - 2
  m = pairs[0][0].shape[m_axis]
  rs, groups, at = [], [], []  # distinct rhs parts; their lhs parts; (group, row)
  for l, r in pairs:
    g = _index(rs, r)
    if g == len(groups):
      groups.append([])
    at.append((g, _index(groups[g], l)))
  outs = [one_pass((ls[0] if len(ls) == 1 else lax.concatenate(ls, m_axis)
                    ).astype(jnp.bfloat16), r.astype(jnp.bfloat16))
          for ls, r in zip(groups, rs)]
  return [lax.slice_in_dim(outs[g], i * m, (i + 1) * m, axis=m_axis)
          for g, i in at]


def _chip_forward(spec: _Spec, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """The emulated dot on ``spec.chip``'s tensor cores: each pass of the
  algorithm one chip dot (:func:`tensor_cores.chip_dot`) in the canonical
  form, the passes combined as :mod:`passes` combines them (XLA's
  ``dot_algorithm_rewriter.cc``: separate dots, then float32 additions)."""
  lhs_move, rhs_move, dn, out_shape = _canonical_dot(
      lhs.shape, rhs.shape, dict(spec.params)["dimension_numbers"])
  fmts = tensor_cores.operand_formats(spec.algorithm, lhs.dtype, rhs.dtype)
  lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  if spec.guard[0]:
    lhs = lax.optimization_barrier(lhs)
  if spec.guard[1]:
    rhs = lax.optimization_barrier(rhs)
  lhs, rhs = passes.move(lhs, lhs_move), passes.move(rhs, rhs_move)
  if fmts is None:
    # A float8 preset's transposed dot (a float32 cotangent times a float8
    # operand): no float8 instruction reads it; exact float32, as without a
    # chip (_float8_dot).
    out = passes.stored(lax.dot_general(lhs, rhs, dn, precision=_EXACT,
                                        preferred_element_type=jnp.float32))
  else:
    def ops(pairs):
      return [tensor_cores.chip_dot(l, r, spec.chip, fmts,
                                    interval=spec.fp8_interval)
              for l, r in pairs]
    if spec.algorithm == "f8":
      out = ops([(lhs, rhs)])[0]
    else:
      out = passes.BF16[spec.algorithm](ops, lhs, rhs, spec.tf32_rounding,
                                        jnp.float32)
  out = out.reshape(out_shape)
  return lax.optimization_barrier(out.astype(spec.out_dtype))


def _forward(spec: _Spec, lhs: jax.Array, rhs: jax.Array, *,
             group: bool = True) -> jax.Array:
  """The emulated op (``group=False``: one dot per pass on the bf16 kernel,
  the algorithm's passes as :func:`written_out` shows them)."""
  if spec.algorithm == "f32":  # a shape rule's exact float32 (spec.rule)
    out = spec.lax_op()(lhs, rhs, precision=_EXACT,
                        preferred_element_type=spec.preferred_element_type)
    return lax.optimization_barrier(passes.stored(out).astype(spec.out_dtype))
  if spec.chip is not None and spec.op == "dot_general":
    return _chip_forward(spec, lhs, rhs)
  lhs_move = rhs_move = dn = out_shape = None  # moved only on the bf16 kernel
  if spec.op == "dot_general" and spec.kernel == "bf16":
    lhs_move, rhs_move, dn, out_shape = _canonical_dot(
        lhs.shape, rhs.shape, dict(spec.params)["dimension_numbers"])
  batched = (spec.op == "dot_general" and spec.kernel == "f32" and
             PASSES[spec.algorithm] > 1 and
             _macs(spec, lhs, rhs) <= BATCH_MACS)
  grouped = (group and dn is not None and
             _grouped_ok(spec, lhs_move[1], rhs_move[1]))
  lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  # Batched or grouped, the operands' producers stay out of the fusion that
  # stacks the parts: XLA:CPU (jax 0.12.0.1) fused a GELU into it and
  # computed the GELU to other bits than in its own fusions
  # (tests/test_switch.py, tests/test_emulate_compile.py).
  if spec.guard[0] or batched or grouped:
    lhs = lax.optimization_barrier(lhs)
  if spec.guard[1] or batched or grouped:
    rhs = lax.optimization_barrier(rhs)
  if dn is not None and spec.algorithm == "tf32x3":
    # Its float32 parts: XLA:CPU (jax 0.10.2) fused the last multiply of a
    # GELU into the fusions that write them, through a barrier, and computed
    # it to other bits than alone (tests/test_emulate_compile.py). Stored,
    # the operand is written where nothing reads it fused.
    lhs, rhs = passes.stored(lhs), passes.stored(rhs)
  lhs, rhs = passes.move(lhs, lhs_move), passes.move(rhs, rhs_move)
  fns = passes.F32 if spec.kernel == "f32" else passes.BF16
  if dn is not None:
    # bfloat16 parts run as bfloat16 dots with float32 results: exact
    # products, float32 sums, and 0.5x the time of a float32 dot on CPUs with
    # AVX512-BF16 (XLA's dot_algorithm_rewriter.cc, openxla/xla).
    base = functools.partial(lax.dot_general, dimension_numbers=dn)
    # Grouped, the parts are float32 until they are stacked
    # (_grouped_passes).
    parts = jnp.float32 if grouped else jnp.bfloat16
  else:
    # The f32 kernel, and convolutions (XLA:CPU widens bfloat16 conv operands
    # to float32 anyway): float32 parts holding bfloat16 values compute the
    # same exact products.
    base = spec.lax_op()
    parts = jnp.float32

  def finish(out, low: bool):
    if (PASSES[spec.algorithm] > 1 and spec.contraction == 1 and
        spec.kernel == "bf16"):
      # XLA:CPU turns a length-1 contraction into a multiply and, in the
      # fused loop that sums the passes, contracts multiply and add into an
      # FMA, which changes the result where a product overflows or underflows
      # (measured; an optimization_barrier does not survive to the fusion).
      # A product of two bfloat16 or TF32 values has at most 22 significant
      # bits, so rounding it to 23 is an identity that XLA cannot drop and
      # LLVM cannot see through: the passes are then summed as XLA sums them.
      out = lax.reduce_precision(out, exponent_bits=8, mantissa_bits=22)
    elif low:
      # An identity on float32 that keeps XLA's simplifier from folding a
      # later transpose (e.g. of a gradient, or the user's `.T`) into this
      # bfloat16 dot: XLA:CPU cannot run the folded form ("Unsupported element
      # type for DotThunk::Execute: BF16 x BF16 = F32"; measured, jax 0.10.2).
      out = lax.reduce_precision(out, exponent_bits=8, mantissa_bits=23)
    return out

  def one_pass(l, r):
    # bfloat16 operands at DEFAULT; float32 operands holding bfloat16, TF32
    # or float16 values at HIGHEST, so that no backend rounds them again.
    low = l.dtype == jnp.bfloat16
    return finish(base(l, r, precision=_LOW if low else _EXACT,
                       preferred_element_type=jnp.float32), low)

  def ops(pairs):
    if grouped:
      return _grouped_passes(pairs, one_pass)
    if len(pairs) == 1 or not batched:
      return [one_pass(l, r) for l, r in pairs]
    return _batched_passes(pairs, dict(spec.params)["dimension_numbers"])

  out = fns[spec.algorithm](ops, lhs, rhs, spec.tf32_rounding, parts)
  if out_shape is not None:
    out = out.reshape(out_shape)
  # A fusion boundary: XLA:CPU (jax 0.12.0.1) fuses the user's next op into
  # the loop summing the passes otherwise, to other bits than alone.
  return lax.optimization_barrier(out.astype(spec.out_dtype))


# ---------------------------------------------------------------------------
# The emulated op: one JAX primitive for both ops, whose rules JAX's own rules
# for the native op give. Its derivatives in either mode, and its batching,
# are the native op's, traced and emulated again at the same algorithm (so a
# TPU's transposed and tangent matmuls carry the forward's precision).

_emulated_p = jex_core.Primitive(MARKER)


def _emulated(spec: _Spec, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  # Inside shard_map, both operands vary over the same mesh axes, as JAX's
  # own dot_general casts them before it binds.
  return _emulated_p.bind(*compat.match_varying(lhs, rhs), spec=spec)


def _native(spec: _Spec) -> Callable[..., jax.Array]:
  """The native op that ``spec`` emulates."""
  return functools.partial(spec.lax_op(), precision=_LOW,
                           preferred_element_type=spec.preferred_element_type)


def _impl(lhs, rhs, *, spec: _Spec) -> jax.Array:
  if _hashable(spec):
    return _forward_jit(spec, lhs, rhs)
  return jax.jit(functools.partial(_forward, spec))(lhs, rhs)


_forward_jit = jax.jit(_forward, static_argnums=0)


@functools.lru_cache(maxsize=4096)
def _native_eqn(spec: _Spec, lhs_shape, rhs_shape):
  """``(primitive, params)`` of the native op on float32 operands."""
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  closed = jax.make_jaxpr(_native(spec))(f32(lhs_shape), f32(rhs_shape))
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == spec.op]
  return eqn.primitive, eqn.params


def _abstract_eval(lhs, rhs, *, spec: _Spec):
  # The native op's own rule on the float32 operands the passes read: its
  # shape, sharding and the mesh axes it varies over, as JAX computes them.
  native_eqn = _native_eqn if _hashable(spec) else _native_eqn.__wrapped__
  prim, params = native_eqn(spec, tuple(lhs.shape), tuple(rhs.shape))
  out, effects = prim.abstract_eval(lhs.update(dtype=np.dtype(np.float32)),
                                    rhs.update(dtype=np.dtype(np.float32)),
                                    **params)
  return out.update(dtype=spec.out_dtype, weak_type=False), effects


_CONV_PARAMS = ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
                "dimension_numbers", "feature_group_count", "batch_group_count")


def op_params(eqn) -> dict[str, Any]:
  """The lax op's arguments of a ``dot_general`` or ``conv_general_dilated``
  equation, other than its precision and result type (:func:`emulated_op`'s
  ``params``)."""
  keys = (_CONV_PARAMS if eqn.primitive.name == "conv_general_dilated"
          else ("dimension_numbers",))
  return {k: eqn.params[k] for k in keys}


def _emulate_again(spec: _Spec) -> walker.Rule:
  """The walker rule that emulates every op at ``spec``'s algorithm."""
  def rule(eqn, invals):
    name = eqn.primitive.name
    if name not in walker.PRIMITIVES:
      return None
    l, r = invals
    # A float8 preset on a chip: its batched dot reads float8 operands too.
    if not (emulatable(l.dtype, r.dtype)
            or (spec.algorithm == "f8" and spec.chip is not None)):
      return None
    algorithm, rule = spec.algorithm, None
    if spec.rule is not None and name == "dot_general":
      rule = spec.rule
      algorithm = _by_shape(rule, l, r, eqn.params["dimension_numbers"])
    s = _make_spec(name, op_params(eqn), l, r,
                   eqn.params.get("preferred_element_type"),
                   algorithm, spec.tf32_rounding, spec.kernel,
                   chip=spec.chip, fp8_interval=spec.fp8_interval, rule=rule)
    return [_marked(s, l, r)]
  return rule


def _by_shape(rule: tuple[str, Any, str, bool], lhs, rhs,
              dimension_numbers) -> str:
  """The algorithm of a dot with ``rule`` (``_Spec.rule``) on these
  operands: ``'f32'`` where XLA's shape rules make it float32, else the
  dot's own."""
  algorithm, precision, target, tpu_matvec_f32 = rule
  if shape_rule(precision, target, lhs.shape, rhs.shape, dimension_numbers,
                tpu_matvec_f32=tpu_matvec_f32):
    return "f32"
  return algorithm


def _transpose_rule(side: int):
  """The cotangent of operand ``side``: the native op's transpose (JAX's own
  rule, so every dimension-number and grouping case is right), each of its
  matmuls and convolutions emulated at the forward's algorithm."""
  def rule(ct, lhs, rhs, *, spec: _Spec):
    other, aval = (rhs, lhs.aval) if side == 0 else (lhs, rhs.aval)
    native = _native(spec)

    def pullback(o, c):
      f = ((lambda a: native(a, o)) if side == 0 else (lambda b: native(o, b)))
      # The operand's own type (the mesh axes it varies over included), so
      # that the transpose adds no collective the native one would not.
      (g,) = jax.linear_transpose(f, aval.update(dtype=np.dtype(np.float32)))(c)
      return g

    ct = ct.astype(jnp.float32) if ct.dtype != spec.out_dtype else ct
    if spec.kernel == "bf16" and spec.op == "dot_general":
      # The cotangent often arrives transposed (JAX's transpose of the
      # user's transpose or of vmap's moved axis), and XLA folds that
      # transpose into the bfloat16 dot: a lhs contracted on its first axis,
      # which XLA:CPU's library calls refuse (``IsDotSupportedByYnn``,
      # openxla/xla xla/backends/cpu/ynn_support.cc) and DotThunk cannot run
      # ("Unsupported element type for DotThunk::Execute: BF16 x BF16 =
      # F32"). Behind a barrier it reaches the dot as an array.
      ct = lax.optimization_barrier(ct)
    closed = jax.make_jaxpr(pullback)(other, ct)
    (g,) = walker.interpret(closed, _emulate_again(spec), other, ct)
    return g.astype(aval.dtype)
  return rule


def _batch_rule(args, dims, *, spec: _Spec):
  """``jax.vmap`` of the native op (JAX's own batching rule), each of its
  matmuls and convolutions emulated at ``spec``'s algorithm."""
  lhs, rhs = args
  axes = tuple(None if d is None else int(d) for d in dims)  # None: unmapped
  closed = jax.make_jaxpr(jax.vmap(_native(spec), in_axes=axes))(lhs, rhs)
  (out,) = walker.interpret(closed, _emulate_again(spec), lhs, rhs)
  return out.astype(spec.out_dtype), 0


_emulated_p.def_impl(_impl)
_emulated_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(_emulated_p, mlir.lower_fun(
    lambda lhs, rhs, *, spec: _forward(spec, lhs, rhs), multiple_results=False))
ad.defbilinear(_emulated_p, _transpose_rule(0), _transpose_rule(1))
batching.primitive_batchers[_emulated_p] = _batch_rule


def _marked(spec: _Spec, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """``_emulated`` bound under :data:`MARKER` (see :func:`is_emulated_call`),
  through a ``jax.jit`` keyed on ``spec`` (see :func:`_traced_once`)."""
  with jax.named_scope(MARKER):
    if not _hashable(spec):
      return _emulated(spec, lhs, rhs)
    return _traced_once(spec, lhs, rhs)


@functools.partial(jax.jit, static_argnums=0)
def _traced_once(spec: _Spec, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """``_emulated`` traced once per spec, shapes and dtypes (jit's cache).

  A model repeats the same matmul in every layer: jit's trace cache then
  traces the emulation once, and the lowering emits one private function
  called once per layer. XLA inlines calls before it optimizes, so the
  compiled program, and every number it computes, is the same (tested).
  """
  with jax.named_scope(MARKER):
    return _emulated(spec, lhs, rhs)


def emulated_dot_general(lhs: jax.typing.ArrayLike, rhs: jax.typing.ArrayLike,
                         dimension_numbers: Any, precision: PrecisionLike = None,
                         preferred_element_type: Any = None, *,
                         target: str = "tpu", tf32_rounding: str = "nearest",
                         out_sharding: Any = None, chip: str | None = None,
                         fp8_promotion_interval: int | None = None,
                         tpu_matvec_f32: bool = True) -> jax.Array:
  """``lax.dot_general`` computed as ``target`` computes it.

  Same arguments as ``lax.dot_general``, so it can be passed as Flax's
  ``dot_general=``. For float32 operands the result is what the target
  computes at ``precision`` (see :func:`algorithm_for` and the module
  docstring for each algorithm); other operands run natively. Each pass is a
  separate matmul and the passes are combined in XLA's order, so with a
  contraction of length 1 the result is XLA's bit for bit; otherwise it is
  within ``(k + passes) * 2**-24 * sum|products|`` of the exact sum of the
  algorithm's products (``k``: contraction length).

  Differentiable in both modes (``jax.grad``, ``jax.jvp``, ``jax.hessian``)
  and batched by ``jax.vmap``: the tangent, transposed and batched matmuls
  are emulated at the same algorithm.

  Args:
    lhs, rhs: the operands.
    dimension_numbers: as ``lax.dot_general``.
    precision: anything ``lax.dot_general`` accepts, or a jaxprec name. None
      means the value of ``jax.config.jax_default_matmul_precision`` when the
      call is traced (None there: the target's ``DEFAULT``).
    preferred_element_type: as ``lax.dot_general``: the result dtype.
    target: ``'tpu'`` (default), ``'gpu'`` (Ampere or newer NVIDIA), or
      ``'cpu'``/``'native'`` (call ``lax.dot_general`` unchanged).
    tf32_rounding: how TF32 algorithms round operands: ``'nearest'`` (ties to
      even, default), ``'nearest_away'`` (ties away from zero, NVIDIA's
      ``cvt.rna`` that XLA's Triton TF32 matmuls use) or ``'truncate'``
      (tensor cores reading unrounded float32).
    out_sharding: passed to ``lax.dot_general`` when nothing is emulated;
      otherwise applied to the result with ``lax.with_sharding_constraint``.
    chip: with ``target='gpu'``, the NVIDIA chip whose tensor cores compute
      each pass: ``'a100'``, ``'h100'`` or ``'b200'``
      (:mod:`jaxprec._src.emulation.tensor_cores`, after MMA-Sim, arXiv
      2511.10909: groups of exact products and the accumulator aligned to
      the largest exponent, truncated, rounded toward zero; float8 on an
      H100 into a 14-bit accumulator). None (default): the algorithm's
      definition, float32 sums rounded to nearest. Exact float32
      (``HIGHEST``) runs on CUDA cores and is the same either way; bfloat16
      or float16 operands (which run natively without a chip) are computed
      on the chip's tensor cores too.
    fp8_promotion_interval: with ``chip``, for float8 operands under
      ``ANY_F8_ANY_F8_F32`` or ``ANY_F8_ANY_F8_ANY`` on a chip whose float8
      accumulator is narrow (``'h100'``): the contraction elements summed in
      the tensor core before each partial sum is added to a float32 sum (a
      multiple of 32; default 128, four ``wgmma`` instructions, as
      CUTLASS's and DeepSeek-V3's promotion). The ``_FAST_ACCUM`` presets
      never promote.
    tpu_matvec_f32: with ``target='tpu'``, compute a dot where one operand
      has no free dimension (matrix·vector, vector·matrix) at ``DEFAULT`` in
      exact float32, as JAX's maintainers state a TPU does
      (https://github.com/jax-ml/jax/issues/16349; a statement, not a
      measurement: :func:`jaxprec._src.core.numerics.tpu_matvec`). True by
      default; False computes it as any other dot (one bfloat16 pass).

  Shape rules. Some dots run in exact float32 whatever the level, because of
  their shapes (:func:`jaxprec._src.core.numerics.shape_rule`): on a GPU,
  XLA's strength reduction of vector·vector dots and of matrix·vector dots
  below 10,000,000 (``(m + n) * k``); on a TPU, matrix·vector dots at
  ``DEFAULT`` (``tpu_matvec_f32``). Such a dot is one float32 dot here,
  with or without a chip, and so are its gradients.

  Returns:
    The result, with ``lax.dot_general``'s shape and dtype.

  Raises:
    ValueError: unknown target, precision, ``tf32_rounding`` or chip, or a
      chip with a target other than ``'gpu'``.
    NotImplementedError: the chip has no tensor-core instruction for the
      operands (float8 on an A100).

  Examples:
    >>> import jax.numpy as jnp, jaxprec
    >>> x = jnp.array([[1 + 2.0**-9]])          # not a bfloat16 value
    >>> dn = (((1,), (0,)), ((), ()))
    >>> float(jaxprec.emulated_dot_general(x, x, dn)[0, 0])  # TPU DEFAULT
    1.0
    >>> float(jaxprec.emulated_dot_general(x, x, dn, "high")[0, 0])  # no lo*lo
    1.00390625
    >>> float(jaxprec.emulated_dot_general(x, x, dn, "highest")[0, 0])
    1.0039100646972656

    A tensor core rounds toward zero where the default model rounds to
    nearest (1 + 3 * 2**-25 lies between 1 and the next float32 value):

    >>> a = jnp.array([[1.0, 2.0**-12]])
    >>> b = jnp.array([[1.0], [3 * 2.0**-13]])
    >>> gpu = dict(precision="TF32_TF32_F32", target="gpu")
    >>> float(jaxprec.emulated_dot_general(a, b, dn, **gpu)[0, 0]) - 1
    1.1920928955078125e-07
    >>> float(jaxprec.emulated_dot_general(a, b, dn, **gpu, chip="a100")[0, 0]) - 1
    0.0
  """
  return emulated_op("dot_general", lhs, rhs,
                     {"dimension_numbers": dimension_numbers}, precision,
                     preferred_element_type, target=target,
                     tf32_rounding=tf32_rounding, out_sharding=out_sharding,
                     chip=chip, fp8_promotion_interval=fp8_promotion_interval,
                     tpu_matvec_f32=tpu_matvec_f32)


def check_chip(chip: Any, target: str, *, name: str = "chip") -> str | None:
  """``chip`` checked against ``target`` (None: no chip model); the errors
  name the argument ``name`` (``search_policy``'s ``tensor_cores``)."""
  if chip is None:
    return None
  chip = tensor_cores.check_chip(
      chip, kind="chip" if name == "chip" else f"{name} chip")
  if target != "gpu":
    raise ValueError(f"{name}={chip!r} names an NVIDIA GPU: it needs "
                     f"target='gpu', not target={target!r}.")
  return chip


def check_flag(name: str, value: Any) -> bool:
  """An option that is True or False; TypeError naming it otherwise."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False; got {value!r}")
  return bool(value)


def check_interval(interval: Any) -> int | None:
  """``fp8_promotion_interval`` checked: None or a positive multiple of 32."""
  if interval is None:
    return None
  if (isinstance(interval, bool) or not isinstance(interval, (int, np.integer))
      or interval <= 0 or interval % 32):
    raise ValueError(f"fp8_promotion_interval must be a positive multiple of "
                     f"32 (contraction elements; 128 is four wgmma "
                     f"instructions); got {interval!r}.")
  return int(interval)


def _narrow_pair(lhs_dtype, rhs_dtype) -> str | None:
  """The one-pass algorithm of two bfloat16 or two float16 operands."""
  d = {np.dtype(lhs_dtype), np.dtype(rhs_dtype)}
  if d == {np.dtype(jnp.bfloat16)}:
    return "bf16x1"
  if d == {np.dtype(np.float16)}:
    return "f16"
  return None


def emulated_op(op: str, lhs, rhs, params: dict, precision=None,
                preferred_element_type=None, *, target: str = "tpu",
                tf32_rounding: str = "nearest", out_sharding: Any = None,
                guard: tuple[bool, bool] = (False, False),
                chip: str | None = None,
                fp8_promotion_interval: int | None = None,
                tpu_matvec_f32: bool = True) -> jax.Array:
  """The emulated ``op`` (``'dot_general'`` or ``'conv_general_dilated'``),
  ``params`` the lax op's other arguments, for the emulation rule, with the
  operands ``guard`` marks behind an optimization barrier
  (:func:`jaxprec._src.emulation.emulate.transposed`), on ``chip``'s tensor
  cores where one is given (:func:`emulated_dot_general`)."""
  def native(p):
    fn = lax.dot_general if op == "dot_general" else lax.conv_general_dilated
    return fn(lhs, rhs, **params, precision=p,
              preferred_element_type=preferred_element_type,
              out_sharding=out_sharding)

  target = check_target(target, emulation=True)
  if tf32_rounding not in TF32_ROUNDINGS:
    raise names.unknown("tf32_rounding", tf32_rounding, TF32_ROUNDINGS)
  chip = check_chip(chip, target)
  interval = check_interval(fp8_promotion_interval)
  check_flag("tpu_matvec_f32", tpu_matvec_f32)
  if target in ("cpu", "native"):
    return native(precision)
  numerics.check_float8_operands(getattr(lhs, "dtype", None),
                                 getattr(rhs, "dtype", None))
  l, r = jnp.asarray(lhs), jnp.asarray(rhs)
  if chip is not None and op != "dot_general":
    warnings.warn(
        f"chip={chip!r}: jaxprec models tensor cores for dots only; this "
        f"convolution is emulated at the algorithm's definition (float32 "
        f"sums rounded to nearest): the order in which a library's "
        f"implicit GEMM walks the filter is not public.",
        NotModelledWarning, stacklevel=3)
    chip = None
  algorithm = algorithm_for(precision, target, l.dtype, r.dtype, op=op)
  if (chip is not None and op == "dot_general" and algorithm != "f8"
      and numerics.reduced_by_shape(l.shape, r.shape,
                                    params["dimension_numbers"])):
    # XLA:GPU rewrites this dot into a multiply of the algorithm's rounded
    # operands and a float32 reduce (numerics.reduced_by_shape): the
    # algorithm's own model, not the chip's tensor cores. At a level the
    # shape rule below makes it exact float32.
    chip = None
  if (algorithm == "native" and chip is not None
      and _narrow_pair(l.dtype, r.dtype) is not None):
    # bfloat16 or float16 operands: one tensor-core pass of their format,
    # on the operands widened exactly, the native op's result type.
    algorithm = _narrow_pair(l.dtype, r.dtype)
    preferred_element_type = jax.eval_shape(
        functools.partial(lax.dot_general, **params,
                          preferred_element_type=preferred_element_type),
        l, r).dtype
    l, r = l.astype(jnp.float32), r.astype(jnp.float32)
  rule = None
  if (op == "dot_general" and algorithm in ("tf32", "bf16x1")
      and l.dtype == r.dtype == jnp.float32):
    # XLA's shape rules (numerics.shape_rule): exact float32 for these
    # shapes, and decided again for the op's batched and transposed dots.
    level = (jax.config.jax_default_matmul_precision if precision is None
             else precision)
    rule = (algorithm, resolve(level), target, bool(tpu_matvec_f32))
    base = algorithm
    algorithm = _by_shape(rule, l, r, params["dimension_numbers"])
  if algorithm == "native":
    if not (jnp.issubdtype(l.dtype, jnp.inexact)
            and jnp.issubdtype(r.dtype, jnp.inexact)):
      # Integer products are exact at any precision; a preset the backend
      # runs only on floats (TF32 on CPU) would be refused by the lowering.
      return native(None)
    return native(precision)
  if algorithm == "f32" and rule is None:  # stored as a multi-pass result is
    return passes.stored(native(_EXACT))
  if algorithm == "f8":
    if chip is not None:
      return _float8_chip(l, r, params, precision, preferred_element_type,
                          chip, interval, guard)
    return _float8_dot(l, r, params, precision, preferred_element_type, target)
  spec = _make_spec(op, params, l, r, preferred_element_type, algorithm,
                    tf32_rounding,
                    kernels.kernel_for(base if rule else algorithm, op), guard,
                    chip=chip, rule=rule)
  out = _marked(spec, l, r)
  if out_sharding is not None:
    out = lax.with_sharding_constraint(out, out_sharding)
  return out


class NotModelledWarning(UserWarning):
  """What the target computes differs from the emulation in a way jaxprec
  does not model (``docs/fidelity.md``, "What is not modelled")."""


def _float8_operands(lhs, rhs, params: dict, precision,
                     preferred_element_type):
  """An ``ANY_F8_*`` preset's name, its operands as JAX converts them, and
  the shape and type of the op's result.

  Raises:
    ValueError: an operand that is not float8 (JAX lowers the presets for
      float8 operands only, on every backend).
  """
  name = resolve(jax.config.jax_default_matmul_precision if precision is None
                 else precision).name
  if not (is_float8(lhs.dtype) and is_float8(rhs.dtype)):
    raise ValueError(
        f"{name} takes two float8 operands (JAX lowers it for those only, on "
        f"every backend); got {lhs.dtype} x {rhs.dtype}. Cast them to a float8 "
        f"type, or pass another precision.")
  if isinstance(precision, lax.DotAlgorithm):  # JAX converts to its types
    lhs = lhs.astype(precision.lhs_precision_type)
    rhs = rhs.astype(precision.rhs_precision_type)
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  out = jax.eval_shape(
      lambda a, b: lax.dot_general(a, b, **params, precision=precision,
                                   preferred_element_type=preferred_element_type),
      shape(lhs), shape(rhs))
  return name, lhs, rhs, out


def _float8_dot(lhs, rhs, params: dict, precision, preferred_element_type,
                target: str) -> jax.Array:
  """An ``ANY_F8_*`` preset on float8 operands: a product of two float8
  values has at most 10 significand bits and, but for ``float8_e8m0fnu``
  (exponents only, to 2**127), lies within float32's range, so it is exact in
  float32; the op is one float32 dot of the widened operands (float32
  accumulation, as the presets name it; an e8m0 product out of float32's
  range overflows or flushes as in a float32 accumulator), converted to the
  op's result type."""
  name, lhs, rhs, out = _float8_operands(lhs, rhs, params, precision,
                                         preferred_element_type)
  if target == "gpu":
    exact = name.removesuffix("_FAST_ACCUM")
    warnings.warn(
        f"{name} on a GPU accumulates in the tensor cores' float8 "
        f"accumulator (an H100's keeps about 14 bits), which the default "
        f"model does not compute: it emulates exact products summed in "
        f"float32, as {exact} computes by definition. Pass chip='h100' (or "
        f"'b200') to compute it as that chip's tensor cores do.",
        NotModelledWarning, stacklevel=3)
  wide = lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                         **params, precision=_EXACT,
                         preferred_element_type=jnp.float32)
  return passes.stored(wide).astype(out.dtype)


def _float8_chip(lhs, rhs, params: dict, precision, preferred_element_type,
                 chip: str, interval: int | None,
                 guard: tuple[bool, bool]) -> jax.Array:
  """An ``ANY_F8_*`` preset on float8 operands on ``chip``'s tensor cores
  (:func:`tensor_cores.chip_dot`): ``_FAST_ACCUM`` chains the whole
  contraction in the chip's float8 accumulator (an H100's ``RZ-E8M13``);
  the others, where that accumulator is narrower than float32, add it to a
  float32 sum every ``interval`` elements (default
  :data:`tensor_cores.FP8_PROMOTION_INTERVAL`), as the StableHLO RFC of the
  presets (openxla/stablehlo, rfcs/20240808-dot-algorithm.md: fast
  accumulation "does not periodically promote the intermediate results")
  and CUTLASS's promotion compute it."""
  dtypes = lhs.dtype, rhs.dtype  # the instruction's, before JAX converts
  name, lhs, rhs, out = _float8_operands(lhs, rhs, params, precision,
                                         preferred_element_type)
  fmts = tensor_cores.operand_formats("f8", *dtypes)
  acc = tensor_cores.accumulation(chip, fmts[0])
  fast = name.endswith("_FAST_ACCUM") or not acc.narrow
  every = 0 if fast else (interval or tensor_cores.FP8_PROMOTION_INTERVAL)
  spec = _make_spec("dot_general", params, lhs, rhs, out.dtype, "f8",
                    "nearest", "bf16", guard, chip=chip, fp8_interval=every)
  return _marked(spec, lhs, rhs)


def emulated_conv_general_dilated(
    lhs: jax.typing.ArrayLike, rhs: jax.typing.ArrayLike,
    window_strides: Sequence[int], padding: Any,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None, dimension_numbers: Any = None,
    feature_group_count: int = 1, batch_group_count: int = 1,
    precision: PrecisionLike = None, preferred_element_type: Any = None,
    out_sharding: Any = None, *, target: str = "tpu",
    tf32_rounding: str = "nearest") -> jax.Array:
  """``lax.conv_general_dilated`` computed as ``target`` computes it.

  Same arguments as ``lax.conv_general_dilated`` (usable as Flax's
  ``conv_general_dilated=``). Convolutions understand precision levels only:
  under a ``DotAlgorithmPreset`` (passed or from the config) JAX lowers them
  at ``DEFAULT``, i.e. one bfloat16 pass on a TPU, and so does this function.
  Otherwise as :func:`emulated_dot_general`, passes and gradients included.

  Args:
    lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
    dimension_numbers, feature_group_count, batch_group_count,
    preferred_element_type, out_sharding: as ``lax.conv_general_dilated``.
    precision: as :func:`emulated_dot_general`.
    target: ``'tpu'``, ``'gpu'``, ``'cpu'`` or ``'native'``.
    tf32_rounding: ``'nearest'``, ``'nearest_away'`` or ``'truncate'``.

  Returns:
    The result, with ``lax.conv_general_dilated``'s shape and dtype.

  Raises:
    ValueError: unknown target, precision or ``tf32_rounding``.

  Examples:
    >>> import jax.numpy as jnp, jaxprec
    >>> x = jnp.full((1, 1, 3), 1 + 2.0**-9)     # (batch, channel, width)
    >>> w = jnp.ones((1, 1, 2))
    >>> jaxprec.emulated_conv_general_dilated(x, w, (1,), "VALID").tolist()
    [[[2.0, 2.0]]]
  """
  params = {
      "window_strides": window_strides, "padding": padding,
      "lhs_dilation": lhs_dilation, "rhs_dilation": rhs_dilation,
      "dimension_numbers": dimension_numbers,
      "feature_group_count": feature_group_count,
      "batch_group_count": batch_group_count,
  }
  return emulated_op("conv_general_dilated", lhs, rhs, params, precision,
                     preferred_element_type, target=target,
                     tf32_rounding=tf32_rounding, out_sharding=out_sharding)


def emulated_ragged_dot(eqn, invals: Sequence[Any],
                        rule: walker.Rule) -> list[Any]:
  """A ``ragged_dot_general`` equation (``lax.ragged_dot``) computed as
  ``rule`` computes dots, in the form the target runs it.

  * A TPU's grouped matmul, where the lhs ragged dimension is not contracted
    (``lax.ragged_dot``, a mixture of experts' forward pass): each row meets
    its own group's rhs only (:func:`_grouped`: one dot per group, its rows
    picked by ``select``, as the megablox kernel stores them,
    jax/experimental/pallas/ops/tpu/megablox/gmm.py), so an inf or NaN in
    another group's weights stays out of the row, and rows past the groups
    are zero.
  * Every other case: JAX's dense form (``_ragged_dot_general_impl``,
    jax/_src/lax/lax.py; XLA:GPU's ``RaggedDotRewriter``,
    xla/hlo/transforms/expanders/ragged_dot_rewriter.cc, computes the same):
    the operands' ragged dimension masked by ``select``, then one
    ``dot_general``. A GPU multiplies a masked zero by the other groups'
    weights, so their inf or NaN reach the row there, as here.

  The equation stays one op to differentiate and batch: its derivatives are
  ``ragged_dot_general``'s own (ragged dots again, emulated the same way),
  never the transposes of the form it is computed in (:func:`walker.bind_as`).
  """
  dense = compat.ragged_dot_dense()
  if dense is None:  # pragma: no cover -- a JAX without the dense form
    raise NotImplementedError(
        "jaxprec cannot emulate ragged_dot_general on this JAX version")
  dims = eqn.params["ragged_dot_dimension_numbers"]
  (lhs_contract, _), (lhs_batch, _) = dims.dot_dimension_numbers
  ragged = tuple(dims.lhs_ragged_dimensions)
  grouped = (getattr(rule, "target", None) == "tpu" and len(ragged) == 1
             and ragged[0] not in (*lhs_contract, *lhs_batch))
  return walker.bind_as(eqn, invals, rule, _grouped if grouped else dense)


def _grouped(lhs, rhs, group_sizes, *, ragged_dot_dimension_numbers,
             precision, preferred_element_type, group_offset=None,
             out_sharding=None):
  """``ragged_dot_general`` with a non-contracted lhs ragged dimension as
  one ``dot_general`` of ``lhs`` with each group's rhs, whose rows of that
  group are picked by ``select`` (never a product or a sum of masked
  terms); rows past the groups are zero. The groups' bounds are JAX's dense
  form's (a cumulative sum of ``group_sizes``)."""
  del out_sharding  # the result is laid out as a dot_general's
  if group_offset is not None:  # as JAX's lowerings and rules
    raise NotImplementedError("Unimplemented group_offset support.")
  dims = ragged_dot_dimension_numbers
  (lc, rc), (lb, rb) = dims.dot_dimension_numbers
  (ragged,), (gdim,) = dims.lhs_ragged_dimensions, dims.rhs_group_dimensions
  drop = lambda ds: tuple(d - (d > gdim) for d in ds)  # noqa: E731
  free = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
  row = len(lb) + free.index(ragged)  # the ragged dimension in the result
  prefix = group_sizes.ndim - 1  # group_sizes: [result dims before row..., g]
  ends = lax.cumsum(group_sizes, axis=prefix)
  starts = ends - group_sizes
  out = None
  for g in range(rhs.shape[gdim]):
    y = lax.dot_general(lhs, lax.index_in_dim(rhs, g, gdim, keepdims=False),
                        ((lc, drop(rc)), (lb, drop(rb))), precision=precision,
                        preferred_element_type=preferred_element_type)
    if out is None:
      out = jnp.zeros(y.shape, y.dtype)
    iota = lax.broadcasted_iota(group_sizes.dtype, y.shape, row)
    bound = lambda b: lax.broadcast_in_dim(  # noqa: E731
        lax.index_in_dim(b, g, prefix, keepdims=False), y.shape,
        tuple(range(prefix)))
    out = lax.select((bound(starts) <= iota) & (iota < bound(ends)), y, out)
  if out is None:  # no groups: every row is past them
    out = jax.eval_shape(functools.partial(
        compat.ragged_dot_dense(), ragged_dot_dimension_numbers=dims,
        precision=precision, preferred_element_type=preferred_element_type),
        lhs, rhs, group_sizes)
    out = jnp.zeros(out.shape, out.dtype)
  return out


def written_out(closed):
  """``closed`` with every emulated op written out as its passes: the
  float32 and bfloat16 matmuls it runs, as :func:`jaxprec.audit` and
  :func:`jaxprec.cost` count them (on the bf16 kernel one dot per pass,
  where the compiled program may group the passes into fewer dots of the
  same blocks: the audit and the cost count the algorithm's passes)."""
  def rule(eqn, invals):
    if eqn.primitive.name == "jaxprec_traced":  # a library primitive's body
      return walker.interpret(walker.traced_body(eqn), rule, *invals)
    if eqn.primitive is not _emulated_p:
      return None
    return [_forward(eqn.params["spec"], *invals, group=False)]
  if not any(w.eqn.primitive is _emulated_p for w in walker.iter_eqns(closed)):
    return closed
  return walker.transform(closed, rule)


def is_emulated_call(eqn) -> bool:
  """Whether a jaxpr equation is a call of an emulated op (already emulated).

  Recognised by its primitive (:data:`MARKER`), never by a function's name.
  ``jaxprec.emulate`` leaves these alone: they are emulated already. The
  ``jit`` call that wraps one (see :func:`_traced_once`) counts too.
  """
  if eqn.primitive.name in ("jit", "pjit"):
    body = eqn.params["jaxpr"].jaxpr.eqns
    return len(body) == 1 and is_emulated_call(body[0])
  return eqn.primitive is _emulated_p
