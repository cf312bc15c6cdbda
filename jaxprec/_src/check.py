"""The divergence checker: ``jaxprec.check`` and ``jaxprec.check_module``.

``check(fn, *args)`` runs ``fn`` once at a reference precision and once per
precision under test, and compares every floating leaf of the output (a
*layer*, named by its pytree path) with the reference. Each candidate run is
one jitted program that computes ``fn`` at its precision and reduces every
layer to the scalars of :func:`jaxprec._src.metrics.layer_stats`: candidate
hidden states never leave the device, and memory stays near one reference run
(whose layers are kept) plus one candidate run, whatever the number of
precisions. Programs are cached per function, precision and input signature,
so a second check of the same function does not compile again.

What a precision name means when *emulating* (``mode='emulate'``, or
``'auto'`` on a backend that is not the target): the numerics its name says,
so that the default trio is informative on any target:

* ``'bfloat16'`` (``'bf16'``): one bfloat16 pass (``BF16_BF16_F32``);
* ``'bfloat16_3x'`` (``'bf16_3x'``): three bfloat16 passes (``BF16_BF16_F32_X3``);
* ``'tensorfloat32'`` (``'tf32'``): TF32 operands (``TF32_TF32_F32``), as an
  Ampere+ GPU computes it, even with ``target='tpu'`` (where JAX's
  ``tensorfloat32`` level means three bfloat16 passes, like ``bfloat16_3x``);
* any other name (``'default'``, ``'high'``, ``'highest'``, ``'float32'``,
  presets, ``lax.Precision`` members): what ``target`` computes for it, e.g.
  ``'float32'`` is six bfloat16 passes on a TPU and float32 on a GPU.

Ops whose code passed its own ``precision=`` keep it (computed as the row's
emulation target computes it). In *native* mode (on the target's own
hardware) every name goes through JAX's flag exactly as JAX reads it, so on a
TPU ``'bfloat16_3x'`` and ``'tensorfloat32'`` are the same row; the report's
``numerics`` say what ran.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprec._src import compat
from jaxprec._src import walker
from jaxprec._src import emulated_ops
from jaxprec._src import metrics as metrics_lib
from jaxprec._src import report as report_lib
from jaxprec._src.emulate import emulate
from jaxprec._src.precision import Precision, PrecisionLike, resolve
from jaxprec._src.report import DivergenceReport, LayerResult

__all__ = ["DEFAULT_ATOL", "DEFAULT_PRECISIONS", "DEFAULT_RTOL", "MODES",
           "ReferenceMismatchError", "TARGETS", "check", "check_module",
           "named_layers", "plan", "save_layers"]

DEFAULT_PRECISIONS = ("bfloat16", "bfloat16_3x", "tensorfloat32")
DEFAULT_ATOL = 1e-3
DEFAULT_RTOL = 1e-3
MODES = ("auto", "emulate", "native")
TARGETS = ("tpu", "gpu")
_FLOAT64_NAMES = ("float64", "f64", "fp64", "double")
# User spellings emulated with the numerics their name says (module docstring).
_LITERAL = {
    "bfloat16": ("bfloat16", "tpu"), "bf16": ("bfloat16", "tpu"),
    "medium": ("bfloat16", "tpu"),
    "bfloat16_3x": ("bfloat16_3x", "tpu"), "bf16_3x": ("bfloat16_3x", "tpu"),
    "tensorfloat32": ("tensorfloat32", "gpu"), "tf32": ("tensorfloat32", "gpu"),
}


class ReferenceMismatchError(ValueError):
  """A given reference does not have the output's layers or shapes."""


# ---------------------------------------------------------------------------
# Layers: floating leaves named by path.


def _key_name(k: Any) -> str:
  tu = jax.tree_util
  if isinstance(k, tu.DictKey):
    return f".{k.key}" if isinstance(k.key, str) else f"[{k.key!r}]"
  if isinstance(k, tu.GetAttrKey):
    return f".{k.name}"
  if isinstance(k, tu.SequenceKey):
    return f"[{k.idx}]"
  if isinstance(k, tu.FlattenedIndexKey):
    return f"[{k.key}]"
  return f"[{k}]"


def _path_name(path: Sequence[Any]) -> str:
  return "".join(_key_name(k) for k in path).lstrip(".") or "output"


def _leaves_with_paths(tree: Any) -> list[tuple[tuple, Any]]:
  """Like ``tree_flatten_with_path``, but plain dicts keep insertion order.

  JAX sorts dict keys; a dict of layers written in depth order
  (``layer_2`` before ``layer_10``) keeps that order here.
  """
  out: list[tuple[tuple, Any]] = []

  def rec(node, path):
    if type(node) in (dict, collections.OrderedDict):
      for k, v in node.items():
        rec(v, path + (jax.tree_util.DictKey(k),))
      return
    kids = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x, node=node: x is not node)[0]
    if len(kids) == 1 and kids[0][0] == () and kids[0][1] is node:
      out.append((path, node))
      return
    for p, v in kids:
      rec(v, path + tuple(p))
  rec(tree, ())
  return out


def _is_float(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return (dtype is not None and hasattr(x, "shape")
          and jnp.issubdtype(dtype, jnp.floating))


def _layers(tree: Any) -> list[tuple[str, Any]]:
  layers = [(_path_name(p), v) for p, v in _leaves_with_paths(tree) if _is_float(v)]
  seen: dict[str, int] = {}
  for name, _ in layers:
    seen[name] = seen.get(name, 0) + 1
  dup = [n for n, c in seen.items() if c > 1]
  if dup:
    raise ValueError(f"Two layers of the output have the same name {dup[0]!r}; "
                     f"rename the keys of the returned pytree.")
  return layers


def _ordered_layers(wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
                    fn: Callable[..., Any], args: "walker.SplitArgs",
                    dynamic: Sequence[Any]) -> list[tuple[str, Any]]:
  """The layers of ``wrap(fn)(*args)`` in the order ``fn`` itself returned them.

  Transformations (emulation, ``eval_shape``) rebuild the output from its
  treedef, which sorts dict keys; the names are read from ``fn``'s own
  output while it is traced, and the result is put back in that order.
  """
  order: list[list[str]] = []

  @functools.wraps(fn)
  def observed(*a, **k):
    out = fn(*a, **k)
    order.append([n for n, _ in _layers(out)])
    return out
  layers = _layers(args.call(wrap(observed), dynamic))
  if not order:
    return layers
  by_name = dict(layers)
  if sorted(by_name) != sorted(order[-1]):
    return layers
  return [(n, by_name[n]) for n in order[-1]]


def named_layers(tree: Any) -> dict[str, Any]:
  """The floating leaves of a pytree by the names ``jaxprec.check`` gives them.

  Names are pytree paths: ``'hidden_states[3]'``, ``'encoder.layer_0'``,
  ``'output'`` for a bare array. Plain dicts keep their insertion order.

  Args:
    tree: hidden states, e.g. the output of ``fn`` given to ``check``.

  Returns:
    An insertion-ordered dict, name -> array.

  Examples:
    >>> import numpy as np, jaxprec
    >>> tree = {"hidden_states": (np.zeros(2), np.ones(2)), "mask": np.ones(2, int)}
    >>> list(jaxprec.named_layers(tree))
    ['hidden_states[0]', 'hidden_states[1]']
  """
  return dict(_layers(tree))


def save_layers(path: str | os.PathLike, tree: Any) -> None:
  """Saves hidden states where ``check(..., reference=path)`` can read them.

  ``.npz`` (NumPy) or ``.safetensors`` (needs the ``safetensors`` package).
  Keys are the names of :func:`named_layers`.

  Args:
    path: the file to write; its extension picks the format.
    tree: the hidden states (a pytree of arrays).
  """
  path = os.fspath(path)
  arrays = {k: np.asarray(v) for k, v in named_layers(tree).items()}
  if path.endswith(".npz"):
    np.savez(path, **arrays)
  elif path.endswith(".safetensors"):
    save_file = _safetensors("save_file")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, path)
  else:
    raise ValueError(f"Unknown reference file type {path!r}: use .npz or "
                     f".safetensors.")


def _safetensors(name: str):
  try:
    import safetensors.numpy as st
  except ImportError as e:
    raise ImportError("reading or writing .safetensors needs the safetensors "
                      "package: pip install safetensors") from e
  return getattr(st, name)


def _normalize(name: str) -> str:
  return re.sub(r"[\[\]./'\"]+", ".", name).strip(".")


def _load_reference(path: str) -> dict[str, np.ndarray]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no reference file {path!r}")
  if path.endswith(".npz"):
    with np.load(path, allow_pickle=False) as z:
      return {k: z[k] for k in z.files}
  return dict(_safetensors("load_file")(path))


def _is_path(ref: Any) -> bool:
  if isinstance(ref, os.PathLike):
    return True
  return isinstance(ref, str) and ref.endswith((".npz", ".safetensors"))


# ---------------------------------------------------------------------------
# What each row runs.


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one precision label is computed (see the module docstring).

  Attributes:
    label: the row's label, as the user wrote it.
    precision: the resolved precision (native runs set JAX's flag to it).
    emulate_target: ``'tpu'``/``'gpu'`` to emulate as that target, None to
      run natively.
    algorithm: what runs for float32 matmuls, e.g. ``'bf16x1'``.
    description: for the report, e.g. ``'tf32 (emulated, gpu numerics)'``.
  """

  label: str
  precision: Precision
  emulate_target: str | None
  algorithm: str
  description: str

  @property
  def key(self) -> tuple:
    return (self.precision.name, self.emulate_target)

  def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    if self.emulate_target is not None:
      return emulate(fn, self.precision, target=self.emulate_target)
    flag = self.precision.flag

    @functools.wraps(fn)
    def native(*args, **kwargs):
      with jax.default_matmul_precision(flag):
        return fn(*args, **kwargs)
    return native


def _label(p: PrecisionLike) -> str:
  if isinstance(p, str):
    return p
  if isinstance(p, lax.Precision):
    return p.name.lower()
  if isinstance(p, (Precision, lax.DotAlgorithmPreset)):
    return p.name
  return str(p)


def plan(precision: PrecisionLike, target: str, mode: str,
         backend: str | None = None) -> Plan:
  """How ``check`` computes one precision for ``target`` in ``mode``.

  Args:
    precision: a precision (any spelling :func:`jaxprec.resolve` accepts).
    target: ``'tpu'`` or ``'gpu'``.
    mode: ``'emulate'`` or ``'native'`` (resolve ``'auto'`` first).
    backend: the backend native runs use (default: JAX's).

  Returns:
    The :class:`Plan`.

  Examples:
    >>> from jaxprec._src.check import plan
    >>> plan("tensorfloat32", "tpu", "emulate").description
    'tf32 (emulated, gpu numerics)'
    >>> plan("float32", "tpu", "emulate").algorithm
    'bf16x6'
  """
  label = _label(precision)
  literal = _LITERAL.get(label.strip().lower()) if isinstance(precision, str) else None
  p = resolve(literal[0] if literal else precision)
  if mode == "native":
    backend = backend or compat.backend_platform()
    algo = p.on(backend).algorithm if backend in ("tpu", "gpu", "cuda", "rocm",
                                                   "cpu") else "?"
    return Plan(label, p, None, algo, f"{algo} (native {backend})")
  emu_target = literal[1] if literal else target
  algo = emulated_ops.algorithm_for(p.per_op, emu_target, jnp.float32, jnp.float32)
  if algo == "native" and p.flag is None:
    algo = emulated_ops.algorithm_for(lax.Precision.DEFAULT, emu_target,
                                      jnp.float32, jnp.float32)
  desc = f"{algo} (emulated)" if emu_target == target else (
      f"{algo} (emulated, {emu_target} numerics)")
  return Plan(label, p, emu_target, algo, desc)


def _check_choice(value: Any, choices: Sequence[str], what: str) -> str:
  v = value.lower() if isinstance(value, str) else None
  if v not in choices:
    import difflib
    msg = (f"Unknown {what} {value!r}; valid choices: "
           f"{', '.join(map(repr, choices))}.")
    close = difflib.get_close_matches(v, choices, n=1) if v else []
    if close:
      msg += f" Did you mean {close[0]!r}?"
    raise ValueError(msg)
  return v


def resolve_mode(mode: str, target: str) -> str:
  """``'auto'``: native on the target's own backend, emulation elsewhere."""
  mode = _check_choice(mode, MODES, "mode")
  if mode != "auto":
    return mode
  backend = compat.backend_platform()
  native = {"tpu": ("tpu",), "gpu": ("gpu", "cuda", "rocm")}[target]
  return "native" if backend in native else "emulate"


def _plans(precisions: Any, target: str, mode: str) -> list[Plan]:
  if isinstance(precisions, (str, lax.Precision, lax.DotAlgorithmPreset, Precision)):
    precisions = (precisions,)
  precisions = tuple(precisions)
  if not precisions:
    raise ValueError("precisions is empty: name at least one, e.g. "
                     "precisions=('bfloat16',)")
  plans = [plan(p, target, mode) for p in precisions]
  labels = [p.label for p in plans]
  if len(set(labels)) != len(labels):
    raise ValueError(f"precisions repeats a name: {labels}")
  return plans


def _reference_plan(reference: str, target: str, mode: str) -> Plan | None:
  """None for float64; float32 runs natively (exact where the backend is)."""
  if reference.strip().lower() in _FLOAT64_NAMES:
    return None
  p = resolve(reference)
  if p.name in ("float32", "F32_F32_F32"):
    backend = compat.backend_platform()
    return Plan(reference, resolve("float32"), None,
                p.on(backend).algorithm, f"{p.on(backend).algorithm} "
                f"(native {backend})")
  return plan(reference, target, mode)


# ---------------------------------------------------------------------------
# Arguments and compiled programs.




def _signature(dynamic: Sequence[Any]) -> tuple:
  return tuple((x.shape, x.dtype) for x in dynamic)


class _Jit:
  """``jax.jit(fn)`` whose calls wait for their results, with one fallback.

  XLA:CPU's algebraic simplifier can fold a transpose into a dot whose
  operands are bfloat16 parts of an emulated matmul (e.g. ``(a @ b).T`` or a
  weight gradient), making a dot that XLA:CPU then refuses to run
  ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32",
  jax 0.10.2). Such a program is compiled once more without that pass; the
  numbers are the same (the simplifier does not change the bf16 products).
  """

  _ERROR = "Unsupported element type for DotThunk"

  def __init__(self, fn: Callable[..., Any]):
    self._fn = fn
    self._jit = jax.jit(fn)
    self._fell_back = False

  def __call__(self, *args):
    try:
      return jax.block_until_ready(self._jit(*args))
    except jax.errors.JaxRuntimeError as e:
      if self._fell_back or self._ERROR not in str(e):
        raise
      self._jit = jax.jit(self._fn, compiler_options={
          "xla_disable_hlo_passes": "algsimp"})
      self._fell_back = True
      return jax.block_until_ready(self._jit(*args))

  def lower(self, *args):
    return self._jit.lower(*args)


# fn -> {key: jitted program}. Programs hold fn weakly (a strong reference
# from a value would keep its key alive forever).
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _program(fn: Callable[..., Any], key: Any, make: Callable[[Callable[[], Any]], Any]):
  try:
    fn_ref = weakref.ref(fn)
    per_fn = _PROGRAMS.setdefault(fn, {})
  except TypeError:  # not weak-referenceable: no caching
    return make(lambda: fn)
  if key is None:
    return make(fn_ref)
  prog = per_fn.get(key)
  if prog is None:
    prog = per_fn[key] = make(fn_ref)
  return prog


@dataclasses.dataclass
class _Reference:
  names: list[str]
  shapes: list[tuple[int, ...]]
  dtypes: list[str]
  layout: metrics_lib.Layout
  hi: Any  # packed (n_chunks, CHUNK) float32, on the device
  lo: Any  # the same for ref - hi when the reference is float64, else None
  stats: Any = None  # metrics_lib.reference_stats, on the device


_reference_stats = jax.jit(metrics_lib.reference_stats, static_argnums=(2,))


def _x64_scope():
  # jax.enable_x64 is public from jax 0.6 on; older JAX had it in experimental.
  ctx = getattr(jax, "enable_x64", None)
  if ctx is not None:
    return ctx(True)
  from jax.experimental import enable_x64  # pragma: no cover
  return enable_x64()


def _info(layers) -> list[tuple[str, tuple[int, ...], str]]:
  return [(n, tuple(v.shape), str(v.dtype)) for n, v in layers]


def _reference_program(fn, args: walker.SplitArgs, ref_plan: Plan | None):
  """The jitted program ``dynamic -> (hi, lo, stats, layers)``."""
  x64 = ref_plan is None
  key = ("ref", "float64" if x64 else ref_plan.key, args.key)

  def make(fn_ref):
    holder: dict[tuple, list] = {}

    def program(dynamic):
      f = fn_ref()
      if x64:
        dyn = [x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating)
               else x for x in dynamic]
        layers = _ordered_layers(lambda g: g, f, args, dyn)
      else:
        layers = _ordered_layers(ref_plan.wrap, f, args, dynamic)
      info = _info(layers)
      holder[_signature(dynamic)] = info
      layout = metrics_lib.Layout(tuple(int(np.prod(s)) for _, s, _ in info))
      values = [v for _, v in layers]
      lo = None
      if x64:
        pairs = [metrics_lib.split_reference_jax(v) for v in values]
        hi = metrics_lib.pack([h for h, _ in pairs], layout)
        if any(l is not None for _, l in pairs):
          lo = metrics_lib.pack([jnp.zeros(h.shape, jnp.float32) if l is None
                                 else l for h, l in pairs], layout)
      else:
        hi = metrics_lib.pack(values, layout)
      stats = metrics_lib.reference_stats(hi, lo, layout)
      # The layers are returned (and dropped unread) so that XLA computes
      # them once instead of fusing their producers into the packing
      # concatenate (see _candidate_program).
      return hi, lo, stats, values
    jitted = _Jit(program)
    jitted.holder = holder  # type: ignore[attr-defined]
    return jitted

  return _program(fn, key, make)


def _run_reference(fn, args: walker.SplitArgs, ref_plan: Plan | None) -> _Reference:
  x64 = ref_plan is None
  prog = _reference_program(fn, args, ref_plan)
  if x64:
    with _x64_scope():
      hi, lo, stats, layers = prog(args.dynamic)
  else:
    hi, lo, stats, layers = prog(args.dynamic)
  del layers  # never copied to the host
  info = prog.holder[_signature(args.dynamic)]
  ref = _reference(info, hi, lo)
  ref.stats = stats
  return ref


def _reference(info, hi, lo) -> _Reference:
  layout = metrics_lib.Layout(tuple(int(np.prod(s)) for _, s, _ in info))
  return _Reference([n for n, _, _ in info], [s for _, s, _ in info],
                    [d for _, _, d in info], layout, hi, lo)


def _output_layers(fn, args: walker.SplitArgs) -> list[tuple[str, tuple[int, ...], str]]:
  holder: dict[str, Any] = {}

  def flat(dynamic):
    layers = _ordered_layers(lambda g: g, fn, args, dynamic)
    holder["info"] = _info(layers)
    return [v for _, v in layers]
  jax.eval_shape(flat, args.dynamic)
  return holder["info"]


def _external_reference(fn, args: walker.SplitArgs, ref: Any) -> _Reference:
  if _is_path(ref):
    found = _load_reference(os.fspath(ref))
  elif isinstance(ref, Mapping) and all(isinstance(k, str) for k in ref) and all(
      _is_float(v) for v in ref.values()):
    found = dict(ref)
  else:
    found = named_layers(ref)
  by_norm: dict[str, tuple[str, Any]] = {}
  for k, v in found.items():
    n = _normalize(k)
    if n in by_norm:
      raise ReferenceMismatchError(
          f"reference names {by_norm[n][0]!r} and {k!r} denote the same "
          f"layer")
    by_norm[n] = (k, v)
  info = _output_layers(fn, args)
  used, his, los = set(), [], []
  for name, shape, _ in info:
    n = _normalize(name)
    if n not in by_norm:
      listed = ", ".join(map(repr, list(found)[:8]))
      more = "..." if len(found) > 8 else ""
      raise ReferenceMismatchError(
          f"reference does not match the output: first mismatch at {name!r}: "
          f"output shape {tuple(shape)}, reference shape: missing (the "
          f"reference has {listed}{more})")
    k, v = by_norm[n]
    v = np.asarray(v)
    if tuple(v.shape) != tuple(shape):
      raise ReferenceMismatchError(
          f"reference does not match the output: first mismatch at {name!r}: "
          f"output shape {tuple(shape)}, reference shape {tuple(v.shape)}")
    if not np.issubdtype(v.dtype, np.floating) and v.dtype.name != "bfloat16":
      raise ReferenceMismatchError(
          f"reference {k!r} is not floating point ({v.dtype})")
    used.add(n)
    h, l = metrics_lib.split_reference(v)
    his.append(h)
    los.append(l)
  extra = [by_norm[n][0] for n in by_norm if n not in used]
  if extra:
    raise ReferenceMismatchError(
        f"reference does not match the output: first mismatch at {extra[0]!r}: "
        f"output shape: missing, reference shape "
        f"{tuple(np.shape(found[extra[0]]))}")
  r = _reference(info, None, None)
  r.hi = jnp.asarray(metrics_lib.pack_numpy(his, r.layout))
  if any(l is not None for l in los):
    r.lo = jnp.asarray(metrics_lib.pack_numpy(
        [np.zeros(np.shape(h), np.float32) if l is None else l
         for h, l in zip(his, los)], r.layout))
  return r


def _candidate_program(fn, args: walker.SplitArgs, p: Plan, ref: _Reference):
  """The jitted program ``(hi, lo, stats, dynamic, atol, rtol) -> stats``."""
  names = tuple(ref.names)
  key = ("cand", p.key, args.key, names, ref.layout, ref.lo is not None)

  def make(fn_ref):
    def program(hi, lo, stats, dynamic, atol, rtol):
      layers = _ordered_layers(p.wrap, fn_ref(), args, dynamic)
      got = tuple(n for n, _ in layers)
      if got != names:
        raise ValueError(
            f"At precision {p.label!r} the output has layers {list(got)[:6]}, "
            f"the reference {list(names)[:6]}")
      values = [c for _, c in layers]
      # The layers are returned too (and dropped unread): otherwise XLA fuses
      # their producers into the packing concatenate and computes them twice
      # (measured: 1.3x the time of the forward pass on wav2vec2-small). They
      # stay on the device and are freed at once.
      return metrics_lib.layer_stats(values, hi, lo, stats, ref.layout,
                                     atol=atol, rtol=rtol), values
    return _Jit(program)

  return _program(fn, key, make)


def _candidate_args(args: walker.SplitArgs, ref: _Reference, atol: float, rtol: float):
  if ref.stats is None:
    ref.stats = _reference_stats(ref.hi, ref.lo, ref.layout)
  return (ref.hi, ref.lo, ref.stats, args.dynamic, np.float32(atol),
          np.float32(rtol))


def _run_candidate(fn, args: walker.SplitArgs, p: Plan, ref: _Reference, atol: float,
                   rtol: float) -> list[metrics_lib.LayerMetrics]:
  prog = _candidate_program(fn, args, p, ref)
  stats, layers = prog(*_candidate_args(args, ref, atol, rtol))
  del layers  # never copied to the host
  return metrics_lib.finish(jax.device_get(stats), ref.layout)


# ---------------------------------------------------------------------------
# The public entry points.


def check(fn: Callable[..., Any], *args: Any,
          precisions: Sequence[PrecisionLike] | PrecisionLike = DEFAULT_PRECISIONS,
          reference: Any = "float32", target: str = "tpu", mode: str = "auto",
          atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
          progress: bool = False, **kwargs: Any) -> DivergenceReport:
  """How far each layer of ``fn(*args, **kwargs)`` drifts at each precision.

  ``fn`` returns a pytree of hidden states (a dict, list, tuple, dataclass, or
  a Hugging Face ``ModelOutput``); every floating leaf is a *layer*, named by
  its path (``'hidden_states[3]'``) and ordered as flattened (plain dicts in
  insertion order). ``fn`` runs once at the reference and once per precision;
  each run is jitted with the metrics inside, so only scalars leave the device
  and compiled programs are reused by later checks of the same ``fn``.

  Which numerics a row shows (details in :mod:`jaxprec._src.check`): with
  ``mode='auto'`` the check runs natively when the backend is the target (a
  TPU for ``target='tpu'``) and emulates the target otherwise (on CPU, always).
  When emulating, ``'bfloat16'``, ``'bfloat16_3x'`` and ``'tensorfloat32'``
  mean what their names say (1 bfloat16 pass, 3 bfloat16 passes, TF32) on any
  target; other names mean what ``target`` computes for them. Natively, names
  go through JAX's flag (on a TPU ``'tensorfloat32'`` is 3 bfloat16 passes).

  Array leaves of ``args``/``kwargs`` are traced; other leaves (Python
  numbers, strings, flags such as ``deterministic=True``) are static. Pass
  parameters as arguments rather than closing over them: closed-over arrays
  are compiled into every program as constants.

  Args:
    fn: the function; its arguments follow.
    *args: positional arguments for ``fn``.
    precisions: the precisions to test (labels of the report's rows); one
      name or a sequence.
    reference: ``'float32'`` (default: exact float32 where the backend has it;
      six bfloat16 passes on a TPU), ``'float64'`` (``fn`` runs with 64-bit
      types enabled in a scope that is always restored, its floating array
      arguments cast to float64), any other precision (computed as a row
      would be), or hidden states computed elsewhere (e.g. by PyTorch): a
      pytree or ``{name: array}`` mapping, or a path to a ``.npz`` (loaded with
      ``allow_pickle=False``) or ``.safetensors`` file, matched by name
      (``'hidden_states[3]'``, ``'hidden_states.3'`` and ``'hidden_states/3'``
      match the same layer).
    target: ``'tpu'`` or ``'gpu'``: whose numerics to show.
    mode: ``'auto'``, ``'emulate'`` or ``'native'``.
    atol, rtol: the tolerance: a layer passes when every element has
      ``|err| <= atol + rtol * |ref|`` (see ``frac_outside`` and
      ``required_atol``); defaults 1e-3 and 1e-3, loose enough that
      multi-pass precisions pass on typical models and one-pass formats
      (bfloat16, TF32) do not: pass your own.
    progress: show a progress bar on stderr (when it is a terminal).
    **kwargs: keyword arguments for ``fn``. (To pass a keyword named like one
      of the above, wrap ``fn`` with ``functools.partial``.)

  Returns:
    A :class:`jaxprec.DivergenceReport`.

  Raises:
    ValueError: an unknown precision, target or mode; a reference that does
      not match the output (the message names the first mismatching path and
      both shapes); an output without floating leaves.
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
    >>> r.numerics["tensorfloat32"]
    'tf32 (emulated, gpu numerics)'
  """
  if not callable(fn):
    raise TypeError(f"jaxprec.check expects a callable; got {fn!r} of type "
                    f"{type(fn).__name__}")
  target = _check_choice(target, TARGETS, "target")
  mode = resolve_mode(mode, target)
  atol, rtol = float(atol), float(rtol)
  if not (atol >= 0 and rtol >= 0):
    raise ValueError(f"atol and rtol must be >= 0; got atol={atol}, rtol={rtol}")
  plans = _plans(precisions, target, mode)
  call = walker.SplitArgs(args, dict(kwargs), who='jaxprec.check')
  backend = compat.backend_platform()
  notes = []
  external = not isinstance(reference, str) or _is_path(reference)
  ref_plan = None
  if not external:
    ref_plan = _reference_plan(reference, target, mode)
  seconds: dict[str, float] = {}
  with report_lib.maybe_progress(len(plans) + 1, "jaxprec check", progress) as bar:
    bar.update("reference")
    t0 = time.perf_counter()
    if external:
      ref = _external_reference(fn, call, reference)
      ref_name = (f"file:{os.fspath(reference)}" if _is_path(reference)
                  else "pytree")
      ref_desc = "external"
    else:
      ref = _run_reference(fn, call, ref_plan)
      ref_name = reference
      ref_desc = "float64 (native, x64)" if ref_plan is None else ref_plan.description
    seconds["reference"] = time.perf_counter() - t0
    if not ref.names:
      raise ValueError(f"{getattr(fn, '__name__', 'fn')}(...) returned no "
                       f"floating arrays to compare")
    results: dict[str, list[metrics_lib.LayerMetrics]] = {}
    for p in plans:
      bar.update(p.label, advance=1)
      t0 = time.perf_counter()
      results[p.label] = _run_candidate(fn, call, p, ref, atol, rtol)
      seconds[p.label] = time.perf_counter() - t0
    bar.update("done", advance=1)
  if mode == "native" and backend == "cpu":
    notes.append("native mode on CPU: the CPU ignores matmul precision, so "
                 "every row computes exact float32")
  if mode == "emulate" and target == "tpu" and any(
      p.emulate_target == "gpu" for p in plans):
    notes.append("'tensorfloat32' shows TF32 (GPU) numerics; on a TPU JAX's "
                 "tensorfloat32 level is 3 bfloat16 passes, like 'bfloat16_3x'")
  layers = tuple(
      LayerResult(name=n, shape=s, dtype=d,
                  metrics={p.label: results[p.label][i] for p in plans})
      for i, (n, s, d) in enumerate(zip(ref.names, ref.shapes, ref.dtypes)))
  numerics = {p.label: p.description for p in plans}
  return DivergenceReport(
      layers=layers, precisions=tuple(p.label for p in plans),
      reference=ref_name, target=target, mode=mode, backend=backend,
      atol=atol, rtol=rtol,
      numerics={**numerics, "(reference)": ref_desc}, notes=tuple(notes),
      seconds=seconds)


def _linen_intermediates(tree: Any, path: tuple[str, ...], out: dict) -> None:
  for k, v in tree.items():
    if isinstance(v, Mapping):
      _linen_intermediates(v, path + (str(k),), out)
    else:  # a method name -> tuple of captured outputs (one per call)
      base = "/".join(path) or "output"
      name = base if k == "__call__" else f"{base}.{k}"
      vals = tuple(v) if isinstance(v, (tuple, list)) else (v,)
      for i, x in enumerate(vals):
        out[name if len(vals) == 1 else f"{name}#{i}"] = x


def _nnx_intermediates(module: Any, state: Any) -> dict:
  from flax import nnx
  flat = {}
  for path, var in nnx.to_flat_state(state):
    flat.setdefault(tuple(path[:-1]), []).append((path[-1], var))
  out: dict[str, Any] = {}
  for mpath, _ in nnx.iter_modules(module):  # post-order: children first
    for method, var in flat.get(tuple(mpath), ()):
      base = "/".join(map(str, mpath)) or "output"
      name = base if method == "__call__" else f"{base}.{method}"
      vals = var.get_value() if hasattr(var, "get_value") else var.value
      vals = tuple(vals) if isinstance(vals, (tuple, list)) else (vals,)
      for i, x in enumerate(vals):
        out[name if len(vals) == 1 else f"{name}#{i}"] = x
  return out


def check_module(module: Any, *args: Any, method: str | None = None,
                 capture: Any = True, precisions: Any = DEFAULT_PRECISIONS,
                 reference: Any = "float32", target: str = "tpu",
                 mode: str = "auto", atol: float = DEFAULT_ATOL,
                 rtol: float = DEFAULT_RTOL, progress: bool = False,
                 **kwargs: Any) -> DivergenceReport:
  """:func:`check` over every submodule's output of a Flax module.

  For a ``flax.linen`` module call ``check_module(module, variables, *inputs)``:
  it runs ``module.apply`` with ``capture_intermediates`` and checks each
  captured output, named by module path (``'encoder/layers_0/attention'``; the
  root's own output is ``'output'``; a module called twice gets ``#0``,
  ``#1``). For a ``flax.nnx`` module call ``check_module(model, *inputs)``:
  the outputs of every submodule's ``__call__`` are captured with
  ``nnx.capture``; the model is split and merged inside, never mutated.
  Layers are ordered as the calls return (children before their parent).

  Args:
    module: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
    *args: for linen, the variables then the inputs; for nnx, the inputs.
    method: the method to call instead of ``__call__`` (linen: its name).
    capture: linen only: ``True`` (every submodule's ``__call__``) or a
      filter ``(module, method_name) -> bool`` as ``capture_intermediates``
      takes.
    precisions, reference, target, mode, atol, rtol, progress: as
      :func:`check`.
    **kwargs: keyword arguments for the module call (e.g.
      ``deterministic=True``).

  Returns:
    A :class:`jaxprec.DivergenceReport`.

  Raises:
    TypeError: ``module`` is not a Flax module, or linen variables are missing.
  """
  common = dict(precisions=precisions, reference=reference, target=target,
                mode=mode, atol=atol, rtol=rtol, progress=progress)
  import flax.linen as nn
  from flax import nnx
  if isinstance(module, nn.Module):
    if not args or not isinstance(args[0], Mapping):
      raise TypeError("check_module(linen_module, variables, *inputs): the "
                      "variables (a dict with 'params') come first")
    variables = {k: v for k, v in args[0].items() if k != "intermediates"}

    def linen_fn(variables, *inputs, **kw):
      _, state = module.apply(variables, *inputs, method=method,
                              capture_intermediates=capture,
                              mutable=["intermediates"], **kw)
      out: dict[str, Any] = {}
      _linen_intermediates(state.get("intermediates", {}), (), out)
      return out
    return _check_cached(linen_fn, ("linen", module, method, capture),
                         variables, *args[1:], **common, **kwargs)
  if isinstance(module, nnx.Module):
    graphdef, state = nnx.split(module)

    def nnx_fn(state, *inputs, **kw):
      m = nnx.merge(graphdef, state)
      target_fn = m if method is None else getattr(m, method)
      _, inter = nnx.capture(target_fn, nnx.Intermediate,
                             method_outputs=nnx.Intermediate)(*inputs, **kw)
      return _nnx_intermediates(m, inter)
    return _check_cached(nnx_fn, ("nnx", graphdef, method), state, *args,
                         **common, **kwargs)
  raise TypeError(f"check_module expects a Flax module (flax.linen or "
                  f"flax.nnx); got "
                  f"{type(module).__name__} (use jaxprec.check for functions)")


# The wrapper functions check_module builds, by module identity, so that a
# second check of the same module reuses the compiled programs.
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
