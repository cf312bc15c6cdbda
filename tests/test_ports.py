"""Port checks: jaxprec's NNX models with the weights of transformers'
PyTorch originals (Wav2Vec2Model, BertModel, LlamaModel), checked against
them layer by layer.

Only transformers' PyTorch classes are used (transformers 4 and 5 both have
them): CI runs this file in the main environment (transformers 4) and in
.ci/torch-stack (transformers 5). Tiny configs, random weights, nothing is
downloaded.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxprec  # noqa: E402
import jaxprec.models as models  # noqa: E402
import jaxprec.torch as jt  # noqa: E402
from jaxprec._src.cli.cli import main  # noqa: E402
from jaxprec._src.torch import torch_ports


def _rel_rms(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def _seeded(cls, config, seed=0):
  with torch.random.fork_rng(devices=[]):
    torch.manual_seed(seed)
    return cls(config).eval()


def _outputs(out):
  """An NNX model's output as {name: array}, named as capture names them."""
  flat = {}
  for k, v in out.items():
    if isinstance(v, tuple):
      flat.update({f"{k}[{i}]": x for i, x in enumerate(v)})
    else:
      flat[k] = v
  return flat


@pytest.fixture(scope="module", params=["hf-llama", "hf-wav2vec2", "hf-bert"])
def port(request):
  return jt.port(request.param, seed=0, layers=2)


def test_port_float32_floor_and_tpu_bfloat16(port):
  report = jaxprec.check(port.fn, *port.args(), reference=port.reference(),
                         precisions=("float32", "bfloat16"))
  names = [l.name for l in report.layers]
  assert set(names) == set(port.reference())  # every PyTorch output lines up
  assert "last_hidden_state" in names and "hidden_states[2]" in names
  for layer in report.layers:  # the framework floor, every layer
    assert layer.metrics["float32"].rel_rms <= 1e-5, (layer.name,
                                                     layer.metrics["float32"])
  last = report.layers[names.index("last_hidden_state")].metrics["bfloat16"]
  assert 3e-3 <= last.rel_rms <= 3e-2, last  # one bfloat16 pass: bf16 range


def _wav2vec2_config(**kw):
  base = dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=3,
              intermediate_size=80, conv_dim=(16, 24), conv_stride=(5, 2),
              conv_kernel=(10, 3), num_conv_pos_embeddings=8,
              num_conv_pos_embedding_groups=2, conv_bias=True,
              do_stable_layer_norm=True, feat_extract_norm="layer")
  return transformers.Wav2Vec2Config(**{**base, **kw})


def _llama_config(**kw):
  base = dict(vocab_size=96, hidden_size=48, intermediate_size=80,
              num_hidden_layers=1, num_attention_heads=6,
              num_key_value_heads=2, head_dim=12, rope_theta=5e5,
              rms_norm_eps=1e-5, initializer_range=0.2)
  return transformers.LlamaConfig(**{**base, **kw})


def _bert_no_pooler(config):
  return transformers.BertModel(config, add_pooling_layer=False)


_BERT = dict(vocab_size=77, hidden_size=48, num_hidden_layers=1,
             num_attention_heads=3, intermediate_size=80, type_vocab_size=3,
             max_position_embeddings=16)
_QWEN2 = dict(vocab_size=96, hidden_size=48, intermediate_size=80,
              num_hidden_layers=1, num_attention_heads=6,
              num_key_value_heads=3, initializer_range=0.2)
# Sizes other than the built-in configs' and the ports': each field comes
# from the PyTorch model's config.
OTHER_SIZES = {
    "wav2vec2": (models.wav2vec2, transformers.Wav2Vec2Model,
                 lambda: _wav2vec2_config(), {"seconds": 0.1}),
    "bert-no-pooler": (models.bert, _bert_no_pooler,
                       lambda: transformers.BertConfig(**_BERT),
                       {"seq_len": 8}),
    "llama-tied-head": (models.llama, transformers.LlamaForCausalLM,
                        lambda: _llama_config(tie_word_embeddings=True),
                        {"seq_len": 8}),
    "llama-own-head": (models.llama, transformers.LlamaForCausalLM,
                       lambda: _llama_config(), {"seq_len": 8}),
    "llama-biases": (models.llama, transformers.LlamaModel,
                     lambda: _llama_config(attention_bias=True, mlp_bias=True),
                     {"seq_len": 8}),
    "qwen2": (models.llama, transformers.Qwen2Model,
              lambda: transformers.Qwen2Config(**_QWEN2), {"seq_len": 8}),
}


@pytest.mark.parametrize("case", OTHER_SIZES)
def test_from_pytorch_takes_the_sizes_of_any_pytorch_model(case):
  build, cls, config, kwargs = OTHER_SIZES[case]
  pt = _seeded(cls, config())
  before = {k: v.clone() for k, v in pt.state_dict().items()}
  fn, (state, x) = build(from_pytorch=pt, **kwargs)
  out = _outputs(fn(state, x))
  x = np.asarray(x)
  ref = jt.capture(pt, x.astype(np.int64) if x.dtype.kind == "i" else x,
                   output_hidden_states=True)
  assert set(ref) == set(out), (sorted(ref), sorted(out))
  for name, want in ref.items():
    assert _rel_rms(out[name], want) <= 1e-5, name
  after = pt.state_dict()  # the PyTorch model is not changed
  assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_layer_of_another_shape_is_refused_naming_the_parameter():
  pt = _seeded(transformers.Wav2Vec2Model, _wav2vec2_config(num_hidden_layers=2))
  pt.encoder.layers[1].feed_forward.intermediate_dense = torch.nn.Linear(48, 96)
  with pytest.raises(ValueError) as e:
    models.wav2vec2(from_pytorch=pt)
  msg = str(e.value)
  assert ("first mismatch at "
          "'encoder.layers.1.feed_forward.intermediate_dense.weight': "
          "PyTorch (96, 48), jaxprec's model (80, 48)") in msg, msg


def test_a_parameter_jaxprec_lacks_or_the_pytorch_model_lacks_is_refused():
  pt = _seeded(transformers.LlamaModel, _llama_config())
  pt.layers[0].self_attn.q_norm = torch.nn.LayerNorm(12)  # Qwen3-style
  with pytest.raises(ValueError, match=r"first mismatch at "
                     r"'layers\.0\.self_attn\.q_norm\.weight': jaxprec's "
                     r"model has no such parameter"):
    models.llama(from_pytorch=pt)
  pt = _seeded(transformers.LlamaModel, _llama_config())
  pt.layers[0].mlp.up_proj = torch.nn.Identity()
  with pytest.raises(ValueError, match=r"first mismatch at "
                     r"'layers\.0\.mlp\.up_proj\.weight': the PyTorch model "
                     r"has no such parameter"):
    models.llama(from_pytorch=pt)


def test_another_architecture_or_variant_is_refused_naming_it():
  bert = _seeded(transformers.BertModel, transformers.BertConfig(**_BERT))
  with pytest.raises(ValueError, match=r"BertModel is a 'bert' model; "
                     r"jaxprec's Wav2Vec2Model loads 'wav2vec2'"):
    models.wav2vec2(from_pytorch=bert)
  post_ln = _seeded(transformers.Wav2Vec2Model, _wav2vec2_config(
      do_stable_layer_norm=False))
  with pytest.raises(ValueError, match=r"do_stable_layer_norm=False is not "
                     r"implemented.*do_stable_layer_norm=True"):
    models.wav2vec2(from_pytorch=post_ln)
  scaled = _llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
  with pytest.raises(ValueError, match=r"rope_type='linear' is not "
                     r"implemented"):
    models.llama(from_pytorch=_seeded(transformers.LlamaModel, scaled))
  with pytest.raises(TypeError, match=r"from_pytorch= takes a transformers "
                     r"PyTorch BertModel.*got Linear"):
    models.bert(from_pytorch=torch.nn.Linear(2, 2))
  with pytest.raises(ValueError, match=r"leave size unset"):
    models.bert("tiny", from_pytorch=bert)


def test_pos_conv_weight_is_the_weight_norm_computes():
  # The positional convolution is weight-normalised (g * v / ||v||): the
  # port loads the weight the PyTorch forward pass uses, not g or v.
  pt = _seeded(transformers.Wav2Vec2Model, _wav2vec2_config())
  model = models.Wav2Vec2Model.from_pytorch(pt)
  conv = pt.encoder.pos_conv_embed.conv
  with torch.no_grad():
    want = conv.weight.numpy()  # (out, in / groups, kernel)
  got = np.asarray(model.encoder.pos_conv_embed.conv.kernel[...])
  np.testing.assert_array_equal(np.transpose(got, (2, 1, 0)), want)


def test_cli_llama_port_against_pytorch(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(torch_ports, "_LAYERS", 1)  # one layer is enough here
  rc = main(["check", "--model", "hf-llama", "--reference", "pytorch",
             "--json", "--out", str(tmp_path / "r")])
  out, err = capsys.readouterr()
  assert rc == 0, err
  report = json.loads(out)
  # The port check: the float32 floor and TPU bfloat16, layer by layer, the
  # layers paired with PyTorch's by their names.
  assert report["precisions"] == ["float32", "bfloat16"], report["precisions"]
  assert report["suspects"] == {"float32": [], "bfloat16": []}
  assert report["alignment"]["layers/0/self_attn"] == "layers.0.self_attn"
  assert report["alignment"]["norm"] == "norm"
  assert (tmp_path / "r" / "report.json").is_file()


def test_cli_port_checks_need_no_flax_model_class(tmp_path, capsys,
                                                  monkeypatch):
  # transformers 5 has no Flax models: the port checks never ask for one.
  from jaxprec._src.torch import torch_ref

  def no_flax(*args, **kwargs):
    raise ImportError("transformers has no Flax models")
  monkeypatch.setattr(torch_ref, "import_transformers_flax", no_flax)
  monkeypatch.setattr(torch_ports, "_LAYERS", 1)
  rc = main(["check", "--model", "hf-wav2vec2", "--reference", "pytorch",
             "--precisions", "bfloat16", "--out", str(tmp_path / "r")])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert "against the PyTorch Wav2Vec2Model" in out
  assert "feature_extractor/conv_layers/0" in out


def test_port_argument_errors():
  with pytest.raises(ValueError, match="Did you mean 'hf-llama'"):
    jt.port("hf-lama")
  with pytest.raises(ValueError, match=r"port\(layers=0\)"):
    jt.port("hf-llama", layers=0)


def test_cli_llama_size_it_does_not_come_in_is_one_usage_line(capsys):
  rc = main(["check", "--model", "llama", "--size", "base"])
  _, err = capsys.readouterr()
  assert rc == 2
  assert err.count("\n") == 1 and "Unknown size 'base'" in err, err


def test_a_bfloat16_pytorch_model_is_ported_with_a_warning():
  torch.manual_seed(0)
  pt = transformers.LlamaModel(_llama_config()).eval()
  with pytest.warns(UserWarning, match=r"bfloat16 parameters; jaxprec's model gets "
                    r"them as float32"):
    models.llama(from_pytorch=pt.to(torch.bfloat16), seq_len=4)
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    models.llama(from_pytorch=pt.float(), seq_len=4)  # float32: no warning
