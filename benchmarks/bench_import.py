"""Import cost of jaxprec over `import jax, flax` (claim: under 0.3 s).

Each measurement is a fresh interpreter; the two kinds alternate so machine noise hits both.
Prints the medians side by side and their difference. Importing jaxprec runs no kernel
measurement and starts no backend, so the emulation kernel does not enter this figure.

  python benchmarks/bench_import.py [--repeats 7]
  python benchmarks/bench_import.py --quick    # 2 repeats: a few seconds
"""

import argparse
import statistics
import subprocess
import sys

from _args import positive as _positive

BASE = "import time; t=time.perf_counter(); import jax, flax; {extra}print(time.perf_counter()-t)"


def once(extra: str) -> float:
  code = BASE.format(extra=extra)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout
  return float(out.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("repeats_positional", nargs="?", type=_positive, default=None,
                  help=argparse.SUPPRESS)  # the old `bench_import.py 7`
  ap.add_argument("--repeats", type=_positive, default=7)
  ap.add_argument("--quick", action="store_true", help="2 repeats: a few seconds")
  args = ap.parse_args()
  n = 2 if args.quick else (args.repeats_positional or args.repeats)
  base, withp = [], []
  for _ in range(n):
    base.append(once(""))
    withp.append(once("import jaxprec; "))
  b, w = statistics.median(base), statistics.median(withp)
  print(f"import jax, flax:          median {b:.3f} s over {n} runs")
  print(f"import jax, flax, jaxprec: median {w:.3f} s over {n} runs")
  print(f"jaxprec adds {w - b:+.3f} s (claim: < 0.300 s); ratio {w / b:.2f}x")


if __name__ == "__main__":
  main()
