"""Cost of ``jaxprec.search_policy``: time per evaluation, and whole searches.

Claims (docs/search.md, jaxprec/_src/search.py):

1. Each evaluation compiles the model under one policy. Compiling the
   metrics as a second program, once per search, makes an evaluation about
   1.4x to 1.8x faster than one program that computes the layers and their
   metrics (built-in tiny Wav2Vec2, 2 shared CPU cores: 1.49, 1.8 and 1.37 in
   three runs).
2. ``jaxprec search --model wav2vec2 --tolerance 1e-3`` (tiny) finishes well
   under 60 s on 2 CPU cores: its evaluations, wall time and the policy's
   cost relative to float32 are printed next to the uniform policies'.

    python benchmarks/bench_search.py [--policies 4] [--tolerance 1e-3]

Times include tracing and XLA compilation (what an evaluation costs); the
policies differ, so nothing is cached between them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import numpy as np

import jaxprec
import jaxprec.models
from jaxprec._src import metrics as metrics_lib
from jaxprec._src import search as search_lib


def per_evaluation(fn, args, n: int) -> None:
  call = search_lib._Args(args, {})  # noqa: SLF001
  shapes = jaxprec.named_layers(jax.eval_shape(fn, *args))
  names = list(shapes)
  layout = metrics_lib.Layout(tuple(int(np.prod(v.shape))
                                    for v in shapes.values()))
  runner = search_lib._Runner(  # noqa: SLF001
      fn, call, names, layout, "tpu", "emulate")
  reference = search_lib._float32_reference(fn)  # noqa: SLF001
  ref = runner.layers_program(reference)(call.dynamic)
  runner.set_reference(ref)
  runner.run(jaxprec.Policy.parse("default=float32"))  # compiles the metrics

  def fused(policy):
    wrapped = runner.wrap(policy)

    def program(dynamic, hi, stats):
      values = search_lib._select(call.call(wrapped, dynamic), names)  # noqa: SLF001
      return metrics_lib.layer_stats(values, hi, None, stats, layout,
                                     atol=0.0, rtol=0.0), values
    stats, _ = jax.jit(program)(call.dynamic, runner.hi, runner.stats)
    return metrics_lib.finish(jax.device_get(stats), layout)

  times: dict[str, list[float]] = {"separate": [], "fused": []}
  for i in range(n):  # interleaved; a new policy (a new compilation) each time
    for kind in ("separate", "fused"):
      policy = jaxprec.Policy.parse(
          f"default=bfloat16_3x,conv_layers_{i}/conv=bfloat16,"
          f"layers_{i % 2}/attention={'float32' if kind == 'fused' else 'bfloat16'}")
      t0 = time.perf_counter()
      (runner.run if kind == "separate" else fused)(policy)
      times[kind].append(time.perf_counter() - t0)
  sep, fus = (statistics.median(times[k]) for k in ("separate", "fused"))
  print(f"time per evaluation (median of {n}, compilation included):")
  print(f"  metrics compiled once per search: {sep:6.2f} s")
  print(f"  one program with the metrics:     {fus:6.2f} s")
  print(f"  ratio fused / separate:           {fus / sep:6.2f}  (claim: about 1.4-1.8)")


def whole_search(fn, args, tolerance: float) -> None:
  t0 = time.perf_counter()
  r = jaxprec.search_policy(fn, *args, tolerance=tolerance, verbose=False)
  wall = time.perf_counter() - t0
  uniform = {p: jaxprec.cost(fn, *args, policy=p).relative
             for p in ("bfloat16", "bfloat16_3x", "float32")}
  print(f"search at rel_rms <= {tolerance:g}: {r.evaluations} evaluations, "
        f"{wall:.1f} s (claim: < 60 s), meets tolerance: {r.meets_tolerance}")
  print(f"  policy cost vs float32: {r.cost.relative:.3f}; uniform: "
        + ", ".join(f"{k} {v:.3f}" for k, v in uniform.items()))
  print(f"  policy: {r.policy}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policies", type=int, default=4)
  parser.add_argument("--tolerance", type=float, default=1e-3)
  ns = parser.parse_args()
  print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, backend {jax.default_backend()}")
  fn, args = jaxprec.models.wav2vec2("tiny")
  print("\n== wav2vec2 tiny")
  per_evaluation(fn, args, ns.policies)
  whole_search(fn, args, ns.tolerance)


if __name__ == "__main__":
  main()
