"""Shadow mode within JAX: ``check_module(..., shadow=True)``.

Each submodule runs alone, at each precision, on the input it received in a
float32 run of the whole model, and is compared with its float32 output on
that input: the *local* error of each layer, which a later layer does not
inherit (a propagated table shows every layer after the first that drifts
drifting too). The pairs of layers with PyTorch are
:func:`jaxprec.torch.port_check`'s; this is the same measurement against
float32 JAX.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxprec._src.checker import harness
from jaxprec._src.checker import metrics as metrics_lib
from jaxprec._src.checker import port_check
from jaxprec._src.checker import progress as progress_lib
from jaxprec._src.checker import report as report_lib
from jaxprec._src.checker import rows
from jaxprec._src.checker.report import DivergenceReport, LayerResult
from jaxprec._src.emulation import kernels
from jaxprec._src.jaxpr import compat


def check_module_shadow(module: Any, args: tuple, kwargs: dict, *,
                        method: str | None, capture: Any, precisions: Any,
                        reference: Any, target: str, mode: str, atol: float,
                        rtol: float, chip: str | None = None,
                        tpu_matvec_f32: bool = True,
                        progress: bool = False) -> DivergenceReport:
  """:func:`jaxprec.check_module` with ``shadow=True`` (see there)."""
  import flax.linen as nn  # noqa: PLC0415 -- Flax only when in use
  if method is not None or capture is not True:
    raise ValueError("check_module(shadow=True) runs each submodule's "
                     "__call__ alone: method= and capture= are not "
                     "supported with it")
  if not (isinstance(reference, str) and reference.strip().lower()
          in ("float32", "f32", "fp32")):
    raise ValueError(f"check_module(shadow=True) compares each layer with "
                     f"float32 JAX on the same input; reference={reference!r} "
                     f"is not supported with it (use reference='float32')")
  setting = rows.setting(target, mode, chip, tpu_matvec_f32)
  target, mode, chip = setting.target, setting.mode, setting.chip
  atol = metrics_lib.check_tolerance("atol", atol)
  rtol = metrics_lib.check_tolerance("rtol", rtol)
  plans = rows.plans(precisions, setting)
  if isinstance(module, nn.Module):
    if not args or not isinstance(args[0], Mapping):
      raise TypeError("check_module(linen_module, variables, *inputs): the "
                      "variables (a dict with 'params') come first")
    variables = {k: v for k, v in args[0].items() if k != "intermediates"}
    model, inputs = (module, variables), args[1:]
  else:
    model, inputs = module, args
  jax_side = port_check.JaxModel(model, tuple(inputs), dict(kwargs))
  if jax_side.kind == "function":
    raise TypeError(f"check_module expects a Flax module (flax.linen or "
                    f"flax.nnx); got {type(module).__name__}")
  f32 = rows.native_float32()
  with progress_lib.Phases(2 + len(plans), "jaxprec check_module(shadow)",
                           progress) as bar:
    bar.update("the float32 run: each layer's input")
    found = jax_side.layers(f32.wrap)
    notes = ["shadow: each layer ran alone on the input it received in a "
             "float32 run, against its float32 output on that input (local "
             "error; not inherited from earlier layers)"]
    if jax_side.inside_transforms:
      notes.append(f"not checked: {', '.join(jax_side.inside_transforms)}, "
                   f"called inside a JAX transform (a scan, a jit, a remat), "
                   f"whose values cannot be taken out of its trace")
    notes += jax_side.native_notes(plans)
    bar.update(f"{len(found)} layers alone at float32", advance=1)
    ref = _alone(found, f32.wrap, "float32", notes)
    found = [l for l in found if l.name in ref]
    results = {}
    for i, p in enumerate(plans, 1):
      bar.update(f"{len(found)} layers alone at {p.label} ({i}/"
                 f"{len(plans)})", advance=1)
      results[p.label] = _alone(found, p.wrap, p.label, notes)
    bar.finish()
  layers = []
  for l in found:
    metrics = {}
    for p in plans:
      got = results[p.label].get(l.name)
      metrics[p.label] = (
          _compare(got, ref[l.name], atol, rtol) if got is not None else
          _compare([np.full(x.shape, np.nan) for x in ref[l.name]],
                   ref[l.name], atol, rtol))
    layers.append(LayerResult(name=l.name, shape=l.out_shapes[0],
                              dtype="float32", metrics=metrics))
  if layers and all(l.empty for l in layers):  # as check_module without shadow
    harness.comparable(f"{type(module).__name__}.__call__",
                       [l.name for l in layers], [l.shape for l in layers])
  notes += report_lib.empty_notes(layers)
  return DivergenceReport(
      layers=tuple(layers), precisions=tuple(p.label for p in plans),
      reference="float32", target=target, mode=mode,
      backend=compat.backend_platform(), atol=atol, rtol=rtol,
      numerics={**{p.label: p.description for p in plans},
                "(reference)": f"{f32.description}, each layer on its own "
                               f"float32 input"},
      notes=tuple(dict.fromkeys(notes)),
      kernel=kernels.current_kernel().to_dict(), chip=chip)


def _compare(candidate: list[Any], reference: list[Any], atol: float,
             rtol: float) -> metrics_lib.LayerMetrics:
  c = np.concatenate([np.asarray(x, np.float32).ravel() for x in candidate])
  r = np.concatenate([np.asarray(x, np.float32).ravel() for x in reference])
  return metrics_lib.compare(c, r, atol=atol, rtol=rtol)


def _alone(found: list[Any], wrap: Any, label: str, notes: list[str]
           ) -> dict[str, list[np.ndarray]]:
  """Layer name -> its outputs alone on its own float32 input, computed as
  ``wrap`` computes: all layers in one program, else one by one (a layer
  that cannot run alone is left out, and named in ``notes``)."""
  calls = [(l.alone, l.inputs) for l in found]
  try:
    return dict(zip([l.name for l in found],
                    port_check.run_alone(calls, wrap)))
  except Exception:  # noqa: BLE001 -- find the layer, below
    pass
  out = {}
  for l, call in zip(found, calls):
    try:
      out[l.name], = port_check.run_alone([call], wrap)
    except Exception as e:  # noqa: BLE001 -- said in the report
      notes.append(f"{l.name} could not run alone ({label}): "
                   f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
  return out

