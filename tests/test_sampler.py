"""Trainer vs sampler: the KV-cache decode of the built-in Llama, the figures
RL frameworks log, and jaxprec.check_sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprec._src.models.llama import LlamaConfig, LlamaForCausalLM

T = 12


@pytest.fixture(scope="module")
def model():
  return LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(1).integers(0, 256, T)


def _logp(logits):
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _sampled(logits, ids):
  """log p of the next token at each position, float64."""
  lp = _logp(logits)[0, :-1]
  return lp[np.arange(len(ids) - 1), ids[1:]]


def _decode(model, ids, chunks):
  cache, out, at = model.init_cache(1, len(ids)), [], 0
  step = jax.jit(lambda m, *a: m.decode(*a))
  for n in chunks:
    o = step(model, jnp.asarray(ids[None, at:at + n]), cache, at)
    cache = o["cache"]
    out.append(o["logits"])
    at += n
  return jnp.concatenate(out, 1)


@pytest.mark.parametrize("chunks", [(1,) * T, (5, 1, 1, 1, 4)])
def test_decode_with_a_cache_is_teacher_forcing_at_float32(model, tokens,
                                                           chunks):
  forced = model(jnp.asarray(tokens[None]))["logits"]
  decoded = _decode(model, tokens, chunks)
  gap = np.abs(_sampled(decoded, tokens) - _sampled(forced, tokens))
  assert gap.max() <= 1e-5
  # every token of the vocabulary too
  assert np.abs(_logp(decoded) - _logp(forced)).max() <= 1e-5


def test_a_left_padded_row_decodes_as_the_sequence_alone(model, tokens):
  pad = 3
  ids = np.concatenate([np.zeros(pad, int), tokens])[None]
  mask = jnp.asarray(np.arange(ids.shape[1]) >= pad)[None].astype(jnp.int32)
  pos = jnp.asarray(np.maximum(np.arange(ids.shape[1]) - pad, 0))[None]
  cache, out = model.init_cache(1, ids.shape[1]), []
  for t in range(ids.shape[1]):
    o = model.decode(jnp.asarray(ids[:, t:t + 1]), cache, t, mask,
                     pos[:, t:t + 1])
    cache = o["cache"]
    out.append(o["logits"])
  padded = jnp.concatenate(out, 1)[:, pad:]
  forced = model(jnp.asarray(ids), mask, pos)["logits"][:, pad:]
  alone = model(jnp.asarray(tokens[None]))["logits"]
  assert np.abs(_logp(padded) - _logp(alone)).max() <= 1e-5
  assert np.abs(_logp(forced) - _logp(alone)).max() <= 1e-5


def test_the_cache_keeps_the_dtype_it_was_given(model, tokens):
  cache = model.init_cache(2, 4, jnp.bfloat16)
  out = model.decode(jnp.ones((2, 1), jnp.int32), cache, 0)
  assert [a.dtype for kv in out["cache"] for a in kv] == [jnp.bfloat16] * 4
  assert out["logits"].shape == (2, 1, 256)
  # the slot written, and no other
  k = np.asarray(out["cache"][0][0], np.float32)
  assert np.abs(k[:, 0]).max() > 0 and not np.abs(k[:, 1:]).any()


# --- the figures, against a float64 computation written out token by token

import math  # noqa: E402

from jaxprec._src.checker import sampler as figures  # noqa: E402


def _ref_logprobs(z, temperature=1.0, top_k=None, top_p=None):
  """One position's log-probabilities, a loop over the vocabulary."""
  z = [float(v) / temperature for v in z]
  keep = list(range(len(z)))
  if top_k is not None:
    keep = sorted(keep, key=lambda i: -z[i])[:top_k]
  m = max(z[i] for i in keep)
  total = math.fsum(math.exp(z[i] - m) for i in keep)
  lp = {i: z[i] - m - math.log(total) for i in keep}
  if top_p is not None:
    kept, mass = [], 0.0
    for i in sorted(lp, key=lambda i: -lp[i]):
      if mass >= top_p:
        break
      kept.append(i)
      mass += math.exp(lp[i])
    total = math.fsum(math.exp(lp[i]) for i in kept)
    lp = {i: lp[i] - math.log(total) for i in kept}
  return [lp.get(i, -math.inf) for i in range(len(z))]


def _ref_kl(lp, lq):
  return math.fsum(math.exp(a) * (a - b) for a, b in zip(lp, lq)
                   if a > -math.inf)


@pytest.mark.parametrize("options", [
    {}, {"logprobs": "processed", "temperature": 0.7},
    {"logprobs": "processed", "temperature": 1.3, "top_k": 6},
    {"logprobs": "processed", "top_p": 0.9},
    {"logprobs": "processed", "temperature": 0.8, "top_k": 10, "top_p": 0.95}])
def test_every_figure_against_a_float64_loop(options):
  rng = np.random.default_rng(3)
  train = rng.normal(0, 2, (9, 16)).astype(np.float32)
  sample = (train + rng.normal(0, 0.05, train.shape)).astype(np.float32)
  sample[4] = train[4] + 0.7 * rng.normal(size=16)  # a larger gap here
  # tokens the sampler could have drawn: its most likely
  ids = np.argmax(sample, -1)
  sampling = figures.Sampling(**options)
  g = figures.gap_figures(train, sample, ids, sampling)
  ref = {k: options.get(k) for k in ("top_k", "top_p")}
  ref["temperature"] = options.get("temperature", 1.0)
  lt = [_ref_logprobs(z, **ref) for z in train]
  ls = [_ref_logprobs(z, **ref) for z in sample]
  delta = [a[i] - b[i] for a, b, i in zip(lt, ls, ids)]
  np.testing.assert_allclose(g.delta, delta, rtol=1e-12, atol=1e-13)
  assert g.mean == pytest.approx(math.fsum(delta) / 9, rel=1e-12, abs=1e-14)
  r = math.sqrt(math.fsum(d * d for d in delta) / 9)
  assert g.rms == pytest.approx(r, rel=1e-12) and g.ratio_log_rms == g.rms
  assert g.max_abs == pytest.approx(max(map(abs, delta)), rel=1e-12)
  kts = [_ref_kl(a, b) for a, b in zip(lt, ls)]
  kst = [_ref_kl(b, a) for a, b in zip(lt, ls)]
  np.testing.assert_allclose(g.kl_train_sample, kts, rtol=1e-9, atol=1e-15)
  np.testing.assert_allclose(g.kl_sample_train, kst, rtol=1e-9, atol=1e-15)
  assert g.kl_train_sample_max == pytest.approx(max(kts), rel=1e-9)
  assert g.kl_sample_train_mean == pytest.approx(math.fsum(kst) / 9,
                                                 rel=1e-9)
  top1 = [max(range(16), key=a.__getitem__) != max(range(16),
                                                   key=b.__getitem__)
          for a, b in zip(lt, ls)]
  assert g.top1_disagreement == sum(top1) / 9 and any(top1) == any(
      g.top1_differs)
  for (lo, hi, frac) in g.outside:
    out = [not lo <= math.exp(d) <= hi for d in delta]
    assert frac == sum(out) / 9
  assert g.outside[1][2] > 0  # the large gap leaves [0.8, 1.25]


def test_a_token_the_trainer_drops_is_an_infinite_gap():
  train = np.array([[5.0, 0.0, -1.0]])
  sample = np.array([[4.0, 5.0, -1.0]])
  g = figures.gap_figures(train, sample, [1], figures.Sampling(
      logprobs="processed", top_k=1))
  assert g.delta == (-math.inf,) and g.top1_differs == (True,)
  assert g.kl_train_sample == g.kl_sample_train == (math.inf,)
  g = figures.gap_figures(train, [[5.0, 4.0, -1.0]],
                          [0], figures.Sampling(logprobs="processed",
                                                top_p=0.9))
  # the trainer keeps token 0 alone, the sampler tokens 0 and 1
  assert g.kl_sample_train == (math.inf,)
  assert math.isfinite(g.kl_train_sample[0]) and math.isfinite(g.delta[0])


@pytest.mark.parametrize("bad, match", [
    ({"logprobs": "sampled"}, "'raw', 'processed'"),
    ({"logprobs": "processed", "temperature": 0}, "temperature=0"),
    ({"logprobs": "processed", "top_k": 0}, "top_k=0"),
    ({"logprobs": "processed", "top_p": 1.5}, "top_p=1.5"),
    ({"temperature": 0.5}, "processed"),
])
def test_bad_sampling_options_are_named(bad, match):
  with pytest.raises(ValueError, match=match):
    figures.Sampling(**bad)


def test_bad_figure_inputs_are_named():
  z = np.zeros((2, 4))
  with pytest.raises(ValueError, match="0..3"):
    figures.gap_figures(z, z, [0, 4])
  with pytest.raises(ValueError, match="shape"):
    figures.gap_figures(z, z[:1], [0, 1])
  with pytest.raises(ValueError, match="NaN"):
    figures.gap_figures(z, z + np.nan, [0, 1])
