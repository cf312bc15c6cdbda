"""BERT in Flax NNX, with the module tree of transformers' PyTorch
``BertModel``.

:class:`BertModel` computes what ``transformers``' ``modeling_bert.py``
computes in eval mode (absolute position embeddings, post-LN layers, GELU,
the tanh pooler). Attribute paths are PyTorch's module names
(``encoder/layer/0/attention/self/query`` is
``encoder.layer.0.attention.self.query``), so :meth:`BertModel.from_pytorch`
loads a PyTorch model's weights by name.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprec._src.models import from_pytorch as loading
from jaxprec._src.models.encoders import BertConfig
from jaxprec._src.models.nnx_layers import attention, gelu, layer_norm


class _Embeddings(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    self.word_embeddings = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
    self.position_embeddings = nnx.Embed(c.max_positions, c.hidden_size,
                                         rngs=rngs)
    self.token_type_embeddings = nnx.Embed(c.type_vocab_size, c.hidden_size,
                                           rngs=rngs)
    self.LayerNorm = layer_norm(c.hidden_size, c.layer_norm_eps, rngs)  # noqa: N815

  def __call__(self, ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
    positions = jnp.arange(ids.shape[1])[None, :]
    return self.LayerNorm(self.word_embeddings(ids)
                          + self.token_type_embeddings(token_type_ids)
                          + self.position_embeddings(positions))


class _SelfAttention(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    self.heads = c.num_heads
    self.query = nnx.Linear(c.hidden_size, c.hidden_size, rngs=rngs)
    self.key = nnx.Linear(c.hidden_size, c.hidden_size, rngs=rngs)
    self.value = nnx.Linear(c.hidden_size, c.hidden_size, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    b, t, n = x.shape
    q, k, v = (p(x).reshape(b, t, self.heads, n // self.heads)
               for p in (self.query, self.key, self.value))
    return attention(q, k, v, mask)


class _Output(nnx.Module):
  """Dense, then layer normalization of the sum with the residual."""

  def __init__(self, cin: int, c: BertConfig, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(cin, c.hidden_size, rngs=rngs)
    self.LayerNorm = layer_norm(c.hidden_size, c.layer_norm_eps, rngs)  # noqa: N815

  def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
    return self.LayerNorm(self.dense(x) + residual)


class _Attention(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    # transformers names it `self`: attention.self.query.
    setattr(self, "self", _SelfAttention(c, rngs=rngs))
    self.output = _Output(c.hidden_size, c, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    return self.output(getattr(self, "self")(x, mask), x)


class _Intermediate(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(c.hidden_size, c.intermediate_size, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return gelu(self.dense(x))


class _Layer(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    self.attention = _Attention(c, rngs=rngs)
    self.intermediate = _Intermediate(c, rngs=rngs)
    self.output = _Output(c.intermediate_size, c, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = self.attention(x, mask)
    return self.output(self.intermediate(x), x)


class _Encoder(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    self.layer = loading.module_list(_Layer(c, rngs=rngs)
                                     for _ in range(c.num_layers))

  def __call__(self, h: jax.Array, mask: jax.Array) -> tuple[jax.Array, ...]:
    states = [h]
    for layer in self.layer:
      h = layer(h, mask)
      states.append(h)
    return tuple(states)


class _Pooler(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(c.hidden_size, c.hidden_size, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return jnp.tanh(self.dense(h[:, 0]))


class BertModel(nnx.Module):
  """A BERT encoder in Flax NNX.

  Called on token ids ``(batch, seq)`` (and optionally ``attention_mask``,
  ``token_type_ids``), it returns, in the order they are computed, what
  transformers' ``BertModel(..., output_hidden_states=True)`` returns:
  ``{"hidden_states": (num_layers + 1 arrays: the embeddings' output, then
  each layer's), "last_hidden_state": ..., "pooler_output": (batch,
  hidden)}`` (no ``pooler_output`` with ``add_pooling_layer=False``).

  Args:
    config: the sizes (:class:`jaxprec.models.BertConfig`).
    add_pooling_layer: whether to add the pooler, as transformers' argument.
    rngs: the random initialisation.

  Examples:
    >>> from flax import nnx
    >>> from jaxprec.models import BertConfig, BertModel, synthetic_tokens
    >>> model = BertModel(BertConfig.tiny(), rngs=nnx.Rngs(0))
    >>> out = model(synthetic_tokens(1, 8))
    >>> list(out), out["last_hidden_state"].shape
    (['hidden_states', 'last_hidden_state', 'pooler_output'], (1, 8, 64))
  """

  def __init__(self, config: BertConfig, *, add_pooling_layer: bool = True,
               rngs: nnx.Rngs):
    self.config = config
    self.embeddings = _Embeddings(config, rngs=rngs)
    self.encoder = _Encoder(config, rngs=rngs)
    self.pooler = _Pooler(config, rngs=rngs) if add_pooling_layer else None

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               token_type_ids: jax.Array | None = None) -> dict[str, Any]:
    ids = jnp.asarray(input_ids)
    mask = jnp.ones_like(ids) if attention_mask is None else jnp.asarray(
        attention_mask)
    types = jnp.zeros_like(ids) if token_type_ids is None else jnp.asarray(
        token_type_ids)
    states = self.encoder(self.embeddings(ids, types), mask)
    out: dict[str, Any] = {"hidden_states": states,
                           "last_hidden_state": states[-1]}
    if self.pooler is not None:
      out["pooler_output"] = self.pooler(states[-1])
    return out

  @classmethod
  def from_pytorch(cls, pt_model: Any) -> BertModel:
    """The model with the weights of transformers' PyTorch ``BertModel``.

    Sizes come from ``pt_model.config`` (and the pooler from whether
    ``pt_model`` has one); ``pt_model`` is not changed.

    Raises:
      TypeError: ``pt_model`` is not a transformers PyTorch model.
      ValueError: it is another architecture, or its config asks for what
        this model does not compute (relative positions, another
        activation), or a parameter's name or shape does not fit (naming the
        first).
    """
    pool = getattr(pt_model, "pooler", None) is not None
    return loading.load(cls, config_from_pytorch(pt_model), pt_model,
                        add_pooling_layer=pool)


def config_from_pytorch(pt_model: Any) -> BertConfig:
  """The :class:`BertConfig` of a PyTorch ``BertModel``'s config, refusing a
  variant :class:`BertModel` does not compute."""
  hf = loading.hf_config(pt_model, ("bert",), "BertModel")
  loading.require(hf, "BertModel", hidden_act="gelu",
                  position_embedding_type=("absolute", None),
                  is_decoder=False)
  return BertConfig(
      vocab_size=hf.vocab_size, max_positions=hf.max_position_embeddings,
      type_vocab_size=hf.type_vocab_size, hidden_size=hf.hidden_size,
      num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
      intermediate_size=hf.intermediate_size,
      layer_norm_eps=float(hf.layer_norm_eps))
