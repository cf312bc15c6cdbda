"""The ``jaxprec`` command line: ``info``, ``audit`` and ``run``.

* ``jaxprec info [--json]``: the precision in force and what it means
  (:func:`jaxprec.explain`).
* ``jaxprec audit [-p P] [--json] MODULE:FUNCTION``: imports ``MODULE`` (or a
  file ``path/to/file.py``), calls ``FUNCTION()``, which takes no arguments and
  returns ``(fn, args)`` or ``(fn, args, kwargs)``, and prints
  :func:`jaxprec.audit` of ``fn(*args, **kwargs)``.
* ``jaxprec run -p P -- CMD ...``: runs ``CMD`` with
  ``JAX_DEFAULT_MATMUL_PRECISION`` set to ``P`` (in JAX's spelling) and exits
  with its exit code.

Bad usage prints one line, ``jaxprec: error: ...``, to stderr and exits 2.
JAX is imported by the commands, not by ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

_PROG = "jaxprec"


class _UsageError(Exception):
  """Bad usage: printed as one line, exit status 2."""


class _Failure(Exception):
  """The user's code failed: printed as one line, exit status 1."""


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line and do not exit."""

  def error(self, message: str):  # type: ignore[override]
    raise _UsageError(message)


def _version() -> str:
  from jaxprec import __version__
  return __version__


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog=_PROG,
      description="See, control and trust the precision of JAX matmuls and "
                  "convolutions.")
  parser.add_argument("--version", action="version",
                      version=f"%(prog)s {_version()}")
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
      "run", help="run a command at a precision",
      description="Runs CMD with JAX_DEFAULT_MATMUL_PRECISION set to PRECISION "
                  "(any spelling jaxprec.resolve accepts, written in JAX's "
                  "spelling) and exits with CMD's exit status.",
      epilog="example: jaxprec run -p float32 -- python train.py --steps 10")
  run.add_argument("-p", "--precision", required=True,
                   help="e.g. float32, bf16, tf32, F32_F32_F32, backend-default")
  run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                   help="the command to run")
  run.set_defaults(handler=_run)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the ``jaxprec`` command line.

  Args:
    argv: the arguments after the program name (default ``sys.argv[1:]``).

  Returns:
    The exit status: 0 on success, 2 for bad usage, 1 when the audited code
    fails, and the command's own status for ``run``.
  """
  try:
    ns = _parser().parse_args(argv)
    if ns.command is None:
      raise _UsageError("missing command: choose one of info, audit, run "
                        "(see jaxprec --help)")
    return ns.handler(ns)
  except _UsageError as e:
    print(f"{_PROG}: error: {_one_line(e)}", file=sys.stderr)
    return 2
  except _Failure as e:
    print(f"{_PROG}: error: {_one_line(e)}", file=sys.stderr)
    return 1
  except SystemExit as e:  # --help and --version
    return e.code if isinstance(e.code, int) else 0


def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split())


# ---------------------------------------------------------------------------
# Commands.


def _info(ns: argparse.Namespace) -> int:
  from jaxprec._src import explain
  if ns.json:
    print(json.dumps(explain.explain_dict(), indent=2))
  else:
    print(explain.explain())
  return 0


def _resolve(value: str):
  from jaxprec._src.precision import resolve
  try:
    return resolve(value)
  except ValueError as e:
    raise _UsageError(str(e)) from None


def _audit(ns: argparse.Namespace) -> int:
  p = _resolve(ns.precision) if ns.precision is not None else None
  factory = _load(ns.target)
  try:
    made = factory()
  except Exception as e:  # noqa: BLE001 -- reported as one line
    raise _Failure(f"{ns.target}() raised {type(e).__name__}: {e}") from None
  if (not isinstance(made, tuple) or len(made) not in (2, 3)
      or not isinstance(made[1], (tuple, list))
      or (len(made) == 3 and not isinstance(made[2], dict))):
    raise _UsageError(
        f"{ns.target}() must return (fn, args) or (fn, args, kwargs) with args "
        f"a tuple and kwargs a dict; got {_describe(made)}")
  fn, args = made[0], tuple(made[1])
  kwargs = made[2] if len(made) == 3 else {}

  import jax
  from jaxprec._src import audit as audit_lib
  try:
    if p is None:
      report = audit_lib.audit(fn, *args, **kwargs)
    else:
      # JAX's flag, as `jaxprec run -p` sets it: under a preset the report
      # shows the convolutions JAX downgrades.
      with jax.default_matmul_precision(p.flag):
        report = audit_lib.audit(fn, *args, **kwargs)
  except TypeError as e:  # fn is not callable
    raise _UsageError(f"{ns.target}(): {e}") from None
  except audit_lib.AuditError as e:
    raise _Failure(str(e)) from None
  print(report.to_json() if ns.json else str(report))
  return 0


def _describe(x: Any) -> str:
  if isinstance(x, tuple):
    return f"a tuple of {len(x)} ({', '.join(type(v).__name__ for v in x)})"
  return f"{type(x).__name__}"


def _load(target: str):
  """The callable named by ``MODULE:FUNCTION`` or ``path/file.py:FUNCTION``."""
  module_part, sep, attr = target.rpartition(":")
  if not sep or not module_part or not attr or not all(
      s.isidentifier() for s in attr.split(".")):
    raise _UsageError(
        f"expected MODULE:FUNCTION or path/to/file.py:FUNCTION, got {target!r}")
  # Like `python -m`: the current directory comes first on sys.path.
  cwd = os.getcwd()
  if cwd not in sys.path and "" not in sys.path:
    sys.path.insert(0, cwd)
  is_path = (module_part.endswith(".py") or "/" in module_part
             or os.sep in module_part)
  try:
    module = _import_path(module_part) if is_path else importlib.import_module(
        module_part)
  except _UsageError:
    raise
  except Exception as e:  # noqa: BLE001 -- import errors are usage errors
    raise _UsageError(
        f"cannot import {module_part!r}: {type(e).__name__}: {e}") from None
  obj: Any = module
  for name in attr.split("."):
    if not hasattr(obj, name):
      raise _UsageError(f"{module_part!r} has no attribute {attr!r}")
    obj = getattr(obj, name)
  if not callable(obj):
    raise _UsageError(f"{target} is not callable (it is a {type(obj).__name__})")
  return obj


def _import_path(path: str):
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise _UsageError(f"no such file: {path}")
  name = os.path.splitext(os.path.basename(path))[0]
  # Like `python file.py`: the file's directory is importable.
  directory = os.path.dirname(path)
  if directory not in sys.path:
    sys.path.insert(0, directory)
  loaded = sys.modules.get(name)
  if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
    name = f"_jaxprec_audit_{name}"  # Never shadow an imported module (json.py).
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise _UsageError(f"cannot import {path!r}: not a Python file")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    sys.modules.pop(name, None)
    raise
  return module


def _run(ns: argparse.Namespace) -> int:
  p = _resolve(ns.precision)
  cmd = list(ns.cmd)
  if cmd and cmd[0] == "--":
    cmd = cmd[1:]
  if not cmd:
    raise _UsageError(
        "run needs a command, e.g. jaxprec run -p float32 -- python train.py")
  from jaxprec._src import env as env_lib
  env = env_lib.env_for(p)
  try:
    proc = subprocess.Popen(cmd, env=env)
  except FileNotFoundError:
    print(f"{_PROG}: error: command not found: {cmd[0]}", file=sys.stderr)
    return 127
  except PermissionError:
    print(f"{_PROG}: error: permission denied: {cmd[0]}", file=sys.stderr)
    return 126
  with proc:
    while True:
      try:
        rc = proc.wait()
        break
      except KeyboardInterrupt:
        continue  # The child got the SIGINT too; report how it ends.
  return 128 - rc if rc < 0 else rc  # Killed by signal N: 128 + N, as shells do.
