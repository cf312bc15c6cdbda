"""The outputs of a linen module's submodules, also inside ``nn.scan``.

:func:`linen_outputs` runs ``module.apply`` with Flax's
``capture_intermediates`` and names every captured output by module path
(``'encoder/layers_0/attention'``; the root's own output is ``'output'``; a
method other than ``__call__`` adds ``'.method'``; a module called twice gets
``'#0'``, ``'#1'``).

Flax's ``nn.scan`` carries only the collections its ``variable_axes``,
``variable_broadcast`` and ``variable_carry`` name, so the outputs that
``capture_intermediates`` sows inside the loop are dropped unless
``'intermediates'`` is one of them. Here a method interceptor marks the
output of every module call that cannot sow with
``jax.ad_checkpoint.checkpoint_name`` (an identity that stays in the jaxpr),
the call is traced to a jaxpr, and the jaxpr is evaluated again with the
marked values taken out: a ``scan`` that holds marks runs as a ``lax.scan``
that also returns them, stacked along a leading axis of the loop's length;
``jit``, ``remat`` and custom-derivative bodies that hold marks are
evaluated in place. Each scanned layer is then one layer with its outputs of
every iteration stacked, under its module path (the scanned body's own
output, the carry and ``y`` of each iteration, under the scanned module's
path). Marks inside a ``while_loop`` or ``cond`` cannot be taken out; those
layers are named in a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxprec._src.checker import layers
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import trees
from jaxprec._src.jaxpr import walker

_COLLECTION = "intermediates"
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


def linen_outputs(module: Any, variables: Mapping, inputs: tuple,
                  kwargs: dict, *, method: str | None,
                  capture: bool | Callable[[Any, str], bool],
                  lost: list[str] | None = None) -> dict[str, Any]:
  """Every captured submodule output of ``module.apply(variables, *inputs)``.

  Args:
    module: a ``flax.linen.Module``.
    variables: its variables.
    inputs, kwargs: the call's arguments.
    method: the method to call (None: ``__call__``).
    capture: ``True`` (every ``__call__``) or a filter ``(module,
      method_name) -> bool`` as ``capture_intermediates`` takes.
    lost: where to append the names of outputs that cannot be taken out
      (inside a ``while_loop`` or ``cond``); None: a warning names them.

  Returns:
    ``{name: output}``, named as the module docstring says. Outputs of scanned
    modules have a leading axis of the loop's length.
  """
  from flax import linen as nn  # noqa: PLC0415 -- Flax only when in use

  wants = capture if callable(capture) else (
      lambda m, name: name == "__call__")
  structure: dict[str, Any] = {}  # a marked output's name -> its treedef

  def interceptor(next_fun, args, kw, context):
    out = next_fun(*args, **kw)
    mod, name = context.module, context.method_name
    if (mod.scope is None or mod.is_mutable_collection(_COLLECTION)
        or not wants(mod, name)):
      return out  # capture_intermediates sows it (or it is not asked for)
    key = output_name(tuple(str(p) for p in mod.scope.path), name)
    leaves, structure[key] = jax.tree_util.tree_flatten(out)
    return jax.tree_util.tree_unflatten(structure[key], [
        checkpoint_name(x, f"{_MARK}{key}\x00{i}") if layers.is_float(x) else x
        for i, x in enumerate(leaves)])

  def run(variables, *inputs):
    with nn.intercept_methods(interceptor):
      _, state = module.apply(variables, *inputs, method=method,
                              capture_intermediates=capture,
                              mutable=[_COLLECTION], **kwargs)
    out: dict[str, Any] = {}
    _collect(state.get(_COLLECTION, {}), (), out)
    return out

  statics, dynamic = trees.split_call((variables, *inputs), {})
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
  # Marked leaves by layer, in the order they ran; a layer met twice (a
  # module called twice) is two calls.
  calls: dict[str, list[dict[int, Any]]] = {}
  for mark, value in found:
    name, i = mark.rsplit("\x00", 1)
    runs = calls.setdefault(name, [])
    if not runs or int(i) in runs[-1]:
      runs.append({})
    runs[-1][int(i)] = value
  for name, runs in calls.items():
    treedef = structure[name]
    add_calls(out, name, [
        jax.tree_util.tree_unflatten(
            treedef, [got.get(i) for i in range(treedef.num_leaves)])
        for got in runs])
  if missing:
    names = ", ".join(repr(n) for n in dict.fromkeys(missing))
    if lost is None:
      warnings.warn(
          f"jaxprec.check_module cannot take out the outputs of {names}: "
          f"they run inside a while_loop or cond; they are not checked.",
          UserWarning, stacklevel=2)
    else:
      lost.extend(n for n in dict.fromkeys(missing) if n not in lost)
  return out


def output_name(path: tuple[str, ...], method: str) -> str:
  """A module output's name (see the module docstring)."""
  base = "/".join(path) or "output"
  return base if method == "__call__" else f"{base}.{method}"


def add_calls(out: dict, name: str, calls: Any) -> None:
  """``out[name]`` for each call's output (``'#0'``, ``'#1'`` when several)."""
  calls = tuple(calls) if isinstance(calls, (tuple, list)) else (calls,)
  for i, x in enumerate(calls):
    out[name if len(calls) == 1 else f"{name}#{i}"] = x


def _collect(tree: Mapping, path: tuple[str, ...], out: dict) -> None:
  """Names the captured outputs of ``tree`` (an ``'intermediates'`` dict)."""
  for k, v in tree.items():
    if isinstance(v, Mapping):
      _collect(v, path + (str(k),), out)
    else:  # a method name -> its outputs, one per call
      add_calls(out, output_name(path, k), v)
