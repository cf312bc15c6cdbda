"""Per-device memory of ``jaxprec.check``'s programs on a batch sharded over 8 devices.

Claim (docs/checker.md, "Sharded and multi-process runs"): on a batch sharded
over several devices, every program of a check (the reference program, and per precision the
row's layers program and its metrics program) keeps each device's share of the layers on
that device. Nothing is gathered onto one device: a check program's
per-device memory follows the per-device batch, as the user's sharded
forward does, not the global batch.

Figures are XLA's memory analysis of each compiled program
(``jax.jit(f).lower(...).compile().memory_analysis()``: argument, output and
temporary bytes, per device for a program partitioned over several devices).
The script runs on 8 host CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set before JAX
starts) and compiles each program three ways:

* **sharded**: the batch split over the 8 devices along its leading axis,
  the parameters replicated (as the user's data-parallel forward runs);
* **local**: the same program on one device with one device's share of the
  batch (global batch / 8): what each device must hold at least;
* **global**: the same program on one device with the whole batch: what a
  program that gathers the layers would hold on one device.

The rows' programs run against the reference the check computed, and the
metrics program once (``host ref``) against the same layers read from the host, as a
reference from a file or a mapping is.

It prints, per program, the bytes of each, the ratio of the sharded program
to the user's sharded forward, and the ratio sharded / local; then the bytes
of the packed reference a check keeps between its programs on the device
that holds the most of it. It exits 1 when a check program's sharded
per-device bytes, or a kept reference's, exceed ``--limit`` (default 1.5)
times the local ones: then its memory grows like the global batch.

    python benchmarks/bench_sharded_check.py [--batch 2048] [--width 256]
        [--layers 4] [--limit 1.5] [--quick]

``--quick`` (a smoke test, seconds): batch 512, width 64, two layers, the
bfloat16 row only (the rows' programs differ in their matmuls alone).
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import argparse  # noqa: E402 -- XLA_FLAGS must be set before JAX starts
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxprec  # noqa: E402
from jaxprec._src.checker import harness, rows  # noqa: E402

from _args import positive as _positive  # noqa: E402
from _args import positive_float as _positive_float  # noqa: E402

DEVICES = 8
PRECISIONS = rows.DEFAULT_ROWS["tpu"]  # a check's default rows
TARGET, MODE = "tpu", "emulate"


def _mlp(ws, x):
  """A residual tanh MLP; every layer's output is a checked hidden state."""
  out = {}
  h = x
  for i, w in enumerate(ws):
    h = h + jnp.tanh(h @ w)
    out[f"layer_{i}"] = h
  return out


def _bytes(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  d = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
       "temp": m.temp_size_in_bytes}
  d["total"] = sum(d.values())
  return d


def _fullest(x: jax.Array) -> int:
  """Bytes of ``x`` on the device that holds the most of it."""
  per: dict[Any, int] = {}
  for shard in x.addressable_shards:
    per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
  return max(per.values())


def _row_programs(call, p, ref) -> tuple[Any, Any]:
  """A check row's two compiled programs: its layers, then their metrics."""
  layers = harness._layers_program(  # noqa: SLF001
      _mlp, call, lambda f, _: p.wrap(f), ("layers", p.key),
      tuple(ref.names), None, p.label)
  values = layers(None, call.dynamic)
  hi, lo, stats, _, atol, rtol = harness.candidate_args(call, ref, 1e-3, 1e-3)
  metrics = harness._metrics_program(ref.layout, True)  # noqa: SLF001
  return (layers.lower(None, call.dynamic).compile(),
          metrics.lower(values, hi, lo, stats, atol, rtol).compile())


def programs(args: tuple, precisions: tuple[str, ...]
             ) -> dict[str, dict[str, int]]:
  """Per-device bytes of the forward and of every check program at ``args``,
  and (``kept``) of the packed references a check keeps between programs."""
  call = harness.Args(args, {}, who="bench_sharded_check")
  out = {"forward": _bytes(jax.jit(_mlp).lower(*args).compile())}
  ref_plan = harness.reference_plan("float32", TARGET, MODE)
  ref = harness.build_reference(_mlp, call, "float32", target=TARGET, mode=MODE)
  ref_prog = harness._reference_program(_mlp, call, ref_plan, None, None)  # noqa: SLF001
  out["check: reference"] = _bytes(ref_prog.lower(call.dynamic).compile())
  for name in precisions:
    p = rows.plan(name, TARGET, MODE)
    for part, compiled in zip(("layers", "metrics"),
                              _row_programs(call, p, ref)):
      out[f"check: {name} {part}"] = _bytes(compiled)
  # A reference read from the host (a file, a mapping): the same programs,
  # its packed reference placed by the check.
  layers = {k: np.asarray(v) for k, v in jax.jit(_mlp)(*args).items()}
  read = harness.build_reference(_mlp, call, layers, target=TARGET, mode=MODE)
  p = rows.plan(precisions[0], TARGET, MODE)
  out[f"check: {p.label} metrics, host ref"] = _bytes(
      _row_programs(call, p, read)[1])
  out["kept"] = {"computed": _fullest(ref.hi), "host": _fullest(read.hi),
                 "whole": ref.hi.nbytes}
  return out


def _kb(n: int) -> str:
  return f"{n / 2**10:10.1f} KiB"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=_positive, default=2048,
                      help="global batch (a multiple of 8)")
  parser.add_argument("--width", type=_positive, default=256)
  parser.add_argument("--layers", type=_positive, default=4)
  parser.add_argument("--limit", type=_positive_float, default=1.5,
                      help="largest sharded / local ratio of a check program")
  parser.add_argument("--quick", action="store_true",
                      help="a smoke test that runs in seconds")
  a = parser.parse_args()
  precisions = PRECISIONS
  if a.quick:
    a.batch, a.width, a.layers, precisions = 512, 64, 2, PRECISIONS[:1]
  if a.batch % DEVICES:
    parser.error(f"--batch must be a multiple of {DEVICES}, got {a.batch}")
  if jax.device_count() != DEVICES:
    print(f"bench_sharded_check: needs {DEVICES} host devices, found "
          f"{jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})",
          file=sys.stderr)
    return 2
  key = jax.random.key(0)
  ws = [jax.random.normal(k, (a.width, a.width)) / (2 * a.width ** 0.5)
        for k in jax.random.split(key, a.layers)]
  x = jax.random.normal(jax.random.key(1), (a.batch, a.width))
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  one = jax.devices()[0]
  sharded = ([jax.device_put(w, NamedSharding(mesh, P())) for w in ws],
             jax.device_put(x, NamedSharding(mesh, P("batch"))))
  local = ([jax.device_put(w, one) for w in ws],
           jax.device_put(x[:a.batch // DEVICES], one))
  whole = ([jax.device_put(w, one) for w in ws], jax.device_put(x, one))
  print(f"jaxprec {jaxprec.__version__}, jax {jax.__version__}, "
        f"{jax.device_count()} {jax.default_backend()} devices; residual MLP "
        f"of {a.layers} layers, width {a.width}, global batch {a.batch} "
        f"({a.batch // DEVICES} per device), parameters replicated; "
        f"precisions {', '.join(precisions)} ({MODE}, target {TARGET})")
  figures = {name: programs(args, precisions) for name, args in
             (("sharded", sharded), ("local", local), ("global", whole))}
  fwd = figures["sharded"]["forward"]["total"]
  print("per-device bytes (XLA memory analysis: arguments + outputs + "
        "temporaries)")
  print(f"  {'program':<34} {'sharded (8 dev)':>15} {'local (1 dev)':>15} "
        f"{'global (1 dev)':>15} {'/ forward':>9} {'/ local':>8}")
  kept = {k: figures[k].pop("kept") for k in figures}
  worst = 0.0
  failed = []
  for prog in figures["sharded"]:
    s, l, g = (figures[k][prog]["total"] for k in ("sharded", "local", "global"))
    ratio = s / l
    if prog != "forward":
      worst = max(worst, ratio)
      if ratio > a.limit:
        failed.append(prog)
    print(f"  {prog:<34} {_kb(s):>15} {_kb(l):>15} {_kb(g):>15} "
          f"{s / fwd:8.2f}x {ratio:7.2f}x")
  for prog in figures["sharded"]:
    d = figures["sharded"][prog]
    print(f"  sharded {prog:<34} argument {_kb(d['argument'])}, output "
          f"{_kb(d['output'])}, temp {_kb(d['temp'])}")
  k = kept["sharded"]
  print(f"kept packed reference, bytes on the fullest device: computed "
        f"{_kb(k['computed'])}, read from the host {_kb(k['host'])} (whole: "
        f"{_kb(k['whole'])}; local: {_kb(kept['local']['whole'])})")
  for how in ("computed", "host"):
    ratio = k[how] / kept["local"]["whole"]
    worst = max(worst, ratio)
    if ratio > a.limit:
      failed.append(f"the {how} reference")
  print(f"largest sharded / local ratio: {worst:.2f}x (limit "
        f"{a.limit:g}x; a program that gathers the layers holds about the "
        f"global column on one device)")
  if failed:
    print(f"bench_sharded_check: more than {a.limit:g}x the local bytes "
          f"per device ({', '.join(failed)}): memory that grows like the "
          f"global batch", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
