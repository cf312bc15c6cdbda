"""jaxprec: know, control and trust the precision of JAX matmuls and convolutions."""

import os as _os
import sys as _sys

from jaxprec._src import names as _names

if "jax" not in _sys.modules:
  # JAX rejects a bad JAX_DEFAULT_MATMUL_PRECISION at import with an opaque error;
  # check it first with jaxprec's message (and accept jaxprec's spellings).
  try:
    _names.check_env_before_jax(_os.environ)
  except ValueError as _e:
    if _names.running_as_cli(_sys.argv):
      # The command line promises one clear line and exit code 2, no traceback.
      print(f"jaxprec: error: {_e}", file=_sys.stderr)
      raise SystemExit(2) from None
    raise

from jaxprec._src.audit import AuditError
from jaxprec._src.audit import AuditReport
from jaxprec._src.audit import AuditRow
from jaxprec._src.audit import audit
from jaxprec._src.context import PresetConvWarning
from jaxprec._src.context import current
from jaxprec._src.context import precision
from jaxprec._src.emulate import emulate
from jaxprec._src.emulated_ops import emulated_conv_general_dilated
from jaxprec._src.emulated_ops import emulated_dot_general
from jaxprec._src.env import ENV_VAR
from jaxprec._src.env import env_for
from jaxprec._src.env import set_default
from jaxprec._src.env import validate_env
from jaxprec._src.explain import explain
from jaxprec._src.precision import Numerics
from jaxprec._src.precision import Precision
from jaxprec._src.precision import PrecisionLike
from jaxprec._src.precision import resolve
from jaxprec._src.precision import valid_names
from jaxprec._src.rounding import round_to

__version__ = "0.1.0.dev0"

__all__ = (
    "AuditError",
    "AuditReport",
    "AuditRow",
    "ENV_VAR",
    "Numerics",
    "Precision",
    "PrecisionLike",
    "PresetConvWarning",
    "audit",
    "current",
    "emulate",
    "emulated_conv_general_dilated",
    "emulated_dot_general",
    "env_for",
    "explain",
    "precision",
    "resolve",
    "round_to",
    "set_default",
    "valid_names",
    "validate_env",
)
