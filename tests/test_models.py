"""Built-in models (jaxprec.models): architecture, sizes, determinism, divergence."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
import jaxprec.models as models
from jaxprec._src.models.encoders import BertEncoder, Wav2Vec2Encoder


def n_params(variables):
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(variables)))


def test_import_jaxprec_does_not_import_flax_or_optional_packages():
  code = ("import sys, jaxprec; bad = [m for m in ('flax', 'optax', 'matplotlib', "
          "'rich', 'transformers', 'safetensors', 'jaxprec.models') if m in "
          "sys.modules]; print(bad)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True).stdout
  assert out.strip() == "[]"


def test_wav2vec2_base_matches_the_published_architecture():
  c = models.Wav2Vec2Config.base()
  assert c.conv_kernel == (10, 3, 3, 3, 3, 2, 2)
  assert c.conv_stride == (5, 2, 2, 2, 2, 2, 2)
  assert (c.conv_dim, c.hidden_size, c.num_layers, c.num_heads,
          c.intermediate_size) == ((512,) * 7, 768, 12, 12, 3072)
  assert (c.pos_conv_kernel, c.pos_conv_groups) == (128, 16)
  audio = jax.ShapeDtypeStruct((1, 16000), jnp.float32)  # 1 s at 16 kHz
  model = Wav2Vec2Encoder(c)
  variables = jax.eval_shape(model.init, jax.random.key(0), audio)
  # HF wav2vec2-base: 94.4M parameters (weight norm's g, the masked-time
  # embedding and conv biases differ by a few thousand).
  assert n_params(variables) == pytest.approx(94.4e6, rel=2e-3)
  out = jax.eval_shape(model.apply, variables, audio)
  assert [x.shape for x in out["conv_features"]] == [
      (1, 3199, 512), (1, 1599, 512), (1, 799, 512), (1, 399, 512),
      (1, 199, 512), (1, 99, 512), (1, 49, 512)]
  assert [x.shape for x in out["hidden_states"]] == [(1, 49, 768)] * 13
  assert c.num_frames(16000) == 49
  conv = variables["params"]["pos_conv_embed"]["conv"]["kernel"]
  assert conv.shape == (128, 768 // 16, 768)  # grouped: 16 groups


def test_bert_base_matches_bert_base_uncased():
  c = models.BertConfig.base()
  ids = jax.ShapeDtypeStruct((1, 128), jnp.int32)
  variables = jax.eval_shape(BertEncoder(c).init, jax.random.key(0), ids)
  # bert-base-uncased: 109,482,240 parameters, of which the pooler (not an
  # encoder layer) is 768 * 768 + 768.
  assert n_params(variables) == 109_482_240 - (768 * 768 + 768)
  out = jax.eval_shape(BertEncoder(c).apply, variables, ids)
  assert [x.shape for x in out["hidden_states"]] == [(1, 128, 768)] * 13


def test_tiny_models_are_deterministic_and_cached():
  fn, args = models.wav2vec2("tiny")
  assert models.wav2vec2("tiny") == (fn, args)  # same objects: programs reused
  out = jax.eval_shape(fn, *args)
  assert len(out["conv_features"]) == 7 and len(out["hidden_states"]) == 3
  assert out["hidden_states"][-1].shape == (1, 49, 64)
  a = models.synthetic_audio(2, 0.5, seed=3)
  np.testing.assert_array_equal(a, models.synthetic_audio(2, 0.5, seed=3))
  assert a.shape == (2, 8000) and a.dtype == np.float32
  np.testing.assert_allclose(a.mean(axis=1), 0, atol=1e-6)
  np.testing.assert_allclose(a.std(axis=1), 1, rtol=1e-5)
  ids = models.synthetic_tokens(1, 16, seed=0)
  assert ids[0, 0] == 1 and ids[0, -1] == 2 and ids.dtype == np.int32
  with pytest.raises(ValueError, match="'tiny', 'small', 'base'"):
    models.wav2vec2("huge")


# For wav2vec2 the same is asserted on `jaxprec check --model wav2vec2`'s
# report.json in tests/test_cli_check.py (one compilation instead of two).
@pytest.mark.parametrize("name", ["bert"])
def test_bf16_error_sits_far_above_bf16_3x(name):
  fn, args = models.MODELS[name]("tiny")
  r = jaxprec.check(fn, *args, precisions=["bfloat16", "bfloat16_3x"],
                    mode="emulate")
  bf16, x3 = r.metric("rel_rms", "bfloat16"), r.metric("rel_rms", "bfloat16_3x")
  for layer, a, b in zip(r.layers, bf16, x3):
    if layer.name == "hidden_states[0]" and name == "bert":
      assert a == b == 0  # embeddings: no matmul
      continue
    assert a > 50 * b > 0, layer.name
    assert 1e-3 < a < 3e-2, layer.name  # bf16's 8 bits: ~0.4% per rounding
  first = r.first_divergence(1e-3, 1e-3)
  assert first["bfloat16"] is not None and first["bfloat16_3x"] is None
