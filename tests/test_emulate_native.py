"""emulate(..., target='cpu'|'native'): nothing emulated, nothing asked for ignored."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxprec


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="out")(nn.relu(nn.Dense(4, name="hidden")(x)))


def _model():
  model, x = _MLP(), jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  return model, model.init(jax.random.key(0), x), x


def test_native_target_applies_a_dtype_policy():
  model, params, x = _model()
  fn = lambda p, x: model.apply(p, x)  # noqa: E731
  for target in ("cpu", "native"):
    run = jaxprec.emulate(fn, "hidden=dtype:bfloat16", target=target)
    dtypes = [r.lhs_dtype for r in jaxprec.audit(run, params, x).rows]
    assert dtypes == ["bfloat16", "float32"], (target, dtypes)
    # The hidden layer's output is bfloat16, so the result differs from float32.
    assert not np.array_equal(np.asarray(run(params, x)),
                              np.asarray(fn(params, x)))
    report = jaxprec.policy_report(run)
    assert [(m.path, m.dtype) for m in report.matches if m.dtype] == [
        ("hidden", "bfloat16")]


def test_native_target_applies_precisions_as_flags():
  model, params, x = _model()
  fn = lambda p, x: model.apply(p, x)  # noqa: E731
  run = jaxprec.emulate(fn, "default=bf16,out=float32", target="native")
  assert [r.precision_name for r in jaxprec.audit(run, params, x).rows] == [
      "DEFAULT", "HIGHEST"]
  single = jaxprec.emulate(lambda a: a @ a, "float32", target="cpu")
  assert [r.precision_name for r in jaxprec.audit(single, x[:, :2].T @ x[:, :2]).rows
          ] == ["HIGHEST"]
  # The flag is restored after the call.
  before = jax.config.jax_default_matmul_precision
  single(jnp.ones((2, 2)))
  assert jax.config.jax_default_matmul_precision == before


def test_native_target_without_a_precision_is_the_function_itself():
  fn = lambda a: a @ a  # noqa: E731
  assert jaxprec.emulate(fn, None, target="native") is fn
