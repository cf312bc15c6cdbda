"""Scoping: ``jaxprec.precision(p)`` as a decorator and a context manager.

Under a ``DotAlgorithmPreset`` JAX lowers convolutions at ``DEFAULT`` (JAX's
conv_general_dilated lowering, jax/_src/lax/convolution.py): the decorator
re-binds them at the preset's level, the ``with`` form warns.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax import lax

from jaxprec._src.core import env as env_lib
from jaxprec._src.core import numerics
from jaxprec._src.core import resumable
from jaxprec._src.core.precision import Precision, PrecisionLike, resolve
from jaxprec._src.jaxpr import walker

F = TypeVar("F", bound=Callable[..., Any])


class PresetConvWarning(UserWarning):
  """A preset is in force where jaxprec cannot raise convolutions to match it."""


_warned_presets: set[str] = set()
_warned_lock = threading.Lock()


def _warn_preset_once(p: Precision) -> None:
  if p.level is lax.Precision.DEFAULT:
    return  # The conv runs at DEFAULT, which is what the preset means anyway.
  with _warned_lock:
    if p.name in _warned_presets:
      return
    _warned_presets.add(p.name)
  warnings.warn(
      f"jaxprec.precision({p.name!r}) used as a context manager: JAX lowers "
      f"convolutions under a DotAlgorithmPreset at precision DEFAULT (one "
      f"bfloat16 pass on TPU), not at {p.level.name}. Fix: decorate the "
      f"function instead (@jaxprec.precision({p.name!r}) re-binds its convs at "
      f"{p.level.name}), or use the level {resolve(p.level).name!r}, or pass "
      f"precision=lax.Precision.{p.level.name} to the convolutions.",
      PresetConvWarning, stacklevel=3)


def _conv_rule(p: Precision) -> walker.Rule:
  """Rewrites convs that recorded a preset to the preset's level."""
  level = (numerics.per_op(p, "conv"),) * 2  # a preset: its level

  def rule(eqn, invals):
    if (eqn.primitive is lax.conv_general_dilated_p
        and isinstance(eqn.params.get("precision"), lax.DotAlgorithmPreset)):
      params = dict(eqn.params, precision=level)
      return [eqn.primitive.bind(*invals, **params)]
    return None
  return rule


class precision:  # noqa: N801 -- reads as a function, like jax.default_matmul_precision
  """Sets the matmul/conv precision, as a decorator or a context manager.

  Accepts any spelling :func:`jaxprec.resolve` accepts. Thread-local, nests,
  restores the previous value on exit (exceptions included), and works with
  ``jax.jit`` applied outside or inside, and under ``grad``, ``vmap`` and
  ``scan``. The flag is resolved while tracing, so a jitted function traced
  under one precision keeps it (JAX includes the flag in its jit cache key).

  Under a preset (e.g. ``'F32_F32_F32'``), the decorator form lowers the
  function's convolutions at the matching level instead of JAX's silent
  DEFAULT; the function is then traced once per input shapes/dtypes and static
  arguments, so its Python side effects run at trace time, as under ``jax.jit``.
  The ``with`` form warns once (:class:`PresetConvWarning`).

  Args:
    p: the precision.

  Examples:
    >>> import jax.numpy as jnp, jaxprec
    >>> @jaxprec.precision("float32")
    ... def f(a, b):
    ...   return a @ b
    >>> print(jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((2, 2))))  # doctest: +ELLIPSIS
    { lambda ; a:f32[2,2] b:f32[2,2]. let
        c:f32[2,2] = dot_general[
          dimension_numbers=(([1], [0]), ([], []))
          precision=(Precision.HIGHEST, Precision.HIGHEST)
          preferred_element_type=float32
        ] a b
      in (c,) }
    >>> with jaxprec.precision("bf16"):
    ...   jaxprec.current().name
    'bfloat16'
  """

  def __init__(self, p: PrecisionLike):
    self.precision = resolve(p)
    self._local = threading.local()

  def __repr__(self) -> str:
    return f"jaxprec.precision({self.precision.name!r})"

  # -- context manager ------------------------------------------------------
  def __enter__(self) -> Precision:
    if self.precision.is_preset:
      _warn_preset_once(self.precision)
    cm = jax.default_matmul_precision(self.precision.flag)
    cm.__enter__()
    stack = getattr(self._local, "stack", None)
    if stack is None:
      stack = self._local.stack = []
    stack.append(cm)
    return self.precision.with_source("context")

  def __exit__(self, *exc) -> None:
    self._local.stack.pop().__exit__(*exc)

  # -- decorator ------------------------------------------------------------
  def __call__(self, fn: F) -> F:
    if not callable(fn):
      raise TypeError(
          f"jaxprec.precision(...) decorates a callable; got {fn!r} of type "
          f"{type(fn).__name__}")
    p = self.precision

    if resumable.kind(fn) is not None:
      # Generators and coroutines run their body at each resumption, not at
      # the call: each step runs inside the scope, restored between steps.
      # Their steps are not traced as one program, so a preset cannot raise
      # their convolutions: warn as the ``with`` form does.
      if p.is_preset:
        _warn_preset_once(p)
      return _marked(resumable.wrap(  # type: ignore[return-value]
          fn, lambda: jax.default_matmul_precision(p.flag)), p)

    if not p.is_preset:
      @functools.wraps(fn)
      def wrapper(*args, **kwargs):
        with jax.default_matmul_precision(p.flag):
          return fn(*args, **kwargs)
      return _marked(wrapper, p)  # type: ignore[return-value]

    rule = _conv_rule(p)
    cache: dict[Any, Any] = {}

    @functools.wraps(fn)
    def preset_wrapper(*args, **kwargs):
      with jax.default_matmul_precision(p.flag):
        call = walker.trace_call(fn, args, kwargs, cache)
        return call.unflatten(walker.interpret(call.jaxpr, rule, *call.dynamic))
    return _marked(preset_wrapper, p)  # type: ignore[return-value]


# The attribute a decorated function carries: the precision its decorator sets.
_DECORATED = "__jaxprec_precision__"


def _marked(wrapper: F, p: Precision) -> F:
  setattr(wrapper, _DECORATED, p)
  return wrapper


def decorated_precision(fn: Any) -> Precision | None:
  """The precision a :class:`precision` decorator sets for ``fn``'s body
  (looked up through wrappers that keep ``__wrapped__``, e.g. ``jax.jit``;
  of two decorators the inner one, whose scope is entered last), else None."""
  found, seen = None, set()
  while fn is not None and id(fn) not in seen:
    seen.add(id(fn))
    p = getattr(fn, _DECORATED, None)
    if isinstance(p, Precision):
      found = p
    fn = getattr(fn, "__wrapped__", None)
  return found


def current() -> Precision:
  """The precision in force here and now, with its ``.source``.

  ``.source`` is ``'context'`` (a ``jaxprec.precision`` or
  ``jax.default_matmul_precision`` scope in this thread), ``'config'``
  (``jaxprec.set_default`` or ``jax.config.update``), ``'env'`` (the
  ``JAX_DEFAULT_MATMUL_PRECISION`` variable read when JAX was imported) or
  ``'backend-default'`` (nothing set: the backend decides).

  Examples:
    >>> import jaxprec
    >>> with jaxprec.precision("highest"):
    ...   p = jaxprec.current()
    >>> p.name, p.source
    ('float32', 'context')
  """
  value, source = env_lib.flag_value_and_source()
  return resolve(value).with_source(source)
