"""A progress bar on stderr, for the command line and long checks."""

from __future__ import annotations

import contextlib
import sys



class Progress:
  """A progress bar on stderr, shown only when stderr is a terminal.

  Uses ``rich`` when installed, else one rewritten line.
  """

  def __init__(self, total: int, description: str, enabled: bool = True):
    self.total = total
    self.description = description
    self.enabled = enabled and _isatty(sys.stderr)
    self._done = 0
    self._rich = None
    self._task = None

  def __enter__(self) -> Progress:
    if not self.enabled:
      return self
    try:
      from rich.console import Console
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RP,
                                 TextColumn, TimeElapsedColumn)
    except ImportError:
      self._line("")
      return self
    self._rich = RP(TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
    self._rich.__enter__()
    self._task = self._rich.add_task(self.description, total=self.total)
    return self

  def update(self, what: str, advance: int = 0) -> None:
    """Shows ``what`` as the current item and advances by ``advance``."""
    if not self.enabled:
      return
    self._done += advance
    if self._rich is not None:
      self._rich.update(self._task, advance=advance,
                        description=f"{self.description}: {what}")
    else:
      self._line(what)

  def _line(self, what: str) -> None:
    sys.stderr.write(f"\r{self.description}: [{self._done}/{self.total}] "
                     f"{what}\033[K")
    sys.stderr.flush()

  def __exit__(self, *exc) -> None:
    if not self.enabled:
      return
    if self._rich is not None:
      self._rich.__exit__(*exc)
    else:
      sys.stderr.write("\r\033[K")
      sys.stderr.flush()


def _isatty(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):
    return False


@contextlib.contextmanager
def maybe_progress(total: int, description: str, enabled: bool):
  """A :class:`Progress` as a context manager (silent when not ``enabled``)."""
  with Progress(total, description, enabled) as p:
    yield p
