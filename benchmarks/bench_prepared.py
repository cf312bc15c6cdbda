"""Weights rounded once: the search's program with and without prepared parts.

Every evaluation of :func:`jaxprec.search_policy` after the first runs one
switched program (``jaxprec/_src/search/switch.py``) on the same parameters. Their
parts (bfloat16 splits, TF32 roundings: ``jaxprec/_src/emulation/prepared.py``) are
computed once per search, and the program reads them, instead of splitting
every weight again at every evaluation.

transformers' FlaxBertModel from a BERT-base config (random weights, nothing
downloaded), batch 1, sequence length 128, every Dense a unit choosing among
bfloat16, bfloat16_3x, BF16_BF16_F32_X6 and float32 (the search's choices).
For each emulation kernel (``bf16``, ``f32``), side by side in one run:

* the switched program's run time per evaluation with the parts prepared
  over the same program splitting them itself (ratio of medians, timed
  alternately so machine noise hits both), at two policies;
* the same against the native float32 forward;
* what preparing costs once (compile excluded) and the parts' size, next to
  the float32 parameters'.

Both programs give the same numbers, bit for bit (checked here too, and in
``tests/test_prepared.py``).

  python benchmarks/bench_prepared.py [--layers 12] [--repeats 15]
  python benchmarks/bench_prepared.py --quick    # a small MLP: seconds
"""

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxprec
from jaxprec._src.checker import harness
from jaxprec._src.core.precision import resolve
from jaxprec._src.emulation import prepared
from jaxprec._src.search import switch

from _args import positive as _positive

CHOICES = ("bfloat16", "bfloat16_3x", "BF16_BF16_F32_X6", "float32")


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          name = line.split(":", 1)[1].strip()
          flags = open("/proc/cpuinfo").read()
          return f"{name}, avx512_bf16: {'avx512_bf16' in flags}"
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _median_pair(f, g, repeats: int) -> tuple[float, float]:
  ta, tb = [], []
  for _ in range(repeats):
    for fn, ts in ((f, ta), (g, tb)):
      t = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - t)
  return statistics.median(ta), statistics.median(tb)


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=_positive, default=12)
  ap.add_argument("--seq", type=_positive, default=128)
  ap.add_argument("--repeats", type=_positive, default=15)
  ap.add_argument("--quick", action="store_true",
                  help="a small Flax MLP, 3 repeats: a few seconds")
  args = ap.parse_args()
  if args.quick:
    args.layers, args.seq, args.repeats = 1, 16, 3

  if args.quick:  # a two-layer Flax MLP: no transformers import, seconds
    import flax.linen as nn

    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Dense(32, name="out")(jnp.tanh(nn.Dense(64, name="hidden")(x)))
    mlp = MLP()
    inputs = jnp.ones((args.seq, 32))
    params = mlp.init(jax.random.key(0), inputs)

    def fn(params, x):
      return mlp.apply(params, x)
    title = f"a Flax MLP 32-64-32, {args.seq} rows"
  else:
    from transformers import BertConfig, FlaxBertModel
    cfg = BertConfig(num_hidden_layers=args.layers)  # BERT-base otherwise
    model = FlaxBertModel(cfg, input_shape=(1, args.seq), seed=0,
                          _do_init=True)
    params, inputs = model.params, jnp.ones((1, args.seq), jnp.int32)

    def fn(params, ids):
      return model(ids, params=params).last_hidden_state
    title = (f"FlaxBertModel, {args.layers} layers, hidden {cfg.hidden_size}, "
             f"batch 1, seq {args.seq}")

  print(f"CPU: {_cpu()}; {os.cpu_count()} cores; jax {jax.__version__}")
  print(f"{title}; choices {', '.join(CHOICES)}")
  units = [r.module_path for r in jaxprec.audit(fn, params, inputs).rows
           if r.module_path]
  units = tuple(dict.fromkeys(units))
  precisions = [resolve(p) for p in CHOICES]
  call = harness.Args((params, inputs), {}, who="bench")
  leaves = call.dynamic
  native = jax.jit(lambda d: call.call(fn, d))
  rng = np.random.default_rng(0)
  policies = {"all bfloat16_3x": [1] * len(units),
              "random": list(rng.integers(0, len(CHOICES), len(units)))}
  print(f"{len(units)} units; float32 parameters feeding them: see below")
  for kernel in ("bf16", "f32"):
    with jaxprec.use_kernel(kernel):
      g = switch.switched(fn, units, precisions, target="tpu")

      def body(index, dynamic):
        return call.call(lambda *a: g(index, *a), dynamic)

      def served(index, ready, dynamic):
        with prepared.serving(dynamic, ready):
          return body(index, dynamic)

      requests: prepared.Requests = {}

      def record(index, dynamic):
        with prepared.recording(dynamic) as asked:
          out = body(index, dynamic)
          requests.update(asked)
        return out
      index = switch.index_of(policies["random"])
      jax.eval_shape(record, index, leaves)
      prepare = prepared.preparer(requests)
      t = time.perf_counter()
      ready = jax.block_until_ready(prepare(leaves))
      t_first = time.perf_counter() - t  # compiled, then run
      t = time.perf_counter()
      ready = jax.block_until_ready(prepare(leaves))
      t_prepare = time.perf_counter() - t
      fast, slow = jax.jit(served), jax.jit(body)
      used = {arg for arg, *_ in requests.values()}
      weights = sum(leaves[i].size * 4 for i in used)
      print(f"\n{kernel} kernel: {len(used)} arrays prepared once, "
            f"{weights / 2**20:.1f} MiB of float32 -> parts "
            f"{_bytes(ready) / 2**20:.1f} MiB "
            f"({_bytes(ready) / max(weights, 1):.2f}x); preparing took "
            f"{t_prepare * 1e3:.1f} ms ({t_first:.2f} s with its compilation)")
      for name, levels in policies.items():
        i = switch.index_of(levels)
        a, b = fast(i, ready, leaves), slow(i, leaves)
        same = np.array_equal(np.asarray(a).view(np.uint32),
                              np.asarray(b).view(np.uint32))
        jax.block_until_ready(native(leaves))
        tp, ts = _median_pair(lambda: fast(i, ready, leaves),
                              lambda: slow(i, leaves), args.repeats)
        tn, tp2 = _median_pair(lambda: native(leaves),
                               lambda: fast(i, ready, leaves), args.repeats)
        print(f"  policy {name:16s} prepared {tp * 1e3:8.2f} ms, "
              f"splitting every run {ts * 1e3:8.2f} ms: ratio {tp / ts:.2f}x; "
              f"prepared / native {tp2 / tn:.2f}x; bit-identical: {same}")
      saved = ts - tp
      print(f"  preparing once / one evaluation splitting itself: "
            f"{t_prepare / ts:.2f}x; " + (
                f"pays for itself after {t_prepare / saved:.1f} evaluations"
                if saved > 0 else "saves nothing here"))


if __name__ == "__main__":
  main()
