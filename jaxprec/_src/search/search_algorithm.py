"""Which policies the search evaluates: bisection over module paths, measured
by sensitivity (``docs/search.md``, "The algorithm")."""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxprec._src.checker import metrics as metrics_lib
from jaxprec._src.core.precision import Precision, resolve
from jaxprec._src.inspect import cost as cost_lib
from jaxprec._src.policy.policy import Policy, Rule
from jaxprec._src.search.search_result import SearchStep, shown

# Groups whose lowering would save less than this fraction of the current
# cost are not split further (not worth an evaluation).
MIN_GAIN = 0.01


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A candidate precision (or a (dtype, precision) pair on the dtype axis),
  with what it runs on the target and its cost."""

  label: str
  precision: Precision | None  # None: a dtype alone (the dtype axis alone)
  algorithm: str  # of a float32 dot on the target
  weight: float
  dtype: str | None = None  # the compute dtype (the dtype axis)

  @property
  def is_float32(self) -> bool:
    return ((self.precision is None or self.precision.name == "float32")
            and self.dtype in (None, "float32"))


@dataclasses.dataclass(frozen=True)
class CostTable:
  """What each unit costs at each candidate, from one audit of ``fn``.

  Traced with JAX's flag cleared and no policy: the ops that record no
  precision are the ones a policy decides (the others are ``fixed``); their
  module paths, in program order, are the units.
  """

  units: list[str]
  unit_costs: np.ndarray  # (units, candidates)
  fixed_cost: float
  float32_cost: float
  # The dtype axis: per unit, (a dtype decision reaches it, it runs matmuls
  # a policy decides); None: the precision axis alone (units are matmuls).
  reach: tuple[tuple[bool, bool], ...] | None = None
  # Per unit, whether only a rule reaches it (a module without a dtype field,
  # cast at its boundary; the default dtype leaves it as built), or None.
  cast: tuple[bool, ...] | None = None

  @classmethod
  def of(cls, fn, args, kwargs, target: str, cands: list[Candidate],
         weights: Mapping[str, float]) -> CostTable:
    rows = cost_lib.trace_rows(fn, args, kwargs, None).rows
    unit_rows: dict[str, list] = {}
    fixed = []
    for r in rows:
      algo = cost_lib.algorithm(r, target, cands[0].precision)
      if r.precision is None and not algo.startswith("native") and (
          algo != "unknown"):
        unit_rows.setdefault(r.module_path, []).append(r)
      else:
        fixed.append(r)

    def cost(rs, p: Precision | None) -> float:
      total = 0.0
      for r in rs:
        w = weights.get(cost_lib.algorithm(r, target, p))
        total += 0.0 if w is None else r.flops * w
      return total
    units = list(unit_rows)
    table = np.array([[cost(unit_rows[u], c.precision) for c in cands]
                      for u in units]).reshape(len(units), len(cands))
    fixed_cost = cost(fixed, None)
    f32 = resolve("float32")
    return cls(units, table, fixed_cost,
               fixed_cost + sum(cost(unit_rows[u], f32) for u in units))


@dataclasses.dataclass(eq=False)
class _Trial:
  levels: tuple[int, ...] | None  # None: all-float32, not a candidate
  policy: Policy
  powers: np.ndarray
  metrics: list
  passed: bool
  index: int
  program: str = "fixed"  # SearchStep.program


@dataclasses.dataclass(eq=False)
class _Node:
  """A group of units (indices into the units) and its measured or inferred
  sensitivity: the increase of each checked layer's power when lowered."""

  units: tuple[int, ...]
  sens: np.ndarray
  measured: bool
  depth: int = 0
  # The split that made it left nearly all the parent's sensitivity in one
  # half: a few paths are to blame, and bisecting finds them.
  concentrated: bool = True
  # An inferred sensitivity that is a small difference of large ones (the
  # sibling held most of the parent's) is noise: measure before splitting.
  reliable: bool = True


# Metrics that are powers already (see Search.powers): the logits gates'
# KL divergences and top-1 disagreement.
_AS_POWER = frozenset({"kl_max", "kl_mean", "top1_disagreement"})


def _paths(n: int) -> str:
  return f"{n} path" if n == 1 else f"{n} paths"


class Search:
  """The search's state: the evaluations made, the best policy, the budget.

  ``runner.run(policy, levels)`` evaluates a policy: ``(metrics, program)``,
  one metrics record per checked layer (named by ``runner.names``) and the
  kind of program that ran it (:attr:`SearchStep.program`).

  A state is a tuple of levels, one index into the candidates (cheapest
  first) per unit; ``None`` is all-float32 when float32 is not a candidate.
  """

  def __init__(self, *, runner: Any, table: CostTable,
               cands: list[Candidate], metric: str, tolerance: float,
               budget: int, verbose: bool,
               float32_policy: Policy | None = None):
    self.runner, self.cands, self.table = runner, cands, table
    self.units, self.unit_costs = table.units, table.unit_costs
    self.float32_policy = float32_policy or Policy(default="float32")
    self.metric, self.budget = metric, budget
    # Errors of independent roundings add in power: the tolerance's power.
    # A KL divergence (quadratic in small logit errors) and a count of
    # changed predictions add as they are.
    self.tol_power = (
        tolerance if metric == "cosine" or metric in _AS_POWER else
        10.0 ** (-tolerance / 10.0) if metric == "sqnr_db" else
        tolerance * tolerance)
    self.verbose = verbose
    self.trials: dict[tuple[int, ...], _Trial] = {}
    self.history: list[SearchStep] = []
    self.best: _Trial | None = None
    self.last: _Trial | None = None
    self.exhausted = False

  # -- bookkeeping ------------------------------------------------------------
  @property
  def evaluations(self) -> int:
    return len(self.history)

  def powers(self, metrics: Sequence[metrics_lib.LayerMetrics]
             ) -> tuple[np.ndarray, bool]:
    """Each layer's metric as a power (errors add in power), and whether
    every layer meets the tolerance."""
    def power(m: metrics_lib.LayerMetrics) -> float:
      v = float(getattr(m, self.metric))
      # The metrics skip non-finite elements; NaN or inf where the reference
      # has none (an overflow in float16 or bfloat16) fails any tolerance.
      if math.isnan(v) or math.isinf(m.required_atol):
        return math.inf
      if self.metric == "cosine":
        return max(0.0, 1.0 - v)
      if self.metric in _AS_POWER:
        return v
      if self.metric == "sqnr_db":
        return 10.0 ** (-v / 10.0) if v < math.inf else 0.0
      return v * v
    powers = np.array([power(m) for m in metrics])
    return powers, bool(np.all(powers <= self.tol_power))

  def relative_cost(self, levels: Sequence[int] | None) -> float:
    """Predicted cost relative to float32 (``levels`` None: all-float32)."""
    if levels is None or self.table.float32_cost == 0:
      return 1.0
    idx = np.asarray(levels, int)
    total = self.table.fixed_cost + float(
        self.unit_costs[np.arange(len(idx)), idx].sum())
    return total / self.table.float32_cost

  def policy(self, levels: Sequence[int] | None) -> Policy:
    if levels is None:
      return self.float32_policy
    counts = np.bincount(np.asarray(levels, int), minlength=len(self.cands))
    default = int(np.argmax(counts))  # most paths; ties: the cheaper
    rules = [self.rule(i, self.cands[l]) for i, l in enumerate(levels)
             if l != default or (self.table.cast and self.table.cast[i])]
    return _default(self.cands[default], tuple(r for r in rules if r))

  def rule(self, i: int, c: Candidate) -> Rule | None:
    """Unit ``i`` at ``c``: its precision if it runs matmuls, its dtype if a
    dtype decision reaches it (None when neither)."""
    kw: dict[str, Any] = {}
    dtype_reaches, has_dots = (False, True) if self.table.reach is None else (
        self.table.reach[i])
    if has_dots and c.precision is not None:
      kw["precision"] = c.precision
    if dtype_reaches and c.dtype is not None:
      kw["dtype"] = c.dtype
    return Rule(path=re.escape(self.units[i]), **kw) if kw else None

  def can_try(self, reserve: int = 0) -> bool:
    # A failing trial leaves the best policy unevaluated last: keep one
    # evaluation for its re-check.
    need = 1 + reserve + (1 if self.best is not None else 0)
    ok = self.evaluations + need <= self.budget
    if not ok:
      self.exhausted = True
    return ok

  def evaluate(self, levels: tuple[int, ...] | None, phase: str, *,
               again: bool = False) -> _Trial:
    """Runs the policy of ``levels`` (None: all-float32), once per levels
    unless ``again``."""
    hit = self.trials.get(levels)
    if hit is not None and not again:
      return hit
    policy = self.policy(levels)
    t0 = time.perf_counter()
    metrics, program = self.runner.run(policy, levels)
    seconds = time.perf_counter() - t0
    powers, passed = self.powers(metrics)
    trial = _Trial(levels, policy, powers, metrics, passed,
                   self.evaluations + 1, program)
    self.trials[levels] = trial
    self._record(trial, phase, seconds)
    if levels is not None and passed and (
        self.best is None
        or self.relative_cost(levels) < self.relative_cost(self.best.levels)):
      self.best = trial
    return trial

  def _record(self, trial: _Trial, phase: str, seconds: float) -> None:
    self.last = trial
    ratio = trial.powers / max(self.tol_power, np.finfo(np.float64).tiny)
    worst = int(np.argmax(np.where(np.isnan(ratio), np.inf, ratio)))
    name = self.runner.names[worst]
    value = float(getattr(trial.metrics[worst], self.metric))
    counts = ({"float32": len(self.units)} if trial.levels is None else
              dict(collections.Counter(self.cands[l].label
                                       for l in trial.levels)))
    rel = self.relative_cost(trial.levels)
    step = SearchStep(index=trial.index, phase=phase, policy=trial.policy,
                      passed=trial.passed, worst_layer=name,
                      worst_value=value, relative_cost=rel,
                      counts=counts, seconds=seconds, program=trial.program)
    self.history.append(step)
    if self.verbose:
      what = ", ".join(f"{k} {v}" for k, v in counts.items()) or "no paths"
      verdict = "pass" if trial.passed else "FAIL"
      print(f"jaxprec search [{trial.index}/{self.budget}] {phase} "
            f"({what}): {verdict}, worst {self.metric} "
            f"{shown(self.metric, value)} at "
            f"{name}; cost {rel:.3f} of float32; {seconds:.1f} s"
            f"{' (switched program)' if trial.program == 'switched' else ''}",
            file=sys.stderr, flush=True)

  # -- the algorithm ------------------------------------------------------------
  def run(self) -> None:
    n = len(self.units)
    if self.evaluate((0,) * n, f"all {self.cands[0].label}").passed or n == 0:
      return
    for k in range(1, len(self.cands)):
      if self.evaluations >= self.budget:
        self.exhausted = True
        return
      if self.evaluate((k,) * n, f"all {self.cands[k].label}").passed:
        for t in range(k):
          self.lower_to(t)
        return

  def headroom(self, base: _Trial) -> np.ndarray:
    return np.maximum(self.tol_power - base.powers, 0.0)

  def saving(self, units: Sequence[int], levels: Sequence[int], t: int) -> float:
    idx = np.asarray(units, int)
    now = self.unit_costs[idx, np.asarray(levels)[idx]].sum()
    return float(now - self.unit_costs[idx, t].sum())

  def lowered(self, levels: Sequence[int], units: Sequence[int],
              t: int) -> tuple[int, ...]:
    moved = set(units)
    return tuple(t if i in moved else l for i, l in enumerate(levels))

  def sensitivity(self, trial: _Trial, base: _Trial) -> np.ndarray:
    return np.maximum(trial.powers - base.powers, 0.0)

  def lower_to(self, t: int) -> None:
    """Lowers what it can of the best policy's units to candidate ``t``.

    Rounds of measure-and-choose against the best policy so far: the groups
    a round found to fit alone but could not lower together with the others
    are split in the next round, until a round lowers nothing.
    """
    base = self.best
    levels = base.levels
    movable = tuple(i for i in range(len(levels))
                    if levels[i] > t and self.saving((i,), levels, t) > 0)
    if not movable or not self.can_try():
      return
    root_trial = self.evaluate(
        self.lowered(levels, movable, t),
        f"lower {_paths(len(movable))} to {self.cands[t].label}")
    if root_trial.passed:
      return  # the best policy now
    nodes = [_Node(movable, self.sensitivity(root_trial, base), True)]
    while nodes:
      base = self.best
      unchosen = self.choose(self.refine(nodes, base, t), t)
      if self.best is base:
        return
      nodes = [dataclasses.replace(g, depth=0) for g in unchosen
               if self.saving(g.units, self.best.levels, t) > 0]

  def density(self, sens: np.ndarray, room: np.ndarray) -> float:
    """How many times an added error fills the headroom (worst layer)."""
    with np.errstate(divide="ignore", invalid="ignore"):
      d = np.where(sens > 0, sens / room, 0.0)
    d = np.where(np.isnan(d), np.inf, d)
    return float(d.max()) if d.size else 0.0

  def refine(self, roots: list[_Node], base: _Trial, t: int) -> list[_Node]:
    """Splits groups that cannot be lowered whole, most promising first.

    A group's promise is the saving expected from lowering part of it: its
    whole saving when its sensitivity is concentrated (one half of its
    parent held nearly all of it; the root and its halves count as such),
    else the saving times the chance an average path of it fits the
    headroom. Groups expected to save less than :data:`MIN_GAIN` of the
    cost are not split. Returns the groups predicted (or measured) to fit
    the headroom alone.
    """
    room = self.headroom(base)
    min_gain = (MIN_GAIN * self.relative_cost(base.levels)
                * self.table.float32_cost)
    leaves: list[_Node] = []
    heap: list[tuple[float, int, _Node]] = []

    def push(node: _Node) -> None:
      d = self.density(node.sens, room)
      if d <= 1.0:
        leaves.append(node)
        return
      if len(node.units) == 1 and node.measured:
        return  # cannot be lowered
      # Spread sensitivity: an average path of the group overfills the
      # headroom d / k times; discount the saving by the square of that.
      chance = 1.0 if node.depth <= 1 or node.concentrated else min(
          1.0, len(node.units) / d) ** 2
      expected = self.saving(node.units, base.levels, t) * chance
      if expected >= min_gain:
        heapq.heappush(heap, (-expected, next(tick), node))

    tick = itertools.count()
    for root in roots:
      push(root)
    name = self.cands[t].label
    while heap:
      if not self.can_try(reserve=1):  # keep one for the verification
        break
      _, _, node = heapq.heappop(heap)
      if not node.measured and (len(node.units) == 1 or not node.reliable):
        trial = self.evaluate(self.lowered(base.levels, node.units, t),
                              f"measure {_paths(len(node.units))} at {name}")
        push(dataclasses.replace(node, sens=self.sensitivity(trial, base),
                                 measured=True, reliable=True))
        continue
      half = len(node.units) // 2
      left_units, right_units = node.units[:half], node.units[half:]
      trial = self.evaluate(self.lowered(base.levels, left_units, t),
                            f"measure {_paths(len(left_units))} at {name}")
      left_sens = self.sensitivity(trial, base)
      with np.errstate(invalid="ignore"):  # inf - inf: an overflow in both
        right_sens = np.maximum(node.sens - left_sens, 0.0)
      right_sens = np.where(np.isnan(right_sens), np.inf, right_sens)
      d_left = self.density(left_sens, room)
      d_right = self.density(right_sens, room)
      concentrated = min(d_left, d_right) <= 0.1 * max(d_left, d_right)
      reliable = d_right >= 0.25 * self.density(node.sens, room)
      push(_Node(left_units, left_sens, True, node.depth + 1, concentrated))
      push(_Node(right_units, right_sens, False, node.depth + 1, concentrated,
                 reliable))
    return leaves

  def choose(self, leaves: list[_Node], t: int) -> list[_Node]:
    """Lowers the groups that save the most per unit of error, verified.

    Returns the groups it did not lower.
    """
    remaining = list(leaves)
    failed: list[_Node] = []  # fit alone, not with the others: split next round
    while remaining:
      base = self.best
      room = self.headroom(base)
      ranked = sorted(
          remaining, key=lambda g: -self.saving(g.units, base.levels, t)
          / max(self.density(g.sens, room), 1e-12))
      chosen: list[_Node] = []
      total = np.zeros_like(room)
      for g in ranked:
        if self.saving(g.units, base.levels, t) <= 0:
          continue
        trial_total = total + g.sens
        if self.density(trial_total, room) <= 1.0:
          chosen.append(g)
          total = trial_total
      while chosen:
        if not self.can_try():
          return remaining + failed
        units = tuple(u for g in chosen for u in g.units)
        trial = self.evaluate(
            self.lowered(base.levels, units, t),
            f"lower {_paths(len(units))} to {self.cands[t].label}")
        if trial.passed:
          break
        # The last added saves the least per unit of error.
        failed.append(chosen.pop())
        remaining.remove(failed[-1])
      if not chosen:
        return remaining + failed
      remaining = [g for g in remaining if g not in chosen]
    return remaining + failed

  def finish(self) -> _Trial | None:
    """Makes the last evaluation the best policy's (re-running it if needed)."""
    if (self.best is not None and self.last is not self.best
        and self.evaluations < self.budget):
      best, self.best = self.best, None
      again = self.evaluate(best.levels, "re-check", again=True)
      self.best = again if again.passed else None
    return self.best

  def fallback(self) -> _Trial | None:
    """All-float32, measured if the search did or the budget allows."""
    for trial in self.trials.values():
      if trial.policy == self.float32_policy or (
          trial.levels and all(self.cands[l].is_float32 for l in trial.levels)):
        return trial
    if self.evaluations >= self.budget:
      return None
    k = [k for k, c in enumerate(self.cands) if c.is_float32]
    # None: float32 is not a candidate.
    return self.evaluate((k[-1],) * len(self.units) if k else None,
                         "all float32")


def _default(c: Candidate, rules: tuple[Rule, ...]) -> Policy:
  """The policy with ``rules`` and ``c`` as its default."""
  kw: dict[str, Any] = {} if c.dtype is None else {"default_dtype": c.dtype}
  return Policy(rules=rules, default=c.precision, **kw)
