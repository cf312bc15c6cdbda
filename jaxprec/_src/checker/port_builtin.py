"""The built-in port checks through :func:`jaxprec.torch.port_check`.

:func:`port_check_builtin` checks one of jaxprec's own NNX ports of a
transformers model (``'hf-llama'``, ``'hf-bert'``, ``'hf-wav2vec2'``:
:func:`jaxprec.torch.port`) against its PyTorch original layer by layer:
the floor, the envelope, the local and the propagated error of every layer,
and the suspects. The layers are paired by their names, which the ports keep
from PyTorch (:meth:`jaxprec.torch.Port.alignment`), not by the automatic
pairing; Wav2Vec2's convolutions are compared in JAX's layout
(:meth:`jaxprec.torch.Port.layouts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxprec._src.checker import port_check as port_check_lib
from jaxprec._src.torch import torch_ports


def port_check_builtin(port: str | torch_ports.Port, *, seed: int = 0,
                       layers: int | None = None,
                       precisions: Sequence[str] | str = ("float32",
                                                          "bfloat16"),
                       target: str = "tpu",
                       factor: float = port_check_lib.PORT_FACTOR,
                       progress: bool = False) -> port_check_lib.PortReport:
  """A built-in port of a transformers model, checked against PyTorch.

  :func:`jaxprec.torch.port_check` of the NNX model of
  :func:`jaxprec.torch.port` against its PyTorch model, on the port's
  inputs, with the pairing the port knows: the NNX layer ``a/b/0`` with the
  PyTorch module ``a.b.0``. The NNX layers a PyTorch module of their name
  does not match (the whole model and an encoder, which return every
  layer's hidden state) are left unpaired, and the report's notes say why.

  Args:
    port: ``'hf-llama'``, ``'hf-bert'`` or ``'hf-wav2vec2'``, or a
      :class:`jaxprec.torch.Port` (one whose NNX model you changed, say).
    seed: seeds the weights and the inputs of a port given by name.
    layers: the number of transformer layers of a port given by name
      (default 4).
    precisions: the rows, as :func:`jaxprec.torch.port_check` takes them.
    target: ``'tpu'`` or ``'gpu'``: whose numerics the rows show.
    factor: the factor of the suspect rule.
    progress: say each phase on stderr, as :func:`jaxprec.torch.port_check`.

  Returns:
    A :class:`jaxprec.torch.PortReport`.

  Raises:
    ValueError: an unknown name (naming the choices); ``seed`` or
      ``layers`` with a :class:`jaxprec.torch.Port`.
    ImportError: PyTorch or transformers is missing (one line, with the
      install hint).

  Examples:
    >>> import jaxprec.torch
    >>> r = jaxprec.torch.port_check_builtin("hf-llama", layers=1)  # doctest: +SKIP
    >>> r.suspects(), r.alignment["layers/0/mlp"]  # doctest: +SKIP
    ([], 'layers.0.mlp')
  """
  if isinstance(port, torch_ports.Port):
    if seed != 0 or layers is not None:
      raise ValueError("port_check_builtin: seed and layers build a port "
                       "from its name; this Port is built already")
  else:
    port = torch_ports.port(port, seed, layers=layers)
  report = port_check_lib.port_check(
      port.model, port.torch_model, *port.inputs.values(),
      torch_inputs=port.torch_inputs(), precisions=precisions, target=target,
      alignment=port.alignment, layouts=port.layouts() or None,
      factor=factor, progress=progress)
  why = port.unpaired()
  notes = [f"{name} is not paired: {why[name]}"
           for name in report.unpaired_jax if name in why]
  notes += [f"{name} is not paired: the PyTorch model has no module "
            f"{name.replace('/', '.')!r}" for name in report.unpaired_jax
            if name not in why]
  return dataclasses.replace(report, notes=(*notes, *report.notes))
