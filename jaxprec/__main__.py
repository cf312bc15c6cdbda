"""``python -m jaxprec``: the ``jaxprec`` command line.

The package's ``__init__`` showed the command's status line on a terminal
before importing JAX (``_jaxprec_main.show``); it is cleared here, before the
command prints anything.
"""

import sys

try:
  from jaxprec._src.cli.cli import main
finally:
  if "_jaxprec_main" in sys.modules:
    sys.modules["_jaxprec_main"].clear()

if __name__ == "__main__":
  sys.exit(main())
