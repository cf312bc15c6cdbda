"""lineax's solves, with the real lineax and Equinox: every dot inside them is
audited and emulated.

``lineax.linear_solve`` binds an Equinox primitive (``linear_solve``, built by
``equinox.internal.create_vprim``) that JAX lowers by tracing its
implementation (``mlir.lower_fun``). Its parameters hold jaxprs (a
``FunctionLinearOperator``'s closure-converted function) that the
implementation calls, and GMRES's implementation binds ``linear_solve`` again
(its small least-squares problem). The reference is the program XLA compiles
for the function, built here without jaxprec: ``jax.jit(f).lower`` with every
``dot_general`` lowered as a TPU computes it (XLA's bfloat16 passes, each a
bfloat16 dot with float32 results, in the canonical ``(B,) M x K`` by
``(B,) K x N`` layout; matrix·vector products at ``DEFAULT`` in float32 where
``tpu_matvec_f32``), at any depth: inside ``linear_solve``'s lowering, its
loops and its nested solves. The audit's rows are counted against the
``dot_general`` ops of the lowered program.
"""

import contextlib
import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.interpreters import mlir as mlir_tables  # the rule tables
from jax.interpreters import mlir

import jaxprec

import reference as ref

lx = pytest.importorskip(
    "lineax", reason="lineax is part of the test extra (pip install -e .[test])")

N = 24


# ---------------------------------------------------------------------------
# The reference: the lowered program, every dot lowered as a TPU computes it.

_INSIDE = threading.local()


def _free(shape, contract, batch):
  return [d for d in range(len(shape)) if d not in contract and d not in batch]


def _canonical(x, batch, free, contract, lhs: bool):
  """``x`` as ``(B,) M x K`` (``lhs``) or ``(B,) K x N``."""
  size = lambda dims: int(np.prod([x.shape[d] for d in dims], dtype=np.int64))  # noqa: E731
  order = (*batch, *free, *contract) if lhs else (*batch, *contract, *free)
  shape = ((size(free), size(contract)) if lhs
           else (size(contract), size(free)))
  return jnp.transpose(x, order).reshape(
      ((size(batch),) if batch else ()) + shape)


def _parts(x, n: int):
  """XLA's bfloat16 split of a float32 ``x`` (dot_algorithm_rewriter.cc,
  openxla/xla): round to nearest even for one pass; else the high parts
  truncated (bit mask 0xFFFF0000) and the last part rounded."""
  rne = functools.partial(lax.reduce_precision, exponent_bits=8,
                          mantissa_bits=7)
  if n == 1:
    return [rne(x)]

  def truncate(v):
    bits = lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)

  hi = truncate(x)
  mid = truncate(x - hi)
  return [hi, mid, rne((x - hi) - mid)]


def _tpu_dot(lhs, rhs, *, dimension_numbers, passes, out_dtype):
  """One bfloat16 pass, or six (``HIGHEST``): the small passes summed in
  XLA's order, NaN replaced by zero, then plus hi·hi."""
  (lc, rc), (lb, rb) = dimension_numbers
  lf, rf = _free(lhs.shape, lc, lb), _free(rhs.shape, rc, rb)
  out_shape = tuple([lhs.shape[d] for d in (*lb, *lf)] +
                    [rhs.shape[d] for d in rf])
  dn = (((2,), (1,)), ((0,), (0,))) if lb else (((1,), (0,)), ((), ()))
  lp = _parts(_canonical(lhs, lb, lf, lc, True), passes)
  rp = _parts(_canonical(rhs, rb, rf, rc, False), passes)

  def dot(i, j):
    return lax.dot_general(lp[i].astype(jnp.bfloat16),
                           rp[j].astype(jnp.bfloat16), dn,
                           preferred_element_type=jnp.float32)

  if passes == 1:
    out = dot(0, 0)
  else:
    s = dot(1, 1)
    for i, j in [(0, 2), (2, 0), (0, 1), (1, 0)]:
      s = s + dot(i, j)
    out = jnp.where(jnp.abs(s) <= np.inf, s, 0) + dot(0, 0)
  return out.reshape(out_shape).astype(out_dtype)


@contextlib.contextmanager
def _dots_lowered_as_a_tpu(matvec_f32: bool):
  """Every ``dot_general`` lowered in this scope (on the default backend) as
  a TPU computes it at ``DEFAULT`` (one pass) or ``HIGHEST`` (six)."""
  prim = lax.dot_general_p
  platform = jax.default_backend()
  tables = [mlir_tables._platform_specific_lowerings[p]
            for p in {"gpu": ("cuda", "rocm")}.get(platform, (platform,))]
  saved = [t.get(prim) for t in tables]
  native = (saved[0] or mlir_tables._lowerings[prim]).rule
  uncached = prim in mlir_tables._uncacheable_primitives

  def rule(ctx, lhs, rhs, *, dimension_numbers, precision,
           preferred_element_type, **params):
    if getattr(_INSIDE, "on", False):  # the passes' own dots
      return native(ctx, lhs, rhs, dimension_numbers=dimension_numbers,
                    precision=precision,
                    preferred_element_type=preferred_element_type, **params)
    a, b = ctx.avals_in
    assert a.dtype == b.dtype == jnp.float32, (a, b)
    level = precision[0] if isinstance(precision, tuple) else precision
    assert level in (None, lax.Precision.DEFAULT, lax.Precision.HIGHEST), level
    (lc, rc), (lb, rb) = dimension_numbers
    vector = not _free(a.shape, lc, lb) or not _free(b.shape, rc, rb)
    out_dtype = preferred_element_type or a.dtype
    if level == lax.Precision.HIGHEST:
      fn = functools.partial(_tpu_dot, passes=6)
    elif vector and matvec_f32:
      fn = functools.partial(_exact_dot, precision=lax.Precision.HIGHEST)
    else:
      fn = functools.partial(_tpu_dot, passes=1)
    _INSIDE.on = True
    try:
      return mlir.lower_fun(
          functools.partial(fn, dimension_numbers=dimension_numbers,
                            out_dtype=out_dtype),
          multiple_results=False)(ctx, lhs, rhs)
    finally:
      _INSIDE.on = False

  # Uncacheable: a pass's own float32 dot must not stand in for a user's.
  mlir.register_lowering(prim, rule, platform=platform, cacheable=False)
  try:
    yield
  finally:
    for t, entry in zip(tables, saved):
      if entry is None:
        t.pop(prim, None)
      else:
        t[prim] = entry
    if not uncached:
      mlir_tables._uncacheable_primitives.discard(prim)


def _exact_dot(lhs, rhs, *, dimension_numbers, precision, out_dtype):
  return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                         preferred_element_type=out_dtype)


def tpu_reference(fn, *args, matvec_f32: bool = True):
  """``fn(*args)`` compiled as a TPU lowers it, run on the default backend."""
  with _dots_lowered_as_a_tpu(matvec_f32):
    compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
  return compiled(*args)


def lowered_dots(fn, *args) -> int:
  """The ``dot_general`` ops of the program JAX lowers for ``fn``."""
  return jax.jit(fn).lower(*args).as_text().count("stablehlo.dot_general")


@pytest.fixture(scope="module")
def tpu():
  """:func:`tpu_reference`, checked first against NumPy + ml_dtypes
  (tests/reference.py): one pass, six passes, and a matrix·vector product
  in float32 or at one pass."""
  rng = np.random.default_rng(1)
  a = rng.standard_normal((N, N)).astype(np.float32)
  v = rng.standard_normal((N, 4)).astype(np.float32)
  dn = (((1,), (0,)), ((), ()))
  for precision, algorithm in ((None, "bf16x1"), ("highest", "bf16x6")):
    got = tpu_reference(lambda a, v: jnp.dot(a, v, precision=precision), a, v)
    want = ref.emulate(a, v, algorithm, ref.dot_general(dn))
    _, magnitude = ref.exact(a, v, algorithm, ref.dot_general(dn))
    assert np.all(np.abs(np.asarray(got) - want)
                  <= ref.error_bound(N, algorithm, magnitude))
  x = v[:, 0]
  exact = a.astype(np.float64) @ x
  np.testing.assert_allclose(tpu_reference(jnp.dot, a, x), exact, rtol=1e-5)
  one_pass = ref.round_bf16(a).astype(np.float64) @ ref.round_bf16(x)
  np.testing.assert_allclose(tpu_reference(jnp.dot, a, x, matvec_f32=False),
                             one_pass, rtol=1e-5)
  assert not np.allclose(one_pass, exact, rtol=1e-5)
  return tpu_reference


# ---------------------------------------------------------------------------
# The solves.


def _problem(solver: str, rhs: str):
  rng = np.random.default_rng(0)
  m = rng.standard_normal((N, N))
  if solver == "cg":  # symmetric positive definite
    a = m @ m.T / N + np.eye(N)
  else:
    a = 3 * np.eye(N) + m / np.sqrt(N)
  b = rng.standard_normal((N, 4) if rhs == "matrix" else N)
  return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


def _solve(solver: str, operator: str, tol: float = 1e-6):
  def solve(a, b):
    if solver == "cg":
      tags, s = lx.positive_semidefinite_tag, lx.CG(rtol=tol, atol=tol,
                                                     max_steps=50)
    else:
      tags, s = (), lx.GMRES(rtol=tol, atol=tol, max_steps=50, restart=8)
    if operator == "matrix":
      op = lx.MatrixLinearOperator(a, tags)
    else:
      op = lx.FunctionLinearOperator(
          lambda v: a @ v, jax.ShapeDtypeStruct(b.shape, b.dtype), tags)
    return lx.linear_solve(op, b, s, throw=False).value
  return solve


def _emulate(fn, **options):
  """``fn`` emulated at one bfloat16 pass on a TPU, on the ``bf16`` kernel
  (bfloat16 dots, as the reference's) whatever the CPU."""
  emulated = jaxprec.emulate(fn, "bfloat16", target="tpu", **options)

  def run(*args):
    with jaxprec.use_kernel("bf16"):
      return emulated(*args)
  return run


# (solver, operator, right-hand side, tpu_matvec_f32): a vector right-hand
# side takes tpu_matvec_f32=False, else its matrix·vector products run in
# float32 and only the inner products (HIGHEST: six passes) are emulated.
CASES = [("cg", "function", "matrix", True), ("cg", "function", "vector", False),
         ("gmres", "function", "matrix", True),
         ("gmres", "function", "vector", False),
         ("gmres", "matrix", "vector", False)]
IDS = ["-".join(map(str, c[:3])) for c in CASES]


@pytest.mark.parametrize("solver, operator, rhs, matvec", CASES, ids=IDS)
def test_solve_is_audited_and_emulated_as_its_lowered_program(
    tpu, solver, operator, rhs, matvec):
  a, b = _problem(solver, rhs)
  solve = _solve(solver, operator)
  report = jaxprec.audit(solve, a, b)
  assert len(report.rows) == lowered_dots(solve, a, b) > 0
  assert all("linear_solve" in r.scope for r in report.rows)
  assert not report.opaque
  want = tpu(solve, a, b, matvec_f32=matvec)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    got = _emulate(solve, tpu_matvec_f32=matvec)(a, b)
    jitted = jax.jit(_emulate(solve, tpu_matvec_f32=matvec))(a, b)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(jitted, want)
  assert not np.array_equal(got, jax.jit(solve)(a, b))


def test_vmapped_gmres_is_emulated_as_its_lowered_program(tpu):
  # jax.vmap over the columns of a matrix right-hand side: lineax batches
  # linear_solve through Equinox's vprim primitive, whose implementation
  # binds vprim again for GMRES's least-squares solve; each matrix·vector
  # product becomes a matrix product (one bfloat16 pass).
  a, b = _problem("gmres", "matrix")
  solve = jax.vmap(_solve("gmres", "function"), in_axes=(None, 1),
                   out_axes=1)
  assert len(jaxprec.audit(solve, a, b).rows) == lowered_dots(solve, a, b)
  want = np.asarray(tpu(solve, a, b))
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    got = np.asarray(jax.jit(_emulate(solve))(a, b))
  native = np.asarray(jax.jit(solve)(a, b))
  # XLA:CPU may sum a batched dot's products in another order than the
  # reference's: within 2**-16 of the solution, where the native solve is
  # off by more than 2**-9.
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 2.0**-16 * scale
  assert np.abs(native - want).max() > 2.0**-9 * scale


GRAD_CASES = [("cg", "function", "matrix"), ("cg", "function", "vector"),
              ("gmres", "function", "vector")]


@pytest.mark.parametrize("solver, operator, rhs", GRAD_CASES,
                         ids=["-".join(c) for c in GRAD_CASES])
def test_solve_gradients_are_emulated_in_either_order(tpu, solver, operator,
                                                       rhs):
  # linear_solve's JVP solves again, and its transpose solves the transposed
  # operator (throw=True: tolerances a bfloat16 pass can reach).
  a, b = _problem(solver, rhs)
  solve = _solve(solver, operator, tol=1e-2)
  c = jnp.asarray(np.random.default_rng(2).standard_normal(b.shape),
                  jnp.float32)

  def loss(a, b):
    return jnp.sum(solve(a, b) * c)

  grad = jax.grad(loss, argnums=(0, 1))
  assert len(jaxprec.audit(grad, a, b).rows) == lowered_dots(grad, a, b)
  want = tpu(grad, a, b, matvec_f32=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    inner = jax.jit(_emulate(grad, tpu_matvec_f32=False))(a, b)
    outer = jax.jit(jax.grad(_emulate(loss, tpu_matvec_f32=False),
                             argnums=(0, 1)))(a, b)
  native = jax.jit(grad)(a, b)
  for i, o, w, n in zip(inner, outer, want, native):
    np.testing.assert_array_equal(i, w)
    np.testing.assert_array_equal(o, w)
    assert not np.array_equal(n, w)


def test_a_callback_inside_an_operator_is_named_and_warned(tpu):
  # A FunctionLinearOperator whose product is a host callback (a SciPy or
  # NumPy operator, say): jaxprec cannot see into it, and says so; the
  # solve's own inner products are emulated still.
  a, b = _problem("cg", "vector")
  host = np.asarray(a, np.float64)

  def solve(b):
    def mv(v):
      return jax.pure_callback(
          lambda v: (host @ v).astype(np.float32),
          jax.ShapeDtypeStruct(v.shape, v.dtype), v)
    op = lx.FunctionLinearOperator(
        mv, jax.ShapeDtypeStruct(b.shape, b.dtype),
        lx.positive_semidefinite_tag)
    return lx.linear_solve(op, b, lx.CG(rtol=1e-6, atol=1e-6, max_steps=50),
                           throw=False).value

  report = jaxprec.audit(solve, b)
  assert {o.primitive for o in report.opaque} == {"pure_callback"}
  assert all("linear_solve" in o.scope for o in report.opaque)
  with pytest.warns(jaxprec.OpaqueOpWarning, match="pure_callback"):
    got = _emulate(solve)(b)
  want = tpu(solve, b)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got, jax.jit(solve)(b))


def test_a_kernel_scope_reaches_the_dots_of_a_jitted_or_transposed_solve():
  # Under jax.jit, XLA lowers linear_solve after the traced function has
  # returned, and jax.grad transposes it then: outside the function's kernel
  # scope. The solve's dots still run on the kernel in force where it was
  # called, as they do eagerly.
  a, b = _problem("cg", "matrix")
  c = jnp.asarray(np.random.default_rng(2).standard_normal(b.shape),
                  jnp.float32)
  emulated = jaxprec.emulate(_solve("cg", "function", tol=1e-2), "bfloat16",
                             target="tpu")

  def loss(a, b):
    return jnp.sum(emulated(a, b) * c)

  def on(kernel, fn):
    def run(a, b):
      with jaxprec.use_kernel(kernel):
        return fn(a, b)
    return run

  eager = {k: on(k, emulated)(a, b) for k in ("bf16", "f32")}
  grads = {k: on(k, jax.grad(loss, argnums=(0, 1)))(a, b)
           for k in ("bf16", "f32")}
  assert not np.array_equal(eager["bf16"], eager["f32"])
  assert not np.array_equal(grads["bf16"][1], grads["f32"][1])
  for kernel in ("bf16", "f32"):
    np.testing.assert_array_equal(jax.jit(on(kernel, emulated))(a, b),
                                  eager[kernel])
    transposed = jax.grad(on(kernel, loss), argnums=(0, 1))(a, b)
    for got, want in zip(transposed, grads[kernel]):
      np.testing.assert_array_equal(got, want)
