"""jaxprec.check_training: the same optax loop at each precision."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxprec
from jaxprec._src.checker.training import divergence_step

K1, K2, K3 = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(K1, (64, 32), jnp.float32)
W_TRUE = jax.random.normal(K2, (32, 8), jnp.float32) / 6
Y = jnp.tanh(X @ W_TRUE)
PARAMS = {"w1": jax.random.normal(K3, (32, 32)) / 6, "w2": jnp.zeros((32, 8))}
BATCHES = [(X[i::4], Y[i::4]) for i in range(4)] * 3  # 12 steps


def loss_fn(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


@pytest.fixture(scope="module")
def report():
  return jaxprec.check_training(loss_fn, PARAMS, BATCHES, optax.adam(3e-2),
                                precisions=["bfloat16", "bfloat16_3x"],
                                mode="emulate")


def test_loss_curves_and_drift(report):
  r = report
  assert r.steps == 12 and r.precisions == ("bfloat16", "bfloat16_3x")
  assert len(r.reference_losses) == 12
  assert r.reference_losses[-1] < 0.5 * r.reference_losses[0]  # it trains
  for p in r.precisions:
    assert len(r.losses[p]) == len(r.drift[p]) == 12
    assert r.losses[p][0] == pytest.approx(r.reference_losses[0], rel=2e-2)
  # Emulated gradients: bf16 training drifts from the float32 run much more
  # than three passes do, and the drift grows.
  bf16, x3 = r.drift["bfloat16"], r.drift["bfloat16_3x"]
  assert all(a > 10 * b > 0 for a, b in zip(bf16, x3))
  assert bf16[-1] > bf16[0]
  assert r.divergence_step == {"bfloat16": None, "bfloat16_3x": None}
  assert r.numerics["bfloat16"] == "bf16x1 (tpu, emulated)"
  assert "bfloat16_3x" in str(r)


def test_report_json_and_plot(report, tmp_path):
  d = json.loads(report.to_json())
  assert d["kind"] == "training" and d["steps"] == 12
  assert d["divergence_step"]["bfloat16"] is None
  report.plot(tmp_path / "training.png")
  assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"


def test_divergence_is_detected_with_a_tight_threshold():
  r = jaxprec.check_training(loss_fn, PARAMS, BATCHES[:4], optax.adam(3e-2),
                             precisions=["bfloat16", "bfloat16_3x"],
                             mode="emulate", threshold=1e-4)
  assert r.divergence_step["bfloat16"] is not None
  step = r.divergence_step["bfloat16"]
  rel = abs(r.losses["bfloat16"][step] - r.reference_losses[step]) / (
      r.reference_losses[step])
  assert rel > 1e-4
  assert (r.divergence_step["bfloat16_3x"] is None
          or r.divergence_step["bfloat16_3x"] > step)


def test_native_mode_on_cpu_equals_the_reference():
  r = jaxprec.check_training(loss_fn, PARAMS, BATCHES[:3], optax.sgd(0.1),
                             precisions="bfloat16", mode="native")
  assert r.losses["bfloat16"] == r.reference_losses
  assert r.drift["bfloat16"] == (0.0, 0.0, 0.0)


def test_batches_as_iterator_or_function():
  it = iter(BATCHES)
  r = jaxprec.check_training(loss_fn, PARAMS, it, optax.sgd(0.1), steps=2,
                             precisions=["bf16"], mode="native")
  assert r.steps == 2
  r2 = jaxprec.check_training(loss_fn, PARAMS, lambda i: BATCHES[i],
                              optax.sgd(0.1), steps=2, precisions=["bf16"],
                              mode="native")
  assert r2.reference_losses == r.reference_losses


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 99}, "only 12 batches"),
    ({"reference": "float64"}, "reference"),
    ({"threshold": 0}, "threshold"),
    ({"precisions": ["nope"]}, "Invalid precision"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxprec.check_training(loss_fn, PARAMS, BATCHES, optax.sgd(0.1), **kwargs)
  with pytest.raises(ValueError, match="steps="):
    jaxprec.check_training(loss_fn, PARAMS, iter(BATCHES), optax.sgd(0.1))


def test_divergence_step_definition():
  assert divergence_step([1.0, 0.95, 0.7], [1.0, 0.9, 0.8], 0.1) == 2
  assert divergence_step([1.0, 0.95, 0.81], [1.0, 0.9, 0.8], 0.1) is None
  assert divergence_step([1.0, math.nan], [1.0, 0.9]) == 1
  assert divergence_step([1.0, math.inf], [1.0, math.inf]) is None
  assert divergence_step([0.0, 2e-13], [0.0, 0.0], 0.1) == 1  # floor 1e-12
  np.testing.assert_equal(divergence_step([], []), None)


@pytest.mark.parametrize("optimizer", ["sgd", None, optax.sgd])
def test_optimizer_must_be_a_gradient_transformation(optimizer):
  with pytest.raises(TypeError, match=r"optimizer must be an "
                     r"optax.GradientTransformation .* got "):
    jaxprec.check_training(loss_fn, PARAMS, BATCHES, optimizer)


@pytest.mark.parametrize("precisions", [3, 2.5])
def test_precisions_must_be_names_or_policies(precisions):
  with pytest.raises(TypeError, match=rf"precisions must be .* got {precisions}"):
    jaxprec.check_training(loss_fn, PARAMS, BATCHES, optax.sgd(0.1),
                           precisions=precisions)


def test_without_precisions_a_gpu_trains_at_a_gpus_default_rows():
  """None: the target's default rows, each what the target computes for it
  (on a GPU, 'tensorfloat32' is TF32 and one bfloat16 pass is
  'BF16_BF16_F32')."""
  r = jaxprec.check_training(loss_fn, PARAMS, BATCHES[:2], optax.sgd(0.1),
                             target="gpu", mode="emulate")
  assert r.precisions == ("BF16_BF16_F32", "tensorfloat32",
                          "TF32_TF32_F32_X3")
  assert [r.numerics[p] for p in r.precisions] == [
      "bf16x1 (gpu, emulated)", "tf32 (gpu, emulated)",
      "tf32x3 (gpu, emulated)"]
