"""``jaxprec check MODULE:FUNCTION --reference pytorch:MODULE:FUNCTION``.

The port check of the command line (:func:`jaxprec.torch.port_check`): the
first FUNCTION returns the JAX model and its inputs, the second the PyTorch
model and its inputs; the table of suspects is printed, ``report.json`` and
``divergence.png`` are written to ``--out``, and the exit status is 1 when a
layer is a suspect at any row. ``jaxprec check --model hf-llama --reference
pytorch`` (and ``hf-bert``, ``hf-wav2vec2``) is the same check of a built-in
port (:func:`jaxprec.torch.port_check_builtin`).
"""

from __future__ import annotations

import argparse

from jaxprec._src.cli import cli_inputs as inputs
from jaxprec._src.cli.cli_inputs import Failure, UsageError

PREFIX = "pytorch:"
DEFAULT_ROWS = ("float32", "bfloat16")


def is_port_reference(reference: str) -> bool:
  """Whether ``--reference`` names a PyTorch model factory
  (``pytorch:MODULE:FUNCTION``)."""
  return reference.startswith(PREFIX)


def _other_options(ns: argparse.Namespace, model: bool) -> list[str]:
  """The flags given that a port check has no use for."""
  return [flag for flag, on in (
      ("--model", model and ns.model is not None), ("--modules", ns.modules),
      ("--policy", bool(ns.policy)), ("--atol", ns.atol is not None),
      ("--rtol", ns.rtol is not None), ("--mode", ns.mode != "auto"),
      ("--size", getattr(ns, "size", None) is not None)) if on]


def _do(given: list[str]) -> str:
  """``'does'`` for one option, ``'do'`` for more."""
  return "does" if len(given) == 1 else "do"


def _refuse_other_options(ns: argparse.Namespace) -> None:
  given = _other_options(ns, model=True)
  if given:
    raise UsageError(
        f"--reference {PREFIX}MODULE:FUNCTION checks MODULE:FUNCTION's model "
        f"against its PyTorch original layer by layer (jaxprec.torch."
        f"port_check); {', '.join(given)} {_do(given)} not apply to it (its verdict is "
        f"the suspect rule, its rows are emulated on --target)")
  if ns.function is None:
    raise UsageError(f"--reference {PREFIX}MODULE:FUNCTION needs the JAX "
                     f"model: jaxprec check MODULE:FUNCTION --reference "
                     f"{PREFIX}MODULE:FUNCTION")


def _jax_model(fn, args: tuple):
  """``(jax_model, inputs)`` for port_check from FUNCTION()'s ``(fn,
  args)``: an NNX module and its inputs; a linen module (or its ``apply``)
  with the variables first; any other callable and its inputs."""
  try:
    import flax.linen as nn  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
  except ImportError:
    return fn, args
  owner = getattr(fn, "__self__", None)
  if isinstance(owner, nn.Module) and fn.__name__ == "apply":
    fn = owner
  if isinstance(fn, nn.Module):
    if not args or not isinstance(args[0], dict):
      raise UsageError(
          f"a linen {type(fn).__name__}: its args are the variables (a dict "
          f"with 'params') and then the inputs, e.g. return model, "
          f"(variables, x)")
    return (fn, args[0]), args[1:]
  if isinstance(fn, nnx.Module) or callable(fn):
    return fn, args
  raise UsageError(f"the JAX FUNCTION returned a {type(fn).__name__} as fn, "
                   f"not a model or a callable")


def run(ns: argparse.Namespace, print_table, write_outputs) -> int:
  """The port check of ``jaxprec check``; 1 when a layer is a suspect."""
  _refuse_other_options(ns)
  torch_target = ns.reference[len(PREFIX):]
  if not torch_target.strip():
    raise UsageError(f"--reference {PREFIX} names no PyTorch model factory: "
                     f"--reference {PREFIX}MODULE:FUNCTION")
  precisions = (inputs.precision_list(ns.precisions)
                if ns.precisions is not None else DEFAULT_ROWS)
  inputs.check_out(ns.out)
  ns.cache_on()
  from jaxprec._src.checker import port_check  # noqa: PLC0415
  from jaxprec._src.torch import torch_ref  # noqa: PLC0415
  try:
    torch_ref.import_torch()
  except ImportError as e:
    raise UsageError(f"--reference {ns.reference}: {inputs.one_line(e)}"
                     ) from None
  ns.status.say(f"importing {ns.function}")
  fn, args, kwargs = inputs.call_target(ns.function)
  jax_model, jax_inputs = _jax_model(fn, args)
  ns.status.say(f"importing {torch_target}")
  torch_model, torch_args, torch_kwargs = inputs.call_target(torch_target)
  ns.status.clear()  # the port check's own progress follows
  try:
    report = port_check.port_check(
        jax_model, torch_model, *jax_inputs, torch_inputs=torch_args,
        kwargs=kwargs, torch_kwargs=torch_kwargs, precisions=precisions,
        target=ns.target, progress=True)
  except (TypeError, ValueError) as e:  # bad models, pins, pairing
    raise UsageError(inputs.one_line(e)) from None
  except BrokenPipeError:
    raise
  except Exception as e:  # noqa: BLE001 -- the user's code failed
    raise inputs.failed(f"checking {ns.function} against {torch_target} "
                        f"failed:", e) from None
  return _finish(ns, report,
                 f"{ns.function} against the PyTorch {torch_target}",
                 print_table, write_outputs)


def build_port(ns: argparse.Namespace):
  """The built-in port ``--model`` names (``torch_ports.Port``, seed
  ``--seed``); without PyTorch or transformers, exit 2 with one line and a
  hint."""
  from jaxprec._src.torch import torch_ports  # noqa: PLC0415
  try:
    torch_ports.require()
  except ImportError as e:
    raise UsageError(f"--model {ns.model}: {inputs.one_line(e)}") from None
  ns.status.say(f"building model {ns.model}")
  try:
    return torch_ports.port(ns.model, ns.seed)
  except ImportError as e:
    raise UsageError(f"--model {ns.model}: {inputs.one_line(e)}") from None


def run_builtin(ns: argparse.Namespace, print_table, write_outputs) -> int:
  """``jaxprec check --model hf-... --reference pytorch``: the port check
  of a built-in port; 1 when a layer is a suspect."""
  given = _other_options(ns, model=False)
  if given:
    raise UsageError(
        f"--model {ns.model} --reference pytorch checks jaxprec's port "
        f"against its PyTorch original layer by layer (jaxprec.torch."
        f"port_check_builtin); {', '.join(given)} {_do(given)} not apply to it (its "
        f"verdict is the suspect rule, its rows are emulated on --target)")
  precisions = (inputs.precision_list(ns.precisions)
                if ns.precisions is not None else DEFAULT_ROWS)
  inputs.check_out(ns.out)
  ns.cache_on()
  from jaxprec._src.checker import port_builtin  # noqa: PLC0415
  port = build_port(ns)
  ns.status.clear()  # the port check's own progress follows
  try:
    report = port_builtin.port_check_builtin(
        port, precisions=precisions, target=ns.target, progress=True)
  except BrokenPipeError:
    raise
  except Exception as e:  # noqa: BLE001 -- the port or PyTorch failed
    raise inputs.failed(f"checking {ns.model} against PyTorch failed:",
                        e) from None
  return _finish(ns, report,
                 f"{ns.model} (jaxprec's NNX port, seed {ns.seed}) against "
                 f"the PyTorch {type(port.torch_model).__name__}",
                 print_table, write_outputs)


def _finish(ns: argparse.Namespace, report, what: str, print_table,
            write_outputs) -> int:
  """Prints the report (JSON with --json), writes --out, and raises a
  Failure naming the suspects, if any."""
  ns.status.clear()
  if ns.json:
    print(report.to_json())
  else:
    print(f"model: {what}")
    print_table(report, ns.full)
  write_outputs(report, ns.out)
  suspects = {p: report.suspects(p) for p in report.precisions}
  found = [f"{p}: {', '.join(s)}" for p, s in suspects.items() if s]
  if found:
    raise Failure("suspects (the port differs from PyTorch beyond what "
                  "float32 and the precision explain) at " + "; ".join(found))
  return 0
