"""Port checks: a PyTorch original and jaxprec's own NNX port of it.

:func:`port` builds a tiny transformers model in PyTorch with random weights
(seeded, PyTorch's global RNG left as it was) and jaxprec's NNX model with
the same weights (``jaxprec.models.*.from_pytorch``), with synthetic inputs.
``jaxprec check --model hf-llama --reference pytorch`` (and ``hf-wav2vec2``,
``hf-bert``) checks the port against the PyTorch original with them. Only
transformers' PyTorch classes are used, which transformers 4 and 5 both
have; nothing is downloaded.

Imports transformers, PyTorch and Flax when a port is built, never at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxprec._src.core import names
from jaxprec._src.torch import torch_ref
from jaxprec._src.torch import torch_twins


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
    graphdef = nnx.graphdef(self.model)
    return torch_twins.depth_ordered(nnx.merge(graphdef, state)(*inputs))

  def args(self) -> tuple:
    """``(state, *inputs)``, the arguments of :meth:`fn`."""
    from flax import nnx  # noqa: PLC0415
    return (nnx.state(self.model), *self.inputs.values())


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


# name -> (config and the name of its transformers class, inputs).
PORTS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    **torch_twins.TWINS,
    "hf-llama": (_llama, _llama_inputs),
}
_LAYERS = 4


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
  layers = torch_twins.layer_count("port", layers, _LAYERS)
  torch = torch_ref.import_torch()
  try:
    import transformers  # noqa: PLC0415 -- optional, imported when used
  except ImportError as e:
    raise ImportError("port checks need transformers' PyTorch models: pip "
                      "install 'jaxprec[torch]' transformers") from e
  make, inputs = PORTS[name]
  config, torch_name = make(transformers, layers)
  from jaxprec._src.models.llama import LlamaModel  # noqa: PLC0415
  from jaxprec._src.models.nnx_bert import BertModel  # noqa: PLC0415
  from jaxprec._src.models.nnx_wav2vec2 import Wav2Vec2Model  # noqa: PLC0415
  jax_cls = {"hf-wav2vec2": Wav2Vec2Model, "hf-bert": BertModel,
             "hf-llama": LlamaModel}[name]
  torch_model = torch_twins.seeded(torch, getattr(transformers, torch_name),
                                   config, seed)
  return Port(name=name, torch_model=torch_model,
              model=jax_cls.from_pytorch(torch_model),
              inputs=inputs(np.random.default_rng(seed)))
