"""The trainer-sampler log-probability gap, as RL frameworks log it.

An RL trainer recomputes the log-probabilities of the tokens its sampler
drew (a teacher-forced forward over whole sequences) and weighs each token
by the importance ratio ``pi_train / pi_sample``. When the two compute with
other numerics (bfloat16, a KV cache, another chip), the ratio is not 1 even
for on-policy data. The figures here are those RL frameworks log (vLLM RFC
48305, ServiceNow Fast-LLM PR 525): computed on the host in float64 from
the logits of both sides and the sampled tokens, position by position.

``logprobs='raw'`` compares the model's own distributions
(``log_softmax(logits)``); ``'processed'`` the sampler's sampling
distribution: logits divided by the temperature, then the top-k, then the
top-p (nucleus) tokens kept and renormalised, each side with its own logits
(vLLM's order). A token one side keeps and the other drops makes a gap of
infinity, which it is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

LOGPROBS = ("raw", "processed")
# The bands RL frameworks clip or mask the importance ratio to.
BANDS = ((0.5, 2.0), (0.8, 1.25))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """How the compared log-probabilities are made (see the module's text).

  Attributes:
    logprobs: ``'raw'`` or ``'processed'``.
    temperature: divides the logits (``'processed'`` only).
    top_k: keep the k most likely tokens (None: all; ``'processed'`` only).
    top_p: keep the smallest most-likely set of probability at least
      ``top_p`` (None: all; ``'processed'`` only).
  """

  logprobs: str = "raw"
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if self.logprobs not in LOGPROBS:
      raise ValueError(f"logprobs={self.logprobs!r}: choose one of "
                       f"{', '.join(map(repr, LOGPROBS))}")
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
        t > 0 and math.isfinite(t)):
      raise ValueError(f"temperature={t!r}: a finite number > 0")
    k = self.top_k
    if k is not None and (isinstance(k, bool) or not isinstance(
        k, (int, np.integer)) or k < 1):
      raise ValueError(f"top_k={k!r}: an integer >= 1, or None (all tokens)")
    p = self.top_p
    if p is not None and (isinstance(p, bool) or not isinstance(
        p, (int, float)) or not 0 < p <= 1):
      raise ValueError(f"top_p={p!r}: a number in (0, 1], or None (all "
                       f"tokens)")
    if self.logprobs == "raw" and (t != 1.0 or k is not None
                                   or p is not None):
      raise ValueError(
          f"temperature={t!r}, top_k={k!r}, top_p={p!r} change only "
          f"processed log-probabilities: pass logprobs='processed' with "
          f"them, or leave them at 1.0, None, None for 'raw'")

  def __str__(self) -> str:
    if self.logprobs == "raw":
      return "raw log-probs (log_softmax of the logits)"
    return (f"processed log-probs (temperature {self.temperature:g}, top-k "
            f"{self.top_k or 'all'}, top-p {self.top_p or 'all'})")


def log_probs(logits: Any, sampling: Sampling = Sampling()) -> np.ndarray:
  """Float64 log-probabilities ``(..., vocab)`` of ``logits`` as
  ``sampling`` makes them; a dropped token is ``-inf``."""
  z = np.asarray(logits, np.float64)
  if sampling.logprobs == "processed":
    z = z / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < z.shape[-1]:
      kth = -np.sort(-z, axis=-1)[..., sampling.top_k - 1:sampling.top_k]
      z = np.where(z >= kth, z, -np.inf)
  z = z - z.max(axis=-1, keepdims=True)
  lp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
  if sampling.logprobs == "processed" and sampling.top_p is not None:
    order = np.argsort(-lp, axis=-1, kind="stable")
    p = np.take_along_axis(np.exp(lp), order, axis=-1)
    before = np.cumsum(p, axis=-1) - p  # mass of the more likely tokens
    keep = np.empty_like(before, bool)
    np.put_along_axis(keep, order, before < sampling.top_p, axis=-1)
    z = np.where(keep, lp, -np.inf)
    lp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
  return lp


@dataclasses.dataclass(frozen=True)
class GapFigures:
  """The trainer-sampler gap over a sequence's sampled tokens.

  Per token (tuples, one entry per position): ``delta`` = log pi_train -
  log pi_sample of the sampled token in nats (the log of the importance
  ratio), ``kl_train_sample`` = KL(pi_train || pi_sample) and
  ``kl_sample_train`` = KL(pi_sample || pi_train) over the whole vocabulary,
  ``top1_differs``.

  Summaries: ``mean``, ``rms`` and ``max_abs`` of ``delta``; the mean and
  largest KL both ways; ``top1_disagreement`` (a fraction);
  ``ratio_log_rms`` (RMS of log(pi_train / pi_sample), equal to ``rms``)
  and ``outside`` (for each band of :data:`BANDS`, the fraction of tokens
  whose ratio lies outside it).
  """

  sampling: Sampling
  delta: tuple[float, ...]
  kl_train_sample: tuple[float, ...]
  kl_sample_train: tuple[float, ...]
  top1_differs: tuple[bool, ...]
  mean: float
  rms: float
  max_abs: float
  kl_train_sample_mean: float
  kl_train_sample_max: float
  kl_sample_train_mean: float
  kl_sample_train_max: float
  top1_disagreement: float
  ratio_log_rms: float
  outside: tuple[tuple[float, float, float], ...]

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["sampling"] = dataclasses.asdict(self.sampling)
    d["outside"] = [{"band": [lo, hi], "fraction": f}
                    for lo, hi, f in self.outside]
    return d


def _kl(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
  """KL(p || q) per position; 0 where p drops a token, inf where only q
  does."""
  p = np.exp(lp)
  with np.errstate(invalid="ignore"):
    term = np.where(p > 0, p * (lp - lq), 0.0)
  return term.sum(axis=-1)


def gap_figures(trainer_logits: Any, sampler_logits: Any, tokens: Any,
                sampling: Sampling = Sampling()) -> GapFigures:
  """The figures of :class:`GapFigures`.

  Args:
    trainer_logits, sampler_logits: ``(positions, vocab)``, the logits each
      side computed at each position.
    tokens: ``(positions,)``, the token sampled at each position (the next
      token of the sequence).
    sampling: how log-probabilities are made.

  Raises:
    ValueError: shapes that do not fit, no positions, a token outside the
      vocabulary, or logits that hold NaN or ``+inf``.

  Examples:
    >>> import numpy as np
    >>> z = np.array([[2.0, 1.0, 0.0], [0.0, 0.5, 3.0]])
    >>> g = gap_figures(z, z + np.array([[0.0, 0.1, 0.0], [0, 0, 0]]), [0, 2])
    >>> round(g.delta[0], 6), g.delta[1], g.top1_disagreement
    (0.025413, 0.0, 0.0)
  """
  t = np.asarray(trainer_logits, np.float64)
  s = np.asarray(sampler_logits, np.float64)
  ids = np.asarray(tokens)
  if t.shape != s.shape or t.ndim != 2 or ids.shape != t.shape[:1]:
    raise ValueError(f"gap_figures: logits (positions, vocab) of one shape "
                     f"and tokens (positions,); got trainer {t.shape}, "
                     f"sampler {s.shape}, tokens {ids.shape}")
  if not t.shape[0]:
    raise ValueError("gap_figures: no positions to compare")
  if not np.issubdtype(ids.dtype, np.integer) or (
      (ids < 0) | (ids >= t.shape[1])).any():
    raise ValueError(f"gap_figures: tokens must be integers in "
                     f"0..{t.shape[1] - 1}; got {ids.tolist()}")
  for name, z in (("trainer", t), ("sampler", s)):
    if np.isnan(z).any() or np.isposinf(z).any():
      raise ValueError(f"gap_figures: the {name}'s logits hold NaN or +inf")
  lt, ls = log_probs(t, sampling), log_probs(s, sampling)
  rows = np.arange(len(ids))
  with np.errstate(invalid="ignore"):
    delta = lt[rows, ids] - ls[rows, ids]
  kts, kst = _kl(lt, ls), _kl(ls, lt)
  differs = np.argmax(lt, -1) != np.argmax(ls, -1)
  ratio = np.exp(delta)
  return GapFigures(
      sampling=sampling,
      delta=tuple(map(float, delta)), kl_train_sample=tuple(map(float, kts)),
      kl_sample_train=tuple(map(float, kst)),
      top1_differs=tuple(map(bool, differs)),
      mean=float(delta.mean()), rms=rms(delta),
      max_abs=float(np.abs(delta).max()),
      kl_train_sample_mean=float(kts.mean()),
      kl_train_sample_max=float(kts.max()),
      kl_sample_train_mean=float(kst.mean()),
      kl_sample_train_max=float(kst.max()),
      top1_disagreement=float(differs.mean()), ratio_log_rms=rms(delta),
      outside=tuple((lo, hi, float(np.mean((ratio < lo) | (ratio > hi))))
                    for lo, hi in BANDS))


def rms(x: Any) -> float:
  """Root mean square, float64."""
  x = np.asarray(x, np.float64)
  return float(np.sqrt(np.mean(x * x)))
