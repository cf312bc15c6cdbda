"""Static arguments that compare equal but trace differently get their own programs."""

import jax.numpy as jnp
import numpy as np

import jaxprec


def _f(p, s):
  # 16777217 is exact as a Python int (int32 here), not as a float32.
  return (p @ p) * (jnp.asarray(s) - 16777216)


def test_check_does_not_reuse_a_program_across_int_and_float_static_args():
  p = jnp.ones((4, 4))
  as_int = jaxprec.check(_f, p, 16777217, precisions="bfloat16")
  as_float = jaxprec.check(_f, p, 16777217.0, precisions="bfloat16")
  fresh = jaxprec.check(lambda p, s: _f(p, s), p, 16777217.0,
                        precisions="bfloat16")
  # float32(16777217.0) - 16777216 == 0: the output is all zeros.
  assert as_float.layers[0].metrics["bfloat16"].ref_max_abs == 0.0
  assert (as_float.layers[0].metrics["bfloat16"].ref_max_abs
          == fresh.layers[0].metrics["bfloat16"].ref_max_abs)
  np.testing.assert_allclose(as_int.layers[0].metrics["bfloat16"].ref_max_abs, 4.0)


def test_an_all_zero_reference_is_said_out_loud():
  # a @ a at 1e-20 is about 1e-40: below float32's normal range, flushed to
  # zero, so every metric reads "exact". The report says why.
  a = jnp.asarray(np.random.default_rng(0).standard_normal((16, 16)), jnp.float32)
  r = jaxprec.check(lambda a: a @ a, a * 1e-20, precisions="bfloat16")
  assert r.layers[0].metrics["bfloat16"].ref_max_abs == 0.0
  assert any("'output' is all zeros" in n and "1.2e-38" in n for n in r.notes)
  assert "all zeros" in r.to_markdown()
  fine = jaxprec.check(lambda a: a @ a, a, precisions="bfloat16")
  assert not any("all zeros" in n for n in fine.notes)
