"""A transformers PyTorch causal LM as the sampler of
:func:`jaxprec.check_sampler`.

The sampler runs transformers' ``LlamaForCausalLM.forward`` in its two
halves: the decoder (``get_decoder()``) with ``past_key_values``, the prompt
in one chunk and then one token at a time, and the LM head
(``get_output_embeddings()``) on its last hidden state, so that the check can
switch the head or the body alone to the trainer's. It computes in the
model's own dtype on its own device, with PyTorch's kernels: nothing is
emulated. Nothing here imports PyTorch at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxprec._src.models import llama
from jaxprec._src.torch.torch_ref import floats, import_torch, run_hooked

MODEL_TYPES = ("llama", "qwen2")


def is_torch_module(obj: Any) -> bool:
  """A ``torch.nn.Module``, known without importing torch."""
  return any(c.__module__ == "torch.nn.modules.module" and c.__name__ ==
             "Module" for c in type(obj).__mro__)


class TorchSampler:
  """A PyTorch causal LM with the weights of ``model`` (the trainer's),
  checked: its architecture, sizes and weights (rounded to its dtype) are
  the model's."""

  def __init__(self, pt_model: Any, model: Any):
    name = type(pt_model).__name__
    what = f"check_sampler: sampler={name}"
    kind = getattr(getattr(pt_model, "config", None), "model_type", None)
    head = getattr(pt_model, "get_output_embeddings", lambda: None)()
    if kind is None or head is None:
      raise TypeError(f"{what}: a PyTorch sampler is a transformers "
                      f"LlamaForCausalLM or Qwen2ForCausalLM (a causal LM "
                      f"with a config and an LM head)")
    if kind not in MODEL_TYPES:
      raise ValueError(f"{what} is a {kind!r} model; a PyTorch sampler is "
                       f"a {' or '.join(map(repr, MODEL_TYPES))} causal LM, "
                       f"as jaxprec.models.LlamaForCausalLM computes")
    try:
      config = llama.config_from_pytorch(pt_model)
    except ValueError as e:
      raise ValueError(f"{what}: {e}") from None
    mine = getattr(model, "config", None)
    if not isinstance(mine, llama.LlamaConfig):
      raise TypeError(f"{what}: a PyTorch sampler samples for "
                      f"jaxprec.models.LlamaForCausalLM; the model is a "
                      f"{type(model).__name__}")
    for f in dataclasses.fields(config):
      a, b = getattr(config, f.name), getattr(mine, f.name)
      if a != b:
        raise ValueError(f"{what} has {f.name}={a!r}, the model "
                         f"{f.name}={b!r}: the sampler must be the model's "
                         f"architecture with its weights (jaxprec.models."
                         f"LlamaForCausalLM.from_pytorch makes the model)")
    torch = import_torch()
    params = list(pt_model.parameters())
    self.model, self.head_module = pt_model, head
    self.dtype, self.device = params[0].dtype, params[0].device
    dtype = str(self.dtype).removeprefix("torch.")
    self.name = f"PyTorch {name}, {dtype} on {self.device}"
    with warnings.catch_warnings():  # its dtype is known: said here
      warnings.simplefilter("ignore")
      ported = type(model).from_pytorch(pt_model)
    from flax import nnx  # noqa: PLC0415
    theirs = dict(nnx.to_flat_state(nnx.state(ported)))
    for path, var in nnx.to_flat_state(nnx.state(model)):
      w = np.asarray(var[...], np.float32).astype(jnp.dtype(dtype))
      if not np.array_equal(w.astype(np.float32), np.asarray(
          theirs[path][...], np.float32)):
        raise ValueError(f"{what}: the sampler's weights are not the "
                         f"model's (rounded to {dtype}), first at "
                         f"{'/'.join(map(str, path))}: make one from the "
                         f"other (jaxprec.models.LlamaForCausalLM."
                         f"from_pytorch)")
    self._torch = torch
    self.notes = (
        f"The sampler is {self.name}: transformers' forward with "
        f"past_key_values and PyTorch's own kernels on this machine, not "
        f"emulated; an inference engine's kernels and another device's are "
        f"not modelled.",
        f"The attribution switches frameworks: the lm_head factor gives "
        f"PyTorch's last hidden states to the trainer's head (jaxprec's), "
        f"the body factor gives the trainer's (jaxprec's decode at the "
        f"trainer's numerics) to PyTorch's head in {dtype}; the attention "
        f"factor is not switched (PyTorch's attention runs inside its "
        f"decoder, which the body factor switches).")

  def __str__(self) -> str:
    return self.name

  def body(self) -> TorchSampler:
    return self

  def lm_head(self) -> TorchSampler:
    return self

  @contextlib.contextmanager
  def _eval(self):
    """No gradients and eval mode (no dropout), the mode restored after."""
    training = self.model.training
    self.model.eval()
    try:
      with self._torch.no_grad():
        yield
    finally:
      self.model.train(training)

  def hidden(self, ids: Any, mask: Any, positions: Any, chunk: int | None
             ) -> tuple[tuple[np.ndarray, ...], list[tuple[int, dict]]]:
    """The decoder's hidden states (float32) and each step's module calls:
    ``ids[:, :chunk]`` in one chunk, then one token at a time with
    ``past_key_values``; ``chunk`` None: the whole sequence at once (teacher
    forcing). A step is ``(n, {name: floating outputs})``: its ``n`` tokens
    and the output of every submodule of the decoder that ran, seen by
    forward hooks (:func:`jaxprec._src.torch.torch_ref.run_hooked`), named
    by its path in the whole model as jaxprec names an NNX module
    (``model/layers/0/self_attn``; ``'#0'``, ``'#1'`` for a module called
    twice)."""
    torch = self._torch
    ids, mask, positions = (None if a is None else torch.tensor(
        np.array(a), dtype=torch.long, device=self.device)
                            for a in (ids, mask, positions))
    decoder = self.model.get_decoder()
    prefix = next(n for n, m in self.model.named_modules() if m is decoder)
    steps, states, cache, at = [], [], None, 0
    for n in ([ids.shape[1]] if chunk is None
              else [chunk] + [1] * (ids.shape[1] - chunk)):
      seen: dict[str, list] = {}
      kwargs = dict(position_ids=None if positions is None
                    else positions[:, at:at + n],
                    output_hidden_states=True)
      if chunk is not None:
        kwargs.update(attention_mask=mask[:, :at + n], use_cache=True,
                      past_key_values=cache)
      else:
        kwargs.update(attention_mask=mask)
      out = run_hooked(
          decoder, (ids[:, at:at + n],), kwargs, bool,  # not the decoder
          lambda name, a, k, o: seen.setdefault(
              ".".join(filter(None, (prefix, name))).replace(".", "/"),
              []).append(floats(o)))
      cache = out.past_key_values
      states.append(out.hidden_states)
      steps.append((n, {f"{name}#{i}" if len(outs) > 1 else name: o
                        for name, outs in seen.items()
                        for i, o in enumerate(outs)}))
      at += n
    return tuple(torch.cat(s, 1).float().cpu().numpy()
                 for s in zip(*states)), steps

  def head(self, hidden: Any) -> np.ndarray:
    """The LM head's logits (float32) of hidden states, given to it in the
    model's dtype."""
    h = self._torch.tensor(np.array(hidden, np.float32)).to(
        self.device, self.dtype)
    with self._eval():
      return self.head_module(h).float().cpu().numpy()
