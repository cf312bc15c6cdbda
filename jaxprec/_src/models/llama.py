"""A Llama/Qwen2-style decoder in Flax NNX, with the module tree of
transformers' PyTorch ``LlamaModel`` and ``LlamaForCausalLM``.

:class:`LlamaModel` computes what ``transformers``' ``modeling_llama.py``
computes: token embeddings, then N pre-norm decoder layers (RMSNorm ->
causal self-attention with rotary position embeddings and grouped key/value
heads -> residual; RMSNorm -> SwiGLU MLP -> residual) and a final RMSNorm.
:class:`LlamaForCausalLM` adds the language-model head, its own weights or
the embedding's (tied). Qwen2's models are the same with biases on the query,
key and value projections.

Attribute paths are PyTorch's module names (``layers/0/self_attn/q_proj`` is
``layers.0.self_attn.q_proj``), so ``from_pytorch`` loads a PyTorch model's
weights by name. The rotary angles are products of the positions and the
inverse frequencies, never a matmul: PyTorch computes them as a float32
matmul with one term, which is exact, and a JAX port that writes it as a dot
would round the positions to bfloat16 on a TPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprec._src.models import from_pytorch as loading
from jaxprec._src.models.encoders import Sized
from jaxprec._src.models.nnx_layers import attention


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(Sized):
  """Sizes of :class:`LlamaModel`, named as in transformers' ``LlamaConfig``
  where they mean the same.

  Attributes:
    head_dim: per head; None is ``hidden_size // num_heads``.
    num_kv_heads: key/value heads; fewer than ``num_heads`` is grouped-query
      attention (``num_heads`` must be a multiple).
    qkv_bias, o_bias, mlp_bias: biases on the query/key/value projections,
      the output projection, the MLP (Llama's ``attention_bias`` sets the
      first two; Qwen2 has ``qkv_bias`` alone).
    tie_word_embeddings: :class:`LlamaForCausalLM`'s head is the embedding.
  """

  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  tie_word_embeddings: bool = False
  SIZES: ClassVar[tuple[str, ...]] = ("tiny", "small")

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")

  @property
  def dim(self) -> int:
    """Per head."""
    return self.head_dim or self.hidden_size // self.num_heads

  @classmethod
  def tiny(cls) -> LlamaConfig:
    """2 layers, 64 wide, 4 query heads sharing 2 key/value heads."""
    return cls()

  @classmethod
  def small(cls) -> LlamaConfig:
    """4 layers, 256 wide, 8 query heads sharing 2 key/value heads."""
    return cls(vocab_size=1024, hidden_size=256, intermediate_size=704,
               num_layers=4, num_heads=8, num_kv_heads=2)


def rotary(positions: jax.Array, dim: int, theta: float
           ) -> tuple[jax.Array, jax.Array]:
  """``(cos, sin)``, each ``(batch, seq, dim)``, as transformers'
  ``LlamaRotaryEmbedding`` (default rope type) makes them: angles
  ``position * theta ** (-2i / dim)``, the half-dimension repeated."""
  inv_freq = jnp.asarray(1.0 / theta ** (np.arange(0, dim, 2) / dim),
                         jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # no matmul
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  half = x.shape[-1] // 2
  turned = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None] + turned * sin[:, :, None]


class _Attention(nnx.Module):
  def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs):
    self.heads, self.kv_heads, self.dim = c.num_heads, c.num_kv_heads, c.dim
    n = c.hidden_size
    self.q_proj = nnx.Linear(n, c.num_heads * c.dim, use_bias=c.qkv_bias,
                             rngs=rngs)
    self.k_proj = nnx.Linear(n, c.num_kv_heads * c.dim, use_bias=c.qkv_bias,
                             rngs=rngs)
    self.v_proj = nnx.Linear(n, c.num_kv_heads * c.dim, use_bias=c.qkv_bias,
                             rngs=rngs)
    self.o_proj = nnx.Linear(c.num_heads * c.dim, n, use_bias=c.o_bias,
                             rngs=rngs)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
               mask: jax.Array | None) -> jax.Array:
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.heads, self.dim)
    k = self.k_proj(x).reshape(b, t, self.kv_heads, self.dim)
    v = self.v_proj(x).reshape(b, t, self.kv_heads, self.dim)
    out = attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, mask,
                    causal=True)
    return self.o_proj(out)


class _MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs):
    n, m = c.hidden_size, c.intermediate_size
    self.gate_proj = nnx.Linear(n, m, use_bias=c.mlp_bias, rngs=rngs)
    self.up_proj = nnx.Linear(n, m, use_bias=c.mlp_bias, rngs=rngs)
    self.down_proj = nnx.Linear(m, n, use_bias=c.mlp_bias, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nnx.Module):
  def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs):
    self.self_attn = _Attention(c, rngs=rngs)
    self.mlp = _MLP(c, rngs=rngs)
    self.input_layernorm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps,
                                       rngs=rngs)
    self.post_attention_layernorm = nnx.RMSNorm(
        c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
               mask: jax.Array | None) -> jax.Array:
    x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
    return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
  """A Llama-style decoder (no language-model head) in Flax NNX.

  Called on token ids ``(batch, seq)`` (and optionally an
  ``attention_mask``, nonzero at tokens to attend to), it returns what
  transformers' ``LlamaModel(..., output_hidden_states=True)`` returns:
  ``{"hidden_states": (num_layers + 1 arrays: each layer's input, then the
  final RMSNorm's output), "last_hidden_state": ...}``.

  Args:
    config: the sizes (:class:`LlamaConfig`).
    rngs: the random initialisation.

  Examples:
    >>> from flax import nnx
    >>> from jaxprec.models import LlamaConfig, LlamaModel, synthetic_tokens
    >>> model = LlamaModel(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> out = model(synthetic_tokens(1, 8, vocab_size=256))
    >>> len(out["hidden_states"]), out["last_hidden_state"].shape
    (3, (1, 8, 64))
  """

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size,
                                  rngs=rngs)
    self.layers = loading.module_list(_DecoderLayer(config, rngs=rngs)
                                      for _ in range(config.num_layers))
    self.norm = nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps,
                            rngs=rngs)

  def __call__(self, input_ids: jax.Array,
               attention_mask: jax.Array | None = None) -> dict[str, Any]:
    ids = jnp.asarray(input_ids)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    cos, sin = rotary(positions, self.config.dim, self.config.rope_theta)
    mask = None if attention_mask is None else jnp.asarray(attention_mask)
    h = self.embed_tokens(ids)
    states = []
    for layer in self.layers:
      states.append(h)
      h = layer(h, cos, sin, mask)
    states.append(self.norm(h))
    return {"hidden_states": tuple(states), "last_hidden_state": states[-1]}

  @classmethod
  def from_pytorch(cls, pt_model: Any) -> LlamaModel:
    """The model with the weights of transformers' PyTorch ``LlamaModel``
    (or ``Qwen2Model``); sizes come from ``pt_model.config``, which is not
    changed.

    Raises:
      TypeError: ``pt_model`` is not a transformers PyTorch model.
      ValueError: it is another architecture, or its config asks for what
        this model does not compute (a rope scaling, sliding windows, another
        activation), or a parameter's name or shape does not fit (naming the
        first).
    """
    return loading.load(cls, config_from_pytorch(pt_model), pt_model)


class LlamaForCausalLM(nnx.Module):
  """:class:`LlamaModel` with the language-model head, as transformers'
  ``LlamaForCausalLM``: returns ``{"hidden_states": ..., "logits": (batch,
  seq, vocab)}``. With ``config.tie_word_embeddings`` the head is the
  embedding matrix (``model/embed_tokens``) and has no weights of its own.

  Args:
    config: the sizes (:class:`LlamaConfig`).
    rngs: the random initialisation.
  """

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.model = LlamaModel(config, rngs=rngs)
    self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
        config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, input_ids: jax.Array,
               attention_mask: jax.Array | None = None) -> dict[str, Any]:
    out = self.model(input_ids, attention_mask)
    h = out["last_hidden_state"]
    logits = (self.model.embed_tokens.attend(h) if self.lm_head is None
              else self.lm_head(h))
    return {"hidden_states": out["hidden_states"], "logits": logits}

  @classmethod
  def from_pytorch(cls, pt_model: Any) -> LlamaForCausalLM:
    """The model with the weights of transformers' PyTorch
    ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``), tied or not as its
    config says; raises as :meth:`LlamaModel.from_pytorch`."""
    return loading.load(cls, config_from_pytorch(pt_model), pt_model)


def config_from_pytorch(pt_model: Any) -> LlamaConfig:
  """The :class:`LlamaConfig` of a PyTorch Llama or Qwen2 model's config,
  refusing a variant the NNX models do not compute."""
  hf = loading.hf_config(pt_model, ("llama", "qwen2"), "LlamaModel")
  loading.require(hf, "LlamaModel", hidden_act="silu")
  rope = dict(getattr(hf, "rope_parameters", None)  # transformers 5
              or getattr(hf, "rope_scaling", None) or {})
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind != "default":
    raise ValueError(f"from_pytorch=: rope_type={kind!r} is not implemented "
                     f"by jaxprec's LlamaModel; it computes rope_type="
                     f"'default' (no rope scaling)")
  if getattr(hf, "partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"from_pytorch=: partial_rotary_factor="
                     f"{hf.partial_rotary_factor!r} is not implemented by "
                     f"jaxprec's LlamaModel; it rotates every dimension (1.0)")
  qwen = hf.model_type == "qwen2"
  if qwen:
    loading.require(hf, "LlamaModel", use_sliding_window=False)
  bias = bool(getattr(hf, "attention_bias", False))
  return LlamaConfig(
      vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
      intermediate_size=hf.intermediate_size,
      num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
      num_kv_heads=getattr(hf, "num_key_value_heads", None)
      or hf.num_attention_heads,
      head_dim=getattr(hf, "head_dim", None),
      rms_norm_eps=float(hf.rms_norm_eps),
      rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta",
                                                      10000.0))),
      qkv_bias=qwen or bias, o_bias=bias and not qwen,
      mlp_bias=bool(getattr(hf, "mlp_bias", False)),
      tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)))
