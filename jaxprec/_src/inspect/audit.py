"""Graph inspection: which matmuls and convolutions run at which precision.

:func:`audit` walks every nested jaxpr of a traced function
(:func:`jaxprec._src.jaxpr.walker.iter_eqns`); what an op computes on TPU and
GPU is :func:`jaxprec._src.core.numerics.op_numerics`' one decision, as the
emulation and the cost model compute it. A row is *risky* where the result is
much less precise than the float32 inputs suggest and nothing in the code says
so (the jax.lax.Precision docs, JAX's tests/lax_test.py and its
conv_general_dilated lowering, jax/_src/lax/convolution.py):

* float32 operands (or a float32 and a bfloat16 or float16 one) rounded to 11
  significand bits or fewer on TPU: one bfloat16, float16 or float8 pass. The
  backend default is included on purpose: it is what users coming from
  PyTorch or NumPy do not expect; an explicit ``'bfloat16'`` is flagged too,
  with a reason that says it was requested.
* a convolution that recorded a ``DotAlgorithmPreset``: JAX lowers it at
  ``DEFAULT`` (one bfloat16 pass on TPU, TF32 on GPU) whatever the preset says.
* an algorithm a TPU does not run (``F32_F32_F32``, a TF32 preset): the
  program does not compile there, and the TPU column shows ``'unsupported'``.
* accumulation in bfloat16 or float16 (:func:`accumulation_risk`).

Other operands (bfloat16 or float16 on both sides, float64, integers) are
computed natively: the precision setting does not apply.

Apart from the matmuls, the report lists every op that *adds* values into a
result in bfloat16 or float16 (:class:`ReductionRow`, :data:`ACCUMULATING`):
sums and their windowed, cumulative and scattered forms, collectives that sum
across devices, a loop carry that a ``scan`` or ``while`` body adds to, and the
dots and convolutions that accumulate in a 16-bit type.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import json
import math
import os
import textwrap
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from jaxprec._src.core import algorithms
from jaxprec._src.core import context
from jaxprec._src.core import numerics
from jaxprec._src.core.algorithms import Numerics
from jaxprec._src.core.precision import resolve
from jaxprec._src.emulation import emulated_ops
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import trees
from jaxprec._src.jaxpr import walker

# Python packages whose frames are not "the user's line": the op's own frame in
# Flax/Optax/jaxprec is kept in AuditRow.op, the user's caller in .source. The
# libraries whose primitives the walker traces through (Equinox's, and
# lineax's, diffrax's and optimistix's solves built on them): a product of
# their own names the user's call of the primitive.
_LIBRARY_PACKAGES = ("flax", "optax", "chex", "jaxprec", "equinox", "lineax",
                     "diffrax", "optimistix")


class AuditError(RuntimeError):
  """Tracing the audited function failed; the original error is ``__cause__``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditRow:
  """One ``dot_general``, ``ragged_dot_general`` or ``conv_general_dilated``
  found by :func:`audit`.

  Attributes:
    primitive: ``'dot_general'``, ``'ragged_dot_general'`` or
      ``'conv_general_dilated'``.
    source: ``'file:line'`` of the innermost frame outside JAX, Flax, Optax,
      Chex and jaxprec (the user's line), or ``''`` when unknown.
    op: the innermost frame outside JAX as ``'function (file:line)'``, e.g.
      ``'Dense.__call__ (.../flax/linen/linear.py:287)'``: names the Flax module
      class when the op comes from one.
    name_stack: the full name stack, e.g. ``'jit(f)/MLP/dense1'``: enclosing
      ``jit`` names, ``jax.named_scope`` names and Flax module paths (for
      NNX, those of :attr:`module_path`).
    scope: enclosing higher-order primitives, outermost first, e.g.
      ``('jit', 'scan')``.
    trip_count: how many times the op runs per call (``scan`` lengths
      multiply; a ``while`` body counts once).
    lhs_shape, rhs_shape, out_shape: operand and result shapes.
    lhs_dtype, rhs_dtype, out_dtype: dtype names, e.g. ``'float32'``:
      ``lhs_dtype``/``rhs_dtype`` are the compute dtypes, the operands' dtypes
      at the op.
    precision: the ``precision`` param as recorded in the jaxpr: None, a pair
      of ``lax.Precision`` levels, or a ``lax.DotAlgorithmPreset``.
    precision_name: the same as text: ``'None'``, ``'DEFAULT'``,
      ``'HIGHEST'``, ``'DEFAULT,HIGHEST'`` or the preset's name.
    tpu, gpu: what runs there: the algorithm name of
      :class:`~jaxprec.Numerics` (``'bf16x1'``, ``'bf16x3'``, ``'bf16x6'``,
      ``'tf32'``, ``'f32'``, ...) for float32 operands (or a float32 and a
      bfloat16 or float16 operand), ``'unsupported'`` where the target does
      not run the precision's algorithm, ``'native <dtype>'`` otherwise,
      ``'unknown'`` for a custom ``lax.DotAlgorithm``.
    tpu_numerics, gpu_numerics: the :class:`~jaxprec.Numerics` behind
      ``tpu``/``gpu``: the one table's record (None for native and unknown).
    flops: floating-point operations per call, times ``trip_count``:
      ``2*M*N*K`` (batch dims included) for a dot; ``2 * output elements *
      kernel spatial size * input features per group`` for a convolution.
    risky: True when float32 operands lose their low bits where the code does
      not say so, or when the op accumulates in bfloat16 or float16 (see the
      module docstring).
    reason: why the row is risky (``''`` when it is not); two reasons are
      joined with ``'; '``.
    module_path: the Flax module that runs the op, as
      :class:`jaxprec.Policy` rules match it: module names joined by ``'/'``,
      e.g. ``'encoder/layer/0/attention/self'`` (the attention einsums of a
      module belong to it); ``''`` for the top module and for ops outside
      modules. For Flax NNX (``fn`` an ``nnx.Module`` or a bound method of
      one), the path of the innermost module that a policy can set (Linear,
      LinearGeneral, Einsum, Conv, ConvTranspose, attention), as
      :func:`jaxprec.swap` names it (``'layers/0/attn'``); other NNX modules
      record no calls.
    emulated: False for an op inside an opaque kernel (the dots of a Pallas
      kernel's body): :func:`jaxprec.emulate` cannot reach it, and the
      precision shown is the kernel's own.
    lhs_storage, rhs_storage: the dtype each operand had before a chain of
      ``convert_element_type`` (and layout ops: reshape, transpose,
      broadcast, squeeze, expand_dims, copy) led to the op, followed across
      ``jit``, ``scan``, ``cond``, ``while`` and remat bodies: what is stored,
      e.g. ``'float32'`` for the float32 kernel of a Flax ``Dense(dtype=
      jnp.bfloat16)``. Equal to the compute dtype when nothing casts.
    accumulation_dtype: the dtype the products are summed in as far as the
      program says: ``preferred_element_type`` when set, else the result
      dtype. ``'bfloat16'`` or ``'float16'`` makes the row risky.
    groups: for a ragged dot (``lax.ragged_dot``, primitive
      ``ragged_dot_general``), how many groups its ``group_sizes`` holds
      (each group's rows meet their own rhs); 0 for every other op.
    shape_rule: the rule a dot's shape brings in on a GPU, else ``''``:
      ``'f32: vector·vector, strength-reduced'`` or ``'f32: matrix·vector,
      strength-reduced'`` where XLA:GPU turns the dot at a precision level
      into a float32 multiply and reduce (``gpu`` is then ``'f32'``;
      :func:`jaxprec._src.core.numerics.strength_reduced`). The table's GPU
      column shows it.
    tpu_shape_rule: the same on a TPU: ``"f32: matrix·vector (as JAX's
      maintainers state)"`` for a matrix·vector dot at ``DEFAULT``, which a
      JAX maintainer states a TPU computes in float32 (``tpu`` is then
      ``'f32'``; :func:`jaxprec._src.core.numerics.tpu_matvec`; the
      emulation's ``tpu_matvec_f32=False`` turns it off). The table's TPU
      column shows it.
  """

  primitive: str
  source: str
  op: str
  name_stack: str
  scope: tuple[str, ...]
  trip_count: int
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  lhs_dtype: str
  rhs_dtype: str
  out_dtype: str
  precision: Any
  precision_name: str
  tpu: str
  gpu: str
  tpu_numerics: Numerics | None
  gpu_numerics: Numerics | None
  flops: int
  risky: bool
  reason: str
  module_path: str = ""
  emulated: bool = True
  lhs_storage: str = ""
  rhs_storage: str = ""
  accumulation_dtype: str = ""
  groups: int = 0
  shape_rule: str = ""
  tpu_shape_rule: str = ""

  @property
  def dtype_story(self) -> str:
    """The dtypes compactly: ``'f32->bf16 x f32->bf16 -> bf16'`` (stored->
    compute for each operand, one name when nothing casts, then the
    accumulation dtype)."""
    def operand(stored: str, compute: str) -> str:
      if stored and stored != compute:
        return f"{_short(stored)}->{_short(compute)}"
      return _short(compute)
    acc = self.accumulation_dtype or self.out_dtype
    return (f"{operand(self.lhs_storage, self.lhs_dtype)} x "
            f"{operand(self.rhs_storage, self.rhs_dtype)} -> {_short(acc)}")

  def to_dict(self) -> dict[str, Any]:
    """The row as JSON-able values (``precision`` becomes ``precision_name``)."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["precision"] = self.precision_name
    d["scope"] = list(self.scope)
    for k in ("lhs_shape", "rhs_shape", "out_shape"):
      d[k] = list(d[k])
    for k in ("tpu_numerics", "gpu_numerics"):
      d[k] = None if d[k] is None else algorithms.numerics_dict(d[k])
    return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpaqueRow:
  """An op whose numerics jaxprec cannot see: a Pallas kernel, an FFI call or
  a host callback (``pure_callback``, ``io_callback``).

  :func:`jaxprec.emulate` runs it natively and warns
  (:class:`jaxprec.OpaqueOpWarning`); the matmuls a Pallas kernel's body
  shows are listed as :class:`AuditRow` with ``emulated=False``.

  Attributes:
    primitive: e.g. ``'pallas_call'``, ``'ffi_call'``, ``'pure_callback'``.
    name: the primitive and, where JAX records one, the kernel, target or
      callback name, e.g. ``"pallas_call 'matmul_kernel'"``.
    source, name_stack, scope, trip_count: as :class:`AuditRow`.
  """

  primitive: str
  name: str
  source: str
  name_stack: str
  scope: tuple[str, ...]
  trip_count: int

  def to_dict(self) -> dict[str, Any]:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["scope"] = list(self.scope)
    return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReductionRow:
  """An op that adds values into a result in bfloat16 or float16 (or
  float8: a floating dtype of 11 significand bits or fewer), found by
  :func:`audit`.

  Each addition rounds the partial result to the narrow dtype: once a
  bfloat16 partial sum is 256 times larger than a term, adding the term
  changes nothing. Which ops count is :data:`ACCUMULATING`; maxima, minima,
  products and ``reduce_precision`` do not (see there).

  Attributes:
    primitive: the op, e.g. ``'reduce_sum'``, ``'cumsum'``, ``'psum'``,
      ``'scatter-add'``, ``'add_any'`` (a loop carry), ``'dot_general'``.
    kind: ``'sum'``, ``'window'``, ``'cumulative'``, ``'scatter'``,
      ``'collective'``, ``'loop'``, ``'dot'`` or ``'conv'``
      (:data:`ACCUMULATING`).
    dtype: the dtype the op adds in, e.g. ``'bfloat16'``.
    operand_shape, out_shape: the shapes of its first narrow operand and of
      the matching result.
    operands: how many narrow operands the one equation adds (a collective
      may bind several); 1 for every other op. jax 0.10 to 0.12 bind a
      ``psum`` of a pytree once per leaf: one row each.
    terms: how many values are added into one result element at most: the
      reduced size of a sum, the window of a windowed sum, the axis of a
      cumulative sum, the number of updates of a scatter, the devices of a
      collective (the product of its mesh axes' sizes), the length of a
      ``scan``, the contracted size of a dot; 0 where the program does not
      say (a ``while`` loop, a collective outside a known mesh).
    direction: ``'forward'``; ``'jvp'`` for an op under JAX's ``jvp(...)``
      name marker that is not transposed: the forward sweep of a
      differentiated function (or a ``jax.jvp``), its primal ops and what
      derivative rules compute from them (``jnp.max``'s count of ties,
      https://github.com/jax-ml/jax/issues/38885);
      ``'backward'`` for a transposed op (``transpose(...)`` in the name
      stack: the backward pass of ``jax.grad`` and ``jax.vjp``).
    axes: the mesh axis names a collective sums over; ``()`` otherwise.
    rejected_by_flag: True for a ``reduce_sum`` of bfloat16 or float16 over
      an axis longer than 1: with ``jax_allow_f16_reductions=False`` JAX
      raises ``ValueError`` when it traces this op (:data:`FLAG_NOTE`). The
      flag checks no other op and changes nothing XLA computes.
    matmul_row: for a dot or convolution, its 1-based number in
      :attr:`AuditReport.rows` (``#3`` in the table); 0 otherwise.
    reason: what the op adds and how to add in float32 instead.
    source, op, name_stack, scope, trip_count, module_path: as
      :class:`AuditRow`.
  """

  primitive: str
  kind: str
  dtype: str
  operand_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  operands: int
  terms: int
  direction: str
  axes: tuple[str, ...]
  rejected_by_flag: bool
  matmul_row: int
  reason: str
  source: str
  op: str
  name_stack: str
  scope: tuple[str, ...]
  trip_count: int
  module_path: str = ""

  def to_dict(self) -> dict[str, Any]:
    """The row as JSON-able values."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for k in ("operand_shape", "out_shape", "axes", "scope"):
      d[k] = list(d[k])
    return d


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The matmuls and convolutions of one traced function, and every op of
  it that adds in bfloat16 or float16.

  Attributes:
    rows: one :class:`AuditRow` per op, in program order, nested bodies
      right after the equation that holds them.
    function: the audited function's qualified name.
    precision_in_force: the precision in force when it was traced
      (``jaxprec.current()``), e.g. ``'float32 (context)'``.
    opaque: the ops jaxprec cannot see into (:class:`OpaqueRow`), in
      program order.
    reductions: every op that adds in bfloat16 or float16
      (:class:`ReductionRow`), in program order: sums, collectives, loop
      carries, and the dots and convolutions of :attr:`rows` that
      accumulate in a 16-bit type.
  """

  rows: tuple[AuditRow, ...]
  function: str = ""
  precision_in_force: str = ""
  opaque: tuple[OpaqueRow, ...] = ()
  reductions: tuple[ReductionRow, ...] = ()

  def __len__(self) -> int:
    return len(self.rows)

  def __iter__(self) -> Iterator[AuditRow]:
    return iter(self.rows)

  def __getitem__(self, i: int) -> AuditRow:
    return self.rows[i]

  @property
  def risky(self) -> tuple[AuditRow, ...]:
    """The rows flagged risky."""
    return tuple(r for r in self.rows if r.risky)

  @property
  def total_flops(self) -> int:
    return sum(r.flops for r in self.rows)

  def flops_by_precision(self) -> dict[str, dict[str, int]]:
    """FLOPs per call summed by what runs on TPU and on GPU.

    Returns:
      ``{'tpu': {'bf16x1': n, ...}, 'gpu': {'tf32': n, ...}}``, keys as in
      :attr:`AuditRow.tpu` / :attr:`AuditRow.gpu`, largest first.
    """
    out: dict[str, dict[str, int]] = {}
    for backend in ("tpu", "gpu"):
      totals: collections.Counter[str] = collections.Counter()
      for r in self.rows:
        totals[getattr(r, backend)] += r.flops
      out[backend] = dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))
    return out

  def to_dict(self) -> dict[str, Any]:
    """The report as JSON-able values."""
    return {
        "function": self.function,
        "precision_in_force": self.precision_in_force,
        "num_ops": len(self.rows),
        "num_risky": len(self.risky),
        "total_flops": self.total_flops,
        "flops_by_precision": self.flops_by_precision(),
        "rows": [r.to_dict() for r in self.rows],
        "opaque": [r.to_dict() for r in self.opaque],
        "num_reductions": len(self.reductions),
        "reductions": [r.to_dict() for r in self.reductions],
    }

  def to_json(self, indent: int | None = 2) -> str:
    """The report as a JSON string (see :meth:`to_dict`)."""
    return json.dumps(self.to_dict(), indent=indent)

  def __str__(self) -> str:
    return self.text()

  def text(self, width: int | None = None) -> str:
    """The table and its summary as text.

    Args:
      width: the columns to fit in: where the table is wider, each op is a
        line (``#``, op, name stack, function, source) with its other
        cells, each after its column's name, on the line below; the summary
        folds at spaces. None (default): one table, as wide as it needs.

    Returns:
      The text ``print(report)`` shows (``width=None``).
    """
    name = self.function or "function"
    head = f"jaxprec audit of {name}"
    if self.precision_in_force:
      head += f", traced at precision {self.precision_in_force}"
    opaque = _opaque_lines(self) + _reduction_lines(self)
    if not self.rows:
      return "\n".join([head, "no matmuls or convolutions (dot_general, "
                         "conv_general_dilated) found", *opaque])
    cols = ("#", "op", "name stack", "function", "source", "operands",
            "dtypes", "precision", "TPU", "GPU", "FLOPs", "risky")
    body = []
    for i, r in enumerate(self.rows, 1):
      op = numerics.op_kind(r.primitive)
      if r.trip_count != 1:
        op += f" x{r.trip_count}"
      if r.groups:
        op += f" ragged, {r.groups} groups"
      if not r.emulated:
        op += " (not emulated)"
      body.append((str(i), op, r.name_stack or "-", r.op.split(" (")[0] or "?",
                   _short_path(r.source),
                   f"{_shape(r.lhs_dtype, r.lhs_shape)} x "
                   f"{_shape(r.rhs_dtype, r.rhs_shape)}",
                   r.dtype_story, r.precision_name,
                   r.tpu_shape_rule or r.tpu,
                   r.shape_rule or r.gpu, si(r.flops, ".0f"),
                   "RISKY" if r.risky else ""))
    out = [head, *table(cols, body, {0, 10})]
    if width is not None and max(map(len, out)) > width:
      out = [head]
      for row in body:  # the row's place, then what it computes
        out.append("  ".join(c for c in (f"#{row[0]}", *row[1:5], row[11]) if c))
        out.append("   " + "; ".join(f"{c} {v}" for c, v in zip(cols[5:11], row[5:11])))
    by = self.flops_by_precision()
    n_risky = len(self.risky)
    out.append(
        f"total: {len(self.rows)} ops, {n_risky} risky, "
        f"{si(self.total_flops, '.0f')} FLOPs per call; "
        f"TPU: {_share(by['tpu'])}; GPU: {_share(by['gpu'])}")
    dtypes = _dtype_summary(self.rows)
    if dtypes:
      out.append(dtypes)
    if n_risky:
      out.append("risky:")
      by_reason: dict[str, list[int]] = {}
      for i, r in enumerate(self.rows, 1):
        if r.risky:
          by_reason.setdefault(r.reason, []).append(i)
      for reason, nums in by_reason.items():
        out.append(f"  {', '.join(f'#{i}' for i in nums)}: {reason}")
    out += opaque
    if width is not None:
      out = [part for line in out for part in (textwrap.wrap(
          line, width, subsequent_indent=" " * (len(line) - len(line.lstrip()) + 2),
          break_long_words=False, break_on_hyphens=False) or [line])]
    return "\n".join(out)


def audit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> AuditReport:
  """Lists every matmul and convolution of ``fn(*args, **kwargs)`` and its precision.

  ``fn`` is traced with ``jax.make_jaxpr`` under the precision in force now
  (a ``jaxprec.precision`` scope, ``jax.default_matmul_precision``, the global
  setting); it is never run, so ``jax.ShapeDtypeStruct`` values work as
  arguments. Jitted functions work too. Array leaves of ``args``/``kwargs``
  (arrays, ``ShapeDtypeStruct``, anything with ``shape`` and ``dtype``) are
  traced; every other leaf (Python numbers, strings, ...) is passed as is.

  Args:
    fn: the function to audit. An ``nnx.Module`` or a bound method of one is
      traced on a copy (the module is never modified), and its rows get the
      paths of its NNX modules (:attr:`AuditRow.module_path`).
    *args: its positional arguments (pytrees).
    **kwargs: its keyword arguments (pytrees).

  Returns:
    An :class:`AuditReport`; empty (not an error) when ``fn`` has no matmuls.
    Its ``reductions`` list every op that adds in bfloat16 or float16
    (sums, collectives, loop carries, 16-bit dots), forward or backward
    (:class:`ReductionRow`).

  Raises:
    TypeError: if ``fn`` is not callable.
    AuditError: if tracing ``fn`` raises; the message names ``fn`` and the
      original error, which is chained as ``__cause__``.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec
    >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    >>> w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    >>> report = jaxprec.audit(lambda x, w: x @ w, x, w)
    >>> row = report.rows[0]
    >>> row.primitive, row.flops, row.tpu, row.gpu, row.risky
    ('dot_general', 1024, 'bf16x1', 'tf32', True)
    >>> with jaxprec.precision("float32"):
    ...   report = jaxprec.audit(lambda x, w: x @ w, x, w)
    >>> report.rows[0].precision_name, report.rows[0].tpu, report.rows[0].risky
    ('HIGHEST', 'bf16x6', False)
  """
  if not callable(fn):
    raise TypeError(
        f"jaxprec.audit expects a callable as its first argument; got {fn!r} "
        f"of type {type(fn).__name__}")
  name = _qualname(fn)
  in_force = context.current()
  decorated = context.decorated_precision(fn)  # its scope wins inside fn
  in_force_text = (f"{in_force.name} ({in_force.source})" if decorated is None
                   else f"{decorated.name} (@jaxprec.precision on {name})")
  fn = nnx_policy.bind(fn, None)  # a traced copy of an NNX module, with paths

  statics, dynamic = trees.split_call(args, kwargs)

  try:
    with flax_paths.record() as module_paths:
      closed = jax.make_jaxpr(lambda *dyn: trees.jax_outputs(
          fn, statics.call(fn, dyn)))(*dynamic)
  except Exception as e:  # noqa: BLE001 -- re-raised with context
    raise AuditError(
        f"jaxprec.audit: tracing {name} failed: {type(e).__name__}: {e}") from e
  opaque: list[OpaqueRow] = []
  reductions: list[ReductionRow] = []
  closed = emulated_ops.written_out(closed)  # emulated already: its passes
  rows = tuple(_rows(closed, module_paths, opaque, reductions))
  return AuditReport(rows=rows, function=name,
                     precision_in_force=in_force_text,
                     opaque=tuple(opaque), reductions=tuple(reductions))


def unseen_modules(report: AuditReport) -> str:
  """Why a policy cannot tell apart the Flax modules of an audited function,
  or ``''``.

  Said when Flax modules (their methods, in Flax's own files) issue some of
  the function's matmuls or convolutions and no op has a module path: the
  function builds or merges its model inside (an NNX model merged with
  ``nnx.merge(graphdef, state)(x)``), so a policy, a search and
  ``jaxprec check --modules`` see one unit where the model has many.
  """
  if any(r.module_path for r in report.rows):
    return ""
  flax_dirs = _package_dirs("flax")
  classes = []
  for r in report.rows:  # r.op: 'Linear.__call__ (.../flax/nnx/nn/linear.py:9)'
    func, _, where = r.op.partition(" (")
    file = where.rstrip(")").rpartition(":")[0]
    if "." in func and os.path.realpath(file).startswith(flax_dirs):
      classes.append(func.split(".")[0])
  if not classes:
    return ""
  kinds = ", ".join(dict.fromkeys(classes))
  return (f"{len(classes)} of the {len(report.rows)} matmuls and convolutions "
          f"of {report.function or 'the function'} run in Flax modules "
          f"({kinds}) that have no module path here, so a policy can set only "
          f"one precision for them all. A function that calls the model (an "
          f"NNX model merged inside it with nnx.merge(graphdef, state)(x), or "
          f"passed to it as an argument) hides its submodules: return the "
          f"module itself as the function (fn = model, args = (x,)) so that "
          f"jaxprec sees its submodules")


# ---------------------------------------------------------------------------
# Rows.


def walk_modules(closed, module_paths: dict[str, list[str]] | None = None
                 ) -> Iterator[tuple[walker.WalkedEqn, str, str]]:
  """``(walked equation, name stack, module path)`` of every equation of ``closed``.

  ``module_paths`` is what :func:`jaxprec._src.flax.paths.record` found
  while ``closed`` was traced. The one place that gives an equation its
  module path: the audit's rows and the search's switched program
  (:mod:`jaxprec._src.search.switch`) both read it.
  """
  # Name stacks are relative to the enclosing jaxpr; ``prefix[d]`` is the path
  # of the body at depth d. iter_eqns yields a parent right before its bodies,
  # depth first, so the last parent seen at depth d - 1 encloses depth d.
  # Module paths were recorded under the same relative name stacks; a body
  # whose stacks match no module call belongs to its parent's module.
  prefix: dict[int, str] = {0: ""}
  module_prefix: dict[int, str] = {0: ""}
  for w in walker.iter_eqns(closed):
    eqn = w.eqn
    depth = len(w.scope)
    relative = compat.eqn_name_stack(eqn)
    path = _join(prefix.get(depth, ""), relative)
    module = flax_paths.lookup(relative, module_paths or {},
                               module_prefix.get(depth, ""))
    if module is None:
      module = module_prefix.get(depth, "")
    module_prefix[depth + 1] = module
    if eqn.primitive.name in ("jit", "pjit"):
      prefix[depth + 1] = _join(path, f"jit({eqn.params.get('name', '')})")
    else:
      prefix[depth + 1] = path
    yield w, path, module


# Ops that move a stored value to a dot without computing on it: the audit
# follows them back to find what is stored (AuditRow.lhs_storage).
FOLLOWED = frozenset({"convert_element_type", "reshape", "transpose",
                       "squeeze", "expand_dims", "broadcast_in_dim", "copy",
                       "copy_p"})


class Storage:
  """The stored dtype of each jaxpr variable, one environment per depth.

  Fed every equation in :func:`walker.iter_eqns` order (a parent right before
  its bodies). A variable made by a :data:`FOLLOWED` op from another has that
  one's storage; a body's inputs have the storage of the parent's operands;
  after a body, the parent's outputs have the storage of the body's outputs
  (for bodies that map one to one: jit, remat, custom_jvp/vjp, scan).
  """

  def __init__(self) -> None:
    self._env: dict[int, dict[Any, str]] = {0: {}}
    self._open: list[tuple[int, Any, list[Any]]] = []

  def of(self, var: Any, depth: int) -> str:
    """The stored dtype name of ``var``, an operand at ``depth``."""
    if isinstance(var, compat.Var):
      found = self._env.get(depth, {}).get(var)
      if found is not None:
        return found
    dtype = var.aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
      return str(dtype)  # a typed PRNG key (key<fry>): no NumPy dtype
    return np.dtype(dtype).name

  def visit(self, eqn: Any, depth: int) -> None:
    """Records what ``eqn`` (met at ``depth``) tells about storage: call it
    for every equation, in order, before asking :meth:`of` about its
    operands."""
    while self._open and self._open[-1][0] >= depth:
      self._close(*self._open.pop())
    env = self._env.setdefault(depth, {})
    if (eqn.primitive.name in FOLLOWED and eqn.invars
        and len(eqn.outvars) == 1):
      env[eqn.outvars[0]] = self.of(eqn.invars[0], depth)
    subs = body_operands(eqn)
    if subs:
      inner: dict[Any, str] = {}
      for jaxpr, operands in subs:
        for v, o in zip(jaxpr.invars, operands):
          inner[v] = self.of(o, depth)
      self._env[depth + 1] = inner
      self._open.append((depth, eqn, [j for j, _ in subs]))

  def _close(self, depth: int, eqn: Any, bodies: list[Any]) -> None:
    if len(bodies) != 1 or len(bodies[0].outvars) != len(eqn.outvars):
      return
    inner = self._env.get(depth + 1, {})
    outer = self._env.setdefault(depth, {})
    for v, o in zip(bodies[0].outvars, eqn.outvars):
      if isinstance(v, compat.Var) and v in inner:
        outer[o] = inner[v]


def body_operands(eqn: Any) -> list[tuple[Any, list[Any]]]:
  """``(body jaxpr, the parent's operands for its inputs)`` for each body."""
  params = eqn.params
  bodies = list(compat.jaxprs_in_params(params))
  if not bodies:
    return []
  ins = list(eqn.invars)
  name = eqn.primitive.name
  if name == "while":
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    carry = ins[cn + bn:]
    return [(params["cond_jaxpr"].jaxpr, ins[:cn] + carry),
            (params["body_jaxpr"].jaxpr, ins[cn:cn + bn] + carry)]
  if name == "cond":  # the first operand is the branch index
    return [(j, ins[1:]) for j in bodies]
  return [(j, ins) for j in bodies if len(j.invars) == len(ins)]


def narrow_float(dtype: Any) -> bool:
  """Whether ``dtype`` is a floating dtype of 11 significand bits or fewer
  (bfloat16, float16, float8): one an op should not add many values in.

  Examples:
    >>> from jaxprec._src.inspect.audit import narrow_float
    >>> narrow_float("bfloat16"), narrow_float("float32"), narrow_float("int8")
    (True, False, False)
  """
  try:
    dtype = jax.numpy.dtype(dtype)
  except TypeError:  # an extended dtype (a typed PRNG key)
    return False
  if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    return False
  return jax.numpy.finfo(dtype).nmant + 1 <= 11


def accumulation_risk(accumulation: str) -> str:
  """Why accumulating in ``accumulation`` is risky (``''`` when it is not):
  a floating dtype with 11 significand bits or fewer (bfloat16, float16,
  float8).

  Examples:
    >>> from jaxprec._src.inspect.audit import accumulation_risk
    >>> accumulation_risk("float32"), accumulation_risk("int32")
    ('', '')
    >>> accumulation_risk("float16")[:51]
    'accumulates in float16, its result dtype: sums of m'
  """
  if not narrow_float(accumulation):
    return ""
  bits = jax.numpy.finfo(jax.numpy.dtype(accumulation)).nmant + 1
  # jnp.dot and jnp.einsum record preferred_element_type = the result dtype
  # when the user asks for none, so the two cases read the same.
  return (f"accumulates in {accumulation}, its result dtype: sums of many "
          f"products keep {bits} significand bits, and XLA need not add them "
          f"in float32. Ask preferred_element_type=float32")


def _rows(closed, module_paths: dict[str, list[str]],
          opaque: list[OpaqueRow],
          reductions: list[ReductionRow]) -> Iterator[AuditRow]:
  """The rows of ``closed``; opaque ops are appended to ``opaque``, ops that
  add in a narrow dtype to ``reductions``."""
  storage = Storage()
  loops = _LoopCarries()
  meshes: dict[int, dict[str, int]] = {0: {}}  # mesh axis sizes per depth
  n = 0
  for w, path, module in walk_modules(closed, module_paths):
    eqn = w.eqn
    depth = len(w.scope)
    storage.visit(eqn, depth)
    sizes = meshes.get(depth, {})
    meshes[depth + 1] = {**sizes, **_mesh_sizes(eqn)}
    name = walker.opaque_name(eqn)
    if name is not None:
      source, _ = _frames(eqn, w.enclosing)
      opaque.append(OpaqueRow(primitive=eqn.primitive.name, name=name,
                              source=source, name_stack=path,
                              scope=tuple(w.scope), trip_count=w.trip_count))
    row = None
    if eqn.primitive.name in walker.PRIMITIVES:
      row = _row(w, path, module, storage)
      n += 1
      yield row
    found = _reduction(w, path, module, row, n, sizes, loops)
    if found is not None:
      reductions.append(found)
    loops.visit(eqn)


# ---------------------------------------------------------------------------
# Low-precision accumulation.

# The ops that add values into a result, by kind: the audit lists each one
# that adds in a narrow float (narrow_float: bfloat16, float16, float8) as a
# ReductionRow. Not listed, by decision: maxima and minima (reduce_max,
# cummax, argmax, pmax, reduce_window_max, ...: they select a value, exactly);
# products (reduce_prod, cumprod, scatter-mul: each product rounds relative to
# itself, no term vanishes against a larger partial result as it does in a
# sum); reduce_precision (it rounds one value, adds nothing); an elementwise
# add of two arrays (one rounding per element); and data movement
# (all_gather, all_to_all, ppermute). ``reduce`` and ``reduce_window`` with
# a computation of their own count where that computation adds (``lax.reduce``
# with a lambda JAX does not recognise as a monoid). The names are those of
# jax 0.10.2 to 0.12 (``psum_invariant`` is shard_map's psum when it checks
# varying axes; pmap binds ``psum`` inside a shard_map); each is in the
# walker's table (tests/test_audit_reductions.py checks it).
ACCUMULATING: dict[str, str] = {
    "reduce_sum": "sum", "reduce": "sum",
    "reduce_window_sum": "window", "reduce_window": "window",
    "cumsum": "cumulative", "cumlogsumexp": "cumulative",
    "scatter-add": "scatter", "scatter_add": "scatter",
    "scatter-sub": "scatter",
    # max pooling's gradient: every window adds its cotangent to its maximum
    "select_and_scatter_add": "scatter",
    "psum": "collective", "psum_start": "collective",
    "psum_invariant": "collective", "psum_invariant_start": "collective",
    "reduce_scatter": "collective", "reduce_scatter_start": "collective",
    "unreduced_psum": "collective", "unreduced_psum_start": "collective",
    "unreduced_reduce_scatter": "collective",
    "unreduced_reduce_scatter_start": "collective",
}

# The adds a loop body applies to its carry (kind "loop"): a gradient
# accumulated over the steps of a scan, JAX's transpose of a scan over shared
# weights, a running sum in a fori_loop.
_CARRY_ADDS = frozenset({"add", "add_any", "sub"})

# What jax_allow_f16_reductions does, in jax 0.10.2 to 0.12 alike: the
# option is defined in jax/_src/config.py ("If False, `reduce_sum` on `f16`
# or `bf16` inputs will raise an error", default True, part of the jit key
# and trace context); its one use is reduce_sum's dtype rule,
# _reduce_sum_dtype_rule in jax/_src/lax/lax.py, which raises ValueError for
# a float16 or bfloat16 operand unless every reduced axis has size 1. No
# lowering reads it: it never changes what XLA compiles.
FLAG_NOTE = (
    "jax_allow_f16_reductions=False (JAX's default is True) makes JAX raise "
    "ValueError when it traces a reduce_sum of bfloat16 or float16 over an "
    "axis longer than 1 (_reduce_sum_dtype_rule, jax/_src/lax/lax.py); it "
    "checks no other op and does not change what XLA computes")

# How to add in float32 instead, by kind.
_FIXES = {
    "sum": "cast the operand to float32 first (jnp.sum(x) does that for "
           "bfloat16 and float16 unless dtype= is given)",
    "window": "cast the operand to float32 first",
    "cumulative": "cast the operand to float32 first",
    "scatter": "scatter a float32 copy and cast the result",
    "collective": "sum a float32 copy across devices (jax issue 27496)",
    "loop": "carry the sum in float32",
    "dot": "ask preferred_element_type=float32",
    "conv": "ask preferred_element_type=float32",
}


def direction(name_stack: str) -> str:
  """``'backward'``, ``'jvp'`` or ``'forward'`` for an op with the name
  stack ``name_stack``, from the markers JAX's autodiff puts into names:
  ``transpose(...)`` around a transposed op (the backward pass of
  ``jax.grad`` and ``jax.vjp``), ``jvp(...)`` around an op of a
  differentiated function's forward sweep (see :class:`ReductionRow`).

  Examples:
    >>> from jaxprec._src.inspect.audit import direction
    >>> direction("transpose(jvp(MLP))/dense"), direction("jvp(MLP)/dense")
    ('backward', 'jvp')
    >>> direction("jit(f)/MLP/dense")
    'forward'
  """
  if "transpose(" in name_stack:
    return "backward"
  if "jvp(" in name_stack:
    return "jvp"
  return "forward"


def _mesh_sizes(eqn: Any) -> dict[str, int]:
  """The axis sizes of the mesh a ``shard_map`` binds (``jax.pmap`` binds
  one too, in jax 0.10.2 to 0.12); ``{}`` for every other equation."""
  if eqn.primitive.name != "shard_map":
    return {}
  shape = getattr(eqn.params.get("mesh"), "shape", None)
  if not isinstance(shape, Mapping):
    return {}
  return {str(k): known_int(v) for k, v in shape.items()}


class _LoopCarries:
  """The adds that a ``scan`` or ``while`` body applies to a narrow carry:
  ``carry_out = add(carry_in, x)``. Fed each equation after its row, before
  its body is walked."""

  def __init__(self) -> None:
    self._terms: dict[int, int] = {}

  def terms(self, eqn: Any) -> int | None:
    """The loop's trip count (0: unknown) if ``eqn`` adds to a carry."""
    return self._terms.get(id(eqn))

  def visit(self, eqn: Any) -> None:
    params = eqn.params
    name = eqn.primitive.name
    if name == "scan":
      body = params["jaxpr"].jaxpr
      first, count = compat.scan_counts(params)
      trips = known_int(params.get("length", 0))
    elif name == "while":
      body, first = params["body_jaxpr"].jaxpr, params["body_nconsts"]
      count, trips = len(body.outvars), 0
    else:
      return
    made = {v: e for e in body.eqns for v in e.outvars}
    for i in range(count):
      out, carry = body.outvars[i], body.invars[first + i]
      add = made.get(out) if isinstance(out, compat.Var) else None
      if (add is not None and add.primitive.name in _CARRY_ADDS
          and any(v is carry for v in add.invars)
          and narrow_float(out.aval.dtype)):
        self._terms[id(add)] = trips


def _reduction(w: walker.WalkedEqn, name_stack: str, module: str,
               row: AuditRow | None, number: int, mesh: dict[str, int],
               loops: _LoopCarries) -> ReductionRow | None:
  """The :class:`ReductionRow` of ``w``, or None where it adds nothing in a
  narrow float. ``row`` is its :class:`AuditRow` (number ``number``) for a
  dot or convolution, ``mesh`` the axis sizes of the enclosing meshes."""
  eqn = w.eqn
  prim = eqn.primitive.name
  params = eqn.params
  ins = [v.aval for v in eqn.invars]
  outs = [v.aval for v in eqn.outvars]
  kind = ACCUMULATING.get(prim)
  axes: tuple[str, ...] = ()
  operands, index = 1, 0
  if row is not None:
    if not narrow_float(row.accumulation_dtype):
      return None
    kind = numerics.op_kind(prim)
    dtype = row.accumulation_dtype
    if prim == "conv_general_dilated":
      spec = params["dimension_numbers"].rhs_spec
      terms = math.prod(ins[1].shape[i] for i in spec[2:]) * ins[1].shape[spec[1]]
    else:
      dims = (params["ragged_dot_dimension_numbers"].dot_dimension_numbers
              if prim == "ragged_dot_general" else params["dimension_numbers"])
      terms = math.prod(ins[0].shape[i] for i in dims[0][0])
  elif loops.terms(eqn) is not None:
    kind, terms = "loop", loops.terms(eqn) or 0
    dtype = np.dtype(outs[0].dtype).name
  elif kind is None:
    return None
  else:
    if kind in ("sum", "window") and prim in ("reduce", "reduce_window"):
      if not any(e.primitive.name in ("add", "add_any")
                 for j in compat.jaxprs_in_params(params) for e in j.eqns):
        return None
    narrow = [i for i, a in enumerate(ins)
              if hasattr(a, "dtype") and narrow_float(a.dtype)]
    if not narrow:
      return None
    index = narrow[0]
    operands = len(narrow) if kind == "collective" else 1
    dtype = np.dtype(ins[index].dtype).name
    terms = _terms(prim, params, ins, index, mesh)
    if kind == "collective":
      names = params.get("axes", params.get("axis_name", ()))
      axes = tuple(str(a) for a in (names if isinstance(names, tuple)
                                    else (names,)))
  shape = tuple(ins[index].shape) if row is None else tuple(row.lhs_shape)
  out_i = min(index, len(outs) - 1) if kind in ("collective", "sum") else 0
  terms = known_int(terms)
  if terms == 1 and kind != "collective":
    return None  # one value: nothing is added (a sum over an axis of size 1)
  rejected = (prim == "reduce_sum" and dtype in ("bfloat16", "float16")
              and any(known_int(ins[0].shape[a]) != 1 for a in params["axes"]))
  if kind == "collective":  # the mesh traced may be smaller than the one run
    what = f"the {dtype} values of every device ({terms or 'unknown'} here)"
  else:
    what = f"{terms} {dtype} values" if terms else f"{dtype} values"
  fix = _FIXES[kind]
  if kind == "sum" and direction(name_stack) == "backward":
    # JAX's transpose of a broadcast (jax/_src/lax/lax.py) is a reduce_sum
    # in the cotangent's dtype, the broadcast value's.
    fix = ("in the backward pass it sums the gradient of a value the forward "
           "pass broadcast: cast that value to float32 before it is broadcast")
  reason = (f"adds {what} into each result, rounding every partial sum to "
            f"{dtype}; {fix}")
  source, op = _frames(eqn, w.enclosing)
  return ReductionRow(
      primitive=prim, kind=kind, dtype=dtype, operand_shape=shape,
      out_shape=tuple(outs[out_i].shape), operands=operands,
      terms=terms, direction=direction(name_stack), axes=axes,
      rejected_by_flag=rejected, matmul_row=number if row is not None else 0,
      reason=reason, source=source, op=op, name_stack=name_stack,
      scope=tuple(w.scope), trip_count=w.trip_count, module_path=module)


def _terms(prim: str, params: dict, ins: list[Any], index: int,
           mesh: dict[str, int]) -> int:
  """How many values a reduction adds into one result element at most."""
  shape = ins[index].shape
  if prim in ("reduce_sum", "reduce"):
    return math.prod(shape[a] for a in params.get("axes",
                                                  params.get("dimensions", ())))
  if prim in ("reduce_window_sum", "reduce_window"):
    return math.prod(params["window_dimensions"])
  if prim in ("cumsum", "cumlogsumexp"):
    return shape[params["axis"]]
  if prim == "select_and_scatter_add":
    return math.prod(-(-w // s) for w, s in zip(params["window_dimensions"],
                                                params["window_strides"]))
  if prim.startswith("scatter"):
    window = params["dimension_numbers"].update_window_dims
    updates = ins[2].shape
    return 1 + math.prod(d for i, d in enumerate(updates) if i not in window)
  # A collective: the devices along its axes.
  if "axis_size" in params:
    return known_int(params["axis_size"])
  names = params.get("axes", params.get("axis_name", ()))
  sizes = [mesh.get(str(a), 0) for a in (names if isinstance(names, tuple)
                                         else (names,))]
  return math.prod(sizes) if all(sizes) else 0


def _row(w: walker.WalkedEqn, name_stack: str, module: str,
         storage: Storage) -> AuditRow:
  eqn = w.eqn
  depth = len(w.scope)
  prim = eqn.primitive.name
  lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
  out = eqn.outvars[0].aval
  precision = eqn.params.get("precision")
  lhs_dtype, rhs_dtype = np.dtype(lhs.dtype).name, np.dtype(rhs.dtype).name
  preferred = eqn.params.get("preferred_element_type")
  accumulation = np.dtype(out.dtype if preferred is None else preferred).name
  tpu, gpu, tpu_n, gpu_n = _effective(prim, precision, lhs_dtype, rhs_dtype)
  # XLA's shape rules (numerics.shape_rule) at the recorded precision, as
  # _effective reads it: XLA:GPU's strength reduction of a small dot with a
  # vector, a TPU's matrix-vector product at DEFAULT.
  level = lax.Precision.DEFAULT if precision is None else precision
  rules = {"gpu": "", "tpu": ""}
  for target, algorithm in (("gpu", gpu), ("tpu", tpu)):
    if prim == "dot_general" and algorithm in ("tf32", "bf16x1"):
      rules[target] = numerics.shape_rule(
          level, target, lhs.shape, rhs.shape,
          eqn.params["dimension_numbers"]) or ""
  if rules["gpu"]:
    gpu, gpu_n = "f32", algorithms.record("f32")
  if rules["tpu"]:
    tpu, tpu_n = "f32", algorithms.record("f32")
  shape_rule, tpu_shape_rule = rules["gpu"], rules["tpu"]
  risky, reason = _risk(prim, precision, lhs_dtype, rhs_dtype, tpu_n)
  acc_reason = accumulation_risk(accumulation)
  if acc_reason:
    risky, reason = True, "; ".join(r for r in (reason, acc_reason) if r)
  source, op = _frames(eqn, w.enclosing)
  groups = 0
  if prim == "ragged_dot_general":
    # Each lhs element meets the free rhs columns of one group only: the
    # rhs's group dimension is not a product.
    ragged = eqn.params["ragged_dot_dimension_numbers"]
    (_, rhs_contract), (_, rhs_batch) = ragged.dot_dimension_numbers
    skip = {*rhs_contract, *rhs_batch, *ragged.rhs_group_dimensions}
    flops = 2 * math.prod(lhs.shape) * math.prod(
        d for i, d in enumerate(rhs.shape) if i not in skip)
    groups = known_int(eqn.invars[2].aval.shape[-1])
  elif prim == "dot_general":
    dims = eqn.params["dimension_numbers"]
    # 2 * (batch * M * K) * N: every lhs element meets every free rhs column.
    (_, rhs_contract), (_, rhs_batch) = dims
    flops = 2 * math.prod(lhs.shape) * math.prod(
        d for i, d in enumerate(rhs.shape)
        if i not in rhs_contract and i not in rhs_batch)
  else:
    # 2 * output elements * kernel spatial size * input features per group
    # (the kernel's input-feature dimension holds in_features / groups).
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
    flops = 2 * math.prod(out.shape) * math.prod(
        rhs.shape[i] for i in spec[2:]) * rhs.shape[spec[1]]
  return AuditRow(
      primitive=prim, source=source, op=op, name_stack=name_stack,
      scope=tuple(w.scope), trip_count=w.trip_count,
      lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape),
      out_shape=tuple(out.shape), lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype,
      out_dtype=np.dtype(out.dtype).name, precision=precision,
      precision_name=_precision_name(precision), tpu=tpu, gpu=gpu,
      tpu_numerics=tpu_n, gpu_numerics=gpu_n,
      flops=known_int(flops) * w.trip_count, risky=risky, reason=reason,
      module_path=module, emulated=walker.OPAQUE_PRIMITIVES.isdisjoint(w.scope),
      lhs_storage=storage.of(eqn.invars[0], depth),
      rhs_storage=storage.of(eqn.invars[1], depth),
      accumulation_dtype=accumulation, groups=groups, shape_rule=shape_rule,
      tpu_shape_rule=tpu_shape_rule)


def _precision_name(precision: Any) -> str:
  if precision is None:
    return "None"
  if isinstance(precision, (lax.DotAlgorithmPreset, lax.Precision)):
    return precision.name
  if isinstance(precision, tuple) and len(precision) == 2:
    names = [p.name if isinstance(p, lax.Precision) else str(p) for p in precision]
    return names[0] if names[0] == names[1] else ",".join(names)
  return str(precision)


def _effective(prim: str, precision: Any, lhs_dtype: str, rhs_dtype: str
               ) -> tuple[str, str, Numerics | None, Numerics | None]:
  """What runs on TPU and GPU, (tpu, gpu, tpu_numerics, gpu_numerics), as
  :func:`jaxprec._src.core.numerics.op_numerics` decides it."""
  recorded = lax.Precision.DEFAULT if precision is None else precision
  meanings = []
  for target in ("tpu", "gpu"):
    try:
      n = numerics.op_numerics(recorded, target, lhs_dtype, rhs_dtype, op=prim)
    except ValueError:
      return "unknown", "unknown", None, None  # a custom lax.DotAlgorithm
    if n is None:  # the precision does not apply to these operands
      native = (f"native {lhs_dtype}" if lhs_dtype == rhs_dtype
                else f"native {lhs_dtype}x{rhs_dtype}")
      return native, native, None, None
    meanings.append(n)
  tpu, gpu = meanings
  return tpu.algorithm, gpu.algorithm, tpu, gpu


def _risk(prim: str, precision: Any, lhs_dtype: str, rhs_dtype: str,
          tpu: Numerics | None) -> tuple[bool, str]:
  if tpu is None:  # native operands, or a custom lax.DotAlgorithm
    return False, ""
  if not tpu.supported:
    head = "not modelled: " if not tpu.modelled else "unsupported on TPU: "
    return True, head + numerics.unsupported_message(
        resolve(precision), "tpu")
  if numerics.lowered(precision, numerics.op_kind(prim)) is not precision:
    # A convolution that recorded a preset (JAX's conv_general_dilated lowering, jax/_src/lax/convolution.py).
    return True, (
        f"convolution recorded with preset {precision.name}: JAX lowers "
        f"convolutions under a preset at DEFAULT, 1 bfloat16 pass on TPU (TF32 "
        f"on GPU); use a level (e.g. 'float32') or decorate the function with "
        f"@jaxprec.precision({precision.name!r})")
  if tpu.operand_bits > 11:
    return False, ""
  if precision is None:
    why = "no precision set, the backend default"
  else:
    why = f"precision {_precision_name(precision)}"
  operands = ("float32 operands" if lhs_dtype == rhs_dtype
              else f"{lhs_dtype} x {rhs_dtype} operands")
  return True, (f"{operands}, {why}: on TPU, {tpu.note} "
                f"({tpu.operand_bits} significand bits)")


def _frames(eqn, enclosing: tuple[Any, ...] = ()) -> tuple[str, str]:
  """(source, op) from the equation's frames; see AuditRow. Where its own
  frames are jaxprec's walker (tracing a library primitive's
  implementation) or none, ``op`` is the innermost enclosing equation's
  (:attr:`walker.WalkedEqn.enclosing`); where they are all a library's (a
  product inside a lineax solve, an ``eqx.filter_jit`` of its own), the
  source is the enclosing equations' first user line, innermost first: the
  user's call of the library."""
  own = [f for f in compat.eqn_user_frames(eqn)
         if not os.path.realpath(f[0]).startswith(_WALKER_DIR)]
  outer = [f for e in reversed(enclosing) for f in compat.eqn_user_frames(e)]
  frames = own or outer
  if not frames:
    return "", ""
  file, line, func = frames[0]
  op = f"{func} ({file}:{line})"
  for file, line, _ in (*own, *outer):
    if not os.path.realpath(file).startswith(_library_dirs()):
      return f"{file}:{line}", op
  return "", op


# jaxprec's jaxpr package: a frame there (the walker tracing a library
# primitive's implementation) is never the user's op.
_WALKER_DIR = os.path.join(os.path.dirname(os.path.realpath(walker.__file__)), "")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
  """The folders of :data:`_LIBRARY_PACKAGES`, each ending in a separator."""
  return tuple(d for pkg in _LIBRARY_PACKAGES for d in _package_dirs(pkg))


@functools.cache
def _package_dirs(pkg: str) -> tuple[str, ...]:
  """The folders of the package ``pkg``, each ending in a separator."""
  try:
    spec = importlib.util.find_spec(pkg)
  except (ImportError, ValueError):
    return ()
  return tuple(os.path.join(os.path.realpath(d), "")
               for d in (spec and spec.submodule_search_locations) or ())


def known_int(x) -> int:
  """``int(x)``, or 0 for a symbolic size (``jax.export``)."""
  try:
    return int(x)
  except (TypeError, ValueError):
    return 0


def _join(a: str, b: str) -> str:
  return f"{a}/{b}" if a and b else a or b


def _qualname(fn) -> str:
  inner = getattr(fn, "func", None)  # functools.partial
  for f in (fn, inner):
    name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None)
    if isinstance(name, str):
      return name
  # A callable object (an NNX module): its class, not a many-line repr.
  return type(fn).__qualname__


# ---------------------------------------------------------------------------
# Text.

_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16",
          "float64": "f64", "int8": "i8", "int32": "i32"}
# Narrow floats: an op that accumulates in one is risky (accumulation_risk).
_NARROW = ("bfloat16", "float16")


def _short(dtype: str) -> str:
  return _SHORT.get(dtype, dtype)


def _dtype_summary(rows: Any) -> str:
  """One line on the dtypes of ``rows``, or ``''`` when all are float32."""
  compute = collections.Counter(d for r in rows
                                for d in {r.lhs_dtype, r.rhs_dtype})
  narrow_acc = [r for r in rows if (r.accumulation_dtype or r.out_dtype)
                in _NARROW]
  cast = sum(1 for r in rows if (r.lhs_storage and r.lhs_storage != r.lhs_dtype)
             or (r.rhs_storage and r.rhs_storage != r.rhs_dtype))
  if set(compute) <= {"float32"} and not narrow_acc:
    return ""
  parts = [f"{n} {_verb(n, 'compute')} in {d}" for d, n in sorted(
      compute.items(), key=lambda kv: (-kv[1], kv[0]))]
  line = f"dtypes: of {len(rows)} ops, {', '.join(parts)}"
  if cast:
    line += f"; {cast} {_verb(cast, 'cast')} an operand from its stored dtype"
  n = len(narrow_acc)
  line += (f"; {n} {_verb(n, 'accumulate')} in bfloat16/float16 (risky: ask "
           f"preferred_element_type=float32)" if narrow_acc
           else "; none accumulates in bfloat16/float16")
  return line


def _verb(n: int, verb: str) -> str:
  return verb + "s" if n == 1 else verb


def si(n: float, small: str = ".3g") -> str:
  """``n`` with an SI prefix (``'1.02k'``); below 1000 in format ``small``."""
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.3g}{unit}"
  return f"{n:{small}}"


def table(cols: Sequence[str], body: Sequence[Sequence[str]],
          right: Collection[int]) -> list[str]:
  """The header ``cols``, a rule and the ``body`` rows, each column as wide
  as its widest cell; columns ``right`` right-aligned."""
  widths = [max(len(c), *(len(b[j]) for b in body)) for j, c in enumerate(cols)]

  def line(cells):
    return "  ".join(c.rjust(w) if j in right else c.ljust(w)
                     for j, (c, w) in enumerate(zip(cells, widths))).rstrip()
  return [line(cols), line(["-" * w for w in widths])] + [line(b) for b in body]


def _shape(dtype: str, shape: tuple[int, ...]) -> str:
  return f"{_short(dtype)}[{','.join(str(d) for d in shape)}]"


def _short_path(source: str) -> str:
  if not source:
    return "?"
  path, _, line = source.rpartition(":")
  try:
    rel = os.path.relpath(path)
  except ValueError:  # another drive on Windows
    rel = path
  if rel.startswith(".."):
    rel = os.path.join(*path.split(os.sep)[-2:]) if os.sep in path else path
  return f"{rel}:{line}"


def _share(totals: dict[str, int]) -> str:
  whole = sum(totals.values())
  if not whole:
    return ", ".join(totals) or "-"
  return ", ".join(f"{k} {100 * v / whole:.0f}%" for k, v in totals.items())


def _opaque_lines(report: AuditReport) -> list[str]:
  rows = report.opaque
  if not rows:
    return []
  out = [f"opaque: {len(rows)} op(s) jaxprec cannot see into (run natively, "
         f"not emulated; their precision is their own):"]
  for r in rows:
    where = f" at {_short_path(r.source)}" if r.source else ""
    stack = f" [{r.name_stack}]" if r.name_stack else ""
    times = f" x{r.trip_count}" if r.trip_count != 1 else ""
    out.append(f"  {r.name}{times}{stack}{where}")
  return out


# Reductions are printed as wrapped lines, not as a table: every line fits
# in this many columns.
_WIDTH = 100


def _count(r: ReductionRow) -> str:
  noun = "device" if r.kind == "collective" else "term"
  if not r.terms:
    return f"{noun}s unknown"
  return f"{r.terms} {noun}" + ("" if r.terms == 1 else "s")


def _reduction_lines(report: AuditReport) -> list[str]:
  """The report's :class:`ReductionRow` as lines of at most :data:`_WIDTH`."""
  rows = report.reductions
  if not rows:
    return []
  dtypes = "/".join(dict.fromkeys(r.dtype for r in rows))
  n = len(rows)
  out = textwrap.wrap(
      f"low-precision accumulation: {n} {'op adds' if n == 1 else 'ops add'} "
      f"in {dtypes}, each partial sum rounded to it:", _WIDTH,
      subsequent_indent="  ")
  for i, r in enumerate(rows, 1):
    what = (f"{r.primitive} #{r.matmul_row}" if r.matmul_row else r.primitive)
    shape = _shape(r.dtype, r.operand_shape)
    if r.operands > 1:
      shape += f" and {r.operands - 1} more"
    parts = [f"R{i}", what, f"{shape} -> [{','.join(map(str, r.out_shape))}]",
             _count(r), r.direction]
    if r.trip_count != 1:
      parts.append(f"x{r.trip_count}")
    if r.axes:
      parts.append(f"over {','.join(r.axes)}")
    if r.module_path:
      parts.append(f"module {r.module_path}")
    if r.name_stack:
      parts.append(f"[{r.name_stack}]")
    if r.source:
      parts.append(f"at {_short_path(r.source)}")
    out += textwrap.wrap("  " + "  ".join(parts), _WIDTH,
                         subsequent_indent="      ", break_on_hyphens=False)
  by_reason: dict[str, list[int]] = {}
  for i, r in enumerate(rows, 1):
    by_reason.setdefault(r.reason, []).append(i)
  for reason, nums in by_reason.items():
    out += textwrap.wrap(f"  {', '.join(f'R{i}' for i in nums)}: {reason}",
                         _WIDTH, subsequent_indent="      ")
  flagged = [i for i, r in enumerate(rows, 1) if r.rejected_by_flag]
  if flagged:
    out += textwrap.wrap(
        f"  {', '.join(f'R{i}' for i in flagged)}: {FLAG_NOTE}", _WIDTH,
        subsequent_indent="      ")
  return out
