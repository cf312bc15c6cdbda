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
