"""The one jaxpr walker shared by the audit, the emulation and the precision scopes.

Two entry points:

* :func:`iter_eqns` walks a jaxpr read-only, recursing into every nested jaxpr
  (``jit``, ``remat``/checkpoint, ``scan``, ``while``, ``cond``,
  ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map`` and any primitive that
  carries a jaxpr in its params), and yields each equation with the chain of
  higher-order primitives that encloses it.
* :func:`interpret` evaluates a jaxpr under the current JAX trace, giving a
  *rule* the chance to replace any equation. Nested jaxprs are rewritten with
  the same rule and re-bound as the same higher-order primitive, so the
  structure (a ``scan`` stays a ``scan``, a ``jit`` stays a ``jit``) survives
  rather than being inlined. Source information and name stacks are propagated
  so that rewritten equations keep their file:line and Flax module path.

Internal JAX APIs are reached only through :mod:`jaxprec._src.jaxpr.compat`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import trees

# A rule sees an equation and its input values and returns the output values
# that replace it (a list, one per outvar), or None to keep the equation.
Rule = Callable[[Any, Sequence[Any]], "Sequence[Any] | None"]


@dataclasses.dataclass(frozen=True)
class WalkedEqn:
  """An equation met by :func:`iter_eqns`.

  Attributes:
    eqn: the ``JaxprEqn``.
    scope: names of the higher-order primitives enclosing it, outermost first,
      e.g. ``('jit', 'scan')``; ``()`` at the top level.
    trip_count: how many times the equation runs per call of the traced
      function, as far as it is static (``scan`` lengths multiply; ``while``
      counts once; ``cond`` branches count once each).
  """

  eqn: Any
  scope: tuple[str, ...]
  trip_count: int = 1


# The primitives whose precision jaxprec reads and emulates, and their op
# kinds as policies name them.
PRIMITIVES = {"dot_general": "dot", "conv_general_dilated": "conv"}

# Primitives whose numerics jaxprec can neither see nor change: compiled
# kernels (Pallas, Mosaic, Triton), foreign functions (FFI, custom_call) and
# host callbacks. The walker binds them unchanged; the audit lists them and
# the emulation warns (jaxprec.OpaqueOpWarning).
OPAQUE_PRIMITIVES = frozenset({
    "pallas_call", "ffi_call", "custom_call", "pure_callback", "io_callback",
    "tpu_custom_call", "triton_kernel_call", "mosaic_gpu_call"})


def opaque_name(eqn) -> str | None:
  """``"pallas_call 'kernel'"`` for an opaque equation (its primitive and,
  where JAX records one, the kernel, FFI target or callback name); None for
  every other equation."""
  prim = eqn.primitive.name
  if prim not in OPAQUE_PRIMITIVES:
    return None
  params = eqn.params
  name = (params.get("name") or params.get("target_name")
          or params.get("call_target_name"))
  if not name and isinstance(params.get("jaxpr"), compat.Jaxpr):
    name = getattr(params["jaxpr"].debug_info, "func_name", None)
  if not name and "callback" in params:
    func = getattr(params["callback"], "callback_func", params["callback"])
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
  return f"{prim} {str(name)!r}" if name else prim


def _sub_jaxprs(eqn) -> Iterator[tuple[Any, int]]:
  """Yields (open Jaxpr, multiplier) for every jaxpr in an equation's params."""
  mult = 1
  if eqn.primitive.name == "scan":
    mult = int(eqn.params.get("length", 1))
  yield from ((j, mult) for j in compat.jaxprs_in_params(eqn.params))


def iter_eqns(jaxpr, scope: tuple[str, ...] = (), trip_count: int = 1
              ) -> Iterator[WalkedEqn]:
  """Walks every equation of ``jaxpr`` and of every jaxpr nested in it.

  Args:
    jaxpr: a ``ClosedJaxpr`` or ``Jaxpr`` (e.g. from ``jax.make_jaxpr``).
    scope: prefix for :attr:`WalkedEqn.scope` (used in recursion).
    trip_count: multiplier for :attr:`WalkedEqn.trip_count`.

  Yields:
    :class:`WalkedEqn` in program order, parents before their bodies.
    ``custom_jvp_call`` and ``custom_vjp_call`` bodies are walked (their
    derivative rules are not traced until differentiation).
  """
  if isinstance(jaxpr, compat.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    yield WalkedEqn(eqn, scope, trip_count)
    for sub, mult in _sub_jaxprs(eqn):
      yield from iter_eqns(sub, scope + (eqn.primitive.name,), trip_count * mult)


def output_times(jaxpr) -> list[tuple[int, ...]]:
  """When each output of ``jaxpr`` is computed, as a sort key per output.

  An output computed earlier in program order has a smaller key. The key of
  an output is the index of the equation that produces it, followed, where
  that equation runs a body whose outputs are its own (``jit``, ``remat``,
  ``scan``, ``while``, ``custom_jvp_call``, ``custom_vjp_call``), by the key
  of the body's output: two layers of one ``scan`` or ``jit`` are ordered as
  its body computes them. An output that is an input (or a constant) has the
  smallest key, ``(-1,)``.

  Args:
    jaxpr: a ``ClosedJaxpr`` or ``Jaxpr``.

  Returns:
    One key per output, in output order.
  """
  if isinstance(jaxpr, compat.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  producers: dict[int, tuple[Any, dict[Any, tuple[int, int]]]] = {}

  def when(jaxpr, var) -> tuple[int, ...]:
    hit = producers.get(id(jaxpr))
    if hit is None or hit[0] is not jaxpr:
      made = {v: (i, k) for i, eqn in enumerate(jaxpr.eqns)
              for k, v in enumerate(eqn.outvars)}
      hit = producers[id(jaxpr)] = (jaxpr, made)
    if not isinstance(var, compat.Var) or var not in hit[1]:
      return (-1,)
    i, k = hit[1][var]
    eqn = jaxpr.eqns[i]
    bodies = [b for b in compat.jaxprs_in_params(eqn.params)
              if len(b.outvars) == len(eqn.outvars)]
    if len(bodies) != 1:  # none, or the branches of a cond
      return (i,)
    return (i, *when(bodies[0], bodies[0].outvars[k]))

  return [when(jaxpr, v) for v in jaxpr.outvars]


# ---------------------------------------------------------------------------
# Rewriting interpreter.


def interpret(closed_jaxpr, rule: Rule, *args) -> list[Any]:
  """Evaluates ``closed_jaxpr`` on ``args``, letting ``rule`` replace equations.

  Works under any JAX transformation (jit, grad, vmap): the values are whatever
  the caller passes, tracers included.

  Args:
    closed_jaxpr: a ``ClosedJaxpr``.
    rule: called as ``rule(eqn, invals)`` for every equation at every depth;
      returns the replacement outputs (a sequence, one per outvar) or None.
    *args: one value per jaxpr input.

  Returns:
    The list of output values.
  """
  return _eval(closed_jaxpr.jaxpr, closed_jaxpr.consts, rule, args)


def transform(closed_jaxpr, rule: Rule):
  """Returns a new ``ClosedJaxpr`` equal to ``closed_jaxpr`` rewritten by ``rule``."""
  return compat.trace_to_closed_jaxpr(
      lambda *a: interpret(closed_jaxpr, rule, *a), closed_jaxpr.in_avals,
      debug_info=closed_jaxpr.jaxpr.debug_info)


@dataclasses.dataclass(frozen=True)
class TracedCall:
  """A Python call traced to a jaxpr: what :func:`trace_call` returns.

  Attributes:
    jaxpr: the ``ClosedJaxpr`` over the call's array arguments.
    out_tree: the output pytree structure.
    dynamic: the array arguments of this call, in order (pass them to
      :func:`interpret`).
  """

  jaxpr: Any
  out_tree: Any
  dynamic: list

  def unflatten(self, outs):
    return jax.tree_util.tree_unflatten(self.out_tree, outs)


def trace_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict,
               cache: dict | None = None, extra_key: Any = ()) -> TracedCall:
  """Traces ``fn(*args, **kwargs)`` to a jaxpr over its array leaves.

  Array leaves (including tracers and NumPy arrays) become jaxpr inputs; every
  other leaf is static, as under ``jax.jit(static_argnames=...)``. With
  ``cache`` (a dict the caller owns), a call with the same pytree structure,
  shapes, dtypes, static values, JAX trace context (the matmul precision flag,
  x64, the jaxprec policy in force and every other config ``jax.jit`` keys
  on: :func:`compat.trace_context`) and ``extra_key`` reuses the earlier
  trace, so ``fn``'s Python code runs once per signature, as under
  ``jax.jit``, and never where ``jax.jit`` would trace again.

  Raises:
    TypeError: ``fn`` returned a leaf that is not a JAX type (a string, say),
      naming its position in the output, as ``jax.jit`` does.
  """
  key, (statics, dynamic, avals) = _key(args, kwargs, extra_key,
                                        cache is not None)
  hit = cache.get(key) if key is not None else None
  if hit is not None:
    return TracedCall(hit[0], hit[1], dynamic)
  store: dict[str, Any] = {}

  def flat_fn(*dyn):
    out = statics.call(fn, dyn)
    _check_outputs(fn, out)
    out_leaves, store["out_tree"] = jax.tree_util.tree_flatten(out)
    return out_leaves

  closed = compat.trace_to_closed_jaxpr(flat_fn, avals,
                                        debug_info=compat.debug_info(fn, avals))
  if key is not None:
    cache[key] = (closed, store["out_tree"])
  return TracedCall(closed, store["out_tree"], dynamic)


def call_key(args: Sequence[Any], kwargs: dict, extra_key: Any = ()
             ) -> tuple[Any, list]:
  """``(key, dynamic)``: the key :func:`trace_call` keeps a trace of
  ``args``/``kwargs`` under, in the JAX context of now (None: not
  hashable), and their array leaves."""
  key, (_, dynamic, _) = _key(args, kwargs, extra_key, True)
  return key, dynamic


def _key(args, kwargs, extra_key, want: bool):
  statics, dynamic = trees.split_call(args, kwargs)
  avals = tuple(compat.typeof(x) for x in dynamic)
  key = None
  if want and statics.key is not None:
    try:
      key = (statics.key, avals, compat.trace_context(), extra_key)
      hash(key)
    except TypeError:
      key = None
  return key, (statics, dynamic, avals)


def _check_outputs(fn, out) -> None:
  """TypeError, as ``jax.jit``'s, for an output leaf that is not a JAX type."""
  for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
    if trees.is_jax_type(x):
      continue
    where = f" at output{jax.tree_util.keystr(path)}" if path else ""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    raise TypeError(
        f"{name} returned a value of type {type(x)}{where}, which is not a "
        f"valid JAX type: only arrays (and pytrees of arrays) can be returned, "
        f"as under jax.jit.")


def _eval(jaxpr, consts, rule: Rule, args) -> list[Any]:
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, compat.Literal) else env[v]

  binders = compat.all_binders(jaxpr)
  if len(binders) != len(consts) + len(args):
    raise TypeError(f"jaxpr takes {len(binders) - len(consts)} inputs, "
                    f"got {len(args)}")
  for v, x in zip(binders, [*consts, *args]):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    with compat.eqn_context(eqn):
      outs = rule(eqn, invals)
      if outs is None:
        outs = _rebind(eqn, invals, rule)
    outs = list(outs)
    if len(outs) != len(eqn.outvars):
      raise AssertionError(
          f"rewriting {eqn.primitive.name} gave {len(outs)} outputs, expected "
          f"{len(eqn.outvars)}")
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, compat.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def bind_unchanged(eqn, invals) -> list[Any]:
  """Binds ``eqn`` as recorded, without rewriting inside it (for use in rules)."""
  return _bind(eqn, invals, eqn.primitive.get_bind_params(dict(eqn.params)))


def _bind(eqn, invals, params) -> list[Any]:
  out = eqn.primitive.bind(*invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _hoisted(rule: Rule, closed):
  """``closed`` rewritten by ``rule``; returns (ClosedJaxpr without consts, consts)."""
  new = transform(closed, rule)
  if not new.consts:
    return new, []
  return compat.hoist_consts(new), list(new.consts)


def _rebind(eqn, invals, rule: Rule) -> list[Any]:
  name = eqn.primitive.name
  params = dict(eqn.params)
  if name in OPAQUE_PRIMITIVES:
    # A kernel's body (Pallas: a jaxpr over refs) is not a function of its
    # inputs that can be re-traced: bind it as recorded.
    return bind_unchanged(eqn, invals)
  handler = _HANDLERS.get(name)
  if handler is not None:
    return handler(eqn, invals, rule, params)
  if name.startswith("scatter") and not any(
      w.eqn.primitive.name in PRIMITIVES
      for sub, _ in _sub_jaxprs(eqn) for w in iter_eqns(sub)):
    # A scatter's combiner (the add of .at[].add, segment_sum and every
    # gather's gradient) holds no matmul or convolution: bound as recorded.
    return bind_unchanged(eqn, invals)
  if any(True for _ in _sub_jaxprs(eqn)):
    # A higher-order primitive we do not know: evaluate its bind-params with
    # every nested ClosedJaxpr rewritten (consts kept). Open jaxprs cannot be
    # rewritten safely without knowing the primitive's conventions.
    for k, v in params.items():
      if isinstance(v, compat.ClosedJaxpr):
        params[k] = transform(v, rule)
      elif isinstance(v, tuple) and v and all(
          isinstance(x, compat.ClosedJaxpr) for x in v):
        items = [transform(x, rule) for x in v]
        # A named tuple stays one (custom_linear_solve's jaxprs: .solve, ...).
        params[k] = v._make(items) if hasattr(v, "_make") else tuple(items)
      elif isinstance(v, compat.Jaxpr):
        raise NotImplementedError(
            f"jaxprec cannot rewrite inside the higher-order primitive {name!r}")
  bind_params = eqn.primitive.get_bind_params(params)
  return _bind(eqn, invals, bind_params)


def _jit(eqn, invals, rule, params):
  params["jaxpr"] = transform(params["jaxpr"], rule)
  return _bind(eqn, invals, params)


def _scan(eqn, invals, rule, params):
  new, consts = _hoisted(rule, params["jaxpr"])
  params["jaxpr"] = new
  if consts:
    params = compat.scan_add_consts(params, len(consts))
  return _bind(eqn, [*consts, *invals], params)


def _while(eqn, invals, rule, params):
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cond_consts, body_consts, carry = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
  cond, cc = _hoisted(rule, params["cond_jaxpr"])
  body, bc = _hoisted(rule, params["body_jaxpr"])
  params.update(cond_jaxpr=cond, body_jaxpr=body, cond_nconsts=nc + len(cc),
                body_nconsts=nb + len(bc))
  return _bind(eqn, [*cc, *cond_consts, *bc, *body_consts, *carry], params)


def _cond(eqn, invals, rule, params):
  branches = [_hoisted(rule, b) for b in params["branches"]]
  all_consts = [c for _, cs in branches for c in cs]
  if not all_consts:
    params["branches"] = tuple(b for b, _ in branches)
    return _bind(eqn, invals, params)
  # Every branch takes every branch's consts; each uses only its own.
  new_branches = []
  offset = 0
  for b, cs in branches:
    new_branches.append(compat.pad_invars(b, before=offset,
                                          after=len(all_consts) - offset - len(cs),
                                          avals=[compat.typeof(c) for c in all_consts]))
    offset += len(cs)
  params["branches"] = tuple(new_branches)
  return _bind(eqn, [invals[0], *all_consts, *invals[1:]], params)


def _remat(eqn, invals, rule, params):
  """params["jaxpr"] is an open Jaxpr with no constvars; new consts lead."""
  new, consts = _hoisted(rule, compat.close(params["jaxpr"]))
  params["jaxpr"] = new.jaxpr
  return _bind(eqn, [*consts, *invals], params)


def _shard_map(eqn, invals, rule, params):
  # Re-traced under the public jax.shard_map with the recorded mesh and specs:
  # the body's collectives and pvary need the mesh's axis names bound.
  closed = compat.close(params["jaxpr"])
  return compat.shard_map(lambda *a: interpret(closed, rule, *a), params,
                          invals)


def _custom(eqn, invals, rule, params):
  bind_params = (compat.custom_jvp_bind_params
                 if eqn.primitive.name == "custom_jvp_call"
                 else compat.custom_vjp_bind_params)
  return _bind(eqn, invals, bind_params(params, rule, _eval))


_HANDLERS: dict[str, Callable[..., list[Any]]] = {
    "jit": _jit,
    "pjit": _jit,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "remat2": _remat,
    "checkpoint": _remat,
    "shard_map": _shard_map,
    "custom_jvp_call": _custom,
    "custom_vjp_call": _custom,
}
