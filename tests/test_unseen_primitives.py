"""Nothing unseen: every primitive is emulated, walked, or named out loud.

The walker's one table (jaxprec/_src/jaxpr/walker.py: ``classify``) holds
every primitive the installed JAX registers, so a new JAX primitive fails
here. A library's own primitive (Equinox's, lineax's ``linear_solve``) is
traced through its implementation (its ``mlir.lower_fun`` lowering or its
``impl``): its matmuls are audited and emulated; where it cannot be traced it
is named in the audit and the emulation warns. ``lax.ragged_dot`` is a dot:
audited with its groups and emulated bit for bit against a NumPy + ml_dtypes
reference of per-group dots, its gradients too.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import mlir

import jaxprec
from jaxprec._src.jaxpr import compat
from jaxprec._src.jaxpr import walker

import reference as ref

TABLE = {
    "matmul": frozenset(walker.PRIMITIVES),
    "higher_order": walker.HIGHER_ORDER,
    "opaque": walker.OPAQUE_PRIMITIVES,
    "kernel": walker.KERNEL_PRIMITIVES,
    "no_matmul": walker.NO_MATMUL,
    "jaxprec": walker.JAXPREC_PRIMITIVES,
    "traced": walker.JAX_TRACED,
}


# ---------------------------------------------------------------------------
# The table is complete and each primitive is in one class.


def test_every_registered_jax_primitive_is_in_exactly_one_class():
  registered = compat.registered_primitives()
  assert {"dot_general", "conv_general_dilated", "ragged_dot_general",
          "scan", "pallas_call", "cholesky"} <= set(registered)
  unclassified = sorted(n for n in registered
                        if walker.classify(n) == "traced"
                        and n not in walker.JAX_TRACED)
  assert not unclassified, (
      f"JAX {jax.__version__} registers primitives the walker's table "
      f"(jaxprec/_src/jaxpr/walker.py) does not name: {unclassified}")
  for name in registered:
    homes = [cls for cls, names in TABLE.items() if name in names]
    assert len(homes) == 1, (name, homes)


def test_classes_are_disjoint_and_classify_names_them():
  classes = list(TABLE.items())
  for i, (a, names_a) in enumerate(classes):
    for b, names_b in classes[i + 1:]:
      assert not names_a & names_b, (a, b, sorted(names_a & names_b))
  assert walker.classify("dot_general") == "matmul"
  assert walker.classify("ragged_dot_general") == "matmul"
  assert walker.classify("while") == "higher_order"
  assert walker.classify("scaled_dot") == "opaque"
  assert walker.classify("a_library_primitive") == "traced"
  assert set(walker.CLASSES) == set(TABLE)
  assert walker.classify("bcoo_dot_general") == "traced"


# ---------------------------------------------------------------------------
# A library's primitive whose implementation holds a matmul.


# The emulation tests below compute the matrix·vector products at one
# bfloat16 pass (tpu_matvec_f32=False): a TPU computes them in float32 at
# DEFAULT (numerics.tpu_matvec), which would hide whether they are emulated.


def _matvec_primitive(name="test_matvec", lowering=True, impl=True):
  """A primitive computing ``jnp.dot(a, x)`` (its impl and its
  ``mlir.lower_fun`` lowering), with JVP and transpose rules."""
  p = Primitive(name)

  def fn(a, x):
    return jnp.dot(a, x)

  if impl:
    p.def_impl(fn)
  p.def_abstract_eval(
      lambda a, x: jax.core.ShapedArray(a.shape[:1], a.dtype))
  if lowering:
    mlir.register_lowering(p, mlir.lower_fun(fn, multiple_results=False))
  ad.defbilinear(p, lambda ct, a, x: jnp.outer(ct, x),
                 lambda ct, a, x: jnp.dot(a.T, ct))
  return p, fn


MATVEC_P, MATVEC = _matvec_primitive()


def _operands(n=8, seed=0):
  rng = np.random.default_rng(seed)
  a = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
  x = jnp.asarray(rng.standard_normal(n), jnp.float32)
  return a, x


def _with_primitive(a, x):
  return jnp.sin(MATVEC_P.bind(a, x))


def _inlined(a, x):
  return jnp.sin(MATVEC(a, x))


def test_library_primitive_is_audited():
  a, x = _operands()
  report = jaxprec.audit(_with_primitive, a, x)
  assert [r.primitive for r in report.rows] == ["dot_general"]
  row = report.rows[0]
  assert row.scope == ("test_matvec",)
  assert (row.lhs_shape, row.rhs_shape, row.flops) == ((8, 8), (8,), 128)
  # A matrix·vector product: float32 on a TPU at DEFAULT (the shape rule).
  assert row.tpu == "f32" and row.tpu_shape_rule and not report.opaque


def test_library_primitive_is_emulated_as_its_inlined_program():
  a, x = _operands()
  native = _with_primitive(a, x)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    got = jaxprec.emulate(_with_primitive, "bfloat16", target="tpu", tpu_matvec_f32=False)(a, x)
    jitted = jax.jit(jaxprec.emulate(_with_primitive, "bfloat16",
                                     target="tpu", tpu_matvec_f32=False))(a, x)
  want = jaxprec.emulate(_inlined, "bfloat16", target="tpu", tpu_matvec_f32=False)(a, x)
  assert not np.array_equal(got, native)  # not run natively
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(jitted, want)
  # Independent: one bfloat16 pass is the dot of bfloat16-rounded operands.
  exact = ref.round_bf16(np.asarray(a)).astype(np.float64) @ ref.round_bf16(
      np.asarray(x)).astype(np.float64)
  np.testing.assert_allclose(np.asarray(got), np.sin(exact), rtol=0,
                             atol=1e-5)


def test_library_primitive_gradients_are_emulated_in_either_order():
  a, x = _operands()

  def loss(a, x):
    return jnp.sum(_with_primitive(a, x) ** 2)

  native = jax.grad(loss, argnums=(0, 1))(a, x)
  outer = jax.grad(jaxprec.emulate(loss, "bfloat16", target="tpu", tpu_matvec_f32=False),
                   argnums=(0, 1))(a, x)
  inner = jaxprec.emulate(jax.grad(loss, argnums=(0, 1)), "bfloat16",
                          target="tpu", tpu_matvec_f32=False)(a, x)
  for o, i, n in zip(outer, inner, native):
    np.testing.assert_array_equal(o, i)
    assert not np.array_equal(o, n)


def test_library_primitive_keeps_its_own_batching_rule():
  # A primitive that batches in its own way (as Equinox's unvmap_any does)
  # keeps it: vmap of the emulated function batches the primitive, not its
  # implementation.
  p, fn = _matvec_primitive("test_matvec_batched")
  calls = []

  def batch(args, dims):
    calls.append(dims)
    a, x = args
    return jax.vmap(fn, in_axes=dims)(a, x) + 1.0, 0

  jax.interpreters.batching.primitive_batchers[p] = batch
  a, x = _operands()
  xs = jnp.stack([x, 2 * x])
  f = jaxprec.emulate(lambda a, x: p.bind(a, x), "bfloat16", target="tpu", tpu_matvec_f32=False)
  got = jax.vmap(f, in_axes=(None, 0))(a, xs)
  want = jax.vmap(jaxprec.emulate(fn, "bfloat16", target="tpu", tpu_matvec_f32=False),
                  in_axes=(None, 0))(a, xs) + 1.0
  assert calls
  np.testing.assert_array_equal(got, want)


def test_library_primitive_without_matmul_is_bound_as_recorded():
  p = Primitive("test_twice")
  p.def_impl(lambda x: 2 * x)
  p.def_abstract_eval(lambda x: x)
  mlir.register_lowering(p, mlir.lower_fun(lambda x: 2 * x,
                                           multiple_results=False))
  f = jaxprec.emulate(lambda x: p.bind(x), "bfloat16", target="tpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    text = str(jax.make_jaxpr(f)(jnp.ones(3)))
    assert float(f(jnp.ones(3))[0]) == 2.0
  assert "test_twice" in text and "jaxprec_traced" not in text


def test_untraceable_library_primitive_is_named_and_warned():
  # A hand-written MLIR lowering and an impl that binds the primitive
  # itself: no implementation in JAX ops to walk.
  from jax._src import dispatch  # the way JAX's own primitives define impl
  p = Primitive("test_opaque_matvec")
  p.def_impl(functools.partial(dispatch.apply_primitive, p))
  p.def_abstract_eval(
      lambda a, x: jax.core.ShapedArray(a.shape[:1], a.dtype))

  def lowering(ctx, a, x):  # noqa: ARG001
    return mlir.lower_fun(jnp.dot, multiple_results=False)(ctx, a, x)

  mlir.register_lowering(p, lowering)
  a, x = _operands()
  report = jaxprec.audit(lambda a, x: p.bind(a, x), a, x)
  assert [o.name for o in report.opaque] == [
      "test_opaque_matvec (implementation not traceable)"]
  assert "test_opaque_matvec" in str(report)
  f = jaxprec.emulate(lambda a, x: p.bind(a, x), "bfloat16", target="tpu")
  with pytest.warns(jaxprec.OpaqueOpWarning, match="test_opaque_matvec"):
    out = f(a, x)
  np.testing.assert_array_equal(out, jnp.dot(a, x))
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    f(a, x)  # warned once per emulated function


# ---------------------------------------------------------------------------
# Callbacks that provably hold no matmul.


def test_matmul_free_error_callbacks_stay_quiet_and_user_callbacks_warn():
  def raises(index):  # as equinox/_errors.py names its error check
    return index

  raises.__module__ = "equinox._errors"
  raises.__qualname__ = "_error.<locals>.raises"

  def user(index):
    return index

  def f(x, cb):
    y = jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return y @ x

  x = jnp.ones((2, 2))
  assert not jaxprec.audit(f, x, raises).opaque
  assert [o.primitive for o in jaxprec.audit(f, x, user).opaque] == [
      "pure_callback"]
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    jaxprec.emulate(f, "bfloat16", target="tpu")(x, raises)
  with pytest.warns(jaxprec.OpaqueOpWarning, match="user"):
    jaxprec.emulate(f, "bfloat16", target="tpu")(x, user)


def test_equinox_error_if_stays_quiet():
  eqx = pytest.importorskip("equinox")

  def f(x):
    x = eqx.error_if(x, x < -100, "too small")
    return x @ x

  x = jnp.ones((3, 3))
  assert not jaxprec.audit(f, x).opaque
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    out = jaxprec.emulate(f, "bfloat16", target="tpu")(x)
  np.testing.assert_array_equal(out, 3 * np.ones((3, 3)))


# ---------------------------------------------------------------------------
# lineax's linear_solve (an Equinox primitive lowered with mlir.lower_fun).


def _inline_library_primitives(fn):
  """``fn`` with every library primitive replaced by its implementation,
  as XLA lowers it."""
  def rule(eqn, invals):
    if walker.classify(eqn.primitive.name) == "traced":
      impl = walker.implementation(eqn)
      if impl is not None:
        return walker.interpret(impl, rule, *invals)
    return None

  def inlined(*args):
    closed = jax.make_jaxpr(fn)(*args)
    return walker.interpret(closed, rule, *args)[0]
  return inlined


def test_lineax_cg_solve_is_audited_and_emulated():
  lx = pytest.importorskip("lineax")
  rng = np.random.default_rng(0)
  m = rng.standard_normal((16, 16))
  a = jnp.asarray(m @ m.T / 16 + np.eye(16), jnp.float32)
  b = jnp.asarray(rng.standard_normal(16), jnp.float32)

  def solve(a, b):
    op = lx.MatrixLinearOperator(a, lx.positive_semidefinite_tag)
    return lx.linear_solve(op, b, lx.CG(rtol=1e-5, atol=1e-5,
                                        max_steps=200), throw=False).value

  report = jaxprec.audit(solve, a, b)
  hlo = jax.jit(solve).lower(a, b).as_text()
  assert len(report.rows) == hlo.count("stablehlo.dot_general") > 0
  assert all("linear_solve" in r.scope for r in report.rows)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    got = jaxprec.emulate(solve, "bfloat16", target="tpu")(a, b)
  want = jaxprec.emulate(_inline_library_primitives(solve), "bfloat16",
                         target="tpu")(a, b)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got, solve(a, b))


# ---------------------------------------------------------------------------
# lax.ragged_dot.

GROUPS = np.array([2, 0, 3, 1], np.int32)  # an empty group; 6 of 7 rows


def _values(shape, rng):
  """float32 values with 12 significant bits in [1, 4): rounding to
  bfloat16 changes them, and every sum of a few bfloat16 products is exact
  in float32 (so any summation order gives the reference's bits)."""
  m = rng.integers(2**11, 2**12, size=shape) * 2.0**-11
  sign = rng.choice([-1.0, 1.0], size=shape)
  return (sign * m * rng.choice([1.0, 2.0], size=shape)).astype(np.float32)


def _ragged_reference(lhs, rhs, groups):
  """Per-group dots of bfloat16-rounded operands in float64, rounded once
  to float32 (exact here); rows past the groups are zero."""
  lo, hi = ref.round_bf16(lhs).astype(np.float64), ref.round_bf16(
      rhs).astype(np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(groups):
    out[start:start + size] = lo[start:start + size] @ hi[g]
    start += size
  return out.astype(np.float32)


def _ragged_operands(seed=0):
  rng = np.random.default_rng(seed)
  return (_values((7, 4), rng), _values((4, 4, 5), rng),
          _values((7, 5), rng))


def _ragged(lhs, rhs):
  return jax.lax.ragged_dot(lhs, rhs, jnp.asarray(GROUPS))


def test_ragged_dot_is_audited_with_its_groups():
  lhs, rhs, _ = _ragged_operands()
  report = jaxprec.audit(_ragged, lhs, rhs)
  (row,) = report.rows
  assert row.primitive == "ragged_dot_general" and row.groups == 4
  assert row.flops == 2 * 7 * 4 * 5  # each row meets one group's rhs
  assert row.tpu == "bf16x1" and row.risky
  assert "ragged, 4 groups" in str(report)


def test_ragged_dot_is_emulated_bit_exact():
  lhs, rhs, _ = _ragged_operands()
  got = jaxprec.emulate(_ragged, "bfloat16", target="tpu")(lhs, rhs)
  want = _ragged_reference(lhs, rhs, GROUPS)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert not np.array_equal(np.asarray(_ragged(lhs, rhs)), want)
  # An explicit precision= on the op wins over emulate's: six passes.
  six = jaxprec.emulate(
      lambda l, r: jax.lax.ragged_dot(l, r, jnp.asarray(GROUPS),
                                      precision="highest"),
      "bfloat16", target="tpu")(lhs, rhs)
  np.testing.assert_allclose(six, _ragged(lhs, rhs), rtol=0, atol=1e-5)
  assert not np.array_equal(six, got)


def test_ragged_dot_gradients_are_emulated_bit_exact_in_either_order():
  lhs, rhs, c = _ragged_operands()

  def loss(lhs, rhs):
    return jnp.sum(_ragged(lhs, rhs) * c)

  grad = jax.grad(loss, argnums=(0, 1))
  outer = jax.grad(jaxprec.emulate(loss, "bfloat16", target="tpu"),
                   argnums=(0, 1))(lhs, rhs)
  inner = jaxprec.emulate(grad, "bfloat16", target="tpu")(lhs, rhs)
  lo, hi, co = (ref.round_bf16(v).astype(np.float64) for v in (lhs, rhs, c))
  dlhs, drhs = np.zeros(lhs.shape), np.zeros(rhs.shape)
  start = 0
  for g, size in enumerate(GROUPS):
    rows = slice(start, start + size)
    dlhs[rows] = co[rows] @ hi[g].T
    drhs[g] = lo[rows].T @ co[rows]
    start += size
  for got in (outer, inner):
    np.testing.assert_array_equal(np.asarray(got[0]), dlhs.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), drhs.astype(np.float32))


def test_check_sees_ragged_dot_divergence():
  lhs, rhs, _ = _ragged_operands()
  lhs = lhs * np.float32(1 + 2.0**-10)  # off the bfloat16 grid
  report = jaxprec.check(lambda l, r: {"out": _ragged(l, r)}, lhs, rhs,
                         precisions=["bfloat16"])
  assert report.metric("rel_rms", "bfloat16")[0] > 1e-4


# A TPU's grouped matmul: each row meets its own group's weights only.


def _grouped_reference(lhs, rhs, groups, round_operands=True):
  """Per-group NumPy dots (bfloat16-rounded operands, float64 sums rounded
  once to float32; exact for :func:`_values`), each row with its own
  group's rhs only; inf and NaN propagate as IEEE says; rows past the
  groups are zero."""
  lo, hi = lhs.astype(np.float64), rhs.astype(np.float64)
  if round_operands:
    lo, hi = (ref.round_bf16(v).astype(np.float64) for v in (lhs, rhs))
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  with np.errstate(invalid="ignore", over="ignore"):
    for g, size in enumerate(groups):
      out[start:start + size] = lo[start:start + size] @ hi[g]
      start += size
  return out.astype(np.float32)


def test_ragged_dot_other_groups_inf_and_nan_stay_out_of_a_row():
  lhs, rhs, _ = _ragged_operands()
  rhs = rhs.copy()
  rhs[1] = np.inf  # the empty group
  rhs[3, :, 0] = np.nan  # group 3 (row 5) only
  want = _grouped_reference(lhs, rhs, GROUPS)
  assert np.isnan(want).sum() == 1 and np.isfinite(want[6]).all()
  for precision in ("bfloat16", "float32"):
    got = np.asarray(jaxprec.emulate(_ragged, precision, target="tpu")(
        lhs, rhs))
    if precision == "bfloat16":
      np.testing.assert_array_equal(got, want)
    else:
      assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[6], np.zeros(5, np.float32))
  # XLA:GPU computes JAX's dense form: a masked zero times inf is NaN.
  gpu = np.asarray(jaxprec.emulate(_ragged, "bfloat16", target="gpu")(
      lhs, rhs))
  assert np.isnan(gpu).all()


def test_ragged_dot_rows_are_bit_for_bit_one_emulated_dot_each():
  rng = np.random.default_rng(3)
  lhs = rng.standard_normal((7, 33)).astype(np.float32)
  rhs = rng.standard_normal((4, 33, 6)).astype(np.float32)
  for precision in ("bfloat16", "bfloat16_3x", "tensorfloat32"):
    got = np.asarray(jaxprec.emulate(_ragged, precision, target="tpu")(
        lhs, rhs))
    start = 0
    for g, size in enumerate(GROUPS):
      one = np.asarray(jaxprec.emulate(jnp.dot, precision, target="tpu")(
          lhs, rhs[g]))
      np.testing.assert_array_equal(got[start:start + size],
                                    one[start:start + size])
      start += size
    np.testing.assert_array_equal(got[start:], 0.0)


def test_ragged_dot_keeps_a_rows_negative_zero():
  # k = 1: one product per element, -1 x +0 = -0, as one emulated dot of
  # the row against its group's matrix gives it.
  lhs = -np.ones((7, 1), np.float32)
  rhs = np.zeros((4, 1, 5), np.float32)
  got = np.asarray(jaxprec.emulate(_ragged, "bfloat16", target="tpu")(
      lhs, rhs))
  one = np.asarray(jaxprec.emulate(jnp.dot, "bfloat16", target="tpu")(
      lhs, rhs[0]))
  assert np.signbit(one).all()  # the per-row reference
  np.testing.assert_array_equal(np.signbit(got[:6]), True)
  np.testing.assert_array_equal(np.signbit(got[6]), False)  # past the groups


def test_ragged_dot_gradients_keep_other_groups_inf_out_in_either_order():
  lhs, rhs, c = _ragged_operands()
  rhs = rhs.copy()
  rhs[1] = np.inf  # the empty group's weights

  def loss(lhs, rhs):
    return jnp.sum(_ragged(lhs, rhs) * c)

  grad = jax.grad(loss, argnums=(0, 1))
  outer = jax.grad(jaxprec.emulate(loss, "bfloat16", target="tpu"),
                   argnums=(0, 1))(lhs, rhs)
  inner = jaxprec.emulate(grad, "bfloat16", target="tpu")(lhs, rhs)
  lo, hi, co = (ref.round_bf16(v).astype(np.float64) for v in (lhs, rhs, c))
  dlhs, drhs = np.zeros(lhs.shape), np.zeros(rhs.shape)
  start = 0
  for g, size in enumerate(GROUPS):
    rows = slice(start, start + size)
    dlhs[rows] = co[rows] @ hi[g].T
    drhs[g] = lo[rows].T @ co[rows]
    start += size
  for got in (outer, inner):
    np.testing.assert_array_equal(np.asarray(got[0]), dlhs.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), drhs.astype(np.float32))


def test_ragged_dot_general_forms_match_per_group_references():
  rng = np.random.default_rng(5)
  gs = np.array([1, 3, 0], np.int32)  # 4 of 5
  # The rhs's group dimension in the middle: [k, g, n].
  lhs, rhs = _values((5, 4), rng), _values((4, 3, 2), rng)
  rhs[:, 2] = np.nan  # the empty group
  dims = jax.lax.RaggedDotDimensionNumbers((([1], [0]), ([], [])), [0], [1])
  f = lambda l, r: jax.lax.ragged_dot_general(l, r, jnp.asarray(gs), dims)
  got = jaxprec.emulate(f, "bfloat16", target="tpu")(lhs, rhs)
  np.testing.assert_array_equal(
      np.asarray(got), _grouped_reference(lhs, np.moveaxis(rhs, 1, 0), gs))
  # vmap: batch dimensions and a group_sizes per batch element.
  lb, rb = _values((2, 7, 4), rng), _values((2, 4, 4, 5), rng)
  gb = np.array([[2, 0, 3, 1], [0, 7, 0, 0]], np.int32)
  rb[0, 1] = np.inf
  rb[1, 0] = np.nan
  got = jax.vmap(jaxprec.emulate(
      lambda l, r, g: jax.lax.ragged_dot(l, r, g), "bfloat16",
      target="tpu"))(lb, rb, gb)
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(got[i]),
                                  _grouped_reference(lb[i], rb[i], gb[i]))
  # The ragged dimension contracted (the weights' gradient): [g, m, n], each
  # group the dot of its own k range; both operands masked, so a NaN in
  # another group's columns stays out.
  lc, rcn = _values((3, 6), rng), _values((6, 2), rng)
  lc[:, 0] = np.nan  # group 0's column only
  cdims = jax.lax.RaggedDotDimensionNumbers((([1], [0]), ([], [])), [1], [])
  gc = np.array([1, 2, 3], np.int32)
  got = jaxprec.emulate(
      lambda l, r: jax.lax.ragged_dot_general(l, r, jnp.asarray(gc), cdims),
      "bfloat16", target="tpu")(lc, rcn)
  lo, hi = (ref.round_bf16(v).astype(np.float64) for v in (lc, rcn))
  want = np.stack([lo[:, s:e] @ hi[s:e] for s, e in ((0, 1), (1, 3), (3, 6))])
  np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))


# The emulated program, read back: audit and cost see inside.


def test_audit_of_an_emulated_function_sees_inside_traced_ops():
  # A library primitive and a ragged dot become jaxprec's own traced op
  # under emulate; the audit and the cost of the emulated function count
  # the passes inside it, as for the inlined program (they found none).
  a, x = _operands()
  lhs, rhs, _ = _ragged_operands()
  for f, g, args in ((_with_primitive, _inlined, (a, x)),
                     (_ragged, None, (lhs, rhs))):
    rows = jaxprec.audit(jaxprec.emulate(f, "bfloat16", target="tpu"),
                         *args).rows
    assert rows and all(r.emulated for r in rows)
    if g is not None:
      want = jaxprec.audit(jaxprec.emulate(g, "bfloat16", target="tpu"),
                           *args).rows
      assert [(r.lhs_shape, r.rhs_shape) for r in rows] == [
          (r.lhs_shape, r.rhs_shape) for r in want]
  one = jaxprec.audit(jaxprec.emulate(jnp.dot, "float32", target="tpu"),
                      lhs, rhs[0]).rows  # one emulated dot per group
  assert len(jaxprec.audit(jaxprec.emulate(_ragged, "float32", target="tpu"),
                           lhs, rhs).rows) == len(one) * len(GROUPS)


def test_an_implementation_that_raised_is_traced_again():
  state = {"raise": True}

  def fn(a, x):
    if state["raise"]:
      raise RuntimeError("not yet")
    return jnp.dot(a, x)

  p = Primitive("test_flaky_matvec")
  p.def_impl(fn)
  p.def_abstract_eval(
      lambda a, x: jax.core.ShapedArray(a.shape[:1], a.dtype))
  mlir.register_lowering(p, mlir.lower_fun(fn, multiple_results=False))
  a, x = _operands()
  first = jaxprec.audit(lambda a, x: p.bind(a, x), a, x)
  assert [o.name for o in first.opaque] == [
      "test_flaky_matvec (implementation not traceable)"]
  state["raise"] = False
  second = jaxprec.audit(lambda a, x: p.bind(a, x), a, x)
  assert [r.primitive for r in second.rows] == ["dot_general"]
  assert not second.opaque


def test_nested_multi_result_and_looping_library_primitives():
  def prim(name, fn, multiple=False):
    p = Primitive(name)
    p.multiple_results = multiple
    p.def_impl(fn)

    def aval(*avals, **params):
      out = jax.eval_shape(functools.partial(fn, **params), *avals)
      return jax.tree.map(lambda o: jax.core.ShapedArray(o.shape, o.dtype),
                          out)
    p.def_abstract_eval(aval)
    mlir.register_lowering(p, mlir.lower_fun(fn, multiple_results=multiple))
    return p

  def looping(a, x, *, n):
    c, _ = jax.lax.scan(lambda c, _: (jnp.tanh(a @ c), None), x, None,
                        length=n)
    return jax.lax.cond(c[0] > 0, lambda c: a @ c, lambda c: -c, c)

  outer_fn = lambda a, x: jnp.sin(MATVEC_P.bind(a, x))  # noqa: E731
  nested = prim("test_nested_matvec", outer_fn)
  multi = prim("test_two_matvecs", lambda a, x: [a @ x, x @ a], True)
  loop = prim("test_looping_matvec", looping)
  a, x = _operands()
  for f, g, dots in (
      (lambda a, x: nested.bind(a, x), outer_fn, 1),
      (lambda a, x: multi.bind(a, x), lambda a, x: [a @ x, x @ a], 2),
      (lambda a, x: loop.bind(a, x, n=3), functools.partial(looping, n=3),
       2)):
    assert len(jaxprec.audit(f, a, x).rows) == dots
    got = jax.jit(jaxprec.emulate(f, "bfloat16", target="tpu"))(a, x)
    want = jaxprec.emulate(g, "bfloat16", target="tpu")(a, x)
    jax.tree.map(np.testing.assert_array_equal, got, want)


# ---------------------------------------------------------------------------
# A policy's module precision and a library primitive's matmuls.


def test_jax_lowers_a_library_primitives_matmul_at_the_call_sites_flag():
  # The fact the emulation follows: lower_fun traces the implementation when
  # the program is lowered, under the flag in force at the call, not under
  # the flag in force where the primitive was bound.
  a, x = _operands()

  def f(a, x):
    with jax.default_matmul_precision("float32"):
      return MATVEC_P.bind(a, x), jnp.dot(a, x)

  with jax.default_matmul_precision("tensorfloat32"):
    text = jax.jit(f).lower(a, x).as_text()
  precisions = [line.split("precision = ")[1].split("]")[0] + "]"
                for line in text.splitlines() if "dot_general" in line]
  assert sorted(precisions) == ["[HIGH, HIGH]", "[HIGHEST, HIGHEST]"]


def test_a_policy_rule_cannot_reach_a_library_primitives_matmul_and_says_so():
  from flax import nnx

  class Block(nnx.Module):

    def __init__(self, a):
      self.a = nnx.Param(a)

    def __call__(self, x):
      return MATVEC_P.bind(self.a[...], x)

  class Model(nnx.Module):

    def __init__(self, a):
      self.blk = Block(a)
      self.out = nnx.Linear(8, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.out(jnp.sin(self.blk(x)))

  a, x = _operands()
  model = Model(a)
  policy = "default=bfloat16,blk(/.*)?=float32"
  with pytest.warns(jaxprec.PolicyUnreachedWarning,
                    match=r"inside test_matvec .* \('bfloat16', the policy"):
    got = jaxprec.emulate(model, policy, target="tpu", tpu_matvec_f32=False)(x)
  # As the TPU computes it: the block's matmul at the call's bfloat16, the
  # rest as the policy says (the head is not in blk: bfloat16 too).
  want = jaxprec.emulate(model, "bfloat16", target="tpu", tpu_matvec_f32=False)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Independently: every matmul one bfloat16 pass (operands rounded to
  # bfloat16, products summed in float64 here).
  bf16 = lambda v: np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float64)
  h = np.sin(bf16(a) @ bf16(x)).astype(np.float32)
  expected = bf16(h) @ bf16(model.out.kernel[...]) + np.asarray(
      model.out.bias[...])
  np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-6)
  assert np.max(np.abs(np.asarray(got) - np.asarray(model(x)))) > 1e-4
  # Nothing to say where no rule could decide it, or the matmul has its own.
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.PolicyUnreachedWarning)
    jaxprec.emulate(model, "default=bfloat16", target="tpu", tpu_matvec_f32=False)(x)
    jaxprec.emulate(_with_primitive, "bfloat16", target="tpu", tpu_matvec_f32=False)(a, x)


def test_a_sparse_matmul_of_jax_experimental_sparse_is_audited_and_emulated():
  # bcoo_dot_general lowers through mlir.lower_fun on CPU and TPU: its
  # implementation's matmul is what the TPU runs, at the precision in force.
  from jax.experimental import sparse

  a, x = _operands()
  m = sparse.BCOO.fromdense(a)

  def f(m, x):
    return m @ x

  assert [r.primitive for r in jaxprec.audit(f, m, x).rows] == ["dot_general"]
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.OpaqueOpWarning)
    got = jaxprec.emulate(f, "bfloat16", target="tpu", tpu_matvec_f32=False)(m, x)
  # Independently: every product of bfloat16-rounded operands, summed.
  bf16 = lambda v: np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float64)
  np.testing.assert_allclose(np.asarray(got), bf16(a) @ bf16(x), rtol=1e-5,
                             atol=1e-5)
  assert np.max(np.abs(np.asarray(got) - np.asarray(f(m, x)))) > 1e-3


def _jax_implemented(name):
  """A library's primitive whose implementation is JAX's own ``jnp.dot``:
  no frame of the trace is a library's or the user's."""
  p = Primitive(name)
  p.def_impl(jnp.dot)
  p.def_abstract_eval(lambda a, x: jax.core.ShapedArray(a.shape[:1], a.dtype))
  mlir.register_lowering(p, mlir.lower_fun(jnp.dot, multiple_results=False))
  return p


JAX_IMPLEMENTED_P = _jax_implemented("test_jax_implemented_matvec")


def _calls_the_library(a, x):
  return JAX_IMPLEMENTED_P.bind(a, x)  # the user's call site


def test_a_row_inside_a_library_primitive_names_the_users_call_site():
  a, x = _operands()
  (row,) = jaxprec.audit(_calls_the_library, a, x).rows
  line = _calls_the_library.__code__.co_firstlineno + 1
  assert row.scope == ("test_jax_implemented_matvec",)
  assert row.op == f"_calls_the_library ({__file__}:{line})"
  assert row.source == f"{__file__}:{line}"
  assert "_trace_implementation" not in str(jaxprec.audit(_calls_the_library, a, x))
