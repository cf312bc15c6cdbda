"""The ``jaxprec`` command: its arguments and what it reads (``cli_inputs``),
what it writes (``cli_outputs``), ``jaxprec run`` (``cli_run``) and the
subcommands (``cli``).
"""
