"""PyTorch as the reference: jaxprec.torch and check(reference=torch).

The twins are tiny Hugging Face models with random weights, built in PyTorch
and converted to Flax with transformers' own converter; the float32 floor is
the two frameworks' disagreement, and the bfloat16 row is a TPU's default
(one bfloat16 pass, emulated).
"""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import jaxprec  # noqa: E402
import jaxprec.torch as jt  # noqa: E402
from jaxprec._src.checker import reference as reference_lib
from jaxprec._src.cli.cli import main  # noqa: E402
from jaxprec._src.core.version import install_hint  # noqa: E402
from jaxprec._src.torch import torch_ref


def _has_flax_models() -> bool:
  """Whether transformers is installed with its Flax models (4.x, not 5)."""
  try:
    import transformers  # noqa: PLC0415
  except ImportError:
    return False
  return hasattr(transformers, "FlaxBertModel")


HF_FLAX = _has_flax_models()
# The twins and flax_params need transformers' Flax models; CI's torch-stack
# stage runs this file beside transformers 5, where they are skipped and the
# install hint is tested instead.
needs_hf_flax = pytest.mark.skipif(
    not HF_FLAX, reason="needs transformers' Flax models (jaxprec[hf-flax])")


@pytest.fixture(scope="module", params=["hf-wav2vec2", "hf-bert"])
def twin(request):
  if not HF_FLAX:
    pytest.skip("needs transformers' Flax models (jaxprec[hf-flax])")
  return jt.twin(request.param, seed=0)


# ---------------------------------------------------------------------------
# capture and from_torch.


class TwoLayer(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.fc1 = torch.nn.Linear(8, 16)
    self.fc2 = torch.nn.Linear(16, 4)
    self.drop = torch.nn.Dropout(0.5)
    self.fail = False

  def forward(self, x):
    h = torch.tanh(self.fc1(x))
    if self.fail:
      raise RuntimeError("forward failed")
    return {"hidden": self.drop(h), "logits": self.fc2(h),
            "ids": torch.arange(3)}


def test_capture_names_eval_mode_and_no_grad():
  torch.manual_seed(0)
  m = TwoLayer().train()
  m.fc2.eval()  # a submodule with its own flag
  x = torch.randn(2, 8)
  out = jt.capture(m, x, modules=r"fc\d")
  # With modules=, the root's output is named as check_module names it.
  assert list(out) == ["output.hidden", "output.logits", "fc1", "fc2"]
  assert list(jt.capture(m, x)) == ["hidden", "logits"]  # ints dropped
  # Eval mode: dropout off, so "hidden" is tanh(fc1(x)) exactly.
  w1, b1 = m.fc1.weight.detach().numpy(), m.fc1.bias.detach().numpy()
  np.testing.assert_allclose(out["output.hidden"],
                             np.tanh(x.numpy() @ w1.T + b1),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out["fc1"], x.numpy() @ w1.T + b1, rtol=1e-6,
                             atol=1e-6)
  assert all(isinstance(v, np.ndarray) and v.dtype == np.float32
             for v in out.values())
  assert m.training and m.fc1.training and not m.fc2.training
  assert not m.fc1._forward_hooks and not m.fc2._forward_hooks
  assert torch.is_grad_enabled()  # no_grad only inside


def test_hooks_removed_and_flags_restored_after_an_exception():
  m = TwoLayer().train()
  m.fail = True
  with pytest.raises(RuntimeError, match="forward failed"):
    jt.capture(m, torch.randn(2, 8), modules="fc1|fc2")
  assert m.training and m.fc1.training and m.fc2.training and m.drop.training
  assert not any(sub._forward_hooks for sub in m.modules())


def test_capture_argument_errors():
  m = TwoLayer()
  with pytest.raises(ValueError, match=r"matches no submodule.*'fc1'"):
    jt.capture(m, torch.randn(2, 8), modules="encoder")
  with pytest.raises(ValueError, match="not a regular expression"):
    jt.capture(m, torch.randn(2, 8), modules="fc(")
  with pytest.raises(TypeError, match="torch.nn.Module"):
    jt.capture(lambda x: x, torch.randn(2))
  with pytest.raises(TypeError, match="dict or a callable"):
    jt.capture(m, torch.randn(2, 8), names=3)


def test_bfloat16_and_float16_are_widened_exactly():
  values = np.array([1.0, 1 + 2**-7, -3.140625, 2**-100, 65504.0], np.float32)
  for dtype, np_dtype in ((torch.bfloat16, ml_dtypes.bfloat16),
                          (torch.float16, np.float16)):
    t = torch.tensor(values).to(dtype)
    got = jt.from_torch({"a": t})["a"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values.astype(np_dtype).astype(np.float32))


def test_from_torch_is_none_for_other_objects_and_needs_no_torch_import():
  assert jt.from_torch({"h": np.zeros(2)}) is None
  assert jt.from_torch([1.0, 2.0]) is None and jt.from_torch(None) is None
  assert jt.from_torch(jnp.zeros(2)) is None
  # A fresh interpreter: importing jaxprec and converting non-torch objects
  # imports neither torch nor transformers.
  code = ("import sys, numpy as np, jaxprec; "
          "from jaxprec._src.checker import reference; "
          "reference.load({'h': np.zeros(2, np.float32)}); "
          "print('torch' in sys.modules, 'transformers' in sys.modules)")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=120)
  assert proc.stdout.split() == ["False", "False"], proc.stderr


def test_from_torch_names_like_named_layers():
  t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
  got = jt.from_torch({"hidden_states": (t, t + 1), "mask": torch.ones(2, dtype=torch.int64)})
  assert list(got) == ["hidden_states[0]", "hidden_states[1]"]
  assert list(got) == list(jaxprec.named_layers(
      {"hidden_states": (np.zeros(2), np.zeros(2)), "mask": np.ones(2, int)}))
  assert list(jt.from_torch(t)) == ["output"]


def test_plain_torch_mlp_against_a_flax_mlp_through_names():
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jnp.tanh(nn.Dense(16, name="dense_0")(x))
      return {"h": h, "y": nn.Dense(4, name="dense_1")(h)}

  torch.manual_seed(1)
  pt = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                           torch.nn.Linear(16, 4))
  params = {"params": {
      "dense_0": {"kernel": pt[0].weight.detach().numpy().T,
                  "bias": pt[0].bias.detach().numpy()},
      "dense_1": {"kernel": pt[2].weight.detach().numpy().T,
                  "bias": pt[2].bias.detach().numpy()}}}
  x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
  ref = jt.capture(pt, x, modules=r"1|2", names={"1": "h", "2": "y",
                                                   "output": None})
  assert list(ref) == ["h", "y"]
  report = jaxprec.check(MLP().apply, params, x, reference=ref,
                         precisions=("float32", "bfloat16"))
  floor = {l.name: l.metrics["float32"].rel_rms for l in report.layers}
  bf16 = {l.name: l.metrics["bfloat16"].rel_rms for l in report.layers}
  assert set(floor) == {"h", "y"}
  assert max(floor.values()) <= 1e-6, floor
  # One bfloat16 pass: about 2**-9 relative error per product.
  assert all(1e-4 < v < 2e-2 for v in bf16.values()), bf16
  # The same through a callable.
  ref2 = jt.capture(pt, x, modules=r"\d",
                    names=lambda n: {"1": "h", "2": "y"}.get(n))
  assert list(ref2) == ["h", "y"]
  np.testing.assert_array_equal(ref2["y"], ref["y"])


# ---------------------------------------------------------------------------
# Twins and check(reference=<torch object>).


def test_twin_float32_floor_and_tpu_bfloat16(twin):
  report = jaxprec.check(twin.fn, *twin.args(), reference=twin.reference(),
                         precisions=("float32", "bfloat16"))
  names = [l.name for l in report.layers]
  assert "last_hidden_state" in names and "hidden_states[4]" in names
  for layer in report.layers:  # the framework floor, every layer
    assert layer.metrics["float32"].rel_rms <= 1e-5, (layer.name,
                                                     layer.metrics["float32"])
  last = report.layers[names.index("last_hidden_state")].metrics["bfloat16"]
  assert 3e-3 <= last.rel_rms <= 3e-2, last
  # Depth order: the embeddings' output first, the last hidden state after
  # every layer (a ModelOutput lists it first, which made it the "first
  # divergence" of every report).
  hidden = [n for n in names if n.startswith("hidden_states[")]
  assert hidden == [f"hidden_states[{i}]" for i in range(len(hidden))]
  assert names.index("hidden_states[0]") < names.index("last_hidden_state")
  assert names.index(hidden[-1]) < names.index("last_hidden_state")
  first = report.first_divergence(atol=1e-3, rtol=1e-3, precision="bfloat16")
  assert first is not None and first.index < names.index("last_hidden_state"), first


@needs_hf_flax
def test_torch_objects_as_reference_give_the_capture_numbers():
  tw = jt.twin("hf-bert", seed=1)
  inputs = {k: torch.from_numpy(v) for k, v in tw.inputs.items()}
  with torch.no_grad():
    output = tw.torch_model(**inputs, output_hidden_states=True)
  direct = reference_lib.load(output)
  captured = tw.reference()
  assert list(direct) == list(captured)
  for k in captured:
    np.testing.assert_array_equal(direct[k], captured[k])
  a = jaxprec.check(tw.fn, *tw.args(), reference=output, precisions="bfloat16")
  b = jaxprec.check(tw.fn, *tw.args(), reference=captured, precisions="bfloat16")
  assert [l.metrics for l in a.layers] == [l.metrics for l in b.layers]
  # A bare tensor: one layer, the same numbers as its NumPy copy.
  last = lambda p, *i: tw.fn(p, *i)["last_hidden_state"]  # noqa: E731
  c = jaxprec.check(last, *tw.args(), reference=output.last_hidden_state,
                    precisions="bfloat16")
  d = jaxprec.check(last, *tw.args(),
                    reference=captured["last_hidden_state"],
                    precisions="bfloat16")
  assert [l.metrics for l in c.layers] == [l.metrics for l in d.layers]
  assert 3e-3 <= c.layers[0].metrics["bfloat16"].rel_rms <= 3e-2


@needs_hf_flax
def test_twin_with_one_layer_too_few_is_refused():
  full = jt.twin("hf-bert", seed=0)
  short = jt.twin("hf-bert", seed=0, layers=3)
  with pytest.raises(ValueError, match=r"hidden_states\[4\]"):
    jaxprec.check(short.fn, *short.args(), reference=full.reference(),
                  precisions="bfloat16")


@needs_hf_flax
def test_twin_leaves_torch_rng_alone_and_unknown_names():
  torch.manual_seed(123)
  before = torch.get_rng_state()
  jt.twin("hf-bert", seed=5)
  assert torch.equal(before, torch.get_rng_state())
  with pytest.raises(ValueError, match="Did you mean 'hf-bert'"):
    jt.twin("hf-bret")


@needs_hf_flax
def test_flax_params_do_not_change_the_models_and_need_no_flax_weights():
  # The twin's Flax model is built without weights (_do_init=False): its
  # parameters' shapes are computed abstractly. A model with weights of its
  # own gets the same parameters, and neither model is changed.
  tw = jt.twin("hf-bert", seed=0)
  assert not tw.flax_model._is_initialized
  built = type(tw.flax_model)(tw.flax_model.config, seed=1)
  state = {k: v.clone() for k, v in tw.torch_model.state_dict().items()}
  flax_before = jax.tree_util.tree_map(np.asarray, built.params)
  from_shapes = jt.flax_params(tw.torch_model, tw.flax_model)
  from_built = jt.flax_params(tw.torch_model, built)
  for a, b in ((from_shapes, from_built), (from_shapes, tw.params)):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
  for k, v in tw.torch_model.state_dict().items():
    assert torch.equal(v, state[k])
  jax.tree_util.tree_map(np.testing.assert_array_equal, flax_before,
                         jax.tree_util.tree_map(np.asarray, built.params))


def test_captured_submodule_outputs_survive_in_place_ops_later():
  """capture(modules=) kept NumPy views of hooked outputs: ReLU(inplace=True)
  and `h += residual` later in the forward pass rewrote them."""
  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.fc = torch.nn.Linear(6, 6)
      self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
      h = self.fc(x)
      before = h.detach().clone()
      self.act(h)
      h += x
      return {"out": h, "before": before}

  torch.manual_seed(0)
  x = torch.randn(4, 6)
  got = jt.capture(Net(), x, modules="fc")
  want = got["output.before"]
  assert (want < 0).any()  # the ReLU had something to rewrite
  np.testing.assert_array_equal(got["fc"], want)


def test_capture_keeps_every_call_of_a_submodule_called_twice():
  """A shared block applied twice: only its last call was kept."""
  class Twice(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.block = torch.nn.Linear(4, 4)
      self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
      return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))

  torch.manual_seed(0)
  net, x = Twice(), torch.randn(2, 4)
  got = jt.capture(net, x, modules="block|head")
  assert list(got) == ["output", "block#0", "block#1", "head"]
  with torch.no_grad():
    first = net.block(x)
    second = net.block(torch.tanh(first))
  np.testing.assert_array_equal(got["block#0"], first.numpy())
  np.testing.assert_array_equal(got["block#1"], second.numpy())


def test_capture_never_writes_into_the_callers_numpy_input():
  class InPlace(torch.nn.Module):
    def forward(self, x):
      x.mul_(2)
      return x + 1

  x = np.ones(3, np.float32)
  got = jt.capture(InPlace(), x)
  np.testing.assert_array_equal(x, np.ones(3, np.float32))
  np.testing.assert_array_equal(got["output"], np.full(3, 3.0, np.float32))


@needs_hf_flax
def test_flax_params_refuse_configs_that_differ_where_shapes_do_not_show():
  import transformers  # noqa: PLC0415
  base = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2,
              num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=32)
  pt = transformers.BertModel(transformers.BertConfig(**base))
  other = transformers.FlaxBertModel(transformers.BertConfig(
      **{**base, "num_attention_heads": 4, "hidden_act": "relu"}),
      _do_init=False)
  with pytest.raises(ValueError, match=r"configs differ where the shapes do "
                     r"not show it: num_attention_heads=2 against 4; "
                     r"hidden_act='gelu' against 'relu'"):
    jt.flax_params(pt, other)
  same = transformers.FlaxBertModel(transformers.BertConfig(**base),
                                    _do_init=False)
  assert jax.tree_util.tree_leaves(jt.flax_params(pt, same))


@pytest.mark.parametrize("layers", [1.5, -1, 0, True, "2"])
def test_twin_refuses_a_layer_count_that_is_not_a_positive_integer(layers):
  with pytest.raises(ValueError, match=r"the number of transformer layers is "
                     r"an integer of at least 1"):
    jt.twin("hf-bert", layers=layers)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_twin_refuses_a_seed_out_of_range(seed):
  """seed=-1 reached NumPy's and JAX's own errors."""
  with pytest.raises(ValueError, match=rf"twin\(seed={seed!r}\): the seed is "
                     rf"an integer from 0 to {2**32 - 1}"):
    jt.twin("hf-bert", seed=seed)


def test_an_integer_tensor_as_reference_names_what_the_user_passed():
  """It said "reference={} (dict) holds no floating arrays", naming
  jaxprec's own conversion, not the tensor."""
  with pytest.raises(ValueError, match=r"reference=tensor\(\[1, 2, 3\]\) "
                     r"\(Tensor of torch.int64\) holds no floating arrays"):
    jaxprec.check(lambda x: {"h": x * 2.0}, np.ones(3, np.float32),
                  reference=torch.tensor([1, 2, 3]), precisions=["bf16"])


@needs_hf_flax
def test_flax_params_refuse_a_pytorch_model_that_does_not_fit():
  """A 3-layer BERT for a 2-layer Flax BERT, a wider one, and a BERT for a
  Wav2Vec2: each refused, naming the first parameter that differs."""
  import transformers  # noqa: PLC0415
  cfg = dict(vocab_size=100, hidden_size=32, num_attention_heads=2,
             intermediate_size=64, max_position_embeddings=16)
  flax_bert = transformers.FlaxBertModel(
      transformers.BertConfig(num_hidden_layers=2, **cfg), _do_init=False)
  deeper = transformers.BertModel(
      transformers.BertConfig(num_hidden_layers=3, **cfg))
  with pytest.raises(ValueError, match=r"first mismatch at "
                     r"'encoder/layer/2/.*': from PyTorch \(.*\), the Flax "
                     r"model has none"):
    jt.flax_params(deeper, flax_bert)
  wider = transformers.BertModel(transformers.BertConfig(
      num_hidden_layers=2, **{**cfg, "intermediate_size": 96}))
  with pytest.raises(ValueError, match=r"BertModel does not fit "
                     r"FlaxBertModel.*intermediate"):
    jt.flax_params(wider, flax_bert)
  tw = jt.twin("hf-wav2vec2", seed=0)
  with pytest.raises(ValueError, match="BertModel does not fit "
                     "FlaxWav2Vec2Model: first mismatch at "):
    jt.flax_params(deeper, tw.flax_model)
  # The same sizes fit, at any size other than the built-in twins'.
  same = transformers.BertModel(transformers.BertConfig(num_hidden_layers=2,
                                                        **cfg))
  params = jt.flax_params(same, flax_bert)
  assert jax.tree_util.tree_leaves(params)


# ---------------------------------------------------------------------------
# The command line.


@needs_hf_flax
def test_cli_reference_pytorch_writes_report_and_plot(tmp_path, capsys):
  out = tmp_path / "rep"
  rc = main(["check", "--model", "hf-bert", "--reference", "pytorch",
             "--precisions", "bfloat16", "--out", str(out), "--json"])
  stdout, err = capsys.readouterr()
  assert rc == 0, err
  import json
  report = json.loads(stdout)  # the port check, paired with BertModel's
  assert report["alignment"]["pooler"] == "pooler"
  assert report["precisions"] == ["bfloat16"]
  assert (out / "report.json").is_file()
  assert (out / "divergence.png").is_file() or "matplotlib" in err


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "bert", "--reference", "pytorch"],
     "--reference pytorch needs a model with a PyTorch twin"),
    # Your own port: the documented route, not the old capture file.
    (["--model", "bert", "--reference", "pytorch"],
     "for your own port, name the PyTorch original: --reference "
     "pytorch:MODULE:FUNCTION"),
    (["--model", "hf-bert", "--size", "base"], "--size applies to --model"),
])
def test_cli_reference_pytorch_usage_errors(argv, fragment, capsys):
  rc = main(["check", *argv])
  _, err = capsys.readouterr()
  assert rc == 2
  assert err.count("\n") == 1 and fragment in err and "Traceback" not in err


def test_cli_without_torch_gives_the_install_hint(tmp_path):
  # A fresh interpreter in which `import torch` fails.
  code = ("import sys; sys.modules['torch'] = None; "
          "from jaxprec._src.cli.cli import main; "
          "sys.exit(main(['check', '--model', 'hf-wav2vec2', '--reference', "
          f"'pytorch', '--out', {str(tmp_path / 'r')!r}]))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and install_hint("torch") in lines[0]
  assert "Traceback" not in proc.stderr


def test_check_module_against_hooked_submodules():
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jnp.tanh(nn.Dense(16, name="fc")(x))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = Block(name=f"layers_{i}")(x)
      return nn.Dense(4, name="head")(x)

  class TorchBlock(torch.nn.Module):
    def __init__(self, n):
      super().__init__()
      self.fc = torch.nn.Linear(n, 16)

    def forward(self, x):
      return torch.tanh(self.fc(x))

  class TorchNet(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.layers = torch.nn.ModuleList([TorchBlock(8), TorchBlock(16)])
      self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
      for layer in self.layers:
        x = layer(x)
      return self.head(x)

  torch.manual_seed(0)
  pt = TorchNet()

  def dense(m):
    return {"kernel": m.weight.detach().numpy().T, "bias": m.bias.detach().numpy()}
  params = {"params": {"layers_0": {"fc": dense(pt.layers[0].fc)},
                       "layers_1": {"fc": dense(pt.layers[1].fc)},
                       "head": dense(pt.head)}}
  x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
  ref = jt.capture(pt, x, modules=r".+",
                   names=lambda n: n.replace("layers.", "layers_"))
  # Hooks fire in execution order; PyTorch's dots match Flax's slashes.
  assert list(ref) == ["output", "layers_0.fc", "layers_0", "layers_1.fc",
                       "layers_1", "head"]
  report = jaxprec.check_module(Net(), params, x, reference=ref,
                                precisions=("float32", "bfloat16"))
  got = {l.name: l.metrics for l in report.layers}
  assert {"layers_0/fc", "layers_1", "head"} <= set(got)
  for name, m in got.items():
    assert m["float32"].rel_rms <= 1e-6, (name, m["float32"])
    assert 1e-4 < m["bfloat16"].rel_rms < 2e-2, (name, m["bfloat16"])


# ---------------------------------------------------------------------------
# transformers without Flax models (5.0 and newer): one line with the hint.


def _transformers_5(monkeypatch):
  """A stand-in for transformers 5 in sys.modules: the PyTorch classes and
  configs, and no Flax model class or modeling_flax_* module."""
  import types  # noqa: PLC0415
  stub = types.ModuleType("transformers")
  stub.__version__ = "5.0.0"
  stub.BertConfig = stub.Wav2Vec2Config = lambda **kwargs: kwargs
  stub.BertModel = stub.Wav2Vec2Model = object
  monkeypatch.setitem(sys.modules, "transformers", stub)
  return stub


@pytest.mark.parametrize("name, cls", [("hf-bert", "FlaxBertModel"),
                                       ("hf-wav2vec2", "FlaxWav2Vec2Model")])
def test_twin_without_flax_models_names_the_class_and_the_extra(
    monkeypatch, name, cls):
  _transformers_5(monkeypatch)
  with pytest.raises(ImportError) as e:
    jt.twin(name)
  msg = str(e.value)
  assert "\n" not in msg and install_hint("hf-flax") in msg
  assert f"transformers 5.0.0 has no {cls}" in msg


def test_flax_params_without_flax_models_gives_the_hint(monkeypatch):
  _transformers_5(monkeypatch)
  with pytest.raises(ImportError) as e:
    jt.flax_params(torch.nn.Linear(2, 2), object())
  assert install_hint("hf-flax") in str(e.value)


def test_import_transformers_flax_without_transformers(monkeypatch):
  monkeypatch.setitem(sys.modules, "transformers", None)
  with pytest.raises(ImportError) as e:
    torch_ref.import_transformers_flax("twin models need", "FlaxBertModel")
  assert str(e.value).startswith(
      f"twin models need transformers' Flax models: {install_hint('hf-flax')}")


@pytest.mark.skipif(HF_FLAX, reason="runs where transformers has no Flax "
                    "models (CI's torch-stack stage: transformers 5)")
def test_real_transformers_without_flax_models_gives_the_hint():
  import transformers  # noqa: PLC0415
  with pytest.raises(ImportError) as e:
    jt.twin("hf-bert")
  assert install_hint("hf-flax") in str(e.value)
  assert f"transformers {transformers.__version__}" in str(e.value)


# ---------------------------------------------------------------------------
# capture(modules=) + check_module: jaxprec's Llama port against the original.


def test_llama_port_against_pytorch_through_capture_and_check_module():
  """capture's names never lined up with check_module's ('output.*', tuple
  outputs of attention), and check_module wanted every submodule: "first
  mismatch at 'embed_tokens'"."""
  transformers = pytest.importorskip("transformers")
  import jaxprec.models  # noqa: PLC0415
  config = transformers.LlamaConfig(
      vocab_size=128, hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      initializer_range=0.2)
  torch.manual_seed(0)
  pt = transformers.LlamaModel(config).eval()
  model = jaxprec.models.LlamaModel.from_pytorch(pt)
  ids = np.arange(16, dtype=np.int32)[None] % 128
  ref = jt.capture(pt, ids.astype(np.int64),
                   modules=r"embed_tokens|norm|layers\.\d+(\.(self_attn|mlp))?")
  # LlamaAttention returns (attn_output, None): named by its path alone.
  assert list(ref) == [
      "output.last_hidden_state", "embed_tokens", "layers.0.self_attn",
      "layers.0.mlp", "layers.0", "layers.1.self_attn", "layers.1.mlp",
      "layers.1", "norm"]
  r = jaxprec.check_module(model, ids, reference=ref,
                           precisions=["float32", "bfloat16"])
  assert [l.name for l in r.layers] == [
      "embed_tokens", "layers/0/self_attn", "layers/0/mlp", "layers/0",
      "layers/1/self_attn", "layers/1/mlp", "layers/1", "norm",
      "output.last_hidden_state"]
  assert "layers/0/self_attn/q_proj" in r.unchecked
  assert "output.hidden_states[1]" in r.unchecked and len(r.unchecked) == 21
  for l in r.layers:  # the framework floor: the port computes the original
    assert l.metrics["float32"].rel_rms < 1e-5, (l.name, l.metrics["float32"])
  for l in r.layers[1:]:  # a TPU's default: one bfloat16 pass
    assert 1e-3 < l.metrics["bfloat16"].rel_rms < 5e-2, l.name
  # Every submodule PyTorch has and the port has too, through one pattern.
  everything = jt.capture(pt, ids.astype(np.int64), modules=r".+",
                          names=lambda n: None if n.startswith(
                              ("rotary_emb", "layers.0.mlp.act_fn",
                               "layers.1.mlp.act_fn")) else n)
  r = jaxprec.check_module(model, ids, reference=everything,
                           precisions=["float32"])
  assert len(r.layers) == 27 and "layers/1/mlp/up_proj" in {
      l.name for l in r.layers}
  assert all(l.metrics["float32"].rel_rms < 1e-5 for l in r.layers)
  # A layer PyTorch has and the port does not: named, with the valid names.
  with pytest.raises(ValueError, match=r"Unknown reference layer "
                     r"'rotary_emb\[0\]'; valid choices: 'embed_tokens'"):
    jaxprec.check_module(model, ids, reference=jt.capture(
        pt, ids.astype(np.int64), modules="rotary_emb"))
