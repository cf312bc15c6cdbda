"""Logits gates: how far a language model's output distributions drift.

Hidden-state errors do not say whether a model still predicts the same
tokens. The gates compare the distributions themselves, position by position
(the last axis holds the vocabulary), in float64 on the host:

* KL divergence ``KL(reference || candidate)`` of the softmax distributions
  (mean and largest over positions);
* top-1 agreement (the fraction of positions whose most likely token is the
  same) and top-k overlap (the mean fraction of the reference's k most
  likely tokens among the candidate's k most likely);
* the largest absolute difference of log-probabilities, over every position
  and token.

A logit of ``-inf`` is a masked token (a padded vocabulary, a decoding
mask): probability 0, as ``jax.nn.log_softmax`` reads it. Where both sides
mask a token it adds nothing; where only the candidate masks a token the
reference gives probability, KL and the log-probability difference are
infinite (a real divergence, not an error). NaN and ``+inf`` have no
distribution: no gates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxprec._src.core import names as names_lib


@dataclasses.dataclass(frozen=True)
class LogitsGates:
  """The logits gates of a candidate against a reference.

  Attributes:
    kl_mean, kl_max: ``KL(reference || candidate)`` in nats, mean and
      largest over positions.
    top1_agreement: fraction of positions whose argmax is the same.
    topk_overlap: mean over positions of ``|topk(c) & topk(r)| / k``.
    max_logprob_diff: largest ``|log p_c - log p_r|`` over all positions and
      tokens.
    k: the k of ``topk_overlap``.
    positions: the number of positions compared.
  """

  kl_mean: float
  kl_max: float
  top1_agreement: float
  topk_overlap: float
  max_logprob_diff: float
  k: int
  positions: int

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _log_softmax(z: np.ndarray) -> np.ndarray:
  """Log-probabilities; ``-inf`` logits (masked tokens) stay ``-inf``."""
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def masked_only(x: np.ndarray) -> bool:
  """Whether the non-finite values of ``x`` (if any) are all ``-inf``, and
  it holds some: masked tokens, not an overflow."""
  x = np.asarray(x, np.float64)
  bad = ~np.isfinite(x)
  return bool(bad.any() and np.isneginf(x[bad]).all())


def usable(x: np.ndarray) -> bool:
  """Whether logits have a distribution at every position: no NaN, no
  ``+inf``, and at least one token not masked (``-inf``) per position."""
  x = np.asarray(x, np.float64)
  return bool(not np.isnan(x).any() and not np.isposinf(x).any()
              and np.isfinite(x).any(axis=-1).all())


def logits_gates(candidate: Any, reference: Any, k: int = 5) -> LogitsGates:
  """The logits gates of ``candidate`` against ``reference``.

  Args:
    candidate, reference: logits of the same shape ``(..., vocab)``
      (arrays, JAX or NumPy); compared in float64.
    k: the k of the top-k overlap (at most the vocabulary size).

  Returns:
    A :class:`LogitsGates`.

  Raises:
    ValueError: shapes that differ, a vocabulary axis of fewer than 2
      entries, a ``k`` outside ``1..vocab``, NaN or ``+inf`` logits, or a
      position whose every token is masked (``-inf``).

  Examples:
    >>> import numpy as np
    >>> from jaxprec._src.checker.logits import logits_gates
    >>> r = np.array([[2.0, 1.0, 0.0], [0.0, 0.5, 3.0]])
    >>> g = logits_gates(r + 1.0, r, k=2)   # a constant shift: same softmax
    >>> g.kl_max < 1e-15, g.top1_agreement, g.topk_overlap
    (True, 1.0, 1.0)
    >>> m = np.array([[2.0, 1.0, -np.inf]])   # the last token masked
    >>> logits_gates(m + 1.0, m, k=1).kl_max < 1e-15
    True
  """
  c = np.asarray(candidate, np.float64)
  r = np.asarray(reference, np.float64)
  if c.shape != r.shape:
    raise ValueError(f"logits_gates: candidate shape {c.shape} != reference "
                     f"shape {r.shape}")
  if c.ndim < 1 or c.shape[-1] < 2:
    raise ValueError(f"logits_gates: the last axis holds the vocabulary and "
                     f"needs at least 2 entries; got shape {c.shape}")
  vocab = c.shape[-1]
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not (
      1 <= k <= vocab):
    raise ValueError(f"logits_gates: k must be an integer in 1..{vocab} (the "
                     f"vocabulary size); got {k!r}")
  for name, x in (("candidate", c), ("reference", r)):
    if np.isnan(x).any() or np.isposinf(x).any():
      raise ValueError(f"logits_gates: the {name}'s logits hold NaN or +inf "
                       f"(-inf is a masked token; these are not)")
    if not np.isfinite(x).any(axis=-1).all():
      raise ValueError(f"logits_gates: a position of the {name} masks every "
                       f"token (-inf): it has no distribution")
  c, r = c.reshape(-1, vocab), r.reshape(-1, vocab)
  if not c.shape[0]:
    raise ValueError(f"logits_gates: no positions to compare (shape "
                     f"{np.shape(candidate)})")
  lc, lr = _log_softmax(c), _log_softmax(r)
  both = np.isneginf(lc) & np.isneginf(lr)  # masked on both sides: no term
  with np.errstate(invalid="ignore"):
    diff = np.where(both, 0.0, np.abs(lc - lr))
  pr = np.exp(lr)
  with np.errstate(invalid="ignore"):
    kl = np.sum(np.where(pr > 0, pr * (lr - lc), 0.0), axis=-1)
  top_c = np.argsort(-c, axis=-1, kind="stable")[:, :k]
  top_r = np.argsort(-r, axis=-1, kind="stable")[:, :k]
  overlap = [len(set(a) & set(b)) / k for a, b in zip(top_c, top_r)]
  return LogitsGates(
      kl_mean=float(kl.mean()), kl_max=float(kl.max()),
      top1_agreement=float(np.mean(top_c[:, 0] == top_r[:, 0])),
      topk_overlap=float(np.mean(overlap)),
      max_logprob_diff=float(diff.max()), k=int(k),
      positions=int(c.shape[0]))


# The logits gates a tolerance can bound (jaxprec.search_policy's metric),
# smaller is better for each: ``top1_disagreement`` is ``1 - top1_agreement``
# and ``logprob_diff`` is ``max_logprob_diff``.
METRICS = ("kl_max", "kl_mean", "logprob_diff", "top1_disagreement")


def metric_value(gates: LogitsGates | None, metric: str) -> float:
  """One of :data:`METRICS` of ``gates``; infinity for ``None`` (logits that
  hold NaN or infinity), which no tolerance admits."""
  if gates is None:
    return float("inf")
  if metric == "top1_disagreement":
    return 1.0 - gates.top1_agreement
  if metric == "logprob_diff":
    return gates.max_logprob_diff
  return float(getattr(gates, metric))


def check_layer(name: Any, k: Any,
                layers: Sequence[tuple[str, tuple[int, ...]]],
                who: str) -> int:
  """The k of the top-k overlap (``k``; None: 5, or the vocabulary size
  where smaller); raises a ValueError unless ``name`` is one of ``layers``
  (``(name, shape)`` pairs) with a vocabulary axis (the last) of at least 2
  entries and ``k`` an integer in ``1..vocab``."""
  shapes = dict(layers)
  if not shapes:
    raise ValueError(
        f"{who}: logits={name!r}, but the function returns no floating-point "
        f"layer to compare (integer and boolean outputs, such as token ids, "
        f"are not compared); return the logits themselves")
  if not isinstance(name, str) or name not in shapes:
    raise names_lib.unknown(
        "logits layer", name, shapes,
        hint=f" (the floating-point layers {who} compares; integer and "
             f"boolean outputs are not; the logits layer holds a language "
             f"model's logits, the vocabulary on the last axis)")
  shape = tuple(shapes[name])
  if not shape or shape[-1] < 2:
    raise ValueError(f"{who}: the logits layer {name!r} has shape {shape}: "
                     f"its last axis holds the vocabulary and needs at least "
                     f"2 entries")
  if int(np.prod(shape[:-1], dtype=np.int64)) == 0:
    raise ValueError(f"{who}: the logits layer {name!r} has shape {shape}: "
                     f"no positions to compare (a batch or sequence of 0)")
  if k is None:
    return min(5, shape[-1])
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not (
      1 <= k <= shape[-1]):
    raise ValueError(f"{who}: logits_k must be an integer in 1..{shape[-1]} "
                     f"(the vocabulary size of {name!r}); got {k!r}")
  return int(k)


def row_gates(candidate: Any, reference: Any, k: int) -> LogitsGates | None:
  """:func:`logits_gates`, or None where either side holds NaN or ``+inf``,
  or masks a whole position (a row that overflowed: no distribution to
  compare), or has no positions. ``-inf`` is a masked token."""
  c, r = np.asarray(candidate), np.asarray(reference)
  if not (usable(c) and usable(r)) or not np.asarray(c).size:
    return None
  return logits_gates(c, r, k)
