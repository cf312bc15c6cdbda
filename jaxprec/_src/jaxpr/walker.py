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
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import trees

# A rule sees an equation and its input values and returns the output values
# that replace it (a list, one per outvar), or None to keep the equation. A
# rule may carry two attributes the walker reads where it rewrites a
# library's primitive (:func:`bind_traced`): ``target`` (whose platform's
# lowering is traced) and ``on_opaque`` (called with the name of each
# opaque op inside the primitive's implementation).
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
    enclosing: the equations whose bodies (or traced implementations) hold
      it, outermost first, e.g. the user's ``jit`` and a library primitive
      inside it: where the equation's own frames are a library's, theirs
      name the user's line.
  """

  eqn: Any
  scope: tuple[str, ...]
  trip_count: int = 1
  enclosing: tuple[Any, ...] = ()


# ---------------------------------------------------------------------------
# The one table: each primitive the walker meets is in exactly one class
# (:func:`classify`). tests/test_unseen_primitives.py checks that every
# primitive the installed JAX registers is in one, so that a new JAX
# primitive fails a test instead of passing unseen.

# Matmuls jaxprec emulates and audits, with their op kinds as policies name
# them. ``ragged_dot_general`` (``lax.ragged_dot``) is a dot: it takes the
# same precisions, and each group's rows are one dot of the target's passes.
PRIMITIVES = {"dot_general": "dot", "conv_general_dilated": "conv",
              "ragged_dot_general": "dot"}

# Primitives whose numerics jaxprec can neither see nor change: compiled
# kernels (Pallas, Mosaic, Triton, cuDNN), foreign functions (FFI,
# custom_call), host callbacks, and the block-scaled matmuls (``scaled_dot``,
# an XLA composite a backend may run as its own kernel; cuDNN's
# ``scaled_matmul``). The walker binds them unchanged; the audit lists them
# and the emulation warns (jaxprec.OpaqueOpWarning).
OPAQUE_PRIMITIVES = frozenset({
    "pallas_call", "ffi_call", "custom_call", "pure_callback", "io_callback",
    "tpu_custom_call", "triton_kernel_call", "mosaic_gpu_call", "mosaic_gpu_p",
    "buffer_callback", "core_map", "mpmd_map", "custom_fusion", "fusible",
    "cudnn_fusion", "scaled_dot", "scaled_matmul", "scaled_matmul_wrapper",
    "dot_product_attention_fwd", "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd", "dot_product_attention_fp8_bwd",
    "dot_product_attention_fp8_fwd_wrapper",
    "dot_product_attention_fp8_bwd_wrapper", "elementwise_inline_asm_p",
    "inline_mgpu_p", "emit_pipeline", "pipeline_body",
    # jax.experimental.thunky (jax 0.12): GPU runtime thunks, PTX kernels
    # and custom calls run as their own programs.
    "thunky.all_gather", "thunky.all_reduce", "thunky.all_to_all",
    "thunky.async_done", "thunky.async_start", "thunky.call_jax",
    "thunky.call_thunky_nested", "thunky.collective_group",
    "thunky.collective_permute", "thunky.cond", "thunky.copy",
    "thunky.custom_call", "thunky.inline_constant", "thunky.memset",
    "thunky.memzero", "thunky.ptx_kernel", "thunky.reduce_scatter",
    "thunky.while",
    # jax.experimental.rnn: cuDNN's RNN kernels (an LSTM's matmuls inside).
    "rnn_fwd", "rnn_bwd"})

# Higher-order primitives: the walker walks the jaxprs in their params.
HIGHER_ORDER = frozenset({
    "jit", "pjit", "closed_call", "core_call", "call", "remat2", "checkpoint",
    "remat_opt", "scan", "while", "cond", "custom_jvp_call",
    "custom_jvp_call_jaxpr", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "custom_lin", "custom_linear_solve", "custom_vmap_call",
    "custom_transpose_call", "custom_partitioning", "linear_call",
    "shard_map", "run_state", "composite", "compute_on", "eval_jaxpr",
    "call_hi_primitive", "call_hi_primitive_linearized", "jaxpr_call",
    "run_scoped", "xla_metadata_call", "fused_call"})

# Primitives that run only inside a Pallas or Mosaic kernel's body, itself
# opaque: the audit shows a kernel's dots (not emulated), nothing binds them.
KERNEL_PRIMITIVES = frozenset({
    # jax._src.pallas.primitives, .core, .einshape, .fuser
    "delay", "get_global", "masked_load", "masked_swap", "multiple_of",
    "num_programs", "program_id", "reciprocal", "semaphore_read",
    "with_memory_space_constraint", "einshape_lo", "pack_dtype",
    "unpack_dtype", "remove_memory_space",
    # jax._src.pallas.mosaic (TPU, SparseCore)
    "add_dependency", "bitcast", "dma_start", "dma_wait",
    "get_barrier_semaphore", "matmul_acc_lhs", "matmul_pop",
    "matmul_push_rhs", "matmul_lhs_fifo", "matmul_pop_fifo",
    "pack_elementwise", "prng_join", "prng_random_bits", "prng_seed",
    "prng_split", "roll", "stochastic_round", "trace_value",
    "unpack_elementwise", "all_reduce_ffs", "all_reduce_population_count",
    "barrier", "load", "masked_cummax", "masked_cummin", "masked_cumsum",
    "masked_sort", "pack", "parallel_loop", "sc_fetch_and_add", "swap",
    "unique", "unpack", "scan_count",
    # jax._src.pallas.mosaic_gpu
    "layout_cast", "_copysign", "async_copy_scales_to_tmem",
    "async_copy_smem_to_tmem", "async_copy_sparse_metadata_to_tmem",
    "async_load", "async_prefetch", "async_store_smem", "async_store_tmem",
    "barrier_arrive", "barrier_test", "barrier_wait", "commit_group",
    "commit_smem", "commit_tmem", "copy_gmem_to_smem", "copy_smem_to_gmem",
    "griddepcontrol_launch_dependents", "griddepcontrol_wait",
    "mgpu_atomic_store", "multimem_load_reduce", "multimem_store",
    "print_layout", "query_cluster_cancel", "semaphore_signal",
    "semaphore_signal_multicast", "semaphore_signal_parallel",
    "semaphore_wait", "set_max_registers_p", "tcgen05_commit_arrive",
    "tcgen05_mma", "try_cluster_cancel", "wait_load_tmem",
    "wait_smem_to_gmem", "wait_gmem_to_smem", "wgmma",
    "wgmma_accumulator_deref_p", "wgmma_accumulator_store_p", "wgmma_ref",
    "wgmma_wait", "mma",
    # jax._src.pallas.triton
    "atomic_cas", "atomic_rmw", "debug_barrier_p", "max_contiguous",
    # the same packages in jax 0.12
    "conv", "has_memory_space", "store", "barrier_arrive_and_wait",
    "debug_barrier", "elementwise_inline_asm", "inline_mgpu",
    "set_max_registers", "mosaic_gpu_reduce_max", "mosaic_gpu_reduce_min",
    "mosaic_gpu_reduce_prod", "mosaic_gpu_reduce_sum",
    "wgmma_accumulator_deref", "wgmma_accumulator_store",
    # jax 0.12.1 (jax._src.pallas.mosaic.primitives)
    "request_p_state"})

# Primitives JAX defines that hold no matmul: elementwise arithmetic,
# reductions, data movement, control of sharding and memory, collectives,
# random numbers, state, shape checks, callbacks without results
# (``debug_callback``, ``debug_print``: they cannot change a value), and the
# elementwise multiply-adds of jax 0.12.1 (``fma``: one rounding of
# ``a * b + c``; ``fmuladd``: fused or not, as the backend likes: both
# elementwise, so no matmul precision applies to them, and a dot's
# accumulation is never one of them in a jaxpr), the
# linear-algebra decompositions (``cholesky``, ``triangular_solve``, ``qr``,
# ``eigh``, ``svd``, ...), which the backend's solver computes with
# products that no precision setting names (LAPACK on CPU, cuSOLVER on GPU,
# XLA's own expansion on TPU): jaxprec runs them natively.
NO_MATMUL = frozenset("""
    abs acos acosh add add_any after_all all_gather all_gather_done
    all_gather_invariant all_gather_reduced all_gather_reduced_start
    all_gather_start all_to_all all_to_all_done all_to_all_start and
    approx_top_k argmax argmin asin asinh atan atan2 atanh axis_index
    bessel_i0e bessel_i1e bitcast_convert_type broadcast_in_dim
    broadcast_to cbrt ceil clamp clz complex concatenate conj
    convert_element_type copy copy_p cos cosh create_token cumlogsumexp
    cummax cummin cumprod cumsum dce_sink digamma div dynamic_slice
    dynamic_update_slice empty empty2 eq eq_to erf erf_inv erfc exp exp2
    expm1 fft floor from_edtype gather ge gt igamma igamma_grad_a igammac
    imag integer_pow iota is_finite le le_to lgamma log log1p logistic lt
    lt_to max min mul mulhi ne neg nextafter not optimization_barrier or
    pad pmax pmin polygamma population_count pow ppermute ppermute_done
    ppermute_start precv preduced psend psum psum_done psum_invariant
    psum_invariant_start psum_start pbroadcast pbroadcast_done
    pbroadcast_start pvary ragged_all_to_all real reduce reduce_and
    reduce_max reduce_min reduce_or reduce_precision reduce_prod
    reduce_scatter reduce_scatter_done reduce_scatter_start reduce_sum
    reduce_window reduce_window_max reduce_window_min reduce_window_sum
    reduce_xor reduced_vary_cast_p regularized_incomplete_beta rem reshape
    rev rng_bit_generator rng_uniform round rsqrt scatter scatter-add
    scatter-max scatter-min scatter-mul scatter-sub scatter_add scatter_mul
    scatter_min scatter_max select_and_gather_add select_and_scatter
    select_and_scatter_add select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh slice sort split sqrt square squeeze
    stack stop_gradient sub tan tanh tie tile to_edtype top_k transpose
    unreduced_psum unreduced_psum_start unreduced_reduce_scatter
    unreduced_reduce_scatter_start unreduced_pmax unreduced_pmin
    unstack vary_unreduced_cast_p xor zeros_like zeta
    cholesky cholesky_update eig eigh geqp3 geqrf hessenberg
    householder_product lu lu_pivots_to_permutation ormqr qr schur svd
    symmetric_product triangular_solve tridiagonal tridiagonal_solve
    random_bits random_clone random_fold_in random_gamma random_seed
    random_split random_unwrap random_wrap iota_2x32_shape threefry2x32
    threefry4x32 philox2x32 philox4x32
    accum_grad_in_ref addupdate get new_ref empty_ref free_ref freeze
    create_linear pin unpin stage box_get box_set new_box log_extend
    log_read new_log
    device_put sharding_constraint layout_constraint reshard shard_alike
    inspect_sharding xla_metadata_value platform_index check unreachable
    dim_as_value dimension_size shape_assertion call_exported name
    debug_callback debug_print
    log2 one_minus_square polynomial program_order relayout
    pbroadcast_dynamic reduced_vary_cast vary_unreduced_cast
    consume assert_consumed_value global_array_to_host_local_array
    host_local_array_to_global_array
    acospi asinpi atan2pi atanpi cospi sinpi tanpi exp2m1 log2p1
    fma fmuladd pmax_scatter pmin_scatter pxor
    random_gamma_grad random_poisson raw_bits
""".split())

# JAX's own primitives whose implementation the walker traces and walks, as
# it does a library's (:func:`implementation`): jax.experimental.sparse,
# whose products lower through ``mlir.lower_fun`` to dense ops on CPU and
# TPU (their matmuls are then audited and emulated), and to cuSPARSE on a
# GPU (hand-written: named as opaque there).
JAX_TRACED = frozenset("""
    bcoo_dot_general bcoo_dot_general_sampled bcoo_extract bcoo_fromdense
    bcoo_sort_indices bcoo_spdot_general bcoo_sum_duplicates bcoo_todense
    bcoo_transpose bcsr_dot_general bcsr_extract bcsr_fromdense bcsr_todense
    coo_fromdense coo_matmat coo_matvec coo_spmm coo_spmv coo_todense
    csr_fromdense csr_matmat csr_matvec csr_spmm csr_spmv csr_todense
    spsolve todense
""".split())

# jaxprec's own primitives: an emulated op (emulation/emulated_ops.py) and a
# library primitive emulated through its implementation (:func:`_traced_p`).
JAXPREC_PRIMITIVES = frozenset({"jaxprec_emulated", "jaxprec_traced"})

CLASSES = ("matmul", "higher_order", "opaque", "kernel", "no_matmul",
           "jaxprec", "traced")


def classify(name: str) -> str:
  """The class of the primitive ``name`` in the walker's one table.

  ``'matmul'`` (:data:`PRIMITIVES`: emulated and audited),
  ``'higher_order'`` (its jaxprs are walked), ``'opaque'`` (named in the
  audit, warned about by the emulation), ``'kernel'`` (only inside an opaque
  kernel), ``'no_matmul'`` (JAX's own, bound as recorded), ``'jaxprec'``
  (emulated already) or ``'traced'``: any other primitive (a library's own,
  such as Equinox's): its implementation is traced and walked
  (:func:`implementation`), or, where it cannot be, the primitive is
  opaque (:func:`opaque_name`).
  """
  for cls, names in (("matmul", PRIMITIVES), ("higher_order", HIGHER_ORDER),
                     ("opaque", OPAQUE_PRIMITIVES),
                     ("kernel", KERNEL_PRIMITIVES), ("no_matmul", NO_MATMUL),
                     ("jaxprec", JAXPREC_PRIMITIVES)):
    if name in names:
      return cls
  return "traced"


# Host callbacks that provably hold no matmul: Equinox's runtime error
# checks (``eqx.error_if``, and everything that uses it: lineax, diffrax,
# optimistix), whose callbacks raise the error or, where a TPU cannot raise,
# return NaNs (equinox/_errors.py). Keyed by module and qualified name.
MATMUL_FREE_CALLBACKS = frozenset({
    ("equinox._errors", "_error.<locals>.raises"),
    ("equinox._errors", "_error.<locals>.tpu_msg")})


def _callback_function(eqn):
  func = eqn.params.get("callback")
  return getattr(func, "callback_func", func)


def opaque_name(eqn, target: str | None = None) -> str | None:
  """``"pallas_call 'kernel'"`` for an opaque equation (its primitive and,
  where JAX records one, the kernel, FFI target or callback name); None for
  every other equation.

  Opaque: a primitive of :data:`OPAQUE_PRIMITIVES` (a callback of
  :data:`MATMUL_FREE_CALLBACKS` excepted), and a library's primitive whose
  implementation cannot be traced (:func:`implementation`), named with
  ``"(implementation not traceable)"``.
  """
  prim = eqn.primitive.name
  cls = classify(prim)
  if cls == "traced":
    if implementation(eqn, target) is not None:
      return None
    return f"{prim} (implementation not traceable)"
  if cls != "opaque":
    return None
  params = eqn.params
  if "callback" in params:
    func = _callback_function(eqn)
    if (getattr(func, "__module__", None),
        getattr(func, "__qualname__", None)) in MATMUL_FREE_CALLBACKS:
      return None
  name = (params.get("name") or params.get("target_name")
          or params.get("call_target_name"))
  if not name and isinstance(params.get("jaxpr"), compat.Jaxpr):
    name = getattr(params["jaxpr"].debug_info, "func_name", None)
  if not name and "callback" in params:
    func = _callback_function(eqn)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
  return f"{prim} {str(name)!r}" if name else prim


# ---------------------------------------------------------------------------
# Any other primitive: its implementation, traced.

_IMPLEMENTATIONS: dict[Any, Any] = {}


def implementation(eqn, target: str | None = None):
  """The ``ClosedJaxpr`` a library primitive's equation computes, over its
  inputs, or None where it cannot be traced.

  What XLA compiles for it where JAX can tell: the function its lowering
  rule traces (``mlir.lower_fun(fun)``, for ``target``'s platform if it has
  its own rule: :func:`compat.lowering_function`), else its ``impl``
  (what it runs eagerly). Jaxprs in its parameters that the function calls
  (lineax's closure-converted operators) are inside it. None where the rule
  is hand-written MLIR, where tracing raises, or where the traced function
  binds the primitive itself, with the same parameters and input types
  (``dispatch.apply_primitive``: no implementation in JAX ops); a bind with
  other parameters (lineax's GMRES solves its small least-squares problem
  with another ``linear_solve``) is a call like any other. Cached per
  primitive, parameters, input types, target and JAX trace context
  (1024 entries, oldest dropped), unless the trace holds constants or
  raised.
  """
  return _implementation(eqn.primitive, eqn.params,
                         tuple(v.aval for v in eqn.invars), target)


def _implementation(prim, params, avals, target):
  key = (prim, tuple(sorted(params.items(), key=lambda kv: kv[0])), avals,
         target, compat.trace_context())
  try:
    hash(key)
  except TypeError:
    key = None
  if key is not None and key in _IMPLEMENTATIONS:
    return _IMPLEMENTATIONS[key]
  closed, failed = _trace_implementation(prim, params, avals, target)
  if key is not None and not failed and not (
      closed is not None and closed.consts):
    # Never a trace with constants (they may be a user's arrays), nor a
    # trace that raised (it may not, called again).
    if len(_IMPLEMENTATIONS) >= 1024:
      _IMPLEMENTATIONS.pop(next(iter(_IMPLEMENTATIONS)))
    _IMPLEMENTATIONS[key] = closed
  return closed


def _trace_implementation(prim, params, avals, target):
  found, failed = [], False
  lowered = compat.lowering_function(prim, target)
  if lowered is not None:
    found.append(lowered)
  impl = getattr(prim, "impl", None)
  if impl is not None and (lowered is None or impl is not lowered[0]):
    found.append((impl, prim.multiple_results))
  for fun, multiple in found:
    def flat(*args, fun=fun, multiple=multiple):
      out = fun(*args, **params)
      return list(out) if multiple else [out]
    try:
      closed = compat.trace_to_closed_jaxpr(flat, list(avals))
    except Exception:  # noqa: BLE001 -- not traceable: the next, or opaque
      failed = True
      continue
    if not _binds_itself(closed.jaxpr, prim, params, avals):
      return closed, False
  return None, failed


def _binds_itself(jaxpr, prim, params, avals) -> bool:
  """Whether ``jaxpr``, or a jaxpr nested in it, binds ``prim`` with
  ``params`` on inputs of ``avals`` (implementations not entered)."""
  for eqn in jaxpr.eqns:
    if (eqn.primitive is prim
        and tuple(v.aval for v in eqn.invars) == tuple(avals)
        and _same_params(eqn.params, params)):
      return True
    if any(_binds_itself(sub, prim, params, avals)
           for sub in compat.jaxprs_in_params(eqn.params)):
      return True
  return False


def _same_params(a: dict, b: dict) -> bool:
  if a.keys() != b.keys():
    return False
  for k, x in a.items():
    y = b[k]
    if x is y:
      continue
    try:
      if type(x) is not type(y) or not bool(x == y):
        return False
    except Exception:  # noqa: BLE001 -- not comparable: not the same
      return False
  return True


def holds_matmul(closed, target: str | None = None) -> bool:
  """Whether ``closed`` holds a matmul at any depth, library primitives'
  implementations included."""
  return any(w.eqn.primitive.name in PRIMITIVES
             for w in iter_eqns(closed, target=target))


def _sub_jaxprs(eqn) -> Iterator[tuple[Any, int]]:
  """Yields (open Jaxpr, multiplier) for every jaxpr in an equation's params."""
  mult = 1
  if eqn.primitive.name == "scan":
    mult = int(eqn.params.get("length", 1))
  yield from ((j, mult) for j in compat.jaxprs_in_params(eqn.params))


def iter_eqns(jaxpr, scope: tuple[str, ...] = (), trip_count: int = 1, *,
              target: str | None = None, enclosing: tuple[Any, ...] = ()
              ) -> Iterator[WalkedEqn]:
  """Walks every equation of ``jaxpr`` and of every jaxpr nested in it.

  Args:
    jaxpr: a ``ClosedJaxpr`` or ``Jaxpr`` (e.g. from ``jax.make_jaxpr``).
    scope: prefix for :attr:`WalkedEqn.scope` (used in recursion).
    trip_count: multiplier for :attr:`WalkedEqn.trip_count`.
    target: the platform whose lowering of a library primitive is walked
      (:func:`implementation`); None: the lowering every platform shares.
    enclosing: :attr:`WalkedEqn.enclosing` of the equations (used in
      recursion).

  Yields:
    :class:`WalkedEqn` in program order, parents before their bodies.
    ``custom_jvp_call`` and ``custom_vjp_call`` bodies are walked (their
    derivative rules are not traced until differentiation), and so is the
    traced implementation of a library's primitive (:func:`classify`:
    ``'traced'``), scoped by the primitive's name.
  """
  if isinstance(jaxpr, compat.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    yield WalkedEqn(eqn, scope, trip_count, enclosing)
    inner = scope + (eqn.primitive.name,)
    within = (*enclosing, eqn)
    impl = None
    if classify(eqn.primitive.name) == "traced":
      # What it computes, the jaxprs in its params included where its
      # implementation calls them (lineax's closure-converted operators).
      impl = implementation(eqn, target)
    elif eqn.primitive is _traced_p:  # emulated already: what it runs
      impl = traced_body(eqn)
    if impl is not None:
      yield from iter_eqns(impl, inner, trip_count, target=target,
                           enclosing=within)
      continue
    for sub, mult in _sub_jaxprs(eqn):
      yield from iter_eqns(sub, inner, trip_count * mult, target=target,
                           enclosing=within)


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


def bind_with(eqn, invals, **changed: Any) -> list[Any]:
  """Binds ``eqn`` with the parameters ``changed`` (for use in rules)."""
  params = eqn.primitive.get_bind_params({**eqn.params, **changed})
  return _bind(eqn, invals, params)


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
  cls = classify(name)
  if cls in ("opaque", "kernel", "jaxprec"):
    # A kernel's body (Pallas: a jaxpr over refs) is not a function of its
    # inputs that can be re-traced: bind it as recorded. jaxprec's own
    # primitives are emulated already.
    return bind_unchanged(eqn, invals)
  if cls == "traced" and (
      not any(True for _ in _sub_jaxprs(eqn))
      or implementation(eqn, getattr(rule, "target", None)) is not None):
    # Its jaxprs, if any, are arguments its implementation calls (lineax's
    # operators, closure-converted): they run inside it.
    return bind_traced(eqn, invals, rule)
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


# ---------------------------------------------------------------------------
# A library's primitive rewritten through its implementation.


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
  """A library primitive's equation as :data:`_traced_p` carries it: the
  primitive, its parameters, the rule, the target, where the caller gives
  one (:func:`bind_as`), the function that computes it (hashed by
  identity), and the emulation kernel setting in force where it is bound:
  under ``jax.jit`` XLA lowers it, and ``jax.grad`` transposes it, after
  the caller's kernel scope has closed (:func:`_in_its_kernel`)."""

  prim: Any
  params: dict
  rule: Rule
  target: str | None
  impl: Callable[..., Any] | None = None
  kernel: str | None = dataclasses.field(
      default_factory=lambda: compat.KERNEL_STATE.value)


def bind_traced(eqn, invals, rule: Rule) -> list[Any]:
  """``eqn``, a library's primitive (:func:`classify`: ``'traced'``),
  computed through its implementation rewritten by ``rule``.

  Where its implementation holds a matmul, the equation becomes a
  ``jaxprec_traced`` primitive that computes the implementation with
  ``rule`` and whose derivatives and batching are the library primitive's
  own rules, traced and rewritten by ``rule`` again (so a primitive that
  batches in its own way, such as Equinox's ``unvmap_any``, keeps it). Bound
  as recorded where the implementation holds no matmul, where it has
  effects, or where it cannot be traced (then :func:`opaque_name` names it).
  """
  target = getattr(rule, "target", None)
  impl = implementation(eqn, target)
  if impl is None or eqn.effects or not holds_matmul(impl, target):
    return bind_unchanged(eqn, invals)
  on_opaque = getattr(rule, "on_opaque", None)
  if on_opaque is not None:
    for w in iter_eqns(impl, target=target):
      name = opaque_name(w.eqn, target)
      if name is not None:
        on_opaque(name)
  call = _Call(eqn.primitive, dict(eqn.params), rule, target)
  return list(_traced_p.bind(*invals, call=call))


def bind_as(eqn, invals, rule: Rule, impl: Callable[..., Any]) -> list[Any]:
  """``eqn`` computed as ``impl(*invals, **eqn.params)`` rewritten by
  ``rule``, whose derivatives and batching are ``eqn``'s primitive's own
  rules, traced and rewritten by ``rule`` again (as :func:`bind_traced`
  does for a library's primitive): the derivative of an op computed in
  another form is the op's own derivative, not that form's."""
  call = _Call(eqn.primitive, dict(eqn.params), rule,
               getattr(rule, "target", None), impl)
  return list(_traced_p.bind(*invals, call=call))


def traced_body(eqn):
  """The ``ClosedJaxpr`` a ``jaxprec_traced`` equation (:func:`bind_traced`,
  :func:`bind_as`) computes: its implementation rewritten by its rule."""
  call = eqn.params["call"]
  return compat.trace_to_closed_jaxpr(
      lambda *a: _run(*a, call=call), [v.aval for v in eqn.invars])


_traced_p = jex_core.Primitive("jaxprec_traced")
_traced_p.multiple_results = True


def _outs(prim, out) -> list[Any]:
  return list(out) if prim.multiple_results else [out]


def _computed(*args, call: _Call) -> list[Any]:
  avals = [compat.typeof(a) for a in args]
  if call.impl is not None:
    closed = compat.trace_to_closed_jaxpr(
        lambda *a: _outs(call.prim, call.impl(*a, **call.params)), avals)
    return interpret(closed, call.rule, *args)
  closed = _implementation(call.prim, call.params, tuple(avals), call.target)
  if closed is None:  # traced once already: it cannot fail now
    raise AssertionError(f"{call.prim.name}: implementation not traceable")
  return interpret(closed, call.rule, *args)


def _abstract_eval(*avals, call: _Call):
  out, effects = call.prim.abstract_eval(*avals, **call.params)
  return _outs(call.prim, out), effects


def _jvp(primals, tangents, *, call: _Call):
  """The library primitive's JVP rule, traced and rewritten by the rule."""
  jvp = ad.primitive_jvps.get(call.prim)
  if jvp is None:
    raise NotImplementedError(
        f"Differentiation rule for '{call.prim.name}' not implemented")
  nonzero = [type(t) is not ad.Zero for t in tangents]
  n = len(primals)
  zero_out: dict[int, Any] = {}

  def flat(*xs):
    rest = iter(xs[n:])
    ts = [next(rest) if nz else ad.Zero(compat.typeof(p).to_tangent_aval())
          for p, nz in zip(xs[:n], nonzero)]
    out, out_t = jvp(list(xs[:n]), ts, **call.params)
    out, out_t = _outs(call.prim, out), _outs(call.prim, out_t)
    zero_out.update((i, t.aval) for i, t in enumerate(out_t)
                    if type(t) is ad.Zero)
    return [*out, *(t for t in out_t if type(t) is not ad.Zero)]

  live = [t for t, nz in zip(tangents, nonzero) if nz]
  closed = compat.trace_to_closed_jaxpr(
      flat, [compat.typeof(x) for x in (*primals, *live)])
  outs = interpret(closed, call.rule, *primals, *live)
  n_out = (len(outs) + len(zero_out)) // 2
  primal_out, rest = outs[:n_out], iter(outs[n_out:])
  tangent_out = [ad.Zero(zero_out[i]) if i in zero_out else next(rest)
                 for i in range(n_out)]
  return primal_out, tangent_out


def _transpose(cts, *args, call: _Call):
  """The library primitive's transpose rule, traced and rewritten."""
  transpose = ad.primitive_transposes.get(call.prim)
  if transpose is None:
    raise NotImplementedError(
        f"Transpose rule for '{call.prim.name}' not implemented")
  linear = [ad.is_undefined_primal(a) for a in args]
  consts = [a for a, lin in zip(args, linear) if not lin]
  live = [c for c in cts if type(c) is not ad.Zero]
  kept: list[bool] = []

  def flat(*xs):
    given, rest = iter(xs[:len(consts)]), iter(xs[len(consts):])
    full = [ad.UndefinedPrimal(a.aval) if lin else next(given)
            for a, lin in zip(args, linear)]
    ct = [c if type(c) is ad.Zero else next(rest) for c in cts]
    if not call.prim.multiple_results:
      ct = ad.instantiate_zeros(ct[0])
    out = transpose(ct, *full, **call.params)
    kept[:] = [lin and o is not None and type(o) is not ad.Zero
               for lin, o in zip(linear, out)]
    return [o for o, k in zip(out, kept) if k]

  closed = compat.trace_to_closed_jaxpr(
      flat, [compat.typeof(x) for x in (*consts, *live)])
  outs = iter(interpret(closed, call.rule, *consts, *live))
  return [next(outs) if k else (ad.Zero(a.aval) if lin else None)
          for a, lin, k in zip(args, linear, kept)]


def _batch(args, dims, *, call: _Call):
  """``jax.vmap`` of the library primitive (its own batching rule), traced
  and rewritten by the rule."""
  axes = tuple(None if d is None or d is getattr(batching, "not_mapped", None)
               else int(d) for d in dims)

  def one(*a):
    return _outs(call.prim, call.prim.bind(*a, **call.params))

  closed = compat.trace_to_closed_jaxpr(
      jax.vmap(one, in_axes=axes), [compat.typeof(a) for a in args])
  outs = interpret(closed, call.rule, *args)
  return outs, [0] * len(outs)


def _in_its_kernel(rule):
  """``rule`` run under the kernel setting of the bind: JAX transposes (and
  lowers) after the caller's kernel scope has closed."""
  @functools.wraps(rule)
  def run(*args, call: _Call):
    with compat.KERNEL_STATE(call.kernel):
      return rule(*args, call=call)
  return run


_run = _in_its_kernel(_computed)
_traced_p.def_impl(_run)
_traced_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(_traced_p, mlir.lower_fun(_run, multiple_results=True))
ad.primitive_jvps[_traced_p] = _in_its_kernel(_jvp)
ad.primitive_transposes[_traced_p] = _in_its_kernel(_transpose)
batching.primitive_batchers[_traced_p] = _in_its_kernel(_batch)
