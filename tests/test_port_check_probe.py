"""jaxprec.torch.port_check on inputs a user may hand it as they come.

A small PyTorch model and its NNX port with copied weights, given inputs as
NumPy float64, PyTorch tensors and JAX arrays: each gives the report of the
same inputs as NumPy float32, and the caller's arrays are left as they were.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jaxprec.torch as jt  # noqa: E402

D_IN, D = 4, 8


class TNet(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(D_IN, D)
    self.norm = torch.nn.LayerNorm(D)

  def forward(self, x):
    return self.norm(self.fc(x))


class JNet(nnx.Module):
  def __init__(self, t):
    self.fc = nnx.Linear(D_IN, D, rngs=nnx.Rngs(0))
    self.norm = nnx.LayerNorm(D, epsilon=1e-5, use_fast_variance=False,
                              rngs=nnx.Rngs(0))
    self.fc.kernel[...] = jnp.asarray(t.fc.weight.detach().numpy().T)
    self.fc.bias[...] = jnp.asarray(t.fc.bias.detach().numpy())
    self.norm.scale[...] = jnp.asarray(t.norm.weight.detach().numpy())
    self.norm.bias[...] = jnp.asarray(t.norm.bias.detach().numpy())

  def __call__(self, x):
    return self.norm(self.fc(x))


X = np.random.default_rng(0).normal(size=(3, D_IN)).astype(np.float32)


@pytest.fixture(scope="module")
def models():
  torch.manual_seed(0)
  t = TNet().eval()
  return JNet(t), t


@pytest.fixture(scope="module")
def baseline(models):
  return jt.port_check(*models, X, precisions=("float32",))


@pytest.mark.parametrize("kind", ["float64", "torch", "torch_kwargs", "jax"])
def test_inputs_of_any_array_kind_give_the_float32_report(models, baseline,
                                                          kind):
  j, t = models
  if kind == "float64":
    x = X.astype(np.float64)
    r = jt.port_check(j, t, x, precisions=("float32",))
    assert x.dtype == np.float64
  elif kind == "torch":
    x = torch.from_numpy(X.copy())
    r = jt.port_check(j, t, x, precisions=("float32",))
    np.testing.assert_array_equal(x.numpy(), X)
  elif kind == "torch_kwargs":  # a tensor among the keyword arguments
    r = jt.port_check(j, t, precisions=("float32",),
                      kwargs={"x": torch.from_numpy(X.copy())})
  else:
    r = jt.port_check(j, t, jnp.asarray(X), precisions=("float32",))
  assert r.alignment == baseline.alignment
  assert r.suspects() == []
  for a, b in zip(r.layers, baseline.layers):
    assert a.floor == b.floor and a.local == b.local, a.name


class TDict(torch.nn.Module):
  """A model returning a dict whose keys are not in sorted order."""

  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(D_IN, D)
    self.head = torch.nn.Linear(D, D)

  def forward(self, x):
    h = self.fc(x)
    return {"out": self.head(h), "hidden": h}


class TMix(torch.nn.Module):
  def forward(self, x, y):
    return x - 2 * y


class TKw(torch.nn.Module):
  """A submodule called with keyword arguments out of sorted order."""

  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(D_IN, D)
    self.mix = TMix()

  def forward(self, x):
    h = self.fc(x)
    return self.mix(y=torch.tanh(h), x=h)


class JMix(nnx.Module):
  def __call__(self, x, y):
    return x - 2 * y


def _linear(t, bug=1.0):
  j = nnx.Linear(D_IN, D, rngs=nnx.Rngs(0))
  j.kernel[...] = jnp.asarray(t.weight.detach().numpy().T) * bug
  j.bias[...] = jnp.asarray(t.bias.detach().numpy())
  return j


class JDict(nnx.Module):
  def __init__(self, t, bug=1.0):
    self.fc = _linear(t.fc)
    self.head = nnx.Linear(D, D, rngs=nnx.Rngs(0))
    self.head.kernel[...] = jnp.asarray(t.head.weight.detach().numpy().T) * bug
    self.head.bias[...] = jnp.asarray(t.head.bias.detach().numpy())

  def __call__(self, x):
    h = self.fc(x)
    return {"out": self.head(h), "hidden": h}


class JKw(nnx.Module):
  def __init__(self, t):
    self.fc = _linear(t.fc)
    self.mix = JMix()

  def __call__(self, x):
    h = self.fc(x)
    return self.mix(y=jnp.tanh(h), x=h)


def test_a_dict_output_pairs_its_values_by_key():
  torch.manual_seed(0)
  t = TDict().eval()
  r = jt.port_check(JDict(t), t, X, precisions=("float32",))
  assert r.alignment["output"] == "output"
  assert r.suspects() == []  # was: 'output' ('out' against 'hidden')
  bad = jt.port_check(JDict(t, bug=1.01), t, X, precisions=("float32",))
  assert bad.suspects() == ["head"]


def test_keyword_inputs_pair_by_name():
  torch.manual_seed(0)
  t = TKw().eval()
  r = jt.port_check(JKw(t), t, X, precisions=("float32",))
  assert r.alignment["mix"] == "mix"
  assert r.layer("mix").floor < 1e-6  # was: 0.67 (x and y swapped)
  assert r.suspects() == []


def test_a_torch_model_as_the_jax_model_is_named(models):
  j, t = models
  with pytest.raises(TypeError, match="jax_model is a torch.nn.Module"):
    jt.port_check(t, j, X, precisions=("float32",))
  with pytest.raises(TypeError, match="jax_model is a torch.nn.Module"):
    jt.port_check(t, t, X, precisions=("float32",))


CLI_MODELS = '''
import numpy as np
import torch

torch.manual_seed(0)
PT = torch.nn.Sequential(torch.nn.Linear(4, 8)).eval()
X = np.zeros((2, 4), np.float32)


def original():
  return PT, (X,)
'''


def test_cli_a_torch_model_as_the_jax_model_or_no_reference_is_usage(
    tmp_path, monkeypatch, capsys):
  from conftest import one_line_error, run_cli  # noqa: PLC0415
  (tmp_path / "ports.py").write_text(CLI_MODELS)
  monkeypatch.chdir(tmp_path)
  rc, _, err = run_cli(capsys, "check", "ports.py:original", "--reference",
                       "pytorch:ports.py:original", "--out", "rep")
  one_line_error(rc, err, 2, "jax_model is a torch.nn.Module")
  rc, _, err = run_cli(capsys, "check", "ports.py:original", "--reference",
                       "pytorch:", "--out", "rep")
  one_line_error(rc, err, 2, "names no PyTorch model factory")


def test_an_overflow_in_float32_is_said(models):
  j, t = models
  r = jt.port_check(j, t, X * 1e30, precisions=("float32",))
  assert any("PyTorch's float32 output of norm is not finite" in n
             for n in r.notes), r.notes
  assert "not finite" in r.table(80)
  ok = jt.port_check(j, t, X * 1e-30, precisions=("float32",))
  assert not any("not finite" in n for n in ok.notes)
