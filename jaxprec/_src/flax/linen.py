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
* ``emulate=True`` computes every matmul and convolution as ``target``
  (``'tpu'``, ``'gpu'``; ``'cpu'``/``'native'`` emulate nothing) computes it,
  on any backend, through Flax's injection points: ``dot_general=``
  (``Dense``, ``DenseGeneral``, and the projections of
  ``MultiHeadDotProductAttention``), ``conv_general_dilated=`` (``Conv``), and
  for the attention score and weighting einsums ``einsum_dot_general=`` of
  ``flax.linen.dot_product_attention`` (other attention functions are wrapped
  in :func:`jaxprec.emulate`). ``Einsum`` and ``ConvTranspose`` have no such
  hook in Flax: their call is lifted (``flax.core.lift.pack``, as
  ``nn.remat`` is) into :func:`jaxprec.emulate`, variables and RNGs
  included. Passing your own ``dot_general``/``conv_general_dilated`` (or a
  ``*_cls``) together with ``emulate=True`` is a ValueError.

With ``emulate=False`` (the default) a module lowers to exactly the StableHLO
of Flax's module at the equivalent precision: no overhead.
"""

from __future__ import annotations

import inspect
from typing import Any

from flax import linen as nn
from flax.core import lift

from jaxprec._src import numerics
from jaxprec._src.flax import emulated
from jaxprec._src.flax.identity import per_op_precision

__all__ = ["Conv", "ConvTranspose", "Dense", "DenseGeneral", "Einsum",
           "MultiHeadDotProductAttention"]


def _set(module: Any, name: str, value: Any) -> None:
  object.__setattr__(module, name, value)


def _hook(module: Any, name: str, make: Any, cls_field: str | None) -> None:
  """Sets ``module.<name>`` to ``make`` when emulating, else to the user's value."""
  user = emulated.unwrap(getattr(module, name))
  if not _emulating(module):
    _set(module, name, user)
    return
  for field, value in ((name, user), (cls_field, getattr(module, cls_field, None))):
    if field is not None and value is not None:
      raise ValueError(
          f"{type(module).__name__}: emulate=True replaces {name}=, but "
          f"{field}={value!r} was passed too; pass one or the other "
          f"(jaxprec.emulated_dot_general and "
          f"jaxprec.emulated_conv_general_dilated take target=).")
  _set(module, name, make)


def _prepare(module: Any, *, conv: bool) -> None:
  _set(module, "precision", per_op_precision(module.precision, conv=conv))
  _set(module, "target", numerics.check_target(module.target, emulation=True))


def _emulating(module: Any) -> bool:
  return module.emulate and emulated.emulates(module.target)


# ---------------------------------------------------------------------------
# Emulation lifted over a whole method, for modules without an op hook.


def _lift_emulate(fn, emulation_target: str):
  """``flax.core.lift`` transform: ``fn(scope, *args)`` under jaxprec.emulate."""
  from jaxprec._src.emulate import emulate

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
    def pure(variable_groups, rng_groups, *args, **kwargs):
      scope = scope_fn(variable_groups, rng_groups)
      y = fn(scope, *args, **kwargs)
      return y, repack_fn(scope)
    return emulate(pure, target=emulation_target)(
        variable_groups, rng_groups, *args, **kwargs)

  return lift.pack(inner, (True,), (True,), (True,), name="emulate",
                   enable_kwargs=True)


def _emulated_call(method, module, *args, **kwargs):
  lifted = nn.transforms.lift_transform(_lift_emulate, method,
                                        emulation_target=module.target)
  return lifted(module, *args, **kwargs)


# ---------------------------------------------------------------------------
# The modules.

def _post_init(base: type, *, conv: bool, hooks: tuple[tuple[str, str], ...] = ()):
  """A ``__post_init__``: jaxprec's ``precision=`` and ``target=``, then the
  emulated op in each ``(hook, its *_cls field)`` of ``hooks``, then
  ``base``'s."""
  make = emulated.EmulatedConv if conv else emulated.EmulatedDotGeneral

  def __post_init__(self):
    _prepare(self, conv=conv)
    for name, cls_field in hooks:
      _hook(self, name, make(self.target), cls_field)
    base.__post_init__(self)
  return __post_init__


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
  __post_init__ = _post_init(nn.Dense, conv=False,
                             hooks=(("dot_general", "dot_general_cls"),))


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
  __post_init__ = _post_init(nn.DenseGeneral, conv=False,
                             hooks=(("dot_general", "dot_general_cls"),))


class Einsum(nn.Einsum):
  """``flax.linen.Einsum`` with jaxprec precision names and emulation.

  Fields as :class:`Dense`'s, besides Flax's. Flax's ``Einsum`` has no op
  hook: with ``emulate=True`` its call is lifted into :func:`jaxprec.emulate`.

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

  def __call__(self, inputs, einsum_str=None):
    if _emulating(self):
      return _emulated_call(nn.Einsum.__call__, self, inputs, einsum_str)
    return super().__call__(inputs, einsum_str)


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
  __post_init__ = _post_init(
      nn.Conv, conv=True,
      hooks=(("conv_general_dilated", "conv_general_dilated_cls"),))


class ConvTranspose(nn.ConvTranspose):
  """``flax.linen.ConvTranspose`` with jaxprec precision names and emulation.

  Fields as :class:`Conv`'s, besides Flax's. Flax's ``ConvTranspose`` has no
  op hook: with ``emulate=True`` its call is lifted into
  :func:`jaxprec.emulate`.

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

  def __call__(self, inputs):
    if _emulating(self):
      return _emulated_call(nn.ConvTranspose.__call__, self, inputs)
    return super().__call__(inputs)


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """``flax.linen.MultiHeadDotProductAttention`` with jaxprec precisions, emulation.

  Same fields, variables and computation as Flax's
  ``flax.linen.MultiHeadDotProductAttention``, plus ``emulate`` and ``target``.
  ``precision`` applies to the query/key/value/output projections and to the
  attention score and weighting einsums, as in Flax. With ``emulate=True``
  the projections get an emulated ``dot_general`` and ``attention_fn`` its
  einsums' (``einsum_dot_general=``, for ``flax.linen.dot_product_attention``
  and functions with that argument; any other function is wrapped in
  :func:`jaxprec.emulate`).

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

  def __post_init__(self):
    _prepare(self, conv=False)
    dot = emulated.EmulatedDotGeneral(self.target)
    _hook(self, "qkv_dot_general", dot, "qkv_dot_general_cls")
    _hook(self, "out_dot_general", dot, "out_dot_general_cls")
    fn = emulated.unwrap(self.attention_fn)
    if _emulating(self):
      custom_einsum = (self.qk_attn_weights_einsum_cls is not None
                       or self.attn_weights_value_einsum_cls is not None)
      try:
        takes_dot = "einsum_dot_general" in inspect.signature(fn).parameters
      except (TypeError, ValueError):
        takes_dot = False
      fn = (emulated.WithEinsumDotGeneral(fn, dot)
            if takes_dot and not custom_einsum
            else emulated.EmulatedFunction(fn, self.target))
    _set(self, "attention_fn", fn)
    super().__post_init__()

