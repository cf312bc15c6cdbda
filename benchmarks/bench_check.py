"""Cost of ``jaxprec.check``: time and peak memory next to plain forward passes.

Claims (docs/checker.md): after compilation, a check with P precisions takes at
most 1.2x the time of the P + 1 forward passes it must run (the reference
forward and one forward at each precision, emulated where the check emulates);
its peak memory stays near one reference run plus one candidate run, whatever
P is.

Time: medians of interleaved repeats (block_until_ready), every program
compiled beforehand; ``check`` reuses its cached programs.

Memory: on CPU the JAX client reports no runtime memory statistics
(``device.memory_stats()`` is None) and tracemalloc does not see XLA's
buffers, so peaks are XLA's own buffer assignment for each compiled program
(``compiled.memory_analysis().peak_memory_in_bytes``: arguments, outputs and
temporaries live at once). A check's peak is the largest over its programs
(the reference program, then one candidate program per precision, whose
arguments include the kept reference). After a check, ``jax.live_arrays()``
shows what it left on the device.

    python benchmarks/bench_check.py [--model wav2vec2] [--sizes small,base]
        [--seconds 1.0] [--repeats 7] [--quick] [--forms]

``--forms``: a first check (compile and run, a new function each time) and
a check after compile, of a check's rows as they run (each row's layers,
then one metrics program shared by the rows) next to one program per row
computing its layers and their metrics together; alternating, medians of
``--repeats``.

``--quick`` (a smoke test, seconds): a two-layer function, one repeat.

The metrics cost a fixed few nanoseconds per hidden-state element per
precision; the forward pass costs FLOPs. So the ratio is largest for models
whose outputs are big next to their compute (wav2vec2's conv feature
encoder at small widths) and falls toward 1 at real sizes: both are printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

import jaxprec
import jaxprec.models
from jaxprec._src.checker import harness, rows
from jaxprec._src.core import numerics

from _args import positive as _positive, positive_float as _positive_float
from _one_program import one_program

PRECISIONS = rows.DEFAULT_ROWS["tpu"]  # a check's default rows


def _peak(compiled) -> int:
  m = compiled.memory_analysis()
  peak = getattr(m, "peak_memory_in_bytes", 0)
  return peak or (m.argument_size_in_bytes + m.output_size_in_bytes
                  + m.temp_size_in_bytes)


def _live_bytes() -> int:
  return sum(x.nbytes for x in jax.live_arrays())


def _mb(n: float) -> str:
  return f"{n / 2**20:7.1f} MB"


def _mlp():
  """A two-layer function (the --quick smoke test)."""
  def fn(w, x):
    h = jnp.tanh(x @ w)
    return {"h": h, "out": jnp.tanh(h @ w)}
  w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
  x = jax.random.normal(jax.random.key(1), (8, 64))
  return fn, (w, x)


def _model(model: str, size: str, seconds: float):
  if model == "wav2vec2":
    return jaxprec.models.wav2vec2(size, seconds=seconds)
  if model == "mlp":
    return _mlp()
  return jaxprec.models.bert(size)


def row_programs(fn, call, p, ref) -> tuple[Any, Any]:
  """A check row's two compiled programs: its layers, then their metrics."""
  layers = harness._layers_program(  # noqa: SLF001
      fn, call, lambda f, _: p.wrap(f), ("layers", p.key), tuple(ref.names),
      None, p.label)
  values = layers(None, call.dynamic)
  hi, lo, stats, _, atol, rtol = harness.candidate_args(call, ref, 1e-3, 1e-3)
  metrics = harness._metrics_program(ref.layout, True)  # noqa: SLF001
  return (layers.lower(None, call.dynamic).compile(),
          metrics.lower(values, hi, lo, stats, atol, rtol).compile())


def bench(model: str, size: str, seconds: float, repeats: int) -> None:
  fn, args = _model(model, size, seconds)
  target, mode = "tpu", numerics.resolve_mode("auto", "tpu")
  plans = [rows.plan(p, target, mode) for p in PRECISIONS]
  ref_plan = harness.reference_plan("float32", target, mode)
  print(f"\n== {model} {size}; target {target}, mode {mode}")

  # Plain forward passes: the reference and one per precision.
  fwd = {"reference": jax.jit(ref_plan.wrap(fn))}
  for p in plans:
    fwd[p.label] = jax.jit(p.wrap(fn))
  for f in fwd.values():
    jax.block_until_ready(f(*args))
  checks = {}
  for n in range(1, len(PRECISIONS) + 1):
    names = PRECISIONS[:n]
    checks[n] = (lambda names=names: jaxprec.check(fn, *args, precisions=names,
                                                   mode=mode))
    checks[n]()  # compile (the programs are shared between the P values)

  times: dict[str, list[float]] = {k: [] for k in fwd}
  ctimes: dict[int, list[float]] = {n: [] for n in checks}
  for _ in range(repeats):  # interleaved, so load from elsewhere hits all
    for k, f in fwd.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      times[k].append(time.perf_counter() - t0)
    for n, c in checks.items():
      t0 = time.perf_counter()
      c()
      ctimes[n].append(time.perf_counter() - t0)

  print(f"time after compile (median of {repeats} interleaved runs):")
  for k, v in times.items():
    desc = ref_plan.description if k == "reference" else next(
        p.description for p in plans if p.label == k)
    print(f"  forward {k:<14} {desc:<30} {1e3 * statistics.median(v):9.2f} ms")
  print(f"  {'P':>2}  {'check':>10}  {'P+1 forwards':>12}  {'ratio':>5}  "
        f"{'target':>6}  {'vs (P+1) x f32 fwd':>18}")
  for n, v in ctimes.items():
    keys = ["reference", *PRECISIONS[:n]]
    base = sum(statistics.median(times[k]) for k in keys)
    c = statistics.median(v)
    native = (n + 1) * statistics.median(times["reference"])
    print(f"  {n:>2}  {1e3 * c:8.2f}ms  {1e3 * base:10.2f}ms  {c / base:5.2f}  "
          f"{'<=1.20':>6}  {c / native:18.2f}")

  # Memory.
  call = harness.Args(args, {}, who="bench")
  ref = harness.build_reference(fn, call, "float32", target=target, mode=mode)
  ref_prog = harness._reference_program(fn, call, ref_plan, None, None)  # noqa: SLF001
  ref_peak = _peak(ref_prog.lower(call.dynamic).compile())
  fwd_peak = {k: _peak(f.lower(*args).compile()) for k, f in fwd.items()}
  kept = ref.hi.nbytes + (0 if ref.lo is None else ref.lo.nbytes)
  # A row is two programs: its layers (while the packed reference is kept),
  # then their metrics (the layers and the reference are its arguments).
  cand_peak = {p.label: max(_peak(c) + extra for c, extra in zip(
      row_programs(fn, call, p, ref), (kept, 0))) for p in plans}
  arg_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(args))
  del ref
  print("peak memory (XLA buffer assignment of each compiled program):")
  print(f"  model arguments (params + input)        {_mb(arg_bytes)}")
  for k, v in fwd_peak.items():
    print(f"  forward {k:<14}                  {_mb(v)}")
  print(f"  kept reference layers (packed float32)  {_mb(kept)}")
  print(f"  check: reference program                {_mb(ref_peak)}")
  for p in PRECISIONS:
    print(f"  check: {p:<14} program          {_mb(cand_peak[p])}")
  print(f"  {'P':>2}  {'check peak':>10}  {'ref run + candidate run':>23}  "
        f"{'ratio':>5}")
  for n in range(1, len(PRECISIONS) + 1):
    peak = max([ref_peak] + [cand_peak[p] for p in PRECISIONS[:n]])
    # One reference forward plus one candidate forward, sharing the arguments.
    pair = (fwd_peak["reference"] + max(fwd_peak[p] for p in PRECISIONS[:n])
            - arg_bytes)
    print(f"  {n:>2}  {_mb(peak):>10}  {_mb(pair):>23}  {peak / pair:5.2f}")
  before = _live_bytes()
  checks[len(PRECISIONS)]()
  after = _live_bytes()
  print(f"  device arrays left alive by a check: {_mb(after - before)}")


def forms(model: str, size: str, seconds: float, repeats: int) -> None:
  """A first check and a check after compile, in each form, side by side."""
  fn, args = _model(model, size, seconds)
  mode = numerics.resolve_mode("auto", "tpu")
  runs = {"layers, then metrics": harness.run_candidate,
          "one program per row": one_program}
  first: dict[str, list[float]] = {k: [] for k in runs}
  after: dict[str, list[float]] = {k: [] for k in runs}
  for _ in range(repeats):
    for form, run in runs.items():
      harness.run_candidate = run
      try:
        g = lambda *a: fn(*a)  # noqa: E731 -- a new function: nothing cached
        t0 = time.perf_counter()
        jaxprec.check(g, *args, mode=mode)
        first[form].append(time.perf_counter() - t0)
        times = []
        for _ in range(3):
          t0 = time.perf_counter()
          jaxprec.check(g, *args, mode=mode)
          times.append(time.perf_counter() - t0)
        after[form].append(statistics.median(times))
      finally:
        harness.run_candidate = runs["layers, then metrics"]
  print(f"\n== {model} {size}: the default rows ({', '.join(PRECISIONS)}), "
        f"medians of {repeats} alternating runs")
  for form in runs:
    print(f"  {form:<22} first check {statistics.median(first[form]):7.2f} s"
          f"   after compile {1e3 * statistics.median(after[form]):9.2f} ms")
  one, two = "one program per row", "layers, then metrics"
  print(f"  ratio (as they run / one program per row): first check "
        f"{statistics.median(first[two]) / statistics.median(first[one]):.2f}x"
        f", after compile "
        f"{statistics.median(after[two]) / statistics.median(after[one]):.2f}x")


def _sizes(text: str) -> str:
  sizes = ("tiny", "small", "base")
  bad = [s.strip() for s in text.split(",") if s.strip() not in sizes]
  if bad:
    raise argparse.ArgumentTypeError(
        f"unknown size {bad[0]!r}; choose from {', '.join(sizes)}")
  return text


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="wav2vec2", choices=("wav2vec2", "bert", "mlp"))
  parser.add_argument("--sizes", default="small,base", type=_sizes,
                      help="comma-separated sizes (tiny, small, base)")
  parser.add_argument("--seconds", type=_positive_float, default=1.0,
                      help="audio length for wav2vec2")
  parser.add_argument("--repeats", type=_positive, default=7)
  parser.add_argument("--quick", action="store_true",
                      help="a smoke test that runs in seconds")
  parser.add_argument("--forms", action="store_true",
                      help="a first check and a check after compile, as the "
                           "rows run and as one program per row")
  a = parser.parse_args()
  if a.quick:
    a.model, a.sizes, a.repeats = "mlp", "-", 1
  print(f"jaxprec {jaxprec.__version__}, jax {jax.__version__}, backend "
        f"{jax.default_backend()}, {os.cpu_count()} CPUs "
        f"({platform.machine()}); precisions: {', '.join(PRECISIONS)}")
  for size in a.sizes.split(","):
    (forms if a.forms else bench)(a.model, size.strip(), a.seconds, a.repeats)


if __name__ == "__main__":
  main()
