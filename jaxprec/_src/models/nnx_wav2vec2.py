"""Wav2Vec2 in Flax NNX, with the module tree of transformers' PyTorch
``Wav2Vec2Model`` in its stable-layer-norm variant.

:class:`Wav2Vec2Model` computes what ``transformers``'
``modeling_wav2vec2.py`` computes in eval mode: the architecture of
:class:`jaxprec.models.Wav2Vec2Encoder`, the positional convolution taking
the weight its weight normalisation computes. Attribute paths are PyTorch's
module names (``encoder/layers/0/attention/q_proj`` is
``encoder.layers.0.attention.q_proj``), so :meth:`Wav2Vec2Model.from_pytorch`
loads a PyTorch model's weights by name, and ``check_module`` lines its
layers up with ``jaxprec.torch.capture(pt_model, modules=...)``.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprec._src.models import from_pytorch as loading
from jaxprec._src.models.nnx_layers import attention, gelu, layer_norm
from jaxprec._src.models.encoders import Wav2Vec2Config

# transformers builds each feature-encoder layer norm as torch.nn.LayerNorm
# with its default epsilon, whatever config.layer_norm_eps says.
_CONV_NORM_EPS = 1e-5


class _ConvLayer(nnx.Module):
  def __init__(self, cin: int, cout: int, kernel: int, stride: int, bias: bool,
               *, rngs: nnx.Rngs):
    self.conv = nnx.Conv(cin, cout, (kernel,), strides=(stride,),
                         padding="VALID", use_bias=bias, rngs=rngs)
    self.layer_norm = layer_norm(cout, _CONV_NORM_EPS, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return gelu(self.layer_norm(self.conv(x)))


class _FeatureEncoder(nnx.Module):
  def __init__(self, c: Wav2Vec2Config, *, rngs: nnx.Rngs):
    dims = (1, *c.conv_dim)
    self.conv_layers = loading.module_list(
        _ConvLayer(dims[i], dims[i + 1], k, s, c.conv_bias, rngs=rngs)
        for i, (k, s) in enumerate(zip(c.conv_kernel, c.conv_stride)))

  def __call__(self, audio: jax.Array) -> jax.Array:
    x = audio[..., None]
    for layer in self.conv_layers:
      x = layer(x)
    return x


class _FeatureProjection(nnx.Module):
  def __init__(self, c: Wav2Vec2Config, *, rngs: nnx.Rngs):
    self.layer_norm = layer_norm(c.conv_dim[-1], c.layer_norm_eps, rngs)
    self.projection = nnx.Linear(c.conv_dim[-1], c.hidden_size, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    norm = self.layer_norm(x)
    return self.projection(norm), norm


class _PositionalConvEmbedding(nnx.Module):
  def __init__(self, c: Wav2Vec2Config, *, rngs: nnx.Rngs):
    k = c.pos_conv_kernel
    self.conv = nnx.Conv(c.hidden_size, c.hidden_size, (k,),
                         padding=((k // 2, k // 2),),
                         feature_group_count=c.pos_conv_groups, rngs=rngs)
    self.drop_last = k % 2 == 0  # transformers' Wav2Vec2SamePadLayer

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.conv(x)
    return gelu(y[:, :-1] if self.drop_last else y)


class _Attention(nnx.Module):
  def __init__(self, hidden: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.q_proj = nnx.Linear(hidden, hidden, rngs=rngs)
    self.k_proj = nnx.Linear(hidden, hidden, rngs=rngs)
    self.v_proj = nnx.Linear(hidden, hidden, rngs=rngs)
    self.out_proj = nnx.Linear(hidden, hidden, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, n = x.shape
    q, k, v = (p(x).reshape(b, t, self.heads, n // self.heads)
               for p in (self.q_proj, self.k_proj, self.v_proj))
    return self.out_proj(attention(q, k, v))


class _FeedForward(nnx.Module):
  def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs):
    self.intermediate_dense = nnx.Linear(hidden, intermediate, rngs=rngs)
    self.output_dense = nnx.Linear(intermediate, hidden, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.output_dense(gelu(self.intermediate_dense(x)))


class _EncoderLayer(nnx.Module):
  def __init__(self, c: Wav2Vec2Config, *, rngs: nnx.Rngs):
    self.attention = _Attention(c.hidden_size, c.num_heads, rngs=rngs)
    self.layer_norm = layer_norm(c.hidden_size, c.layer_norm_eps, rngs)
    self.feed_forward = _FeedForward(c.hidden_size, c.intermediate_size,
                                     rngs=rngs)
    self.final_layer_norm = layer_norm(c.hidden_size, c.layer_norm_eps, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.layer_norm(x))
    return x + self.feed_forward(self.final_layer_norm(x))


class _Encoder(nnx.Module):
  def __init__(self, c: Wav2Vec2Config, norm_last_state: bool, *,
               rngs: nnx.Rngs):
    self.norm_last_state = norm_last_state
    self.pos_conv_embed = _PositionalConvEmbedding(c, rngs=rngs)
    self.layer_norm = layer_norm(c.hidden_size, c.layer_norm_eps, rngs)
    self.layers = loading.module_list(_EncoderLayer(c, rngs=rngs)
                                      for _ in range(c.num_layers))

  def __call__(self, h: jax.Array) -> tuple[jax.Array, ...]:
    h = h + self.pos_conv_embed(h)
    states = []
    for layer in self.layers:
      states.append(h)
      h = layer(h)
    last = self.layer_norm(h)
    states.append(last if self.norm_last_state else h)
    return tuple(states), last


class Wav2Vec2Model(nnx.Module):
  """A Wav2Vec2 encoder (stable layer norm) in Flax NNX.

  Called on raw audio ``(batch, samples)``, it returns, in the order they
  are computed, what transformers' ``Wav2Vec2Model(...,
  output_hidden_states=True)`` returns: ``{"extract_features": (batch, frames,
  conv_dim[-1]), "hidden_states": (num_layers + 1 arrays (batch, frames,
  hidden)), "last_hidden_state": ...}``: ``hidden_states[i]`` is layer
  ``i``'s input, and the last one the final layer normalization's output
  (transformers 4) or the last layer's output before it (transformers 5,
  ``norm_last_state=False``).

  Args:
    config: the sizes (:class:`jaxprec.models.Wav2Vec2Config`).
    norm_last_state: whether ``hidden_states[-1]`` is the normalized
      ``last_hidden_state`` (default) or the last layer's output.
    rngs: the random initialisation.

  Examples:
    >>> from flax import nnx
    >>> from jaxprec.models import Wav2Vec2Config, Wav2Vec2Model, synthetic_audio
    >>> model = Wav2Vec2Model(Wav2Vec2Config.tiny(), rngs=nnx.Rngs(0))
    >>> out = model(synthetic_audio(1, 0.1))
    >>> len(out["hidden_states"]), out["last_hidden_state"].shape
    (3, (1, 4, 64))
  """

  def __init__(self, config: Wav2Vec2Config, *, norm_last_state: bool = True,
               rngs: nnx.Rngs):
    self.config = config
    self.feature_extractor = _FeatureEncoder(config, rngs=rngs)
    self.feature_projection = _FeatureProjection(config, rngs=rngs)
    self.encoder = _Encoder(config, norm_last_state, rngs=rngs)

  def __call__(self, input_values: jax.Array) -> dict[str, Any]:
    features = self.feature_extractor(jnp.asarray(input_values))
    h, extract_features = self.feature_projection(features)
    states, last = self.encoder(h)
    return {"extract_features": extract_features, "hidden_states": states,
            "last_hidden_state": last}

  @classmethod
  def from_pytorch(cls, pt_model: Any) -> Wav2Vec2Model:
    """The model with the weights of transformers' PyTorch ``Wav2Vec2Model``.

    Sizes come from ``pt_model.config``; ``pt_model`` is not changed.
    ``hidden_states[-1]`` follows the PyTorch model's own convention: its
    config's ``tie_last_hidden_states`` where set, else the normalized state
    under transformers 4 and the last layer's output under transformers 5
    (whose ``Wav2Vec2Model`` says ``capture_outputs(
    tie_last_hidden_states=False)``).

    Raises:
      TypeError: ``pt_model`` is not a transformers PyTorch model.
      ValueError: it is another architecture, or its config asks for what
        this model does not compute (``do_stable_layer_norm=False``, another
        activation, an adapter), or a parameter's name or shape does not fit
        (naming the first).
    """
    config = config_from_pytorch(pt_model)
    tie = getattr(pt_model.config, "tie_last_hidden_states", None)
    if tie is None:
      version = getattr(sys.modules.get("transformers"), "__version__", "0")
      major = str(version).split(".")[0]
      tie = not major.isdigit() or int(major) < 5
    return loading.load(cls, config, pt_model, norm_last_state=bool(tie),
                        unused=("masked_spec_embed",))


def config_from_pytorch(pt_model: Any) -> Wav2Vec2Config:
  """The :class:`Wav2Vec2Config` of a PyTorch ``Wav2Vec2Model``'s config,
  refusing a variant :class:`Wav2Vec2Model` does not compute."""
  hf = loading.hf_config(pt_model, ("wav2vec2",), "Wav2Vec2Model")
  loading.require(hf, "Wav2Vec2Model", do_stable_layer_norm=True,
                  feat_extract_norm="layer", feat_extract_activation="gelu",
                  hidden_act="gelu", add_adapter=False)
  return Wav2Vec2Config(
      conv_dim=tuple(hf.conv_dim), conv_kernel=tuple(hf.conv_kernel),
      conv_stride=tuple(hf.conv_stride), conv_bias=bool(hf.conv_bias),
      hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
      num_heads=hf.num_attention_heads, intermediate_size=hf.intermediate_size,
      pos_conv_kernel=hf.num_conv_pos_embeddings,
      pos_conv_groups=hf.num_conv_pos_embedding_groups,
      layer_norm_eps=float(hf.layer_norm_eps))
