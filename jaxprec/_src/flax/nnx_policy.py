"""A policy's precisions on Flax NNX modules, and the Flax-free helpers they share.

NNX has no method interception: a policy reaches an NNX model by setting the
``precision`` of each matched module of a clone (:func:`decide`,
:func:`set_precision`), and the ``dtype`` of each module the policy gives a
compute dtype (:func:`decide_dtype`; a dtype rule that matches a module without
a ``dtype`` attribute is an error, :func:`check_dtypes`). :func:`jaxprec.swap` does that once;
:func:`bind` does it each time a function is traced, for
:func:`jaxprec.emulate`, :func:`jaxprec.cost` and the search, which are given
an ``nnx.Module`` (or a bound method of one) as the function. Paths are the
``'/'``-joined attribute names of :func:`flax.nnx.iter_graph`, as in
:func:`jaxprec.swap` (:func:`jaxprec._src.flax.paths.nnx_modules`, the one
source). While :func:`jaxprec.audit` traces (a
:func:`jaxprec._src.flax.paths.record` block), the traced copy's modules that
a policy can set run inside :func:`jaxprec._src.flax.paths.nnx_call`, so that
the audit's rows get their paths (:func:`mark_paths`).

Also here, because modules at every level use them: :func:`per_op_precision`
(what a Flax module passes to ``lax`` for a jaxprec ``precision=``),
:class:`PrecisionScoped` and :func:`is_attention_name`.

This module imports Flax only when called with NNX objects; it never imports
:func:`jaxprec.emulate` (which calls it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax import lax

from jaxprec._src import numerics
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.flax.state import Recorder
from jaxprec._src.policy import Policy
from jaxprec._src.precision import Precision, resolve

__all__ = ["Lifted", "PrecisionScoped", "bind", "check_dtypes", "classify",
           "classify_nnx", "decide", "decide_dtype", "is_attention_name", "lift",
           "mark_paths", "own_precision", "per_op_precision", "set_precision"]


def per_op_precision(value: Any, *, conv: bool) -> Any:
  """What a Flax module should pass to ``lax`` for a jaxprec ``precision=``.

  None and ``lax.DotAlgorithm`` objects pass through, as do pairs of
  different levels; anything else is resolved and becomes
  :func:`jaxprec._src.numerics.per_op` of its kind (a convolution gets a
  preset's level).
  """
  if value is None or isinstance(value, lax.DotAlgorithm):
    return value
  if (isinstance(value, (tuple, list)) and len(value) == 2
      and all(isinstance(v, lax.Precision) for v in value)
      and value[0] != value[1]):
    return tuple(value)
  return numerics.per_op(resolve(value), "conv" if conv else "dot")


def own_precision(module: Any, p: Precision | None, kind: str
                  ) -> tuple[bool, Precision | None]:
  """``(kept, precision)``: whether a Flax module keeps its own ``precision=``
  rather than the policy's ``p``, and the precision it runs at.

  A module whose ``precision`` already is what ``p`` would set (a swapped
  model) is the policy's decision, not the module's.
  """
  own = getattr(module, "precision", None)
  if own is None or (p is not None
                     and own == per_op_precision(p, conv=kind == "conv")):
    return False, p
  try:
    return True, resolve(own)
  except (TypeError, ValueError):
    return True, None


def is_attention_name(cls: type) -> bool:
  """Whether a class is an attention module by its name.

  Attention modules of other libraries (Hugging Face's
  ``FlaxBertSelfAttention``, ``FlaxWav2Vec2Attention``, ...) subclass nothing
  of Flax's: go by the name.
  """
  return "Attention" in cls.__name__


def classify(module: Any, table: Sequence[tuple[Any, str]]
             ) -> tuple[str | None, str]:
  """``(module type, op kind)`` of a Flax module; type None for other modules.

  The type is that of the first ``(classes, type)`` row of ``table`` whose
  classes ``module`` is an instance of, else ``'Attention'`` for a class named
  so (:func:`is_attention_name`). The op kind follows from the type:
  ``'attention'`` for attention modules, ``'conv'`` for convolutions,
  ``'dot'`` for the rest.
  """
  for classes, module_type in table:
    if isinstance(module, classes):
      return module_type, _KINDS.get(module_type, "dot")
  if is_attention_name(type(module)):
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


def decide(model: Any, policy: Policy, recorder: Recorder | None
           ) -> Iterator[tuple[Any, Precision | None, str]]:
  """``(module, precision, op kind)`` for each NNX module a policy can set.

  Modules of :data:`jaxprec._src.policy.MODULE_TYPES` (by class or alias)
  that have a ``precision`` attribute, in graph order; the precision is the
  policy's for the module's path, type and kind (None: leave as is). Each
  decision is recorded in ``recorder``.

  ``model`` must be a copy (a clone or a traced copy): the policy's compute
  dtypes are set on it in place as the modules are visited
  (:func:`decide_dtype`: every module with a ``dtype`` attribute that the
  policy gives a dtype), and recorded with the precision decisions.

  Raises:
    ValueError: an explicit dtype rule matches a module without a ``dtype``
      attribute (:func:`check_dtypes`).
  """
  if policy.has_dtypes:
    check_dtypes(model, policy)
  for path, node in flax_paths.nnx_modules(model):
    module_type, kind = classify_nnx(node)
    settable = module_type is not None and hasattr(node, "precision")
    dt, drule, how = decide_dtype(path, node, module_type, kind, policy)
    if how == "field":
      node.dtype = getattr(jax.numpy, dt)
    if not settable and how is None:
      continue
    p, rule = policy.match(path, module_type, kind) if settable else (None, None)
    if recorder is not None:
      kept, shown = own_precision(node, p, kind) if settable else (False, None)
      recorder.record(path, module_type, kind, shown, rule, kept=kept,
                      dtype=dt, dtype_how=how, dtype_rule=drule)
    if settable:
      yield node, p, kind


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


def _settable(model: Any) -> Iterator[tuple[str, Any, str, str]]:
  """``(path, module, module type, op kind)`` of each NNX module of ``model``
  that a policy can set (:func:`decide`), in graph order."""
  for path, node in flax_paths.nnx_modules(model):
    module_type, kind = classify_nnx(node)
    if module_type is not None and hasattr(node, "precision"):
      yield path, node, module_type, kind


def mark_paths(model: Any) -> None:
  """Makes each module of ``model`` (a traced copy) that a policy can set run
  inside :func:`jaxprec._src.flax.paths.nnx_call` of its path, in place.

  Only inside a :func:`jaxprec._src.flax.paths.record` block (an audit);
  elsewhere it does nothing. Each such module gets a subclass of its class
  (same name) that holds its path and whose ``__call__`` does that; being in
  the class, the path follows the module into the copies that NNX transforms
  make (``nnx.scan`` over stacked layers). A class that cannot be subclassed
  so is left as is (its ops then belong to the enclosing module).
  """
  if not flax_paths.recording():
    return
  for path, node, _, _ in _settable(model):
    base = getattr(type(node), "_jaxprec_nnx_base", type(node))
    scoped = _path_scoped_class(base, path)
    if scoped is None:
      continue
    try:
      object.__setattr__(node, "__class__", scoped)
    except TypeError:  # an incompatible layout (__slots__)
      continue


@functools.lru_cache(maxsize=4096)
def _path_scoped_class(cls: type, path: str) -> type | None:
  """``cls`` with ``__call__`` run inside ``nnx_call(path)``."""
  call = cls.__call__

  def __call__(self, *args, **kwargs):
    with flax_paths.nnx_call(path):
      return call(self, *args, **kwargs)

  try:
    return type(cls.__name__, (cls,), {
        "__call__": functools.wraps(call)(__call__),
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__, "_jaxprec_nnx_base": cls})
  except TypeError:  # a class whose subclassing needs arguments
    return None


def set_precision(module: Any, p: Precision | None, kind: str) -> None:
  """Gives an NNX module (of a clone) precision ``p``, in place.

  A ``precision`` the module already has is kept (the model's code chose
  it), as :func:`jaxprec.swap` keeps it. Attention modules' attention
  function runs with JAX's flag at the module's precision
  (:class:`PrecisionScoped`), so that it reaches the score and weighting
  matmuls.
  """
  from flax import nnx  # noqa: PLC0415 -- Flax only when in use
  if p is not None and module.precision is None:
    module.precision = per_op_precision(p, conv=kind == "conv")
  if (isinstance(module, nnx.MultiHeadAttention)
      and not isinstance(module.attention_fn, PrecisionScoped)):
    module.attention_fn = PrecisionScoped(module.attention_fn)


def bind(fn: Callable[..., Any], policy: Policy | None,
         recorder: Recorder | None = None) -> Callable[..., Any]:
  """``fn`` with ``policy``'s path rules reaching its NNX modules.

  For an ``nnx.Module`` or a bound method of one, returns a function that,
  each time it is called (for :func:`jaxprec.audit` and :func:`jaxprec.cost`,
  each time it is traced), clones the module, sets the policy's precisions
  (if any) on the clone (:func:`decide`, :func:`set_precision`), marks its
  modules' paths for the audit (:func:`mark_paths`) and calls it. Any other
  ``fn`` is returned as is: a linen model meets the policy through the
  interception of :func:`jaxprec._src.flax.scope.policy_scope`. The user's
  module is never modified.
  """
  nnx_mod = sys.modules.get("flax.nnx")
  if nnx_mod is None:
    return fn
  if isinstance(fn, nnx_mod.Module):
    module, method = fn, type(fn).__call__
  elif (isinstance(fn, types.MethodType)
        and isinstance(fn.__self__, nnx_mod.Module)):
    module, method = fn.__self__, fn.__func__
  else:
    return fn
  if policy is not None and policy.has_dtypes:
    check_dtypes(module, policy)  # now, not at the first call

  def with_policy(*args, **kwargs):
    clone = nnx_mod.clone(module)
    if policy is not None:
      for node, p, kind in decide(clone, policy, recorder):
        set_precision(node, p, kind)
    mark_paths(clone)
    return method(clone, *args, **kwargs)

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
  graph definition, as ``nnx.jit`` does. State the method changes (batch
  statistics, RNG counters) stays in the traced copy: the user's module is
  never modified.
  """

  module: Any
  method: Callable[..., Any]
  policy: Policy | None
  recorder: Recorder | None

  def split(self) -> tuple[Any, Any]:
    """``(graphdef, state)`` of the module now."""
    return sys.modules["flax.nnx"].split(self.module)

  def call(self, graphdef: Any, state: Any, *args, **kwargs):
    nnx_mod = sys.modules["flax.nnx"]
    module = nnx_mod.merge(graphdef, state)
    if self.policy is not None:
      for node, p, kind in decide(module, self.policy, self.recorder):
        set_precision(node, p, kind)
    mark_paths(module)
    return self.method(module, *args, **kwargs)


def lift(fn: Callable[..., Any], policy: Policy | None = None,
         recorder: Recorder | None = None) -> Lifted | None:
  """A :class:`Lifted` for an ``nnx.Module`` or a bound method of one, with
  ``policy``'s path rules (and compute dtypes) applied to each traced copy;
  None for anything else.

  Raises:
    ValueError: a dtype rule of ``policy`` matches a module without a
      ``dtype`` attribute (:func:`check_dtypes`).
  """
  nnx_mod = sys.modules.get("flax.nnx")
  if nnx_mod is None:
    return None
  if isinstance(fn, nnx_mod.Module):
    module, method = fn, type(fn).__call__
  elif isinstance(fn, types.MethodType) and isinstance(fn.__self__, nnx_mod.Module):
    module, method = fn.__self__, fn.__func__
  else:
    return None
  if policy is not None and policy.has_dtypes:
    check_dtypes(module, policy)  # now, not at the first call
  return Lifted(module, method, policy, recorder)


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
