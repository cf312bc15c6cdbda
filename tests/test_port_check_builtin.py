"""port_check on jaxprec's own ports of transformers models (the built-in
hf-* checks, by automatic pairing and by name with port_check_builtin, with
bugs planted in them; a Wav2Vec2) and the docs page's examples, as
written."""

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


# The NNX layers of each built-in port that a PyTorch module of their name
# does not match: they return every hidden state, PyTorch's the last one.
UNPAIRED = {"hf-llama": ("output",), "hf-bert": ("encoder", "output"),
            "hf-wav2vec2": ("encoder", "output")}


@pytest.mark.parametrize("name", [
    "hf-llama", "hf-bert", pytest.param("hf-wav2vec2", marks=pytest.mark.slow)])
def test_port_check_builtin_pairs_by_name_and_finds_no_suspect(name):
  r = jt.port_check_builtin(name, layers=1)
  assert r.precisions == ("float32", "bfloat16")
  assert r.suspects("float32") == [] and r.suspects("bfloat16") == []
  # Every pair is the NNX layer a/b/0 with the PyTorch module a.b.0.
  assert all(t == j.replace("/", ".") for j, t in r.alignment.items())
  assert len(r.alignment) >= 14
  assert r.unpaired_jax == UNPAIRED[name]
  for j in UNPAIRED[name]:  # each unpaired layer is in the notes, with why
    assert any(n.startswith(f"{j} is not paired: ") and "hidden state" in n
               for n in r.notes), r.notes
  for l in r.layers:  # float32 is at its floor; bfloat16 rounds matmuls
    assert l.floor <= 1e-5 and l.verdict == {"float32": "ok",
                                             "bfloat16": "ok"}, l
  assert max(l.local["bfloat16"] for l in r.layers) > 1e-3


@pytest.mark.slow
def test_wav2vec2_convolutions_are_paired_in_jax_layout():
  # PyTorch's Conv1d runs NCW, the NNX port NWC: the port's layouts put
  # PyTorch's arrays in JAX's layout, so the convolutions pair by name.
  r = jt.port_check_builtin("hf-wav2vec2", layers=1, precisions="bfloat16")
  for name in ("feature_extractor/conv_layers/0/conv",
               "feature_extractor/conv_layers/2", "feature_extractor",
               "encoder/pos_conv_embed/conv"):
    layer = r.layer(name)
    assert r.alignment[name] == name.replace("/", ".")
    assert layer.floor <= 1e-6 and 1e-3 < layer.local["bfloat16"] < 1e-2
  assert not any("conv" in j for j in r.unpaired_jax)
  assert r.suspects() == []


def _bert_with_a_wrong_layer_norm_bias():
  port = jt.port("hf-bert", layers=2)
  ln = port.model.encoder.layer[1].attention.output.LayerNorm
  ln.bias[...] = ln.bias[...] + 0.5  # a bias loaded wrong
  return port


def test_a_wrong_layer_norm_bias_is_the_one_suspect():
  r = jt.port_check_builtin(_bert_with_a_wrong_layer_norm_bias())
  want = ["encoder/layer/1/attention/output/LayerNorm"]
  assert r.suspects("float32") == want and r.suspects("bfloat16") == want
  assert r.layer("encoder/layer/1/attention").verdict["float32"] == "inside"
  assert r.layer("encoder/layer/0").verdict["float32"] == "ok"


def test_a_wrong_activation_is_the_one_suspect(monkeypatch):
  import jax  # noqa: PLC0415
  port = jt.port("hf-llama", layers=1)
  monkeypatch.setattr(jax.nn, "silu", jax.nn.gelu)  # SwiGLU's SiLU as GELU
  r = jt.port_check_builtin(port)
  assert r.suspects("float32") == ["layers/0/mlp"]
  assert r.suspects("bfloat16") == ["layers/0/mlp"]
  assert r.layer("layers/0/mlp/down_proj").verdict["float32"] == "ok"


@pytest.mark.slow
def test_a_wrong_convolution_is_found_through_the_layout():
  port = jt.port("hf-wav2vec2", layers=1)
  conv = port.model.feature_extractor.conv_layers[1].conv
  conv.kernel[..., 0] = -conv.kernel[..., 0]  # one channel's sign flipped
  r = jt.port_check_builtin(port)
  want = ["feature_extractor/conv_layers/1/conv"]
  assert r.suspects("float32") == want and r.suspects("bfloat16") == want


def test_port_check_builtin_argument_errors():
  with pytest.raises(ValueError, match="Did you mean 'hf-llama'"):
    jt.port_check_builtin("hf-lama")
  with pytest.raises(ValueError, match="this Port is built already"):
    jt.port_check_builtin(jt.port("hf-llama", layers=1), layers=2)


def test_the_docs_examples_run_and_print_what_the_page_says(capsys):
  page = (pathlib.Path(__file__).resolve().parents[1] / "docs" /
          "port-check.md").read_text(encoding="utf-8")
  # A block headed `# NAME.py` is a file a command of the page reads
  # (tests/test_doc_commands.py runs it).
  blocks = [b for b in re.findall(r"^```python\n(.*?)^```", page, re.M | re.S)
            if not b.startswith("# docs-test: skip")
            and not re.match(r"# \w+\.py\n", b)]
  assert len(blocks) == 2
  for block in blocks:
    exec(compile(block, "port-check.md", "exec"), {"__name__": "example"})  # noqa: S102
    said = block.rstrip().splitlines()[-1]
    assert said.startswith("# ")
    assert capsys.readouterr().out.splitlines()[-1] == said[2:]
