"""Flax module paths: the one source for the interceptor and the audit.

A module's path is the ``'/'``-joined names from the top module down, without
the top module's class name (``'encoder/layer/0/attention/self'``; ``()`` for
the top module). For a linen module, :class:`ModulePaths` computes it while
it runs; the policy interceptor and the audit (:func:`record`,
:func:`lookup`) both ask it, so a policy rule written from
``jaxprec.audit(...)`` rows' ``.module_path`` matches the modules the
interceptor sees. For an NNX module, it is the attribute names of
:func:`flax.nnx.iter_graph` (:func:`nnx_modules`); the NNX hook runs each
module call inside :func:`nnx_call`, which records it for the audit.

A path is always the full path from the model the user called, across
Flax's bridges: the linen module inside ``flax.nnx.bridge.ToNNX`` at ``blk``
is at ``blk`` (its submodule ``dense`` at ``blk/dense``), and the NNX modules
that ``flax.nnx.bridge.ToLinen`` named ``blk`` makes continue its path the
same way (:data:`linen_bridge`). Every module call of a thread, linen or NNX,
is a frame of one stack, so a module finds the module whose call it runs in.

Imports Flax only inside :func:`record` (and only when Flax linen is
imported already) and :func:`flax_named_call_enabled`.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import jax

from jaxprec._src.jaxpr import compat

_RECORDS = itertools.count()


def flax_named_call_enabled() -> bool:
  """Whether Flax names its module calls' scopes now (``flax_profile``).

  ``flax.linen.module._use_named_call`` is private: a bool in flax 0.12.8 and
  older, a ``ContextVar`` from flax 0.12.12 (a ContextVar is always truthy,
  so reading it as a bool said "on" under ``override_named_call(False)``).
  Defaults to on if it moves.
  """
  from flax.linen import module as linen_module  # noqa: PLC0415
  flag = getattr(linen_module, "_use_named_call", True)
  get = getattr(flag, "get", None)
  return bool(get() if callable(get) else flag)

def join(path: tuple[str, ...]) -> str:
  """The text form of a path: its names joined with ``'/'``."""
  return "/".join(path)


def split(path: str) -> tuple[str, ...]:
  """The names of a path's text form (``()`` for ``''``)."""
  return tuple(path.split("/")) if path else ()


class ModulePaths:
  """Full module paths, including modules applied inside another's method.

  ``module.path`` is its scope's path. Lifted transforms (``nn.remat``,
  ``nn.scan``, ``nn.jit``, ``nn.vmap``, ...) make new root scopes that keep
  the full path. A module applied with its own ``.apply`` inside another
  module's method (Hugging Face's ``FlaxConvWithWeightNorm`` does
  ``self.conv.apply(...)``) has a new root with an empty path: its path
  continues the caller's, with its name, as JAX's name stack does; inside
  the call of a ``flax.nnx.bridge.ToNNX`` (:func:`nnx_call` with
  ``bridge``), it is the bridge's path itself.

  Use :meth:`of` for a module about to run and :meth:`entered` around its
  call, so that modules applied inside it find their caller.
  """

  def __init__(self):
    self._bases: dict[int, tuple[Any, tuple[str, ...]]] = {}

  def of(self, module: Any) -> tuple[str, ...]:
    """The path of a linen module (``()`` for an unbound one)."""
    scope = module.scope
    if scope is None:
      return ()
    root = scope.root
    hit = self._bases.get(id(root))
    if hit is None or hit[0] is not root:
      # The caller: the innermost call of a module outside this root's tree
      # (calls of its own modules, which another interceptor entered, are
      # not).
      caller = next((c for c in reversed(_LOCAL.calls) if c[2] is not root),
                    None)
      base: tuple[str, ...] = ()
      if caller is not None and not tuple(root.path):  # applied in a call
        outer, bridge, _ = caller
        base = outer if bridge else (
            *outer, module.name or type(module).__name__)
      self._bases[id(root)] = hit = (root, base)
    return (*hit[1], *(str(p) for p in scope.path))

  @contextlib.contextmanager
  def entered(self, path: tuple[str, ...],
              module: Any = None) -> Iterator[None]:
    """The block runs inside the call of the (linen) ``module`` at ``path``."""
    scope = getattr(module, "scope", None)
    with _called(path, root=None if scope is None else scope.root):
      yield


@contextlib.contextmanager
def _called(path: tuple[str, ...], bridge: bool = False,
            root: Any = None) -> Iterator[None]:
  """The block is the call of the module at ``path`` (a frame of
  ``_LOCAL.calls``; ``root``: a linen module's root scope)."""
  _LOCAL.calls.append((path, bridge, root))
  try:
    yield
  finally:
    _LOCAL.calls.pop()


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
  carry their modules' names. NNX module calls that :func:`nnx_call` marks
  are recorded too. Without Flax linen imported, only those are.
  """
  found: dict[str, list[str]] = {}
  # A trace JAX serves from its caches (a jax.checkpoint or jax.jit function
  # inside fn, traced by an earlier record) runs no module call, and would
  # leave ``found`` empty: stale paths. A key of its own per record makes
  # JAX trace again.
  linen = "flax.linen" in sys.modules
  _LOCAL.found.append(found)
  try:
    with compat.jit_key_scope(f"jaxprec record {next(_RECORDS)}"), \
         (_record_linen(found) if linen else contextlib.nullcontext()):
      yield found
  finally:
    _LOCAL.found.pop()


@contextlib.contextmanager
def _record_linen(found: dict[str, list[str]]) -> Iterator[None]:
  """Fills ``found`` (:func:`record`) from linen module calls."""
  from flax import linen as nn  # noqa: PLC0415 -- Flax only when in use

  paths = ModulePaths()

  def interceptor(next_fun, args, kwargs, context):
    path = paths.of(context.module)
    seen = found.setdefault(compat.current_name_stack(), [])
    if join(path) not in seen:
      seen.append(join(path))
    if linen_bridge is not None:
      kwargs = linen_bridge(context.module, path, context.method_name, kwargs)
    with paths.entered(path, context.module):
      return next_fun(*args, **kwargs)

  # Flax names its calls' scopes unless profiling names are off (flax_profile).
  named = flax_named_call_enabled()
  with (contextlib.nullcontext() if named else nn.override_named_call(True)), \
       nn.intercept_methods(interceptor):
    yield


class _Local(threading.local):
  """This thread's :func:`record` dicts and module calls, innermost last.

  ``calls`` holds ``(path, bridge, root)`` per linen or NNX module call
  (:meth:`ModulePaths.entered`, :func:`nnx_call`).
  """

  def __init__(self):
    self.found: list[dict[str, list[str]]] = []
    self.calls: list[tuple[tuple[str, ...], bool, Any]] = []


_LOCAL = _Local()

# ``flax.nnx.bridge.ToLinen`` makes its NNX module inside its linen call, so
# no hook is on it: ``linen_bridge(module, path, method_name, kwargs)`` gives
# the keyword arguments of a linen module's method call with which the NNX
# module it makes (a ToLinen's) gets the per-module hook at paths under
# ``path``; the other kwargs unchanged. The hook (flax/hook.py, above this
# module, which every caller of :func:`record` imports) sets it; the policy's
# linen interceptor calls it too.
linen_bridge: Any = None


def nnx_modules(model: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """``(path, module)`` for each NNX module of ``model``, in graph order.

  The path is :func:`join` of ``prefix`` (``model``'s own path, ``''`` for
  the top) and the attribute names (list indices as text) of
  :func:`flax.nnx.iter_graph`; a module reachable by several paths is listed
  once, under its first.
  """
  nnx = sys.modules["flax.nnx"]
  for path, node in list(nnx.iter_graph(model)):
    if isinstance(node, nnx.Module):
      yield join((*split(prefix), *(str(k) for k in path))), node


@contextlib.contextmanager
def nnx_call(path: str, *, bridge: bool = False) -> Iterator[None]:
  """The block is the call of the NNX module at ``path`` (:func:`nnx_modules`).

  ``bridge``: the module is a ``flax.nnx.bridge.ToNNX``, whose linen module
  has the bridge's path (:meth:`ModulePaths.of`). Inside a :func:`record`
  block, the block runs in a ``jax.named_scope`` named after the path
  (relative to the module call that encloses it, as linen names a
  submodule's scope) and its name stack is recorded as the path's, so that
  :func:`lookup` finds the module of the block's equations.
  """
  outer = join(_LOCAL.calls[-1][0]) if _LOCAL.calls else ""
  with _called(split(path), bridge):
    if not _LOCAL.found or not path:  # the top module's ops are ''s anyway
      yield
      return
    name = (path[len(outer) + 1:] if outer and path.startswith(outer + "/")
            else path)
    with jax.named_scope(name):
      seen = _LOCAL.found[-1].setdefault(compat.current_name_stack(), [])
      if path not in seen:
        seen.append(path)
      yield


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
