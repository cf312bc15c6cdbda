"""The flax.linen encoders behind the random ``wav2vec2()`` and ``bert()``,
the layers they share, and the configs (the NNX ports' too).

:class:`Wav2Vec2Encoder` has the architecture of Hugging Face's
``FlaxWav2Vec2Model`` with ``feat_extract_norm="layer"`` and
``do_stable_layer_norm=True`` (the ``wav2vec2-large-lv60`` family, the model
of transformers issue 15754):

1. feature encoder: 7 temporal convolutions (kernels 10,3,3,3,3,2,2, strides
   5,2,2,2,2,2,2), each followed by layer normalization over channels and GELU;
2. feature projection: layer normalization, then a dense layer to the hidden
   size;
3. convolutional positional embedding: a grouped convolution (kernel 128, 16
   groups at base size; the last frame dropped for even kernels) and GELU,
   added to the projected features (HF's weight normalization of that kernel
   is a reparametrisation and is left out: it adds no matmul);
4. N pre-LN transformer layers (LN -> self-attention -> residual; LN -> GELU
   feed-forward -> residual) and a final layer normalization.

Its outputs, in depth order: ``conv_features`` (the 7 convolution outputs)
and ``hidden_states`` (N + 1 states: the input of each layer, then the final
normalized output, as HF's ``output_hidden_states=True`` returns them).

:class:`BertEncoder` has Hugging Face's ``FlaxBertModel`` architecture: word,
position and token-type embeddings summed and layer-normalized, then N
post-LN transformer layers (self-attention -> dense -> residual -> LN; GELU
feed-forward -> residual -> LN). It returns ``hidden_states``: the
embeddings' output and each layer's output (N + 1 states).

Both have the op types and, at their configs' ``base()``, the shapes of the
published models. Nothing is downloaded; weights are Flax's default
initialisers from a fixed seed.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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



@dataclasses.dataclass(frozen=True, kw_only=True)
class Wav2Vec2Config(EncoderSizes):
  """Sizes of :class:`Wav2Vec2Encoder`; ``base()`` matches wav2vec2-base
  (95M parameters)."""

  conv_dim: tuple[int, ...] = (512,) * 7
  conv_kernel: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)
  conv_stride: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
  conv_bias: bool = True
  pos_conv_kernel: int = 128
  pos_conv_groups: int = 16
  layer_norm_eps: float = 1e-5

  @classmethod
  def small(cls) -> Wav2Vec2Config:
    """A 4-layer, 256-wide model: base's structure at about 1/30 the cost."""
    return cls(conv_dim=(128,) * 7, hidden_size=256, num_layers=4, num_heads=4,
               intermediate_size=1024, pos_conv_kernel=64, pos_conv_groups=8)

  @classmethod
  def tiny(cls) -> Wav2Vec2Config:
    """2 layers, 64 wide: for tests and a check in seconds on a laptop."""
    return cls(conv_dim=(32,) * 7, hidden_size=64, num_layers=2, num_heads=4,
               intermediate_size=128, pos_conv_kernel=16, pos_conv_groups=4)

  def num_frames(self, samples: int) -> int:
    """Frames the feature encoder makes of ``samples`` audio samples."""
    for k, s in zip(self.conv_kernel, self.conv_stride):
      samples = (samples - k) // s + 1
    return samples


class _ConvLayer(nn.Module):
  features: int
  kernel: int
  stride: int
  bias: bool
  eps: float

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.features, (self.kernel,), (self.stride,), padding="VALID",
                use_bias=self.bias, name="conv")(x)
    x = nn.LayerNorm(epsilon=self.eps, name="layer_norm")(x)
    return nn.gelu(x, approximate=False)


class _PositionalConvEmbedding(nn.Module):
  hidden: int
  kernel: int
  groups: int

  @nn.compact
  def __call__(self, x):
    pad = self.kernel // 2
    y = nn.Conv(self.hidden, (self.kernel,), padding=((pad, pad),),
                feature_group_count=self.groups, name="conv")(x)
    if self.kernel % 2 == 0:
      y = y[:, :-1]
    return nn.gelu(y, approximate=False)


class _EncoderLayer(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x):
    c = self.config
    h = nn.LayerNorm(epsilon=c.layer_norm_eps, name="layer_norm")(x)
    x = x + SelfAttention(c.hidden_size, c.num_heads, name="attention")(h)
    h = nn.LayerNorm(epsilon=c.layer_norm_eps, name="final_layer_norm")(x)
    return x + FeedForward(c.hidden_size, c.intermediate_size,
                           name="feed_forward")(h)


class Wav2Vec2Encoder(nn.Module):
  """Raw audio ``(batch, samples)`` -> conv features and hidden states.

  Called on audio, it returns ``{"conv_features": (7 arrays (batch,
  frames_i, conv_dim_i)), "hidden_states": (num_layers + 1 arrays (batch,
  frames, hidden))}``.

  Attributes:
    config: the sizes (:class:`Wav2Vec2Config`).
  """

  config: Wav2Vec2Config = dataclasses.field(default_factory=Wav2Vec2Config)

  @nn.compact
  def __call__(self, audio: jax.Array) -> dict[str, tuple[jax.Array, ...]]:
    c = self.config
    x = audio[..., None]
    convs = []
    for i, (d, k, s) in enumerate(zip(c.conv_dim, c.conv_kernel, c.conv_stride)):
      x = _ConvLayer(d, k, s, c.conv_bias, c.layer_norm_eps,
                     name=f"conv_layers_{i}")(x)
      convs.append(x)
    h = nn.LayerNorm(epsilon=c.layer_norm_eps, name="feature_projection_norm")(x)
    h = nn.Dense(c.hidden_size, name="feature_projection")(h)
    h = h + _PositionalConvEmbedding(c.hidden_size, c.pos_conv_kernel,
                                     c.pos_conv_groups, name="pos_conv_embed")(h)
    states = []
    for i in range(c.num_layers):
      states.append(h)
      h = _EncoderLayer(c, name=f"layers_{i}")(h)
    states.append(nn.LayerNorm(epsilon=c.layer_norm_eps, name="layer_norm")(h))
    return {"conv_features": tuple(convs), "hidden_states": tuple(states)}


def synthetic_audio(batch: int = 1, seconds: float = 1.0, *,
                    sample_rate: int = 16000, seed: int = 0) -> np.ndarray:
  """Deterministic test audio: a few sines plus noise, zero mean, unit variance.

  Args:
    batch: number of clips.
    seconds: length of each clip.
    sample_rate: samples per second (Wav2Vec2 expects 16 kHz).
    seed: the random seed (frequencies, phases, noise).

  Returns:
    A float32 array ``(batch, round(seconds * sample_rate))``.
  """
  rng = np.random.default_rng(seed)
  n = int(round(seconds * sample_rate))
  t = np.arange(n) / sample_rate
  freqs = rng.uniform(80, 3000, size=(batch, 5, 1))
  phases = rng.uniform(0, 2 * np.pi, size=(batch, 5, 1))
  amps = rng.uniform(0.2, 1.0, size=(batch, 5, 1))
  x = (amps * np.sin(2 * np.pi * freqs * t + phases)).sum(axis=1)
  x = x + 0.1 * rng.standard_normal((batch, n))
  x = (x - x.mean(axis=1, keepdims=True)) / x.std(axis=1, keepdims=True)
  return x.astype(np.float32)
