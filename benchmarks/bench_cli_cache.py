"""A second ``jaxprec check`` against the first: JAX's persistent compilation cache.

Claim (docs/performance.md): a warm ``jaxprec check --model
wav2vec2`` (its compiled programs in the cache from an earlier run) takes at
most 0.5x the wall time of a cold one (an empty ``JAXPREC_CACHE_DIR``).

Each repeat runs, as separate processes, in a fresh empty cache directory:
``jaxprec check`` (cold: it compiles and fills the cache), the same command
again (warm: it loads the programs), and the command with ``--no-cache``
(today's cost without the cache). Wall times include starting Python and
importing JAX, which the cache cannot save. Printed: medians and ratios to
the cold run, side by side; ``--search`` adds ``jaxprec search --tolerance
1e-3`` (cold cache) against the cold check.

    python benchmarks/bench_cli_cache.py [--model wav2vec2] [--size tiny]
        [--repeats 3] [--search] [--quick]

``--quick`` (a smoke test, seconds): a two-matmul function instead of the
model, one repeat.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from _args import positive as _positive

_QUICK_TARGET = '''
import jax, jax.numpy as jnp

def f(w, x):
  h = jnp.tanh(x @ w)
  return {"h": h, "out": h @ w}

def make():
  w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
  x = jax.random.normal(jax.random.key(1), (8, 64))
  return f, (w, x)
'''


def _jaxprec(args: list[str], cache: str, out: str) -> float:
  """Seconds of wall time of ``jaxprec ARGS`` in a new process."""
  env = dict(os.environ, JAXPREC_CACHE_DIR=cache)
  cmd = [sys.executable, "-m", "jaxprec", *args]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                        cwd=out)
  seconds = time.perf_counter() - t0
  if proc.returncode not in (0, 1):  # search exits 1 when nothing passes
    raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                     f"{proc.stderr[-2000:]}")
  return seconds


def _files(path: str) -> tuple[int, int]:
  n = size = 0
  for root, _, names in os.walk(path):
    for name in names:
      n += 1
      size += os.path.getsize(os.path.join(root, name))
  return n, size


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="wav2vec2", choices=("wav2vec2", "bert"))
  ap.add_argument("--size", default="tiny", choices=("tiny", "small", "base"))
  ap.add_argument("--repeats", type=_positive, default=3)
  ap.add_argument("--search", action="store_true",
                  help="also time jaxprec search --tolerance 1e-3")
  ap.add_argument("--quick", action="store_true",
                  help="a two-matmul function, one repeat (smoke test)")
  a = ap.parse_args()
  repeats = 1 if a.quick else a.repeats

  with tempfile.TemporaryDirectory() as work:
    if a.quick:
      with open(os.path.join(work, "quick_target.py"), "w") as f:
        f.write(_QUICK_TARGET)
      what = ["quick_target.py:make"]
      label = "two-matmul function"
    else:
      what = ["--model", a.model, "--size", a.size]
      label = f"{a.model} ({a.size})"
    check = ["check", *what, "--out", os.path.join(work, "report")]
    search = ["search", *what, "--tolerance", "1e-3"]
    times: dict[str, list[float]] = {"cold": [], "warm": [], "no-cache": [],
                                     "search": []}
    entries = (0, 0)
    for r in range(repeats):
      cache = os.path.join(work, f"cache{r}")
      times["cold"].append(_jaxprec(check, cache, work))
      times["warm"].append(_jaxprec(check, cache, work))
      entries = _files(os.path.join(cache, "jax-compilation"))
      times["no-cache"].append(
          _jaxprec([*check, "--no-cache"], os.path.join(work, f"nc{r}"), work))
      if a.search:
        times["search"].append(
            _jaxprec(search, os.path.join(work, f"search{r}"), work))

  cold = statistics.median(times["cold"])
  print(f"jaxprec check {label}: wall time per process, median of {repeats} "
        f"(Python {platform.python_version()}, {platform.processor() or platform.machine()})")
  print(f"{'run':<44}{'seconds':>9}{'ratio':>8}")
  rows = [("cold (empty JAXPREC_CACHE_DIR)", "cold", ""),
          ("warm (second run, same cache)", "warm", "   <= 0.5"),
          ("--no-cache", "no-cache", "")]
  if a.search:
    rows.append(("jaxprec search --tolerance 1e-3 (cold cache)", "search",
                 "   <= 1.5"))
  for name, key, limit in rows:
    t = statistics.median(times[key])
    print(f"{name:<44}{t:>9.2f}{t / cold:>7.2f}x{limit}")
  print(f"cache: {entries[0]} files, {entries[1] / 1e6:.1f} MB after the "
        f"warm run")


if __name__ == "__main__":
  main()
