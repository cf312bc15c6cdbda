"""Policy search: the cheapest per-layer precision that meets a tolerance.

:func:`search_policy` answers "which layers must run at a higher precision,
and what does that cost?" (NVIDIA's Polygraphy answers it for TensorRT with
``debug precision --mode bisect``). It assigns one of the candidate
precisions to every Flax module path that runs a matmul or convolution the
policy can reach (the *units*: :attr:`jaxprec.AuditRow.module_path` of the
ops that record no precision of their own, ``''`` for ops outside modules),
runs the function under each candidate :class:`jaxprec.Policy` (compiled
once per policy: ``jax.jit`` of :func:`jaxprec.emulate`, or natively on the
target's own hardware), compares every output layer with a float32 reference
using :mod:`jaxprec._src.metrics` inside the jitted program, and keeps the
cheapest assignment, by :func:`jaxprec.cost`, that meets the tolerance on
every checked layer.

The algorithm (``docs/search.md`` walks through it):

1. Every unit at the cheapest candidate. If that meets the tolerance, it is
   the answer, after one evaluation.
2. Every unit at the next candidates in cost order, until one meets the
   tolerance: level ``L``. (If none does, the answer is all-float32, with a
   warning.)
3. From all-``L`` down, for each cheaper candidate ``t`` (cheapest first),
   in rounds:

   a. *measure*: the sensitivity of a group of units (contiguous in
      execution order) is the increase of each checked layer's error when
      only that group runs at ``t``. Groups that cannot be lowered whole are
      bisected, the most promising first (expected saving: large when one
      half of a group holds nearly all of its sensitivity, discounted when
      the sensitivity is spread so that even an average unit would not
      fit); a half's sensitivity is measured, the other half's inferred by
      difference (errors of independent roundings add in power:
      ``rel_rms**2``, ``max_abs**2``, ``1 - cosine``, ``10**(-sqnr/10)``),
      unless the difference is noise, so a bisection step costs one
      evaluation;
   b. *choose*: lower greedily the groups that save the most cost per unit
      of error they add while the predicted error fits the tolerance, and
      verify with one evaluation (dropping the last group and retrying when
      the prediction was optimistic);
   c. the next round splits the groups that fit alone but not together,
      until a round lowers nothing.
4. The answer is the cheapest evaluated policy that met the tolerance; the
   last evaluation is always of it (run again if the search's last trial was
   another), so :attr:`SearchResult.report` measures exactly the returned
   policy.

A model with one ill-conditioned layer among ``n`` takes about ``log2(n) +
4`` evaluations; many sensitive layers take more, down to one evaluation per
unit that must stay precise, and ``budget`` caps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import heapq
import itertools
import json
import math
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprec._src import compat
from jaxprec._src import walker
from jaxprec._src import cost as cost_lib
from jaxprec._src import metrics as metrics_lib
from jaxprec._src import policy as policy_lib
from jaxprec._src.check import named_layers
from jaxprec._src.emulate import emulate
from jaxprec._src.emulated_ops import algorithm_for
from jaxprec._src.policy import Policy, Rule
from jaxprec._src.precision import Precision, PrecisionLike, resolve
from jaxprec._src.report import DivergenceReport, LayerResult

__all__ = ["DEFAULT_BUDGET", "DEFAULT_CANDIDATES", "METRICS", "MODES",
           "SearchResult", "SearchStep", "check_arguments", "search_policy"]

# Metrics a tolerance can bound. Smaller is better for all but cosine (the
# tolerance bounds 1 - cosine) and sqnr_db (the tolerance is a minimum).
METRICS = ("rel_rms", "max_abs", "max_rel", "cosine", "sqnr_db", "ulp_median",
           "ulp_max")
DEFAULT_CANDIDATES = {
    "tpu": ("bfloat16", "bfloat16_3x", "float32"),
    "gpu": ("tensorfloat32", "TF32_TF32_F32_X3", "float32"),
}
DEFAULT_BUDGET = 24
MODES = ("auto", "emulate", "native")
# Groups whose lowering would save less than this fraction of the current
# cost are not split further (not worth an evaluation).
MIN_GAIN = 0.01


# ---------------------------------------------------------------------------
# Metrics as powers: quantities that add over independent rounding errors.


def _power(metric: str, m: metrics_lib.LayerMetrics) -> float:
  v = float(getattr(m, metric))
  if math.isnan(v):
    return math.inf
  if metric == "cosine":
    return max(0.0, 1.0 - v)
  if metric == "sqnr_db":
    return 10.0 ** (-v / 10.0) if v < math.inf else 0.0
  return v * v


def _tolerance_power(metric: str, tolerance: float) -> float:
  if metric == "cosine":
    return tolerance
  if metric == "sqnr_db":
    return 10.0 ** (-tolerance / 10.0)
  return tolerance * tolerance


def _value(metric: str, m: metrics_lib.LayerMetrics) -> float:
  """The number the tolerance bounds (``1 - cosine`` for cosine)."""
  v = float(getattr(m, metric))
  return 1.0 - v if metric == "cosine" else v


def _check_metric(metric: Any) -> str:
  if metric not in METRICS:
    msg = (f"Unknown metric {metric!r}; valid choices: "
           f"{', '.join(map(repr, METRICS))}.")
    if isinstance(metric, str):
      close = difflib.get_close_matches(metric, METRICS, n=1)
      if close:
        msg += f" Did you mean {close[0]!r}?"
    raise ValueError(msg)
  return metric


def _check_tolerance(tolerance: Any, metric: str) -> float:
  if isinstance(tolerance, bool) or not isinstance(
      tolerance, (int, float, np.floating, np.integer)):
    raise TypeError(f"tolerance must be a number; got {tolerance!r} of type "
                    f"{type(tolerance).__name__}.")
  t = float(tolerance)
  if not (math.isfinite(t) and t >= 0):
    raise ValueError(f"tolerance must be a finite number >= 0 (a bound on "
                     f"{metric}); got {tolerance!r}.")
  return t


# ---------------------------------------------------------------------------
# Candidates.


@dataclasses.dataclass(frozen=True)
class _Candidate:
  label: str
  precision: Precision
  algorithm: str  # of a float32 dot on the target
  weight: float


def _candidates(candidates: Any, target: str,
                weights: Mapping[str, float]) -> list[_Candidate]:
  if candidates is None:
    candidates = DEFAULT_CANDIDATES[target]
  if isinstance(candidates, (str, Precision, lax.Precision,
                             lax.DotAlgorithmPreset)):
    candidates = (candidates,)
  try:
    candidates = tuple(candidates)
  except TypeError:
    raise TypeError(f"candidates must be a sequence of precisions; got "
                    f"{candidates!r}.") from None
  if not candidates:
    raise ValueError("candidates is empty: name at least one precision, e.g. "
                     "candidates=('bfloat16', 'float32').")
  f32 = weights[algorithm_for("float32", target, jnp.float32, jnp.float32)]
  out: list[_Candidate] = []
  for c in candidates:
    try:
      p = resolve(c)
    except ValueError as e:
      raise ValueError(f"Unknown candidate {c!r}: {e}") from None
    if p.flag is None:
      raise ValueError(f"Candidate {c!r} is the backend default, which means "
                       f"different things on different hardware; name a "
                       f"precision (e.g. 'bfloat16', 'float32').")
    if p.on(target).algorithm == "unsupported":
      raise ValueError(f"Candidate {c!r} ({p.name}) does not run on {target}.")
    algo = algorithm_for(p.per_op, target, jnp.float32, jnp.float32)
    w = weights.get(algo)
    if w is None:
      raise ValueError(f"Candidate {c!r} runs {algo} on {target}, which has "
                       f"no cost weight.")
    if w > f32:
      raise ValueError(
          f"Candidate {c!r} runs {algo} on {target}, which costs {w:g} per "
          f"FLOP, more than float32 ({f32:g}); the search returns policies "
          f"that cost no more than float32.")
    for o in out:
      if o.algorithm == algo:
        raise ValueError(
            f"Candidates {o.label!r} and {c!r} both run {algo} on {target}; "
            f"keep one.")
    label = c if isinstance(c, str) else p.name
    out.append(_Candidate(label, p, algo, w))
  out.sort(key=lambda c: (c.weight, c.precision.on(target).operand_bits))
  return out


# ---------------------------------------------------------------------------
# Arguments, reference and compiled programs.




def _native(fn: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
  """``fn`` run natively under ``policy`` (as :func:`jaxprec.swap` runs models)."""
  outside = policy.precision_for("", None, "dot")

  def run(*args, **kwargs):
    flag = (contextlib.nullcontext() if outside is None
            else jax.default_matmul_precision(outside.flag))
    with flag, policy_lib.policy_scope(policy):
      return fn(*args, **kwargs)
  return run


def _select(tree: Any, names: Sequence[str]) -> list[Any]:
  layers = named_layers(tree)
  return [layers[n] for n in names]


class _Runner:
  """Runs ``fn`` under a policy and reduces its checked layers to metrics.

  Each policy compiles one program, ``jax.jit`` of the emulated (or native)
  function returning the checked layers; the metrics are a second jitted
  program, compiled once per search (the layers' shapes do not change), so
  the layers stay on the device and only per-layer scalars reach the host.
  (Fusing both into one program made every evaluation about 1.4x to 1.8x slower
  on the built-in tiny Wav2Vec2: ``benchmarks/bench_search.py``.)
  """

  def __init__(self, fn, call: walker.SplitArgs, names: Sequence[str],
               layout: metrics_lib.Layout, target: str, mode: str):
    self.fn, self.call, self.names = fn, call, tuple(names)
    self.layout, self.target, self.mode = layout, target, mode
    self.hi = self.stats = None
    self._programs: dict[Policy, Any] = {}
    self._metrics = _metrics_program(layout)

  def wrap(self, policy: Policy) -> Callable[..., Any]:
    if self.mode == "native":
      return _native(self.fn, policy)
    return emulate(self.fn, policy, target=self.target)

  def layers_program(self, wrapped: Callable[..., Any]):
    names, call = self.names, self.call
    return jax.jit(lambda dynamic: _select(call.call(wrapped, dynamic), names))

  def set_reference(self, values: Sequence[Any]) -> None:
    self.hi, self.stats = _reference_program(self.layout)(list(values))

  def run(self, policy: Policy) -> list[metrics_lib.LayerMetrics]:
    prog = self._programs.get(policy)
    if prog is None:
      prog = self._programs[policy] = self.layers_program(self.wrap(policy))
    with warnings.catch_warnings():
      # Every rule of a searched policy names a path the audit found.
      warnings.simplefilter("ignore", policy_lib.UnusedRuleWarning)
      values = prog(self.call.dynamic)
    stats = self._metrics(values, self.hi, self.stats)
    return metrics_lib.finish(jax.device_get(stats), self.layout)


# Both programs depend on the layers' sizes only: kept for later searches.
@functools.lru_cache(maxsize=8)
def _metrics_program(layout: metrics_lib.Layout):
  def program(values, hi, stats):
    return metrics_lib.layer_stats(values, hi, None, stats, layout, atol=0.0,
                                   rtol=0.0)
  return jax.jit(program)


@functools.lru_cache(maxsize=8)
def _reference_program(layout: metrics_lib.Layout):
  def program(values):
    hi = metrics_lib.pack(values, layout)
    return hi, metrics_lib.reference_stats(hi, None, layout)
  return jax.jit(program)


def _float32_reference(fn):
  def run(*args, **kwargs):
    with jax.default_matmul_precision("float32"):
      return fn(*args, **kwargs)
  return run


def _resolve_mode(mode: Any, target: str) -> str:
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r}; valid choices: "
                     f"{', '.join(map(repr, MODES))}.")
  if mode != "auto":
    return mode
  backend = compat.backend_platform()
  native = {"tpu": ("tpu",), "gpu": ("gpu", "cuda", "rocm")}[target]
  return "native" if backend in native else "emulate"


def _check_layers(layers: Any, names: Sequence[str]) -> list[str]:
  if layers is None:
    return list(names)
  if isinstance(layers, str):
    layers = (layers,)
  chosen = []
  for name in layers:
    if name not in names:
      close = difflib.get_close_matches(str(name), list(names), n=1)
      hint = f" Did you mean {close[0]!r}?" if close else ""
      listed = ", ".join(map(repr, names[:12])) + (", ..." if len(names) > 12
                                                  else "")
      raise ValueError(f"Unknown layer {name!r}; the output's layers are "
                       f"{listed}.{hint}")
    if name not in chosen:
      chosen.append(name)
  if not chosen:
    raise ValueError("layers is empty: name at least one output layer, or "
                     "pass None for all of them.")
  return [n for n in names if n in chosen]


# ---------------------------------------------------------------------------
# Results.


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
    worst_value: its metric value (``1 - cosine`` for ``cosine``).
    relative_cost: the policy's cost relative to all-float32.
    counts: candidate -> number of module paths at it.
    seconds: wall time, compilation included.
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

  def to_dict(self) -> dict[str, Any]:
    return {"index": self.index, "phase": self.phase,
            "policy": str(self.policy), "passed": self.passed,
            "worst_layer": self.worst_layer,
            "worst_value": _json_float(self.worst_value),
            "relative_cost": _json_float(self.relative_cost),
            "counts": dict(self.counts), "seconds": self.seconds}


def _json_float(x: float) -> float | str:
  if isinstance(x, float) and not math.isfinite(x):
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
  return x


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchResult:
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

  def precision_by_path(self) -> dict[str, str]:
    """Module path -> the candidate the policy gives it."""
    out = {}
    for path in self.units:
      p = self.policy.precision_for(path, None, "dot")
      out[path] = p.name if p is not None else "-"
    return out

  def to_dict(self) -> dict[str, Any]:
    """JSON-able values (non-finite numbers as strings, as in check reports)."""
    return {
        "kind": "search", "policy": str(self.policy),
        "meets_tolerance": self.meets_tolerance, "metric": self.metric,
        "tolerance": self.tolerance, "target": self.target, "mode": self.mode,
        "candidates": list(self.candidates),
        "relative_cost": _json_float(self.cost.relative),
        "evaluations": self.evaluations, "budget": self.budget,
        "values": {k: _json_float(v) for k, v in self.values.items()},
        "precision_by_path": self.precision_by_path(),
        "cost": self.cost.to_dict(),
        "history": [s.to_dict() for s in self.history],
        "seconds": self.seconds,
    }

  def to_json(self, indent: int | None = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

  def __str__(self) -> str:
    rel = "{:.3f}".format(self.cost.relative)
    bound = {"cosine": "1 - cosine <=", "sqnr_db": "sqnr_db >="}.get(
        self.metric, f"{self.metric} <=")
    status = "meets" if self.meets_tolerance else "DOES NOT meet"
    lines = [
        f"jaxprec search: {bound} {self.tolerance:g} on {len(self.values)} "
        f"layers; target {self.target} ({self.mode}); candidates "
        f"{', '.join(self.candidates)}",
        f"policy: {self.policy}",
        f"cost: {rel} of float32 on {self.target} ({status} the tolerance)",
        f"evaluations: {self.evaluations} (budget {self.budget}; plus 1 "
        f"reference run), {self.seconds:.1f} s",
    ]
    if self.values:
      worst = max(self.values, key=lambda k: self._badness(self.values[k]))
      lines.append(f"worst layer: {worst} ({self.metric} "
                   f"{self.values[worst]:.3g})")
    counts: dict[str, int] = {}
    for p in self.precision_by_path().values():
      counts[p] = counts.get(p, 0) + 1
    lines.append("module paths: " + ", ".join(
        f"{n} at {p}" for p, n in counts.items()))
    return "\n".join(lines)

  def _badness(self, v: float) -> float:
    if math.isnan(v):
      return math.inf
    return -v if self.metric == "sqnr_db" else v


# ---------------------------------------------------------------------------
# The search.


@dataclasses.dataclass(frozen=True)
class _CostTable:
  """What each unit costs at each candidate, from one audit of ``fn``.

  Traced with JAX's flag cleared and no policy: the ops that record no
  precision are the ones a policy decides (the others are ``fixed``); their
  module paths, in program order, are the units.
  """

  units: list[str]
  unit_costs: np.ndarray  # (units, candidates)
  fixed_cost: float
  float32_cost: float

  @classmethod
  def of(cls, fn, args, kwargs, target: str, cands: list[_Candidate],
         weights: Mapping[str, float]) -> _CostTable:
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


def _paths(n: int) -> str:
  return f"{n} path" if n == 1 else f"{n} paths"


class _Search:
  """The search's state: the evaluations made, the best policy, the budget.

  A state is a tuple of levels, one index into the candidates (cheapest
  first) per unit; ``None`` is all-float32 when float32 is not a candidate.
  """

  def __init__(self, *, runner: _Runner, table: _CostTable,
               cands: list[_Candidate], metric: str, tolerance: float,
               budget: int, verbose: bool):
    self.runner, self.cands = runner, cands
    self.units = table.units
    self.unit_costs = table.unit_costs  # (units, candidates)
    self.fixed_cost, self.float32_cost = table.fixed_cost, table.float32_cost
    self.metric, self.tolerance, self.budget = metric, tolerance, budget
    self.tol_power = _tolerance_power(metric, tolerance)
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

  def relative_cost(self, levels: Sequence[int] | None) -> float:
    """Predicted cost relative to float32 (``levels`` None: all-float32)."""
    if levels is None or self.float32_cost == 0:
      return 1.0
    idx = np.asarray(levels, int)
    total = self.fixed_cost + float(
        self.unit_costs[np.arange(len(idx)), idx].sum())
    return total / self.float32_cost

  def policy(self, levels: Sequence[int] | None) -> Policy:
    if levels is None:
      return Policy(default="float32")
    if not levels:
      return Policy(default=self.cands[0].precision)
    counts = np.bincount(np.asarray(levels), minlength=len(self.cands))
    default = int(np.argmax(counts))  # most paths; ties: the cheaper
    rules = [Rule(path=re.escape(u), precision=self.cands[l].precision)
             for u, l in zip(self.units, levels) if l != default]
    return Policy(rules=tuple(rules), default=self.cands[default].precision)

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
    metrics = self.runner.run(policy)
    seconds = time.perf_counter() - t0
    powers = np.array([_power(self.metric, m) for m in metrics])
    passed = bool(np.all(powers <= self.tol_power))
    trial = _Trial(levels, policy, powers, metrics, passed,
                   self.evaluations + 1)
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
    value = _value(self.metric, trial.metrics[worst])
    counts: dict[str, int] = {}
    if trial.levels is None:
      counts = {"float32": len(self.units)}
    for l in trial.levels or ():
      counts[self.cands[l].label] = counts.get(self.cands[l].label, 0) + 1
    rel = self.relative_cost(trial.levels)
    step = SearchStep(index=trial.index, phase=phase, policy=trial.policy,
                      passed=trial.passed, worst_layer=name,
                      worst_value=value, relative_cost=rel,
                      counts=counts, seconds=seconds)
    self.history.append(step)
    if self.verbose:
      what = ", ".join(f"{k} {v}" for k, v in counts.items()) or "no paths"
      verdict = "pass" if trial.passed else "FAIL"
      print(f"jaxprec search [{trial.index}/{self.budget}] {phase} "
            f"({what}): {verdict}, worst {self.metric} {value:.2e} at "
            f"{name}; cost {rel:.3f} of float32; {seconds:.1f} s",
            file=sys.stderr, flush=True)

  # -- the algorithm ------------------------------------------------------------
  def run(self) -> None:
    n, m = len(self.units), len(self.cands)
    first = self.evaluate((0,) * n, f"all {self.cands[0].label}")
    if first.passed or n == 0:
      return
    level = None
    for k in range(1, m):
      if self.evaluations >= self.budget:
        self.exhausted = True
        return
      if self.evaluate((k,) * n, f"all {self.cands[k].label}").passed:
        level = k
        break
    if level is None:
      return
    for t in range(level):
      self.lower_to(t)

  def headroom(self, base: _Trial) -> np.ndarray:
    return np.maximum(self.tol_power - base.powers, 0.0)

  def saving(self, units: Sequence[int], levels: Sequence[int], t: int) -> float:
    idx = np.asarray(units, int)
    now = self.unit_costs[idx, np.asarray(levels)[idx]].sum()
    return float(now - self.unit_costs[idx, t].sum())

  def lowered(self, levels: Sequence[int], units: Sequence[int],
              t: int) -> tuple[int, ...]:
    out = list(levels)
    for u in units:
      out[u] = t
    return tuple(out)

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

  def density(self, node: _Node, room: np.ndarray) -> float:
    """How many times the node's added error fills the headroom (worst layer)."""
    with np.errstate(divide="ignore", invalid="ignore"):
      d = np.where(node.sens > 0, node.sens / room, 0.0)
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
    min_gain = MIN_GAIN * self.relative_cost(base.levels) * self.float32_cost
    leaves: list[_Node] = []
    heap: list[tuple[float, int, _Node]] = []

    def push(node: _Node) -> None:
      d = self.density(node, room)
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
      right_sens = np.maximum(node.sens - left_sens, 0.0)
      d_left = self.density(_Node((), left_sens, True), room)
      d_right = self.density(_Node((), right_sens, False), room)
      concentrated = min(d_left, d_right) <= 0.1 * max(d_left, d_right)
      reliable = d_right >= 0.25 * self.density(node, room)
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
          / max(self.density(g, room), 1e-12))
      chosen: list[_Node] = []
      total = np.zeros_like(room)
      for g in ranked:
        if self.saving(g.units, base.levels, t) <= 0:
          continue
        trial_total = total + g.sens
        if self.density(_Node((), trial_total, False), room) <= 1.0:
          chosen.append(g)
          total = trial_total
      if not chosen:
        return remaining + failed
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
    if self.best is not None and self.last is not self.best:
      if self.evaluations < self.budget:
        best, self.best = self.best, None
        again = self.evaluate(best.levels, "re-check", again=True)
        self.best = again if again.passed else None
    return self.best

  def fallback(self) -> _Trial | None:
    """All-float32, measured if the search did or the budget allows."""
    for trial in self.trials.values():
      if trial.policy == Policy(default="float32"):
        return trial
    if self.evaluations >= self.budget:
      return None
    levels = None  # float32 is not a candidate
    for k, c in enumerate(self.cands):
      if c.precision.name == "float32":
        levels = (k,) * len(self.units)
    return self.evaluate(levels, "all float32")


def check_arguments(*, tolerance: Any, metric: Any = "rel_rms",
                    candidates: Any = None, target: Any = "tpu",
                    budget: Any = DEFAULT_BUDGET):
  """Validates :func:`search_policy`'s arguments (the command line checks
  them before building a model).

  Returns:
    ``(metric, tolerance, candidates, target, budget)``, normalized; the
    candidates as internal records, cheapest first.

  Raises:
    TypeError, ValueError: as :func:`search_policy` does.
  """
  metric = _check_metric(metric)
  tolerance = _check_tolerance(tolerance, metric)
  target = cost_lib.check_target(target)
  if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
    raise TypeError(f"budget must be an int; got {budget!r}.")
  if budget < 1:
    raise ValueError(f"budget must be >= 1 (evaluations); got {budget}.")
  cands = _candidates(candidates, target, cost_lib.weights_for(target))
  return metric, tolerance, cands, target, int(budget)


def search_policy(fn: Callable[..., Any], *args: Any, tolerance: float,
                  metric: str = "rel_rms",
                  candidates: Sequence[PrecisionLike] | None = None,
                  target: str = "tpu", budget: int = DEFAULT_BUDGET,
                  layers: Sequence[str] | str | None = None,
                  reference: Any = "float32", mode: str = "auto",
                  verbose: bool = True, **kwargs: Any) -> SearchResult:
  """Finds the cheapest per-layer precision policy that meets a tolerance.

  Every Flax module path that runs a matmul or convolution (as
  :attr:`jaxprec.AuditRow.module_path` shows it; ``''`` for ops outside
  modules) gets one of ``candidates``; the result is the cheapest assignment
  found, by :func:`jaxprec.cost` on ``target``, whose every checked output
  layer is within ``tolerance`` of the reference. The search starts from the
  cheapest candidate everywhere (if that passes, it is the answer after one
  evaluation) and, where it does not, raises precision where it buys the
  most accuracy per unit of cost, measuring the sensitivity of groups of
  paths by bisection so that the number of runs stays near logarithmic in
  the number of paths (details: :mod:`jaxprec._src.search`,
  ``docs/search.md``). Each candidate policy is compiled once: ``jax.jit``
  of :func:`jaxprec.emulate` (on the target's own hardware, natively), with
  the metrics computed inside the program. One line per evaluation goes to
  stderr unless ``verbose=False``.

  Args:
    fn: returns the layers to check: any pytree of arrays (its floating
      leaves, named as :func:`jaxprec.named_layers` names them).
    *args: positional arguments for ``fn`` (arrays are traced; other leaves
      are static). Pass parameters as arguments, not closed over.
    tolerance: the bound on ``metric`` for every checked layer (>= 0):
      ``metric <= tolerance``; for ``'cosine'`` ``1 - cosine <= tolerance``;
      for ``'sqnr_db'`` ``sqnr_db >= tolerance``.
    metric: one of :data:`METRICS` (see :mod:`jaxprec._src.metrics`).
    candidates: the precisions to choose from (any order; sorted by cost on
      ``target``; none may cost more than float32). Default: ``('bfloat16',
      'bfloat16_3x', 'float32')`` on a TPU, ``('tensorfloat32',
      'TF32_TF32_F32_X3', 'float32')`` on a GPU.
    target: ``'tpu'`` or ``'gpu'``.
    budget: the most evaluations (runs of ``fn`` under a candidate policy;
      the reference run is extra). When it runs out the best policy found
      so far that meets the tolerance is returned, with a warning.
    layers: names of the output layers to check (default: all).
    reference: ``'float32'`` (``fn`` at float32, natively: exact on CPU and
      GPU, six bfloat16 passes on a TPU), another precision or a policy
      (computed as a candidate is), or the layers themselves (a pytree like
      ``fn``'s output, or a ``{name: array}`` mapping).
    mode: ``'auto'`` (native on the target's own hardware, emulated
      elsewhere), ``'emulate'`` or ``'native'``.
    verbose: print a line per evaluation to stderr.
    **kwargs: keyword arguments for ``fn``.

  Returns:
    A :class:`jaxprec.SearchResult`: ``.policy``, ``.report``, ``.cost``,
    ``.evaluations``, ``.history``.

  Raises:
    TypeError: ``fn`` is not callable; a non-numeric tolerance.
    ValueError: an unknown metric, candidate, target, mode or layer; a
      negative tolerance; a budget below 1; an output without floating
      layers; a reference that does not match the output.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec
    >>> def f(w, x):
    ...   h = jnp.tanh(x @ w)
    ...   return {"h": h, "out": h @ w}
    >>> w = jax.random.normal(jax.random.key(0), (32, 32)) / 6
    >>> x = jax.random.normal(jax.random.key(1), (4, 32))
    >>> r = jaxprec.search_policy(f, w, x, tolerance=1e-2, verbose=False)
    >>> str(r.policy), r.evaluations, r.cost.relative
    ('default=bfloat16', 1, 0.16666666666666666)
    >>> r = jaxprec.search_policy(f, w, x, tolerance=1e-4, verbose=False)
    >>> str(r.policy), r.meets_tolerance
    ('default=bfloat16_3x', True)
  """
  if not callable(fn):
    raise TypeError(f"jaxprec.search_policy expects a callable; got {fn!r} of "
                    f"type {type(fn).__name__}")
  metric, tolerance, cands, target, budget = check_arguments(
      tolerance=tolerance, metric=metric, candidates=candidates,
      target=target, budget=budget)
  mode = _resolve_mode(mode, target)
  weights = cost_lib.weights_for(target)
  if mode == "native" and compat.backend_platform() == "cpu":
    warnings.warn("jaxprec.search_policy: native mode on cpu: the CPU ignores "
                  "matmul precision, so every policy computes float32 (use "
                  "mode='emulate')", UserWarning, stacklevel=2)
  t_start = time.perf_counter()
  fn = cost_lib.unjit(fn)  # each policy must trace fn anew
  call = walker.SplitArgs(args, dict(kwargs), who='jaxprec.search_policy')
  table = _CostTable.of(fn, args, kwargs, target, cands, weights)

  # Output layers and the reference.
  shapes = jax.eval_shape(lambda d: call.call(fn, d), call.dynamic)
  all_names = list(named_layers(shapes))
  if not all_names:
    raise ValueError(f"{getattr(fn, '__name__', 'fn')}(...) returned no "
                     f"floating arrays to compare")
  names = _check_layers(layers, all_names)
  shape_of = dict(zip(all_names, named_layers(shapes).values()))
  layout = metrics_lib.Layout(tuple(int(np.prod(shape_of[n].shape))
                                    for n in names))
  runner = _Runner(fn, call, names, layout, target, mode)
  ref_values = _reference_values(fn, call, names, shape_of, reference, runner,
                                 target)
  runner.set_reference(ref_values)
  del ref_values

  search = _Search(runner=runner, table=table, cands=cands, metric=metric,
                   tolerance=tolerance, budget=budget, verbose=verbose)
  search.run()
  best = search.finish()
  if best is not None:
    policy, metrics, meets = best.policy, best.metrics, True
    if search.exhausted:
      warnings.warn(
          f"jaxprec.search_policy: the budget of {budget} evaluations ran "
          f"out; returning the cheapest policy found that meets the "
          f"tolerance ({policy}). A larger budget may find a cheaper one.",
          UserWarning, stacklevel=2)
  else:
    trial = search.fallback()
    policy = Policy(default="float32")
    metrics = None if trial is None else trial.metrics
    meets = trial is not None and trial.passed
    msg = ("no policy of the candidates met the tolerance"
           if not search.exhausted else
           f"the budget of {budget} evaluations ran out before any policy "
           f"met the tolerance")
    warnings.warn(
        f"jaxprec.search_policy: {msg} ({metric} "
        f"{'>=' if metric == 'sqnr_db' else '<='} {tolerance:g}); returning "
        f"{policy}{'' if trial is not None else ' (not evaluated)'}.",
        UserWarning, stacklevel=2)
  report = None if metrics is None else _report(
      policy, metrics, names, shape_of, reference, target, mode, metric,
      tolerance)
  values = {} if metrics is None else {
      n: _value(metric, m) for n, m in zip(names, metrics)}
  cost_report = cost_lib.cost(fn, *args, policy=policy, target=target,
                              **kwargs)
  return SearchResult(
      policy=policy, meets_tolerance=meets, report=report, values=values,
      cost=cost_report, evaluations=search.evaluations, budget=budget,
      history=tuple(search.history), metric=metric, tolerance=tolerance,
      candidates=tuple(c.label for c in cands), target=target, mode=mode,
      units=tuple(table.units), seconds=time.perf_counter() - t_start)


def _reference_values(fn, call: walker.SplitArgs, names, shape_of, reference, runner,
                      target) -> list[Any]:
  if isinstance(reference, str) and "=" not in reference and \
      resolve(reference).name == "float32":
    wrapped = _float32_reference(fn)
  elif isinstance(reference, (str, Precision, Policy, lax.Precision,
                              lax.DotAlgorithmPreset)):
    wrapped = runner.wrap(policy_lib.as_policy(reference))
  else:
    if isinstance(reference, Mapping) and all(
        isinstance(k, str) for k in reference) and all(
            hasattr(v, "shape") for v in reference.values()):
      found = dict(reference)
    else:
      found = named_layers(reference)
    out = []
    for n in names:
      if n not in found:
        raise ValueError(f"reference has no layer {n!r} (it has "
                         f"{', '.join(map(repr, list(found)[:8]))})")
      v = jnp.asarray(found[n], jnp.float32)
      if tuple(v.shape) != tuple(shape_of[n].shape):
        raise ValueError(f"reference layer {n!r} has shape {tuple(v.shape)}, "
                         f"the output {tuple(shape_of[n].shape)}")
      out.append(v)
    return out
  return runner.layers_program(wrapped)(call.dynamic)


def _report(policy: Policy, metrics, names, shape_of, reference, target: str,
            mode: str, metric: str, tolerance: float) -> DivergenceReport:
  layers = tuple(
      LayerResult(name=n, shape=tuple(shape_of[n].shape),
                  dtype=str(shape_of[n].dtype), metrics={"policy": m})
      for n, m in zip(names, metrics))
  ref = reference if isinstance(reference, str) else (
      str(reference) if isinstance(reference, Policy) else "pytree")
  return DivergenceReport(
      layers=layers, precisions=("policy",), reference=ref, target=target,
      mode=mode, backend=compat.backend_platform(), atol=0.0, rtol=0.0,
      numerics={"policy": str(policy)},
      notes=(f"searched for {metric} within {tolerance:g} on every layer; "
             f"atol = rtol = 0 here, so '!' marks any difference",))
