"""The ``jaxprec`` command: its arguments and what it reads (``cli_inputs``),
``jaxprec run`` (``cli_run``), and the subcommands and what they write
(``cli``).
"""
