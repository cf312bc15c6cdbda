"""Emulated BERT-base forward vs its native float32 forward, per kernel.

transformers' FlaxBertModel built from a BERT-base config (random weights,
nothing downloaded), batch 1, sequence length 128. Prints, side by side in one
run, for each emulation kernel (``bf16``, ``f32``; ``docs/emulation.md``):

* the run time of the emulated forward at 1 pass (TPU DEFAULT) over the
  native one (limit 1.5x): both jitted and compiled first, then timed
  alternately so machine noise hits both, ratio of medians;
* the compile time (trace, lower and compile) of the emulated forward at 1, 3
  and 6 passes over the native one (limits 1.35x, 2.0x, 2.8x), each a median
  of fresh compiles next to a native one, the import of jaxprec not included;
  the last line gives them together with the CPU model and whether it has
  AVX512-BF16 (the kernel ``auto`` picks depends on it);
* beside them, what ``import jaxprec`` costs after ``import jax, flax.linen,
  flax.nnx`` on the same CPU (limit 0.05 s): timed inside fresh interpreters,
  medians of ``--import-repeats`` (``benchmarks/bench_import.py`` has the
  whole-process figures).

  python benchmarks/bench_emulate_bert.py [--batch 1] [--repeats 15] [--layers 12]
      [--compile-repeats 5] [--import-repeats 7]
  python benchmarks/bench_emulate_bert.py --quick    # 2 layers, seq 32: seconds
  python benchmarks/bench_emulate_bert.py --split    # + trace/lower vs compile
  python benchmarks/bench_emulate_bert.py --multi-pass  # + run and compile
      time at 3 and 6 passes on each kernel, per form of the multi-pass dots
      (bf16: grouped, the default, wide, one dot per pass; f32: batched, the
      default, one dot per pass)
"""

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

import jaxprec
from jaxprec._src.emulation import kernels as _kernels

import bench_import
from _args import positive as _positive

KERNELS = ("bf16", "f32")
RUN_LIMIT = 1.5
COMPILE_LIMITS = {"default": 1.35, "high": 2.0, "highest": 2.8}  # 1, 3, 6 passes


def compile_seconds(fn, *args) -> tuple[float, float, float]:
  """Trace and lower, then compile, ``fn`` afresh (a new function: no jit
  cache hit); returns the two wall times and the process's CPU time for both
  (every thread's: XLA compiles kernels on a thread pool)."""
  fresh = lambda *a: fn(*a)  # noqa: E731
  c = time.process_time()
  t = time.perf_counter()
  lowered = jax.jit(fresh).lower(*args)
  t1 = time.perf_counter()
  lowered.compile()
  return t1 - t, time.perf_counter() - t1, time.process_time() - c


def import_seconds(n: int) -> tuple[float, float]:
  """``import jaxprec`` after jax and flax, timed inside ``n`` fresh
  interpreters with cached bytecode (one warm-up first): medians of the wall
  and the CPU time."""
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  env.pop("PYTHONDONTWRITEBYTECODE", None)
  with tempfile.TemporaryDirectory() as cache:
    env["PYTHONPYCACHEPREFIX"] = cache
    bench_import.once("import jaxprec; ", env)
    runs = [bench_import.once("import jaxprec; ", env) for _ in range(n)]
  return (statistics.median(r[2] for r in runs),
          statistics.median(r[3] for r in runs))


def cpu_line() -> str:
  """The CPU model and whether it has AVX512-BF16 (``/proc/cpuinfo``)."""
  has = "avx512_bf16" in _kernels.bf16_dot_units()
  return (f"{_kernels._cpu_model()}, "  # pylint: disable=protected-access
          f"avx512_bf16: {'yes' if has else 'no'}")


def _timed(fn, *args) -> tuple[float, float]:
  """One run of ``fn``: wall time and the process's CPU time (every thread's;
  less moved than the wall by other jobs on the machine)."""
  c, t = time.process_time(), time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t, time.process_time() - c


# The forms a multi-pass dot runs in (emulated_ops.BATCH_MACS: None keeps
# the default, -1 runs one dot per pass), per kernel, the default first.
FORMS = {
    "bf16": (("grouped by rhs part", None),
             ("dot per pass", -1)),
    "f32": (("batched", None), ("dot per pass", -1)),
}


def _in_form(form: tuple, fn, *args):
  """``fn(*args)`` with ``emulated_ops.BATCH_MACS`` set for ``form``,
  restored after."""
  from jaxprec._src.emulation import emulated_ops  # pylint: disable=g-import-not-at-top
  saved = emulated_ops.BATCH_MACS
  if form[1] is not None:
    emulated_ops.BATCH_MACS = form[1]
  try:
    return fn(*args)
  finally:
    emulated_ops.BATCH_MACS = saved


def multi_pass_run_times(forward, params, ids, repeats: int,
                         compile_repeats: int) -> None:
  """The forward at 3 and 6 passes on each kernel, in each form its
  multi-pass dots may run in (``FORMS``): run time (all compiled first, then
  timed alternately with native) and compile time (fresh compiles, each next
  to a native one), ratios of medians to native, wall and CPU time."""
  native = jax.jit(forward)
  jax.block_until_ready(native(params, ids))
  for kernel, forms in FORMS.items():
    for precision in ("high", "highest"):
      fns = {}
      with jaxprec.use_kernel(kernel):
        for form in forms:
          fns[form[0]] = jax.jit(jaxprec.emulate(forward, precision, target="tpu"))
          _in_form(form, lambda f: jax.block_until_ready(f(params, ids)),
                   fns[form[0]])  # compile
        runs = {"native": [], **{f: [] for f in fns}}
        for _ in range(repeats):
          runs["native"].append(_timed(native, params, ids))
          for form in forms:
            runs[form[0]].append(_in_form(form, _timed, fns[form[0]], params, ids))
        compiles = {f[0]: [] for f in forms}
        for _ in range(compile_repeats):
          for form in forms:
            n = compile_seconds(forward, params, ids)
            e = _in_form(form, compile_seconds,
                         jaxprec.emulate(forward, precision, target="tpu"),
                         params, ids)
            compiles[form[0]].append((e[0] + e[1], n[0] + n[1], e[2], n[2]))
      med = lambda xs: statistics.median(xs)  # noqa: E731
      nat = [med(r[i] for r in runs["native"]) for i in (0, 1)]
      parts = []
      for form in forms:
        r = runs[form[0]]
        c = compiles[form[0]]
        parts.append(
            f"{form[0]}: run {med(x[0] for x in r) / nat[0]:.2f}x "
            f"(CPU {med(x[1] for x in r) / nat[1]:.2f}x), compile "
            f"{med(x[0] for x in c) / med(x[1] for x in c):.2f}x "
            f"(CPU {med(x[2] for x in c) / med(x[3] for x in c):.2f}x)")
      print(f"forward at {precision} ({kernel} kernel; native run "
            f"{nat[0] * 1e3:.1f} ms): " + "; ".join(parts))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=_positive, default=1)
  ap.add_argument("--seq", type=_positive, default=128)
  ap.add_argument("--layers", type=_positive, default=12)
  ap.add_argument("--repeats", type=_positive, default=15)
  ap.add_argument("--compile-repeats", type=_positive, default=5,
                  help="fresh compiles per variant (medians; default 5)")
  ap.add_argument("--import-repeats", type=int, default=7,
                  help="fresh interpreters timing `import jaxprec` (0: skip)")
  ap.add_argument("--split", action="store_true",
                  help="also print trace+lower and XLA compile times apart")
  ap.add_argument("--multi-pass", action="store_true",
                  help="also time the forward at 3 and 6 passes on each "
                  "kernel, run and compile, in each form its multi-pass dots "
                  "may run in (FORMS)")
  ap.add_argument("--quick", action="store_true",
                  help="1 layer, seq 16, 3 repeats: a few seconds")
  args = ap.parse_args()
  if args.quick:
    args.layers, args.seq, args.repeats, args.compile_repeats = 1, 16, 3, 1
    args.import_repeats = min(args.import_repeats, 1)
  if args.import_repeats < 0:
    ap.error(f"--import-repeats must be 0 or more, got {args.import_repeats}")

  from transformers import BertConfig, FlaxBertModel
  cfg = BertConfig(num_hidden_layers=args.layers)  # BERT-base sizes otherwise
  model = FlaxBertModel(cfg, input_shape=(1, args.seq), seed=0, _do_init=True)
  params = model.params
  ids = jnp.asarray(jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq), 0,
                                       cfg.vocab_size))

  def forward(p, x):
    return model(x, params=p).last_hidden_state

  native = jax.jit(forward)
  emulated = {}
  for kernel in KERNELS:
    with jaxprec.use_kernel(kernel):
      emulated[kernel] = jax.jit(jaxprec.emulate(forward, "default", target="tpu"))
      emulated[kernel](params, ids).block_until_ready()  # compile
  ref = native(params, ids)
  diff = {k: float(jnp.max(jnp.abs(f(params, ids) - ref))) for k, f in emulated.items()}

  times = {"native": [], **{k: [] for k in KERNELS}}
  for _ in range(args.repeats):
    t = time.perf_counter(); jax.block_until_ready(native(params, ids))
    times["native"].append(time.perf_counter() - t)
    for k in KERNELS:
      with jaxprec.use_kernel(k):
        t = time.perf_counter(); jax.block_until_ready(emulated[k](params, ids))
        times[k].append(time.perf_counter() - t)
  med = {k: statistics.median(v) for k, v in times.items()}

  print(f"FlaxBertModel base ({args.layers} layers), batch {args.batch}, seq {args.seq}, "
        f"{args.repeats} runs each, jax {jax.__version__}, {jax.default_backend()}")
  print(f"auto: {jaxprec.current_kernel().reason}")
  print(f"native float32 forward: median {med['native'] * 1e3:8.1f} ms")
  for k in KERNELS:
    r = med[k] / med["native"]
    print(f"emulated 1 pass, {k:4s} kernel: median {med[k] * 1e3:8.1f} ms, ratio "
          f"{r:.2f}x (limit {RUN_LIMIT}x: {'ok' if r <= RUN_LIMIT else 'MISSED'}); "
          f"max |emulated - native| = {diff[k]:.3g}")

  if args.multi_pass:
    multi_pass_run_times(forward, params, ids, args.repeats,
                         args.compile_repeats)

  # Compile times, fresh functions each; a native compile next to each
  # emulated one, --compile-repeats times, medians (one compile of BERT-base
  # moves by +-30% here from run to run).
  print(f"compile times: medians of {args.compile_repeats} fresh compiles, each "
        "next to a native one")
  ratios = {k: [] for k in KERNELS}
  cpu_ratios = {k: [] for k in KERNELS}
  for precision, limit in COMPILE_LIMITS.items():
    for k in KERNELS:
      pairs = []
      for _ in range(args.compile_repeats):
        native_split = compile_seconds(forward, params, ids)
        with jaxprec.use_kernel(k):
          split = compile_seconds(
              jaxprec.emulate(forward, precision, target="tpu"), params, ids)
        pairs.append((split, native_split))
      med2 = lambda i, j: statistics.median(p[i][j] for p in pairs)  # noqa: E731
      c = statistics.median(p[0][0] + p[0][1] for p in pairs)
      native_c = statistics.median(p[1][0] + p[1][1] for p in pairs)
      r = c / native_c
      cpu_r = (statistics.median(p[0][2] for p in pairs) /
               statistics.median(p[1][2] for p in pairs))
      ratios[k].append(f"{r:.2f}x")
      cpu_ratios[k].append(f"{cpu_r:.2f}x")
      print(f"compile time, emulated {precision:7s} ({k:4s}): {c:6.2f} s vs "
            f"native {native_c:6.2f} s, ratio "
            f"{r:.2f}x (limit {limit}x: {'ok' if r <= limit else 'MISSED'}); "
            f"CPU time ratio {cpu_r:.2f}x")
      if args.split:
        print(f"  trace+lower {med2(0, 0):5.2f} s vs native {med2(1, 0):5.2f} s; "
              f"XLA compile {med2(0, 1):5.2f} s vs native {med2(1, 1):5.2f} s")
  print("compile ratios at 1 / 3 / 6 passes (limits "
        f"{' / '.join(f'{v}x' for v in COMPILE_LIMITS.values())}; import not "
        "included): " + "; ".join(f"{k} {' / '.join(v)}" for k, v in ratios.items())
        + f"; {cpu_line()}")
  print("the same in CPU time (less moved by other jobs on the machine): "
        + "; ".join(f"{k} {' / '.join(v)}" for k, v in cpu_ratios.items()))
  if args.import_repeats:
    wall, used = import_seconds(args.import_repeats)
    print(f"import jaxprec after jax and flax: {wall:.3f} s wall, {used:.3f} s "
          f"CPU (medians of {args.import_repeats} fresh interpreters; limit "
          f"{bench_import.LIMIT} s: "
          f"{'ok' if wall < bench_import.LIMIT else 'MISSED'})")
  print("auto runs " + " / ".join(
      _kernels.kernel_for(a) for a in ("bf16x1", "bf16x3", "bf16x6"))
        + " at 1 / 3 / 6 passes on this CPU")


if __name__ == "__main__":
  main()
