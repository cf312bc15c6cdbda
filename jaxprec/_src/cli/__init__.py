"""The ``jaxprec`` command (docs/cli.md; docs/architecture.md lists the
modules).
"""
