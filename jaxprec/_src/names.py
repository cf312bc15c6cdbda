"""Precision spellings as plain strings, importable without JAX.

``jaxprec/__init__.py`` uses this table to check ``JAX_DEFAULT_MATMUL_PRECISION``
before JAX is imported (JAX rejects a bad value at import with an opaque error);
:mod:`jaxprec._src.precision` builds :class:`~jaxprec.Precision` values on it.
"""

from __future__ import annotations

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
    "F64_F64_F64",
)
FLAGS.update({p: p for p in PRESETS})

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

ALIAS_HELP = ("any letter case; aliases: bf16, tf32, fp32, f32, bf16_3x, bf16_6x, "
              "default, fastest, high, highest, medium; also lax.Precision and "
              "lax.DotAlgorithmPreset members, or None for the backend default")


def canonical(name: str) -> str | None:
  """The canonical name for a spelling, or None if unknown."""
  key = name.strip()
  if key in FLAGS:
    return key
  return ALIASES.get(key.lower())


def suggest(name: str) -> str | None:
  """The closest accepted spelling to ``name``, for "did you mean" messages."""
  import difflib
  choices = sorted(set(ALIASES) | set(FLAGS))
  close = difflib.get_close_matches(name.strip().lower(),
                                    [c.lower() for c in choices], n=1, cutoff=0.6)
  if not close:
    return None
  return next(c for c in choices if c.lower() == close[0])


def invalid_message(value: object, why: str) -> str:
  msg = (f"Invalid precision {value!r}: {why}. Valid names: "
         f"{', '.join(sorted(FLAGS))} ({ALIAS_HELP}).")
  if isinstance(value, str) and value.strip():
    s = suggest(value)
    if s is not None:
      msg += f" Did you mean {s!r}?"
  return msg


def check_env_before_jax(environ) -> None:
  """Validates (and, for jaxprec-only aliases, normalises) the env var.

  Called by ``import jaxprec`` only when JAX is not imported yet. A spelling
  that JAX would reject but jaxprec understands (``fp32``, ``BF16``,
  ``bfloat16_3x``) is rewritten to JAX's spelling so that ``import jax``
  succeeds; an unknown one raises ValueError naming the variable.
  """
  raw = environ.get(ENV_VAR)
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


def running_as_cli(argv) -> bool:
  """Whether this process is the ``jaxprec`` command (console script or -m)."""
  import os
  if not argv:
    return False
  return os.path.basename(argv[0]) in ("jaxprec", "-m", "__main__.py")
