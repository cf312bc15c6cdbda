"""Progress of a long check on stderr: a bar on a terminal, one line per
phase elsewhere (a CI log, a pipe, a notebook), so a cold check is never
silent for its whole compile time."""

from __future__ import annotations

import sys
import time

from jaxprec._src.checker import render


def stderr_is_terminal() -> bool:
  """Whether stderr is a terminal (False when it cannot say)."""
  try:
    return bool(sys.stderr.isatty())
  except (AttributeError, ValueError):  # replaced or closed
    return False


class Phases:
  """A context manager reporting the phases of ``total`` steps.

  With ``enabled``: on a terminal, :class:`render.Progress`'s bar; elsewhere
  one line per :meth:`update`, ``'{description}: {what}'``, and
  ``'{description}: done in 12.3 s'`` at :meth:`finish`. Lines are flushed
  at once.
  """

  def __init__(self, total: int, description: str, enabled: bool = True):
    self.description = description
    self.bar = render.Progress(total, description, enabled)
    self.lines = bool(enabled) and not stderr_is_terminal()
    self._t0 = time.perf_counter()

  def __enter__(self) -> Phases:
    self._t0 = time.perf_counter()
    self.bar.__enter__()
    return self

  def update(self, what: str, advance: int = 0) -> None:
    """Shows the phase ``what``; advances the bar by ``advance``."""
    self.bar.update(what, advance)
    if self.lines:
      self._line(what)

  def finish(self) -> None:
    """The last step is done: ``'{description}: done in 12.3 s'``."""
    self.bar.update("done", self.bar.total - self.bar.done)
    if self.lines:
      self._line(f"done in {time.perf_counter() - self._t0:.1f} s")

  def _line(self, what: str) -> None:
    print(f"{self.description}: {what}", file=sys.stderr, flush=True)

  def __exit__(self, *exc) -> None:
    self.bar.__exit__(*exc)
