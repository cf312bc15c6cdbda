"""DivergenceReport and TrainingReport: schema, JSON, tables, plots, queries."""

import dataclasses
import json
import re
import math
import sys

import pytest

import jaxprec
from jaxprec._src.checker.metrics import LayerMetrics
from jaxprec._src.checker.report import (DivergenceReport, LayerResult,
                                         TrainingReport)

SCHEMA_METRICS = {"max_abs", "max_rel", "rel_rms", "cosine", "sqnr_db",
                  "ulp_median", "ulp_max", "frac_outside", "nan", "inf"}


def lm(max_abs, required=None, *, rel_rms=None, nan=0, inf=0, cosine=1.0,
       ref_max_abs=1.0):
  required = max_abs if required is None else required
  return LayerMetrics(
      max_abs=max_abs, max_rel=max_abs * 10, rel_rms=rel_rms or max_abs / 3,
      cosine=cosine, sqnr_db=math.inf if max_abs == 0 else 40.0,
      ulp_median=3.0, ulp_max=1e6, frac_outside=0.25, nan=nan, inf=inf,
      required_atol=required, size=12, ref_rms=0.5, ref_max_abs=ref_max_abs)


def make_report(**kw):
  layers = (
      LayerResult(name="emb", shape=(1, 4, 3), dtype="float32",
                  metrics={"bf16": lm(0.0), "bf16_3x": lm(0.0)}),
      LayerResult(name="hidden_states[1]", shape=(1, 4, 3), dtype="float32",
                  metrics={"bf16": lm(2e-3, 1.5e-3), "bf16_3x": lm(1e-5)}),
      LayerResult(name="hidden_states[2]", shape=(1, 4, 3), dtype="float32",
                  metrics={"bf16": lm(8e-3, 6e-3, nan=2, cosine=float("nan")),
                           "bf16_3x": lm(4e-5)}),
      LayerResult(name="hidden_states[3]", shape=(1, 4, 3), dtype="float32",
                  metrics={"bf16": lm(3e-2, math.inf, inf=1),
                           "bf16_3x": lm(1.6e-4)}),
  )
  args = dict(layers=layers, precisions=("bf16", "bf16_3x"), reference="float32",
              target="tpu", mode="emulate", backend="cpu", atol=1e-3, rtol=1e-3,
              numerics={"bf16": "bf16x1 (emulated)", "bf16_3x": "bf16x3 (emulated)",
                        "(reference)": "f32 (native cpu)"},
              notes=("a note",), seconds={"reference": 0.5, "bf16": 1.0})
  args.update(kw)
  return DivergenceReport(**args)


def test_to_dict_follows_schema_2():
  d = make_report().to_dict()
  assert d["schema"] == 2 and d["kind"] == "check"
  for k in ("reference", "target", "mode", "precisions", "layers", "atol",
            "rtol", "numerics", "summary"):
    assert k in d
  assert d["precisions"] == ["bf16", "bf16_3x"]
  layer = d["layers"][1]
  assert layer["name"] == "hidden_states[1]" and layer["shape"] == [1, 4, 3]
  assert set(layer["metrics"]) == {"bf16", "bf16_3x"}
  assert SCHEMA_METRICS <= set(layer["metrics"]["bf16"])
  assert layer["reference"] == {"rms": 0.5, "max_abs": 1.0, "nan": 0, "inf": 0,
                                "overflow": 0}


def test_json_has_no_nan_literals_and_round_trips():
  r = make_report()
  text = r.to_json()
  assert "NaN" not in text and "Infinity" not in text
  d = json.loads(text)
  m3 = d["layers"][3]["metrics"]["bf16"]
  assert m3["required_atol"] == "inf" and m3["inf"] == 1
  assert d["layers"][2]["metrics"]["bf16"]["cosine"] == "nan"
  assert d["layers"][0]["metrics"]["bf16"]["sqnr_db"] == "inf"
  back = DivergenceReport.from_json(text)
  assert back.precisions == r.precisions and back.numerics == r.numerics
  for a, b in zip(back.layers, r.layers):
    assert (a.name, a.shape) == (b.name, b.shape)
    for p in r.precisions:
      x, y = a.metrics[p], b.metrics[p]
      for k in vars(y):
        vx, vy = getattr(x, k), getattr(y, k)
        assert vx == vy or (math.isnan(vx) and math.isnan(vy)), k
  with pytest.raises(ValueError, match="schema"):
    DivergenceReport.from_dict(dict(d, schema=3))


def test_first_divergence_exact_and_from_bounds():
  r = make_report()
  f = r.first_divergence()  # the check's tolerance
  assert f["bf16"].layer == "hidden_states[1]" and f["bf16"].index == 1
  assert f["bf16"].exact and f["bf16"].value == 1.5e-3
  assert f["bf16_3x"] is None
  assert r.first_divergence(1e-2, 1e-3, precision="bf16").layer == "hidden_states[3]"
  assert r.first_divergence(1e-2, 0, precision="bf16").layer == "hidden_states[3]"
  assert r.first_divergence(1e-4, 0, precision="bf16_3x").layer == "hidden_states[3]"
  # rtol between 0 and the check's: need(r) lies between required_atol and
  # the chord from max_abs: 2e-3 at 0 -> 1.5e-3 at 1e-3.
  low_high = r._required(r.layers[1].metrics["bf16"], 5e-4)
  assert low_high == pytest.approx((1.5e-3, 1.75e-3))
  f = r.first_divergence(1.6e-3, 5e-4, precision="bf16")
  assert f.layer == "hidden_states[1]" and not f.exact  # might pass
  f = r.first_divergence(1.4e-3, 5e-4, precision="bf16")
  assert f.exact  # cannot pass
  assert r.first_divergence(1.8e-3, 5e-4, precision="bf16").layer == "hidden_states[2]"
  assert r.passes(1.0, 0, precision="bf16_3x") and not r.passes()
  with pytest.raises(ValueError, match="bf16_3x"):
    r.first_divergence(precision="float32")


def test_worst_summary_and_required():
  r = make_report()
  w = r.worst(2)
  assert [(f.precision, f.layer) for f in w] == [("bf16", "hidden_states[3]"),
                                                 ("bf16", "hidden_states[2]")]
  assert r.worst(1, "cosine", "bf16")[0].layer == "hidden_states[2]"  # NaN first
  assert r.required_atol("bf16_3x") == 1.6e-4
  assert math.isinf(r.required_atol("bf16"))
  s = r.summary()
  assert s["bf16"]["first_divergence"] == "hidden_states[1]"
  assert s["bf16_3x"]["first_divergence"] is None
  assert s["bf16_3x"]["growth_per_layer"] == pytest.approx(4.0)
  with pytest.raises(ValueError, match="Unknown metric"):
    r.metric("nope")
  with pytest.raises(KeyError, match="hidden_states"):
    r.layer("hidden_states[9]")


def test_table_with_and_without_rich(monkeypatch):
  r = make_report()
  text = str(r)
  for s in ("hidden_states[2]", "bf16_3x", "first divergence hidden_states[1]",
            "note: a note", "2 nan", "f32 (native cpu)"):
    assert s in text, s
  assert "┃" in text  # rich is installed here
  monkeypatch.setitem(sys.modules, "rich", None)
  monkeypatch.setitem(sys.modules, "rich.console", None)
  plain = str(r)
  assert "┃" not in plain and "hidden_states[2]" in plain
  assert plain == r.to_text()


def test_markdown():
  md = make_report().to_markdown()
  lines = md.splitlines()
  table = [l for l in lines if l.startswith("|")]
  assert len(table) == 2 + 4  # header, rule, 4 layers
  assert table[0].count("|") == table[2].count("|")
  assert "hidden_states[3]" in md and "- bf16:" in md
  assert lines[0].startswith("**jaxprec.check: 4 layers") and lines[0].endswith("**  ")
  assert lines[1].startswith("**numerics: bf16: bf16x1")


# The plot's lines, legend, tolerance and exact layers: tests/test_plots.py.


def test_plot_draws_dollar_signs_as_written(tmp_path):
  """A layer or precision named with `$` (an unbalanced mathtext formula)
  crashed savefig after report.json was written."""
  pytest.importorskip("matplotlib")
  base = make_report()
  layers = tuple(dataclasses.replace(l, name=f"${l.name}") for l in base.layers)
  r = make_report(layers=layers, reference="$ref")
  path = tmp_path / "d.png"
  fig = r.plot(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
  assert ticks == [f"${l.name}" for l in base.layers]
  # The log axis keeps its mathtext ticks (10^-3, not raw "$\mathdefault").
  assert all(t.get_parse_math() for t in fig.axes[0].get_yticklabels())
  assert not any(t.get_parse_math() for t in fig.axes[0].get_xticklabels())
  t = TrainingReport(
      precisions=("$bf16",), reference="$f", target="tpu", mode="emulate",
      backend="cpu", steps=2, reference_losses=(1.0, 0.5),
      losses={"$bf16": (1.0, 0.52)}, drift={"$bf16": (1e-3, 2e-3)},
      divergence_step={"$bf16": None}, threshold=0.1,
      numerics={"$bf16": "bf16x1 (emulated)"})
  t.plot(tmp_path / "t.png")
  assert (tmp_path / "t.png").stat().st_size > 1000


def test_training_report(tmp_path):
  t = TrainingReport(
      precisions=("bf16",), reference="float32", target="tpu", mode="emulate",
      backend="cpu", steps=3, reference_losses=(1.0, 0.5, 0.25),
      losses={"bf16": (1.0, 0.52, float("nan"))}, drift={"bf16": (1e-3, 2e-3, 0.0)},
      divergence_step={"bf16": 2}, threshold=0.1,
      numerics={"bf16": "bf16x1 (emulated)"})
  text = str(t)
  assert "bf16x1" in text and "diverged at step" in text
  d = json.loads(t.to_json())
  assert d["kind"] == "training" and d["losses"]["bf16"][2] == "nan"
  assert d["divergence_step"] == {"bf16": 2}
  fig = t.plot(tmp_path / "t.png")
  assert (tmp_path / "t.png").exists() and len(fig.axes) == 2


def test_report_is_exported():
  assert jaxprec.DivergenceReport is DivergenceReport
  assert jaxprec.TrainingReport is TrainingReport
  assert jaxprec.LayerMetrics is LayerMetrics


# -- Argument checks --------------------------------------


@pytest.mark.parametrize("bad", [-1, -1e-9, float("nan"), float("inf"), 1e39])
def test_first_divergence_refuses_negative_nan_or_infinite_tolerances(bad):
  r = make_report()
  with pytest.raises(ValueError, match=rf"atol must be a finite number >= 0.*got {re.escape(repr(bad))}"):
    r.first_divergence(atol=bad)
  with pytest.raises(ValueError, match=rf"rtol must be a finite number >= 0.*got {re.escape(repr(bad))}"):
    r.first_divergence(1e-3, bad)
  with pytest.raises(ValueError, match="atol must be a finite number >= 0"):
    r.passes(atol=bad)
  with pytest.raises(ValueError, match="rtol must be a finite number >= 0"):
    r.required_atol("bf16", rtol=bad)


@pytest.mark.parametrize("bad", ["1e-3", [1e-3], True])
def test_first_divergence_refuses_tolerances_that_are_not_numbers(bad):
  with pytest.raises(TypeError, match=r"atol must be a finite number >= 0.*got "
                     + re.escape(repr(bad)) + " of type " + type(bad).__name__):
    make_report().first_divergence(atol=bad)


def test_first_divergence_accepts_large_and_integer_tolerances():
  r = make_report()
  assert r.first_divergence(3e38, 0, precision="bf16_3x") is None
  # A layer whose NaN or inf has no counterpart in the reference fails at any
  # tolerance (atol=inf, refused now, passed it).
  assert r.first_divergence(3e38, 3e38, precision="bf16").layer == \
      "hidden_states[3]"
  assert r.first_divergence(0, 0, precision="bf16").layer == "hidden_states[1]"


def test_worst_refuses_a_bad_count_metric_or_precision():
  r = make_report()
  with pytest.raises(ValueError, match=r"n must be a non-negative integer.*got -1"):
    r.worst(-1)
  for bad in (1.5, "3", None, float("nan")):
    with pytest.raises(TypeError, match=r"n must be a non-negative integer.*got "):
      r.worst(bad)
  assert r.worst(0) == []
  with pytest.raises(ValueError, match=r"Unknown metric 'rel_rsm'.*Did you mean 'rel_rms'"):
    r.worst(3, "rel_rsm")
  with pytest.raises(ValueError, match=r"Unknown precision 'bf61'.*'bf16'"):
    r.worst(3, precision="bf61")
  with pytest.raises(KeyError, match=r"Unknown layer 'hidden_states\[9\]'; valid "
                                     r"choices: .*Did you mean 'hidden_states\[3\]'"):
    r.layer("hidden_states[9]")


# -- Markdown and text with awkward layer names ------------


def renamed_report(names):
  base = make_report()
  layers = tuple(LayerResult(name=n, shape=l.shape, dtype=l.dtype,
                             metrics=l.metrics)
                 for n, l in zip(names, base.layers))
  return make_report(layers=layers)


def test_markdown_escapes_newlines_and_pipes_in_layer_names():
  names = ("a\nb", "c|d", "e\\f", "g\r\th")
  md = renamed_report(names).to_markdown()
  table = [l for l in md.splitlines() if l.startswith("|")]
  assert len(table) == 2 + 4  # each layer one row
  n_cols = 3 + 2  # #, layer, shape, one req_atol column per precision
  for row in table:
    # cells split on unescaped pipes only
    assert len(re.split(r"(?<!\\)\|", row)) == n_cols + 2, row
  assert "| a\\\\nb |" in table[2]  # GFM shows a\nb
  assert "| c\\|d |" in table[3]
  assert "| e\\\\\\\\f |" in table[4]  # GFM shows e\\f, as the text table
  assert "| g\\\\r\\\\th |" in table[5]
  text = renamed_report(names).to_text()
  assert "a\\nb" in text and "g\\r\\th" in text
  assert len(text.splitlines()) == len(make_report().to_text().splitlines())


# -- The framework floor ----------------------------------


def floor_report(floor_max_abs=2e-6, **kw):
  base = make_report()
  layers = tuple(
      LayerResult(name=l.name, shape=l.shape, dtype=l.dtype,
                  metrics={"float32": lm(floor_max_abs), **l.metrics})
      for l in base.layers)
  args = dict(layers=layers, precisions=("float32", "bf16", "bf16_3x"),
              reference="pytree", floor="float32",
              numerics={**base.numerics, "float32": "f32 (native cpu)"})
  args.update(kw)
  return make_report(**args)


def test_floor_must_be_one_of_the_precisions():
  with pytest.raises(ValueError, match=r"Unknown floor 'fp32'; valid choices: "
                                       r".* \(the report's precisions\)"):
    floor_report(floor="fp32")
  assert make_report().floor is None


def test_floor_is_not_a_candidate_precision():
  r = floor_report()
  assert r.candidates == ("bf16", "bf16_3x")
  # The floor would diverge at atol=1e-7; the candidates' answers ignore it.
  assert set(r.first_divergence(1e-7, 0)) == {"bf16", "bf16_3x"}
  assert r.first_divergence(1e-7, 0, precision="float32").layer == "emb"
  assert not r.passes(1e-7, 0, precision="float32")
  # A floor beyond the tolerance does not make the candidates fail.
  r2 = floor_report(0.5, precisions=("float32", "bf16_3x"))
  assert r2.passes(1e-3, 0) and not r2.passes(1e-3, 0, precision="float32")
  assert r2.first_divergence(1e-3, 0) == {"bf16_3x": None}
  assert r2.worst(1)[0].precision == "bf16_3x"
  assert {f.precision for f in r.worst(20)} == {"bf16", "bf16_3x"}
  assert r.worst(1, precision="float32")[0].precision == "float32"
  assert r.metric("max_abs") == r.metric("max_abs", "bf16")  # default: bf16
  assert r.required_atol() == r.required_atol("bf16")
  assert "float32" in r.summary()


def test_floor_is_marked_in_the_text_table_and_markdown():
  r = floor_report()
  # rich draws the header cell literally ("[floor]" is not taken as markup)
  assert any("┃" in l and "float32 [floor]" in l for l in str(r).splitlines())
  for text in (r.to_text(), str(r)):
    assert "float32 [floor]" in text
    assert "'float32' is the framework floor" in text
    assert "float32 [floor]: no divergence" in text or "float32 [floor]: first" in text
    assert "bf16 [floor]" not in text
  md = r.to_markdown()
  header = [l for l in md.splitlines() if l.startswith("|")][0]
  assert "float32 [floor] req_atol" in header and "bf16 req_atol" in header
  full = [l for l in r.to_markdown(full=True).splitlines()
          if l.startswith("|")][0]
  assert "float32 [floor] max_abs" in full and "bf16 rel_rms" in full
  assert "framework floor" in md
  plain = make_report()
  assert "[floor]" not in plain.to_text() and "floor" not in plain.to_markdown()


def test_floor_json_round_trip_and_old_files():
  r = floor_report()
  d = json.loads(r.to_json())
  assert d["floor"] == "float32" and d["schema"] == 2
  back = DivergenceReport.from_json(r.to_json())
  assert back.floor == "float32" and back.candidates == r.candidates
  assert back.to_dict() == r.to_dict()
  assert json.loads(make_report().to_json())["floor"] is None
  old = make_report().to_dict()
  del old["floor"]  # a schema-1 file written before the floor existed
  assert DivergenceReport.from_dict(old).floor is None


# -- Rendering helpers ---------------------------------------------------------


def test_render_number_helpers():
  from jaxprec._src.checker import render
  assert render.encode(float("inf")) == "inf"
  assert render.decode_float("-inf") == -math.inf
  assert render.fmt(1.5e-3) == "1.50e-03"


@pytest.mark.parametrize("field", ["kernel", "numerics", "seconds"])
@pytest.mark.parametrize("bad", ["bf16", [1, 2], 3])
def test_from_json_refuses_a_field_that_is_not_an_object(field, bad):
  d = make_report().to_dict()
  d[field] = bad
  with pytest.raises(ValueError, match=rf"report field '{field}' must be an "
                     rf"object \(\{{name: value\}}\); got {re.escape(repr(bad))}"):
    DivergenceReport.from_json(json.dumps(d))


def test_from_json_reads_a_null_kernel_as_none_recorded():
  d = make_report().to_dict()
  d["kernel"] = None
  assert DivergenceReport.from_json(json.dumps(d)).kernel == {}


def test_a_zero_req_atol_says_exact_or_within_rtol():
  # req_atol 0 is no atol needed: no error at all ('exact') or every error
  # within rtol * |ref| ('in rtol'), never a bare 0 that reads as exact.
  layers = (
      LayerResult(name="exact", shape=(3,), dtype="float32",
                  metrics={"bf16": lm(0.0)}),
      LayerResult(name="within", shape=(3,), dtype="float32",
                  metrics={"bf16": lm(1e-4, 0.0)}),
      LayerResult(name="over", shape=(3,), dtype="float32",
                  metrics={"bf16": lm(2e-3)}))
  r = DivergenceReport(layers=layers, precisions=("bf16",), reference="float32",
                       target="tpu", mode="emulate", backend="cpu", atol=1e-3,
                       rtol=1e-3)
  text = r.to_text()
  rows = {l.split()[1]: l for l in text.splitlines()
          if l.split()[:1] in (["0"], ["1"], ["2"])}
  assert rows["exact"].split()[-1] == "exact"
  assert rows["within"].split()[-2:] == ["in", "rtol"]
  assert rows["over"].split()[-2:] == ["2.00e-03", "!"]
  assert "'in rtol': 0, every error within rtol*|ref|" in text
