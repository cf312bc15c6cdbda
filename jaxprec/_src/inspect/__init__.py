"""Reading a program without running it: :func:`jaxprec.audit` (every dot and
conv, opaque ops named), :func:`jaxprec.cost` and the chip table, and
:func:`jaxprec.explain`.
"""
