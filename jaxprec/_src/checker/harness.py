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
  function (held weakly) and per static description of the call;
* **placement**: on arguments over several devices (one process, or many
  under ``jax.distributed``) the layers are stacked in one group per device
  (:class:`jaxprec._src.checker.metrics.Layout`), and a reference the host
  packs is split the same way (:func:`on_devices`).

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
from jaxprec._src.checker import metrics as metrics_lib
from jaxprec._src.checker import reference as reference_lib
from jaxprec._src.checker import rows as rows_lib
from jaxprec._src.emulation import emulate as emulate_lib
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import trees
from jaxprec._src.jaxpr import walker
from jaxprec._src.policy import policy as policy_lib
from jaxprec._src.policy.policy import Policy, UnusedRuleWarning
from jaxprec._src.checker.rows import (Plan, computes_narrow, is_computed,
                                       label_of, reference_plan, with_dtypes)

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
  array leaf on the most devices (:func:`group_devices`); ``groups``: their
  number.
  """

  def __init__(self, args: Sequence[Any], kwargs: dict, *, who: str):
    for x in jax.tree_util.tree_leaves((tuple(args), dict(kwargs))):
      if isinstance(x, jax.ShapeDtypeStruct):
        raise TypeError(f"{who} runs the function: pass arrays, not "
                        "jax.ShapeDtypeStruct (jaxprec.audit takes those)")
    self.static, self.dynamic = trees.split_call(args, kwargs, abstract=False)
    self.key = self.static.key
    self.devices = group_devices(self.dynamic)
    self.groups = max(1, len(self.devices))

  def call(self, fn: Callable[..., Any], dynamic: Sequence[Any]) -> Any:
    """Calls ``fn`` with ``dynamic`` in place of the array leaves."""
    return trees.jax_outputs(fn, self.static.call(fn, dynamic))


def group_devices(dynamic: Sequence[Any]) -> tuple[Any, ...]:
  """The devices of the array of ``dynamic`` that lies on the most of them.

  In its mesh's order (a ``NamedSharding``), else by device id; ``()`` when
  no argument is a JAX array on devices (NumPy arrays, tracers). A program
  over several devices stacks its layers in that many groups.
  """
  best: tuple[Any, ...] = ()
  for x in dynamic:
    if not isinstance(x, jax.Array):
      continue
    try:
      sharding = x.sharding
      if isinstance(sharding, jax.sharding.NamedSharding):
        devices = tuple(sharding.mesh.devices.flat)
      else:
        devices = tuple(sorted(sharding.device_set, key=lambda d: d.id))
    except (AttributeError, TypeError, ValueError):  # a tracer: no devices
      continue
    if len(devices) > len(best):
      best = devices
  return best


def on_devices(packed: np.ndarray, devices: Sequence[Any]) -> jax.Array:
  """A packed host array split over ``devices``: group ``k`` on the ``k``-th.

  With one device or none, the array as ``jnp.asarray`` places it. A
  reference read from the host and checked against a batch sharded over
  several devices is split over them as the layers it is compared with are,
  never held whole by one. Under ``jax.distributed`` every process passes
  the same array and keeps its own devices' rows.
  """
  if len(devices) <= 1:
    return jnp.asarray(packed)
  mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("groups",))
  return jax.device_put(packed, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("groups")))


# ---------------------------------------------------------------------------
# Dtype decisions.


# JAX's primitives that draw random bits (jax.random's samplers bind them).
_RANDOM_BITS = frozenset({"random_bits", "threefry2x32"})


def narrow_compute(fn, call: Args, cache: dict | None = None
                   ) -> tuple[bool, bool, bool, bool]:
  """``(narrow, undoable, narrow_after, random)`` for ``fn`` at ``call``'s
  signature.

  ``narrow``: its program casts to bfloat16 or float16, or runs a matmul or
  convolution on them (a model built with ``dtype=jnp.bfloat16`` or a
  policy's ``dtype:``); ``undoable``: the float32 reference policy
  (:func:`jaxprec._src.policy.policy.reference_policy`) reaches one of its
  modules (a ``dtype`` field set or a boundary cast), so that a float32 or
  float64 reference runs every module at the reference dtype and compares a
  bfloat16 model with the float32 model; ``narrow_after``: under that policy
  it still computes narrow (its own casts outside any module it can set);
  ``random``: it draws random numbers (dropout in train mode, a sampler),
  which ``jax.random`` draws from other bits under x64. Two traces at most, once per function and
  signature (cached).
  """
  def trace(f):
    return jax.make_jaxpr(lambda dynamic: call.call(f, dynamic))(call.dynamic)

  def make(fn_ref):
    closed = trace(nnx_policy.bind(fn_ref(), None))  # NNX: a clone runs
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
        after = trace(bound)
    reached = any(m.dtype_how in ("field", "boundary")
                  for m in recorder.report().matches)
    return True, reached, computes_narrow(after) if reached else True, random
  # Keyed on the arguments' shapes and dtypes and on what jax.jit keys on
  # (x64, a policy in force, ...): a bfloat16 input may make ``fn`` narrow.
  key = None if call.key is None else (
      "narrow", call.key, trees.signature(call.dynamic), compat.trace_context())
  return _program(fn, key, make, cache)


def _traced(fn, call: Args, cache: dict | None) -> tuple[tuple[str, ...], bool]:
  """What one trace of ``fn`` at ``call``'s signature shows, cached: the
  algorithms of its dots that the backend refuses (``emulate.
  refused_algorithm``: a ``lax.DotAlgorithm`` or a preset such as
  ``TF32_TF32_F32`` on CPU), and whether it runs a matmul or a
  convolution."""
  def make(fn_ref):
    closed = jax.make_jaxpr(lambda dynamic: call.call(
        nnx_policy.bind(fn_ref(), None), dynamic))(call.dynamic)
    found = (emulate_lib.refused_algorithm(w.eqn)
             for w in walker.iter_eqns(closed))
    return (tuple(dict.fromkeys(name for name in found if name)),
            walker.holds_matmul(closed.jaxpr))
  key = None if call.key is None else (
      "traced", call.key, trees.signature(call.dynamic), compat.trace_context())
  return _program(fn, key, make, cache)


def refused_dots(fn, call: Args, cache: dict | None = None) -> tuple[str, ...]:
  """The algorithms of ``fn``'s dots that the backend refuses, which a
  float32 or float64 reference computes exactly
  (``emulate.exact_refused_dots``). One trace, cached."""
  return _traced(fn, call, cache)[0]


def holds_matmul(fn, call: Args, cache: dict | None = None) -> bool:
  """Whether ``fn`` runs a matmul or a convolution at ``call``'s signature
  (one trace, cached, shared with :func:`refused_dots`); True when it
  cannot be traced here."""
  try:
    return _traced(fn, call, cache)[1]
  except Exception:  # noqa: BLE001 -- the check ran: say nothing
    return True


# ---------------------------------------------------------------------------
# Compiled programs.


class Jit:
  """``jax.jit(fn)`` whose calls block until the results are ready."""

  def __init__(self, fn: Callable[..., Any]):
    self._jit = jax.jit(fn)

  def __call__(self, *args):
    return jax.block_until_ready(self._jit(*args))

  def lower(self, *args):
    return self._jit.lower(*args)


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


def native_notes(fn: Callable[..., Any], call: Args, plans: Sequence[Plan]
                 ) -> list[str]:
  """:func:`jaxprec._src.checker.rows.native_notes` of ``fn`` on ``call``,
  kept with ``fn``'s programs: a second check of ``fn`` traces nothing."""
  key = ("native ops", call.key, tuple(p.key for p in plans),
         trees.signature(call.dynamic), compat.trace_context())
  return _program(fn, key, lambda fn_ref: rows_lib.native_notes(
      lambda *dyn: call.call(fn_ref(), dyn), tuple(call.dynamic), {}, plans))


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
    kept: the layer :func:`build_reference`'s ``keep`` names, on the host
      (NumPy, as computed: float64 for a float64 reference), else None.
    skipped: ``(name, type)`` of the outputs that are not compared
      (:func:`jaxprec._src.checker.layers.not_compared`).
    notes: what the report says of how it was computed (the dots it computes
      exactly because the backend refuses their algorithm).
  """

  names: list[str]
  shapes: list[tuple[int, ...]]
  dtypes: list[str]
  layout: metrics_lib.Layout
  hi: Any
  lo: Any
  stats: Any
  description: str
  name: str
  kept: Any = None
  skipped: tuple[tuple[str, str], ...] = ()
  notes: tuple[str, ...] = ()


def _info(layers) -> list[tuple[str, tuple[int, ...], str]]:
  return [(n, tuple(v.shape), str(v.dtype)) for n, v in layers]


def _layout(info, groups: int) -> metrics_lib.Layout:
  return metrics_lib.Layout(tuple(int(np.prod(s)) for _, s, _ in info),
                            groups)


def _reference_program(fn, call: Args, ref_plan: Plan | None,
                       select: tuple[str, ...] | None, cache: dict | None,
                       dtypes: Policy | None = None, exact: bool = False):
  """The jitted program ``dynamic -> (hi, lo, stats, layers)``.

  ``dtypes``: the float64 reference's policy undoing dtype decisions;
  ``exact``: the dots whose algorithm the backend refuses computed exactly
  (``emulate.exact_refused_dots``).
  """
  x64 = ref_plan is None
  groups = call.groups
  key = ("ref", "float64" if x64 else ref_plan.key, call.key, select, groups)
  if x64:
    wrap = (lambda g: g) if dtypes is None else (
        lambda g: with_dtypes(g, dtypes))
    key += () if dtypes is None else (str(dtypes),)
  else:
    wrap = ref_plan.wrap
  if exact:
    key += ("exact",)
    wrap = (lambda w: lambda g: emulate_lib.exact_refused_dots(w(g)))(wrap)
  static = call.static

  def make(fn_ref):
    holder: dict[tuple, list] = {}

    def program(dynamic):
      dyn = [x.astype(jnp.float64) if x64 and jnp.issubdtype(
          x.dtype, jnp.floating) else x for x in dynamic]
      skipped: list[tuple[str, str]] = []
      layers = layers_lib.ordered_layers(wrap, fn_ref(), static, dyn,
                                         skipped=skipped)
      holder[("skipped", trees.signature(dynamic))] = tuple(skipped)
      if select is not None:
        by_name = dict(layers)
        layers = [(n, by_name[n]) for n in select]
      info = _info(layers)
      holder[trees.signature(dynamic)] = info
      layout = _layout(info, groups)
      values = [v for _, v in layers]
      hi, lo = metrics_lib.pack_reference(values, layout, jnp)
      stats = metrics_lib.reference_stats(hi, lo, layout)
      # The layers are returned (and dropped unread) so that XLA computes
      # them once instead of fusing their producers into the packing
      # concatenate (see _candidate_program).
      return hi, lo, stats, values
    jitted = Jit(program)
    jitted.holder = holder  # type: ignore[attr-defined]
    return jitted

  return _program(fn, key, make, cache)


def output_info(fn, call: Args, skipped: list | None = None
                ) -> list[tuple[str, tuple[int, ...], str]]:
  """``(name, shape, dtype)`` of every layer of ``fn``'s output (no run);
  ``skipped`` gets the outputs that are not compared
  (:func:`jaxprec._src.checker.layers.not_compared`)."""
  holder: dict[str, Any] = {}
  static = call.static

  def flat(dynamic):
    layers = layers_lib.ordered_layers(lambda g: g, fn, static, dynamic,
                                       skipped=skipped)
    holder["info"] = _info(layers)
    return [v for _, v in layers]
  jax.eval_shape(flat, call.dynamic)
  return holder["info"]


def comparable(fn: Callable[..., Any], names: Sequence[str],
               shapes: Sequence[tuple[int, ...]]) -> None:
  """Raises a ValueError unless some layer of ``fn``'s output (``names``,
  ``shapes``) has elements to compare: none at all, or only empty ones
  (each named with its shape). ``fn``: the function, or its name."""
  name = fn if isinstance(fn, str) else getattr(fn, "__name__", "fn")
  what = f"{name}(...) returned"
  if not names:
    raise ValueError(f"{what} no floating arrays to compare")
  if all(0 in s for s in shapes):
    raise ValueError(
        f"{what} only empty floating arrays, nothing to compare: "
        + ", ".join(f"{n!r} {tuple(s)}" for n, s in zip(names, shapes)))


_reference_stats = jax.jit(metrics_lib.reference_stats, static_argnums=(2,))


def build_reference(fn, call: Args, reference: Any, *, target: str, mode: str,
                    select: Sequence[str] | None = None,
                    cache: dict | None = None,
                    options: dict[str, Any] | None = None,
                    keep: str | None = None) -> Reference:
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
    options: the rows' emulation options (``chip``, ``tpu_matvec_f32``:
      :func:`jaxprec._src.checker.rows.plan`), for a reference computed
      as a row is.
    keep: a layer to copy to the host whole (``Reference.kept``): the
      logits of the logits gates. The programs are the same with it or
      without (they return every layer already).

  Raises:
    ValueError: an output without floating layers; a bad reference.
    ReferenceMismatchError: a read reference that does not match the output.
  """
  select = None if select is None else tuple(select)
  if not is_computed(reference):
    found = reference_lib.load(reference)
    skipped = []
    info = output_info(fn, call, skipped)
    if select is not None:
      by_name = {n: (n, s, d) for n, s, d in info}
      info = [by_name[n] for n in select]
    values = reference_lib.match(found, info, extra_ok=select is not None)
    layout = _layout(info, call.groups)
    hi, lo = (None if a is None else on_devices(a, call.devices)
              for a in metrics_lib.pack_reference(values, layout, np))
    stats = _reference_stats(hi, lo, layout)
    desc, name = "external", reference_lib.describe(reference)
    kept = None if keep is None else np.asarray(
        values[[n for n, _, _ in info].index(keep)])
    notes = ()
  else:
    hi, lo, stats, info, desc, kept, skipped, notes = _computed_reference(
        fn, call, reference, target, mode, select, cache, options or {}, keep)
    name = label_of(reference)
  return Reference([n for n, _, _ in info], [s for _, s, _ in info],
                   [d for _, _, d in info], _layout(info, call.groups), hi, lo,
                   stats, desc, name, kept, tuple(skipped), notes)


def _computed_reference(fn, call: Args, reference: Any, target: str, mode: str,
                        select: tuple[str, ...] | None, cache: dict | None,
                        options: dict[str, Any], keep: str | None = None):
  """``(hi, lo, stats, info, description, kept, skipped, notes)`` of a
  computed reference (``kept``: the layer ``keep`` names, on the host, else
  None; ``skipped``: the outputs not compared; ``notes``: for the report)."""
  try:
    ref_plan = reference_plan(reference, target, mode, **options)
  except ValueError as e:
    raise ValueError(f"Unknown reference {reference!r}: {e} A reference is "
                     f"{reference_lib.SUPPORTED}.") from None
  x64 = ref_plan is None
  dtype = "float64" if x64 else "float32"
  undo, note, random, exact, notes = None, "", False, False, []
  if x64 or (not isinstance(ref_plan.precision, Policy) and
             ref_plan.precision.name in ("float32", "F32_F32_F32")):
    _, undoable, narrow_after, random = narrow_compute(fn, call, cache)
    if narrow_after:  # said out loud: what the reference cannot undo
      note = ("; it computes in bfloat16/float16 outside any module jaxprec "
              "can set (its own casts are kept)")
    if undoable:
      undo = policy_lib.reference_policy(dtype)
    refused = refused_dots(fn, call, cache)
    if refused:  # said out loud (a report note): exact where fn is not
      exact = True
      notes.append(
          f"the {dtype} reference computes the dots whose code names "
          f"{', '.join(refused)} at exact {dtype}: JAX refuses "
          f"{'it' if len(refused) == 1 else 'them'} on "
          f"{compat.backend_platform()} ('not supported by dot_general'); "
          f"the rows compute them as the code names them")
  desc = ("float64 (native, x64)" if x64 else ref_plan.description) + (
      "" if undo is None else f", modules at {dtype}") + note
  if not x64:
    ref_plan = dataclasses.replace(ref_plan, dtypes=undo, description=desc)
    undo = None
  prog = _reference_program(fn, call, ref_plan, select, cache, dtypes=undo,
                            exact=exact)
  with (jax.enable_x64(True) if x64 else contextlib.nullcontext()):
    hi, lo, stats, layers = prog(call.dynamic)
    info = prog.holder[trees.signature(call.dynamic)]
    skipped = prog.holder.get(("skipped", trees.signature(call.dynamic)), ())
    kept = None
    if keep is not None and keep in [n for n, _, _ in info]:
      kept = np.asarray(jax.device_get(
          layers[[n for n, _, _ in info].index(keep)]))
  del layers  # never copied to the host (but the one kept)
  if x64 and random:  # said out loud: not comparable
    desc += ("; fn draws random numbers, which x64 draws from other bits: "
             "the reference's are not the rows' (check it in eval mode, or "
             "against 'float32')")
    warnings.warn(
        "jaxprec: the float64 reference draws other random numbers than the "
        "rows (jax.random samples float64 under x64), so its figures compare "
        "different random values; check the model in eval mode (no dropout) "
        "or use reference='float32'.", UserWarning, stacklevel=4)
  return hi, lo, stats, info, desc, kept, skipped, tuple(notes)


def _layers_program(fn, call: Args, wrap, key: Any, names: tuple[str, ...],
                    cache: dict | None, label: str):
  """The jitted program ``(index, dynamic) -> layers`` of
  ``wrap(fn, index)``: the layers ``names``, in that order (``label`` names
  the row in the error when one is missing)."""
  static = call.static

  def make(fn_ref):
    def program(index, dynamic):
      layers = layers_lib.ordered_layers(
          lambda f: wrap(f, index), fn_ref(), static, dynamic)
      by_name = dict(layers)
      missing = [n for n in names if n not in by_name]
      if missing:
        raise ValueError(
            f"At {label} the output has layers {[n for n, _ in layers][:6]}, "
            f"the reference {list(names)[:6]}")
      return [by_name[n] for n in names]
    return Jit(program)

  return _program(fn, (key, call.key, names), make, cache)


# Depends on the layers' sizes only: kept for later runs.
@functools.lru_cache(maxsize=16)
def _metrics_program(layout: metrics_lib.Layout, finite_only: bool = False):
  def program(values, hi, lo, stats, atol, rtol):
    return metrics_lib.layer_stats(values, hi, lo, stats, layout, atol=atol,
                                   rtol=rtol, finite_only=finite_only)
  return jax.jit(program)


def candidate_args(call: Args, ref: Reference, atol: float, rtol: float):
  """The arguments of a candidate program."""
  return (ref.hi, ref.lo, ref.stats, call.dynamic, np.float32(atol),
          np.float32(rtol))


def _finish(out, values, ref: Reference, args
            ) -> list[metrics_lib.LayerMetrics]:
  """The metrics of the all-finite program's ``out``, or, where a NaN or an
  infinity makes its numbers wrong, of the masked program on ``values``."""
  hi, lo, stats, _, atol, rtol = args
  out = jax.device_get(out)
  if not out.pop("finite"):
    out = _metrics_program(ref.layout)(values, hi, lo, stats, atol, rtol)
  return metrics_lib.finish(jax.device_get(out), ref.layout)


def run_candidate(fn, call: Args, p: Plan, ref: Reference, atol: float,
                  rtol: float, cache: dict | None = None, *,
                  seen: Callable[[list[Any]], None] | None = None
                  ) -> list[metrics_lib.LayerMetrics]:
  """Runs one row and returns its metrics, one per reference layer.

  Two programs: the row's layers, then their metrics, compiled once per
  layout and shared by every row (and every check of that layout). The
  metrics read the very values the row computed, and the rows compile
  without them: a first check of a small function compiles several times
  faster than with one program per row computing both, of a real model
  about as fast, and a check after compile runs a few percent slower
  (``benchmarks/bench_check.py --forms``). The metrics compile the
  all-finite path only, and compute again with the masked path where a NaN
  or an infinity needs it.

  Args:
    fn, call: the function and its arguments.
    p: the row.
    ref: the reference (:func:`build_reference`).
    atol, rtol: the tolerance of ``frac_outside`` and ``required_atol``.
    cache: where to keep the program (default: the global per-fn cache).
    seen: called with the row's layers (device arrays, in the order of
      ``ref.names``) before they are dropped: the logits gates copy one of
      them to the host.
  """
  return _run(fn, call, lambda f, _: p.wrap(f), ("layers", p.key),
                      None, ref, cache, atol, rtol, seen,
                      f"precision {p.label!r}")


def run_indexed(fn, call: Args, wrap: Callable[[Callable[..., Any], Any],
                                               Callable[..., Any]],
                key: Any, index: Any, ref: Reference, cache: dict,
                seen: Callable[[list[Any]], None] | None = None
                ) -> list[metrics_lib.LayerMetrics]:
  """Runs the program ``wrap(fn, index)`` and returns its metrics.

  One program per ``key`` serves every ``index`` (an array argument): the
  search's switched program (:mod:`jaxprec._src.search.switch`), where the index
  array chooses each unit's precision at run time. The metrics are a second
  program, as :func:`run_candidate` with ``fused=False`` (``seen`` as
  there).
  """
  return _run(fn, call, wrap, ("indexed", key), index, ref, cache,
                      0.0, 0.0, seen, "the switched program")


def _run(fn, call: Args, wrap, key: Any, index: Any, ref: Reference,
                 cache: dict | None, atol: float, rtol: float,
                 seen: Callable[[list[Any]], None] | None,
                 label: str) -> list[metrics_lib.LayerMetrics]:
  """The metrics of ``wrap(fn, index)``'s layers, a second program."""
  args = candidate_args(call, ref, atol, rtol)
  hi, lo, stats, dynamic, atol_, rtol_ = args
  values = _layers_program(fn, call, wrap, key, tuple(ref.names), cache,
                           label)(index, dynamic)
  if seen is not None:
    seen(values)
  out = _metrics_program(ref.layout, True)(values, hi, lo, stats, atol_, rtol_)
  return _finish(out, values, ref, args)
