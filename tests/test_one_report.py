"""Every report of jaxprec has one JSON envelope and one set of renderers.

Whichever comparison made it (``check``, ``check_module``, ``check_training``,
``port_check``, ``check_sampler``, ``search_policy``), a report's JSON opens
with ``schema``, ``kind`` (which report) and ``jaxprec_version``, writes
non-finite numbers as strings (strict JSON), and its text and Markdown keep a
layer's whole name on one row.
"""

import json
import math

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
  assert cells[0].replace("\x00", "|") == ODD.replace("\n", "\\n")
  assert cells[1:] == ["encoder.layers.0.attn.out_proj", "bfloat16",
                       "2.50e-07", "nan", "3.00e-03", "inf", "4.00e-03",
                       "SUSPECT"]
  assert f"- suspects at bfloat16: {ODD.replace(chr(10), chr(92) + 'n')}" \
      .replace("|", "\\|") in md
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
  assert md.rstrip().endswith("- a \\| note")


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
