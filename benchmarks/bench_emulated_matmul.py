"""Cost of emulated matmuls relative to the native float32 matmul.

Times, in one run and on the same inputs, a jitted native float32
``lax.dot_general`` and ``jaxprec.emulated_dot_general`` at each algorithm
(size x size @ size x size, float32), after compilation, as the median of
interleaved repeats with ``block_until_ready``, and prints each ratio next to
its target.

    python benchmarks/bench_emulated_matmul.py [--size 1024] [--repeats 21]
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import numpy as np
from jax import lax

import jaxprec

MATMUL = (((1,), (0,)), ((), ()))

# name, target, precision, target ratio (None: no target)
CASES = [
    ("1 pass (bf16x1, TPU DEFAULT)", "tpu", "default", 1.3),
    ("3 pass (bf16x3, TPU HIGH)", "tpu", "high", 2.5),
    ("6 pass (bf16x6, TPU HIGHEST)", "tpu", "highest", 5.0),
    ("9 pass (BF16_BF16_F32_X9)", "tpu", "BF16_BF16_F32_X9", None),
    ("TF32 (GPU DEFAULT)", "gpu", "default", None),
    ("3 x TF32 (TF32_TF32_F32_X3)", "gpu", "TF32_TF32_F32_X3", None),
]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=21)
  args = parser.parse_args()

  rng = np.random.default_rng(0)
  a = jax.device_put(rng.standard_normal((args.size, args.size), np.float32))
  b = jax.device_put(rng.standard_normal((args.size, args.size), np.float32))

  fns = {"native float32": jax.jit(lambda x, y: lax.dot_general(x, y, MATMUL))}
  for name, target, precision, _ in CASES:
    fns[name] = jax.jit(functools.partial(
        jaxprec.emulated_dot_general, dimension_numbers=MATMUL,
        precision=precision, target=target))
  for fn in fns.values():  # compile and warm up
    fn(a, b).block_until_ready()
    fn(a, b).block_until_ready()

  times: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(args.repeats):  # interleaved, so drifts hit every variant
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn(a, b).block_until_ready()
      times[name].append(time.perf_counter() - t0)

  base = float(np.median(times["native float32"]))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{platform.processor() or platform.machine()}, "
        f"{args.size}x{args.size} @ {args.size}x{args.size} float32, "
        f"median of {args.repeats}")
  print(f"{'variant':34s} {'ms':>8s} {'ratio':>6s}  target")
  print(f"{'native float32':34s} {base * 1e3:8.2f} {1.0:6.2f}")
  targets = {name: t for name, _, _, t in CASES}
  for name in fns:
    if name == "native float32":
      continue
    med = float(np.median(times[name]))
    ratio = med / base
    t = targets[name]
    verdict = "" if t is None else (f"<= {t:.1f}  " +
                                    ("ok" if ratio <= t else "MISSED"))
    print(f"{name:34s} {med * 1e3:8.2f} {ratio:6.2f}  {verdict}")


if __name__ == "__main__":
  main()
