"""JAX's seams: private JAX behind feature detection, pytree splits, the one
jaxpr walker. The lowest package.
"""
