"""The chip model's cost against the default GPU model, on a real model.

jaxprec's built-in BERT encoder (``jaxprec.models.bert``, random weights,
nothing downloaded) emulated for ``target="gpu"`` at TF32 (GPU ``DEFAULT``),
once with the default model (``chip=None``: the algorithm's definition) and
once per chip model (``chip="a100"``, ``"h100"``: each dot as that chip's
tensor cores compute it, ``docs/gpu.md``). Each program is jitted and compiled
first, then the programs are timed alternately (so machine noise hits all of
them) and the medians printed side by side with their ratio to the default
model, the compile times, the largest difference between the two models'
outputs, and the CPU's model name.

  python benchmarks/bench_chip_model.py [--size small] [--batch 1] [--seq 64]
      [--repeats 7]
  python benchmarks/bench_chip_model.py --quick     # tiny, seq 16: seconds
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jaxprec
import jaxprec.models
from jaxprec._src.emulation import kernels as _kernels

from _args import positive as _positive

CHIPS = ("a100", "h100")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", choices=("tiny", "small", "base"), default="small")
  ap.add_argument("--batch", type=_positive, default=1)
  ap.add_argument("--seq", type=_positive, default=64)
  ap.add_argument("--repeats", type=_positive, default=7)
  ap.add_argument("--precision", default="default",
                  help="the precision of every dot (default: GPU DEFAULT, TF32)")
  ap.add_argument("--quick", action="store_true",
                  help="the tiny model, seq 8, 2 repeats, chip h100 only")
  args = ap.parse_args()
  chips = CHIPS
  if args.quick:
    args.size, args.seq, args.repeats, chips = "tiny", 8, 2, ("h100",)

  fn, fargs = jaxprec.models.bert(args.size, batch=args.batch,
                                  seq_len=args.seq)
  programs, compile_s = {}, {}
  for chip in (None, *chips):
    f = jax.jit(jaxprec.emulate(fn, args.precision, target="gpu", chip=chip))
    t = time.perf_counter()
    f.lower(*fargs).compile()
    compile_s[chip] = time.perf_counter() - t
    jax.block_until_ready(f(*fargs))
    programs[chip] = f

  outs = {c: jax.tree_util.tree_leaves(f(*fargs)) for c, f in programs.items()}
  diff = {c: max(float(jnp.max(jnp.abs(a - b)))
                 for a, b in zip(outs[c], outs[None]))
          for c in chips}
  times = {c: [] for c in programs}
  for _ in range(args.repeats):
    for c, f in programs.items():
      t = time.perf_counter()
      jax.block_until_ready(f(*fargs))
      times[c].append(time.perf_counter() - t)
  med = {c: statistics.median(v) for c, v in times.items()}

  print(f"jaxprec BERT encoder '{args.size}', batch {args.batch}, seq "
        f"{args.seq}, precision {args.precision!r} on target='gpu', "
        f"{args.repeats} runs each, jax {jax.__version__}, "
        f"{jax.default_backend()}, CPU: {_kernels._cpu_model()}")  # pylint: disable=protected-access
  print(f"default model:   median {med[None] * 1e3:9.1f} ms, compile "
        f"{compile_s[None]:5.2f} s")
  for c in chips:
    print(f"chip={c!r}: median {med[c] * 1e3:9.1f} ms, compile "
          f"{compile_s[c]:5.2f} s; ratio to the default model "
          f"{med[c] / med[None]:.1f}x run, "
          f"{compile_s[c] / compile_s[None]:.1f}x compile; max |chip - "
          f"default| = {diff[c]:.3g}")


if __name__ == "__main__":
  main()
