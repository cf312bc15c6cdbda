"""Assertions for users' test suites: is my model robust to a precision?"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax import lax

from jaxprec._src.checker import check as check_lib
from jaxprec._src.checker.render import fmt as _fmt
from jaxprec._src.checker.report import DivergenceReport
from jaxprec._src.core.precision import PrecisionLike


def assert_precision_robust(fn: Callable[..., Any], *args: Any,
                            precision: PrecisionLike | Sequence[PrecisionLike]
                            = "bfloat16",
                            rtol: float = 1e-2, atol: float = 1e-2,
                            reference: Any = "float32", target: str = "tpu",
                            mode: str = "auto",
                            **kwargs: Any) -> DivergenceReport:
  """Asserts that every layer of ``fn(*args)`` stays within tolerance at ``precision``.

  Runs :func:`jaxprec.check` with one precision and passes silently when every
  element of every layer (every floating leaf of the output) satisfies
  ``|err| <= atol + rtol * |ref|``; otherwise raises ``AssertionError`` naming
  the worst layer (the one that would need the largest ``atol``), its error,
  the tolerance, and the first layer outside it. For pytest suites: the
  compiled programs are cached, so asserting twice on the same function costs
  one run per precision.

  Args:
    fn: the function; returns hidden states (any pytree of arrays).
    *args: its positional arguments.
    precision: the precision to test, as in :func:`jaxprec.check`
      (``'bfloat16'``: one bfloat16 pass on a TPU, TF32 on a GPU), or a
      list or tuple of them to test each (``['bfloat16', 'bfloat16_3x']``);
      an ``(lhs, rhs)`` pair of ``lax.Precision`` members is one per-op
      precision.
    rtol, atol: the tolerance (defaults 1e-2 and 1e-2: bfloat16 keeps 8
      significant bits, 0.4% per rounding, so 1% is a realistic bound for a
      few layers; tighten it for your model).
    reference, target, mode: as in :func:`jaxprec.check`.
    **kwargs: keyword arguments for ``fn``.

  Returns:
    The :class:`jaxprec.DivergenceReport` (when the assertion passes).

  Raises:
    AssertionError: a layer is outside the tolerance at some precision; the
      message names each precision that fails.
    ValueError: ``precision`` is an empty list.

  Examples:
    >>> import jax.numpy as jnp, jaxprec.testing
    >>> x = jnp.linspace(-1, 1, 256, dtype=jnp.float32).reshape(16, 16)
    >>> _ = jaxprec.testing.assert_precision_robust(lambda a: a @ a, x, atol=0.05)
    >>> jaxprec.testing.assert_precision_robust(lambda a: a @ a, x, atol=1e-6,
    ...                                         rtol=0)
    Traceback (most recent call last):
    ...
    AssertionError: <lambda> is not robust to 'bfloat16' ...
  """
  rows = _rows(precision)
  report = check_lib.check(fn, *args, precisions=rows,
                           reference=reference, target=target, mode=mode,
                           atol=atol, rtol=rtol, **kwargs)
  name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "fn")
  failures = {label: msg for label in report.precisions
              if (msg := _failure(report, label, atol, rtol)) is not None}
  if not failures:
    return report
  if len(report.precisions) == 1:
    raise AssertionError(f"{name} is not robust to {failures[report.precisions[0]]}")
  raise AssertionError(
      f"{name} is not robust to {len(failures)} of {len(report.precisions)} "
      f"precisions ({', '.join(map(repr, failures))}):\n"
      + "\n".join(f"- {m}" for m in failures.values()))


def _rows(precision: Any) -> tuple[Any, ...]:
  """The precisions to test: a list or tuple is several, except an
  ``(lhs, rhs)`` pair of ``lax.Precision`` members (one per-op precision)."""
  if isinstance(precision, (list, tuple)):
    if (len(precision) == 2
        and all(isinstance(p, lax.Precision) for p in precision)):
      return (tuple(precision),)
    if not precision:
      raise ValueError(
          "precision is empty: name at least one, e.g. precision='bfloat16' "
          "or precision=['bfloat16', 'bfloat16_3x']")
    return tuple(precision)
  return (precision,)


def _failure(report: DivergenceReport, label: str, atol: float,
             rtol: float) -> str | None:
  """Why ``label`` fails (the message after "is not robust to"), or None."""
  needs = [l.metrics[label].required_atol for l in report.layers]
  bad = [i for i, need in enumerate(needs) if not need <= atol]
  if not bad:
    return None
  worst = max(bad, key=lambda i: (needs[i] != needs[i], needs[i]))
  layer = report.layers[worst]
  m = layer.metrics[label]
  first = report.layers[bad[0]].name
  nonfinite = (f"; {m.nan} NaN and {m.inf} infinite values where the "
               f"reference has {m.ref_nan} and {m.ref_inf}"
               if m.nan + m.inf != m.ref_nan + m.ref_inf else "")
  return (
      f"{label!r} ({report.numerics[label]}, target "
      f"{report.target}, vs {report.reference}): worst layer {layer.name!r} "
      f"(#{worst} of {len(report.layers)}) has max |error| {_fmt(m.max_abs)} "
      f"(rel_rms {_fmt(m.rel_rms)}); {100 * m.frac_outside:.3g}% of its "
      f"elements are outside atol + rtol*|ref| with atol={atol:g}, "
      f"rtol={rtol:g}; it would pass with atol >= {_fmt(m.required_atol)}"
      f"{nonfinite}. First layer outside the tolerance: {first!r}; "
      f"{len(bad)} of {len(report.layers)} layers are.")
