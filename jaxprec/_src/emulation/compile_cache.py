"""JAX's persistent compilation cache, for jaxprec's checks and searches.

Most of a ``jaxprec check`` of a small model is compiling its programs (the
reference, one per precision, one per policy), and the next run compiles the
same programs again. JAX's persistent compilation cache stores each compiled
program on disk, keyed by its HLO, the compile options, the backend and the
jaxlib version, so that a later process loads it instead:
:func:`enable_compilation_cache` for the rest of the process,
:func:`compilation_cache` for a ``with`` block (``jaxprec check``, ``jaxprec
search``, ``cache=True``), in :func:`default_dir`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from jaxprec._src.emulation import kernels

# The JAX settings that the cache changes; compilation_cache restores them.
_SETTINGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
             "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


def default_dir() -> str:
  """``jax-compilation`` in jaxprec's cache directory (``JAXPREC_CACHE_DIR``).

  Examples:
    >>> import os
    >>> os.path.basename(default_dir())
    'jax-compilation'
  """
  return os.path.join(kernels.cache_dir(), "jax-compilation")


def checked_dir(path: str | os.PathLike | None) -> str:
  """``path`` (default :func:`default_dir`) as an absolute path, created."""
  if path is None:
    path = default_dir()
  elif isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"the compilation cache path must be a str or os.PathLike "
                    f"(or None for {default_dir()!r}), got "
                    f"{type(path).__name__} {path!r}")
  if not os.fspath(path):
    raise ValueError(f"the compilation cache path is empty: pass a directory, "
                     f"or None for {default_dir()!r}")
  # `~` is the home directory, as in JAXPREC_CACHE_DIR.
  path = os.path.abspath(os.path.expanduser(os.fspath(path)))
  if os.path.isfile(path):
    raise ValueError(f"the compilation cache path {path!r} is a file, not a "
                     f"directory: choose a directory, e.g. {default_dir()!r}")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"cannot create the compilation cache directory "
                     f"{path!r}: {e.strerror or e}; set JAXPREC_CACHE_DIR to "
                     f"a writable directory, or turn the cache off") from None
  return path


def _reset() -> None:
  """Makes JAX open the cache again from its settings at the next compile
  (JAX keeps it open until reset: changing the setting alone is not enough)."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  cc.reset_cache()


def _apply(path: str) -> None:
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # -1: no minimum size (0 would let JAX choose one for the filesystem).
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  _reset()


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str:
  """Turns on JAX's persistent compilation cache for the rest of the process.

  Compiled programs are then written to ``path`` and loaded from it by later
  processes (and by this one, after JAX's in-memory caches), including small
  ones: the minimum compile time and entry size are set to zero. To turn the
  cache on for one call only, pass ``cache=True`` to :func:`jaxprec.check` or
  :func:`jaxprec.search_policy`, which restore JAX's settings afterwards.

  The cache holds compiled programs only (with any constants they embed: the
  arrays ``fn`` closes over). Delete the directory to clear it. It is trusted
  code: never use a directory that others may write to.

  Args:
    path: the directory (created if missing). Default:
      ``$JAXPREC_CACHE_DIR/jax-compilation``, else ``jax-compilation`` in the
      user's cache directory (``~/.cache/jaxprec/jax-compilation`` on Linux).

  Returns:
    The absolute path of the cache directory.

  Raises:
    TypeError: ``path`` is not a ``str``, ``os.PathLike`` or ``None``.
    ValueError: ``path`` is a file or cannot be created.

  Examples:
    >>> import jaxprec
    >>> jaxprec.enable_compilation_cache()  # doctest: +SKIP
    '/home/me/.cache/jaxprec/jax-compilation'
  """
  checked = checked_dir(path)
  _apply(checked)
  return checked


@contextlib.contextmanager
def compilation_cache(path: str | os.PathLike | None = None) -> Iterator[str]:
  """JAX's persistent compilation cache on in a ``with`` block, then restored.

  Within the block, programs compile as :func:`enable_compilation_cache`
  describes; afterwards JAX's cache settings are what they were (also when
  the block raises). The settings are process-wide: another thread compiling
  during the block uses the cache too.

  Args:
    path: as for :func:`enable_compilation_cache`.

  Yields:
    The absolute path of the cache directory.

  Raises:
    TypeError, ValueError: as :func:`enable_compilation_cache`.

  Examples:
    >>> import jax, os, tempfile
    >>> before = jax.config.jax_persistent_cache_min_compile_time_secs
    >>> with compilation_cache(tempfile.mkdtemp()) as d:
    ...   _ = jax.jit(lambda x: x + 1)(1.0)
    >>> len(os.listdir(d)) > 0
    True
    >>> jax.config.jax_persistent_cache_min_compile_time_secs == before
    True
  """
  checked = checked_dir(path)
  import jax
  saved = {name: getattr(jax.config, name) for name in _SETTINGS}
  try:
    _apply(checked)
    yield checked
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
    _reset()


def resolve_cache(cache: bool | str | os.PathLike | None,
                  who: str) -> str | os.PathLike | None:
  """The cache directory that ``cache=`` of ``who`` asks for, or None for off.

  ``False`` or ``None``: off; ``True``: :func:`default_dir`; a ``str`` or
  ``os.PathLike``: that directory.

  Raises:
    TypeError: any other value (the message names the choices).

  Examples:
    >>> resolve_cache(False, "jaxprec.check") is None
    True
    >>> resolve_cache(True, "jaxprec.check") == default_dir()
    True
  """
  if cache is None or cache is False:
    return None
  if cache is True:
    return default_dir()
  if isinstance(cache, (str, os.PathLike)):
    if not os.fspath(cache):
      raise ValueError(f"{who}: cache='' is not a directory: pass True for "
                       f"{default_dir()!r}, a directory, or False")
    return cache
  raise TypeError(f"{who}: cache must be True (the default directory "
                  f"{default_dir()!r}), False, or a directory (str or "
                  f"os.PathLike), got {type(cache).__name__} {cache!r}")
