"""The notebooks in notebooks/: committed without outputs, and they run.

Each notebook is executed top to bottom in a fresh kernel (nbclient, the
interpreter running pytest) with a timeout; a cell that raises, including a
failed ``assert`` in the notebook, fails the test.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# A hang guard per cell (wall clock), not a speed claim: machines differ and
# the suite runs in parallel. Each notebook's wall and CPU time are printed
# (``pytest -s`` or ``--durations``) to keep an eye on what it costs.
CELL_TIMEOUT_S = 600
TEST_EXTRA = 'pip install -e ".[test]"'

nbformat = pytest.importorskip(
    "nbformat", reason=f"nbformat is part of the test extra: {TEST_EXTRA}")


def _ids(paths):
  return [p.name for p in paths]


def test_there_are_notebooks():
  assert NOTEBOOKS, "notebooks/ has no .ipynb"
  assert (ROOT / "notebooks" / "01_tour.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_stripped(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  dirty = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
           and (cell.get("outputs") or cell.get("execution_count") is not None)]
  assert not dirty, (
      f"{path.name}: code cells {dirty} have outputs or execution counts; commit "
      "notebooks stripped (e.g. jupyter nbconvert --clear-output --inplace)")
  assert "widgets" not in nb.metadata, f"{path.name}: widget state in metadata"
  assert nb.metadata.get("kernelspec", {}).get("name") == "python3", (
      f"{path.name}: kernelspec must be python3, the kernel nbclient starts")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_relative_links_exist(path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type != "markdown":
      continue
    for target in re.findall(r"\]\(([^)\s]+)\)", cell.source):
      if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|#", target):
        continue
      assert (path.parent / target.split("#")[0]).exists(), f"{path.name}: {target}"


def _kernel_manager(tmp_path):
  """A kernel manager whose "python3" kernel is this interpreter.

  A "python3" kernelspec elsewhere on the machine (~/.local/share/jupyter, a
  system Jupyter) could point to another Python without jaxprec; this one can't.
  """
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.manager import KernelManager

  kernels = tmp_path / "kernels"
  (kernels / "python3").mkdir(parents=True)
  (kernels / "python3" / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (pytest)", "language": "python"}))
  return KernelManager(kernel_name="python3",
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, tmp_path):
  nbclient = pytest.importorskip(
      "nbclient", reason=f"nbclient is part of the test extra: {TEST_EXTRA}")
  pytest.importorskip("ipykernel", reason=f"ipykernel is part of the test extra: {TEST_EXTRA}")
  psutil = pytest.importorskip("psutil", reason=f"psutil comes with ipykernel: {TEST_EXTRA}")
  nb = nbformat.read(path, as_version=4)
  # The kernel inherits this environment: start it at the backend default, as a
  # fresh user would, whatever the CI machine sets.
  env = {k: v for k, v in os.environ.items() if k != "JAX_DEFAULT_MATMUL_PRECISION"}
  env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
  km = _kernel_manager(tmp_path)
  kernel, cpu = [], [0.0]

  def on_notebook_start(**_):
    kernel.append(psutil.Process(km.provisioner.pid))

  def on_cell_executed(**_):  # the kernel is still running; after the last cell it is gone
    t = kernel[0].cpu_times()
    cpu[0] = t.user + t.system + t.children_user + t.children_system

  client = nbclient.NotebookClient(
      nb, km=km, timeout=CELL_TIMEOUT_S,
      resources={"metadata": {"path": str(path.parent)}},
      on_notebook_start=on_notebook_start, on_cell_executed=on_cell_executed)
  start = time.perf_counter()
  try:
    client.execute(env=env)
  except nbclient.exceptions.CellExecutionError as e:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # drop the traceback's colours
    pytest.fail(f"{path.name} failed:\n{plain}")
  elapsed = time.perf_counter() - start
  errors = [out for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]
  assert not errors, f"{path.name}: error outputs {errors}"
  ran = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert ran and all(cell.execution_count for cell in ran), "not every cell ran"
  # The committed file is untouched: execution happened on the copy in memory.
  assert not any(c.get("outputs") for c in nbformat.read(path, as_version=4).cells
                 if c.cell_type == "code")
  assert kernel and cpu[0] > 0, "the kernel's CPU time was not measured"
  print(f"{path.name}: executed in {elapsed:.1f} s ({cpu[0]:.1f} s of CPU)")
