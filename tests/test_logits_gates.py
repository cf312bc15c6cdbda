"""jaxprec.torch.logits_gates: KL, top-k agreement, largest logprob difference.

Checked against SciPy's own log-softmax and relative entropy.
"""

import numpy as np
import pytest
from scipy import special, stats

from jaxprec._src.checker.logits import logits_gates


def test_the_gates_match_scipy():
  rng = np.random.default_rng(0)
  r = rng.normal(size=(3, 5, 11)) * 3
  c = r + rng.normal(size=r.shape) * 0.1
  g = logits_gates(c.astype(np.float32), r, k=3)
  lc = special.log_softmax(np.asarray(c, np.float32).astype(np.float64), -1)
  lr = special.log_softmax(r, -1)
  kl = stats.entropy(np.exp(lr).reshape(-1, 11), np.exp(lc).reshape(-1, 11),
                     axis=-1)
  assert g.kl_mean == pytest.approx(kl.mean(), rel=1e-9)
  assert g.kl_max == pytest.approx(kl.max(), rel=1e-9)
  assert g.max_logprob_diff == pytest.approx(np.abs(lc - lr).max(), rel=1e-12)
  assert g.positions == 15 and g.k == 3
  assert 0 < g.kl_mean < g.kl_max


def test_top1_and_topk_count_positions():
  r = np.array([[3.0, 2.0, 1.0, 0.0]] * 4)
  c = r.copy()
  c[0] = [2.0, 3.0, 1.0, 0.0]  # top-1 swapped, top-2 set kept
  c[1] = [3.0, 0.0, 1.0, 2.0]  # top-1 kept, top-2 set half changed
  g = logits_gates(c, r, k=2)
  assert g.top1_agreement == 0.75
  assert g.topk_overlap == pytest.approx((1 + 0.5 + 1 + 1) / 4)
  same = logits_gates(r + 5.0, r, k=4)  # a shift leaves the softmax alone
  assert same.kl_max < 1e-15 and same.max_logprob_diff < 1e-12
  assert same.top1_agreement == same.topk_overlap == 1.0


@pytest.mark.parametrize("c, r, k, match", [
    (np.zeros((2, 3)), np.zeros((2, 4)), 1, "shape"),
    (np.zeros((2, 1)), np.zeros((2, 1)), 1, "at least 2"),
    (np.zeros((2, 3)), np.zeros((2, 3)), 4, r"k must be an integer in 1\.\.3"),
    (np.full((2, 3), np.nan), np.zeros((2, 3)), 1, "NaN"),
])
def test_bad_logits_are_refused(c, r, k, match):
  with pytest.raises(ValueError, match=match):
    logits_gates(c, r, k=k)


def test_masked_tokens_are_probability_zero_as_scipy_reads_the_rest():
  # A padded vocabulary: the last 3 tokens are -inf on both sides. The gates
  # are those of the 8 unmasked tokens (SciPy on them), not an error.
  rng = np.random.default_rng(1)
  r = rng.normal(size=(4, 11)) * 2
  c = r + rng.normal(size=r.shape) * 0.05
  r[:, 8:] = c[:, 8:] = -np.inf
  g = logits_gates(c, r, k=3)
  lc, lr = special.log_softmax(c[:, :8], -1), special.log_softmax(r[:, :8], -1)
  kl = stats.entropy(np.exp(lr), np.exp(lc), axis=-1)
  assert g.kl_max == pytest.approx(kl.max(), rel=1e-9)
  assert g.max_logprob_diff == pytest.approx(np.abs(lc - lr).max(), rel=1e-12)
  assert g.positions == 4 and np.isfinite(g.kl_mean)
  # A decoding mask that differs by position, the same on both sides.
  m = np.triu(np.ones((4, 11), bool), 1)
  assert np.isfinite(logits_gates(np.where(m, -np.inf, c[:, :]).clip(-50),
                                  np.where(m, -np.inf, r).clip(-50), k=1).kl_max)


def test_a_token_only_the_candidate_masks_is_an_infinite_divergence():
  r = np.array([[1.0, 0.0, 0.5]])
  c = np.array([[1.0, 0.0, -np.inf]])
  g = logits_gates(c, r, k=1)
  assert g.kl_max == np.inf and g.max_logprob_diff == np.inf
  # The other way round: the reference gives it probability 0, KL is finite.
  assert np.isfinite(logits_gates(r, c, k=1).kl_max)


@pytest.mark.parametrize("c, match", [
    (np.array([[1.0, np.inf, 0.0]]), r"\+inf"),
    (np.array([[-np.inf, -np.inf, -np.inf]]), "masks every token"),
    (np.zeros((0, 3)), "no positions"),
])
def test_what_has_no_distribution_is_refused(c, match):
  r = np.zeros_like(c)
  with pytest.raises(ValueError, match=match):
    logits_gates(c, r, k=1)
