"""The search's dtype axis (``docs/search.md``, "Compute dtypes too"):
:func:`table` builds its (dtype, precision) candidates, cheapest first, and
the :class:`~jaxprec._src.search.search_algorithm.CostTable` of the units'
roofline costs.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxprec._src.core import names
from jaxprec._src.core import numerics
from jaxprec._src.core.precision import Precision, resolve
from jaxprec._src.flax import nnx_policy
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.flax import state as flax_state
from jaxprec._src.inspect import audit as audit_lib
from jaxprec._src.inspect import chips as chips_lib
from jaxprec._src.inspect import cost as cost_lib
from jaxprec._src.policy.policy import Policy, Rule
from jaxprec._src.search.search_algorithm import Candidate, CostTable

AXES = ("precision", "dtype")
DEFAULT_DTYPES = ("bfloat16", "float32")
# The chip whose spec sheet orders the dtype axis's costs, per target.
DEFAULT_CHIPS = {"tpu": "tpu-v5e", "gpu": "h100"}


def check_axes(axes: Any) -> tuple[str, ...]:
  """``axes`` as a tuple in :data:`AXES` order.

  Accepts a name, a comma-separated string (``'precision,dtype'``) or a
  sequence of names.

  Raises:
    ValueError: an unknown or empty axis, naming it and the choices.

  Examples:
    >>> from jaxprec._src.search.search_dtype import check_axes
    >>> check_axes("dtype,precision"), check_axes(("precision",))
    (('precision', 'dtype'), ('precision',))
  """
  given = axes.split(",") if isinstance(axes, str) else axes
  try:
    given = [n.strip() if isinstance(n, str) else n for n in given]
  except TypeError:
    raise names.unknown("axes", axes, AXES,
                        hint=" (one, or a sequence of them)") from None
  if not given:
    raise ValueError(f"axes is empty; valid choices: "
                     f"{', '.join(map(repr, AXES))} (one or both).")
  for n in given:
    if n not in AXES:
      raise names.unknown("axis", n, AXES)
  return tuple(a for a in AXES if a in given)


def check_dtypes(dtypes: Any) -> tuple[str, ...]:
  """Candidate dtypes, canonical, narrowest first (default
  :data:`DEFAULT_DTYPES`); ValueError naming a bad one."""
  if dtypes is None:
    return DEFAULT_DTYPES
  if isinstance(dtypes, str):
    dtypes = dtypes.split(",")
  try:
    names = [numerics.canonical_dtype(d.strip() if isinstance(d, str) else d)
             for d in dtypes]
  except TypeError:
    raise ValueError(f"dtypes must be a sequence of dtypes, e.g. "
                     f"('bfloat16', 'float32'); got {dtypes!r}.") from None
  if not names:
    raise ValueError("dtypes is empty: name at least one, e.g. "
                     "dtypes=('bfloat16', 'float32').")
  return tuple(sorted(set(names), key=lambda d: (numerics.DTYPE_BYTES[d],
                                                 numerics.DTYPES.index(d))))


def check_arguments(axes: Any, dtypes: Any, chip: Any, target: str
                    ) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
  """Checks ``search_policy``'s ``axes``, ``dtypes`` and ``chip`` (``target``
  is checked).

  Returns:
    ``(axes, dtypes)`` as :func:`check_axes` and :func:`check_dtypes` give
    them; ``dtypes`` None without the dtype axis.

  Raises:
    ValueError: a bad value (naming it and the choices); ``dtypes`` or
      ``chip`` without the dtype axis; a chip of another target; a narrow
      dtype the chip (or the target's default chip) has no peak figure for.
  """
  axes = check_axes(axes)
  names = check_dtypes(dtypes)
  if "dtype" not in axes:
    if dtypes is not None or chip is not None:
      raise ValueError(f"dtypes= and chip= apply to the dtype axis; got axes="
                       f"{axes!r}: pass axes=('precision', 'dtype') or "
                       f"('dtype',).")
    return axes, None
  spec = chips_lib.check_chip(chip or DEFAULT_CHIPS[target])
  if spec.target != target:
    raise ValueError(f"chip {spec.name!r} is a {spec.target} chip; the "
                     f"target is {target!r}.")
  ok = [d for d in numerics.DTYPES if d == "float32" or d in spec.peak]
  for d in names:  # a narrow dtype's matmuls run natively in it
    if d not in ok:
      raise ValueError(
          f"dtype {d!r} has no peak figure on {spec.name}, so its matmuls "
          f"cannot be costed; choose dtypes from "
          f"{', '.join(map(repr, ok))}, or a chip that has it (a gpu one).")
  return axes, names


# ---------------------------------------------------------------------------
# One trace per dtype: the matmuls, the modules reached, their boundaries.


def _float_bytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree)
             if getattr(x, "dtype", None) is not None and hasattr(x, "shape")
             and np.issubdtype(np.dtype(x.dtype), np.floating))


@contextlib.contextmanager
def _boundaries(found: dict[str, int]) -> Iterator[None]:
  """Adds the floating bytes in and out of each linen module call to ``found``
  (by module path as the policy in force sees it)."""
  if "flax.linen" not in sys.modules:
    yield
    return
  from flax import linen as nn  # noqa: PLC0415 -- Flax only when in use

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    scope = flax_state.active()
    if scope is not None and context.method_name != "setup":
      path = scope.relative(scope.paths.of(context.module))
      found[path] = found.get(path, 0) + _float_bytes((args, kwargs, out))
    return out

  with nn.intercept_methods(interceptor):
    yield


def _trace(fn, args, kwargs, dtype: str):
  """``(rows, reached, boundary bytes)`` of ``fn`` traced with every module at
  ``dtype``: the audit rows, the module paths a dtype decision reached (in
  call order, with how: ``'field'``/``'boundary'``), and the bytes."""
  fn = cost_lib.unjit(fn)
  # A rule for every path: the default dtype leaves a linen module without a
  # dtype field as built, a rule casts it at its boundary, so it is a unit.
  # (NNX cannot cast one: a rule may not match it, the default skips it.)
  nnx = nnx_policy.bind(fn, None) is not fn
  policy = (Policy(default_dtype=dtype) if nnx
            else Policy(rules=[Rule(path=".*", dtype=dtype)]))
  recorder = flax_state.Recorder(policy)
  found: dict[str, int] = {}
  bound = nnx_policy.bind(fn, policy, recorder)

  @functools.wraps(bound)
  def traced(*a, **k):
    with flax_scope.policy_scope(policy, recorder), \
         jax.default_matmul_precision(None), _boundaries(found):
      return bound(*a, **k)
  rows = audit_lib.audit(traced, *args, **kwargs).rows
  reached: dict[str, str] = {}
  for m in recorder.report().matches:
    if m.dtype_how in ("field", "boundary") and m.path not in reached:
      reached[m.path] = m.dtype_how
  return rows, reached, found


def _is_container(path: str, paths: Sequence[str]) -> bool:
  return any(p != path and (path == "" or p.startswith(path + "/"))
             for p in paths)


def _seconds(rows, chip: chips_lib.Chip, target: str,
             p: Precision | None, what: str | None) -> float:
  """Roofline seconds of ``rows``; a row without a figure raises (naming
  ``what``), or counts nothing when ``what`` is None."""
  total = 0.0
  for r in rows:
    algo = cost_lib.algorithm(r, target, p)
    s = chips_lib.op_seconds(chip, algo, r.flops, cost_lib.op_bytes(r)[0])
    if s is None and what is not None:
      raise ValueError(
          f"{what}: a {r.primitive} at {r.module_path or '(top)'!r} runs "
          f"{algo!r}, which {chip.name} has no peak figure for; choose other "
          f"dtypes or candidates (or another chip).")
    total += 0.0 if s is None else s
  return total


def table(fn, args, kwargs, *, target: str, axes: tuple[str, ...],
          dtypes: tuple[str, ...], precisions: Sequence[Candidate],
          chip: str | None) -> tuple[CostTable, list[Candidate]]:
  """``(table, candidates)`` of the call ``fn(*args, **kwargs)`` (traced,
  never run) on the roofline of ``chip`` (default :data:`DEFAULT_CHIPS`).

  The candidates come cheapest first, each with ``dtype`` set (and
  ``precision`` None on the dtype axis alone); ``axes``, ``dtypes`` and
  ``chip`` are as :func:`check_arguments` checked them, ``precisions`` the
  precision candidates, cheapest first. ValueError: a candidate the chip has
  no peak figure for.
  """
  spec = chips_lib.check_chip(DEFAULT_CHIPS[target] if chip is None else chip)
  traced = {d: _trace(fn, args, kwargs, d)
            for d in dict.fromkeys((*dtypes, "float32"))}
  # Units in call order: the modules reached, then matmul paths outside them.
  reached: dict[str, str] = {}
  for _, r, _ in traced.values():
    for path, how in r.items():
      reached.setdefault(path, how)
  dots = dict.fromkeys(row.module_path for rows, _, _ in traced.values()
                       for row in rows
                       if row.precision is None and row.emulated)
  use_precision = "precision" in axes
  units = [p for p, how in reached.items()
           if p in dots or how == "boundary"
           or not _is_container(p, list(reached))]
  if use_precision:
    units += [p for p in dots if p not in reached]
  # Candidates: a narrow dtype's matmuls run natively whatever the precision.
  pairs: list[tuple[str, Precision | None, str]] = []
  for d in dtypes:
    if not use_precision:
      pairs.append((d, None, f"dtype:{d}"))
    elif numerics.DTYPE_BYTES[d] < 4:
      c = precisions[0]
      pairs.append((d, c.precision, f"{c.label}+dtype:{d}"))
    else:
      pairs += [(d, c.precision, f"{c.label}+dtype:{d}") for c in precisions]

  def unit_cost(u: str, d: str, p: Precision | None) -> float:
    rows, _, found = traced[d]
    mine = [r for r in rows if r.module_path == u and r.precision is None
            and r.emulated]
    if mine:
      return _seconds(mine, spec, target, p, f"dtype {d}")
    return found.get(u, 0) / spec.hbm_bytes_per_s

  costs = np.array([[unit_cost(u, d, p) for d, p, _ in pairs] for u in units]
                   ).reshape(len(units), len(pairs))
  rows32 = traced["float32"][0]
  fixed = [r for r in rows32 if not (r.module_path in units
                                     and r.precision is None and r.emulated)]
  fixed_cost = _seconds(fixed, spec, target, None, None)
  f32 = resolve("float32") if use_precision else None
  float32_cost = fixed_cost + sum(unit_cost(u, "float32", f32) for u in units)
  totals = costs.sum(axis=0)
  cands = [Candidate(label, p, f"{d}/{'-' if p is None else p.name}",
                     float(total), dtype=d)
           for (d, p, label), total in zip(pairs, totals)]
  order = sorted(range(len(cands)), key=lambda k: (
      cands[k].weight, numerics.DTYPE_BYTES[cands[k].dtype],
      0 if cands[k].precision is None
      else cands[k].precision.on(target).operand_bits))
  cands = [cands[k] for k in order]
  reach = tuple((u in reached, u in dots) for u in units)
  cast = tuple(reached.get(u) == "boundary" for u in units)
  return CostTable(units, costs[:, order], fixed_cost, float32_cost,
                   reach=reach, cast=cast), cands
