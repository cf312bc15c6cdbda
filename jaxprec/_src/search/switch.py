"""One compiled program for every precision policy the search tries
(``docs/search.md``, "Limits").

:func:`switched` emulates each unit's matmuls and convolutions as a
``lax.switch`` among its candidates' emulations, indexed by an ``int32``
array argument: the index array is the policy. Each branch is exactly the op
the fixed-policy program (``jaxprec.emulate(fn, policy)``) computes, so the
numerics are identical (``tests/test_switch.py``). That holds for the ops
around them too because a multi-pass emulated op stores its result through a
scatter (:func:`jaxprec._src.emulation.passes._last`), which XLA does not
fuse into the ops that read it: they read it from memory in both programs,
as they must across a ``lax.switch``, and XLA compiles them alike.

A unit the switched trace does not find is a :class:`SwitchError`; the search
then compiles one program per policy and says so.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxprec._src.core import numerics
from jaxprec._src.core.precision import Precision
from jaxprec._src.emulation import emulate as emulate_lib
from jaxprec._src.emulation import emulated_ops
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.inspect import audit as audit_lib
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import walker


_TRACES = itertools.count()


class SwitchError(ValueError):
  """The switched trace does not match the units (the search falls back to
  one program per policy)."""


def switched(fn: Callable[..., Any], units: Sequence[str],
             precisions: Sequence[Precision], *, target: str,
             traces: dict | None = None, **options: Any) -> Callable[..., Any]:
  """``fn`` emulated with unit ``u``'s ops at ``precisions[index[u]]``.

  Args:
    fn: the function (not jitted: the search looks through a top-level jit).
    units: module paths, as :attr:`jaxprec.AuditRow.module_path` gives them.
    precisions: the choices, in index order.
    target: ``'tpu'`` or ``'gpu'``.
    traces: where ``fn``'s traces are kept, per signature (default: a dict
      of this function's). Calls that pass one dict share them: the
      search's runner passes its own, for the wrappers of one function that
      :func:`jaxprec._src.checker.layers.ordered_layers` makes at each trace.
    **options: the emulated ops' options (``tf32_rounding``).

  Returns:
    ``g(index, *args, **kwargs)``: ``index`` an ``int32`` array of shape
    ``(len(units),)``; ``g`` computes what ``jaxprec.emulate(fn, policy,
    target=target)`` computes for the policy that gives unit ``u`` the
    precision ``precisions[index[u]]``. Ops with a precision of their own,
    and ops in no unit, are emulated as ``jaxprec.emulate(fn)`` emulates
    them (they are fixed in the search).

  Raises:
    SwitchError: (when ``g`` is traced) a unit whose ops the trace does not
      find.
  """
  units = tuple(units)
  position = {u: i for i, u in enumerate(units)}
  opaque: list[str] = []
  warned: set[str] = set()
  what = getattr(fn, "__qualname__", type(fn).__name__)
  bound = nnx_policy.bind(fn, None)  # an NNX module: a traced copy, with paths
  # fn's trace per signature and JAX context, with what it holds.
  traces = {} if traces is None else traces
  # A jit key of the traces' own (see trace()), the same for every trace
  # kept in ``traces``: a new one would make each trace a new key there.
  scope = traces.setdefault("switch: scope",
                            f"jaxprec switched trace {next(_TRACES)}")

  def traced(*args, **kwargs):
    with jax.default_matmul_precision(None):
      return bound(*args, **kwargs)

  def trace(args, kwargs):
    # A trace of its own: JAX's trace caches (a jax.checkpoint or jax.jit
    # around the model's modules) would otherwise serve the audit's trace,
    # in which no module call is recorded now. Kept per signature and
    # context (keyed outside the scopes, which are new at each record),
    # with the module paths it recorded, for the next trace of the program.
    key, dynamic = walker.call_key(args, kwargs)
    held = None if key is None else traces.get(key)
    if held is None:
      with flax_paths.record() as found, compat.jit_key_scope(scope):
        call = walker.trace_call(traced, args, kwargs)
      closed = _unshared(call.jaxpr)
      unit_of = unit_eqns(closed, found, position)
      held = (closed, call.out_tree, unit_of, _holders(closed, unit_of))
      if key is not None:
        traces[key] = held
    closed, out_tree, unit_of, inline = held
    return walker.TracedCall(closed, out_tree, dynamic), (closed, unit_of, inline)

  @functools.wraps(fn)
  def run(index, *args, **kwargs):
    call, (closed, unit_of, inline) = trace(args, kwargs)
    missing = set(units) - {units[i] for _, i in unit_of.values()}
    if missing:
      raise SwitchError(
          f"the switched trace found no matmul of the units "
          f"{sorted(missing)[:4]}")
    # One emulation rule per choice; ops without a precision take the
    # choice's (convolutions its level, as a policy gives them).
    guarded = emulate_lib.transposed(closed)  # as emulate: the same ops
    rules = [emulate_lib.emulation_rule(p, target=target, conv_default=p,
                                        guarded=guarded, **options)
             for p in precisions]
    fixed = emulate_lib.emulation_rule(None, target=target,
                                       on_opaque=opaque.append,
                                       guarded=guarded, **options)

    def rule(eqn, invals):
      if id(eqn) in inline:
        # A jit or custom-derivative body holding a unit's matmul is
        # evaluated in place: its own trace could not see ``index``. XLA
        # inlines such calls anyway, and the forward pass of a custom
        # derivative is its body, so the program computes the same.
        body = eqn.params[_CALLS[eqn.primitive.name]]
        return walker.interpret(body, rule, *invals)
      hit = unit_of.get(id(eqn))
      if hit is None or hit[0] is not eqn:
        return fixed(eqn, invals)
      branches = [_branch(r, eqn) for r in rules]
      return [lax.switch(index[hit[1]], branches, *invals)]

    out = call.unflatten(walker.interpret(closed, rule, *call.dynamic))
    emulate_lib.warn_opaque(opaque, warned, what)
    return out

  return run


def unit_eqns(closed, found: dict[str, list[str]], position: dict[str, int]
              ) -> dict[int, tuple[Any, int]]:
  """``id(eqn) -> (eqn, unit index)`` for the matmuls and convolutions a
  policy decides: float32 operands, no precision of their own, in a unit."""
  out: dict[int, tuple[Any, int]] = {}
  for w, _, module in audit_lib.walk_modules(closed, found):
    eqn = w.eqn
    if (eqn.primitive.name in walker.PRIMITIVES
        and eqn.params.get("precision") is None and module in position
        and numerics.emulatable(eqn.invars[0].aval.dtype,
                                eqn.invars[1].aval.dtype)):
      out[id(eqn)] = (eqn, position[module])
  return out


def _unshared(closed):
  """``closed`` with a copy of every equation and nested jaxpr where it is
  met, so that each equation object occurs once.

  JAX's trace caches give two calls of one function (a ``jax.jit`` function,
  the body of a ``lax.scan`` or the branches of a ``lax.cond`` written
  outside the module) the same jaxpr, whose matmuls may belong to two units:
  keyed by equation, one unit's index would choose for both.
  """
  def copy(value):
    if isinstance(value, compat.ClosedJaxpr) and not compat.JAXPR_MERGED:
      return value.replace(jaxpr=copy(value.jaxpr))
    if isinstance(value, compat.Jaxpr):
      return value.replace(eqns=[
          e.replace(params={k: copy(v) for k, v in e.params.items()})
          for e in value.eqns])
    if isinstance(value, tuple) and any(
        isinstance(v, (compat.ClosedJaxpr, compat.Jaxpr)) for v in value):
      items = [copy(v) for v in value]  # a named tuple stays one
      return value._make(items) if hasattr(value, "_make") else tuple(items)
    return value
  return copy(closed)


# The calls that may hold a unit's matmul: the parameter holding their body.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr"}


def _holders(closed, unit_of: dict[int, tuple[Any, int]]) -> set[int]:
  """``id`` of every jit or custom-derivative call (at any depth) whose body
  holds a unit's matmul (jaxprec's own emulated calls excepted)."""
  out: set[int] = set()

  def visit(jaxpr) -> bool:
    found = False
    for eqn in jaxpr.eqns:
      if id(eqn) in unit_of:
        found = True
      inner = False
      for sub in compat.jaxprs_in_params(eqn.params):
        inner = visit(sub) or inner
      if (inner and eqn.primitive.name in _CALLS
          and not emulated_ops.is_emulated_call(eqn)):
        out.add(id(eqn))
      found = found or inner
    return found

  visit(closed.jaxpr)
  return out


def _branch(rule: walker.Rule, eqn) -> Callable[..., jax.Array]:
  def branch(*invals):
    out = rule(eqn, list(invals))
    if out is None:  # nothing to emulate at this choice: the op as recorded
      out = walker.bind_unchanged(eqn, list(invals))
    return out[0]
  return branch


def index_of(levels: Sequence[int]) -> jax.Array:
  """The ``index`` argument for per-unit choice indices."""
  return jnp.asarray(levels, jnp.int32)
