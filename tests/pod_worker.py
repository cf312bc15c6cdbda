"""One process of a multi-process ``jaxprec.check`` run (tests/test_pod.py).

    python tests/pod_worker.py PROCESS_ID NUM_PROCESSES PORT RESULTS_DIR

Joins ``jax.distributed`` on CPU with gloo collectives and a coordinator on
``localhost:PORT`` (process 0 runs it), shards a batch over one device per
process, and writes ``RESULTS_DIR/result_<id>.json``: this process's
``jaxprec.check`` report of the sharded batch, the same against its
float32 layers read from the host, and what
``jaxprec check --out RESULTS_DIR/out_<id>`` of the same batch printed and
returned; ``report.plot(RESULTS_DIR/plot_<id>.png)`` is called in every
process. Exit status 3: this jaxlib has no gloo collectives.
"""

import contextlib
import io
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

# 64 rows of 128 per process: each process's share of a layer is whole
# chunks of 512 elements (jaxprec._src.checker.metrics.CHUNK).
ROWS, WIDTH = 128, 128


def data():
  """The weights and the global batch (the same in every process)."""
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
  x = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
  return w, x


def mlp(w, x):
  h1 = jnp.tanh(x @ w)
  return {"h1": h1, "h2": jnp.tanh(h1 @ w)}


def target():
  """``(fn, args)`` for ``jaxprec check``: the batch sharded over the processes."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  w, x = data()
  n, i = jax.process_count(), jax.process_index()
  rows = x.shape[0] // n
  xs = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("batch")), x[i * rows:(i + 1) * rows], x.shape)
  ws = jax.make_array_from_process_local_data(NamedSharding(mesh, P()), w,
                                              w.shape)
  assert not xs.is_fully_addressable and len(xs.sharding.device_set) == n
  return mlp, (ws, xs)


def main(pid: int, n: int, port: int, results: str) -> int:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=n,
                             process_id=pid, initialization_timeout=60)
  try:
    devices = jax.devices()
  except Exception as e:  # noqa: BLE001 -- a jaxlib built without gloo
    if "gloo" in str(e).lower():
      print(f"no gloo collectives in this jaxlib: {e}", file=sys.stderr)
      return 3
    raise
  assert len(devices) == n and jax.process_count() == n, devices
  import jaxprec
  from jaxprec._src.cli import cli
  fn, args = target()
  report = jaxprec.check(fn, *args, precisions="bfloat16", mode="emulate")
  # The float32 layers of the whole batch, computed here and read back as a
  # reference held by the host (as from a file): placed over the processes.
  layers = {k: np.asarray(v) for k, v in jax.jit(mlp)(*data()).items()}
  read = jaxprec.check(fn, *args, precisions="bfloat16", reference=layers,
                       mode="emulate")
  # The command line imports this module by name and finds this one, so its
  # check reuses the programs just compiled.
  sys.modules.setdefault("pod_worker", sys.modules[__name__])
  report.plot(os.path.join(results, f"plot_{pid}.png"))  # process 0 saves
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    rc = cli.main(["check", "pod_worker:target",
                   "--precisions", "bfloat16", "--mode", "emulate",
                   "--no-cache", "--json",
                   "--out", os.path.join(results, f"out_{pid}")])
  with open(os.path.join(results, f"result_{pid}.json"), "w") as f:
    json.dump({"process_index": jax.process_index(),
               "report": report.to_dict(), "read": read.to_dict(),
               "cli_rc": rc, "cli_stdout": stdout.getvalue()}, f)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(*map(int, sys.argv[1:4]), sys.argv[4]))
