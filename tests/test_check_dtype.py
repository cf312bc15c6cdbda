"""check(...) with dtype rows, and the reference of a model built in bfloat16."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
from jaxprec._src.checker import harness
from jaxprec._src.checker import metrics
from jaxprec._src.flax import nnx_policy

import models

ROWS = ("default=dtype:bfloat16",
        "default=dtype:bfloat16,.*LayerNorm.*=dtype:float32",
        "default=bfloat16+dtype:bfloat16,.*LayerNorm.*=float32+dtype:float32")


@pytest.fixture(scope="module")
def berts():
  m32, params, ids = models.tiny_bert(jnp.float32)
  m16, params16, _ = models.tiny_bert(jnp.bfloat16)
  jax.tree.map(np.testing.assert_array_equal, params, params16)  # same weights

  def fn(model):
    return lambda p, ids: model(ids, params=p, output_hidden_states=True
                                ).hidden_states
  return fn(m32), fn(m16), params, ids


def _rel_rms(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.sum((got - ref) ** 2) / np.sum(ref ** 2)))


def test_reference_of_a_bfloat16_bert_is_the_float32_model_bit_for_bit(berts):
  fn32, fn16, params, ids = berts
  call = harness.Args((params, ids), {}, who="test")
  assert harness.narrow_compute(fn16, call)[1]
  assert not harness.narrow_compute(fn32, call)[1]
  ref16 = harness.build_reference(fn16, call, "float32", target="tpu",
                                  mode="emulate")
  ref32 = harness.build_reference(fn32, call, "float32", target="tpu",
                                  mode="emulate")
  assert ref16.names == ref32.names == ["[0]", "[1]", "[2]"]
  assert ref16.dtypes == ["float32"] * 3  # every module at float32
  np.testing.assert_array_equal(np.asarray(ref16.hi), np.asarray(ref32.hi))
  assert ref32.description == "f32 (native cpu)"  # a float32 model: as before
  assert ref16.description == "f32 (native cpu), modules at float32"
  # ... and the float32 model's own outputs.
  with jax.default_matmul_precision("float32"):
    want = jax.jit(fn32)(params, ids)
  packed = metrics.pack_numpy([np.asarray(w) for w in want], ref16.layout)
  np.testing.assert_array_equal(np.asarray(ref16.hi), packed)


def test_check_rows_may_be_dtype_policies(berts):
  fn32, fn16, params, ids = berts
  r = jaxprec.check(fn16, params, ids, precisions=(*ROWS, "bfloat16"),
                    mode="emulate")
  assert r.precisions == (*ROWS, "bfloat16")  # both axes in the labels
  assert r.reference == "float32"
  assert r.numerics["(reference)"] == "f32 (native cpu), modules at float32"
  # The all-bfloat16 row is the bfloat16 model as built, against the float32
  # model: measured here with NumPy in float64. The float32 model runs jitted,
  # as check's reference does (the previous test's program: eagerly, it cost
  # 2 s of dispatch); the bfloat16 one eagerly, as built (jitted, XLA's
  # fusions keep some float32 intermediates: a smaller error than the row's).
  with jax.default_matmul_precision("float32"):
    want = [np.asarray(a, np.float64) for a in jax.jit(fn32)(params, ids)]
  got = fn16(params, ids)
  np.testing.assert_allclose(r.metric("rel_rms", ROWS[0]),
                             [_rel_rms(g, w) for g, w in zip(got, want)],
                             rtol=1e-4)
  bf16, ln32 = r.metric("rel_rms", ROWS[0]), r.metric("rel_rms", ROWS[1])
  assert all(1e-3 < v < 5e-2 for v in (*bf16, *ln32))
  # Layer norms in float32 change every layer: the dropout modules after
  # them have no dtype field and are left as built under the bfloat16
  # default, so the float32 norms reach the hidden states, the embeddings'
  # (hidden_states[0]) included.
  assert all(a < b for a, b in zip(ln32, bf16))
  # A float32 BERT checked with the same rows gives the same numbers: its
  # reference is the same, and so is each row's program.
  r32 = jaxprec.check(fn32, params, ids, precisions=ROWS, mode="emulate")
  assert r32.numerics["(reference)"] == "f32 (native cpu)"
  for row in ROWS:
    np.testing.assert_array_equal(r32.metric("rel_rms", row),
                                  r.metric("rel_rms", row))


def test_float64_reference_of_a_bfloat16_model_runs_modules_at_float64():
  class MLP(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
      h = jnp.tanh(nn.Dense(16, dtype=self.dtype)(x))
      return nn.LayerNorm(dtype=self.dtype)(nn.Dense(8, dtype=self.dtype)(h))

  x = jax.random.normal(jax.random.key(1), (4, 16))
  params = MLP().init(jax.random.key(0), x)
  r = jaxprec.check(MLP(dtype=jnp.bfloat16).apply, params, x,
                    precisions=["default=float32+dtype:float32", "bfloat16"],
                    reference="float64", mode="emulate")
  assert r.numerics["(reference)"] == (
      "float64 (native, x64), modules at float64")
  # The float32 row of the bfloat16 model is near the float64 model, far
  # closer than bfloat16 would be.
  assert r.layers[0].metrics["default=float32+dtype:float32"].rel_rms < 1e-5
  assert r.layers[0].metrics["bfloat16"].rel_rms > 1e-3  # the model as built
  assert not jax.config.jax_enable_x64


def test_a_float32_model_checks_as_before():
  # No dtype decisions: the reference program is the plain one.
  def mlp(w, x):
    return {"h": jnp.tanh(x @ w)}
  w = jax.random.normal(jax.random.key(0), (16, 16))
  x = jax.random.normal(jax.random.key(1), (4, 16))
  r = jaxprec.check(mlp, w, x, precisions=["bf16"], mode="emulate")
  assert r.numerics["(reference)"] == "f32 (native cpu)"
  call = harness.Args((w, x), {}, who="test")
  assert not harness.narrow_compute(mlp, call)[1]
  # Narrow, but in no module jaxprec can set: nothing to undo.
  assert harness.narrow_compute(
      lambda w, x: mlp(w.astype(jnp.bfloat16), x), call) == (
          True, False, True, False)  # ..., and no random draws


def test_reference_of_a_bfloat16_nnx_model_is_the_float32_model():
  from flax import nnx  # noqa: PLC0415

  class Net(nnx.Module):
    def __init__(self, dtype, rngs):
      self.a = nnx.Linear(16, 16, dtype=dtype, rngs=rngs)
      self.norm = nnx.LayerNorm(16, dtype=dtype, rngs=rngs)
      self.b = nnx.Linear(16, 4, dtype=dtype, rngs=rngs)

    def __call__(self, x):
      h = self.norm(jnp.tanh(self.a(x)))
      return {"h": h, "out": self.b(h)}

  x = jax.random.normal(jax.random.key(1), (4, 16))
  m16, m32 = Net(jnp.bfloat16, nnx.Rngs(0)), Net(jnp.float32, nnx.Rngs(0))
  # As check and search_policy call it: the model's state an argument.
  (fn16, args16), (fn32, args32) = (nnx_policy.stateful(m, (x,))
                                    for m in (m16, m32))
  ref16 = harness.build_reference(fn16, harness.Args(args16, {}, who="test"),
                                  "float32", target="tpu", mode="emulate")
  ref32 = harness.build_reference(fn32, harness.Args(args32, {}, who="test"),
                                  "float32", target="tpu", mode="emulate")
  np.testing.assert_array_equal(np.asarray(ref16.hi), np.asarray(ref32.hi))
  assert m16.a.dtype == jnp.bfloat16  # the user's model is untouched
  r = jaxprec.check(m16, x, precisions=["default=dtype:bfloat16"],
                    mode="emulate")
  with jax.default_matmul_precision("float32"):
    want, got = m32(x), m16(x)
  np.testing.assert_allclose(r.metric("rel_rms", "default=dtype:bfloat16"),
                             [_rel_rms(got[k], want[k]) for k in ("h", "out")],
                             rtol=1e-4)


def test_narrow_casts_outside_modules_are_said_out_loud():
  # A plain function that casts to bfloat16 itself: no module to set, so the
  # reference keeps the casts, and says so instead of "modules at float32".
  def own_casts(w, x):
    return (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)

  w = jax.random.normal(jax.random.key(0), (8, 4))
  x = jax.random.normal(jax.random.key(1), (2, 8))
  call = harness.Args((w, x), {}, who="test")
  assert harness.narrow_compute(own_casts, call) == (True, False, True, False)
  assert not harness.narrow_compute(own_casts, call)[1]
  r = jaxprec.check(own_casts, w, x, precisions=["bfloat16"], mode="emulate")
  ref = r.numerics["(reference)"]
  assert "modules at float32" not in ref
  assert "outside any module" in ref and "kept" in ref
  r64 = jaxprec.check(own_casts, w, x, precisions=["bfloat16"],
                      reference="float64", mode="emulate")
  assert "outside any module" in r64.numerics["(reference)"]


def test_narrow_answer_is_not_reused_across_input_dtypes():
  # One function, float32 then bfloat16 arguments: the cached answer for the
  # first must not stand for the second (a stale reference otherwise).
  def square(a):
    return a @ a

  a = jnp.eye(4)
  assert harness.narrow_compute(square, harness.Args((a,), {}, who="t"))[0] is False
  assert harness.narrow_compute(
      square, harness.Args((a.astype(jnp.bfloat16),), {}, who="t"))[0] is True


class _Embeddings(nn.Module):
  """A bfloat16 projection joined with a float32 parameter (promoted to
  float32, as a ViT's class token), then a Dropout: a module without a dtype
  field."""
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, dtype=self.dtype, name="proj")(x)
    cls = self.param("cls", nn.initializers.normal(1.0), (1, 8))
    return nn.Dropout(0.1, name="drop")(jnp.concatenate([cls, h], 0),
                                        deterministic=True)


def test_the_default_dtype_row_is_the_model_as_built():
  x = jax.random.normal(jax.random.key(1), (3, 4))
  model = _Embeddings()
  params = model.init(jax.random.key(0), x)
  swapped = jaxprec.swap(model, "default=dtype:bfloat16")
  native = model.apply(params, x)
  assert native.dtype == jnp.float32
  np.testing.assert_array_equal(swapped.apply(params, x), native)  # dtype too
  (drop,) = [m for m in jaxprec.policy_report(swapped).matches
             if m.path == "drop"]
  assert (drop.dtype, drop.dtype_how) == (None, "skipped")
  # Its only matmul computes in bfloat16: the dtype row is the float32 row.
  r = jaxprec.check(model.apply, params, x, mode="emulate",
                    precisions=["default=dtype:bfloat16", "float32"])
  assert (r.metric("rel_rms", "default=dtype:bfloat16")
          == r.metric("rel_rms", "float32"))
  # A rule still casts it at its boundary.
  ruled = jaxprec.swap(model, "drop=dtype:bfloat16").apply(params, x)
  assert ruled.dtype == jnp.bfloat16
