"""The scope in which a policy applies: :func:`policy_scope`.

Thread-local and restored in ``finally``. Imports Flax's side
(:mod:`jaxprec._src.flax.interception`) only once Flax linen is imported, so
:func:`jaxprec.emulate` and :func:`jaxprec.cost` can enter a policy without
importing Flax.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import jax

from jaxprec._src.flax import state
from jaxprec._src.flax.state import ActiveScope, Recorder, active
from jaxprec._src.jaxpr import compat
from jaxprec._src.policy.policy import Policy


@contextlib.contextmanager
def policy_scope(policy: Policy, recorder: Recorder | None = None,
                 *, what: str = "the model",
                 root_path: tuple[str, ...] | None = None
                 ) -> Iterator[ActiveScope]:
  """Applies ``policy`` to the Flax linen module calls made in the block.

  Reuses the innermost active scope when it has the same policy (so a swapped
  model inside ``jaxprec.emulate(..., policy)`` records once). If Flax linen
  is imported, every linen module method call in the block runs with JAX's
  matmul precision flag set to the policy's precision for that module (see
  :mod:`jaxprec._src.flax.interception`). On leaving the outermost scope
  of a recorder, warns (:class:`jaxprec.UnusedRuleWarning`) about unused
  rules.

  Args:
    policy: the policy.
    recorder: collects the policy's decisions, or None.
    what: names the model in the unused-rule warning.
    root_path: module paths are relative to this module's path (a swapped
      submodule's); set on the scope if it has none yet.

  Yields:
    The :class:`ActiveScope` in force.
  """
  top = active()
  if top is not None and top.policy == policy:
    if top.root_path is None:
      top.root_path = root_path
    yield top
    return
  scope = ActiveScope(policy=policy, recorder=recorder, root_path=root_path,
                      outer_flag=jax.config.jax_default_matmul_precision)
  with state.pushed(scope):
    # The policy joins jax.jit's cache key, so a function jitted under one
    # policy is traced again under another instead of reusing the first trace.
    # So does the recorder: a jitted body (``nn.jit``) that an earlier
    # recorder's trace left in JAX's cache would decide nothing in this one,
    # and its rules would read as unused.
    key = str(policy) if recorder is None else (
        f"{policy} (recorder {recorder.token})")
    intercept = contextlib.nullcontext()
    if "flax.linen" in sys.modules:
      from jaxprec._src.flax import interception
      intercept = interception.intercept(scope)
    with compat.jit_key_scope(key), intercept:
      yield scope
  if recorder is not None and not state.recording(recorder):
    recorder.warn_unused(what, stacklevel=4)
