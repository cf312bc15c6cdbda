"""Precision-aware drop-ins for Flax NNX's matmul and convolution modules.

Each class subclasses Flax NNX's, with the same constructor arguments, the same
state and the same computation, plus ``emulate=`` and ``target=`` keyword
arguments; ``precision=`` takes any spelling :func:`jaxprec.resolve` accepts.
As in :mod:`jaxprec.linen`: the precision is stored as the value Flax hands to
``lax`` (a convolution stores a preset's level); ``emulate=True`` runs the
module's call under :func:`jaxprec.emulate` for ``target`` (``'tpu'``,
``'gpu'``), its state an argument of the trace and the variables it writes
written back, so it computes what ``jaxprec.emulate`` of NNX's module
computes, bit for bit. With ``emulate=False`` a module lowers to the StableHLO
of NNX's module at the equivalent precision.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxprec._src.core import numerics
from jaxprec._src.core.precision import resolve
from jaxprec._src.flax.hook import per_op_precision


@dataclasses.dataclass(frozen=True)
class PrecisionScoped:
  """An attention function run with JAX's flag at its ``precision=`` argument.

  Flax NNX's ``dot_product_attention`` ignores ``precision`` for the score and
  weighting matmuls when there is no dropout: it calls
  ``jax.nn.dot_product_attention``, which has no precision argument and uses
  the flag for float32 inputs (the jax.nn.dot_product_attention docs). Setting
  the flag for the call makes ``precision`` reach them; ops given a precision
  keep it.
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


@functools.lru_cache(maxsize=None)
def _emulator(base_call, target: str):
  """``fn(module, *args, **kwargs)``: ``base_call`` emulated for ``target``
  (one trace cache per NNX class and target)."""
  from jaxprec._src.emulation.emulate import emulate_nnx_call
  return emulate_nnx_call(base_call, target)


def _emulating_call(base_call):
  """A ``__call__`` that runs ``base_call`` under :func:`jaxprec.emulate`
  when ``self.emulate`` and ``self.target`` emulates."""

  @functools.wraps(base_call)
  def __call__(self, *args, **kwargs):
    if getattr(self, "emulate", False) and self.target not in ("cpu", "native"):
      return _emulator(base_call, self.target)(self, *args, **kwargs)
    return base_call(self, *args, **kwargs)

  return __call__


def _init(base: type):
  """An ``__init__`` with ``base``'s signature plus ``emulate=`` and
  ``target=``, its ``precision=`` any jaxprec spelling, stored as the ``lax``
  value (given to ``base``'s: attention builds its projections there)."""
  conv = issubclass(base, (nnx.Conv, nnx.ConvTranspose))

  def __init__(self, *args, precision=None, emulate: bool = False,
               target: str = "tpu", **kwargs):
    target = numerics.check_target(target, emulation=True)
    base.__init__(self, *args, precision=per_op_precision(precision, conv=conv),
                  **kwargs)
    if isinstance(self, nnx.MultiHeadAttention):
      # NNX's default attention function computes the scores with
      # jax.nn.dot_product_attention (no precision argument) when there is
      # no dropout: scope the flag so that `precision` reaches them.
      self.attention_fn = PrecisionScoped(self.attention_fn)
    self.emulate = emulate
    self.target = target

  sig = inspect.signature(base.__init__)
  params = list(sig.parameters.values())
  extra = [inspect.Parameter("emulate", inspect.Parameter.KEYWORD_ONLY,
                             default=False, annotation=bool),
           inspect.Parameter("target", inspect.Parameter.KEYWORD_ONLY,
                             default="tpu", annotation=str)]
  cut = next((i for i, p in enumerate(params)
              if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
  __init__.__signature__ = sig.replace(parameters=params[:cut] + extra + params[cut:])
  __init__.__doc__ = base.__init__.__doc__
  return __init__


class Linear(nnx.Linear):
  """``flax.nnx.Linear`` with jaxprec precision names and TPU/GPU emulation.

  Examples:
    >>> import jax.numpy as jnp, jaxprec.nnx as jpn
    >>> from flax import nnx
    >>> layer = jpn.Linear(1, 1, use_bias=False, precision="bf16", emulate=True,
    ...                    kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
    >>> float(layer(jnp.full((1, 1), 1 + 2.0**-9))[0, 0])   # as a TPU
    1.0
  """

  __init__ = _init(nnx.Linear)
  __call__ = _emulating_call(nnx.Linear.__call__)


class LinearGeneral(nnx.LinearGeneral):
  """``flax.nnx.LinearGeneral`` with jaxprec precision names and emulation.

  Examples:
    >>> import jax.numpy as jnp, jaxprec.nnx as jpn
    >>> from flax import nnx
    >>> layer = jpn.LinearGeneral(4, (2, 3), precision="float32", rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 4))).shape
    (1, 2, 3)
  """

  __init__ = _init(nnx.LinearGeneral)
  __call__ = _emulating_call(nnx.LinearGeneral.__call__)


class Einsum(nnx.Einsum):
  """``flax.nnx.Einsum`` with jaxprec precision names and emulation.

  Examples:
    >>> import jax.numpy as jnp, jaxprec.nnx as jpn
    >>> from flax import nnx
    >>> layer = jpn.Einsum("ab,bc->ac", (4, 3), (3,), precision="tf32",
    ...                    emulate=True, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 4))).shape
    (2, 3)
  """

  __init__ = _init(nnx.Einsum)
  __call__ = _emulating_call(nnx.Einsum.__call__)


class Conv(nnx.Conv):
  """``flax.nnx.Conv`` with jaxprec precision names and emulation.

  A preset becomes its level (convolutions understand levels only).

  Examples:
    >>> import jax.numpy as jnp, jaxprec.nnx as jpn
    >>> from flax import nnx
    >>> layer = jpn.Conv(1, 2, (3,), precision="F32_F32_F32", rngs=nnx.Rngs(0))
    >>> layer.precision
    Precision.HIGHEST
  """

  __init__ = _init(nnx.Conv)
  __call__ = _emulating_call(nnx.Conv.__call__)


class ConvTranspose(nnx.ConvTranspose):
  """``flax.nnx.ConvTranspose`` with jaxprec precision names and emulation.

  Examples:
    >>> import jax.numpy as jnp, jaxprec.nnx as jpn
    >>> from flax import nnx
    >>> layer = jpn.ConvTranspose(1, 2, (3,), precision="bf16", emulate=True,
    ...                           rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 4, 1))).shape
    (1, 4, 2)
  """

  __init__ = _init(nnx.ConvTranspose)
  __call__ = _emulating_call(nnx.ConvTranspose.__call__)


class MultiHeadAttention(nnx.MultiHeadAttention):
  """``flax.nnx.MultiHeadAttention`` with jaxprec precision names and emulation.

  ``precision`` applies to the projections and to the attention score and
  weighting matmuls. For the latter this differs from NNX: its default
  ``attention_fn`` calls ``jax.nn.dot_product_attention`` when there is no
  dropout, which has no precision argument, so NNX computes them at the
  precision in force whatever ``precision`` says; here ``attention_fn`` runs
  with JAX's flag set to ``precision``. With ``emulate=True`` the projections
  and ``attention_fn`` run under :func:`jaxprec.emulate`.

  Examples:
    >>> import jax.numpy as jnp, jaxprec.nnx as jpn
    >>> from flax import nnx
    >>> attn = jpn.MultiHeadAttention(2, 4, precision="bf16", emulate=True,
    ...                               decode=False, rngs=nnx.Rngs(0))
    >>> attn(jnp.ones((1, 3, 4))).shape
    (1, 3, 4)
  """

  __init__ = _init(nnx.MultiHeadAttention)
  __call__ = _emulating_call(nnx.MultiHeadAttention.__call__)
