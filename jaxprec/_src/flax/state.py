"""The runtime state of a policy in force: typed, thread-local.

:func:`jaxprec._src.flax.scope.policy_scope` pushes an :class:`ActiveScope`;
the linen interceptor reads it. No Flax here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

from jaxprec._src.flax.paths import ModulePaths
from jaxprec._src.policy import Policy, Recorder

__all__ = ["ActiveScope", "active", "pushed", "recording"]

_local = threading.local()


def _stack() -> list[ActiveScope]:
  stack = getattr(_local, "stack", None)
  if stack is None:
    stack = _local.stack = []
  return stack


@dataclasses.dataclass(kw_only=True, eq=False)
class ActiveScope:
  """A policy in force in this thread, and what its interception keeps.

  Attributes:
    policy: the policy.
    recorder: collects its decisions (None: nothing recorded).
    outer_flag: JAX's matmul precision flag outside the scope: what ops get
      when the policy decides nothing for them.
    paths: the module paths of the linen calls made in the scope.
    root_path: the path of the module the policy's paths are relative to (a
      swapped submodule's); None until the first swapped module call sets it,
      then paths are relative to it.
  """

  policy: Policy
  recorder: Recorder | None = None
  outer_flag: Any = None
  paths: ModulePaths = dataclasses.field(default_factory=ModulePaths)
  root_path: tuple[str, ...] | None = None

  def relative(self, path: tuple[str, ...]) -> str:
    """``path`` as the policy sees it: relative to :attr:`root_path`."""
    root = self.root_path or ()
    return "/".join(path[len(root):] if path[:len(root)] == root else path)


def active() -> ActiveScope | None:
  """The innermost policy scope of this thread, or None."""
  stack = _stack()
  return stack[-1] if stack else None


def recording(recorder: Recorder) -> bool:
  """Whether a scope of this thread records into ``recorder``."""
  return any(s.recorder is recorder for s in _stack())


@contextlib.contextmanager
def pushed(scope: ActiveScope) -> Iterator[ActiveScope]:
  """``scope`` is the innermost of this thread in the block (popped in finally)."""
  stack = _stack()
  stack.append(scope)
  try:
    yield scope
  finally:
    stack.pop()
