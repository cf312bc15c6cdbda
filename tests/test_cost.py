"""Tests for jaxprec.cost: FLOPs of every matmul and conv times the passes its
precision needs on the target, per module path and against all-float32."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxprec
from jaxprec import UnsupportedAlgorithmError
from jaxprec._src.inspect import cost as cost_lib

F32 = jnp.float32
X = jax.ShapeDtypeStruct((8, 16), F32)
W1 = jax.ShapeDtypeStruct((16, 32), F32)
W2 = jax.ShapeDtypeStruct((32, 4), F32)
MLP_FLOPS = (2 * 8 * 16 * 32, 2 * 8 * 32 * 4)  # 2*M*K*N per dot: 8192, 2048


def mlp(x, w1, w2):
  return jnp.tanh(x @ w1) @ w2


class ConvNet(nn.Module):
  """A conv, a dense, and an explicit-precision dense (kept as written)."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3,), padding="VALID", name="conv")(x)  # (1, 8, 4)
    x = nn.Dense(5, name="dense")(x)
    return nn.Dense(2, precision="highest", name="fixed")(x)


CONV_X = jnp.ones((1, 10, 3), F32)
# conv: 2 * output elements (1*8*4) * kernel size 3 * input features 3.
CONV_FLOPS = {"conv": 2 * 32 * 3 * 3, "dense": 2 * 32 * 5, "fixed": 2 * 40 * 2}


@pytest.fixture(scope="module")
def convnet():
  model = ConvNet()
  return model.apply, (model.init(jax.random.key(0), CONV_X), CONV_X)


@pytest.mark.parametrize("policy,target,weight", [
    ("bfloat16", "tpu", 1), ("bfloat16_3x", "tpu", 3), ("float32", "tpu", 6),
    ("BF16_BF16_F32_X9", "tpu", 9), ("tf32", "gpu", 1),
    ("TF32_TF32_F32_X3", "gpu", 3), ("float32", "gpu", 8),
    ("BF16_BF16_F32", "gpu", 0.5), ("BF16_BF16_F32_X3", "gpu", 1.5),
])
def test_hand_computed_flops_times_passes(policy, target, weight):
  r = jaxprec.cost(mlp, X, W1, W2, policy=policy, target=target)
  f32 = {"tpu": 6, "gpu": 8}[target]
  assert r.flops == sum(MLP_FLOPS) == 10240
  assert r.cost == weight * 10240
  assert r.float32_cost == f32 * 10240
  assert r.relative == pytest.approx(weight / f32)
  assert r.unknown_flops == 0
  assert [row.path for row in r.rows] == [""]  # no Flax module: path ''
  assert r.rows[0].ops == 2


def test_policy_per_module_path_and_explicit_precision_kept(convnet):
  fn, args = convnet
  r = jaxprec.cost(fn, *args, policy="default=bfloat16,conv=float32")
  rows = {row.path: row for row in r.rows}
  assert list(rows) == ["conv", "dense", "fixed"]
  assert {p: row.flops for p, row in rows.items()} == CONV_FLOPS
  assert rows["conv"].algorithms == ("bf16x6",)
  assert rows["conv"].cost == 6 * CONV_FLOPS["conv"]
  assert rows["dense"].algorithms == ("bf16x1",)
  assert rows["dense"].cost == CONV_FLOPS["dense"]
  assert rows["dense"].relative == pytest.approx(1 / 6)
  # precision="highest" in the model's code: float32 whatever the policy.
  assert rows["fixed"].algorithms == ("bf16x6",)
  assert rows["fixed"].cost == rows["fixed"].float32_cost == 6 * CONV_FLOPS["fixed"]
  total = 6 * 576 + 320 + 6 * 160
  assert r.cost == total and r.float32_cost == 6 * (576 + 320 + 160)
  assert r.relative == pytest.approx(total / (6 * 1056))
  assert r.row("dense") is rows["dense"]
  with pytest.raises(KeyError, match="Unknown module path 'dens'.*Did you mean 'dense'"):
    r.row("dens")


def test_path_rules_and_float32_baseline_is_one(convnet):
  fn, args = convnet
  assert jaxprec.cost(fn, *args, policy="float32").relative == 1.0
  r = jaxprec.cost(fn, *args, policy="default=bfloat16_3x,dense=bfloat16")
  rows = {row.path: row for row in r.rows}
  assert rows["conv"].cost == 3 * 576 and rows["dense"].cost == 320


def test_jitted_function_under_two_policies(convnet):
  fn, args = convnet
  jitted = jax.jit(fn)
  a = jaxprec.cost(jitted, *args, policy="default=bfloat16,conv=float32")
  b = jaxprec.cost(jitted, *args, policy="default=bfloat16,dense=float32")
  assert a.row("conv").algorithms == b.row("dense").algorithms == ("bf16x6",)
  assert a.row("dense").algorithms == b.row("conv").algorithms == ("bf16x1",)


def test_policy_none_uses_the_precision_in_force():
  with jaxprec.precision("float32"):
    assert jaxprec.cost(mlp, X, W1, W2).relative == 1.0
  with jaxprec.precision("bfloat16_3x"):
    assert jaxprec.cost(mlp, X, W1, W2).relative == 0.5
  # Nothing set: the target's default (one bfloat16 pass on a TPU).
  assert jaxprec.cost(mlp, X, W1, W2).relative == pytest.approx(1 / 6)


def test_explicit_precision_outside_modules_is_kept():
  def f(x, w1, w2):
    return jnp.dot(jnp.tanh(x @ w1), w2, precision="highest")
  r = jaxprec.cost(f, X, W1, W2, policy="bfloat16")
  assert r.by_algorithm == {"bf16x1": 8192, "bf16x6": 2048}
  assert r.cost == 8192 + 6 * 2048
  assert r.float32_cost == 6 * 10240


def test_bfloat16_operands_are_native():
  x = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((16, 4), jnp.bfloat16)
  tpu = jaxprec.cost(lambda x, w: x @ w, x, w, policy="float32")
  gpu = jaxprec.cost(lambda x, w: x @ w, x, w, policy="float32", target="gpu")
  assert tpu.rows[0].algorithms == ("native bfloat16",)
  assert (tpu.cost, tpu.relative) == (1024, 1.0)
  assert (gpu.cost, gpu.relative) == (512, 1.0)


def test_scan_trip_count_multiplies():
  def f(x, w):
    def body(c, _):
      return jnp.tanh(c @ w), None
    return lax.scan(body, x, None, length=3)[0]
  w = jax.ShapeDtypeStruct((16, 16), F32)
  r = jaxprec.cost(f, X, w, policy="bfloat16_3x")
  assert r.flops == 3 * 2 * 8 * 16 * 16
  assert r.cost == 3 * r.flops


def test_unknown_algorithm_is_left_out_of_both_totals():
  # float16 passes on a TPU have no weight.
  def f(x, w1, w2):
    return jnp.dot(jnp.tanh(x @ w1), w2, precision="F16_F16_F32")
  r = jaxprec.cost(f, X, W1, W2, policy="bfloat16")
  assert r.unknown_flops == 2048
  assert (r.cost, r.float32_cost) == (8192, 6 * 8192)
  assert "not counted" in str(r) and "f16" in str(r)
  # ... unless given one.
  r = jaxprec.cost(f, X, W1, W2, policy="bfloat16", weights={"f16": 2})
  assert r.unknown_flops == 0 and r.cost == 8192 + 2 * 2048


def test_an_algorithm_the_target_does_not_run_is_never_costed():
  # A TF32 preset does not run on a TPU: no cost of 0, the emulation's error.
  def f(x, w1, w2):
    return jnp.dot(jnp.tanh(x @ w1), w2, precision="TF32_TF32_F32")
  with pytest.raises(UnsupportedAlgorithmError,
                     match=r"no cost on a TPU: TF32_TF32_F32 .* does not run "
                           r"on a TPU.*'float32' \(bf16x6"):
    jaxprec.cost(f, X, W1, W2, policy="bfloat16")
  assert jaxprec.cost(f, X, W1, W2, policy="bfloat16", target="gpu").cost > 0


def test_weights_override_h100_ratio():
  r = jaxprec.cost(mlp, X, W1, W2, policy="tf32", target="gpu",
                   weights={"f32": 7.4})
  assert r.relative == pytest.approx(1 / 7.4)
  assert r.weights["f32"] == 7.4 and cost_lib.WEIGHTS["gpu"]["f32"] == 8.0


def test_builtin_model_per_path(convnet):
  import jaxprec.models
  fn, args = jaxprec.models.wav2vec2("tiny")
  r = jaxprec.cost(fn, *args, policy="default=bfloat16,conv=float32")
  audit = jaxprec.audit(fn, *args)
  assert r.flops == audit.total_flops
  convs = [row for row in r.rows if row.algorithms == ("bf16x6",)]
  assert {row.path for row in convs} == {
      *(f"conv_layers_{i}/conv" for i in range(7)), "pos_conv_embed/conv"}
  assert all(row.relative == 1.0 for row in convs)
  assert all(row.relative == pytest.approx(1 / 6) for row in r.rows
             if row not in convs)


def test_str_and_to_dict(convnet):
  fn, args = convnet
  r = jaxprec.cost(fn, *args, policy="default=bfloat16,conv=float32")
  text = str(r)
  assert text.splitlines()[0].startswith("jaxprec cost of ")
  assert "module path" in text and "conv" in text and "bf16x6" in text
  assert "weights (tpu, cost per FLOP): " in text
  d = json.loads(r.to_json())
  assert d["relative"] == pytest.approx(r.relative)
  assert [row["path"] for row in d["rows"]] == ["conv", "dense", "fixed"]
  assert d["policy"] == "default=bfloat16,conv=float32"


def test_bad_input():
  with pytest.raises(TypeError, match="expects a callable"):
    jaxprec.cost(3, X)
  with pytest.raises(ValueError,
                     match="Unknown target 'cpu'; valid choices: 'tpu', 'gpu'"):
    jaxprec.cost(mlp, X, W1, W2, target="cpu")
  with pytest.raises(ValueError, match="Invalid precision 'bf17'"):
    jaxprec.cost(mlp, X, W1, W2, policy="bf17")
  with pytest.raises(ValueError, match="weights must map"):
    jaxprec.cost(mlp, X, W1, W2, weights={"f32": -1})
  with pytest.raises(jaxprec.AuditError):
    jaxprec.cost(mlp, X, W2, W1)
