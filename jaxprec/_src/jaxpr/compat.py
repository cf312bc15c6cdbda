"""The one place where jaxprec reaches into JAX internals.

Every use of a private JAX API is here, feature-detected where versions differ,
so that a JAX upgrade breaks one module (chex's ``pytypes.py`` does the same).
Written against jax 0.10.2; each difference in jax 0.11 and 0.12 (CI's newest
stage) is detected by feature, not by version number, and named where it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
from jax._src import core as _core
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import partial_eval as pe

# Public APIs where the installed JAX has them, feature-detected: all exist in
# jax 0.10.2 (the version this was written against); each private fallback can
# go once the oldest supported JAX has the public name.
ClosedJaxpr = jex.core.ClosedJaxpr
Jaxpr = jex.core.Jaxpr
Literal = jex.core.Literal
Var = getattr(jex.core, "Var", _core.Var)
DropVar = getattr(jex.core, "DropVar", _core.DropVar)
typeof = getattr(jax, "typeof", _core.typeof)


def match_varying(*args):
  """``args`` cast (``pvary``) to vary over the same ``shard_map`` mesh axes,
  as JAX's own binary ops cast theirs before they bind
  (``jax._src.core.auto_insert_reshard``, jax 0.10 to 0.12); unchanged where
  JAX has no such cast."""
  insert = getattr(_core, "auto_insert_reshard", None)
  return list(args) if insert is None else list(insert(*args))
try:  # jax.extend.linear_util.wrap_init, with debug_info (jax 0.10.2)
  from jax.extend.linear_util import wrap_init
except ImportError:  # pragma: no cover -- older JAX
  from jax._src.linear_util import wrap_init
# jax.extend.source_info_util (jax 0.10.2) has the name-stack and context
# functions; user_frames stays private (see eqn_user_frames).
source_info_util = getattr(jex, "source_info_util", _source_info_util)

# jax 0.11 merged ClosedJaxpr into Jaxpr: one class whose ``.jaxpr`` returns
# the object itself and whose constants are attached to its leading binders
# (``constvars``; ``invars`` are the rest). Before, a ClosedJaxpr wrapped an
# open Jaxpr whose ``constvars`` and ``invars`` were separate lists.
JAXPR_MERGED = ClosedJaxpr is Jaxpr


def all_binders(jaxpr) -> list[Any]:
  """Every input variable of ``jaxpr``: its constvars, then its invars.

  A jaxpr evaluated with ``(consts, args)`` binds ``[*consts, *args]`` to
  these. The same on every version: on jax 0.11+ a jaxpr whose constants
  were detached (what custom-rule thunks return) has no constvars but takes
  its constants as leading invars, which is the same list.
  """
  return [*jaxpr.constvars, *jaxpr.invars]


def scan_add_consts(params: dict, n: int) -> dict:
  """scan params for ``n`` extra leading constant inputs."""
  params = dict(params)
  if "ft_in" in params:
    # jax 0.11+: scan's inputs are one FlatTree of three groups (consts,
    # carry, xs) in ``ft_in``, not the counts ``num_consts``/``num_carry``.
    from jax._src import flattree as ft  # noqa: PLC0415
    consts, carry, xs = params["ft_in"].unpack()
    params["ft_in"] = ft.pack(((ft.nones(n), consts), carry, xs))
    return params
  params["num_consts"] = params["num_consts"] + n
  if "linear" in params:
    params["linear"] = (False,) * n + tuple(params["linear"])
  return params


def scan_counts(params: dict) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a scan equation's params.

  jax 0.11+ keeps them as the groups of one FlatTree, ``ft_in``.
  """
  if "ft_in" in params:
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
  return params["num_consts"], params["num_carry"]


def jaxprs_in_params(params) -> Any:
  """The open jaxprs in an equation's params (``ClosedJaxpr`` unwrapped),
  also inside tuples: ``jax.extend.core.jaxprs_in_params`` (jax 0.10.2), else
  the same walk here."""
  public = getattr(jex.core, "jaxprs_in_params", None)
  if public is not None:
    yield from public(params)
    return
  for val in params.values():  # pragma: no cover -- older JAX
    for v in val if isinstance(val, tuple) else (val,):
      if isinstance(v, Jaxpr):
        yield v
      elif isinstance(v, ClosedJaxpr):
        yield v.jaxpr


@contextlib.contextmanager
def eqn_context(eqn):
  """Re-enters an equation's source info, name stack and context (as eval_jaxpr)."""
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback,
                                     name_stack=name_stack), eqn.ctx.manager:
    yield


def trace_to_closed_jaxpr(fn: Callable[..., Sequence[Any]], in_avals,
                          *, debug_info=None) -> ClosedJaxpr:
  """Traces a flat function (flat inputs, a flat list of outputs) on abstract
  values, keeping weak types exactly."""
  from jax._src import api_util
  if debug_info is None:
    debug_info = api_util.debug_info("jaxprec", fn, tuple(in_avals), {})
  wrapped = wrap_init(lambda *a: list(fn(*a)), debug_info=debug_info)
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
  return ClosedJaxpr(jaxpr, consts)


def debug_info(fn, in_avals):
  """JAX debug info naming ``fn`` (used in tracing error messages)."""
  from jax._src import api_util
  try:
    return api_util.debug_info("jaxprec", fn, tuple(in_avals), {})
  except Exception:  # noqa: BLE001 -- best effort: odd callables have no signature
    return None


def hoist_consts(closed: ClosedJaxpr) -> ClosedJaxpr:
  """Moves a ClosedJaxpr's consts to leading inputs (the caller passes them)."""
  return pe.close_jaxpr(pe.convert_constvars_jaxpr(closed.jaxpr))


close = pe.close_jaxpr  # an open Jaxpr without constvars as a ClosedJaxpr


def pad_invars(closed: ClosedJaxpr, *, before: int, after: int, avals) -> ClosedJaxpr:
  """Adds unused leading inputs: ``before`` then own ones then ``after``.

  ``closed`` has its own hoisted consts as its first inputs; ``avals`` are the
  avals of all the padded inputs in order (before + own + after).
  """
  jaxpr = closed.jaxpr
  n_own = len(avals) - before - after
  new_before = [Var(a) for a in avals[:before]]
  new_after = [Var(a) for a in avals[before + n_own:]]
  own, rest = jaxpr.invars[:n_own], jaxpr.invars[n_own:]
  invars = [*new_before, *own, *new_after, *rest]
  return ClosedJaxpr(jaxpr.replace(invars=invars,
                                   debug_info=jaxpr.debug_info._replace(
                                       arg_names=None)), closed.consts)


def shard_map(body: Callable[..., Sequence[Any]], params: dict,
              args: Sequence[Any]) -> list[Any]:
  """``body`` called on ``args`` under the public ``jax.shard_map`` with a
  recorded shard_map equation's mesh, specs, manual axes and check.

  Tracing ``body`` there binds the mesh's axis names, so that collectives
  and ``pvary`` in it trace (a jaxpr re-traced outside raises "unbound axis
  name"), and constants ``body`` creates are replicated, as shard_map does
  for closed-over values. Param names: ``in_specs``, ``out_specs``,
  ``check_vma`` and ``newly_manual_axes`` (jax 0.10.2); ``check_rep`` and
  ``manual_axes`` before, feature-detected.
  """
  import inspect  # noqa: PLC0415
  signature = inspect.signature(jax.shard_map).parameters
  mesh = params["mesh"]
  kwargs: dict[str, Any] = dict(mesh=mesh, in_specs=tuple(params["in_specs"]),
                                out_specs=tuple(params["out_specs"]))
  check = params.get("check_vma", params.get("check_rep", True))
  kwargs["check_vma" if "check_vma" in signature else "check_rep"] = check
  manual = params.get("newly_manual_axes", params.get("manual_axes"))
  if manual is not None and "axis_names" in signature:
    kwargs["axis_names"] = frozenset(manual) | frozenset(
        getattr(mesh, "manual_axes", ()))
  return list(jax.shard_map(lambda *a: tuple(body(*a)), **kwargs)(*args))


def _rewritten_body(params: dict, rule, eval_fn):
  """``(params, call_jaxpr, num_consts, fun)``: a custom_*_call's params
  without these two, and its body as a WrappedFun that evaluates it with
  ``rule``."""
  params = dict(params)
  call_jaxpr = params.pop("call_jaxpr")
  fun = wrap_init(
      lambda *a: eval_fn(call_jaxpr.jaxpr, call_jaxpr.consts, rule, a),
      debug_info=call_jaxpr.jaxpr.debug_info)
  return params, call_jaxpr, params.pop("num_consts"), fun


# The zeros a custom_vjp rule is given or returns in place of an array:
# ``jax.custom_derivatives.SymbolicZero`` (public; the cotangents of a rule
# declared with ``symbolic_zeros=True``) and JAX's internal ``Zero``
# (``jax._src.ad_util``, jax 0.10.2 to 0.12), which ``SymbolicZero`` does not
# subclass.
def _zero_types() -> tuple[type, ...]:
  from jax._src import ad_util  # noqa: PLC0415
  public = jax.custom_derivatives.SymbolicZero
  return (public, *(t for t in (getattr(ad_util, "Zero", None),)
                    if isinstance(t, type) and t is not public))


_ZEROS = _zero_types()


def custom_jvp_bind_params(params: dict, rule, eval_fn) -> dict:
  """Bind params of a custom_jvp_call whose body and JVP are both rewritten.

  The rule's tangent computation is evaluated with ``rule`` too: JAX
  transposes the rewritten ops (the emulated ops' own transpose rules) where
  ``jax.grad`` needs it.
  """
  from jax._src import custom_derivatives as cd
  params, _, num_consts, fun = _rewritten_body(params, rule, eval_fn)
  jvp_jaxpr_fun = params.pop("jvp_jaxpr_fun")

  # As jax._src.custom_derivatives.lift_jvp, evaluating with the rule.
  def jvp(*xs):
    n, ragged = divmod(len(xs), 2)
    assert not ragged
    primals, tangents = xs[num_consts:n], xs[n + num_consts:]
    zeros = [type(t) is cd.SymbolicZero for t in tangents]
    jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*zeros)
    nonzero = [t for t in tangents if type(t) is not cd.SymbolicZero]
    n_out = len(out_zeros)
    out = eval_fn(jvp_jaxpr, jvp_consts, rule, [*primals, *nonzero])
    out_primals, nz_out = out[:n_out], iter(out[n_out:])
    out_tangents = [cd.SymbolicZero(typeof(p).to_tangent_aval())
                    if z else next(nz_out) for p, z in zip(out_primals, out_zeros)]
    return [*out_primals, *out_tangents]

  params["subfuns"] = (fun, wrap_init(jvp, debug_info=jvp_jaxpr_fun.debug_info))
  return params


def custom_vjp_bind_params(params: dict, rule, eval_fn) -> dict:
  """Bind params of a custom_vjp_call whose body, fwd and bwd are all rewritten."""
  from jax._src import custom_derivatives as cd
  params, call_jaxpr, num_consts, fun = _rewritten_body(params, rule, eval_fn)
  fwd_jaxpr_thunk = params.pop("fwd_jaxpr_thunk")
  bwd = params.pop("bwd")

  # As jax._src.custom_derivatives.lift_fwd, evaluating with the rule.
  def fwd(*args):
    vals, nonzeros = args[::2], args[1::2]
    primals = vals[num_consts:]
    const_nonzeros, in_nonzeros = nonzeros[:num_consts], nonzeros[num_consts:]
    if any(const_nonzeros):
      raise jax._src.interpreters.ad.CustomVJPException()
    fwd_jaxpr, fwd_consts = fwd_jaxpr_thunk.call_wrapped(*in_nonzeros)
    return eval_fn(fwd_jaxpr, fwd_consts, rule, list(primals))

  const_avals = call_jaxpr.in_avals[:num_consts]
  bwd_c = cd._handle_consts_in_bwd(bwd, const_avals)

  # The user's bwd is Python: trace it once per call to a jaxpr, then rewrite.
  # Zeros are not arrays: the cotangents of unused outputs under
  # ``defvjp(..., symbolic_zeros=True)`` arrive as ``SymbolicZero`` objects
  # (Equinox's ``filter_custom_vjp``, diffrax's adjoints), and the rule
  # returns ``Zero`` objects or Nones for inputs it gives no cotangent. They
  # stay in place, given to and taken from the traced rule as they are, so
  # that every matmul of the rule is rewritten whatever reaches it. So do
  # concrete arrays (an eager jax.grad): the rule sees them as JAX gives them
  # (Equinox's checks branch on a concrete value), as constants of the trace.
  def new_bwd(*args):
    is_zero = lambda x: x is None or isinstance(x, _ZEROS)  # noqa: E731
    flat, tree = jax.tree_util.tree_flatten(args, is_leaf=is_zero)
    arrays = [isinstance(x, _core.Tracer) for x in flat]
    holder = {}

    def flat_bwd(*leaves):
      it = iter(leaves)
      full = [next(it) if a else x for x, a in zip(flat, arrays)]
      out = bwd_c.call_wrapped(*jax.tree_util.tree_unflatten(tree, full))
      out_flat, holder["tree"] = jax.tree_util.tree_flatten(out,
                                                            is_leaf=is_zero)
      holder["mask"] = [not is_zero(o) for o in out_flat]
      holder["raw"] = out_flat
      return [o for o, m in zip(out_flat, holder["mask"]) if m]

    inputs = [x for x, a in zip(flat, arrays) if a]
    closed = trace_to_closed_jaxpr(flat_bwd, [typeof(x) for x in inputs])
    outs = iter(eval_fn(closed.jaxpr, closed.consts, rule, inputs))
    raw = [next(outs) if m else r for r, m in zip(holder["raw"], holder["mask"])]
    return jax.tree_util.tree_unflatten(holder["tree"], raw)

  params["subfuns"] = (
      fun,
      wrap_init(fwd, debug_info=fwd_jaxpr_thunk.debug_info),
      wrap_init(new_bwd, debug_info=bwd.debug_info),
  )
  return params


@functools.lru_cache(maxsize=None)
def backend_platform() -> str:
  """The default backend's platform ('cpu', 'gpu', 'tpu'); starts the backend."""
  return jax.default_backend()


def process_index() -> int:
  """``jax.process_index()`` once JAX runs; 0 before, without starting JAX.

  A multi-process run (``jax.distributed``, a TPU pod) has started a backend
  by the time anything is written; a process that never started one (a
  report read back from JSON and plotted) is alone and is process 0.
  """
  started = jax.distributed.is_initialized()
  if not started:
    try:  # private: jax 0.10.2 to 0.12 (no public name)
      from jax._src import xla_bridge
      started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # pragma: no cover -- moved: ask JAX
      started = True
  return jax.process_index() if started else 0


def matmul_precision_state() -> tuple[Any, Any]:
  """JAX's ``default_matmul_precision`` config state and its 'unset' marker.

  ``state.get_local()`` is the thread-local (scope) value or the marker;
  ``state.get_global()`` the global one. Private
  (``jax._src.config``, jax >= 0.4.30): JAX has no public way to tell a scope
  from the global setting.
  """
  from jax._src import config as jax_config
  return jax_config.default_matmul_precision, jax_config.config_ext.unset


# ---------------------------------------------------------------------------
# Source information of equations, for reports (used by jaxprec._src.inspect.audit).
# jax._src.source_info_util is private; written against jax 0.10.2.


def eqn_name_stack(eqn) -> str:
  """The equation's name stack as text, e.g. ``'MLP/dense1'`` (``''`` if none).

  Relative to the enclosing jaxpr: JAX starts a new name stack inside ``jit``
  and loop bodies, so a caller that wants a full path joins the parents' stacks.
  """
  return str(eqn.source_info.name_stack)


def eqn_user_frames(eqn) -> list[tuple[str, int, str]]:
  """``(file, line, function)`` of the frames that recorded ``eqn``, innermost first.

  JAX's own frames (and the standard library's) are left out, as in JAX's
  ``source_info_util.user_frames``; library frames such as Flax's stay in.
  """
  frames = _source_info_util.user_frames(eqn.source_info.traceback)
  return [(f.file_name, f.start_line, f.function_name) for f in frames]


def current_name_stack() -> str:
  """The name stack JAX records on equations traced here and now, as text.

  Relative to the jaxpr being traced, like :func:`eqn_name_stack`'s (used by
  jaxprec's Flax interception to map module calls to equations).
  """
  return str(source_info_util.current_name_stack())


def trace_context() -> Any:
  """Everything in JAX's config that ``jax.jit`` keys its traces on, now.

  The matmul precision flag, x64, jaxprec's policy state
  (:func:`jit_key_scope`) and every other config state created with
  ``include_in_jit_key``: a trace cache keyed on this value is never reused
  where ``jax.jit`` would trace again. Hashable. ``jax._src.config
  .trace_context`` is private (jax 0.4.30 to 0.10.2 at least); no public
  equivalent exists in jax 0.10.2.
  """
  from jax._src import config as jax_config
  return jax_config.trace_context()


def _jit_key_state(name: str, doc: str):
  """A JAX config state that is part of ``jax.jit``'s cache key and of
  :func:`trace_context` (``jax._src.config.State`` with ``include_in_jit_key``;
  written against jax 0.10.2, no public equivalent)."""
  from jax._src import config as jax_config
  return jax_config.State(name, None, doc, include_in_jit_key=True,
                          include_in_trace_context=True)


# Created at import, before anything is traced: a state created later would
# change every trace context and make jax.jit trace each function again once.
_POLICY_KEY_STATE = _jit_key_state(
    "jaxprec_policy",
    "The jaxprec policy in force while tracing (set by jaxprec only).")
# jaxprec's emulation kernel setting, a JAX config state like the policy's: a
# function jitted under one kernel is traced again under another.
# ``KERNEL_STATE(...)`` for a thread-local scope, ``.set_global``, ``.value``.
KERNEL_STATE = _jit_key_state(
    "jaxprec_kernel",
    "The jaxprec emulation kernel setting (set by jaxprec only).")


def jit_key_scope(value: str):
  """A scope whose ``value`` is part of ``jax.jit``'s cache key.

  A policy decides precisions while a function is traced (through Flax method
  interception) in a way JAX cannot see; without this, a function jitted once
  under one policy would silently reuse that trace under another. Scopes
  nest: the key is the outer scope's value joined with ``value``, so an
  inner scope never makes two different outer scopes look alike.
  """
  outer = _POLICY_KEY_STATE.value
  return _POLICY_KEY_STATE(value if outer is None else f"{outer} | {value}")



# ---------------------------------------------------------------------------
# Primitives: every one JAX registers, and what a primitive computes.


def registered_primitives() -> dict[str, Any]:
  """Every primitive JAX defines, by name: the ``jax.extend.core.Primitive``
  instances held by JAX's modules (at module level, or in a dict, list or
  tuple there), after importing every module of ``jax._src`` that imports.

  There is no public registry of primitives (jax 0.10.2 to 0.12): JAX keeps
  them as module attributes (``dot_general_p`` in ``jax._src.lax.lax``).
  Modules that need a library that is not installed (a GPU plugin) are
  skipped, so their primitives are missing where their library is.
  """
  import importlib  # noqa: PLC0415
  import pkgutil  # noqa: PLC0415
  import sys  # noqa: PLC0415
  import jax._src as src  # noqa: PLC0415
  import jax.experimental as experimental  # noqa: PLC0415
  # jax.experimental too: jax.experimental.sparse defines its primitives
  # there, not in jax._src, so a test that imported it would see more.
  for package, prefix in ((src, "jax._src."),
                          (experimental, "jax.experimental.")):
    for info in pkgutil.walk_packages(package.__path__, prefix,
                                      onerror=lambda name: None):
      if "test" in info.name.rsplit(".", 1)[-1]:
        continue  # test utilities define primitives of their own
      try:
        importlib.import_module(info.name)
      except Exception:  # noqa: BLE001 -- a missing optional library
        continue
  found: dict[str, Any] = {}
  for name, module in list(sys.modules.items()):
    if (not (name == "jax" or name.startswith("jax.")) or module is None
        or "test" in name):
      continue
    for value in list(vars(module).values()):
      if isinstance(value, dict):  # values only: rule tables key on any
        values = list(value.values())  # primitive, a library's too
      elif isinstance(value, (list, tuple)):
        values = list(value)
      else:
        values = [value]
      for v in values:
        if isinstance(v, jex.core.Primitive):
          found.setdefault(v.name, v)
  return found


_PLATFORMS = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}


def lowering_function(prim, target: str | None = None
                      ) -> tuple[Callable[..., Any], bool] | None:
  """``(fun, multiple_results)`` when ``prim`` lowers as
  ``mlir.lower_fun(fun, multiple_results)`` does for ``target`` (its
  platform's rule, else the rule for every platform); None for any other
  lowering rule, or none.

  ``fun`` is what XLA compiles for the primitive: JAX traces it while
  lowering (``jax._src.interpreters.mlir.lower_fun``). The rule tables
  (``mlir._lowerings``, ``mlir._platform_specific_lowerings``) and the
  closure of ``lower_fun``'s rule are private (jax 0.10.2 to 0.12).
  """
  try:
    from jax._src.interpreters import mlir as _mlir  # noqa: PLC0415
    tables = [getattr(_mlir, "_platform_specific_lowerings", {}).get(
        _PLATFORMS.get(target or "", ""), {}), getattr(_mlir, "_lowerings", {})]
  except ImportError:  # pragma: no cover -- moved
    return None
  for table in tables:
    entry = table.get(prim)
    if entry is None:
      continue
    rule = getattr(entry, "rule", entry)
    code = getattr(rule, "__code__", None)
    cells = getattr(rule, "__closure__", None) or ()
    if code is None or code.co_name != "f_lowered" or "fun" not in code.co_freevars:
      return None  # a hand-written lowering: not a function of JAX ops
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    return free["fun"], bool(free.get("multiple_results", True))
  return None


def ragged_dot_dense() -> Callable[..., Any] | None:
  """JAX's dense form of ``ragged_dot_general`` (its lowering on CPU and
  GPU: each group's rows masked, then one ``dot_general``), called with the
  primitive's operands and parameters; None where JAX has no such
  function. ``jax._src.lax.lax._ragged_dot_general_impl`` is private
  (jax 0.10.2 to 0.12)."""
  from jax._src.lax import lax as _lax  # noqa: PLC0415
  return getattr(_lax, "_ragged_dot_general_impl", None)
