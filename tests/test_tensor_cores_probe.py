"""Edge cases of the chip models' arguments."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec

DN = (((1,), (0,)), ((), ()))


def test_chip_names_take_any_letter_case_as_targets_do():
  """``chip='H100'`` is the H100 (as ``target='GPU'`` is the GPU), not an
  error that suggests ``'a100'``."""
  a = jnp.array([[1.0, 2.0**-12, 2.0**-13, 2.0**-12]])
  b = jnp.array([[1.0, 1.0], [3 * 2.0**-13, 2.0**-13], [0.0, 2.0**-12],
                 [0.0, 2.0**-12]])
  want = jaxprec.emulated_dot_general(a, b, DN, "tensorfloat32", target="gpu",
                                      chip="h100")
  for chip in ("H100", " h100 "):
    got = jaxprec.emulated_dot_general(a, b, DN, "tensorfloat32",
                                       target="GPU", chip=chip)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    g = jaxprec.emulate(lambda x, y: x @ y, "tensorfloat32", target="gpu",
                        chip=chip)
    np.testing.assert_array_equal(np.asarray(g(a, b)), np.asarray(want))
  with pytest.raises(ValueError, match="Unknown chip 'h200'.*Did you mean "
                     "'h100'"):
    jaxprec.emulated_dot_general(a, b, DN, target="gpu", chip="h200")
  with pytest.raises(ValueError, match="Unknown chip ''"):
    jaxprec.emulated_dot_general(a, b, DN, target="gpu", chip="")


def test_vmap_of_a_float8_preset_keeps_the_chip():
  """``jax.vmap`` of a float8 preset on an H100 computes each batch element
  as the unbatched op does (the promotion interval included), not as a
  native float8 dot."""
  ml_dtypes = pytest.importorskip("ml_dtypes")
  import jax
  rng = np.random.default_rng(0)
  x = jnp.asarray(np.abs(rng.standard_normal((4, 256))).astype(
      ml_dtypes.float8_e4m3fn))
  y = jnp.asarray(np.abs(rng.standard_normal((256, 4))).astype(
      ml_dtypes.float8_e4m3fn))
  f = lambda p: jaxprec.emulated_dot_general(  # noqa: E731
      p, y, DN, "ANY_F8_ANY_F8_F32", jnp.float32, target="gpu", chip="h100",
      fp8_promotion_interval=64)
  want = np.asarray(f(x))
  got = np.asarray(jax.vmap(f)(jnp.stack([x, x])))
  np.testing.assert_array_equal(got[0], want)
  np.testing.assert_array_equal(got[1], want)
