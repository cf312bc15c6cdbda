"""The one per-module hook: a policy's decisions around every Flax module call.

Both Flax APIs run each module call through :func:`decide`, so one policy
gives a linen model and an NNX model with the same modules the same program:

* **linen**: ``flax.linen.intercept_methods`` calls the interceptor of
  :mod:`jaxprec._src.flax.interception` around every module method call.
* **NNX**: NNX has no method interception. :func:`install` gives each module
  of a copy of the model (a clone, or the traced copy ``nnx.merge`` makes) a
  subclass of its class (same name, same state) whose ``__call__`` runs
  through :func:`run`. Being in the class, the wrapper follows the module into
  the copies that NNX transforms (``nnx.jit``, ``nnx.scan``) and
  ``nnx.clone`` make.

Each call runs under ``jax.default_matmul_precision`` (thread-local, restored
on return) at the flag for the precision the policy in force gives the
module's path, type and op kind. JAX writes the flag into every
``dot_general`` and ``conv_general_dilated`` recorded without an explicit
precision while the call traces (the jax.default_matmul_precision docs), so
the policy reaches every matmul of the module's own code: layers, a raw
``x @ w``, ``jnp.einsum``, attention scores; nothing is left to do at run
time.

What a module is to a policy (:func:`classify`: its type and op kind) is
decided here too, for both APIs. Across Flax's bridges the paths are the full
paths from the model called (:mod:`jaxprec._src.flax.paths`): a
``flax.nnx.bridge.ToNNX`` call is a bridge frame for the linen module inside
it, and the NNX module a ``flax.nnx.bridge.ToLinen`` makes in its linen call
gets the hook for that call, at paths under the ToLinen's
(:func:`linen_bridge`). Imports Flax NNX only when given NNX modules.

Beside the policy's decision, the hook lets observers see each module call
(:func:`observing`): its path, module, arguments and output, as the call
returns, for both APIs (a port check records the layers of a model so).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
from jax import lax

from jaxprec._src.core import numerics
from jaxprec._src.core.precision import Precision, resolve
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.flax.state import active
from jaxprec._src.policy.policy import Policy, Rule


def per_op_precision(value: Any, *, conv: bool) -> Any:
  """What a Flax module should pass to ``lax`` for a jaxprec ``precision=``.

  None and ``lax.DotAlgorithm`` objects pass through, as do pairs of
  different levels; anything else is resolved and becomes
  :func:`jaxprec._src.core.numerics.per_op` of its kind (a convolution gets a
  preset's level).
  """
  if value is None or isinstance(value, lax.DotAlgorithm):
    return value
  if (isinstance(value, (tuple, list)) and len(value) == 2
      and all(isinstance(v, lax.Precision) for v in value)
      and value[0] != value[1]):
    return tuple(value)
  return numerics.per_op(resolve(value), "conv" if conv else "dot")


def classify(module: Any, table: Sequence[tuple[Any, str]]
             ) -> tuple[str | None, str]:
  """``(module type, op kind)`` of a Flax module; type None for other modules.

  The type is that of the first ``(classes, type)`` row of ``table`` whose
  classes ``module`` is an instance of, else ``'Attention'`` for a class named
  so (attention modules of other libraries, Hugging Face's
  ``FlaxBertSelfAttention``, subclass nothing of Flax's). The op kind follows
  from the type: ``'attention'`` for attention modules, ``'conv'`` for
  convolutions, ``'dot'`` for the rest.
  """
  for classes, module_type in table:
    if isinstance(module, classes):
      return module_type, _KINDS.get(module_type, "dot")
  if "Attention" in type(module).__name__:
    return "Attention", "attention"
  return None, "dot"


_KINDS = {"Attention": "attention", "Conv": "conv", "ConvTranspose": "conv"}


@functools.cache
def _nnx_types() -> tuple[tuple[Any, str], ...]:
  from flax import nnx  # noqa: PLC0415 -- Flax only when in use
  return ((nnx.MultiHeadAttention, "Attention"),
          (nnx.ConvTranspose, "ConvTranspose"), (nnx.Conv, "Conv"),
          (nnx.LinearGeneral, "DenseGeneral"), (nnx.Linear, "Dense"),
          (nnx.Einsum, "Einsum"))


def classify_nnx(module: Any) -> tuple[str | None, str]:
  """``(module type, op kind)`` of an NNX module (:func:`classify`)."""
  return classify(module, _nnx_types())


def decide(policy: Policy, path: str, module: Any, module_type: str | None,
           kind: str, outer_flag: Any = None
           ) -> tuple[Any, Precision | None, Rule | None, bool]:
  """``(flag, precision, rule, kept)``: what ``policy`` decides for one call.

  ``flag``, the value of JAX's matmul precision flag the call runs under, is
  that of the policy's precision for the module's path, type and op kind
  (:func:`jaxprec._src.core.numerics.flag_for`); a module that keeps a
  ``precision`` of its own (``kept``: one that is not what the policy's
  precision sets, as on a swapped model) runs at that one, so that ops of its
  call which take no precision argument (``jax.nn.dot_product_attention``) get
  it too; ``outer_flag`` (the flag outside the policy's scope) when the
  policy decides nothing. ``precision`` is the one the module's ops run at
  (None: left as it was, or its own that jaxprec cannot resolve), ``rule``
  the policy's rule that matched (or None).
  """
  p, rule = policy.match(path, module_type, kind)
  own = None if module_type is None else getattr(module, "precision", None)
  kept = own is not None and (
      p is None or own != per_op_precision(p, conv=kind == "conv"))
  shown = run_at = p
  if kept:
    try:
      shown = run_at = resolve(own)
    except (TypeError, ValueError):
      shown = None
  flag = outer_flag if run_at is None else numerics.flag_for(run_at, kind)
  return flag, shown, rule, kept


def run(module: Any, path: str, call: Callable[..., Any], args: tuple,
        kwargs: dict, entry: Any = None) -> Any:
  """``call(module, *args, **kwargs)``, the call of the NNX module at ``path``,
  through the hook.

  ``entry``, on a swapped model's modules, is its way into its policy: while
  ``entry.in_force()`` is False, ``entry.enter(module, path, call, args,
  kwargs)`` runs the call under the policy (and comes back here). Otherwise
  the call runs at the flag :func:`decide` gives it under the policy in force
  (none: as it is), inside :func:`jaxprec._src.flax.paths.nnx_call` of its
  path.
  """
  if entry is not None and not entry.in_force():
    return entry.enter(module, path, call, args, kwargs)
  scope = active()
  flag = contextlib.nullcontext()
  if scope is not None:
    module_type, kind = classify_nnx(module)
    flag = jax.default_matmul_precision(
        decide(scope.policy, scope.relative(flax_paths.split(path)), module,
               module_type, kind, scope.outer_flag)[0])
  bridge = isinstance(module, sys.modules["flax.nnx"].bridge.ToNNX)
  with flax_paths.nnx_call(path, bridge=bridge), flag:
    out = call(module, *args, **kwargs)
  return _observed(path, module, args, kwargs, out)


class Observer(Protocol):
  """Sees one module call as it returns (:func:`observing`; with
  ``methods=True``, also given ``method=``, the method's name); returns None,
  or the output the call returns instead (the same structure and values:
  ``check_module`` marks each leaf with ``checkpoint_name``)."""

  def __call__(self, path: str, module: Any, args: tuple, kwargs: dict,
               output: Any) -> Any:
    ...


class _Observers(threading.local):
  """This thread's observers, outermost first, each with whether it sees
  every method (:func:`observing`'s ``methods``)."""

  def __init__(self):
    self.stack: list[tuple[Observer, bool]] = []


_OBSERVERS = _Observers()


def _observed(path: str, module: Any, args: tuple, kwargs: dict,
              out: Any, method: str = "__call__") -> Any:
  """``out``, as the observers see it and may replace it, innermost last."""
  for observer, methods in _OBSERVERS.stack:
    if methods or method == "__call__":
      seen = observer(path, module, args, kwargs, out,
                      **({"method": method} if methods else {}))
      out = out if seen is None else seen
  return out


@contextlib.contextmanager
def observing(observer: Observer, *, methods: bool = False) -> Iterator[None]:
  """``observer(path, module, args, kwargs, output)`` for every module
  ``__call__`` that returns in the block, in the order the calls end
  (children before their parent; the top module's path is ``''``).

  NNX modules are seen through the hook's call wrapper (on a copy that
  :func:`install` gave the hook); linen modules through an interceptor of
  ``flax.linen.intercept_methods`` (when linen is imported), at the paths
  :class:`jaxprec._src.flax.paths.ModulePaths` gives them (a linen module is
  passed bound, as it ran). The observer runs while the call's trace does:
  inside a JAX transform its values are that transform's tracers. What it
  returns, where not None, is the call's output from then on.

  ``methods``: the observer also sees the calls of a linen module's other
  methods (not ``setup``), and each call as ``observer(path, module, args,
  kwargs, output, method=name)``; NNX calls are ``__call__``'s only.
  """
  _OBSERVERS.stack.append((observer, methods))
  try:
    with _linen_observed():
      yield
  finally:
    _OBSERVERS.stack.pop()


@contextlib.contextmanager
def _linen_observed() -> Iterator[None]:
  """Linen module calls reach the observers (one interceptor per thread)."""
  if "flax.linen" not in sys.modules or len(_OBSERVERS.stack) > 1:
    yield
    return
  nn = sys.modules["flax.linen"]
  paths = flax_paths.ModulePaths()

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    path = paths.of(module)
    with paths.entered(path, module):
      out = next_fun(*args, **kwargs)
    if module.scope is not None and context.method_name != "setup":
      out = _observed(flax_paths.join(path), module, args, kwargs, out,
                      context.method_name)
    return out
  with nn.intercept_methods(interceptor):
    yield


def linen_bridge(module: Any, path: tuple[str, ...], method_name: str,
                 kwargs: dict) -> dict:
  """The kwargs of a linen module's method call, for the NNX module inside.

  A ``flax.nnx.bridge.ToLinen`` makes its NNX module anew in each call and
  calls ``nnx_method`` on it: for its ``__call__``, ``nnx_method`` becomes a
  function that gives that module and its submodules the hook at paths under
  ``path`` (the ToLinen's: its NNX module has its path, as a linen module has
  its ToNNX's) for the call, records the policy's decisions for them, and
  calls the method asked for. Any other call's kwargs come back as they are.
  Set as :data:`jaxprec._src.flax.paths.linen_bridge`.
  """
  nnx = sys.modules.get("flax.nnx")
  method = kwargs.get("nnx_method")
  if (nnx is None or method_name != "__call__"
      or not isinstance(module, nnx.bridge.ToLinen)
      or getattr(method, "_jaxprec_bridge", False)):  # the other interceptor's
    return kwargs
  prefix = flax_paths.join(path)

  def bridged(node, *args, **kw):
    nodes = [(n, type(n)) for _, n in flax_paths.nnx_modules(node)]
    install(node, prefix=prefix)
    _record(node, prefix)
    try:
      if method is None:
        return node(*args, **kw)
      if isinstance(method, str):
        return getattr(node, method)(*args, **kw)
      return method(node, *args, **kw)
    finally:  # the module may be one the user holds (nnx_class a function)
      for n, cls in nodes:
        object.__setattr__(n, "__class__", cls)

  bridged._jaxprec_bridge = True  # noqa: SLF001
  return {**kwargs, "nnx_method": bridged}


flax_paths.linen_bridge = linen_bridge


def _record(model: Any, prefix: str) -> None:
  """Records the decisions of the policy in force for the modules of
  ``model`` (at ``prefix``), as the NNX policy records those of a model."""
  scope = active()
  if scope is None or scope.recorder is None:
    return
  for path, node in flax_paths.nnx_modules(model, prefix):
    if callable_class(type(node)):
      module_type, kind = classify_nnx(node)
      path = scope.relative(flax_paths.split(path))
      _, shown, rule, kept = decide(scope.policy, path, node, module_type, kind)
      scope.recorder.record(path, module_type, kind, shown, rule, kept=kept)


def base_class(cls: type) -> type:
  """The user's class behind a hooked NNX class (``cls`` itself otherwise)."""
  return getattr(cls, "_jaxprec_nnx_base", cls)


def install(model: Any, entry: Any = None, *, prefix: str = "") -> None:
  """Gives every module of ``model`` (a copy: never the user's) the hook, in place.

  Each module gets the hooked subclass of its class for its path (under
  ``prefix``, ``model``'s own path; and ``entry``, whose ``classes`` dict
  keeps those made for it); with ``entry`` None, a module hooked already (a
  swapped model's) keeps its hook. A class that cannot be subclassed so
  (an incompatible layout) or has no ``__call__`` is left as is: its ops
  belong to the enclosing module.
  """
  for path, node in flax_paths.nnx_modules(model, prefix):
    if entry is None and "_jaxprec_nnx_base" in vars(type(node)):
      continue
    key = (base_class(type(node)), path)
    if entry is None:
      cls = _hooked_class(*key)
    else:
      if key not in entry.classes:
        entry.classes[key] = _make_class(*key, entry)
      cls = entry.classes[key]
    if cls is not None:
      with contextlib.suppress(TypeError):  # an incompatible layout (__slots__)
        object.__setattr__(node, "__class__", cls)


@functools.lru_cache(maxsize=4096)
def _hooked_class(cls: type, path: str) -> type | None:
  return _make_class(cls, path, None)


def _make_class(cls: type, path: str, entry: Any) -> type | None:
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
  namespace = {
      "__call__": functools.wraps(call)(__call__),
      "__module__": cls.__module__, "__qualname__": cls.__qualname__,
      "__doc__": cls.__doc__, "_jaxprec_nnx_base": cls}
  for bases in ((cls,), (_unargued(), cls)):
    try:
      return type(cls.__name__, bases, namespace, **kwargs)
    except TypeError:  # its __init_subclass__ needs arguments: _unargued
      continue
  return None


@functools.cache
def _unargued() -> type:
  """The first base of a hooked class whose class's ``__init_subclass__``
  needs arguments that the hook cannot know (``class Block(Base, tag=...)``).

  The chain of ``__init_subclass__`` runs from past the classes that refuse
  to run without them (so NNX's own runs, which registers the class); what
  they set on the user's class, the hooked class inherits. An NNX ``Pytree``
  without attributes of its own, so that the instances keep their layout.
  """
  class Unargued(sys.modules["flax.nnx"].Pytree):
    __slots__ = ()

    def __init_subclass__(cls, **kwargs):
      owners = [c for c in cls.__mro__[1:] if "__init_subclass__" in vars(c)]
      errors = []
      for after in owners[:-1]:  # this class's, then past each other's
        try:
          return super(after, cls).__init_subclass__(**kwargs)
        except TypeError as e:
          errors.append(e)
      raise errors[0]
  for name in ("_pytree__is_pytree", "_pytree__nodes"):  # the user's class's
    if name in vars(Unargued):
      delattr(Unargued, name)
  return Unargued


def callable_class(cls: type) -> bool:
  """Whether instances of ``cls`` are callable (it or a base defines
  ``__call__``): the modules the hook wraps and a policy decides for."""
  return any("__call__" in vars(c) for c in cls.__mro__[:-1])


def is_nnx_module(value: Any) -> bool:
  """Whether ``value`` is an ``nnx.Module`` (False when NNX is not imported)."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(value, nnx.Module)
