"""Linen interception: a policy's precision for every module call.

Imported only when Flax linen is (:func:`jaxprec._src.flax.scope.policy_scope`
checks ``sys.modules``).

How a policy reaches the ops of a linen model whose code the user does not own
(Hugging Face Flax models, for instance): ``flax.linen.intercept_methods``
calls an interceptor around every module method call, with the module. The
interceptor takes the module's path (:mod:`jaxprec._src.flax.paths`, the
audit's source too), type and op kind, asks the policy for a precision and
runs the method under ``jax.default_matmul_precision`` at that precision
(thread-local, restored on return). JAX resolves the flag while tracing and
writes it into each ``dot_general``/``conv_general_dilated`` equation recorded
without an explicit precision (SEMANTICS.md section 1), so every op gets the
precision of its innermost module, including ops that are not modules
themselves (the attention-score ``jnp.einsum`` calls inside
``flax.linen.dot_product_attention_weights``), and nothing is left to do at
run time: the program is the one the model would give with those precisions
written by hand.

The op kind of an op is its innermost module's: ``'conv'`` in convolution
modules, ``'attention'`` in attention modules (the score and weighting
matmuls: the projections are ``Dense``/``DenseGeneral`` submodules with their
own calls), ``'dot'`` elsewhere. The flag for a precision and kind is
:func:`jaxprec._src.numerics.flag_for` (a conv under a preset runs at its
level).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from flax import linen as nn

from jaxprec._src import numerics
from jaxprec._src.flax.nnx_policy import classify, own_precision
from jaxprec._src.flax.state import ActiveScope, active

__all__ = ["classify_linen", "intercept"]


_LINEN_TYPES = ((nn.MultiHeadDotProductAttention, "Attention"),
                (nn.ConvTranspose, "ConvTranspose"),
                ((nn.Conv, nn.ConvLocal), "Conv"),
                (nn.DenseGeneral, "DenseGeneral"), (nn.Dense, "Dense"),
                (nn.Einsum, "Einsum"))


def classify_linen(module: nn.Module) -> tuple[str | None, str]:
  """``(module type, op kind)`` of a linen module; type None for other modules."""
  return classify(module, _LINEN_TYPES)


@contextlib.contextmanager
def intercept(scope: ActiveScope) -> Iterator[None]:
  """Runs linen module calls in the block at ``scope.policy``'s precisions."""
  policy, recorder, outer = scope.policy, scope.recorder, scope.outer_flag

  def interceptor(next_fun, args, kwargs, context):
    if active() is not scope:  # an inner scope (another policy) decides
      return next_fun(*args, **kwargs)
    path = scope.paths.of(context.module)
    module_type, kind = classify_linen(context.module)
    path_str = scope.relative(path)
    p, rule = policy.match(path_str, module_type, kind)
    if recorder is not None and context.method_name != "setup":
      kept, shown = (own_precision(context.module, p, kind)
                     if module_type is not None else (False, p))
      recorder.record(path_str, module_type, kind, shown, rule, kept=kept)
    flag = outer if p is None else numerics.flag_for(p, kind)
    with scope.paths.entered(path), jax.default_matmul_precision(flag):
      return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield
