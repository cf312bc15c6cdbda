"""``python -m jaxprec``: the ``jaxprec`` command line."""

import sys

from jaxprec._src.cli.cli import main

if __name__ == "__main__":
  sys.exit(main())
