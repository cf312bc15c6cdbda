"""Whole-function emulation: ``jaxprec.emulate(fn, precision, target=...)``.

The function is traced once per input signature with JAX's precision flag
cleared, so that the jaxpr records ``precision=None`` exactly on the ops the
user wrote without one. The shared walker then re-evaluates the jaxpr with
every ``dot_general`` and ``conv_general_dilated`` (at any depth: jit, remat,
scan, while, cond, custom_jvp, custom_vjp, shard_map) replaced by its emulated
counterpart from :mod:`jaxprec._src.emulation.emulated_ops`. Nested structure
is kept.

Which precision an op gets:

* an op whose code passed ``precision=`` keeps it;
* an op without one takes ``precision`` (convolutions take its level, as
  ``@jaxprec.precision`` does, so a preset never silently downgrades them), or,
  when ``precision`` is None, the precision in force when the emulated function
  is traced (``jaxprec.precision`` scopes, ``set_default``, the env var);
* a convolution whose code passed a ``DotAlgorithmPreset`` is emulated at
  DEFAULT, because that is how JAX lowers it (JAX's conv_general_dilated
  lowering, jax/_src/lax/convolution.py).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax import lax

from jaxprec._src.core import names
from jaxprec._src.core import numerics
from jaxprec._src.core.context import current
from jaxprec._src.core.precision import Precision, PrecisionLike, cpu_refuses, resolve
from jaxprec._src.emulation import dtype_emulation
from jaxprec._src.emulation import emulated_ops
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import walker
from jaxprec._src.policy import policy as policy_lib

F = TypeVar("F", bound=Callable[..., Any])


class OpaqueOpWarning(UserWarning):
  """``fn`` calls ops jaxprec cannot see into (a Pallas kernel, an FFI call, a
  host callback): they run natively, not as the emulated target would."""


class PolicyUnreachedWarning(UserWarning):
  """A policy's per-module precision cannot reach the matmuls inside a
  library's primitive (one lowered with ``mlir.lower_fun``, such as lineax's
  ``linear_solve``): JAX traces its implementation when the program is
  lowered, at the precision in force at the call, not the module's. jaxprec
  emulates them at that precision, as the target computes them; give the
  library's own ``precision=`` option, or scope the whole call."""


def emulation_rule(default: Precision, *, target: str,
                   conv_default: Precision | None = None,
                   on_opaque: Callable[[str], None] | None = None,
                   guarded: frozenset = frozenset(),
                   **options) -> walker.Rule:
  """The walker rule that emulates dots and convs (used by :func:`emulate`).

  bfloat16/float16 compute is rounded once per op first
  (:func:`jaxprec._src.emulation.dtype_emulation.rewrite`).

  Args:
    default: the precision for ops that recorded none.
    target: 'tpu' or 'gpu' ('cpu'/'native' emulate nothing).
    conv_default: the precision for convolutions that recorded none, if not
      ``default`` (a policy's ``conv=`` rule).
    on_opaque: called with :func:`walker.opaque_name` of every opaque op met
      (bound unchanged: jaxprec cannot emulate inside it).
    guarded: variables a transpose made (:func:`transposed`): an op reads
      them behind an optimization barrier.
    **options: passed to the emulated ops (e.g. ``tf32_rounding='truncate'``).
  """
  dot_default = numerics.per_op(default, "dot")
  conv_level = numerics.per_op(
      default if conv_default is None else conv_default, "conv")
  conv_default = None if conv_level is None else (conv_level, conv_level)

  def guard(eqn) -> tuple[bool, bool]:
    return tuple(not isinstance(v, compat.Literal) and v in guarded
                 for v in eqn.invars[:2])

  def rule(eqn, invals):
    prim = eqn.primitive
    if emulated_ops.is_emulated_call(eqn):
      return walker.bind_unchanged(eqn, invals)  # emulated already: keep as is
    opaque = walker.opaque_name(eqn, target)
    if opaque is not None:
      if on_opaque is not None:
        on_opaque(opaque)
      return walker.bind_unchanged(eqn, invals)
    low = dtype_emulation.rewrite(eqn, invals, target=target, **options)
    if low is not None:  # bfloat16/float16 compute: one rounding per op
      return low
    if prim.name == "ragged_dot_general":  # dots at its precision
      return emulated_ops.emulated_ragged_dot(eqn, invals, rule)
    p = eqn.params
    if prim is lax.dot_general_p:
      prec = dot_default if p["precision"] is None else p["precision"]
    elif prim is lax.conv_general_dilated_p:
      prec = (conv_default if p["precision"] is None
              else numerics.lowered(p["precision"], "conv"))
    else:
      return None
    out = emulated_ops.emulated_op(
        prim.name, *invals, emulated_ops.op_params(eqn), prec,
        p.get("preferred_element_type"),
        target=target, guard=guard(eqn), **options)
    return [out]
  # What the walker reads where it rewrites a library's primitive
  # (walker.bind_traced): the platform whose lowering XLA would compile, and
  # where the opaque ops inside its implementation are reported.
  rule.target = target
  rule.on_opaque = on_opaque
  return rule


# Ops that keep each element: an operand a transpose made stays one.
_KEEPS = frozenset({"reshape", "squeeze", "expand_dims", "convert_element_type",
                    "copy", "copy_p", "broadcast_in_dim", "slice"})


def transposed(closed) -> frozenset:
  """The variables of ``closed`` (at any depth) a transpose made, directly or
  through data movement: the operands an emulated op reads behind an
  ``optimization_barrier``.

  Otherwise XLA folds the transpose into the op's dots: ``w.T @ w`` became a
  bfloat16 dot in a layout XLA:CPU cannot run ("Unsupported element type
  for DotThunk"), or a float32 dot that sums in another order than where
  the operand arrives already transposed, as in the branches of the search's
  switched program (:mod:`jaxprec._src.search.switch`). Only those operands:
  a barrier on every operand slows compilation.
  """
  out: set = set()
  for w in walker.iter_eqns(closed):
    eqn = w.eqn
    name = eqn.primitive.name
    if name in ("transpose", "rev") or (
        name in _KEEPS and eqn.invars
        and not isinstance(eqn.invars[0], compat.Literal)
        and eqn.invars[0] in out):
      out.update(eqn.outvars)
  return frozenset(out)


def emulate(fn: F, precision: PrecisionLike | policy_lib.Policy = None, *,
            target: str = "tpu",
            **options: Any) -> F:
  """Returns ``fn`` with every matmul and conv computed as ``target`` would.

  On any backend (CPU included, where JAX ignores precision), the returned
  function computes what ``fn`` computes on a TPU (``target='tpu'``: one, three
  or six bfloat16 passes) or an Ampere+ NVIDIA GPU (``target='gpu'``: TF32 or
  float32) at the given precision. It has ``fn``'s signature, composes with
  ``jax.jit``, ``jax.grad`` and ``jax.vmap`` in either order, and its
  gradients' matmuls are emulated at the same precision. Ops that compute in
  bfloat16 or float16 are computed in float32 and rounded once each (dots:
  float32 sums of exact products, one rounding), whatever XLA's excess
  precision would do (docs/fidelity.md). Under ``jax.jit`` the
  emulated function traces once per input signature; called eagerly, it keeps
  a trace cache so ``fn``'s Python code runs once per signature (as under jit).

  Args:
    fn: the function to emulate.
    precision: precision for the matmuls and convs that ``fn`` wrote without
      one; None uses the precision in force when the emulated function is
      traced. Ops with an explicit ``precision=`` keep theirs. A
      :class:`jaxprec.Policy` (or a policy string) gives Flax linen modules
      called by ``fn`` their own precisions (as :func:`jaxprec.swap`), and
      other ops the precision its rules give ops of their kind outside any
      module (path ``''``), else its default.
    target: ``'tpu'``, ``'gpu'``, or ``'cpu'``/``'native'`` for no emulation:
      then ``fn`` runs natively with the precision (or the policy's
      precisions and compute dtypes) applied as :func:`jaxprec.swap` applies
      them, so on a TPU or GPU it computes what was asked.
    **options: passed to the emulated ops: ``tf32_rounding`` (``'nearest'``,
      ``'nearest_away'`` or ``'truncate'``); with ``target='gpu'``,
      ``chip`` (``'a100'``, ``'h100'`` or ``'b200'``: every dot computed as
      that chip's tensor cores compute it, gradients included) and
      ``fp8_promotion_interval``; with ``target='tpu'``,
      ``tpu_matvec_f32`` (default True: matrix·vector dots at ``DEFAULT`` in
      float32, as JAX's maintainers state a TPU computes them; False: one
      bfloat16 pass like any dot). See :func:`jaxprec.emulated_dot_general`.

  Returns:
    The emulated function.

  Raises:
    TypeError: ``fn`` is not callable, an unknown option, or a
      ``tpu_matvec_f32`` that is not a bool.
    ValueError: unknown precision, target, ``tf32_rounding`` or chip, or a
      chip with a target other than ``'gpu'``.

  Examples:
    >>> import jax.numpy as jnp, jaxprec
    >>> x = jnp.full((1, 1), 1 + 2.0**-10)
    >>> float((x @ x)[0, 0]) == (1 + 2.0**-10) ** 2          # CPU: exact float32
    True
    >>> y = jaxprec.emulate(lambda a: a @ a, "bfloat16")(x)  # TPU: one bf16 pass
    >>> float(y[0, 0])
    1.0
  """
  if not callable(fn):
    raise TypeError(f"jaxprec.emulate expects a callable; got {fn!r} of type "
                    f"{type(fn).__name__}")
  target = numerics.check_target(target, emulation=True)
  options = _check_options(options, target)
  policy = None
  if isinstance(precision, policy_lib.Policy) or (
      isinstance(precision, str) and "=" in precision):
    policy = policy_lib.Policy.parse(precision)
  if target in ("cpu", "native"):
    if policy is None and precision is None:
      return fn
    # Nothing emulated, but what was asked still applies: precisions as JAX's
    # flags (a TPU or GPU runs them), compute dtypes as the modules' own.
    return _native(fn, policy or policy_lib.Policy(default=resolve(precision)))
  recorder = None if policy is None else flax_scope.Recorder(policy)
  # An NNX module's state is an argument of each call, not a constant of the
  # cached trace (no stale weights); the policy reaches its copy.
  fn, stateful = nnx_policy.lift(fn, policy, recorder)
  emulated = _emulator(fn, policy if policy is not None else precision,
                       target, options, recorder, stateful)
  if recorder is not None:
    emulated._jaxprec_recorder = recorder  # for jaxprec.policy_report
  return emulated  # type: ignore[return-value]


def emulate_nnx_call(method: Callable[..., Any], target: str,
                     policy: policy_lib.Policy | None = None,
                     recorder: flax_scope.Recorder | None = None,
                     path: str = "") -> Callable[..., Any]:
  """``fn(module, *args, **kwargs)``: the call ``method(module, ...)`` of an
  NNX module emulated for ``target``, as :func:`emulate` of the module
  emulates it, with the variables it writes written back into ``module``.

  With ``policy``: the call of a swapped model's module at ``path`` (the
  policy applied already), traced as ``emulate(model, policy)`` traces it:
  the same trace, the same numbers.
  """
  stateful = nnx_policy.Stateful(None, method, policy, recorder, path=path,
                                 apply_policy=policy is None)
  return _emulator(method, policy, target, {}, recorder, stateful)


def refused_algorithm(eqn) -> str | None:
  """The name of the algorithm a ``dot_general`` equation's code passed
  (``precision=lax.DotAlgorithm(...)`` or a ``DotAlgorithmPreset``) when
  the backend refuses it (on CPU: :func:`cpu_refuses`), else None."""
  if eqn.primitive.name != "dot_general":
    return None
  algorithm = eqn.params.get("precision")
  if not isinstance(algorithm, (lax.DotAlgorithm, lax.DotAlgorithmPreset)):
    return None
  if compat.backend_platform() != "cpu" or not cpu_refuses(algorithm):
    return None
  return getattr(algorithm, "name", None) or "lax.DotAlgorithm(...)"


def _exact_dot(eqn, invals):
  """The walker rule of :func:`exact_refused_dots`."""
  if refused_algorithm(eqn) is None:
    return None
  highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
  return walker.bind_with(eqn, invals, precision=highest)


def exact_refused_dots(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` with every ``dot_general`` whose algorithm the backend refuses
  (:func:`refused_algorithm`) computed at ``HIGHEST``: exact in the
  operands' dtype on CPU (float32, or float64 under x64), the reference
  a check compares with. Everything else runs as ``fn`` runs it."""
  fn, stateful = nnx_policy.lift(fn, None, None)
  return _emulator(fn, None, "native", {}, None, stateful, rule=_exact_dot)


def _emulator(fn: Callable[..., Any],
              precision: PrecisionLike | policy_lib.Policy, target: str,
              options: dict[str, Any], recorder: flax_scope.Recorder | None,
              stateful: nnx_policy.Stateful | None,
              rule: walker.Rule | None = None) -> Callable[..., Any]:
  """The emulated function of :func:`emulate` (``target`` emulates), or
  with ``rule`` the function ``rule`` rewrites (nothing emulated).

  With ``stateful``, the NNX module's state (and that of each graph-node
  argument, an ``nnx.Rngs``) is an argument of the trace and the variables
  the call writes are written back, as the native call writes them; a
  ``stateful`` without a module takes it as the first argument.
  """
  policy = precision if isinstance(precision, policy_lib.Policy) else None
  if policy is not None:
    dot_fixed, conv_fixed = (policy.precision_for("", None, kind)
                             for kind in ("dot", "conv"))
  else:
    dot_fixed = conv_fixed = None if precision is None else resolve(precision)
  cache: dict[Any, Any] = {}
  # Once per trace (traces hash by identity): an eager call reuses the
  # cached trace at every call.
  guards = functools.lru_cache(maxsize=64)(transposed)
  warned: set[str] = set()
  what = getattr(fn, "__qualname__", type(fn).__name__)

  fixed_rule = rule

  @functools.wraps(fn)
  def emulated(*args, **kwargs):
    now = current() if dot_fixed is None or conv_fixed is None else None
    scope = (contextlib.nullcontext() if policy is None
             else flax_scope.policy_scope(policy, recorder, what=what))
    with scope as active:
      # The trace depends on the JAX context outside the cleared flag: the
      # precision in force (the policy's unmatched layers record it), x64,
      # the policy. Key on all of it, as jax.jit would (no stale traces).
      outer = (compat.trace_context(), getattr(active, "outer_flag", None))
      traced, call_args = fn, args
      if stateful is not None:
        module = stateful.module
        if module is None:
          module, args = args[0], args[1:]
        graphdefs, call_args, kwargs, nodes = stateful.split(
            module, args, kwargs)
        traced = functools.partial(stateful.call, graphdefs)
        # Their text too: static attributes that compare equal but trace
        # differently (2 and 2.0, 0.0 and -0.0) give equal graph definitions.
        outer = (*outer, graphdefs, repr(graphdefs))
      with jax.default_matmul_precision(None), _closed_over_nnx_writes(what):
        call = walker.trace_call(traced, call_args, kwargs, cache,
                                 extra_key=outer)
      if policy is not None:
        _record_unset(call.jaxpr, policy, recorder)
        if policy.rules:
          _warn_unreached(call.jaxpr, target, dot_fixed, warned, what)
    opaque: list[str] = []
    rule = fixed_rule or emulation_rule(dot_fixed or now, target=target,
                                        conv_default=conv_fixed or now,
                                        on_opaque=opaque.append,
                                        guarded=guards(call.jaxpr),
                                        **options)
    out = call.unflatten(walker.interpret(call.jaxpr, rule, *call.dynamic))
    warn_opaque(opaque, warned, what)
    if stateful is not None:
      out, written = out
      stateful.update(nodes, written)
    return out

  return emulated


@contextlib.contextmanager
def _closed_over_nnx_writes(what: str):
  """Says what to do when ``fn`` writes an NNX model it closes over.

  ``emulate`` traces ``fn``; an NNX model that ``fn`` closes over (rather than
  one passed as ``fn`` or as an argument) and writes to (batch statistics, RNG
  counts) cannot be written from inside that trace.
  """
  try:
    yield
  except Exception as e:
    # Flax's refusal to write a variable from another trace.
    if not (type(e).__name__ == "TraceContextError"
            and type(e).__module__.startswith("flax")):
      raise
    raise type(e)(
        f"jaxprec.emulate traces {what}, and the NNX model it closes over writes "
        f"its variables (batch statistics, RNG counts) inside that trace, "
        f"which Flax refuses. Emulate the model itself "
        f"(jaxprec.emulate(model, ...)) or pass it as an argument, and "
        f"jaxprec writes what the call changes back into it. Flax said: {e}"
    ) from e


def _native(fn: Callable[..., Any], policy: policy_lib.Policy
            ) -> Callable[..., Any]:
  """``fn`` run natively under ``policy``: its precisions as JAX's flags (per
  module, as :func:`jaxprec.swap`), its compute dtypes, nothing emulated."""
  recorder = flax_scope.Recorder(policy)
  what = getattr(fn, "__qualname__", type(fn).__name__)
  fn, stateful = nnx_policy.lift(fn, policy, recorder)
  outside = policy.precision_for("", None, "dot")

  @functools.wraps(fn)
  def native(*args, **kwargs):
    flag = (contextlib.nullcontext() if outside is None
            else jax.default_matmul_precision(numerics.flag_for(outside, "dot")))
    with flag, flax_scope.policy_scope(policy, recorder, what=what):
      if stateful is None:
        return fn(*args, **kwargs)
      graphdefs, args, kwargs, nodes = stateful.split(
          stateful.module, args, kwargs)
      out, written = stateful.call(graphdefs, *args, **kwargs)
      stateful.update(nodes, written)
      return out

  native._jaxprec_recorder = recorder  # for jaxprec.policy_report
  return native


_OPTIONS = ("tf32_rounding", "chip", "fp8_promotion_interval",
            "tpu_matvec_f32")


def _check_options(options: dict[str, Any], target: str) -> dict[str, Any]:
  """``options`` checked now, not at the first call: names and values."""
  for name in options:
    if name not in _OPTIONS:
      raise names.unknown("jaxprec.emulate option", name, _OPTIONS,
                          error=TypeError)
  emulated_ops.check_chip(options.get("chip"), target)
  emulated_ops.check_interval(options.get("fp8_promotion_interval"))
  if "tpu_matvec_f32" in options:
    emulated_ops.check_flag("tpu_matvec_f32", options["tpu_matvec_f32"])
  if "tf32_rounding" in options:
    options = dict(options, tf32_rounding=names.check_choice(
        options["tf32_rounding"], emulated_ops.TF32_ROUNDINGS, "tf32_rounding"))
  return options


def opaque_ops(closed: Any, target: str) -> list[str]:
  """The ops :func:`emulate` for ``target`` runs natively in the jaxpr
  ``closed`` (:func:`walker.opaque_name`: kernels, custom and FFI calls,
  callbacks, primitives whose implementation cannot be traced), once each,
  in program order: the ops it warns about (:class:`OpaqueOpWarning`)."""
  return list(dict.fromkeys(
      name for w in walker.iter_eqns(closed, target=target)
      if (name := walker.opaque_name(w.eqn, target)) is not None))


def warn_opaque(found: list[str], warned: set[str], what: str) -> None:
  """Warns once per emulated function about opaque ops not warned about yet."""
  new = [n for n in dict.fromkeys(found) if n not in warned]  # program order
  if not new:
    return
  warned.update(new)
  warnings.warn(
      f"jaxprec.emulate({what}): {', '.join(new)} cannot be seen into: "
      f"{'its' if len(new) == 1 else 'their'} matmuls and convolutions run "
      f"natively here, not emulated as the target computes them. "
      f"jaxprec.audit lists them.", OpaqueOpWarning, stacklevel=3)


def _warn_unreached(closed, target: str, outside: Precision | None,
                    warned: set[str], what: str) -> None:
  """Warns once per library primitive whose implementation holds a matmul
  with no precision of its own: the policy's module rules cannot decide it
  (:class:`PolicyUnreachedWarning`)."""
  found = []
  for w in walker.iter_eqns(closed, target=target):
    eqn = w.eqn
    name = eqn.primitive.name
    if (walker.classify(name) != "traced" or walker.opaque_name(eqn, target)
        or f"unreached {name}" in warned):
      continue
    impl = walker.implementation(eqn, target)
    if any(v.eqn.primitive.name in walker.PRIMITIVES
           and v.eqn.params.get("precision") is None
           for v in walker.iter_eqns(impl, target=target)):
      warned.add(f"unreached {name}")
      found.append(name)
  if found:
    at = "the backend default" if outside is None else repr(outside.name)
    warnings.warn(
        f"jaxprec.emulate({what}): the matmuls inside {', '.join(found)} "
        f"(a library's primitive) are lowered by JAX at the precision in "
        f"force at the call ({at}, the policy's default), not at the "
        f"precision the policy gives the module that calls "
        f"{'it' if len(found) == 1 else 'them'}: emulated so, as the target "
        f"computes them. Pass the library's own precision option, or run the "
        f"whole call under jaxprec.precision(...).",
        PolicyUnreachedWarning, stacklevel=3)


def _record_unset(closed, policy: policy_lib.Policy,
                  recorder: flax_scope.Recorder) -> None:
  """Records the policy's decision for ops that recorded no precision."""
  seen = set()
  for w in walker.iter_eqns(closed):
    kind = walker.PRIMITIVES.get(w.eqn.primitive.name)
    if kind and kind not in seen and w.eqn.params.get("precision") is None:
      seen.add(kind)
      p, rule = policy.match("", None, kind)
      recorder.record("", None, kind, p, rule)
