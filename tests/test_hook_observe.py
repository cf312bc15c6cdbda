"""The one per-module hook lets a recorder observe every module call.

``hook.observing(observer)`` calls ``observer(path, module, args, kwargs,
output)`` as each module call returns, for linen (through the hook's
interceptor) and for NNX (through the call wrapper the hook installs on a
copy), with the same paths and values for twin models, and alongside a
policy's decisions.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxprec
from jaxprec._src.flax import hook


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(3, name="fc")(x))


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = LinenBlock(name="block")(x)
    return nn.Dense(2, name="head")(h)


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.fc(x))


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.block = NnxBlock(rngs)
    self.head = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.block(x))


def _twins():
  x = np.asarray(jax.random.normal(jax.random.key(1), (5, 4)), np.float32)
  lin = LinenNet()
  v = lin.init(jax.random.key(0), x)
  net = NnxNet(nnx.Rngs(0))
  p = v["params"]
  net.block.fc.kernel[...] = p["block"]["fc"]["kernel"]
  net.block.fc.bias[...] = p["block"]["fc"]["bias"]
  net.head.kernel[...] = p["head"]["kernel"]
  net.head.bias[...] = p["head"]["bias"]
  return lin, v, net, x


def _expected(p, x):
  """Each call's (path, input, output), in float64 NumPy, children first."""
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  fc = f64(x) @ f64(p["block"]["fc"]["kernel"]) + f64(p["block"]["fc"]["bias"])
  block = np.tanh(fc)
  head = block @ f64(p["head"]["kernel"]) + f64(p["head"]["bias"])
  return [("block/fc", x, fc), ("block", x, block), ("head", block, head),
          ("", x, head)]


def _observe(run):
  seen = []

  def observer(path, module, args, kwargs, out):
    seen.append((path, type(module).__name__, args, kwargs, out))
  with hook.observing(observer):
    run()
  return seen


def _assert_calls(seen, expected):
  assert [s[0] for s in seen] == [e[0] for e in expected]
  for (_, _, args, kwargs, out), (_, x, y) in zip(seen, expected):
    assert kwargs == {}
    np.testing.assert_allclose(np.asarray(args[0], np.float64), x, rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float64), y, rtol=1e-5,
                               atol=1e-6)


def test_linen_and_nnx_calls_are_observed_with_their_inputs_and_outputs():
  lin, v, net, x = _twins()
  expected = _expected(v["params"], x)
  _assert_calls(_observe(lambda: lin.apply(v, x)), expected)
  copy = nnx.clone(net)
  hook.install(copy)
  seen = _observe(lambda: copy(x))
  _assert_calls(seen, expected)
  assert [s[1] for s in seen] == ["Linear", "NnxBlock", "Linear", "NnxNet"]


def test_nothing_is_observed_outside_the_block_and_the_user_model_is_untouched():
  _, _, net, x = _twins()
  copy = nnx.clone(net)
  hook.install(copy)
  seen = []
  copy(x)
  with hook.observing(lambda *a: seen.append(a[0])):
    pass
  copy(x)
  assert seen == []
  assert type(net) is NnxNet and type(net.block.fc) is nnx.Linear


def test_a_swapped_model_is_observed_once_per_call_under_its_policy():
  _, v, net, x = _twins()
  swapped = jaxprec.swap(net, "block/*=float32,default=bfloat16")
  seen = _observe(lambda: swapped(x))
  _assert_calls(seen, _expected(v["params"], x))
  report = jaxprec.policy_report(swapped)
  assert {m.path for m in report.matches} >= {"block/fc", "head"}


class LinenEncoder(nn.Module):
  @nn.compact
  def encode(self, x):
    return jnp.tanh(nn.Dense(3, name="fc")(x))

  def __call__(self, x):
    return self.encode(x) * 2


def test_an_observer_of_every_method_sees_linen_methods_by_name():
  x = np.ones((5, 4), np.float32)
  enc = LinenEncoder()
  v = enc.init(jax.random.key(0), x)
  every, calls = [], []
  with hook.observing(lambda p, m, a, k, out, method: every.append(
      (p, method, out)), methods=True), \
      hook.observing(lambda p, *a: calls.append(p)):
    y = enc.apply(v, x)
  assert [(p, m) for p, m, _ in every] == [
      ("fc", "__call__"), ("", "encode"), ("", "__call__")]
  assert calls == ["fc", ""]  # __call__ only
  p = v["params"]["fc"]
  want = np.tanh(x @ np.asarray(p["kernel"], np.float64)
                 + np.asarray(p["bias"], np.float64))
  np.testing.assert_allclose(np.asarray(every[1][2], np.float64), want,
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(y, np.float64), 2 * want, rtol=1e-6)
