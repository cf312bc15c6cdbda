"""``jaxprec.check`` in two processes under ``jax.distributed`` (CPU, gloo).

Both processes run tests/pod_worker.py: a localhost coordinator, one CPU
device per process, a batch sharded across the two. The run happens once
per module (two fresh processes take seconds) and each test reads its
results.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = pathlib.Path(__file__).resolve().parent / "pod_worker.py"
PROCESSES = 2
TIMEOUT_S = 180
NO_GLOO = 3  # the worker's exit status when jaxlib has no gloo collectives


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _without_timing(report: dict) -> dict:
  """A report's figures: everything but the wall-clock seconds."""
  return {k: v for k, v in report.items() if k != "seconds"}


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
  """Runs the two processes; returns the results folder and their results."""
  results = tmp_path_factory.mktemp("pod")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  port = str(_free_port())
  logs, procs = [], []
  try:
    for i in range(PROCESSES):
      log = open(results / f"log_{i}.txt", "w+", encoding="utf-8")
      logs.append(log)
      procs.append(subprocess.Popen(
          [sys.executable, str(WORKER), str(i), str(PROCESSES), port,
           str(results)], cwd=results, env=env, stdout=log,
          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
      try:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        break
  finally:
    for p in procs:  # a hung or failed peer never outlives the test
      if p.poll() is None:
        p.kill()
        p.wait()
    text = []
    for i, log in enumerate(logs):
      log.seek(0)
      text.append(f"--- process {i} (exit {procs[i].returncode}):\n"
                  f"{log.read()[-4000:]}")
      log.close()
  out = "\n".join(text)
  codes = [p.returncode for p in procs]
  if NO_GLOO in codes:
    pytest.skip(f"this jaxlib has no gloo CPU collectives:\n{out}")
  assert codes == [0] * PROCESSES, out
  return results, [json.loads((results / f"result_{i}.json").read_text())
                   for i in range(PROCESSES)]


def test_two_processes_report_the_same_figures_bit_for_bit(pod):
  _, (r0, r1) = pod
  assert (r0["process_index"], r1["process_index"]) == (0, 1)
  a, b = _without_timing(r0["report"]), _without_timing(r1["report"])
  assert a == b  # JSON floats round-trip exactly: the same bits
  assert [l["shape"] for l in a["layers"]] == [[128, 128], [128, 128]]
  m = [l["metrics"]["bfloat16"] for l in a["layers"]]
  assert all(x["nan"] == x["inf"] == 0 and x["rel_rms"] > 1e-4 for x in m)


def test_the_sharded_check_measures_the_whole_batch(pod):
  """The figures of the batch sharded over two processes are those of the
  whole batch checked in one process (sums may be added in another order:
  close, not equal; maxima and counts exactly)."""
  import jax
  import jaxprec
  sys.path.insert(0, str(WORKER.parent))
  try:
    import pod_worker  # noqa: PLC0415
  finally:
    sys.path.remove(str(WORKER.parent))
  _, (r0, _) = pod
  local = jaxprec.check(pod_worker.mlp, *map(jax.numpy.asarray, pod_worker.data()),
                        precisions="bfloat16", mode="emulate").to_dict()
  for ls, ll in zip(r0["report"]["layers"], local["layers"], strict=True):
    assert ls["name"] == ll["name"] and ls["size"] == ll["size"] == 128 * 128
    ms, ml = ls["metrics"]["bfloat16"], ll["metrics"]["bfloat16"]
    for k in ("max_abs", "ulp_max", "nan", "inf", "frac_outside",
              "required_atol"):
      assert ms[k] == ml[k], k
    for k in ms:
      np.testing.assert_allclose(ms[k], ml[k], rtol=1e-5, atol=0, err_msg=k)


def test_a_reference_read_from_the_host_is_placed_over_the_processes(pod):
  """A mapping reference (as from a file) against the sharded batch: the
  same report in both processes, and the figures of the computed float32
  reference (the same layers, computed on one device)."""
  _, (r0, r1) = pod
  a, b = _without_timing(r0["read"]), _without_timing(r1["read"])
  assert a == b
  assert a["numerics"]["(reference)"] == "external"
  for lr, lc in zip(a["layers"], r0["report"]["layers"], strict=True):
    mr, mc = lr["metrics"]["bfloat16"], lc["metrics"]["bfloat16"]
    for k in mr:
      np.testing.assert_allclose(mr[k], mc[k], rtol=1e-5, atol=0, err_msg=k)


def test_the_cli_writes_out_from_process_zero_only(pod):
  results, (r0, r1) = pod
  assert r0["cli_rc"] == r1["cli_rc"] == 0
  printed = [_without_timing(json.loads(r["cli_stdout"])) for r in (r0, r1)]
  assert printed[0] == printed[1]  # process 1 computed the same report
  assert printed[0]["layers"] == _without_timing(r0["report"])["layers"]
  written = json.loads((results / "out_0" / "report.json").read_text())
  assert _without_timing(written) == printed[0]
  assert (results / "out_0" / "divergence.png").stat().st_size > 0
  assert not (results / "out_1").exists()


def test_a_report_plot_is_saved_by_process_zero_only(pod):
  results, _ = pod
  assert (results / "plot_0.png").stat().st_size > 0
  assert not (results / "plot_1.png").exists()


def test_a_plot_outside_jax_saves_and_starts_no_backend(pod, tmp_path):
  """Process 0 alone saves a figure; a process that never ran JAX (a report
  read back from JSON) is process 0, and asking starts no backend (which
  would take a TPU or GPU for a plot)."""
  results, _ = pod
  script = (
      "import sys, jaxprec\n"
      "from jax._src import xla_bridge\n"
      "text = open(sys.argv[1], encoding='utf-8').read()\n"
      "jaxprec.DivergenceReport.from_json(text).plot(sys.argv[2])\n"
      "assert not xla_bridge.backends_are_initialized()\n")
  png = tmp_path / "again.png"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script,
                         str(results / "out_0" / "report.json"), str(png)],
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert png.stat().st_size > 0
