"""A policy's decisions on Flax NNX modules: compute dtypes, records, the hook.

A policy reaches an NNX model through a copy of it (a clone, or the traced
copy ``nnx.merge`` makes): :func:`apply` sets the ``dtype`` of each module the
policy gives a compute dtype (:func:`decide_dtype`; a dtype rule that matches a
module without a ``dtype`` attribute is an error, :func:`check_dtypes`),
records the policy's decision for every module, and gives each module the
per-module hook (:func:`jaxprec._src.flax.hook.install`), under which each
module call runs at the precision the policy in force gives it.
:func:`jaxprec.swap` does that once, on a clone; :func:`bind` and
:class:`Lifted` do it each time a function is traced, for
:func:`jaxprec.emulate`, :func:`jaxprec.audit`, :func:`jaxprec.cost` and the
search, which are given an ``nnx.Module`` (or a bound method of one) as the
function. Paths are the ``'/'``-joined attribute names of
:func:`flax.nnx.iter_graph` (:func:`jaxprec._src.flax.paths.nnx_modules`, the
one source).

Also here: :class:`PrecisionScoped`, for the precision-aware attention module.

This module imports Flax only when called with NNX objects; it never imports
:func:`jaxprec.emulate` (which calls it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import jax

from jaxprec._src.core.precision import resolve
from jaxprec._src.flax import hook
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.flax.identity import classify_nnx, own_precision
from jaxprec._src.flax.state import Recorder, active
from jaxprec._src.policy.policy import Policy


def apply(model: Any, policy: Policy | None, recorder: Recorder | None,
          *, hooks: bool = True) -> None:
  """Applies ``policy`` to ``model``, a copy (never the user's), in place.

  Sets each module's compute dtype (:func:`decide_dtype`), records the
  policy's decision for every module that can be called in ``recorder`` (as
  the linen interceptor records every module call), and, with ``hooks``, installs the
  per-module hook (:func:`jaxprec._src.flax.hook.install`). The precisions
  themselves are decided by the hook at each call, from the policy in force.

  Raises:
    ValueError: an explicit dtype rule matches a module without a ``dtype``
      attribute (:func:`check_dtypes`).
  """
  if policy is not None:
    if policy.has_dtypes:
      check_dtypes(model, policy)
    for path, node in flax_paths.nnx_modules(model):
      module_type, kind = classify_nnx(node)
      dt, drule, how = decide_dtype(path, node, module_type, kind, policy)
      if how == "field":
        node.dtype = getattr(jax.numpy, dt)
      if recorder is not None and (how is not None
                                   or hook.callable_class(type(node))):
        p, rule = policy.match(path, module_type, kind)
        kept, shown = (own_precision(node, p, kind) if module_type is not None
                       else (False, p))
        recorder.record(path, module_type, kind, shown, rule, kept=kept,
                        dtype=dt, dtype_how=how, dtype_rule=drule)
  if hooks:
    hook.install(model)


def decide_dtype(path: str, node: Any, module_type: str | None, kind: str,
                 policy: Policy) -> tuple[str | None, Any, str | None]:
  """``(dtype, rule, how)`` of the policy for an NNX module.

  ``how``: ``'field'`` (it has a ``dtype`` attribute, to be set),
  ``'skipped'`` (none, and the dtype is the policy's default: left alone),
  None (no dtype decision). A dtype rule matching a module without one is an
  error (:func:`check_dtypes`), reported here as ``'skipped'``.
  """
  if not policy.has_dtypes:
    return None, None, None
  dt, rule = policy.match_dtype(path, module_type, kind)
  if dt is None:
    return None, None, None
  if hasattr(node, "dtype"):
    return dt, rule, "field"
  return None, rule, "skipped"


def check_dtypes(model: Any, policy: Policy) -> None:
  """Raises if a dtype rule of ``policy`` matches an NNX module of ``model``
  that has no ``dtype`` attribute.

  NNX has no method interception, so such a module cannot be cast at its
  boundary; under ``default_dtype`` such modules are left alone (and reported
  as ``'skipped'``).

  Raises:
    ValueError: naming the module's path and type, and the rule.
  """
  for path, node in flax_paths.nnx_modules(model):
    module_type, kind = classify_nnx(node)
    dt, rule = policy.match_dtype(path, module_type, kind)
    if rule is not None and not hasattr(node, "dtype"):
      raise ValueError(
          f"Policy rule {str(rule)!r} gives dtype {dt!r} to the NNX module at "
          f"path {path or '(top)'!r} of type {type(node).__name__}, which has "
          f"no dtype attribute. NNX modules cannot be cast at their boundary "
          f"(NNX has no method interception): match only modules with a dtype "
          f"attribute (e.g. nnx.Linear, nnx.LayerNorm), or use default_dtype, "
          f"which leaves such modules as they are.")


def _module_and_method(fn: Any, policy: Policy | None
                       ) -> tuple[Any, Callable[..., Any]] | None:
  """``(module, unbound method)`` of an ``nnx.Module`` or a bound method of
  one, the module's dtypes checked against ``policy`` now, not at the first
  call (:func:`check_dtypes`); None for anything else (or when NNX is not
  imported)."""
  if hook.is_nnx_module(fn):
    found = fn, type(fn).__call__
  elif isinstance(fn, types.MethodType) and hook.is_nnx_module(fn.__self__):
    found = fn.__self__, fn.__func__
  else:
    return None
  if policy is not None and policy.has_dtypes:
    check_dtypes(found[0], policy)
  return found


def _in_force(policy: Policy | None):
  """A scope of ``policy`` unless one is in force already (none for None)."""
  scope = active()
  if policy is None or (scope is not None and scope.policy == policy):
    return contextlib.nullcontext()
  return flax_scope.policy_scope(policy)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity
class Stateful:
  """An NNX module's method as a function of the module's state, its first
  argument: ``Stateful(graphdef, method)(state, *args)`` calls ``method`` on
  ``nnx.merge(graphdef, state)``.

  ``check`` and ``search_policy`` keep the programs they compile for a
  function. A program traced from the module itself would hold its
  parameters as constants, and a later check after the user changed them in
  place (an optimizer step, ``nnx.update``) would answer with the old ones: a
  stale number. With the state an argument, a program depends on the graph
  definition only (as ``nnx.jit``'s do), and every call reads the state the
  module holds then. The merged copy is made inside the program's trace, so
  what the call writes stays in it.
  """

  graphdef: Any
  method: Callable[..., Any]

  def __call__(self, state: Any, /, *args: Any, **kwargs: Any) -> Any:
    return self.method(sys.modules["flax.nnx"].merge(self.graphdef, state),
                       *args, **kwargs)

  def __post_init__(self):  # named as the user's method
    object.__setattr__(self, "__module__",
                       getattr(self.method, "__module__", None))
    object.__setattr__(self, "__qualname__",
                       getattr(self.method, "__qualname__", "Module.__call__"))
    object.__setattr__(self, "__name__",
                       getattr(self.method, "__name__", "__call__"))

  def observing(self, record: Callable[[Any], None]) -> Stateful:
    """The same call, with ``record(output)`` called on each output."""
    method = self.method

    def observed(module, *args, **kwargs):
      out = method(module, *args, **kwargs)
      record(out)
      return out
    observed.__qualname__ = getattr(method, "__qualname__", "observed")
    observed.__module__ = getattr(method, "__module__", None)
    return Stateful(self.graphdef, observed)


def stateful(fn: Callable[..., Any], args: tuple
             ) -> tuple[Callable[..., Any], tuple]:
  """``(fn, args)`` of a call, with an ``nnx.Module`` (or a bound method of
  one) as a :class:`Stateful` of its state, which leads ``args``; any other
  ``fn`` unchanged."""
  found = _module_and_method(fn, None)
  if found is None:
    return fn, args
  module, method = found
  graphdef, state = sys.modules["flax.nnx"].split(module)
  try:
    # Its text too: static attributes that compare equal but trace
    # differently (2 and 2.0, 0.0 and -0.0) give equal graph definitions.
    made = _stateful(graphdef, method, repr(graphdef))
  except TypeError:  # a graph definition that is not hashable: not shared
    made = Stateful(graphdef, method)
  return made, (state, *args)


@functools.lru_cache(maxsize=16)
def _stateful(graphdef: Any, method: Callable[..., Any], text: str
              ) -> Stateful:
  # One per graph definition: programs compiled for it serve every model of
  # that structure, whatever its state (an argument).
  del text  # part of the key only
  return Stateful(graphdef, method)


def bind_stateful(fn: Callable[..., Any], policy: Policy | None,
                  recorder: Recorder | None = None) -> Callable[..., Any]:
  """:func:`bind` of a :class:`Stateful` (its state is an argument already);
  any other ``fn`` unchanged."""
  return bind(fn, policy, recorder) if isinstance(fn, Stateful) else fn


def bind(fn: Callable[..., Any], policy: Policy | None,
         recorder: Recorder | None = None) -> Callable[..., Any]:
  """``fn`` with ``policy`` reaching its NNX modules through the hook.

  For an ``nnx.Module`` or a bound method of one, returns a function that,
  each time it is called (for :func:`jaxprec.audit` and :func:`jaxprec.cost`,
  each time it is traced), clones the module, applies the policy to the clone
  (:func:`apply`: dtypes, records, the hook) and calls it through the hook
  under the policy (entered unless in force). Any other ``fn`` is returned as
  is: a linen model meets the policy through the interception of
  :func:`jaxprec._src.flax.scope.policy_scope`. The user's module is never
  modified (state the call writes stays in the clone).
  """
  if isinstance(fn, Stateful):
    def with_state(state, /, *args, **kwargs):
      module = sys.modules["flax.nnx"].merge(fn.graphdef, state)  # a copy
      if policy is not None and policy.has_dtypes:
        check_dtypes(module, policy)
      apply(module, policy, recorder)
      with _in_force(policy):
        return hook.run(module, "", fn.method, args, kwargs)
    with_state.__wrapped__ = fn
    with_state.__name__, with_state.__qualname__ = fn.__name__, fn.__qualname__
    with_state.__module__ = fn.__module__
    return with_state
  found = _module_and_method(fn, policy)
  if found is None:
    return fn
  module, method = found
  nnx = sys.modules["flax.nnx"]

  def with_policy(*args, **kwargs):
    clone = nnx.clone(module)
    apply(clone, policy, recorder)
    with _in_force(policy):
      return hook.run(clone, "", method, args, kwargs)

  with_policy.__wrapped__ = fn
  with_policy.__name__ = getattr(method, "__name__", "__call__")
  with_policy.__qualname__ = (getattr(fn, "__qualname__", None)
                              or type(module).__qualname__)
  with_policy.__doc__ = getattr(fn, "__doc__", None)
  return with_policy


@dataclasses.dataclass(frozen=True)
class Lifted:
  """An NNX module's method as a pure function of the module's state.

  :func:`jaxprec.emulate` keeps a trace cache. A trace of ``module(x)`` would
  bake the module's parameters in as constants, and a later call after the
  user changed them in place (an optimizer step, ``nnx.update``) would answer
  with the old ones: a stale number. Instead each call passes the module's
  current state as an argument of :meth:`call` and keys the trace on the
  graph definition, as ``nnx.jit`` does; :meth:`call` returns the variables
  the method wrote (batch statistics, RNG counters, new ones it made) with its
  output, and :meth:`update` writes them into the module, as the native call
  would have.

  Attributes:
    module: the module; None when it is the first argument of each call
      (a swapped model's wrapper emulating its own call).
    method: the unbound method called.
    policy: applied to each traced copy (:func:`apply`), or None.
    recorder: records the policy's decisions.
    path: the module's path in the policy's model (``''``: the top).
    apply_policy: False when the copy comes from a swapped model, which has
      the policy applied already.
  """

  module: Any
  method: Callable[..., Any]
  policy: Policy | None
  recorder: Recorder | None
  path: str = ""
  apply_policy: bool = True

  def split(self, module: Any | None, args: tuple, kwargs: dict
            ) -> tuple[Any, tuple, dict, list[tuple[Any, Any]]]:
    """``(graphdefs, args, kwargs, nodes)`` of a call, for :meth:`call`.

    The module (``module``, or :attr:`module` when None) and every argument
    that is an NNX graph node (an ``nnx.Rngs``, another module) are split:
    ``graphdefs`` holds their graph definitions (part of the trace's key),
    the returned ``args`` (led by the module's state) and ``kwargs`` hold
    their states in their places, and ``nodes`` pairs each such argument's
    place with the argument itself (for :meth:`update`).
    """
    nnx = sys.modules["flax.nnx"]
    graphdef, state = nnx.split(self.module if module is None else module)
    args, kwargs = list(args), dict(kwargs)
    places: list[tuple[Any, Any]] = []
    nodes: list[tuple[Any, Any]] = []
    for holder, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
      for k in keys:
        node = holder[k]
        if _is_node(node):
          g, holder[k] = nnx.split(node)
          places.append((k, g))
          nodes.append((k, node))
    return (graphdef, tuple(places)), (state, *args), kwargs, nodes

  def call(self, graphdefs: Any, state: Any, /, *args, **kwargs
           ) -> tuple[Any, tuple[Any, ...]]:
    """``(output, written)``: the method's output on a copy of the module
    made from ``state`` (and copies of the graph-node arguments made from
    theirs), and the variables the call wrote in each, module first, as
    ``nnx.State`` values (those whose value is not the one passed in, and
    new ones)."""
    nnx = sys.modules["flax.nnx"]
    graphdef, places = graphdefs
    module = nnx.merge(graphdef, state)
    if self.apply_policy:
      apply(module, self.policy, self.recorder)
    else:
      hook.install(module)
    args, kwargs = list(args), dict(kwargs)
    copies = [(module, _flat_leaves(state))]
    for k, g in places:
      holder = args if isinstance(k, int) else kwargs
      before = _flat_leaves(holder[k])
      holder[k] = nnx.merge(g, holder[k])
      copies.append((holder[k], before))
    out = hook.run(module, self.path, self.method, tuple(args), kwargs)
    return out, tuple(_written(node, before) for node, before in copies)

  def update(self, module: Any, nodes: list[tuple[Any, Any]],
             written: tuple[Any, ...]) -> None:
    """Writes the variables :meth:`call` returned into the module
    (``module``, or :attr:`module` when None) and the graph-node arguments,
    as the native call would have written them."""
    nnx = sys.modules["flax.nnx"]
    targets = [self.module if module is None else module] + [n for _, n in nodes]
    for target, state in zip(targets, written):
      if not jax.tree.leaves(state):
        continue
      try:
        nnx.update(target, state)
      except sys.modules["flax.errors"].TraceContextError as e:
        raise type(e)(
            "the call writes the model's variables (batch statistics, RNG "
            "counts), and jaxprec writes them back into the model as a native "
            "call does; under jax.jit that write crosses a trace, which Flax "
            "refuses (a native call of the model under jax.jit fails the same "
            "way). Use nnx.jit, e.g. nnx.jit(lambda m, x: "
            "jaxprec.emulate(m, ...)(x))(model, x), or call the model outside "
            f"jax.jit. Flax said: {e}") from e



def _is_node(value: Any) -> bool:
  """Whether a call argument is an NNX graph node with state of its own (a
  module, an ``nnx.Rngs``; not a lone variable)."""
  nnx = sys.modules["flax.nnx"]
  return (nnx.graph.is_graph_node(value)
          and not isinstance(value, nnx.Variable))


def _flat_leaves(state: Any) -> dict[Any, list[Any]]:
  return {p: _leaves(v) for p, v in sys.modules["flax.nnx"].to_flat_state(state)}


def _written(node: Any, before: dict[Any, list[Any]]) -> Any:
  """The variables of ``node`` whose values are not those of ``before``."""
  nnx = sys.modules["flax.nnx"]
  return nnx.from_flat_state(
      [(p, v) for p, v in nnx.to_flat_state(nnx.state(node))
       if not _same(before.get(p), _leaves(v))])


def _leaves(value: Any) -> list[Any]:
  return jax.tree.leaves(value)


def _same(a: list[Any] | None, b: list[Any]) -> bool:
  """Whether two variables' leaves are the very same objects (not written)."""
  return a is not None and len(a) == len(b) and all(
      x is y for x, y in zip(a, b))


def lift(fn: Callable[..., Any], policy: Policy | None = None,
         recorder: Recorder | None = None) -> Lifted | None:
  """A :class:`Lifted` for an ``nnx.Module`` or a bound method of one, with
  ``policy`` applied to each traced copy; None for anything else.

  Raises:
    ValueError: a dtype rule of ``policy`` matches a module without a
      ``dtype`` attribute (:func:`check_dtypes`).
  """
  found = _module_and_method(fn, policy)
  return None if found is None else Lifted(*found, policy, recorder)


@dataclasses.dataclass(frozen=True)
class PrecisionScoped:
  """An attention function run with JAX's flag at its ``precision=`` argument.

  Flax NNX's ``dot_product_attention`` ignores ``precision`` for the score and
  weighting matmuls when there is no dropout: it calls
  ``jax.nn.dot_product_attention``, which has no precision argument and uses
  the flag for float32 inputs (the jax.nn.dot_product_attention docs). Setting the flag for
  the call makes ``precision`` reach them; ops given a precision keep it.
  """

  fn: Callable[..., Any]

  @property
  def __signature__(self):
    return inspect.signature(self.fn)

  def __call__(self, *args, **kwargs):
    try:
      flag = resolve(kwargs.get("precision")).flag
    except ValueError:  # a custom lax.DotAlgorithm: nothing to scope
      flag = None
    if flag is None:
      return self.fn(*args, **kwargs)
    with jax.default_matmul_precision(flag):
      return self.fn(*args, **kwargs)
