"""Rows: how ``check``, ``search_policy`` and ``check_training`` compute one row.

A row is a precision or a :class:`jaxprec.Policy`; :func:`plan` says how it
is computed for a target in a mode (:class:`Plan`): emulated
(:func:`jaxprec.emulate`) or natively under JAX's flag or the policy's
interception. :func:`reference_plan` does the same for a computed reference.
A :class:`Plan` may also carry a policy of dtypes (:attr:`Plan.dtypes`): the
reference of a model with dtype decisions runs every module at the reference
dtype (:func:`with_dtypes`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxprec._src.checker import reference as reference_lib
from jaxprec._src.core import numerics
from jaxprec._src.core.precision import Precision, PrecisionLike, resolve
from jaxprec._src.emulation import emulated_ops, tensor_cores
from jaxprec._src.emulation.emulate import emulate, opaque_ops
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.jaxpr import compat, walker
from jaxprec._src.policy import policy as policy_lib
from jaxprec._src.policy.policy import Policy

# The rows of a check that names none, per target: the precisions a user of
# that target chooses between whose numerics differ from the float32
# reference, each meaning what the target computes for it
# (jaxprec._src.core.numerics.algorithm_for). A TPU: its three levels,
# DEFAULT, HIGH, HIGHEST (1, 3 and 6 bfloat16 passes; the jax.lax.Precision
# docs). An Ampere+ GPU: one bfloat16 pass, which it runs only as the
# BF16_BF16_F32 algorithm (its DEFAULT and HIGH are TF32), TF32 (DEFAULT) and
# 3 TF32 passes (TF32_TF32_F32_X3, XLA's IsSupportedDotAlgorithmOnGpu in
# xla/service/algorithm_util.cc); its HIGHEST is exact float32, the
# reference itself.
DEFAULT_ROWS = {
    "tpu": ("bfloat16", "bfloat16_3x", "float32"),
    "gpu": ("BF16_BF16_F32", "tensorfloat32", "TF32_TF32_F32_X3"),
}
FLOAT64_NAMES = ("float64", "f64", "fp64", "double")
# The framework floor: the row an external reference adds first.
FLOOR = "float32"
_ONE_ROW = (str, lax.Precision, lax.DotAlgorithmPreset, Precision, Policy)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one row (a precision or a policy) is computed.

  Attributes:
    label: the row's label: as the user wrote a precision; ``str(policy)``.
    precision: the resolved precision (native runs set JAX's flag to it), or
      the :class:`jaxprec.Policy`.
    emulate_target: ``'tpu'``/``'gpu'`` to emulate as that target, None to
      run natively.
    algorithm: what runs for float32 matmuls, e.g. ``'bf16x1'``
      (``'policy'`` for a policy).
    description: what the row computes, for the report: the algorithm, the
      target, how (``'tf32 (gpu, emulated)'``, ``'bf16x6 (native tpu)'``).
    dtypes: for the reference of a model with dtype decisions, every module
      at this policy's dtype (:func:`with_dtypes`); None: ``fn`` as it is.
    options: the emulation options of an emulated row, as sorted ``(name,
      value)`` pairs passed to :func:`jaxprec.emulate` (``chip`` for a row
      emulated with GPU numerics; :func:`emulation_options`). Part of
      :attr:`key`, so no compiled program serves two chips.
  """

  label: str
  precision: Precision | Policy
  emulate_target: str | None
  algorithm: str
  description: str
  dtypes: Policy | None = None
  options: tuple[tuple[str, Any], ...] = ()

  @property
  def key(self) -> tuple:
    p = self.precision
    key = (p if isinstance(p, Policy) else p.name, self.emulate_target,
           self.options)
    return key if self.dtypes is None else (*key, str(self.dtypes))

  def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` computed as this row computes it."""
    if self.dtypes is not None:
      fn = with_dtypes(fn, self.dtypes)
    if self.emulate_target is not None:
      return emulate(fn, self.precision, target=self.emulate_target,
                     **dict(self.options))
    if isinstance(self.precision, Policy):
      # Natively: the policy's precisions as JAX's flags, per module.
      return emulate(fn, self.precision, target="native")
    flag = self.precision.flag

    @functools.wraps(fn)
    def native(*args, **kwargs):
      with jax.default_matmul_precision(flag):
        return fn(*args, **kwargs)
    return native


def native_notes(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict,
                 plans: Sequence[Plan]) -> list[str]:
  """A note per emulated target naming the ops of ``fn(*args, **kwargs)``
  (traced, not run) that its emulated rows run natively
  (:func:`jaxprec._src.emulation.emulate.opaque_ops`)."""
  rows: dict[str, list[str]] = {}
  for p in plans:
    if p.emulate_target is not None:
      rows.setdefault(p.emulate_target, []).append(p.label)
  closed = walker.trace_call(fn, args, kwargs).jaxpr if rows else None
  return [f"ran natively, not emulated (opaque to jaxprec): "
          f"{', '.join(found)}; in the emulated rows ({', '.join(labels)}) "
          f"the matmuls and convolutions inside compute as this "
          f"{compat.backend_platform()} computes them, not as the {target} "
          f"would (jaxprec.audit lists them)"
          for target, labels in rows.items()
          if (found := opaque_ops(closed, target))]


def with_dtypes(fn: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
  """``fn`` with every module at ``policy``'s dtype (linen, Hugging Face, NNX)."""
  bound = nnx_policy.bind(fn, policy)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with flax_scope.policy_scope(policy):
      return bound(*args, **kwargs)
  return run


def label_of(p: Any) -> str:
  if isinstance(p, str):
    return p
  if isinstance(p, lax.Precision):
    return p.name.lower()
  if isinstance(p, (Precision, lax.DotAlgorithmPreset)):
    return p.name
  return str(p)


def emulation_options(emulate_target: str, chip: str | None = None,
                      **options: Any) -> tuple[tuple[str, Any], ...]:
  """The options a row emulated as ``emulate_target`` passes to
  :func:`jaxprec.emulate`, as :attr:`Plan.options`.

  ``chip`` (already checked against the check's target) reaches the rows
  emulated with GPU numerics only. Other options (``tpu_matvec_f32``) are
  passed where they differ from their defaults.
  """
  out = dict(options)
  if chip is not None and emulate_target == "gpu":
    out["chip"] = chip
  return tuple(sorted(out.items()))


def _chip_words(options: tuple[tuple[str, Any], ...], algo: str) -> str:
  """The chip of a row its tensor cores compute (``'f32'`` runs on CUDA
  cores, whatever the chip: ``tensor_cores.chip_algorithms``)."""
  chip = dict(options).get("chip")
  if chip is None or (algo != "policy"
                      and algo not in tensor_cores.chip_algorithms()):
    return ""
  return f", {chip} tensor cores"


def plan(precision: PrecisionLike | Policy, target: str, mode: str,
         backend: str | None = None, *, chip: str | None = None,
         **options: Any) -> Plan:
  """How a row is computed for ``target`` in ``mode``.

  Emulated, a name means what ``target`` computes for it
  (:func:`jaxprec._src.core.numerics.algorithm_for`), as in
  :func:`jaxprec.emulate`: ``'bfloat16'`` is one bfloat16 pass on a TPU and
  TF32 on a GPU, whose one bfloat16 pass is ``'BF16_BF16_F32'``.

  Args:
    precision: a precision (any spelling :func:`jaxprec.resolve` accepts), a
      :class:`jaxprec.Policy` or a policy string (with ``=``).
    target: ``'tpu'`` or ``'gpu'``.
    mode: ``'emulate'`` or ``'native'`` (resolve ``'auto'`` first).
    backend: the backend native runs use (default: JAX's).
    chip: the NVIDIA chip whose tensor cores compute the rows emulated with
      GPU numerics (:func:`jaxprec.emulate`'s ``chip``; checked by the
      caller), or None. Native rows run on the device itself.
    **options: other emulation options (``tpu_matvec_f32``).

  Returns:
    The :class:`Plan`.

  Examples:
    >>> from jaxprec._src.checker.rows import plan
    >>> plan("tensorfloat32", "gpu", "emulate").description
    'tf32 (gpu, emulated)'
    >>> plan("tensorfloat32", "tpu", "emulate").description
    'bf16x3 (tpu, emulated)'
    >>> plan("bfloat16", "gpu", "emulate").algorithm
    'tf32'
    >>> plan("float32", "tpu", "emulate").algorithm
    'bf16x6'
    >>> plan("default=bf16,dense=float32", "tpu", "emulate").label
    'default=bfloat16,dense=float32'
  """
  if isinstance(precision, Policy) or (isinstance(precision, str)
                                       and "=" in precision):
    pol = policy_lib.as_policy(precision)
    label = str(pol)
    if mode == "native":
      backend = backend or compat.backend_platform()
      return Plan(label, pol, None, "policy", f"policy (native {backend})")
    opts = emulation_options(target, chip, **options)
    return Plan(label, pol, target, "policy",
                f"policy ({target}, emulated{_chip_words(opts, 'policy')})",
                options=opts)
  label = label_of(precision)
  p = resolve(precision)
  if mode == "native":
    backend = backend or compat.backend_platform()
    algo = p.on(backend).algorithm if backend in ("tpu", "gpu", "cuda", "rocm",
                                                   "cpu") else "?"
    if algo == "unsupported":  # JAX would refuse it when the row runs
      on = numerics.BACKEND_TARGETS.get(backend)
      raise numerics.UnsupportedAlgorithmError(
          numerics.unsupported_message(p, on) if on in numerics.TARGETS else
          f"{label} cannot run natively on this {backend}: "
          f"{p.on(backend).note} (mode='emulate')")
    return Plan(label, p, None, algo, f"{algo} (native {backend})")
  # The one meaning of a name on a target; raises where the target does not
  # run its algorithm (F32_F32_F32 or a TF32 preset on a TPU).
  algo = numerics.algorithm_for(p, target, jnp.float32, jnp.float32)
  opts = emulation_options(target, chip, **options)
  return Plan(label, p, target, algo,
              f"{algo} ({target}, emulated{_chip_words(opts, algo)})",
              options=opts)


def default_rows(target: str, *, external: bool = False) -> tuple[str, ...]:
  """The rows of a check that names none (:data:`DEFAULT_ROWS`); against an
  external reference the framework floor (:data:`FLOOR`) comes first."""
  out = DEFAULT_ROWS[target]
  return (FLOOR, *(r for r in out if r != FLOOR)) if external else out


@dataclasses.dataclass(frozen=True)
class Setting:
  """A comparison's numerics, resolved once where the user's words enter
  (:func:`setting`); the rows and runs below read it and parse no word again.

  Attributes:
    target: ``'tpu'`` or ``'gpu'``: whose numerics the rows show.
    mode: ``'emulate'`` or ``'native'`` (``'auto'`` resolved).
    chip: the NVIDIA chip whose tensor cores compute the rows emulated with
      GPU numerics, or None.
    tpu_matvec_f32: emulated TPU rows keep XLA's float32 matrix-vector rule.
  """

  target: str
  mode: str
  chip: str | None = None
  tpu_matvec_f32: bool = True

  @property
  def options(self) -> dict[str, Any]:
    """The rows' emulation options (:func:`plan`'s ``chip``, and
    ``tpu_matvec_f32`` where it is not its default)."""
    return {"chip": self.chip,
            **({} if self.tpu_matvec_f32 else {"tpu_matvec_f32": False})}


def setting(target: Any, mode: Any = "auto", chip: Any = None,
            tpu_matvec_f32: Any = True) -> Setting:
  """The :class:`Setting` of a comparison's words, each checked as
  :func:`jaxprec.emulate` checks it (a ValueError or TypeError naming the
  value and the valid choices).

  Examples:
    >>> from jaxprec._src.checker.rows import setting
    >>> setting("GPU", "auto", "h100")
    Setting(target='gpu', mode='emulate', chip='h100', tpu_matvec_f32=True)
  """
  target = numerics.check_target(target)
  chip = emulated_ops.check_chip(chip, target)
  flag = emulated_ops.check_flag("tpu_matvec_f32", tpu_matvec_f32)
  return Setting(target, numerics.resolve_mode(mode, target), chip, flag)


def plans(precisions: Any, setting: Setting, *,
          external: bool = False) -> list[Plan]:
  """One :class:`Plan` per row (None: :func:`default_rows`, ``external``
  passed on) at ``setting``; TypeError/ValueError naming a bad value."""
  target, mode = setting.target, setting.mode
  if precisions is None:
    precisions = default_rows(target, external=external)
  if isinstance(precisions, _ONE_ROW):
    precisions = (precisions,)
  if precisions is None or not isinstance(precisions, (Sequence, set, frozenset)):
    raise TypeError(
        f"precisions must be a precision name, a jaxprec.Policy, or a sequence "
        f"of them, e.g. precisions=('bfloat16', 'float32'); got "
        f"{precisions!r} of type {type(precisions).__name__}.")
  precisions = tuple(precisions)
  if not precisions:
    raise ValueError("precisions is empty: name at least one, e.g. "
                     "precisions=('bfloat16',)")
  out = [plan(p, target, mode, **setting.options) for p in precisions]
  labels = [p.label for p in out]
  if len(set(labels)) != len(labels):
    raise ValueError(f"precisions repeats a name: {labels}")
  return out


def native_float32(label: str = "float32") -> Plan:
  """float32 natively: exact where the backend has it (6 bf16 passes on a TPU)."""
  return dataclasses.replace(plan("float32", "tpu", "native"), label=label)


def reference_plan(reference: Any, target: str, mode: str, *,
                   chip: str | None = None, **options: Any) -> Plan | None:
  """None for float64; float32 runs natively (exact where the backend is);
  another precision or a policy as :func:`plan` (with ``chip`` and
  ``options``)."""
  if isinstance(reference, str) and reference.strip().lower() in FLOAT64_NAMES:
    return None
  is_policy = isinstance(reference, Policy) or (isinstance(reference, str)
                                                and "=" in reference)
  if not is_policy and resolve(reference).name in ("float32", "F32_F32_F32"):
    return native_float32(label_of(reference))
  return plan(reference, target, mode, chip=chip, **options)


# Compute dtypes a float32 or float64 reference undoes (numerics.DTYPES).
_NARROW = tuple(d for d in numerics.DTYPES if numerics.DTYPE_BYTES[d] < 4)


def computes_narrow(closed) -> bool:
  """Whether a ``ClosedJaxpr`` casts to, or multiplies in, bfloat16/float16."""
  for w in walker.iter_eqns(closed.jaxpr):
    eqn, name = w.eqn, w.eqn.primitive.name
    if name == "convert_element_type" and str(
        jnp.dtype(eqn.params["new_dtype"])) in _NARROW:
      return True
    if name in ("dot_general", "conv_general_dilated") and any(
        str(getattr(v.aval, "dtype", "")) in _NARROW for v in eqn.invars):
      return True
  return False


def is_computed(reference: Any) -> bool:
  """Whether ``reference`` is computed (a precision or policy), not read."""
  if isinstance(reference, (Policy, Precision, lax.Precision,
                            lax.DotAlgorithmPreset)):
    return True
  return isinstance(reference, str) and not reference_lib.is_file(reference)

