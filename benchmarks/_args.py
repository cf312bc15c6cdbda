"""Argument types shared by the benchmark scripts (``argparse`` ``type=``).

A bad value is argparse's error: one line naming the option, exit status 2.
The scripts import this module by name (``python benchmarks/<script>.py`` puts
this directory first on ``sys.path``).
"""

import argparse
import math


def positive(text: str) -> int:
  """An integer of at least 1 (counts, sizes, repeats)."""
  n = int(text)
  if n < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
  return n


def positive_float(text: str) -> float:
  """A finite number above 0."""
  x = float(text)
  if not 0 < x < math.inf:
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
  return x


def non_negative_float(text: str) -> float:
  """A finite number of at least 0 (a tolerance)."""
  x = float(text)
  if not 0 <= x < math.inf:
    raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
  return x
