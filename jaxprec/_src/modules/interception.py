"""The Flax side of policies: module types, module paths, and interception.

Imported only when Flax is (``jaxprec._src.policy`` checks ``sys.modules``).

How a policy reaches the ops of a linen model whose code the user does not own
(Hugging Face Flax models, for instance): ``flax.linen.intercept_methods``
calls an interceptor around every module method call, with the module. The
interceptor computes the module's path, type and op kind, asks the policy for a
precision and runs the method under ``jax.default_matmul_precision`` at that
precision (thread-local, restored on return). JAX resolves the flag while
tracing and writes it into each ``dot_general``/``conv_general_dilated``
equation recorded without an explicit precision (SEMANTICS.md section 1), so
every op gets the precision of its innermost module, including ops that are
not modules themselves (the attention-score ``jnp.einsum`` calls inside
``flax.linen.dot_product_attention_weights``), and nothing is left to do at
run time: the program is the one the model would give with those precisions
written by hand.

The op kind of an op is its innermost module's: ``'conv'`` in convolution
modules, ``'attention'`` in attention modules (the score and weighting
matmuls: the projections are ``Dense``/``DenseGeneral`` submodules with their
own calls), ``'dot'`` elsewhere. Convolution modules get the level of a preset
(JAX lowers a convolution under a preset at DEFAULT: SEMANTICS.md pitfall 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from flax import linen as nn

from jaxprec._src import compat
from jaxprec._src.policy import ActiveScope, active
from jaxprec._src.precision import Precision

__all__ = ["classify_linen", "classify_nnx", "flag_for", "intercept",
           "record_paths"]

_LEVEL_FLAGS = {jax.lax.Precision.DEFAULT: "bfloat16",
                jax.lax.Precision.HIGH: "tensorfloat32",
                jax.lax.Precision.HIGHEST: "float32"}


def _is_attention_name(cls: type) -> bool:
  # Attention modules of other libraries (Hugging Face's FlaxBertSelfAttention,
  # FlaxWav2Vec2Attention, ...) subclass nothing of Flax's: go by the name.
  return "Attention" in cls.__name__


def classify_linen(module: nn.Module) -> tuple[str | None, str]:
  """``(module type, op kind)`` of a linen module; type None for other modules."""
  if isinstance(module, nn.MultiHeadDotProductAttention):
    return "Attention", "attention"
  if isinstance(module, nn.ConvTranspose):
    return "ConvTranspose", "conv"
  if isinstance(module, (nn.Conv, nn.ConvLocal)):
    return "Conv", "conv"
  if isinstance(module, nn.DenseGeneral):
    return "DenseGeneral", "dot"
  if isinstance(module, nn.Dense):
    return "Dense", "dot"
  if isinstance(module, nn.Einsum):
    return "Einsum", "dot"
  if _is_attention_name(type(module)):
    return "Attention", "attention"
  return None, "dot"


def classify_nnx(module: Any) -> tuple[str | None, str]:
  """``(module type, op kind)`` of an NNX module; type None for other modules."""
  from flax import nnx
  if isinstance(module, nnx.MultiHeadAttention):
    return "Attention", "attention"
  if isinstance(module, nnx.ConvTranspose):
    return "ConvTranspose", "conv"
  if isinstance(module, nnx.Conv):
    return "Conv", "conv"
  if isinstance(module, nnx.LinearGeneral):
    return "DenseGeneral", "dot"
  if isinstance(module, nnx.Linear):
    return "Dense", "dot"
  if isinstance(module, nnx.Einsum):
    return "Einsum", "dot"
  if _is_attention_name(type(module)):
    return "Attention", "attention"
  return None, "dot"


def flag_for(p: Precision, kind: str) -> str | None:
  """The flag value that gives ops of ``kind`` precision ``p``."""
  if kind == "conv" and p.is_preset:
    return _LEVEL_FLAGS[p.level]
  return p.flag


# ---------------------------------------------------------------------------
# Module paths.


class _Paths:
  """Full module paths, including modules applied inside another's method.

  ``module.path`` is its scope's path. Lifted transforms (``nn.remat``,
  ``nn.scan``, ``nn.jit``, ``nn.vmap``, ...) make new root scopes that keep
  the full path. A module applied with its own ``.apply`` inside another
  module's method (Hugging Face's ``FlaxConvWithWeightNorm`` does
  ``self.conv.apply(...)``) has a new root with an empty path: its path
  continues the caller's, with its name, as JAX's name stack does.
  """

  def __init__(self):
    self.bases: dict[int, tuple[Any, tuple[str, ...]]] = {}
    self.frames: list[tuple[str, ...]] = []

  def of(self, module: nn.Module) -> tuple[str, ...]:
    scope = module.scope
    if scope is None:
      return ()
    root = scope.root
    hit = self.bases.get(id(root))
    if hit is None or hit[0] is not root:
      nested_apply = self.frames and not tuple(root.path)
      base = ((*self.frames[-1], module.name or type(module).__name__)
              if nested_apply else ())
      self.bases[id(root)] = hit = (root, base)
    return (*hit[1], *(str(p) for p in scope.path))

  @contextlib.contextmanager
  def entered(self, path: tuple[str, ...]) -> Iterator[None]:
    self.frames.append(path)
    try:
      yield
    finally:
      self.frames.pop()


# ---------------------------------------------------------------------------
# The policy interceptor.


@contextlib.contextmanager
def intercept(scope: ActiveScope) -> Iterator[None]:
  """Runs linen module calls in the block at ``scope.policy``'s precisions."""
  paths = scope.state.setdefault("paths", _Paths())
  policy, recorder, outer = scope.policy, scope.recorder, scope.outer_flag

  def interceptor(next_fun, args, kwargs, context):
    if active() is not scope:  # an inner scope (another policy) decides
      return next_fun(*args, **kwargs)
    module = context.module
    path = paths.of(module)
    module_type, kind = classify_linen(module)
    root = scope.state.get("root_path", ())
    path_str = "/".join(path[len(root):] if path[:len(root)] == root else path)
    p, rule = policy.match(path_str, module_type, kind)
    if recorder is not None and context.method_name != "setup":
      recorder.record(path_str, module_type, kind, p, rule)
    flag = outer if p is None else flag_for(p, kind)
    with paths.entered(path), jax.default_matmul_precision(flag):
      return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield


# ---------------------------------------------------------------------------
# Module paths for reports (jaxprec.audit).


@contextlib.contextmanager
def record_paths() -> Iterator[dict[str, str]]:
  """Records, while tracing, the JAX name stack of every linen module call.

  Yields a dict filled as modules run: the name stack (as text, relative to
  the jaxpr being traced, as equations record it) of each module method call
  -> that module's ``'/'``-joined path. Flax's named scopes are switched on
  for the block so that equations carry their modules' names.
  """
  found: dict[str, str] = {}
  paths = _Paths()

  def interceptor(next_fun, args, kwargs, context):
    path = paths.of(context.module)
    found.setdefault(compat.current_name_stack(), "/".join(path))
    with paths.entered(path):
      return next_fun(*args, **kwargs)

  # Flax names its calls' scopes unless profiling names are off (flax_profile);
  # flax.linen.module._use_named_call is private: default to on if it moves.
  named = getattr(nn.module, "_use_named_call", True)
  with (contextlib.nullcontext() if named else nn.override_named_call(True)), \
       nn.intercept_methods(interceptor):
    yield found

