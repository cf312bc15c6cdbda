"""Counting the passes of emulated dots in lowered StableHLO text.

The ``bf16`` kernel lowers one ``dot_general`` per pass; the ``f32`` kernel
runs the passes of one dot of at most ``emulated_ops.BATCH_MACS``
multiply-adds as one batched ``dot_general`` over a new leading axis, one
batch element per pass. For
operands without batch axes of their own, the passes are the dots' count,
each batched dot counted by its leading batch size.
"""

import re

_DOT = re.compile(r"stablehlo\.dot_general.*")
_BATCHED = re.compile(r"batching_dims = \[0\] x \[0\].*?: \(tensor<(\d+)x")


def dot_lines(text: str) -> list[str]:
  """Every ``stablehlo.dot_general`` line of ``text``."""
  return _DOT.findall(text)


def passes(text: str) -> int:
  """The passes the dots of ``text`` run (see the module docstring)."""
  total = 0
  for line in dot_lines(text):
    m = _BATCHED.search(line)
    total += int(m.group(1)) if m else 1
  return total
