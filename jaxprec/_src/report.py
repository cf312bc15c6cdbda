"""Divergence reports: tables, JSON, Markdown and plots.

:class:`DivergenceReport` is what :func:`jaxprec.check` returns and
:class:`TrainingReport` what :func:`jaxprec.check_training` returns. Both are
frozen dataclasses holding plain Python values (no arrays), so they can be
kept, compared and serialised.

JSON schema 1 (``DivergenceReport.to_dict()``; keys beyond these may be added
in later versions of schema 1, never removed or changed)::

  {"schema": 1, "kind": "check",
   "reference": "float32",           # or "float64", "file:<path>", "pytree"
   "target": "tpu", "mode": "emulate", "backend": "cpu",
   "precisions": ["bfloat16", ...],   # row labels, as the user wrote them
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
   "notes": [...], "seconds": {"reference": ..., "bfloat16": ...}}

Non-finite numbers are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (JSON has no literal for them); :meth:`DivergenceReport.from_dict`
reads them back. Every other number is a JSON number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from jaxprec._src import metrics as metrics_lib
from jaxprec._src.metrics import LayerMetrics

__all__ = ["DivergenceReport", "Finding", "LayerResult", "SCHEMA",
           "TrainingReport"]

SCHEMA = 1
_PLOTS_HINT = ("needs matplotlib: pip install 'jaxprec[plots]' (or pip "
               "install matplotlib)")


# ---------------------------------------------------------------------------
# JSON-safe numbers.


def encode_float(x: float) -> float | str:
  """A float as JSON allows it: non-finite values become strings."""
  if isinstance(x, float) and not math.isfinite(x):
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
  return x


def decode_float(x: Any) -> Any:
  if isinstance(x, str) and x in ("nan", "inf", "-inf"):
    return float(x)
  return x


def _encode(obj: Any) -> Any:
  if isinstance(obj, float):
    return encode_float(obj)
  if isinstance(obj, Mapping):
    return {k: _encode(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_encode(v) for v in obj]
  return obj


def _fmt(x: float, digits: int = 2) -> str:
  if isinstance(x, int):
    return str(x)
  if math.isnan(x):
    return "nan"
  if math.isinf(x):
    return "inf" if x > 0 else "-inf"
  if x == 0:
    return "0"
  return f"{x:.{digits}e}"


# ---------------------------------------------------------------------------
# Check reports.


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
            f"{self.metric} {_fmt(self.value)}")


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

  # -- queries ---------------------------------------------------------------
  def __len__(self) -> int:
    return len(self.layers)

  def __iter__(self) -> Iterator[LayerResult]:
    return iter(self.layers)

  def layer(self, name: str) -> LayerResult:
    """The layer called ``name``; KeyError naming close matches otherwise."""
    for l in self.layers:
      if l.name == name:
        return l
    import difflib
    close = difflib.get_close_matches(name, [l.name for l in self.layers], n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise KeyError(f"no layer {name!r} in the report{hint}")

  def metric(self, name: str, precision: str | None = None) -> list[float]:
    """One metric for every layer, in depth order (``precision``: the first
    one when omitted)."""
    p = self._precision(precision)
    if name not in metrics_lib.METRICS and name != "required_atol":
      raise ValueError(f"Unknown metric {name!r}; valid choices: "
                       f"{', '.join(metrics_lib.METRICS)}, required_atol.")
    return [getattr(l.metrics[p], name) for l in self.layers]

  def _precision(self, precision: str | None) -> str:
    if precision is None:
      return self.precisions[0]
    if precision not in self.precisions:
      raise ValueError(f"Unknown precision {precision!r}; this report has "
                       f"{', '.join(map(repr, self.precisions))}.")
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
      atol, rtol: the tolerance (default: the check's).
      precision: one precision label; None for all of them.

    Returns:
      For one precision, a :class:`Finding` (metric ``'required_atol'``: the
      smallest passing ``atol`` of that layer) or None when every layer
      passes; for all precisions, a dict label -> that.

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
    atol = self.atol if atol is None else float(atol)
    rtol = self.rtol if rtol is None else float(rtol)
    labels = self.precisions if precision is None else (self._precision(precision),)
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
    """Whether every layer is within tolerance (at one or all precisions)."""
    found = self.first_divergence(atol, rtol, precision=precision)
    if isinstance(found, dict):
      return all(v is None for v in found.values())
    return found is None

  def required_atol(self, precision: str | None = None,
                    rtol: float | None = None) -> float:
    """The smallest ``atol`` with which every layer passes (at ``rtol``; an
    upper bound for an ``rtol`` other than 0 and the check's)."""
    p = self._precision(precision)
    rtol = self.rtol if rtol is None else float(rtol)
    vals = [self._required(l.metrics[p], rtol)[1] for l in self.layers]
    return max(vals, default=0.0)

  def worst(self, n: int = 5, metric: str = "rel_rms",
            precision: str | None = None) -> list[Finding]:
    """The ``n`` largest values of ``metric`` over layers (and precisions).

    For ``cosine`` and ``sqnr_db``, where smaller is worse, the smallest.

    Args:
      n: how many.
      metric: a metric name (see :mod:`jaxprec._src.metrics`).
      precision: one label, or None for all precisions together.

    Returns:
      :class:`Finding` objects, worst first; NaN values rank worst.
    """
    labels = self.precisions if precision is None else (self._precision(precision),)
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
    from jaxprec import __version__
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
    return _encode({
        "schema": SCHEMA, "kind": "check", "jaxprec_version": __version__,
        "reference": self.reference, "target": self.target, "mode": self.mode,
        "backend": self.backend, "precisions": list(self.precisions),
        "numerics": dict(self.numerics), "atol": float(self.atol),
        "rtol": float(self.rtol),
        "layers": layers, "summary": self.summary(), "notes": list(self.notes),
        "seconds": dict(self.seconds),
    })

  def to_json(self, indent: int | None = 2) -> str:
    """:meth:`to_dict` as a JSON string (strict: no NaN or Infinity literals)."""
    return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

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
        m = {k: decode_float(v) for k, v in m.items()}
        ms[p] = LayerMetrics(
            **{k: m[k] for k in metrics_lib.METRICS},
            required_atol=m.get("required_atol", float("nan")),
            size=l.get("size", 0),
            ref_rms=decode_float(ref.get("rms", 0.0)),
            ref_max_abs=decode_float(ref.get("max_abs", 0.0)),
            ref_nan=ref.get("nan", 0), ref_inf=ref.get("inf", 0))
      layers.append(LayerResult(name=l["name"], shape=tuple(l["shape"]),
                                dtype=l.get("dtype", ""), metrics=ms))
    return cls(layers=tuple(layers), precisions=tuple(d["precisions"]),
               reference=d["reference"], target=d["target"], mode=d["mode"],
               backend=d.get("backend", ""), atol=d.get("atol", 0.0),
               rtol=d.get("rtol", 0.0),
               numerics=dict(d.get("numerics", {})),
               notes=tuple(d.get("notes", ())),
               seconds=dict(d.get("seconds", {})))

  @classmethod
  def from_json(cls, text: str) -> DivergenceReport:
    return cls.from_dict(json.loads(text))

  # -- rendering ---------------------------------------------------------------
  def _heading(self) -> str:
    ref = self.numerics.get("(reference)")
    ref = f" ({ref})" if ref else ""
    what = "; ".join(f"{p}: {self.numerics.get(p, '?')}" for p in self.precisions)
    return (f"jaxprec.check: {len(self.layers)} layers vs reference "
            f"{self.reference}{ref}; target {self.target}, mode {self.mode} "
            f"(backend {self.backend or '?'})\nnumerics: {what}")

  def _columns(self) -> list[str]:
    cols = ["#", "layer", "shape"]
    for p in self.precisions:
      cols += [f"{p} max_abs", f"{p} rel_rms"]
    return cols

  def _rows(self) -> list[list[str]]:
    rows = []
    for i, l in enumerate(self.layers):
      row = [str(i), l.name, "x".join(map(str, l.shape)) or "()"]
      for p in self.precisions:
        m = l.metrics[p]
        flag = "" if m.required_atol <= self.atol else " !"
        bad = ""
        if m.nan or m.inf:
          bad = f" ({m.nan} nan, {m.inf} inf)"
        row += [_fmt(m.max_abs) + flag + bad, _fmt(m.rel_rms)]
      rows.append(row)
    return rows

  def _summary_lines(self) -> list[str]:
    lines = [f"'!': outside atol={self.atol:g} + rtol={self.rtol:g}*|ref| "
             f"somewhere in the layer"]
    for p, s in self.summary().items():
      first = (f"first divergence {s['first_divergence']} "
               f"(#{s['first_divergence_index']})"
               if s["first_divergence"] is not None else "no divergence")
      growth = s["growth_per_layer"]
      g = f"x{growth:.2f} per layer" if math.isfinite(growth) else "n/a"
      lines.append(f"{p}: {first}; required atol {_fmt(s['required_atol'])}; "
                   f"worst {s['worst_layer']} (rel_rms "
                   f"{_fmt(s['worst_rel_rms'])}); rel_rms growth {g}")
    lines += [f"note: {n}" for n in self.notes]
    return lines

  def to_text(self) -> str:
    """The table as plain text (what ``str`` gives without ``rich``)."""
    cols, rows = self._columns(), self._rows()
    widths = [max(len(c), *(len(r[j]) for r in rows)) if rows else len(c)
              for j, c in enumerate(cols)]
    left = {1, 2}

    def line(cells):
      return "  ".join(c.ljust(w) if j in left else c.rjust(w)
                       for j, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [self._heading(), line(cols), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out += self._summary_lines()
    return "\n".join(out)

  def _rich_table(self):
    from rich.table import Table
    from rich.text import Text
    table = Table()
    for j, c in enumerate(self._columns()):
      if j >= 3:
        p, _, m = c.rpartition(" ")
        c = f"{p}\n{m}"
      table.add_column(c, justify="left" if j in (1, 2) else "right",
                       no_wrap=True)
    for r in self._rows():
      table.add_row(*[Text(c, style="bold red") if c.endswith(" !") or " ! " in c
                      else Text(c) for c in r])
    return table

  def __rich__(self):
    from rich.console import Group
    from rich.text import Text
    return Group(Text(self._heading()), self._rich_table(),
                 *[Text(s) for s in self._summary_lines()])

  def __str__(self) -> str:
    try:
      from rich.console import Console
    except ImportError:
      return self.to_text()
    buf = io.StringIO()
    Console(file=buf, width=1000, color_system=None, force_terminal=False,
            legacy_windows=False).print(self._rich_table())
    table = "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
    return "\n".join([self._heading(), table, *self._summary_lines()])

  def to_markdown(self) -> str:
    """The table and summary as GitHub-flavoured Markdown."""
    cols, rows = self._columns(), self._rows()

    def esc(s: str) -> str:
      return s.replace("|", "\\|")
    heading = [f"**{esc(line)}**" for line in self._heading().splitlines()]
    out = ["  \n".join(heading), "",
           "| " + " | ".join(esc(c) for c in cols) + " |",
           "|" + "|".join("---:" if j not in (1, 2) else "---"
                          for j in range(len(cols))) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    out.append("")
    out += [f"- {esc(s)}" for s in self._summary_lines()]
    return "\n".join(out) + "\n"

  def plot(self, path: str | os.PathLike | None = None, *,
           metric: str = "rel_rms") -> "matplotlib.figure.Figure":
    """Plots ``metric`` against depth, one line per precision, log scale.

    Args:
      path: where to save the figure (format from the extension, e.g.
        ``.png``, ``.svg``); None only returns the figure.
      metric: which metric to plot (default ``rel_rms``).

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ImportError: matplotlib is not installed (the ``plots`` extra).
    """
    Figure = _figure_class("DivergenceReport.plot")
    fig = Figure(figsize=(max(6.0, 0.35 * len(self.layers) + 3), 4.5),
                 layout="constrained")
    ax = fig.add_subplot()
    xs = list(range(len(self.layers)))
    for p in self.precisions:
      ys = [v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0
            else float("nan") for v in self.metric(metric, p)]
      ax.plot(xs, ys, marker="o", label=f"{p} ({self.numerics.get(p, '?')})")
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([l.name for l in self.layers], rotation=60, ha="right",
                       fontsize=7)
    ax.set_xlabel("layer (depth)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs reference {self.reference} "
                 f"(target {self.target}, {self.mode})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if self.precisions:
      ax.legend(fontsize=8)
    if path is not None:
      fig.savefig(os.fspath(path), dpi=120)
    return fig


def _figure_class(what: str):
  try:
    from matplotlib.figure import Figure
  except ImportError as e:
    raise ImportError(f"jaxprec {what} {_PLOTS_HINT}") from e
  return Figure


# ---------------------------------------------------------------------------
# Training reports.


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingReport:
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

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe values: ``{"schema": 1, "kind": "training", ...}``, the
    attributes by name; non-finite numbers as strings, as in check reports."""
    return _encode({
        "schema": SCHEMA, "kind": "training", "reference": self.reference,
        "target": self.target, "mode": self.mode, "backend": self.backend,
        "precisions": list(self.precisions), "steps": self.steps,
        "threshold": self.threshold, "numerics": dict(self.numerics),
        "reference_losses": list(self.reference_losses),
        "losses": {p: list(v) for p, v in self.losses.items()},
        "drift": {p: list(v) for p, v in self.drift.items()},
        "divergence_step": dict(self.divergence_step),
        "notes": list(self.notes), "seconds": self.seconds,
    })

  def to_json(self, indent: int | None = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

  def __str__(self) -> str:
    head = (f"jaxprec.check_training: {self.steps} steps vs reference "
            f"{self.reference}; target {self.target}, mode {self.mode} "
            f"(backend {self.backend}); divergence: relative loss difference "
            f"> {self.threshold:g}")
    cols = ["precision", "numerics", "final loss", "max rel loss diff",
            "final drift", "diverged at step"]
    rows = [["(reference) " + self.reference, "",
             _fmt(self.reference_losses[-1], 4) if self.reference_losses else "-",
             "", "", ""]]
    for p in self.precisions:
      losses, ref = self.losses[p], self.reference_losses
      diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref)]
      step = self.divergence_step[p]
      rows.append([p, self.numerics.get(p, ""),
                   _fmt(losses[-1], 4) if losses else "-",
                   _fmt(max(diffs, default=0.0)),
                   _fmt(self.drift[p][-1]) if self.drift[p] else "-",
                   "-" if step is None else str(step)])
    widths = [max(len(c), *(len(r[j]) for r in rows)) for j, c in enumerate(cols)]

    def line(cells):
      return "  ".join(c.ljust(w) if j < 2 else c.rjust(w)
                       for j, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [head, line(cols), line(["-" * w for w in widths])]
    out += [line(r) for r in rows] + [f"note: {n}" for n in self.notes]
    return "\n".join(out)

  def plot(self, path: str | os.PathLike | None = None
           ) -> "matplotlib.figure.Figure":
    """Loss curves (left) and parameter drift (right, log scale) per step.

    Args:
      path: where to save the figure; None only returns it.

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ImportError: matplotlib is not installed (the ``plots`` extra).
    """
    Figure = _figure_class("TrainingReport.plot")
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
      fig.savefig(os.fspath(path), dpi=120)
    return fig


# ---------------------------------------------------------------------------
# Progress on stderr, for the command line.


class Progress:
  """A progress bar on stderr, shown only when stderr is a terminal.

  Uses ``rich`` when installed, else one rewritten line.
  """

  def __init__(self, total: int, description: str, enabled: bool = True):
    self.total = total
    self.description = description
    self.enabled = enabled and _isatty(sys.stderr)
    self._done = 0
    self._rich = None
    self._task = None

  def __enter__(self) -> Progress:
    if not self.enabled:
      return self
    try:
      from rich.console import Console
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RP,
                                 TextColumn, TimeElapsedColumn)
    except ImportError:
      self._line("")
      return self
    self._rich = RP(TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
    self._rich.__enter__()
    self._task = self._rich.add_task(self.description, total=self.total)
    return self

  def update(self, what: str, advance: int = 0) -> None:
    """Shows ``what`` as the current item and advances by ``advance``."""
    if not self.enabled:
      return
    self._done += advance
    if self._rich is not None:
      self._rich.update(self._task, advance=advance,
                        description=f"{self.description}: {what}")
    else:
      self._line(what)

  def _line(self, what: str) -> None:
    sys.stderr.write(f"\r{self.description}: [{self._done}/{self.total}] "
                     f"{what}\033[K")
    sys.stderr.flush()

  def __exit__(self, *exc) -> None:
    if not self.enabled:
      return
    if self._rich is not None:
      self._rich.__exit__(*exc)
    else:
      sys.stderr.write("\r\033[K")
      sys.stderr.flush()


def _isatty(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):
    return False


@contextlib.contextmanager
def maybe_progress(total: int, description: str, enabled: bool):
  with Progress(total, description, enabled) as p:
    yield p
