"""jaxprec.testing.assert_precision_robust, as users' pytest suites call it."""

import jax
import jax.numpy as jnp
import pytest

import jaxprec
import jaxprec.testing

W = jax.random.normal(jax.random.key(0), (3, 32, 32), jnp.float32) / 6
X = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)


def net(w, x):
  h1 = jnp.tanh(x @ w[0])
  h2 = jnp.tanh(h1 @ w[1])
  return {"h1": h1, "h2": h2, "logits": h2 @ w[2]}


def test_passes_silently_within_tolerance():
  report = jaxprec.testing.assert_precision_robust(net, W, X, mode="emulate")
  assert isinstance(report, jaxprec.DivergenceReport)
  jaxprec.testing.assert_precision_robust(net, W, X, precision="bfloat16_3x",
                                          rtol=1e-4, atol=1e-4, mode="emulate")


def test_fails_naming_the_worst_layer_its_error_and_the_tolerance():
  with pytest.raises(AssertionError) as info:
    jaxprec.testing.assert_precision_robust(net, W, X, rtol=0, atol=1e-4,
                                            mode="emulate")
  msg = str(info.value)
  report = jaxprec.check(net, W, X, precisions=["bfloat16"], mode="emulate",
                         atol=1e-4, rtol=0)
  needs = {l.name: l.metrics["bfloat16"].required_atol for l in report.layers}
  worst = max(needs, key=needs.get)
  assert f"worst layer {worst!r}" in msg
  assert f"{report.layer(worst).metrics['bfloat16'].max_abs:.2e}" in msg
  assert "atol=0.0001, rtol=0" in msg and "'bfloat16'" in msg
  assert "bf16x1 (tpu, emulated)" in msg and "First layer outside the tolerance: 'h1'" in msg
  assert msg.startswith("net is not robust")


def test_fails_on_nans_that_only_the_precision_makes():
  x = jnp.full((4, 4), 1 + 2.0**-9, jnp.float32)

  def f(x):
    d = x @ x - 4 * (1 + 2.0**-9) ** 2
    return {"sqrt": jnp.sqrt(d + 0.015)}
  jaxprec.testing.assert_precision_robust(f, x, precision="float32", atol=1,
                                          mode="emulate")
  with pytest.raises(AssertionError, match="16 NaN"):
    jaxprec.testing.assert_precision_robust(f, x, atol=1, mode="emulate")


def test_is_not_in_the_top_level_namespace_and_needs_no_flax():
  assert not hasattr(jaxprec, "assert_precision_robust")
  assert jaxprec.testing.__all__ == ("assert_precision_robust",)


def test_a_list_tests_each_precision_and_names_those_that_fail():
  # bfloat16_3x passes at 1e-4, bfloat16 does not: before, the list was read
  # as an (lhs, rhs) pair and only float32 was tested, silently passing.
  with pytest.raises(AssertionError) as info:
    jaxprec.testing.assert_precision_robust(
        net, W, X, precision=["bfloat16", "bfloat16_3x"], rtol=1e-4,
        atol=1e-4, mode="emulate")
  msg = str(info.value)
  assert msg.startswith("net is not robust to 1 of 2 precisions ('bfloat16')")
  assert "- 'bfloat16' (bf16x1 (tpu, emulated)" in msg
  assert "'bfloat16_3x' (" not in msg
  report = jaxprec.testing.assert_precision_robust(
      net, W, X, precision=("bfloat16_3x", "float32"), rtol=1e-4, atol=1e-4,
      mode="emulate")
  assert report.precisions == ("bfloat16_3x", "float32")
  with pytest.raises(AssertionError, match="2 of 2 precisions"):
    jaxprec.testing.assert_precision_robust(
        net, W, X, precision=["bf16", "tf32"], rtol=0, atol=1e-7,
        mode="emulate")


def test_a_pair_of_lax_precisions_is_one_precision():
  from jax import lax
  report = jaxprec.testing.assert_precision_robust(
      net, W, X, precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
      rtol=1e-5, atol=1e-5, mode="emulate")
  assert len(report.precisions) == 1
  with pytest.raises(AssertionError, match="is not robust to '"):
    jaxprec.testing.assert_precision_robust(
        net, W, X, precision=(lax.Precision.DEFAULT, lax.Precision.DEFAULT),
        rtol=0, atol=1e-6, mode="emulate")


def test_an_empty_list_is_refused():
  with pytest.raises(ValueError, match="precision is empty"):
    jaxprec.testing.assert_precision_robust(net, W, X, precision=[])
