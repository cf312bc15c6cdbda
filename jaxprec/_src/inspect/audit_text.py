"""The text table of an audit report (``str(jaxprec.audit(...))``)."""

from __future__ import annotations

import collections
import os
from collections.abc import Collection, Sequence
from typing import Any

from jaxprec._src.core import numerics

_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16",
          "float64": "f64", "int8": "i8", "int32": "i32"}
# Narrow floats: an op that accumulates in one is risky (audit_dtypes).
_NARROW = ("bfloat16", "float16")


def _short(dtype: str) -> str:
  return _SHORT.get(dtype, dtype)


def dtype_story(row: Any) -> str:
  """``'f32->bf16 x f32->bf16 -> bf16'``: each operand's stored->compute
  dtype (one name when nothing casts), then the accumulation dtype."""
  def operand(stored: str, compute: str) -> str:
    if stored and stored != compute:
      return f"{_short(stored)}->{_short(compute)}"
    return _short(compute)
  acc = row.accumulation_dtype or row.out_dtype
  return (f"{operand(row.lhs_storage, row.lhs_dtype)} x "
          f"{operand(row.rhs_storage, row.rhs_dtype)} -> {_short(acc)}")


def dtype_summary(rows: Any) -> str:
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


def format_report(report: Any) -> str:
  """The text table of an :class:`~jaxprec.AuditReport` (its ``str``)."""
  name = report.function or "function"
  head = f"jaxprec audit of {name}"
  if report.precision_in_force:
    head += f", traced at precision {report.precision_in_force}"
  opaque = _opaque_lines(report)
  if not report.rows:
    return "\n".join([head, "no matmuls or convolutions (dot_general, "
                       "conv_general_dilated) found", *opaque])
  cols = ("#", "op", "name stack", "function", "source", "operands",
          "dtypes", "precision", "TPU", "GPU", "FLOPs", "risky")
  body = []
  for i, r in enumerate(report.rows, 1):
    op = numerics.op_kind(r.primitive)
    if r.trip_count != 1:
      op += f" x{r.trip_count}"
    if not r.emulated:
      op += " (not emulated)"
    body.append((str(i), op, r.name_stack or "-", r.op.split(" (")[0] or "?",
                 _short_path(r.source),
                 f"{_shape(r.lhs_dtype, r.lhs_shape)} x "
                 f"{_shape(r.rhs_dtype, r.rhs_shape)}",
                 dtype_story(r), r.precision_name, r.tpu, r.gpu,
                 si(r.flops, ".0f"),
                 "RISKY" if r.risky else ""))
  out = [head, *table(cols, body, {0, 10})]
  by = report.flops_by_precision()
  n_risky = len(report.risky)
  out.append(
      f"total: {len(report.rows)} ops, {n_risky} risky, "
      f"{si(report.total_flops, '.0f')} FLOPs per call; "
      f"TPU: {_share(by['tpu'])}; GPU: {_share(by['gpu'])}")
  dtypes = dtype_summary(report.rows)
  if dtypes:
    out.append(dtypes)
  if n_risky:
    out.append("risky:")
    by_reason: dict[str, list[int]] = {}
    for i, r in enumerate(report.rows, 1):
      if r.risky:
        by_reason.setdefault(r.reason, []).append(i)
    for reason, nums in by_reason.items():
      out.append(f"  {', '.join(f'#{i}' for i in nums)}: {reason}")
  return "\n".join(out + opaque)


def _opaque_lines(report: Any) -> list[str]:
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
