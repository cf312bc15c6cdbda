"""Pieces shared by the built-in NNX models: attention, layer normalization
and activations."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def gelu(x: jax.Array) -> jax.Array:
  """GELU with the error function, transformers' ``"gelu"`` (not the tanh
  approximation)."""
  return jax.nn.gelu(x, approximate=False)


def layer_norm(n: int, eps: float, rngs: nnx.Rngs) -> nnx.LayerNorm:
  """``nnx.LayerNorm`` with a two-pass variance (mean of squared
  deviations), as ``torch.nn.LayerNorm``."""
  return nnx.LayerNorm(n, epsilon=eps, use_fast_variance=False, rngs=rngs)


def attention(q: jax.Array, k: jax.Array, v: jax.Array,
              mask: jax.Array | None = None, *,
              causal: bool = False, first: Any = 0) -> jax.Array:
  """Scaled dot-product attention with grouped key/value heads.

  The score and value matmuls are ``jnp.einsum`` calls (``dot_general``), so
  precision settings and emulation reach them, as they reach Flax's own
  attention.

  Args:
    q: queries ``(batch, q_len, heads, head_dim)``.
    k, v: keys and values ``(batch, kv_len, kv_heads, head_dim)``;
      ``heads`` is a multiple of ``kv_heads``, and query head ``i`` reads
      key/value head ``i // (heads // kv_heads)`` (transformers'
      ``repeat_kv``).
    mask: ``(batch, kv_len)``, nonzero where a key may be attended to.
    causal: each query attends only to keys at its position or before.
    first: the key position of the first query (a decoding step with a
      cache: the queries are keys ``first, first + 1, ...``).

  Returns:
    ``(batch, q_len, heads * head_dim)``.
  """
  b, t, h, d = q.shape
  s, g = k.shape[1], k.shape[2]
  q = q.reshape(b, t, g, h // g, d)
  scores = jnp.einsum("btgrd,bsgd->bgrts", q, k) * jnp.float32(d ** -0.5)
  keep = jnp.ones((b, 1, 1, t, s), bool)
  if mask is not None:
    keep = keep & (mask[:, None, None, None, :] > 0)
  if causal:
    keep = keep & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + first)
  scores = jnp.where(keep, scores, jnp.finfo(scores.dtype).min)
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bgrts,bsgd->btgrd", weights, v)
  return out.reshape(b, t, h * d)
