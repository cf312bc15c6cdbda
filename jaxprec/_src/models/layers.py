"""Transformer pieces shared by the built-in models (flax.linen), and their
configs' sizes."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxprec._src.core import names


class Sized:
  """A config with a classmethod per size name in ``SIZES``, and
  :meth:`of_size` to call one by its name."""

  SIZES: ClassVar[tuple[str, ...]] = ("tiny", "small", "base")

  @classmethod
  def of_size(cls, size: str):
    if size not in cls.SIZES:
      raise names.unknown("size", size, cls.SIZES)
    return getattr(cls, size)()


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderSizes(Sized):
  """The transformer sizes BERT and Wav2Vec2 share; the defaults, ``base()``,
  are their base models' (bert-base-uncased, wav2vec2-base)."""

  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  intermediate_size: int = 3072

  @classmethod
  def base(cls):
    return cls()


class SelfAttention(nn.Module):
  """Multi-head self-attention with q/k/v/out projections, as in BERT/Wav2Vec2.

  The score and value matmuls are ``jnp.einsum`` calls (``dot_general``), as in
  Hugging Face's Flax models, so precision settings reach them.
  """

  hidden: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    b, t, _ = x.shape
    d = self.hidden // self.heads

    def proj(name):
      return nn.Dense(self.hidden, name=name)(x).reshape(b, t, self.heads, d)
    q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d))
    if mask is not None:
      scores = jnp.where(mask[:, None, None, :] > 0, scores,
                         jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, self.hidden)
    return nn.Dense(self.hidden, name="out_proj")(out)


class FeedForward(nn.Module):
  """Dense -> GELU -> Dense."""

  hidden: int
  intermediate: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Dense(self.intermediate, name="intermediate_dense")(x)
    x = nn.gelu(x, approximate=False)
    return nn.Dense(self.hidden, name="output_dense")(x)
