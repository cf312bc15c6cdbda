"""Every report of jaxprec has one JSON envelope and one set of renderers.

Whichever comparison made it (``check``, ``check_module``, ``check_training``,
``port_check``, ``check_sampler``, ``search_policy``), a report's JSON opens
with ``schema``, ``kind`` (which report) and ``jaxprec_version``, writes
non-finite numbers as strings (strict JSON), and its text and Markdown keep a
layer's whole name on one row.
"""

import json
import math
import re

import pytest

import jaxprec
from jaxprec._src.checker import render
from jaxprec._src.checker.port_check import PortLayer, PortReport
from jaxprec._src.checker.report import DivergenceReport, TrainingReport
from jaxprec._src.checker.sampler_check import SamplerReport
from jaxprec._src.search.search_result import SearchResult
from test_report import make_report

NAN, INF = float("nan"), float("inf")
# A name no table may cut or split: a pipe, a line break, 70 characters.
ODD = "encoder/layers_0/attn|out\nproj_" + "x" * 40


def port_report(name: str = ODD) -> PortReport:
  layer = PortLayer(
      name=name, torch_name="encoder.layers.0.attn.out_proj", shape=(2, 4),
      floor=2.5e-7, noise=NAN, envelope={"bfloat16": 3e-3},
      local={"bfloat16": INF}, local_max_abs={"bfloat16": INF},
      propagated={"bfloat16": 4e-3}, bound={"bfloat16": 3e-2},
      verdict={"bfloat16": "SUSPECT"})
  return PortReport(layers=(layer,), alignment={name: layer.torch_name},
                    unpaired_jax=(), unpaired_torch=("act",),
                    parameterless_torch=("act",), precisions=("bfloat16",),
                    target="tpu", numerics={"bfloat16": "bf16x1 (tpu, emulated)"},
                    factor=10.0, kind="nnx", notes=("a note",))


def training_report() -> TrainingReport:
  return TrainingReport(
      precisions=("bf16",), reference="float32", target="tpu", mode="emulate",
      backend="cpu", steps=2, reference_losses=(1.0, 0.5),
      losses={"bf16": (1.0, NAN)}, drift={"bf16": (1e-3, INF)},
      divergence_step={"bf16": 1}, threshold=0.1,
      numerics={"bf16": "bf16x1 (emulated)"}, notes=("a | note",))


def test_every_report_is_one_kind_of_report():
  kinds = {cls: cls.KIND for cls in (DivergenceReport, TrainingReport,
                                     PortReport, SamplerReport, SearchResult)}
  assert all(issubclass(cls, render.Report) for cls in kinds)
  assert sorted(kinds.values()) == ["check", "port", "sampler", "search",
                                    "training"]


@pytest.mark.parametrize("report", [make_report(), training_report(),
                                    port_report()],
                         ids=["check", "training", "port"])
def test_the_envelope_opens_every_report_and_json_is_strict(report):
  text = report.to_json()
  assert "NaN" not in text and "Infinity" not in text
  d = json.loads(text)
  assert list(d)[:3] == ["schema", "kind", "jaxprec_version"]
  assert d["schema"] == render.SCHEMA == 2 and d["kind"] == report.KIND
  assert d["jaxprec_version"] == jaxprec.__version__
  assert report.to_json() == text  # the same report, the same bytes
  assert json.loads(report.to_json(indent=None)) == d


def test_a_port_report_names_its_program_apart_from_its_kind():
  d = port_report().to_dict()
  assert (d["kind"], d["program"]) == ("port", "nnx")
  layer = d["layers"][0]
  assert layer["noise"] == "nan" and layer["local"]["bfloat16"] == "inf"
  assert d["suspects"] == {"bfloat16": [ODD]}


def test_a_check_report_reads_schema_1_and_2_and_refuses_the_rest():
  r = make_report()
  d = r.to_dict()
  assert DivergenceReport.from_dict(d).to_dict() == d
  old = dict(d, schema=1)
  del old["jaxprec_version"]
  assert DivergenceReport.from_dict(old).to_dict() == d
  for bad, word in [(dict(d, schema=3), "schema 3"),
                    (port_report().to_dict(), "kind 'port'")]:
    with pytest.raises(ValueError, match=word) as e:
      DivergenceReport.from_dict(bad)
    assert "schema 1 or 2" in str(e.value)


def test_port_markdown_keeps_each_layer_on_one_row_with_every_figure():
  md = port_report().to_markdown()
  rows = [l for l in md.splitlines() if l.startswith("| encoder")]
  assert len(rows) == 1  # the line break and the pipe are escaped
  cells = [c.strip() for c in rows[0].replace("\\|", "\x00").split("|")[1:-1]]
  # the PyTorch layer after an arrow, as the text draws it under the name
  # (GitHub shows the name as the text table does: its line break as \n)
  shown = render.escaped(ODD)
  assert cells[0].replace("\x00", "|") == (render.escaped(shown)
                                           + " ↳ encoder.layers.0.attn.out_proj")
  assert cells[1:] == ["bfloat16", "2.50e-07", "nan", "3.00e-03", "inf",
                       "4.00e-03", "SUSPECT"]
  assert f"- {render.markdown_cell(f'suspects at bfloat16: {shown}')}" in md
  assert "1 without parameters" in md and "- note: a note" in md
  assert "act" in port_report().to_markdown(full=True).split("partner:")[1]


def test_port_text_and_markdown_say_the_same_lines_under_the_table():
  r = port_report("dense")
  text = " ".join(r.table(width=200).split())
  for line in r._closing(full=False):
    assert " ".join(line.split()) in text
    assert f"- {render.markdown_cell(line)}" in r.to_markdown()


def test_training_markdown_is_its_table():
  md = training_report().to_markdown()
  assert md.splitlines()[2].startswith("| precision | numerics | final loss")
  assert "| bf16 | bf16x1 (emulated) | nan |" in md
  assert md.rstrip().endswith("- note: a \\| note")


def test_markdown_table_aligns_and_escapes():
  lines = render.markdown_table(["a", "b"], [["x|y", "1"], ["p\nq", "2"]], {0})
  assert lines == ["| a | b |", "|---|---:|", "| x\\|y | 1 |", "| p\\nq | 2 |"]
  assert math.isnan(render.decode_float("nan"))


def test_a_comparisons_words_are_resolved_in_one_place():
  """check, check_module(shadow=True), check_training, port_check and the CLI
  resolve target, mode, chip and tpu_matvec_f32 through rows.setting only;
  the rows below read the Setting."""
  import ast
  import pathlib

  from jaxprec._src.checker import rows
  words = {"check_target", "resolve_mode", "check_chip", "check_flag"}
  src = pathlib.Path(jaxprec.__file__).parent / "_src"
  callers = set()
  for f in [*(src / "checker").glob("*.py"), *(src / "cli").glob("*.py")]:
    for node in ast.walk(ast.parse(f.read_text())):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in words):
        callers.add(f.stem)
  # The sampler's Compute is its own words' entry (it admits target 'cpu').
  assert callers == {"rows", "sampler_check"}
  s = rows.setting("gpu", "auto", "h100", False)
  assert s.options == {"chip": "h100", "tpu_matvec_f32": False}
  assert [p.description for p in rows.plans(("bfloat16",), s)] == [
      "tf32 (gpu, emulated, h100 tensor cores)"]
  for bad, word in [(dict(target="ipu"), "ipu"), (dict(mode="fast"), "fast"),
                    (dict(chip="h100"), "h100")]:
    with pytest.raises(ValueError, match=word):
      rows.setting(**{"target": "tpu", **bad})


# -- one document, one renderer ----------------------------------------------

# A name longer than the page: folded whole wherever a page is given.
LONG = ("encoder/layers_0/attention/a_rather_long_projection_name_that_keeps"
        "_going_and_going")


def _reports():
  from test_report import renamed_report
  return {"check": renamed_report((LONG, "b", "c", "d")),
          "port": port_report(LONG), "training": training_report()}


@pytest.mark.parametrize("kind", ["check", "port", "training"])
@pytest.mark.parametrize("how", ["table", "to_text"])
def test_every_report_fits_a_width_and_never_cuts_a_name(kind, how):
  r = _reports()[kind]
  wide = getattr(r, how)()
  narrow = getattr(r, how)(width=80)
  assert "…" not in wide + narrow
  assert max(map(len, narrow.splitlines())) <= 80
  if kind != "training":
    # as wide as it needs: the name whole on one line; fitted: folded whole
    assert any(LONG in line for line in wide.splitlines())
    assert not any(LONG in line for line in narrow.splitlines())
    # folded whole in its column, each piece cut after a separator
    if kind == "check":
      from test_report_fit import drawn_names
      assert drawn_names(narrow)[0] == LONG, narrow
    else:  # the name column's lines, from the first piece to the arrow
      lines = narrow.splitlines()
      rule = next(i for i, l in enumerate(lines) if l.startswith("---"))
      width = lines[rule].index(" ")
      column = [l[:width].strip() for l in lines[rule + 1:]]
      assert "".join(column[:column.index(next(
          c for c in column if c.startswith("↳")))]) == LONG, narrow


def test_a_table_too_wide_folds_its_names_before_drawing_a_row_per_line():
  r = _reports()["check"]
  # 80 columns hold the table with the long name folded in its column
  lines = r.to_text(width=80).splitlines()
  header = next(l for l in lines if l.split()[:2] == ["#", "layer"])
  assert "req_atol" in header and "shape" in header
  at = next(i for i, l in enumerate(lines) if l.startswith("0  encoder/"))
  assert lines[at + 1].split()[0] not in ("1", "bf16")  # the name goes on
  # 40 do not: each layer a line of its own, its cells below by precision
  narrow = r.to_text(width=40).splitlines()
  assert any("(req_atol per" in l for l in narrow)
  assert any(l.split()[:1] == ["bf16"] for l in narrow)
  assert max(map(len, narrow)) <= 40


def test_a_port_table_leaves_out_the_noise_before_folding_names():
  r = port_report("dense")
  assert "noise" in r.to_text().splitlines()[1]
  assert "noise" not in r.to_text(width=80).splitlines()[1]
  assert "noise" in r.to_json()  # the JSON has every figure


@pytest.mark.parametrize("kind", ["check", "port", "training"])
def test_rich_fits_the_console_for_every_report(kind):
  import io
  from rich.console import Console
  out = io.StringIO()
  Console(file=out, width=80, color_system=None).print(_reports()[kind])
  lines = out.getvalue().splitlines()
  assert lines and max(map(len, lines)) <= 80 and "…" not in out.getvalue()


def test_every_report_renders_one_document():
  from jaxprec._src.search.search_result import SearchResult
  for r in _reports().values():
    doc = r._document()
    assert isinstance(doc, render.Document) and doc.heading
    tables = [p for p in doc.parts if isinstance(p, render.Table)]
    assert tables and all(len(row) == len(t.cols)
                          for t in tables for row in t.rows)
    assert r.to_text() == render.text(doc)
    assert r.to_markdown() == render.markdown(doc)
  # the sampler's and the search's reports are drawn by the same renderer
  for cls in (SamplerReport, SearchResult):
    assert "_document" in vars(cls) and "__str__" not in vars(cls)
    assert "to_markdown" not in vars(cls) and "table" not in vars(cls)


def test_markdown_shows_a_multi_line_cell_on_one_row():
  doc = render.Document(heading=("h",), parts=(
      render.Table(cols=("a", "b"), rows=(("x\ny", "1"),)), "p|q"))
  md = render.markdown(doc)
  assert "| x y | 1 |" in md and "- p\\|q" in md
  assert render.text(doc).splitlines()[1:] == ["a  b", "-  -", "x  1", "y",
                                               "p|q"]


# Pages from one column to wide; names a narrow page must fold.
WIDTHS = [1, 10, 20, 40, 79, 80, 81, 100, 200]


@pytest.mark.parametrize("kind", ["check", "port", "training"])
@pytest.mark.parametrize("width", WIDTHS)
def test_every_line_of_every_report_fits_every_width(kind, width):
  import io
  from rich.cells import cell_len
  from rich.console import Console
  r = _reports()[kind]
  out = io.StringIO()
  Console(file=out, width=width, color_system=None).print(r)
  for how, got in [("table", r.table(width=width)),
                   ("to_text", r.to_text(width=width)),
                   ("rich", out.getvalue())]:
    assert "…" not in got, how
    assert max(map(cell_len, got.splitlines())) <= width, (how, got)
    assert got == (out.getvalue() if how == "rich"
                   else getattr(r, how)(width=width))  # nothing kept


@pytest.mark.parametrize("how", ["table", "to_text"])
def test_a_row_per_line_keeps_each_figure_beside_its_name(how):
  """Too narrow for the table: each figure on a line with its column's
  name, and no name without a figure (an empty cell is left out)."""
  port = getattr(port_report("dense"), how)(width=50).splitlines()
  for name, value in [("floor", "2.50e-07"), ("envelope", "3.00e-03"),
                      ("local", "inf"), ("propagated", "4.00e-03"),
                      ("verdict", "SUSPECT")]:
    assert any(re.search(rf"(^|  ){name} +{value}( |$)", l.strip())
               for l in port), (name, port)
  training = getattr(training_report(), how)(width=50).splitlines()
  assert any(l.split() == ["final", "loss", "5.0000e-01"] for l in training)
  assert any(l.split() == ["numerics", "bf16x1", "(emulated)"]
             for l in training), training
  names = {"floor", "envelope", "local", "propagated", "verdict", "numerics",
           "final loss", "max rel loss diff", "final drift",
           "diverged at step"}
  assert not [l for l in port + training if l.strip() in names]


@pytest.mark.parametrize("kind", ["check", "port", "training"])
@pytest.mark.parametrize("width", [0, -3, 2.5, "80", True])
def test_a_bad_width_is_refused_by_every_report(kind, width):
  r = _reports()[kind]
  for how in (r.table, r.to_text):
    error = ValueError if isinstance(width, int) and width is not True else (
        TypeError)
    with pytest.raises(error, match=re.escape(f"width={width!r}")) as e:
      how(width=width)
    assert "None or a whole number of columns >= 1" in str(e.value)


def test_a_report_of_2000_layers_is_drawn_whole():
  """Every form draws every layer (the time it takes is measured side by
  side with rich's in benchmarks/bench_render.py)."""
  import io

  from rich.console import Console

  from jaxprec._src.checker.report import LayerResult
  from test_report import make_report
  metrics = make_report().layers[1].metrics
  r = make_report(layers=tuple(
      LayerResult(name=f"encoder/layers_{i}/mlp/dense", shape=(1, 4, 3),
                  dtype="float32", metrics=metrics) for i in range(2000)))
  draws = {"table": lambda: r.table(), "table(80)": lambda: r.table(width=80),
           "to_text(40)": lambda: r.to_text(width=40),
           "to_markdown": r.to_markdown,
           "rich.print": lambda: Console(file=io.StringIO(), width=100,
                                         color_system=None).print(r)}
  for what, draw in draws.items():
    text = draw()
    if text is not None:  # each layer drawn, its name whole
      assert sum("encoder/layers_1999/mlp/dense" in l
                 for l in text.splitlines()) == 1, what
  assert sum(l.startswith("│ ") for l in r.table().splitlines()) == 2000


# Names a user may give a layer: each drawn whole, on no line wider than
# the page, a wide character (CJK, emoji) counted as the two columns a
# terminal gives it.
ODD_NAMES = ["编码器/层_0/注意力/输出投影", "enc/😀😀😀/dense", "a|b", "a\tb\\c",
             "[bold]x[/bold]", "", "/".join(f"seg{i:03d}" for i in range(38))]


@pytest.mark.parametrize("name", ODD_NAMES)
@pytest.mark.parametrize("kind", ["check", "port"])
def test_any_name_fits_every_width_and_a_box_is_aligned(kind, name):
  import io

  from rich.cells import cell_len
  from rich.console import Console

  from test_report import renamed_report
  r = (renamed_report((name, "b", "c", "d")) if kind == "check"
       else port_report(name))
  shown = render.escaped(name)
  assert shown in r.to_text() and shown in r.table()
  box = [l for l in r.table().splitlines() if l[:1] in "┏┃┡│└"]
  assert len({cell_len(l) for l in box}) == 1, box  # every edge aligned
  plain = r.to_text().splitlines()
  rule = next(l for l in plain if l.startswith("-"))
  assert max(map(cell_len, plain[plain.index(rule) - 1:plain.index(rule) + 3])
             ) <= cell_len(rule)  # a row as wide as its header's rule
  for width in (2, 10, 20, 40, 79, 80, 100):
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(r)
    for got in (r.table(width=width), r.to_text(width=width),
                out.getvalue()):
      assert "…" not in got
      assert max(map(cell_len, got.splitlines())) <= width, (width, got)


def _github(md: str) -> str:
  """The HTML that CommonMark with GitHub's tables and strikethrough makes of
  ``md`` (markdown-it-py, which rich depends on)."""
  markdown_it = pytest.importorskip("markdown_it")
  return markdown_it.MarkdownIt("commonmark").enable(
      ["table", "strikethrough"]).render(md)


# Names and a policy that Markdown would format: emphasis, code, a link, an
# HTML tag, an entity, strikethrough, a pipe, a backslash, a line break.
MD_NAMES = ["_private_/x", "a*b*c", "x<y>z", "[bold]x[/bold]", "a`b`c",
            "a~~b~~c", "a|b", "a\\b", "a&amp;b", "line\nbreak", "[a](b)",
            "<lambda>"]
MD_POLICY = "default=bfloat16,.*attn.*=float32"


def test_github_shows_each_name_and_line_as_the_text_does():
  import html

  from jaxprec._src.checker.report import LayerResult
  from test_report import make_report
  m = make_report().layers[1].metrics["bf16"]
  r = make_report(
      layers=tuple(LayerResult(name=n, shape=(2,), dtype="float32",
                               metrics={"bf16": m, MD_POLICY: m})
                   for n in MD_NAMES),
      precisions=("bf16", MD_POLICY),
      numerics={"bf16": "bf16x1 (emulated)", MD_POLICY: "policy (emulated)"})
  page = _github(r.to_markdown())
  rows = re.findall(r"<tr>\n(.*?)</tr>", page, re.S)[1:]  # after the header
  names = [re.findall(r"<td[^>]*>(.*?)</td>", row)[1] for row in rows]
  assert [html.unescape(n) for n in names] == [render.escaped(n)
                                                for n in MD_NAMES]
  assert not [n for n in names if "<" in n]  # no emphasis, code, link, tag
  items = [html.unescape(i) for i in re.findall(r"<li>(.*?)</li>", page)]
  assert f"P1: {MD_POLICY}" in items
  none = make_report(precisions=(), layers=tuple(
      LayerResult(name="a", shape=(2,), dtype="float32", metrics={})
      for _ in range(2)))  # a heading line ends in a space: 'numerics: '
  for report in (r, none):
    page = _github(report.to_markdown())
    for line in report.to_text().splitlines()[:2]:  # the heading, in bold
      assert f"<strong>{html.escape(line.strip(), quote=False)}</strong>" in (
          page), page


def test_a_row_per_line_keeps_a_cell_of_two_lines_on_its_line():
  """A cell of two lines (the sampler's 'on gpu\\n(h100)') outside the name
  column: one line beside its column's name, no blank line, no second
  label."""
  doc = render.Document(heading=("h",), parts=(render.Table(
      cols=("factor", "sampler", "trainer", "RMS delta"),
      rows=(("lm_head", "default=dtype:bfloat16 on gpu\n(h100)",
             "default (bf16x1) on tpu", "0.0119"),
            ("decode", "decode with a KV cache", "teacher forcing", "0")),
      name=0),))
  wide = render.text(doc).splitlines()
  assert len(wide) == 6 and wide[4].split() == ["(h100)"]  # as it was
  for how in (render.text, render.to_str):
    lines = how(doc, 50).splitlines()
    assert "" not in lines and max(map(len, lines)) <= 50
    sampler = [l.split() for l in lines if l.split()[:1] == ["sampler"]]
    assert sampler == [["sampler", "default=dtype:bfloat16", "on", "gpu",
                        "(h100)"], ["sampler", "decode", "with", "a", "KV",
                                    "cache"]], lines


def test_a_control_character_in_a_name_is_written_as_an_escape():
  """A name holding an escape sequence ('\\x1b[2J' clears a terminal), a NUL
  or a DEL reaches no terminal raw: it reads as Python writes it."""
  from test_report import renamed_report
  r = renamed_report(("a\x1b[2Jb", "c\x00d", "e\x7ff", "g\x85h"))
  out = [r.table(), r.to_text(), r.table(width=40), r.to_text(width=40),
         r.to_markdown()]
  for got in out:
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", got), repr(got)
  for name in ("a\\x1b[2Jb", "c\\x00d", "e\\x7ff", "g\\x85h"):
    assert name in out[0] and name in out[1], name
  assert render.escaped("a\x1bb\n\t\\") == "a\\x1bb\\n\\t\\\\"
