"""The shared jaxpr walker: read-only walk and rewriting interpreter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.jaxpr import walker


@jax.custom_jvp
def cj(x):
  return x @ x


@cj.defjvp
def _cj_jvp(p, t):
  (x,), (tx,) = p, t
  return cj(x), tx @ x + x @ tx


@jax.custom_vjp
def cv(x):
  return x @ x


def _cv_fwd(x):
  return x @ x, x


def _cv_bwd(x, g):
  return (g @ x.T + x.T @ g,)


cv.defvjp(_cv_fwd, _cv_bwd)


def nested(x, *, use_while=True):
  y = jax.jit(lambda a: a @ a)(x)
  y = jax.checkpoint(lambda a: a @ a)(y)
  y, _ = lax.scan(lambda c, _: (c @ c, None), y, None, length=3)
  if use_while:
    y = lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0] @ c[0], c[1] + 1), (y, 0))[0]
  y = lax.cond(y.sum() > 0, lambda a: a @ a, lambda a: a, y)
  return cj(y) + cv(y)


def _rotation(a, b):
  ca, sa, cb, sb = np.cos(a), np.sin(a), np.cos(b), np.sin(b)
  rz = np.array([[ca, -sa, 0], [sa, ca, 0], [0, 0, 1]])
  rx = np.array([[1, 0, 0], [0, cb, -sb], [0, sb, cb]])
  return jnp.asarray(rz @ rx, jnp.float32)


# A rotation: its powers stay bounded, so nested products stay informative.
X = _rotation(0.3, 0.7)


def double_dots(eqn, invals):
  """A rule that visibly changes every dot: doubles its result."""
  if eqn.primitive is lax.dot_general_p:
    return [lax.dot_general(*invals, **eqn.params) * 2]
  return None


def keep(eqn, invals):
  return None


def dot_scopes(closed):
  return [(w.scope, w.trip_count) for w in walker.iter_eqns(closed)
          if w.eqn.primitive is lax.dot_general_p]


def test_iter_eqns_reaches_every_nested_jaxpr_with_trip_counts():
  closed = jax.make_jaxpr(nested)(X)
  assert dot_scopes(closed) == [
      (("jit",), 1), (("remat2",), 1), (("scan",), 3), (("while",), 1),
      (("cond",), 1), (("custom_jvp_call",), 1), (("custom_vjp_call",), 1)]
  # Nested scans multiply their lengths.
  f = lambda x: lax.scan(lambda c, _: (lax.scan(lambda d, _: (d @ d, None), c, None,
                                                length=4)[0], None), x, None, length=5)[0]
  assert dot_scopes(jax.make_jaxpr(f)(X)) == [(("scan", "scan"), 20)]


def test_identity_rule_reproduces_values_and_structure():
  closed = jax.make_jaxpr(nested)(X)
  out = walker.interpret(closed, keep, X)[0]
  np.testing.assert_array_equal(out, nested(X))
  re_traced = walker.transform(closed, keep)
  assert [e.primitive.name for e in re_traced.jaxpr.eqns] == \
      [e.primitive.name for e in closed.jaxpr.eqns]


def test_rule_applies_at_every_depth_and_structure_is_kept():
  closed = jax.make_jaxpr(nested)(X)
  new = walker.transform(closed, double_dots)
  # Still a jit, a remat, a scan, a while, a cond, a custom_jvp and custom_vjp.
  names = [e.primitive.name for e in new.jaxpr.eqns]
  for prim in ("jit", "remat2", "scan", "while", "cond", "custom_jvp_call",
               "custom_vjp_call"):
    assert prim in names
  # Every dot (7 sites) is followed by the rule's multiply.
  muls = [w for w in walker.iter_eqns(new) if w.eqn.primitive.name == "mul"]
  assert len(muls) >= 7
  f = lambda x: lax.cond(x.sum() > 0, lambda a: jax.jit(lambda b: b @ b)(a),
                         lambda a: a, x)
  np.testing.assert_allclose(
      walker.interpret(jax.make_jaxpr(f)(X), double_dots, X)[0], 2 * (X @ X),
      rtol=1e-6)


def test_scan_body_rewrite_value_matches_manual():
  f = lambda x: lax.scan(lambda c, _: (c @ c, None), x, None, length=2)[0]
  got = walker.interpret(jax.make_jaxpr(f)(X), double_dots, X)[0]
  want = 2 * ((2 * (X @ X)) @ (2 * (X @ X)))
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_derivative_rules_of_custom_jvp_and_vjp_are_rewritten_too():
  for fn, manual in [(cj, lambda x, g: 2 * (g @ x.T + x.T @ g)),
                     (cv, lambda x, g: 2 * (g @ x.T + x.T @ g))]:
    closed = jax.make_jaxpr(fn)(X)
    g = jax.grad(lambda x: walker.interpret(closed, double_dots, x)[0].sum())(X)
    np.testing.assert_allclose(g, manual(X, jnp.ones_like(X)), rtol=1e-5)


def test_rule_creating_constants_inside_loops_and_branches():
  big = np.linspace(0, 1, 9, dtype=np.float32).reshape(3, 3)

  def add_const(eqn, invals):  # closes over a non-scalar constant
    if eqn.primitive is lax.dot_general_p:
      return [lax.dot_general(*invals, **eqn.params) + jnp.asarray(big)]
    return None

  f = lambda x: nested(x, use_while=True)
  closed = jax.make_jaxpr(f)(X)
  got = jax.jit(lambda x: walker.interpret(closed, add_const, x)[0])(X)
  np.testing.assert_allclose(got, walker.interpret(closed, add_const, X)[0], rtol=1e-5)
  h = lambda x: lax.scan(lambda c, _: (c @ X, None), x, None, length=2)[0]
  v = walker.interpret(jax.make_jaxpr(h)(X), add_const, X)[0]
  np.testing.assert_allclose(v, (X @ X + big) @ X + big, rtol=1e-5)
  w = lambda x: lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0] @ X, c[1] + 1),
                               (x, 0))[0]
  v = walker.interpret(jax.make_jaxpr(w)(X), add_const, X)[0]
  np.testing.assert_allclose(v, (X @ X + big) @ X + big, rtol=1e-5)
  g = lambda x: lax.cond(x.sum() > 0, lambda a: a @ a, lambda a: a @ a.T, x)
  for sign in (1, -1):
    v = walker.interpret(jax.make_jaxpr(g)(sign * X), add_const, sign * X)[0]
    np.testing.assert_allclose(v, g(sign * X) + big, rtol=1e-6)


def test_under_jit_grad_vmap():
  closed = jax.make_jaxpr(lambda x: nested(x, use_while=False))(X)
  f = lambda x: walker.interpret(closed, keep, x)[0]
  np.testing.assert_allclose(jax.jit(f)(X), nested(X, use_while=False), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(X),
                             jax.grad(lambda x: nested(x, use_while=False).sum())(X),
                             rtol=1e-5)
  xs = jnp.stack([X, -X])
  np.testing.assert_allclose(jax.vmap(f)(xs),
                             jax.vmap(lambda x: nested(x, use_while=False))(xs),
                             rtol=1e-6)


def test_source_info_and_name_stack_survive_rewriting():
  def f(x):
    with jax.named_scope("layer1"):
      return x @ x
  closed = jax.make_jaxpr(f)(X)
  new = walker.transform(closed, keep)
  (eqn,) = [e for e in new.jaxpr.eqns if e.primitive is lax.dot_general_p]
  assert "layer1" in str(eqn.source_info.name_stack)


def test_trace_call_caches_by_signature_and_static_args():
  calls = []

  def f(x, n, *, scale):
    calls.append(1)
    return {"y": x * n * scale}
  cache = {}
  a = walker.trace_call(f, (X, 2), {"scale": 3.0}, cache)
  b = walker.trace_call(f, (X + 1, 2), {"scale": 3.0}, cache)
  assert len(calls) == 1 and a.jaxpr is b.jaxpr
  out = b.unflatten(walker.interpret(b.jaxpr, keep, *b.dynamic))
  np.testing.assert_allclose(out["y"], (X + 1) * 6)
  walker.trace_call(f, (X, 3), {"scale": 3.0}, cache)
  walker.trace_call(f, (X[:2], 2), {"scale": 3.0}, cache)
  assert len(calls) == 3
  # Unhashable static values still work, uncached.
  walker.trace_call(lambda x, l: x * len(l), (X, [1, 2]), {}, cache)


def test_wrong_arity_is_reported():
  closed = jax.make_jaxpr(lambda x: x @ x)(X)
  with pytest.raises(TypeError, match="takes 1 inputs, got 2"):
    walker.interpret(closed, keep, X, X)


def test_trace_call_keys_on_the_jax_trace_context():
  # A trace made under one precision flag (or x64) is not reused under another.
  calls = []

  def f(x):
    calls.append(jax.config.jax_default_matmul_precision)
    return x @ x
  cache = {}
  a = walker.trace_call(f, (X,), {}, cache)
  with jax.default_matmul_precision("float32"):
    b = walker.trace_call(f, (X,), {}, cache)
  with jax.enable_x64(True):
    walker.trace_call(f, (X,), {}, cache)
  walker.trace_call(f, (X,), {}, cache)
  assert calls == [None, "float32", None]
  precs = [j.jaxpr.eqns[0].params["precision"] for j in (a.jaxpr, b.jaxpr)]
  assert precs == [None, (lax.Precision.HIGHEST, lax.Precision.HIGHEST)]


def test_trace_call_rejects_non_array_outputs_naming_them():
  with pytest.raises(TypeError, match=r"returned a value of type <class 'str'> "
                     r"at output\[0\]\['name'\], which is not a valid JAX type"):
    walker.trace_call(lambda x: ({"name": "y", "y": x},), (X,), {})
  out = walker.trace_call(lambda x: (x, 2, 3.5, np.float32(1)), (X,), {})
  assert len(out.jaxpr.out_avals) == 4  # Python and NumPy numbers are fine


def test_opaque_primitives_are_bound_unchanged_and_named():
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] @ x_ref[...]

  f = lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(
      X.shape, X.dtype), interpret=True)(x)
  closed = jax.make_jaxpr(f)(X)
  assert walker.opaque_name(closed.jaxpr.eqns[0]) == "pallas_call 'kernel'"
  assert walker.opaque_name(jax.make_jaxpr(jnp.sin)(X).jaxpr.eqns[0]) is None
  (got,) = walker.interpret(closed, keep, X)
  np.testing.assert_allclose(got, np.asarray(X) @ np.asarray(X), rtol=1e-6)


def test_one_array_leaf_rule():
  from jaxprec._src.jaxpr import trees
  sd = jax.ShapeDtypeStruct((2,), jnp.float32)
  assert [trees.is_array(x) for x in (X, np.ones(2), np.float32(1), sd)] == [
      True] * 4
  assert [trees.is_array(x) for x in (2.0, "a", None, np.float32)] == [
      False] * 4
  assert not trees.is_array(sd, abstract=False)
  assert [trees.is_jax_type(x) for x in (X, 1, 2.5, np.int8(1), "s", None)] == [
      True, True, True, True, False, False]


def test_emulate_rewrites_inside_shard_map():
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  mesh = jax.make_mesh((1,), ("x",))

  def f(a, b):
    return jax.shard_map(lambda u, v: u @ v, mesh=mesh, in_specs=(P(), P()),
                         out_specs=P())(a, b)

  a = jnp.full((4, 4), 1 + 2.0**-9)  # not a bfloat16 value: rounds to 1
  for g in (jaxprec.emulate(f, "bfloat16"),
            jax.jit(jaxprec.emulate(f, "bfloat16"))):
    np.testing.assert_array_equal(g(a, a), np.full((4, 4), 4.0, np.float32))
  assert float(f(a, a)[0, 0]) > 4.0  # natively on CPU: float32


def test_emulate_rewrites_inside_custom_linear_solve():
  def g(a, b):
    return jax.lax.custom_linear_solve(
        lambda x: a @ x, b, lambda mv, x: jnp.linalg.solve(a, x))

  a = jnp.eye(4) * 2 + 0.1
  b = jnp.full((4,), 1 + 2.0**-9)
  got = jaxprec.emulate(g, "bfloat16")(a, b)
  np.testing.assert_allclose(got, np.linalg.solve(np.asarray(a, np.float64),
                                                  np.asarray(b, np.float64)),
                             rtol=1e-6)
