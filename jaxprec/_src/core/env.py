"""The global setting and the environment variable, checked with the same
parser and message as everything else (:func:`jaxprec.resolve`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax

from jaxprec._src.core import names
from jaxprec._src.core.precision import Precision, PrecisionLike, resolve
from jaxprec._src.jaxpr import compat

ENV_VAR = names.ENV_VAR
"""The environment variable JAX reads at import: ``"JAX_DEFAULT_MATMUL_PRECISION"``."""

# The global value jaxprec.set_default last wrote, to tell 'config' from 'env'.
_set_by_us: list[Any] = []


def flag_value_and_source() -> tuple[str | None, str]:
  """The raw flag value in force and where it came from."""
  state, unset = compat.matmul_precision_state()
  local = state.get_local()
  if local is not unset:
    return local, "context"
  value = state.get_global()
  if value is None:
    return None, "backend-default"
  if _set_by_us and _set_by_us[-1] == value:
    return value, "config"
  env = os.environ.get(ENV_VAR)
  if env is not None and names.FLAGS.get(names.canonical(env) or "", env) == value:
    return value, "env"
  return value, "config"


def set_default(p: PrecisionLike) -> Precision:
  """Sets the global default matmul precision (``jax.config``) for all threads.

  Scopes (``jaxprec.precision``) still override it. ``set_default(None)``
  returns to the backend default.

  Args:
    p: any spelling :func:`jaxprec.resolve` accepts.

  Returns:
    The precision that was in force globally before, so it can be restored with
    ``jaxprec.set_default(previous)``.

  Examples:
    >>> import jaxprec
    >>> before = jaxprec.set_default("fp32")
    >>> jaxprec.current().name, jaxprec.current().source
    ('float32', 'config')
    >>> _ = jaxprec.set_default(before)
  """
  new = resolve(p)
  previous = compat.matmul_precision_state()[0].get_global()
  jax.config.update("jax_default_matmul_precision", new.flag)
  _set_by_us.append(new.flag)
  return resolve(previous)


def env_for(p: PrecisionLike, base: Mapping[str, str] | None = None) -> dict[str, str]:
  """An environment for a subprocess that runs JAX at precision ``p``.

  Args:
    p: any spelling :func:`jaxprec.resolve` accepts; ``None`` removes the
      variable so the child gets the backend default.
    base: the environment to start from (default ``os.environ``); not modified.

  Returns:
    A new dict: ``base`` plus ``JAX_DEFAULT_MATMUL_PRECISION`` in JAX's spelling.

  Examples:
    >>> import subprocess, sys, jaxprec
    >>> env = jaxprec.env_for("fp32")
    >>> env["JAX_DEFAULT_MATMUL_PRECISION"]
    'float32'
  """
  new = resolve(p)
  env = dict(os.environ if base is None else base)
  if new.flag is None:
    env.pop(ENV_VAR, None)
  else:
    env[ENV_VAR] = new.flag
  return env


def validate_env(environ: Mapping[str, str] | None = None) -> Precision | None:
  """Checks ``JAX_DEFAULT_MATMUL_PRECISION``; returns its Precision or None if unset.

  Raises:
    ValueError: naming the variable, the bad value, the valid names and the
      closest match (JAX itself fails at import with an opaque message).
  """
  environ = os.environ if environ is None else environ
  raw = environ.get(ENV_VAR)
  if raw is None:
    return None
  try:
    return resolve(raw)
  except ValueError as e:
    raise ValueError(f"{ENV_VAR}: {e}") from None
