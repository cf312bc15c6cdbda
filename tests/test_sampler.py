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
