"""Precision names: one parser for every spelling JAX, PyTorch and users write.

Everything that takes a precision in jaxprec (the decorator, the env var, the CLI,
policy strings, the emulated ops) goes through :func:`resolve`, so there is one
grammar and one error message.

Facts used here: the jax.default_matmul_precision docs; the jax.lax.Precision docs and JAX's tests/lax_test.py; PyTorch's torch.set_float32_matmul_precision docs (JAX's flag values
are listed in ``jax/_src/config.py``'s ``default_matmul_precision``; per-op
aliases in ``jax/_src/lax/lax.py``'s ``_precision_strings``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprec._src.core import algorithms
from jaxprec._src.core import names
from jaxprec._src.core.algorithms import Numerics


class Kind(enum.Enum):
  UNSET = "unset"
  LEVEL = "level"
  PRESET = "preset"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
  """A resolved matmul/conv precision. Frozen and hashable.

  Build one with :func:`resolve`; do not construct it directly.

  Attributes:
    name: canonical jaxprec name, e.g. ``'bfloat16'``, ``'float32'``,
      ``'BF16_BF16_F32_X3'``, or ``'backend-default'`` for ``None``.
    flag: the value to hand to ``jax.default_matmul_precision`` /
      ``JAX_DEFAULT_MATMUL_PRECISION`` (``None`` leaves the backend default).
    level: the ``lax.Precision`` to use for convolutions, which understand levels
      only (a preset maps to the level that is at least as precise on TPU).
    preset: the ``lax.DotAlgorithmPreset`` where the precision is one, else None.
    tpu, gpu, cpu: what the precision computes for float32 operands there
      (for float8 operands, the ``ANY_F8_*`` presets): the
      :class:`~jaxprec.Numerics` record of the one table of algorithms
      (:mod:`jaxprec._src.core.algorithms`), its ``'unsupported'`` record where
      the target does not run the algorithm (``F32_F32_F32`` on a TPU; on
      CPU the presets the installed JAX refuses there, ``ANY_F8_ANY_F8_F32``
      among them: :func:`cpu_refuses`).
    source: where the value came from when returned by :func:`jaxprec.current`
      (``'context'``, ``'config'``, ``'env'``, ``'backend-default'``); empty
      for values made by :func:`resolve`. Not part of equality.
  """

  name: str
  flag: str | None
  level: lax.Precision
  preset: lax.DotAlgorithmPreset | None
  tpu: Numerics
  gpu: Numerics
  source: str = dataclasses.field(default="", compare=False)

  @property
  def cpu(self) -> Numerics:
    """What a CPU computes: exact float32 for every level and every preset
    the installed JAX lowers there on float32 operands, 'unsupported' for
    the presets it refuses, and the preset's own algorithm for one whose
    operands JAX converts first (``F16_F16_F16``: "If an explicit algorithm
    was specified, we always cast the input types to the correct types",
    ``_handle_dot_precision`` in ``jax/_src/lax/lax.py``, to a type of
    ``DotAlgorithmPreset.supported_lhs_types``, which for the float16
    presets is float16 alone)."""
    if self.preset is None:
      return algorithms.CPU
    record = algorithms.record(algorithms.PRESETS[self.preset.name])
    if cpu_refuses(self.preset):
      return (algorithms.CPU_UNSUPPORTED if record.modelled
              else algorithms.CPU_UNMODELLED)
    if record.pass_format == "float16":
      return record
    return algorithms.CPU

  @property
  def kind(self) -> Kind:
    if self.flag is None:
      return Kind.UNSET
    return Kind.PRESET if self.preset is not None else Kind.LEVEL

  @property
  def is_preset(self) -> bool:
    return self.preset is not None

  @property
  def per_op(self) -> lax.Precision | lax.DotAlgorithmPreset | None:
    """The value to pass as ``precision=`` to ``lax.dot_general`` and friends."""
    if self.flag is None:
      return None
    return self.preset if self.preset is not None else self.level

  def on(self, backend: str) -> Numerics:
    """Numerics on ``backend`` (``'tpu'``, ``'gpu'``/``'cuda'``, ``'cpu'``)."""
    b = BACKEND_TARGETS.get(str(backend).lower())
    if b is None:
      raise names.unknown("backend", backend, ("tpu", "gpu", "cpu"),
                          near=BACKEND_TARGETS)
    return getattr(self, b)

  def with_source(self, source: str) -> Precision:
    return dataclasses.replace(self, source=source)

  def __str__(self) -> str:
    return self.name

  def __repr__(self) -> str:
    src = f", source={self.source!r}" if self.source else ""
    return f"jaxprec.Precision({self.name!r}{src})"


# The target each JAX backend name computes as.
BACKEND_TARGETS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu",
                   "cpu": "cpu"}

P = lax.Precision
D = lax.DotAlgorithmPreset


def _precision(name: str, level: P, preset: D | None = None) -> Precision:
  """The :class:`Precision` of a level or preset; its meaning on each target
  from the one table (:mod:`jaxprec._src.core.algorithms`)."""
  def on(target):
    if preset is None:
      return algorithms.meaning(algorithms.LEVELS[target][level.name], target)
    return algorithms.meaning(algorithms.PRESETS[preset.name], target)
  return Precision(name=name, flag=names.FLAGS[name], level=level,
                   preset=preset, tpu=on("tpu"), gpu=on("gpu"))


_CPU_REFUSES: dict[Any, bool] = {}


def cpu_refuses(preset: lax.DotAlgorithmPreset | lax.DotAlgorithm) -> bool:
  """Whether the installed JAX refuses ``preset`` on CPU ("not supported by
  dot_general on CPU", or for a ``lax.DotAlgorithm`` object "is not
  supported"): asked of JAX's own dot lowering, once per algorithm, by
  lowering a 2 x 2 dot for the CPU (``_handle_dot_precision`` in
  ``jax/_src/lax/lax.py`` keeps the list, and it changes: jax 0.12.1 took
  ``F16_F16_F32``). Float8 operands for the ``ANY_F8_*`` presets, float32
  for the others."""
  name = getattr(preset, "name", preset)
  if name not in _CPU_REFUSES:
    dtype = (jnp.float8_e4m3fn if str(name).startswith("ANY_F8") else np.float32)
    s = jax.ShapeDtypeStruct((2, 2), dtype)
    f = lambda a, b: lax.dot(a, b, precision=preset)  # noqa: E731
    try:
      jax.jit(f).trace(s, s).lower(lowering_platforms=("cpu",))
      refused = False
    except ValueError as e:
      if "not supported" not in str(e):
        raise
      refused = True
    _CPU_REFUSES[name] = refused
  return _CPU_REFUSES[name]


# ``level`` is what a convolution runs under the precision (convolutions
# understand levels only).
_CANONICAL: dict[str, Precision] = {
    p.name: p for p in [
        _precision("backend-default", P.DEFAULT),
        _precision("bfloat16", P.DEFAULT),
        _precision("bfloat16_3x", P.HIGH),
        _precision("tensorfloat32", P.HIGH),
        _precision("float32", P.HIGHEST),
    ] + [_precision(d.name, level, d) for d, level in (
        (D.BF16_BF16_F32, P.DEFAULT), (D.BF16_BF16_F32_X3, P.HIGH),
        (D.BF16_BF16_F32_X6, P.HIGHEST), (D.BF16_BF16_F32_X9, P.HIGHEST),
        (D.BF16_BF16_BF16, P.DEFAULT), (D.TF32_TF32_F32, P.HIGH),
        (D.TF32_TF32_F32_X3, P.HIGHEST), (D.F16_F16_F32, P.DEFAULT),
        (D.F16_F16_F16, P.DEFAULT), (D.F32_F32_F32, P.HIGHEST),
        (D.F64_F64_F64, P.HIGHEST), (D.ANY_F8_ANY_F8_F32, P.DEFAULT),
        (D.ANY_F8_ANY_F8_F32_FAST_ACCUM, P.DEFAULT),
        (D.ANY_F8_ANY_F8_ANY, P.DEFAULT),
        (D.ANY_F8_ANY_F8_ANY_FAST_ACCUM, P.DEFAULT))] + [
        # The presets of newer JAX releases, where the installed one has them
        # (names.PRESETS_SINCE).
        _precision(n, P.DEFAULT, getattr(D, n)) for n in names.PRESETS_SINCE
        if hasattr(D, n)]
}

_LEVEL_NAMES = {P.DEFAULT: "bfloat16", P.HIGH: "tensorfloat32", P.HIGHEST: "float32"}

PrecisionLike = Union[str, lax.Precision, lax.DotAlgorithmPreset,
                      lax.DotAlgorithm, Precision, tuple, None]

# The preset each lax.DotAlgorithm spells, by its fields (lhs, rhs and
# accumulation types, component counts, primitive operations): the fields
# JAX's DotAlgorithmPreset._convert_to_hlo_attr gives each preset
# (jax/_src/lax/lax.py). TF32 has no NumPy type, so no DotAlgorithm spells the
# TF32 presets; the ANY_F8 ones take any two float8 types and say whether
# accumulation may be imprecise (_FAST_ACCUM).
_ALGORITHM_PRESETS = {
    ("float16", "float16", "float16", 1): D.F16_F16_F16,
    ("float16", "float16", "float32", 1): D.F16_F16_F32,
    ("bfloat16", "bfloat16", "bfloat16", 1): D.BF16_BF16_BF16,
    ("bfloat16", "bfloat16", "float32", 1): D.BF16_BF16_F32,
    ("bfloat16", "bfloat16", "float32", 3): D.BF16_BF16_F32_X3,
    ("bfloat16", "bfloat16", "float32", 6): D.BF16_BF16_F32_X6,
    ("bfloat16", "bfloat16", "float32", 9): D.BF16_BF16_F32_X9,
    ("float32", "float32", "float32", 1): D.F32_F32_F32,
    ("float64", "float64", "float64", 1): D.F64_F64_F64,
    ("float8", "float8", "float32", 1): D.ANY_F8_ANY_F8_F32,
}


def _type_name(t: Any) -> str | None:
  """A DotAlgorithm field's dtype name as JAX lowers it (canonical: float64
  is float32 unless x64 is on; any float8 type: 'float8'); None for None or
  what is not a dtype (np.dtype(None) would be float64)."""
  if t is None:
    return None
  try:
    name = jax.dtypes.canonicalize_dtype(np.dtype(t)).name
  except TypeError:
    return None
  return "float8" if name.startswith("float8") else name


def _algorithm_preset(value: lax.DotAlgorithm) -> lax.DotAlgorithmPreset:
  """The preset ``value`` spells field for field; ValueError naming the
  algorithm and the ones that are presets otherwise."""
  key = (*map(_type_name, (value.lhs_precision_type, value.rhs_precision_type,
                           value.accumulation_type)),
         value.num_primitive_operations)
  preset = None
  if (value.lhs_component_count, value.rhs_component_count) == (1, 1):
    preset = _ALGORITHM_PRESETS.get(key)
  if preset is D.ANY_F8_ANY_F8_F32 and value.allow_imprecise_accumulation:
    preset = D.ANY_F8_ANY_F8_F32_FAST_ACCUM
  elif value.allow_imprecise_accumulation:
    preset = None
  if preset is None:
    spelled = "; ".join(
        f"{p.name} = ({', '.join(k[:3])}, num_primitive_operations={k[3]})"
        for k, p in _ALGORITHM_PRESETS.items())
    raise _invalid(value, (
        "a lax.DotAlgorithm that no lax.DotAlgorithmPreset spells, so jaxprec "
        "cannot say what a TPU or GPU computes for it. DotAlgorithms it "
        "reads, as (lhs_precision_type, rhs_precision_type, accumulation_type"
        "), component counts 1, allow_imprecise_accumulation False (True: "
        f"ANY_F8_ANY_F8_F32_FAST_ACCUM): {spelled}; float8 is any float8 "
        "type. Or pass a lax.DotAlgorithmPreset or a name"))
  return preset


def valid_names() -> list[str]:
  """The canonical names and the accepted aliases, sorted, for messages and docs."""
  return sorted(n for n in set(_CANONICAL) | set(names.ALIASES)
                if names.canonical(n) in _CANONICAL)


def _invalid(value: Any, why: str, *, suggest: bool = True) -> ValueError:
  return ValueError(names.invalid_message(value, why, suggest=suggest))


def resolve(value: PrecisionLike) -> Precision:
  """Turns any precision spelling into a :class:`Precision`.

  Accepts every value of JAX's ``jax_default_matmul_precision`` flag, every
  per-op spelling (``lax.Precision`` members and names, ``'fastest'``,
  ``'bfloat16_3x'``, ``lax.DotAlgorithmPreset`` members and names, and a
  ``lax.DotAlgorithm`` whose fields spell a preset: the preset), any letter
  case, the short aliases ``bf16``, ``tf32``, ``fp32``, ``f32``, ``bf16_3x``,
  ``bf16_6x``, PyTorch's ``'highest'``/``'high'``/``'medium'``, a
  ``(lhs, rhs)`` pair of equal levels, a :class:`Precision`, and ``None`` (the
  backend default).

  Args:
    value: the precision to resolve.

  Returns:
    The canonical :class:`Precision`.

  Raises:
    ValueError: for an unknown name or a value of the wrong type (a
      ``lax.DotAlgorithm`` no preset spells); the message lists the valid
      names and suggests the closest one.

  Examples:
    >>> import jaxprec
    >>> jaxprec.resolve("FP32").name
    'float32'
    >>> jaxprec.resolve("bf16").flag
    'bfloat16'
    >>> jaxprec.resolve("F32_F32_F32").level
    Precision.HIGHEST
    >>> jaxprec.resolve("bfloat61")
    Traceback (most recent call last):
    ...
    ValueError: Invalid precision 'bfloat61': unknown name. Did you mean 'bfloat16'? ...
  """
  if value is None:
    return _CANONICAL["backend-default"]
  if isinstance(value, Precision):
    return _CANONICAL[value.name] if not value.source else value
  if isinstance(value, lax.Precision):
    return _CANONICAL[_LEVEL_NAMES[value]]
  if isinstance(value, lax.DotAlgorithm):  # a NamedTuple: before pairs
    value = _algorithm_preset(value)
  if isinstance(value, lax.DotAlgorithmPreset):
    if value is lax.DotAlgorithmPreset.DEFAULT:
      return _CANONICAL["backend-default"]
    return _CANONICAL[value.name]
  if isinstance(value, (tuple, list)):
    if len(value) == 2 and value[0] == value[1]:
      return resolve(value[0])
    if len(value) == 2 and all(isinstance(v, (str, lax.Precision)) for v in value):
      a, b = resolve(value[0]), resolve(value[1])
      if a.kind is Kind.LEVEL and b.kind is Kind.LEVEL:
        # JAX computes a mixed pair at the higher of the two levels on TPU;
        # jaxprec takes the more precise one so it never understates precision.
        return a if a.level.value >= b.level.value else b
    raise _invalid(value, "a pair must hold two precision levels")
  if type(value).__name__ == "Policy" and hasattr(value, "rules"):
    raise _invalid(value, "a Policy is not one precision; pass it to "
                   "jaxprec.swap or jaxprec.emulate, which apply it per layer")
  if isinstance(value, bool) or not isinstance(value, str):
    raise _invalid(value, f"expected a string, lax.Precision, "
                   f"lax.DotAlgorithmPreset or None, got {type(value).__name__}")
  if not value.strip():
    raise _invalid(value, "empty string")
  canon = names.canonical(value)
  if canon is None:
    raise _invalid(value, "unknown name")
  if canon not in _CANONICAL:  # a preset of a newer JAX
    raise _invalid(value, names.too_new(canon) or
                   f"this JAX has no lax.DotAlgorithmPreset {canon}",
                   suggest=False)
  return _CANONICAL[canon]
