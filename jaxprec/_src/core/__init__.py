"""Names and facts: every spelling of a precision (``names``, ``precision``),
the one table of matmul algorithms (``algorithms``), what a target computes
for a precision and op (``numerics``), and the flag in force (``env``,
``context``, ``resumable``: ``@jaxprec.precision`` as decorator and context).

Imports only :mod:`jaxprec._src.jaxpr`; never Flax.
"""
