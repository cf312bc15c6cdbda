"""What :func:`jaxprec.search_policy` returns: :class:`SearchResult` and its steps."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxprec._src.checker import render
from jaxprec._src.checker.report import DivergenceReport
from jaxprec._src.inspect import cost as cost_lib
from jaxprec._src.policy.policy import Policy


def shown(metric: str, v: float) -> str:
  """``v`` as printed: a cosine with the digits where it differs from 1."""
  return f"{v:.9f}" if metric == "cosine" else f"{v:.3g}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchStep:
  """One evaluation of the search (an entry of :attr:`SearchResult.history`).

  Attributes:
    index: 1 for the first evaluation.
    phase: what the step tried, e.g. ``'all bfloat16'``, ``'measure 6 paths
      at bfloat16'``, ``'lower 9 paths to bfloat16'``, ``'re-check'``.
    policy: the policy evaluated.
    passed: whether every checked layer met the tolerance.
    worst_layer: the layer closest to (or furthest past) the tolerance.
    worst_value: its metric value, as :func:`jaxprec.check` reports it (the
      cosine itself for ``cosine``, whose tolerance bounds ``1 - cosine``).
    relative_cost: the policy's cost relative to all-float32.
    counts: candidate -> number of module paths at it.
    seconds: wall time, compilation included.
    program: ``'fixed'`` (a program compiled for this policy) or
      ``'switched'`` (the search's one program for every policy, with each
      path's precision chosen at run time: :mod:`jaxprec._src.search.switch`).
  """

  index: int
  phase: str
  policy: Policy
  passed: bool
  worst_layer: str
  worst_value: float
  relative_cost: float
  counts: Mapping[str, int]
  seconds: float
  program: str = "fixed"

  def to_dict(self) -> dict[str, Any]:
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {**fields, "policy": str(self.policy),
            "worst_value": render.encode(self.worst_value),
            "relative_cost": render.encode(self.relative_cost),
            "counts": dict(self.counts)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchResult(render.Report):
  """What :func:`jaxprec.search_policy` returns.

  Attributes:
    policy: the cheapest policy found that meets the tolerance: a default and
      one rule per module path (exact, :func:`re.escape`-d) at another
      precision. ``str(policy)`` is accepted by :meth:`jaxprec.Policy.parse`,
      :func:`jaxprec.swap`, :func:`jaxprec.emulate` and ``jaxprec run
      --policy``.
    meets_tolerance: whether ``report`` shows every checked layer within the
      tolerance (False only when even all-float32 does not, or the budget
      ran out before any policy did).
    report: the measured divergence of ``policy`` on the checked layers (one
      column, ``'policy'``; computed with ``atol = rtol = 0``), or None when
      the budget left no evaluation for it.
    values: checked layer -> its metric value under ``policy``.
    cost: :func:`jaxprec.cost` of ``policy`` on the target.
    evaluations: how many times the function ran under a candidate policy
      (the reference run is not counted).
    budget: the most evaluations allowed.
    history: one :class:`SearchStep` per evaluation, in order.
    metric, tolerance: what was bounded (``cosine``: ``1 - cosine <=
      tolerance``; ``sqnr_db``: ``sqnr_db >= tolerance``; others: ``<=``).
    candidates: the candidate precisions, cheapest first.
    target, mode: whose numerics, and ``'emulate'`` or ``'native'``.
    units: the module paths the search assigned, in execution order.
    seconds: wall time of the whole search.
    axes: what the search decided per unit: ``('precision',)``,
      ``('precision', 'dtype')`` or ``('dtype',)``.
  """

  policy: Policy
  meets_tolerance: bool
  report: DivergenceReport | None
  values: Mapping[str, float]
  cost: cost_lib.CostReport
  evaluations: int
  budget: int
  history: tuple[SearchStep, ...]
  metric: str
  tolerance: float
  candidates: tuple[str, ...]
  target: str
  mode: str
  units: tuple[str, ...]
  seconds: float = 0.0
  axes: tuple[str, ...] = ("precision",)

  @property
  def relative_cost(self) -> float | None:
    """The policy's cost relative to all-float32 (None where no op's cost
    is known).

    On the precision axis alone, ``cost.relative`` (matmul passes). With the
    dtype axis, the search's own roofline estimate on the chip (matmuls, and
    the memory traffic of modules without matmuls, such as layer norms), as
    its last step (always of :attr:`policy`) shows it; ``cost`` has the
    matmuls' time alone (``cost.time_relative``).
    """
    if "dtype" in self.axes:
      if self.history and self.history[-1].policy == self.policy:
        return self.history[-1].relative_cost
      if getattr(self.cost, "time_relative", None) is not None:
        return self.cost.time_relative
    return self.cost.relative

  def precision_by_path(self) -> dict[str, str]:
    """Module path -> the candidate the policy gives it."""
    chosen = {u: self.policy.precision_for(u, None, "dot") for u in self.units}
    return {u: "-" if p is None else p.name for u, p in chosen.items()}

  def dtype_by_path(self) -> dict[str, str]:
    """Module path -> the compute dtype the policy gives it (``'-'``: none)."""
    return {path: self.policy.dtype_for(path, None, "dot") or "-"
            for path in self.units}

  def best_uniform(self) -> SearchStep | None:
    """The cheapest evaluation that gave every module path one candidate
    and met the tolerance (the search tries them cheapest first), or None
    when none was evaluated or none met it."""
    uniform = [s for s in self.history if s.passed and len(s.counts) == 1
               and s.phase.startswith("all ")]
    return min(uniform, key=lambda s: s.relative_cost, default=None)

  def check_atol(self) -> float | None:
    """The smallest ``atol`` with which :func:`jaxprec.check` at ``rtol=0``
    passes :attr:`policy` on the checked layers (the largest ``max_abs`` of
    :attr:`report`), or None without a report: the check's gate
    (elementwise ``|err| <= atol + rtol * |ref|``) is another measure than
    the search's (``metric`` per layer)."""
    if self.report is None or not self.report.precisions:
      return None
    return self.report.required_atol(rtol=0.0)

  KIND = "search"

  def _fields(self) -> dict[str, Any]:
    return {
        "policy": str(self.policy),
        "meets_tolerance": self.meets_tolerance, "metric": self.metric,
        "tolerance": self.tolerance, "target": self.target, "mode": self.mode,
        "candidates": list(self.candidates),
        "relative_cost": render.encode(self.relative_cost),
        "evaluations": self.evaluations, "budget": self.budget,
        "values": render.encode(self.values),
        "precision_by_path": self.precision_by_path(),
        "cost": self.cost.to_dict(),
        "history": [s.to_dict() for s in self.history],
        "seconds": self.seconds,
        "best_uniform": None if (u := self.best_uniform()) is None else {
            "candidate": next(iter(u.counts)),
            "relative_cost": render.encode(u.relative_cost)},
        "check_atol": render.encode(self.check_atol()),
        **({} if self.axes == ("precision",) else {
            "axes": list(self.axes), "dtype_by_path": self.dtype_by_path()}),
    }

  def _document(self, full: bool = False) -> render.Document:
    bound = {"cosine": "1 - cosine <=", "sqnr_db": "sqnr_db >="}.get(
        self.metric, f"{self.metric} <=")
    status = "meets" if self.meets_tolerance else "DOES NOT meet"
    chip = getattr(self.cost, "chip", None)
    unit = "" if self.axes == ("precision",) or not chip else (
        f" (roofline time on {chip})")
    lines = [
        f"jaxprec search: tolerance {bound} {self.tolerance:g} in each of "
        f"{render.plural(len(self.values), 'layer')} ({self.metric} per "
        f"layer, not jaxprec.check's elementwise atol/rtol); target "
        f"{self.target} ({self.mode}); candidates {', '.join(self.candidates)}",
        f"policy: {self.policy}",
        f"cost: {self.relative_cost:.3f} of float32 on {self.target}{unit} "
        f"({status} the tolerance){self._against_uniform()}",
        f"evaluations: {self.evaluations} (budget {self.budget}; plus 1 "
        f"reference run), {self.seconds:.1f} s",
    ]
    if self.values:
      # Larger is better for sqnr_db and cosine, smaller for the rest; NaN
      # is the worst.
      sign = -1 if self.metric in ("sqnr_db", "cosine") else 1
      worst = max(self.values, key=lambda k: math.inf if math.isnan(
          self.values[k]) else sign * self.values[k])
      lines.append(f"worst layer: {worst} ({self.metric} "
                   f"{shown(self.metric, self.values[worst])})")
    atol = self.check_atol()
    if atol is not None and math.isfinite(atol):
      lines.append(f"in jaxprec.check's terms (|err| <= atol + rtol*|ref| "
                   f"elementwise): this policy passes "
                   f"atol={render.at_least(atol)}, rtol=0")
    by_path = self.precision_by_path()
    if self.axes != ("precision",):
      dtypes = self.dtype_by_path()
      by_path = dtypes if "precision" not in self.axes else {
          path: f"{p}+dtype:{dtypes[path]}" for path, p in by_path.items()}
    counts = collections.Counter(by_path.values())
    lines.append("module paths: " + ", ".join(
        f"{n} at {p}" for p, n in counts.items()))
    return render.Document(heading=tuple(lines[:1]), parts=tuple(lines[1:]))

  def _against_uniform(self) -> str:
    """``', against 0.500 for uniform bfloat16_3x'``: the saving against the
    cheapest one-candidate policy that met the tolerance."""
    u = self.best_uniform()
    if u is None:
      return ""
    name = next(iter(u.counts))
    if u.policy == self.policy:
      return (f"; the policy is uniform {name}, the cheapest uniform "
              f"policy that meets it")
    return (f", against {u.relative_cost:.3f} for uniform {name}, the "
            f"cheapest uniform policy that meets it")
