"""Cost of emulated matmuls relative to the native float32 matmul, per kernel.

Times, in one run and on the same inputs, a jitted native float32
``lax.dot_general`` and ``jaxprec.emulated_dot_general`` at each algorithm on
each emulation kernel (``bf16``: bfloat16 dots; ``f32``: merged float32 dots;
see ``docs/emulation.md``), size x size @ size x size float32, after
compilation, as the median of interleaved repeats with ``block_until_ready``,
and prints each ratio next to its limit and the kernel that
``auto`` picks here.

    python benchmarks/bench_emulated_matmul.py [--size 1024] [--repeats 21]
    python benchmarks/bench_emulated_matmul.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import jax
import numpy as np
from jax import lax

import jaxprec

from _args import positive as _positive

MATMUL = (((1,), (0,)), ((), ()))
KERNELS = ("bf16", "f32")

# name, algorithm, target, precision, limit (None: no limit)
CASES = [
    ("1 pass (TPU DEFAULT)", "bf16x1", "tpu", "default", 1.15),
    ("3 pass (TPU HIGH)", "bf16x3", "tpu", "high", 2.3),
    ("6 pass (TPU HIGHEST)", "bf16x6", "tpu", "highest", 3.6),
    ("9 pass (BF16_BF16_F32_X9)", "bf16x9", "tpu", "BF16_BF16_F32_X9", None),
    ("TF32 (GPU DEFAULT)", "tf32", "gpu", "default", None),
    ("3 x TF32 (TF32_TF32_F32_X3)", "tf32x3", "gpu", "TF32_TF32_F32_X3", None),
]


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      text = f.read()
  except OSError:
    return platform.processor() or platform.machine()
  model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                if line.startswith("model name")), platform.machine())
  units = [u for u in ("avx512_bf16", "amx_bf16") if u in text]
  return f"{model} ({', '.join(units) if units else 'no bfloat16 dot units'})"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=_positive, default=1024)
  parser.add_argument("--repeats", type=_positive, default=21)
  parser.add_argument("--quick", action="store_true",
                      help="256^3, 3 repeats, 1/3/6 passes only: a few seconds")
  args = parser.parse_args()
  cases = CASES
  if args.quick:
    args.size, args.repeats, cases = 256, 3, CASES[:3]

  rng = np.random.default_rng(0)
  a = jax.device_put(rng.standard_normal((args.size, args.size), np.float32))
  b = jax.device_put(rng.standard_normal((args.size, args.size), np.float32))

  fns = {("native float32", ""): jax.jit(lambda x, y: lax.dot_general(x, y, MATMUL))}
  for kernel in KERNELS:
    with jaxprec.use_kernel(kernel):
      for name, _, target, precision, _ in cases:
        fn = jax.jit(functools.partial(
            jaxprec.emulated_dot_general, dimension_numbers=MATMUL,
            precision=precision, target=target))
        fn(a, b).block_until_ready()  # compiled under this kernel
        fns[(name, kernel)] = fn
  for key, fn in fns.items():  # warm up
    with jaxprec.use_kernel(key[1] or "auto"):
      fn(a, b).block_until_ready()

  times: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
  for _ in range(args.repeats):  # interleaved, so drifts hit every variant
    for key, fn in fns.items():
      with jaxprec.use_kernel(key[1] or "auto"):
        t0 = time.perf_counter()
        fn(a, b).block_until_ready()
        times[key].append(time.perf_counter() - t0)

  auto = jaxprec.current_kernel()
  kernel_of = {algorithm: auto.kernel_for(algorithm) for _, algorithm, *_ in cases}
  base = float(np.median(times[("native float32", "")]))
  load = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "?"
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {cpu_model()}, "
        f"{args.size}x{args.size} @ {args.size}x{args.size} float32, median of "
        f"{args.repeats}, load average {load}")
  print(f"auto: {auto.reason}")
  print(f"{'variant':30s} {'kernel':6s} {'ms':>8s} {'ratio':>6s}  limit")
  print(f"{'native float32':30s} {'':6s} {base * 1e3:8.2f} {1.0:6.2f}")
  for name, algorithm, _, _, limit in cases:
    for kernel in KERNELS:
      med = float(np.median(times[(name, kernel)]))
      ratio = med / base
      verdict = "" if limit is None else (f"<= {limit:.2f}  " +
                                          ("ok" if ratio <= limit else "MISSED"))
      mark = "  (auto)" if kernel_of[algorithm] == kernel else ""
      print(f"{name:30s} {kernel:6s} {med * 1e3:8.2f} {ratio:6.2f}  {verdict}{mark}")


if __name__ == "__main__":
  main()
