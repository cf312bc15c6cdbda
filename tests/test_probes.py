"""Regressions found by probing the finished API as a hostile new user would."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jaxprec

RNG = np.random.default_rng(7)
A = RNG.standard_normal((8, 8)).astype(np.float32)


def bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _emulated_scale(fn):
  return jaxprec.emulate(fn, "bfloat16")


def _preset_scale(fn):
  return jaxprec.precision("F32_F32_F32")(fn)


# -- static arguments that compare equal but trace differently ---------------


@pytest.mark.parametrize("wrap", [_emulated_scale, _preset_scale],
                         ids=["emulate", "preset"])
def test_static_int_then_float_traces_again(wrap):
  # 1 == 1.0 == True in Python; a trace made with 1 must not serve 1.0.
  f = wrap(lambda x, s: x * s)
  x = jnp.arange(3, dtype=jnp.int32)
  assert f(x, 1).dtype == jnp.int32
  out = f(x, 1.0)
  assert out.dtype == jnp.float32  # what jnp gives for int32 * 1.0
  np.testing.assert_array_equal(np.asarray(out), [0.0, 1.0, 2.0])
  assert f(x, True).dtype == jnp.int32
  assert f(x, 1.0).dtype == jnp.float32


@pytest.mark.parametrize("wrap", [_emulated_scale, _preset_scale],
                         ids=["emulate", "preset"])
def test_static_signed_zero_traces_again(wrap):
  # 0.0 == -0.0 in Python, but 1 / (x * -0.0) is -inf.
  f = wrap(lambda x, s: 1.0 / (x * s))
  x = jnp.ones(2, jnp.float32)
  assert np.all(np.asarray(f(x, 0.0)) == np.inf)
  assert np.all(np.asarray(f(x, -0.0)) == -np.inf)


def test_static_nan_reuses_one_trace_and_stays_correct():
  calls = []

  def f(x, s):
    calls.append(1)
    return x * s
  g = jaxprec.emulate(f, "bfloat16")
  for _ in range(3):
    assert np.all(np.isnan(np.asarray(g(jnp.ones(2), float("nan")))))
  assert len(calls) == 1


# -- metrics -----------------------------------------------------------------


def _ulps(a, b):
  """float32 ULP distance by integer arithmetic (both values positive)."""
  ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
  ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
  return np.abs(ia - ib)


def test_ulp_median_never_exceeds_ulp_max():
  # Every element has the same error, so the median is the maximum; the
  # median's histogram bucket midpoint (37119) used to exceed it (37027).
  x = jnp.full((4, 4), 1.01, jnp.float32)
  r = jaxprec.check(lambda p: p @ p, x, precisions="bfloat16")
  m = r.layers[0].metrics["bfloat16"]
  xf = np.float64(np.float32(1.01))
  ref = np.float32(4 * xf * xf)
  cand = np.float32(4 * bf16(1.01) ** 2)
  want = float(_ulps(cand, ref))
  assert m.ulp_max == want
  assert m.ulp_median == want


# -- emulate's options are checked when emulate is called --------------------


def test_emulate_rejects_unknown_option_at_once_naming_the_choices():
  with pytest.raises(TypeError, match=r"'tf32_roundin'.*'tf32_rounding'"):
    jaxprec.emulate(lambda a: a @ a, "tf32", target="gpu", tf32_roundin="truncate")


def test_emulate_rejects_bad_tf32_rounding_at_once():
  with pytest.raises(ValueError, match=r"'up'.*'nearest'.*'truncate'"):
    jaxprec.emulate(lambda a: a @ a, "tf32", target="gpu", tf32_rounding="up")


def test_emulate_tf32_rounding_option_still_applies():
  # 1 + 2**-11 + 2**-12: above the TF32 midpoint, so nearest rounds it up
  # to 1 + 2**-10 while truncate keeps 1.
  x = jnp.full((1, 1), 1 + 2.0**-11 + 2.0**-12, jnp.float32)
  one = jnp.ones((1, 1), jnp.float32)
  f = lambda a, b: a @ b
  near = jaxprec.emulate(f, "tf32", target="gpu", tf32_rounding="nearest")
  trunc = jaxprec.emulate(f, "tf32", target="gpu", tf32_rounding="truncate")
  assert float(near(x, one)[0, 0]) == 1 + 2.0**-10
  assert float(trunc(x, one)[0, 0]) == 1.0


# -- a rule on a module whose code set its own precision= decides nothing ----


def _linen_own_precision():
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.Dense(4, name="fc1", precision=lax.Precision.HIGHEST,
                   use_bias=False)(x)
      return nn.Dense(4, name="fc2", use_bias=False)(y)
  x = jnp.asarray(RNG.standard_normal((2, 4)), jnp.float32)
  net = Net()
  return net, net.init(jax.random.PRNGKey(0), x), x


def _by_path(report):
  return {m.path: m for m in report.matches}


def test_rule_on_module_with_own_precision_is_reported_unused_linen():
  net, v, x = _linen_own_precision()
  f = jaxprec.emulate(net.apply, "default=float32,fc1=bfloat16")
  with pytest.warns(jaxprec.UnusedRuleWarning, match="fc1=bfloat16"):
    out = f(v, x)
  # fc1 keeps HIGHEST (its code's choice): exact float32 on TPU too.
  w1 = np.asarray(v["params"]["fc1"]["kernel"], np.float64)
  w2 = np.asarray(v["params"]["fc2"]["kernel"], np.float64)
  h = (np.asarray(x, np.float64) @ w1).astype(np.float32).astype(np.float64)
  np.testing.assert_allclose(np.asarray(out, np.float64), h @ w2, rtol=1e-5,
                             atol=1e-6)
  report = jaxprec.policy_report(f)
  fc1 = _by_path(report)["fc1"]
  assert fc1.kept and fc1.precision.name == "float32"
  assert [str(r) for r in report.unused_rules] == ["fc1=bfloat16"]
  assert "own precision" in str(report)


def test_rule_on_module_with_own_precision_is_reported_unused_nnx():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc1 = nnx.Linear(4, 4, precision=lax.Precision.HIGHEST, rngs=rngs)
      self.fc2 = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.fc2(self.fc1(x))
  net = Net(nnx.Rngs(0))
  f = jaxprec.emulate(net, "default=bfloat16,fc1=bfloat16_3x")
  with pytest.warns(jaxprec.UnusedRuleWarning, match="fc1=bfloat16_3x"):
    f(jnp.ones((2, 4)))
  report = jaxprec.policy_report(f)
  assert _by_path(report)["fc1"].kept
  assert not _by_path(report)["fc2"].kept
  assert [str(r) for r in report.unused_rules] == ["fc1=bfloat16_3x"]


def test_swapped_nnx_model_emulated_with_its_policy_warns_nothing():
  # The precisions swap set are the policy's decisions, not the model's own.
  import warnings
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc1 = nnx.Linear(4, 4, rngs=rngs)
      self.fc2 = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.fc2(self.fc1(x))
  pol = "default=bfloat16,fc1=float32"
  swapped = jaxprec.swap(Net(nnx.Rngs(0)), pol)
  f = jaxprec.emulate(swapped, pol)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxprec.UnusedRuleWarning)
    f(jnp.ones((2, 4)))
  report = jaxprec.policy_report(f)
  assert not any(m.kept for m in report.matches)
  assert report.unused_rules == ()
