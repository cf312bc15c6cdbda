"""Which pytree leaves are arrays: the one rule every entry point uses.

jaxprec splits a call's arguments into array leaves (traced, or passed to
``jax.jit`` as arguments) and static ones (passed as they are), and checks a
traced function's outputs. Both questions are answered here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["is_array", "is_jax_type", "jax_outputs", "static_key"]

_CONCRETE = (jax.Array, np.ndarray, np.generic)
_SCALARS = (bool, int, float, complex)


def is_array(x: Any, *, abstract: bool = True) -> bool:
  """Whether a pytree leaf is an array argument.

  Args:
    x: the leaf.
    abstract: also count shape-and-dtype stand-ins (``jax.ShapeDtypeStruct``
      and any object with ``shape`` and ``dtype``), as tracing does; False for
      entry points that run the function and need real values.

  Returns:
    True for JAX arrays (tracers included), NumPy arrays and scalars, and with
    ``abstract`` anything with ``shape`` and ``dtype`` that is not a class
    (``np.float32`` the type has both attributes).

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jaxprec._src.trees import is_array
    >>> is_array(jnp.ones(2)), is_array(np.float32(1)), is_array(2.0)
    (True, True, False)
    >>> is_array(jax.ShapeDtypeStruct((2,), jnp.float32)), is_array(np.float32)
    (True, False)
    >>> is_array(jax.ShapeDtypeStruct((2,), jnp.float32), abstract=False)
    False
  """
  if isinstance(x, _CONCRETE):
    return True
  if not abstract or isinstance(x, type):
    return False
  return hasattr(x, "shape") and hasattr(x, "dtype")


def is_jax_type(x: Any) -> bool:
  """Whether ``jax.jit`` accepts ``x`` as an output leaf.

  Arrays, tracers, NumPy values, Python numbers and objects with
  ``__jax_array__``; not strings, ``None`` leaves of custom nodes, or other
  objects.
  """
  return (isinstance(x, _CONCRETE + _SCALARS) and not isinstance(x, type)) \
      or hasattr(x, "__jax_array__")


def jax_outputs(fn: Callable[..., Any], out: Any) -> Any:
  """``out``, the outputs of a call of ``fn`` that jaxprec runs.

  Raises:
    TypeError: for a leaf that is not a JAX type (:func:`is_jax_type`, a
      string say), naming ``fn`` and the leaf's path; ``jax.jit`` would name
      jaxprec's own function instead.
  """
  for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
    if not is_jax_type(x):
      module = getattr(fn, "__module__", None)
      name = getattr(fn, "__qualname__", None) or repr(fn)
      where = jax.tree_util.keystr(path) or " (the whole output)"
      raise TypeError(
          f"{name if module is None else f'{module}.{name}'} returned a "
          f"{type(x).__name__} at output{where}: jaxprec checks arrays, so "
          f"every output leaf must be an array or a number (return that "
          f"value some other way, or drop it)")
  return out


def static_key(leaves: tuple[Any, ...]) -> tuple[Any, ...]:
  """A cache key for static leaves: equal keys only for interchangeable values.

  Python's ``==`` equates ``1``, ``1.0`` and ``True`` (and ``0.0`` with
  ``-0.0``), yet a function traced with one returns other dtypes, or other
  signs, than with another. The key holds each leaf's type, and floats and
  complex numbers by their exact ``repr``. Hashable when the leaves are.

  Examples:
    >>> from jaxprec._src.trees import static_key
    >>> static_key((1,)) == static_key((1.0,))
    False
    >>> static_key((0.0,)) == static_key((-0.0,))
    False
    >>> static_key((None, "relu")) == static_key((None, "relu"))
    True
  """
  return tuple((type(x), repr(x)) if isinstance(x, (float, complex))
               else (type(x), x) for x in leaves)
