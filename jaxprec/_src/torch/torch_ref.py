"""PyTorch as the reference: a PyTorch model's outputs as jaxprec layers.

:func:`capture` runs a ``torch.nn.Module``, :func:`from_torch` converts its
output, both named as :func:`jaxprec.named_layers` names a JAX output;
:func:`flax_params` gives a Flax Hugging Face model the weights of its
PyTorch twin. Objects are recognised by their type's module, so nothing here
imports JAX, PyTorch or transformers at import time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxprec._src.core.version import install_hint, torch_hint


def hf_flax_hint() -> str:
  """The install line for transformers' Flax models (transformers 5 removed
  every Flax model class and modeling_flax_* module)."""
  return (f"{install_hint('hf-flax')} (transformers 4.x: transformers 5 has "
          f"no Flax models)")


def import_torch():
  """``torch``, or ImportError with the install hint."""
  try:
    import torch  # noqa: PLC0415 -- optional, imported when used
  except ImportError as e:
    raise ImportError(f"jaxprec.torch needs PyTorch: {torch_hint()}") from e
  return torch


def import_transformers_flax(what: str, *names: str) -> Any:
  """``transformers``, with its Flax model classes ``names``, or a one-line
  ImportError with the install hint (``what`` needs them: ``'flax_params
  needs'``), whether transformers is missing or has no Flax models (5.0 and
  newer)."""
  try:
    import transformers  # noqa: PLC0415 -- optional, imported when used
  except ImportError as e:
    raise ImportError(f"{what} transformers' Flax models: "
                      f"{hf_flax_hint()}") from e
  for name in names:
    if not hasattr(transformers, name):
      version = getattr(transformers, "__version__", "?")
      raise ImportError(f"{what} transformers' Flax models, and "
                        f"transformers {version} has no {name}: "
                        f"{hf_flax_hint()}")
  return transformers


def _top_module(obj: Any) -> str:
  return (type(obj).__module__ or "").split(".")[0]


def _is_tensor(x: Any) -> bool:
  """A torch.Tensor (or Parameter), known without importing torch."""
  return _top_module(x) == "torch" and hasattr(x, "detach") and hasattr(
      x, "dtype") and hasattr(x, "shape")


def _is_model_output(x: Any) -> bool:
  """A Hugging Face PyTorch ``ModelOutput`` (an ordered dict of tensors)."""
  return any(c.__name__ == "ModelOutput" and
             (c.__module__ or "").startswith("transformers")
             for c in type(x).__mro__) and isinstance(x, Mapping)


def _holds_tensor(x: Any, depth: int = 0) -> bool:
  if _is_tensor(x):
    return True
  if depth > 8:
    return False
  if isinstance(x, Mapping):
    return any(_holds_tensor(v, depth + 1) for v in x.values())
  if isinstance(x, (tuple, list)):
    return any(_holds_tensor(v, depth + 1) for v in x)
  return False


def _to_numpy(t: Any) -> np.ndarray:
  """A tensor as NumPy, copied; bfloat16 and float16 widened exactly to
  float32. A copy, not a view of the tensor's memory: an in-place op later in
  the forward pass (``nn.ReLU(inplace=True)``, ``h += residual``) would
  rewrite what a hook captured."""
  torch = import_torch()
  t = t.detach()
  if t.dtype in (torch.bfloat16, torch.float16):
    t = t.to(torch.float32)  # every bfloat16/float16 value is a float32
  return np.array(t.cpu().numpy(), copy=True)


def _is_float_array(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None or not hasattr(x, "shape"):
    return False
  try:
    return np.issubdtype(np.dtype(dtype), np.floating) or str(dtype) == "bfloat16"
  except TypeError:
    return False


def _named(x: Any, path: str, out: dict[str, np.ndarray]) -> None:
  """Adds the floating tensors of ``x`` under ``path`` (jaxprec's naming)."""
  if _is_tensor(x):
    if getattr(x, "is_floating_point", lambda: False)():
      out[path.lstrip(".") or "output"] = _to_numpy(x)
    return
  if isinstance(x, Mapping):  # ModelOutputs hold only their non-None fields
    for k, v in x.items():
      if v is not None:
        key = f".{k}" if isinstance(k, str) else f"[{k!r}]"
        _named(v, path + key, out)
    return
  if isinstance(x, (tuple, list)):
    for i, v in enumerate(x):
      _named(v, f"{path}[{i}]", out)
    return
  if _is_float_array(x):
    out[path.lstrip(".") or "output"] = np.asarray(x)


def from_torch(obj: Any) -> dict[str, np.ndarray] | None:
  """A PyTorch output as ``{name: np.ndarray}``, or None if it is not one.

  Accepts a ``torch.Tensor``, a Hugging Face ``ModelOutput``, or a dict, list
  or tuple holding tensors; names follow :func:`jaxprec.named_layers`
  (``'last_hidden_state'``, ``'hidden_states[3]'``, ``'output'`` for a bare
  tensor). Only floating tensors are kept; bfloat16 and float16 are widened
  exactly to float32. Anything else gives None, without importing PyTorch.

  Examples:
    >>> import numpy as np
    >>> from jaxprec._src.torch.torch_ref import from_torch
    >>> from_torch({"h": np.zeros(2)}) is None  # no tensor: not PyTorch's
    True
  """
  if not (_is_tensor(obj) or _is_model_output(obj) or (
      isinstance(obj, (Mapping, tuple, list)) and _holds_tensor(obj))):
    return None
  out: dict[str, np.ndarray] = {}
  _named(obj, "", out)
  return out


def _rename(found: dict[str, np.ndarray],
            names: Mapping[str, str | None] | Callable[[str], str | None] | None
            ) -> dict[str, np.ndarray]:
  if names is None:
    return found
  if not (isinstance(names, Mapping) or callable(names)):
    raise TypeError(f"names= must be a dict or a callable mapping PyTorch "
                    f"names to the JAX side's names; got {type(names).__name__}")
  out: dict[str, np.ndarray] = {}
  for k, v in found.items():
    new = names.get(k, k) if isinstance(names, Mapping) else names(k)
    if new is None:
      continue  # dropped
    if not isinstance(new, str):
      raise TypeError(f"names= gave {new!r} for {k!r}: expected a str (or "
                      f"None to drop the layer)")
    if new in out:
      raise ValueError(f"names= maps two layers to {new!r}")
    out[new] = v
  return out


def _as_torch(x: Any, torch) -> Any:
  """A NumPy argument as a tensor of its own: a copy, so that an in-place op
  in ``forward`` never writes into the caller's array."""
  return torch.from_numpy(x.copy()) if isinstance(x, np.ndarray) else x


def capture(module: Any, *args: Any, modules: str | None = None,
            names: Mapping[str, str | None] | Callable[[str], str | None]
            | None = None, **kwargs: Any) -> dict[str, np.ndarray]:
  """Runs a PyTorch module and returns its hidden states, named for jaxprec.

  ``module(*args, **kwargs)`` runs under ``torch.no_grad()`` in eval mode;
  every submodule's training flag is restored afterwards, on errors too.
  NumPy arrays among ``args``/``kwargs`` are passed as tensors.

  Args:
    module: a ``torch.nn.Module`` (e.g. a Hugging Face model).
    *args: its positional arguments.
    modules: a regular expression, matched in full against the names of
      ``module.named_modules()`` (``'encoder.layers.0.attention'``): each
      matching submodule's output is added, named by its path, through
      forward hooks that are always removed; the names are then those
      :func:`jaxprec.check_module` gives a Flax module tree of the same
      shape, the root's output included (``'output'``,
      ``'output.last_hidden_state'``).
    names: maps PyTorch names to the JAX side's names: a dict (unlisted
      names are kept) or a callable; a mapped value of None drops the layer.
    **kwargs: its keyword arguments (e.g. ``output_hidden_states=True``).

  Returns:
    An insertion-ordered ``{name: np.ndarray}``: the output's floating
    tensors (``'last_hidden_state'``, ``'hidden_states[3]'``, as
    :func:`jaxprec.check` names a function's output; with ``modules=``
    under ``'output'``: ``'output.last_hidden_state'``), then the hooked
    submodules' (``'encoder.layers.0'``; a submodule's tuple output is
    named by item, ``'encoder.layers.0[1]'``, unless its one floating tensor
    is its first item, as in transformers' ``(hidden_states,)`` and
    ``(attn_output, None)``: then it is ``'encoder.layers.0'``;
    ``'encoder.layers.0#0'``, ``'encoder.layers.0#1'`` for each call of a
    submodule called more than once, as :func:`jaxprec.check_module` names
    them). bfloat16 and float16 are widened exactly to float32.

  Raises:
    ImportError: PyTorch is not installed (with the install hint).
    ValueError: ``modules=`` is not a valid regular expression or matches no
      submodule (listing some names).
  """
  torch = import_torch()
  if not isinstance(module, torch.nn.Module):
    raise TypeError(f"capture() needs a torch.nn.Module; got "
                    f"{type(module).__name__}")
  pattern = None
  if modules is not None:
    try:
      pattern = re.compile(modules)
    except (re.error, TypeError) as e:
      raise ValueError(f"modules={modules!r} is not a regular expression: "
                       f"{e}") from None
  calls: dict[str, list[dict[str, np.ndarray]]] = {}  # per call, in order
  select = None
  if pattern is not None:
    all_names = [n for n, _ in module.named_modules() if n]
    if not any(pattern.fullmatch(n) for n in all_names):
      shown = ", ".join(repr(n) for n in all_names[:8])
      raise ValueError(
          f"modules={modules!r} matches no submodule (matched in full "
          f"against named_modules(): {shown}{'...' if len(all_names) > 8 else ''})")
    select = lambda name: bool(name) and pattern.fullmatch(name)  # noqa: E731

  def record(name, _args, _kwargs, output):
    _named(_main_output(output), name, one := {})
    calls.setdefault(name, []).append(one)
  output = run_hooked(module, args, kwargs, select or (lambda _: False),
                      record)
  found: dict[str, np.ndarray] = {}
  # With modules=, named as check_module names the root module's output.
  _named(output, "" if pattern is None else "output", found)
  for k, v in _numbered(calls).items():
    if k in found:
      raise ValueError(f"submodule {k!r} has the name of an output layer; "
                       f"rename one with names=")
    found[k] = v
  return _rename(found, names)


def run_hooked(module: Any, args: tuple, kwargs: dict,
               select: Callable[[str], bool] | None,
               record: Callable[[str, tuple, dict, Any], None]) -> Any:
  """``module(*args, **kwargs)`` in eval mode under ``torch.no_grad()``, with
  ``record(name, args, kwargs, output)`` called by a forward hook as the call
  of each submodule whose name ``select`` accepts returns (None: every
  module; the root's name is ``''``), in the order the calls end.

  The one way jaxprec sees PyTorch's module calls (:func:`capture`, the port
  check). NumPy arrays among the arguments are passed as tensors; the hooks
  are removed and every submodule's training flag restored, on errors too.
  ``record`` runs during the call: copy what it keeps (a later in-place op
  may change a tensor). Returns the module's output.
  """
  torch = import_torch()
  handles = []
  flags = {m: m.training for m in module.modules()}
  try:
    for name, sub in module.named_modules():
      if select is None or select(name):
        def hook(_mod, a, k, out, name=name):
          record(name, a, dict(k), out)
        handles.append(sub.register_forward_hook(hook, with_kwargs=True))
    module.eval()
    args = tuple(_as_torch(a, torch) for a in args)
    kwargs = {k: _as_torch(v, torch) for k, v in kwargs.items()}
    with torch.no_grad():
      return module(*args, **kwargs)
  finally:
    for h in handles:
      h.remove()
    for m, training in flags.items():
      m.training = training


@dataclasses.dataclass(frozen=True)
class ModuleCall:
  """One module call of a PyTorch model (:func:`module_calls`).

  Attributes:
    name: the module's name in ``named_modules()`` (``''``: the root).
    inputs, outputs: its floating arguments and output (the output as
      :func:`_main_output` gives it), as float32 NumPy, in the order
      ``jax.tree_util`` gives the same structure's leaves (:func:`floats`).
    parameterless: the module holds no parameter, its children's included
      (an activation, dropout, an identity).
  """

  name: str
  inputs: list[np.ndarray]
  outputs: list[np.ndarray]
  parameterless: bool


def module_calls(model: Any, args: tuple, kwargs: dict, who: str
                 ) -> list[ModuleCall]:
  """Every module call of ``model(*args, **kwargs)`` (:func:`run_hooked`),
  in the order the calls end: children before their parent, the root last.

  Raises:
    TypeError: ``model`` is not a ``torch.nn.Module`` (``who`` names it).
  """
  torch = import_torch()
  if not isinstance(model, torch.nn.Module):
    raise TypeError(f"{who} must be a torch.nn.Module; got "
                    f"{type(model).__name__}")
  bare = {n for n, m in model.named_modules()
          if next(m.parameters(), None) is None}  # its children's included
  found: list[ModuleCall] = []

  def record(name, a, k, out):
    found.append(ModuleCall(
        name, [np.asarray(v, np.float32) for v in floats((a, k))],
        [np.asarray(v, np.float32) for v in floats(_main_output(out))],
        name in bare))
  run_hooked(model, args, kwargs, None, record)
  return found


def floats(x: Any) -> list[np.ndarray]:
  """The floating tensors (and arrays) of a PyTorch value in the order
  ``jax.tree_util`` gives the same structure's leaves: a dict's by its sorted
  keys, an ``OrderedDict``'s (a ``ModelOutput``'s) in its order, None left
  out; so that the outputs and inputs of paired layers pair in order."""
  if _is_tensor(x):
    return [_to_numpy(x)] if x.is_floating_point() else []
  if isinstance(x, Mapping):
    items = list(x.items())
    if not isinstance(x, collections.OrderedDict):
      with contextlib.suppress(TypeError):  # keys that do not sort: as given
        items.sort(key=lambda kv: kv[0])
    return [f for _, v in items if v is not None for f in floats(v)]
  if isinstance(x, (tuple, list)):
    return [f for v in x for f in floats(v)]
  return [np.asarray(x)] if _is_float_array(x) else []


def _floats(x: Any) -> bool:
  """Whether ``x`` holds a floating tensor (or array)."""
  _named(x, "x", found := {})
  return bool(found)


def _main_output(output: Any) -> Any:
  """A hooked submodule's output as a JAX module would return it: a tuple
  or list whose one floating tensor is its first item (PyTorch's
  ``(hidden_states,)`` or ``(attn_output, None)``, as transformers' layers
  return) is that tensor; anything else is itself."""
  if (isinstance(output, (tuple, list)) and output and _floats(output[0])
      and _is_tensor(output[0]) and not any(map(_floats, output[1:]))):
    return output[0]
  return output


def _numbered(calls: dict[str, list[dict[str, np.ndarray]]]
              ) -> dict[str, np.ndarray]:
  """The hooked outputs by name; a submodule called more than once has each
  call's outputs under ``name#0``, ``name#1``, ... (as
  :func:`jaxprec.check_module` names a Flax module called twice)."""
  out: dict[str, np.ndarray] = {}
  for name, per_call in calls.items():
    for i, one in enumerate(per_call):
      for k, v in one.items():  # k is name + the output's own path
        out[k if len(per_call) == 1 else f"{name}#{i}{k[len(name):]}"] = v
  return out


def flax_params(pt_model: Any, flax_model: Any) -> Any:
  """The Flax twin's parameters from a PyTorch Hugging Face model.

  Uses transformers' own converter
  (``modeling_flax_pytorch_utils.convert_pytorch_state_dict_to_flax``); neither
  model is changed.

  Args:
    pt_model: a transformers PyTorch model (``Wav2Vec2Model``, ``BertModel``).
    flax_model: its Flax counterpart (``FlaxWav2Vec2Model``, ...), built with
      the same config; with its own weights, or without
      (``_do_init=False``: then only their shapes are computed, abstractly,
      which saves initialising them: 8 s for the built-in Wav2Vec2 twin).

  Returns:
    The parameters for ``flax_model(..., params=...)``.

  Raises:
    ImportError: PyTorch is missing, or transformers, or its Flax models
      (transformers 5 has none): one line with the install hint.
    ValueError: the PyTorch model does not fit the Flax model (another
      architecture or size), naming the first parameter whose name or shape
      differs.
  """
  import_torch()
  import_transformers_flax("flax_params needs", "FlaxPreTrainedModel")
  from transformers import modeling_flax_pytorch_utils as convert  # noqa: PLC0415
  state = {k: v.detach().clone() for k, v in pt_model.state_dict().items()}
  shapes = _shapes(flax_model)
  what = (f"{type(pt_model).__name__} does not fit "
          f"{type(flax_model).__name__}")
  try:
    params = convert.convert_pytorch_state_dict_to_flax(state, shapes)
  except ValueError as e:  # the converter's own shape check
    raise ValueError(f"flax_params: {what}: {' '.join(str(e).split())}") from None
  _check_fit(params, shapes.params, what)
  _check_config(pt_model, flax_model, what)
  return params


# Config fields that change the numbers without changing a parameter's shape.
_SHAPELESS_FIELDS = (
    "num_attention_heads", "num_key_value_heads", "hidden_act",
    "layer_norm_eps", "rms_norm_eps", "rope_theta", "position_embedding_type",
    "feat_extract_activation", "feat_extract_norm", "do_stable_layer_norm",
    "num_conv_pos_embedding_groups", "conv_stride", "conv_bias")


def _check_config(pt_model: Any, flax_model: Any, what: str) -> None:
  """ValueError naming the config fields (of :data:`_SHAPELESS_FIELDS`) in
  which the two models differ: weights of the same shapes that compute
  something else would pass for the two frameworks' own disagreement."""
  a = getattr(pt_model, "config", None)
  b = getattr(flax_model, "config", None)
  if a is None or b is None:
    return
  differ = [f"{k}={getattr(a, k)!r} against {getattr(b, k)!r}"
            for k in _SHAPELESS_FIELDS
            if hasattr(a, k) and hasattr(b, k)
            and _plain(getattr(a, k)) != _plain(getattr(b, k))]
  if differ:
    raise ValueError(f"flax_params: {what}: their configs differ where the "
                     f"shapes do not show it: {'; '.join(differ)} (PyTorch "
                     f"against Flax)")


def _plain(v: Any) -> Any:
  return tuple(v) if isinstance(v, (list, tuple)) else v


def _check_fit(got: Any, want: Any, what: str) -> None:
  """ValueError naming the first parameter whose name or shape differs
  between the converted parameters and the Flax model's own."""
  from flax import traverse_util  # noqa: PLC0415
  got_flat = traverse_util.flatten_dict(dict(got), sep="/")
  want_flat = traverse_util.flatten_dict(dict(want), sep="/")
  for name in [*want_flat, *(k for k in got_flat if k not in want_flat)]:
    a = tuple(got_flat[name].shape) if name in got_flat else None
    b = tuple(want_flat[name].shape) if name in want_flat else None
    if a != b:
      raise ValueError(
          f"flax_params: {what}: first mismatch at {name!r}: from PyTorch "
          f"{'missing' if a is None else a}, the Flax model "
          f"{'has none' if b is None else b}")


def _shapes(flax_model: Any) -> Any:
  """What transformers' converter reads of a Flax model: its base model
  prefix, and its parameters' names and shapes (abstract where the model was
  built without weights)."""
  import jax  # noqa: PLC0415
  prefix = flax_model.base_model_prefix
  if getattr(flax_model, "_is_initialized", True):
    params = flax_model.params
  else:
    params = jax.eval_shape(
        lambda key: flax_model.init_weights(key, flax_model.input_shape),
        jax.random.PRNGKey(0))
  return types.SimpleNamespace(base_model_prefix=prefix, params=params)
