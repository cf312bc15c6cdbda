"""Shared fixtures: every test leaves JAX's global precision state as it found it."""

import jax
import pytest


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
