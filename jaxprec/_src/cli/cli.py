"""The ``jaxprec`` command line, as ``docs/cli.md`` documents it.

Arguments are checked before any model runs; JAX is imported by the
commands, not by ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence

from jaxprec._src.cli import cli_inputs as inputs
from jaxprec._src.cli import cli_port
from jaxprec._src.cli import cli_sampler
from jaxprec._src.cli.cli_inputs import PYTORCH, Failure, UsageError
from jaxprec._src.core.version import install_hint
from jaxprec._src.torch import torch_ports

_PROG = "jaxprec"
# The names of jaxprec.models.MODELS (importing it imports Flax).
_MODELS = ("wav2vec2", "bert", "llama")
# What --modules reads, for check and search.
_MODULES = ("of the Flax model that FUNCTION returns as fn "
            "(jaxprec.check_module): an nnx.Module (args: its inputs), a "
            "linen Module or its .apply (args: the variables, then the "
            "inputs) or a linen Module bound to its variables (args: its "
            "inputs)")
# What FUNCTION() returns, said where a model is missing.
_FUNCTION_FORM = ("MODULE:FUNCTION for your own model (FUNCTION() returns "
                  "(fn, args) or (fn, args, kwargs), e.g. model.py:make)")


class _Help(argparse.HelpFormatter):
  """argparse's help, folded at spaces only (never inside ``hf-bert``)."""

  def _split_lines(self, text, width):
    return textwrap.wrap(" ".join(text.split()), width,
                         break_on_hyphens=False, break_long_words=False)

  def _fill_text(self, text, width, indent):
    return "\n".join(textwrap.wrap(
        " ".join(text.split()), width, initial_indent=indent,
        subsequent_indent=indent, break_on_hyphens=False,
        break_long_words=False))


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line and do not exit, and which
  takes an option by its whole name only (a prefix such as ``--mode`` would
  otherwise be read as ``--model``)."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", _Help)
    kwargs.setdefault("allow_abbrev", False)
    super().__init__(*args, **kwargs)

  def error(self, message: str):  # type: ignore[override]
    raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
  from jaxprec._src.core.version import __version__
  parser = _Parser(
      prog=_PROG,
      description="See, control and trust the precision of JAX matmuls and "
                  "convolutions.")
  parser.add_argument("--version", action="version",
                      version=f"%(prog)s {__version__}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")

  info = sub.add_parser(
      "info", help="show the precision in force and what it means",
      description="Shows the backend and devices, the precision in force and "
                  "its source, what it computes on TPU and GPU, how to change "
                  "it, and the pitfalls.")
  info.add_argument("--json", action="store_true", help="print JSON")
  info.set_defaults(handler=_info)

  audit = sub.add_parser(
      "audit", help="list a function's matmuls and convolutions",
      description="Imports MODULE (a module name, or a path to a .py file), "
                  "calls FUNCTION(), which takes no arguments and returns "
                  "(fn, args) or (fn, args, kwargs), and lists every matmul and "
                  "convolution of fn(*args, **kwargs) with its precision. fn is "
                  "traced, never run: jax.ShapeDtypeStruct arguments work.",
      epilog="example: jaxprec audit mymodel:audit_target --json")
  audit.add_argument("target", metavar="MODULE:FUNCTION",
                     help="e.g. mypkg.model:make or path/to/model.py:make")
  audit.add_argument("-p", "--precision", default=None,
                     help="trace with JAX's flag set to this precision, as "
                          "`jaxprec run -p` would (default: the one in force)")
  audit.add_argument("--json", action="store_true", help="print JSON")
  audit.set_defaults(handler=_audit)

  run = sub.add_parser(
      "run", help="run a command at a precision or policy",
      description="Runs CMD with JAX_DEFAULT_MATMUL_PRECISION set to PRECISION "
                  "(any spelling jaxprec.resolve accepts, written in JAX's "
                  "spelling) and exits with CMD's exit status. With --policy "
                  "POLICY instead, CMD gets the policy's canonical text in "
                  "JAXPREC_POLICY (its code reads it with "
                  "jaxprec.policy_from_env() for jaxprec.swap or "
                  "jaxprec.emulate), and JAX_DEFAULT_MATMUL_PRECISION too "
                  "when the "
                  "policy is one precision for everything.",
      epilog="examples: jaxprec run -p float32 -- python train.py --steps 10; "
             "jaxprec run --policy 'default=bf16,conv=float32' -- python "
             "serve.py")
  which = run.add_mutually_exclusive_group(required=True)
  which.add_argument("-p", "--precision",
                     help="e.g. float32, bf16, tf32, F32_F32_F32, "
                          "backend-default")
  which.add_argument("--policy",
                     help="a jaxprec policy, e.g. 'default=bfloat16,"
                          "conv=float32', passed to CMD in JAXPREC_POLICY "
                          "(see jaxprec search)")
  run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                   help="the command to run")
  run.set_defaults(handler=_run)

  check = sub.add_parser(
      "check", help="how far each layer drifts at each precision",
      description="Runs a model at a reference precision and at each precision "
                  "under test (emulating TPU or GPU numerics where the backend "
                  "is not the target, e.g. on CPU), compares every layer, "
                  "prints a table, and writes report.json and divergence.png "
                  "to --out. Give --model NAME for a built-in model, or "
                  "MODULE:FUNCTION, where FUNCTION() returns (fn, args) or "
                  "(fn, args, kwargs) and fn returns the hidden states (any "
                  "pytree of arrays); with --modules, fn is a Flax model "
                  "and every submodule's output is a layer. Progress goes "
                  "to stderr: a line per phase when it is not a terminal.",
      epilog="examples: jaxprec check --model wav2vec2; jaxprec check "
             "--model hf-llama --reference pytorch; jaxprec check "
             "mymodel:make --precisions bfloat16_3x --atol 1e-3 (exit 1 if "
             "exceeded); jaxprec check mymodel.py:model --modules "
             "--reference torch_ref.npz")
  check.add_argument("function", nargs="?", metavar="MODULE:FUNCTION",
                     help="e.g. mypkg.model:make or path/to/model.py:make")
  check.add_argument("--modules", action="store_true",
                     help="check the output of every submodule " + _MODULES)
  check.add_argument("--model", choices=(*_MODELS, *torch_ports.PORTS),
                     help="a built-in model (random weights, nothing "
                          "downloaded); hf-wav2vec2, hf-bert and hf-llama "
                          "are jaxprec's NNX ports of tiny transformers "
                          "PyTorch models, with their weights (needs torch "
                          "and transformers), for --reference pytorch")
  _add_shared(check)
  check.add_argument("--precisions", default=None,
                     help="comma-separated precisions to test, each "
                          "meaning what --target computes for it (default "
                          "on tpu bfloat16,bfloat16_3x,float32; on gpu "
                          "BF16_BF16_F32,tensorfloat32,TF32_TF32_F32_X3)")
  check.add_argument("--policy", action="append", default=None,
                     metavar="POLICY",
                     help="a policy row ('default=bfloat16_3x,encoder/.*="
                          "float32', as jaxprec search prints it), after the "
                          "--precisions rows (only the policies when "
                          "--precisions is not given); repeatable")
  check.add_argument("--reference", default="float32",
                     help="float32 (default), float64, another precision, "
                          "a .npz/.npy/.safetensors file of hidden states, "
                          "pytorch: the PyTorch original of --model "
                          "hf-wav2vec2, hf-bert or hf-llama, or "
                          "pytorch:MODULE:FUNCTION: FUNCTION() returns "
                          "(torch_model, args); with either pytorch form "
                          "the model is port-checked against it layer by "
                          "layer (exit 1 when a layer is a suspect)")
  check.add_argument("--target", default="tpu", type=str.lower,
                     choices=("tpu", "gpu"),
                     help="whose numerics to show (default tpu)")
  check.add_argument("--chip", default=None,
                     help="with --target gpu: a100, h100 or b200, the NVIDIA "
                          "chip whose tensor cores compute every row emulated "
                          "with GPU numerics (default: the algorithm's "
                          "definition; docs/gpu.md)")
  check.add_argument("--mode", default="auto", type=str.lower,
                     choices=("auto", "emulate", "native"),
                     help="auto (default): native on the target, emulated "
                          "elsewhere")
  check.add_argument("--atol", default=None,
                     help="absolute tolerance (default 1e-3); with --atol or "
                          "--rtol, exit 1 when a layer fails |err| <= atol + "
                          "rtol*|ref| (the table's '!'); one not given keeps "
                          "its default, as in jaxprec.check")
  check.add_argument("--rtol", default=None,
                     help="relative tolerance (default 1e-3; see --atol; "
                          "--rtol 0 gates on --atol alone)")
  check.add_argument("--full", action="store_true",
                     help="every metric in the table: max_abs, rel_rms and "
                          "req_atol per precision (default: req_atol, the "
                          "one the '!' reads); a port check lists every "
                          "unpaired PyTorch layer, those without parameters "
                          "too")
  check.add_argument("--json", action="store_true",
                     help="print the JSON report instead of the table")
  check.add_argument("--out", default="./jaxprec-report",
                     help="directory for report.json and divergence.png "
                          "(default ./jaxprec-report)")
  check.set_defaults(handler=_check)

  search = sub.add_parser(
      "search", help="find the cheapest per-layer precision within a tolerance",
      description="Searches for the cheapest precision policy (a precision "
                  "per Flax module path, from --candidates) whose every "
                  "output layer stays within --tolerance of float32, "
                  "emulating TPU or GPU numerics where the backend is not "
                  "the target. Prints the policy (the text jaxprec run "
                  "--policy and jaxprec.Policy.parse take), its cost relative "
                  "to float32, and the number of evaluations; one progress "
                  "line per evaluation goes to stderr. Exits 1 when no "
                  "policy meets the tolerance.",
      epilog="examples: jaxprec search --model wav2vec2 --tolerance 1e-3; "
             "jaxprec search mymodel:make --tolerance 30 --metric sqnr_db")
  search.add_argument("function", nargs="?", metavar="MODULE:FUNCTION",
                      help="e.g. mypkg.model:make or path/to/model.py:make "
                           "(as for check)")
  search.add_argument("--modules", action="store_true",
                      help="keep the output of every submodule within "
                           "--tolerance, not only fn's " + _MODULES)
  search.add_argument("--model", choices=_MODELS,
                      help="a built-in model (random weights, nothing "
                           "downloaded)")
  _add_shared(search)
  search.add_argument("--tolerance", required=True,
                      help="bound on --metric for every layer (sqnr_db: a "
                           "minimum; cosine: a bound on 1 - cosine)")
  search.add_argument("--metric", default="rel_rms",
                      help="rel_rms (default), max_abs, max_rel, cosine, "
                           "sqnr_db, ulp_median or ulp_max")
  search.add_argument("--candidates", default=None,
                      help="comma-separated precisions to choose from "
                           "(default bfloat16,bfloat16_3x,float32 for tpu; "
                           "tensorfloat32,TF32_TF32_F32_X3,float32 for gpu)")
  search.add_argument("--target", default="tpu", type=str.lower,
                     choices=("tpu", "gpu"),
                      help="whose numerics and costs (default tpu)")
  search.add_argument("--budget", type=int, default=None,
                      help="most evaluations (default 24)")
  search.add_argument("--json", action="store_true",
                      help="print the result as JSON")
  search.add_argument("--program-per-policy", action="store_true", help=(
      "compile a program per policy, not one for all (the same answers)"))
  search.add_argument("--prepare-weights", action="store_true",
                      help=argparse.SUPPRESS)  # removed: refused with why
  search.add_argument("--axes", default="precision",
                      help="what to choose per module: precision (default), "
                           "precision,dtype or dtype (the compute dtype)")
  search.add_argument("--dtypes", default=None,
                      help="with --axes ...dtype: comma-separated compute "
                           "dtypes to choose from (default bfloat16,float32)")
  search.add_argument("--chip", default=None,
                      help="with --axes ...dtype: the chip whose roofline "
                           "orders the costs (tpu-v4, tpu-v5e, tpu-v5p, a100, "
                           "h100; default tpu-v5e for tpu, h100 for gpu)")
  search.set_defaults(handler=_search)
  cli_sampler.add(sub, _write_outputs, _print_report)
  return parser


def _add_shared(parser: argparse.ArgumentParser) -> None:
  """The options of check and search that mean the same in both."""
  parser.add_argument("--size", choices=("tiny", "small", "base"),
                      default=None,
                      help="size of the built-in model (default tiny)")
  parser.add_argument("--seed", type=inputs.seed, default=0,
                      help="seed of the built-in model (default 0)")
  parser.add_argument("--no-cache", action="store_true",
                      help="do not use JAX's persistent compilation cache "
                           "(default: compiled programs are kept in "
                           "$JAXPREC_CACHE_DIR/jax-compilation, else "
                           "~/.cache/jaxprec/jax-compilation, and reused by "
                           "the next run)")


def _cache_on(ns: argparse.Namespace, stack: contextlib.ExitStack) -> None:
  """JAX's persistent compilation cache on until ``stack`` closes, unless
  --no-cache; a directory that cannot be created is a warning."""
  if ns.no_cache:
    return
  from jaxprec._src.emulation import compile_cache
  try:
    path = compile_cache.checked_dir(None)
  except ValueError as e:
    say("warning", f"compilation cache off: {inputs.one_line(e)}")
    return
  stack.enter_context(compile_cache.compilation_cache(path))


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the ``jaxprec`` command line.

  Args:
    argv: the arguments after the program name (default ``sys.argv[1:]``).

  Returns:
    The exit status: 0 on success, 2 for bad usage, 1 when the audited or
    checked code fails or a check exceeds its ``--atol``/``--rtol``, and the
    command's own status for ``run``.
  """
  streams = sys.stdout, sys.stderr
  if _on_terminal(sys.stderr):
    sys.stderr = _Fitted(sys.stderr, columns())
  try:
    status = _main(argv)
    sys.stdout.flush()  # here, where a reader that left is caught below
    sys.stderr.flush()
    return status
  except BrokenPipeError:  # `jaxprec info --json | head`: a reader left,
    # of stdout or of stderr, even while an error was said. Python would
    # fail flushing them at exit (a traceback, or exit status 120): point
    # both at /dev/null, and exit as a shell says SIGPIPE ended a process.
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in streams:
      with contextlib.suppress(OSError, ValueError):  # a closed stream
        os.dup2(devnull, stream.fileno())
    return 128 + 13
  finally:
    for fitted in (sys.stdout, sys.stderr):
      if isinstance(fitted, _Fitted):
        fitted.close()
    sys.stdout, sys.stderr = streams


def _main(argv: Sequence[str] | None) -> int:
  try:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = _parser().parse_args(inputs.join_negative_numbers(argv))
    # JSON is never folded, nor what goes to a pipe or a file (a log keeps
    # each message on its line, each layer name whole).
    if not getattr(ns, "json", False) and _on_terminal(sys.stdout):
      sys.stdout = _Fitted(sys.stdout, columns())
    if ns.command is None:
      raise UsageError("missing command: choose one of info, audit, run, "
                       "check, search, sampler (see jaxprec --help)")
    from jaxprec._src.emulation import kernels
    try:  # a bad JAXPREC_KERNEL is bad usage, for every command
      kernels.check_setting()
    except ValueError as e:
      raise UsageError(str(e)) from None
    with contextlib.ExitStack() as stack:  # ns.cache_on(): check, search
      ns.cache_on = lambda: _cache_on(ns, stack)
      # Cleared before anything else is printed, errors included.
      ns.status = stack.enter_context(_Status(f"{_PROG} {ns.command}"))
      stack.enter_context(_warnings_said(ns.status))
      return ns.handler(ns)
  except SystemExit as e:  # --help, --version, or the user's code exits
    # The status Python gives sys.exit(code): a code that is not an int or
    # None is printed, and is 1.
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
  except (UsageError, Failure) as e:
    original = getattr(e, "original", None)
    if original is not None and os.environ.get(inputs.TRACEBACK_VAR) == "1":
      import traceback  # noqa: PLC0415
      traceback.print_exception(type(original), original,
                                original.__traceback__, file=sys.stderr)
    say("error", e)
    return 2 if isinstance(e, UsageError) else 1
  except KeyboardInterrupt:  # Ctrl-C: one line, the shells' status for SIGINT
    print(f"{_PROG}: interrupted", file=sys.stderr)
    return 128 + 2


def say(kind: str, text: object) -> None:
  """Prints ``jaxprec: KIND: TEXT`` on stderr, one line (in :func:`main`, on
  a terminal, folded at spaces to :func:`columns`)."""
  print(f"{_PROG}: {kind}: {inputs.one_line(text)}", file=sys.stderr,
        flush=True)


def _on_terminal(stream) -> bool:
  """Whether ``stream`` is a terminal, whose width the output is folded to."""
  try:
    return stream.isatty()
  except (AttributeError, ValueError):  # a closed or a stream-like object
    return False


def columns() -> int:
  """The width the command's output fits on a terminal: ``$COLUMNS`` when
  set, else the terminal's, else 100."""
  return shutil.get_terminal_size((100, 24)).columns


def stdout_width() -> int | None:
  """:func:`columns` when standard output is a terminal; None in a pipe or a
  file, where nothing is fitted (a log keeps each line whole, for grep)."""
  return columns() if _on_terminal(sys.stdout) else None


class _Fitted:
  """A text stream that folds each line longer than ``width`` at spaces
  (:func:`render.fold`: a word is split only where it is longer than a line
  by itself, after a ``,`` or ``/``), the later parts indented two more
  than the line. Text with a carriage return or an escape sequence (a
  status line, a progress bar, rich's output, which fit themselves) passes
  as it is. Tables are fitted where they are drawn; this folds the prose."""

  def __init__(self, stream, width: int):
    self._stream = stream
    self._width = max(width, 20)
    self._pending = ""

  def write(self, text: str) -> int:
    if "\r" in text or "\x1b" in text:
      self._stream.write(self._pending)
      self._pending = ""
      return self._stream.write(text)
    self._pending += text
    *lines, self._pending = self._pending.split("\n")
    for line in lines:
      self._stream.write(self._fold(line) + "\n")
    return len(text)

  def _fold(self, line: str) -> str:
    if len(line) <= self._width:
      return line
    from jaxprec._src.checker import render  # noqa: PLC0415
    indent = " " * min(len(line) - len(line.lstrip(" ")) + 2, self._width // 2)
    return "\n".join(render.fold(line, self._width, indent))

  def close(self) -> None:
    """Writes what is left of the last line (the stream stays open)."""
    if self._pending:
      self._stream.write(self._fold(self._pending))
      self._pending = ""
    self._stream.flush()

  def __getattr__(self, name: str):  # flush, isatty, fileno, encoding, ...
    return getattr(self._stream, name)


@contextlib.contextmanager
def _warnings_said(status: "_Status"):
  """Every warning of the command as one ``jaxprec: warning:`` line, as the
  CLI says everything else: its category and message, and the file and line
  only where they are the user's (not jaxprec's, JAX's or Flax's)."""
  import warnings  # noqa: PLC0415
  old = warnings.showwarning

  def show(message, category, filename, lineno, file=None, line=None):
    del file, line
    status.clear()
    where = "" if inputs.library_file(filename) else f" ({filename}:{lineno})"
    say("warning", f"{category.__name__}: {message}{where}")

  warnings.showwarning = show
  try:
    yield
  finally:
    warnings.showwarning = old


class _Status:
  """A command's own phases on stderr (building the model), before those of
  the check or search: one line each when stderr is not a terminal (a CI
  log), else one status line rewritten in place and cleared before anything
  else is printed, so a terminal shows something from the start."""

  def __init__(self, command: str):
    self.command = command
    try:
      self.tty = bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced or closed
      self.tty = False
    self._shown = False
    self.t0 = time.perf_counter()

  def __enter__(self) -> _Status:
    return self

  def say(self, what: str, piped: bool = True) -> None:
    """Shows the phase ``what``; with ``piped=False`` only on a terminal."""
    if self.tty:
      sys.stderr.write(f"\r{self.command}: {what}...\033[K")
      sys.stderr.flush()
      self._shown = True
    elif piped:
      print(f"{self.command}: {what}", file=sys.stderr, flush=True)

  def line(self, what: str) -> None:
    """``what`` as a line of its own, on a terminal too."""
    self.clear()
    print(f"{self.command}: {what}", file=sys.stderr, flush=True)

  def clear(self) -> None:
    """Removes the status line of a terminal."""
    if self._shown:
      sys.stderr.write("\r\033[K")
      sys.stderr.flush()
      self._shown = False

  def __exit__(self, *exc) -> None:
    self.clear()


# ---------------------------------------------------------------------------
# Commands.


def _info(ns: argparse.Namespace) -> int:
  from jaxprec._src.inspect import explain
  print(json.dumps(explain.explain_dict(), indent=2) if ns.json
        else explain.explain())
  return 0


def _audit(ns: argparse.Namespace) -> int:
  p = (inputs.resolve(ns.precision, "--precision")
       if ns.precision is not None else None)
  fn, args, kwargs = inputs.call_target(ns.target)

  import jax
  from jaxprec._src.inspect import audit as audit_lib
  try:
    # JAX's flag, as `jaxprec run -p` sets it: under a preset the report
    # shows the convolutions JAX downgrades.
    with (contextlib.nullcontext() if p is None
          else jax.default_matmul_precision(p.flag)):
      report = audit_lib.audit(fn, *args, **kwargs)
  except TypeError as e:  # fn is not callable
    raise UsageError(f"{ns.target}(): {e}") from None
  except audit_lib.AuditError as e:
    raise Failure(str(e)) from None
  print(report.to_json() if ns.json else report.text(stdout_width()))
  hidden = audit_lib.unseen_modules(report)
  if hidden:
    say("warning", hidden)
  return 0


def _one_model(ns: argparse.Namespace, models: Sequence[str]) -> None:
  """Exactly one of --model and MODULE:FUNCTION (check, search)."""
  if ns.model is not None and ns.function is not None:
    raise UsageError(f"{ns.command} takes one model: --model {ns.model} or "
                     f"{ns.function}, not both")
  if ns.model is None and ns.function is None:
    raise UsageError(f"{ns.command} needs a model: --model NAME (one of "
                     f"{', '.join(models)}) or {_FUNCTION_FORM}")


def _model_or_target(ns: argparse.Namespace):
  """(fn, args, kwargs, description) from --model or MODULE:FUNCTION (check, search)."""
  if ns.model is not None:
    try:
      from jaxprec._src.models import builders
    except ImportError as e:
      raise Failure(f"--model needs Flax: {e}") from None
    try:  # a size the model does not come in: one line, before any phase
      builders.check_size(ns.model, ns.size)
    except ValueError as e:
      raise UsageError(f"--model {ns.model}: {inputs.one_line(e)}") from None
  ns.status.say(f"building model {ns.model} ({ns.size or 'tiny'})"
                if ns.model is not None else f"importing {ns.function}")
  if ns.model is not None:
    try:
      fn, args = builders.MODELS[ns.model](ns.size or "tiny", ns.seed)
    except ValueError as e:  # a size the model does not come in
      raise UsageError(f"--model {ns.model}: {inputs.one_line(e)}") from None
    kwargs: dict = {}
    what = f"{ns.model} ({ns.size or 'tiny'}, seed {ns.seed})"
  else:
    fn, args, kwargs = inputs.call_target(ns.function)
    what = ns.function
  if not callable(fn):
    raise UsageError(f"{ns.function}() returned a {type(fn).__name__} as fn, "
                     f"not a callable")
  return fn, args, kwargs, what


def _flax_module(fn, args: tuple, target: str):
  """``check --modules``: ``(module, args, method)`` for
  :func:`jaxprec.check_module` from FUNCTION()'s fn: an ``nnx.Module`` or
  a bound method of one, a linen ``Module`` (bound to its variables or
  not), a bound method of a bound one, or its ``apply`` (looked
  through ``jax.jit`` and ``functools.wraps``)."""
  try:
    import flax.linen as nn  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
  except ImportError as e:
    raise UsageError(f"--modules needs Flax: {e}") from None
  kinds = (nn.Module, nnx.Module)
  inner = fn
  while (not isinstance(inner, kinds)
         and not isinstance(getattr(inner, "__self__", None), kinds)
         and hasattr(inner, "__wrapped__")):
    inner = inner.__wrapped__
  owner = getattr(inner, "__self__", None)
  module, method = inner, None
  bound = isinstance(owner, nn.Module) and owner.scope is not None
  if isinstance(owner, nnx.Module) or bound:  # model.encode, bound linen
    module = owner
    method = None if inner.__name__ == "__call__" else inner.__name__
  elif isinstance(owner, nn.Module) and inner.__name__ == "apply":
    module = owner
  if isinstance(module, nn.Module) and module.scope is not None:
    return module, args, method  # bound: check_module takes its variables
  if isinstance(module, nn.Module):
    if not args or not isinstance(args[0], Mapping):
      raise UsageError(
          f"--modules: {target}() returned a linen {type(module).__name__}: "
          f"its args are the variables (a dict with 'params') and then the "
          f"inputs, e.g. return model, (variables, x); or return the model "
          f"bound to them: model.bind(variables), (x,)")
    return module, args, method
  if isinstance(module, nnx.Module):
    return module, args, method
  what = getattr(fn, "__qualname__", None) or type(fn).__name__
  raise UsageError(
      f"--modules: {target}() returned {what!r} as fn, not a Flax module, so "
      f"jaxprec cannot see its submodules; return the model itself: "
      f"(model, (x,)) for NNX (not a function that calls "
      f"nnx.merge(graphdef, state)), (model, (variables, x)), "
      f"(model.apply, (variables, x)) or (model.bind(variables), (x,)) for "
      f"linen")


def _check(ns: argparse.Namespace) -> int:
  ns.status.say("checking the arguments", piped=False)
  _one_model(ns, (*_MODELS, *torch_ports.PORTS))

  from jaxprec._src.checker import rows
  try:  # jaxprec.emulate's check and message
    ns.chip = rows.setting(ns.target, chip=ns.chip).chip
  except ValueError as e:
    raise UsageError(f"--chip: {e}") from None
  port = (cli_port.is_port_reference(ns.reference) or
          (ns.model in torch_ports.PORTS and ns.reference == PYTORCH))
  if port and ns.chip is not None:
    raise UsageError("--chip applies to a check against a precision or a "
                     "saved reference, not to a port check against PyTorch")
  if cli_port.is_port_reference(ns.reference):  # your port against PyTorch
    return cli_port.run(ns, _print_report, _write_outputs)
  if ns.modules and ns.model is not None:
    raise UsageError(f"--modules applies to MODULE:FUNCTION (your own Flax "
                     f"model); --model {ns.model} is checked at its hidden "
                     f"states")
  if ns.size is not None and ns.model not in _MODELS:
    raise UsageError(f"--size applies to --model {' or '.join(_MODELS)} only")
  if ns.model in torch_ports.PORTS and ns.reference == PYTORCH:
    return cli_port.run_builtin(ns, _print_report, _write_outputs)
  from jaxprec._src.checker import check as check_lib
  from jaxprec._src.checker import metrics
  from jaxprec._src.checker import reference as reference_lib
  from jaxprec._src.checker import render
  # check's own default: with an external reference it adds the float32 floor.
  policies = tuple(inputs.resolve(p, "--policy", policy=True)
                   for p in ns.policy or ())
  if ns.precisions is not None:
    precisions = inputs.precision_list(ns.precisions) + policies
  else:  # the policies alone, else check's default rows
    precisions = policies or None
  reference = ns.reference
  if reference == PYTORCH:
    if ns.model not in torch_ports.PORTS:
      what = ns.function if ns.model is None else f"--model {ns.model}"
      ports = " or ".join(torch_ports.PORTS)
      raise UsageError(f"--reference pytorch needs a model with a PyTorch "
                       f"twin: --model {ports} ({what} has none; for your "
                       f"own port, name the PyTorch original: --reference "
                       f"pytorch:MODULE:FUNCTION, docs/port-check.md)")
  elif inputs.is_reference_file(reference):
    inputs.check_reference_file(reference)
  elif reference.strip().lower() not in ("float64", "f64", "fp64", "double"):
    inputs.resolve(reference, "--reference")
  from jaxprec._src.checker import rows
  try:  # the rows, before the model is built: a row the target refuses
    setting = rows.setting(ns.target, ns.mode)
    computed = rows.is_computed(reference)
    rows.plans(precisions, setting, external=not computed)
    if computed:
      rows.reference_plan(reference, setting.target, setting.mode)
  except ValueError as e:
    raise UsageError(str(e)) from None
  enforce = ns.atol is not None or ns.rtol is not None
  tol = {"atol": check_lib.DEFAULT_ATOL, "rtol": check_lib.DEFAULT_RTOL}
  for name in tol:
    v = inputs.tolerance(getattr(ns, name), f"--{name}",
                         metrics.MAX_TOLERANCE)
    if v is not None:  # one not given keeps its default, as in check()
      tol[name] = v

  inputs.check_out(ns.out)
  ns.cache_on()  # after the arguments: bad usage writes nothing
  if ns.model in torch_ports.PORTS:
    twin = cli_port.build_port(ns)
    fn, args, kwargs = twin.fn, twin.args(), {}
    what = f"{ns.model} (jaxprec's NNX port, seed {ns.seed})"
  else:
    fn, args, kwargs, what = _model_or_target(ns)
  run = functools.partial(check_lib.check, fn)
  if ns.modules:
    module, args, method = _flax_module(fn, args, ns.function)
    run = functools.partial(check_lib.check_module, module, method=method)
    what = f"{what} (every submodule)"
  ns.status.clear()  # the check's own progress follows
  try:
    report = run(*args, precisions=precisions, reference=reference,
                 target=ns.target, mode=ns.mode, progress=True, **tol,
                 chip=ns.chip, **kwargs)
  except reference_lib.ReferenceMismatchError as e:
    hint = ("" if ns.modules or ns.function is None else
            "; a reference of every submodule (jaxprec.torch.capture(..., "
            "modules=...) and jaxprec.save_layers) is checked with --modules")
    raise UsageError(f"{e}{hint}") from None
  except BrokenPipeError:  # a reader of stdout or stderr left: main says so
    raise
  except Exception as e:  # noqa: BLE001 -- the user's code failed
    raise inputs.failed(f"checking {what} failed:", e) from None
  if ns.json:
    print(report.to_json())
  else:
    print(f"model: {what}")
    _print_report(report, ns.full)
  _write_outputs(report, ns.out)
  failed = [] if not enforce else [
      f"{p}: {f.layer} needs atol >= {render.at_least(f.value)}"
      for p, f in report.first_divergence().items() if f is not None]
  if failed:
    raise Failure(f"outside atol={tol['atol']:g} rtol={tol['rtol']:g}: "
                  + "; ".join(failed))
  return 0


def _write_outputs(report, out: str, png_name: str = inputs.OUT_FILES[1]
                   ) -> None:
  """Writes ``report.json`` and the plot (``divergence.png``) into ``out``
  (process 0 alone in a multi-process run); a plot that fails is a warning.

  Raises:
    Failure: ``out`` cannot be written.
  """
  from jaxprec._src.jaxpr import compat
  if compat.process_index() != 0:
    return
  json_path, png = (os.path.join(out, name)
                    for name in (inputs.OUT_FILES[0], png_name))
  try:
    os.makedirs(out, exist_ok=True)
    if os.path.lexists(png):
      os.remove(png)
    with open(json_path, "w", encoding="utf-8") as f:
      f.write(report.to_json() + "\n")
  except OSError as e:
    raise Failure(f"cannot write to {out!r}: {e}") from None
  try:
    report.plot(png)
  except ImportError:
    say("note", f"{png_name} not written: matplotlib is not installed "
                f"({install_hint('plots')})")
    return
  except Exception as e:  # noqa: BLE001 -- the report is written: say so
    with contextlib.suppress(OSError):
      os.remove(png)
    say("warning", f"{png_name} not written ({type(e).__name__}: "
                   f"{inputs.one_line(e)}); report.json is written")
    return
  print(f"wrote {json_path} and {png}", file=sys.stderr)


def _print_report(report, full: bool = False) -> None:
  """A report of any comparison: fitted to the terminal, or as wide as it
  needs in a pipe or a file (a log keeps each line whole, for grep)."""
  if sys.stdout.isatty():
    try:
      from rich.console import Console
    except ImportError:
      pass
    else:
      Console().print(report.rich(full))
      return
  print(report.table(full, width=stdout_width()))


def _run(ns: argparse.Namespace) -> int:
  policy = (None if ns.policy is None
            else inputs.resolve(ns.policy, "--policy", policy=True))
  cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
  if not cmd:
    raise UsageError(
        "run needs a command, e.g. jaxprec run -p float32 -- python train.py")
  from jaxprec._src.cli import cli_run
  # Each form sets JAX's flag and JAXPREC_POLICY: nothing inherited applies.
  env = (cli_run.environment(
             precision=inputs.resolve(ns.precision, "--precision"))
         if policy is None else cli_run.environment(policy=policy))
  try:
    child = cli_run.start(cmd, env)
  except FileNotFoundError:
    say("error", f"command not found: {cmd[0]}")
    return 127
  except PermissionError:
    say("error", f"permission denied: {cmd[0]}")
    return 126
  return cli_run.wait(child)  # SIGTERM, SIGINT, SIGHUP forwarded


def _search(ns: argparse.Namespace) -> int:
  if ns.prepare_weights:
    raise UsageError("--prepare-weights was removed (it did not pay back "
                     "within a search's evaluations); drop the flag")
  _one_model(ns, _MODELS)
  ns.tolerance = inputs.number(ns.tolerance, "--tolerance")
  if ns.size is not None and ns.model is None:
    raise UsageError("--size applies to --model only")
  from jaxprec._src.search import search as search_lib
  from jaxprec._src.search import search_dtype
  candidates = (None if ns.candidates is None
                else inputs.comma_list(ns.candidates, "--candidates"))
  budget = search_lib.DEFAULT_BUDGET if ns.budget is None else ns.budget
  axes = {"axes": ns.axes, "dtypes": ns.dtypes, "chip": ns.chip}
  try:  # the arguments, before the model is built
    if "dtype" not in search_dtype.check_axes(ns.axes) and (
        ns.dtypes is not None or ns.chip is not None):
      raise UsageError("--dtypes and --chip apply to --axes with dtype, "
                       "e.g. --axes precision,dtype")
    search_lib.check_arguments(tolerance=ns.tolerance, metric=ns.metric,
                               candidates=candidates, target=ns.target,
                               budget=budget, **axes)
  except (ValueError, TypeError) as e:
    raise UsageError(str(e)) from None
  if ns.modules and ns.model is not None:
    raise UsageError(f"--modules applies to MODULE:FUNCTION (your own Flax "
                     f"model); --model {ns.model} is searched at its hidden "
                     f"states")
  ns.cache_on()
  fn, args, kwargs, what = _model_or_target(ns)
  if ns.modules:  # every submodule's output a layer, as check --modules
    from jaxprec._src.checker import check as check_lib
    module, args, method = _flax_module(fn, args, ns.function)
    try:
      fn, _, args = check_lib.module_outputs(module, args, kwargs,
                                             method=method)
    except (TypeError, ValueError) as e:
      raise UsageError(f"--modules: {inputs.one_line(e)}") from None
    what = f"{what} (every submodule)"
  ns.status.line("tracing, the reference at float32, then a line per "
                 "evaluation")
  import warnings
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", UserWarning)
      result = search_lib.search_policy(
          fn, *args, tolerance=ns.tolerance, metric=ns.metric,
          candidates=candidates, target=ns.target, budget=budget, **axes,
          compile_once=not ns.program_per_policy, **kwargs)
  except BrokenPipeError:  # a reader of stdout or stderr left: main says so
    raise
  except Exception as e:  # noqa: BLE001 -- the user's code failed
    raise inputs.failed(f"searching {what} failed:", e) from None
  for w in caught:
    say("warning", w.message)
  if ns.json:
    print(result.to_json())
  else:
    print(f"model: {what}")
    print(result)
  if not result.meets_tolerance:
    raise Failure(f"no policy met the tolerance ({result.metric} "
                  f"{ns.tolerance:g}); the printed policy is the fallback")
  return 0
