"""Hashable emulated-op callables for Flax's injection points.

Flax modules take ``dot_general=``, ``conv_general_dilated=``, ``einsum_op=``
and ``attention_fn=`` as fields or attributes; ``flax.linen`` needs them
hashable (module fields take part in ``nn.jit``'s cache key) and
``jnp.einsum`` takes its ``_dot_general`` as a static argument. These frozen
dataclasses wrap :mod:`jaxprec._src.emulated_ops` (and, where Flax offers no
hook below the function, :func:`jaxprec.emulate`) with the target bound.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from jaxprec._src import emulated_ops
from jaxprec._src.flax.nnx_policy import PrecisionScoped

__all__ = ["EmulatedConv", "EmulatedDotGeneral", "EmulatedEinsum",
           "EmulatedFunction", "PrecisionScoped", "WithEinsumDotGeneral",
           "emulates", "unwrap"]


def emulates(target: str) -> bool:
  """Whether ``target`` emulates anything ('cpu'/'native' run natively)."""
  return target not in ("cpu", "native")


@dataclasses.dataclass(frozen=True)
class EmulatedDotGeneral:
  """``lax.dot_general`` as ``target`` computes it (Flax's ``dot_general=``)."""

  target: str = "tpu"
  tf32_rounding: str = "nearest"

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, **kwargs):
    return emulated_ops.emulated_dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type,
        target=self.target, tf32_rounding=self.tf32_rounding, **kwargs)


@dataclasses.dataclass(frozen=True)
class EmulatedConv:
  """``lax.conv_general_dilated`` as ``target`` computes it."""

  target: str = "tpu"
  tf32_rounding: str = "nearest"

  def __call__(self, *args, **kwargs):
    return emulated_ops.emulated_conv_general_dilated(
        *args, target=self.target, tf32_rounding=self.tf32_rounding, **kwargs)


@dataclasses.dataclass(frozen=True)
class EmulatedEinsum:
  """``jnp.einsum`` with its matmuls emulated (NNX's ``einsum_op=``)."""

  target: str = "tpu"
  tf32_rounding: str = "nearest"

  def __call__(self, subscripts, *operands, **kwargs):
    return jnp.einsum(subscripts, *operands, **kwargs,
                      _dot_general=EmulatedDotGeneral(self.target,
                                                      self.tf32_rounding))


@dataclasses.dataclass(frozen=True)
class WithEinsumDotGeneral:
  """An attention function called with ``einsum_dot_general=dot``.

  For ``flax.linen.dot_product_attention`` (and functions with its
  signature): its score and weighting einsums then use ``dot``. Keeps the
  wrapped function's signature, which Flax inspects to filter arguments.
  """

  fn: Callable[..., Any]
  dot: Any

  @property
  def __signature__(self):
    return inspect.signature(self.fn)

  def __call__(self, *args, **kwargs):
    return self.fn(*args, einsum_dot_general=self.dot, **kwargs)


@dataclasses.dataclass(frozen=True)
class EmulatedFunction:
  """``fn`` with every matmul and conv emulated by :func:`jaxprec.emulate`.

  For attention functions that have no ``dot_general`` hook (NNX's
  ``dot_product_attention``). A ``module=`` argument (Flax passes the module
  to sow attention weights) is bound, not traced. Keeps ``fn``'s signature.
  """

  fn: Callable[..., Any]
  target: str = "tpu"
  tf32_rounding: str = "nearest"

  @property
  def __signature__(self):
    return inspect.signature(self.fn)

  def __call__(self, *args, **kwargs):
    from jaxprec._src.emulate import emulate
    fn = self.fn
    if "module" in kwargs:
      fn = functools.partial(fn, module=kwargs.pop("module"))
    return emulate(fn, target=self.target,
                   tf32_rounding=self.tf32_rounding)(*args, **kwargs)


def unwrap(value: Any) -> Any:
  """The user's value behind ours (None for our op replacements)."""
  if isinstance(value, (EmulatedDotGeneral, EmulatedConv, EmulatedEinsum)):
    return None
  if isinstance(value, (WithEinsumDotGeneral, EmulatedFunction, PrecisionScoped)):
    return unwrap(value.fn)
  return value
