"""Policy search: the cheapest per-layer precision that meets a tolerance.

:func:`search_policy` validates its arguments, runs the function under each
candidate :class:`jaxprec.Policy` (emulated on the precision axis: one
switched program for every policy, :mod:`jaxprec._src.search.switch`) and
returns a :class:`SearchResult`; :mod:`jaxprec._src.search.search_algorithm`
decides which policies to evaluate (``docs/search.md``, "The algorithm").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprec._src.checker import harness
from jaxprec._src.checker import logits as logits_lib
from jaxprec._src.checker import metrics as metrics_lib
from jaxprec._src.checker import rows
from jaxprec._src.checker.report import DivergenceReport, LayerResult
from jaxprec._src.core import numerics
from jaxprec._src.core.names import unknown
from jaxprec._src.core.precision import Precision, PrecisionLike, resolve
from jaxprec._src.emulation import compile_cache
from jaxprec._src.emulation import emulated_ops
from jaxprec._src.inspect import audit as audit_lib
from jaxprec._src.flax import nnx_policy
from jaxprec._src.inspect import cost as cost_lib
from jaxprec._src.jaxpr import compat
from jaxprec._src.policy.policy import Policy
from jaxprec._src.search import search_dtype
from jaxprec._src.search import switch
from jaxprec._src.search.search_algorithm import Candidate, CostTable, Search
from jaxprec._src.search.search_result import SearchResult

# Metrics a tolerance can bound. Smaller is better for all but cosine (the
# tolerance bounds 1 - cosine) and sqnr_db (the tolerance is a minimum).
METRICS = ("rel_rms", "max_abs", "max_rel", "cosine", "sqnr_db", "ulp_median",
           "ulp_max")
# Metrics of the logits gates (search_policy's ``logits``): they bound the
# logits layer alone; smaller is better for each.
LOGITS_METRICS = logits_lib.METRICS
DEFAULT_CANDIDATES = {
    "tpu": ("bfloat16", "bfloat16_3x", "float32"),
    "gpu": ("tensorfloat32", "TF32_TF32_F32_X3", "float32"),
}
DEFAULT_BUDGET = 24


def _candidates(candidates: Any, target: str,
                weights: Mapping[str, float]) -> list[Candidate]:
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
  f32 = weights[numerics.algorithm_for("float32", target, jnp.float32, jnp.float32)]
  out: list[Candidate] = []
  for c in candidates:
    try:
      p = resolve(c)
    except ValueError as e:
      # One name, said once: "Unknown candidate 'bf17': unknown name. ..."
      why = str(e).removeprefix(f"Invalid precision {c!r}: ")
      raise ValueError(f"Unknown candidate {c!r}: {why}") from None
    if p.flag is None:
      raise ValueError(f"Candidate {c!r} is the backend default, which means "
                       f"different things on different hardware; name a "
                       f"precision (e.g. 'bfloat16', 'float32').")
    if not p.on(target).supported:  # the one table's answer
      raise ValueError(f"Candidate {c!r}: "
                       f"{numerics.unsupported_message(p, target)}")
    algo = numerics.algorithm_for(p.per_op, target, jnp.float32, jnp.float32)
    w = weights.get(algo)
    if w is None:
      raise ValueError(f"Candidate {c!r} runs {algo} on {target}, which has "
                       f"no cost weight.")
    if w > f32:
      raise ValueError(
          f"Candidate {c!r} runs {algo} on {target}, which costs {w:g} per "
          f"FLOP, more than float32 ({f32:g}); the search returns policies "
          f"that cost no more than float32.")
    same = [o.label for o in out if o.algorithm == algo]
    if same:
      raise ValueError(f"Candidates {same[0]!r} and {c!r} both run {algo} on "
                       f"{target}; keep one.")
    label = c if isinstance(c, str) else p.name
    out.append(Candidate(label, p, algo, w))
  out.sort(key=lambda c: (c.weight, c.precision.on(target).operand_bits))
  return out


class _Runner:
  """Evaluates policies with the shared harness: after the first, in one
  switched program where it can (``compile_once`` of :func:`search_policy`).
  """

  def __init__(self, fn, call: harness.Args, ref: harness.Reference,
               target: str, mode: str, *, units: Sequence[str] = (),
               precisions: Sequence[Precision] | None = None,
               tensor_cores: str | None = None,
               logits: str | None = None, logits_k: int | None = None):
    # The harness keeps programs only for a function it can weakly reference.
    self.fn, self.call, self.ref = _referable(fn), call, ref
    self.names = tuple(ref.names)
    # A logits metric: each run is one record (_LogitsRun), of that layer.
    self.logits, self.logits_k = logits, logits_k
    if logits is not None:
      self.names = (logits,)
    self.target, self.mode = target, mode
    self.units = tuple(units)
    # The chip whose tensor cores compute the emulated dots (search_policy's
    # tensor_cores): part of every program's key, through the plan's and
    # the switched program's.
    self.tensor_cores = tensor_cores
    # The switch's choices (float32 last when no candidate is float32);
    # None: no switched program, or the switch could not serve this model.
    self.precisions = None if precisions is None else tuple(precisions)
    self.fixed_runs = 0
    self._programs: dict[Any, Any] = {}
    self._traces: dict[Any, Any] = {}

  def run(self, policy: Policy, levels: Sequence[int] | None = None, *,
          fixed: bool = False) -> tuple[list[Any], str]:
    """``(metrics, program)``: ``program`` is ``'fixed'`` or ``'switched'``;
    ``metrics`` one :class:`~jaxprec._src.checker.metrics.LayerMetrics` per
    layer, or with ``logits`` one :class:`_LogitsRun`."""
    if self.logits is None:
      return self._run(policy, levels, fixed, None)
    got: dict[str, Any] = {}
    index = self.ref.names.index(self.logits)

    def seen(values):
      got["row"] = np.asarray(jax.device_get(values[index]))
    metrics, program = self._run(policy, levels, fixed, seen)
    gates = logits_lib.row_gates(got.pop("row"), self.ref.kept, self.logits_k)
    return [_LogitsRun.of(gates, metrics)], program

  def _run(self, policy, levels, fixed, seen):
    if fixed or self.precisions is None or self.fixed_runs == 0:
      self.fixed_runs += 1
      p = rows.plan(policy, self.target, self.mode, chip=self.tensor_cores)
      return harness.run_candidate(self.fn, self.call, p, self.ref, 0.0, 0.0,
                                   cache=self._programs, seen=seen), "fixed"
    index = switch.index_of(
        [len(self.precisions) - 1] * len(self.units) if levels is None
        else levels)
    try:
      return harness.run_indexed(
          self.fn, self.call, self._wrap,
          (self.precisions, self.units, self.tensor_cores),
          index, self.ref, self._programs, seen=seen), "switched"
    except switch.SwitchError as e:
      self.precisions = None
      warnings.warn(
          f"jaxprec.search_policy: {e}; each policy compiles a program of "
          f"its own instead (the search is slower, its answers the same).",
          UserWarning, stacklevel=4)
      return self._run(policy, levels, True, seen)

  def _wrap(self, f, index):
    # ``f`` is a new wrapper of self.fn at each trace: one trace of it serves
    # every trace of the switched program.
    chip = {} if self.tensor_cores is None else {"chip": self.tensor_cores}
    g = switch.switched(f, self.units, self.precisions, target=self.target,
                        traces=self._traces, **chip)
    return functools.partial(g, index)


@dataclasses.dataclass(frozen=True)
class _LogitsRun:
  """One evaluation measured by the logits gates: the search's one record
  (the logits metrics by name, infinite where the logits hold NaN or
  infinity), the gates and every layer's metrics (for the report)."""

  kl_max: float
  kl_mean: float
  logprob_diff: float
  top1_disagreement: float
  required_atol: float
  gates: logits_lib.LogitsGates | None
  layers: tuple[metrics_lib.LayerMetrics, ...]

  @classmethod
  def of(cls, gates, layers) -> _LogitsRun:
    return cls(**{m: logits_lib.metric_value(gates, m)
                  for m in logits_lib.METRICS},
               required_atol=0.0 if gates is not None else math.inf,
               gates=gates, layers=tuple(layers))


def _referable(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn``, or a function calling it where ``fn`` cannot be weakly
  referenced."""
  try:
    weakref.ref(fn)
  except TypeError:
    @functools.wraps(fn)
    def call(*args, **kwargs):
      return fn(*args, **kwargs)
    if not hasattr(fn, "__qualname__"):
      call.__qualname__ = call.__name__ = type(fn).__qualname__
    return call
  return fn


def _check_layers(layers: Any, names: Sequence[str]) -> list[str]:
  if layers is None:
    return list(names)
  layers = (layers,) if isinstance(layers, str) else tuple(layers)
  for name in layers:
    if name not in names:
      raise unknown("layer", name, names, hint=" (the output's layers)")
  if not layers:
    raise ValueError("layers is empty: name at least one output layer, or "
                     "pass None for all of them.")
  return [n for n in names if n in layers]


def check_arguments(*, tolerance: Any, metric: Any = "rel_rms",
                    candidates: Any = None, target: Any = "tpu",
                    budget: Any = DEFAULT_BUDGET, axes: Any = ("precision",),
                    dtypes: Any = None, chip: Any = None,
                    logits: Any = None):
  """Validates :func:`search_policy`'s arguments, raising as it does (the
  command line checks them before building a model).

  Returns:
    ``(metric, tolerance, candidates, target, budget, axes, dtypes)``,
    normalized; the candidates as internal records, cheapest first
    (``dtypes`` None without the dtype axis; ``chip`` is checked, not
    returned).
  """
  target = numerics.check_target(target)
  axes, dtypes = search_dtype.check_arguments(axes, dtypes, chip, target)
  if metric in LOGITS_METRICS:
    if logits is None:
      raise ValueError(
          f"metric {metric!r} bounds the logits gates of a language model's "
          f"logits layer: name it with logits= (e.g. logits='logits')")
  elif logits is not None:
    raise ValueError(f"logits={logits!r} serves the logits metrics "
                     f"{', '.join(map(repr, LOGITS_METRICS))}; got metric "
                     f"{metric!r}")
  elif metric not in METRICS:
    raise unknown("metric", metric, METRICS + LOGITS_METRICS)
  if isinstance(tolerance, bool) or not isinstance(
      tolerance, (int, float, np.floating, np.integer)):
    raise TypeError(f"tolerance must be a number; got {tolerance!r} of type "
                    f"{type(tolerance).__name__}.")
  if not (math.isfinite(tolerance) and tolerance >= 0):
    raise ValueError(f"tolerance must be a finite number >= 0 (a bound on "
                     f"{metric}); got {tolerance!r}.")
  if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
    raise TypeError(f"budget must be an int; got {budget!r}.")
  if budget < 1:
    raise ValueError(f"budget must be >= 1 (evaluations); got {budget}.")
  cands = _candidates(candidates, target, cost_lib.weights_for(target))
  return metric, float(tolerance), cands, target, int(budget), axes, dtypes


def search_policy(fn: Callable[..., Any], *args: Any, tolerance: float,
                  metric: str = "rel_rms",
                  candidates: Sequence[PrecisionLike] | None = None,
                  target: str = "tpu", budget: int = DEFAULT_BUDGET,
                  layers: Sequence[str] | str | None = None,
                  reference: Any = "float32", mode: str = "auto",
                  verbose: bool = True,
                  cache: bool | str | os.PathLike = False,
                  axes: Sequence[str] | str = ("precision",),
                  dtypes: Sequence[Any] | None = None,
                  chip: str | None = None,
                  compile_once: bool = True,
                  tensor_cores: str | None = None,
                  logits: str | None = None, logits_k: int | None = None,
                  **kwargs: Any) -> SearchResult:
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
  the number of paths (details: ``docs/search.md``).

  Args:
    fn: returns the layers to check: any pytree of arrays (its floating
      leaves, named as :func:`jaxprec.named_layers` names them).
    *args: positional arguments for ``fn`` (arrays are traced; other leaves
      are static). Pass parameters as arguments, not closed over.
    tolerance: the bound on ``metric`` for every checked layer (>= 0):
      ``metric <= tolerance``; for ``'cosine'`` ``1 - cosine <= tolerance``;
      for ``'sqnr_db'`` ``sqnr_db >= tolerance``.
    metric: one of :data:`METRICS` (see :mod:`jaxprec._src.checker.metrics`),
      or, with ``logits``, one of :data:`LOGITS_METRICS`: ``'kl_max'``,
      ``'kl_mean'`` (``KL(reference || policy)`` of the softmax
      distributions in nats, largest or mean over positions),
      ``'logprob_diff'`` (the largest ``|log p - log p_ref|``) or
      ``'top1_disagreement'`` (``1 - top1_agreement``), computed as
      :func:`jaxprec.torch.logits_gates` computes them (on the host, float64).
      These bound the logits layer alone.
    candidates: the precisions to choose from (any order; sorted by cost on
      ``target``; none may cost more than float32). Default: ``('bfloat16',
      'bfloat16_3x', 'float32')`` on a TPU, ``('tensorfloat32',
      'TF32_TF32_F32_X3', 'float32')`` on a GPU.
    target: ``'tpu'`` or ``'gpu'``.
    budget: the most evaluations (runs of ``fn`` under a candidate policy;
      the reference run is extra). When it runs out the best policy found
      so far that meets the tolerance is returned, with a warning.
    layers: names of the output layers to check (default: all).
    reference: what :func:`jaxprec.check` reads: ``'float32'`` (``fn`` at
      float32, natively: exact on CPU and GPU, six bfloat16 passes on a
      TPU), ``'float64'``, another precision or a policy (computed as a
      candidate is), or hidden states computed elsewhere (a pytree like
      ``fn``'s output, a ``{name: array}`` mapping, or a ``.npz``, ``.npy``
      or ``.safetensors`` file), matched by name as ``check`` matches.
    mode: ``'auto'`` (native on the target's own hardware, emulated
      elsewhere), ``'emulate'`` or ``'native'``.
    verbose: print a line per evaluation to stderr.
    cache: JAX's persistent compilation cache for this call, as for
      :func:`jaxprec.check`: ``False`` (default), ``True`` (the default
      directory) or a directory; JAX's settings are restored afterwards.
    axes: what the search decides per unit: ``('precision',)`` (default:
      the matmul precision of each module path that runs matmuls),
      ``('precision', 'dtype')`` (a compute dtype from ``dtypes`` and a
      precision from ``candidates`` for each module a dtype decision
      reaches, layer norms included) or ``('dtype',)`` (the compute dtype
      alone); a comma-separated string is accepted. On the dtype axis the
      candidates are ordered, and policies costed, by their roofline time on
      ``chip`` (``docs/search.md``), and a float32 or float64 reference runs
      a model built in bfloat16 at that dtype (as :func:`jaxprec.check`).
    dtypes: the dtype axis's compute dtypes (default ``('bfloat16',
      'float32')``; ``'float16'`` too on a GPU).
    chip: the dtype axis's chip (:data:`jaxprec._src.inspect.chips.CHIPS`; default
      ``'tpu-v5e'`` for a TPU target, ``'h100'`` for a GPU); its time is
      :attr:`SearchResult.cost`'s ``seconds``.
    compile_once: emulating on the precision axis, run every evaluation
      after the first in one switched program (each path's precision chosen
      at run time by an index array: :mod:`jaxprec._src.search.switch`) instead of
      compiling a program per policy. It computes what the per-policy
      program computes, bit for bit; the returned policy is run once more
      in its own program, which checks so (a difference warns) and gives
      the report. ``False`` compiles one program per policy. The dtype axis
      and native runs always compile per policy.
    tensor_cores: with ``target='gpu'``, the NVIDIA chip (``'a100'``,
      ``'h100'``, ``'b200'``) whose tensor cores compute every emulated
      evaluation, the reference when it is computed at a precision other
      than float32, and the returned policy's report, as
      :func:`jaxprec.emulate`'s ``chip`` computes them (``docs/gpu.md``).
      None (default): the algorithm's definition. It is a keyword of its
      own, not ``chip``: ``chip`` is the dtype axis's roofline chip (it
      orders costs, and names chips without a tensor-core model), and the
      two may differ; neither changes the other's meaning.
    logits: the output layer holding a language model's logits (the
      vocabulary on the last axis), which a logits metric bounds; its gates
      are in the result's ``report.logits``. Needs a logits metric.
    logits_k: the k of the report's top-k overlap, as
      :func:`jaxprec.check`'s.
    **kwargs: keyword arguments for ``fn``.

  Returns:
    A :class:`jaxprec.SearchResult`: ``.policy``, ``.report``, ``.cost``,
    ``.evaluations``, ``.history``.

  Raises:
    TypeError: ``fn`` is not callable; a non-numeric tolerance; a
      ``compile_once`` that is not a bool.
    ValueError: an unknown metric, candidate, target, mode, layer, axis,
      dtype or chip; a negative tolerance; a budget below 1; an output
      without floating layers, or with empty ones only (or ``layers``
      naming empty ones only); a reference that does not match the
      output; a ``cache`` directory that cannot be created; a logits
      metric without
      ``logits`` or ``logits`` with another metric; a ``logits`` that names
      no layer, or one whose last axis has fewer than 2 entries.

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

    On a model with modules, ``axes=('precision', 'dtype')`` picks a compute
    dtype per module too, e.g. ``'default=bfloat16+dtype:bfloat16,
    dense_2=float32+dtype:float32'`` (``docs/search.md``).
  """
  if not callable(fn):
    raise TypeError(f"jaxprec.search_policy expects a callable; got {fn!r} of "
                    f"type {type(fn).__name__}")
  if not isinstance(compile_once, (bool, np.bool_)):
    raise TypeError(f"compile_once must be True or False; got "
                    f"{compile_once!r}.")
  if "prepare_weights" in kwargs:
    raise TypeError("jaxprec.search_policy: prepare_weights was removed (it "
                    "did not pay back within a search's evaluations); drop "
                    "the argument.")
  directory = compile_cache.resolve_cache(cache, "jaxprec.search_policy")
  metric, tolerance, cands, target, budget, axes, dtypes = check_arguments(
      tolerance=tolerance, metric=metric, candidates=candidates,
      target=target, budget=budget, axes=axes, dtypes=dtypes, chip=chip,
      logits=logits)
  # jaxprec.emulate's check and message (a chip needs target='gpu'), naming
  # tensor_cores: this function's chip= is the roofline chip.
  tensor_cores = emulated_ops.check_chip(tensor_cores, target,
                                         name="tensor_cores")
  mode = numerics.resolve_mode(mode, target)
  if directory is not None:  # after the checks: a refused call writes nothing
    with compile_cache.compilation_cache(directory):
      return search_policy(
          fn, *args, tolerance=tolerance, metric=metric, candidates=candidates,
          target=target, budget=budget, layers=layers, reference=reference,
          mode=mode, verbose=verbose, cache=False, axes=axes, dtypes=dtypes,
          chip=chip, compile_once=compile_once, tensor_cores=tensor_cores,
          **({} if logits is None else {"logits": logits,
                                        "logits_k": logits_k}),
          **kwargs)
  if mode == "native" and compat.backend_platform() == "cpu":
    warnings.warn("jaxprec.search_policy: native mode on cpu: the CPU ignores "
                  "matmul precision, so every policy computes float32 (use "
                  "mode='emulate')", UserWarning, stacklevel=2)
  t_start = time.perf_counter()
  fn = cost_lib.unjit(fn)  # each policy must trace fn anew
  fn, args = nnx_policy.stateful(fn, args)  # an NNX model: its state an argument
  call = harness.Args(args, dict(kwargs), who="jaxprec.search_policy")
  float32_policy = Policy(default="float32")
  if "dtype" in axes:
    table, cands = search_dtype.table(
        fn, args, kwargs, target=target, axes=axes,
        dtypes=dtypes, precisions=cands, chip=chip)
    chip = chip or search_dtype.DEFAULT_CHIPS[target]
    float32_policy = Policy(default="float32" if "precision" in axes else None,
                            default_dtype="float32")
  else:
    table = CostTable.of(fn, args, kwargs, target, cands,
                         cost_lib.weights_for(target))
  if len(table.units) <= 1:  # one unit: say so when the model hides its modules
    hidden = audit_lib.unseen_modules(
        cost_lib.trace_rows(fn, args, kwargs, None))
    if hidden:
      warnings.warn(f"jaxprec.search_policy: {hidden}", UserWarning,
                    stacklevel=2)

  # Output layers and the reference (read or computed as check does).
  info = harness.output_info(fn, call)
  all_names = [n for n, _, _ in info]
  harness.comparable(fn, all_names, [s for _, s, _ in info])
  names = _check_layers(layers, all_names)
  if logits is not None:
    logits_k = logits_lib.check_layer(
        logits, logits_k, [(n, s) for n, s, _ in info],
        "jaxprec.search_policy")
    names = [n for n in all_names if n in names or n == logits]
  empty = [n for n, shape, _ in info if n in names and 0 in shape]
  if empty == names:
    raise ValueError(f"jaxprec.search_policy: layers={layers!r} names only "
                     f"empty layers, nothing to compare; name one with "
                     f"elements")
  if empty:
    # No elements: nothing to compare, so no policy's figure there says
    # anything; left out, and said so.
    warnings.warn(
        f"jaxprec.search_policy: {', '.join(map(repr, empty[:4]))} "
        f"{'has' if len(empty) == 1 else 'have'} no elements and "
        f"{'is' if len(empty) == 1 else 'are'} not checked.", UserWarning,
        stacklevel=2)
    names = [n for n in names if n not in empty]
  ref = harness.build_reference(
      fn, call, reference, target=target, mode=mode,
      select=None if names == all_names else names,
      options={"chip": tensor_cores}, keep=logits)
  switchable = (compile_once and mode == "emulate" and "dtype" not in axes
                and bool(table.units))
  runner = _Runner(fn, call, ref, target, mode, units=table.units,
                   precisions=_choices(cands) if switchable else None,
                   tensor_cores=tensor_cores, logits=logits, logits_k=logits_k)

  search = Search(runner=runner, table=table, cands=cands, metric=metric,
                  tolerance=tolerance, budget=budget, verbose=verbose,
                  float32_policy=float32_policy)
  search.run()
  best = search.finish()
  trial = best if best is not None else search.fallback()
  policy = float32_policy if best is None else best.policy
  metrics = None if trial is None else trial.metrics
  meets = trial is not None and trial.passed
  if trial is not None and trial.program == "switched":
    metrics, meets = _fixed_run(runner, search, trial)
  if best is not None and search.exhausted:
    warnings.warn(
        f"jaxprec.search_policy: the budget of {budget} evaluations ran "
        f"out; returning the cheapest policy found that meets the "
        f"tolerance ({policy}). A larger budget may find a cheaper one.",
        UserWarning, stacklevel=2)
  elif best is None:
    msg = ("no policy of the candidates met the tolerance"
           if not search.exhausted else
           f"the budget of {budget} evaluations ran out before any policy "
           f"met the tolerance")
    warnings.warn(
        f"jaxprec.search_policy: {msg} ({metric} "
        f"{'>=' if metric == 'sqnr_db' else '<='} {tolerance:g}); returning "
        f"{policy}{'' if trial is not None else ' (not evaluated)'}.",
        UserWarning, stacklevel=2)
  if logits is not None and metrics is not None:  # one _LogitsRun
    run, = metrics
    values = {logits: float(getattr(run, metric))}
    report = dataclasses.replace(
        _report(policy, list(run.layers), ref, target, mode, metric,
                tolerance, tensor_cores, logits=True),
        logits_layer=logits, logits={"policy": run.gates})
  else:
    report = None if metrics is None else _report(
        policy, metrics, ref, target, mode, metric, tolerance, tensor_cores)
    values = {} if metrics is None else {
        n: float(getattr(m, metric)) for n, m in zip(ref.names, metrics)}
  del runner, call  # they hold the arguments
  cost_report = cost_lib.cost(fn, *args, policy=policy, target=target,
                              **({} if "dtype" not in axes else {"chip": chip}),
                              **kwargs)
  return SearchResult(
      policy=policy, meets_tolerance=meets, report=report, values=values,
      cost=cost_report, evaluations=search.evaluations, budget=budget,
      history=tuple(search.history), metric=metric, tolerance=tolerance,
      candidates=tuple(c.label for c in cands), target=target, mode=mode,
      units=tuple(table.units), seconds=time.perf_counter() - t_start,
      axes=axes)


def _choices(cands: Sequence[Candidate]) -> tuple[Precision, ...]:
  """The switched program's choices: the candidates' precisions, cheapest
  first, and float32 last when no candidate is (the all-float32 fallback)."""
  out = tuple(c.precision for c in cands)
  return out if any(c.is_float32 for c in cands) else (*out, resolve("float32"))


def _fixed_run(runner: _Runner, search: Search, trial) -> tuple[list, bool]:
  """The returned policy's metrics from its own compiled program, as
  :func:`jaxprec.check` reports them; a difference from the switched
  program's, which should agree bit for bit, warns."""
  metrics, _ = runner.run(trial.policy, fixed=True)
  powers, passed = search.powers(metrics)
  if not np.array_equal(powers, trial.powers, equal_nan=True):
    warnings.warn(
        f"jaxprec.search_policy: {trial.policy} measured differently in the "
        f"search's switched program ({search.metric} powers "
        f"{trial.powers.tolist()[:4]}) and in its own program "
        f"({powers.tolist()[:4]}); the report is the latter's"
        f"{'' if passed or not trial.passed else ', which misses the tolerance'}"
        f". Please report this with the model: the two should agree bit for "
        f"bit (search_policy(..., compile_once=False) avoids the switch).",
        UserWarning, stacklevel=3)
  return metrics, passed


def _report(policy: Policy, metrics, ref: harness.Reference, target: str,
            mode: str, metric: str, tolerance: float,
            tensor_cores: str | None = None,
            logits: bool = False) -> DivergenceReport:
  layers = tuple(
      LayerResult(name=n, shape=tuple(s), dtype=d, metrics={"policy": m})
      for n, s, d, m in zip(ref.names, ref.shapes, ref.dtypes, metrics))
  return DivergenceReport(
      layers=layers, precisions=("policy",), reference=ref.name, target=target,
      mode=mode, backend=compat.backend_platform(), atol=0.0, rtol=0.0,
      numerics={"policy": str(policy), "(reference)": ref.description},
      notes=(f"searched for {metric} within {tolerance:g} "
             f"{'of the logits' if logits else 'on every layer'}; "
             f"atol = rtol = 0 here, so '!' marks any difference",),
      chip=tensor_cores)
