"""Check reports: :class:`DivergenceReport`, its layers and findings, and its JSON.

:class:`DivergenceReport` is what :func:`jaxprec.check` returns. It is a
frozen dataclass holding plain Python values (no arrays), so it can be kept,
compared and serialised. Rendering (tables, Markdown, plots) lives in
:mod:`jaxprec._src.checker.render`, the training report in
:mod:`jaxprec._src.checker.training_report`.

JSON schema 1 (``DivergenceReport.to_dict()``; keys beyond these may be added
in later versions of schema 1, never removed or changed)::

  {"schema": 1, "kind": "check",
   "reference": "float32",           # or "float64", "file:<path>", "pytree"
   "target": "tpu", "mode": "emulate", "backend": "cpu",
   "precisions": ["bfloat16", ...],   # row labels, as the user wrote them
   "floor": "float32" | null,         # the framework-floor row, if any
   "numerics": {"bfloat16": "bf16x1 (emulated)", ...},
   "atol": 1e-3, "rtol": 1e-3,
   "layers": [{"name": "hidden_states[3]", "shape": [1, 49, 64],
               "dtype": "float32", "size": 3136,
               "reference": {"rms": ..., "max_abs": ..., "nan": 0, "inf": 0},
               "metrics": {"bfloat16": {"max_abs", "max_rel", "rel_rms",
                                        "cosine", "sqnr_db", "ulp_median",
                                        "ulp_max", "frac_outside", "nan",
                                        "inf", "required_atol"}, ...}}, ...],
   "summary": {"bfloat16": {"first_divergence": "hidden_states[0]" | null,
                            "first_divergence_index": 0 | null,
                            "required_atol": ..., "worst_layer": ...,
                            "worst_rel_rms": ..., "growth_per_layer": ...}},
   "notes": [...], "seconds": {"reference": ..., "bfloat16": ...},
   "kernel": {"setting": "auto", "source": "default",
              "bf16_units": ["avx512_bf16"],   # null off CPU or when set
              "per_algorithm": {"bf16x3": "bf16", ...}}}

``"floor"`` was added within schema 1: files without it read as ``null``.
``"kernel"``, the emulation kernel in force when the check ran (its two
kernels sum long contractions in different orders, so two reports compare
bit for bit only under the same kernel), was added within schema 1: files
without it read as ``{}``.
Non-finite numbers are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (JSON has no literal for them); :meth:`DivergenceReport.from_dict`
reads them back. Every other number is a JSON number.

The framework floor. With an external reference (another framework's
outputs), :func:`jaxprec.check` adds a ``float32`` row: JAX's float32 against
that reference, the two frameworks' own disagreement, below which no precision
can go. ``DivergenceReport.floor`` names that row. It is marked in every
rendering, and it is not a candidate precision: the queries that span all
precisions (:meth:`~DivergenceReport.first_divergence`,
:meth:`~DivergenceReport.passes`, :meth:`~DivergenceReport.worst` with
``precision=None``) and the default ``precision`` of the others skip it; name
it explicitly (``precision='float32'``) to query it. :meth:`summary` keeps it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

from jaxprec._src.checker import metrics as metrics_lib
from jaxprec._src.checker import render
from jaxprec._src.checker.metrics import LayerMetrics
from jaxprec._src.core import names

SCHEMA = 1


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
class DivergenceReport:
  """How far each layer drifts from a reference at each precision.

  Returned by :func:`jaxprec.check` and :func:`jaxprec.check_module`.
  ``str(report)`` is a table (drawn with ``rich`` when it is installed);
  :meth:`to_json` follows the versioned schema in this module's docstring.

  Attributes:
    layers: one :class:`LayerResult` per layer, in depth order.
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
      in every rendering and is not a candidate precision (see the module
      docstring).
    kernel: the emulation kernel in force when the check ran
      (:meth:`jaxprec.KernelChoice.to_dict`), or ``{}``.
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
    """The first layer (in depth order) outside ``atol + rtol * |ref|``.

    A layer diverges when some element has ``|err| > atol + rtol * |ref|``
    (NumPy's ``allclose`` test) or a non-finite value the reference does not
    have. The answer is exact for any ``atol`` when ``rtol`` is the check's
    or 0. For another ``rtol`` it is decided from bounds on the atol each
    layer needs: a layer that may or may not pass is reported (so the answer
    can be early, never late), with ``Finding.exact = False``; run the check
    at that ``rtol`` for an exact answer.

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
      for i, l in enumerate(self.layers):
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
    vals = [self._required(l.metrics[p], rtol)[1] for l in self.layers]
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
      :class:`Finding` objects, worst first; NaN values rank worst.

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
      for i, v in enumerate(self.metric(metric, p)):
        rows.append(Finding(precision=p, layer=self.layers[i].name, index=i,
                            metric=metric, value=float(v)))

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
  def to_dict(self) -> dict[str, Any]:
    """The report as JSON-safe values (schema in the module docstring)."""
    from jaxprec._src.core.version import __version__
    layers = []
    for l in self.layers:
      first = l.metrics[self.precisions[0]] if self.precisions else None
      layers.append({
          "name": l.name, "shape": list(l.shape), "dtype": l.dtype,
          "size": first.size if first else 0,
          "reference": {"rms": first.ref_rms, "max_abs": first.ref_max_abs,
                        "nan": first.ref_nan, "inf": first.ref_inf}
                       if first else {},
          "metrics": {p: l.metrics[p].to_dict() for p in self.precisions},
      })
    return render.encode({
        "schema": SCHEMA, "kind": "check", "jaxprec_version": __version__,
        "reference": self.reference, "target": self.target, "mode": self.mode,
        "backend": self.backend, "precisions": list(self.precisions),
        "floor": self.floor,
        "numerics": dict(self.numerics), "atol": float(self.atol),
        "rtol": float(self.rtol),
        "layers": layers, "summary": self.summary(), "notes": list(self.notes),
        "seconds": dict(self.seconds), "kernel": dict(self.kernel),
    })

  to_json = render.to_json

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> DivergenceReport:
    """Reads back :meth:`to_dict` (or parsed :meth:`to_json`) output."""
    if d.get("schema") != SCHEMA:
      raise ValueError(f"Unsupported report schema {d.get('schema')!r}; this "
                       f"jaxprec reads schema {SCHEMA}.")
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
            ref_nan=ref.get("nan", 0), ref_inf=ref.get("inf", 0))
      layers.append(LayerResult(name=l["name"], shape=tuple(l["shape"]),
                                dtype=l.get("dtype", ""), metrics=ms))
    return cls(layers=tuple(layers), precisions=tuple(d["precisions"]),
               reference=d["reference"], target=d["target"], mode=d["mode"],
               backend=d.get("backend", ""), atol=d.get("atol", 0.0),
               rtol=d.get("rtol", 0.0),
               numerics=_mapping(d, "numerics"),
               notes=tuple(d.get("notes", ())),
               seconds=_mapping(d, "seconds"), floor=d.get("floor"),
               kernel=_mapping(d, "kernel"))

  @classmethod
  def from_json(cls, text: str) -> DivergenceReport:
    return cls.from_dict(json.loads(text))

  # -- rendering: the functions of jaxprec._src.checker.render ---------------
  to_text = render.text
  __rich__ = render.rich_group
  __str__ = render.to_str
  to_markdown = render.markdown
  plot = render.plot
