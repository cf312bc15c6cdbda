"""Shared fixtures: every test leaves JAX's global precision state as it found it.

The suite runs in parallel (pytest-xdist, ``-n auto --dist loadfile`` in the
README's command): every worker has its own temporary directories (tmp_path,
the session's ``JAXPREC_CACHE_DIR``), and no test writes into the repository.
"""

import os

import jax
import pytest

# Workers ``-n auto`` starts at most: each imports JAX, Flax, PyTorch and
# transformers (a few hundred MB), and the slowest test file bounds the run.
MAX_AUTO_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
  """``-n auto``: one worker per CPU this process may run on (logical CPUs,
  cgroup affinity respected; psutil's default counts physical cores, which is
  1 on a 2-vCPU cloud machine), at most ``MAX_AUTO_WORKERS``;
  ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it."""
  del config
  env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
  if env:
    return int(env)
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # macOS, Windows
    cpus = os.cpu_count() or 1
  return max(1, min(cpus, MAX_AUTO_WORKERS))


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
  """jaxprec's caches (kernel benchmark, compiled programs) go to a temporary
  directory, never to the user's ~/.cache; subprocesses inherit it."""
  before = os.environ.get("JAXPREC_CACHE_DIR")
  os.environ["JAXPREC_CACHE_DIR"] = str(tmp_path_factory.mktemp("jaxprec-cache"))
  yield
  if before is None:
    os.environ.pop("JAXPREC_CACHE_DIR", None)
  else:
    os.environ["JAXPREC_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def _restore_matmul_precision():
  before = jax.config.jax_default_matmul_precision
  yield
  jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(autouse=True)
def _restore_emulation_kernel():
  import jaxprec  # pylint: disable=import-outside-toplevel
  from jaxprec._src import compat  # pylint: disable=import-outside-toplevel
  before = compat.kernel_state().get_global()
  yield
  jaxprec.set_kernel(before)


def lowered(fn, *args) -> str:
  """StableHLO text of ``jax.jit(fn)`` on ``args``."""
  return jax.jit(fn).lower(*args).as_text()
