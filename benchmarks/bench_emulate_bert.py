"""Emulated BERT-base forward at 'bfloat16' vs its native float32 forward (claim: <= 1.5x).

transformers' FlaxBertModel built from a BERT-base config (random weights, nothing
downloaded), sequence length 128. Both forwards are jitted and compiled first; then the
two are timed alternately, so machine noise hits both, and the ratio of medians is printed.

  python benchmarks/bench_emulate_bert.py [--batch 1] [--repeats 15] [--layers 12]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jaxprec


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--repeats", type=int, default=15)
  ap.add_argument("--precision", default="bfloat16")
  args = ap.parse_args()

  from transformers import BertConfig, FlaxBertModel
  cfg = BertConfig(num_hidden_layers=args.layers)  # BERT-base sizes otherwise
  model = FlaxBertModel(cfg, input_shape=(1, args.seq), seed=0, _do_init=True)
  params = model.params
  ids = jnp.asarray(jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq), 0,
                                       cfg.vocab_size))

  def forward(p, x):
    return model(x, params=p).last_hidden_state

  native = jax.jit(forward)
  emulated = jax.jit(jaxprec.emulate(forward, args.precision, target="tpu"))
  a, b = native(params, ids), emulated(params, ids)  # compile both
  jax.block_until_ready((a, b))
  diff = float(jnp.max(jnp.abs(a - b)))

  tn, te = [], []
  for _ in range(args.repeats):
    t = time.perf_counter(); jax.block_until_ready(native(params, ids)); tn.append(time.perf_counter() - t)
    t = time.perf_counter(); jax.block_until_ready(emulated(params, ids)); te.append(time.perf_counter() - t)
  n, e = statistics.median(tn), statistics.median(te)
  print(f"FlaxBertModel base ({args.layers} layers), batch {args.batch}, seq {args.seq}, "
        f"{args.repeats} runs each, jax {jax.__version__}, {jax.default_backend()}")
  print(f"native float32 forward:          median {n * 1e3:8.1f} ms")
  print(f"emulated {args.precision:>9} (tpu) forward: median {e * 1e3:8.1f} ms")
  print(f"ratio emulated/native: {e / n:.2f}x (claim: <= 1.5x); "
        f"max |emulated - native| = {diff:.3g}")


if __name__ == "__main__":
  main()
