"""The text of a cost report (``str(jaxprec.cost(...))``)."""

from __future__ import annotations

from typing import Any

from jaxprec._src.inspect import chips
from jaxprec._src.inspect.audit_text import si, table


def format_report(r: Any) -> str:
  """The text of a :class:`~jaxprec.CostReport` (its ``str``)."""
  head = (f"jaxprec cost of {r.function or 'function'} on {r.target}, "
          f"policy {r.policy or '(none)'}: {si(r.cost)} pass-FLOPs = "
          f"{_rel(r.relative)} of float32 ({si(r.float32_cost)})")
  out = [head, f"bytes moved: {si(r.bytes)}B = {r.bytes_relative:.3f} of "
               f"all-float32 ({si(r.float32_bytes)}B)"]
  timed = r.seconds is not None
  if timed:
    chip = chips.CHIPS[r.chip]
    out.append(
        f"time on {r.chip} ({chip.description}), roofline max(passes*FLOPs/"
        f"peak, bytes/HBM) per op, no overlap or fusion: "
        f"{_time(r.seconds)} = {_rel(r.time_relative)} of all-float32 "
        f"({_time(r.float32_seconds)})")
  cols = ["module path", "ops", "FLOPs", "runs as", "cost", "vs float32",
          "bytes", "bytes/f32"]
  if timed:
    cols += ["time", "time/f32"]

  def cells(path, ops, flops, algos, x):
    row = [path, ops, si(flops), algos, si(x.cost), _rel(x.relative),
           si(x.bytes), f"{x.bytes_relative:.3f}"]
    if timed:
      row += [_time(x.seconds), _rel(x.time_relative)]
    return row
  body = [cells(x.path or "(top)", str(x.ops), x.flops, "+".join(x.algorithms),
                x) for x in r.rows]
  body.append(cells("total", str(sum(x.ops for x in r.rows)), r.flops, "", r))
  out += table(cols, body, set(range(len(cols))) - {0, 3})
  used = [a for a in r.by_algorithm if a in r.weights]
  out.append(f"weights ({r.target}, cost per FLOP): " + ", ".join(
      f"{a} {r.weights[a]:g}" for a in used))
  if r.unknown_flops:
    unknown = [a for a in r.by_algorithm if a not in r.weights]
    out.append(f"not counted: {si(r.unknown_flops)} FLOPs of "
               f"{', '.join(unknown)} (no weight; pass weights=)")
  if timed and r.untimed_flops:
    out.append(f"not timed: {si(r.untimed_flops)} FLOPs whose pass type "
               f"{r.chip} has no peak for")
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