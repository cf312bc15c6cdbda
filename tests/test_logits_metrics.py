"""The logits gates in jaxprec.check (logits=) and jaxprec.search_policy
(metric='kl_max', ..., logits=), on a tiny NNX language model.

Each row's gates are checked against jaxprec.torch.logits_gates computed
here from the model's own logits, emulated with jaxprec.emulate.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprec
from jaxprec.torch import logits_gates

VOCAB, SEQ, WIDTH = 50, 8, 32


class TinyLM(nnx.Module):
  """Token embedding, two Dense layers, a vocabulary head."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.dense_1 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.dense_2 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    h = jnp.tanh(self.dense_1(self.embed(tokens)))
    h = jnp.tanh(self.dense_2(h)) + h
    return {"hidden": h, "logits": self.head(h) * 4.0}


@pytest.fixture(scope="module")
def lm():
  model = TinyLM(nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, VOCAB)
  return model, tokens


@pytest.fixture(scope="module")
def report(lm):
  model, tokens = lm
  # On a GPU target 'float32' is exact float32, and 'bfloat16' is what a GPU
  # computes for that name (TF32), as jaxprec.emulate(..., target='gpu').
  return jaxprec.check(model, tokens, precisions=["float32", "bfloat16"],
                       target="gpu", mode="emulate", logits="logits")


def test_float32_row_is_exact(report):
  g = report.logits["float32"]
  assert report.logits_layer == "logits"
  assert g.kl_max <= 1e-12 and g.kl_mean <= 1e-12
  assert g.top1_agreement == 1.0 and g.topk_overlap == 1.0
  assert g.max_logprob_diff <= 1e-5
  assert g.k == 5 and g.positions == 2 * SEQ


def test_bfloat16_row_matches_logits_gates_of_emulate(lm, report):
  model, tokens = lm
  reference = np.asarray(model(tokens)["logits"])
  row = np.asarray(jaxprec.emulate(model, "bfloat16", target="gpu")(
      tokens)["logits"])
  want = logits_gates(row, reference, k=5)
  got = report.logits["bfloat16"]
  assert want.kl_max > 1e-9  # bfloat16 moves the distributions
  assert got.kl_max == pytest.approx(want.kl_max, rel=1e-6)
  assert got.kl_mean == pytest.approx(want.kl_mean, rel=1e-6)
  assert got.max_logprob_diff == pytest.approx(want.max_logprob_diff,
                                               rel=1e-6)
  assert got.top1_agreement == want.top1_agreement
  assert got.topk_overlap == want.topk_overlap
  assert got.positions == want.positions


def test_a_row_that_overflows_has_no_gates():
  # 3.4e38 is a float32; bfloat16 rounds it up past its largest, to inf.
  x = jnp.full((2, 4), 3.4e38, jnp.float32)
  r = jaxprec.check(lambda w, x: {"logits": x @ w}, jnp.eye(4), x,
                    precisions=["bfloat16"], mode="emulate", logits="logits")
  assert r.logits == {"bfloat16": None}
  assert any("no logits gates" in n for n in r.notes)
  assert "bfloat16: no logits gates (NaN or infinity)" in str(r)
  back = jaxprec.DivergenceReport.from_json(r.to_json())
  assert back.logits == {"bfloat16": None}


def test_logits_k_sets_the_topk(lm):
  model, tokens = lm
  r = jaxprec.check(model, tokens, precisions=["bfloat16"], mode="emulate",
                    logits="logits", logits_k=2)
  assert r.logits["bfloat16"].k == 2


def test_table_and_markdown_show_the_gates(report):
  text = str(report)
  lines = text.splitlines()
  head = [l for l in lines if l.startswith("logits gates of logits")]
  assert len(head) == 1 and "16 positions" in head[0]
  rows = [l for l in lines if l.startswith(("float32: KL", "bfloat16: KL"))]
  assert len(rows) == 2
  assert all(len(l) <= 100 for l in head + rows)
  g = report.logits["bfloat16"]
  assert f"top-1 {g.top1_agreement:.4f}" in rows[1]
  md = report.to_markdown()
  assert "- logits gates of logits" in md
  assert "- bfloat16: KL mean" in md


def test_json_round_trip(report):
  d = json.loads(report.to_json())
  assert d["logits_layer"] == "logits"
  assert set(d["logits"]) == {"float32", "bfloat16"}
  assert d["logits"]["bfloat16"]["kl_max"] == report.logits["bfloat16"].kl_max
  back = jaxprec.DivergenceReport.from_json(report.to_json())
  assert back.logits == report.logits and back.logits_layer == "logits"
  assert back == report


def test_without_logits_nothing_changes(lm):
  model, tokens = lm
  r = jaxprec.check(model, tokens, precisions=["bfloat16"], mode="emulate")
  assert r.logits == {} and r.logits_layer is None
  d = json.loads(r.to_json())
  assert "logits" not in d and "logits_layer" not in d
  assert "logits gates" not in str(r) and "logits gates" not in (
      r.to_markdown())


def test_unknown_logits_layer_names_the_layers(lm):
  model, tokens = lm
  with pytest.raises(ValueError, match=r"Unknown logits layer 'logit'; valid "
                     r"choices: 'hidden', 'logits'.*Did you mean 'logits'"):
    jaxprec.check(model, tokens, precisions=["bfloat16"], logits="logit")


def test_a_vocabulary_of_one_is_refused():
  x = jnp.ones((4, 3))
  with pytest.raises(ValueError, match=r"logits layer 'logits' has shape "
                     r"\(4, 1\).*at least 2 entries"):
    jaxprec.check(lambda x: {"logits": x[:, :1] @ x[:1, :1]}, x,
                  precisions=["bfloat16"], logits="logits")


def test_logits_k_beyond_the_vocabulary_is_refused(lm):
  model, tokens = lm
  with pytest.raises(ValueError, match=r"logits_k must be an integer in "
                     r"1\.\.50"):
    jaxprec.check(model, tokens, precisions=["bfloat16"], logits="logits",
                  logits_k=51)


def test_check_module_takes_logits(lm):
  model, tokens = lm
  r = jaxprec.check_module(model, tokens, precisions=["bfloat16"],
                           mode="emulate", logits="head")
  assert r.logits_layer == "head"
  assert r.logits["bfloat16"].kl_max > 0
  with pytest.raises(ValueError, match="shadow"):
    jaxprec.check_module(model, tokens, shadow=True, logits="head")


def test_search_kl_max_meets_the_tolerance_on_recheck(lm):
  model, tokens = lm
  tolerance = 1e-8  # below one bfloat16 pass everywhere
  res = jaxprec.search_policy(model, tokens, tolerance=tolerance,
                              metric="kl_max", logits="logits",
                              verbose=False)
  assert res.meets_tolerance
  assert res.history[0].passed is False  # all-bfloat16 did not meet it
  assert set(res.values) == {"logits"} and res.values["logits"] <= tolerance
  assert res.report.logits_layer == "logits"
  assert res.report.logits["policy"].kl_max == res.values["logits"]
  again = jaxprec.check(model, tokens, precisions=[res.policy],
                        mode="emulate", logits="logits")
  assert again.logits[str(res.policy)].kl_max <= tolerance


@pytest.mark.parametrize("metric", ["kl_mean", "logprob_diff",
                                    "top1_disagreement"])
def test_search_other_logits_metrics(lm, metric):
  model, tokens = lm
  res = jaxprec.search_policy(model, tokens, tolerance=1.0, metric=metric,
                              logits="logits", verbose=False, budget=2)
  g = res.report.logits["policy"]
  want = {"kl_mean": g.kl_mean, "logprob_diff": g.max_logprob_diff,
          "top1_disagreement": 1.0 - g.top1_agreement}[metric]
  assert res.values == {"logits": want}
  assert res.meets_tolerance and res.evaluations == 1  # all bfloat16 meets it


def test_search_logits_metric_needs_logits(lm):
  model, tokens = lm
  with pytest.raises(ValueError, match="metric 'kl_max'.*logits="):
    jaxprec.search_policy(model, tokens, tolerance=1e-3, metric="kl_max")
  with pytest.raises(ValueError, match="logits='logits' serves the logits"):
    jaxprec.search_policy(model, tokens, tolerance=1e-3, logits="logits")
  with pytest.raises(ValueError, match="Unknown logits layer 'logit'"):
    jaxprec.search_policy(model, tokens, tolerance=1e-3, metric="kl_max",
                          logits="logit")


def _padded_lm(x, w):
  """Logits over a vocabulary padded from 9 to 12 tokens with -inf."""
  mask = np.arange(12) >= 9
  return {"logits": jnp.where(mask, -jnp.inf, x @ w)}


_RNG = np.random.default_rng(0)
_W = (_RNG.standard_normal((16, 12)) / 4).astype(np.float32)
_X = _RNG.standard_normal((3, 16)).astype(np.float32)


def test_masked_logits_have_gates_and_no_overflow_note():
  r = jaxprec.check(_padded_lm, _X, _W, precisions=["bfloat16"],
                    mode="emulate", logits="logits")
  g = r.logits["bfloat16"]
  want = logits_gates(
      jaxprec.emulate(_padded_lm, "bfloat16", target="tpu")(_X, _W)["logits"],
      jax.jit(_padded_lm)(_X, _W)["logits"])
  assert 0 < g.kl_max < 1e-3 and g.positions == want.positions == 3
  assert g.kl_max == pytest.approx(want.kl_max, rel=1e-3)
  assert g.max_logprob_diff == pytest.approx(want.max_logprob_diff, rel=1e-3)
  assert any("masks 9 of 36 entries with -inf" in n for n in r.notes)
  assert not any("overflowed" in n for n in r.notes), r.notes


def test_search_on_masked_logits_meets_the_tolerance():
  res = jaxprec.search_policy(_padded_lm, _X, _W, metric="kl_max",
                              logits="logits", tolerance=1e-3)
  assert res.policy is not None


def test_logits_of_no_positions_are_refused_by_name():
  with pytest.raises(ValueError, match=r"logits layer 'logits' has shape "
                     r"\(0, 12\): no positions to compare"):
    jaxprec.check(_padded_lm, _X[:0], _W, logits="logits", mode="emulate")


def test_an_integer_logits_layer_is_named_as_not_compared():
  w, x = np.ones((4, 6), np.float32), np.ones((2, 4), np.float32)
  with pytest.raises(ValueError, match=r"Unknown logits layer 'ids'; valid "
                     r"choices: 'logits' \(the floating-point layers "
                     r"jaxprec.check compares; integer and boolean outputs "
                     r"are not"):
    jaxprec.check(lambda x, w: {"ids": jnp.argmax(x @ w, -1), "logits": x @ w},
                  x, w, logits="ids", mode="emulate")
  with pytest.raises(ValueError, match=r"logits='ids', but the function "
                     r"returns no floating-point layer to compare"):
    jaxprec.check(lambda x, w: {"ids": jnp.argmax(x @ w, -1)}, x, w,
                  logits="ids", mode="emulate")
