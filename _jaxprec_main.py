"""The ``jaxprec`` command's entry point.

Importing jaxprec imports JAX, which takes a second or more: on a terminal
this shows the command's name first (one status line, cleared before the
command prints anything), then runs :func:`jaxprec._src.cli.cli.main`. It is
a module of its own, outside the ``jaxprec`` package, because importing
anything inside the package imports the package, and with it JAX.
``python -m jaxprec`` runs the same command without the early line.
"""

import sys

_COMMANDS = ("info", "audit", "run", "check", "search")


def main() -> int:
  """Runs the ``jaxprec`` command on ``sys.argv``; returns its exit status."""
  try:
    tty = sys.stderr.isatty()
  except (AttributeError, ValueError):  # replaced or closed
    tty = False
  if tty:
    command = next((a for a in sys.argv[1:2] if a in _COMMANDS), None)
    name = f"jaxprec {command}" if command else "jaxprec"
    sys.stderr.write(f"\r{name}: starting...\033[K")
    sys.stderr.flush()
  try:
    from jaxprec._src.cli.cli import main as run  # pylint: disable=import-outside-toplevel
  finally:
    if tty:
      sys.stderr.write("\r\033[K")
      sys.stderr.flush()
  return run()


if __name__ == "__main__":
  sys.exit(main())
