"""A policy's decisions on Flax NNX modules: compute dtypes, records, the hook.

A policy reaches an NNX model through a copy of it (a clone, or the traced
copy ``nnx.merge`` makes), to which :func:`apply` applies it: once for
:func:`jaxprec.swap`, at each trace for the others (:func:`bind`,
:class:`Stateful`). Imports Flax only when called with NNX objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import sys
import types
from collections.abc import Callable
from typing import Any

import jax

from jaxprec._src.flax import hook
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.flax.state import Recorder
from jaxprec._src.policy.policy import Policy


def apply(model: Any, policy: Policy | None, recorder: Recorder | None,
          *, hooks: bool = True) -> None:
  """Applies ``policy`` to ``model``, a copy (never the user's), in place.

  Sets the ``dtype`` of each module the policy gives a compute dtype (a
  module without that attribute is left alone under the default dtype, and
  recorded as ``'skipped'``), records the policy's decision for every module
  that can be called in ``recorder`` (as the linen interceptor records every
  module call), and, with ``hooks``, installs the per-module hook
  (:func:`jaxprec._src.flax.hook.install`). The precisions themselves are
  decided by the hook at each call, from the policy in force.

  Raises:
    ValueError: an explicit dtype rule matches a module without a ``dtype``
      attribute (:func:`check_dtypes`).
  """
  if policy is not None:
    if policy.has_dtypes:
      check_dtypes(model, policy)
    for path, node in flax_paths.nnx_modules(model):
      module_type, kind = hook.classify_nnx(node)
      dt, drule = policy.match_dtype(path, module_type, kind)
      how = None if dt is None else (
          "field" if hasattr(node, "dtype") else "skipped")
      if how == "field":
        node.dtype = getattr(jax.numpy, dt)
      if recorder is not None and (how or hook.callable_class(type(node))):
        _, shown, rule, kept = hook.decide(policy, path, node, module_type,
                                           kind)
        recorder.record(path, module_type, kind, shown, rule, kept=kept,
                        dtype=dt if how == "field" else None, dtype_how=how,
                        dtype_rule=drule)
  if hooks:
    hook.install(model)


def check_dtypes(model: Any, policy: Policy) -> None:
  """Raises if a dtype rule of ``policy`` matches an NNX module of ``model``
  that has no ``dtype`` attribute (it cannot be cast at its boundary).

  Raises:
    ValueError: naming the module's path and type, and the rule.
  """
  for path, node in flax_paths.nnx_modules(model):
    module_type, kind = hook.classify_nnx(node)
    dt, rule = policy.match_dtype(path, module_type, kind)
    if rule is not None and not hasattr(node, "dtype"):
      raise ValueError(
          f"Policy rule {str(rule)!r} gives dtype {dt!r} to the NNX module at "
          f"path {path or '(top)'!r} of type {type(node).__name__}, which has "
          f"no dtype attribute. NNX modules cannot be cast at their boundary "
          f"(NNX has no method interception): match only modules with a dtype "
          f"attribute (e.g. nnx.Linear, nnx.LayerNorm), or use default_dtype, "
          f"which leaves such modules as they are.")


def module_and_method(fn: Any, policy: Policy | None = None
                      ) -> tuple[Any, Callable[..., Any]] | None:
  """``(module, unbound method)`` of an ``nnx.Module`` or a bound method of
  one, its dtypes checked against ``policy`` now (:func:`check_dtypes`); None
  for anything else (or when NNX is not imported)."""
  if hook.is_nnx_module(fn):
    found = fn, type(fn).__call__
  elif isinstance(fn, types.MethodType) and hook.is_nnx_module(fn.__self__):
    found = fn.__self__, fn.__func__
  else:
    return None
  if policy is not None and policy.has_dtypes:
    check_dtypes(found[0], policy)
  return found


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity
class Stateful:
  """An NNX module's method as a function of the module's state.

  A program traced from the module itself would hold its parameters as
  constants, and a later call after the user changed them in place (an
  optimizer step, ``nnx.update``) would answer with the old ones: a stale
  number. With the state an argument, a program depends on the graph
  definition only (as ``nnx.jit``'s do), and every call reads the state the
  module holds then. The module runs as a copy made inside the trace, so what
  the call writes stays in it unless written back:

  * ``check`` and ``search_policy`` keep their programs per :func:`stateful`:
    ``fn(state, *args)`` calls ``method`` on ``nnx.merge(graphdef, state)``.
  * :func:`jaxprec.emulate` traces :meth:`call`, keyed on the graph
    definitions of :meth:`split` and their text; :meth:`update` writes back
    what the call wrote, as the native call would have.

  Attributes:
    module: the module; None when it is the first argument of each call (a
      swapped model's wrapper emulating its own call) or is ``graphdef``.
    method: the unbound method called.
    policy: applied to each copy (:func:`apply`) and entered, or None.
    recorder: records the policy's decisions.
    path: the module's path in the policy's model (``''``: the top).
    apply_policy: False when the copy comes from a swapped model, which has
      the policy applied already.
    graphdef: the graph definition of ``fn(state, *args)`` (:func:`stateful`).
  """

  module: Any
  method: Callable[..., Any]
  policy: Policy | None = None
  recorder: Recorder | None = None
  path: str = ""
  apply_policy: bool = True
  graphdef: Any = None

  def __post_init__(self):  # named as the user's method
    for name, default in (("__module__", None), ("__name__", "__call__"),
                          ("__qualname__", "Module.__call__")):
      object.__setattr__(self, name, getattr(self.method, name, default))

  def __call__(self, state: Any, /, *args: Any, **kwargs: Any) -> Any:
    return self.method(sys.modules["flax.nnx"].merge(self.graphdef, state),
                       *args, **kwargs)

  def observing(self, record: Callable[[Any], None]) -> Stateful:
    """The same call, with ``record(output)`` called on each output."""
    method = self.method

    @functools.wraps(method)
    def observed(module, *args, **kwargs):
      out = method(module, *args, **kwargs)
      record(out)
      return out
    return dataclasses.replace(self, method=observed)

  def run(self, copy: Any, args: tuple, kwargs: dict) -> Any:
    """The method on ``copy``, a copy of the module, through the hook, with
    the policy applied to it and in force."""
    apply(copy, self.policy if self.apply_policy else None, self.recorder)
    # A policy in force already stays (policy_scope reuses its scope).
    with (contextlib.nullcontext() if self.policy is None
          else flax_scope.policy_scope(self.policy)):
      return hook.run(copy, self.path, self.method, args, kwargs)

  def split(self, module: Any, args: tuple, kwargs: dict
            ) -> tuple[Any, tuple, dict, list[Any]]:
    """``(graphdefs, args, kwargs, nodes)`` of a call, for :meth:`call`.

    ``module`` and every argument that is an NNX graph node (an
    ``nnx.Rngs``, another module) are split: ``graphdefs`` holds their graph
    definitions (part of the trace's key), the returned ``args`` (led by the
    module's state) and ``kwargs`` hold their states in their places, and
    ``nodes`` lists ``module`` and those arguments (for :meth:`update`).
    """
    nnx = sys.modules["flax.nnx"]
    graphdef, state = nnx.split(module)
    args, kwargs = list(args), dict(kwargs)
    places: list[tuple[Any, Any]] = []
    nodes = [module]
    for holder, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
      for k in keys:
        node = holder[k]  # a graph node with state of its own, not a variable
        if (nnx.graph.is_graph_node(node)
            and not isinstance(node, nnx.Variable)):
          g, holder[k] = nnx.split(node)
          places.append((k, g))
          nodes.append(node)
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
    args, kwargs = list(args), dict(kwargs)
    copies = [(module, _leaves(state))]
    for k, g in places:
      holder = args if isinstance(k, int) else kwargs
      before = _leaves(holder[k])
      holder[k] = nnx.merge(g, holder[k])
      copies.append((holder[k], before))
    out = self.run(module, tuple(args), kwargs)
    return out, tuple(_written(node, before) for node, before in copies)

  def update(self, nodes: list[Any], written: tuple[Any, ...]) -> None:
    """Writes the variables :meth:`call` returned into the module and the
    graph-node arguments (``nodes`` of :meth:`split`), as the native call
    would have written them."""
    nnx = sys.modules["flax.nnx"]
    for target, state in zip(nodes, written):
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


def _leaves(state: Any) -> dict[Any, list[Any]]:
  """Each variable's leaves, by path."""
  return {p: jax.tree.leaves(v)
          for p, v in sys.modules["flax.nnx"].to_flat_state(state)}


def _written(node: Any, before: dict[Any, list[Any]]) -> Any:
  """The variables of ``node`` whose leaves are not the very objects of
  ``before`` (written, or new)."""
  nnx = sys.modules["flax.nnx"]

  def same(old, new):
    return (old is not None and len(old) == len(new)
            and all(map(operator.is_, old, new)))
  return nnx.from_flat_state(
      [(p, v) for p, v in nnx.to_flat_state(nnx.state(node))
       if not same(before.get(p), jax.tree.leaves(v))])


def stateful(fn: Callable[..., Any], args: tuple
             ) -> tuple[Callable[..., Any], tuple]:
  """``(fn, args)`` of a call, with an ``nnx.Module`` (or a bound method of
  one) as a :class:`Stateful` of its state, which leads ``args``; any other
  ``fn`` unchanged."""
  found = module_and_method(fn)
  if found is None:
    return fn, args
  module, method = found
  graphdef, state = sys.modules["flax.nnx"].split(module)
  try:
    # Its text too: static attributes that compare equal but trace
    # differently (2 and 2.0, 0.0 and -0.0) give equal graph definitions.
    made = _stateful(graphdef, method, repr(graphdef))
  except TypeError:  # a graph definition that is not hashable: not shared
    made = Stateful(None, method, graphdef=graphdef)
  return made, (state, *args)


@functools.lru_cache(maxsize=16)
def _stateful(graphdef: Any, method: Callable[..., Any], text: str
              ) -> Stateful:
  # One per graph definition: programs compiled for it serve every model of
  # that structure, whatever its state (an argument).
  del text  # part of the key only
  return Stateful(None, method, graphdef=graphdef)


def bind(fn: Callable[..., Any], policy: Policy | None,
         recorder: Recorder | None = None) -> Callable[..., Any]:
  """``fn`` with ``policy`` reaching its NNX modules through the hook.

  For an ``nnx.Module``, a bound method of one or a :class:`Stateful`,
  returns a function that, each time it is called (for :func:`jaxprec.audit`
  and :func:`jaxprec.cost`, each time it is traced), runs the method on a
  copy of the module (a clone, or ``nnx.merge`` of the state argument) with
  the policy applied and in force (:meth:`Stateful.run`). Any other ``fn`` is
  returned as is: a linen model meets the policy through the interception of
  :func:`jaxprec._src.flax.scope.policy_scope`. The user's module is never
  modified (state the call writes stays in the copy).
  """
  nnx = sys.modules.get("flax.nnx")
  if isinstance(fn, Stateful):
    bound = dataclasses.replace(fn, policy=policy, recorder=recorder)

    def call(state, /, *args, **kwargs):
      return bound.run(nnx.merge(fn.graphdef, state), args, kwargs)
  else:
    found = module_and_method(fn, policy)
    if found is None:
      return fn
    bound = Stateful(*found, policy, recorder)

    def call(*args, **kwargs):
      return bound.run(nnx.clone(bound.module), args, kwargs)
  call.__wrapped__ = fn
  call.__name__ = bound.__name__
  call.__qualname__ = (getattr(fn, "__qualname__", None)
                       or type(bound.module).__qualname__)
  call.__module__ = bound.__module__
  call.__doc__ = getattr(bound.method, "__doc__", None)
  return call


def lift(fn: Callable[..., Any], policy: Policy | None = None,
         recorder: Recorder | None = None
         ) -> tuple[Callable[..., Any], Stateful | None]:
  """``(fn, stateful)``: how :func:`jaxprec.emulate` calls ``fn`` under
  ``policy``.

  An ``nnx.Module`` or a bound method of one gives a :class:`Stateful` with
  ``policy`` applied to each traced copy; a :class:`Stateful` (its state an
  argument already) is :func:`bind` of it, with ``stateful`` None; any other
  ``fn`` comes back unchanged, with ``stateful`` None.

  Raises:
    ValueError: a dtype rule of ``policy`` matches a module without a
      ``dtype`` attribute (:func:`check_dtypes`).
  """
  if isinstance(fn, Stateful):
    return bind(fn, policy, recorder), None
  found = module_and_method(fn, policy)
  return fn, None if found is None else Stateful(*found, policy, recorder)
