"""What the ``jaxprec`` command line reads: ``MODULE:FUNCTION`` targets,
reference files, ``--out``, ``--seed`` and ``--precisions``, checked before
any model is built.

Errors: :class:`UsageError` (one line, exit 2) and :class:`Failure` (the
user's code failed: one line, exit 1).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import tempfile
from typing import Any

# `check --reference pytorch`: the PyTorch twin of the --model.
PYTORCH = "pytorch"


class UsageError(Exception):
  """Bad usage: printed as one line, exit status 2."""


class Failure(Exception):
  """The user's code failed: printed as one line, exit status 1.

  ``original``: the user's exception, whose traceback ``JAXPREC_TRACEBACK=1``
  prints (:func:`failed`)."""

  original: BaseException | None = None


# Set to 1, the command prints the traceback of the user's exception before
# its one line.
TRACEBACK_VAR = "JAXPREC_TRACEBACK"


def failed(what: str, e: BaseException) -> Failure:
  """The :class:`Failure` of the user's code raising ``e``: one line with
  ``what``, the exception, and where in the user's own files it was raised
  (the innermost frame outside jaxprec, JAX, Flax, NumPy and Python), and
  how to see the whole traceback (unless :data:`TRACEBACK_VAR` shows it)."""
  import traceback  # noqa: PLC0415
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if not library_file(f.filename)]
  where = (f" (at {frames[-1].filename}:{frames[-1].lineno} in "
           f"{frames[-1].name})" if frames else "")
  hint = ("" if os.environ.get(TRACEBACK_VAR) == "1"  # printed above it
          else f"; {TRACEBACK_VAR}=1 shows the traceback")
  f = Failure(f"{what} {type(e).__name__}: {e}{where}{hint}")
  f.original = e
  return f


def library_file(filename: str) -> bool:
  """Whether ``filename`` is jaxprec's, JAX's, Flax's, NumPy's, PyTorch's or
  Python's own (not the user's)."""
  import sys  # noqa: PLC0415
  path = os.path.abspath(str(filename))
  roots = [os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))),  # the jaxprec package
           os.path.dirname(os.path.abspath(os.__file__))]  # the stdlib
  for name in ("jax", "jaxlib", "flax", "numpy", "torch", "transformers"):
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__file__", None):
      roots.append(os.path.dirname(os.path.abspath(mod.__file__)))
  return "<" in str(filename) or any(path.startswith(r + os.sep)
                                     for r in roots)


# A built-in model's seed seeds both NumPy and jax.random.key, which takes
# 32-bit seeds without 64-bit types: 0 to 2**32 - 1.
MAX_SEED = 2**32 - 1


def seed(text: str) -> int:
  """``--seed``: an integer from 0 to :data:`MAX_SEED` (an argparse type:
  anything else is one error line and exit 2)."""
  import argparse  # noqa: PLC0415
  try:
    value = int(text)
  except ValueError:
    value = -1
  if not 0 <= value <= MAX_SEED:
    raise argparse.ArgumentTypeError(
        f"invalid seed {text!r}: an integer from 0 to {MAX_SEED}")
  return value


def comma_list(text: str, flag: str) -> tuple[str, ...]:
  """The items of ``flag``'s comma-separated ``text``; none is bad usage."""
  items = tuple(p.strip() for p in text.split(",") if p.strip())
  if not items:
    raise UsageError(f"{flag} is empty; e.g. {flag} bfloat16,float32")
  return items


def resolve(text: str, flag: str, policy: bool = False):
  """A precision, or with ``policy`` a Policy (a policy string or one
  precision), from the text of option ``flag``; bad usage naming ``flag``
  when it names none, its list of valid names cut short
  (:func:`jaxprec._src.core.names.short_invalid_message`)."""
  from jaxprec._src.core import names
  from jaxprec._src.core.precision import resolve as resolve_precision
  from jaxprec._src.policy.policy import as_policy
  try:
    return as_policy(text) if policy else resolve_precision(text)
  except ValueError as e:
    raise UsageError(f"{flag}: {names.short_invalid_message(str(e))}"
                     ) from None


def precision_list(text: str) -> tuple[str, ...]:
  """``check --precisions``: comma-separated precisions, each named once.

  One precision under two spellings (``bf16,bfloat16``) is a repeat too: the
  same row twice. Raises :class:`UsageError` for an empty list, an unknown
  name or a repeat.
  """
  precisions = comma_list(text, "--precisions")
  spellings: dict[str, list[str]] = {}
  for p in precisions:
    spellings.setdefault(resolve(p, "--precisions").name, []).append(p)
  repeated = [(name, said) for name, said in spellings.items() if len(said) > 1]
  if repeated:
    what = ", ".join(name if set(said) == {name} else
                     f"{name} (as {' and '.join(dict.fromkeys(said))})"
                     for name, said in repeated)
    raise UsageError(f"--precisions repeats {what}: name each precision "
                     f"once, e.g. --precisions "
                     f"{','.join(said[0] for said in spellings.values())}")
  return precisions


def tolerance(text: str | None, flag: str,
              largest: float | None = None) -> float | None:
  """``--atol``/``--rtol`` from its text (None when not given): a finite
  number >= 0, at most ``largest`` (float32's largest, as
  :func:`jaxprec.check` takes them).

  Anything else is bad usage, named as typed: ``1e400`` overflows (Python
  reads it as inf), ``nan`` and ``inf`` are not finite, a negative value is
  not a tolerance.
  """
  if text is None:
    return None
  if _is_float(text) and float(text) < 0:  # -inf too: said negative
    raise UsageError(
        f"{flag} {text} is negative (a tolerance bounds the size of an "
        f"error); {_tolerance_range(flag, largest)}")
  return abs(number(text, flag, largest))  # -0.0 is 0


def number(text: str, flag: str, largest: float | None = None) -> float:
  """A finite number from the text of ``flag`` (``search --tolerance``,
  whose sign the search checks), at most ``largest`` in size; bad usage
  naming the text as typed otherwise (``1e400`` overflows to inf)."""
  try:
    value = float(text)
  except ValueError:
    raise UsageError(f"{flag} {text!r} is not a number; "
                     f"{_tolerance_range(flag, largest)}") from None
  literal = text.strip().lower().lstrip("+-")
  if math.isnan(value):
    problem = "is not a number"
  elif math.isinf(value):
    problem = ("is infinite" if literal in ("inf", "infinity")
               else "overflows to inf")
  elif largest is not None and abs(value) > largest:
    problem = "is beyond float32's largest, where the metrics compare"
  else:
    return value
  raise UsageError(f"{flag} {text} {problem}; "
                   f"{_tolerance_range(flag, largest)}")


def _tolerance_range(flag: str, largest: float | None) -> str:
  bound = ">= 0" if largest is None else f"from 0 to {largest:.2g}"
  return f"a tolerance is a finite number {bound}, e.g. {flag} 1e-3"


# The options whose value is a number that may be typed negative: argparse
# reads `--atol -inf` or `--atol -1e-3` as two options (it takes only
# `-1` or `-.5` for a negative number), so they are joined as `--atol=-inf`
# and the value is refused with its reason.
NUMBER_OPTIONS = ("--atol", "--rtol", "--tolerance")


def join_negative_numbers(argv: list[str]) -> list[str]:
  """``argv`` with ``--atol -inf`` written ``--atol=-inf`` (see
  :data:`NUMBER_OPTIONS`) for ``check`` and ``search``; the rest as given,
  and nothing after ``--``."""
  if not any(a in ("check", "search") for a in argv[:1]):
    return list(argv)
  out: list[str] = []
  k = 0
  while k < len(argv):
    a = argv[k]
    if a == "--":
      return out + list(argv[k:])
    if (a in NUMBER_OPTIONS and k + 1 < len(argv)
        and argv[k + 1].startswith("-") and _is_float(argv[k + 1])):
      out.append(f"{a}={argv[k + 1]}")
      k += 2
      continue
    out.append(a)
    k += 1
  return out


def _is_float(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def one_line(e: BaseException) -> str:
  return " ".join(str(e).split())


def call_target(target: str) -> tuple[Any, tuple, dict]:
  """``(fn, args, kwargs)`` from ``MODULE:FUNCTION``, whose FUNCTION() makes them."""
  made = call(target)
  if (not isinstance(made, tuple) or len(made) not in (2, 3)
      or not isinstance(made[1], (tuple, list))
      or (len(made) == 3 and not isinstance(made[2], dict))):
    raise UsageError(
        f"{target}() must return (fn, args) or (fn, args, kwargs) with args "
        f"a tuple and kwargs a dict; got {kinds(made)}")
  return made[0], tuple(made[1]), (made[2] if len(made) == 3 else {})


def call(target: str) -> Any:
  """What ``MODULE:FUNCTION``'s FUNCTION() returns; its exception is a
  :class:`Failure`."""
  factory = load(target)
  try:
    return factory()
  except Exception as e:  # noqa: BLE001 -- reported as one line
    raise failed(f"{target}() raised", e) from None


def kinds(value: Any) -> str:
  """What a FUNCTION() returned, in words: ``'a tuple of 2 (int, list)'``."""
  if not isinstance(value, tuple):
    return type(value).__name__
  return (f"a tuple of {len(value)} "
          f"({', '.join(type(v).__name__ for v in value)})")


def load(target: str):
  """The callable named by ``MODULE:FUNCTION`` or ``path/file.py:FUNCTION``."""
  module_part, sep, attr = target.rpartition(":")
  if not sep or not module_part or not attr or not all(
      s.isidentifier() for s in attr.split(".")):
    raise UsageError(
        f"expected MODULE:FUNCTION or path/to/file.py:FUNCTION, got {target!r}")
  # Like `python -m`: the current directory comes first on sys.path.
  cwd = os.getcwd()
  if cwd not in sys.path and "" not in sys.path:
    sys.path.insert(0, cwd)
  is_path = (module_part.endswith(".py") or "/" in module_part
             or os.sep in module_part)
  try:
    module = import_path(module_part) if is_path else importlib.import_module(
        module_part)
  except UsageError:
    raise
  except Exception as e:  # noqa: BLE001 -- import errors are usage errors
    raise UsageError(
        f"cannot import {module_part!r}: {type(e).__name__}: {e}") from None
  obj: Any = module
  for name in attr.split("."):
    if not hasattr(obj, name):
      raise UsageError(f"{module_part!r} has no attribute {attr!r}")
    obj = getattr(obj, name)
  if not callable(obj):
    raise UsageError(f"{target} is not callable (it is a {type(obj).__name__})")
  return obj


def import_path(path: str):
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise UsageError(f"no such file: {path}")
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
    raise UsageError(f"cannot import {path!r}: not a Python file")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    sys.modules.pop(name, None)
    raise
  return module


def is_reference_file(reference: str) -> bool:
  """Whether ``--reference`` names a file rather than a precision."""
  from jaxprec._src.core import names
  if names.canonical(reference) is not None or reference == PYTORCH:
    return False
  return ("/" in reference or os.sep in reference or os.path.exists(reference)
          or bool(os.path.splitext(reference)[1]))


def check_reference_file(path: str) -> None:
  """Reads the ``--reference`` file before the model is built: exit 2 if unusable."""
  from jaxprec._src.checker import reference as reference_lib
  kinds = f"supported types: {', '.join(reference_lib.FILE_TYPES)}"
  suffix = os.path.splitext(path)[1]
  if suffix.lower() not in reference_lib.FILE_TYPES:
    raise UsageError(f"unsupported reference file {path!r} ({kinds})")
  if not os.path.isfile(path):
    raise UsageError(f"no such reference file: {path!r} ({kinds})")
  try:
    reference_lib.load(path)
  except Exception as e:  # noqa: BLE001 -- any failure to read it is usage
    message = one_line(e)
    if path not in message:
      message = f"cannot read reference file {path!r}: {message}"
    if "supported" not in message.lower():
      message += f" ({kinds})"
    raise UsageError(message) from None


# The files ``--out`` receives (``jaxprec check`` writes them).
OUT_FILES = ("report.json", "divergence.png")


def check_out(out: str, files: tuple[str, ...] = OUT_FILES) -> None:
  """Fails before the check runs when ``--out`` cannot be a writable directory
  or holds a directory where one of :data:`OUT_FILES` is to be written."""
  path = os.path.abspath(out)
  if os.path.exists(path) and not os.path.isdir(path):
    raise UsageError(f"--out {out!r} exists and is not a directory")
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise UsageError(f"--out {out!r} cannot be created: {existing!r} is not "
                      f"a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise UsageError(f"--out {out!r} is not writable (no write permission "
                      f"on {existing!r})")
  for name in files:  # a directory where a file is to be written
    if os.path.isdir(os.path.join(path, name)):
      raise UsageError(f"--out {out!r} holds a directory named {name!r}, "
                       f"where the check writes a file: remove it or choose "
                       f"another --out")
  # Permissions do not tell (root, /proc, a read-only mount): a directory is
  # created and removed in --out or its nearest existing parent.
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".jaxprec-out-", dir=existing))
  except OSError as e:
    raise UsageError(f"--out {out!r} is not writable: cannot create a "
                     f"directory in {existing!r} ({e.strerror})") from None

