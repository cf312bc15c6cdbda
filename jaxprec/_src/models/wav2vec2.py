"""A Wav2Vec2-style speech encoder in flax.linen, randomly initialised.

The architecture of Hugging Face's ``FlaxWav2Vec2Model`` with
``feat_extract_norm="layer"`` and ``do_stable_layer_norm=True`` (the
``wav2vec2-large-lv60`` family, the model of transformers issue 15754):

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

Outputs, in depth order: ``conv_features`` (the 7 convolution outputs) and
``hidden_states`` (N + 1 states: the input of each layer, then the final
normalized output, as HF's ``output_hidden_states=True`` returns them). Same
op types and, at :meth:`Wav2Vec2Config.base`, the same shapes as the published
model. Nothing is downloaded; weights are Flax's default initialisers from a
fixed seed.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np

from jaxprec._src.models.layers import EncoderSizes, FeedForward, SelfAttention

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
