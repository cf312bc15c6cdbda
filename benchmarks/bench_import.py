"""Import cost of jaxprec over `import jax, flax.linen, flax.nnx` (limit: under 0.05 s).

Each measurement is a fresh interpreter that imports jax, flax.linen and flax.nnx (the
base) or those and then jaxprec; the two kinds alternate so machine noise hits both.
Figures: the whole process's wall time and CPU time (user + system, as the OS reports
it), base against with-jaxprec, medians side by side, their difference and its spread
(quartiles of the per-pair differences); and jaxprec's own import, timed inside the
with-jaxprec processes after jax and flax are imported (time.perf_counter and
time.process_time), which is the same delta measured without subtracting two large
numbers. On a loaded machine the wall times swing by seconds and the CPU times by tenths:
read the in-process figure there.

Bytecode is cached as in an installed package: the interpreters write and read .pyc
files under a temporary PYTHONPYCACHEPREFIX (even where PYTHONDONTWRITEBYTECODE is set),
after one warm-up run of each kind. `--no-bytecode` compiles jaxprec's modules from
source in every run (PYTHONDONTWRITEBYTECODE=1, an editable checkout without .pyc).
Importing jaxprec runs no kernel measurement and starts no backend.

  python benchmarks/bench_import.py [--repeats 21]
  python benchmarks/bench_import.py --quick    # 2 repeats
"""

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from _args import positive as _positive

LIMIT = 0.05
BASE = ("import jax, flax.linen, flax.nnx, time; t, c = time.perf_counter(), "
        "time.process_time(); {extra}print(time.perf_counter() - t, time.process_time() - c)")


def once(extra: str, env: dict[str, str]) -> tuple[float, ...]:
  """Seconds of one fresh interpreter: the whole process's wall and CPU time, then
  the wall and CPU time of ``extra`` (run after jax and flax are imported)."""
  t, r = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
  out = subprocess.run([sys.executable, "-c", BASE.format(extra=extra)], env=env,
                       capture_output=True, text=True, check=True).stdout
  wall, r2 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = r2.ru_utime - r.ru_utime + r2.ru_stime - r.ru_stime
  return (wall, cpu, *map(float, out.strip().splitlines()[-1].split()))


def cpu() -> str:
  """The CPU's model name and whether it has AVX-512 and bfloat16 dot units."""
  info = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  flags = set(info.get("flags", "").split())
  model = info.get("model name") or platform.processor() or platform.machine()
  has = lambda flag: f"{flag} {'yes' if flag in flags else 'no'}"  # noqa: E731
  cores = os.cpu_count()
  return (f"{model}, {cores} cores: {has('avx512f')}, {has('avx512_bf16')}, "
          f"{has('amx_bf16')}; load average {os.getloadavg()[0]:.1f}")


def _side_by_side(what: str, base: list[float], withp: list[float]) -> str:
  b, w = statistics.median(base), statistics.median(withp)
  pairs = [x - y for x, y in zip(withp, base)]
  q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
  span = lambda xs: f"{min(xs):.3f}..{max(xs):.3f}"  # noqa: E731
  return (f"{what + ':':<20} jax+flax {b:.3f} s ({span(base)}), +jaxprec {w:.3f} s "
          f"({span(withp)})\n{'':<20} jaxprec adds {w - b:+.3f} s (limit: < {LIMIT:.3f} s); "
          f"ratio {w / b:.3f}x; per-pair differences' quartiles {q[0]:+.3f} / {q[1]:+.3f} / "
          f"{q[2]:+.3f} s")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("repeats_positional", nargs="?", type=_positive, default=None,
                  help=argparse.SUPPRESS)  # the old `bench_import.py 7`
  ap.add_argument("--repeats", type=_positive, default=21)
  ap.add_argument("--quick", action="store_true", help="2 repeats (figures too noisy to read)")
  ap.add_argument("--no-bytecode", action="store_true",
                  help="compile jaxprec from source in every run (no .pyc)")
  args = ap.parse_args()
  n = 2 if args.quick else (args.repeats_positional or args.repeats)
  import flax  # noqa: PLC0415 -- versions for the header only
  import jax  # noqa: PLC0415
  print(f"CPU: {cpu()}")
  print(f"Python {platform.python_version()}, jax {jax.__version__}, "
        f"flax {flax.__version__}, {n} interleaved runs of each kind")
  with tempfile.TemporaryDirectory() as cache:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    if args.no_bytecode:
      env["PYTHONDONTWRITEBYTECODE"] = "1"
      print("bytecode: none for jaxprec (PYTHONDONTWRITEBYTECODE=1)")
    else:
      env.pop("PYTHONDONTWRITEBYTECODE", None)
      env["PYTHONPYCACHEPREFIX"] = cache
      print("bytecode: cached (one warm-up run of each kind first)")
      once("import jaxprec; ", env)
      once("", env)
    base, withp = [], []
    for _ in range(n):
      base.append(once("", env))
      withp.append(once("import jaxprec; ", env))
  print("medians (min..max) in seconds:")
  for i, what in enumerate(("whole process, wall", "whole process, CPU")):
    print(_side_by_side(what, [x[i] for x in base], [x[i] for x in withp]))
  wall, used = [x[2] for x in withp], [x[3] for x in withp]
  print(f"{'in process:':<20} `import jaxprec` after jax and flax: wall "
        f"{statistics.median(wall):.3f} s ({min(wall):.3f}..{max(wall):.3f}), CPU "
        f"{statistics.median(used):.3f} s ({min(used):.3f}..{max(used):.3f}) "
        f"(limit: < {LIMIT:.3f} s)")


if __name__ == "__main__":
  main()
