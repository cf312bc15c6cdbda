"""Cost of ``jaxprec.search_policy``: time per evaluation, and whole searches.

Claims (docs/search.md, jaxprec/_src/search/search.py):

1. An evaluation that compiles the model under its policy (the first
   evaluation of a search, or every one with ``compile_once=False``). Compiling the
   metrics as a second program, once per search, makes an evaluation about
   1.4x to 1.8x faster than one program that computes the layers and their
   metrics (built-in tiny Wav2Vec2, 2 shared CPU cores: 1.49, 1.8 and 1.37 in
   three runs).
2. ``jaxprec search --model wav2vec2 --tolerance 1e-3`` (tiny) finishes well
   under 60 s on 2 CPU cores: its evaluations, wall time and the policy's
   cost relative to float32 are printed next to the uniform policies'.
3. The search's switched program (``compile_once=True``, the default: one
   compiled program serves every evaluation after the first) against one
   program per policy (``compile_once=False``), side by side, with the same
   policy and the same metric values in every step.

    python benchmarks/bench_search.py [--policies 4] [--tolerance 1e-3] [--quick]

``--quick`` (a smoke test, seconds): one policy each way on a two-layer
function, and a search on it.

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

import jaxprec
import jaxprec.models
from jaxprec._src.checker import harness, rows

from _args import positive as _positive, non_negative_float as _tolerance
from _one_program import one_program


def _wav2vec2_policy(i: int, fused: bool) -> str:
  return (f"default=bfloat16_3x,conv_layers_{i}/conv=bfloat16,"
          f"layers_{i % 2}/attention={'float32' if fused else 'bfloat16'}")


def _quick_policy(i: int, fused: bool) -> str:
  return f"default={('bfloat16', 'float32')[i % 2]}" if fused else (
      f"default={('bfloat16_3x', 'tensorfloat32')[i % 2]}")


def per_evaluation(fn, args, n: int, make_policy=_wav2vec2_policy) -> None:
  call = harness.Args(args, {}, who="bench")
  ref = harness.build_reference(fn, call, "float32", target="tpu",
                                mode="emulate")

  def run(policy, fused):
    p = rows.plan(policy, "tpu", "emulate")
    run = one_program if fused else harness.run_candidate
    return run(fn, call, p, ref, 0.0, 0.0, cache={})
  run(jaxprec.Policy.parse("default=float32"), False)  # compiles the metrics

  times: dict[str, list[float]] = {"separate": [], "fused": []}
  for i in range(n):  # interleaved; a new policy (a new compilation) each time
    for kind in ("separate", "fused"):
      policy = jaxprec.Policy.parse(make_policy(i, kind == "fused"))
      t0 = time.perf_counter()
      run(policy, kind == "fused")
      times[kind].append(time.perf_counter() - t0)
  sep, fus = (statistics.median(times[k]) for k in ("separate", "fused"))
  print(f"time per evaluation (median of {n}, compilation included):")
  print(f"  metrics compiled once per search: {sep:6.2f} s")
  print(f"  one program with the metrics:     {fus:6.2f} s")
  print(f"  ratio fused / separate:           {fus / sep:6.2f}  (claim: about 1.4-1.8)")


def whole_search(fn, args, tolerance: float) -> None:
  """The search with one switched program and with one program per policy,
  side by side (fresh functions each, so no program is shared)."""
  runs = {}
  for once in (True, False):
    f = lambda *a, _fn=fn: _fn(*a)  # noqa: E731 -- a new function: no cached programs
    t0 = time.perf_counter()
    r = jaxprec.search_policy(f, *args, tolerance=tolerance, verbose=False,
                              compile_once=once)
    runs[once] = (r, time.perf_counter() - t0)
  uniform = {p: jaxprec.cost(fn, *args, policy=p).relative
             for p in ("bfloat16", "bfloat16_3x", "float32")}
  (r, wall), (r_per, wall_per) = runs[True], runs[False]
  print(f"search at rel_rms <= {tolerance:g}: {r.evaluations} evaluations, "
        f"meets tolerance: {r.meets_tolerance}")
  print(f"  one switched program (compile_once=True): {wall:6.1f} s "
        f"(claim: < 60 s)")
  print(f"  one program per policy:                   {wall_per:6.1f} s")
  print(f"  ratio switched / per policy:              {wall / wall_per:6.2f}")
  print(f"  same policy and history: {str(r.policy) == str(r_per.policy)} "
        f"and {[s.worst_value for s in r.history] == [s.worst_value for s in r_per.history]}")
  print(f"  policy cost vs float32: {r.cost.relative:.3f}; uniform: "
        + ", ".join(f"{k} {v:.3f}" for k, v in uniform.items()))
  print(f"  policy: {r.policy}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policies", type=_positive, default=4)
  parser.add_argument("--tolerance", type=_tolerance, default=1e-3)
  parser.add_argument("--quick", action="store_true",
                      help="a smoke test that runs in seconds")
  ns = parser.parse_args()
  print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, backend {jax.default_backend()}")
  if ns.quick:
    from bench_check import _mlp  # noqa: PLC0415 -- the same smoke-test function
    fn, args = _mlp()
    print("\n== quick: a two-layer function")
    per_evaluation(fn, args, 1, _quick_policy)
    whole_search(fn, args, 1e-4)
    return
  fn, args = jaxprec.models.wav2vec2("tiny")
  print("\n== wav2vec2 tiny")
  per_evaluation(fn, args, ns.policies)
  whole_search(fn, args, ns.tolerance)


if __name__ == "__main__":
  main()
