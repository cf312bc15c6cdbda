"""The one table of precision decisions: what runs for an op, and how to ask for it.

Every feature that decides something about an op's numerics asks here (the
audit, the cost model, the emulation, the Flax interception and modules, the
checker and the search). A convolution understands levels only (JAX's
conv_general_dilated lowering, jax/_src/lax/convolution.py).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax import lax

from jaxprec._src.core import algorithms
from jaxprec._src.core.algorithms import Numerics
from jaxprec._src.core.names import check_choice, unknown
from jaxprec._src.core.precision import BACKEND_TARGETS
from jaxprec._src.core.precision import Precision, PrecisionLike, resolve
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import walker

# What a TPU or an Ampere+ GPU computes; 'cpu'/'native' emulate nothing.
TARGETS = algorithms.TARGETS
EMULATION_TARGETS = ("tpu", "gpu", "cpu", "native")
# How a checker computes a target's numerics: 'auto' runs natively on the
# target's own backend and emulates elsewhere.
MODES = ("auto", "emulate", "native")
# Op kinds as policies name them (the primitives they stand for:
# jaxprec._src.jaxpr.walker.PRIMITIVES).
OP_KINDS = ("dot", "conv")

# The algorithms the emulation computes (:func:`algorithm_for`): those of
# the one table (jaxprec._src.core.algorithms) that a kernel runs, exact float32,
# 'f8' (float8 operands widened to float32: their products are exact there, so
# one float32 dot, float32 accumulation) and 'native' (the lax op as recorded).
ALGORITHMS = ("native", "f32", "f8") + algorithms.emulated()
# Matmul passes of each, read from the table's records.
PASSES = {"native": 1, **{a: algorithms.record(a).passes
                          for a in ALGORITHMS[1:]}}

_P = lax.Precision
# Compute dtypes a policy may give a module (Rule(dtype=), default_dtype), by
# their numpy names. float64 only for jaxprec's own reference runs.
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "f32": "float32", "fp32": "float32",
    "float64": "float64", "f64": "float64", "fp64": "float64", "double": "float64",
}
_EMULATED_DTYPES = (np.dtype(np.float32), np.dtype(jax.numpy.bfloat16),
                    np.dtype(np.float16))


def canonical_dtype(value: Any, *, allow_float64: bool = False) -> str:
  """The name of a compute dtype: ``'bfloat16'``, ``'float16'`` or ``'float32'``.

  The one checker of dtypes for policies (``Rule(dtype=)``,
  ``Policy(default_dtype=)``, the ``dtype:`` items of policy strings).

  Args:
    value: a name or alias (``'bf16'``; ``'f16'``, ``'fp16'``, ``'half'``;
      ``'f32'``, ``'fp32'``; any case), a numpy dtype, or a scalar type
      (``jnp.bfloat16``, ``np.float32``).
    allow_float64: also accept float64 (``'f64'``, ``'fp64'``, ``'double'``),
      for jaxprec's own float64 reference runs; policies never hold it.

  Returns:
    One of :data:`DTYPES` (or ``'float64'``).

  Raises:
    ValueError: naming the value, the valid choices and the closest match.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxprec._src.core.numerics import canonical_dtype
    >>> canonical_dtype("bf16"), canonical_dtype(jnp.float32)
    ('bfloat16', 'float32')
    >>> canonical_dtype("bflaot16")
    Traceback (most recent call last):
    ...
    ValueError: Unknown dtype 'bflaot16'; valid choices: 'bfloat16', 'float16', 'float32' ... Did you mean 'bfloat16'?
  """
  choices = DTYPES + (("float64",) if allow_float64 else ())
  name = None
  if isinstance(value, str):
    name = _DTYPE_ALIASES.get(value.strip().lower())
  elif value is not None and not isinstance(value, (bool, int, float)):
    try:
      name = np.dtype(value).name
    except TypeError:
      name = None
  if name in choices:
    return name
  shown = name if name is not None and not isinstance(value, str) else value
  hint = (" (aliases: bf16, f16, fp16, half, f32, fp32; numpy dtypes and "
          "jnp.bfloat16, jnp.float32, ...)")
  if name == "float64":
    hint += (". float64 is not a compute dtype a policy can give; the float64 "
             "reference is the checker's reference='float64'")
  raise unknown("dtype", shown, choices, hint=hint, near=() if name else {
      k: v for k, v in _DTYPE_ALIASES.items() if v in choices})


def check_target(target: Any, *, emulation: bool = False) -> str:
  """A target, lower-cased: one of :data:`TARGETS`, or with ``emulation=True``
  of :data:`EMULATION_TARGETS`. ValueError naming the choices otherwise."""
  return check_choice(target, EMULATION_TARGETS if emulation else TARGETS,
                      "emulation target" if emulation else "target")


def resolve_mode(mode: Any, target: str) -> str:
  """``'emulate'`` or ``'native'``; ``'auto'`` is native on the target's own
  backend and emulation elsewhere."""
  mode = check_choice(mode, MODES, "mode")
  if mode != "auto":
    return mode
  backend = BACKEND_TARGETS.get(compat.backend_platform())
  return "native" if backend == check_target(target) else "emulate"


def op_kind(primitive: Any) -> str:
  """``'dot'`` or ``'conv'`` for a primitive or its name."""
  name = getattr(primitive, "name", primitive)
  try:
    return walker.PRIMITIVES[name]
  except KeyError:
    raise unknown("op", name, walker.PRIMITIVES) from None


def per_op(p: Precision | None, kind: str) -> Any:
  """The ``precision=`` an op of ``kind`` gets under ``p``.

  None for the backend default (or ``p`` None). Dots take the preset or the
  level pair; convolutions take the level, because JAX lowers a convolution
  under a preset at DEFAULT (JAX's conv_general_dilated lowering,
  jax/_src/lax/convolution.py), which is never what the preset means.

  Examples:
    >>> import jaxprec
    >>> from jaxprec._src.core.numerics import per_op
    >>> per_op(jaxprec.resolve("F32_F32_F32"), "conv")
    Precision.HIGHEST
    >>> per_op(jaxprec.resolve("F32_F32_F32"), "dot").name
    'F32_F32_F32'
  """
  if p is None or p.flag is None:
    return None
  return p.level if kind == "conv" else p.per_op


def lowered(recorded: Any, kind: str) -> Any:
  """The ``precision`` JAX lowers an op of ``kind`` with, given the one its
  jaxpr equation recorded: a convolution that recorded a
  ``DotAlgorithmPreset`` lowers at ``(DEFAULT, DEFAULT)`` (:func:`per_op`);
  anything else as recorded."""
  if kind == "conv" and isinstance(recorded, lax.DotAlgorithmPreset):
    return (_P.DEFAULT, _P.DEFAULT)
  return recorded


def flag_for(p: Precision, kind: str) -> str | None:
  """The value of JAX's flag that gives ops of ``kind`` precision ``p``
  (a conv under a preset: the preset's level, as :func:`per_op`)."""
  if kind == "conv" and p.is_preset:
    return resolve(p.level).flag
  return p.flag


def is_float8(dtype: Any) -> bool:
  """Whether ``dtype`` is one of JAX's 8-bit floats (``float8_e4m3fn``,
  ``float8_e5m2``, ... every ``float8_*`` type), the operands of the
  ``ANY_F8_*`` presets."""
  d = np.dtype(dtype)
  return d.itemsize == 1 and d.name.startswith("float8")


_HELD: dict[tuple[str, str], bool] = {}


def _backend_holds(name: str) -> bool:
  """Whether the default backend's XLA holds arrays of the type ``name``
  and converts them to float32: asked once per backend and type, by
  compiling the conversion."""
  key = (jax.default_backend(), name)
  if key not in _HELD:
    s = jax.ShapeDtypeStruct((2,), getattr(jax.numpy, name))
    try:
      jax.jit(lambda v: v.astype(np.float32)).lower(s).compile()
      _HELD[key] = True
    except Exception:  # noqa: BLE001 - XLA's error types differ by release
      _HELD[key] = False
  return _HELD[key]


def float8_types() -> tuple[str, ...]:
  """The 8-bit (and 4-bit) float types jaxprec emulates on this JAX and
  backend: those JAX names whose arrays the backend's XLA holds and converts
  to float32 (jaxlib 0.12.1's XLA:CPU has no ``float8_e5m3fnu``, though JAX
  names it). A dot on another such type is refused
  (:func:`check_float8_operands`).

  Examples:
    >>> import jaxprec
    >>> "float8_e4m3fn" in jaxprec.float8_types()
    True
  """
  return tuple(n for n in sorted(dir(jax.numpy))
               if n.startswith(("float8_", "float4_")) and _backend_holds(n))


def check_float8_operands(*dtypes: Any) -> None:
  """ValueError for an operand of an 8-bit or 4-bit float type the backend's
  XLA cannot hold (:func:`float8_types`), naming the types it can."""
  for dt in dtypes:
    try:
      d = np.dtype(dt)
    except TypeError:
      continue
    if (d.itemsize == 1 and jax.numpy.issubdtype(d, jax.numpy.floating)
        and not _backend_holds(d.name)):
      raise ValueError(
          f"{d.name}: this JAX names the type, but its XLA on "
          f"{jax.default_backend()} holds no such arrays (it cannot convert "
          f"them to float32), so jaxprec cannot emulate a dot on them. The "
          f"8-bit and 4-bit float types it emulates here: "
          f"{', '.join(float8_types())}.")


def _narrow_float(d: np.dtype) -> bool:
  """bfloat16, float16, or a float of one byte (every float8 type, and
  float4_e2m1fn): each of their values is a float32 value, and those of one
  byte (at most 5 significand bits, exponents within bfloat16's) also a
  bfloat16 value."""
  return d in _EMULATED_DTYPES or (
      d.itemsize == 1 and jax.numpy.issubdtype(d, jax.numpy.floating))


def emulatable(lhs_dtype: Any, rhs_dtype: Any) -> bool:
  """float32 x float32, or float32 x a narrower float (bfloat16, float16, a
  float8 or float4 type: upcast exactly), the operands a level applies to."""
  dts = (np.dtype(lhs_dtype), np.dtype(rhs_dtype))
  return all(map(_narrow_float, dts)) and np.dtype(np.float32) in dts


class UnsupportedAlgorithmError(ValueError):
  """A target does not run the algorithm that a precision names (a compile
  error on that device, never a silent fallback)."""


# The levels as each target's users spell them, most precise first.
_LEVEL_SPELLINGS = {"tpu": ("float32", "bfloat16_3x", "bfloat16"),
                    "gpu": ("float32", "tensorfloat32", "bfloat16")}


# Where the table's targets come from (jaxprec._src.core.algorithms).
_SUPPORT_SOURCES = {
    "tpu": ("JAX's tests/lax_test.py, testDotAlgorithm, runs only DEFAULT and "
            "the BF16_BF16_F32 presets up to X6 on a TPU"),
    "gpu": "XLA's IsSupportedDotAlgorithmOnGpu, xla/service/algorithm_util.cc",
}


def unsupported_message(p: Precision, target: str) -> str:
  """Why ``target`` cannot run ``p``, and the precisions that it can run."""
  asked = (algorithms.record(algorithms.PRESETS[p.preset.name])
           if p.preset is not None else None)
  what = f"{p.name} ({asked.algorithm}: {asked.note})" if asked else p.name
  seen, offers = set(), []
  for name in _LEVEL_SPELLINGS[target]:
    n = resolve(name).on(target)
    if n.supported and n.algorithm not in seen:
      seen.add(n.algorithm)
      offers.append(f"{name!r} ({n.algorithm}, {n.operand_bits} significand "
                    f"bits)")
  if asked is not None and not asked.modelled:
    return (f"{what}: jaxprec does not model this algorithm, so it cannot "
            f"emulate it or say what a {target.upper()} computes for it (XLA "
            f"scales each operand into float8_e4m3fn's range in a rewrite of "
            f"its own). To emulate, use {', '.join(offers[:-1])} or "
            f"{offers[-1]}.")
  others = [t for t in TARGETS if t != target and asked is not None
            and t in asked.targets]
  elsewhere = "".join(f"; a {t.upper()} runs {p.name} (target={t!r})"
                      for t in others)
  return (f"{what} does not run on a {target.upper()}: XLA rejects the "
          f"algorithm there ({_SUPPORT_SOURCES[target]}). "
          f"On a {target.upper()} use {', '.join(offers[:-1])} or "
          f"{offers[-1]}{elsewhere}.")


def op_numerics(precision: PrecisionLike, target: str, lhs_dtype: Any,
                rhs_dtype: Any, *, op: str = "dot_general") -> Numerics | None:
  """What ``target`` runs for one matmul or conv: the one decision.

  The audit's TPU and GPU columns, the emulation (:func:`algorithm_for`)
  and the cost model all ask here, so they give an op the same answer.

  Args:
    precision: anything ``lax.dot_general`` accepts (None, a
      ``lax.Precision``, a ``(lhs, rhs)`` pair, a ``DotAlgorithmPreset``, their
      names) and any jaxprec name. None means the value of
      ``jax.config.jax_default_matmul_precision`` now (None there: the
      target's default, ``DEFAULT``).
    target: one of :data:`EMULATION_TARGETS` (``'cpu'``/``'native'`` emulate
      nothing).
    lhs_dtype, rhs_dtype: the operand dtypes. The precision applies where one
      operand is float32 and the other float32, bfloat16, float16 or a
      float8 (or float4) type (the narrower one is exact in float32): a
      float32 x bfloat16 or float32 x float8_e4m3fn dot at ``DEFAULT`` is one
      bfloat16 pass on a TPU. An ``ANY_F8_*`` preset is its record whatever
      the operands (JAX lowers it for two float8 operands only; the emulation
      refuses others).
    op: ``'dot_general'`` or ``'conv_general_dilated'``. Convolutions
      understand levels only: under a ``DotAlgorithmPreset`` JAX lowers them at
      ``DEFAULT`` (JAX's conv_general_dilated lowering,
      jax/_src/lax/convolution.py), and so does the emulation.

  Returns:
    The algorithm's record (:class:`jaxprec.Numerics`), the ``'unsupported'``
    record where the target does not run the precision's algorithm, or None
    where the precision does not apply (other operand dtypes, target
    ``'cpu'``/``'native'``): the op runs natively.

  Raises:
    ValueError: unknown target, op or precision (a custom
      ``lax.DotAlgorithm`` too).
  """
  target = check_target(target, emulation=True)
  kind = op_kind(op)
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  p = resolve(precision)  # validates even when nothing is emulated
  if target in ("cpu", "native"):
    return None
  if p.preset is not None and kind == "conv":
    p = resolve(_P.DEFAULT)  # a convolution under a preset (per_op's rule)
  if p.preset is not None and algorithms.PRESETS[p.preset.name] == "f8":
    return p.on(target)  # for two float8 operands (the emulation checks)
  if not emulatable(lhs_dtype, rhs_dtype):
    return None
  return p.on(target)


# The rules a dot's shape brings in (:func:`shape_rule`), as the audit shows
# them.
VECTOR_DOT_RULE = "f32: vector·vector, strength-reduced"
MATVEC_RULE = "f32: matrix·vector, strength-reduced"
TPU_MATVEC_RULE = "f32: matrix·vector (as JAX's maintainers state)"
# XLA:GPU strength-reduces a matrix-vector dot below this size: the
# ``threshold`` its strength reduction passes to
# ``IsMatrixMultiplicationTooSmallForRewriting`` (openxla/xla,
# xla/service/gpu/transforms/dot_strength_reduction.cc).
STRENGTH_REDUCTION_SIZE = 10_000_000


def _vector_sizes(lhs_shape, rhs_shape, dimension_numbers
                  ) -> tuple[bool, bool, int]:
  """``(lhs_is_vector, rhs_is_vector, size)`` of a dot: an operand is a
  vector when it has only batch and contracting dimensions (XLA's test);
  ``size`` is ``IsMatrixMultiplicationTooSmallForRewriting``'s
  ``(lhs non-contracting + rhs non-contracting) * contracting`` (each a
  product of dimension sizes, batch dimensions left out; xla/service/gpu/
  matmul_utils.cc)."""
  (lc, rc), (lb, rb) = dimension_numbers
  prod = lambda shape, dims: math.prod(int(shape[d]) for d in dims)  # noqa: E731
  lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  size = (prod(lhs_shape, lf) + prod(rhs_shape, rf)) * prod(lhs_shape, lc)
  return not lf, not rf, size


def _at_a_level(precision: PrecisionLike) -> Precision:
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  return resolve(precision)


def strength_reduced(precision: PrecisionLike, target: str, lhs_shape,
                     rhs_shape, dimension_numbers) -> str | None:
  """Whether XLA:GPU turns a dot into multiply + reduce, and so computes it
  in float32: the rule's label, else None.

  XLA:GPU's dot strength reduction (openxla/xla,
  ``xla/service/gpu/transforms/dot_strength_reduction.cc``,
  ``DotStrengthReduction::InstructionMatchesPattern``; before it,
  ``ShouldStrengthReduceDotToReduce`` in
  ``xla/service/gpu/transforms/algebraic_simplifier.cc``) rewrites a dot
  where one operand has only batch and contracting dimensions (a vector):

  * vector·vector always ("not supported by GemmFusion");
  * matrix·vector and vector·matrix when
    ``IsMatrixMultiplicationTooSmallForRewriting(dot, 10000000)``: the
    non-contracting sizes of both operands summed, times the contracting
    size, below 10,000,000 (batch dimensions not counted;
    ``xla/service/gpu/matmul_utils.cc``). Above it XLA also rewrites a dot
    that Triton's GEMM emitter cannot handle (``CanTritonHandleGEMM``),
    which is not modelled here: such a dot keeps its algorithm.

  The multiply it writes for a dot without an explicit algorithm
  (``MakeMultiplyForDotPrecisionAlgorithm``, ``ALG_UNSET``) is a float32
  multiply and the reduce sums in float32 (``GetGemmAccumulatorType``): at
  a precision level such a dot is exact float32, not TF32. An explicit
  algorithm (a preset) rounds the multiply's operands as the algorithm
  says, which the algorithm's own model computes: None.

  Args:
    precision: as :func:`op_numerics` (None: the flag in force).
    target: the target; None for any but ``'gpu'``.
    lhs_shape, rhs_shape: the operands' shapes.
    dimension_numbers: the dot's ``((lhs_contract, rhs_contract),
      (lhs_batch, rhs_batch))``.

  Returns:
    :data:`VECTOR_DOT_RULE`, :data:`MATVEC_RULE` or None.

  Examples:
    >>> from jaxprec._src.core.numerics import strength_reduced
    >>> mv = (((1,), (0,)), ((), ()))
    >>> strength_reduced("default", "gpu", (998, 10000), (10000,), mv)
    'f32: matrix·vector, strength-reduced'
    >>> strength_reduced("default", "gpu", (999, 10000), (10000,), mv) is None
    True
  """
  if target != "gpu" or _at_a_level(precision).preset is not None:
    return None
  return reduced_by_shape(lhs_shape, rhs_shape, dimension_numbers)


def reduced_by_shape(lhs_shape, rhs_shape, dimension_numbers) -> str | None:
  """Whether XLA:GPU's strength reduction rewrites a dot of these shapes
  into multiply + reduce, whatever its precision (:func:`strength_reduced`
  has the rule): :data:`VECTOR_DOT_RULE`, :data:`MATVEC_RULE` or None.

  Under a preset the multiply's operands are rounded as the algorithm says
  (``MakeMultiplyForDotPrecisionAlgorithm``) and summed in float32 by the
  reduce: no tensor core computes such a dot, so a chip's model does not
  apply to it."""
  lhs_vector, rhs_vector, size = _vector_sizes(lhs_shape, rhs_shape,
                                               dimension_numbers)
  if not (lhs_vector or rhs_vector):
    return None
  if lhs_vector and rhs_vector:
    return VECTOR_DOT_RULE
  return MATVEC_RULE if size < STRENGTH_REDUCTION_SIZE else None


def tpu_matvec(precision: PrecisionLike, target: str, lhs_shape, rhs_shape,
               dimension_numbers) -> str | None:
  """Whether a TPU computes a dot in float32 because it is a matrix-vector
  product: :data:`TPU_MATVEC_RULE`, else None.

  Not a measured rule: a JAX maintainer's statement, "If you perform a
  matrix-vector multiplication, it is performed in full ``float32``
  precision on TPU" (https://github.com/jax-ml/jax/issues/16349, at the
  default precision; the TPU compiler is closed). jaxprec applies it where
  one operand has no free (non-batch, non-contracting) dimension at all
  (matrix·vector, vector·matrix, vector·vector, batched or not) and the
  precision is the level ``DEFAULT`` (one bfloat16 pass otherwise); an
  explicit preset (``BF16_BF16_F32``) and the multi-pass levels keep their
  algorithms. :func:`jaxprec.emulate`'s ``tpu_matvec_f32=False`` turns it
  off.

  Args:
    precision, lhs_shape, rhs_shape, dimension_numbers: as
      :func:`strength_reduced`.
    target: the target; None for any but ``'tpu'``.

  Examples:
    >>> from jaxprec._src.core.numerics import tpu_matvec
    >>> tpu_matvec(None, "tpu", (4, 8), (8,), (((1,), (0,)), ((), ())))
    "f32: matrix·vector (as JAX's maintainers state)"
    >>> tpu_matvec(None, "tpu", (4, 8), (8, 2), (((1,), (0,)), ((), ()))) is None
    True
  """
  if target != "tpu":
    return None
  lhs_vector, rhs_vector, _ = _vector_sizes(lhs_shape, rhs_shape,
                                            dimension_numbers)
  if not (lhs_vector or rhs_vector):
    return None
  p = _at_a_level(precision)
  if p.preset is not None or p.level != _P.DEFAULT:
    return None
  return TPU_MATVEC_RULE


def shape_rule(precision: PrecisionLike, target: str, lhs_shape, rhs_shape,
               dimension_numbers, *, tpu_matvec_f32: bool = True
               ) -> str | None:
  """The rule that makes ``target`` compute a dot of these shapes in exact
  float32 (:func:`strength_reduced` on a GPU; on a TPU :func:`tpu_matvec`,
  unless ``tpu_matvec_f32`` is False), else None. The emulation and the
  audit both ask here."""
  if target == "gpu":
    return strength_reduced(precision, target, lhs_shape, rhs_shape,
                            dimension_numbers)
  if target == "tpu" and tpu_matvec_f32:
    return tpu_matvec(precision, target, lhs_shape, rhs_shape,
                      dimension_numbers)
  return None


def algorithm_for(precision: PrecisionLike, target: str, lhs_dtype: Any,
                  rhs_dtype: Any, *, op: str = "dot_general") -> str:
  """Names the algorithm ``target`` runs for a matmul or conv at ``precision``.

  The one reading of a precision name on a target: what
  ``jax.default_matmul_precision(name)`` makes ``target`` compute (the
  ``jax.lax.Precision`` docs for the levels; a ``DotAlgorithmPreset`` names
  its algorithm on every target that runs it). ``'bfloat16'`` is one
  bfloat16 pass on a TPU and TF32 on an Ampere+ GPU, whose one bfloat16 pass
  is ``'BF16_BF16_F32'``. :func:`jaxprec.emulate`, the checker's rows, the
  search's candidates and the cost model ask here, and the audit asks
  :func:`op_numerics`, which this reads.

  Args:
    precision, target, lhs_dtype, rhs_dtype, op: as :func:`op_numerics`.

  Returns:
    One of :data:`ALGORITHMS` (:func:`op_numerics`' record; ``'native'``
    where nothing is emulated, ``F64_F64_F64`` included; ``'f8'`` for an
    ``ANY_F8_*`` preset on float8 operands).

  Raises:
    UnsupportedAlgorithmError: ``target`` does not run the algorithm (e.g.
      ``F32_F32_F32`` or a TF32 preset on a TPU); the message names the
      precisions it runs.
    ValueError: unknown target, op or precision.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxprec._src.core.numerics import algorithm_for
    >>> algorithm_for("highest", "tpu", jnp.float32, jnp.float32)
    'bf16x6'
    >>> algorithm_for("BF16_BF16_F32_X3", "gpu", jnp.float32, jnp.float32)
    'bf16x3'
    >>> algorithm_for("bfloat16", "gpu", jnp.float32, jnp.float32)
    'tf32'
    >>> algorithm_for("BF16_BF16_F32_X3", "tpu", jnp.float32, jnp.float32,
    ...               op="conv_general_dilated")
    'bf16x1'
    >>> algorithm_for("high", "tpu", jnp.bfloat16, jnp.bfloat16)
    'native'
    >>> algorithm_for("default", "tpu", jnp.float32, jnp.bfloat16)
    'bf16x1'
    >>> algorithm_for("F32_F32_F32", "tpu", jnp.float32, jnp.float32)
    Traceback (most recent call last):
    ...
    jaxprec._src.core.numerics.UnsupportedAlgorithmError: F32_F32_F32 (f32: exact float32) does not run on a TPU: ... use 'float32' (bf16x6, 24 significand bits), ...
  """
  n = op_numerics(precision, target, lhs_dtype, rhs_dtype, op=op)
  if n is None:
    return "native"
  if not n.supported:
    if precision is None:
      precision = jax.config.jax_default_matmul_precision
    raise UnsupportedAlgorithmError(
        unsupported_message(resolve(precision), target))
  return "native" if n.algorithm in algorithms.NATIVE else n.algorithm


def carried(precision: PrecisionLike, source: str, target: str
            ) -> PrecisionLike:
  """A precision ``target`` computes as ``source`` computes ``precision``
  (float32 operands): ``precision`` where the two read it alike, else the
  preset of the algorithm ``source`` runs (a CPU's: exact float32), where
  ``target`` runs one (else ``precision`` as typed); None for a CPU, which
  computes every precision as exact float32 (and refuses some presets).

  Examples:
    >>> from jaxprec._src.core.numerics import carried
    >>> carried("default", "tpu", "gpu"), carried(None, "cpu", "gpu")
    ('BF16_BF16_F32', 'F32_F32_F32')
    >>> carried("float32", "gpu", "tpu")  # a TPU runs no exact float32
    'float32'
  """
  if source == target or target == "native":
    return precision
  if target == "cpu":
    return None
  f32 = np.float32
  want = algorithm_for(precision, source, f32, f32)
  if source not in TARGETS:  # a CPU computes float32 exactly
    want = "f32"
  try:
    if algorithm_for(precision, target, f32, f32) == want:
      return precision
  except UnsupportedAlgorithmError:
    pass
  return next((name for name, a in algorithms.PRESETS.items()
               if a == want and target in algorithms.record(a).targets),
              precision)
