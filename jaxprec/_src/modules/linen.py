"""Precision-aware drop-ins for Flax linen's matmul and convolution modules.

Each class subclasses Flax's, with the same fields, the same variables and the
same computation, plus:

* ``precision=`` takes any spelling :func:`jaxprec.resolve` accepts
  (``'bf16'``, ``'tf32'``, ``'float32'``, ``'F32_F32_F32'``, ...). It is
  stored as the value Flax hands to ``lax`` (``module.precision`` shows
  ``Precision.HIGHEST`` for ``'float32'``). Convolutions understand levels
  only, so a convolution module stores a preset's level (``'F32_F32_F32'``
  gives ``HIGHEST``) instead of letting JAX lower it at ``DEFAULT``
  (JAX's conv_general_dilated lowering, jax/_src/lax/convolution.py). Pairs of different levels and ``lax.DotAlgorithm``
  objects pass through unchanged.
* ``emulate=True`` computes every matmul and convolution of the module's
  call as ``target`` (``'tpu'``, ``'gpu'``; ``'cpu'``/``'native'`` emulate
  nothing) computes it, on any backend: the call is lifted
  (``flax.core.lift.pack``, as ``nn.remat`` is) into :func:`jaxprec.emulate`,
  variables and RNGs included, so it computes what ``jaxprec.emulate`` of the
  Flax layer computes, bit for bit. A ``dot_general=`` (or any other op
  function) the user passes is emulated with the rest.

With ``emulate=False`` (the default) a module lowers to exactly the StableHLO
of Flax's module at the equivalent precision: no overhead.
"""

from __future__ import annotations

import inspect

from flax import linen as nn
from flax.core import lift

from jaxprec._src.core import numerics
from jaxprec._src.flax.hook import per_op_precision


def _lift_emulate(fn, emulation_target: str):
  """``flax.core.lift`` transform: ``fn(scope, *args)`` under jaxprec.emulate."""
  from jaxprec._src.emulation.emulate import emulate

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
    def pure(variable_groups, rng_groups, *args, **kwargs):
      scope = scope_fn(variable_groups, rng_groups)
      y = fn(scope, *args, **kwargs)
      return y, repack_fn(scope)
    return emulate(pure, target=emulation_target)(
        variable_groups, rng_groups, *args, **kwargs)

  return lift.pack(inner, (True,), (True,), (True,), name="emulate",
                   enable_kwargs=True)


def _post_init(base: type, *, conv: bool):
  """A ``__post_init__``: jaxprec's ``precision=`` and ``target=``, then
  ``base``'s."""

  def __post_init__(self):
    object.__setattr__(self, "precision",
                       per_op_precision(self.precision, conv=conv))
    object.__setattr__(self, "target",
                       numerics.check_target(self.target, emulation=True))
    base.__post_init__(self)
  return __post_init__


def _call(base: type):
  """A ``__call__`` that runs ``base``'s under :func:`jaxprec.emulate`
  (lifted over the variables and RNGs) when the module emulates, else as it
  is."""
  base_call = base.__call__

  def __call__(self, *args, **kwargs):
    if self.emulate and self.target not in ("cpu", "native"):
      return nn.transforms.lift_transform(
          _lift_emulate, base_call, emulation_target=self.target)(
              self, *args, **kwargs)
    return base_call(self, *args, **kwargs)

  __call__.__signature__ = inspect.signature(base_call)
  __call__.__doc__ = base_call.__doc__
  return nn.nowrap(__call__)


class Dense(nn.Dense):
  """``flax.linen.Dense`` with jaxprec precision names and TPU/GPU emulation.

  Attributes:
    precision: any spelling :func:`jaxprec.resolve` accepts, stored as the
      value Flax passes to ``lax``.
    emulate: compute as ``target`` does, on any backend.
    target: ``'tpu'`` (default), ``'gpu'``, or ``'cpu'``/``'native'``.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec.linen as jpl
    >>> x = jnp.full((1, 1), 1 + 2.0**-9)           # not a bfloat16 value
    >>> layer = jpl.Dense(1, use_bias=False, kernel_init=jax.nn.initializers.ones,
    ...                   precision="bf16", emulate=True)
    >>> params = layer.init(jax.random.key(0), x)
    >>> float(layer.apply(params, x)[0, 0])          # one bfloat16 pass, as a TPU
    1.0
    >>> layer.precision
    Precision.DEFAULT
  """

  emulate: bool = False
  target: str = "tpu"
  __post_init__ = _post_init(nn.Dense, conv=False)
  __call__ = _call(nn.Dense)


class DenseGeneral(nn.DenseGeneral):
  """``flax.linen.DenseGeneral`` with jaxprec precision names and emulation.

  Fields as :class:`Dense`'s, besides Flax's.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec.linen as jpl
    >>> layer = jpl.DenseGeneral((2, 3), precision="float32")
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 4)))
    >>> layer.apply(params, jnp.ones((1, 4))).shape
    (1, 2, 3)
  """

  emulate: bool = False
  target: str = "tpu"
  __post_init__ = _post_init(nn.DenseGeneral, conv=False)
  __call__ = _call(nn.DenseGeneral)


class Einsum(nn.Einsum):
  """``flax.linen.Einsum`` with jaxprec precision names and emulation.

  Fields as :class:`Dense`'s, besides Flax's.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec.linen as jpl
    >>> layer = jpl.Einsum((4, 3), "ab,bc->ac", precision="tf32", emulate=True)
    >>> params = layer.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> jax.tree.map(jnp.shape, params)
    {'params': {'bias': (3,), 'kernel': (4, 3)}}
  """

  emulate: bool = False
  target: str = "tpu"
  __post_init__ = _post_init(nn.Einsum, conv=False)
  __call__ = _call(nn.Einsum)


class Conv(nn.Conv):
  """``flax.linen.Conv`` with jaxprec precision names and emulation.

  Fields as :class:`Dense`'s, besides Flax's; a preset ``precision`` becomes
  its level, as convolutions understand levels only.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec.linen as jpl
    >>> layer = jpl.Conv(2, (3,), precision="F32_F32_F32")
    >>> layer.precision       # a preset's level: JAX would lower it at DEFAULT
    Precision.HIGHEST
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 8, 1)))
    >>> layer.apply(params, jnp.ones((1, 8, 1))).shape
    (1, 8, 2)
  """

  emulate: bool = False
  target: str = "tpu"
  __post_init__ = _post_init(nn.Conv, conv=True)
  __call__ = _call(nn.Conv)


class ConvTranspose(nn.ConvTranspose):
  """``flax.linen.ConvTranspose`` with jaxprec precision names and emulation.

  Fields as :class:`Conv`'s, besides Flax's.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec.linen as jpl
    >>> layer = jpl.ConvTranspose(2, (3,), precision="bf16", emulate=True)
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 4, 1)))
    >>> layer.apply(params, jnp.ones((1, 4, 1))).shape
    (1, 4, 2)
  """

  emulate: bool = False
  target: str = "tpu"
  __post_init__ = _post_init(nn.ConvTranspose, conv=True)
  __call__ = _call(nn.ConvTranspose)


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """``flax.linen.MultiHeadDotProductAttention`` with jaxprec precisions, emulation.

  Same fields, variables and computation as Flax's
  ``flax.linen.MultiHeadDotProductAttention``, plus ``emulate`` and ``target``.
  ``precision`` applies to the query/key/value/output projections and to the
  attention score and weighting einsums, as in Flax. With ``emulate=True``
  the whole call (projections, ``attention_fn``) runs under
  :func:`jaxprec.emulate`.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec.linen as jpl
    >>> attn = jpl.MultiHeadDotProductAttention(num_heads=2, precision="bf16",
    ...                                         emulate=True)
    >>> x = jnp.ones((1, 3, 4))
    >>> params = attn.init(jax.random.key(0), x)
    >>> attn.apply(params, x).shape
    (1, 3, 4)
  """

  emulate: bool = False
  target: str = "tpu"

  __post_init__ = _post_init(nn.MultiHeadDotProductAttention, conv=False)
  __call__ = _call(nn.MultiHeadDotProductAttention)
