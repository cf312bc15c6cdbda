"""DivergenceReport.plot: what the figure says, read from the matplotlib
Figure object (its lines, labels and y data), never from pixels."""

from __future__ import annotations

import math
import sys

import pytest

pytest.importorskip("matplotlib")

from jaxprec._src.checker import render  # noqa: E402
from jaxprec._src.checker.metrics import LayerMetrics  # noqa: E402
from jaxprec._src.checker.report import DivergenceReport, LayerResult  # noqa: E402
from jaxprec._src.core import algorithms  # noqa: E402
from jaxprec._src.core.version import install_hint  # noqa: E402


def lm(rel_rms: float, max_abs: float | None = None) -> LayerMetrics:
  max_abs = rel_rms * 2 if max_abs is None else max_abs
  return LayerMetrics(
      max_abs=max_abs, max_rel=max_abs * 10, rel_rms=rel_rms, cosine=1.0,
      sqnr_db=40.0, ulp_median=3.0, ulp_max=10.0, frac_outside=0.0, nan=0,
      inf=0, required_atol=max_abs, size=12, ref_rms=0.5, ref_max_abs=1.0)


NUMERICS = {"bfloat16": "bf16x1 (tpu, emulated)",
            "bfloat16_3x": "bf16x3 (tpu, emulated)",
            "tensorfloat32": "tf32 (gpu, emulated)",
            "float32": "f32 (native cpu)",
            "default=bfloat16,dense=float32": "policy (tpu, emulated)"}


def report(values: dict[str, list[float]], *, floor: str | None = None,
           atol: float = 1e-3, rtol: float = 2e-3, target: str = "tpu",
           numerics: dict[str, str] | None = None) -> DivergenceReport:
  """A report whose rows have these rel_rms values, layer by layer."""
  precisions = tuple(values)
  n = len(next(iter(values.values())))
  layers = tuple(
      LayerResult(name=f"hidden_states[{i}]", shape=(2, 3), dtype="float32",
                  metrics={p: lm(values[p][i]) for p in precisions})
      for i in range(n))
  return DivergenceReport(
      layers=layers, precisions=precisions, reference="float32", target=target,
      mode="emulate", backend="cpu", atol=atol, rtol=rtol, floor=floor,
      numerics=numerics or {p: NUMERICS[p] for p in precisions})


def lines(fig) -> dict[str, object]:
  return {l.get_label(): l for l in fig.axes[0].get_lines()}


def legend(fig) -> list[str]:
  return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_legend_says_what_the_target_computes_from_the_table():
  r = report({"bfloat16": [1e-2, 2e-2], "bfloat16_3x": [1e-5, 2e-5],
              "tensorfloat32": [1e-4, 1e-4], "float32": [1e-7, 1e-7],
              "default=bfloat16,dense=float32": [1e-3, 1e-3]})
  texts = legend(r.plot())
  assert texts[:5] == [
      "bfloat16: bfloat16, 1 pass (TPU default), emulated",
      "bfloat16_3x: bfloat16, 3 passes (TPU HIGH), emulated",
      "tensorfloat32: tensorfloat32, 1 pass (GPU default), emulated",
      "float32: exact float32, native cpu",
      "default=bfloat16,dense=float32 (policy (tpu, emulated))",
  ]
  assert not any("bf16x1" in t for t in texts)


@pytest.mark.parametrize("target", algorithms.TARGETS)
@pytest.mark.parametrize("level", ["DEFAULT", "HIGH", "HIGHEST"])
def test_every_level_is_named_from_the_one_table(target, level):
  algo = algorithms.LEVELS[target][level]
  record = algorithms.RECORDS[algo]
  r = report({"x": [1e-3]}, target=target,
             numerics={"x": f"{algo} (emulated)"})
  label = render.plot_label(r, "x")
  if record.pass_format == "float32":
    assert label == "x: exact float32 (GPU HIGHEST), emulated"
  else:
    assert f"{record.pass_format}, {record.passes} pass" in label
    # The first level that runs the algorithm names it (GPU HIGH is TF32,
    # the same as its DEFAULT).
    first = next(k for k, v in algorithms.LEVELS[target].items() if v == algo)
    word = "default" if first == "DEFAULT" else first
    assert label.endswith(f"({target.upper()} {word}), emulated")


def test_the_plot_says_pass_and_fail_as_the_table_does():
  # The gate is elementwise (|err| <= atol + rtol*|ref|): a rel_rms under
  # rtol can fail it. So the check's tolerance is a line only on
  # required_atol, and on every metric the failing layers are ringed.
  # Layer 0 passes (req_atol 2e-4 <= 1e-3), layer 1 fails (2e-3) although its
  # rel_rms (1e-3) is under rtol (2e-3).
  r = report({"bfloat16": [1e-4, 1e-3]}, atol=1e-3, rtol=2e-3)
  assert [l.metrics["bfloat16"].passes(r.atol) for l in r.layers] == [True,
                                                                      False]
  for metric in ("rel_rms", "max_abs", "required_atol", "cosine"):
    ls = lines(r.plot(metric=metric))
    (ring,) = [l for k, l in ls.items() if k == "_fails"]
    assert list(ring.get_xdata()) == [1] and ring.get_markeredgecolor() == "tab:red"
    assert any(t.startswith("fails the check's gate") for t in
               legend(r.plot(metric=metric)))
    tol = [k for k in ls if k.startswith("the check's atol")]
    assert (len(tol) == 1) == (metric == "required_atol"), (metric, tol)
  (atol_line,) = [l for k, l in lines(r.plot(metric="required_atol")).items()
                  if k.startswith("the check's atol")]
  assert list(atol_line.get_ydata()) == [1e-3, 1e-3]
  assert atol_line.get_color() == "tab:red" and atol_line.get_linestyle() == ":"
  # A tolerance of the user's own is drawn in the metric's units.
  own = lines(r.plot(tolerance=5e-4))["tolerance: rel_rms = 0.0005"]
  assert list(own.get_ydata()) == [5e-4, 5e-4]
  ok = report({"bfloat16": [1e-4, 2e-4]}, atol=1e-3)
  assert "_fails" not in lines(ok.plot())
  assert not any(k.startswith(("tolerance", "the check's")) for k in
                 lines(r.plot(tolerance=0, metric="required_atol")))
  with pytest.raises(ValueError, match="tolerance must be a finite number"):
    r.plot(tolerance=-1.0)


def test_an_exact_layer_is_drawn_at_a_floor_with_its_own_marker():
  r = report({"bfloat16": [0.0, 1e-2, 3e-2], "bfloat16_3x": [0.0, 0.0, 4e-5]})
  fig = r.plot()
  ls = lines(fig)
  main = ls["bfloat16: bfloat16, 1 pass (TPU default), emulated"]
  # The line itself has no value at the exact layer (a log axis cannot show 0)...
  assert math.isnan(main.get_ydata()[0]) and list(main.get_ydata()[1:]) == [1e-2, 3e-2]
  # ...which is a hollow triangle at a floor below every value and the tolerance.
  exact = [l for l in fig.axes[0].get_lines()
           if l.get_marker() == "v" and len(l.get_xdata())]
  assert len(exact) == 2
  floor = exact[0].get_ydata()[0]
  assert floor == pytest.approx(1e-6)  # a power of ten below 4e-5
  assert all(set(l.get_ydata()) == {floor} for l in exact)
  assert sorted(round(x) for l in exact for x in l.get_xdata()) == [0, 0, 1]
  assert exact[0].get_markeredgecolor() == main.get_color()
  assert exact[0].get_markerfacecolor() == "none"
  assert "exact (0), drawn at 1e-06" in legend(fig)
  assert floor < fig.axes[0].get_ylim()[1] and floor > fig.axes[0].get_ylim()[0]
  no_exact = report({"bfloat16": [1e-2, 2e-2]}).plot()
  assert not any(t.startswith("exact") for t in legend(no_exact))


def test_the_legend_hides_no_line_the_floor_included():
  """The legend sits beside the axes: nothing it covers is data."""
  r = report({"float32": [5e-7, 6e-7, 5e-7, 4e-7],
              "bfloat16": [1.5e-2, 3.4e-2, 2e-2, 2.5e-2]}, floor="float32")
  fig = r.plot()
  floor = lines(fig)["float32 (framework floor)"]
  assert floor.get_linestyle() == "--" and floor.get_color() == "grey"
  assert "float32 (framework floor)" in legend(fig)
  fig.draw_without_rendering()
  box = fig.axes[0].get_legend().get_window_extent()
  axes = fig.axes[0].get_window_extent()
  assert box.x0 >= axes.x1  # entirely to the right of the plotting area
  assert box.x1 <= fig.bbox.x1 + 1  # and inside the figure


def test_long_layer_names_and_policies_fit_the_figure_without_a_warning(
    tmp_path):
  """Layer names of 120 characters collapsed the constrained layout (a
  UserWarning, the legend and the axis cut off): the ticks show each name's
  tail, long legend entries fold, and everything drawn lies in the figure."""
  import dataclasses
  import warnings
  policy = ",".join(f"encoder/layers_{i}/attention/.*=float32"
                    for i in range(4)) + ",default=bfloat16"
  r = report({"bfloat16": [1e-2, 2e-2, 3e-2], policy: [1e-3, 1e-3, 2e-3]},
             numerics={"bfloat16": "bf16x1 (emulated)",
                       policy: "policy (emulated)"})
  stem = ("encoder/" + "a_rather_long_submodule_name/" * 4)[:116]
  names = [f"{stem}{i}/out"[-120:] for i in range(3)]
  assert all(len(n) == 120 for n in names)
  r = dataclasses.replace(r, layers=tuple(
      dataclasses.replace(l, name=n) for l, n in zip(r.layers, names)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fig = r.plot(tmp_path / "long.png")
    fig.draw_without_rendering()
  ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
  assert len(set(ticks)) == 3 and all(len(t) <= render.TICK_CHARS
                                      for t in ticks)
  assert all(t.startswith("…") and n.endswith(t[1:])
             for t, n in zip(ticks, names))  # the tail: what tells them apart
  assert all(len(line) <= render.LEGEND_CHARS
             for t in legend(fig) for line in t.split("\n"))
  assert policy in "".join(legend(fig)).replace("\n", "")
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  box = fig.get_tightbbox(FigureCanvasAgg(fig).get_renderer())
  page = fig.bbox_inches
  assert (box.x0 >= page.x0 and box.y0 >= page.y0 and box.x1 <= page.x1
          and box.y1 <= page.y1), (box, page)


def test_shortened_tick_labels_stay_apart():
  same_tail = ["a" * 40 + "/out", "b" * 40 + "/out"]
  assert render.tick_labels(same_tail, chars=8) == ["…aaa/out", "…bbb/out"]
  assert render.tick_labels(same_tail, chars=5) == ["#0 …/out", "#1 …/out"]
  assert render.tick_labels(["short", "x/y"]) == ["short", "x/y"]


def test_plot_saves_a_png_and_names_the_extra_when_missing(tmp_path, monkeypatch):
  path = tmp_path / "d.png"
  r = report({"bfloat16": [0.0, 1e-2]})
  fig = r.plot(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert fig.axes[0].get_yscale() == "log"
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
  with pytest.raises(ImportError) as e:
    r.plot(tmp_path / "e.png")
  assert install_hint("plots") in str(e.value)
