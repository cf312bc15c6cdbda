"""Names and facts: every spelling of a precision, the one table of matmul
algorithms, what a target computes for a precision and op, and the flag in
force (``docs/architecture.md`` lists the modules).

Imports only :mod:`jaxprec._src.jaxpr`; never Flax.
"""
