"""Scopes for generators and coroutines: each resumption runs inside the scope.

A decorator that wraps a call in ``with scope():`` has no effect on a
generator function or an ``async def``: calling one only creates the
generator or coroutine, and its body runs later, at each ``next``/``send``/
``await``, outside the scope. :func:`wrap` returns a function of the same
kind whose every step (each ``send``, ``throw`` or ``close`` of the underlying
generator or coroutine) runs inside a fresh ``scope()``; between steps the
caller's state is back, so code interleaved with the steps (other tasks,
the consumer of a generator) never sees the scope.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Generator
from typing import Any

Scope = Callable[[], contextlib.AbstractContextManager]


def kind(fn: Any) -> str | None:
  """``'generator'``, ``'coroutine'``, ``'async generator'`` or None."""
  if inspect.isgeneratorfunction(fn):
    return "generator"
  if inspect.iscoroutinefunction(fn):
    return "coroutine"
  if inspect.isasyncgenfunction(fn):
    return "async generator"
  return None


def _steps(it: Any, scope: Scope) -> Generator[Any, Any, Any]:
  """Drives ``it`` (a generator, coroutine or awaitable's iterator), each
  step inside ``scope()``; yields what it yields, returns what it returns."""
  sent, thrown = None, None
  while True:
    with scope():
      try:
        value = it.send(sent) if thrown is None else it.throw(thrown)
      except StopIteration as stop:
        return stop.value
    sent, thrown = None, None
    try:
      sent = yield value
    except GeneratorExit:
      with scope():
        it.close()
      raise
    except BaseException as e:  # noqa: BLE001 -- thrown in: passed on to `it`
      thrown = e


@types.coroutine
def _scoped(awaitable: Any, scope: Scope):
  """Awaits ``awaitable`` with each step inside ``scope()``."""
  if not hasattr(awaitable, "send"):  # a plain awaitable: step its iterator
    awaitable = awaitable.__await__()
  return (yield from _steps(awaitable, scope))


def wrap(fn: Callable[..., Any], scope: Scope) -> Callable[..., Any]:
  """``fn`` (a generator, coroutine or async generator function) with each
  resumption of what it returns run inside ``scope()``.

  Examples:
    >>> import jax, jaxprec
    >>> from jaxprec._src.core.resumable import wrap
    >>> def gen():
    ...   yield jaxprec.current().name
    ...   yield jaxprec.current().name
    >>> g = wrap(gen, lambda: jax.default_matmul_precision("float32"))()
    >>> next(g), jaxprec.current().name, next(g)
    ('float32', 'backend-default', 'float32')
    >>> g.close()
  """
  what = kind(fn)
  if what == "generator":
    @functools.wraps(fn)
    def generator(*args, **kwargs):
      return (yield from _steps(fn(*args, **kwargs), scope))
    return generator
  if what == "coroutine":
    @functools.wraps(fn)
    async def coroutine(*args, **kwargs):
      return await _scoped(fn(*args, **kwargs), scope)
    return coroutine
  if what == "async generator":
    @functools.wraps(fn)
    async def async_generator(*args, **kwargs):
      agen = fn(*args, **kwargs)
      sent, thrown = None, None
      try:
        while True:
          step = agen.asend(sent) if thrown is None else agen.athrow(thrown)
          sent, thrown = None, None
          try:
            value = await _scoped(step, scope)
          except StopAsyncIteration:
            return
          try:
            sent = yield value
          except GeneratorExit:
            raise
          except BaseException as e:  # noqa: BLE001 -- passed on to agen
            thrown = e
      finally:
        await _scoped(agen.aclose(), scope)
    return async_generator
  raise TypeError(f"not a generator or coroutine function: {fn!r}")
