"""Operands rounded once: the parameters that feed matmuls, split per format.

An emulated matmul splits or rounds its float32 operands into the parts its
algorithm multiplies (:mod:`jaxprec._src.emulation.passes`: bfloat16 parts, TF32
parts, float16 values). Within one :func:`jaxprec.search_policy`, every
evaluation runs the same program on the same parameters, and splitting a
model's weights costs a good part of a forward pass (BERT-base, batch 1:
``benchmarks/bench_prepared.py``). So a program can take them ready:

* :func:`provenance` finds the operands of a traced function's top-level
  matmuls and convolutions that are one of its float32 array arguments
  through data movement (reshapes, transposes, slices, broadcasts,
  same-dtype converts); those moved in order and count only (not a
  transpose, see ``_MOVES``), that the emulated op does not transpose
  either and that are not on both sides of one matmul are served: a
  Flax ``Dense`` or ``Conv`` kernel, a ``DenseGeneral`` kernel contracted
  on its leading axes. It follows them into the ``jax.jit`` bodies that
  :func:`jaxprec._src.search.switch.switched` evaluates in place.
* :func:`recording` traces the program once, abstractly, and collects which
  parts (:func:`jaxprec._src.emulation.passes.compute` keys) each such argument's
  operands ask for, at every candidate precision.
* :func:`prepare` computes them once, in a program of their own.
* :func:`serving` gives them to the program, moved as the program would
  move them, and the emulated ops multiply them.

The parts are computed by the same bit operations in either program (an
exact split: nothing is summed or rounded twice) and reach the dots laid out
alike, so the numbers are the same bit for bit (``tests/test_prepared.py``,
``tests/test_prepared_probes.py``). Operands computed from the parameters (a
weight norm, say), transposed ones, an argument on both sides of one matmul,
operands of matmuls inside a ``scan``, ``remat`` or ``cond`` body or a
``jax.jit`` the program does not inline, and activations are split where
they are used, as before. The parts cost memory while the search runs: up to
six bfloat16 values per parameter that feeds a matmul (1, 2 and 3 parts for
the one-, three- and six-pass candidates), i.e. three times the float32
weights, and six float32 values on the ``f32`` kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxprec._src.emulation import passes
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import walker

# Data movement: each output element is one input element. Provenance
# follows all of it (so that one argument on both sides of a matmul is seen
# as one), but only operands moved in order and count are served (_served):
# the served operand is then laid out as the one the program would compute.
# A transpose (or a reversal) is not: XLA folds a transpose into the dot that
# reads a computed operand, and may then run another dot kernel (summing in
# another order) than on a transposed argument (tests/test_prepared_probes.py);
# a broadcast that adds elements would be prepared at its own size.
_MOVES = frozenset({"transpose", "rev", "reshape", "squeeze", "expand_dims",
                    "slice", "copy", "copy_p", "convert_element_type",
                    "broadcast_in_dim"})
_REORDER = frozenset({"transpose", "rev"})


def _served(chain: tuple[Any, ...]) -> bool:
  """Whether an operand moved by ``chain`` may be served (see _MOVES)."""
  for eqn in chain:
    if eqn.primitive.name in _REORDER:
      return False
    if (eqn.primitive.name == "broadcast_in_dim"
        and eqn.outvars[0].aval.size != eqn.invars[0].aval.size):
      return False
  return True


# A request: the parts (keys) of program argument ``arg`` moved by ``chain``
# (data-movement equations) and then by ``move`` (:func:`passes.move`), as
# one emulated op reads them; named by :func:`_name`.
Request = tuple[int, tuple[Any, ...], Any, set]  # (arg, chain, move, keys)
Requests = dict[str, Request]
Ready = dict[str, dict[str, tuple[jax.Array, ...]]]  # name -> key -> parts


def provenance(jaxpr, inputs: dict[int, Any] | None = None
               ) -> dict[Any, tuple[Any, tuple[Any, ...]]]:
  """``var -> (input, data-movement equations)`` at ``jaxpr``'s top level.

  Every float32 input ``i`` maps to ``(inputs[i], ())`` (default: ``i``;
  inputs missing from ``inputs`` map to nothing); an equation that only
  moves the elements of a mapped float32 variable maps its output to the
  same input, with the equation appended (a float32-to-float32 convert, a
  change of weak type, is left out: it moves nothing).
  """
  if isinstance(jaxpr, compat.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  out: dict[Any, tuple[Any, tuple[Any, ...]]] = {}
  for i, v in enumerate(jaxpr.invars):
    if v.aval.dtype != np.float32:
      continue
    if inputs is None:
      out[v] = (i, ())
    elif i in inputs:
      out[v] = inputs[i]
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name not in _MOVES or len(eqn.invars) != 1 or len(eqn.outvars) != 1:
      continue
    src, dst = eqn.invars[0], eqn.outvars[0]
    if isinstance(src, compat.Literal) or src not in out:
      continue
    if dst.aval.dtype != np.float32:
      continue
    i, chain = out[src]
    out[dst] = (i, chain if name == "convert_element_type" else (*chain, eqn))
  return out


# Ops that keep each element: an operand a transpose made stays one.
_KEEPS = frozenset({"reshape", "squeeze", "expand_dims", "convert_element_type",
                    "copy", "copy_p", "broadcast_in_dim", "slice"})


def guarded(closed) -> frozenset:
  """The variables of ``closed`` (at any depth) a transpose made, directly or
  through data movement: the operands an emulated op reads behind an
  ``optimization_barrier``.

  Otherwise XLA folds the transpose into the op's dots: ``w.T @ w`` became a
  bfloat16 dot in a layout XLA:CPU cannot run ("Unsupported element type
  for DotThunk"), or a float32 dot that sums in another order than where
  the operand arrives already transposed, as in the branches of the search's
  switched program (:mod:`jaxprec._src.search.switch`;
  ``tests/test_prepared_probes.py``). Only those operands: a barrier on
  every operand made BERT-base compile 5 to 18% slower (measured).
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


def _moved(x: jax.Array, chain: tuple[Any, ...], how: Any) -> jax.Array:
  for eqn in chain:
    (x,) = walker.bind_unchanged(eqn, [x])
  return passes.move(x, how)


def _name(arg: int, chain: tuple[Any, ...], how: Any) -> str:
  """A name for the moved argument, the same in every trace of a program."""
  text = repr([(e.primitive.name, sorted((k, repr(v)) for k, v in
                                         e.params.items())) for e in chain])
  digest = hashlib.sha1(f"{text}|{how!r}".encode()).hexdigest()[:16]
  return f"{arg}:{digest}"


class _State(threading.local):
  def __init__(self):
    self.mode: str | None = None  # 'record' or 'serve'
    self.index: dict[int, int] = {}  # id(program argument) -> its index
    self.requests: Requests = {}
    self.ready: Ready = {}


_STATE = _State()


@contextlib.contextmanager
def recording(dynamic: Sequence[Any]) -> Iterator[Requests]:
  """Traces run in this scope record the parts their operands ask for.

  ``dynamic``: the program's array arguments (tracers); the yielded dict
  fills with :data:`Requests` while the program is traced.
  Nothing is served: the traced program splits every operand itself.
  """
  with _scope("record", dynamic, {}) as state:
    yield state.requests


@contextlib.contextmanager
def serving(dynamic: Sequence[Any], ready: Ready | None) -> Iterator[None]:
  """Traces run in this scope read prepared parts from ``ready``
  (:func:`prepare`'s result, as program arguments) where they are there."""
  if not ready:
    yield
    return
  with _scope("serve", dynamic, ready):
    yield


@contextlib.contextmanager
def _scope(mode: str, dynamic: Sequence[Any], ready: Ready):
  saved = (_STATE.mode, _STATE.index, _STATE.requests, _STATE.ready)
  _STATE.mode, _STATE.ready, _STATE.requests = mode, ready, {}
  _STATE.index = {id(x): i for i, x in enumerate(dynamic)}
  try:
    yield _STATE
  finally:
    _STATE.mode, _STATE.index, _STATE.requests, _STATE.ready = saved


class Sources:
  """Where a traced function's matmuls find their operands' parts.

  :meth:`for_eqn` gives the emulated op of an equation a callable
  ``source(lhs_needs, rhs_needs) -> (lhs_ready, rhs_ready)``, or None when
  neither operand is a prepared argument. Equations are those at the top
  level of the traced jaxpr and of the bodies :meth:`enter` follows, known
  by identity (each equation object occurs once there:
  :func:`jaxprec._src.search.switch._unshared`; a variable may not, when JAX's
  trace caches share a body between two calls).
  """

  def __init__(self, jaxpr, dynamic: Sequence[Any]):
    # input index of the traced function -> (program argument index, ())
    args = {i: (_STATE.index[id(x)], ()) for i, x in enumerate(dynamic)
            if id(x) in _STATE.index}
    self._operands: dict[int, list[Any]] = {}  # id(eqn) -> per input
    self._add(jaxpr, args)

  def _add(self, jaxpr, inputs: dict[int, Any]) -> None:
    where = provenance(jaxpr, inputs)
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
      found = [None if isinstance(v, compat.Literal) else where.get(v)
               for v in eqn.invars]
      if any(f is not None for f in found):
        self._operands[id(eqn)] = found

  def enter(self, eqn, body) -> None:
    """Follows ``eqn``'s operands into ``body``, the jaxpr of a call that
    is evaluated in place (:func:`jaxprec._src.search.switch.switched` inlines a
    ``jax.jit`` body holding a unit's matmul): its inputs are the call's."""
    found = self._operands.get(id(eqn))
    if found is not None:
      self._add(body, {i: f for i, f in enumerate(found) if f is not None})

  def for_eqn(self, eqn):
    found = self._operands.get(id(eqn), [None, None])[:2]
    if found[0] is not None and found[1] is not None and (
        found[0][0] == found[1][0]):
      # One argument on both sides (``w.T @ w``): XLA rounds it once for
      # both and folds the transpose into the dot; serving one side would
      # change the dot it runs (tests/test_prepared_probes.py).
      return None
    if found == [None, None]:
      return None
    mode, requests, ready = _STATE.mode, _STATE.requests, _STATE.ready

    def source(*needs):
      """``needs``: ``(keys, move)`` per operand (emulated_ops.operand_needs)."""
      out = []
      for where, (wanted, how) in zip(found, needs):
        if where is None or not wanted:
          out.append(None)
          continue
        arg, chain = where
        if not _served(chain) or (
            how is not None and tuple(how[0]) != tuple(range(len(how[0])))):
          out.append(None)  # moved out of order (by fn or the op): _MOVES
          continue
        name = _name(arg, chain, how)
        if mode == "record":
          requests.setdefault(name, (arg, chain, how, set()))[3].update(wanted)
          out.append(None)
          continue
        have = ready.get(name, {})
        # Not prepared (an op the recording trace did not meet): split here.
        out.append({k: have[k] for k in wanted}
                   if all(k in have for k in wanted) else None)
      return tuple(out)
    return source


def sources(jaxpr, dynamic: Sequence[Any]) -> Sources | None:
  """:class:`Sources` for a function traced to ``jaxpr`` from ``dynamic``
  inside :func:`recording` or :func:`serving`; None outside them."""
  if _STATE.mode is None or not any(id(x) in _STATE.index for x in dynamic):
    return None
  return Sources(jaxpr, dynamic)


LIMIT_BYTES = 1 << 30
"""The most memory prepared parts may take (1 GiB). Above it nothing is
prepared: the program splits its operands itself, as it does without them."""


def prepare(dynamic: Sequence[Any], requests: Requests,
            limit: int | None = LIMIT_BYTES) -> Ready:
  """The parts ``requests`` asks for, computed once, in one jitted program.

  The data movement and the split are the ones the program would apply
  (the same bit operations: an exact split), so the parts are bit for bit
  those it would compute. Compiled at each call (a search calls it once);
  :func:`preparer` gives the program itself.

  Args:
    dynamic: the program's array arguments.
    requests: what :func:`recording` recorded.
    limit: the most bytes the parts may take (None: no limit); above it,
      nothing is prepared (``{}``).

  Returns:
    ``{name: {key: parts}}``, the ``ready`` of :func:`serving`.
  """
  run = preparer(requests)
  if limit is not None and nbytes(jax.eval_shape(run, dynamic)) > limit:
    return {}
  return run(dynamic)


def nbytes(tree: Any) -> int:
  """Bytes of the arrays (or shapes) in ``tree``."""
  return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def preparer(requests: Requests) -> Callable[[Sequence[Any]], Ready]:
  """The jitted program ``dynamic -> ready`` of :func:`prepare`."""
  plan = [(name, requests[name]) for name in sorted(requests)
          if requests[name][3]]

  @jax.jit
  def build(leaves):
    return {name: {k: passes.compute(k, _moved(x, chain, how))
                   for k in sorted(keys)}
            for (name, (_, chain, how, keys)), x in zip(plan, leaves)}

  def run(dynamic: Sequence[Any]) -> Ready:
    return build([dynamic[arg] for _, (arg, *_) in plan]) if plan else {}
  return run
