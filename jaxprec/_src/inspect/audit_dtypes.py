"""The dtype story of an audited op: what is stored (:class:`Storage`), and
why accumulating in a narrow float is risky (:func:`accumulation_risk`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxprec._src.jaxpr import compat


# Ops that move a stored value to a dot without computing on it: the audit
# follows them back to find what is stored (AuditRow.lhs_storage).
FOLLOWED = frozenset({"convert_element_type", "reshape", "transpose",
                       "squeeze", "expand_dims", "broadcast_in_dim", "copy",
                       "copy_p"})


class Storage:
  """The stored dtype of each jaxpr variable, one environment per depth.

  Fed every equation in :func:`walker.iter_eqns` order (a parent right before
  its bodies). A variable made by a :data:`FOLLOWED` op from another has that
  one's storage; a body's inputs have the storage of the parent's operands;
  after a body, the parent's outputs have the storage of the body's outputs
  (for bodies that map one to one: jit, remat, custom_jvp/vjp, scan).
  """

  def __init__(self) -> None:
    self._env: dict[int, dict[Any, str]] = {0: {}}
    self._open: list[tuple[int, Any, list[Any]]] = []

  def of(self, var: Any, depth: int) -> str:
    """The stored dtype name of ``var``, an operand at ``depth``."""
    if isinstance(var, compat.Var):
      found = self._env.get(depth, {}).get(var)
      if found is not None:
        return found
    dtype = var.aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
      return str(dtype)  # a typed PRNG key (key<fry>): no NumPy dtype
    return np.dtype(dtype).name

  def visit(self, eqn: Any, depth: int) -> None:
    """Records what ``eqn`` (met at ``depth``) tells about storage: call it
    for every equation, in order, before asking :meth:`of` about its
    operands."""
    while self._open and self._open[-1][0] >= depth:
      self._close(*self._open.pop())
    env = self._env.setdefault(depth, {})
    if (eqn.primitive.name in FOLLOWED and eqn.invars
        and len(eqn.outvars) == 1):
      env[eqn.outvars[0]] = self.of(eqn.invars[0], depth)
    subs = body_operands(eqn)
    if subs:
      inner: dict[Any, str] = {}
      for jaxpr, operands in subs:
        for v, o in zip(jaxpr.invars, operands):
          inner[v] = self.of(o, depth)
      self._env[depth + 1] = inner
      self._open.append((depth, eqn, [j for j, _ in subs]))

  def _close(self, depth: int, eqn: Any, bodies: list[Any]) -> None:
    if len(bodies) != 1 or len(bodies[0].outvars) != len(eqn.outvars):
      return
    inner = self._env.get(depth + 1, {})
    outer = self._env.setdefault(depth, {})
    for v, o in zip(bodies[0].outvars, eqn.outvars):
      if isinstance(v, compat.Var) and v in inner:
        outer[o] = inner[v]


def body_operands(eqn: Any) -> list[tuple[Any, list[Any]]]:
  """``(body jaxpr, the parent's operands for its inputs)`` for each body."""
  params = eqn.params
  bodies = list(compat.jaxprs_in_params(params))
  if not bodies:
    return []
  ins = list(eqn.invars)
  name = eqn.primitive.name
  if name == "while":
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    carry = ins[cn + bn:]
    return [(params["cond_jaxpr"].jaxpr, ins[:cn] + carry),
            (params["body_jaxpr"].jaxpr, ins[cn:cn + bn] + carry)]
  if name == "cond":  # the first operand is the branch index
    return [(j, ins[1:]) for j in bodies]
  return [(j, ins) for j in bodies if len(j.invars) == len(ins)]


def accumulation_risk(accumulation: str) -> str:
  """Why accumulating in ``accumulation`` is risky (``''`` when it is not):
  a floating dtype with 11 significand bits or fewer (bfloat16, float16,
  float8).

  Examples:
    >>> from jaxprec._src.inspect.audit_dtypes import accumulation_risk
    >>> accumulation_risk("float32"), accumulation_risk("int32")
    ('', '')
    >>> accumulation_risk("float16")[:51]
    'accumulates in float16, its result dtype: sums of m'
  """
  dtype = jax.numpy.dtype(accumulation)
  if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    return ""
  bits = jax.numpy.finfo(dtype).nmant + 1
  if bits > 11:
    return ""
  # jnp.dot and jnp.einsum record preferred_element_type = the result dtype
  # when the user asks for none, so the two cases read the same.
  return (f"accumulates in {accumulation}, its result dtype: sums of many "
          f"products keep {bits} significand bits, and XLA need not add them "
          f"in float32. Ask preferred_element_type=float32")
