"""The one table of matmul algorithms: one record per algorithm, and which runs where.

Each :class:`Numerics` record names one algorithm that a TPU or an NVIDIA GPU
runs for a matmul or convolution with float32 operands. :data:`LEVELS` says
which algorithm each ``lax.Precision`` level means on each target and
:data:`PRESETS` which one each ``lax.DotAlgorithmPreset`` names. Every other
module that needs one of these facts asks here.

Sources:

* Levels: the ``jax.lax.Precision`` docs (TPU ``DEFAULT`` one bfloat16 pass,
  ``HIGH`` three, ``HIGHEST`` six; GPU ``DEFAULT`` TF32, ``HIGHEST`` float32).
  GPU ``HIGH`` is TF32 on some chips and float32 on others; the table says
  TF32, the cheaper, the one that can surprise.
* The passes of each algorithm: XLA's ``DotAlgorithmRewriter``
  (openxla/xla, ``xla/service/gpu/transforms/dot_algorithm_rewriter.cc``:
  ``RewriteF32ToBF16X3``, ``RewriteF32ToBF16X6``) and its Triton emitter
  (``xla/backends/gpu/codegen/triton/dot_algorithms.cc``: ``EmitBF16x9Matmul``,
  TF32x3).
* Which target runs an algorithm: JAX's own test matrix
  (``tests/lax_test.py``, ``testDotAlgorithm``) runs only ``DEFAULT``,
  ``BF16_BF16_F32``, ``BF16_BF16_F32_X3`` and ``BF16_BF16_F32_X6`` on a TPU
  and skips the others there as "not supported on TPU"
  (``testDotAlgorithmCasting``: "F32_F32_F32 is not supported on TPU");
  XLA's ``IsSupportedDotAlgorithmOnGpu`` (``xla/service/algorithm_util.cc``)
  accepts ``TF32_TF32_F32``, ``TF32_TF32_F32_X3``, the bfloat16 passes and
  ``F32_F32_F32`` for float32 operands on Ampere and newer. An algorithm a
  target does not run is a compile error there, never a silent fallback, and
  jaxprec says so wherever it meets one (:func:`meaning`).
* Which presets a CPU refuses is not in this table: JAX's dot lowering
  decides (``_handle_dot_precision`` in ``jax/_src/lax/lax.py``, which took
  ``F16_F16_F32`` from jax 0.12.1 on), so :mod:`jaxprec._src.core.precision`
  asks the installed JAX.
* The float8 split presets of jax 0.12.1 (``F8E4M3FN_F8E4M3FN_F32_X3`` and
  ``_X4``): their docstrings in ``jax/_src/lax/lax.py`` and the algorithm
  they lower to (``hlo.DotAlgorithm`` with float8_e4m3fn operands, float32
  accumulation, 3 or 4 primitive operations). XLA scales each operand into
  float8_e4m3fn's range before it splits it, in a rewrite this table does not
  model: :data:`UNMODELLED`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxprec._src.core import names

# What a TPU or an Ampere+ GPU computes.
TARGETS = ("tpu", "gpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Numerics:
  """One algorithm: what a precision computes for float32 operands on a target.

  Attributes:
    algorithm: its name, e.g. ``'bf16x1'``, ``'bf16x3'``, ``'bf16x6'``,
      ``'tf32'``, ``'f32'`` (jaxprec's emulation uses these names), or
      ``'unsupported'`` where the target does not run the precision.
    passes: matmul passes it runs (1 for a single pass or for exact float32;
      0 where the target does not run it).
    pass_format: the format each pass multiplies in (``'bfloat16'``,
      ``'tensorfloat32'``, ``'float16'``, ``'float32'``, ``'float64'``,
      ``'float8'``; ``''`` where the target does not run it).
    operand_bits: significand bits (implicit bit included) that the operands
      effectively keep: 24 for float32, 8 for bfloat16, 11 for TF32 and
      float16, about 16 for three bfloat16 passes.
    dots: the dots each emulation kernel spends on it: ``(bfloat16 dots of the
      bf16 kernel, float32 dots of the bf16 kernel, float32 dots of the f32
      kernel)`` (:mod:`jaxprec._src.emulation.kernels`); None where no kernel runs it
      (exact float32 is one native dot).
    targets: the targets that run it (:data:`TARGETS`).
    note: one line for humans.
    modelled: False for an algorithm jaxprec names but does not model
      (:data:`UNMODELLED`): neither emulated nor costed, and refused with a
      message that says so.
  """

  algorithm: str
  passes: int
  operand_bits: int
  note: str
  pass_format: str = ""
  dots: tuple[int, int, int] | None = None
  targets: tuple[str, ...] = ()
  modelled: bool = True

  @property
  def rel_error(self) -> float:
    """Expected relative error of one product: ``2 * 2**-operand_bits``
    (the bound for a product of two rounded operands)."""
    return 2.0 * 2.0 ** -self.operand_bits

  @property
  def supported(self) -> bool:
    """False for the :data:`UNSUPPORTED` meaning and for an algorithm
    jaxprec does not model (:data:`UNMODELLED`)."""
    return self.passes > 0 and self.modelled


def numerics_dict(n: Numerics) -> dict[str, Any]:
  """A :class:`~jaxprec.Numerics` record's figures as JSON-able values."""
  return {"algorithm": n.algorithm, "passes": n.passes,
          "operand_bits": n.operand_bits, "rel_error": n.rel_error,
          "note": n.note}


_BOTH = ("tpu", "gpu")
_GPU = ("gpu",)

RECORDS: Mapping[str, Numerics] = {n.algorithm: n for n in (
    Numerics(algorithm="bf16x1", passes=1, operand_bits=8,
             pass_format="bfloat16", dots=(1, 0, 1), targets=_BOTH,
             note="1 bfloat16 pass: operands rounded to bfloat16, float32 "
                  "accumulation"),
    Numerics(algorithm="bf16x3", passes=3, operand_bits=16,
             pass_format="bfloat16", dots=(3, 0, 2), targets=_BOTH,
             note="3 bfloat16 passes (about 16 significand bits)"),
    Numerics(algorithm="bf16x6", passes=6, operand_bits=24,
             pass_format="bfloat16", dots=(6, 0, 3), targets=_BOTH,
             note="6 bfloat16 passes (about float32; subnormals dropped)"),
    Numerics(algorithm="bf16x9", passes=9, operand_bits=24,
             pass_format="bfloat16", dots=(9, 0, 3), targets=_BOTH,
             note="9 bfloat16 passes (float32 including the smallest terms)"),
    Numerics(algorithm="bf16_bf16_bf16", passes=1, operand_bits=8,
             pass_format="bfloat16", dots=(1, 0, 1), targets=_BOTH,
             note="bfloat16 operands and a bfloat16 result"),
    Numerics(algorithm="tf32", passes=1, operand_bits=11,
             pass_format="tensorfloat32", dots=(0, 1, 1), targets=_GPU,
             note="TensorFloat-32: operands keep 10 explicit mantissa bits"),
    Numerics(algorithm="tf32x3", passes=3, operand_bits=21,
             pass_format="tensorfloat32", dots=(0, 3, 2), targets=_GPU,
             note="3 TF32 passes (about 21 significand bits)"),
    Numerics(algorithm="f16", passes=1, operand_bits=11,
             pass_format="float16", dots=(0, 1, 1), targets=_BOTH,
             note="operands rounded to float16, float32 accumulation"),
    Numerics(algorithm="f16_f16_f16", passes=1, operand_bits=11,
             pass_format="float16", dots=(0, 1, 1), targets=_BOTH,
             note="float16 operands and a float16 result"),
    Numerics(algorithm="f32", passes=1, operand_bits=24,
             pass_format="float32", targets=_GPU, note="exact float32"),
    Numerics(algorithm="f64", passes=1, operand_bits=53,
             pass_format="float64", targets=_GPU, note="float64"),
    Numerics(algorithm="f8", passes=1, operand_bits=4, pass_format="float8",
             targets=_BOTH,
             note="8-bit float operands (for 8-bit float inputs only)"),
    # jax 0.12.1: bfloat16 or float32 operands, each scaled into
    # float8_e4m3fn's range and split into a float8_e4m3fn part and a
    # float8_e4m3fn residual; 3 float8 dots (the residual x residual product
    # dropped) or all 4, float32 accumulation (DotAlgorithmPreset's
    # docstrings, jax/_src/lax/lax.py). About 8 significand bits per operand
    # (two parts of 4). How XLA picks the scale, and which chips run it, is
    # in XLA's rewrite, which jaxprec does not model.
    Numerics(algorithm="f8e4m3fn_x3", passes=3, operand_bits=8,
             pass_format="float8", modelled=False,
             note="3 float8_e4m3fn passes on scaled parts (not modelled by "
                  "jaxprec)"),
    Numerics(algorithm="f8e4m3fn_x4", passes=4, operand_bits=8,
             pass_format="float8", modelled=False,
             note="4 float8_e4m3fn passes on scaled parts (not modelled by "
                  "jaxprec)"),
)}

# The algorithms jaxprec names but does not model: resolved, audited as
# "not modelled", and refused by the emulation with a message that says so.
UNMODELLED = tuple(a for a, r in RECORDS.items() if not r.modelled)

# What a target answers for an algorithm it does not run.
UNSUPPORTED = Numerics(algorithm="unsupported", passes=0, operand_bits=0,
                       note="not supported on this backend")
# CPU ignores every level and the presets it runs: all give the same
# float32 results (the presets it refuses: CPU_UNSUPPORTED).
CPU = Numerics(algorithm="f32", passes=1, operand_bits=24,
               pass_format="float32",
               note="exact float32: CPU ignores every precision level")

# What a CPU answers for a preset JAX's dot lowering refuses there ("not
# supported by dot_general on CPU"; jaxprec._src.core.precision asks the
# installed JAX which).
CPU_UNSUPPORTED = Numerics(
    algorithm="unsupported", passes=0, operand_bits=0,
    note="JAX refuses the preset on CPU (not supported by dot_general on "
         "CPU); jaxprec.emulate computes it for target 'tpu' or 'gpu'")
# The same for a preset jaxprec does not model (UNMODELLED): no target
# emulates it either.
CPU_UNMODELLED = Numerics(
    algorithm="unsupported", passes=0, operand_bits=0,
    note="JAX refuses the preset on CPU (not supported by dot_general on "
         "CPU), and jaxprec does not model it for any target")

# The algorithm each level means on each target, by lax.Precision name.
LEVELS: Mapping[str, Mapping[str, str]] = {
    "tpu": {"DEFAULT": "bf16x1", "HIGH": "bf16x3", "HIGHEST": "bf16x6"},
    "gpu": {"DEFAULT": "tf32", "HIGH": "tf32", "HIGHEST": "f32"},
}
# The algorithm each preset names, by lax.DotAlgorithmPreset name; the same
# on every target that runs it (Numerics.targets).
PRESETS: Mapping[str, str] = {
    "BF16_BF16_F32": "bf16x1", "BF16_BF16_F32_X3": "bf16x3",
    "BF16_BF16_F32_X6": "bf16x6", "BF16_BF16_F32_X9": "bf16x9",
    "BF16_BF16_BF16": "bf16_bf16_bf16",
    "TF32_TF32_F32": "tf32", "TF32_TF32_F32_X3": "tf32x3",
    "F16_F16_F32": "f16", "F16_F16_F16": "f16_f16_f16",
    "F32_F32_F32": "f32", "F64_F64_F64": "f64",
    "ANY_F8_ANY_F8_F32": "f8", "ANY_F8_ANY_F8_F32_FAST_ACCUM": "f8",
    "ANY_F8_ANY_F8_ANY": "f8", "ANY_F8_ANY_F8_ANY_FAST_ACCUM": "f8",
    "F8E4M3FN_F8E4M3FN_F32_X3": "f8e4m3fn_x3",
    "F8E4M3FN_F8E4M3FN_F32_X4": "f8e4m3fn_x4",
}
# Algorithms JAX computes itself (no emulation kernel: the lax op runs as
# recorded). 'f8' has no kernel either: the emulation widens its float8
# operands to float32, where their products are exact, and runs one float32
# dot (jaxprec._src.emulation.emulated_ops.emulated_op).
NATIVE = ("f64",)


def record(algorithm: str) -> Numerics:
  """The record of ``algorithm``; ValueError naming the choices otherwise."""
  try:
    return RECORDS[algorithm]
  except KeyError:
    raise names.unknown("algorithm", algorithm, RECORDS) from None


def meaning(algorithm: str, target: str) -> Numerics:
  """What ``target`` (one of :data:`TARGETS`) computes for ``algorithm``: its
  record where the target runs it, :data:`UNSUPPORTED` where it does not."""
  r = record(algorithm)
  return r if target in r.targets or not r.modelled else UNSUPPORTED


def float32_algorithm(target: str) -> str:
  """The algorithm ``target`` runs at ``HIGHEST``: its float32 matmul."""
  return LEVELS[target]["HIGHEST"]


def emulated() -> tuple[str, ...]:
  """The algorithms an emulation kernel runs (a record with ``dots``)."""
  return tuple(a for a, r in RECORDS.items() if r.dots is not None)


def pass_type(key: str, target: str) -> tuple[str, int] | None:
  """``(pass format, passes)`` of an algorithm on ``target``, or of a
  ``'native <dtype>'`` cost key (an op on operands the precision does not
  apply to): a native float32 op runs as the target's float32 algorithm
  (:func:`float32_algorithm`), any other as one pass in its own dtype. None
  where the target does not run the algorithm, or for a custom one.
  """
  if key.startswith("native "):
    dtype = key[len("native "):]
    if dtype != "float32":
      return dtype, 1
    key = float32_algorithm(target)
  r = RECORDS.get(key)
  if r is None or target not in r.targets:
    return None
  return r.pass_format, r.passes
