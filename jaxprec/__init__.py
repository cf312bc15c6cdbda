"""jaxprec: know, control and trust the precision of JAX matmuls and convolutions."""

import importlib as _importlib
import os as _os
import sys as _sys
import typing as _typing

from jaxprec._src.core import names as _names

if "jax" not in _sys.modules:
  # JAX rejects a bad JAX_DEFAULT_MATMUL_PRECISION at import with an opaque error;
  # check it first with jaxprec's message (and accept jaxprec's spellings).
  try:
    _names.check_env_before_jax(_os.environ)
  except ValueError as _e:
    if not _names.running_as_cli(_sys.argv):
      raise
    if _names.asks_help_or_version(_sys.argv):
      # Help and the version need no precision: warn, and let JAX import.
      print(f"jaxprec: warning: ignoring {_e}", file=_sys.stderr)
      del _os.environ[_names.ENV_VAR]
    else:
      # The command line promises one clear line and exit code 2, no traceback.
      print(f"jaxprec: error: {_e}", file=_sys.stderr)
      raise SystemExit(2) from None
  if _names.running_as_cli(_sys.argv):
    # `python -m jaxprec` on a terminal: the command's name on screen before
    # JAX imports, as the `jaxprec` launcher shows it (once: the launcher's
    # line stays); jaxprec/__main__.py clears it.
    try:
      _importlib.import_module("_jaxprec_main").show(_sys.argv[1:])
    except ImportError:  # an install without the launcher module
      pass

from jaxprec._src.core.algorithms import Numerics
from jaxprec._src.core.context import PresetConvWarning
from jaxprec._src.core.context import current
from jaxprec._src.core.context import precision
from jaxprec._src.core.env import ENV_VAR
from jaxprec._src.core.env import env_for
from jaxprec._src.core.env import set_default
from jaxprec._src.core.env import validate_env
from jaxprec._src.core.numerics import UnsupportedAlgorithmError
from jaxprec._src.core.numerics import float8_types
from jaxprec._src.core.precision import Precision
from jaxprec._src.core.precision import PrecisionLike
from jaxprec._src.core.precision import resolve
from jaxprec._src.core.precision import valid_names
from jaxprec._src.core.version import __version__

if _typing.TYPE_CHECKING:
  # Loaded on first use (``__getattr__`` below); imported here so that type
  # checkers and the API docs see them where they are.
  from jaxprec._src.checker.check import check
  from jaxprec._src.checker.check import check_module
  from jaxprec._src.checker.layers import named_layers
  from jaxprec._src.checker.metrics import LayerMetrics
  from jaxprec._src.checker.reference import save_layers
  from jaxprec._src.checker.report import DivergenceReport
  from jaxprec._src.checker.report import Finding
  from jaxprec._src.checker.report import LayerResult
  from jaxprec._src.checker.report import TrainingReport
  from jaxprec._src.checker.sampler import GapFigures
  from jaxprec._src.checker.sampler import Sampling
  from jaxprec._src.checker.sampler_check import Compute
  from jaxprec._src.checker.sampler_check import SamplerReport
  from jaxprec._src.checker.sampler_check import check_sampler
  from jaxprec._src.checker.training import check_training
  from jaxprec._src.cli.cli_run import policy_from_env
  from jaxprec._src.emulation.compile_cache import enable_compilation_cache
  from jaxprec._src.emulation.emulate import OpaqueOpWarning
  from jaxprec._src.emulation.emulate import PolicyUnreachedWarning
  from jaxprec._src.emulation.emulate import emulate
  from jaxprec._src.emulation.emulated_ops import NotModelledWarning
  from jaxprec._src.emulation.emulated_ops import emulated_conv_general_dilated
  from jaxprec._src.emulation.emulated_ops import emulated_dot_general
  from jaxprec._src.emulation.kernels import KernelChoice
  from jaxprec._src.emulation.kernels import bf16_dot_units
  from jaxprec._src.emulation.kernels import current_kernel
  from jaxprec._src.emulation.kernels import set_kernel
  from jaxprec._src.emulation.kernels import use_kernel
  from jaxprec._src.emulation.rounding import round_to
  from jaxprec._src.inspect.audit import AuditError
  from jaxprec._src.inspect.audit import AuditReport
  from jaxprec._src.inspect.audit import AuditRow
  from jaxprec._src.inspect.audit import audit
  from jaxprec._src.inspect.chips import CHIPS
  from jaxprec._src.inspect.cost import CostReport
  from jaxprec._src.inspect.cost import CostRow
  from jaxprec._src.inspect.cost import cost
  from jaxprec._src.inspect.explain import explain
  from jaxprec._src.modules.swap import policy_report
  from jaxprec._src.modules.swap import swap
  from jaxprec._src.policy.policy import Policy
  from jaxprec._src.policy.policy import PolicyMatch
  from jaxprec._src.policy.policy import PolicyReport
  from jaxprec._src.policy.policy import Rule
  from jaxprec._src.policy.policy import UnusedRuleWarning
  from jaxprec._src.search.search import SearchResult
  from jaxprec._src.search.search import search_policy
  from jaxprec._src.search.search_result import SearchStep

# The rest of the public names, by the module each comes from. Resolving a
# precision needs only the names imported above; these modules (the checker,
# the search, the audit, the emulation, ...) load on first use, so that
# `import jaxprec` costs little over `import jax`.
_LAZY_NAMES = {
    "jaxprec._src.checker.check": ("check", "check_module"),
    "jaxprec._src.checker.layers": ("named_layers",),
    "jaxprec._src.checker.metrics": ("LayerMetrics",),
    "jaxprec._src.checker.reference": ("save_layers",),
    "jaxprec._src.checker.report": (
        "DivergenceReport", "Finding", "LayerResult", "TrainingReport",
    ),
    "jaxprec._src.checker.sampler": ("GapFigures", "Sampling"),
    "jaxprec._src.checker.sampler_check": (
        "Compute", "SamplerReport", "check_sampler"),
    "jaxprec._src.checker.training": ("check_training",),
    "jaxprec._src.cli.cli_run": ("policy_from_env",),
    "jaxprec._src.emulation.compile_cache": ("enable_compilation_cache",),
    "jaxprec._src.emulation.emulate": (
        "OpaqueOpWarning", "PolicyUnreachedWarning", "emulate"),
    "jaxprec._src.emulation.emulated_ops": (
        "NotModelledWarning", "emulated_conv_general_dilated", "emulated_dot_general",
    ),
    "jaxprec._src.emulation.kernels": (
        "KernelChoice", "bf16_dot_units", "current_kernel", "set_kernel", "use_kernel",
    ),
    "jaxprec._src.emulation.rounding": ("round_to",),
    "jaxprec._src.inspect.audit": ("AuditError", "AuditReport", "AuditRow", "audit"),
    "jaxprec._src.inspect.chips": ("CHIPS",),
    "jaxprec._src.inspect.cost": ("CostReport", "CostRow", "cost"),
    "jaxprec._src.inspect.explain": ("explain",),
    "jaxprec._src.modules.swap": ("policy_report", "swap"),
    "jaxprec._src.policy.policy": (
        "Policy", "PolicyMatch", "PolicyReport", "Rule", "UnusedRuleWarning",
    ),
    "jaxprec._src.search.search": ("SearchResult", "search_policy"),
    "jaxprec._src.search.search_result": ("SearchStep",),
}
_WHERE = {name: module for module, names in _LAZY_NAMES.items() for name in names}
# jaxprec.linen, .nnx, .models and .testing import Flax, and jaxprec.torch
# leads to PyTorch: loaded on first use too.
_SUBMODULES = ("linen", "models", "nnx", "testing", "torch")

__all__ = (
    "AuditError",
    "AuditReport",
    "AuditRow",
    "CHIPS",
    "Compute",
    "CostReport",
    "CostRow",
    "DivergenceReport",
    "ENV_VAR",
    "Finding",
    "GapFigures",
    "KernelChoice",
    "LayerMetrics",
    "LayerResult",
    "NotModelledWarning",
    "Numerics",
    "OpaqueOpWarning",
    "Policy",
    "PolicyMatch",
    "PolicyReport",
    "PolicyUnreachedWarning",
    "Precision",
    "PrecisionLike",
    "PresetConvWarning",
    "Rule",
    "SamplerReport",
    "Sampling",
    "SearchResult",
    "SearchStep",
    "TrainingReport",
    "UnsupportedAlgorithmError",
    "UnusedRuleWarning",
    "audit",
    "bf16_dot_units",
    "check",
    "check_module",
    "check_sampler",
    "check_training",
    "cost",
    "current",
    "current_kernel",
    "emulate",
    "emulated_conv_general_dilated",
    "emulated_dot_general",
    "enable_compilation_cache",
    "env_for",
    "explain",
    "float8_types",
    "named_layers",
    "policy_from_env",
    "policy_report",
    "precision",
    "resolve",
    "round_to",
    "save_layers",
    "search_policy",
    "set_default",
    "set_kernel",
    "swap",
    "use_kernel",
    "valid_names",
    "validate_env",
)


# Hidden from type checkers: to them every name is imported above, and an
# unknown one is an error rather than Any.
if not _typing.TYPE_CHECKING:

  def __getattr__(name: str) -> _typing.Any:
    module = _WHERE.get(name)
    if module is not None:
      value = getattr(_importlib.import_module(module), name)
      globals()[name] = value  # the next lookup is an ordinary one
      return value
    if name in _SUBMODULES:
      return _importlib.import_module(f"jaxprec.{name}")
    raise AttributeError(f"module 'jaxprec' has no attribute {name!r}")

  def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
