"""Assertions for users' pytest suites (no Flax needed).

Examples:
  >>> import jax.numpy as jnp, jaxprec.testing
  >>> x = jnp.eye(4)
  >>> _ = jaxprec.testing.assert_precision_robust(lambda a: a @ a, x)
"""

from jaxprec._src.checker.testing import assert_precision_robust

__all__ = (
    "assert_precision_robust",
)
