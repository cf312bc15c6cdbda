"""What the ``jaxprec`` command line writes: ``report.json`` and ``divergence.png``."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from jaxprec._src.cli.cli_inputs import Failure, one_line
from jaxprec._src.jaxpr import compat


def write_outputs(report: Any, out: str) -> None:
  """Writes ``report.json`` and ``divergence.png`` into ``out``.

  The previous run's picture is removed first; a plot that fails is a
  warning line (the report is written), without matplotlib a note. In a
  multi-process run (``jax.distributed``) process 0 alone writes; the others,
  which computed the same report, write nothing.

  Raises:
    Failure: ``out`` cannot be written.
  """
  if compat.process_index() != 0:
    return
  png = os.path.join(out, "divergence.png")
  try:
    os.makedirs(out, exist_ok=True)
    # A previous run's picture never stays beside this run's report.
    if os.path.lexists(png):
      os.remove(png)
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
      f.write(report.to_json() + "\n")
  except OSError as e:
    raise Failure(f"cannot write to {out!r}: {e}") from None
  try:
    report.plot(png)
  except ImportError:
    print("jaxprec: note: divergence.png not written: matplotlib is not "
          f"installed (pip install 'jaxprec[plots]')", file=sys.stderr)
    return
  except Exception as e:  # noqa: BLE001 -- the report is written: say so
    with contextlib.suppress(OSError):
      os.remove(png)
    print(f"jaxprec: warning: divergence.png not written "
          f"({type(e).__name__}: {one_line(e)}); report.json is written",
          file=sys.stderr)
    return
  print(f"wrote {os.path.join(out, 'report.json')} and "
        f"{os.path.join(out, 'divergence.png')}", file=sys.stderr)
