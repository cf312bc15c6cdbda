"""The ``jaxprec`` command's entry point, and its first status line.

Importing jaxprec imports JAX, which takes a second or more: on a terminal
this shows the command's name first (one status line, cleared before the
command prints anything), then runs :func:`jaxprec._src.cli.cli.main`. It is
a module of its own, outside the ``jaxprec`` package, because importing
anything inside the package imports the package, and with it JAX.
``python -m jaxprec`` shows the same line: the package's ``__init__`` calls
:func:`show` before it imports JAX, and ``jaxprec/__main__.py`` calls
:func:`clear` once the command line is imported.
"""

import sys

_COMMANDS = ("info", "audit", "run", "check", "search")
_shown = False


def show(args) -> None:
  """Writes ``jaxprec COMMAND: starting...`` as a status line on stderr when
  it is a terminal (``args``: the arguments after the program name)."""
  global _shown
  try:
    tty = sys.stderr.isatty()
  except (AttributeError, ValueError):  # replaced or closed
    tty = False
  if not tty or _shown:
    return
  command = next((a for a in list(args)[:1] if a in _COMMANDS), None)
  name = f"jaxprec {command}" if command else "jaxprec"
  sys.stderr.write(f"\r{name}: starting...\033[K")
  sys.stderr.flush()
  _shown = True


def clear() -> None:
  """Removes the status line of :func:`show`, if it is on screen."""
  global _shown
  if _shown:
    sys.stderr.write("\r\033[K")
    sys.stderr.flush()
    _shown = False


def main() -> int:
  """Runs the ``jaxprec`` command on ``sys.argv``; returns its exit status."""
  show(sys.argv[1:])
  try:
    from jaxprec._src.cli.cli import main as run  # pylint: disable=import-outside-toplevel
  finally:
    clear()
  return run()


if __name__ == "__main__":
  sys.exit(main())
