"""Precision spellings as plain strings, importable without JAX.

``jaxprec/__init__.py`` uses this table to check ``JAX_DEFAULT_MATMUL_PRECISION``
before JAX is imported (JAX rejects a bad value at import with an opaque error);
:mod:`jaxprec._src.core.precision` builds :class:`~jaxprec.Precision` values on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

ENV_VAR = "JAX_DEFAULT_MATMUL_PRECISION"

# Canonical jaxprec name -> the value JAX's flag accepts (None: leave unset).
FLAGS: dict[str, str | None] = {
    "backend-default": None,
    "bfloat16": "bfloat16",
    "bfloat16_3x": "tensorfloat32",  # JAX's flag has no 'bfloat16_3x'.
    "tensorfloat32": "tensorfloat32",
    "float32": "float32",
}
PRESETS = (
    "ANY_F8_ANY_F8_F32", "ANY_F8_ANY_F8_F32_FAST_ACCUM", "ANY_F8_ANY_F8_ANY",
    "ANY_F8_ANY_F8_ANY_FAST_ACCUM", "F16_F16_F16", "F16_F16_F32",
    "BF16_BF16_BF16", "BF16_BF16_F32", "BF16_BF16_F32_X3", "BF16_BF16_F32_X6",
    "BF16_BF16_F32_X9", "TF32_TF32_F32", "TF32_TF32_F32_X3", "F32_F32_F32",
    "F64_F64_F64", "F8E4M3FN_F8E4M3FN_F32_X3", "F8E4M3FN_F8E4M3FN_F32_X4",
)
FLAGS.update({p: p for p in PRESETS})

# The presets a JAX release added after jax 0.10.0, the oldest jaxprec
# supports: the first release that has each (lax.DotAlgorithmPreset and
# the flag's values in jax/_src/config.py). An older JAX rejects the name.
PRESETS_SINCE: dict[str, tuple[int, int, int]] = {
    "F8E4M3FN_F8E4M3FN_F32_X3": (0, 12, 1),
    "F8E4M3FN_F8E4M3FN_F32_X4": (0, 12, 1),
}


def installed_jax() -> tuple[int, int, int] | None:
  """The installed jax release as ``(major, minor, patch)``, read from its
  package metadata without importing it; None where it cannot be read."""
  from importlib import metadata
  try:
    parts = metadata.version("jax").split(".")[:3]
    return tuple(int("".join(c for c in x if c.isdigit()) or 0)
                 for x in parts)  # type: ignore[return-value]
  except (metadata.PackageNotFoundError, ValueError):
    return None


def too_new(name: str, release: tuple[int, int, int] | None = None
            ) -> str | None:
  """Why the installed JAX (or ``release``) lacks the preset ``name``; None
  where it has it (or the release cannot be read)."""
  since = PRESETS_SINCE.get(name)
  release = installed_jax() if release is None else release
  if since is None or release is None or release >= since:
    return None
  have = ".".join(map(str, release))
  return (f"{name} is a lax.DotAlgorithmPreset of jax "
          f"{'.'.join(map(str, since))} and newer; this JAX is {have}")

# Exactly what JAX's flag accepts (jax/_src/config.py, default_matmul_precision).
JAX_FLAG_VALUES = frozenset(
    ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32") + PRESETS)

# Every accepted spelling, lower-cased, mapped to a canonical name.
ALIASES: dict[str, str] = {
    # JAX's flag values and per-op strings (jax/_src/lax/lax.py _precision_strings).
    "default": "bfloat16", "fastest": "bfloat16", "bfloat16": "bfloat16",
    "high": "tensorfloat32", "tensorfloat32": "tensorfloat32",
    "bfloat16_3x": "bfloat16_3x",
    "highest": "float32", "float32": "float32",
    # Short aliases.
    "bf16": "bfloat16", "tf32": "tensorfloat32", "fp32": "float32",
    "f32": "float32", "bf16_3x": "bfloat16_3x", "bf16_6x": "BF16_BF16_F32_X6",
    # PyTorch's torch.set_float32_matmul_precision: 'highest' (float32) and
    # 'high' (TF32 or the two-bfloat16 split) coincide with JAX's spellings;
    # 'medium' is bfloat16.
    "medium": "bfloat16",
    # Spellings of "no setting".
    "backend-default": "backend-default", "backend_default": "backend-default",
    "none": "backend-default",
}
ALIASES.update({p.lower(): p for p in PRESETS})


def canonical(name: str) -> str | None:
  """The canonical name for a spelling, or None if unknown."""
  key = name.strip()
  if key in FLAGS:
    return key
  return ALIASES.get(key.lower())


# How alike by difflib's ratio a close name is (close_name): one letter wrong
# in four ('bf17' for 'bf16') still is, 'nonsense' for 'none' (0.67) is not.
_SUGGEST_CUTOFF = 0.75
# An unknown-name message lists at most this many choices.
_LISTED = 12


def _one_edit(a: str, b: str) -> bool:
  """Whether ``a`` and ``b`` (3 letters or more) differ by one edit."""
  if min(len(a), len(b)) < 3 or abs(len(a) - len(b)) > 1 or a == b:
    return False
  i = 0
  while i < min(len(a), len(b)) and a[i] == b[i]:
    i += 1
  if len(a) != len(b):
    return a[i + (len(a) > len(b)):] == b[i + (len(b) > len(a)):]
  return (a[i + 1:] == b[i + 1:]
          or a[i:i + 2] == b[i:i + 2][::-1] and a[i + 2:] == b[i + 2:])


def close_name(value: object, names: Iterable[str] | Mapping[str, str]
               ) -> str | None:
  """The name in ``names`` that ``value`` is a typo of, any letter case, for
  "Did you mean" messages; None unless ``value`` is a string and one is close:
  one edit away (a letter added, dropped, changed or two swapped: 'tpv' for
  'tpu', 3 letters or more), else :data:`_SUGGEST_CUTOFF` alike, else one word
  of it ('rms' for 'rel_rms').

  ``names`` may map each spelling to match to the name to offer (an alias
  to its canonical name).
  """
  import difflib
  if not isinstance(value, str) or not value.strip():
    return None
  offer = names if isinstance(names, Mapping) else {n: n for n in names}
  lower: dict[str, str] = {}
  for n in sorted(offer):
    lower.setdefault(n.lower(), offer[n])
  key = value.strip().lower()
  edits = [n for n in lower if _one_edit(key, n)]  # the most alike of them
  close = (difflib.get_close_matches(key, edits, n=1, cutoff=0)
           or difflib.get_close_matches(key, list(lower), n=1,
                                        cutoff=_SUGGEST_CUTOFF)
           or [n for n in lower
               if len(key) >= 3 and key in n.replace("-", "_").split("_")])
  return lower[close[0]] if close else None


def unknown(kind: str, value: object, choices: Iterable[str], *,
            error: type[Exception] = ValueError, hint: str = "",
            near: Iterable[str] | Mapping[str, str] | None = None) -> Exception:
  """The one error for a name that is not one of ``choices``, to raise.

  Its message names ``value`` (repr) and the choices (the first
  :data:`_LISTED` of them), and ends "Did you mean 'x'?" only where a choice
  is close (:func:`close_name`):
  ``Unknown target 'tpuu'; valid choices: 'tpu', 'gpu'. Did you mean 'tpu'?``

  Args:
    kind: what the name names ('target', 'emulation kernel').
    value: the name given.
    choices: the valid names, in the order to list them.
    error: the exception type (ValueError, TypeError, a KeyError subclass).
    hint: text after the list, before its period (' (aliases: bf16, ...)').
    near: the spellings to suggest from instead of ``choices`` (a mapping
      offers its values); empty for no suggestion.
  """
  choices = list(choices)
  listed = ", ".join(map(repr, choices[:_LISTED]))
  if len(choices) > _LISTED:
    listed += f", ... ({len(choices)} in all)"
  msg = f"Unknown {kind} {value!r}; valid choices: {listed}{hint}."
  close = close_name(value, choices if near is None else near)
  if close is not None:
    msg += f" Did you mean {close!r}?"
  return error(msg)


def check_choice(value: object, choices: Sequence[str], kind: str, *,
                 error: type[Exception] = ValueError) -> str:
  """The choice ``value`` names (any letter case, spaces stripped); else
  :func:`unknown`'s error.

  Examples:
    >>> from jaxprec._src.core.names import check_choice
    >>> check_choice("TPU", ("tpu", "gpu"), "target")
    'tpu'
    >>> check_choice("tpuu", ("tpu", "gpu"), "target")
    Traceback (most recent call last):
    ...
    ValueError: Unknown target 'tpuu'; valid choices: 'tpu', 'gpu'. Did you mean 'tpu'?
  """
  if isinstance(value, str):
    key = value.strip().lower()
    for c in choices:
      if c.lower() == key:
        return c
  raise unknown(kind, value, choices, error=error)


def _presets_here() -> int:
  """How many preset names the installed JAX has (:data:`PRESETS_SINCE`)."""
  return sum(1 for p in PRESETS if not too_new(p))


def _aliases(name: str) -> list[str]:
  """The spellings of ``name`` other than its own, in :data:`ALIASES` order."""
  return [a for a, c in ALIASES.items() if c == name and a != name.lower()]


def _grouped_names() -> str:
  """The valid precision names in groups, for :func:`invalid_message`: the
  levels with their aliases, the backend default, the presets by count."""
  levels = ", ".join(
      n + (f" ({', '.join(_aliases(n))})" if _aliases(n) else "")
      for n in FLAGS if n not in PRESETS and n != "backend-default")
  preset_aliases = [f"{a} for {c}" for a, c in ALIASES.items()
                    if c in PRESETS and a != c.lower()]
  also = f"; {', '.join(preset_aliases)}" if preset_aliases else ""
  return (f"the levels {levels}; backend-default (or None); {_presets_here()} "
          f"lax.DotAlgorithmPreset names such as BF16_BF16_F32_X3 and "
          f"F32_F32_F32{also}. Any letter case, lax.Precision and "
          f"lax.DotAlgorithmPreset members too; every spelling: "
          f"jaxprec.valid_names()")


def invalid_message(value: object, why: str, *, suggest: bool = True) -> str:
  """The one message for a precision :func:`jaxprec.resolve` refuses.

  The suggestion comes first, then the valid names in groups: the levels with
  their aliases, the backend default, and the ``lax.DotAlgorithmPreset``
  names by count with examples (every spelling: ``jaxprec.valid_names()``).

  Examples:
    >>> from jaxprec._src.core.names import invalid_message
    >>> print(invalid_message("bfloat61", "unknown name"))  # doctest: +ELLIPSIS
    Invalid precision 'bfloat61': unknown name. Did you mean 'bfloat16'? Valid names: ...
  """
  msg = f"Invalid precision {value!r}: {why}."
  s = close_name(value, set(ALIASES) | set(FLAGS)) if suggest else None
  if s is not None:
    msg += f" Did you mean {s!r}?"
  return f"{msg} Valid names: {_grouped_names()}."


# Where every precision spelling is listed, for a message too short to list
# them (the command line's).
SPELLINGS_PAGE = "docs/precision.md ('Spellings')"


def short_invalid_message(message: str) -> str:
  """:func:`invalid_message`'s text (alone or inside another message, e.g.
  a policy entry's) with the list of valid names cut to the common ones and
  where the rest are: what a command line prints. Any other message is
  returned as it is.

  Examples:
    >>> from jaxprec._src.core.names import invalid_message
    >>> print(short_invalid_message(invalid_message("bf61", "unknown name")))
    ... # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
    Invalid precision 'bf61': unknown name. Did you mean 'bf16'? Common names:
    bfloat16 (bf16), bfloat16_3x (bf16_3x), tensorfloat32 (tf32), float32
    (f32), backend-default; every spelling and the ... lax.DotAlgorithmPreset
    names: docs/precision.md ('Spellings') or jaxprec.valid_names().
  """
  tail = f" Valid names: {_grouped_names()}."
  if not message.endswith(tail):
    return message
  # A level's shortest spelling with digits (bf16, not 'default').
  short = {c: min(_aliases(c), default=None, key=lambda a: (
      not any(ch.isdigit() for ch in a), len(a))) for c in FLAGS
           if c not in PRESETS}
  common = ", ".join(f"{c} ({a})" if a and len(a) < len(c) else c
                     for c, a in short.items() if c != "backend-default")
  return (f"{message[:-len(tail)]} Common names: {common}, backend-default; "
          f"every spelling and the {_presets_here()} lax.DotAlgorithmPreset "
          f"names: {SPELLINGS_PAGE} or jaxprec.valid_names().")


def check_env_before_jax(environ) -> None:
  """Validates (and, for jaxprec-only aliases, normalises) the env var.

  Called by ``import jaxprec`` only when JAX is not imported yet. A spelling
  that JAX would reject but jaxprec understands (``fp32``, ``BF16``,
  ``bfloat16_3x``) is rewritten to JAX's spelling so that ``import jax``
  succeeds; an unknown one raises ValueError naming the variable.
  """
  raw = environ.get(ENV_VAR)
  if raw is not None and too_new(raw.strip()):
    raise ValueError(f"{ENV_VAR}: " + invalid_message(
        raw, too_new(raw.strip()), suggest=False))
  if raw is None or raw in JAX_FLAG_VALUES:
    return
  name = canonical(raw) if raw.strip() else None
  if name is None:
    raise ValueError(f"{ENV_VAR}: " + invalid_message(
        raw, "unknown name" if raw.strip() else "empty string"))
  flag = FLAGS[name]
  if flag is None:
    del environ[ENV_VAR]
  else:
    environ[ENV_VAR] = flag


# The file names of the `jaxprec` console script (pip writes jaxprec.exe and
# jaxprec-script.py on Windows).
_SCRIPTS = ("jaxprec", "jaxprec.exe", "jaxprec-script.py")
# Python options that take the next argument as their value.
_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def _module_run(orig_argv) -> str | None:
  """The module ``python -m MODULE`` runs in ``orig_argv``, or None."""
  tokens = list(orig_argv or ())[1:]
  i = 0
  while i < len(tokens):
    tok = tokens[i]
    if tok == "-m":
      return tokens[i + 1] if i + 1 < len(tokens) else None
    if tok.startswith("-m") and not tok.startswith("--"):
      return tok[2:]
    if tok == "-c" or tok == "-" or not tok.startswith("-"):
      return None  # a command, stdin or a script: not -m
    i += 2 if tok in _OPTIONS_WITH_VALUE else 1
  return None


def running_as_cli(argv, orig_argv=None) -> bool:
  """Whether this process is the ``jaxprec`` command (console script or -m).

  Only jaxprec's own command counts: another application run as
  ``python -m pkg`` that imports jaxprec is not the command line.

  Args:
    argv: ``sys.argv``.
    orig_argv: ``sys.orig_argv`` (the interpreter's own command line; default
      the running one).
  """
  import sys
  if not argv:
    return False
  base = argv[0].replace("\\", "/").rsplit("/", 1)[-1]
  if base in _SCRIPTS:
    return True
  if orig_argv is None:
    orig_argv = getattr(sys, "orig_argv", ())
  if argv[0] == "-m" or base == "__main__.py":
    return _module_run(orig_argv) in ("jaxprec", "jaxprec.__main__")
  return False


def asks_help_or_version(argv) -> bool:
  """Whether a ``jaxprec`` command line asks only for help or the version.

  Those need no precision: ``import jaxprec`` lets them run when
  ``JAX_DEFAULT_MATMUL_PRECISION`` is invalid (with a warning).
  """
  tokens = list(argv[1:])
  if "--" in tokens:
    tokens = tokens[:tokens.index("--")]
  if not tokens:
    return False
  if tokens[0] in ("-h", "--help", "--version"):
    return True
  if tokens[0] == "run":  # What follows `run -p P` is the command's own.
    return len(tokens) > 1 and tokens[1] in ("-h", "--help")
  return any(t in ("-h", "--help") for t in tokens[1:])
