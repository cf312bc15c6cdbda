"""Precision-aware drop-ins for Flax NNX's matmul and convolution modules.

Each class subclasses Flax NNX's, with the same constructor arguments, the same
state and the same computation, plus ``emulate=`` and ``target=`` keyword
arguments; ``precision=`` takes any spelling :func:`jaxprec.resolve` accepts.
As in :mod:`jaxprec.linen`: the precision is stored as the value Flax hands to
``lax`` (a convolution stores a preset's level); ``emulate=True`` computes as
``target`` (``'tpu'``, ``'gpu'``) does through NNX's hooks (``dot_general``,
``conv_general_dilated``, ``einsum_op``, and for ``MultiHeadAttention`` the
projections' ``dot_general`` and an ``attention_fn`` wrapped in
:func:`jaxprec.emulate`); ``ConvTranspose`` has no hook, so its call runs
under :func:`jaxprec.emulate`. With ``emulate=False`` a module lowers to the
StableHLO of NNX's module at the equivalent precision.

:func:`configure` applies the same settings to an existing NNX module (used by
:func:`jaxprec.swap` on a clone).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxprec._src import numerics
from jaxprec._src.flax import emulated
from jaxprec._src.flax.identity import per_op_precision

__all__ = ["Conv", "ConvTranspose", "Einsum", "Linear", "LinearGeneral",
           "MultiHeadAttention", "configure"]

_CONV_TYPES = (nnx.Conv, nnx.ConvTranspose)


def _hooks(module: Any) -> list[tuple[str, Any, Any]]:
  """(attribute, Flax's default value, our replacement maker) per hook."""
  if isinstance(module, nnx.MultiHeadAttention):
    return [("qkv_dot_general", None, emulated.EmulatedDotGeneral),
            ("out_dot_general", None, emulated.EmulatedDotGeneral)]
  if isinstance(module, nnx.LinearGeneral):
    return [("dot_general", None, emulated.EmulatedDotGeneral)]
  if isinstance(module, nnx.Linear):
    return [("dot_general", lax.dot_general, emulated.EmulatedDotGeneral)]
  if isinstance(module, nnx.Einsum):
    return [("einsum_op", jnp.einsum, emulated.EmulatedEinsum)]
  if isinstance(module, nnx.Conv):
    return [("conv_general_dilated", lax.conv_general_dilated,
             emulated.EmulatedConv)]
  return []


def _is_default(value: Any, default: Any) -> bool:
  return value is default or emulated.unwrap(value) is None and value is not None


def configure(module: Any, *, precision: Any = None, set_precision: bool = True,
              emulate: bool = False, target: str = "tpu") -> None:
  """Sets an NNX module's precision and emulation in place.

  Args:
    module: an ``nnx.Linear``, ``LinearGeneral``, ``Einsum``, ``Conv``,
      ``ConvTranspose`` or ``MultiHeadAttention`` (or a subclass).
    precision: any jaxprec spelling; stored as the ``lax`` value.
    set_precision: False leaves ``module.precision`` as it is.
    emulate, target: as the modules' arguments.

  Raises:
    ValueError: bad precision or target, or ``emulate=True`` on a module whose
      hook holds a user function.
  """
  target = numerics.check_target(target, emulation=True)
  if set_precision:
    module.precision = per_op_precision(precision,
                                        conv=isinstance(module, _CONV_TYPES))
  on = emulate and emulated.emulates(target)
  for name, default, make in _hooks(module):
    value = getattr(module, name, default)
    if not on:
      if emulated.unwrap(value) is None and value is not None:
        value = default  # ours: back to Flax's default
      setattr(module, name, value)
      continue
    if not _is_default(value, default) or (
        name == "dot_general" and getattr(module, "dot_general_cls", None)):
      raise ValueError(
          f"{type(module).__name__}: emulate=True replaces {name}, which holds "
          f"{value!r}; pass one or the other.")
    setattr(module, name, make(target))
  if isinstance(module, nnx.MultiHeadAttention):
    # NNX's default attention function computes the scores with
    # jax.nn.dot_product_attention (no precision argument) when there is no
    # dropout: scope the flag so that `precision` reaches them.
    fn = emulated.PrecisionScoped(emulated.unwrap(module.attention_fn))
    if on:
      try:
        takes_dot = "einsum_dot_general" in inspect.signature(fn).parameters
      except (TypeError, ValueError):
        takes_dot = False
      fn = (emulated.WithEinsumDotGeneral(fn, emulated.EmulatedDotGeneral(target))
            if takes_dot else emulated.EmulatedFunction(fn, target))
    module.attention_fn = fn
  if isinstance(module, nnx.ConvTranspose) and on and not getattr(
      type(module).__call__, "_jaxprec_emulating", False):
    object.__setattr__(module, "__class__", _emulating_class(type(module)))
  module.emulate = emulate
  module.target = target


def _emulating_call(base_call):
  """A ``__call__`` that runs ``base_call`` under :func:`jaxprec.emulate`
  when ``self.emulate`` (for modules without an op hook)."""

  def __call__(self, *args, **kwargs):
    call = functools.partial(base_call, self)
    if getattr(self, "emulate", False) and emulated.emulates(self.target):
      from jaxprec._src.emulate import emulate
      return emulate(call, target=self.target)(*args, **kwargs)
    return call(*args, **kwargs)

  __call__._jaxprec_emulating = True
  return __call__


@functools.lru_cache(maxsize=None)
def _emulating_class(cls: type) -> type:
  # Same layout as `cls` (no new bases), so an instance's class can be swapped.
  return type(cls.__name__, (cls,),
              {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
               "__call__": _emulating_call(cls.__call__)})


def _init(base: type):
  """An ``__init__`` with ``base``'s signature plus ``emulate=`` and ``target=``."""

  def __init__(self, *args, precision=None, emulate: bool = False,
               target: str = "tpu", **kwargs):
    base.__init__(self, *args, **kwargs)
    configure(self, precision=precision, emulate=emulate, target=target)

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
  get an emulated ``dot_general`` and ``attention_fn`` runs under
  :func:`jaxprec.emulate`.

  Examples:
    >>> import jax.numpy as jnp, jaxprec.nnx as jpn
    >>> from flax import nnx
    >>> attn = jpn.MultiHeadAttention(2, 4, precision="bf16", emulate=True,
    ...                               decode=False, rngs=nnx.Rngs(0))
    >>> attn(jnp.ones((1, 3, 4))).shape
    (1, 3, 4)
  """

  def __init__(self, *args, precision=None, emulate: bool = False,
               target: str = "tpu", **kwargs):
    # The projections are built in __init__ with this precision and hooks.
    target = numerics.check_target(target, emulation=True)
    p = per_op_precision(precision, conv=False)
    if emulate and emulated.emulates(target):
      for name in ("qkv_dot_general", "out_dot_general"):
        if kwargs.get(name) is not None or kwargs.get(f"{name}_cls") is not None:
          raise ValueError(
              f"MultiHeadAttention: emulate=True replaces {name}=; pass one or "
              f"the other.")
        kwargs[name] = emulated.EmulatedDotGeneral(target)
    super().__init__(*args, precision=p, **kwargs)
    configure(self, precision=p, emulate=emulate, target=target)

  __init__.__signature__ = _init(nnx.MultiHeadAttention).__signature__
