"""The built-in models as ``(fn, args)``: randomly initialised, or the NNX
models with the weights of their PyTorch originals (``from_pytorch=``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprec._src.models import from_pytorch as loading
from jaxprec._src.models.encoders import (BertConfig, BertEncoder,
                                          Wav2Vec2Config, Wav2Vec2Encoder,
                                          synthetic_audio, synthetic_tokens)
from jaxprec._src.models.llama import LlamaConfig, LlamaForCausalLM, LlamaModel
from jaxprec._src.models.nnx_bert import BertModel
from jaxprec._src.models.nnx_wav2vec2 import Wav2Vec2Model


def _inputs(name: str, config: Any, seed: int, batch: int,
            length: float) -> jax.Array:
  """Model ``name``'s synthetic inputs: ``batch`` audio clips of ``length``
  seconds, or token batches ``(batch, length)``."""
  if name == "wav2vec2":
    return jnp.asarray(synthetic_audio(batch, length, seed=seed))
  return jnp.asarray(synthetic_tokens(batch, length, seed=seed,
                                      vocab_size=config.vocab_size))


_CONFIGS = {"bert": BertConfig, "llama": LlamaConfig, "wav2vec2": Wav2Vec2Config}


@functools.lru_cache(maxsize=24)
def _random(name: str, size: str, seed: int, batch: int, length: float
            ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """The model ``name`` at ``size``, randomly initialised from ``seed``;
  cached, so that repeated checks reuse compiled programs."""
  config = _CONFIGS[name].of_size(size)
  if name == "llama":
    fn, state = loading.split_fn(LlamaModel(config, rngs=nnx.Rngs(seed)),
                                 f"llama_{size}")
    return fn, (state, _inputs(name, config, seed, batch, length))
  model = (BertEncoder if name == "bert" else Wav2Vec2Encoder)(config)
  inputs = _inputs(name, config, seed, batch, length)
  variables = jax.jit(model.init)(jax.random.key(seed), inputs)

  def fn(variables, inputs):
    return model.apply(variables, inputs)
  fn.__name__ = fn.__qualname__ = f"{name}_{size}"
  return fn, (variables, inputs)


def _build(name: str, size: str | None, seed: int, batch: int, length: float,
           from_pytorch: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """``name(...)``'s ``(fn, args)``: :func:`_random`, or the NNX model with
  ``from_pytorch``'s weights."""
  if from_pytorch is None:
    return _random(name, size or "tiny", seed, batch, length)
  loading.no_size(name, size)
  if name == "llama":
    causal = hasattr(from_pytorch, "lm_head")
    cls = LlamaForCausalLM if causal else LlamaModel
  else:
    cls = BertModel if name == "bert" else Wav2Vec2Model
  model = cls.from_pytorch(from_pytorch)
  fn, state = loading.split_fn(model, f"{type(from_pytorch).__name__}_port")
  return fn, (state, _inputs(name, model.config, seed, batch, length))


def wav2vec2(size: str | None = None, seed: int = 0, *, batch: int = 1,
             seconds: float = 1.0, from_pytorch: Any = None
             ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A ready-to-check Wav2Vec2 encoder: ``(fn, args)``.

  Without ``from_pytorch``: the flax.linen :class:`Wav2Vec2Encoder` at
  ``size``, randomly initialised from ``seed``; ``fn(variables, audio)``
  returns ``{"conv_features", "hidden_states"}``. The same call returns the
  same objects (cached), so repeated checks reuse compiled programs.

  With ``from_pytorch``, a transformers PyTorch ``Wav2Vec2Model`` with the
  stable-layer-norm config (``do_stable_layer_norm=True,
  feat_extract_norm="layer"``): the NNX :class:`Wav2Vec2Model` with its
  sizes and weights; ``fn(state, audio)`` returns what the PyTorch model
  returns with ``output_hidden_states=True`` (``extract_features``,
  ``hidden_states[i]``, ``last_hidden_state``).

  Args:
    size: ``'tiny'`` (default), ``'small'`` or ``'base'``
      (:class:`Wav2Vec2Config`); left unset with ``from_pytorch``.
    seed: seeds the weights (random models) and the audio.
    batch: number of audio clips.
    seconds: clip length at 16 kHz.
    from_pytorch: the PyTorch model whose weights to load; not changed.

  Returns:
    ``(fn, (variables or state, audio))``.

  Raises:
    ValueError: an unknown size, or ``size`` with ``from_pytorch``, or a
      PyTorch model that does not fit (naming the first parameter whose name
      or shape differs, or the config field jaxprec does not implement).

  Examples:
    >>> import jax, jaxprec.models
    >>> fn, args = jaxprec.models.wav2vec2("tiny")
    >>> out = jax.jit(fn)(*args)
    >>> len(out["conv_features"]), len(out["hidden_states"]), out["hidden_states"][-1].shape
    (7, 3, (1, 49, 64))
  """
  return _build("wav2vec2", size, seed, batch, seconds, from_pytorch)


def bert(size: str | None = None, seed: int = 0, *, batch: int = 1,
         seq_len: int = 32, from_pytorch: Any = None
         ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A ready-to-check BERT encoder: ``(fn, (variables or state, input_ids))``.

  Without ``from_pytorch``: the flax.linen :class:`BertEncoder` at ``size``,
  randomly initialised from ``seed`` and cached like :func:`wav2vec2`. With
  ``from_pytorch``, a transformers PyTorch ``BertModel``: the NNX
  :class:`BertModel` with its sizes and weights; ``fn(state, input_ids)``
  returns what the PyTorch model returns with ``output_hidden_states=True``
  (``hidden_states[i]``, ``last_hidden_state``, ``pooler_output``).

  Args:
    size: ``'tiny'`` (default), ``'small'`` or ``'base'``
      (:class:`BertConfig`); left unset with ``from_pytorch``.
    seed: seeds the weights (random models) and the tokens.
    batch, seq_len: the token batch's shape.
    from_pytorch: the PyTorch model whose weights to load; not changed.

  Returns:
    ``(fn, (variables or state, input_ids))``.

  Raises:
    ValueError: as :func:`wav2vec2`.
  """
  return _build("bert", size, seed, batch, seq_len, from_pytorch)


def llama(size: str | None = None, seed: int = 0, *, batch: int = 1,
          seq_len: int = 16, from_pytorch: Any = None
          ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A ready-to-check Llama-style decoder: ``(fn, (state, input_ids))``.

  ``fn(state, input_ids)`` runs the NNX model whose state it is
  (:class:`LlamaModel`, randomly initialised from ``seed``, or
  ``from_pytorch``'s weights) and returns its hidden states. Random models
  are cached, so repeated checks reuse compiled programs.

  Args:
    size: ``'tiny'`` (default) or ``'small'`` (:class:`LlamaConfig`); left
      unset with ``from_pytorch``, whose config gives the sizes.
    seed: seeds the weights and the tokens.
    batch, seq_len: the token batch's shape.
    from_pytorch: a transformers PyTorch ``LlamaModel`` or
      ``LlamaForCausalLM`` (or Qwen2's) whose weights to load
      (:meth:`LlamaModel.from_pytorch`); it is not changed.

  Returns:
    ``(fn, (state, input_ids))``.

  Examples:
    >>> import jax, jaxprec.models
    >>> fn, args = jaxprec.models.llama("tiny")
    >>> jax.jit(fn)(*args)["last_hidden_state"].shape
    (1, 16, 64)
  """
  return _build("llama", size, seed, batch, seq_len, from_pytorch)


# The built-in models by the names ``jaxprec check --model`` takes.
MODELS = {"bert": bert, "llama": llama, "wav2vec2": wav2vec2}


def check_size(name: str, size: str | None) -> None:
  """Raises the ``ValueError`` that building model ``name`` at ``size``
  (None: ``'tiny'``) would raise for a size it does not come in, without
  building it."""
  _CONFIGS[name].of_size(size or "tiny")
