"""PyTorch originals paired with a JAX model holding the same weights.

:func:`port` pairs a tiny random transformers PyTorch model with jaxprec's
own NNX model (``jaxprec.models.*.from_pytorch``); ``jaxprec check --model
hf-llama --reference pytorch`` (and ``hf-wav2vec2``, ``hf-bert``) checks the
port against the original, with the PyTorch classes transformers 4 and 5 both
have. :func:`twin` pairs it with its Hugging Face Flax model instead
(:func:`jaxprec._src.torch.torch_ref.flax_params`; transformers 4:
transformers 5 has no Flax models). Both seed the PyTorch weights, leaving
PyTorch's global RNG as it was, and make synthetic inputs; nothing is
downloaded. Imports transformers, PyTorch and Flax when a pair is built,
never at import.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxprec._src.core import names
from jaxprec._src.core.version import install_hint, torch_hint
from jaxprec._src.torch import torch_ref


@dataclasses.dataclass(frozen=True)
class Twin:
  """A Hugging Face model in PyTorch and in Flax, with the same weights.

  Attributes:
    name: e.g. ``'hf-wav2vec2'``.
    torch_model: the PyTorch model (e.g. ``transformers.Wav2Vec2Model``).
    flax_model: its Flax counterpart (e.g. ``FlaxWav2Vec2Model``), built
      without weights of its own (``_do_init=False``): call it with
      ``params=``.
    params: the Flax parameters, converted from ``torch_model``.
    inputs: the inputs by argument name, as NumPy arrays, in call order.
  """

  name: str
  torch_model: Any
  flax_model: Any
  params: Any
  inputs: dict[str, np.ndarray]

  def reference(self, **kwargs: Any) -> dict[str, np.ndarray]:
    """The PyTorch model's hidden states (:func:`jaxprec.torch.capture`)."""
    return torch_ref.capture(self.torch_model, **self.inputs,
                             output_hidden_states=True, **kwargs)

  def fn(self, params: Any, *inputs: Any) -> Any:
    """The Flax model's hidden states, ``fn(params, *inputs.values())``.

    In depth order (:func:`depth_ordered`), so that a report's first
    divergence is the first layer that diverges, not ``last_hidden_state``.
    """
    return depth_ordered(
        self.flax_model(*inputs, params=params, output_hidden_states=True))

  def args(self) -> tuple:
    """``(params, *inputs)``, the arguments of :meth:`fn`."""
    return (self.params, *self.inputs.values())


# Hugging Face ModelOutput fields in the order the model computes them; a
# ModelOutput lists last_hidden_state first.
_DEPTH = ("extract_features", "hidden_states", "last_hidden_state",
          "pooler_output")


def depth_ordered(output: Any) -> dict[str, Any]:
  """A Hugging Face ``ModelOutput``'s fields as a dict in depth order.

  ``extract_features``, ``hidden_states`` (one layer per entry, embeddings
  first), ``last_hidden_state``, ``pooler_output``, then any other non-None
  field in its own order. Layer names are unchanged (``hidden_states[3]``).

  Examples:
    >>> from jaxprec._src.torch.torch_ports import depth_ordered
    >>> list(depth_ordered({"last_hidden_state": 1, "hidden_states": (0,),
    ...                     "attentions": None}))
    ['hidden_states', 'last_hidden_state']
  """
  fields = {k: v for k, v in dict(output).items() if v is not None}
  first = [k for k in _DEPTH if k in fields]
  return {k: fields[k] for k in first + [k for k in fields if k not in first]}


@dataclasses.dataclass(frozen=True)
class Port:
  """A transformers PyTorch model and jaxprec's NNX model with its weights.

  Attributes:
    name: e.g. ``'hf-llama'``.
    torch_model: the PyTorch model (e.g. ``transformers.LlamaModel``).
    model: the NNX model (e.g. :class:`jaxprec.models.LlamaModel`).
    inputs: the inputs by argument name, as NumPy arrays, in call order.
  """

  name: str
  torch_model: Any
  model: Any
  inputs: dict[str, np.ndarray]

  def reference(self, **kwargs: Any) -> dict[str, np.ndarray]:
    """The PyTorch model's hidden states (:func:`jaxprec.torch.capture`)."""
    # Token ids as int64, as PyTorch's embedding layers take them.
    inputs = {k: v.astype(np.int64) if np.issubdtype(v.dtype, np.integer)
              else v for k, v in self.inputs.items()}
    return torch_ref.capture(self.torch_model, **inputs,
                             output_hidden_states=True, **kwargs)

  def fn(self, state: Any, *inputs: Any) -> Any:
    """The NNX model's outputs, ``fn(state, *inputs.values())``, named and
    ordered as the PyTorch model's (``hidden_states[i]`` first)."""
    from flax import nnx  # noqa: PLC0415
    return nnx.merge(nnx.graphdef(self.model), state)(*inputs)

  def args(self) -> tuple:
    """``(state, *inputs)``, the arguments of :meth:`fn`."""
    from flax import nnx  # noqa: PLC0415
    return (nnx.state(self.model), *self.inputs.values())

  def torch_inputs(self) -> tuple:
    """The inputs as PyTorch takes them, in call order: token ids as
    int64, as PyTorch's embedding layers take them."""
    return tuple(v.astype(np.int64) if np.issubdtype(v.dtype, np.integer)
                 else v for v in self.inputs.values())

  def alignment(self, jax_names: list[str], torch_names: list[str]
                ) -> dict[str, str | None]:
    """The known pairing of the NNX model's layers with PyTorch's, for
    :func:`jaxprec.torch.port_check`'s ``alignment=``: the NNX layer
    ``a/b/0`` is the PyTorch module ``a.b.0`` (jaxprec's ports keep
    PyTorch's module names); a layer in :meth:`unpaired`, or without a
    PyTorch module of its name, is left unpaired (None)."""
    torch_set = set(torch_names)
    unpaired = self.unpaired()
    return {j: None if j in unpaired or j.replace("/", ".") not in torch_set
            else j.replace("/", ".") for j in jax_names}

  def unpaired(self) -> dict[str, str]:
    """NNX layer -> why it has no PyTorch partner, though a PyTorch module
    has its name."""
    return dict(_UNPAIRED[self.name])

  def layouts(self) -> dict[str, tuple[int, ...]]:
    """PyTorch layer regex -> the axes permutation taking its arrays to the
    NNX layer's layout, for :func:`jaxprec.torch.port_check`'s
    ``layouts=``: Wav2Vec2's convolutions run NCW in PyTorch, NWC in JAX."""
    return dict(_LAYOUTS.get(self.name, {}))


# The layers of jaxprec's ports whose PyTorch module of the same name returns
# other outputs.
_ROOT = ("jaxprec's model returns every layer's hidden state, PyTorch's "
         "(without output_hidden_states) the last one's; its layers are "
         "paired one by one")
_ENCODER = ("jaxprec's encoder returns every layer's hidden state, PyTorch's "
            "(a ModelOutput) the last one's; its layers are paired one by one")
_UNPAIRED = {
    "hf-llama": {"output": _ROOT},
    "hf-bert": {"output": _ROOT, "encoder": _ENCODER},
    "hf-wav2vec2": {"output": _ROOT, "encoder": _ENCODER},
}
# PyTorch's Conv1d runs NCW (batch, channels, time), flax.nnx.Conv NWC.
_LAYOUTS = {
    "hf-wav2vec2": {
        r"feature_extractor(\.conv_layers\.\d+(\.conv)?)?": (0, 2, 1),
        r"encoder\.pos_conv_embed\.conv": (0, 2, 1)},
}


def _wav2vec2(transformers, layers: int) -> tuple[Any, str]:
  config = transformers.Wav2Vec2Config(
      hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
      intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
      conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
      num_conv_pos_embedding_groups=4,
      # The Flax model implements only the "stable layer norm" variant.
      do_stable_layer_norm=True, feat_extract_norm="layer",
      hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
      feat_proj_dropout=0.0, layerdrop=0.0)
  return config, "Wav2Vec2Model"


def _wav2vec2_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
  t = np.arange(8000, dtype=np.float64) / 16000
  audio = 0.5 * np.sin(2 * np.pi * 220 * t) + 0.1 * rng.standard_normal(t.size)
  return {"input_values": audio[None].astype(np.float32)}


def _bert(transformers, layers: int) -> tuple[Any, str]:
  config = transformers.BertConfig(
      vocab_size=1000, hidden_size=64, num_hidden_layers=layers,
      num_attention_heads=4, intermediate_size=128,
      max_position_embeddings=64, hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0,
      # At BERT's init scale (0.02) random blocks barely move the residual
      # stream, and so neither does their rounding; 0.2 makes them count.
      initializer_range=0.2)
  return config, "BertModel"


def _bert_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
  ids = rng.integers(1, 1000, size=(1, 32)).astype(np.int32)
  return {"input_ids": ids, "attention_mask": np.ones_like(ids),
          "token_type_ids": np.zeros_like(ids)}


def _llama(transformers, layers: int) -> tuple[Any, str]:
  config = transformers.LlamaConfig(
      vocab_size=128, hidden_size=64, intermediate_size=128,
      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=64, rope_theta=10000.0, attention_dropout=0.0,
      # At the default init scale (0.02) random layers barely move the
      # residual stream, and so neither does their rounding; 0.2 makes them
      # count.
      initializer_range=0.2)
  return config, "LlamaModel"


def _llama_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
  return {"input_ids": rng.integers(0, 128, size=(1, 16)).astype(np.int32)}


# name -> (config and the name of its transformers PyTorch class, whose Flax
# class is the same name with "Flax" before it; inputs).
TWINS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "hf-wav2vec2": (_wav2vec2, _wav2vec2_inputs),
    "hf-bert": (_bert, _bert_inputs),
}
PORTS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    **TWINS,
    "hf-llama": (_llama, _llama_inputs),
}
_LAYERS = 4
# The seeds a twin takes: what NumPy, PyTorch and Flax all accept.
_MAX_SEED = 2**32 - 1


def _layer_count(what: str, layers: Any, default: int) -> int:
  """``layers`` as an int, ``default`` for None; ValueError unless it is an
  integer of at least 1."""
  if layers is None:
    return default
  if isinstance(layers, bool) or not isinstance(
      layers, (int, np.integer)) or layers < 1:
    raise ValueError(f"{what}(layers={layers!r}): the number of transformer "
                     f"layers is an integer of at least 1 (default {default})")
  return int(layers)


def _seeded(torch: Any, cls: Any, config: Any, seed: int) -> Any:
  """``cls(config)`` in eval mode, its weights drawn from ``seed``; PyTorch's
  global RNG is left as it was."""
  with torch.random.fork_rng(devices=[]):
    torch.manual_seed(seed)
    return cls(config).eval()


def twin(name: str, seed: int = 0, *, layers: int | None = None) -> Twin:
  """A built-in twin pair: a tiny random Hugging Face model in both frameworks.

  Args:
    name: ``'hf-wav2vec2'`` or ``'hf-bert'``.
    seed: seeds the PyTorch weights (PyTorch's global RNG is restored) and
      the inputs: an integer from 0 to ``2**32 - 1``.
    layers: the number of transformer layers (default 4).

  Returns:
    A :class:`Twin`.

  Raises:
    ValueError: an unknown name (naming the choices), ``layers`` not an
      integer of at least 1, or ``seed`` out of its range or not an integer.
    ImportError: PyTorch is missing, or transformers, or its Flax models
      (transformers 5 has none): one line with the install hint.
  """
  if name not in TWINS:
    raise names.unknown("twin", name, TWINS)
  layers = _layer_count("twin", layers, _LAYERS)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not (
      0 <= seed <= _MAX_SEED):
    raise ValueError(f"twin(seed={seed!r}): the seed is an integer from 0 to "
                     f"{_MAX_SEED} (it seeds PyTorch, Flax and NumPy)")
  torch = torch_ref.import_torch()
  transformers = torch_ref.import_transformers_flax("twin models need")
  make, inputs = TWINS[name]
  config, torch_name = make(transformers, layers)
  torch_ref.import_transformers_flax("twin models need", f"Flax{torch_name}")
  verbosity = transformers.logging.get_verbosity()
  transformers.logging.set_verbosity_error()  # "Flax classes are deprecated"
  try:
    torch_model = _seeded(torch, getattr(transformers, torch_name), config, seed)
    # Built without weights: the converted ones are its parameters.
    flax_model = getattr(transformers, f"Flax{torch_name}")(
        config, seed=seed, _do_init=False)
    params = torch_ref.flax_params(torch_model, flax_model)
  finally:
    transformers.logging.set_verbosity(verbosity)
  return Twin(name=name, torch_model=torch_model, flax_model=flax_model,
              params=params, inputs=inputs(np.random.default_rng(seed)))


def require() -> tuple[Any, Any]:
  """``(torch, transformers)``, what a port check needs, or one one-line
  ImportError naming every one of them that is missing, with the install
  lines (PyTorch's CPU build first)."""
  found, missing = [], []
  for name in ("torch", "transformers"):
    if missing:
      # Without torch, transformers is only looked for: imported, version 5
      # prints a line of its own that PyTorch is missing.
      if importlib.util.find_spec(name) is None:
        missing.append(name)
      continue
    try:
      found.append(importlib.import_module(name))
    except ImportError:
      missing.append(name)
  if missing:
    lines = (torch_hint("transformers") if "torch" in missing
             else install_hint("torch", "transformers"))
    raise ImportError(
        f"port checks need PyTorch (torch) and transformers' PyTorch models; "
        f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
        f"installed: {lines}")
  torch, transformers = found
  return torch, transformers


def port(name: str, seed: int = 0, *, layers: int | None = None) -> Port:
  """A built-in port check: a tiny random transformers model in PyTorch and
  jaxprec's NNX model with its weights.

  Args:
    name: ``'hf-wav2vec2'``, ``'hf-bert'`` or ``'hf-llama'``.
    seed: seeds the PyTorch weights (PyTorch's global RNG is restored) and
      the inputs.
    layers: the number of transformer layers (default 4).

  Returns:
    A :class:`Port`.

  Raises:
    ValueError: an unknown name (naming the choices), or ``layers`` not an
      integer of at least 1.
    ImportError: PyTorch or transformers is missing (one line, with the
      install hint).

  Examples:
    >>> import jaxprec, jaxprec.torch
    >>> p = jaxprec.torch.port("hf-llama", layers=1)  # doctest: +SKIP
    >>> report = jaxprec.check(p.fn, *p.args(), reference=p.reference())  # doctest: +SKIP
  """
  if name not in PORTS:
    raise names.unknown("port", name, PORTS)
  layers = _layer_count("port", layers, _LAYERS)
  torch, transformers = require()
  make, inputs = PORTS[name]
  config, torch_name = make(transformers, layers)
  from jaxprec._src.models.llama import LlamaModel  # noqa: PLC0415
  from jaxprec._src.models.nnx_bert import BertModel  # noqa: PLC0415
  from jaxprec._src.models.nnx_wav2vec2 import Wav2Vec2Model  # noqa: PLC0415
  jax_cls = {"hf-wav2vec2": Wav2Vec2Model, "hf-bert": BertModel,
             "hf-llama": LlamaModel}[name]
  torch_model = _seeded(torch, getattr(transformers, torch_name), config,
                        seed)
  return Port(name=name, torch_model=torch_model,
              model=jax_cls.from_pytorch(torch_model),
              inputs=inputs(np.random.default_rng(seed)))
