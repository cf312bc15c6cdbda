"""The built-in models as ``(fn, args)``: randomly initialised, or with the
weights of their PyTorch originals (``from_pytorch=``).

Random models are the flax.linen encoders (:mod:`jaxprec._src.models.wav2vec2`,
:mod:`~jaxprec._src.models.bert`); ``from_pytorch=`` builds the NNX models
(:mod:`~jaxprec._src.models.nnx_wav2vec2`, :mod:`~jaxprec._src.models.nnx_bert`)
from a transformers PyTorch model and returns them as ``fn(state, *inputs)``,
whose outputs are named as the PyTorch model's
``output_hidden_states=True`` outputs, so that
``check(fn, *args, reference=jaxprec.torch.capture(pt_model, ...))`` lines up
layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from jaxprec._src.models import bert as bert_linen
from jaxprec._src.models import from_pytorch as loading
from jaxprec._src.models import wav2vec2 as wav2vec2_linen
from jaxprec._src.models.nnx_bert import BertModel
from jaxprec._src.models.nnx_wav2vec2 import Wav2Vec2Model


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
  if from_pytorch is None:
    return wav2vec2_linen.wav2vec2(size or "tiny", seed, batch=batch,
                                   seconds=seconds)
  loading.no_size("wav2vec2", size)
  model = Wav2Vec2Model.from_pytorch(from_pytorch)
  fn, state = loading.split_fn(model, f"{type(from_pytorch).__name__}_port")
  audio = wav2vec2_linen.synthetic_audio(batch, seconds, seed=seed)
  return fn, (state, jnp.asarray(audio))


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
  if from_pytorch is None:
    return bert_linen.bert(size or "tiny", seed, batch=batch, seq_len=seq_len)
  loading.no_size("bert", size)
  model = BertModel.from_pytorch(from_pytorch)
  fn, state = loading.split_fn(model, f"{type(from_pytorch).__name__}_port")
  ids = bert_linen.synthetic_tokens(batch, seq_len,
                                    vocab_size=model.config.vocab_size,
                                    seed=seed)
  return fn, (state, jnp.asarray(ids))
