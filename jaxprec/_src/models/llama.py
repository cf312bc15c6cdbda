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
  # In the dtype of x, as transformers' LlamaRotaryEmbedding returns them
  # (``cos.to(dtype=x.dtype)``): a bfloat16 model rotates in bfloat16.
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  half = x.shape[-1] // 2
  turned = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None] + turned * sin[:, :, None]


# A key/value cache: one ``(keys, values)`` pair per layer, each ``(batch,
# length, kv_heads, head_dim)``, the keys rotated (transformers' cache
# holds them so). A pytree of arrays: it passes through jax.jit and
# jaxprec.emulate as an argument.
Cache = tuple[tuple[jax.Array, jax.Array], ...]


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
               mask: jax.Array | None, kv: Any = None, slot: Any = 0) -> Any:
    """The output; with ``kv`` (this layer's cache), ``(output, kv)``: the
    keys and values written at cache slots ``slot, slot + 1, ...``, the
    queries attending to every slot up to their own."""
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.heads, self.dim)
    k = self.k_proj(x).reshape(b, t, self.kv_heads, self.dim)
    v = self.v_proj(x).reshape(b, t, self.kv_heads, self.dim)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if kv is None:
      return self.o_proj(attention(q, k, v, mask, causal=True))
    # Stored as the cache's dtype and read back as computed: a float32 cache
    # holds bfloat16 keys exactly.
    kv = tuple(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype),
                                                   slot, axis=1)
               for c, new in zip(kv, (k, v)))
    out = attention(q, kv[0].astype(k.dtype), kv[1].astype(v.dtype), mask,
                    causal=True, first=slot)
    return self.o_proj(out), kv


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
               mask: jax.Array | None, kv: Any = None, slot: Any = 0) -> Any:
    """The output; with ``kv``, ``(output, kv)`` (:class:`_Attention`)."""
    a = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, slot)
    if kv is not None:
      a, kv = a
    x = x + a
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x if kv is None else (x, kv)


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
               attention_mask: jax.Array | None = None,
               position_ids: jax.Array | None = None) -> dict[str, Any]:
    """Teacher forcing over whole sequences; ``position_ids`` ``(batch,
    seq)`` are the rotary positions (None: ``0, 1, ...``; a left-padded
    batch gives each row its own, as transformers' ``generate`` does)."""
    return self._run(input_ids, attention_mask, position_ids, None, 0)

  def decode(self, input_ids: jax.Array, cache: Cache, position: Any,
             attention_mask: jax.Array | None = None,
             position_ids: jax.Array | None = None) -> dict[str, Any]:
    """One decoding step (or a chunk) with a key/value cache.

    Args:
      input_ids: the new tokens ``(batch, t)``.
      cache: :meth:`init_cache`'s, or the previous step's ``"cache"``.
      position: the cache slot of the first new token (an int or a scalar
        array: one compiled step serves every position).
      attention_mask: ``(batch, cache length)``, nonzero at slots to attend
        to (padding is zero); slots after a query's own are never attended.
      position_ids: rotary positions ``(batch, t)``; None: the slots.

    Returns:
      ``__call__``'s dict for the new tokens, and ``"cache"``, the cache
      with their keys and values written.
    """
    return self._run(input_ids, attention_mask, position_ids, cache, position)

  def init_cache(self, batch: int, length: int,
                 dtype: Any = jnp.float32) -> Cache:
    """An empty cache (zeros) for ``batch`` sequences of up to ``length``
    tokens. A float32 cache holds keys computed in bfloat16 exactly, and
    :meth:`decode` reads them back in the dtype they were computed in."""
    c = self.config
    shape = (batch, length, c.num_kv_heads, c.dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(c.num_layers))

  def _run(self, input_ids, attention_mask, position_ids, cache, slot):
    ids = jnp.asarray(input_ids)
    positions = (jnp.asarray(slot) + jnp.arange(ids.shape[1])
                 if position_ids is None else jnp.asarray(position_ids))
    positions = jnp.broadcast_to(positions, ids.shape)
    cos, sin = rotary(positions, self.config.dim, self.config.rope_theta)
    mask = None if attention_mask is None else jnp.asarray(attention_mask)
    h = self.embed_tokens(ids)
    states, written = [], []
    for i, layer in enumerate(self.layers):
      states.append(h)
      if cache is None:
        h = layer(h, cos, sin, mask)
      else:
        h, kv = layer(h, cos, sin, mask, tuple(cache[i]), slot)
        written.append(kv)
    states.append(self.norm(h))
    out = {"hidden_states": tuple(states), "last_hidden_state": states[-1]}
    if cache is not None:
      out["cache"] = tuple(written)
    return out

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
               attention_mask: jax.Array | None = None,
               position_ids: jax.Array | None = None) -> dict[str, Any]:
    out = self.model(input_ids, attention_mask, position_ids)
    return {"hidden_states": out["hidden_states"],
            "logits": self.head(out["last_hidden_state"])}

  def decode(self, input_ids: jax.Array, cache: Cache, position: Any,
             attention_mask: jax.Array | None = None,
             position_ids: jax.Array | None = None) -> dict[str, Any]:
    """One decoding step (or a chunk) with a key/value cache: ``{"logits":
    ..., "hidden_states": ..., "cache": ...}`` for the new tokens, as
    :meth:`LlamaModel.decode`. At float32 a token-by-token decode computes
    the logits of teacher forcing (``__call__``) to float32 rounding.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxprec.models import LlamaConfig, LlamaForCausalLM
      >>> model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> ids = jnp.array([[5, 9, 2]])
      >>> cache = model.init_cache(1, 3)
      >>> steps = []
      >>> for t in range(3):
      ...   out = model.decode(ids[:, t:t + 1], cache, t)
      ...   cache = out["cache"]
      ...   steps.append(out["logits"])
      >>> full = model(ids)["logits"]
      >>> bool(jnp.abs(jnp.concatenate(steps, 1) - full).max() < 1e-5)
      True
    """
    out = self.model.decode(input_ids, cache, position, attention_mask,
                            position_ids)
    return {"hidden_states": out["hidden_states"],
            "logits": self.head(out["last_hidden_state"]),
            "cache": out["cache"]}

  def init_cache(self, batch: int, length: int,
                 dtype: Any = jnp.float32) -> Cache:
    """:meth:`LlamaModel.init_cache`."""
    return self.model.init_cache(batch, length, dtype)

  def head(self, hidden: jax.Array) -> jax.Array:
    """The logits of the final hidden states: the language-model head, or
    the embedding's transpose when tied."""
    return (self.model.embed_tokens.attend(hidden) if self.lm_head is None
            else self.lm_head(hidden))

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
