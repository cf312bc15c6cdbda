"""Rendering for people: numbers, tables (text, rich), Markdown, plots, and
the progress bar of long checks.

The functions here read a :class:`jaxprec.DivergenceReport` (duck-typed: this
module imports no report type, so the report modules can import it) and
return text or a matplotlib figure. The report's methods (``str``,
``to_text``, ``to_markdown``, ``plot``) call them.

It also holds what every report shares: :class:`Report` (the JSON envelope
of every report, ``schema``, ``kind`` and ``jaxprec_version``), :func:`fmt`,
:func:`table` and :func:`markdown_table` for tables, :func:`encode` /
:func:`decode_float` for JSON, which has no literal for NaN or infinities,
and :func:`save` for figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

FLOOR_MARK = "[floor]"

# The JSON schema of every report (docs/checker.md, "JSON schema"). 2: every
# report opens with schema, kind (which report) and jaxprec_version; a port
# check's program kind moved from "kind" to "program". A check report of
# schema 2 holds the keys of schema 1, which readers still read.
SCHEMA = 2


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


def at_least(x: float) -> str:
  """``x`` (finite, >= 0) rounded up to 3 significant digits: a tolerance
  printed for the user to paste, which must pass where ``x`` does.

  Examples:
    >>> at_least(0.0034421682), at_least(0.00345), at_least(0.0)
    ('0.00345', '0.00345', '0')
  """
  if x <= 0:
    return f"{x:g}"
  text = f"{x:.3g}"
  if float(text) < x:  # rounded down: the next 3-digit value up
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    text = f"{(math.floor(x / step) + 1) * step:.3g}"
  return text


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


class Report:
  """What every report of jaxprec is, whichever comparison made it.

  :meth:`to_dict` is the report as JSON allows: ``{"schema": SCHEMA, "kind":
  KIND, "jaxprec_version": ..., **fields}``, non-finite numbers as the
  strings ``"nan"``, ``"inf"``, ``"-inf"``; :meth:`to_json` writes it as
  strict JSON (the same report, the same bytes). A report sets ``KIND`` and
  writes ``_fields`` (its own keys); its text is ``str(report)``.
  """

  KIND: ClassVar[str] = ""

  def _fields(self) -> dict[str, Any]:
    raise NotImplementedError

  def to_dict(self) -> dict[str, Any]:
    """The report as JSON-safe values (schema: ``docs/checker.md``)."""
    from jaxprec._src.core.version import __version__  # noqa: PLC0415
    return encode({"schema": SCHEMA, "kind": self.KIND,
                   "jaxprec_version": __version__, **self._fields()})

  def to_json(self, indent: int | None = 2) -> str:
    """:meth:`to_dict` as strict JSON (no ``NaN`` or ``Infinity`` literal)."""
    return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

  # -- for people: one document, one renderer --------------------------------
  def _document(self, full: bool = False) -> Document:
    raise NotImplementedError

  def table(self, full: bool = False, width: int | None = None) -> str:
    """The report as text, its tables in boxes as ``rich`` draws them when
    ``rich`` is installed (``str(report)`` is ``report.table()``).

    Args:
      full: everything: every figure of every row, every unpaired layer.
      width: the columns to fit in: a table wider than that folds its names
        in their column (whole, never cut) and, where that is not enough,
        gives each row lines of its own. None (default): as wide as the
        report needs, so that a log or a pipe gets every character;
        ``rich.print(report)`` fits the terminal.

    Returns:
      The text, without colour.

    Raises:
      TypeError, ValueError: ``width`` is not None or an int >= 1.
    """
    return to_str(self._document(full), width)

  def to_text(self, full: bool = False, width: int | None = None) -> str:
    """The report as plain text (no ``rich``), as :meth:`table` fits it."""
    return text(self._document(full), width)

  def to_markdown(self, full: bool = False) -> str:
    """The report as GitHub-flavoured Markdown: its tables as Markdown
    tables (a name stays one row: ``|`` escaped, line breaks shown as
    ``\\n``), the lines under them as a list."""
    return markdown(self._document(full))

  def rich(self, full: bool = False) -> Fitted:
    """The report as a ``rich`` renderable that fits the console it is
    printed on: ``rich.print(report.rich(full=True))`` (``rich.print(report)``
    is ``report.rich()``)."""
    return Fitted(self._document(full))

  def __rich__(self) -> Fitted:
    return self.rich()

  def __str__(self) -> str:
    return self.table()


def decode_float(x: Any) -> Any:
  """The inverse of :func:`encode` for a float (other values pass through)."""
  if isinstance(x, str) and x in ("nan", "inf", "-inf"):
    return float(x)
  return x


def columns(text: str) -> int:
  """The columns ``text`` takes on a terminal: a wide character (CJK, most
  emoji; East Asian Width W or F, Unicode Standard Annex #11) takes two, a
  combining mark none."""
  if text.isascii():
    return len(text)
  return sum(0 if unicodedata.combining(c) else
             2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def fitting(text: str, width: int) -> int:
  """How many characters of ``text``, from its start, fit in ``width``
  columns (at least one)."""
  if text.isascii():
    return max(min(width, len(text)), 1)
  used = 0
  for i, c in enumerate(text):
    used += columns(c)
    if used > width:
      return max(i, 1)
  return len(text)


def padded(text: str, width: int, left: bool = True) -> str:
  """``text`` padded with spaces to ``width`` columns, on its right
  (``left``) or on its left."""
  pad = " " * (width - columns(text))
  return text + pad if left else pad + text


def table(cols: list[str], rows: list[list[str]], left: set[int],
          box: bool = False) -> list[str]:
  """A plain-text table's lines: the header (a header with a line break is
  two lines, the last lines aligned), a rule, the rows; the columns in
  ``left`` aligned left, the others right. ``box``: drawn in a box, as
  ``rich`` draws a table."""
  heads = [c.split("\n") for c in cols]
  depth = max(map(len, heads), default=1)
  heads = [[""] * (depth - len(h)) + h for h in heads]
  widths = [max([*map(columns, h), *(columns(r[j]) for r in rows)])
            for j, h in enumerate(heads)]

  def line(cells, bar=""):
    cells = [padded(c, w, j in left)
             for j, (c, w) in enumerate(zip(cells, widths))]
    return (f"{bar} " + f" {bar} ".join(cells) + f" {bar}" if bar
            else "  ".join(cells).rstrip())
  head = [[h[k] for h in heads] for k in range(depth)]
  if not box:
    return ([line(h) for h in head] + [line(["-" * w for w in widths])]
            + [line(r) for r in rows])

  def rule(a, b, c, fill):
    return a + b.join(fill * (w + 2) for w in widths) + c
  return ([rule("┏", "┳", "┓", "━"), *(line(h, "┃") for h in head),
           rule("┡", "╇", "┩", "━"), *(line(r, "│") for r in rows),
           rule("└", "┴", "┘", "─")])


# What Markdown would read as formatting in a cell (CommonMark): emphasis
# ('*'; '_' except between two letters or digits, where it never is), code,
# an HTML tag or entity, strikethrough, a link's '](', a column's '|'.
_MARKDOWN = re.compile(r"[|*`<&~]|\](?=\()|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def markdown_cell(text: str) -> str:
  """``text`` as one cell of a Markdown table, shown as written: line breaks,
  tabs and carriage returns as ``\\n``, ``\\t``, ``\\r``, a backslash
  doubled, and what Markdown would read as formatting (``|``, emphasis, code,
  links, HTML, entities, strikethrough) escaped by a backslash (CommonMark,
  "Backslash escapes")."""
  return _MARKDOWN.sub(lambda m: "\\" + m.group(), escaped(text))


def markdown_table(cols: list[str], rows: list[list[str]],
                   left: set[int]) -> list[str]:
  """A GitHub-flavoured Markdown table's lines, the columns in ``left``
  aligned left, the others right; every cell through
  :func:`markdown_cell`."""
  def line(cells):
    return "| " + " | ".join(markdown_cell(c) for c in cells) + " |"
  return [line(cols), "|" + "|".join("---" if j in left else "---:"
                                     for j in range(len(cols))) + "|",
          *map(line, rows)]


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


def escaped(s: str) -> str:
  """A name on one line, as Python writes it: a backslash doubled, ``\\n``,
  ``\\r``, ``\\t``, and any other control character (an escape sequence
  would reach the terminal) as ``\\xNN``."""
  s = s.replace("\\", "\\\\").replace("\n", "\\n").replace(
      "\r", "\\r").replace("\t", "\\t")
  return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}",
                s)


def fold(line: str, width: int, indent: str = "") -> list[str]:
  """``line`` folded onto lines of at most ``width`` characters, the later
  ones starting with ``indent``: at spaces, and a word longer than a line (a
  policy string, a module path) after a ``,`` or ``/`` in it, so that a
  token (a word, a policy entry, a path segment) is split only where it is
  longer than a line by itself.

  Examples:
    >>> fold("P1: default=bfloat16,encoder/layers/0=float32", 30, "  ")
    ['P1: default=bfloat16,', '  encoder/layers/0=float32']
    >>> fold("worst encoder/layers/0/attention/output_dense (#0)", 30)
    ['worst encoder/layers/0/', 'attention/output_dense (#0)']
  """
  indent = indent[:max(width - 1, 0)]  # a page narrower than the indent
  room = max(width - len(indent), 1)
  pieces = []
  for word in re.split(r"(?<= )", line):
    if columns(word.rstrip()) <= room:
      pieces.append(word)
      continue
    for entry in re.split(r"(?<=,)", word):  # policy entries first
      parts = ([entry] if columns(entry.rstrip()) <= room
               else re.split(r"(?<=/)", entry))  # then path segments
      for part in parts:
        while columns(part.rstrip()) > room:  # longer than a line itself
          n = fitting(part, room)
          pieces.append(part[:n])
          part = part[n:]
        pieces.append(part)
  out = [""]
  for piece in pieces:
    if not piece:
      continue
    if columns(out[-1] + piece.rstrip()) > width:
      if out[-1].strip():
        out[-1] = out[-1].rstrip()
        piece = piece.lstrip(" ")  # no indent where a wide character fills
        out.append(indent if columns(indent + piece.rstrip()) <= width
                   else "")
      else:  # a line's indent wider than the page leaves: narrowed
        out[-1] = out[-1][:max(width - columns(piece.rstrip()), 0)]
    out[-1] += piece
  return [l.rstrip() for l in out]


# ---------------------------------------------------------------------------
# DivergenceReport tables.
#
# One table for every rendering: a compact default with one column per row
# of the check (the metric the verdict reads, `req_atol`, and the '!' mark),
# and with `full=True` the max_abs and rel_rms of each row as well. A policy
# row is labelled P1, P2, ... with its string on a legend line; a container
# whose output is its child's is drawn once. Where the table is wider than
# the terminal, each layer gets a line of its own with its cells below
# (`_vertical`); nothing is cut, a name longer than the terminal folds.

# The column of the verdict: the smallest atol with which the layer passes at
# the check's rtol (what '!' compares with atol).
VERDICT = "req_atol"


def plural(n: int, word: str) -> str:
  """``'1 layer'``, ``'2 layers'``."""
  return f"{n} {word}" if n == 1 else f"{n} {word}s"


def empty_notes(layers: Sequence[tuple[str, tuple[int, ...]]],
                then: str) -> list[str]:
  """The note naming the layers without elements (``(name, shape)``; none:
  no note), which compare nothing; ``then``: what the report does with them."""
  if not layers:
    return []
  shown = ", ".join(f"{n!r} {tuple(s)}" for n, s in layers[:_SHOWN]) + (
      f" and {len(layers) - _SHOWN} more" if len(layers) > _SHOWN else "")
  one = len(layers) == 1
  return [f"{shown} {'has' if one else 'have'} no elements and compared "
          f"nothing: {then}"]


def labels(report: Any) -> dict[str, str]:
  """Precision label -> its name in the tables: a policy (a label with
  ``=``) is ``P1``, ``P2``, ... in order, the framework floor is marked."""
  out, k = {}, 0
  for p in report.precisions:
    if "=" in p:
      k += 1
      short = f"P{k}"
    else:
      short = escaped(p)
    out[p] = f"{short} {FLOOR_MARK}" if p == report.floor else short
  return out


def contains(outer: str, inner: str, root: str = "output") -> bool:
  """Whether the layer ``outer`` is a module that holds ``inner`` (a module
  path below it, or any layer for the root's, ``root``: ``'output'``, or
  ``'(root)'`` beside a submodule named ``output``)."""
  if outer == root:
    return inner != root
  return (len(inner) > len(outer) and inner.startswith(outer)
          and inner[len(outer)] in "/[")


def folded(report: Any) -> dict[int, int]:
  """Rows a table leaves out -> the row drawn for them.

  A layer right after a layer it contains (``encoder`` after
  ``encoder/layers_1``, ``encoder[0]`` after ``encoder[0][0]``, the root's
  ``output`` after the last layer) with the same shape and the same figures
  at every precision is the same output, a container returning its child's:
  it is one row of the table, named under it. The report keeps every layer.
  """
  out: dict[int, int] = {}
  ls = report.layers
  root = "(root)" if any(l.name == "(root)" for l in ls) else "output"
  for i in range(1, len(ls)):
    a, b = ls[i - 1], ls[i]
    if (contains(b.name, a.name, root) and a.shape == b.shape
        and dict(a.metrics) == dict(b.metrics)):
      out[i] = out.get(i - 1, i - 1)
  return out


def _heading(report: Any) -> str:
  ref = report.numerics.get("(reference)")
  ref = f" ({ref})" if ref else ""
  short = labels(report)
  what = "; ".join(f"{short[p]}: {report.numerics.get(p, '?')}"
                   for p in report.precisions)
  chip = getattr(report, "chip", None)
  chip = f" ({chip} tensor cores)" if chip else ""
  out = (f"jaxprec.check: {plural(len(report.layers), 'layer')} vs reference "
         f"{report.reference}{ref}; target {report.target}{chip}, mode "
         f"{report.mode} (backend {report.backend or '?'})\nnumerics: {what}")
  if report.floor is not None:
    out += (f"\n{FLOOR_MARK} {report.floor!r} is the framework floor: float32 "
            f"against the external reference, the two frameworks' own "
            f"disagreement; no precision can go below it")
  return out


def _metric_names(full: bool) -> tuple[str, ...]:
  return ("max_abs", "rel_rms", VERDICT) if full else (VERDICT,)


def _header(report: Any, full: bool, precisions) -> list[tuple[str, str]]:
  """The columns' headers, each (top line, bottom line)."""
  short = labels(report)
  cols = [("", "#"), ("", "layer"), ("", "shape")]
  for p in precisions:
    cols += [(short[p], m) for m in _metric_names(full)]
  return cols


def _verdict(report: Any, m: Any) -> str:
  flag = "" if m.required_atol <= report.atol else " !"
  bad = ", ".join(f"{n} {what}" for n, what in ((m.nan, "nan"), (m.inf, "inf"))
                 if n)
  value = fmt(m.required_atol)
  if m.required_atol == 0 and not bad:
    # 0 needs no atol: either no error at all, or every error within
    # rtol * |ref|; the cell says which.
    value = "exact" if m.max_abs == 0 else "in rtol"
  return value + flag + (f" ({bad})" if bad else "")


def _rows(report: Any, full: bool, precisions) -> list[list[str]]:
  rows = []
  skip = folded(report)
  for i, l in enumerate(report.layers):
    if i in skip:
      continue
    row = [str(i), escaped(l.name), "x".join(map(str, l.shape)) or "()"]
    for p in precisions:
      m = l.metrics[p]
      if full:
        row += ["-", "-"] if l.empty else [fmt(m.max_abs), fmt(m.rel_rms)]
      row.append("empty" if l.empty else _verdict(report, m))
    rows.append(row)
  return rows


def tolerance_line(report: Any) -> str:
  """The one tolerance of a check, as every rendering states it."""
  return (f"gate: a layer fails ('!') where an element has |err| > atol + "
          f"rtol*|ref| (atol={report.atol:g}, rtol={report.rtol:g}) or a nan/"
          f"inf the reference has not; {VERDICT}: the smallest atol with which "
          f"it passes at rtol={report.rtol:g} ('exact': no error; 'in rtol': "
          f"0, every error within rtol*|ref|)")


def _legend_lines(report: Any) -> list[str]:
  """What the table's short names stand for: policies, folded rows."""
  short = labels(report)
  lines = [f"{short[p]}: {p}" for p in report.precisions if "=" in p]
  skip = folded(report)
  if skip:
    names = [f"{escaped(report.layers[i].name)} (#{i} = #{j})"
             for i, j in skip.items()]
    more = (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN
            else "")
    lines.append(f"not in the table, the same output as a layer they "
                 f"contain: "
                 f"{', '.join(names[:_SHOWN])}{more}")
  return lines


def _summary_lines(report: Any) -> list[str]:
  lines = [tolerance_line(report), *_legend_lines(report)]
  short = labels(report)
  for p, s in report.summary().items():
    first = (f"first divergence {escaped(s['first_divergence'])} "
             f"(#{s['first_divergence_index']})"
             if s["first_divergence"] is not None else "no divergence")
    growth = s["growth_per_layer"]
    g = f"x{growth:.2f} per layer" if math.isfinite(growth) else "n/a"
    worst = s["worst_layer"]
    worst = escaped(worst) if worst is not None else None
    lines.append(f"{short[p]}: {first}; required atol "
                 f"{fmt(s['required_atol'])}; worst {worst} (rel_rms "
                 f"{fmt(s['worst_rel_rms'])}); rel_rms growth {g}")
  lines += _logits_lines(report)
  lines += [f"note: {escaped(n)}" for n in report.notes]
  unchecked = getattr(report, "unchecked", ())
  if unchecked:
    shown = ", ".join(escaped(n) for n in unchecked[:_SHOWN])
    more = (f" and {len(unchecked) - _SHOWN} more (report.unchecked lists "
            f"them all)" if len(unchecked) > _SHOWN else "")
    lines.append(f"unchecked: {plural(len(unchecked), 'layer')} "
                 f"{'has' if len(unchecked) == 1 else 'have'} no reference "
                 f"and {'was' if len(unchecked) == 1 else 'were'} not "
                 f"compared: {shown}{more}")
  return lines


def _logits_lines(report: Any) -> list[str]:
  """The logits gates of each row (``check(..., logits=)``): a line naming
  the layer, then one line per row."""
  layer = getattr(report, "logits_layer", None)
  if layer is None:
    return []
  short = labels(report)
  gates = report.logits
  n = next((g.positions for g in gates.values() if g is not None), None)
  lines = [f"logits gates of {escaped(layer)}"
           + ("" if n is None else f" ({plural(n, 'position')})")
           + ": KL(ref||row) in nats, dlogp = log p - log p_ref"]
  for p in report.precisions:
    if p not in gates:
      continue
    g = gates[p]
    if g is None:
      lines.append(f"{short[p]}: no logits gates (NaN or infinity)")
      continue
    lines.append(f"{short[p]}: KL mean {fmt(g.kl_mean)} max {fmt(g.kl_max)}; "
                 f"top-1 {g.top1_agreement:.4f}; top-{g.k} "
                 f"{g.topk_overlap:.4f}; max |dlogp| "
                 f"{fmt(g.max_logprob_diff)}")
  return lines


# Names a line under the table lists (the report holds them all).
_SHOWN = 8

# A cell the check marks as failing: its value and the mark, with the
# nan/inf counts ('7.3e-03 ! (2 nan)'); drawn bold red by rich.
_FAILING = r"\S+ !( \([^)]*\))?"


def check_document(report: Any, full: bool = False) -> Document:
  """A :class:`jaxprec.DivergenceReport` as a :class:`Document`: the
  heading, a row per layer (``#``, name, shape, then the verdict's metric
  of each row of the check, with ``full`` max_abs and rel_rms too), the
  tolerance, legend, summary and notes."""
  cols = [f"{a}\n{b}" if a else b
          for a, b in _header(report, full, report.precisions)]
  return Document(
      heading=tuple(_heading(report).splitlines()),
      parts=(Table(cols=tuple(cols),
                   rows=tuple(map(tuple, _rows(report, full,
                                               report.precisions))),
                   left=frozenset({1, 2}), name=1, keys=3, mark=_FAILING,
                   caption=f"{VERDICT}{', with max_abs and rel_rms' if full else ''}"
                           f" per precision"),
             *_summary_lines(report)))


# ---------------------------------------------------------------------------
# One document, every rendering.
#
# A report of any comparison is written once as a Document: heading lines,
# then tables and paragraphs. One renderer draws every Document: plain text
# (as wide as it needs, or fitted to a width: names fold in their column,
# never cut; a table still too wide gives each row lines of its own), rich
# (fitted to the console), and Markdown.


@dataclasses.dataclass(frozen=True)
class Table:
  """A table of a report, as every rendering draws it.

  Attributes:
    cols: the headers; ``'top\\nbottom'`` is a header of two lines, whose
      top line names a group of columns (a row of the comparison).
    rows: the cells, as text. In the ``name`` column a cell's lines (split
      at ``\\n``) flow down into the empty cells of the rows under it.
    left: the columns aligned left; the others are aligned right.
    name: the column of names, which folds (whole, at ``/``, ``.``, ``_``)
      where the table is wider than the page.
    keys: how many columns name a row: where the table is too wide even
      with its names folded, each row is drawn as these on a line, then its
      other cells, grouped by their header's top line.
    caption: what that narrow form says its cells are.
    drop: columns left out before names are folded (the JSON has them).
    mark: a regular expression of the cells to draw in bold red.
  """

  cols: tuple[str, ...]
  rows: tuple[tuple[str, ...], ...]
  left: frozenset[int] = frozenset({0})
  name: int | None = 0
  keys: int = 1
  caption: str = ""
  drop: frozenset[int] = frozenset()
  mark: str | None = None


@dataclasses.dataclass(frozen=True)
class Document:
  """A report for people: ``heading`` lines, then ``parts``, each a
  :class:`Table` or a paragraph (a string: folded in text, an item of a
  list in Markdown)."""

  heading: tuple[str, ...]
  parts: tuple[Table | str, ...] = ()


# The fewest columns a folded name keeps before a table is drawn row by row.
_NAME_ROOM = 16


def _pieces(name: str, width: int) -> list[str]:
  """``name`` in pieces of at most ``width`` characters that join to it, cut
  after a separator (``/``, ``.``, ``_``) where one is in a piece's 2nd
  half."""
  pieces = []
  while columns(name) > width:
    n = fitting(name, width)
    cut = max(name.rfind(c, n // 2, n) for c in "/._") + 1 or n
    pieces.append(name[:cut])
    name = name[cut:]
  return [*pieces, name]


def _flowed(t: Table, room: int | None) -> list[tuple[str, ...]]:
  """The rows as lines of text: the name column's lines (its ``\\n``
  lines, each folded to ``room``) flowed into the empty name cells below,
  then onto lines of their own; another cell's lines each on a line of
  their own."""
  out = []
  for row in _named(t, room):
    cells = [c.split("\n") for c in row]
    out += [tuple(c[i] if i < len(c) else "" for c in cells)
            for i in range(max(map(len, cells), default=1))]
  return out


def _named(t: Table, room: int | None) -> list[tuple[str, ...]]:
  if t.name is None:
    return list(t.rows)
  j, out, pending = t.name, [], []

  def blank(piece):
    return tuple(piece if k == j else "" for k in range(len(t.cols)))
  for row in t.rows:
    if row[j] == "" and pending:
      out.append(row[:j] + (pending.pop(0),) + row[j + 1:])
      continue
    out += [blank(p) for p in pending]
    pending = [p for line in row[j].split("\n")
               for p in (_pieces(line, room) if room else [line])]
    out.append(row[:j] + (pending.pop(0),) + row[j + 1:])
  return out + [blank(p) for p in pending]


def _kept(t: Table, columns: set[int]) -> Table:
  keep = [k for k in range(len(t.cols)) if k not in columns]

  def index(k):
    return None if k is None or k in columns else keep.index(k)
  return dataclasses.replace(
      t, cols=tuple(t.cols[k] for k in keep),
      rows=tuple(tuple(r[k] for k in keep) for r in t.rows),
      left=frozenset(index(k) for k in t.left if k not in columns),
      name=index(t.name), drop=frozenset(),
      keys=sum(k < t.keys for k in keep))


def _table_lines(t: Table, width: int | None) -> list[str]:
  """The table as text: as wide as it needs (``width`` None), else fitted:
  the ``drop`` columns left out, then the names folded, then a row's cells
  on lines of their own."""
  lines = table(list(t.cols), _flowed(t, None), set(t.left))
  if width is None or max(map(columns, lines)) <= width:
    return lines
  if t.drop:
    t = _kept(t, set(t.drop))
    lines = table(list(t.cols), _flowed(t, None), set(t.left))
    if max(map(columns, lines)) <= width:
      return lines
  if t.name is not None:
    head = max(map(columns, t.cols[t.name].split("\n")))
    other = max(map(columns, table(
        list(t.cols), [r[:t.name] + ("",) + r[t.name + 1:]
                       for r in t.rows], set(t.left))))
    room = width - other + head  # the names' column, as wide as it can be
    if room >= max(_NAME_ROOM, head):
      return table(list(t.cols), _flowed(t, room), set(t.left))
  return _vertical(t, width)


def _groups(t: Table) -> list[tuple[str, list[int]]]:
  """The columns after the keys, grouped by their header's top line (a
  header of one line is a group of its own)."""
  out: list[tuple[str, list[int]]] = []
  for k in range(t.keys, len(t.cols)):
    top, _, bottom = t.cols[k].rpartition("\n")
    if top and out and out[-1][0] == top:
      out[-1][1].append(k)
    else:
      out.append((top or bottom, [k]))
  return out


def _vertical(t: Table, width: int) -> list[str]:
  """The table for a narrow page: per row a line with its key cells, then
  its other cells, ``label value`` (a group of several columns: ``label
  name value name value``; an empty group left out), as many to a line as
  ``width`` holds, aligned from row to row, under the first key where that
  fits, else indented by two. A cell of several lines outside the names is
  one line here."""
  rows = _flowed(dataclasses.replace(t, rows=tuple(
      tuple(c if k == t.name else c.replace("\n", " ")
            for k, c in enumerate(r)) for r in t.rows)), None)
  groups = _groups(t)
  cw = {k: max([columns(r[k]) for r in rows], default=1)
        for k in range(t.keys, len(t.cols))}
  lw = max((columns(top) for top, _ in groups), default=1)

  def bottom(k):
    return t.cols[k].rpartition("\n")[2]

  def chunk(r, top, ks):
    cells = [padded(r[k], cw[k]) for k in ks]
    body = "  ".join(f"{bottom(k)} {c}" if len(ks) > 1 else c
                     for k, c in zip(ks, cells))
    return f"{padded(top, lw)}  {body}"
  size = max((columns(chunk(rows[0], top, ks)) for top, ks in groups),
             default=0) if rows else 0
  first = (max([columns(r[0]) for r in rows] + [columns(t.cols[0])])
           if t.keys else 0)
  if first + 2 + size > width:  # the cells under the first key do not fit
    first = 0
  indent = first + 2
  per_line = max(1, (width - indent + 3) // (size + 3)) if size else 1

  def keys(cells):
    if not t.keys:
      return ""
    head = padded(cells[0], first, 0 in t.left)
    return "  ".join([head, *cells[1:t.keys]]).rstrip()
  head = keys([c.rpartition("\n")[2] for c in t.cols])
  head += f"  ({t.caption})" if t.caption else ""
  lines = [head, "-" * min(width, max(columns(head), indent + size))]
  for r in rows:
    lines.append(keys(list(r)))
    cells = [padded(chunk(r, top, ks), size) for top, ks in groups
             if any(r[k] for k in ks)]
    for s in range(0, len(cells), per_line):
      lines.append((" " * indent + "   ".join(cells[s:s + per_line])).rstrip())
  return lines


def check_width(width: Any) -> None:
  """Raises a clear error unless ``width`` is None or an int >= 1."""
  if width is None:
    return
  if isinstance(width, bool) or not isinstance(width, int):
    raise TypeError(f"width={width!r}: expected None or a whole number of "
                    f"columns >= 1")
  if width < 1:
    raise ValueError(f"width={width!r}: expected None or a whole number of "
                     f"columns >= 1")


def _lines(doc: Document, width: int | None,
           box: bool = False) -> list[tuple[str, str | None]]:
  """``doc``'s lines, each with the regular expression of the cells to mark
  in it: as :func:`text` draws them, with ``box`` each table that fits in a
  box."""
  def folded(line: str) -> list[str]:
    return [line] if width is None else fold(line, width, "  ")
  out = [(x, None) for line in doc.heading for x in folded(line)]
  for part in doc.parts:
    if not isinstance(part, Table):
      out += [(x, None) for x in folded(part)]
      continue
    lines = (table(list(part.cols), _flowed(part, None), set(part.left),
                   box=True) if box else [])
    if not lines or (width is not None
                     and max(map(columns, lines)) > width):
      lines = [x for line in _table_lines(part, width) for x in folded(line)]
    out += [(x, part.mark) for x in lines]
  return out


def text(doc: Document, width: int | None = None) -> str:
  """``doc`` as plain text.

  Args:
    doc: the :class:`Document`.
    width: the columns to fit in: a table wider than that folds its names
      in their column (whole, never cut), and where that is not enough gives
      each row lines of its own; lines of prose fold at spaces. None
      (default): as wide as it needs, nothing folded.

  Raises:
    TypeError, ValueError: ``width`` is not None or an int >= 1.
  """
  check_width(width)
  return "\n".join(line for line, _ in _lines(doc, width))


def markdown(doc: Document) -> str:
  """``doc`` as GitHub-flavoured Markdown: the heading in bold, each table a
  Markdown table (a cell's lines joined by a space, every cell through
  :func:`markdown_cell`: GitHub shows the text of :func:`text`, and a name
  stays one row), each paragraph an item of a list."""
  def cell(text):  # GitHub shows the text the text rendering shows
    return markdown_cell(text.replace("\n", " "))

  def joined(cells):  # a cell's lines on one line
    return [c.replace("\n", " ") for c in cells]
  out = ["  \n".join(f"**{cell(h).strip()}**" for h in doc.heading), ""]
  items: list[str] = []
  for part in doc.parts + (None,):
    if not isinstance(part, str) and items:
      out += [*items, ""]
      items = []
    if isinstance(part, Table):
      out += [*markdown_table(joined(part.cols), list(map(joined, part.rows)),
                              set(part.left)), ""]
    elif isinstance(part, str):
      items.append(f"- {cell(part)}")
  return "\n".join(out).rstrip("\n") + "\n"


class Fitted:
  """A :class:`Document` as a ``rich`` renderable that fits the console it
  is printed on (what ``rich.print(report)`` draws): each table in a box
  where it fits, else as :func:`text` fits it, its failing cells in bold
  red; nothing is cut or ends in an ellipsis."""

  def __init__(self, doc: Document):
    self.doc = doc

  def __rich_console__(self, console, options):
    from rich.text import Text
    for line, mark in _lines(self.doc, options.max_width, box=True):
      t = Text(line)  # not markup: "[floor]" and names are text
      if mark:
        t.highlight_regex(mark, "bold red")
      yield t

  def __rich_measure__(self, console, options):
    from rich.measure import Measurement
    return Measurement(1, max([columns(line) for line, _ in
                               _lines(self.doc, None, box=True)] + [1]))


def to_str(doc: Document, width: int | None = None) -> str:
  """``doc`` with its tables in boxes, as ``rich`` draws them, where
  ``rich`` is installed, else :func:`text`.

  Args:
    doc: the :class:`Document`.
    width: the columns to fit in (as :func:`text`; a table is boxed where
      the box fits). None (default): as wide as the widest table and line
      need, so that nothing is ever cut, e.g. in a log.

  Raises:
    TypeError, ValueError: ``width`` is not None or an int >= 1.
  """
  check_width(width)
  try:
    import rich  # noqa: F401, PLC0415
  except ImportError:
    return text(doc, width)
  return "\n".join(line for line, _ in _lines(doc, width, box=True))


# The metrics whose 0 means "no error at all" (an exact layer), and the
# tolerance of the check each is drawn against: the absolute ones against
# atol, the relative ones against rtol.
_ERROR_METRICS = {"max_abs": "atol", "required_atol": "atol", "max_rel": "rtol",
                  "rel_rms": "rtol", "ulp_median": None, "ulp_max": None,
                  "frac_outside": None}
# How a target's levels read in a legend.
_LEVEL_WORDS = {"DEFAULT": "default", "HIGH": "HIGH", "HIGHEST": "HIGHEST"}


def _row_target(report: Any, what: str) -> str:
  """The target whose numerics a row's ``numerics`` text describes:
  ``'tf32 (gpu, emulated)'`` is the GPU's, ``'f32 (native cpu)'`` the
  CPU's, any other the report's target."""
  from jaxprec._src.core import precision  # noqa: PLC0415
  inside = what.partition("(")[2].rstrip(")")
  for part in (s.strip() for s in inside.split(",")):
    words = part.split()
    if len(words) == 1 and words[0] in precision.BACKEND_TARGETS:
      return words[0]
    if len(words) == 2 and words[0] == "native":
      return precision.BACKEND_TARGETS.get(words[1], words[1])
  return report.target


def plot_label(report: Any, p: str) -> str:
  """A row's name in the plot's legend: the label, then what the target
  computes for it in words from the one table of algorithms
  (:mod:`jaxprec._src.core.algorithms`): ``'bfloat16: bfloat16, 1 pass (TPU
  default), emulated'``; a policy or an unknown algorithm keeps its
  ``numerics`` text; the framework floor is ``'<label> (framework floor)'``."""
  from jaxprec._src.core import algorithms  # noqa: PLC0415
  what = report.numerics.get(p, "")
  if p == report.floor:
    return f"{escaped(p)} (framework floor)"
  record = algorithms.RECORDS.get(what.split(" ", 1)[0]) if what else None
  if record is None:
    return f"{escaped(p)} ({what or '?'})"
  target = _row_target(report, what)
  if record.pass_format in ("float32", "float64"):
    words = f"exact {record.pass_format}"
  else:
    n = record.passes
    words = f"{record.pass_format}, {n} pass{'' if n == 1 else 'es'}"
  level = next((_LEVEL_WORDS.get(name, name) for name, algo
                in algorithms.LEVELS.get(target, {}).items()
                if algo == record.algorithm), None)
  if level is not None:
    words += f" ({target.upper()} {level})"
  how = "emulated" if "emulated" in what else (
      f"native {target}" if "native" in what else "")
  return f"{escaped(p)}: {words}" + (f", {how}" if how else "")


def _exact_floor(values: list[float], tolerance: float | None) -> float:
  """Where an exact layer (error 0) is drawn on the log axis: a power of ten
  below every positive value plotted and the tolerance (1e-8 when there is
  none)."""
  low = min((v for v in values if math.isfinite(v) and v > 0), default=None)
  if tolerance:
    low = tolerance if low is None else min(low, tolerance)
  if low is None:
    return 1e-8
  return 10.0 ** (math.floor(math.log10(low)) - 1)


# The most characters of a layer name under the plot's x axis: a longer name
# is shown by its tail (the part that tells layers apart), after an ellipsis.
TICK_CHARS = 32
# The most characters of a line of the plot's legend; a longer entry (a
# policy) folds at spaces and commas.
LEGEND_CHARS = 60


def tick_labels(names: list[str], chars: int = TICK_CHARS) -> list[str]:
  """The plot's x tick labels: each layer name on one line, a name longer
  than ``chars`` shortened to its tail (``'…/layers_3/attention/out'``).
  Where two shortened names would read the same, each of them starts with
  its layer number (``'#3 …'``, the table's ``#``), so no two labels are
  alike unless the names are.

  Examples:
    >>> tick_labels(["a", "x" * 40 + "/dense"], chars=12)
    ['a', '…xxxxx/dense']
  """
  cells = [escaped(n) for n in names]
  short = [c if len(c) <= chars else "…" + c[len(c) - chars + 1:]
           for c in cells]
  seen: dict[str, set[str]] = {}
  for c, s in zip(cells, short):
    seen.setdefault(s, set()).add(c)
  return [f"#{i} {s}" if s != c and len(seen[s]) > 1 else s
          for i, (c, s) in enumerate(zip(cells, short))]


def plot(report: Any, path: str | os.PathLike | None = None, *,
         metric: str = "rel_rms",
         tolerance: float | None = None) -> "matplotlib.figure.Figure":
  """Plots ``metric`` against depth, one line per precision, log scale.

  Each precision is named in the legend with what the target computes for it
  (``'bfloat16: bfloat16, 1 pass (TPU default), emulated'``). The framework
  floor (``report.floor``), when there is one, is a dashed grey line. The
  tolerance is a dotted red line. A layer where the metric is exactly 0 (no
  error), which a log axis cannot show, is drawn as a hollow downward
  triangle on a floor value below everything else, and the legend says so
  (``'exact (0), drawn at 1e-09'``). A point of a layer that fails the
  check's gate (the table's ``'!'``) is ringed in red, whatever the metric:
  one whose metric has no value (the row holds inf or NaN there) as an
  upward triangle of the row's colour at the top edge. The legend sits
  beside the axes, never over a line.

  Args:
    report: the :class:`jaxprec.DivergenceReport` (``self``).
    path: where to save the figure (format from the extension, e.g.
      ``.png``, ``.svg``); None only returns the figure. In a multi-process
      run (``jax.distributed``) process 0 alone saves it; every process
      returns the figure.
    metric: which metric to plot (default ``rel_rms``).
    tolerance: where to draw a tolerance line, in ``metric``'s units (for
      example a search's ``rel_rms`` tolerance); default: the check's
      ``atol`` for ``required_atol``, where it is the table's verdict, and
      no line for the other metrics, where a line would not be the
      elementwise gate. 0 draws none.

  Returns:
    The ``matplotlib.figure.Figure``.

  Raises:
    ImportError: matplotlib is not installed (the ``plots`` extra).
  """
  Figure = figure_class("DivergenceReport.plot")
  # An empty layer compares nothing: no point, not even an exact one.
  series = {p: [math.nan if l.empty else v
                for l, v in zip(report.layers, report.metric(metric, p))]
            for p in report.precisions}
  if tolerance is None:
    # The check's gate is elementwise (|err| <= atol + rtol * |ref|): only
    # required_atol against atol says pass or fail as the table does, so
    # only there is the check's tolerance a line. On every metric the
    # layers the table marks '!' are ringed in red.
    tol = report.atol if metric == "required_atol" else 0.0
    tol_label = (f"the check's atol = {tol:g} (at rtol = {report.rtol:g}: "
                 f"above it a layer fails)")
  else:
    tol = metrics_tolerance(tolerance)
    tol_label = f"tolerance: {metric} = {tol:g}"
  exact_metric = metric in _ERROR_METRICS
  floor_value = _exact_floor([v for ys in series.values() for v in ys
                              if isinstance(v, (int, float))], tol)
  fig = Figure(figsize=(max(6.0, 0.35 * len(report.layers) + 3) + 3.5, 4.5),
               layout="constrained")
  ax = fig.add_subplot()
  xs = list(range(len(report.layers)))
  any_exact = False
  colors: dict[str, str] = {}
  # Exact markers of the rows side by side, not on top of each other.
  shift = {p: 0.08 * (k - (len(series) - 1) / 2) for k, p in enumerate(series)}
  for p, values in series.items():
    ys = [v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0
          else float("nan") for v in values]
    if p == report.floor:
      (line,) = ax.plot(xs, ys, ls="--", color="grey", marker=None, lw=1.5,
                        zorder=3, label=plot_label(report, p))
    else:
      (line,) = ax.plot(xs, ys, marker="o", label=plot_label(report, p))
    colors[p] = line.get_color()
    exact = [x for x, v in zip(xs, values) if exact_metric and v == 0]
    if exact:
      any_exact = True
      ax.plot([x + shift[p] for x in exact], [floor_value] * len(exact),
              ls="none", marker="v",
              markersize=8, markerfacecolor="none",
              markeredgecolor=line.get_color(), zorder=4,
              label="_exact")  # '_': not in the legend; one entry below
  failed = undrawn = False
  ring = dict(ls="none", marker="o", markersize=11, markerfacecolor="none",
              markeredgecolor="tab:red", zorder=5)
  for p, values in series.items():
    if p == report.floor:
      continue
    req = report.metric("required_atol", p)
    fails = [(x, v) for x, v, r in zip(xs, values, req)
             if isinstance(r, (int, float)) and not r <= report.atol]
    drawn = lambda v: (isinstance(v, (int, float))  # noqa: E731
                       and math.isfinite(v) and v > 0)
    bad = [(x, v) for x, v in fails if drawn(v)]
    # A failing layer at an exact 0 is ringed on its marker; one with no
    # value (inf or NaN in the row: the metric is NaN) at the top edge.
    at_floor = [x + shift[p] for x, v in fails if exact_metric and v == 0]
    on_top = [x for x, v in fails if not drawn(v)
              and not (exact_metric and v == 0)]
    failed = failed or bool(fails)
    undrawn = undrawn or bool(on_top)
    if bad:
      ax.plot([x for x, _ in bad], [v for _, v in bad], label="_fails",
              **ring)
    if at_floor:
      ax.plot(at_floor, [floor_value] * len(at_floor), label="_fails_exact",
              **ring)
    if on_top:  # the row's colour inside the ring says which row
      top = dict(transform=ax.get_xaxis_transform(), clip_on=False)
      ax.plot(on_top, [1.0] * len(on_top), ls="none", marker="^",
              color=colors[p], zorder=5, label="_undrawn", **top)
      ax.plot(on_top, [1.0] * len(on_top), label="_fails_undrawn", **top,
              **ring)
  if failed:
    ax.plot([], [], label=f"fails the check's gate (the table's '!'; atol = "
                          f"{report.atol:g}, rtol = {report.rtol:g})", **ring)
  if undrawn:
    ax.plot([], [], ls="none", marker="^", color="black",
            label=f"at the top, ringed: the row fails where {metric} has no "
                  f"value (inf or NaN in the row)")
  if tol > 0:
    ax.axhline(tol, color="tab:red", ls=":", lw=1.5, label=tol_label)
  if any_exact:
    ax.plot([], [], ls="none", marker="v", markerfacecolor="none",
            markeredgecolor="black", label=f"exact (0), drawn at "
                                           f"{floor_value:.0e}")
  ax.set_yscale("log")
  ax.set_xticks(xs)
  ax.set_xticklabels(tick_labels([l.name for l in report.layers]),
                     rotation=60, ha="right", fontsize=7)
  ax.set_xlabel("layer (depth)")
  ax.set_ylabel(metric)
  ax.set_title("\n".join(fold(f"{metric} vs reference {report.reference} "
                             f"(target {report.target}, {report.mode})", 90)),
               fontsize=9, pad=14 if undrawn else 6)  # clear of a top ring
  ax.grid(True, which="both", alpha=0.3)
  if report.precisions:
    # Beside the axes (constrained layout makes room): never over a line.
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles, ["\n".join(fold(n, LEGEND_CHARS)) for n in names],
              fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
  if path is not None:
    save(fig, path)
  return fig


def metrics_tolerance(value: Any) -> float:
  """A plot's ``tolerance``: a finite number >= 0 (the checker's rule)."""
  from jaxprec._src.checker import metrics  # noqa: PLC0415
  return metrics.check_tolerance("tolerance", value)


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

  @property
  def done(self) -> int:
    """The steps done so far."""
    return self._done

  def update(self, what: str, advance: int = 0) -> None:
    """Shows ``what`` as the current item and advances by ``advance``."""
    self._done += advance
    if not self.enabled:
      return
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
