"""Trainer vs sampler: the KV-cache decode of the built-in Llama, the figures
RL frameworks log, and jaxprec.check_sampler."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxprec._src.checker import check
from jaxprec._src.models import llama as llama_lib
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


# --- jaxprec.check_sampler

import json  # noqa: E402

import jaxprec  # noqa: E402

TPU_DEFAULT = jaxprec.Compute(precision="default", target="tpu")
H100_BF16 = jaxprec.Compute(precision="default=dtype:bfloat16", target="gpu",
                            chip="h100")


@pytest.fixture(scope="module")
def tpu_vs_h100(model, tokens):
  return jaxprec.check_sampler(model, tokens, trainer=TPU_DEFAULT,
                               sampler=H100_BF16, batch=(5, 14))


# The module calls of one decoder layer, in the order they return (a module
# after its children), as transformers' LlamaDecoderLayer makes them.
LAYER_CALLS = ("input_layernorm", "self_attn/q_proj", "self_attn/k_proj",
               "self_attn/v_proj", "self_attn/o_proj", "self_attn",
               "post_attention_layernorm", "mlp/gate_proj", "mlp/up_proj",
               "mlp/down_proj", "mlp", "")


def _module_order(layers):
  return (["model/embed_tokens"]
          + [f"model/layers/{i}/{c}".rstrip("/") for i in range(layers)
             for c in LAYER_CALLS] + ["model/norm", "lm_head"])


def test_float32_decode_is_the_float32_trainer(model, tokens):
  r = jaxprec.check_sampler(model, tokens)
  assert r.total <= 1e-5 and r.figures.max_abs <= 1e-5
  assert r.first_divergence is None
  assert max(v for _, v in r.layers) <= r.floor
  # every module call's output, paired position by position, in the order
  # the calls return; the logits last
  assert [n for n, _ in r.layers] == _module_order(model.config.num_layers)
  # what cannot be paired by position is counted and named: the forward's
  # LlamaModel call (its decode is a method the hook does not see) and the
  # keys and values each layer and its attention return in a decode step
  note, = [n for n in r.notes if "not compared position by position" in n]
  caches = [f"model/layers/{i}{a}[1][{j}]" for i in range(2)
            for a in ("/self_attn", "") for j in (0, 1)]
  assert note.startswith(f"{len(caches) + 4} module outputs")
  assert "model.hidden_states[0], " in note
  assert all(c in note for c in caches[:4]) and "and 4 more" in note


def test_tpu_trainer_vs_bf16_h100_sampler(model, tokens, tpu_vs_h100):
  r = tpu_vs_h100
  assert r.total >= 1e-3 and r.total == r.figures.rms
  d = r.first_divergence
  assert d is not None and d.relative_rms > r.floor
  assert d.layer in dict(r.layers) and 0 <= d.position < T
  # the bfloat16 sampler's embedding lookup parts first, at the first token:
  # its row rounded to bfloat16
  e = np.asarray(model.model.embed_tokens.embedding[...], np.float64)[
      tokens[0]]
  rounded = e.astype(ml_dtypes.bfloat16).astype(np.float64)
  assert (d.position, d.layer) == (0, "model/embed_tokens")
  assert d.relative_rms == pytest.approx(
      np.sqrt(np.mean((rounded - e) ** 2) / np.mean(e ** 2)), rel=1e-6)
  # and every module call inside the decoder layers is compared
  assert [n for n, _ in r.layers] == _module_order(model.config.num_layers)
  assert [s.factor for s in r.shares] == ["lm_head", "body", "attention",
                                          "decode", "batch"]
  assert math.fsum([s.share for s in r.shares] + [r.remainder]) == (
      pytest.approx(r.total, abs=1e-15))
  # each share is the total minus the RMS gap with that factor switched
  for s in r.shares:
    assert s.share == pytest.approx(r.total - s.rms, abs=1e-15)
  # the trainer's attention, a TPU's one bfloat16 pass, as the sampler's
  # GPU computes it
  assert r.shares[2].trainer == "BF16_BF16_F32 (bf16x1) on gpu (h100)"
  # the report's gap, recomputed here: the trainer as jaxprec.emulate runs
  # it, the sampler as a decode loop of the emulated model
  forced = jax.jit(jaxprec.emulate(model, "default", target="tpu"))(
      jnp.asarray(tokens[None]))["logits"]
  step = jax.jit(jaxprec.emulate(model.decode, "default=dtype:bfloat16",
                                 target="gpu", chip="h100"))
  ids = np.concatenate([np.zeros(2, int), tokens])[None]  # padded: 14 long
  others = np.random.default_rng(0)
  rows = [ids[0]] + [np.concatenate([np.zeros(14 - n, int),
                                     others.integers(0, 256, n)])
                     for n in (5, 14)]
  mask = np.array([[0, 0] + [1] * 12, [0] * 9 + [1] * 5, [1] * 14])
  pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
  cache, out = model.init_cache(3, 14), []
  for t in range(14):
    o = step(jnp.asarray(np.array(rows)[:, t:t + 1]), cache, t,
             jnp.asarray(mask), jnp.asarray(pos[:, t:t + 1]))
    cache = o["cache"]
    out.append(o["logits"][0, 0])
  decoded = np.stack(out)[2:]
  lt, ls = _logp(forced)[0], _logp(decoded)
  delta = [lt[i, tokens[i + 1]] - ls[i, tokens[i + 1]] for i in range(T - 1)]
  np.testing.assert_allclose(r.figures.delta, delta, rtol=1e-6, atol=1e-9)


def test_a_float32_head_lowers_the_heads_share(model, tokens, tpu_vs_h100):
  f32_head = jaxprec.Compute(precision="default=dtype:bfloat16", target="gpu",
                             chip="h100", head="default=float32+dtype:float32")
  r = jaxprec.check_sampler(model, tokens, trainer=TPU_DEFAULT,
                            sampler=f32_head, batch=(5, 14))
  head = {s.factor: s for s in r.shares}["lm_head"]
  before = {s.factor: s for s in tpu_vs_h100.shares}["lm_head"]
  assert head.share < before.share
  assert r.total < tpu_vs_h100.total
  assert "head default=float32+dtype:float32" in r.sampler


# float32 on a GPU: exact, as on this CPU
F32_GPU = jaxprec.Compute(precision="float32", target="gpu")
# the same but the attention's own matmuls: one bfloat16 pass
ATTN_BF16 = jaxprec.Compute(precision="float32", target="gpu",
                            attention="BF16_BF16_F32")


def _adds_up(r):
  assert math.fsum([s.share for s in r.shares] + [r.remainder]) == (
      pytest.approx(r.total, abs=1e-15))
  for s in r.shares:
    assert s.share == pytest.approx(r.total - s.rms, abs=1e-15)


def test_a_bfloat16_attention_is_the_attentions_share(model, tokens):
  # The sampler differs from the trainer in the attention's own matmuls
  # alone: one bfloat16 pass, a float32 body and head.
  r = jaxprec.check_sampler(model, tokens, trainer=F32_GPU,
                            sampler=ATTN_BF16)
  shares = {s.factor: s for s in r.shares}
  assert r.total > 1e-4 and shares["attention"].share > 0.5 * r.total
  # switched back, only decoding is left: the float32 floor
  assert shares["attention"].rms <= 1e-5
  assert shares["body"].share == shares["lm_head"].share == 0
  assert (shares["attention"].sampler, shares["attention"].trainer) == (
      "BF16_BF16_F32 (bf16x1) on gpu", "float32 (f32) on gpu")
  assert r.sampler == ("float32 (f32) on gpu, attention BF16_BF16_F32 "
                       "(bf16x1)")
  _adds_up(r)


def test_a_model_without_an_attention_module_says_the_factor_reaches_nothing(
    tokens):
  # Attention is found by its module's class (the op kind 'attention'); a
  # model whose attention class is named otherwise gets no attention=
  # precision, and the factor's 0 share is said to mean nothing.
  plain = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  mixer = type("Mixer", (llama_lib._Attention,), {})
  renamed = 0
  for _, m in nnx.iter_graph(plain):
    if type(m) is llama_lib._Attention:
      m.__class__ = mixer
      renamed += 1
  assert renamed == LlamaConfig.tiny().num_layers
  r = jaxprec.check_sampler(plain, tokens, trainer=F32_GPU, sampler=ATTN_BF16)
  shares = {s.factor: s for s in r.shares}
  assert shares["attention"].share == 0 and r.total <= 1e-5
  assert any("No module of the model is an attention module" in n
             for n in r.notes), r.notes
  r = jaxprec.check_sampler(LlamaForCausalLM(LlamaConfig.tiny(),
                                             rngs=nnx.Rngs(0)),
                            tokens, trainer=F32_GPU, sampler=ATTN_BF16)
  assert not any("attention module" in n for n in r.notes), r.notes


def test_a_bfloat16_body_splits_into_the_attention_and_the_rest(model,
                                                                 tokens):
  # Without attention=, each side's attention computes at its body's
  # precision; the attention factor takes that part out of the body's.
  r = jaxprec.check_sampler(model, tokens, trainer=F32_GPU,
                            sampler=jaxprec.Compute(precision="BF16_BF16_F32",
                                                    target="gpu"))
  shares = {s.factor: s for s in r.shares}
  assert shares["body"].share > 0 and shares["attention"].share > 0
  assert shares["body"].sampler == "BF16_BF16_F32 (bf16x1) on gpu"
  _adds_up(r)
  # The first matmul parts the paths, inside the first decoder layer at the
  # first token: the query projection (the norm before it is exact on both
  # sides), its operands rounded to bfloat16 against float32's.
  d = r.first_divergence
  assert (d.position, d.layer) == (0, "model/layers/0/self_attn/q_proj")
  assert dict(r.layers)["model/layers/0/input_layernorm"] == 0
  layer = model.model.layers[0]
  x = np.asarray(model.model.embed_tokens.embedding[...], np.float64)[
      tokens[0]]
  x = x / np.sqrt(np.mean(x * x) + 1e-6) * np.asarray(
      layer.input_layernorm.scale[...], np.float64)
  w = np.asarray(layer.self_attn.q_proj.kernel[...], np.float64)
  bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)
  diff = bf16(x) @ bf16(w) - x @ w
  assert d.relative_rms == pytest.approx(
      np.sqrt(np.mean(diff ** 2) / np.mean((x @ w) ** 2)), rel=1e-3)


@pytest.mark.parametrize("source", ["tpu", "gpu", "cpu"])
def test_a_sides_attention_is_carried_to_the_others_target_as_computed(
    source):
  from jaxprec._src.core import algorithms, numerics  # noqa: PLC0415
  f32 = np.float32
  for name in (None, "default", "bfloat16", "high", "float32",
               "BF16_BF16_F32_X3", "TF32_TF32_F32", "F32_F32_F32"):
    try:
      want = numerics.algorithm_for(name, source, f32, f32)
    except numerics.UnsupportedAlgorithmError:
      continue
    want = "f32" if source == "cpu" else want  # exact float32 there
    for target in ("tpu", "gpu"):
      got = numerics.carried(name, source, target)
      if target in algorithms.record(want).targets:
        assert numerics.algorithm_for(got, target, f32, f32) == want, (
            name, source, target, got)
      else:  # no such algorithm there: the name as typed
        assert got == name
  assert numerics.carried("default", "tpu", "gpu") == "BF16_BF16_F32"
  assert numerics.carried("TF32_TF32_F32", "gpu", "cpu") is None
  assert numerics.carried("default", "cpu", "cpu") == "default"


def _bf16(x):
  return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def _bf16_attention(q, k, v, mask=None, *, causal=False, first=0):
  """Causal attention whose two matmuls take their operands rounded to
  bfloat16 (one pass: exact products, float32 sums), the rest float32."""
  assert mask is None and causal and first == 0
  b, t, h, d = q.shape
  k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
  s = jnp.einsum("bthd,bshd->bhts", _bf16(q), _bf16(k),
                 precision="highest") * jnp.float32(d ** -0.5)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
  w = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhts,bshd->bthd", _bf16(w), _bf16(v),
                    precision="highest").reshape(b, t, h * d)


def test_the_attention_option_reaches_the_attention_matmuls_alone(
    model, tokens, monkeypatch):
  from jaxprec._src.models import llama  # noqa: PLC0415
  ids = jnp.asarray(tokens[None])
  setting, target, _ = ATTN_BF16.body()
  got = np.asarray(jaxprec.emulate(model, setting, target=target)(ids)[
      "logits"])
  # the program: the score and value matmuls of each attention module at
  # the attention's precision, its projections and the rest at the body's
  rows = jaxprec.audit(jaxprec.swap(model, setting), ids).rows
  at = {(r.module_path.rsplit("/", 1)[-1], r.precision_name) for r in rows}
  assert at == {("self_attn", "BF16_BF16_F32")} | {
      (p, "HIGHEST") for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                               "gate_proj", "up_proj", "down_proj",
                               "lm_head")}
  assert sum(r.module_path.endswith("self_attn") for r in rows) == 4
  f32 = np.asarray(model(ids)["logits"])
  monkeypatch.setattr(llama, "attention", _bf16_attention)
  want = np.asarray(model(ids)["logits"])
  # the model with only its attention's matmuls rounded, to float32 sums
  assert np.abs(got - want).max() <= 1e-5 < np.abs(want - f32).max() / 100


class CausalSelfAttention(nnx.Module):
  """A user's attention, the usual idiom: projections of its own, then its
  own ``q @ k.T``, softmax and ``@ v``."""

  def __init__(self, n, *, rngs):
    self.query, self.key, self.value, self.out = (
        nnx.Linear(n, n, rngs=rngs) for _ in range(4))

  def __call__(self, x):
    q, k, v = self.query(x), self.key(x), self.value(x)
    w = jax.nn.softmax(q @ k.swapaxes(-1, -2) / 4.0, axis=-1)
    return self.out(w @ v)


class SelfAttn(CausalSelfAttention):
  """The same, under a name without Attention in it."""


def test_the_attention_option_reaches_a_users_attention(recwarn):
  m = CausalSelfAttention(16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  setting, target, _ = ATTN_BF16.body()
  got = np.asarray(jaxprec.emulate(m, setting, target=target)(x))
  q, k, v = m.query(x), m.key(x), m.value(x)
  w = jax.nn.softmax(jnp.matmul(_bf16(q), _bf16(k).swapaxes(-1, -2),
                                precision="highest") / 4.0, axis=-1)
  want = np.asarray(m.out(jnp.matmul(_bf16(w), _bf16(v),
                                     precision="highest")))
  f32 = np.asarray(m(x))
  assert np.abs(got - want).max() <= 1e-6 < np.abs(want - f32).max() / 100
  assert not recwarn.list
  # a module whose class name does not say Attention is not one to a
  # policy: the option reaches nothing, and says so
  other = SelfAttn(16, rngs=nnx.Rngs(0))
  with pytest.warns(jaxprec.UnusedRuleWarning, match="'attention=BF16"):
    got = np.asarray(jaxprec.emulate(other, setting, target=target)(x))
  np.testing.assert_array_equal(got, np.asarray(other(x)))


def test_the_same_check_twice_is_the_same_report(model, tokens, tpu_vs_h100):
  again = jaxprec.check_sampler(model, tokens, trainer=TPU_DEFAULT,
                                sampler=H100_BF16, batch=(5, 14))
  assert again.to_json() == tpu_vs_h100.to_json()
  d = json.loads(again.to_json())
  assert (d["schema"], d["kind"]) == (2, "sampler")
  assert d["figures"]["sampling"]["logprobs"] == "raw"
  # str() is as wide as the report needs (a log gets every character);
  # a width fits it
  assert all(len(line) <= 100 for line in again.table(width=100).splitlines())
  assert str(again).count("\n") > 10 and "first divergence" in str(again)
  md = again.to_markdown()
  assert "| lm_head |" in md and "| remainder |" in md


class _OffByOne(LlamaForCausalLM):
  """Writes each step's keys and values one cache slot too far."""

  def decode(self, input_ids, cache, position, attention_mask=None,
             position_ids=None):
    return super().decode(input_ids, cache, position + 1, attention_mask,
                          position_ids)


def test_an_off_by_one_cache_slot_is_caught_and_named(tokens):
  model = _OffByOne(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  r = jaxprec.check_sampler(model, tokens)
  d = r.first_divergence
  # the projections of the first token are right; what its attention reads
  # from the cache is not, and the output projection is the first module
  # output to show it
  assert d is not None and (d.position, d.layer) == (
      0, "model/layers/0/self_attn/o_proj")
  assert dict(r.layers)["model/layers/0/self_attn/v_proj"] <= r.floor
  assert r.total > 1e-2
  # teacher forcing in place of the decode takes the whole gap away
  decode = {s.factor: s for s in r.shares}["decode"]
  assert decode.rms == 0 and decode.share == r.total


class _OneTokenMLP(llama_lib._MLP):
  """Adds 1e-3 to its output when it sees one token: in decode alone."""

  def __call__(self, x):
    out = super().__call__(x)
    return out + 1e-3 if x.shape[1] == 1 else out


class _DecodeBug(LlamaForCausalLM):
  """The tiny Llama with a bug in layer 1's MLP, on the decode path only."""

  def __init__(self, config, *, rngs):
    super().__init__(config, rngs=rngs)
    self.model.layers[1].mlp = _OneTokenMLP(config, rngs=rngs)


def test_a_bug_in_one_modules_decode_is_named_there(tokens):
  model = _DecodeBug(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  r = jaxprec.check_sampler(model, tokens, prompt=3)
  d = r.first_divergence
  # the prompt (3 tokens in one chunk) is clean; the first token decoded
  # alone parts at the MLP, after its own projections agreed
  assert (d.position, d.layer) == (3, "model/layers/1/mlp")
  assert dict(r.layers)["model/layers/1/mlp/down_proj"] <= r.floor
  # 1e-3 everywhere, relative to the forward's MLP output there (float32,
  # the model's own modules one by one)
  m = model.model
  cos, sin = llama_lib.rotary(jnp.arange(T)[None], m.config.dim,
                              m.config.rope_theta)
  h = m.layers[0](m.embed_tokens(jnp.asarray(tokens[None])), cos, sin, None)
  one = m.layers[1]
  h = h + one.self_attn(one.input_layernorm(h), cos, sin, None)
  out = np.asarray(one.mlp(one.post_attention_layernorm(h)), np.float64)
  want = 1e-3 / np.sqrt(np.mean(out[0, 3] ** 2))
  assert d.relative_rms == pytest.approx(want, rel=1e-3)


class _SharedMLP(LlamaForCausalLM):
  """Layer 1 calls layer 0's MLP: one module, two calls a step."""

  def __init__(self, config, *, rngs):
    super().__init__(config, rngs=rngs)
    self.model.layers[1].mlp = self.model.layers[0].mlp


def test_a_module_called_twice_pairs_call_by_call_in_the_order_they_ran(
    tokens):
  r = jaxprec.check_sampler(_SharedMLP(LlamaConfig.tiny(),
                                       rngs=nnx.Rngs(0)), tokens[:4])
  assert r.first_divergence is None
  names = [n for n, _ in r.layers]
  # the second call's outputs come where it ran: in layer 1, after its norm
  at = names.index("model/layers/1/post_attention_layernorm")
  assert names[at + 1:at + 5] == [f"model/layers/0/mlp{c}#1" for c in (
      "/gate_proj", "/up_proj", "/down_proj", "")]
  assert names.index("model/layers/0/mlp#0") < names.index("model/layers/0")
  assert not [n for n in r.notes if "mlp" in n]  # every call paired


class _InCond(nnx.Module):
  """Calls its MLP inside a cond (both branches run it)."""

  def __init__(self, config, *, rngs):
    self.inner = llama_lib._MLP(config, rngs=rngs)

  def __call__(self, x):
    return nnx.cond(jnp.all(jnp.isfinite(x)), lambda m, x: m(x),
                    lambda m, x: -m(x), self.inner, x)


class _CondLlama(LlamaForCausalLM):
  def __init__(self, config, *, rngs):
    super().__init__(config, rngs=rngs)
    self.model.layers[0].mlp = _InCond(config, rngs=rngs)


def test_module_calls_inside_a_cond_are_named_as_not_compared(tokens,
                                                              recwarn):
  r = jaxprec.check_sampler(_CondLlama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)),
                            tokens[:4])
  assert r.first_divergence is None
  inside = [f"model/layers/0/mlp/inner{p}" for p in (
      "/gate_proj", "/up_proj", "/down_proj", "")]
  assert [n for n in r.notes if "while_loop or cond" in n] == [
      f"The outputs of {', '.join(inside)} are not compared: they run "
      f"inside a while_loop or cond, out of which they cannot be taken."]
  names = dict(r.layers)
  assert "model/layers/0/mlp" in names and not set(inside) & set(names)
  assert not [w for w in recwarn.list if "check_module" in str(w.message)]


class _HeadNamedOutput(LlamaForCausalLM):
  """The tiny Llama with its head as a submodule named ``output``."""

  def __init__(self, config, *, rngs):
    super().__init__(config, rngs=rngs)
    self.output, self.lm_head = self.lm_head, None

  def head(self, hidden):
    return self.output(hidden)


def test_a_head_named_output_is_a_module_output_beside_the_roots(tokens):
  # The root's own output is then '(root)', never the submodule 'output'.
  stock, named = (jaxprec.check_sampler(
      cls(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), tokens[:4],
      trainer=TPU_DEFAULT, sampler=H100_BF16)
                  for cls in (LlamaForCausalLM, _HeadNamedOutput))
  layers = dict(named.layers)
  assert layers.pop("output") == dict(stock.layers)["lm_head"]
  assert layers == dict(stock.layers)
  assert named.first_divergence == stock.first_divergence
  assert named.total == stock.total


def test_unpaired_outputs_are_named_as_check_module_names_them(model, tokens):
  # The note wrote model['hidden_states'][0] for check_module's
  # model.hidden_states[0].
  r = jaxprec.check_sampler(model, tokens[:4])
  note, = [n for n in r.notes if "not compared position by position" in n]
  fn, _, args = check.module_outputs(model, (jnp.asarray(tokens[None, :4]),),
                                     {})
  names = set(jaxprec.named_layers(fn(*args)))
  listed = note.split(": ", 1)[1].split(" and ")[0].split(", ")
  first = "model.hidden_states[0]"
  assert first in listed and first in names
  # the rest are the decode's alone (each attention's cache, k and v)
  assert set(listed) - names == {f"model/layers/0{a}[1][{i}]" for a in (
      "", "/self_attn") for i in (0, 1)}


@pytest.mark.parametrize("kwargs, error, match", [
    ({"trainer": "float32"}, TypeError, "jaxprec.Compute"),
    ({"prompt": 12}, ValueError, "1..11"),
    ({"batch": (0,)}, ValueError, "batch="),
    ({"floor": 0}, ValueError, "floor=0"),
])
def test_bad_check_sampler_arguments_are_named(model, tokens, kwargs, error,
                                                match):
  with pytest.raises(error, match=match):
    jaxprec.check_sampler(model, tokens, **kwargs)


def test_bad_attention_arguments_are_named():
  with pytest.raises(ValueError, match="^Compute attention=: Invalid "
                     "precision 'fastest-ever'.*Valid names"):
    jaxprec.Compute(attention="fastest-ever")
  with pytest.raises(jaxprec.UnsupportedAlgorithmError,
                     match="^Compute attention=: F32_F32_F32 .*does not run "
                           "on a TPU"):
    jaxprec.Compute(target="tpu", attention="F32_F32_F32")
  with pytest.raises(ValueError, match="attention='default=dtype:bfloat16'"
                                       ": sets a compute dtype"):
    jaxprec.Compute(attention="default=dtype:bfloat16")


def test_the_sampler_command_takes_each_sides_attention(capsys):
  from conftest import one_line_error  # noqa: PLC0415
  from jaxprec._src.cli import cli  # noqa: PLC0415
  code = cli.main(["sampler", "--length", "4", "--no-cache", "--json",
                   "--trainer", "float32@gpu", "--sampler", "float32@gpu",
                   "--sampler-attention", "BF16_BF16_F32",
                   "--trainer-attention", "F32_F32_F32"])
  d = json.loads(capsys.readouterr().out)
  assert code == 0 and d["sampler"] == str(ATTN_BF16)
  assert d["trainer"] == "float32 (f32) on gpu, attention F32_F32_F32 (f32)"
  share = {s["factor"]: s["share"] for s in d["shares"]}["attention"]
  assert share > 0.5 * d["total"] > 0
  code = cli.main(["sampler", "--sampler-attention", "fastest-ever"])
  one_line_error(code, capsys.readouterr().err, 2, "--sampler",
                 "attention=", "fastest-ever")


def test_bad_compute_arguments_are_named(model):
  with pytest.raises(ValueError, match="chip"):
    jaxprec.Compute(target="tpu", chip="h100")
  with pytest.raises(ValueError, match="warp"):
    jaxprec.Compute(target="warp")
  with pytest.raises(ValueError, match="fastest-ever"):
    jaxprec.Compute(precision="fastest-ever")
  with pytest.raises(ValueError, match="0..255"):
    jaxprec.check_sampler(model, [1, 256])


def test_the_decode_is_transformers_decode_with_past_key_values(tokens):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = transformers.LlamaConfig(
      vocab_size=256, hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      initializer_range=0.2)
  torch.manual_seed(0)
  pt = transformers.LlamaForCausalLM(config).eval()
  model = LlamaForCausalLM.from_pytorch(pt)
  ids = torch.tensor(tokens[None], dtype=torch.long)
  with torch.no_grad():
    cache, steps = transformers.DynamicCache(), []
    for t in range(T):
      out = pt(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
      cache = out.past_key_values
      steps.append(out.logits.double().numpy())
  torch_decoded = np.concatenate(steps, 1)
  jax_decoded = _decode(model, tokens, (1,) * T)
  gap = np.abs(_logp(torch_decoded) - _logp(jax_decoded))
  assert gap.max() <= 1e-5
  # and PyTorch's cache decode is teacher forcing too: the floor holds
  with torch.no_grad():
    forced = pt(ids).logits.double().numpy()
  assert np.abs(_logp(forced) - _logp(torch_decoded)).max() <= 1e-5


# --- jaxprec sampler


def test_the_sampler_command_prints_the_report(capsys):
  from jaxprec._src.cli import cli  # noqa: PLC0415
  code = cli.main(["sampler", "--model", "llama", "--length", "8",
                   "--batch", "3,10", "--json", "--no-cache",
                   "--fail-above", "1e-5"])
  d = json.loads(capsys.readouterr().out)
  assert code == 0 and (d["schema"], d["kind"]) == (2, "sampler")
  assert d["batch"] == [3, 10] and len(d["tokens"]) == 8
  assert d["first_divergence"] is None and d["total"] <= 1e-5


def test_the_sampler_command_fails_above_its_bound_and_names_bad_usage(
    capsys):
  from jaxprec._src.cli import cli  # noqa: PLC0415
  code = cli.main(["sampler", "--length", "6", "--no-cache", "--sampler",
                   "default@tpu", "--fail-above", "1e-5"])
  out = capsys.readouterr()
  assert code == 1 and "exceeds --fail-above" in out.err
  assert "attribution" in out.out
  assert cli.main(["sampler", "--sampler", "float32"]) == 2
  assert "PRECISION@TARGET" in capsys.readouterr().err
  assert cli.main(["sampler", "--sampler", "float32@gpu:z9"]) == 2
  assert "z9" in capsys.readouterr().err
  assert cli.main(["sampler", "--sampler", "pytorch"]) == 2
  assert "MODULE:FUNCTION returns" in capsys.readouterr().err


def test_a_bfloat16_model_rotates_and_caches_in_bfloat16(model):
  """transformers casts the rotary cos/sin to the hidden states' dtype: a
  bfloat16 sampler's cache holds bfloat16 keys."""
  bf16 = jaxprec.swap(model, "default=dtype:bfloat16")
  out = bf16.decode(jnp.asarray([[7, 3]]), bf16.init_cache(1, 2), 0)
  k = np.asarray(out["cache"][0][0], np.float32)
  assert np.abs(k).max() > 0
  np.testing.assert_array_equal(k, k.astype(jnp.bfloat16).astype(np.float32))


# --- a PyTorch sampler: transformers' decode with past_key_values


def _hf_llama(vocab=256, seed=0):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      initializer_range=0.2)
  torch.manual_seed(seed)
  return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_and_port():
  pt = _hf_llama()
  return pt, LlamaForCausalLM.from_pytorch(pt)


def test_a_pytorch_float32_sampler_is_the_jax_float32_sampler(hf_and_port,
                                                               tokens):
  pt, model = hf_and_port
  pt.train()  # the check runs it in eval mode, and leaves it as it was
  r = jaxprec.check_sampler(model, tokens, sampler=pt, batch=(5, 14))
  assert pt.training
  pt.eval()
  jax_sampler = jaxprec.check_sampler(model, tokens, batch=(5, 14))
  assert r.total <= 1e-5 and r.figures.max_abs <= 1e-5
  assert r.first_divergence is None
  assert max(v for _, v in r.layers) <= r.floor
  # PyTorch's module calls (forward hooks), paired with the trainer's by
  # path: every one inside the decoder layers; its rotary table and
  # activation modules, which the NNX model has not, are counted and named
  assert [n for n, _ in r.layers] == _module_order(model.config.num_layers)
  note, = [n for n in r.notes if "not compared position by position" in n]
  assert note.startswith("8 module outputs") and all(
      f"{x}," in note or f"{x}." in note for x in (
          "model/rotary_emb[0]", "model/rotary_emb[1]",
          "model/layers/0/mlp/act_fn", "model/layers/1/mlp/act_fn"))
  np.testing.assert_allclose(r.figures.delta, jax_sampler.figures.delta,
                             rtol=0, atol=1e-5)
  assert r.sampler == "PyTorch LlamaForCausalLM, float32 on cpu"
  assert json.loads(r.to_json())["sampler"] == r.sampler


def test_a_pytorch_bfloat16_sampler_is_transformers_own_decode(hf_and_port,
                                                                tokens):
  import copy  # noqa: PLC0415
  torch = pytest.importorskip("torch")
  pt, model = hf_and_port
  bf16 = copy.deepcopy(pt).to(torch.bfloat16)
  r = jaxprec.check_sampler(model, tokens, sampler=bf16, prompt=3)
  assert "PyTorch LlamaForCausalLM, bfloat16 on cpu" in str(r)
  assert json.loads(r.to_json())["sampler"].startswith("PyTorch")
  assert any("PyTorch" in n and "bfloat16" in n for n in r.notes)
  # the gap, recomputed: transformers' forward with past_key_values, the
  # prompt in one chunk, against the float32 model's teacher forcing
  ids = torch.tensor(tokens[None], dtype=torch.long)
  with torch.no_grad():
    out = bf16(ids[:, :3], use_cache=True)
    steps, cache = [out.logits[0, -1]], out.past_key_values
    for t in range(3, T - 1):
      out = bf16(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
      cache = out.past_key_values
      steps.append(out.logits[0, -1])
  sampled = _logp(torch.stack(steps).double().numpy())
  forced = _logp(model(jnp.asarray(tokens[None]))["logits"])[0, 2:-1]
  delta = [forced[i, t] - sampled[i, t] for i, t in enumerate(tokens[3:])]
  # (within the float32 floor: the trainer here runs without jit)
  np.testing.assert_allclose(r.figures.delta, delta, rtol=0, atol=1e-5)
  assert r.total > 1e-3 and r.first_divergence is not None
  assert (r.first_divergence.position, r.first_divergence.layer) == (
      0, "model/embed_tokens")  # PyTorch's bfloat16 embedding
  # every factor is switched, none left at 0 unsaid: the float32 body under
  # the bfloat16 head, the bfloat16 body under the float32 head
  shares = {s.factor: s for s in r.shares}
  assert shares["body"].sampler == shares["lm_head"].sampler == r.sampler
  for factor in ("lm_head", "body"):
    assert shares[factor].rms != r.total
  assert shares["body"].rms < r.total / 2


def test_bad_pytorch_samplers_are_named(hf_and_port, tokens):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pt, model = hf_and_port
  gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=256, n_embd=32, n_layer=1, n_head=2))
  with pytest.raises(ValueError, match="GPT2LMHeadModel.*'gpt2'"):
    jaxprec.check_sampler(model, tokens, sampler=gpt2)
  with pytest.raises(TypeError, match="Linear"):
    jaxprec.check_sampler(model, tokens, sampler=torch.nn.Linear(2, 2))
  with pytest.raises(ValueError, match="vocab_size=300.*vocab_size=256"):
    jaxprec.check_sampler(model, tokens, sampler=_hf_llama(vocab=300))
  with pytest.raises(ValueError, match="weights are not the model.s.*first at lm_head/kernel"):
    jaxprec.check_sampler(model, tokens, sampler=_hf_llama(seed=1))
  with pytest.raises(TypeError, match="trainer=.*Compute"):
    jaxprec.check_sampler(model, tokens, trainer=pt)


# --- jaxprec sampler MODULE:FUNCTION: the user's own model

OWN = """\
import numpy as np
import transformers
import torch
from jaxprec.models import LlamaForCausalLM

def make():
  config = transformers.LlamaConfig(
      vocab_size=256, hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      initializer_range=0.2)
  torch.manual_seed(0)
  pt = transformers.LlamaForCausalLM(config).eval()
  tokens = np.arange(10) * 7 % 256
  return LlamaForCausalLM.from_pytorch(pt), tokens, pt

def two():
  model, tokens, _ = make()
  return model, tokens

def swapped():
  model, tokens = two()
  return tokens, model

def one():
  return two()[0]
"""


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  path = tmp_path_factory.mktemp("own") / "own_sampler.py"
  path.write_text(OWN)
  return str(path)


def test_the_sampler_command_checks_the_users_own_model(own_model, capsys):
  from jaxprec._src.cli import cli  # noqa: PLC0415
  code = cli.main(["sampler", f"{own_model}:two", "--json", "--no-cache",
                   "--sampler", "default@tpu", "--prompt", "3"])
  d = json.loads(capsys.readouterr().out)
  assert code == 0 and d["tokens"] == [t * 7 % 256 for t in range(10)]
  assert d["sampler"] == "default (bf16x1) on tpu" and d["prompt"] == 3
  assert d["total"] > 1e-5
  # the third item, a PyTorch model, is the sampler --sampler pytorch names
  code = cli.main(["sampler", f"{own_model}:make", "--json", "--no-cache",
                   "--sampler", "pytorch", "--batch", "4"])
  d = json.loads(capsys.readouterr().out)
  assert code == 0 and d["sampler"] == "PyTorch LlamaForCausalLM, float32 on cpu"
  assert d["total"] <= 1e-5 and d["batch"] == [4]


@pytest.mark.parametrize("function, args, fragments", [
    ("one", (), ("one() returned LlamaForCausalLM", "(model, tokens)",
                 "pytorch_model")),
    ("swapped", (), ("swapped() returned a tuple of 2 (ndarray, "
                     "LlamaForCausalLM)", "model a causal LM")),
    ("two", ("--sampler", "pytorch"), ("--sampler pytorch",
                                       "two() returned 2 items")),
    ("two", ("--length", "8"), ("--length", "FUNCTION returns the tokens")),
    ("two", ("--model", "llama"), ("one model",)),
    ("make", ("--sampler", "pytorch", "--sampler-head", "float32"),
     ("--sampler-head", "PyTorch sampler")),
    ("make", ("--sampler", "pytorch", "--sampler-attention", "bfloat16"),
     ("--sampler-attention", "PyTorch sampler")),
])
def test_the_sampler_command_names_a_bad_function(own_model, capsys,
                                                   function, args,
                                                   fragments):
  from conftest import one_line_error  # noqa: PLC0415
  from jaxprec._src.cli import cli  # noqa: PLC0415
  code = cli.main(["sampler", f"{own_model}:{function}", "--no-cache",
                   *args])
  one_line_error(code, capsys.readouterr().err, 2, *fragments)


# --- the plot: the gap along the sequence, the attribution as bars

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_plot_draws_the_reports_gap_and_shares(tpu_vs_h100, tmp_path,
                                                   monkeypatch):
  import dataclasses  # noqa: PLC0415
  import sys  # noqa: PLC0415
  pytest.importorskip("matplotlib")
  from jaxprec._src.core.version import install_hint  # noqa: PLC0415
  r = tpu_vs_h100
  fig = r.plot(tmp_path / "s.png")
  assert (tmp_path / "s.png").read_bytes()[:8] == PNG
  gap, bars = fig.axes
  x, y = gap.get_lines()[0].get_data()
  assert list(x) == list(range(r.prompt, len(r.tokens)))  # token positions
  assert list(y) == list(r.figures.delta)
  assert [p.get_height() for p in bars.patches] == [
      s.share for s in r.shares] + [r.remainder]
  assert [t.get_text() for t in bars.get_xticklabels()] == [
      "lm_head", "body", "attention", "decode", "batch", "remainder"]
  assert bars.get_lines()[0].get_ydata()[0] == r.total  # the total, a line
  assert r.sampler in fig.get_suptitle()
  # a token one side drops: an infinite gap, not drawn, and said
  inf = dataclasses.replace(r, total=math.inf, remainder=math.nan,
                            figures=dataclasses.replace(
      r.figures, delta=(math.inf,) + r.figures.delta[1:]))
  fig = inf.plot(tmp_path / "inf.png")
  assert "1 infinite" in fig.axes[0].get_title()
  assert "total RMS delta inf" in [
      t.get_text() for t in fig.axes[1].get_legend().get_texts()]
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
  with pytest.raises(ImportError, match="SamplerReport.plot") as e:
    r.plot(tmp_path / "t.png")
  assert install_hint("plots") in str(e.value)


def test_the_sampler_command_writes_the_report_and_the_plot(tmp_path, capsys,
                                                            monkeypatch):
  import sys  # noqa: PLC0415
  pytest.importorskip("matplotlib")
  from jaxprec._src.cli import cli  # noqa: PLC0415
  out = tmp_path / "rep"
  code = cli.main(["sampler", "--length", "6", "--no-cache", "--json",
                   "--sampler", "default@tpu", "--out", str(out)])
  printed, err = capsys.readouterr()
  assert code == 0 and f"wrote {out / 'report.json'}" in err
  assert (out / "report.json").read_text() == printed
  assert (out / "sampler.png").read_bytes()[:8] == PNG
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
  code = cli.main(["sampler", "--length", "6", "--no-cache", "--out",
                   str(out)])
  err = capsys.readouterr().err
  assert code == 0 and "sampler.png not written" in err
  assert not (out / "sampler.png").exists()
  (tmp_path / "file").write_text("")
  assert cli.main(["sampler", "--out", str(tmp_path / "file")]) == 2
  assert "not a directory" in capsys.readouterr().err


def test_the_sampler_check_shows_each_phase(model, tokens, capsys):
  # progress=True: a line per phase on stderr where it is not a terminal
  # (the trainer, the sampler, each factor), then the time it took; nothing
  # without it.
  jaxprec.check_sampler(model, tokens)
  assert capsys.readouterr().err == ""
  jaxprec.check_sampler(model, tokens, progress=True,
                        sampler=jaxprec.Compute(precision="bfloat16", target="tpu"))
  lines = capsys.readouterr().err.splitlines()
  assert lines[0] == ("jaxprec sampler: trainer: teacher forcing, "
                      "the precision in force on cpu"), lines
  assert lines[1].startswith("jaxprec sampler: sampler: decode with a KV "
                             "cache, bfloat16"), lines
  assert lines[2:7] == [f"jaxprec sampler: factor {f} ({i}/5)" for i, f in
                        enumerate(("lm_head", "body", "attention", "decode",
                                   "batch"), 1)]
  assert lines[7].startswith("jaxprec sampler: done in ") and len(lines) == 8
