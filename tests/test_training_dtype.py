"""check_training of a bfloat16 model: the reference is the float32 model."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxprec


class _MLP(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(16, dtype=self.dtype, name="hidden")(x))
    return nn.Dense(1, dtype=self.dtype, name="out")(h)


def _train_float32(loss_fn, params, batches, opt):
  state, losses = opt.init(params), []
  for b in batches:
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, b)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return losses


def test_a_bfloat16_model_trains_against_the_float32_model():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((32, 1)), jnp.float32)
  batches = [(x, y)] * 3
  params = _MLP().init(jax.random.key(0), x)

  def loss_for(model):
    def loss_fn(p, b):
      out = model.apply(p, b[0]).astype(jnp.float32)
      return jnp.mean((out - b[1]) ** 2)
    return loss_fn

  opt = optax.sgd(0.1)
  report = jaxprec.check_training(
      loss_for(_MLP(dtype=jnp.bfloat16)), params, batches, opt,
      precisions=["float32"], mode="native")
  expected = _train_float32(loss_for(_MLP()), params, batches, opt)
  np.testing.assert_allclose(report.reference_losses, expected, rtol=1e-6)
  # The row runs the model as it is: in bfloat16, so its losses differ.
  assert report.losses["float32"] != report.reference_losses
