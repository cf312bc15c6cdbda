"""The runtime state of a policy in force: typed, thread-local.

:func:`jaxprec._src.flax.scope.policy_scope` pushes an :class:`ActiveScope`;
the linen interceptor reads it; a :class:`Recorder` collects what the policy
decided (for :func:`jaxprec.policy_report`). No Flax here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from jaxprec._src.flax.paths import ModulePaths, join
from jaxprec._src.policy.policy import (Policy, PolicyMatch, PolicyReport, Rule,
                                 UnusedRuleWarning)
from jaxprec._src.core.precision import Precision

_TOKENS = itertools.count()


class Recorder:
  """Collects a policy's decisions (thread-safe) and warns once per unused rule."""

  def __init__(self, policy: Policy):
    self.policy = policy
    # Distinct per recorder, for jax.jit's cache key (flax.scope.policy_scope).
    self.token = next(_TOKENS)
    self._lock = threading.Lock()
    self._counts: dict[PolicyMatch, int] = {}
    self._warned: set[Rule] = set()
    self._idle_warned = False  # the default dtype reached no module

  def record(self, path: str, module_type: str | None, op: str,
             precision: Precision | None, rule: Rule | None,
             **decided: Any) -> None:
    """Counts one decision; ``decided``: its other fields of
    :class:`jaxprec.PolicyMatch` (``kept``, ``dtype``, ``dtype_how``,
    ``dtype_rule``)."""
    key = PolicyMatch(path=path, module_type=module_type, op=op,
                      precision=precision, rule=rule, calls=0, **decided)
    with self._lock:
      self._counts[key] = self._counts.get(key, 0) + 1

  def report(self) -> PolicyReport:
    with self._lock:
      items = list(self._counts.items())
    return PolicyReport(policy=self.policy, matches=tuple(
        dataclasses.replace(m, calls=n) for m, n in items))

  def warn_unused(self, what: str = "the model", stacklevel: int = 3) -> None:
    report = self.report()
    unused = report.unused_rules
    dtype = self.policy.default_dtype
    idle = dtype is not None and not any(
        m.dtype_how in ("field", "boundary") for m in report.matches)
    with self._lock:
      new = [r for r in unused if r not in self._warned]
      self._warned.update(new)
      idle, self._idle_warned = idle and not self._idle_warned, (
          self._idle_warned or idle)
    if idle:  # e.g. a plain JAX function: no module to give the dtype
      warnings.warn(
          f"jaxprec policy default dtype {dtype!r} decided the dtype of "
          f"nothing in {what}: compute dtypes are decided per Flax module "
          f"(linen or Hugging Face modules it calls, or the NNX module "
          f"given as the function itself, with a dtype attribute), and none "
          f"ran; cast the inputs or write the dtype into the code instead.",
          UnusedRuleWarning, stacklevel=stacklevel)
    if new:
      warnings.warn(
          f"jaxprec policy rules that decided the precision or dtype of nothing in "
          f"{what}: {', '.join(repr(str(r)) for r in new)}. A rule is unused "
          f"when it matches no module (check paths with jaxprec.audit(...) "
          f"rows' .module_path), only modules an earlier rule matched, or "
          f"only modules whose code set their own precision=. "
          f"See jaxprec.policy_report(...).",
          UnusedRuleWarning, stacklevel=stacklevel)


class _Stack(threading.local):
  """This thread's policy scopes, innermost last."""

  def __init__(self):
    self.scopes: list[ActiveScope] = []


_STACK = _Stack()


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
    return join(path[len(root):] if path[:len(root)] == root else path)


def active() -> ActiveScope | None:
  """The innermost policy scope of this thread, or None."""
  return _STACK.scopes[-1] if _STACK.scopes else None


def recording(recorder: Recorder) -> bool:
  """Whether a scope of this thread records into ``recorder``."""
  return any(s.recorder is recorder for s in _STACK.scopes)


@contextlib.contextmanager
def pushed(scope: ActiveScope) -> Iterator[ActiveScope]:
  """``scope`` is the innermost of this thread in the block (popped in finally)."""
  _STACK.scopes.append(scope)
  try:
    yield scope
  finally:
    _STACK.scopes.pop()
