"""Explains the matmul precision in force: where it comes from and what it means.

:func:`explain` is the text behind ``jaxprec info``; :func:`explain_dict` the
JSON behind ``jaxprec info --json``. The pitfalls come from the
jax.lax.Precision docs, JAX's tests/lax_test.py and JAX's conv_general_dilated
lowering, jax/_src/lax/convolution.py.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxprec._src.core import algorithms
from jaxprec._src.core import context
from jaxprec._src.core import env as env_lib
from jaxprec._src.core.version import __version__
from jaxprec._src.emulation import kernels

HOW_TO_CHANGE: dict[str, str] = {
    "function": ("@jaxprec.precision('float32') on a function, or "
                 "`with jaxprec.precision('float32'):` around a block"),
    "process": (f"{env_lib.ENV_VAR}=float32 python train.py, or "
                "jaxprec run -p float32 -- python train.py"),
    "global": "jaxprec.set_default('float32') (all threads; scopes override it)",
    "one op": ("precision='float32' on lax.dot_general, jnp.dot, jnp.matmul, "
               "jnp.einsum, lax.conv_general_dilated or a Flax layer"),
}

PITFALLS: tuple[str, ...] = (
    "CPU ignores the precision entirely: every level and preset gives exact "
    "float32 here, so tests on CPU cannot show TPU or GPU numerics; "
    "jaxprec.emulate computes them on any backend.",
    "Presets downgrade convolutions: under a DotAlgorithmPreset such as "
    "F32_F32_F32, JAX lowers conv_general_dilated at DEFAULT (1 bfloat16 pass "
    "on TPU). Use a level ('float32') or the decorator @jaxprec.precision(...), "
    "which re-binds convolutions at the preset's level.",
    "Attention-score matmuls (jnp.einsum in dot_product_attention_weights, "
    "jax.nn.dot_product_attention) are not module calls: setting precision= on "
    "Dense layers misses them; set the precision on the whole function.",
    "The flag's spellings differ from per-op ones: JAX_DEFAULT_MATMUL_PRECISION "
    "rejects 'fastest', 'HIGHEST' and lower-case presets; jaxprec.resolve "
    "accepts them all.",
    "Precision settings apply to float32 operands only: bfloat16 or float16 "
    "inputs are computed natively whatever the setting.",
)


def explain_dict() -> dict[str, Any]:
  """What :func:`explain` says, as JSON-able values (``jaxprec info --json``).

  Starts the JAX backend (it lists the devices).

  Returns:
    A dict with keys ``jaxprec_version``, ``jax_version``, ``backend``,
    ``devices``, ``precision`` (``name``, ``source``, ``flag``, ``level``,
    ``preset``), ``env`` (the variable and its value), ``numerics``
    (``here``, ``tpu``, ``gpu``, ``cpu``: see :class:`~jaxprec.Numerics`),
    ``how_to_change`` and ``pitfalls``.

  Examples:
    >>> import jaxprec
    >>> from jaxprec._src.inspect.explain import explain_dict
    >>> with jaxprec.precision("float32"):
    ...   d = explain_dict()
    >>> d["precision"]["name"], d["precision"]["source"]
    ('float32', 'context')
    >>> d["numerics"]["tpu"]["algorithm"], d["numerics"]["gpu"]["algorithm"]
    ('bf16x6', 'f32')
  """
  p = context.current()
  platform = jax.default_backend()
  devices = jax.devices()
  try:
    here = p.on(platform)
  except ValueError:  # a plugin backend jaxprec has no table for
    here = None
  kernel = kernels.current_kernel()
  return {
      "jaxprec_version": __version__,
      "jax_version": jax.__version__,
      "backend": platform,
      "devices": [{"id": d.id, "platform": d.platform,
                   "device_kind": d.device_kind} for d in devices],
      "precision": {
          "name": p.name,
          "source": p.source,
          "flag": p.flag,
          "level": p.level.name,
          "preset": p.preset.name if p.preset is not None else None,
      },
      "env": {"name": env_lib.ENV_VAR, "value": os.environ.get(env_lib.ENV_VAR)},
      "numerics": {
          "here": None if here is None else algorithms.numerics_dict(here),
          "tpu": algorithms.numerics_dict(p.tpu),
          "gpu": algorithms.numerics_dict(p.gpu),
          "cpu": algorithms.numerics_dict(p.cpu),
      },
      "kernel": {
          "setting": kernel.setting,
          "source": kernel.source,
          "env": {"name": kernels.ENV_VAR,
                  "value": kernels._environment()},  # as read, once
          "ratio": kernel.ratio,
          "bf16_units": (None if kernel.bf16_units is None
                         else list(kernel.bf16_units)),
          "reason": kernel.reason,
          "per_algorithm": kernel.per_algorithm(),
      },
      "how_to_change": dict(HOW_TO_CHANGE),
      "pitfalls": list(PITFALLS),
  }


_SOURCES = {
    "context": "a jaxprec.precision / jax.default_matmul_precision scope",
    "config": "the global setting (jaxprec.set_default or jax.config.update)",
    "env": f"the {env_lib.ENV_VAR} environment variable",
    "backend-default": "nothing is set: each backend uses its own default",
}


def _describe(n: dict[str, Any] | None) -> str:
  if n is None:
    return "unknown (no table for this backend)"
  if n["passes"] == 0:
    return f"{n['algorithm']}: {n['note']}"
  return (f"{n['algorithm']}: {n['note']} ({n['operand_bits']} significand "
          f"bits, relative error per product ~{n['rel_error']:.1e})")


# The algorithms whose kernel the text names: the TPU's one bfloat16 pass
# and every multi-pass algorithm of the one table.
_KERNEL_ALGORITHMS = tuple(
    a for a in algorithms.emulated()
    if algorithms.record(a).passes > 1 or a == algorithms.LEVELS["tpu"]["DEFAULT"])


def _kernel_lines(k: dict[str, Any]) -> list[str]:
  """Which kernel runs the emulated passes, and why (docs/emulation.md)."""
  by_kernel: dict[str, list[str]] = {}
  for algorithm in _KERNEL_ALGORITHMS:
    by_kernel.setdefault(k["per_algorithm"][algorithm], []).append(algorithm)
  runs = "; ".join(f"{name} dots for {', '.join(algs)}"
                   for name, algs in sorted(by_kernel.items()))
  return [f"emulation kernel: {k['setting']} (source: {k['source']}): {runs}",
          f"  why: {k['reason']}; change it with {k['env']['name']}="
          "auto|bf16|f32 or jaxprec.set_kernel(...)"]


def explain() -> str:
  """A few lines on the precision in force here and how to change it.

  Covers the backend and devices, the precision in force and where it comes
  from (a scope, the global setting, the environment, or nothing), what it
  computes for float32 operands here and on TPU and GPU, how to change it, and
  the pitfalls. Starts the JAX backend.

  Returns:
    The text that ``jaxprec info`` prints.

  Examples:
    >>> import jaxprec
    >>> with jaxprec.precision("bf16"):
    ...   text = jaxprec.explain()
    >>> print(text.splitlines()[2])
    precision in force: bfloat16 (source: context, a jaxprec.precision / jax.default_matmul_precision scope)
  """
  d = explain_dict()
  p, num = d["precision"], d["numerics"]
  devices = d["devices"]
  kinds = sorted({x["device_kind"] for x in devices})
  env_value = d["env"]["value"]
  lines = [
      f"jaxprec {d['jaxprec_version']}, jax {d['jax_version']}",
      f"backend: {d['backend']}, {len(devices)} device(s): {', '.join(kinds)}",
      f"precision in force: {p['name']} (source: {p['source']}, "
      f"{_SOURCES.get(p['source'], p['source'])})",
      f"  {d['env']['name']}="
      + (env_value if env_value is not None else "(unset)")
      + f"; value for jax.default_matmul_precision: {p['flag']!r}",
      "what it computes for float32 operands:",
      f"  here ({d['backend']}): {_describe(num['here'])}",
      f"  TPU: {_describe(num['tpu'])}",
      f"  GPU: {_describe(num['gpu'])}",
      "how to change it:",
  ]
  lines[-1:-1] = _kernel_lines(d["kernel"])
  width = max(len(k) for k in d["how_to_change"])
  lines += [f"  {k + ':':<{width + 1}} {v}" for k, v in d["how_to_change"].items()]
  lines.append("pitfalls:")
  lines += [f"  - {x}" for x in d["pitfalls"]]
  return "\n".join(lines)
