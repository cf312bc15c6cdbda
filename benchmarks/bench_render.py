"""Drawing a big report: jaxprec's renderer against rich's table, side by side.

A check report of LAYERS layers (default 2000) is drawn as ``report.table()``
(its boxes drawn by jaxprec, the characters rich draws), ``report.table(width=80)``,
``report.to_text(width=40)`` (a row per line) and ``report.to_markdown()``, and the
same table is drawn by ``rich.table.Table`` on a console as wide as it needs (what the
renderer used before it drew its own boxes). Each draw is timed REPEATS times,
alternating; the figures are medians and ratios to rich's. Limit: the report drawn in
under a tenth of rich's time (``report.table()``), every form under 1 s.

  python benchmarks/bench_render.py [--layers 2000] [--repeats 5]
  python benchmarks/bench_render.py --quick    # 200 layers, 2 repeats
"""

import argparse
import io
import math
import platform
import statistics
import sys
import time

from _args import positive as _positive

LIMIT = 0.1


def report(layers: int):
  from jaxprec._src.checker.metrics import LayerMetrics
  from jaxprec._src.checker.report import DivergenceReport, LayerResult

  def lm(e):
    return LayerMetrics(max_abs=e, max_rel=10 * e, rel_rms=e / 3, cosine=1.0,
                        sqnr_db=40.0, ulp_median=3.0, ulp_max=1e6,
                        frac_outside=0.25, nan=0, inf=0, required_atol=e,
                        size=12, ref_rms=0.5, ref_max_abs=1.0)
  return DivergenceReport(
      layers=tuple(LayerResult(name=f"encoder/layers_{i}/mlp/dense",
                               shape=(1, 4, 3), dtype="float32",
                               metrics={"bf16": lm(2e-3), "bf16_3x": lm(1e-5)})
                   for i in range(layers)),
      precisions=("bf16", "bf16_3x"), reference="float32", target="tpu",
      mode="emulate", backend="cpu", atol=1e-3, rtol=1e-3,
      numerics={"bf16": "bf16x1 (emulated)", "bf16_3x": "bf16x3 (emulated)"})


def with_rich(r) -> str:
  """The report's table drawn by rich, as wide as it needs."""
  from rich.console import Console
  from rich.table import Table
  from rich.text import Text
  from jaxprec._src.checker import render
  part = next(p for p in r._document().parts if isinstance(p, render.Table))
  table = Table()
  for j, col in enumerate(part.cols):
    table.add_column(Text(col), justify="left" if j in part.left else "right",
                     no_wrap=j != part.name, overflow="fold")
  for row in part.rows:
    table.add_row(*map(Text, row))
  console = Console(file=io.StringIO(), width=1 << 12, color_system=None)
  console.print(table)
  return console.file.getvalue()


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=_positive, default=2000)
  p.add_argument("--repeats", type=_positive, default=5)
  p.add_argument("--quick", action="store_true",
                 help="200 layers, 2 repeats (a smoke run)")
  a = p.parse_args()
  layers, repeats = (200, 2) if a.quick else (a.layers, a.repeats)
  r = report(layers)
  draws = {"rich.table.Table (before)": lambda: with_rich(r),
           "report.table()": r.table,
           "report.table(width=80)": lambda: r.table(width=80),
           "report.to_text(width=40)": lambda: r.to_text(width=40),
           "report.to_markdown()": r.to_markdown}
  times = {k: [] for k in draws}
  for _ in range(repeats):
    for k, draw in draws.items():
      t = time.perf_counter()
      draw()
      times[k].append(time.perf_counter() - t)
  base = statistics.median(times["rich.table.Table (before)"])
  print(f"{layers} layers, median of {repeats}; {platform.processor() or platform.machine()}, "
        f"Python {sys.version.split()[0]}")
  ok = True
  for k, ts in times.items():
    m = statistics.median(ts)
    ratio = m / base if base > 0 else math.nan
    print(f"  {k:<28} {m:8.4f} s  {ratio:6.3f}x rich")
    ok &= m < 1.0
  mine = statistics.median(times["report.table()"]) / base
  ok &= mine < LIMIT
  print(f"report.table(): {mine:.3f}x rich's time (limit {LIMIT}x); every form "
        f"under 1 s: {'yes' if ok else 'NO'}")
  return 0 if ok or a.quick else 1


if __name__ == "__main__":
  sys.exit(main())
