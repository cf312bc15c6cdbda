"""``jaxprec run``'s child: its environment, and the signals that stop a job
reach the command (``docs/cli.md``). A signal the kernel sends (Ctrl-C or a
hang-up at a terminal: ``si_code > 0``) reached the terminal's whole
foreground process group, the command included, so it is not sent a second
time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from jaxprec._src.core import env as env_lib

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_POLL_S = 0.05
# The variable ``run --policy`` passes the policy's canonical text in.
POLICY_VAR = "JAXPREC_POLICY"


def environment(precision: Any = None, policy: Any = None,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
  """The command's environment for ``run -p PRECISION`` or ``run --policy``.

  Each form sets both variables, so nothing inherited (a leftover ``export``,
  an outer ``jaxprec run``) applies against the one given:

  * ``precision`` (a :class:`jaxprec.Precision`): JAX's flag
    ``JAX_DEFAULT_MATMUL_PRECISION`` is it (removed for ``backend-default``),
    and ``JAXPREC_POLICY`` is removed;
  * ``policy`` (a :class:`jaxprec.Policy`): ``JAXPREC_POLICY`` is its
    canonical text; JAX's flag is its precision when it is one precision
    for everything (no rules), and is removed otherwise (the command's code
    applies the policy: ``jaxprec.swap``, ``jaxprec.emulate``).

  Args:
    precision, policy: exactly one of them.
    base: the environment to start from (default ``os.environ``); not
      modified.
  """
  if (precision is None) == (policy is None):
    raise ValueError("give exactly one of precision and policy")
  base = os.environ if base is None else base
  one = precision if policy is None else (
      policy.default if not policy.rules else None)
  env = env_lib.env_for(one, base)  # None removes JAX's flag
  if policy is None:
    env.pop(POLICY_VAR, None)
  else:
    env[POLICY_VAR] = str(policy)
  return env


def policy_from_env(environ: Mapping[str, str] | None = None) -> Any:
  """The policy ``jaxprec run --policy POLICY -- CMD`` gave ``CMD``, or None.

  ``jaxprec run --policy`` passes the policy's text in ``JAXPREC_POLICY``;
  this reads it back as a :class:`jaxprec.Policy` for ``jaxprec.swap`` or
  ``jaxprec.emulate`` in ``CMD``'s code. A variable that is unset or empty
  gives None (the program runs as written).

  Args:
    environ: the environment to read (default ``os.environ``).

  Returns:
    A :class:`jaxprec.Policy`, or None.

  Raises:
    ValueError: ``JAXPREC_POLICY`` holds no policy; the message names the
      variable, its value and what is wrong with it.

  Examples:
    >>> import jaxprec
    >>> env = {"JAXPREC_POLICY": "default=bf16,dense_2=float32"}
    >>> print(jaxprec.policy_from_env(env))
    default=bfloat16,dense_2=float32
    >>> jaxprec.policy_from_env({}) is None
    True
  """
  from jaxprec._src.policy.policy import as_policy  # noqa: PLC0415
  text = (os.environ if environ is None else environ).get(POLICY_VAR, "")
  if not text.strip():
    return None
  try:
    return as_policy(text)  # what run --policy takes: a policy or a precision
  except ValueError as e:
    raise ValueError(f"{POLICY_VAR}={text!r} is not a jaxprec policy: {e} "
                     f"(jaxprec run --policy sets it, e.g. "
                     f"'default=bfloat16,dense_2=float32')") from None


@dataclasses.dataclass
class Child:
  """A started command: the signals received while it started, and the
  handlers to restore (None outside the main thread: none were installed)."""

  proc: subprocess.Popen
  early: list[int]
  old: dict[int, Any] | None


def start(cmd: Sequence[str], env: dict[str, str]) -> Child:
  """Starts ``cmd`` with the environment ``env``.

  Handlers that record the signals are in place before the command starts,
  so one that arrives in between is forwarded too (the command starts with
  the default handlers: ``exec`` keeps none). Outside the main thread, where
  Python cannot install handlers, nothing is recorded or forwarded.

  Raises:
    FileNotFoundError, PermissionError: as :class:`subprocess.Popen`.
  """
  early: list[int] = []
  old = None
  if threading.current_thread() is threading.main_thread():
    # An ignored signal stays ignored, in the command too (``nohup``).
    old = {s: signal.signal(s, lambda n, _: early.append(n))
           for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN}
  try:
    return Child(subprocess.Popen(list(cmd), env=env), early, old)
  except BaseException:
    _restore(old)
    raise


def wait(child: Child) -> int:
  """Waits for the command, forwarding SIGTERM, SIGINT and SIGHUP sent to
  this process; its status, ``128 + N`` when a signal N ends it (as shells
  say). The handlers :func:`start` replaced are restored, also on an
  exception."""
  try:
    with child.proc:
      rc = _wait(child)
  finally:
    _restore(child.old)
  return 128 - rc if rc < 0 else rc


def _restore(old: dict[int, Any] | None) -> None:
  for s, handler in (old or {}).items():
    signal.signal(s, handler)


def _wait(child: Child) -> int:
  proc, handled = child.proc, tuple(child.old or ())
  if not handled:  # not the main thread (no handlers), or all ignored
    return proc.wait()
  if not hasattr(signal, "sigtimedwait"):  # macOS: forward by handler
    def forward(n, _):
      if n != signal.SIGINT:  # Ctrl-C reached the command already
        _send(proc, n)
    for s in handled:
      signal.signal(s, forward)
    for n in child.early:
      forward(n, None)
    while True:
      try:
        return proc.wait()
      except KeyboardInterrupt:
        continue
  signal.pthread_sigmask(signal.SIG_BLOCK, handled)
  try:
    for n in child.early:  # arrived while it started: origin unknown
      _send(proc, n)
    while True:
      rc = proc.poll()
      if rc is not None:
        return rc
      info = signal.sigtimedwait(handled, _POLL_S)
      if info is not None and info.si_code <= 0:  # sent by a process
        _send(proc, info.si_signo)
  finally:
    # Signals still pending reach the recording handlers, then are dropped.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)


def _send(proc: subprocess.Popen, signum: int) -> None:
  with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
    proc.send_signal(signum)
