"""Which pytree leaves are arrays: the one rule every entry point uses.

jaxprec splits a call's arguments into array leaves (traced, or passed to
``jax.jit`` as arguments) and static ones (passed as they are), and checks a
traced function's outputs. Both questions are answered here, once:
:func:`split_call` is the one place that splits a call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

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
    >>> from jaxprec._src.jaxpr.trees import is_array
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
    >>> from jaxprec._src.jaxpr.trees import static_key
    >>> static_key((1,)) == static_key((1.0,))
    False
    >>> static_key((0.0,)) == static_key((-0.0,))
    False
    >>> static_key((None, "relu")) == static_key((None, "relu"))
    True
  """
  return tuple((type(x), repr(x)) if isinstance(x, (float, complex))
               else (type(x), x) for x in leaves)


@dataclasses.dataclass(frozen=True, eq=False)
class CallStatics:
  """The static part of a call: everything but its array leaves.

  Holds no arrays (compiled programs may keep it). :meth:`call` puts array
  values back in place of the array leaves.

  Attributes:
    treedef: the structure of ``(args, kwargs)``.
    is_array: which leaves are arrays.
    leaves: the static leaves, None where a leaf is an array.
    key: a hashable description of the static part (:func:`static_key` of
      the leaves), or None where a static leaf is not hashable.
  """

  treedef: Any
  is_array: tuple[bool, ...]
  leaves: tuple[Any, ...]
  key: Any

  def call(self, fn: Callable[..., Any], dynamic: Sequence[Any]) -> Any:
    """Calls ``fn`` with ``dynamic`` in place of the array leaves."""
    it = iter(dynamic)
    full = [next(it) if a else s for s, a in zip(self.leaves, self.is_array)]
    args, kwargs = jax.tree_util.tree_unflatten(self.treedef, full)
    return fn(*args, **kwargs)


def split_call(args: Sequence[Any], kwargs: dict, *, abstract: bool = True
               ) -> tuple[CallStatics, list[Any]]:
  """Splits a call's arguments into its static part and its array leaves.

  The one place every entry point (``audit``, ``cost``, ``emulate``,
  ``check``, ``search_policy``) splits a call. Array leaves are those of
  :func:`is_array` (with ``abstract``), typed PRNG keys
  (``jax.random.key``) included; pytrees of arrays (an ``nnx.Rngs``, an NNX
  ``State``) are split into their leaves. Every other leaf is static.

  Returns:
    ``(statics, dynamic)``: :class:`CallStatics` and the array leaves.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jaxprec._src.jaxpr.trees import split_call
    >>> statics, dynamic = split_call((jnp.ones(2), "relu"), {"key": jax.random.key(0)})
    >>> statics.is_array, [str(x.dtype) for x in dynamic]
    ((True, False, True), ['float32', 'key<fry>'])
    >>> statics.call(lambda x, act, key: act, dynamic)
    'relu'
  """
  leaves, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
  arrays = tuple(is_array(x, abstract=abstract) for x in leaves)
  static = tuple(None if a else x for x, a in zip(leaves, arrays))
  try:
    key = (treedef, arrays, static_key(static))
    hash(key)
  except TypeError:
    key = None
  return (CallStatics(treedef, arrays, static, key),
          [x for x, a in zip(leaves, arrays) if a])


def signature(dynamic: Sequence[Any]) -> tuple:
  """Shapes and dtypes as ``jax.jit`` sees them (x64 off: float64 -> float32).

  Typed PRNG keys keep their key dtype (``key<fry>``).
  """
  out = []
  for x in dynamic:
    dtype = x.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
      dtype = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    out.append((tuple(np.shape(x)), dtype))
  return tuple(out)
