"""Rendering for people: numbers, tables (text, rich), Markdown, plots, and
the progress bar of long checks.

The functions here read a :class:`jaxprec.DivergenceReport` (duck-typed: this
module imports no report type, so the report modules can import it) and
return text or a matplotlib figure. The report's methods (``str``,
``to_text``, ``to_markdown``, ``plot``) call them.

It also holds what every report shares: :func:`fmt` and :func:`table` for
tables, :func:`encode` / :func:`decode_float` for JSON, which has no literal
for NaN or infinities, and :func:`save` for figures.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

FLOOR_MARK = "[floor]"


# ---------------------------------------------------------------------------
# Numbers.


def fmt(x: float, digits: int = 2) -> str:
  """A number for a table: ``1.23e-03``, ``0``, ``nan``, ``inf``."""
  if isinstance(x, int):
    return str(x)
  if math.isnan(x):
    return "nan"
  if math.isinf(x):
    return "inf" if x > 0 else "-inf"
  if x == 0:
    return "0"
  return f"{x:.{digits}e}"


def encode(obj: Any) -> Any:
  """``obj`` as JSON allows it: non-finite floats become strings, through
  dicts, lists and tuples."""
  if isinstance(obj, float) and not math.isfinite(obj):
    return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
  if isinstance(obj, Mapping):
    return {k: encode(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [encode(v) for v in obj]
  return obj


def to_json(report: Any, indent: int | None = 2) -> str:
  """``report.to_dict()`` as a JSON string (strict: no NaN or Infinity
  literals)."""
  return json.dumps(report.to_dict(), indent=indent, allow_nan=False)


def decode_float(x: Any) -> Any:
  """The inverse of :func:`encode` for a float (other values pass through)."""
  if isinstance(x, str) and x in ("nan", "inf", "-inf"):
    return float(x)
  return x


def table(cols: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
  """A plain-text table's lines: the header, a rule, the rows; the columns in
  ``left`` aligned left, the others right."""
  widths = [max(len(c), *(len(r[j]) for r in rows)) if rows else len(c)
            for j, c in enumerate(cols)]

  def line(cells):
    return "  ".join(c.ljust(w) if j in left else c.rjust(w)
                     for j, (c, w) in enumerate(zip(cells, widths))).rstrip()
  return [line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]


def figure_class(what: str):
  """matplotlib's ``Figure``; ImportError naming the extra when it is missing."""
  try:
    from matplotlib.figure import Figure
  except ImportError as e:
    from jaxprec._src.core.version import install_hint  # noqa: PLC0415
    raise ImportError(f"jaxprec {what} needs matplotlib: "
                      f"{install_hint('plots')} (or pip install matplotlib)"
                      ) from e
  return Figure


def save(fig: Any, path: str | os.PathLike) -> None:
  """Saves ``fig`` with the names in it drawn as written: a ``$`` in a layer
  or precision name is not a mathtext formula (which failed to parse, after
  the report was written). The names are the x tick labels, the legends, the
  titles and axis labels; the log axis's own tick labels (``10^-3``) keep
  their mathtext. In a multi-process run (``jax.distributed``) process 0
  alone writes the file."""
  from jaxprec._src.jaxpr import compat
  if compat.process_index() != 0:
    return
  texts = [fig._suptitle] if getattr(fig, "_suptitle", None) else []
  for ax in fig.axes:
    texts += [*ax.get_xticklabels(), ax.title, ax.xaxis.label, ax.yaxis.label]
    legend = ax.get_legend()
    if legend is not None:
      texts += legend.get_texts()
  for text in texts:
    text.set_parse_math(False)
  fig.savefig(os.fspath(path), dpi=120)


def _cell(s: str) -> str:
  """A name on one line: control characters written as escapes."""
  return s.replace("\\", "\\\\").replace("\n", "\\n").replace(
      "\r", "\\r").replace("\t", "\\t")


# ---------------------------------------------------------------------------
# DivergenceReport tables.


def _label(report: Any, p: str) -> str:
  return f"{p} {FLOOR_MARK}" if p == report.floor else p


def _heading(report: Any) -> str:
  ref = report.numerics.get("(reference)")
  ref = f" ({ref})" if ref else ""
  what = "; ".join(f"{_label(report, p)}: {report.numerics.get(p, '?')}"
                   for p in report.precisions)
  out = (f"jaxprec.check: {len(report.layers)} layers vs reference "
         f"{report.reference}{ref}; target {report.target}, mode {report.mode} "
         f"(backend {report.backend or '?'})\nnumerics: {what}")
  if report.floor is not None:
    out += (f"\n{FLOOR_MARK} {report.floor!r} is the framework floor: float32 "
            f"against the external reference, the two frameworks' own "
            f"disagreement; no precision can go below it")
  return out


def _columns(report: Any) -> list[str]:
  cols = ["#", "layer", "shape"]
  for p in report.precisions:
    label = _label(report, p)
    cols += [f"{label} max_abs", f"{label} rel_rms"]
  return cols


def _rows(report: Any) -> list[list[str]]:
  rows = []
  for i, l in enumerate(report.layers):
    row = [str(i), _cell(l.name), "x".join(map(str, l.shape)) or "()"]
    for p in report.precisions:
      m = l.metrics[p]
      flag = "" if m.required_atol <= report.atol else " !"
      bad = f" ({m.nan} nan, {m.inf} inf)" if m.nan or m.inf else ""
      row += [fmt(m.max_abs) + flag + bad, fmt(m.rel_rms)]
    rows.append(row)
  return rows


def _summary_lines(report: Any) -> list[str]:
  lines = [f"'!': outside atol={report.atol:g} + rtol={report.rtol:g}*|ref| "
           f"somewhere in the layer"]
  for p, s in report.summary().items():
    first = (f"first divergence {_cell(s['first_divergence'])} "
             f"(#{s['first_divergence_index']})"
             if s["first_divergence"] is not None else "no divergence")
    growth = s["growth_per_layer"]
    g = f"x{growth:.2f} per layer" if math.isfinite(growth) else "n/a"
    worst = s["worst_layer"]
    worst = _cell(worst) if worst is not None else None
    lines.append(f"{_label(report, p)}: {first}; required atol "
                 f"{fmt(s['required_atol'])}; worst {worst} (rel_rms "
                 f"{fmt(s['worst_rel_rms'])}); rel_rms growth {g}")
  lines += [f"note: {_cell(n)}" for n in report.notes]
  unchecked = getattr(report, "unchecked", ())
  if unchecked:
    shown = ", ".join(_cell(n) for n in unchecked[:_SHOWN])
    more = (f" and {len(unchecked) - _SHOWN} more (report.unchecked lists "
            f"them all)" if len(unchecked) > _SHOWN else "")
    lines.append(f"unchecked: {len(unchecked)} layers have no reference and "
                 f"were not compared: {shown}{more}")
  return lines


# Unchecked layers a rendering names (report.unchecked holds them all).
_SHOWN = 8


def text(report: Any) -> str:
  """The table as plain text (what ``str`` gives without ``rich``)."""
  return "\n".join([_heading(report),
                    *table(_columns(report), _rows(report), {1, 2}),
                    *_summary_lines(report)])


def _rich_table(report: Any):
  from rich.table import Table
  from rich.text import Text
  table = Table()
  for j, c in enumerate(_columns(report)):
    if j >= 3:
      p, _, m = c.rpartition(" ")
      c = f"{p}\n{m}"
    # Text, not a string: "[floor]" and names are not rich markup.
    table.add_column(Text(c), justify="left" if j in (1, 2) else "right",
                     no_wrap=True)
  for r in _rows(report):
    table.add_row(*[Text(c, style="bold red") if c.endswith(" !") or " ! " in c
                    else Text(c) for c in r])
  return table


def rich_group(report: Any):
  """The heading, table and summary as a ``rich`` renderable."""
  from rich.console import Group
  from rich.text import Text
  return Group(Text(_heading(report)), _rich_table(report),
               *[Text(s) for s in _summary_lines(report)])


def to_str(report: Any) -> str:
  """The heading, table and summary (``str``): the table drawn with ``rich``
  when installed, else :func:`text`."""
  try:
    from rich.console import Console
  except ImportError:
    return text(report)
  buf = io.StringIO()
  Console(file=buf, width=1000, color_system=None, force_terminal=False,
          legacy_windows=False).print(_rich_table(report))
  table = "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
  return "\n".join([_heading(report), table, *_summary_lines(report)])


def markdown(report: Any) -> str:
  """The table and summary as GitHub-flavoured Markdown (``to_markdown``).

  Layer names are escaped: ``|`` as ``\\|``, a backslash doubled, and line
  breaks, tabs and carriage returns shown as ``\\n``, ``\\t``, ``\\r``, so
  that every layer stays one row of the table.
  """
  cols, rows = _columns(report), _rows(report)

  def esc(s: str) -> str:  # cells of _rows/_summary_lines are one line already
    return s.replace("\\", "\\\\").replace("|", "\\|")
  heading = [f"**{esc(line)}**" for line in _heading(report).splitlines()]
  out = ["  \n".join(heading), "",
         "| " + " | ".join(esc(c) for c in cols) + " |",
         "|" + "|".join("---:" if j not in (1, 2) else "---"
                        for j in range(len(cols))) + "|"]
  out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
  out.append("")
  out += [f"- {esc(s)}" for s in _summary_lines(report)]
  return "\n".join(out) + "\n"


def plot(report: Any, path: str | os.PathLike | None = None, *,
         metric: str = "rel_rms") -> "matplotlib.figure.Figure":
  """Plots ``metric`` against depth, one line per precision, log scale.

  The framework floor (``report.floor``), when there is one, is a dashed grey
  line labelled ``'<label> (framework floor)'``.

  Args:
    report: the :class:`jaxprec.DivergenceReport` (``self``).
    path: where to save the figure (format from the extension, e.g.
      ``.png``, ``.svg``); None only returns the figure. In a multi-process
      run (``jax.distributed``) process 0 alone saves it; every process
      returns the figure.
    metric: which metric to plot (default ``rel_rms``).

  Returns:
    The ``matplotlib.figure.Figure``.

  Raises:
    ImportError: matplotlib is not installed (the ``plots`` extra).
  """
  Figure = figure_class("DivergenceReport.plot")
  fig = Figure(figsize=(max(6.0, 0.35 * len(report.layers) + 3), 4.5),
               layout="constrained")
  ax = fig.add_subplot()
  xs = list(range(len(report.layers)))
  for p in report.precisions:
    ys = [v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0
          else float("nan") for v in report.metric(metric, p)]
    if p == report.floor:
      ax.plot(xs, ys, ls="--", color="grey", marker=None,
              label=f"{p} (framework floor)")
    else:
      ax.plot(xs, ys, marker="o",
              label=f"{p} ({report.numerics.get(p, '?')})")
  ax.set_yscale("log")
  ax.set_xticks(xs)
  ax.set_xticklabels([_cell(l.name) for l in report.layers], rotation=60,
                     ha="right", fontsize=7)
  ax.set_xlabel("layer (depth)")
  ax.set_ylabel(metric)
  ax.set_title(f"{metric} vs reference {report.reference} "
               f"(target {report.target}, {report.mode})", fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  if report.precisions:
    ax.legend(fontsize=8)
  if path is not None:
    save(fig, path)
  return fig


# ---------------------------------------------------------------------------
# Progress.


class Progress:
  """A progress bar on stderr, shown only when ``enabled`` and stderr is a
  terminal; a context manager.

  Uses ``rich`` when installed, else one rewritten line.
  """

  def __init__(self, total: int, description: str, enabled: bool = True):
    self.total = total
    self.description = description
    try:
      self.enabled = enabled and bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
      self.enabled = False
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
