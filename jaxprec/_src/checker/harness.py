"""The run harness: how ``check``, ``search_policy`` and ``check_training`` run ``fn``.

One place owns what the checkers share:

* **arguments**: :class:`Args` splits a call's arguments into array leaves
  (jit arguments) and static leaves;
* **rows**: :func:`plan` says how one precision or :class:`jaxprec.Policy`
  is computed for a target in a mode (:class:`Plan`, :mod:`jaxprec._src.checker.rows`);
* **the reference**: :func:`build_reference` computes it at a precision, or
  reads hidden states computed elsewhere (:mod:`jaxprec._src.checker.reference`),
  and packs it on the device;
* **programs**: the jitted reference and candidate programs, cached per
  function (held weakly) and per static description of the call.

Cached programs hold no arrays: every array (the arguments, the packed
reference, the tolerances) is an argument of the compiled program, and the
function is held through a weak reference, so nothing a caller passed stays
alive once the caller drops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxprec._src.checker import layers as layers_lib
from jaxprec._src.checker import metric_stats as stats_lib
from jaxprec._src.checker import metrics as metrics_lib
from jaxprec._src.checker import placement
from jaxprec._src.checker import reference as reference_lib
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import trees
from jaxprec._src.jaxpr import walker
from jaxprec._src.policy import policy as policy_lib
from jaxprec._src.policy.policy import Policy, UnusedRuleWarning
from jaxprec._src.checker.rows import (
  Plan,
  computes_narrow,
  is_computed,
  label_of,
  reference_plan,
  with_dtypes,
)

# ---------------------------------------------------------------------------
# Arguments.


class Args:
  """``args``/``kwargs`` of a call the harness runs, split for ``jax.jit``.

  Split by :func:`jaxprec._src.jaxpr.trees.split_call`: array leaves (JAX and
  NumPy arrays and scalars, typed PRNG keys, the arrays inside an
  ``nnx.Rngs``) are ``dynamic``: they become jit arguments and are converted
  as ``jax.jit`` converts them (a NumPy float64 is float32 unless x64 is on).
  Every other leaf is static. ``jax.ShapeDtypeStruct`` leaves are refused,
  naming ``who``. ``static`` holds no arrays (compiled programs keep it);
  ``key`` is a hashable description of it, or None. ``devices``: those of the
  array leaf on the most devices (:mod:`jaxprec._src.checker.placement`); ``groups``:
  their number.
  """

  def __init__(self, args: Sequence[Any], kwargs: dict, *, who: str):
    for x in jax.tree_util.tree_leaves((tuple(args), dict(kwargs))):
      if isinstance(x, jax.ShapeDtypeStruct):
        raise TypeError(f"{who} runs the function: pass arrays, not "
                        "jax.ShapeDtypeStruct (jaxprec.audit takes those)")
    self.static, self.dynamic = trees.split_call(args, kwargs, abstract=False)
    self.key = self.static.key
    self.devices = placement.group_devices(self.dynamic)
    self.groups = max(1, len(self.devices))

  def call(self, fn: Callable[..., Any], dynamic: Sequence[Any]) -> Any:
    """Calls ``fn`` with ``dynamic`` in place of the array leaves."""
    return trees.jax_outputs(fn, self.static.call(fn, dynamic))


# ---------------------------------------------------------------------------
# Dtype decisions.


def has_dtype_decisions(fn, call: Args, cache: dict | None = None) -> bool:
  """Whether ``fn`` computes in a narrow float in modules jaxprec can set.

  True when its program casts to bfloat16 or float16, or runs a matmul or
  convolution on them (a model built with ``dtype=jnp.bfloat16`` (Flax,
  Hugging Face) or a policy's ``dtype:``), and the reference dtype policy
  (:func:`jaxprec._src.policy.policy.reference_policy`) reaches at least one of its
  modules. A float32 or float64 reference of such a model runs every module
  at the reference dtype, so that a bfloat16 model is compared with the
  float32 model. A float32 model's reference is computed as before.
  """
  return narrow_compute(fn, call, cache)[1]


# JAX's primitives that draw random bits (jax.random's samplers bind them).
_RANDOM_BITS = frozenset({"random_bits", "threefry2x32"})


def narrow_compute(fn, call: Args, cache: dict | None = None
                   ) -> tuple[bool, bool, bool, bool]:
  """``(narrow, undoable, narrow_after, random)`` for ``fn`` at ``call``'s
  signature.

  ``narrow``: its program computes in bfloat16 or float16; ``undoable``: the
  float32 reference policy reaches one of its modules (a ``dtype`` field set
  or a boundary cast); ``narrow_after``: under that policy it still computes
  narrow (its own casts outside any module it can set); ``random``: it draws
  random numbers (dropout in train mode, a sampler), which ``jax.random``
  draws from other bits under x64. Two traces at most, once per function and
  signature (cached).
  """
  static = call.static

  def make(fn_ref):
    run = nnx_policy.bind(fn_ref(), None)  # an NNX model: a clone runs
    closed = jax.make_jaxpr(lambda dynamic: trees.jax_outputs(
        run, static.call(run, dynamic)))(
        call.dynamic)
    random = any(w.eqn.primitive.name in _RANDOM_BITS
                 for w in walker.iter_eqns(closed))
    if not computes_narrow(closed):
      return False, False, False, random
    undo = policy_lib.reference_policy("float32")
    recorder = flax_scope.Recorder(undo)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", UnusedRuleWarning)
      bound = nnx_policy.bind(fn_ref(), undo, recorder)
      with flax_scope.policy_scope(undo, recorder):
        after = jax.make_jaxpr(lambda dynamic: trees.jax_outputs(
            bound, static.call(bound, dynamic)))(
            call.dynamic)
    reached = any(m.dtype_how in ("field", "boundary")
                  for m in recorder.report().matches)
    return True, reached, computes_narrow(after) if reached else True, random
  # Keyed on the arguments' shapes and dtypes and on what jax.jit keys on
  # (x64, a policy in force, ...): a bfloat16 input may make ``fn`` narrow.
  key = None if call.key is None else (
      "narrow", call.key, trees.signature(call.dynamic), compat.trace_context())
  return _program(fn, key, make, cache)


# ---------------------------------------------------------------------------
# Compiled programs.


class _Jit:
  """``jax.jit(fn)`` whose calls wait for their results."""

  def __init__(self, fn: Callable[..., Any]):
    self._jit = jax.jit(fn)

  def __call__(self, *args):
    return jax.block_until_ready(self._jit(*args))

  def lower(self, *args):
    return self._jit.lower(*args)


def jit(fn: Callable[..., Any]) -> _Jit:
  """``jax.jit`` whose calls block until the results are ready."""
  return _Jit(fn)


# fn -> {key: program}. Values hold fn weakly (a strong reference from a
# value would keep its key alive forever) and no arrays.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _program(fn: Callable[..., Any], key: Any,
             make: Callable[[Callable[[], Any]], Any], cache: dict | None = None):
  """The program ``make(fn_ref)``, cached under ``key`` (None: not cached)."""
  try:
    fn_ref = weakref.ref(fn)
    hash(fn)
  except TypeError:  # not weak-referenceable or not hashable: no caching
    return make(lambda: fn)
  if key is None:
    return make(fn_ref)
  per_fn = _PROGRAMS.setdefault(fn, {}) if cache is None else cache
  prog = per_fn.get(key)
  if prog is None:
    prog = per_fn[key] = make(fn_ref)
  return prog


@dataclasses.dataclass
class Reference:
  """The reference layers, packed on the device.

  Attributes:
    names, shapes, dtypes: the checked layers, in order.
    layout: their sizes (:class:`jaxprec._src.checker.metrics.Layout`).
    hi: packed ``(n_chunks, CHUNK)`` float32.
    lo: the same for ``ref - hi`` of a float64 reference, else None.
    stats: :func:`jaxprec._src.checker.metrics.reference_stats` of it.
    description: for the report (``'(reference)'`` numerics).
    name: the report's ``reference``.
    external: read (a file, a mapping, a pytree), not computed.
  """

  names: list[str]
  shapes: list[tuple[int, ...]]
  dtypes: list[str]
  layout: metrics_lib.Layout
  hi: Any
  lo: Any
  stats: Any = None
  description: str = ""
  name: str = ""
  external: bool = False


_reference_stats = jax.jit(metrics_lib.reference_stats, static_argnums=(2,))


def _info(layers) -> list[tuple[str, tuple[int, ...], str]]:
  return [(n, tuple(v.shape), str(v.dtype)) for n, v in layers]


def _layout(info, groups: int) -> metrics_lib.Layout:
  return metrics_lib.Layout(tuple(int(np.prod(s)) for _, s, _ in info),
                            groups)


def _pick(layers, select: tuple[str, ...] | None):
  if select is None:
    return layers
  by_name = dict(layers)
  return [(n, by_name[n]) for n in select]


def _reference_program(fn, call: Args, ref_plan: Plan | None,
                       select: tuple[str, ...] | None, cache: dict | None,
                       dtypes: Policy | None = None):
  """The jitted program ``dynamic -> (hi, lo, stats, layers)``.

  ``dtypes``: the float64 reference's policy undoing dtype decisions.
  """
  x64 = ref_plan is None
  groups = call.groups
  key = ("ref", "float64" if x64 else ref_plan.key, call.key, select, groups)
  if x64 and dtypes is not None:
    key += (str(dtypes),)
  wrap64 = (lambda g: g) if dtypes is None else (
      lambda g: with_dtypes(g, dtypes))
  static = call.static

  def make(fn_ref):
    holder: dict[tuple, list] = {}

    def program(dynamic):
      f = fn_ref()
      if x64:
        dyn = [x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating)
               else x for x in dynamic]
        layers = layers_lib.ordered_layers(wrap64, f, static, dyn)
      else:
        layers = layers_lib.ordered_layers(ref_plan.wrap, f, static, dynamic)
      layers = _pick(layers, select)
      info = _info(layers)
      holder[trees.signature(dynamic)] = info
      layout = _layout(info, groups)
      values = [v for _, v in layers]
      lo = None
      if x64:
        pairs = [stats_lib.split_reference_jax(v) for v in values]
        hi = stats_lib.pack([h for h, _ in pairs], layout)
        if any(l is not None for _, l in pairs):
          lo = stats_lib.pack([jnp.zeros(h.shape, jnp.float32) if l is None
                                 else l for h, l in pairs], layout)
      else:
        hi = stats_lib.pack(values, layout)
      stats = metrics_lib.reference_stats(hi, lo, layout)
      # The layers are returned (and dropped unread) so that XLA computes
      # them once instead of fusing their producers into the packing
      # concatenate (see _candidate_program).
      return hi, lo, stats, values
    jitted = _Jit(program)
    jitted.holder = holder  # type: ignore[attr-defined]
    return jitted

  return _program(fn, key, make, cache)


def output_info(fn, call: Args) -> list[tuple[str, tuple[int, ...], str]]:
  """``(name, shape, dtype)`` of every layer of ``fn``'s output (no run)."""
  holder: dict[str, Any] = {}
  static = call.static

  def flat(dynamic):
    layers = layers_lib.ordered_layers(lambda g: g, fn, static, dynamic)
    holder["info"] = _info(layers)
    return [v for _, v in layers]
  jax.eval_shape(flat, call.dynamic)
  return holder["info"]


def build_reference(fn, call: Args, reference: Any, *, target: str, mode: str,
                    select: Sequence[str] | None = None,
                    cache: dict | None = None) -> Reference:
  """The reference: computed at a precision or policy, or read.

  Args:
    fn: the function.
    call: its arguments.
    reference: ``'float32'`` (natively), ``'float64'`` (x64 in a scope that
      is always restored), another precision or a policy (computed as a row
      is), or hidden states computed elsewhere
      (:func:`jaxprec._src.checker.reference.load`).
    target, mode: for computed references.
    select: the layers to keep (default: all), in output order.
    cache: where to keep the program (default: the global per-fn cache).

  Raises:
    ValueError: an output without floating layers; a bad reference.
    ReferenceMismatchError: a read reference that does not match the output.
  """
  select = None if select is None else tuple(select)
  if not is_computed(reference):
    found = reference_lib.load(reference)
    info = output_info(fn, call)
    if select is not None:
      by_name = {n: (n, s, d) for n, s, d in info}
      info = [by_name[n] for n in select]
    values = reference_lib.match(found, info, extra_ok=select is not None)
    his, los = zip(*(metrics_lib.split_reference(v) for v in values)) if values \
        else ((), ())
    layout = _layout(info, call.groups)
    hi = placement.on_devices(metrics_lib.pack_numpy(list(his), layout),
                            call.devices)
    lo = None
    if any(l is not None for l in los):
      lo = placement.on_devices(metrics_lib.pack_numpy(
          [np.zeros(np.shape(h), np.float32) if l is None else l
           for h, l in zip(his, los)], layout), call.devices)
    ref = Reference([n for n, _, _ in info], [s for _, s, _ in info],
                    [d for _, _, d in info], layout, hi, lo,
                    description="external", name=reference_lib.describe(reference),
                    external=True)
    ref.stats = _reference_stats(ref.hi, ref.lo, ref.layout)
    return ref
  try:
    ref_plan = reference_plan(reference, target, mode)
  except ValueError as e:
    raise ValueError(f"Unknown reference {reference!r}: {e} A reference is "
                     f"{reference_lib.SUPPORTED}.") from None
  x64 = ref_plan is None
  undo = None
  note, random = "", False
  if x64 or (not isinstance(ref_plan.precision, Policy) and ref_plan.precision.name
             in ("float32", "F32_F32_F32")):
    narrow, undoable, narrow_after, random = narrow_compute(fn, call, cache)
    if narrow_after:  # said out loud: what the reference cannot undo
      note = ("; it computes in bfloat16/float16 outside any module jaxprec "
              "can set (its own casts are kept)")
    if undoable:
      undo = policy_lib.reference_policy("float64" if x64 else "float32")
    if undoable and not x64:
      ref_plan = dataclasses.replace(
          ref_plan, dtypes=undo,
          description=f"{ref_plan.description}, modules at float32{note}")
    elif not x64:
      ref_plan = dataclasses.replace(
          ref_plan, description=f"{ref_plan.description}{note}")
  prog = _reference_program(fn, call, ref_plan, select, cache, dtypes=undo)
  with (jax.enable_x64(True) if x64 else contextlib.nullcontext()):
    hi, lo, stats, layers = prog(call.dynamic)
    info = prog.holder[trees.signature(call.dynamic)]
  del layers  # never copied to the host
  name = str(reference) if isinstance(reference, Policy) else (
      reference if isinstance(reference, str) else label_of(reference))
  desc = "float64 (native, x64)" if x64 else ref_plan.description
  if x64 and undo is not None:
    desc += ", modules at float64"
  if x64:
    desc += note
  if x64 and random:  # said out loud: not comparable
    desc += ("; fn draws random numbers, which x64 draws from other bits: "
             "the reference's are not the rows' (check it in eval mode, or "
             "against 'float32')")
    warnings.warn(
        "jaxprec: the float64 reference draws other random numbers than the "
        "rows (jax.random samples float64 under x64), so its figures compare "
        "different random values; check the model in eval mode (no dropout) "
        "or use reference='float32'.", UserWarning, stacklevel=3)
  return Reference([n for n, _, _ in info], [s for _, s, _ in info],
                   [d for _, _, d in info], _layout(info, call.groups), hi, lo,
                   stats, description=desc, name=name)


def _candidate_program(fn, call: Args, p: Plan, ref: Reference,
                       cache: dict | None):
  """The jitted program ``(hi, lo, stats, dynamic, atol, rtol) -> stats``."""
  names = tuple(ref.names)
  layout, static = ref.layout, call.static
  key = ("cand", p.key, call.key, names, layout, ref.lo is not None)

  def make(fn_ref):
    def program(hi, lo, stats, dynamic, atol, rtol):
      layers = layers_lib.ordered_layers(p.wrap, fn_ref(), static, dynamic)
      by_name = dict(layers)
      missing = [n for n in names if n not in by_name]
      if missing:
        got = [n for n, _ in layers]
        raise ValueError(
            f"At precision {p.label!r} the output has layers {got[:6]}, "
            f"the reference {list(names)[:6]}")
      values = [by_name[n] for n in names]
      # The layers are returned too (and dropped unread): otherwise XLA fuses
      # their producers into the packing concatenate and computes them twice
      # (measured: 1.3x the time of the forward pass on wav2vec2-small). They
      # stay on the device and are freed at once. Only the all-finite path
      # is compiled in (finite_only: a lax.cond costs more than the metrics
      # on CPU); run_candidate computes the rest again where it does not hold.
      return metrics_lib.layer_stats(values, hi, lo, stats, layout,
                                     atol=atol, rtol=rtol,
                                     finite_only=True), values
    return _Jit(program)

  return _program(fn, key, make, cache)


def _layers_program(fn, call: Args, p: Plan, names: tuple[str, ...],
                    cache: dict | None):
  """The jitted program ``dynamic -> layers`` (for :func:`run_candidate`)."""
  static = call.static
  key = ("layers", p.key, call.key, names)

  def make(fn_ref):
    def program(dynamic):
      by_name = dict(layers_lib.ordered_layers(p.wrap, fn_ref(), static,
                                               dynamic))
      return [by_name[n] for n in names]
    return _Jit(program)

  return _program(fn, key, make, cache)


# Depends on the layers' sizes only: kept for later runs.
@functools.lru_cache(maxsize=16)
def _metrics_program(layout: metrics_lib.Layout, finite_only: bool = False):
  def program(values, hi, lo, stats, atol, rtol):
    return metrics_lib.layer_stats(values, hi, lo, stats, layout, atol=atol,
                                   rtol=rtol, finite_only=finite_only)
  return jax.jit(program)


def _metrics(values, hi, lo, stats, layout, atol, rtol) -> dict:
  """The metrics of ``values``: the all-finite program, then, where a NaN or
  an infinity makes its numbers wrong, the masked one (as the fused
  candidate program does: see :func:`_candidate_program`)."""
  out = jax.device_get(_metrics_program(layout, True)(
      values, hi, lo, stats, atol, rtol))
  if not out.pop("finite"):
    out = _metrics_program(layout)(values, hi, lo, stats, atol, rtol)
  return out


def candidate_args(call: Args, ref: Reference, atol: float, rtol: float):
  """The arguments of a candidate program."""
  if ref.stats is None:
    ref.stats = _reference_stats(ref.hi, ref.lo, ref.layout)
  return (ref.hi, ref.lo, ref.stats, call.dynamic, np.float32(atol),
          np.float32(rtol))


def run_candidate(fn, call: Args, p: Plan, ref: Reference, atol: float,
                  rtol: float, cache: dict | None = None, *,
                  fused: bool = True) -> list[metrics_lib.LayerMetrics]:
  """Runs one row and returns its metrics, one per reference layer.

  Args:
    fn, call: the function and its arguments.
    p: the row.
    ref: the reference (:func:`build_reference`).
    atol, rtol: the tolerance of ``frac_outside`` and ``required_atol``.
    cache: where to keep the program (default: the global per-fn cache).
    fused: one program computes the layers and their metrics (default:
      ``check``, which reuses its programs); else the metrics are a second
      program, compiled once per layout and shared by every row (the
      search, whose rows are new programs). Measured on the built-in tiny
      Wav2Vec2 and BERT, three rows: the second program compiles a cold
      check in 4.9-5.2 s instead of 6.3-6.8 s and 2.4-2.5 s instead of 3.3
      s, and runs as fast there, but on Wav2Vec2-base a warm check costs
      1.20-1.33x its forwards instead of 1.06-1.13x
      (``benchmarks/bench_check.py``), so ``check`` keeps one program. Both
      compile the all-finite metrics only, and compute them again with the
      masked path where a NaN or an infinity needs it.
  """
  hi, lo, stats, dynamic, atol, rtol = candidate_args(call, ref, atol, rtol)
  if fused:
    prog = _candidate_program(fn, call, p, ref, cache)
    out, layers = prog(hi, lo, stats, dynamic, atol, rtol)
    out = jax.device_get(out)
    if not out.pop("finite"):  # a NaN or an infinity: the masked path
      out = _metrics_program(ref.layout)(layers, hi, lo, stats, atol, rtol)
    del layers  # never copied to the host
  else:
    values = _layers_program(fn, call, p, tuple(ref.names), cache)(dynamic)
    out = _metrics(values, hi, lo, stats, ref.layout, atol, rtol)
    del values
  return metrics_lib.finish(jax.device_get(out), ref.layout)


def run_indexed(fn, call: Args, wrap: Callable[[Callable[..., Any], Any],
                                               Callable[..., Any]],
                key: Any, index: Any, ref: Reference, cache: dict
                ) -> list[metrics_lib.LayerMetrics]:
  """Runs the program ``wrap(fn, index)`` and returns its metrics.

  One program per ``key`` serves every ``index`` (an array argument): the
  search's switched program (:mod:`jaxprec._src.search.switch`), where the index
  array chooses each unit's precision at run time. The metrics are a second
  program, as :func:`run_candidate` with ``fused=False``.
  """
  prog = _indexed_program(fn, call, wrap, key, tuple(ref.names), cache)
  hi, lo, stats, dynamic, atol, rtol = candidate_args(call, ref, 0.0, 0.0)
  values = prog(index, dynamic)
  out = _metrics(values, hi, lo, stats, ref.layout, atol, rtol)
  del values
  return metrics_lib.finish(jax.device_get(out), ref.layout)


def _indexed_program(fn, call: Args, wrap, key: Any, names: tuple[str, ...],
                     cache: dict):
  static = call.static

  def make(fn_ref):
    def program(index, dynamic):
      by_name = dict(layers_lib.ordered_layers(
          lambda f: wrap(f, index), fn_ref(), static, dynamic))
      return [by_name[n] for n in names]
    return _Jit(program)

  return _program(fn, ("indexed", key, call.key, names), make, cache)
