"""Reports: :class:`DivergenceReport` (with its layers and findings) and
:class:`TrainingReport`, and their JSON.

:class:`DivergenceReport` is what :func:`jaxprec.check` returns. It is a
frozen dataclass holding plain Python values (no arrays), so it can be kept,
compared and serialised. Rendering (tables, Markdown, plots) lives in
:mod:`jaxprec._src.checker.render`. The JSON schema (schema 1: keys may be
added, never removed or changed) is documented in ``docs/checker.md``
("JSON schema 1"), with the framework floor (``DivergenceReport.floor``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jaxprec._src.checker import metrics as metrics_lib
from jaxprec._src.checker import render
from jaxprec._src.checker.logits import LogitsGates
from jaxprec._src.checker.metrics import LayerMetrics
from jaxprec._src.core import names

SCHEMA = render.SCHEMA
# The schemas from_dict reads: 2 holds the keys of 1.
_READS = (1, 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerResult:
  """One layer (floating leaf of the checked output) of a report.

  Attributes:
    name: the leaf's pytree path, e.g. ``'hidden_states[3]'``, or the module
      path for :func:`jaxprec.check_module`.
    shape, dtype: of the layer's output.
    metrics: precision label -> :class:`LayerMetrics`.
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  metrics: Mapping[str, LayerMetrics]

  @property
  def empty(self) -> bool:
    """Whether the layer has no elements (a dimension of size 0): it compares
    nothing, so no query of the report names it."""
    return math.prod(self.shape) == 0 and not any(
        m.size for m in self.metrics.values())


def empty_notes(layers: Sequence[LayerResult]) -> list[str]:
  """The note of a check report naming its empty layers (none: no note)."""
  return render.empty_notes(
      [(l.name, l.shape) for l in layers if l.empty],
      "no error is counted there, and worst(), first_divergence(), "
      "required_atol() and the summary skip such a layer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
  """A layer picked out of a report by :meth:`DivergenceReport.first_divergence`
  or :meth:`DivergenceReport.worst`.

  Attributes:
    precision: the precision label.
    layer: the layer's name.
    index: its position (depth) in the report, from 0.
    metric: the metric the value is of.
    value: the metric's value.
    exact: False when :meth:`DivergenceReport.first_divergence` decided with
      bounds (an ``rtol`` other than 0 and the check's); see there.
  """

  precision: str
  layer: str
  index: int
  metric: str
  value: float
  exact: bool = True

  def __str__(self) -> str:
    return (f"{self.layer} (#{self.index}) at {self.precision}: "
            f"{self.metric} {render.fmt(self.value)}")


def _mapping(d: Mapping[str, Any], key: str) -> dict[str, Any]:
  """``d[key]`` of a report file, an object (``{}`` when absent or null)."""
  value = d.get(key)
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    raise ValueError(f"report field {key!r} must be an object ({{name: "
                     f"value}}); got {value!r} ({type(value).__name__})")
  return dict(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DivergenceReport(render.Report):
  """How far each layer drifts from a reference at each precision.

  Returned by :func:`jaxprec.check` and :func:`jaxprec.check_module`.
  ``str(report)`` is a table (boxed, as ``rich`` draws one, when ``rich``
  is installed); :meth:`to_json` follows the versioned schema of
  ``docs/checker.md``.

  Attributes:
    layers: one :class:`LayerResult` per layer, in depth order. A layer
      without elements compares nothing: its figures read as no error, no
      query names it, its table cell reads ``empty`` and a note names it.
    precisions: the precision labels, as passed to ``check``.
    reference: ``'float32'``, ``'float64'``, another precision name,
      ``'file:<path>'`` or ``'pytree'``.
    target: ``'tpu'`` or ``'gpu'``: whose numerics the rows show.
    mode: ``'emulate'`` or ``'native'`` (what ``mode='auto'`` chose).
    backend: the JAX backend the check ran on.
    atol, rtol: the tolerance of the check (``frac_outside``,
      ``required_atol`` and the defaults of :meth:`first_divergence`).
    numerics: precision label -> what ran, e.g. ``'bf16x3 (emulated)'``.
    notes: remarks worth reading (e.g. how a name was interpreted).
    seconds: wall time of each run, compilation included.
    floor: the label of the framework-floor row (float32 against an external
      reference: the two frameworks' own disagreement), or None. It is marked
      in every rendering and is not a candidate precision: the queries over
      all precisions and the default ``precision`` skip it (name it to query
      it); :meth:`summary` keeps it.
    kernel: the emulation kernel in force when the check ran
      (:meth:`jaxprec.KernelChoice.to_dict`), or ``{}``.
    unchecked: the output layers an external reference has no values for
      (:func:`jaxprec.check_module` takes a partial reference), in depth
      order: not compared, so no query says anything about them; every
      rendering names them.
    chip: the NVIDIA chip whose tensor cores computed the rows emulated
      with GPU numerics (``check(..., chip=)``), or None: the algorithm's
      definition.
    logits_layer: the layer whose logits gates the report holds
      (``check(..., logits=)``), or None.
    logits: precision label -> the :class:`jaxprec.torch.LogitsGates` of that
      row's logits against the reference's, or None where they hold NaN or
      infinity; ``{}`` without ``logits_layer``.
  """

  layers: tuple[LayerResult, ...]
  precisions: tuple[str, ...]
  reference: str
  target: str
  mode: str
  backend: str = ""
  atol: float = 0.0
  rtol: float = 0.0
  numerics: Mapping[str, str] = dataclasses.field(default_factory=dict)
  notes: tuple[str, ...] = ()
  seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
  floor: str | None = None
  kernel: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  unchecked: tuple[str, ...] = ()
  chip: str | None = None
  # Out of repr: a report without them reads as it did before they were.
  logits_layer: str | None = dataclasses.field(default=None, repr=False)
  logits: Mapping[str, LogitsGates | None] = dataclasses.field(
      default_factory=dict, repr=False)

  def __post_init__(self):
    if self.floor is not None and self.floor not in self.precisions:
      raise names.unknown("floor", self.floor, self.precisions,
                          hint=" (the report's precisions)")

  @property
  def candidates(self) -> tuple[str, ...]:
    """The precision labels under test: :attr:`precisions` but the floor."""
    return tuple(p for p in self.precisions if p != self.floor)

  # -- queries ---------------------------------------------------------------
  def __len__(self) -> int:
    return len(self.layers)

  def __iter__(self) -> Iterator[LayerResult]:
    return iter(self.layers)

  def layer(self, name: str) -> LayerResult:
    """The layer called ``name``; KeyError naming the layers otherwise."""
    by_name = {l.name: l for l in self.layers}
    if name in by_name:
      return by_name[name]
    raise names.unknown("layer", name, by_name, error=KeyError)

  def metric(self, name: str, precision: str | None = None) -> list[float]:
    """One metric for every layer, in depth order (``precision``: the first
    candidate, i.e. not the floor, when omitted)."""
    p = self._precision(precision)
    choices = (*metrics_lib.METRICS, "required_atol")
    if not isinstance(name, str) or name not in choices:
      raise names.unknown("metric", name, choices)
    return [getattr(l.metrics[p], name) for l in self.layers]

  def _precision(self, precision: str | None) -> str:
    if precision is None:
      return (self.candidates or self.precisions)[0]
    if not isinstance(precision, str) or precision not in self.precisions:
      raise names.unknown("precision", precision, self.precisions,
                          hint=" (those of this report)")
    return precision

  def _compared(self) -> Iterator[tuple[int, LayerResult]]:
    """The layers with elements, with their depth: an empty one compares
    nothing, and no query names it."""
    return ((i, l) for i, l in enumerate(self.layers) if not l.empty)

  def _required(self, m: LayerMetrics, rtol: float) -> tuple[float, float]:
    """Bounds ``(low, high)`` on the smallest passing atol at ``rtol``.

    Exact (``low == high``) at ``rtol = 0`` (``max_abs``) and at the check's
    ``rtol`` (``required_atol``). ``need(r) = max_i(|e_i| - r |ref_i|)`` is
    convex and non-increasing in ``r``: between those two points the chord
    bounds it from above and the right point from below; past the check's
    ``rtol`` the reverse, with the chord's extension as the lower bound.
    """
    if rtol == self.rtol:
      return m.required_atol, m.required_atol
    nonfinite = math.isinf(m.required_atol) or math.isnan(m.required_atol)
    if rtol == 0 or nonfinite:
      v = math.inf if nonfinite else m.max_abs
      return v, v
    r0, rc = m.max_abs, m.required_atol
    if self.rtol == 0:  # only one point known
      return max(0.0, r0 - rtol * m.ref_max_abs), r0
    line = r0 + (rc - r0) * rtol / self.rtol
    if rtol < self.rtol:
      return rc, line
    return max(0.0, line), rc

  def first_divergence(self, atol: float | None = None,
                       rtol: float | None = None, *,
                       precision: str | None = None
                       ) -> Finding | None | dict[str, Finding | None]:
    """The first layer (in depth order) outside ``atol + rtol * |ref|``; an
    empty layer (no elements) is never one.

    A layer diverges when some element has ``|err| > atol + rtol * |ref|``
    (NumPy's ``allclose`` test) or a non-finite value the reference does not
    have: the check's one gate, which the table marks ``!`` and states on its
    ``gate:`` line, and ``jaxprec check --atol/--rtol`` exits 1 on; with the
    defaults this names the first layer the table marks. The answer is exact
    for any ``atol`` when ``rtol`` is the check's or 0. For another ``rtol``
    it is decided from bounds on the atol each layer needs: a layer that may
    or may not pass is reported (so the answer can be early, never late), with
    ``Finding.exact = False``; run the check at that ``rtol`` for an exact
    answer.

    Args:
      atol, rtol: the tolerance (default: the check's); non-negative numbers.
      precision: one precision label; None for all candidate precisions (the
        framework floor, if any, is not one; name it to ask about it).

    Returns:
      For one precision, a :class:`Finding` (metric ``'required_atol'``: the
      smallest passing ``atol`` of that layer) or None when every layer
      passes; for all precisions, a dict label -> that.

    Raises:
      TypeError: ``atol`` or ``rtol`` is not a number.
      ValueError: ``atol`` or ``rtol`` is negative or NaN, or ``precision``
        is not one of the report's.

    Examples:
      >>> import jax.numpy as jnp, jaxprec
      >>> def f(x):
      ...   return {"first": x * 2, "second": (x * 2) @ x}
      >>> x = jnp.linspace(-1, 1, 64, dtype=jnp.float32).reshape(8, 8)
      >>> r = jaxprec.check(f, x, precisions=["bfloat16"], mode="emulate")
      >>> r.first_divergence(1e-4, 0)["bfloat16"].layer
      'second'
      >>> print(r.first_divergence(10.0, 0, precision="bfloat16"))
      None
    """
    check = metrics_lib.check_tolerance
    atol = self.atol if atol is None else check("atol", atol)
    rtol = self.rtol if rtol is None else check("rtol", rtol)
    labels = self.candidates if precision is None else (self._precision(precision),)
    found: dict[str, Finding | None] = {}
    for p in labels:
      found[p] = None
      for i, l in self._compared():
        low, high = self._required(l.metrics[p], rtol)
        if not high <= atol:
          found[p] = Finding(precision=p, layer=l.name, index=i,
                             metric="required_atol", value=high,
                             exact=low == high or low > atol)
          break
    return found if precision is None else found[labels[0]]

  def passes(self, atol: float | None = None, rtol: float | None = None, *,
             precision: str | None = None) -> bool:
    """Whether every layer is within tolerance (at one precision, or at all
    candidate precisions: the framework floor is not one)."""
    found = self.first_divergence(atol, rtol, precision=precision)
    if isinstance(found, dict):
      return all(v is None for v in found.values())
    return found is None

  def required_atol(self, precision: str | None = None,
                    rtol: float | None = None) -> float:
    """The smallest ``atol`` with which every layer passes (at ``rtol``; an
    upper bound for an ``rtol`` other than 0 and the check's)."""
    p = self._precision(precision)
    rtol = self.rtol if rtol is None else metrics_lib.check_tolerance("rtol", rtol)
    vals = [self._required(l.metrics[p], rtol)[1] for _, l in self._compared()]
    return max(vals, default=0.0)

  def worst(self, n: int = 5, metric: str = "rel_rms",
            precision: str | None = None) -> list[Finding]:
    """The ``n`` largest values of ``metric`` over layers (and precisions).

    For ``cosine`` and ``sqnr_db``, where smaller is worse, the smallest.

    Args:
      n: how many (a non-negative integer).
      metric: a metric name (see :mod:`jaxprec._src.checker.metrics`).
      precision: one label, or None for all candidate precisions together
        (not the framework floor).

    Returns:
      :class:`Finding` objects, worst first; NaN values rank worst. An empty
      layer (no elements) is none of them.

    Raises:
      TypeError: ``n`` is not an integer.
      ValueError: ``n`` is negative, or ``metric`` or ``precision`` unknown.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
      raise TypeError(f"n must be a non-negative integer (how many layers), "
                      f"e.g. n=5; got {n!r} of type {type(n).__name__}")
    if n < 0:
      raise ValueError(f"n must be a non-negative integer (how many layers), "
                       f"e.g. n=5; got {n!r}")
    labels = self.candidates if precision is None else (self._precision(precision),)
    lower_is_worse = metric in ("cosine", "sqnr_db")
    rows = []
    for p in labels:
      values = self.metric(metric, p)
      for i, l in self._compared():
        rows.append(Finding(precision=p, layer=l.name, index=i,
                            metric=metric, value=float(values[i])))

    def key(f: Finding):
      v = f.value
      if math.isnan(v):
        return (0, 0.0, f.index)
      return (1, v if lower_is_worse else -v, f.index)
    return sorted(rows, key=key)[:n]

  def summary(self) -> dict[str, dict[str, Any]]:
    """Per precision: first divergence, required atol, worst layer, growth."""
    out = {}
    for p in self.precisions:
      first = self.first_divergence(precision=p)
      worst = self.worst(1, "rel_rms", p)
      out[p] = {
          "first_divergence": first.layer if first else None,
          "first_divergence_index": first.index if first else None,
          "required_atol": self.required_atol(p),
          "worst_layer": worst[0].layer if worst else None,
          "worst_rel_rms": worst[0].value if worst else float("nan"),
          "growth_per_layer": metrics_lib.growth_per_layer(
              self.metric("rel_rms", p)),
      }
    return out

  # -- serialisation -----------------------------------------------------------
  KIND = "check"

  def _fields(self) -> dict[str, Any]:
    layers = []
    for l in self.layers:
      first = l.metrics[self.precisions[0]] if self.precisions else None
      layers.append({
          "name": l.name, "shape": list(l.shape), "dtype": l.dtype,
          "size": first.size if first else 0,
          "reference": {"rms": first.ref_rms, "max_abs": first.ref_max_abs,
                        "nan": first.ref_nan, "inf": first.ref_inf,
                        "overflow": first.ref_overflow}
                       if first else {},
          "metrics": {p: l.metrics[p].to_dict() for p in self.precisions},
      })
    extra = {} if self.logits_layer is None else {
        "logits_layer": self.logits_layer,
        "logits": {p: None if g is None else g.to_dict()
                   for p, g in self.logits.items()}}
    return {
        "reference": self.reference, "target": self.target, "mode": self.mode,
        "chip": self.chip,
        "backend": self.backend, "precisions": list(self.precisions),
        "floor": self.floor,
        "numerics": dict(self.numerics), "atol": float(self.atol),
        "rtol": float(self.rtol),
        "layers": layers, "summary": self.summary(), "notes": list(self.notes),
        "seconds": dict(self.seconds), "kernel": dict(self.kernel),
        "unchecked": list(self.unchecked), **extra,
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> DivergenceReport:
    """Reads back :meth:`to_dict` (or parsed :meth:`to_json`) output."""
    if not isinstance(d, Mapping):
      raise ValueError(f"DivergenceReport reads a check report, a JSON "
                       f"object; got a {type(d).__name__}")
    # A schema 1 report may lack its kind (a check's); schema 2 names it.
    kind = d.get("kind", "check" if d.get("schema") == 1 else None)
    if d.get("schema") not in _READS or kind != "check":
      raise ValueError(
          f"Unsupported report: schema {d.get('schema')!r}, kind "
          f"{kind!r}; DivergenceReport reads a check report of "
          f"schema {' or '.join(map(str, _READS))}.")
    missing = [k for k in ("layers", "precisions", "reference", "target",
                           "mode") if k not in d]
    if missing:
      raise ValueError(f"the check report lacks {', '.join(map(repr, missing))}")
    layers = []
    for l in d["layers"]:
      ref = l.get("reference", {})
      ms = {}
      for p, m in l["metrics"].items():
        m = {k: render.decode_float(v) for k, v in m.items()}
        ms[p] = LayerMetrics(
            **{k: m[k] for k in metrics_lib.METRICS},
            required_atol=m.get("required_atol", float("nan")),
            size=l.get("size", 0),
            ref_rms=render.decode_float(ref.get("rms", 0.0)),
            ref_max_abs=render.decode_float(ref.get("max_abs", 0.0)),
            ref_nan=ref.get("nan", 0), ref_inf=ref.get("inf", 0),
            ref_overflow=ref.get("overflow", 0))
      layers.append(LayerResult(name=l["name"], shape=tuple(l["shape"]),
                                dtype=l.get("dtype", ""), metrics=ms))
    return cls(layers=tuple(layers), precisions=tuple(d["precisions"]),
               reference=d["reference"], target=d["target"], mode=d["mode"],
               backend=d.get("backend", ""), atol=d.get("atol", 0.0),
               rtol=d.get("rtol", 0.0),
               numerics=_mapping(d, "numerics"),
               notes=tuple(d.get("notes", ())),
               seconds=_mapping(d, "seconds"), floor=d.get("floor"),
               kernel=_mapping(d, "kernel"),
               unchecked=tuple(d.get("unchecked", ())), chip=d.get("chip"),
               logits_layer=d.get("logits_layer"),
               logits={p: None if g is None else LogitsGates(
                   **{k: render.decode_float(v) for k, v in g.items()})
                       for p, g in _mapping(d, "logits").items()})

  @classmethod
  def from_json(cls, text: str) -> DivergenceReport:
    return cls.from_dict(json.loads(text))

  # -- for people: jaxprec._src.checker.render draws the document -----------
  def _document(self, full: bool = False) -> render.Document:
    return render.check_document(self, full)

  def table(self, full: bool = False, width: int | None = None) -> str:
    """The heading, table and summary as text (``str(report)`` is
    ``report.table()``).

    The table has a row per layer and, by default, one column per precision:
    ``req_atol``, the smallest ``atol`` with which the layer passes at the
    check's ``rtol``, marked ``!`` where it is above the check's ``atol``
    (the layer fails; :meth:`first_divergence` names the first). A policy is
    labelled ``P1``, ``P2``, ... with its string on a line under the table;
    a container module whose output is its child's is one row (a line under
    the table names it; the report keeps both). Drawn with ``rich`` when it
    is installed.

    Args:
      full: every metric: ``max_abs``, ``rel_rms`` and ``req_atol`` per
        precision.
      width: the columns to fit in: where the table is wider, a long layer
        name folds in its column (whole, never cut), and where that is not
        enough each layer gets lines of its own. None (default): as wide as
        the table needs, so that a log or a pipe gets every character.
        ``rich.print(report)`` fits the terminal.

    Returns:
      The text, without colour.

    Examples:
      >>> import jax.numpy as jnp, jaxprec
      >>> x = jnp.linspace(-1, 1, 64, dtype=jnp.float32).reshape(8, 8)
      >>> r = jaxprec.check(lambda x: {"y": x @ x}, x, precisions=["bf16"],
      ...                   mode="emulate")
      >>> for line in r.table().splitlines()[3:7]:
      ...   print(line)
      ┃   ┃       ┃       ┃       bf16 ┃
      ┃ # ┃ layer ┃ shape ┃   req_atol ┃
      ┡━━━╇━━━━━━━╇━━━━━━━╇━━━━━━━━━━━━┩
      │ 0 │ y     │ 8x8   │ 7.26e-03 ! │
    """
    return super().table(full, width)

  plot = render.plot


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingReport(render.Report):
  """The same training loop run at several precisions, against a reference.

  Returned by :func:`jaxprec.check_training`.

  Attributes:
    precisions: the precision labels.
    reference: the reference precision name.
    target, mode, backend: as in :class:`DivergenceReport`.
    steps: number of training steps.
    reference_losses: the reference run's loss at each step (before the
      update of that step).
    losses: label -> losses at each step.
    drift: label -> relative L2 distance of the parameters from the
      reference run's after each step: ``||p - p_ref|| / ||p_ref||`` over all
      floating parameter leaves together.
    divergence_step: label -> the first step whose loss differs from the
      reference's by more than ``threshold`` relatively
      (``|l - l_ref| > threshold * max(|l_ref|, 1e-12)``) or is not finite;
      None if none.
    threshold: the relative loss difference that counts as divergence.
    numerics: label -> what ran.
    notes: remarks.
    seconds: wall time of the whole loop, compilation included.
  """

  precisions: tuple[str, ...]
  reference: str
  target: str
  mode: str
  backend: str
  steps: int
  reference_losses: tuple[float, ...]
  losses: Mapping[str, tuple[float, ...]]
  drift: Mapping[str, tuple[float, ...]]
  divergence_step: Mapping[str, int | None]
  threshold: float
  numerics: Mapping[str, str] = dataclasses.field(default_factory=dict)
  notes: tuple[str, ...] = ()
  seconds: float = 0.0

  KIND = "training"

  def _fields(self) -> dict[str, Any]:
    """The attributes by name (:meth:`to_dict`: ``{"schema": 2, "kind":
    "training", ...}``)."""
    return {
        "reference": self.reference,
        "target": self.target, "mode": self.mode, "backend": self.backend,
        "precisions": list(self.precisions), "steps": self.steps,
        "threshold": self.threshold, "numerics": dict(self.numerics),
        "reference_losses": list(self.reference_losses),
        "losses": {p: list(v) for p, v in self.losses.items()},
        "drift": {p: list(v) for p, v in self.drift.items()},
        "divergence_step": dict(self.divergence_step),
        "notes": list(self.notes), "seconds": self.seconds,
    }

  def _document(self, full: bool = False) -> render.Document:
    head = (f"jaxprec.check_training: {self.steps} steps vs reference "
            f"{self.reference}; target {self.target}, mode {self.mode} "
            f"(backend {self.backend}); divergence: relative loss difference "
            f"> {self.threshold:g}")
    cols = ["precision", "numerics", "final loss", "max rel loss diff",
            "final drift", "diverged at step"]
    rows = [["(reference) " + self.reference, "",
             render.fmt(self.reference_losses[-1], 4) if self.reference_losses else "-",
             "", "", ""]]
    for p in self.precisions:
      losses, ref = self.losses[p], self.reference_losses
      diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref)]
      step = self.divergence_step[p]
      rows.append([p, self.numerics.get(p, ""),
                   render.fmt(losses[-1], 4) if losses else "-",
                   render.fmt(max(diffs, default=0.0)),
                   render.fmt(self.drift[p][-1]) if self.drift[p] else "-",
                   "-" if step is None else str(step)])
    return render.Document(
        heading=(head,),
        parts=(render.Table(cols=tuple(cols), rows=tuple(map(tuple, rows)),
                            left=frozenset({0, 1})),
               *[f"note: {n}" for n in self.notes]))

  def plot(self, path: str | os.PathLike | None = None
           ) -> "matplotlib.figure.Figure":
    """Loss curves (left) and parameter drift (right, log scale) per step.

    Args:
      path: where to save the figure; None only returns it. In a
        multi-process run (``jax.distributed``) process 0 alone saves it.

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ImportError: matplotlib is not installed (the ``plots`` extra).
    """
    Figure = render.figure_class("TrainingReport.plot")
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_loss, ax_drift = fig.subplots(1, 2)
    steps = list(range(self.steps))
    ax_loss.plot(steps, self.reference_losses, color="black", lw=2,
                 label=f"reference {self.reference}")
    for p in self.precisions:
      ax_loss.plot(steps, self.losses[p], label=p)
      ys = [v if math.isfinite(v) and v > 0 else float("nan") for v in self.drift[p]]
      ax_drift.plot(steps, ys, label=p)
      if self.divergence_step[p] is not None:
        ax_loss.axvline(self.divergence_step[p], ls=":", alpha=0.5)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=8)
    ax_drift.set_yscale("log")
    ax_drift.set_xlabel("step")
    ax_drift.set_ylabel("||p - p_ref|| / ||p_ref||")
    ax_drift.legend(fontsize=8)
    for ax in (ax_loss, ax_drift):
      ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"training at each precision vs {self.reference} "
                 f"(target {self.target}, {self.mode})", fontsize=10)
    if path is not None:
      render.save(fig, path)
    return fig
