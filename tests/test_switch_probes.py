"""Probes of the search's switched program (jaxprec/_src/search/switch.py) found by
trying odd model structures: each test failed before its fix."""

import warnings
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
import switching
from jaxprec._src.search import switch


# ---------------------------------------------------------------------------
# One jaxpr, two units: JAX's trace caches give two calls of a function
# written outside the modules (a jax.jit function, a lax.scan body, lax.cond
# branches) the same equations. Keyed by equation, the switched program ran
# both calls at the second unit's precision (wrong numbers, no warning), or
# found no matmul of the first unit and fell back to one program per policy.


@jax.jit
def _shared_jit(w, x):
  return jnp.tanh(x @ w + 100.0) - jnp.tanh(x @ w)


def _shared_scan_body(c, w):
  return jnp.tanh(c @ w + 30.0), None


def _branch_a(c, w):
  return c @ w


def _branch_b(c, w):
  return c @ w.T


class _Block(nn.Module):
  own: bool = False  # a matmul of its own: the unit is found either way

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.3), (8, 8))
    if self.own:
      x = x @ (w * 0.5)
    h = _shared_jit(w, x)
    h = jax.lax.scan(_shared_scan_body, h, jnp.stack([w, w]))[0]
    return jax.lax.cond(h[0, 0] > -10.0, _branch_a, _branch_b, h + 20.0, w)


class _TwoBlocks(nn.Module):
  @nn.compact
  def __call__(self, x):
    return {"a": _Block(own=True, name="a")(x),
            "b": _Block(name="b")(x * 0.01)}


def _two_blocks():
  x = jax.random.normal(jax.random.key(1), (4, 8))
  model = _TwoBlocks()
  return model.apply, (model.init(jax.random.key(0), x), x)


def test_units_sharing_a_traced_function_are_switched_bit_for_bit():
  fn, args = _two_blocks()
  units, cands, search = switching.units_and_cands(fn, args)
  assert set(units) == {"a", "b"}
  g = jax.jit(switch.switched(fn, units, [c.precision for c in cands],
                              target="tpu"))
  for levels in [(0, 0), (2, 0), (0, 2), (1, 0), (2, 1)]:
    fixed = jax.jit(jaxprec.emulate(fn, search.policy(levels), target="tpu"))
    want, got = fixed(*args), g(switch.index_of(levels), *args)
    for name in want:
      assert switching.same(got[name], want[name]), (levels, name)


def test_shared_traced_function_search_switches_and_agrees_with_per_policy():
  fn, args = _two_blocks()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback, no disagreement
    once = jaxprec.search_policy(fn, *args, tolerance=1e-4, verbose=False)
    per = jaxprec.search_policy(fn, *args, tolerance=1e-4, verbose=False,
                                compile_once=False)
  assert "switched" in {s.program for s in once.history}
  assert [str(s.policy) for s in once.history] == [
      str(s.policy) for s in per.history]
  assert [s.worst_value for s in once.history] == [
      s.worst_value for s in per.history]
  assert str(once.policy) == str(per.policy) and once.values == per.values


def test_unshared_copy_keeps_named_tuples_of_jaxprs():
  """custom_linear_solve keeps its jaxprs in a named tuple (``.solve``)."""
  w = jax.random.normal(jax.random.key(0), (8, 8))
  a = w @ w.T + 8 * jnp.eye(8)

  def f(a, b):
    return jax.lax.custom_linear_solve(lambda v: a @ v, b,
                                       lambda mv, r: r / 8.0, symmetric=True)

  b = jnp.arange(8.0)
  closed = jax.make_jaxpr(f)(a, b)
  copied = switch._unshared(closed)
  (eqn,) = [e for e in copied.jaxpr.eqns
            if e.primitive.name == "custom_linear_solve"]
  (original,) = [e for e in closed.jaxpr.eqns
                 if e.primitive.name == "custom_linear_solve"]
  assert type(eqn.params["jaxprs"]) is type(original.params["jaxprs"])
  assert eqn.params["jaxprs"].solve is not None
  assert eqn is not original
  (out,) = jax.core.eval_jaxpr(copied.jaxpr, copied.consts, a, b)
  assert switching.same(out, f(a, b))


# ---------------------------------------------------------------------------
# A callable that cannot be weakly referenced (an object of a class with
# __slots__): the harness keeps no program for it, so the "compiled once"
# switched program was compiled again at every evaluation (slower than one
# program per policy).


class _Slotted:
  __slots__ = ("model", "traces")

  def __init__(self, model):
    self.model, self.traces = model, []

  def __call__(self, params, x):
    self.traces.append(1)
    return self.model.apply(params, x)


class _Offset(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(8, name="a")(x + 100.0) - 100.0)
    return {"h": h, "o": nn.Dense(8, name="b")(h)}


def test_unreferable_callable_compiles_the_switched_program_once():
  model = _Offset()
  x = jax.random.normal(jax.random.key(1), (4, 8))
  params = model.init(jax.random.key(0), x)
  slotted = _Slotted(model)
  with pytest.raises(TypeError):
    weakref.ref(slotted)
  plain_traces = []

  def plain(params, x):
    plain_traces.append(1)
    return model.apply(params, x)

  kw = dict(tolerance=1e-5, verbose=False)
  r = jaxprec.search_policy(slotted, params, x, **kw)
  want = jaxprec.search_policy(plain, params, x, **kw)
  assert r.evaluations >= 4 and "switched" in {s.program for s in r.history}
  assert str(r.policy) == str(want.policy) and r.values == want.values
  # fn is traced once per program (audits, reference, first evaluation,
  # the switched program, the returned policy's own program), as a plain
  # function is: not once more per switched evaluation.
  assert len(slotted.traces) == len(plain_traces)


# ---------------------------------------------------------------------------
# A jax.checkpoint around the whole model: JAX keeps its trace, and the
# switched trace was served the audit's, in which no module call ran, so it
# found no unit and fell back to one program per policy.


def test_checkpointed_model_switches():
  model = _Offset()
  x = jax.random.normal(jax.random.key(3), (4, 8))
  params = model.init(jax.random.key(0), x)
  fn = jax.checkpoint(model.apply)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback
    r = jaxprec.search_policy(fn, params, x, tolerance=1e-5, verbose=False)
  assert set(r.units) == {"a", "b"}
  assert "switched" in {s.program for s in r.history}
  want = jaxprec.search_policy(model.apply, params, x, tolerance=1e-5,
                               verbose=False, compile_once=False)
  assert str(r.policy) == str(want.policy) and r.values == want.values


# Searching (or auditing) the same checkpointed model twice: the second audit
# was served the first's trace, recorded no module call and gave every
# matmul the path '' (a search over one unit, without a word).


def test_a_second_search_of_a_checkpointed_model_finds_the_same_units():
  model = _Offset()
  x = jax.random.normal(jax.random.key(3), (4, 8))
  params = model.init(jax.random.key(0), x)
  fn = jax.checkpoint(model.apply)
  first = jaxprec.search_policy(fn, params, x, tolerance=1e-5, verbose=False)
  second = jaxprec.search_policy(fn, params, x, tolerance=1e-5, verbose=False)
  assert set(first.units) == set(second.units) == {"a", "b"}
  assert str(first.policy) == str(second.policy)
  paths = [{r.module_path for r in jaxprec.audit(fn, params, x).rows}
           for _ in range(2)]
  assert paths[0] == paths[1] == {"a", "b"}


def test_nested_jit_key_scopes_keep_the_outer_key():
  from jaxprec._src.jaxpr import compat
  traces = []

  @jax.jit
  def f(x):
    traces.append(1)
    return x + 1

  for outer in ("one", "two"):
    with compat.jit_key_scope(outer), compat.jit_key_scope("inner"):
      f(1.0)
  assert len(traces) == 2  # the inner scope alone would have reused a trace


# An integer matmul under a GPU preset: the preset reached the native dot,
# which the CPU lowering refuses (TF32 presets take floats only).


@pytest.mark.parametrize("precision", ["TF32_TF32_F32_X3", "tensorfloat32",
                                       "BF16_BF16_F32_X6"])
def test_integer_matmul_under_a_float_preset_runs_exactly(precision):
  a = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)
  for target in ("gpu", "tpu"):
    got = jax.jit(jaxprec.emulate(lambda m: m @ m, precision, target=target))(a)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.asarray(a) @ np.asarray(a))


def test_gpu_search_with_an_integer_matmul_in_a_module():
  class WithInt(nn.Module):
    @nn.compact
    def __call__(self, x, idx):
      counts = idx @ jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
      return {"h": jnp.tanh(nn.Dense(8, name="d")(x + 100.0)),
              "c": counts.astype(jnp.float32)}

  x = jax.random.normal(jax.random.key(1), (4, 8))
  idx = jnp.ones((4, 3), jnp.int32)
  model = WithInt()
  params = model.init(jax.random.key(0), x, idx)
  once = jaxprec.search_policy(model.apply, params, x, idx, tolerance=1e-5,
                               target="gpu", verbose=False)
  per = jaxprec.search_policy(model.apply, params, x, idx, tolerance=1e-5,
                              target="gpu", verbose=False, compile_once=False)
  assert str(once.policy) == str(per.policy) and once.values == per.values


def test_an_empty_output_layer_is_not_checked_and_said_so():
  w = jax.random.normal(jax.random.key(0), (8, 8))
  x = jax.random.normal(jax.random.key(1), (4, 8))

  def f(w, x):
    y = jnp.tanh(x @ w)
    return {"y": y, "z": y[:0]}

  with pytest.warns(UserWarning, match="'z' has no elements and is not checked"):
    r = jaxprec.search_policy(f, w, x, tolerance=1e-2, verbose=False)
  assert r.meets_tolerance and str(r.policy) == "default=bfloat16"
  assert set(r.values) == {"y"}


# ---------------------------------------------------------------------------
# A three-operand einsum on the GPU target: its first dot feeds the second.
# At float32 the fixed program's first dot was a plain HIGHEST dot whose
# operand order and output layout XLA chose for the dot reading it (b @ c.T
# computed transposed), summing in another order than the switched branch,
# whose result is read from memory (compiled HLO, jax 0.10.2).


def test_three_operand_einsum_on_gpu_is_switched_bit_for_bit():
  rng = np.random.default_rng(0)
  ops = [rng.standard_normal(s).astype(np.float32)
         for s in ((2, 8, 32), (32, 16), (8, 16))]

  def f(a, b, c):
    return {"y": jnp.tanh(jnp.einsum("bsh,hd,td->bst", a, b, c))}

  names = ("tensorfloat32", "TF32_TF32_F32_X3", "float32")
  with jaxprec.use_kernel("bf16"):
    g = jax.jit(switch.switched(f, [""], [jaxprec.resolve(n) for n in names],
                                target="gpu"))
    for i, name in enumerate(names):
      fixed = jax.jit(jaxprec.emulate(f, jaxprec.Policy(default=name),
                                      target="gpu"))(*ops)
      got = g(switch.index_of([i]), *ops)
      assert switching.same(got["y"], fixed["y"]), name
