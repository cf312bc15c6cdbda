"""Policies' compute dtypes at run time: swap and emulate on linen, Hugging Face and NNX."""

import dataclasses
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxprec
from models import nnx_model, tiny_bert

# -- a linen model with one fragile layer ------------------------------------------------

# dense_2 computes x0 - x1 for x0 = 1000.25, x1 = 1000: exact in float32 (0.25),
# 0 in bfloat16 (1000.25 needs 12 significant bits; bfloat16 has 8).
X = jnp.array([[1000.25, 1000.0, 3.0, -2.0], [1000.5, 1000.0, 1.0, 4.0]], jnp.float32)


def _kernel(columns):
  return jnp.asarray(np.array(columns, np.float32).T)


class Fragile(nn.Module):
  """dense_1 and dense_3 (of dense_1) never see dense_2; dense_4 mixes both."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    h1 = nn.Dense(2, dtype=self.dtype, name="dense_1")(x)
    h2 = nn.Dense(1, dtype=self.dtype, name="dense_2")(x)
    h3 = nn.Dense(2, dtype=self.dtype, name="dense_3")(h1)
    return nn.Dense(1, dtype=self.dtype, name="dense_4")(jnp.concatenate([h3, h2], -1))


def fragile_params():
  zeros = lambda n: jnp.zeros((n,), jnp.float32)  # noqa: E731
  return {"params": {
      "dense_1": {"kernel": _kernel([[0, 0, 1, 0], [0, 0, 0.5, 1]]), "bias": zeros(2)},
      "dense_2": {"kernel": _kernel([[1, -1, 0, 0]]), "bias": zeros(1)},
      "dense_3": {"kernel": _kernel([[1, 1], [1, -1]]), "bias": zeros(2)},
      "dense_4": {"kernel": _kernel([[1, 1, 8]]), "bias": zeros(1)},
  }}


def _intermediates(apply, params, x):
  out, state = apply(params, x, capture_intermediates=True)
  found = {k: v["__call__"][0] for k, v in state["intermediates"].items() if k != "__call__"}
  return {**found, "": out}


def _bf16(a):
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_a_dtype_rule_changes_only_what_depends_on_its_layer():
  model, params = Fragile(), fragile_params()
  before = dataclasses.replace(model)
  ref = _intermediates(model.apply, params, X)
  swapped = jaxprec.swap(model, "dense_2=dtype:bfloat16")
  for apply in (swapped.apply, jax.jit(swapped.apply, static_argnames="capture_intermediates")):
    got = _intermediates(apply, params, X)
    assert got.keys() == ref.keys() == {"dense_1", "dense_2", "dense_3", "dense_4", ""}
    for name in ("dense_1", "dense_3"):  # do not depend on dense_2: bit for bit
      assert got[name].dtype == jnp.float32
      assert np.array_equal(np.asarray(got[name]), np.asarray(ref[name])), name
    # dense_2 in bfloat16: independent reference (ml_dtypes): x and kernel
    # rounded to bfloat16, exact products and sums, the result rounded.
    assert got["dense_2"].dtype == jnp.bfloat16
    kernel = params["params"]["dense_2"]["kernel"]
    want = _bf16(_bf16(X) @ _bf16(kernel))
    assert np.array_equal(np.asarray(got["dense_2"], np.float64), want)
    np.testing.assert_array_equal(np.asarray(ref["dense_2"]), [[0.25], [0.5]])
    np.testing.assert_array_equal(want, [[0.0], [0.0]])  # the cancellation
    for name in ("dense_4", ""):  # depend on dense_2: changed
      assert got[name].dtype == jnp.float32
      assert not np.array_equal(np.asarray(got[name]), np.asarray(ref[name])), name
  assert model == before and model.dtype is jnp.float32  # the user's module untouched
  report = jaxprec.policy_report(swapped)
  decided = {m.path: (m.dtype, m.dtype_how, str(m.dtype_rule) if m.dtype_rule else None)
             for m in report.matches}
  assert decided["dense_2"] == ("bfloat16", "field", "dense_2=dtype:bfloat16")
  assert all(v == (None, None, None) for k, v in decided.items() if k != "dense_2")
  assert report.unused_rules == ()


def test_default_dtype_reaches_every_module_and_a_rule_keeps_one_float32():
  model, params = Fragile(), fragile_params()
  swapped = jaxprec.swap(model, "default=dtype:bf16,dense_2=dtype:float32")
  got = _intermediates(swapped.apply, params, X)
  assert {k: str(v.dtype) for k, v in got.items()} == {
      "dense_1": "bfloat16", "dense_2": "float32", "dense_3": "bfloat16",
      "dense_4": "bfloat16", "": "bfloat16"}
  np.testing.assert_array_equal(np.asarray(got["dense_2"]), [[0.25], [0.5]])  # kept exact
  # The top module has a dtype field too: set, then restored.
  assert model.dtype is jnp.float32
  # Parameters keep their stored dtype: init gives the same variables.
  init = swapped.init(jax.random.key(0), X)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), init) == jax.tree.map(
      lambda a: (a.shape, a.dtype), model.init(jax.random.key(0), X))
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(init))
  assert {m.path: m.dtype_how for m in jaxprec.policy_report(swapped).matches} == {
      p: "field" for p in ("", "dense_1", "dense_2", "dense_3", "dense_4")}


class Child(nn.Module):
  dtype: Any = jnp.float32

  def setup(self):
    self.dense = nn.Dense(1, dtype=self.dtype)  # built in setup: inherits

  def __call__(self, x):
    return self.dense(x)


class Parent(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Child(name="child")(x), Child(name="other")(x)


def test_submodules_built_in_setup_inherit_the_decided_dtype():
  # Flax runs setup through the interceptors (method_name 'setup') before it
  # builds the submodules: the decided dtype is in place when they are built.
  model = Parent()
  params = model.init(jax.random.key(0), X)
  swapped = jaxprec.swap(model, "child=dtype:bfloat16")
  assert jaxprec.policy_report(swapped).matches == ()  # nothing traced yet
  a, b = swapped.apply(params, X)
  assert (a.dtype, b.dtype) == (jnp.bfloat16, jnp.float32)
  how = {m.path: (m.dtype, m.dtype_how) for m in jaxprec.policy_report(swapped).matches}
  assert how == {"": (None, None), "child": ("bfloat16", "field"),
                 "child/dense": (None, None), "other": (None, None),
                 "other/dense": (None, None)}
  # A rule for the submodule itself wins over what it inherits.
  a, b = jaxprec.swap(model, "child/dense=dtype:float16,child=dtype:bf16").apply(params, X)
  assert (a.dtype, b.dtype) == (jnp.float16, jnp.float32)


class Scale(nn.Module):
  """No dtype field: a policy's dtype casts its inputs and outputs."""

  @nn.compact
  def __call__(self, x, steps):
    self.sow("intermediates", "seen", x)
    w = self.param("w", nn.initializers.constant(1 + 2.0**-9), (x.shape[-1],))
    return x * w, steps + 1


class WithScale(nn.Module):
  @nn.compact
  def __call__(self, x, steps):
    return Scale(name="scale")(x, steps)


def test_a_module_without_a_dtype_field_is_cast_at_its_boundary():
  model, steps = WithScale(), jnp.arange(2, dtype=jnp.int32)
  params = model.init(jax.random.key(0), X, steps)
  swapped = jaxprec.swap(model, "scale=dtype:bfloat16")
  (y, n), state = swapped.apply(params, X, steps, mutable="intermediates")
  seen = state["intermediates"]["scale"]["seen"][0]
  assert seen.dtype == jnp.bfloat16  # inputs cast
  assert np.array_equal(np.asarray(seen, np.float64), _bf16(X))
  assert y.dtype == jnp.bfloat16 and n.dtype == jnp.int32  # outputs cast; integers kept
  np.testing.assert_array_equal(np.asarray(n), [1, 2])
  # The parameter is not cast: it promotes the product to float32, rounded
  # once at the boundary.
  assert np.array_equal(np.asarray(y, np.float64), _bf16(_bf16(X) * (1 + 2.0**-9)))
  (m,) = [m for m in jaxprec.policy_report(swapped).matches if m.path == "scale"]
  assert (m.dtype, m.dtype_how, str(m.dtype_rule)) == (
      "bfloat16", "boundary", "scale=dtype:bfloat16")
  assert "dtype bfloat16 (boundary)  <- scale=dtype:bfloat16" in str(
      jaxprec.policy_report(swapped))


def test_emulate_applies_a_dtype_policy_to_linen_calls():
  model, params = Fragile(), fragile_params()
  fn = jaxprec.emulate(lambda p, x: model.apply(p, x), "dense_2=dtype:bfloat16+F32_F32_F32")
  ref = model.apply(params, X)
  got = jax.jit(fn)(params, X)
  assert not np.array_equal(np.asarray(got), np.asarray(ref))
  want = jaxprec.swap(model, "dense_2=dtype:bfloat16").apply(params, X)
  assert np.array_equal(np.asarray(got), np.asarray(want))
  (m,) = [m for m in jaxprec.policy_report(fn).matches if m.path == "dense_2"]
  assert (m.dtype, m.dtype_how) == ("bfloat16", "field")


# -- Hugging Face: the undo switch ---------------------------------------------------------


@pytest.fixture(scope="module")
def berts():
  m32, params, ids = tiny_bert(jnp.float32)
  m16, params16, _ = tiny_bert(jnp.bfloat16)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, params16))
  return m32, m16, params, ids


def test_default_float32_undoes_a_bfloat16_bert_bit_for_bit(berts):
  m32, m16, params, ids = berts
  low = m16(ids, params=params)
  assert low.last_hidden_state.dtype == jnp.bfloat16
  undo = jaxprec.swap(m16, jaxprec.Policy(default_dtype="float32"))
  # Eager against eager, jitted against jitted (XLA's fusions change float32 bits).
  for run in (lambda f: f, jax.jit):
    got = run(lambda p, i: undo(i, params=p))(params, ids)
    want = run(lambda p, i: m32(i, params=p))(params, ids)
    for name in ("last_hidden_state", "pooler_output"):
      g, w = getattr(got, name), getattr(want, name)
      assert g.dtype == jnp.float32
      assert np.array_equal(np.asarray(g), np.asarray(w)), name
  assert not np.array_equal(np.asarray(low.last_hidden_state, np.float32),
                            np.asarray(want.last_hidden_state))
  # The user's model is untouched.
  assert m16.module.dtype is jnp.bfloat16 and m16.dtype is jnp.bfloat16
  assert m16(ids, params=params).last_hidden_state.dtype == jnp.bfloat16


def test_bfloat16_bert_with_float32_layer_norms_reports_them(berts):
  _, m16, params, ids = berts
  swapped = jaxprec.swap(m16, "default=dtype:bfloat16,.*LayerNorm.*=dtype:float32")
  out = swapped(ids, params=params).last_hidden_state
  assert out.dtype == jnp.float32  # the last layer norm's output
  report = jaxprec.policy_report(swapped)
  norms = [m for m in report.matches if "LayerNorm" in m.path]
  assert sorted(m.path for m in norms) == [
      "embeddings/LayerNorm", *(f"encoder/layer/{i}/{part}/LayerNorm"
                                for i in range(2) for part in ("attention/output", "output"))]
  assert all((m.dtype, m.dtype_how, str(m.dtype_rule)) == (
      "float32", "field", ".*LayerNorm.*=dtype:float32") for m in norms)
  dense = [m for m in report.matches if m.module_type == "Dense"]
  assert len(dense) == 2 * 6 + 1 and all(
      (m.dtype, m.dtype_how, m.dtype_rule) == ("bfloat16", "field", None) for m in dense)
  assert report.unused_rules == () and report.default_used
  text, md = str(report), report.to_markdown()
  assert ("embeddings/LayerNorm [-, dot]: dtype float32 (field)  <- "
          ".*LayerNorm.*=dtype:float32") in text
  assert "| embeddings/LayerNorm | - | dot | - | float32 | field | .*LayerNorm.*=dtype:float32 |" in md


def test_a_parent_rule_reaches_submodules_built_in_its_setup(berts):
  # FlaxBertPooler builds its Dense in setup with dtype=self.dtype.
  _, m16, params, ids = berts
  out = jaxprec.swap(m16, "pooler=dtype:float32")(ids, params=params)
  assert out.pooler_output.dtype == jnp.float32
  assert out.last_hidden_state.dtype == jnp.bfloat16


# -- NNX -----------------------------------------------------------------------------------


def _dtypes(model):
  from jaxprec._src.flax.paths import nnx_modules  # noqa: PLC0415
  return {p: getattr(m, "dtype", "none") for p, m in nnx_modules(model)}


def test_nnx_swap_sets_dtypes_on_a_clone():
  model, x = nnx_model("transformer")
  before = _dtypes(model)
  swapped = jaxprec.swap(model, "default=dtype:bf16,norm=dtype:float32")
  assert _dtypes(model) == before  # the user's model untouched
  after = _dtypes(swapped)
  assert after["norm"] is jnp.float32 and after[""] == "none"
  assert all(after[p] is jnp.bfloat16 for p in after if p not in ("norm", ""))
  assert swapped(x).dtype == jnp.bfloat16 and model(x).dtype == jnp.float32
  report = jaxprec.policy_report(swapped)
  how = {m.path: (m.dtype, m.dtype_how) for m in report.matches}
  assert how["norm"] == ("float32", "field") and how["embed"] == ("bfloat16", "field")
  assert how[""] == (None, "skipped")  # no dtype attribute: left alone under the default
  assert "(top) [-, dot]: dtype - (no dtype attribute; default not applied)" in str(report)


def test_nnx_dtype_rule_on_a_module_without_dtype_is_an_error():
  model, _ = nnx_model("transformer")
  for policy in (".*=dtype:bf16", "path:=dtype:f32"):
    with pytest.raises(ValueError, match=r"gives dtype '.*' to the NNX module at path "
                                         r"'\(top\)' of type NnxTransformer, which has no "
                                         r"dtype attribute. NNX modules cannot be cast at "
                                         r"their boundary"):
      jaxprec.swap(model, policy)
    with pytest.raises(ValueError, match="NNX modules cannot be cast at their boundary"):
      jaxprec.emulate(model, policy)  # at once, not at the first call


def test_emulate_of_an_nnx_model_sets_dtypes_on_its_copy():
  model, x = nnx_model("mlp")
  before = _dtypes(model)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxprec.UnusedRuleWarning)
    fn = jaxprec.emulate(model, "default=dtype:bf16+F32_F32_F32")
    y = fn(x)
  assert y.dtype == jnp.bfloat16
  assert _dtypes(model) == before
  want = jaxprec.swap(model, "default=dtype:bf16")(x)
  assert np.array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
  got = {m.path: m.dtype_how for m in jaxprec.policy_report(fn).matches if m.path}
  assert got == {"l1": "field", "l2": "field", "out": "field"}


def test_nnx_float32_default_undoes_a_bfloat16_model():
  model = nnx_model("mlp", dtype=jnp.bfloat16)[0]
  ref, x = nnx_model("mlp")
  undo = jaxprec.swap(model, jaxprec.Policy(default_dtype=jnp.float32))
  assert np.array_equal(np.asarray(undo(x)), np.asarray(ref(x)))
  assert model.l1.dtype is jnp.bfloat16 and model(x).dtype == jnp.bfloat16


def test_swapped_models_with_different_dtypes_under_one_jitted_function():
  model, params = Fragile(), fragile_params()
  a = jaxprec.swap(model, "default=dtype:bf16")
  b = jaxprec.swap(model, "default=dtype:f16")
  f = jax.jit(lambda m, p, x: m.apply(p, x), static_argnums=0)
  assert f(a, params, X).dtype == jnp.bfloat16
  assert f(b, params, X).dtype == jnp.float16
