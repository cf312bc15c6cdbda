"""Linen interception: a policy's precision and dtype for every module call.

Imported only when Flax linen is (:func:`jaxprec._src.flax.scope.policy_scope`
checks ``sys.modules``).

Every linen module method call runs under the flag the hook decides
(:mod:`jaxprec._src.flax.hook`), so every op gets the precision of its
innermost module, also ops that are not modules (the attention-score
``jnp.einsum`` calls of ``flax.linen.dot_product_attention_weights``).

The compute dtype (:meth:`jaxprec.Policy.match_dtype`) is applied per module:
a module with a ``dtype`` dataclass field runs its ``setup`` and each method
with that field set on the bound module (restored in ``finally``; the user's
module is never bound, hence never touched), so submodules built with
``dtype=self.dtype`` inherit it unless a rule decides otherwise for them.
Flax's ``setup`` runs through the interceptors too (``method_name ==
'setup'``; flax 0.10 and 0.12 ``Module._call_wrapped_method``). A module
without a ``dtype`` field that a dtype *rule* matches has its floating inputs
and outputs cast at its boundary (as jmp does); under the default dtype it is
left as it is (``'skipped'``, as in NNX), so that ``default=dtype:D`` is the
model built with ``dtype=D``. Parameters keep their stored dtype: Flax's
``promote_dtype`` casts them at use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxprec._src.flax import hook
from jaxprec._src.flax.state import ActiveScope, active


_LINEN_TYPES = ((nn.MultiHeadDotProductAttention, "Attention"),
                (nn.ConvTranspose, "ConvTranspose"),
                ((nn.Conv, nn.ConvLocal), "Conv"),
                (nn.DenseGeneral, "DenseGeneral"), (nn.Dense, "Dense"),
                (nn.Einsum, "Einsum"))


@functools.lru_cache(maxsize=1024)
def has_dtype_field(cls: type) -> bool:
  """Whether a linen module class has a ``dtype`` dataclass field."""
  try:
    return any(f.name == "dtype" for f in dataclasses.fields(cls))
  except TypeError:  # not a dataclass
    return False


def cast_floating(tree: Any, dtype: Any) -> Any:
  """``tree`` with its floating arrays cast to ``dtype``; other leaves as they are.

  Python scalars stay (weakly typed, they promote); integer and bool arrays
  stay.
  """
  dtype = np.dtype(dtype)

  def leaf(x):
    if (isinstance(x, (jax.Array, np.ndarray))
        and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype):
      return x.astype(dtype)
    return x

  return jax.tree.map(leaf, tree)


@contextlib.contextmanager
def intercept(scope: ActiveScope) -> Iterator[None]:
  """Runs linen module calls in the block at ``scope.policy``'s precisions
  and compute dtypes."""
  policy, recorder = scope.policy, scope.recorder
  dtypes = policy.has_dtypes

  def interceptor(next_fun, args, kwargs, context):
    if active() is not scope:  # an inner scope (another policy) decides
      return next_fun(*args, **kwargs)
    module = context.module
    path = scope.paths.of(module)
    module_type, kind = hook.classify(module, _LINEN_TYPES)
    path_str = scope.relative(path)
    setup = context.method_name == "setup"
    flag, precision, rule, kept = hook.decide(
        policy, path_str, module, module_type, kind, scope.outer_flag)
    dt, drule, how = None, None, None
    if dtypes:
      dt, drule = policy.match_dtype(path_str, module_type, kind)
      if dt is not None and has_dtype_field(type(module)):
        how = "field"
      elif dt is not None:  # only a rule casts at the boundary (as NNX)
        dt, how = (dt, "boundary") if drule is not None else (None, "skipped")
    if recorder is not None and not setup:
      recorder.record(path_str, module_type, kind, precision, rule, kept=kept,
                      dtype=dt, dtype_how=how, dtype_rule=drule)
    kwargs = hook.linen_bridge(module, path, context.method_name, kwargs)
    with scope.paths.entered(path, module), \
         jax.default_matmul_precision(flag):
      if how == "field" and module.scope is not None:  # bound: not the user's
        old = module.dtype
        object.__setattr__(module, "dtype", getattr(jnp, dt))
        try:
          return next_fun(*args, **kwargs)
        finally:
          object.__setattr__(module, "dtype", old)
      if how == "boundary" and not setup:
        args, kwargs = cast_floating((args, kwargs), getattr(jnp, dt))
        return cast_floating(next_fun(*args, **kwargs), getattr(jnp, dt))
      return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield
