"""port_check on jaxprec's own ports of transformers models (the built-in
hf-bert check, a Wav2Vec2) and the docs page's examples, as written."""

import pathlib
import re

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

import jaxprec.torch as jt  # noqa: E402


def test_the_builtin_bert_port_has_no_suspect():
  port = jt.port("hf-bert", seed=0)
  jax_inputs = tuple(port.inputs.values())
  torch_inputs = tuple(v.astype(np.int64) if np.issubdtype(v.dtype, np.integer)
                       else v for v in jax_inputs)
  r = jt.port_check(port.model, port.torch_model, *jax_inputs,
                    torch_inputs=torch_inputs)
  assert r.suspects() == []
  layer = r.layer("encoder/layer/1/attention")
  assert r.alignment[layer.name] == "encoder.layer.1.attention"
  assert layer.floor < 1e-5 and layer.local["bfloat16"] > 1e-4
  assert len(r.alignment) > 20


def test_the_wav2vec2_port_has_no_suspect():
  transformers = pytest.importorskip("transformers")
  import jaxprec.models  # noqa: PLC0415
  cfg = transformers.Wav2Vec2Config(
      hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
      conv_kernel=(10, 3), num_conv_pos_embeddings=8,
      num_conv_pos_embedding_groups=2, do_stable_layer_norm=True,
      feat_extract_norm="layer")
  torch.manual_seed(0)
  pt = transformers.Wav2Vec2Model(cfg).eval()
  model = jaxprec.models.Wav2Vec2Model.from_pytorch(pt)
  audio = np.random.default_rng(0).normal(size=(1, 400)).astype(np.float32)
  r = jt.port_check(model, pt, audio)
  assert r.suspects() == []
  assert r.alignment["encoder/layers/1/feed_forward"] == (
      "encoder.layers.1.feed_forward")
  assert r.layer("encoder/layers/1").local["bfloat16"] > 1e-5


def test_the_docs_examples_run_and_print_what_the_page_says(capsys):
  page = (pathlib.Path(__file__).resolve().parents[1] / "docs" /
          "port-check.md").read_text(encoding="utf-8")
  blocks = [b for b in re.findall(r"^```python\n(.*?)^```", page, re.M | re.S)
            if not b.startswith("# docs-test: skip")]
  assert len(blocks) == 2
  for block in blocks:
    exec(compile(block, "port-check.md", "exec"), {"__name__": "example"})  # noqa: S102
    said = block.rstrip().splitlines()[-1]
    assert said.startswith("# ")
    assert capsys.readouterr().out.splitlines()[-1] == said[2:]
