"""Port checks: is a JAX port of a PyTorch model wrong, or is it precision?

:func:`port_check` runs a JAX model (an NNX module, a linen module with its
variables, or a function) and its PyTorch original on the same inputs, pairs
their layers without hand-written names, and for every pair and row
(precision) measures:

* the **local** error: the JAX layer run on the PyTorch layer's own input,
  against the PyTorch layer's output (shadow mode, as PyTorch's Numeric
  Suite's shadow loggers separate local from propagated error);
* the **propagated** error: the JAX layer's output in a full JAX run against
  the PyTorch layer's output (what ``jaxprec.check`` shows);
* the **floor**: the local error of float32 JAX against float32 PyTorch, and
  the **noise**: float32 JAX against float64 JAX on the same input, what
  float32 rounding alone makes in that layer;
* the **envelope**: the row's precision against float32 JAX on the same input
  (emulated on the target), what the precision alone makes in that layer.

A layer's local error is *explained* when it is within ``factor * (noise +
envelope) + SLACK`` (``rel_rms``); a layer that is not, while every paired
layer inside it is, is a **suspect**: the bug is in its own code.
All arithmetic on results is float64 NumPy on the host.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import functools
import itertools
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxprec._src.checker import layers as layers_lib
from jaxprec._src.checker import logits as logits_lib
from jaxprec._src.checker import progress as progress_lib
from jaxprec._src.checker import render
from jaxprec._src.checker import rows as rows_lib
from jaxprec._src.jaxpr import trees
from jaxprec._src.torch import torch_ref

# A layer's local error is explained when it is at most
# PORT_FACTOR * (noise + envelope) + SLACK (rel_rms). Two float32
# implementations that differ only in the order of their roundings are each
# about one noise away from the exact result, so a correct layer's floor is
# within about 2x its noise (measured on the test ports and jaxprec's Llama,
# BERT and Wav2Vec2 ports: at most 2.3x, and 0 where the noise is 0); a
# wrong formula (GELU's tanh approximation for the exact GELU, a lost
# LayerNorm bias) is 1e3x to 1e7x above it.
PORT_FACTOR = 10.0
# The rel_rms that is always explained: 2**-20, 16 float32 units in the last
# place, for layers whose float32 noise is zero (a gather, a copy).
SLACK = 2.0 ** -20
# Pairing: a candidate whose score is within this of the best is a tie.
_TIE = 0.02

# Pins: JAX name -> PyTorch name, (JAX regex, PyTorch template) pairs, or a
# function of the two models' layer names returning the first.
AlignmentLike = (Mapping[str, str | None]
                 | Sequence[tuple[str, str | None]]
                 | Callable[[list[str], list[str]], Mapping[str, str | None]]
                 | None)
# Layouts: PyTorch layer regex -> the axes permutation taking its arrays to
# the JAX layer's layout ((0, 2, 1): NCW to NWC).
LayoutsLike = Mapping[str, Sequence[int]] | None


# ---------------------------------------------------------------------------
# Layers as both frameworks run them.


@dataclasses.dataclass(frozen=True)
class _Alone:
  """A layer as a function of its own: ``fn(state, *args, **kwargs)``, with
  the arguments of its call in the float32 run."""

  fn: Callable[..., list[Any]]
  state: Any
  args: tuple
  kwargs: dict

  def on(self, inputs: list[Any]) -> tuple[Any, tuple, dict]:
    """``(state, args, kwargs)`` with the floating array inputs, in order,
    replaced by ``inputs``."""
    args, kwargs = _substituted(self.args, self.kwargs, list(inputs))
    return self.state, args, kwargs


def run_alone(calls: Sequence[tuple[_Alone, list[Any]]],
              wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
              x64: bool = False) -> list[list[np.ndarray]]:
  """Each layer alone on the given inputs, all in one compiled program
  computed as ``wrap`` computes (float64 when ``x64``: state and inputs
  widened, in a scope that is restored)."""
  fns = [alone.fn for alone, _ in calls]

  def every(*items):
    return [f(s, *a, **k) for f, (s, a, k) in zip(fns, items)]
  items = tuple(alone.on(new) for alone, new in calls)
  with _x64(x64):
    if x64:
      items = _f64(items)
    statics, dynamic = trees.split_call(items, {})
    wrapped = wrap(every)
    out = _run_once(lambda dyn: statics.call(wrapped, dyn), dynamic)
    return [[np.asarray(v, np.float64) for v in o] for o in out]


# Each program of a port check runs once: compiled with LLVM's cheapest
# optimisations, which halves XLA:CPU's compile time for the small models a
# port check runs, without changing a result: LLVM keeps IEEE arithmetic at
# every level (XLA:CPU's fast-math is off by default).
_COMPILE_ONCE = {"xla_backend_optimization_level": 0,
                 "xla_llvm_disable_expensive_passes": True}


def _run_once(fn: Callable[[Any], Any], dynamic: Any) -> Any:
  """``jax.jit(fn)(dynamic)``, compiled for one run."""
  lowered = jax.jit(fn).lower(dynamic)
  try:
    compiled = lowered.compile(_COMPILE_ONCE)
  except Exception:  # noqa: BLE001 -- a backend without these options
    compiled = lowered.compile()
  return compiled(dynamic)


@dataclasses.dataclass
class _Layer:
  """One call of a module: its float inputs and outputs as float32 NumPy."""

  name: str
  inputs: list[np.ndarray]
  outputs: list[np.ndarray]
  alone: _Alone | None = None  # the layer alone, to run on other inputs
  # ``(output, state, ...)``, as ports that carry a cache return it: a tuple
  # whose first item is an array and whose others are not all arrays of its
  # shape (a tuple of every layer's hidden state); it pairs by that array.
  lead: bool = False
  parameterless: bool = False  # a PyTorch module holding no parameter

  @property
  def in_shapes(self) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(x.shape) for x in self.inputs)

  @property
  def out_shapes(self) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(x.shape) for x in self.outputs)


def _leads(out: Any) -> bool:
  """Whether a module's output is ``(output, state, ...)`` (see _Layer)."""
  return (isinstance(out, (tuple, list)) and len(out) > 1
          and layers_lib.is_float(out[0]) and not all(
              layers_lib.is_float(v) and v.shape == out[0].shape
              for v in out[1:]))


def _float_leaves(tree: Any) -> list[Any]:
  return [x for x in jax.tree_util.tree_leaves(tree) if layers_lib.is_float(x)]


def _numbered(names: list[str]) -> list[str]:
  """``name#0``, ``name#1`` for a name met more than once (a module called
  twice), as :func:`jaxprec.check_module` and :func:`capture` name them."""
  counts, seen = collections.Counter(names), collections.Counter()
  out = []
  for n in names:
    out.append(n if counts[n] == 1 else f"{n}#{seen[n]}")
    seen[n] += 1
  return out


def _named(paths: list[str]) -> tuple[list[str], str]:
  """The layer names of module calls by path (the root's ``''``), as
  :func:`jaxprec.check_module` names them (``#0``, ``#1`` for a module
  called twice; the root ``'output'``, or ``'(root)'`` beside a child named
  ``output``: :func:`layers_lib.root_name`), and the root's name."""
  return layers_lib.rooted(_numbered(paths)), layers_lib.root_name(paths)


def _torch_layers(model: Any, args: tuple, kwargs: dict
                  ) -> tuple[list[_Layer], str]:
  """Every submodule call of a PyTorch model that has a floating output, in
  the order the calls end (:func:`torch_ref.module_calls`: children before
  their parent, the root last), named by :func:`_named`; and the root's
  name."""
  calls = torch_ref.module_calls(model, args, kwargs, "port_check: torch_model")
  names, root = _named([c.name for c in calls])
  return [_Layer(n, c.inputs, c.outputs, parameterless=c.parameterless)
          for n, c in zip(names, calls) if c.outputs], root


def _module_calls(model: Any, run: Callable[[], Any], kind: str
                  ) -> list[tuple[str, Any, tuple, dict, Any]]:
  """``(path, module, args, kwargs, output)`` of each module call of
  ``run()`` that :func:`jaxprec.check_module` lists (of a ``kind`` model:
  :func:`layers_lib.unlisted`), as the calls end, from the one hook
  (:func:`hook.observing`; ``model``, an NNX copy, gets it); root: ``''``."""
  from jaxprec._src.flax import hook  # noqa: PLC0415
  if kind == "nnx":
    hook.install(model)
  calls: list = []

  def observer(path, module, args, kwargs, out):
    if not layers_lib.unlisted(kind, module, kwargs):
      calls.append((path, module, args, kwargs, out))
  with hook.observing(observer):
    run()
  return calls


def _x64(on: bool) -> Any:
  """64-bit types in a scope that is restored when ``on``; else nothing (a
  user's own x64 setting is left alone)."""
  return jax.enable_x64(True) if on else contextlib.nullcontext()


def _f64(tree: Any) -> Any:
  return jax.tree_util.tree_map(
      lambda x: np.asarray(x, np.float64) if layers_lib.is_float(x) else x,
      tree)


def _substituted(args: tuple, kwargs: dict, new: list[Any]) -> tuple[tuple, dict]:
  """``(args, kwargs)`` with their floating array leaves replaced, in order,
  by ``new``."""
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  it = iter(new)
  leaves = [next(it) if layers_lib.is_float(x) else x for x in leaves]
  return jax.tree_util.tree_unflatten(tree, leaves)


class JaxModel:
  """The JAX side: its layers at float32 (with a way to run each alone),
  and its layers' outputs at any row."""

  def __init__(self, jax_model: Any, inputs: tuple, kwargs: dict):
    self.kind, self._run = self._kind(jax_model)
    self.inputs, self.kwargs = inputs, kwargs
    self.model = jax_model
    # Set by layers(): the layers a float32 run gives concretely, and those
    # called inside a JAX transform (a scan, a jit), which cannot be taken out.
    self.kept: frozenset[str] | None = None
    self.inside_transforms: tuple[str, ...] = ()
    # The root's layer name (a function's outputs: 'output', none holds
    # another); set by layers() for a model.
    self.root = "output"

  @staticmethod
  def _kind(jax_model: Any) -> tuple[str, Any]:
    try:
      from flax import nnx  # noqa: PLC0415
      from flax import linen as nn  # noqa: PLC0415
    except ImportError:  # a function needs no Flax
      nnx = nn = None
    if nnx is not None and isinstance(jax_model, nnx.Module):
      # A copy: the runs move no Variable of the user's (an RNG count).
      return "nnx", nnx.split(nnx.clone(jax_model))
    torch = torch_ref.import_torch()
    if isinstance(jax_model, torch.nn.Module):
      raise TypeError(f"port_check: jax_model is a torch.nn.Module "
                      f"({type(jax_model).__name__}); the JAX model comes "
                      f"first: port_check(jax_model, torch_model, *inputs)")
    if nn is not None and isinstance(jax_model, nn.Module):
      raise TypeError("port_check: give a linen module with its variables, "
                      "as (module, variables)")
    if (nn is not None and isinstance(jax_model, tuple) and len(jax_model) == 2
        and isinstance(jax_model[0], nn.Module)):
      module, variables = jax_model
      if not isinstance(variables, Mapping):
        raise TypeError(f"port_check: (linen module, variables): the "
                        f"variables must be a dict with 'params'; got "
                        f"{type(variables).__name__}")
      return "linen", (module, variables)
    if callable(jax_model):
      return "function", jax_model
    raise TypeError(f"port_check: jax_model must be an NNX module, a (linen "
                    f"module, variables) pair or a function; got "
                    f"{type(jax_model).__name__}")

  def _calls(self, inputs: tuple, kwargs: dict, state: Any = None):
    if self.kind == "nnx":
      from flax import nnx  # noqa: PLC0415
      graphdef, own = self._run
      m = nnx.merge(graphdef, own if state is None else state)  # a new object
      return _module_calls(m, lambda: m(*inputs, **kwargs), "nnx")
    module, own = self._run
    return _module_calls(module, lambda: module.apply(
        own if state is None else state, *inputs, **kwargs), "linen")

  def _state(self) -> Any:
    return self._run[1] if self.kind in ("nnx", "linen") else None

  def outputs_fn(self) -> Callable[..., dict[str, list[Any]]]:
    """``f(state, *inputs, **kwargs) -> {layer: [float outputs]}``."""
    if self.kind == "function":
      fn = self._run

      def from_function(_state, *inputs, **kwargs):
        return {n: [v] for n, v in layers_lib.layers(fn(*inputs, **kwargs))}
      return from_function

    def from_modules(state, *inputs, **kwargs):
      calls = self._calls(inputs, kwargs, state=state)
      names, _ = _named([c[0] for c in calls])
      return {n: _float_leaves(c[4]) for n, c in zip(names, calls)
              if self.kept is None or n in self.kept}
    return from_modules

  def native_notes(self, plans: Sequence[rows_lib.Plan]) -> list[str]:
    """The ops the emulated rows run natively (``rows_lib.native_notes``)."""
    return rows_lib.native_notes(self.outputs_fn(),
                                 (self._state(), *self.inputs), self.kwargs,
                                 plans)

  def outputs(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
              x64: bool = False) -> dict[str, list[np.ndarray]]:
    """Every layer's outputs of a full run, computed as ``wrap`` computes."""
    state, inputs, kwargs = self._state(), self.inputs, self.kwargs
    with _x64(x64):
      if x64:
        state, inputs, kwargs = _f64((state, inputs, kwargs))
      # One compiled program: run eagerly, an emulated model would compile
      # each of its operations on its own.
      statics, dynamic = trees.split_call((state, *inputs), kwargs)
      fn = wrap(self.outputs_fn())
      out = _run_once(lambda dyn: statics.call(fn, dyn), dynamic)
      return {k: [np.asarray(v, np.float64) for v in vs]
              for k, vs in out.items()}

  def layers(self, f32: Callable[[Callable[..., Any]], Callable[..., Any]]
             ) -> list[_Layer]:
    """The layers of a float32 run, each with its shadow (the layer alone on
    other inputs), in the order the calls end."""
    if self.kind == "function":
      out = self.outputs(f32)
      return [_Layer(n, [], [np.asarray(v, np.float32) for v in vs])
              for n, vs in out.items()]
    with jax.default_matmul_precision("float32"):
      calls = self._calls(self.inputs, self.kwargs)
    names, self.root = _named([c[0] for c in calls])
    found, inside = [], []
    for name, (_, mod, args, kwargs, out) in zip(names, calls):
      outs = _float_leaves(out)
      if not outs:
        continue
      if any(isinstance(x, jax.core.Tracer)
             for x in [*outs, *_float_leaves((args, kwargs))]):
        inside.append(name)  # called in a transform's trace: no values
        continue
      ins = [np.asarray(x, np.float32) for x in
             _float_leaves((args, kwargs))]
      found.append(_Layer(name, ins, [np.asarray(x, np.float32) for x in outs],
                          self._alone(mod, args, kwargs), _leads(out)))
    self.kept = frozenset(l.name for l in found)
    self.inside_transforms = tuple(inside)
    return found

  def _alone(self, mod: Any, args: tuple, kwargs: dict) -> _Alone:
    """The module ``mod`` of the float32 run as a function of its own (a
    linen module inside an NNX model's ``ToNNX`` as a linen one)."""
    from flax import nnx  # noqa: PLC0415
    if isinstance(mod, nnx.Module):
      graphdef, state = nnx.split(mod)

      def alone(state, *a, **k):
        return _float_leaves(nnx.merge(graphdef, state)(*a, **k))
    else:
      unbound, state = mod.unbind()

      def alone(state, *a, **k):
        return _float_leaves(unbound.apply(state, *a, **k))
    return _Alone(alone, state, args, kwargs)


# ---------------------------------------------------------------------------
# Errors.


def rel_rms(candidate: Sequence[Any], reference: Sequence[Any]) -> float:
  """``||c - r|| / ||r||`` over all elements of the lists, in float64 (0 when
  both are zero; inf when only ``r`` is; inf on a non-finite mismatch)."""
  c = np.concatenate([np.asarray(x, np.float64).ravel() for x in candidate])
  r = np.concatenate([np.asarray(x, np.float64).ravel() for x in reference])
  bad = ~(np.isfinite(c) & np.isfinite(r))
  if bad.any():
    if not np.array_equal(c[bad], r[bad], equal_nan=True):
      return math.inf
    c, r = c[~bad], r[~bad]
  num, den = float(np.sum((c - r) ** 2)), float(np.sum(r ** 2))
  if den == 0:
    return 0.0 if num == 0 else math.inf
  return math.sqrt(num / den)


def _max_abs(candidate: Sequence[Any], reference: Sequence[Any]) -> float:
  d = [np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
       for a, b in zip(candidate, reference)]
  return float(max((x.max() for x in d if x.size), default=0.0))


# ---------------------------------------------------------------------------
# Alignment.


def _closeness(err: float) -> float:
  """An error as a score in [0, 1]: 1e-12 -> 1, 1 -> 0."""
  if not math.isfinite(err):
    return 0.0
  return min(1.0, max(0.0, -math.log10(max(err, 1e-12)) / 12))


@functools.lru_cache(maxsize=65536)
def _name_similarity(a: str, b: str) -> float:
  """How alike two names are, in [0, 1]; 1 for transformers' convention:
  ``hidden_states[i + 1]`` is the output of a list's layer ``i``
  (``layers.i``, ``encoder.layer.i``, ``h.i``)."""
  hs, item = re.fullmatch(r"hidden_states\[(\d+)\]", a), re.search(
      r"(?:^|\.)[A-Za-z_]\w*\.(\d+)$", b)
  if hs and item and int(hs[1]) == int(item[1]) + 1:
    return 1.0
  return difflib.SequenceMatcher(
      None, layers_lib.normalize(a).lower(),
      layers_lib.normalize(b).lower()).ratio()


def _fits(j: _Layer, t: _Layer, inputs: bool) -> bool:
  """Whether ``j`` may pair with ``t``: their outputs have the same shapes
  (or ``j`` returns ``(output, state, ...)`` and its output has the shape
  of ``t``'s one output), and so do their inputs when ``inputs``."""
  outs = j.out_shapes == t.out_shapes or (
      j.lead and len(t.outputs) == 1 and j.out_shapes[0] == t.out_shapes[0])
  return outs and (not inputs or j.in_shapes == t.in_shapes)


def _pins(alignment: AlignmentLike, jax_names: list[str],
          torch_names: list[str]) -> dict[str, str | None]:
  """The user's pairs, JAX name -> PyTorch name (None: leave unpaired)."""
  if alignment is None:
    return {}
  if callable(alignment) and not isinstance(alignment, Mapping):
    alignment = alignment(list(jax_names), list(torch_names))
    if not isinstance(alignment, Mapping):
      raise TypeError(f"alignment: the function must return a dict (JAX "
                      f"name -> PyTorch name); it returned "
                      f"{type(alignment).__name__}")
  pins: dict[str, str | None] = {}
  if isinstance(alignment, Mapping):
    for j, t in alignment.items():
      if j not in jax_names:
        raise ValueError(f"alignment names {j!r}, which is no layer of the "
                         f"JAX model{_closest(j, jax_names)}")
      pins[j] = t
  elif isinstance(alignment, Sequence) and not isinstance(alignment, str):
    for pair in alignment:
      if not (isinstance(pair, tuple) and len(pair) == 2):
        raise TypeError(f"alignment: each pair is (JAX regex, PyTorch name "
                        f"template or None); got {pair!r}")
      pattern, template = pair
      try:
        rx = re.compile(pattern)
      except re.error as e:
        raise ValueError(f"alignment: {pattern!r} is not a regular "
                         f"expression: {e}") from None
      hits = [(j, m) for j in jax_names if (m := rx.fullmatch(j))]
      if not hits:
        raise ValueError(f"alignment: {pattern!r} matches no layer of the "
                         f"JAX model (some: {', '.join(jax_names[:6])})")
      for j, m in hits:
        pins.setdefault(j, None if template is None else m.expand(template))
  else:
    raise TypeError(f"alignment must be a dict (JAX name -> PyTorch name), a "
                    f"list of (JAX regex, PyTorch template) pairs, a "
                    f"function returning such a dict, or None; got "
                    f"{type(alignment).__name__}")
  for j, t in pins.items():
    if t is not None and t not in torch_names:
      raise ValueError(f"alignment pairs {j!r} with {t!r}, which is no "
                       f"layer of the PyTorch model"
                       f"{_closest(t, torch_names)}")
  taken = [t for t in pins.values() if t is not None]
  twice = sorted({t for t in taken if taken.count(t) > 1})
  if twice:
    raise ValueError(f"alignment pairs {twice[0]!r} with two JAX layers")
  return pins


def _closest(name: str, names: list[str]) -> str:
  near = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
  return (f"; closest: {', '.join(map(repr, near))}" if near else
          f"; layers: {', '.join(map(repr, names[:8]))}")


def _dp(js: list[int], ts: list[int], score: Callable[[int, int], float | None]
        ) -> list[tuple[int, int]]:
  """The order-preserving pairing of ``js`` with ``ts`` of the largest total
  score (None: not a pair)."""
  n, m = len(js), len(ts)
  best = np.zeros((n + 1, m + 1))
  for a in range(1, n + 1):
    for b in range(1, m + 1):
      s = score(js[a - 1], ts[b - 1])
      best[a, b] = max(best[a - 1, b], best[a, b - 1],
                       -1.0 if s is None else best[a - 1, b - 1] + s)
  pairs = []
  a, b = n, m
  while a and b:
    s = score(js[a - 1], ts[b - 1])
    if s is not None and best[a, b] == best[a - 1, b - 1] + s:
      pairs.append((js[a - 1], ts[b - 1]))
      a, b = a - 1, b - 1
    elif best[a, b] == best[a - 1, b]:
      a -= 1
    else:
      b -= 1
  return pairs[::-1]


def align(jax_layers: list[_Layer], torch_layers: list[_Layer],
          alignment: AlignmentLike, local: Callable[[int, int], float],
          root: str = "output") -> dict[int, int]:
  """JAX layer index -> PyTorch layer index (see :func:`port_check`).

  Pairs keep the order both frameworks ran the layers in; a pair needs equal
  output shapes (and input shapes, when the JAX layers have inputs); among
  those, the pairing with the most pairs wins, then the closest float32
  outputs, then the most similar names. A JAX layer with two candidates that
  tie is decided by its local error (``local(j, t)``: it run on each
  candidate's input); a tie that remains is an error naming them. ``root``:
  the JAX root's name.
  """
  jn = [l.name for l in jax_layers]
  tn = [l.name for l in torch_layers]
  pins = _pins(alignment, jn, tn)
  inputs = any(l.inputs for l in jax_layers)
  fixed: dict[int, int] = {}
  for j, t in pins.items():
    if t is None:
      continue
    a, b = jn.index(j), tn.index(t)
    if not _fits(jax_layers[a], torch_layers[b], inputs=False):
      raise ValueError(
          f"alignment pairs {j!r} (outputs {list(jax_layers[a].out_shapes)}) "
          f"with {t!r} (outputs {list(torch_layers[b].out_shapes)}): their "
          f"shapes differ")
    fixed[a] = b
  free_j = [i for i, n in enumerate(jn) if n not in pins]
  free_t = [i for i in range(len(tn)) if i not in fixed.values()]
  close: dict[tuple[int, int], float] = {}

  def score(a: int, b: int) -> float | None:
    j, t = jax_layers[a], torch_layers[b]
    if not _fits(j, t, inputs):
      return None
    if (a, b) not in close:
      close[a, b] = _closeness(rel_rms(j.outputs[:len(t.outputs)],
                                       t.outputs))
    return 1.0 + 0.5 * close[a, b] + 0.25 * _name_similarity(j.name, t.name)

  def same(b: int, c: int) -> bool:  # no figure could tell them apart
    x, y = torch_layers[b], torch_layers[c]
    if not inputs:  # a function's outputs: only the values count
      return x.out_shapes == y.out_shapes and all(
          np.array_equal(u, v) for u, v in zip(x.outputs, y.outputs))
    return (x.out_shapes == y.out_shapes and x.in_shapes == y.in_shapes
            and all(np.array_equal(u, v) for u, v in
                    zip(x.outputs + x.inputs, y.outputs + y.inputs)))

  for attempt in range(2):
    pairs = _dp(free_j, free_t, score)
    tied = _ties(pairs, free_t, score, same)
    if not tied:
      break
    if attempt == 0:  # decide by the local error, where it can be measured
      for a, cands in tied.items():
        for b in cands:
          err = local(a, b)
          if math.isfinite(err):
            close[a, b] = _closeness(err)
      continue
    a, cands = next(iter(tied.items()))
    names = ", ".join(repr(tn[b]) for b in cands)
    # The pin suggested crosses the fewest pairs made (pins and pairs).
    made = [(x, y) for x, y in (*pairs, *fixed.items()) if x != a]
    pin = min(cands, key=lambda b: sum((x < a) != (y < b) for x, y in made))
    raise ValueError(
        f"port_check cannot pair the JAX layer {jn[a]!r}: the PyTorch layers "
        f"{names} fit it equally (same shapes, equally close at float32, "
        f"equally named); pin one with alignment={{{jn[a]!r}: {tn[pin]!r}}}")
  return {**_uncrossed(pairs, jax_layers, close, root), **fixed}


def _uncrossed(pairs: list[tuple[int, int]], jax_layers: list[_Layer],
               close: dict[tuple[int, int], float], root: str
               ) -> dict[int, int]:
  """``pairs`` with siblings called in another order than PyTorch calls
  them (``up`` before ``gate``) paired by closeness: two pairs of sibling
  JAX layers with nothing paired inside them trade partners where the
  traded pairs are closer at float32 (by more than a decade)."""
  out = dict(pairs)
  leaf = {a for a in out if not any(_inside(
      jax_layers[a].name, jax_layers[c].name, root) for c in out)}
  parent = {a: _base(jax_layers[a].name).rpartition("/")[0] for a in leaf}
  changed = True
  while changed:
    changed = False
    for a, c in itertools.combinations(sorted(leaf), 2):
      b, d = out[a], out[c]
      if (parent[a] == parent[c] and (a, d) in close and (c, b) in close
          and close[a, d] + close[c, b] > close[a, b] + close[c, d] + 1 / 12):
        out[a], out[c], changed = d, b, True
  return out


def _ties(pairs: list[tuple[int, int]], free_t: list[int],
          score: Callable[[int, int], float | None],
          same: Callable[[int, int], bool]) -> dict[int, list[int]]:
  """JAX layers whose partner has a rival as good in its order window:
  JAX index -> [partner and rivals, in PyTorch's order]. A rival with the
  partner's very inputs and outputs (an identity, a container returning its
  child's output) is none: every figure would be the same."""
  used = {b for _, b in pairs}
  out: dict[int, list[int]] = {}
  for k, (a, b) in enumerate(pairs):
    lo = pairs[k - 1][1] if k else -1
    hi = pairs[k + 1][1] if k + 1 < len(pairs) else math.inf
    s = score(a, b)
    rivals = [c for c in free_t if lo < c < hi and c != b and c not in used
              and (r := score(a, c)) is not None and r >= s - _TIE
              and not same(b, c)]
    if rivals:
      out[a] = sorted([b, *rivals])
  return out


# ---------------------------------------------------------------------------
# The report.


@dataclasses.dataclass(frozen=True)
class PortLayer:
  """One paired layer of a :class:`PortReport`; errors are ``rel_rms``
  (``||jax - ref|| / ||ref||`` over the layer's floating outputs).

  Attributes:
    name: the JAX layer (module path, as :func:`jaxprec.check_module` names
      it; a function's output by its pytree path).
    torch_name: the PyTorch module it is paired with (the root:
      ``'output'``, or ``'(root)'`` beside a submodule named ``output``).
    shape: the shape of its (first) output.
    floor: float32 JAX against float32 PyTorch, local (the layer on
      PyTorch's input); NaN where the layer cannot run alone (a function's
      output).
    noise: float32 JAX against float64 JAX on the same input: what float32
      rounding alone makes in the layer (propagated for a function's output).
    envelope: per row, the row against float32 JAX on the same input.
    local: per row, the layer at the row on PyTorch's input against
      PyTorch's output (NaN where it cannot run alone).
    local_max_abs: per row, the largest absolute local error.
    propagated: per row, the full JAX run at the row against PyTorch.
    bound: per row, what explains the error: ``factor * (noise +
      envelope) + SLACK``.
    verdict: per row, ``'ok'`` (explained), ``'SUSPECT'``, ``'inside'``
      (not explained, but a suspect inside the module explains it) or
      ``'after'`` (a function's output after an unexplained one).
    unpaired_inside: JAX layers inside this module that have no PyTorch
      partner (a suspect's bug may be in one of them).
  """

  name: str
  torch_name: str
  shape: tuple[int, ...]
  floor: float
  noise: float
  envelope: dict[str, float]
  local: dict[str, float]
  local_max_abs: dict[str, float]
  propagated: dict[str, float]
  bound: dict[str, float]
  verdict: dict[str, str]
  unpaired_inside: tuple[str, ...] = ()

  def error(self, precision: str) -> float:
    """The error the verdict judges: local, else propagated."""
    x = self.local[precision]
    return self.propagated[precision] if math.isnan(x) else x

  def to_dict(self) -> dict[str, Any]:
    return render.encode(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class PortReport(render.Report):
  """What :func:`jaxprec.torch.port_check` found.

  Attributes:
    layers: one :class:`PortLayer` per paired layer, in the order the JAX
      layers ran (children before their parent).
    alignment: JAX layer -> PyTorch layer, the pairing used.
    unpaired_jax, unpaired_torch: the layers without a partner, in order.
    parameterless_torch: those of ``unpaired_torch`` that hold no
      parameter, their children's included (activations, dropout,
      identities): the table counts them unless ``full``.
    precisions: the rows; the floor is float32 whatever they are.
    target: whose numerics the rows show (``'tpu'`` or ``'gpu'``).
    numerics: row -> what it computes (``'bf16x1 (emulated)'``).
    factor: the factor of the suspect rule.
    kind: the JAX side's program: ``'nnx'``, ``'linen'`` or ``'function'``
      (``"program"`` in :meth:`to_dict`, whose ``"kind"`` is ``"port"``,
      the report's).
    notes: what the user should know (layers that could not run alone).
    logits: per row, the :class:`jaxprec.torch.LogitsGates` of the layer
      ``logits_layer`` (the full JAX run at the row against PyTorch), when
      ``port_check`` was given ``logits=``; else empty.
    logits_layer: the JAX layer holding the logits, or None.
    unpaired_suspects: per row, the unpaired JAX layers that hold a jump of
      the propagated error no paired layer explains (a note says where).
  """

  layers: tuple[PortLayer, ...]
  alignment: dict[str, str]
  unpaired_jax: tuple[str, ...]
  unpaired_torch: tuple[str, ...]
  precisions: tuple[str, ...]
  target: str
  numerics: dict[str, str]
  factor: float
  kind: str
  notes: tuple[str, ...] = ()
  logits: dict[str, logits_lib.LogitsGates] = dataclasses.field(
      default_factory=dict)
  logits_layer: str | None = None
  unpaired_suspects: dict[str, tuple[str, ...]] = dataclasses.field(
      default_factory=dict)
  parameterless_torch: tuple[str, ...] = ()

  def layer(self, name: str) -> PortLayer:
    """The paired layer named ``name`` (its JAX name)."""
    for l in self.layers:
      if l.name == name:
        return l
    raise KeyError(f"no paired layer {name!r}{_closest(name, [l.name for l in self.layers])}")

  def _row(self, precision: str) -> str:
    if precision not in self.precisions:
      raise ValueError(f"{precision!r} is not a row of this report; rows: "
                       f"{', '.join(self.precisions)}")
    return precision

  def suspects(self, precision: str | None = None) -> list[str]:
    """The suspect layers at a row (None: at any row), in execution order,
    innermost first: layers whose local error the floor noise and the
    precision's envelope do not explain while every paired layer inside them
    is explained; then the unpaired layers holding a jump of the propagated
    error that no paired layer explains.

    Examples:
      A report built by hand (``port_check`` builds them):

      >>> from jaxprec._src.checker.port_check import PortReport
      >>> r = PortReport(layers=(), alignment={}, unpaired_jax=(),
      ...                unpaired_torch=(), precisions=("float32",),
      ...                target="tpu", numerics={}, factor=10.0, kind="nnx")
      >>> r.suspects("float32")
      []
    """
    rows = self.precisions if precision is None else (self._row(precision),)
    return list(dict.fromkeys(
        [l.name for l in self.layers
         if any(l.verdict[p] == "SUSPECT" for p in rows)]
        + [n for p in rows for n in self.unpaired_suspects.get(p, ())]))

  KIND = "port"

  def _fields(self) -> dict[str, Any]:
    """Everything (:meth:`to_dict`: ``{"schema": 2, "kind": "port",
    "program": "nnx", ...}``)."""
    return {
        "program": self.kind, "target": self.target,
        "precisions": list(self.precisions), "numerics": self.numerics,
        "factor": self.factor, "slack": SLACK,
        "suspects": {p: self.suspects(p) for p in self.precisions},
        "alignment": self.alignment,
        "unpaired_jax": list(self.unpaired_jax),
        "unpaired_torch": list(self.unpaired_torch),
        "parameterless_torch": list(self.parameterless_torch),
        "layers": [dataclasses.asdict(l) for l in self.layers],
        "logits_layer": self.logits_layer,
        "logits": {p: g.to_dict() for p, g in self.logits.items()},
        "notes": list(self.notes)}

  def _heading(self) -> str:
    return (f"port check ({self.kind}), target {self.target}: "
            + "; ".join(f"{p} = {self.numerics.get(p, p)}"
                        for p in self.precisions))

  def _closing(self, full: bool) -> list[str]:
    """The lines under the table: suspects, the rule, the logits gates, the
    unpaired layers, the notes (one paragraph each)."""
    def names(ns):
      return ", ".join(map(render.escaped, ns))
    out = [f"suspects at {p}: {names(s) if (s := self.suspects(p)) else 'none'}"
           for p in self.precisions]
    out.append(f"suspect: local error > {self.factor:g} x (noise + "
               f"envelope) + 2^-20 while every paired layer inside is "
               f"within it (errors are rel_rms)")
    out += [f"logits ({self.logits_layer}) at {p}: KL mean "
            f"{render.fmt(g.kl_mean)}, max {render.fmt(g.kl_max)}; "
            f"top-1 agreement {g.top1_agreement:.1%}, top-{g.k} "
            f"overlap {g.topk_overlap:.1%}; max |logprob diff| "
            f"{render.fmt(g.max_logprob_diff)}"
            for p, g in self.logits.items()]
    if self.unpaired_jax:
      out.append("JAX layers without a PyTorch partner: "
                 + names(self.unpaired_jax))
    bare = () if full else self.parameterless_torch
    listed = [n for n in self.unpaired_torch if n not in bare]
    if listed or bare:
      out.append(
          "PyTorch layers without a JAX partner: " + names(listed)
          + ("" if not bare else
             f"{'; and ' if listed else ''}{len(bare)} without parameters "
             f"(activations, dropout, identities; full=True or --full "
             f"lists them)"))
    return out + [f"note: {n}" for n in self.notes]

  def _document(self, full: bool = False) -> render.Document:
    """A line per layer and row: the floor, the noise, the envelope, the
    local and propagated errors (``rel_rms``) and the verdict; the PyTorch
    layer under a JAX name unlike it (``↳ blocks.1.fc1``). Then the
    suspects and the unpaired layers (``full``: every one of them)."""
    rows = []
    for l in self.layers:
      name = render.escaped(l.name)
      if layers_lib.normalize(l.name) != layers_lib.normalize(l.torch_name):
        name += f"\n↳ {render.escaped(l.torch_name)}"
      for i, p in enumerate(self.precisions):
        rows.append((name if i == 0 else "", p,
                     render.fmt(l.floor) if i == 0 else "",
                     render.fmt(l.noise) if i == 0 else "",
                     render.fmt(l.envelope[p]), render.fmt(l.local[p]),
                     render.fmt(l.propagated[p]), l.verdict[p]))
    return render.Document(
        heading=(self._heading(),),
        parts=(render.Table(
            cols=("layer", "row", "floor", "noise", "envelope", "local",
                  "propagated", "verdict"),
            rows=tuple(rows), left=frozenset({0, 1, 7}), keys=2,
            drop=frozenset({3}), mark="SUSPECT"), *self._closing(full)))

  def plot(self, path: Any = None) -> Any:
    """One panel per row: each paired layer's local error (dots, ``x`` for a
    suspect) and propagated error (a line), over two bands: the noise band
    (up to ``factor x noise``, what float32 explains) and the precision band
    (up to the bound, what float32 and the row's envelope explain); log
    scale, layers in execution order.

    Args:
      path: where to save the figure; None only returns it.

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ImportError: matplotlib is not installed (the ``plots`` extra).
    """
    Figure = render.figure_class("PortReport.plot")
    n = len(self.precisions)
    fig = Figure(figsize=(max(6.0, 0.35 * len(self.layers) + 2), 3.2 * n),
                 layout="constrained")
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    xs = list(range(len(self.layers)))
    tiny = SLACK / 10

    def pos(v: float) -> float:
      return v if math.isfinite(v) and v > 0 else tiny

    for ax, p in zip(axes, self.precisions):
      noise = [pos(self.factor * (0 if math.isnan(l.noise) else l.noise)
                   + SLACK) for l in self.layers]
      bound = [pos(l.bound[p]) for l in self.layers]
      ax.fill_between(xs, tiny, noise, step="mid", alpha=0.25,
                      color="tab:green", label="explained by float32 noise")
      if any(b > n for b, n in zip(bound, noise)):
        # A row with no envelope (float32 against float32) has no band.
        ax.fill_between(xs, noise, bound, step="mid", alpha=0.2,
                        color="tab:blue", label=f"explained by {p}'s envelope")
      ax.plot(xs, [pos(l.propagated[p]) for l in self.layers], color="gray",
              lw=1, label="propagated")
      local = [pos(l.error(p)) for l in self.layers]
      bad = [l.verdict[p] == "SUSPECT" for l in self.layers]
      ax.scatter([x for x, b in zip(xs, bad) if not b],
                 [y for y, b in zip(local, bad) if not b], s=14,
                 color="black", label="local", zorder=3)
      if any(bad):
        ax.scatter([x for x, b in zip(xs, bad) if b],
                   [y for y, b in zip(local, bad) if b], s=60, marker="x",
                   color="tab:red", label="suspect", zorder=4)
      ax.set_yscale("log")
      ax.set_ylabel("rel_rms")
      ax.set_title(f"{p}: {self.numerics.get(p, p)}", fontsize=9)
      ax.set_xticks(xs)
      ax.set_xticklabels(render.tick_labels([l.name for l in self.layers]),
                         rotation=90, fontsize=7)
      ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if path is not None:
      render.save(fig, path)
    return fig


# ---------------------------------------------------------------------------
# The check.


def port_check(jax_model: Any, torch_model: Any, *inputs: Any,
               precisions: Sequence[str] | str = ("float32", "bfloat16"),
               target: str = "tpu", alignment: AlignmentLike = None,
               torch_inputs: Sequence[Any] | None = None,
               kwargs: Mapping[str, Any] | None = None,
               torch_kwargs: Mapping[str, Any] | None = None,
               factor: float = PORT_FACTOR, logits: str | None = None,
               top_k: int | None = None, layouts: LayoutsLike = None,
               progress: bool = False) -> PortReport:
  """Is a JAX port of a PyTorch model wrong, or is it precision? Which layer?

  Runs both models on the same inputs, pairs their layers, and measures for
  every pair and row the local error (the JAX layer on the PyTorch layer's
  own input, against the PyTorch layer's output), the propagated error (the
  full JAX run against PyTorch), the floor (float32 JAX against float32
  PyTorch, local), the noise (float32 against float64 JAX on the same input)
  and the envelope (the row against float32 JAX on the same input, emulated
  on ``target``). A layer whose local error exceeds ``factor * (noise +
  envelope) + SLACK`` (``rel_rms``, ``SLACK = 2**-20``) while every paired
  layer inside it is within that bound is a *suspect*: the bug is in its
  own code, between its children. Neither model nor the inputs are changed.

  Pairing, without hand-written names: the JAX layers (every module call, in
  the order the calls end, named as :func:`jaxprec.check_module` names
  them) and the PyTorch ones (every ``forward`` call, in forward-hook
  order) are paired in that order, a pair needing equal output and input
  shapes (a JAX layer returning ``(output, state, ...)`` pairs by its
  output); among pairings with the most pairs, the one whose float32
  outputs are closest, then whose names are most alike (``hidden_states[i +
  1]`` is ``layers.i``), wins, and siblings called in another order than
  PyTorch's trade partners where that makes both closer. Two candidates
  that tie are decided by the local error; if they still tie, the call is
  refused naming them. ``report.alignment`` shows the pairing,
  ``unpaired_jax`` and ``unpaired_torch`` the layers left out.

  Args:
    jax_model: an ``nnx.Module``, a ``(linen module, variables)`` pair, or a
      function returning its hidden states as a pytree (then only
      propagated errors are measured, and the suspect is the first output
      not explained after one that is).
    torch_model: the ``torch.nn.Module`` it ports (run in eval mode under
      ``no_grad``; every submodule's training flag is restored).
    *inputs: arrays (NumPy, JAX or PyTorch), given to both models (as
      NumPy to JAX, as tensors to PyTorch); float64 ones as float32.
    precisions: the rows (any name :func:`jaxprec.check` accepts;
      ``'float32'`` is the floor).
    target: ``'tpu'`` or ``'gpu'``: whose numerics the rows show.
    alignment: pins: a dict JAX name -> PyTorch name (None: leave the JAX
      layer unpaired), or a list of ``(JAX regex, PyTorch template)`` pairs
      (the template expanded with the match: ``(r"blocks/(\\d+)",
      r"layers.\\1")``), or a function taking the JAX and the PyTorch
      layer names (lists, in the order the calls end) and returning such a
      dict. The other layers are paired automatically.
    torch_inputs: PyTorch's positional arguments when their layout differs
      from the JAX model's (``inputs`` then go to JAX only).
    kwargs, torch_kwargs: keyword arguments for the JAX model and for
      PyTorch (``torch_kwargs`` default: ``kwargs``).
    factor: the factor of the suspect rule (default :data:`PORT_FACTOR`).
    logits: for a language model, the JAX layer whose output is the logits
      (``'lm_head'``; it must be paired): the report's ``logits`` then
      holds, per row, the KL divergence of the output distributions, the
      top-1 agreement, the top-``top_k`` overlap and the largest
      log-probability difference of the full JAX run against PyTorch
      (:func:`jaxprec.torch.logits_gates`).
    top_k: the k of the top-k overlap (default: 5, or the vocabulary size
      where it is smaller, as :func:`jaxprec.check`).
    layouts: PyTorch layer name (a regular expression, matched in full) ->
      the axes permutation taking that layer's arrays to the JAX layer's
      layout, e.g. ``{r"features\\.\\d+": (0, 2, 1)}`` for a convolution
      that runs NCW in PyTorch and NWC in JAX. It permutes the layer's
      floating inputs and outputs with as many axes as it has (others are
      left as they are) before the layers are paired and compared.
    progress: say each phase on stderr (the runs of each row, the layers
      alone at each row): a bar on a terminal, a line per phase elsewhere.

  Returns:
    A :class:`PortReport`.

  Raises:
    TypeError: a model of the wrong kind; a bad ``alignment`` or
      ``layouts``.
    ValueError: an unknown precision or target; a pin naming no layer; two
      PyTorch layers that fit a JAX layer equally (naming them); no pair; a
      ``layouts`` pattern matching no PyTorch layer, a permutation that is
      none (of integers ``0 .. n-1``) or whose length no array of the
      layers its pattern matches has.
    ImportError: PyTorch is not installed.
  """
  setting = rows_lib.setting(target)
  target, mode = setting.target, setting.mode
  if not (isinstance(factor, (int, float)) and not isinstance(factor, bool)
          and math.isfinite(factor) and factor >= 1):
    raise ValueError(f"factor must be a finite number >= 1; got {factor!r}")
  plans = rows_lib.plans(precisions, setting)
  plans = [rows_lib.native_float32(p.label) if p.label == rows_lib.FLOOR
           else p for p in plans]
  # Phases: PyTorch, JAX, the pairing, full runs, layers alone (2 + rows).
  rows = sum(1 for p in plans
             if not (p.label == rows_lib.FLOOR and p.emulate_target is None))
  with progress_lib.Phases(6 + 2 * rows, "jaxprec port check",
                           progress) as bar:
    report = _port_check(
        jax_model, torch_model, inputs, plans, bar, target=target,
        alignment=alignment, torch_inputs=torch_inputs, kwargs=kwargs,
        torch_kwargs=torch_kwargs, factor=factor, logits=logits, top_k=top_k,
        layouts=layouts)
    bar.finish()
  return report


def _port_check(jax_model: Any, torch_model: Any, inputs: tuple,
                plans: list[rows_lib.Plan], bar: progress_lib.Phases, *,
                target: str, alignment: AlignmentLike, torch_inputs: Any,
                kwargs: Any, torch_kwargs: Any, factor: float,
                logits: str | None, top_k: int | None,
                layouts: LayoutsLike) -> PortReport:
  """:func:`port_check` of the rows ``plans``, its phases shown on ``bar``."""
  f32 = rows_lib.native_float32().wrap
  bar.update("running PyTorch")
  inputs, torch_inputs, kwargs, torch_kwargs = _host_inputs(
      (inputs, torch_inputs, kwargs, torch_kwargs))
  kwargs = dict(kwargs or {})
  torch_kwargs = dict(kwargs if torch_kwargs is None else torch_kwargs)
  jax_side = JaxModel(jax_model, inputs, kwargs)
  torch_layers, torch_root = _torch_layers(
      torch_model, tuple(inputs if torch_inputs is None else torch_inputs),
      torch_kwargs)
  torch_layers = _laid_out(torch_layers, layouts)
  if jax_side.kind == "function":  # the root's outputs by name, last
    root = next((l for l in torch_layers if l.name == torch_root), None)
    torch_layers = [l for l in torch_layers if l.name != torch_root]
    if root is not None:
      torch_layers += _root_layers(torch_model, inputs, torch_inputs,
                                   torch_kwargs, torch_root)
  bar.update(f"running JAX at float32 ({len(torch_layers)} PyTorch layers)",
             advance=1)
  jax_layers = jax_side.layers(f32)
  root = next((l for l in jax_layers if l.name == jax_side.root), None)
  if torch_inputs is not None and root is not None:
    # torch_inputs are the inputs in PyTorch's layout: the JAX model's own
    # inputs are its root's, which may have the same shapes (channels as
    # many as time steps) and yet another layout.
    torch_layers = [dataclasses.replace(l, inputs=root.inputs)
                    if l.name == torch_root else l for l in torch_layers]
  notes: list[str] = _non_finite_input_notes(
      (inputs, kwargs) if torch_inputs is None
      else (inputs, kwargs, torch_inputs, torch_kwargs))
  if jax_side.inside_transforms:
    notes.append(
        f"not checked: {', '.join(jax_side.inside_transforms)}, called inside "
        f"a JAX transform (a scan, a jit, a remat), whose values a port check "
        f"cannot take out; the module that calls the transform is checked")

  def local(a: int, b: int) -> float:  # to decide a tie
    alone = jax_layers[a].alone
    if alone is None:
      return math.nan
    try:
      y, = run_alone([(alone, torch_layers[b].inputs)], f32)
    except Exception:  # noqa: BLE001 -- the layer cannot take that input
      return math.nan
    return rel_rms(y[:len(torch_layers[b].outputs)], torch_layers[b].outputs)

  bar.update(f"pairing {len(jax_layers)} JAX layers with "
             f"{len(torch_layers)} PyTorch layers", advance=1)
  pairs = align(jax_layers, torch_layers, alignment, local, jax_side.root)
  if not pairs:
    raise ValueError(
        f"port_check paired no layer: the JAX layers "
        f"({', '.join(l.name for l in jax_layers[:6])}) and the PyTorch "
        f"layers ({', '.join(l.name for l in torch_layers[:6])}) have no "
        f"output and input shapes in common; pin pairs with alignment=")
  bar.update("full run at float32", advance=1)
  full_f32 = jax_side.outputs(f32)
  full = {}
  for i, p in enumerate(plans, 1):
    native = p.label == rows_lib.FLOOR and p.emulate_target is None
    if not native:
      bar.update(f"full run at {p.label} (row {i}/{len(plans)})", advance=1)
    full[p.label] = full_f32 if native else jax_side.outputs(p.wrap)
  full_f64 = None
  if jax_side.kind == "function":
    bar.update("full run at float64")
    full_f64 = jax_side.outputs(lambda f: f, x64=True)
  shadowed = [a for a in sorted(pairs) if jax_layers[a].alone is not None]
  runs = {"float32": (f32, False), "float64": (lambda f: f, True),
          **{p.label: (p.wrap, False) for p in plans
             if not (p.label == rows_lib.FLOOR and p.emulate_target is None)}}
  alone = {}
  for i, (key, (wrap, x64)) in enumerate(runs.items(), 1):
    bar.update(f"{len(shadowed)} layers alone at {key} ({i}/{len(runs)})",
               advance=1)
    alone[key] = _alone_all(shadowed, jax_layers, torch_layers, pairs, wrap,
                            x64, key, notes, bar)
  for a, b in pairs.items():
    j, n = jax_layers[a], len(torch_layers[b].outputs)
    if len(j.outputs) > n:  # (output, state, ...): its output is compared
      notes.append(
          f"{j.name} returns {len(j.outputs)} floating arrays where "
          f"{torch_layers[b].name} returns one: the first, its output, is "
          f"compared; the other {len(j.outputs) - 1} (of shapes "
          f"{', '.join(map(str, sorted(set(j.out_shapes[1:]))))}) are taken "
          f"as state (a cache) and not compared")
      for out in alone.values():
        if a in out:
          out[a] = out[a][:n]
      for out in (*full.values(), full_f32):
        out[j.name] = out[j.name][:n]
  if jax_side.kind == "function":  # its outputs: the whole function's
    order = [jax_layers[a].name for a in sorted(pairs)]
    whole = jax_side.outputs_fn()
    call = _Alone(lambda *x, **k: [v for n in order for v in whole(*x, **k)[n]],
                  None, jax_side.inputs, jax_side.kwargs)
    ins = _float_leaves((jax_side.inputs, jax_side.kwargs))
    calls = {a: (call, ins, slice(k, k + 1))
             for k, a in enumerate(sorted(pairs))}
    ys = [{a: f[jax_layers[a].name] for a in pairs}
          for f in (full_f32, full_f64)]
  else:
    calls = {a: (jax_layers[a].alone, torch_layers[pairs[a]].inputs,
                 slice(len(torch_layers[pairs[a]].outputs))) for a in shadowed}
    ys = [alone["float32"], alone["float64"]]
  guessed = _unmeasured_noise(calls, *ys, [l.name for l in jax_layers], f32,
                              notes)
  results = []
  for a in sorted(pairs):
    b = pairs[a]
    j, t = jax_layers[a], torch_layers[b]
    y32 = alone["float32"].get(a)
    floor = math.nan if y32 is None else rel_rms(y32, t.outputs)
    n32, n64 = (y.get(a) for y in ys)
    noise = guessed.get(a, math.nan if n32 is None or n64 is None
                        else rel_rms(n32, n64))
    env, loc, loc_abs, prop, bound = {}, {}, {}, {}, {}
    for p in plans:
      prop[p.label] = rel_rms(full[p.label][j.name], t.outputs)
      if y32 is not None:
        y = alone.get(p.label, alone["float32"]).get(a, y32)
        env[p.label] = rel_rms(y, y32)
        loc[p.label] = rel_rms(y, t.outputs)
        loc_abs[p.label] = _max_abs(y, t.outputs)
      else:
        env[p.label] = rel_rms(full[p.label][j.name], full_f32[j.name])
        loc[p.label] = loc_abs[p.label] = math.nan
      bound[p.label] = factor * ((0.0 if math.isnan(noise) else noise)
                                 + env[p.label]) + SLACK
    results.append(dict(
        name=j.name, torch_name=t.name, shape=j.out_shapes[0], floor=floor,
        noise=noise, envelope=env, local=loc, local_max_abs=loc_abs,
        propagated=prop, bound=bound))
  compared = {jax_layers[a].name: torch_layers[b].outputs
              for a, b in pairs.items()}
  notes += render.empty_notes(
      [(r["name"], r["shape"]) for r in results
       if not sum(np.size(y) for y in compared[r["name"]])],
      "no error is counted there, and such a layer is never a suspect")
  notes += jax_side.native_notes(plans)
  notes += _non_finite_notes(
      [(jax_layers[a].name, torch_layers[pairs[a]].name) for a in sorted(pairs)],
      full_f32, {l.name: l.outputs for l in torch_layers})
  gates: dict[str, logits_lib.LogitsGates] = {}
  if logits is not None:
    where = {jax_layers[a].name: b for a, b in pairs.items()}
    if logits not in where:
      raise ValueError(f"logits={logits!r} is no paired JAX layer"
                       f"{_closest(logits, sorted(where))}")
    ref = torch_layers[where[logits]].outputs[0]
    k = top_k if top_k is not None else min(5, max(np.shape(ref)[-1:] or (5,)))
    gates = {p.label: logits_lib.logits_gates(full[p.label][logits][0], ref,
                                              k=k) for p in plans}
  notes += _weights_differ(results, [jax_layers[a] for a in sorted(pairs)])
  paired_names = {jax_layers[a].name for a in pairs}
  layers, held = _verdicts(
      results, [p.label for p in plans], jax_side.kind,
      [l.name for l in jax_layers], paired_names, factor, notes,
      jax_side.root)
  return PortReport(
      layers=tuple(layers),
      alignment={jax_layers[a].name: torch_layers[pairs[a]].name
                 for a in sorted(pairs)},
      unpaired_jax=tuple(l.name for l in jax_layers
                         if l.name not in paired_names),
      unpaired_torch=tuple(torch_layers[b].name
                           for b in range(len(torch_layers))
                           if b not in set(pairs.values())),
      parameterless_torch=tuple(
          l.name for b, l in enumerate(torch_layers)
          if l.parameterless and b not in set(pairs.values())),
      precisions=tuple(p.label for p in plans), target=target,
      numerics={p.label: p.description for p in plans}, factor=float(factor),
      kind=jax_side.kind, notes=tuple(dict.fromkeys(notes)),
      logits=gates, logits_layer=logits, unpaired_suspects=held)


def _unmeasured_noise(calls: Mapping[int, tuple[_Alone, list[Any], slice]],
                      y32: Mapping[int, list[np.ndarray]],
                      y64: Mapping[int, list[np.ndarray]], names: list[str],
                      f32, notes: list[str]) -> dict[int, float]:
  """JAX layer index -> its float32 noise, estimated where float64 cannot
  measure it: the layer's float64 outputs ``y64`` equal its float32 ones
  ``y32`` bit for bit (it computes in float32 whatever its inputs' type),
  and not every output value is one of its inputs' or weights' (a lookup, a
  copy: noise 0). The estimate: half of how far its float32 output moves
  when its inputs and weights move by one unit in the last place (a
  rounding moves a value by half a unit at most), and at least ``2**-24``.
  ``calls[a]`` is ``(call, inputs, at)``: layer ``a``'s outputs are the
  outputs ``[at]`` of ``call`` on ``inputs`` (the layer alone on its
  partner's input; a function's outputs, the whole function on its
  arguments)."""
  def selects(a: int) -> bool:
    call, ins, _ = calls[a]
    pool = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in (
        *ins, *_float_leaves(call.state), np.zeros(1))])
    return all(np.isin(np.asarray(y, np.float32), pool).all() for y in y32[a])
  same = [a for a in calls if a in y32 and a in y64 and all(
      np.array_equal(u, v) for u, v in zip(y32[a], y64[a])) and not selects(a)]
  if not same:
    return {}
  rng = np.random.default_rng(0)

  def ulp(x: Any) -> Any:
    if not layers_lib.is_float(x):
      return x
    x = np.asarray(x, np.float32)
    return np.where(rng.random(x.shape) < 0.5, np.nextafter(x, np.inf),
                    np.nextafter(x, -np.inf)).astype(np.float32)
  runs = {id(calls[a][0]): calls[a][:2] for a in same}  # a function: one
  try:
    moved = dict(zip(runs, run_alone([(dataclasses.replace(
        call, state=jax.tree_util.tree_map(ulp, call.state)),
        [ulp(x) for x in ins]) for call, ins in runs.values()], f32)))
  except Exception:  # noqa: BLE001 -- a layer that cannot run so: as measured
    return {}
  notes.append(
      f"the float32 noise of {', '.join(names[a] for a in same)} cannot be "
      f"measured: their float64 run equals their float32 run bit for bit "
      f"(they compute in float32 whatever their inputs' type: a dtype "
      f"policy, an astype(float32)); it is estimated as half of how far "
      f"their float32 output moves when their inputs and weights (a "
      f"function's: its arguments) move by one unit in the last place")
  return {a: max(rel_rms(moved[id(calls[a][0])][calls[a][2]], y32[a]) / 2,
                 2.0 ** -24) for a in same}


def _weights_differ(results: list[dict], layers: list[_Layer]) -> list[str]:
  """The note saying that the models hold other weights: more than half the
  layers with weights are off by an error of order 1 on PyTorch's input."""
  weighted = [r["floor"] for r, l in zip(results, layers)
              if l.alone is not None and _float_leaves(l.alone.state)]
  far = [x for x in weighted if x > 0.1]
  if len(weighted) < 2 or 2 * len(far) <= len(weighted):
    return []
  return [f"the weights differ: {len(far)} of {len(weighted)} layers with "
          f"weights are off by {min(far):.2g} to {max(far):.2g} (rel_rms) at "
          f"float32 on PyTorch's own inputs, as models with other weights "
          f"are, not a port with one bug; build both from the same weights "
          f"(copy the PyTorch model's state_dict into the JAX model)"]


def _non_finite_notes(pairs: list[tuple[str, str]],
                      jax_f32: dict[str, list[np.ndarray]],
                      torch_f32: dict[str, list[np.ndarray]]) -> list[str]:
  """Notes naming the first paired layer whose float32 outputs are not
  finite, on each side: an overflow (or a NaN) there makes the errors of the
  layers at and after it say more about float32's range than the port."""
  def first(side: dict[str, list[np.ndarray]], key: int) -> str | None:
    return next((p[key] for p in pairs if p[key] in side and not all(
        np.isfinite(v).all() for v in side[p[key]])), None)
  out = []
  for who, at in (("JAX", first(jax_f32, 0)), ("PyTorch", first(torch_f32, 1))):
    if at is not None:
      out.append(f"{who}'s float32 output of {at} is not finite (inf or NaN: "
                 f"a float32 overflow?): the errors there and after it "
                 f"compare non-finite values, and their verdicts say more "
                 f"about float32's range than about the port")
  return out


def _non_finite_input_notes(tree: Any) -> list[str]:
  """The note saying that the inputs hold NaN or inf: every layer then
  compares non-finite values, and no verdict of the check means anything."""
  bad = total = 0
  for x in jax.tree_util.tree_leaves(tree):
    if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating):
      bad += int((~np.isfinite(x)).sum())
      total += x.size
  if not bad:
    return []
  return [f"the inputs hold NaN or inf ({bad} of {total} floating-point "
          f"values): every layer computes from them, so the errors compare "
          f"non-finite values and no verdict below says anything about the "
          f"port; give finite inputs"]


def _host_inputs(tree: Any) -> Any:
  """The array leaves of the inputs as NumPy, for both models: a tensor or a
  JAX array as a NumPy copy, float64 as float32 (the floor's precision; JAX
  runs float32 without x64, and PyTorch's float32 weights refuse float64)."""
  torch = torch_ref.import_torch()

  def one(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
      x = torch_ref._to_numpy(x)  # noqa: SLF001 -- one conversion of tensors
    elif isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      x = np.asarray(x)
    if isinstance(x, np.ndarray) and x.dtype == np.float64:
      x = x.astype(np.float32)
    return x
  return jax.tree_util.tree_map(one, tree)


def _alone_all(which: list[int], jax_layers: list[_Layer],
               torch_layers: list[_Layer], pairs: dict[int, int], wrap,
               x64: bool, key: str, notes: list[str],
               bar: progress_lib.Phases) -> dict[int, list[np.ndarray]]:
  """JAX layer index -> its outputs alone on its partner's input, computed
  as ``wrap`` computes: all in one program, else one by one (a layer that
  fails is left out, and named in ``notes``; each shown on ``bar``)."""
  calls = [(jax_layers[a].alone, torch_layers[pairs[a]].inputs) for a in which]
  try:
    return dict(zip(which, run_alone(calls, wrap, x64)))
  except Exception:  # noqa: BLE001 -- find the layer, below
    pass
  out = {}
  for k, (a, call) in enumerate(zip(which, calls), 1):
    bar.update(f"layer {k}/{len(which)} alone at {key}: {jax_layers[a].name}")
    try:
      out[a], = run_alone([call], wrap, x64)
    except Exception as e:  # noqa: BLE001 -- said in the report
      notes.append(f"{jax_layers[a].name} could not run alone on the input "
                   f"of {torch_layers[pairs[a]].name} ({key}): "
                   f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
  return out


def _laid_out(torch_layers: list[_Layer], layouts: LayoutsLike
              ) -> list[_Layer]:
  """``torch_layers`` with each array of a layer ``layouts`` names
  permuted (those with as many axes as the permutation)."""
  if layouts is None:
    return torch_layers
  if not isinstance(layouts, Mapping):
    raise TypeError(f"layouts must be a dict (PyTorch layer regex -> axes "
                    f"permutation) or None; got {type(layouts).__name__}")
  rules = []
  for pattern, perm in layouts.items():
    try:
      rx = re.compile(pattern)
    except (re.error, TypeError) as e:
      raise ValueError(f"layouts: {pattern!r} is not a regular expression: "
                       f"{e}") from None
    axes = _axes(perm)
    if axes is None:
      raise ValueError(f"layouts[{pattern!r}] = {perm!r} is no axes "
                       f"permutation (e.g. (0, 2, 1): NCW to NWC)")
    matched = [l for l in torch_layers if rx.fullmatch(l.name)]
    if not matched:
      names = [l.name for l in torch_layers]
      raise ValueError(f"layouts: {pattern!r} matches no layer of the "
                       f"PyTorch model{_closest(pattern, names)}")
    ranks = sorted({x.ndim for l in matched for x in (*l.inputs, *l.outputs)})
    if len(axes) not in ranks:
      raise ValueError(
          f"layouts[{pattern!r}] = {perm!r} permutes arrays of {len(axes)} "
          f"axes; the arrays of the layers it matches "
          f"({', '.join(repr(l.name) for l in matched[:3])}"
          f"{', ...' if len(matched) > 3 else ''}) have "
          f"{' or '.join(map(str, ranks)) or 'no'} axes")
    rules.append((rx, axes))

  def permuted(xs: list[np.ndarray], perm: tuple[int, ...]):
    return [np.transpose(x, perm) if x.ndim == len(perm) else x for x in xs]
  out = []
  for l in torch_layers:
    perm = next((p for rx, p in rules if rx.fullmatch(l.name)), None)
    out.append(l if perm is None else _Layer(
        l.name, permuted(l.inputs, perm), permuted(l.outputs, perm),
        parameterless=l.parameterless))
  return out


def _axes(perm: Any) -> tuple[int, ...] | None:
  """``perm`` as a tuple of axes where it is a permutation of ``0 .. n-1``
  (n at least 1) given as integers (a sequence or a 1-D integer array; no
  booleans, floats or strings); else None."""
  if isinstance(perm, np.ndarray):
    if perm.ndim != 1 or not np.issubdtype(perm.dtype, np.integer):
      return None
    perm = perm.tolist()
  if isinstance(perm, (str, bytes)) or not isinstance(perm, Sequence):
    return None
  if not all(isinstance(a, (int, np.integer))
             and not isinstance(a, (bool, np.bool_)) for a in perm):
    return None
  axes = tuple(int(a) for a in perm)
  return axes if axes and sorted(axes) == list(range(len(axes))) else None


def _root_layers(torch_model, inputs, torch_inputs, torch_kwargs, root: str
                 ) -> list[_Layer]:
  """The PyTorch root's outputs, one layer each, named as
  :func:`jaxprec.torch.capture` names them (a bare tensor: ``root``, the
  root's name)."""
  found = torch_ref.capture(
      torch_model, *(inputs if torch_inputs is None else torch_inputs),
      **torch_kwargs)
  return [_Layer(root if n == "output" else n, [],
                 [np.asarray(v, np.float32)]) for n, v in found.items()]


def _base(name: str) -> str:
  return name.split("#")[0]


def _inside(outer: str, inner: str, root: str) -> bool:
  """Whether the JAX layer ``inner`` is a module inside ``outer`` (every
  other layer is inside the root's, ``root``)."""
  return inner != outer and render.contains(_base(outer), _base(inner), root)


def _verdicts(results: list[dict], rows: list[str], kind: str,
              names: list[str], paired: set[str], factor: float,
              notes: list[str], root: str
              ) -> tuple[list[PortLayer], dict[str, tuple[str, ...]]]:
  """The :class:`PortLayer` of each result with its verdicts, and per row
  the unpaired layers that hold a jump of the propagated error (see
  :func:`_jumps`); ``root``: the root's name."""
  def error(r, p):
    x = r["local"][p]
    return r["propagated"][p] if math.isnan(x) else x

  bad = {p: [r["name"] for r in results if error(r, p) > r["bound"][p]]
         for p in rows}
  unpaired = [n for n in names if n not in paired]
  held = ({} if kind == "function" else
          _jumps(results, rows, names, unpaired, bad, factor, notes, root))
  out = []
  for k, r in enumerate(results):
    verdict = {}
    for p in rows:
      if r["name"] not in bad[p]:
        verdict[p] = "ok"
      elif kind == "function":
        before = results[k - 1]["name"] if k else None
        verdict[p] = "after" if before in bad[p] else "SUSPECT"
      else:
        inner = [q for q in (*bad[p], *held.get(p, ()))
                 if _inside(r["name"], q, root)]
        verdict[p] = "inside" if inner else "SUSPECT"
    out.append(PortLayer(
        **r, verdict=verdict,
        unpaired_inside=tuple(u for u in unpaired
                              if _inside(r["name"], u, root))))
  return out, held


def _jumps(results: list[dict], rows: list[str], names: list[str],
           unpaired: list[str], bad: dict[str, list[str]], factor: float,
           notes: list[str], root: str) -> dict[str, tuple[str, ...]]:
  """Row -> the unpaired JAX layers that hold a jump of the propagated
  error no paired layer explains: a paired layer whose local error is
  explained while its propagated error is above ``factor`` times the
  largest before it plus its bound. The code that ran between it and the
  paired layer before it made the error: the innermost layer holding that
  code (the one that ended in between, else the innermost that holds both)
  is named, where it is unpaired and no unexplained paired layer is inside
  it."""
  held: dict[str, tuple[str, ...]] = {}
  for p in rows:
    top = 0.0
    for prev, r in zip(results, results[1:]):
      top = max(top, prev["propagated"][p])
      if r["name"] in bad[p] or not (
          r["propagated"][p] > factor * (top + r["bound"][p])):
        continue
      i, k = names.index(prev["name"]), names.index(r["name"])
      at = _holder(names[i + 1:k] or [prev["name"], r["name"]], names, k,
                   root)
      if (at in unpaired and at not in held.get(p, ())
          and not any(_inside(at, q, root) for q in bad[p])):
        held[p] = (*held.get(p, ()), at)
        notes.append(
            f"{at} has no PyTorch partner and holds a jump of the "
            f"propagated error at {p}: {render.fmt(top)} at most before it, "
            f"{render.fmt(r['propagated'][p])} at {r['name']}, whose local "
            f"error is explained: the error is made in {at}, after "
            f"{prev['name']} (pair it with alignment= to check it alone)")
  return held


def _holder(inner: list[str], names: list[str], at: int, root: str) -> str:
  """The innermost JAX layer holding every layer of ``inner`` (of a name
  called twice, the call in ``inner``, else the first to end at or after
  ``names[at]``; the root's name, ``root``, holds them all)."""
  common = os.path.commonprefix([_base(n).split("/") for n in inner])
  while common and "/".join(common) not in map(_base, names):
    common = common[:-1]
  hits = [n for n in names if _base(n) == ("/".join(common) or root)]
  return next((n for n in (*inner, *names[at:]) if n in hits), root)
