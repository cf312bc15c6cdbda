"""PyTorch as the reference: ``jaxprec.torch``.

PyTorch and transformers are imported only when these are used.

* :func:`capture`: a PyTorch module's hidden states as ``{name: array}``,
  named as :func:`jaxprec.named_layers` names JAX outputs, for
  ``jaxprec.check(..., reference=...)``.
* :func:`from_torch`: a tensor or Hugging Face ``ModelOutput`` the same way
  (``check`` also accepts them directly as ``reference=``).
* :func:`flax_params`: a Flax Hugging Face model's parameters from its PyTorch
  twin, with transformers' own converter.
* :func:`twin`: the built-in twin pairs ``'hf-wav2vec2'`` and ``'hf-bert'``
  (Hugging Face's Flax models: transformers 4).
* :func:`port`: the built-in port checks ``'hf-wav2vec2'``, ``'hf-bert'`` and
  ``'hf-llama'``: a transformers PyTorch model and jaxprec's NNX model with
  its weights (transformers 4 and 5).
* :func:`port_check`: your own JAX port (an NNX module, a linen module with
  its variables, or a function) against its PyTorch original, layer by
  layer: is a difference a bug of the port, or precision? (a
  :class:`PortReport`); :func:`port_check_builtin`: the same for a built-in
  port, its layers paired by their names; :func:`logits_gates`: KL
  divergence, top-k agreement and the largest log-probability difference of
  two sets of logits.
"""

from jaxprec._src.checker.logits import LogitsGates
from jaxprec._src.checker.logits import logits_gates
from jaxprec._src.checker.port_check import PortLayer
from jaxprec._src.checker.port_check import PortReport
from jaxprec._src.checker.port_builtin import port_check_builtin
from jaxprec._src.checker.port_check import port_check
from jaxprec._src.torch.torch_ports import PORTS
from jaxprec._src.torch.torch_ports import TWINS
from jaxprec._src.torch.torch_ports import Port
from jaxprec._src.torch.torch_ports import Twin
from jaxprec._src.torch.torch_ports import port
from jaxprec._src.torch.torch_ports import twin
from jaxprec._src.torch.torch_ref import capture
from jaxprec._src.torch.torch_ref import flax_params
from jaxprec._src.torch.torch_ref import from_torch

__all__ = ("LogitsGates", "PORTS", "Port", "PortLayer", "PortReport", "TWINS",
           "Twin", "capture", "flax_params", "from_torch", "logits_gates",
           "port", "port_check", "port_check_builtin", "twin")
