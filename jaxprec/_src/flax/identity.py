"""What a Flax module is to a policy: its type, op kind and own precision.

One source for both APIs: the linen interceptor
(:mod:`jaxprec._src.flax.interception`), the NNX hook
(:mod:`jaxprec._src.flax.hook`) and the precision-aware modules ask here.
Imports Flax NNX only when asked about NNX modules.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from jax import lax

from jaxprec._src.core import numerics
from jaxprec._src.core.precision import Precision, resolve


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
