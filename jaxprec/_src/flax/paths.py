"""Flax module paths: the one source for the interceptor and the audit.

A module's path is the ``'/'``-joined names from the top module down, without
the top module's class name (``'encoder/layer/0/attention/self'``; ``()`` for
the top module). :class:`ModulePaths` computes it for a linen module while it
runs; the policy interceptor (:mod:`jaxprec._src.flax.interception`) and the
audit (:func:`record`, :func:`lookup`) both ask it, so a policy rule written
from ``jaxprec.audit(...)`` rows' ``.module_path`` matches the modules the
interceptor sees.

This module imports Flax only inside :func:`record`, and only when Flax linen
is already imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from jaxprec._src import compat

__all__ = ["ModulePaths", "join", "lookup", "record"]


def join(path: tuple[str, ...]) -> str:
  """The text form of a path: its names joined with ``'/'``."""
  return "/".join(path)


class ModulePaths:
  """Full module paths, including modules applied inside another's method.

  ``module.path`` is its scope's path. Lifted transforms (``nn.remat``,
  ``nn.scan``, ``nn.jit``, ``nn.vmap``, ...) make new root scopes that keep
  the full path. A module applied with its own ``.apply`` inside another
  module's method (Hugging Face's ``FlaxConvWithWeightNorm`` does
  ``self.conv.apply(...)``) has a new root with an empty path: its path
  continues the caller's, with its name, as JAX's name stack does.

  Use :meth:`of` for a module about to run and :meth:`entered` around its
  call, so that modules applied inside it find their caller.
  """

  def __init__(self):
    self._bases: dict[int, tuple[Any, tuple[str, ...]]] = {}
    self._frames: list[tuple[str, ...]] = []

  def of(self, module: Any) -> tuple[str, ...]:
    """The path of a linen module (``()`` for an unbound one)."""
    scope = module.scope
    if scope is None:
      return ()
    root = scope.root
    hit = self._bases.get(id(root))
    if hit is None or hit[0] is not root:
      nested_apply = self._frames and not tuple(root.path)
      base = ((*self._frames[-1], module.name or type(module).__name__)
              if nested_apply else ())
      self._bases[id(root)] = hit = (root, base)
    return (*hit[1], *(str(p) for p in scope.path))

  @contextlib.contextmanager
  def entered(self, path: tuple[str, ...]) -> Iterator[None]:
    """The block runs inside the call of the module at ``path``."""
    self._frames.append(path)
    try:
      yield
    finally:
      self._frames.pop()


@contextlib.contextmanager
def record() -> Iterator[dict[str, list[str]]]:
  """Records, while tracing, the JAX name stack of every linen module call.

  Yields a dict filled as modules run: the name stack (as text, relative to
  the jaxpr being traced, as equations record it) of each module method call
  -> the paths (:func:`join` of :meth:`ModulePaths.of`) of the modules called
  with that name stack, in first-call order. Several modules share a relative
  name stack when they run in different sub-jaxprs (``nn.remat(Dense)(name=
  'rem')`` in two parents: ``'rem'`` in each); :func:`lookup` tells them
  apart. Flax's named scopes are switched on for the block so that equations
  carry their modules' names. Without Flax linen imported, the dict stays
  empty.
  """
  found: dict[str, list[str]] = {}
  if "flax.linen" not in sys.modules:
    yield found
    return
  from flax import linen as nn  # noqa: PLC0415 -- Flax only when in use

  paths = ModulePaths()

  def interceptor(next_fun, args, kwargs, context):
    path = paths.of(context.module)
    seen = found.setdefault(compat.current_name_stack(), [])
    if join(path) not in seen:
      seen.append(join(path))
    with paths.entered(path):
      return next_fun(*args, **kwargs)

  # Flax names its calls' scopes unless profiling names are off (flax_profile);
  # flax.linen.module._use_named_call is private: default to on if it moves.
  named = getattr(nn.module, "_use_named_call", True)
  with (contextlib.nullcontext() if named else nn.override_named_call(True)), \
       nn.intercept_methods(interceptor):
    yield found


def lookup(name_stack: str, found: dict[str, list[str]],
           within: str = "") -> str | None:
  """The module path of an equation, from what :func:`record` found.

  Args:
    name_stack: the equation's name stack, relative to its jaxpr.
    found: the dict :func:`record` filled.
    within: the module path of the equation that holds the jaxpr (``''`` at
      the top): the equation's module is inside it.

  Returns:
    The path of the innermost recorded module call enclosing ``name_stack``
    that lies within ``within`` (the first recorded if several do); None if
    none.
  """
  while True:
    for path in found.get(name_stack, ()):
      if not within or path == within or path.startswith(within + "/"):
        return path
    if "/" not in name_stack:
      return None
    name_stack = name_stack.rsplit("/", 1)[0]
