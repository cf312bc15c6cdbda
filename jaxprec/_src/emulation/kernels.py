"""Which kernel computes the emulated passes: bfloat16 dots or float32 dots.

Both kernels compute the same algorithms (:mod:`jaxprec._src.emulation.passes`);
they differ in the dots that run the passes (``docs/emulation.md``, "How it
runs: two kernels"):

``'bf16'``
  One bfloat16-operand dot with float32 results per pass (a small dot's
  passes as blocks of one wider dot, each the same library dot), combined in
  XLA's order: bit for bit XLA's result at contraction length 1.
``'f32'``
  Float32 dots on operands rounded in float32, passes merged where the
  products stay exact: within the accumulation bound of the ``bf16`` kernel,
  not bit for bit.
``'auto'`` (default)
  GPU and TPU backends use ``bf16``. On CPU the choice is a function of the
  CPU's feature flags alone (:func:`bf16_dot_units`), never of a timing, so
  that the same inputs give the same bits in every process on a machine,
  whatever its load: :meth:`KernelChoice.kernel_for`.

Set it with ``JAXPREC_KERNEL=auto|bf16|f32``, :func:`set_kernel` (global) or
:func:`use_kernel` (a thread-local scope); a scope beats the global setting,
which beats the environment. The setting is part of ``jax.jit``'s cache key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import warnings
from collections.abc import Iterator
from typing import Any

import jax

from jaxprec._src.core import algorithms
from jaxprec._src.core import names
from jaxprec._src.jaxpr import compat

ENV_VAR = "JAXPREC_KERNEL"
CACHE_ENV_VAR = "JAXPREC_CACHE_DIR"
KERNELS = ("auto", "bf16", "f32")

# The CPU flags (as /proc/cpuinfo spells them) of bfloat16 dot units: x86's
# AVX512-BF16 and AMX-BF16, Arm's FEAT_BF16.
BF16_UNIT_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# The time of a bfloat16 dot (float32 result) over a float32 dot that auto
# assumes, by whether the CPU has bfloat16 dot units; without them (Eigen's
# dots) bfloat16 is widened to float32 (docs/performance.md). A constant, not
# a timing, so that the choice does not move with the machine's load.
NOMINAL_RATIO = {True: 0.55, False: 1.16}
# The f32 kernel runs an algorithm where it costs below this fraction of the
# bf16 kernel (in float32-dot equivalents).
F32_MARGIN = 0.9
_OPS = ("dot_general", "conv_general_dilated")


def check_kernel(name: Any) -> str:
  """``name`` if it is a kernel setting; otherwise a ValueError naming the choices."""
  return names.check_choice(name, KERNELS, "emulation kernel")


def set_kernel(name: str | None) -> None:
  """Sets the emulation kernel for the process (all threads).

  Args:
    name: ``'auto'``, ``'bf16'`` or ``'f32'`` (see :mod:`jaxprec._src.emulation.kernels`);
      None goes back to ``JAXPREC_KERNEL``, or ``'auto'`` when it is unset.

  Raises:
    ValueError: an unknown name; the message lists the choices.

  Examples:
    >>> import jaxprec
    >>> jaxprec.set_kernel("f32")
    >>> jaxprec.current_kernel().setting
    'f32'
    >>> jaxprec.set_kernel(None)
  """
  compat.KERNEL_STATE.set_global(None if name is None else check_kernel(name))


def use_kernel(name: str) -> contextlib.AbstractContextManager[None]:
  """A scope (this thread) in which emulation runs on kernel ``name``.

  Raises:
    ValueError: an unknown name (at once, not when the scope is entered).

  Examples:
    >>> import jax.numpy as jnp, jaxprec
    >>> x = jnp.array([[1 + 2.0**-9]])
    >>> dn = (((1,), (0,)), ((), ()))
    >>> with jaxprec.use_kernel("f32"):
    ...   float(jaxprec.emulated_dot_general(x, x, dn, "high")[0, 0])
    1.00390625
  """
  return _kernel_scope(check_kernel(name))


@contextlib.contextmanager
def _kernel_scope(name: str) -> Iterator[None]:
  with compat.KERNEL_STATE(name):
    yield


# "first": JAXPREC_KERNEL as first read; "warned": a change was warned about.
_ENV_READ: dict[str, Any] = {}


def _environment() -> str | None:
  """``JAXPREC_KERNEL`` as this process first read it.

  Read once, as JAX reads its own variables: functions jitted under the first
  value would keep it (the variable is not part of ``jax.jit``'s key), so a
  later change warns and is not followed; :func:`set_kernel` is the way.
  """
  now = os.environ.get(ENV_VAR) or None
  first = _ENV_READ.setdefault("first", now)
  if now != first and not _ENV_READ.get("warned"):
    _ENV_READ["warned"] = True
    warnings.warn(
        f"{ENV_VAR} changed from {first!r} to {now!r} after jaxprec first "
        f"read it; it is read once per process, so {first!r} stays in force. "
        f"Use jaxprec.set_kernel(...) to change the kernel in a running "
        f"process.", stacklevel=3)
  return first


def _forget_environment() -> None:
  """Reads ``JAXPREC_KERNEL`` afresh at its next use (tests)."""
  _ENV_READ.clear()


def check_setting() -> str:
  """The setting in force; a ValueError naming the choices for a bad
  ``JAXPREC_KERNEL`` (the command line checks it first)."""
  return _setting()[0]


def _setting() -> tuple[str, str]:
  """(setting, source): source is 'scope', 'global', 'env' or 'default'."""
  state = compat.KERNEL_STATE
  local = state.get_local()
  if isinstance(local, str):  # jax marks "no thread-local value" otherwise
    return local, "scope"
  glob = state.get_global()
  if glob is not None:
    return glob, "global"
  env = _environment()
  if env:
    try:
      return check_kernel(env), "env"
    except ValueError as e:
      raise ValueError(f"{ENV_VAR}: {e}") from None
  return "auto", "default"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelChoice:
  """The kernel setting in force and what it means on this backend.

  Attributes:
    setting: ``'auto'``, ``'bf16'`` or ``'f32'``.
    source: where it comes from: ``'scope'`` (:func:`use_kernel`),
      ``'global'`` (:func:`set_kernel`), ``'env'`` (``JAXPREC_KERNEL``) or
      ``'default'``.
    backend: the JAX backend (``'cpu'``, ``'gpu'``, ``'tpu'``).
    device_kind: its first device's kind.
    ratio: the time of a bfloat16 dot over a float32 dot that ``auto``
      assumes for this CPU, :data:`NOMINAL_RATIO` by its features, never
      measured (``auto`` on CPU only; None otherwise).
    reason: one sentence saying why.
    bf16_units: the CPU flags of bfloat16 dot units found
      (:func:`bf16_dot_units`; ``auto`` on CPU only, None otherwise).
  """

  setting: str
  source: str
  backend: str
  device_kind: str
  ratio: float | None
  reason: str
  bf16_units: tuple[str, ...] | None = None

  def kernel_for(self, algorithm: str, op: str = "dot_general") -> str:
    """``'bf16'`` or ``'f32'``: the kernel that runs ``algorithm`` for ``op``.

    Under ``auto`` on CPU, one-pass algorithms run on ``bf16``, and a
    multi-pass one on ``f32`` only where its float32 dots are fewer than
    :data:`F32_MARGIN` times the ``bf16`` kernel's cost in float32-dot
    equivalents (``ratio * bf16_dots + f32_dots``); algorithms whose passes
    are all float32 take the kernel with fewer dots.

    Raises:
      ValueError: an algorithm or op jaxprec does not emulate.
    """
    record = algorithms.RECORDS.get(algorithm)
    if record is None or record.dots is None:
      raise names.unknown("emulated algorithm", algorithm, algorithms.emulated())
    if op not in _OPS:
      raise names.unknown("op", op, _OPS)
    if self.setting != "auto":
      return self.setting
    if self.ratio is None:  # GPU, TPU: bfloat16 dot units
      return "bf16"
    bf16_dots, f32_dots, merged = record.dots
    if op != "dot_general":  # convolution passes run in float32 either way
      f32_dots, bf16_dots = f32_dots + bf16_dots, 0
    if not bf16_dots:  # float32 passes in both kernels: the fewer dots
      return "bf16" if f32_dots < merged else "f32"
    if (bf16_dots, f32_dots) == (1, 0):
      # One pass: the two kernels cost about the same without bfloat16 dot
      # units (benchmarks/bench_emulated_matmul.py).
      return "bf16"
    bf16_cost = self.ratio * bf16_dots + f32_dots
    return "f32" if merged < F32_MARGIN * bf16_cost else "bf16"

  def per_algorithm(self) -> dict[str, str]:
    """The kernel of each multi-kernel algorithm, for matmuls."""
    return {a: self.kernel_for(a) for a in algorithms.emulated()}

  def to_dict(self) -> dict[str, Any]:
    """What a report records of the kernel (``report.json``'s ``"kernel"``).

    Examples:
      >>> import jaxprec
      >>> with jaxprec.use_kernel("f32"):
      ...   d = jaxprec.current_kernel().to_dict()
      >>> d["setting"], d["source"], d["per_algorithm"]["bf16x3"]
      ('f32', 'scope', 'f32')
    """
    return {"setting": self.setting, "source": self.source,
            "backend": self.backend, "device_kind": self.device_kind,
            "bf16_units": (None if self.bf16_units is None
                           else list(self.bf16_units)),
            "reason": self.reason, "per_algorithm": self.per_algorithm()}


def current_kernel() -> KernelChoice:
  """The emulation kernel in force here, and why.

  Starts the JAX backend. With ``'auto'`` on CPU the choice follows the
  CPU's feature flags (:func:`bf16_dot_units`): nothing is timed, so every
  process on a machine computes the same bits.

  Raises:
    ValueError: ``JAXPREC_KERNEL`` holds an unknown value.
  """
  setting, source = _setting()
  backend = jax.default_backend()
  choice = functools.partial(KernelChoice, setting=setting, source=source,
                             backend=backend,
                             device_kind=jax.devices()[0].device_kind)
  if setting != "auto":
    how = {"scope": "jaxprec.use_kernel", "global": "jaxprec.set_kernel",
           "env": f"{ENV_VAR}={setting}"}[source]
    return choice(ratio=None, reason=f"set by {how}")
  if backend != "cpu":
    return choice(ratio=None,
                  reason=f"{backend} backends have bfloat16 dot units")
  units = bf16_dot_units()
  has = (f"has bfloat16 dot units ({', '.join(units)})" if units
         else "has no bfloat16 dot units")
  return choice(ratio=NOMINAL_RATIO[bool(units)], bf16_units=units,
                reason=(f"chosen from the CPU's feature flags, not timed: "
                        f"{_cpu_model()} {has}"))


def kernel_for(algorithm: str, op: str = "dot_general") -> str:
  """The kernel (``'bf16'`` or ``'f32'``) that runs ``algorithm`` now."""
  return current_kernel().kernel_for(algorithm, op)


def cache_dir() -> str:
  """Where jaxprec keeps its caches: ``JAXPREC_CACHE_DIR``, else the user's cache dir.

  The user's cache dir is ``$XDG_CACHE_HOME/jaxprec`` (``~/.cache/jaxprec``),
  ``~/Library/Caches/jaxprec`` on macOS or ``%LOCALAPPDATA%\\jaxprec`` on
  Windows. Delete the directory to clear it.
  """
  explicit = os.environ.get(CACHE_ENV_VAR)
  if explicit:
    return os.path.expanduser(explicit)
  home = os.path.expanduser("~")
  if os.name == "nt":
    base = os.environ.get("LOCALAPPDATA") or os.path.join(home, "AppData", "Local")
  elif platform.system() == "Darwin":
    base = os.path.join(home, "Library", "Caches")
  else:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
  return os.path.join(base, "jaxprec")


@functools.cache
def _cpuinfo(field: str) -> str | None:
  """The first ``field : value`` line's value in ``/proc/cpuinfo`` (None: none)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        name, sep, value = line.partition(":")
        if sep and name.strip() == field:
          return value.strip()
  except OSError:
    pass
  return None


def _cpu_model() -> str:
  return (_cpuinfo("model name") or platform.processor() or platform.machine()
          or "unknown CPU")


def bf16_dot_units() -> tuple[str, ...]:
  """The CPU's flags, among :data:`BF16_UNIT_FLAGS`, that name bfloat16 dot
  units (x86 ``flags``, Arm ``Features`` in ``/proc/cpuinfo``); ``()`` where
  there are none or the OS does not list them.

  Read once per process: a machine's flags do not change while it runs.
  """
  flags = set((_cpuinfo("flags") or _cpuinfo("Features") or "").split())
  return tuple(f for f in BF16_UNIT_FLAGS if f in flags)
