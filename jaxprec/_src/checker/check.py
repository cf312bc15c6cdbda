"""The divergence checker: ``jaxprec.check`` and ``jaxprec.check_module``
(with :func:`module_outputs`, the capture of a Flax module's outputs).

Each candidate run is one jitted program that computes ``fn`` at its
precision and reduces every layer to the scalars of
:func:`jaxprec._src.checker.metrics.layer_stats`: candidate hidden states
never leave the device, and memory stays near one reference run (whose layers
are kept) plus one candidate run, whatever the number of precisions. What a
precision name means in each mode is :mod:`jaxprec._src.checker.rows`'s
(:func:`~jaxprec._src.checker.rows.plan`), documented in ``docs/checker.md``
("What a precision name means").
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxprec._src.checker import harness
from jaxprec._src.checker import layers as layers_lib
from jaxprec._src.checker import logits as logits_lib
from jaxprec._src.checker import metrics as metrics_lib
from jaxprec._src.checker import reference as reference_lib
from jaxprec._src.checker import progress as progress_lib
from jaxprec._src.checker import report as report_lib
from jaxprec._src.checker import rows
from jaxprec._src.checker.report import DivergenceReport, LayerResult
from jaxprec._src.core.precision import PrecisionLike
from jaxprec._src.emulation import compile_cache
from jaxprec._src.emulation import kernels
from jaxprec._src.flax import hook
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.flax import state as flax_state
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import trees
from jaxprec._src.jaxpr import walker
from jaxprec._src.policy.policy import Policy

DEFAULT_ATOL = 1e-3
DEFAULT_RTOL = 1e-3


def check(fn: Callable[..., Any], *args: Any,
          precisions: Sequence[PrecisionLike | Policy] | PrecisionLike | Policy
          | None = None,
          reference: Any = "float32", target: str = "tpu", mode: str = "auto",
          atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
          progress: bool = False,
          cache: bool | str | os.PathLike = False,
          chip: str | None = None, tpu_matvec_f32: bool = True,
          logits: str | None = None, logits_k: int | None = None,
          **kwargs: Any) -> DivergenceReport:
  """How far each layer of ``fn(*args, **kwargs)`` drifts at each precision.

  ``fn`` returns a pytree of hidden states (a dict, list, tuple, dataclass, or
  a Hugging Face ``ModelOutput``); every floating leaf is a *layer*, named by
  its path (``'hidden_states[3]'``) and ordered as flattened (plain dicts in
  insertion order). ``fn`` runs once at the reference and once per precision;
  each run is jitted with the metrics inside, so only scalars leave the device
  and compiled programs are reused by later checks of the same ``fn``.

  Which numerics a row shows (details in ``docs/checker.md``): with
  ``mode='auto'`` the check runs natively when the backend is the target (a
  TPU for ``target='tpu'``) and emulates the target otherwise (on CPU, always).
  A name means what ``jax.default_matmul_precision(name)`` makes ``target``
  compute (``docs/semantics.md``), as in :func:`jaxprec.emulate`:
  ``'bfloat16'`` is one bfloat16 pass on a TPU and TF32 on a GPU (whose one
  bfloat16 pass is ``'BF16_BF16_F32'``); ``'tensorfloat32'`` is three
  bfloat16 passes on a TPU. The report's ``numerics`` say what each row
  computed (``'tf32 (gpu, emulated)'``).

  Array leaves of ``args``/``kwargs`` are traced; other leaves (Python
  numbers, strings, flags such as ``deterministic=True``) are static. Pass
  parameters as arguments rather than closing over them: closed-over arrays
  are compiled into every program as constants.

  Args:
    fn: the function; its arguments follow.
    *args: positional arguments for ``fn``.
    precisions: the rows of the report: precisions (any name
      :func:`jaxprec.resolve` accepts) or policies (a :class:`jaxprec.Policy`
      or a policy string such as ``'default=bfloat16,dense=float32'``, e.g.
      the ``policy`` of :func:`jaxprec.search_policy`, labelled by its
      string); one or a sequence. None (default): the target's own choices,
      ``('bfloat16', 'bfloat16_3x', 'float32')`` on a TPU (1, 3 and 6
      bfloat16 passes) and ``('BF16_BF16_F32', 'tensorfloat32',
      'TF32_TF32_F32_X3')`` on a GPU (1 bfloat16 pass, TF32, 3 TF32
      passes). With an external reference the default rows start with
      ``'float32'``, the *framework floor*.
    reference: ``'float32'`` (default: exact float32 where the backend has it;
      six bfloat16 passes on a TPU), ``'float64'`` (``fn`` runs with 64-bit
      types enabled in a scope that is always restored, its floating array
      arguments cast to float64), any other precision (computed as a row
      would be), or hidden states computed elsewhere (e.g. by PyTorch): a
      pytree or ``{name: array}`` mapping, or a path (``str`` or
      ``os.PathLike``, suffix in any case) to a ``.npz`` (loaded with
      ``allow_pickle=False``), ``.npy`` (one array) or ``.safetensors``
      file, matched by name (``'hidden_states[3]'``, ``'hidden_states.3'``
      and ``'hidden_states/3'`` match the same layer). Against an external
      reference a ``'float32'`` row is computed as JAX's float32 reference
      is (exact float32 where the backend has it) and is the report's
      ``floor``: the two frameworks' own disagreement.
    target: ``'tpu'`` or ``'gpu'``: whose numerics to show.
    mode: ``'auto'``, ``'emulate'`` or ``'native'``.
    atol, rtol: the tolerance: a layer passes when every element has
      ``|err| <= atol + rtol * |ref|`` (see ``frac_outside`` and
      ``required_atol``); defaults 1e-3 and 1e-3, loose enough that
      multi-pass precisions pass on typical models and one-pass formats
      (bfloat16, TF32) do not: pass your own.
    progress: show the progress on stderr: a bar on a terminal, else one
      line per phase (the reference, each row, the time taken).
    cache: JAX's persistent compilation cache for this call (JAX's settings
      are restored afterwards): ``False`` (default: as JAX is configured),
      ``True`` (``$JAXPREC_CACHE_DIR/jax-compilation``, else under the
      user's cache directory) or a directory. A later process checking the
      same programs loads them instead of compiling them again (see
      :func:`jaxprec.enable_compilation_cache`).
    chip: with ``target='gpu'``, the NVIDIA chip (``'a100'``, ``'h100'``,
      ``'b200'``; any case) whose tensor cores compute every emulated row,
      as :func:`jaxprec.emulate`'s ``chip`` computes it
      (``docs/gpu.md``); a computed reference other than float32 too. Native
      rows run on the device. The report names the chip. None (default):
      the algorithm's definition.
    tpu_matvec_f32: emulated TPU rows compute a matrix-vector product at
      ``DEFAULT`` in float32, as JAX's maintainers state a TPU does
      (:func:`jaxprec.emulate`'s ``tpu_matvec_f32``); False computes it as
      any other dot (one bfloat16 pass).
    logits: the layer (as the report names it: ``'logits'``,
      ``'output.logits'``) that holds a language model's logits, the
      vocabulary on the last axis: each row's logits gates against the
      reference (:class:`jaxprec.torch.LogitsGates`: KL divergence of the
      softmax distributions, mean and largest over positions, top-1
      agreement, top-k overlap, largest log-probability difference) are in
      the report's ``logits``, its table's footer, Markdown and JSON (under
      new keys, only when set). They are computed
      on the host in float64 by :func:`jaxprec.torch.logits_gates`: that one
      layer is copied from the device for the reference and for each row
      (the compiled programs are the same with it or without). A row whose
      logits (or the reference's) hold NaN or infinity has no gates
      (``None``; a note says so). None (default): no gates.
    logits_k: the k of the top-k overlap (at most the vocabulary size);
      None (default): 5, or the vocabulary size where smaller.
    **kwargs: keyword arguments for ``fn``. (To pass a keyword named like one
      of the above, wrap ``fn`` with ``functools.partial``.)

  Returns:
    A :class:`jaxprec.DivergenceReport`.

  Raises:
    TypeError: ``precisions`` that is not a precision, a policy or a
      sequence of them; a tolerance that is not a number.
    ValueError: an unknown precision, target, mode or chip, or a chip with a
      target other than ``'gpu'``; a negative or NaN tolerance; an unreadable reference file or an unsupported reference
      (the message names the supported ones); a reference that does not
      match the output (the message names the first mismatching path and
      both shapes); an output without floating leaves, or whose
      floating leaves are all empty (each named); a ``cache``
      directory that cannot be created; a ``logits`` that names no layer
      (the message names the layers and the closest one), a logits layer
      whose last axis has fewer than 2 entries, a ``logits_k`` outside
      ``1..vocab``.
    FileNotFoundError: a reference path that does not exist.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxprec
    >>> def mlp(w, x):
    ...   h1 = jnp.tanh(x @ w)
    ...   h2 = jnp.tanh(h1 @ w)
    ...   return {"h1": h1, "h2": h2}
    >>> w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
    >>> x = jax.random.normal(jax.random.key(1), (8, 64))
    >>> r = jaxprec.check(mlp, w, x, mode="emulate")
    >>> [l.name for l in r.layers], r.mode
    (['h1', 'h2'], 'emulate')
    >>> bf16, bf16x3 = r.metric("rel_rms", "bfloat16"), r.metric("rel_rms", "bfloat16_3x")
    >>> all(a > 100 * b for a, b in zip(bf16, bf16x3))
    True
    >>> r.numerics["bfloat16"], r.numerics["float32"]
    ('bf16x1 (tpu, emulated)', 'bf16x6 (tpu, emulated)')
    >>> g = jaxprec.check(mlp, w, x, mode="emulate", target="gpu",
    ...                   precisions=("bfloat16", "BF16_BF16_F32"))
    >>> g.numerics["bfloat16"], g.numerics["BF16_BF16_F32"]
    ('tf32 (gpu, emulated)', 'bf16x1 (gpu, emulated)')
  """
  if not callable(fn):
    raise TypeError(f"jaxprec.check expects a callable; got {fn!r} of type "
                    f"{type(fn).__name__}")
  directory = compile_cache.resolve_cache(cache, "jaxprec.check")
  # The words, resolved once (the same checks and messages as
  # jaxprec.emulate's); what runs below reads `setting`.
  setting = rows.setting(target, mode, chip, tpu_matvec_f32)
  target, mode, chip = setting.target, setting.mode, setting.chip
  atol = metrics_lib.check_tolerance("atol", atol)
  rtol = metrics_lib.check_tolerance("rtol", rtol)
  external = not harness.is_computed(reference)
  plans = rows.plans(precisions, setting, external=external)
  if directory is not None:  # after the checks: a refused call writes nothing
    with compile_cache.compilation_cache(directory):
      return check(fn, *args, precisions=precisions, reference=reference,
                   target=target, mode=mode, atol=atol, rtol=rtol,
                   progress=progress, cache=False, chip=chip,
                   tpu_matvec_f32=tpu_matvec_f32,
                   **({} if logits is None else {"logits": logits,
                                                 "logits_k": logits_k}),
                   **kwargs)
  floor = None
  if external:  # float32 against another framework: the floor
    plans = [rows.native_float32(p.label) if p.label == rows.FLOOR
             else p for p in plans]
    floor = rows.FLOOR if any(p.label == rows.FLOOR for p in plans) else None
  fn, args = nnx_policy.stateful(fn, args)  # an NNX model: its state an argument
  call = harness.Args(args, dict(kwargs), who="jaxprec.check")
  if logits is not None:  # before anything runs: a bad name costs no run
    logits_k = logits_lib.check_layer(
        logits, logits_k,
        [(n, s) for n, s, _ in harness.output_info(fn, call)], "jaxprec.check")
  ref, results, seconds, gates = _runs(fn, call, plans, reference, setting,
                                       atol, rtol, progress, logits, logits_k)
  layers = tuple(
      LayerResult(name=n, shape=s, dtype=d,
                  metrics={p.label: results[p.label][i] for p in plans})
      for i, (n, s, d) in enumerate(zip(ref.names, ref.shapes, ref.dtypes)))
  return DivergenceReport(
      layers=layers, precisions=tuple(p.label for p in plans),
      reference=ref.name, target=target, mode=mode,
      backend=compat.backend_platform(), atol=atol, rtol=rtol,
      numerics={**{p.label: p.description for p in plans},
                "(reference)": ref.description},
      notes=tuple(_notes(fn, call, plans, setting, ref, layers, floor, gates,
                         logits)),
      seconds=seconds, floor=floor,
      kernel=kernels.current_kernel().to_dict(), chip=chip,
      **({} if logits is None else {"logits": gates, "logits_layer": logits}))


def _runs(fn: Callable[..., Any], call: harness.Args,
          plans: Sequence[rows.Plan], reference: Any, setting: rows.Setting,
          atol: float, rtol: float, progress: bool, logits: str | None,
          logits_k: int | None):
  """The reference, then each row: ``(reference, row -> its layers'
  metrics, phase -> seconds, row -> its logits gates)``."""
  seconds: dict[str, float] = {}
  gates: dict[str, logits_lib.LogitsGates | None] = {}
  # The bar counts the rows, as the phases name them ('(2/3)' at 2/3); the
  # reference is step 0.
  with progress_lib.Phases(len(plans), "jaxprec check", progress) as bar:
    bar.update(_reference_phase(reference))
    t0 = time.perf_counter()
    ref = harness.build_reference(fn, call, reference, target=setting.target,
                                  mode=setting.mode, options=setting.options,
                                  keep=logits)
    seconds["reference"] = time.perf_counter() - t0
    harness.comparable(fn, ref.names, ref.shapes)
    results: dict[str, list[metrics_lib.LayerMetrics]] = {}
    for i, p in enumerate(plans, 1):
      bar.update(f"compiling+running {p.label} ({i}/{len(plans)})", advance=1)
      t0 = time.perf_counter()
      seen = None if logits is None else _gates_of(
          gates, p.label, ref, ref.names.index(logits), logits_k)
      results[p.label] = harness.run_candidate(fn, call, p, ref, atol, rtol,
                                               seen=seen)
      seconds[p.label] = time.perf_counter() - t0
    bar.finish()
  return ref, results, seconds, gates


def _notes(fn: Callable[..., Any], call: harness.Args,
           plans: Sequence[rows.Plan], setting: rows.Setting,
           ref: harness.Reference, layers: Sequence[LayerResult],
           floor: str | None, gates: dict, logits: str | None) -> list[str]:
  """What a check's user should know that its figures do not say: how the
  rows computed, the ops that ran natively, layers whose figures compare
  nothing, outputs not compared, rows that cannot differ."""
  notes = []
  native_cpu = (setting.mode == "native"
                and compat.backend_platform() == "cpu")
  if native_cpu:
    notes.append("native mode on CPU: the CPU ignores matmul precision, so "
                 "every row computes exact float32")
  if setting.chip is not None and setting.mode == "native":
    notes.append(f"chip={setting.chip!r} models a GPU's tensor cores in "
                 f"emulation; native rows run on the device itself")
  if (not setting.tpu_matvec_f32
      and any(p.emulate_target == "tpu" for p in plans)):
    notes.append("tpu_matvec_f32=False: matrix-vector products at DEFAULT "
                 "are emulated as one bfloat16 pass, not in float32")
  zero = [layer.name for layer in layers if not layer.empty
          and all(m.ref_max_abs == 0 for m in layer.metrics.values())]
  if zero:  # said out loud: metrics there say 'exact'
    shown = ", ".join(repr(n) for n in zero[:5]) + (
        f" and {len(zero) - 5} more" if len(zero) > 5 else "")
    notes.append(
        f"the reference of {shown} is all zeros: relative metrics there "
        f"compare nothing and read as exact. If these values are not zero "
        f"in exact arithmetic, they are below float32's smallest normal "
        f"(about 1.2e-38), which XLA flushes to zero on CPU and TPU: "
        f"rescale the inputs")
  skipped = ref.skipped
  if skipped:  # said out loud: outputs the check does not compare
    shown = ", ".join(f"{n!r} ({w})" for n, w in skipped[:6]) + (
        f" and {len(skipped) - 6} more" if len(skipped) > 6 else "")
    notes.append(f"not compared: {shown}, outputs that are not floating-point "
                 f"arrays (token ids, masks, counts); the check compares "
                 f"floating-point layers (token ids through their logits: "
                 f"logits=)")
  notes += report_lib.empty_notes(layers)
  notes += harness.native_notes(fn, call, plans)  # ops not emulated
  notes += ref.notes
  notes += overflow_notes(layers)
  masked = (logits if logits is not None and ref.kept is not None
            and logits_lib.masked_only(ref.kept) else None)
  notes += nonfinite_reference_notes(layers, ref.name, masked=masked)
  labels = [p.label for p in plans if p.label != floor]
  if not native_cpu and rows_agree(layers, labels):  # native: said above
    same = "" if len(labels) < 2 else "every row is the same: "
    if not harness.holds_matmul(fn, call):
      notes.append(
          f"{same}the function has no matmul or convolution (no "
          f"dot_general or conv_general_dilated in its program), so the "
          f"precision changes nothing in it")
    elif same:
      notes.append(
          f"{same}at these inputs the precision changes nothing in the "
          f"function's matmuls and convolutions (their operands are "
          f"float64 or integers, which no precision rounds, or values "
          f"every row computes exactly)")
  missing = [p for p, g in gates.items() if g is None]
  if missing:
    notes.append(
        f"the logits of {logits!r} hold NaN or +inf, or mask every token "
        f"of a position, at {', '.join(map(repr, missing))} (or in the "
        f"reference): no logits gates there (-inf alone is a masked token)")
  return notes


def _gates_of(gates: dict, label: str, ref: harness.Reference, index: int,
              k: int) -> Callable[[list[Any]], None]:
  """The ``seen`` of a row (:func:`jaxprec._src.checker.harness.run_candidate`):
  it copies the logits layer (``index``) to the host and stores the row's
  gates against the reference's in ``gates[label]``."""
  def seen(values):
    row = np.asarray(jax.device_get(values[index]))
    gates[label] = logits_lib.row_gates(row, ref.kept, k)
  return seen


def _reference_phase(reference: Any) -> str:
  """The progress line of the reference: ``'reference at float32'``."""
  if isinstance(reference, str) and harness.is_computed(reference):
    return f"reference at {reference}"
  if isinstance(reference, (str, os.PathLike)):
    return f"reference from {os.fspath(reference)}"
  return "reference (given)"


def overflow_notes(layers: Sequence[LayerResult]) -> list[str]:
  """The note naming layers whose float64 reference float32 cannot hold."""
  over = [(l.name, max(m.ref_overflow for m in l.metrics.values()))
          for l in layers]
  over = [(n, k) for n, k in over if k]
  if not over:
    return []
  shown = ", ".join(f"{n!r} ({k} elements)" for n, k in over[:5]) + (
      f" and {len(over) - 5} more layers" if len(over) > 5 else "")
  return [f"the float64 reference of {shown} holds values beyond float32's "
          f"range (above 3.4e38 in magnitude): a float32 program overflows "
          f"there, so these layers fail at every precision (rescale the "
          f"inputs or the model)"]


def nonfinite_reference_notes(layers: Sequence[LayerResult], reference: str,
                              *, masked: str | None = None) -> list[str]:
  """The note naming layers whose reference itself holds inf or NaN (it
  overflowed, or computed NaN): their metrics compare the finite elements
  only. ``masked``: the logits layer whose reference's only non-finite
  values are ``-inf``, masked tokens, named in a note of its own."""
  bad, out = [], []
  for l in layers:
    m = next(iter(l.metrics.values()), None)
    if l.name == masked and m is not None:
      out.append(f"the logits layer {masked!r} masks {m.ref_inf} of {m.size} "
                 f"entries with -inf in the reference: masked tokens, "
                 f"probability 0 in the logits gates; the table compares "
                 f"the others")
      continue
    if m is not None and (m.ref_nan or m.ref_inf):
      what = " and ".join(f"{k} {w}" for k, w in ((m.ref_inf, "inf"),
                                                   (m.ref_nan, "nan")) if k)
      bad.append(f"{l.name!r} ({what} of {m.size})")
  if not bad:
    return out
  shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more layers"
                                if len(bad) > 5 else "")
  redo = "" if reference == "float64" else " or check against float64"
  return out + [f"the reference ({reference}) itself holds inf or NaN in {shown}: "
          f"it overflowed (or computed NaN) there, so those elements compare "
          f"with nothing and the metrics read the finite ones only; rescale "
          f"the inputs or the model{redo}"]


def rows_agree(layers: Sequence[LayerResult], labels: Sequence[str]) -> bool:
  """Whether the rows ``labels`` have the same figures at every layer (what
  a function without a matmul or convolution gives: the precision changes
  nothing)."""
  def figures(m):
    return (m.max_abs, m.rel_rms, m.required_atol, m.nan, m.inf)
  return bool(labels) and all(
      len({repr(figures(l.metrics[p])) for p in labels}) == 1 for l in layers)


_MARK = "jaxprec layer "  # checkpoint_name prefix of a marked output leaf
_INLINED = frozenset({"jit", "pjit", "checkpoint", "remat2",
                      "custom_jvp_call", "custom_vjp_call"})


def _mark(eqn: Any) -> str | None:
  """The layer mark of a ``checkpoint_name`` equation, else None."""
  name = str(eqn.params.get("name", "")) if eqn.primitive.name == "name" else ""
  return name[len(_MARK):] if name.startswith(_MARK) else None


def _taking_marks(found: list[tuple[str, Any]], lost: list[str]) -> walker.Rule:
  """The rule that evaluates a jaxpr with its marked values appended to
  ``found`` as ``(mark, value)``, at the level the rule is called at."""

  def rule(eqn, invals):
    prim, mark = eqn.primitive.name, _mark(eqn)
    if mark is not None:
      found.append((mark, invals[0]))
      return invals
    bodies = list(compat.jaxprs_in_params(eqn.params))
    marks = [m for b in bodies for w in walker.iter_eqns(b)
             if (m := _mark(w.eqn)) is not None]
    if not marks:
      return walker.bind_unchanged(eqn, invals) if bodies else None
    if prim == "scan":
      return _scan(eqn, invals, found, lost)
    if prim in _INLINED:  # a body whose outputs are the equation's
      body = next(b for b in bodies if len(b.outvars) == len(eqn.outvars))
      return walker.interpret(compat.close(body), rule, *invals)
    lost.extend(m.split("\x00")[0] for m in marks)
    return walker.bind_unchanged(eqn, invals)
  return rule


def _scan(eqn, invals, found, lost) -> list[Any]:
  """A ``scan`` equation run as ``lax.scan``, its body's marks stacked."""
  p = eqn.params
  nc, nk = compat.scan_counts(p)
  consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
  body = p["jaxpr"]
  marks: list[str] = []

  def step(carry, x):
    inner: list[tuple[str, Any]] = []
    outs = walker.interpret(body, _taking_marks(inner, lost), *consts, *carry,
                            *x)
    marks[:] = [m for m, _ in inner]
    return list(outs[:nk]), (list(outs[nk:]), [v for _, v in inner])
  carry, (ys, stacked) = jax.lax.scan(
      step, list(init), list(xs), length=p["length"], reverse=p["reverse"],
      unroll=p["unroll"])
  found.extend(zip(marks, stacked))
  return [*carry, *ys]


# The treedefs of marked outputs by number, the _KEPT most recently used
# (a long session does not grow the table): a mark carries its number, so that
# a body traced once and reused (nnx.jit's cache) is read in a later trace.
_KEPT = 4096
_TREES: dict[int, Any] = {}  # number -> treedef, least recently used first
_TREEDEFS: dict[Any, int] = {}  # treedef -> number
_COUNT = itertools.count()
_TREES_LOCK = threading.Lock()


def _tree(treedef: Any = None, number: int | None = None) -> Any:
  """The number of ``treedef`` (a new one for a treedef not kept), or the
  treedef of ``number`` (None once dropped); either is then most recent."""
  with _TREES_LOCK:
    if number is None:
      number = _TREEDEFS.get(treedef)
      if number is None:
        number = _TREEDEFS[treedef] = next(_COUNT)
        while len(_TREES) >= _KEPT:
          del _TREEDEFS[_TREES.pop(next(iter(_TREES)))]
      _TREES[number] = _TREES.pop(number, treedef)
      return number
    found = _TREES.pop(number, None)
    if found is not None:
      _TREES[number] = found
    return found


def _marked(key: str, out: Any, structure: dict[str, Any]) -> Any:
  """``out`` with each JAX array leaf marked as the output ``key``'s
  (``checkpoint_name``, an identity that stays in the jaxpr, naming its
  treedef's number and its index); its treedef and its constants (Python
  numbers, NumPy arrays: the caller gets them as they are) kept in
  ``structure``, one dict per call, so that the report has every leaf."""
  leaves, treedef = jax.tree_util.tree_flatten(out)
  number = _tree(treedef)
  structure[key] = treedef, [*structure.get(key, (None, []))[1], {
      i: x for i, x in enumerate(leaves)
      if isinstance(x, (int, float, complex, np.ndarray, np.generic))}]
  return jax.tree_util.tree_unflatten(treedef, [
      checkpoint_name(x, f"{_MARK}{key}\x00{number}\x00{i}")
      if isinstance(x, jax.Array) else x for i, x in enumerate(leaves)])


def taken_out(run: Callable[..., dict], args: tuple,
              structure: dict[str, Any], lost: list[str] | None
              ) -> dict[str, Any]:
  """``run(*args)`` (a dict of outputs by name) with every output that
  :func:`_marked` marked in it added by its name.

  ``run`` is traced to a jaxpr, which is evaluated again with the marked
  values taken out: a ``scan`` that holds marks (``nn.scan``, ``nnx.scan``,
  which carry no collection of module outputs) runs as a ``lax.scan`` that
  also returns them, stacked along a leading axis of the loop's length;
  ``jit``, ``remat`` and custom-derivative bodies that hold marks are
  evaluated in place. Marks inside a ``while_loop`` or ``cond`` cannot be
  taken out: their names are appended to ``lost`` (None: named in a
  warning)."""
  statics, dynamic = trees.split_call(args, {})
  holder: dict[str, Any] = {}

  def flat(*dyn):
    out = statics.call(run, dyn)
    leaves, holder["tree"] = jax.tree_util.tree_flatten(out)
    return leaves
  closed = jax.make_jaxpr(flat)(*dynamic)
  found: list[tuple[str, Any]] = []
  missing: list[str] = []
  leaves = walker.interpret(closed, _taking_marks(found, missing), *dynamic)
  out = jax.tree_util.tree_unflatten(holder["tree"], leaves)
  # Marked leaves by layer as (treedef, {index: leaf}) per call; a layer met
  # twice (a module called twice) is two calls. ``ran``: the calls in the
  # order they ran, as (layer, call).
  calls: dict[str, list[tuple[Any, dict[int, Any]]]] = {}
  ran: list[tuple[str, int]] = []
  for mark, value in found:
    name, number, i = mark.rsplit("\x00", 2)
    tree = _tree(number=int(number))
    tree = structure.get(name, (None,))[0] if tree is None else tree
    if tree is None:  # a reused trace's, its number dropped since
      missing.append(name)
      continue
    runs = calls.setdefault(name, [])
    if not runs or int(i) in runs[-1][1] or tree != runs[-1][0]:
      runs.append((tree, {}))
      ran.append((name, len(runs) - 1))
    runs[-1][1][int(i)] = value
  for name, (treedef, consts) in structure.items():
    if name not in calls and name not in missing:  # constants alone: no mark
      calls[name] = [(treedef, {})] * len(consts)
      ran += [(name, k) for k in range(len(consts))]
  for name, k in ran:
    treedef, got = calls[name][k]
    consts = structure.get(name, (None, []))[1]
    out[name if len(calls[name]) == 1 else f"{name}#{k}"] = (
        jax.tree_util.tree_unflatten(treedef, [
            got.get(i, (consts[k] if k < len(consts) else {}).get(i))
            for i in range(treedef.num_leaves)]))
  if missing:
    names = ", ".join(repr(n) for n in dict.fromkeys(missing))
    if lost is None:
      warnings.warn(
          f"jaxprec.check_module cannot take out the outputs of {names}: "
          f"they run inside a while_loop or cond (or in a trace JAX "
          f"reused from {_KEPT} output structures ago); they are not "
          f"checked.",
          UserWarning, stacklevel=3)
    else:
      lost.extend(n for n in dict.fromkeys(missing) if n not in lost)
  return out


def _output_name(path: tuple[str, ...], method: str) -> str:
  """A module output's name: its path, ``'.method'`` for a method other
  than ``__call__`` (or a name it sows); the root's start with ``''``
  (:func:`module_outputs` prefixes them)."""
  base = "/".join(path)
  return base if method == "__call__" else f"{base}.{method}"


def _add_calls(out: dict, name: str, calls: Any) -> None:
  """``out[name]`` for each call's output (``'#0'``, ``'#1'`` when several)."""
  calls = tuple(calls) if isinstance(calls, (tuple, list)) else (calls,)
  for i, x in enumerate(calls):
    out[name if len(calls) == 1 else f"{name}#{i}"] = x


def _execution_order(fn: Callable[..., dict], args: Sequence[Any],
                     kwargs: dict) -> tuple[str, ...]:
  """The keys of ``fn(*args, **kwargs)`` (a dict) in the order they are computed.

  Read from ``fn``'s jaxpr (:func:`jaxprec._src.jaxpr.walker.output_times`), so
  that it holds inside every transform (``nn.jit``, ``nn.remat``,
  ``nn.scan``, ``nnx.scan``, ...), whose outputs JAX and Flax rebuild with
  sorted keys. A value is computed when its last leaf is; of values computed
  by one operation (a module that returns its child's output), the deeper
  module path comes first, the root's (``'output'``, a method's
  ``'output.encode'``) last.
  """
  statics, dynamic = trees.split_call(args, kwargs)
  names: list[tuple[str, int]] = []

  def flat(*dyn):
    out = statics.call(fn, dyn)
    leaves = []
    for name, value in out.items():
      for leaf in jax.tree_util.tree_leaves(value):
        names.append((name, len(leaves)))
        leaves.append(leaf)
    return leaves
  closed = jax.make_jaxpr(flat)(*dynamic)
  when: dict[str, tuple[int, ...]] = {}
  for (name, _), t in zip(names, walker.output_times(closed)):
    when[name] = max(when.get(name, t), t)
  seen = list(dict.fromkeys(n for n, _ in names))
  return tuple(sorted(seen, key=lambda n: (when[n], -n.count("/"),
                                            layers_lib.is_rooted(n))))


def _in_order(out: dict, order: Sequence[str]) -> dict:
  """``out`` with the keys of ``order`` first, in that order."""
  first = {n: out[n] for n in order if n in out}
  return {**first, **{n: v for n, v in out.items() if n not in first}}


def check_module(module: Any, *args: Any, method: str | None = None,
                 capture: Any = True, precisions: Any = None,
                 reference: Any = "float32", target: str = "tpu",
                 mode: str = "auto", atol: float = DEFAULT_ATOL,
                 rtol: float = DEFAULT_RTOL, progress: bool = False,
                 cache: bool | str | os.PathLike = False,
                 shadow: bool = False, chip: str | None = None,
                 tpu_matvec_f32: bool = True, logits: str | None = None,
                 logits_k: int | None = None,
                 **kwargs: Any) -> DivergenceReport:
  """:func:`check` over every submodule's output of a Flax module.

  For a ``flax.linen`` module call ``check_module(module, variables, *inputs)``;
  for a ``flax.nnx`` module call ``check_module(model, *inputs)``. Both see
  the output of every submodule's ``__call__`` through jaxprec's one module
  hook (the one policies and the port check use; NNX: on a copy, so the
  model is never mutated), named by module path
  (``'encoder/layers_0/attention'``; a module called twice gets ``#0``,
  ``#1``). The root's own output is ``'output'`` (a method's:
  ``'output.encode'``), or ``'(root)'`` (``'(root).encode'``) when a
  submodule is named ``output``, which keeps its path (``'((root))'`` when
  one is named ``(root)`` too). Values a module sows
  (``Module.sow``) are layers too, named ``'block.scores'`` (the module's
  path, the name sown). The linen modules inside an NNX model's
  ``nnx.bridge.ToNNX`` are listed under its path; the NNX modules inside a
  linen model's ``nnx.bridge.ToLinen`` are not.
  Layers are named by module path and ordered by when they are computed
  (children before their parent), also inside ``nn.jit``, ``nn.remat``,
  ``nn.scan``, ``nnx.jit``, ``nnx.remat`` and ``nnx.scan``, so that
  :meth:`~jaxprec.DivergenceReport.first_divergence` names the first layer
  that runs. A scanned layer (``nn.scan``, ``nnx.scan``) is one layer with
  its outputs of every iteration stacked along a leading axis; outputs that
  cannot be taken out of a ``while_loop`` or ``cond`` are named in a warning
  (:func:`taken_out`).

  Args:
    module: a ``flax.linen.Module`` (or one bound to its variables,
      ``module.bind(variables)``) or a ``flax.nnx.Module``.
    *args: for linen, the variables then the inputs (a bound module: the
      inputs alone); for nnx, the inputs.
    method: the method to call instead of ``__call__`` (linen: its name).
    capture: ``True`` (every submodule's ``__call__``) or a filter
      ``(module, method_name) -> bool`` of the calls to check (as linen's
      ``capture_intermediates`` takes): on linen every method's call
      reaches it, on NNX each ``__call__``.
    precisions, reference, target, mode, atol, rtol, progress, cache, chip,
    tpu_matvec_f32, logits, logits_k: as :func:`check` (``logits`` names a
      module output, e.g. ``'output'`` or ``'lm_head'``; not with
      ``shadow``). An external reference (e.g.
      ``jaxprec.torch.capture(pt_model, ..., modules=...)``, which names a
      PyTorch module tree as this function names a Flax one) may hold some
      of the layers: those are compared, and the others are listed in the
      report's ``unchecked`` (and in its table, markdown and JSON).
    shadow: each submodule's *local* error instead of the propagated one:
      it runs alone, at each precision, on the input it received in a
      float32 run of the model, against its float32 output on that input
      (layers in the order their calls end; a module called twice gets
      ``#0``, ``#1``). An error is then the layer's own, never inherited
      from the layers before it. Needs ``reference='float32'``; ``method``
      and ``capture`` are not supported with it. For the same against a
      PyTorch original, see :func:`jaxprec.torch.port_check`.
    **kwargs: keyword arguments for the module call (e.g.
      ``deterministic=True``).

  Returns:
    A :class:`jaxprec.DivergenceReport`.

  Raises:
    TypeError: ``module`` is not a Flax module, linen variables are missing,
      or ``capture`` is neither True nor a callable.
    ValueError: as :func:`check`; an external reference layer that names no
      layer of the module (a ``ReferenceMismatchError`` naming it, the
      module's layers and the closest one).
  """
  if shadow and logits is not None:
    raise ValueError("check_module: logits gates compare the model's "
                     "propagated logits; shadow=True checks each layer alone: "
                     "pass one of them")
  if shadow:
    from jaxprec._src.checker import shadow as shadow_lib  # noqa: PLC0415
    return shadow_lib.check_module_shadow(
        module, args, kwargs, method=method, capture=capture,
        precisions=precisions, reference=reference, target=target, mode=mode,
        atol=atol, rtol=rtol, chip=chip, tpu_matvec_f32=tpu_matvec_f32,
        progress=progress)
  common = dict(precisions=precisions, reference=reference, target=target,
                mode=mode, atol=atol, rtol=rtol, progress=progress,
                cache=cache, chip=chip, tpu_matvec_f32=tpu_matvec_f32)
  if logits is not None:
    common.update(logits=logits, logits_k=logits_k)
  fn, key, args = module_outputs(module, args, kwargs, method=method,
                                 capture=capture)
  return _check_module_fn(fn, key, args, kwargs, common)


def module_outputs(module: Any, args: tuple, kwargs: dict, *,
                   method: str | None = None, capture: Any = True
                   ) -> tuple[Callable[..., dict], Any, tuple]:
  """``(fn, key, args)``: ``fn(*args, **kwargs)`` returns the output of
  every submodule of the Flax ``module`` by module path, in the order they
  ran (what :func:`check_module` checks, and ``jaxprec search --modules``
  searches); ``key`` names ``fn`` for the program caches; ``args`` are the
  model's state or variables, then the inputs. The model is never mutated.

  Both APIs go through the one hook (:func:`hook.observing`): each module
  call it shows is marked (:func:`_marked`) and taken out of the program
  (:func:`taken_out`). The NNX modules a linen model's ``ToLinen`` makes are
  not listed (they get the hook under a policy only); the linen modules of
  an NNX model's ``ToNNX`` are, under its path (the ToNNX's own call is its
  linen module's).

  Raises:
    TypeError: as :func:`check_module`; a ``capture`` that is neither True
      nor callable.
    ValueError: the method gives no output.
  """
  import flax.linen as nn  # noqa: PLC0415 -- Flax only when in use
  from flax import nnx  # noqa: PLC0415
  from flax import traverse_util  # noqa: PLC0415
  if isinstance(module, nn.Module) and module.scope is not None:
    # Bound (module.bind(variables)): its variables, then the inputs.
    module, variables = module.unbind()
    args = (variables, *args)
  if isinstance(module, nn.Module):
    if not args or not isinstance(args[0], Mapping):
      raise TypeError("check_module(linen_module, variables, *inputs): the "
                      "variables (a dict with 'params') come first, or pass "
                      "the module bound to them: "
                      "check_module(linen_module.bind(variables), *inputs)")
    args = ({k: v for k, v in args[0].items() if k != "intermediates"},
            *args[1:])
    key: tuple = ("linen", module)

    def call(variables, /, *inputs, **kw):
      own, state = module.apply(variables, *inputs, method=method,
                                mutable=["intermediates"], **kw)
      return own, traverse_util.flatten_dict(
          state.get("intermediates", {})).items()
  elif isinstance(module, nnx.Module):
    graphdef, state = nnx.split(module)
    # The graph definition's text too: static attributes that compare equal
    # but trace differently (2 and 2.0) give equal graph definitions.
    args, key = (state, *args), ("nnx", graphdef, repr(graphdef))

    call = _nnx_call(graphdef, method)
  else:
    raise TypeError(f"check_module expects a Flax module (flax.linen or "
                    f"flax.nnx); got {type(module).__name__} (use "
                    f"jaxprec.check for functions)")
  if capture is not True and not callable(capture):
    raise TypeError(f"check_module: capture must be True or a filter "
                    f"(module, method_name) -> bool; got {capture!r}")
  captured = _capturing(call, key[0], method, capture)
  order = _execution_order(captured, args, kwargs)
  _some_output(order, module, method, capture)

  def fn(*args, **kw):
    out = _in_order(captured(*args, lost=[], **kw), order)
    return dict(zip(layers_lib.rooted(list(out)), out.values()))
  fn.__name__ = f"{type(module).__name__}.{method or '__call__'}"  # errors
  return fn, (*key, method, capture, order), args


def nnx_outputs(graphdef: Any, method: str | None) -> Callable[..., dict]:
  """``captured(state, *inputs, lost=None, **kw)``: the output of every
  module call of ``method`` (None: ``__call__``) on ``nnx.merge(graphdef,
  state)``, a new object each time, by path (:func:`_output_name`; ``'#0'``,
  ``'#1'`` for a module called twice), the capture of :func:`check_module`
  (the root's own call is ``''``; a method other than ``__call__`` adds its
  own output, ``'.METHOD'``: :func:`layers_lib.rooted` names them as
  layers). Each output is marked as the call returns (the hook's observers)
  and taken out of the program (:func:`taken_out`), so that a jitted or
  emulated ``captured`` returns them all; the policy in force reaches the
  copy as it reaches the model itself."""
  return _capturing(_nnx_call(graphdef, method), "nnx", method, True)


def _nnx_call(graphdef: Any, method: str | None) -> Callable[..., Any]:
  """``call(state, *inputs, **kw) -> (output, sown)`` of ``method`` on a new
  object of ``graphdef`` (the user's model is untouched), with the hook."""
  from flax import nnx  # noqa: PLC0415 -- Flax only when in use

  def call(state, /, *inputs, **kw):
    m = nnx.merge(graphdef, state)
    # The hook, as on the model itself: its module paths are seen (the
    # audit, a search's units), a policy row's rules reach them.
    scope = flax_state.active()
    nnx_policy.apply(m, None if scope is None else scope.policy,
                     None if scope is None else scope.recorder)
    nnx.pop(m, nnx.Intermediate)  # what an earlier call sowed
    own = (m if method is None else getattr(m, method))(*inputs, **kw)
    return own, [(p, v.get_value()) for p, v in nnx.to_flat_state(
        nnx.state(m, nnx.Intermediate))]
  return call


def _capturing(call: Callable[..., Any], kind: str, method: str | None,
               capture: Any) -> Callable[..., dict]:
  """``captured(*args, lost=None, **kw)``: ``call``'s module outputs (the
  hook's observers, ``capture``'s calls), what it sows, and the method's own
  output where it is not ``__call__``, by name; ``kind``: ``'linen'`` or
  ``'nnx'``."""
  wants = capture if callable(capture) else (
      lambda m, name: name == "__call__")

  def captured(*args, lost=None, **kw):
    structure: dict[str, Any] = {}

    def observer(path, module, args, kwargs, out, method):
      if layers_lib.unlisted(kind, module, kwargs) or not wants(module, method):
        return None
      return _marked(_output_name(flax_paths.split(path), method), out,
                     structure)

    def run(*args):
      with hook.observing(observer, methods=True):
        own, sown = call(*args, **kw)
      out = {} if method is None or capture is not True else {
          _output_name((), method): own}
      # What the model sows (Module.sow) is checked too.
      for path, value in sown:
        _add_calls(out, _output_name(tuple(map(str, path[:-1])),
                                     str(path[-1])), value)
      return out
    return taken_out(run, args, structure, lost)
  return captured


def _some_output(order: Sequence[str], module: Any, method: str | None,
                 capture: Any) -> None:
  """Raises a ValueError naming the method (and a ``capture`` filter) when
  it gave no output to check."""
  if not order:
    why = ("it calls no submodule and returns no array; check a method that "
           "does, or its function with jaxprec.check" if capture is True else
           f"the capture= filter {capture!r} picked none of its module calls "
           f"(it is given (module, method_name) for each)")
    raise ValueError(f"check_module: {type(module).__name__}."
                     f"{method or '__call__'} gave no output to check: {why}")


def _check_module_fn(fn: Callable[..., dict], key: Any, args: tuple,
                     kwargs: dict, common: dict) -> DivergenceReport:
  """:func:`check` of ``fn`` (a module's outputs by name); an external
  reference may hold some of its layers: only those are compared, and the
  report names the rest (``unchecked``)."""
  reference = common["reference"]
  if harness.is_computed(reference):
    return _check_cached(fn, key, *args, **common, **kwargs)
  found = reference_lib.load(reference)
  names = [n for n, _, _ in harness.output_info(
      fn, harness.Args(args, kwargs, who="jaxprec.check_module"))]
  checked, unchecked = reference_lib.select(found, names)
  if unchecked:
    keep = frozenset(checked)

    def partial(*a, all_layers=fn, **kw):
      return {n: v for n, v in layers_lib.layers(all_layers(*a, **kw))
              if n in keep}
    partial.__name__ = fn.__name__
    fn, key = partial, (key, tuple(checked))
  report = _check_cached(fn, key, *args, **dict(common, reference=found),
                         **kwargs)
  return dataclasses.replace(report, unchecked=tuple(unchecked),
                             reference=reference_lib.describe(reference))


# The wrapper functions check_module builds, by module identity, so that a
# second check of the same module reuses the compiled programs.
# They hold the module (or its graphdef), never arrays; at most 16 are kept.
_MODULE_FNS: dict[Any, Callable[..., Any]] = {}


def _check_cached(fn: Callable[..., Any], key: Any, *args: Any, **kwargs: Any):
  try:
    hash(key)
  except TypeError:
    return check(fn, *args, **kwargs)
  cached = _MODULE_FNS.get(key)
  if cached is None:
    if len(_MODULE_FNS) >= 16:
      _MODULE_FNS.pop(next(iter(_MODULE_FNS)))
    cached = _MODULE_FNS[key] = fn
  return check(cached, *args, **kwargs)
