"""Weights of a PyTorch original for jaxprec's NNX models, checked to fit.

The built-in NNX models mirror the module tree of transformers' PyTorch
classes: the NNX attribute path ``encoder/layers/0/attention/q_proj`` is the
PyTorch module ``encoder.layers.0.attention.q_proj``, so :func:`load` finds
each parameter's PyTorch counterpart by name and refuses a model that does
not fit. :func:`hf_config` and :func:`require` refuse a config the NNX model
does not implement. Imports PyTorch only through the model it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flax import nnx

from jaxprec._src.core import names


def module_list(modules: Iterable[nnx.Module]) -> Any:
  """A list of submodules as an NNX attribute: ``nnx.List`` where Flax has it
  (0.12 and newer), a plain list before (where NNX took lists as they are)."""
  make = getattr(nnx, "List", list)  # flax < 0.12: no nnx.List
  return make(list(modules))


def no_size(name: str, size: str | None) -> None:
  """ValueError for ``name(size=..., from_pytorch=...)``: the PyTorch model's
  config gives the sizes."""
  if size is not None:
    raise ValueError(f"{name}(size={size!r}, from_pytorch=...): the sizes "
                     f"come from the PyTorch model's config; leave size unset")


def split_fn(model: nnx.Module, name: str) -> tuple[Callable[..., Any], Any]:
  """``(fn, state)``: ``fn(state, *inputs)`` calls a copy of ``model`` made
  from ``state`` (a pure function of arrays, for :func:`jaxprec.check`)."""
  graphdef, state = nnx.split(model)

  def fn(state, *inputs):
    return nnx.merge(graphdef, state)(*inputs)
  fn.__name__ = fn.__qualname__ = name
  return fn, state


def _shape(var: Any) -> tuple[int, ...]:
  value = var.get_value() if hasattr(var, "get_value") else var.value
  return tuple(value.shape)


def _set(var: Any, value: Any) -> None:
  if hasattr(var, "set_value"):  # flax >= 0.12 deprecates .value
    var.set_value(value)
  else:
    var.value = value


# NNX layer type -> {its parameter: PyTorch's name for it}. A ``kernel`` is
# PyTorch's weight transposed: (out, in / groups, *window) -> (*window,
# in / groups, out).
_LEAVES: tuple[tuple[type, dict[str, str]], ...] = (
    (nnx.Linear, {"kernel": "weight", "bias": "bias"}),
    (nnx.Conv, {"kernel": "weight", "bias": "bias"}),
    (nnx.LayerNorm, {"scale": "weight", "bias": "bias"}),
    (nnx.RMSNorm, {"scale": "weight"}),
    (nnx.Embed, {"embedding": "weight"}),
)


def _plan(model: nnx.Module) -> dict[str, tuple[tuple[int, ...], tuple]]:
  """Every NNX parameter of ``model`` by the PyTorch parameter it loads:
  ``{PyTorch name: (PyTorch shape, NNX path)}``."""
  layers = {tuple(path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Module)}
  plan = {}
  for path, var in nnx.to_flat_state(nnx.state(model)):
    path = tuple(path)
    layer = layers.get(path[:-1])
    leaves = next((leaves for cls, leaves in _LEAVES
                   if isinstance(layer, cls)), {})
    if path[-1] not in leaves:
      raise TypeError(f"jaxprec cannot load {'/'.join(map(str, path))} of "
                      f"{type(layer).__name__} from PyTorch")
    shape = _shape(var)
    if path[-1] == "kernel":
      shape = (shape[-1], shape[-2], *shape[:-2])
    plan[".".join(map(str, (*path[:-1], leaves[path[-1]])))] = (shape, path)
  return plan


def torch_parameters(pt_model: Any) -> dict[str, Any]:
  """``pt_model.named_parameters()``, with weight-normalised weights as the
  weights they compute: a ``torch.nn.utils.parametrizations.weight_norm``
  module's ``parametrizations.weight.original0``/``original1`` (g and v)
  become its ``weight``, ``g * v / ||v||``, as its forward pass uses it."""
  params: dict[str, Any] = {}
  for name, p in pt_model.named_parameters():
    owner, found, rest = f".{name}".partition(".parametrizations.")
    if not found:
      params[name] = p
      continue
    attr = rest.split(".")[0]
    weight = f"{owner}.{attr}"[1:]
    if weight not in params:  # the computed weight
      params[weight] = getattr(pt_model.get_submodule(owner[1:]), attr)
  return params


def load(cls: type, config: Any, pt_model: Any, *,
         unused: Iterable[str] = (), **kwargs: Any) -> nnx.Module:
  """``cls(config, **kwargs)``, a jaxprec NNX model, with the PyTorch model's
  weights.

  Args:
    cls: a jaxprec NNX model class whose module tree mirrors ``pt_model``'s.
    config: its sizes, the PyTorch model's.
    pt_model: the ``torch.nn.Module`` to take the weights from; not changed.
    unused: PyTorch parameter names the NNX model leaves out because they do
      not take part in inference (e.g. Wav2Vec2's ``masked_spec_embed``,
      used only for masking in training).
    **kwargs: more arguments of ``cls``.

  Returns:
    The NNX model with the weights, as float32.

  Raises:
    ValueError: a parameter of either model has no counterpart, or a shape
      differs: names the first such parameter (in the PyTorch model's order,
      then the NNX model's).
  """
  import torch  # noqa: PLC0415 -- pt_model is a torch module: torch is there
  model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), **kwargs))
  what = (f"from_pytorch: {type(pt_model).__name__} does not fit jaxprec's "
          f"{cls.__name__}")
  plan = _plan(model)
  unused = set(unused)
  with torch.no_grad():
    params = {k: v for k, v in torch_parameters(pt_model).items()
              if k not in unused}
    for name, tensor in params.items():
      if name not in plan:
        raise ValueError(f"{what}: first mismatch at {name!r}: jaxprec's "
                         f"model has no such parameter ({_near(name, plan)})")
      want = plan[name][0]
      if tuple(tensor.shape) != want:
        raise ValueError(f"{what}: first mismatch at {name!r}: PyTorch "
                         f"{tuple(tensor.shape)}, jaxprec's model {want}")
    for name in plan:
      if name not in params:
        raise ValueError(f"{what}: first mismatch at {name!r}: the PyTorch "
                         f"model has no such parameter")
    narrow = sorted({str(t.dtype).replace("torch.", "")
                     for t in params.values() if t.dtype != torch.float32})
    if narrow:
      import warnings  # noqa: PLC0415
      warnings.warn(
          f"{what}: the PyTorch model holds {', '.join(narrow)} parameters; "
          f"jaxprec's model gets them as float32 and computes in float32, so "
          f"it is compared with a float32 computation, not with the "
          f"{narrow[0]} one the PyTorch model runs. Port a float32 model "
          f"(pt_model.float()) and give both the same compute dtype to "
          f"compare like with like.", stacklevel=3)
    values = {}
    for name, tensor in params.items():
      w = tensor.detach().to(torch.float32).cpu().numpy().copy()
      path = plan[name][1]
      values[path] = (np.transpose(w, (*range(2, w.ndim), 1, 0))
                      if path[-1] == "kernel" else w)
  import jax.numpy as jnp  # noqa: PLC0415
  graphdef, state = nnx.split(model)
  for path, var in nnx.to_flat_state(state):
    _set(var, jnp.asarray(values[tuple(path)]))
  return nnx.merge(graphdef, state)


def _near(name: str, plan: Mapping[str, Any]) -> str:
  close = names.close_name(name, list(plan))
  return f"closest: {close!r}" if close else f"it has {len(plan)} parameters"


def hf_config(pt_model: Any, model_types: tuple[str, ...], cls: str) -> Any:
  """The transformers config of ``pt_model``, checked to be of
  ``model_types``; TypeError or ValueError naming what it is instead."""
  config = getattr(pt_model, "config", None)
  if config is None or not hasattr(pt_model, "named_parameters"):
    raise TypeError(f"from_pytorch= takes a transformers PyTorch {cls} (a "
                    f"torch.nn.Module with a .config); got "
                    f"{type(pt_model).__name__}")
  kind = getattr(config, "model_type", None)
  if kind not in model_types:
    raise ValueError(f"from_pytorch=: {type(pt_model).__name__} is a "
                     f"{kind!r} model; jaxprec's {cls} loads "
                     f"{' or '.join(map(repr, model_types))}")
  return config


def require(config: Any, cls: str, **allowed: Any) -> None:
  """ValueError naming the first config field whose value jaxprec's model
  does not implement: ``allowed`` maps a field to its one value, or a tuple
  of the values it may take."""
  for field, ok in allowed.items():
    value = getattr(config, field, None)
    choices = ok if isinstance(ok, tuple) else (ok,)
    if value not in choices:
      raise ValueError(f"from_pytorch=: {field}={value!r} is not implemented "
                       f"by jaxprec's {cls}; it computes "
                       f"{' or '.join(f'{field}={c!r}' for c in choices)}")
