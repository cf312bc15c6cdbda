"""What a precision policy costs: FLOPs weighted by the passes each op needs.

:func:`cost` lists a function's matmuls and convolutions with
:func:`jaxprec.audit`, traced as :func:`jaxprec.emulate` traces it under a
policy, finds for each op the algorithm the target runs
(:func:`jaxprec._src.core.numerics.algorithm_for`, as the emulation does), and
weighs its FLOPs by that algorithm's passes times the cost of one pass in its
format (:data:`PASS_COSTS`), in units of the target's cheapest float32 matmul
pass: one bfloat16 pass on a TPU, one TF32 pass on an NVIDIA GPU
(``docs/search.md`` has the table with sources). With a chip
(:mod:`jaxprec._src.inspect.chips`) each op also takes a roofline time;
``docs/cost.md`` has the figures, their sources and what the model leaves out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxprec._src.core import algorithms
from jaxprec._src.core import context
from jaxprec._src.core import names
from jaxprec._src.core import numerics
from jaxprec._src.core.numerics import algorithm_for
from jaxprec._src.core.precision import Precision
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.inspect import audit as audit_lib
from jaxprec._src.inspect import chips as chips_lib
from jaxprec._src.inspect.audit import si, table
from jaxprec._src.policy import policy as policy_lib
from jaxprec._src.policy.policy import Policy, PolicyLike

# Cost of one pass in each format, per FLOP, in units of the target's
# cheapest float32 matmul pass (docs/search.md has the sources: a GPU's
# float32 8 is the A100's dense TF32/FP32 ratio, 156 / 19.5 TFLOPS). A pass
# format a target has no figure for is left unweighted.
PASS_COSTS: Mapping[str, Mapping[str, float]] = {
    "tpu": {"bfloat16": 1.0},
    "gpu": {"tensorfloat32": 1.0, "float32": 8.0, "bfloat16": 0.5,
            "float16": 0.5, "float8": 0.25, "int8": 0.25, "float64": 8.0},
}
# The cost keys of ops the precision does not apply to (algorithm()).
_NATIVE_KEYS = tuple(f"native {d}" for d in (
    "bfloat16", "float16", "float8", "int8", "float32", "float64"))


def _weights(target: str) -> dict[str, float]:
  """Cost per FLOP of each algorithm the target runs and of each native
  dtype: passes times the cost of a pass in its format, both read from the
  one table (:func:`jaxprec._src.core.algorithms.pass_type`)."""
  out = {}
  for key in (*numerics.ALGORITHMS[1:], *_NATIVE_KEYS):
    kind = algorithms.pass_type(key, target)
    if kind is not None and kind[0] in PASS_COSTS[target]:
      out[key] = kind[1] * PASS_COSTS[target][kind[0]]
  return out


WEIGHTS: Mapping[str, Mapping[str, float]] = {
    t: _weights(t) for t in numerics.TARGETS}


def weights_for(target: str, weights: Mapping[str, float] | None = None
                ) -> dict[str, float]:
  """:data:`WEIGHTS` of ``target`` updated with ``weights`` (validated)."""
  out = dict(WEIGHTS[target])
  for k, v in (weights or {}).items():
    if not isinstance(k, str) or isinstance(v, bool) or not isinstance(
        v, (int, float)) or not (math.isfinite(v) and v >= 0):
      raise ValueError(f"weights must map algorithm names to finite numbers "
                       f">= 0; got {k!r}: {v!r}.")
    out[k] = float(v)
  return out


def _native_key(lhs: str, rhs: str) -> str:
  """The cost key of an op on ``lhs`` x ``rhs`` operands the precision does
  not apply to: ``'native <the wider dtype>'``, 8-bit types by class."""
  a, b = ("float8" if d.startswith("float8") else "int8"
          if d in ("int8", "uint8") else d for d in (lhs, rhs))
  order = ("float64", "float32", "bfloat16", "float16", "float8", "int8")
  return f"native {next((d for d in order if d in (a, b)), a)}"


def algorithm(row: audit_lib.AuditRow, target: str,
              unset: Precision | None = None) -> str:
  """What ``target`` runs for an audited op (a key of :data:`WEIGHTS`).

  Args:
    row: the op.
    target: ``'tpu'`` or ``'gpu'``.
    unset: the precision for an op that recorded none (None: DEFAULT).

  Returns:
    An emulation algorithm name (``'bf16x3'``, ``'tf32'``, ...), ``'native
    <dtype>'`` for operands the precision does not apply to, or
    ``'unknown'`` for a custom ``lax.DotAlgorithm``.

  Raises:
    UnsupportedAlgorithmError: ``target`` does not run the op's algorithm
      (``F32_F32_F32`` or a TF32 preset on a TPU), as the emulation raises.
  """
  prec = row.precision
  if prec is None and unset is not None:
    prec = numerics.per_op(unset, numerics.op_kind(row.primitive))
  if prec is None:  # the backend default: the target's DEFAULT
    prec = lax.Precision.DEFAULT
  try:
    algo = algorithm_for(prec, target, jnp.dtype(row.lhs_dtype),
                         jnp.dtype(row.rhs_dtype), op=row.primitive)
  except numerics.UnsupportedAlgorithmError as e:
    # Never a cost of 0: the target cannot run the op at all.
    where = f" at {row.source}" if row.source else ""
    raise numerics.UnsupportedAlgorithmError(
        f"jaxprec.cost: the {row.primitive}{where} has no cost on a "
        f"{target.upper()}: {e}") from None
  except (ValueError, TypeError):
    return "unknown"
  if algo == "native":
    return _native_key(row.lhs_dtype, row.rhs_dtype)
  return algo


def unjit(fn: Callable[..., Any]) -> Callable[..., Any]:
  """The Python function under a top-level ``jax.jit``, else ``fn``.

  A policy reaches a model's ops while it is traced, and ``jax.jit`` keeps
  its trace per input signature and JAX flag, not per policy: tracing the
  jitted function under a second policy would reuse the first's jaxpr.
  """
  inner = getattr(fn, "__wrapped__", None)
  if callable(inner) and isinstance(fn, jax.stages.Wrapped):
    return inner
  return fn


def trace_rows(fn: Callable[..., Any], args: tuple, kwargs: dict,
               policy: Policy | None) -> audit_lib.AuditReport:
  """:func:`jaxprec.audit` of ``fn``, traced as ``jaxprec.emulate(fn, policy)`` is.

  The policy's interception is in force (when Flax linen is imported) and
  JAX's flag is cleared, so ops record the precision the policy gives their
  module, and ops outside modules (and ops without a policy) record None.
  A top-level ``jax.jit`` is looked through (:func:`unjit`).
  """
  fn = nnx_policy.bind(unjit(fn), policy)  # NNX path rules

  @functools.wraps(fn)
  def traced(*a, **k):
    scope = (contextlib.nullcontext() if policy is None
             else flax_scope.policy_scope(policy))
    with scope, jax.default_matmul_precision(None):
      return fn(*a, **k)
  return audit_lib.audit(traced, *args, **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostRow:
  """The matmuls and convolutions of one Flax module path.

  Attributes:
    path: the module path (as :attr:`jaxprec.AuditRow.module_path`; ``''``
      for the top module and for ops outside modules).
    ops: number of ops.
    flops: their FLOPs per call.
    algorithms: what the target runs for them, e.g. ``('bf16x3',)``.
    cost: FLOPs times the weight of each op's algorithm.
    float32_cost: the same at ``policy='float32'``.
    unknown_flops: FLOPs of ops whose algorithm has no weight.
    bytes: bytes the ops move per call: operands and results at their
      dtypes (operands at their compute dtype, after any cast).
    float32_bytes: the same with every operand and result float32.
    seconds: with a chip, the sum of the ops' roofline times (see
      :func:`jaxprec.cost`); None without one.
    float32_seconds: the same ops all-float32 (float32 operands and
      results, the target's float32 algorithm); None without a chip.
    untimed_flops: FLOPs of ops whose pass type the chip has no peak for
      (left out of both times).
  """

  path: str
  ops: int
  flops: int
  algorithms: tuple[str, ...]
  cost: float
  float32_cost: float
  unknown_flops: int = 0
  bytes: int = 0
  float32_bytes: int = 0
  seconds: float | None = None
  float32_seconds: float | None = None
  untimed_flops: int = 0

  @property
  def relative(self) -> float | None:
    """``cost / float32_cost``; 1.0 when both are 0 because there is no op,
    None when both are 0 because every op's cost is unknown."""
    return _ratio(self.cost, self.float32_cost, self.unknown_flops)

  @property
  def bytes_relative(self) -> float:
    """``bytes / float32_bytes``: 0.5 for an all-bfloat16 op."""
    return _ratio(self.bytes, self.float32_bytes)

  @property
  def time_relative(self) -> float | None:
    """``seconds / float32_seconds``; None without a chip, or where the chip
    times none of the ops."""
    if self.seconds is None or self.float32_seconds is None:
      return None
    return _ratio(self.seconds, self.float32_seconds, self.untimed_flops)

  def to_dict(self) -> dict[str, Any]:
    return _to_dict(self)


# Each ratio of a cost row or report, by the figure it divides by.
_RATIOS = {"float32_cost": "relative", "float32_bytes": "bytes_relative",
           "float32_seconds": "time_relative"}


def _to_dict(x: Any) -> dict[str, Any]:
  """The fields of a :class:`CostRow` or :class:`CostReport` as JSON-able
  values, each ratio right after the figure it divides by, the rows last."""
  out: dict[str, Any] = {}
  for f in dataclasses.fields(x):
    v = getattr(x, f.name)
    out[f.name] = ([r.to_dict() for r in v] if f.name == "rows"
                   else list(v) if isinstance(v, tuple)
                   else dict(v) if isinstance(v, Mapping) else v)
    if f.name in _RATIOS:
      out[_RATIOS[f.name]] = getattr(x, _RATIOS[f.name])
  if "rows" in out:
    out["rows"] = out.pop("rows")
  return out


def _ratio(a: float, b: float, left_out: int = 0) -> float | None:
  """``a / b``. 0/0 is 1.0 where nothing was left out of both (no op: the
  same cost as float32), and None where something was (every op unknown or
  untimed: no figure, not "the same cost as float32")."""
  if b == 0:
    if a == 0:
      return None if left_out else 1.0
    return math.inf
  return a / b


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostReport:
  """What :func:`jaxprec.cost` returns: a policy's matmul cost on a target.

  Attributes:
    function: the function's name.
    policy: the policy as text (``str(policy)``).
    target: ``'tpu'`` or ``'gpu'``.
    rows: one :class:`CostRow` per module path, in program order.
    flops: FLOPs per call of every matmul and convolution.
    cost: FLOPs times passes (see :data:`WEIGHTS`), over ops with a weight.
    float32_cost: the same with ``policy='float32'``.
    unknown_flops: FLOPs of ops whose algorithm has no weight (left out of
      both costs).
    by_algorithm: FLOPs per algorithm, largest first.
    weights: the weights used.
    chip: the chip the times are for (a key of ``CHIPS``), or None.
    bytes, float32_bytes: bytes moved per call by every op, at the ops'
      dtypes and all-float32 (see :class:`CostRow`).
    seconds, float32_seconds: with a chip, the roofline time of every op
      with a known pass type, and of the same ops all-float32; None without.
    untimed_flops: FLOPs of ops the chip has no peak for (out of both times).
  """

  function: str
  policy: str
  target: str
  rows: tuple[CostRow, ...]
  flops: int
  cost: float
  float32_cost: float
  unknown_flops: int
  by_algorithm: Mapping[str, int]
  weights: Mapping[str, float]
  chip: str | None = None
  bytes: int = 0
  float32_bytes: int = 0
  seconds: float | None = None
  float32_seconds: float | None = None
  untimed_flops: int = 0

  @property
  def relative(self) -> float | None:
    """``cost / float32_cost``: 1.0 for all-float32, below 1 when cheaper;
    None where every op's cost is unknown (``unknown_flops``)."""
    return _ratio(self.cost, self.float32_cost, self.unknown_flops)

  @property
  def bytes_relative(self) -> float:
    """``bytes / float32_bytes``: 0.5 when every operand and result is 16-bit."""
    return _ratio(self.bytes, self.float32_bytes)

  @property
  def time_relative(self) -> float | None:
    """``seconds / float32_seconds``, the time against all-float32 on the
    chip; None without a chip, or where it times none of the ops
    (``untimed_flops``)."""
    if self.seconds is None or self.float32_seconds is None:
      return None
    return _ratio(self.seconds, self.float32_seconds, self.untimed_flops)

  def row(self, path: str) -> CostRow:
    """The row of module ``path``; KeyError naming the paths otherwise."""
    for r in self.rows:
      if r.path == path:
        return r
    raise names.unknown("module path", path, [r.path for r in self.rows],
                        error=KeyError, hint=" (those of this cost report)")

  def to_dict(self) -> dict[str, Any]:
    """JSON-able values: the attributes, the ratios and the rows."""
    return _to_dict(self)

  def to_json(self, indent: int | None = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  def __str__(self) -> str:
    out = [f"jaxprec cost of {self.function or 'function'} on {self.target}, "
           f"policy {self.policy or '(none)'}: {si(self.cost)} pass-FLOPs = "
           f"{_rel(self.relative)} of float32 ({si(self.float32_cost)})",
           f"bytes moved: {si(self.bytes)}B = {self.bytes_relative:.3f} of "
           f"all-float32 ({si(self.float32_bytes)}B)"]
    timed = self.seconds is not None
    if timed:
      out.append(
          f"time on {self.chip} ({chips_lib.CHIPS[self.chip].description}), "
          f"roofline max(passes*FLOPs/peak, bytes/HBM) per op, no overlap or "
          f"fusion: {_time(self.seconds)} = {_rel(self.time_relative)} of "
          f"all-float32 ({_time(self.float32_seconds)})")
    cols = ["module path", "ops", "FLOPs", "runs as", "cost", "vs float32",
            "bytes", "bytes/f32"]
    if timed:
      cols += ["time", "time/f32"]

    def cells(path, ops, flops, algos, x):
      row = [path, str(ops), si(flops), algos, si(x.cost), _rel(x.relative),
             si(x.bytes), f"{x.bytes_relative:.3f}"]
      if timed:
        row += [_time(x.seconds), _rel(x.time_relative)]
      return row
    body = [cells(x.path or "(top)", x.ops, x.flops, "+".join(x.algorithms),
                  x) for x in self.rows]
    body.append(cells("total", sum(x.ops for x in self.rows), self.flops, "",
                      self))
    out += table(cols, body, set(range(len(cols))) - {0, 3})
    out.append(f"weights ({self.target}, cost per FLOP): " + ", ".join(
        f"{a} {self.weights[a]:g}" for a in self.by_algorithm
        if a in self.weights))
    if self.unknown_flops:
      unknown = [a for a in self.by_algorithm if a not in self.weights]
      out.append(f"not counted: {si(self.unknown_flops)} FLOPs of "
                 f"{', '.join(unknown)} (no weight; pass weights=)")
    if timed and self.untimed_flops:
      out.append(f"not timed: {si(self.untimed_flops)} FLOPs whose pass type "
                 f"{self.chip} has no peak for")
    return "\n".join(out)


def _time(seconds: float | None) -> str:
  if seconds is None:
    return "-"
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if seconds >= scale:
      return f"{seconds / scale:.3g} {unit}"
  return f"{seconds / 1e-9:.3g} ns"


def _rel(x: float | None) -> str:
  return "-" if x is None else f"{x:.3f}"


def _costs(rows, policy: Policy | None, target: str,
           weights: Mapping[str, float]) -> list[tuple[str, float | None]]:
  """``(algorithm, cost or None)`` of each row under ``policy``; an op that
  recorded no precision gets what ``jaxprec.emulate(fn, policy)`` gives it."""
  unset = {}
  for kind in numerics.OP_KINDS:
    p = None if policy is None else policy.precision_for("", None, kind)
    unset[kind] = context.current() if p is None else p
  out = []
  for r in rows:
    algo = algorithm(r, target, unset[numerics.op_kind(r.primitive)])
    w = weights.get(algo)
    out.append((algo, None if w is None else r.flops * w))
  return out


def op_bytes(row: audit_lib.AuditRow) -> tuple[int, int]:
  """``(bytes, float32 bytes)`` an audited op moves per call: its operands
  and result at their dtypes, and with every floating one float32 (integers
  keep their size), times its trip count."""
  moved = f32 = 0
  for shape, dtype in ((row.lhs_shape, row.lhs_dtype),
                       (row.rhs_shape, row.rhs_dtype),
                       (row.out_shape, row.out_dtype)):
    n = audit_lib.known_int(math.prod(shape))
    dt = jnp.dtype(dtype)
    moved += n * dt.itemsize
    f32 += n * (4 if jnp.issubdtype(dt, jnp.floating) else dt.itemsize)
  return moved * row.trip_count, f32 * row.trip_count


def cost(fn: Callable[..., Any], *args: Any, policy: PolicyLike | None = None,
         target: str | None = None, weights: Mapping[str, float] | None = None,
         chip: str | None = None, **kwargs: Any) -> CostReport:
  """The matmul and convolution cost of ``fn`` under a precision policy.

  Every ``dot_general`` and ``conv_general_dilated`` of ``fn(*args,
  **kwargs)`` (found by :func:`jaxprec.audit`, traced as
  ``jaxprec.emulate(fn, policy)`` traces it; ``fn`` is not run) costs its
  FLOPs times the passes its precision needs on ``target``: on a TPU one
  bfloat16 pass is 1, ``bfloat16_3x`` 3, ``float32`` 6; on an NVIDIA GPU one
  TF32 pass is 1, ``float32`` 8 (see :data:`WEIGHTS` and ``docs/search.md``).
  Each op also moves its operands and result at their dtypes (``bytes``;
  ``float32_bytes`` all-float32). With ``chip``, each op takes the roofline
  time ``max(passes * FLOPs / peak of its pass type, bytes / HBM
  bandwidth)`` from the chip's spec sheet (:data:`CHIPS`), summed without
  overlap or fusion, and ``time_relative`` compares it with the same ops
  all-float32: float32 operands and results at the target's float32
  algorithm (``docs/cost.md``). The report gives the totals, the ratios to
  all-float32 and a row per Flax module path.

  Args:
    fn: the function; its arguments follow (arrays or
      ``jax.ShapeDtypeStruct``; other leaves are static).
    *args: positional arguments for ``fn``.
    policy: a :class:`jaxprec.Policy`, a policy string or one precision; None:
      the precision in force. Ops whose code sets a precision keep it.
    target: ``'tpu'`` or ``'gpu'``; None: the chip's, else ``'tpu'``.
    weights: cost per FLOP by algorithm name, updating :data:`WEIGHTS` (e.g.
      ``{'f32': 7.4}`` for an H100 SXM).
    chip: ``'tpu-v4'``, ``'tpu-v5e'``, ``'tpu-v5p'``, ``'tpu-v6e'``,
      ``'tpu7x'``, ``'a100'``, ``'h100'`` or ``'b200'`` (:data:`CHIPS`) for times; None:
      no times.
    **kwargs: keyword arguments for ``fn``.

  Returns:
    A :class:`jaxprec.CostReport`.

  Raises:
    TypeError: ``fn`` is not callable.
    UnsupportedAlgorithmError: an op's algorithm does not run on the target
      (a ValueError; the message names the precisions that do).
    ValueError: unknown target or chip (the message lists the choices and
      the closest one), a chip of another target, bad policy or weights.
    jaxprec.AuditError: tracing ``fn`` failed.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec
    >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    >>> w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    >>> r = jaxprec.cost(lambda x, w: x @ w, x, w, policy="bfloat16_3x")
    >>> r.flops, r.cost, r.float32_cost, r.relative
    (1024, 3072.0, 6144.0, 0.5)
    >>> jaxprec.cost(lambda x, w: x @ w, x, w, policy="tf32", target="gpu").relative
    0.125
    >>> r.bytes, r.float32_bytes   # (8*16 + 16*4 + 8*4) float32 elements
    (896, 896)
    >>> xb = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    >>> wb = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    >>> r = jaxprec.cost(lambda x, w: x @ w, xb, wb, chip="tpu-v5e")
    >>> r.target, r.bytes_relative, round(r.time_relative, 3)  # bandwidth-bound
    ('tpu', 0.5, 0.5)
  """
  if not callable(fn):
    raise TypeError(f"jaxprec.cost expects a callable; got {fn!r} of type "
                    f"{type(fn).__name__}")
  spec = None if chip is None else chips_lib.check_chip(chip)
  if target is None:
    target = "tpu" if spec is None else spec.target
  target = numerics.check_target(target)
  if spec is not None and spec.target != target:
    raise ValueError(
        f"chip {spec.name!r} is a {spec.target.upper()} but target={target!r}; "
        f"leave target unset or pass target={spec.target!r}")
  table = weights_for(target, weights)
  pol = None if policy is None else policy_lib.as_policy(policy)
  base = Policy(default="float32")
  report = trace_rows(fn, args, kwargs, pol)
  rows = report.rows
  base_rows = rows if pol == base else trace_rows(fn, args, kwargs, base).rows
  if len(base_rows) != len(rows):  # the code branched on the precision
    raise ValueError(
        f"jaxprec.cost: {report.function} traced to {len(rows)} matmuls and "
        f"convolutions under {pol} but {len(base_rows)} at float32; a cost "
        f"relative to float32 needs the same ops")
  costs = _costs(rows, pol, target, table)
  base_costs = _costs(base_rows, base, target, table)
  f32_algo = algorithms.float32_algorithm(target)
  per_path: dict[str, dict[str, Any]] = {}
  by_algo: dict[str, int] = {}
  time0 = None if spec is None else 0.0  # no times without a chip
  for r, (algo, c), (_, c32) in zip(rows, costs, base_costs):
    by_algo[algo] = by_algo.get(algo, 0) + r.flops
    e = per_path.setdefault(r.module_path, {
        "ops": 0, "flops": 0, "algorithms": (), "cost": 0.0,
        "float32_cost": 0.0, "unknown_flops": 0, "bytes": 0,
        "float32_bytes": 0, "seconds": time0, "float32_seconds": time0,
        "untimed_flops": 0})
    e["ops"] += 1
    e["flops"] += r.flops
    if algo not in e["algorithms"]:
      e["algorithms"] += (algo,)
    if c is None or c32 is None:  # no weight: out of both totals
      e["unknown_flops"] += r.flops
    else:
      e["cost"] += c
      e["float32_cost"] += c32
    moved, moved32 = op_bytes(r)
    e["bytes"] += moved
    e["float32_bytes"] += moved32
    if spec is not None:
      t = chips_lib.op_seconds(spec, algo, r.flops, moved)
      if t is None:  # no peak for its pass type: out of both times
        e["untimed_flops"] += r.flops
      else:
        e["seconds"] += t
        e["float32_seconds"] += chips_lib.op_seconds(
            spec, f32_algo, r.flops, moved32)
  out = tuple(CostRow(path=path, **e) for path, e in per_path.items())
  totals = {k: sum(getattr(r, k) for r in out) for k in (
      "flops", "cost", "float32_cost", "unknown_flops", "bytes",
      "float32_bytes", "untimed_flops", "seconds", "float32_seconds")
            if spec is not None or "seconds" not in k}
  return CostReport(
      function=report.function,
      policy="" if pol is None else str(pol), target=target, rows=out,
      by_algorithm=dict(sorted(by_algo.items(), key=lambda kv: (-kv[1], kv[0]))),
      weights=table, chip=None if spec is None else spec.name, **totals)
