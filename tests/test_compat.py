"""jaxprec._src.jaxpr.compat: the differences between jax 0.10 and the newest releases.

Each test here runs on the oldest JAX in the main stage and on the newest in
CI's newest stage (``.ci/newest``): the same assertion on both.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxprec
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.jaxpr import compat, walker


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_jaxpr_merged_flag_matches_the_classes():
  assert compat.JAXPR_MERGED == (compat.ClosedJaxpr is compat.Jaxpr)
  closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(3))
  # On jax 0.11+ ``.jaxpr`` is the object itself; before, the wrapped one.
  assert (closed.jaxpr is closed) == compat.JAXPR_MERGED


def test_all_binders_are_the_consts_then_the_inputs():
  c = np.arange(3.0, dtype=np.float32)
  closed = jax.make_jaxpr(lambda x: x * jnp.asarray(c) + 1.0)(jnp.ones(3))
  hoisted = compat.hoist_consts(closed)
  # Hoisted: the constants are leading inputs, none stay attached.
  assert not hoisted.consts
  assert len(compat.all_binders(hoisted.jaxpr)) == len(closed.consts) + 1
  x = np.full(3, 2.0, np.float32)
  keep = lambda eqn, invals: None  # noqa: E731
  got = walker.interpret(hoisted, keep, *closed.consts, x)
  np.testing.assert_array_equal(np.asarray(got[0]), x * c + 1.0)


def test_interpret_rejects_a_wrong_number_of_inputs_naming_both():
  closed = jax.make_jaxpr(lambda x, y: x + y)(1.0, 2.0)
  with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
    walker.interpret(closed, lambda e, i: None, 1.0)


def test_scan_add_consts_adds_leading_constant_inputs():
  def f(x):
    return jax.lax.scan(lambda c, y: (c + y, c * y), x, jnp.ones((4, 3)))

  eqn = jax.make_jaxpr(f)(jnp.ones(3)).eqns[-1]
  assert eqn.primitive.name == "scan"
  params = compat.scan_add_consts(eqn.params, 2)
  assert params is not eqn.params  # the equation's own params are not changed
  if "ft_in" in params:  # jax 0.11+
    consts, carry, xs = params["ft_in"].unpack()
    before, _, _ = eqn.params["ft_in"].unpack()
    assert len(list(consts)) == len(list(before)) + 2
  else:
    assert params["num_consts"] == eqn.params["num_consts"] + 2
    if "linear" in params:
      assert params["linear"][:2] == (False, False)
      assert len(params["linear"]) == len(eqn.params["linear"]) + 2


def test_a_rule_creating_constants_inside_scan_runs_bit_for_bit():
  """The scan body's matmul, emulated at one bfloat16 pass, against ml_dtypes."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((3, 3)).astype(np.float32)
  xs = rng.standard_normal((4, 3)).astype(np.float32)

  def f(xs):
    def body(c, x):
      return c, jnp.dot(x, jnp.asarray(w))
    return jax.lax.scan(body, 0.0, xs)[1]

  # One pass: the per-step vector·matrix product is float32 on a TPU at
  # DEFAULT (numerics.tpu_matvec), so the rule is off here.
  got = np.asarray(jaxprec.emulate(f, "bfloat16", target="tpu",
                                   tpu_matvec_f32=False)(xs))
  want = _bf16(xs) @ _bf16(w)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert not np.allclose(got, xs.astype(np.float64) @ w, rtol=1e-6, atol=1e-6)


def test_jvp_through_custom_jvp_closing_over_an_array_is_emulated():
  """jax 0.11+ custom-rule thunks return their constants as leading inputs."""
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((5, 4)).astype(np.float32))

  @jax.custom_jvp
  def f(x):
    return x @ w

  @f.defjvp
  def f_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x @ w, t @ w

  x = rng.standard_normal((2, 5)).astype(np.float32)
  t = rng.standard_normal((2, 5)).astype(np.float32)
  out, tangent = jax.jvp(jaxprec.emulate(f, "bfloat16", target="tpu"), (x,), (t,))
  # The rule's matmul runs at one bfloat16 pass too: ml_dtypes' rounding.
  np.testing.assert_allclose(np.asarray(out), _bf16(x) @ _bf16(w), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(tangent), _bf16(t) @ _bf16(w), rtol=1e-6)
  assert not np.allclose(np.asarray(tangent), t.astype(np.float64) @ np.asarray(w),
                         rtol=1e-6)


@pytest.mark.parametrize("on", [True, False])
def test_flax_named_call_enabled_follows_override(on):
  with nn.override_named_call(on):
    assert flax_paths.flax_named_call_enabled() is on


def test_audit_names_linen_modules_with_flax_profiling_names_off():
  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3, name="out")(jnp.tanh(nn.Dense(4, name="hidden")(x)))

  model = MLP()
  x = jnp.ones((2, 5))
  params = model.init(jax.random.key(0), x)
  with nn.override_named_call(False):
    rows = jaxprec.audit(model.apply, params, x)
  assert [r.module_path for r in rows] == ["hidden", "out"]
