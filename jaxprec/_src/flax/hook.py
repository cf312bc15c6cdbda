"""The one per-module hook: a policy's decisions around every Flax module call.

Both Flax APIs run each module call through this hook, so one policy gives a
linen model and an NNX model with the same modules the same program:

* **linen**: ``flax.linen.intercept_methods`` calls the interceptor of
  :mod:`jaxprec._src.flax.interception` around every module method call.
* **NNX**: NNX has no method interception. :func:`install` gives each module
  of a copy of the model (a clone, or the traced copy ``nnx.merge`` makes) a
  call wrapper of its own: the instance's class becomes a subclass of its class
  (same name, same state) whose ``__call__`` runs the module's call through
  :func:`run`. Being in the class, the wrapper follows the module into the
  copies that NNX transforms (``nnx.jit``, ``nnx.scan``) and ``nnx.clone``
  make.

Around each call the hook asks the policy in force
(:func:`jaxprec._src.flax.state.active`) for the module's precision
(:func:`decide`: its path, type and op kind) and runs the call under
``jax.default_matmul_precision`` at :func:`jaxprec._src.core.numerics.flag_for` of
it. JAX writes the flag into every ``dot_general`` and
``conv_general_dilated`` recorded without an explicit precision while the call
traces, so the policy reaches every matmul of the module's own code: layers,
a raw ``x @ w``, ``jnp.einsum``, attention scores. Inside a
:func:`jaxprec._src.flax.paths.record` block (an audit) the NNX call also
records its path (:func:`jaxprec._src.flax.paths.nnx_call`).

A swapped NNX model's wrappers also carry an :class:`Entry`: a call made while
its policy is not in force (the user calling the model) enters it there, and
runs the call natively or through :func:`jaxprec.emulate`.

Imports Flax NNX only when given NNX modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any, Protocol

import jax

from jaxprec._src.core import numerics
from jaxprec._src.core.precision import Precision
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.flax.identity import classify_nnx, own_precision
from jaxprec._src.flax.state import ActiveScope, active
from jaxprec._src.policy.policy import Rule


@dataclasses.dataclass(frozen=True)
class Decision:
  """What a policy decided for one module call.

  Attributes:
    flag: the value of JAX's matmul precision flag the call runs under.
    precision: the precision the module's ops run at (its own, if it keeps
      one), or None.
    rule: the policy's rule that matched, or None.
    kept: the module keeps a ``precision`` of its own.
  """

  flag: Any
  precision: Precision | None
  rule: Rule | None
  kept: bool


def decide(scope: ActiveScope, path: str, module: Any, module_type: str | None,
           kind: str) -> Decision:
  """``scope``'s policy's :class:`Decision` for one module call.

  The flag is the policy's precision for the module's path, type and op kind
  (:func:`jaxprec._src.core.numerics.flag_for`); a module that keeps a
  ``precision`` of its own (:func:`own_precision`) runs at that one, so that
  ops of its call which take no precision argument
  (``jax.nn.dot_product_attention``) get it too; the flag outside the scope
  when the policy decides nothing.
  """
  p, rule = scope.policy.match(path, module_type, kind)
  kept, shown = (own_precision(module, p, kind) if module_type is not None
                 else (False, p))
  run_at = shown if kept and shown is not None else p
  flag = scope.outer_flag if run_at is None else numerics.flag_for(run_at, kind)
  return Decision(flag, shown, rule, kept)


class Entry(Protocol):
  """What a swapped NNX model's wrappers carry: its policy, and how to run a
  call that starts outside it."""

  def in_force(self) -> bool:
    """Whether the call runs inside this entry's policy already."""

  def enter(self, module: Any, path: str, call: Callable[..., Any],
            args: tuple, kwargs: dict) -> Any:
    """Runs ``call(module, *args, **kwargs)`` under the entry's policy."""


def run(module: Any, path: str, call: Callable[..., Any], args: tuple,
        kwargs: dict, entry: Entry | None = None) -> Any:
  """``call(module, *args, **kwargs)``, the call of the NNX module at ``path``,
  through the hook.

  With an ``entry`` whose policy is not in force yet, the entry runs it (and
  comes back here). Otherwise the call runs at the flag :func:`decide` gives
  it under the policy in force (none: as it is), inside
  :func:`jaxprec._src.flax.paths.nnx_call` of its path.
  """
  if entry is not None and not entry.in_force():
    return entry.enter(module, path, call, args, kwargs)
  scope = active()
  flag = contextlib.nullcontext()
  if scope is not None:
    module_type, kind = classify_nnx(module)
    flag = jax.default_matmul_precision(
        decide(scope, path, module, module_type, kind).flag)
  with flax_paths.nnx_call(path), flag:
    return call(module, *args, **kwargs)


def base_class(cls: type) -> type:
  """The user's class behind a hooked NNX class (``cls`` itself otherwise)."""
  return getattr(cls, "_jaxprec_nnx_base", cls)


def install(model: Any, entry: Entry | None = None,
            classes: dict | None = None) -> None:
  """Gives every module of ``model`` (a copy: never the user's) the hook, in place.

  Each module, found by :func:`jaxprec._src.flax.paths.nnx_modules` with its
  path, gets the hooked subclass of its class for that path (and ``entry``).
  With ``entry`` None, a module hooked already keeps its hook (a swapped
  model's, with its entry). ``classes`` caches the classes made for
  ``entry`` (the caller owns it, so that the cache lives as long as the
  entry); without an entry a process-wide cache serves. A class that cannot be
  subclassed so (``__slots__``, arguments to ``__init_subclass__``) or that
  has no ``__call__`` is left as is: its ops belong to the enclosing module.
  """
  for path, node in flax_paths.nnx_modules(model):
    if entry is None and "_jaxprec_nnx_base" in vars(type(node)):
      continue
    base = base_class(type(node))
    if entry is None:
      cls = _hooked_class(base, path)
    else:
      key = (base, path)
      if key not in classes:
        classes[key] = _make_class(base, path, entry)
      cls = classes[key]
    if cls is None:
      continue
    try:
      object.__setattr__(node, "__class__", cls)
    except TypeError:  # an incompatible layout (__slots__)
      continue


@functools.lru_cache(maxsize=4096)
def _hooked_class(cls: type, path: str) -> type | None:
  return _make_class(cls, path, None)


def _make_class(cls: type, path: str, entry: Entry | None) -> type | None:
  """``cls`` with its ``__call__`` run through :func:`run` at ``path``."""
  if not callable_class(cls):
    return None  # not callable: nothing to wrap
  call = cls.__call__

  def __call__(self, *args, **kwargs):
    return run(self, path, call, args, kwargs, entry)

  # NNX's Pytree takes the subclass's pytree-ness as a class argument whose
  # default is the global config, not the parent's: pass the parent's.
  kwargs = ({"pytree": cls._pytree__is_pytree}
            if hasattr(cls, "_pytree__is_pytree") else {})
  try:
    return type(cls.__name__, (cls,), {
        "__call__": functools.wraps(call)(__call__),
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__, "_jaxprec_nnx_base": cls}, **kwargs)
  except TypeError:  # a class whose subclassing needs arguments
    return None


def callable_class(cls: type) -> bool:
  """Whether instances of ``cls`` are callable (it or a base defines
  ``__call__``): the modules the hook wraps and a policy decides for."""
  return any("__call__" in vars(c) for c in cls.__mro__[:-1])


def is_nnx_module(value: Any) -> bool:
  """Whether ``value`` is an ``nnx.Module`` (False when NNX is not imported)."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(value, nnx.Module)
