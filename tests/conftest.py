"""Shared fixtures: every test leaves JAX's global precision state as it found it."""

import os

import jax
import pytest


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
