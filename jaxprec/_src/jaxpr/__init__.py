"""JAX's seams: private JAX behind feature detection (``compat``), what counts
as an array leaf and the one split of a call into arrays and statics
(``trees``), and the one jaxpr walker (``walker``) that the audit, the
emulation, scopes and the cost model share.

The lowest package: imports no other package of jaxprec, and no Flax.
"""
