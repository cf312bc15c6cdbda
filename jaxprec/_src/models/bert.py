"""A BERT-style text encoder in flax.linen, randomly initialised.

Hugging Face's ``FlaxBertModel`` architecture: word, position and token-type
embeddings summed and layer-normalized, then N post-LN transformer layers
(self-attention -> dense -> residual -> LN; GELU feed-forward -> residual ->
LN). Returns ``hidden_states``: the embeddings' output and each layer's
output (N + 1 states, as HF's ``output_hidden_states=True``). Same op types
and, at :meth:`BertConfig.base`, the same shapes as bert-base-uncased.
Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jaxprec._src.models.layers import EncoderSizes, FeedForward, SelfAttention

@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig(EncoderSizes):
  """Sizes of :class:`BertEncoder`; ``base()`` matches bert-base-uncased."""

  vocab_size: int = 30522
  max_positions: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12

  @classmethod
  def small(cls) -> BertConfig:
    return cls(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024)

  @classmethod
  def tiny(cls) -> BertConfig:
    return cls(vocab_size=1000, max_positions=128, hidden_size=64, num_layers=2,
               num_heads=4, intermediate_size=128)


class _BertLayer(nn.Module):
  config: BertConfig

  @nn.compact
  def __call__(self, x, mask):
    c = self.config
    a = SelfAttention(c.hidden_size, c.num_heads, name="attention")(x, mask)
    x = nn.LayerNorm(epsilon=c.layer_norm_eps, name="attention_norm")(x + a)
    f = FeedForward(c.hidden_size, c.intermediate_size, name="feed_forward")(x)
    return nn.LayerNorm(epsilon=c.layer_norm_eps, name="output_norm")(x + f)


class BertEncoder(nn.Module):
  """Token ids ``(batch, seq)`` -> ``{"hidden_states": (num_layers + 1 arrays)}``."""

  config: BertConfig = dataclasses.field(default_factory=BertConfig)

  @nn.compact
  def __call__(self, input_ids, attention_mask=None, token_type_ids=None):
    c = self.config
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    positions = jnp.arange(input_ids.shape[1])[None, :]
    h = (nn.Embed(c.vocab_size, c.hidden_size, name="word_embeddings")(input_ids)
         + nn.Embed(c.max_positions, c.hidden_size,
                    name="position_embeddings")(positions)
         + nn.Embed(c.type_vocab_size, c.hidden_size,
                    name="token_type_embeddings")(token_type_ids))
    h = nn.LayerNorm(epsilon=c.layer_norm_eps, name="embeddings_norm")(h)
    states = [h]
    for i in range(c.num_layers):
      h = _BertLayer(c, name=f"layer_{i}")(h, attention_mask)
      states.append(h)
    return {"hidden_states": tuple(states)}


def synthetic_tokens(batch: int = 1, seq_len: int = 32, *, vocab_size: int = 1000,
                     seed: int = 0) -> np.ndarray:
  """Deterministic token ids: a 'CLS' id (1), random ids, a 'SEP' id (2)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, vocab_size, size=(batch, seq_len))
  ids[:, 0], ids[:, -1] = 1, 2
  return ids.astype(np.int32)
