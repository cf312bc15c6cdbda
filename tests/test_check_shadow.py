"""check_module(..., shadow=True): each layer's local error within JAX.

Every layer runs alone, at each precision, on the input it received in a
float32 run; its error is its own. Checked against NumPy (one bfloat16 pass
of a Dense layer in float64) and against the propagated report.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxprec

D, F = 16, 32


class Block(nnx.Module):
  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(D, rngs=rngs)
    self.fc1 = nnx.Linear(D, F, rngs=rngs)
    self.fc2 = nnx.Linear(F, D, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln(x))))


class Net(nnx.Module):
  def __init__(self):
    rngs = nnx.Rngs(0)
    self.blocks = nnx.List([Block(rngs) for _ in range(3)])
    self.norm = nnx.LayerNorm(D, rngs=rngs)

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return self.norm(x)


X = np.random.default_rng(0).normal(size=(2, 8, D)).astype(np.float32)


@pytest.fixture(scope="module")
def reports():
  model = Net()
  shadow = jaxprec.check_module(model, X, precisions=("bfloat16",),
                                shadow=True)
  propagated = jaxprec.check_module(model, X, precisions=("bfloat16",))
  return model, shadow, propagated


def _bf16(a):
  return a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_shadow_gives_each_dense_layer_its_own_bfloat16_pass(reports):
  model, shadow, _ = reports
  # fc1 of block 1 on its float32 input: one bfloat16 pass against float32.
  h = model.blocks[0](jnp.asarray(X))
  x = np.asarray(model.blocks[1].ln(h), np.float64)
  w = np.asarray(model.blocks[1].fc1.kernel[...], np.float64)
  b = np.asarray(model.blocks[1].fc1.bias[...], np.float64)
  exact, one = x @ w + b, _bf16(x) @ _bf16(w) + b
  want = np.sqrt(np.sum((one - exact) ** 2) / np.sum(exact ** 2))
  got = shadow.layer("blocks/1/fc1").metrics["bfloat16"].rel_rms
  assert got == pytest.approx(want, rel=2e-2)


def test_shadow_errors_are_local_and_propagated_ones_are_not(reports):
  _, shadow, propagated = reports
  assert [l.name for l in shadow.layers] == [l.name for l in propagated.layers]
  # A LayerNorm has no matmul: alone, at bfloat16, it is exact; in the full
  # run it carries every earlier layer's error.
  for name in ("blocks/1/ln", "blocks/2/ln", "norm"):
    assert shadow.layer(name).metrics["bfloat16"].max_abs == 0
    assert propagated.layer(name).metrics["bfloat16"].rel_rms > 1e-4
  assert shadow.layer("blocks/2/fc2").metrics["bfloat16"].rel_rms > 1e-4
  assert any("shadow" in n for n in shadow.notes)


class LBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(D, name="fc")(nn.LayerNorm(name="ln")(x))


def test_shadow_of_a_linen_module_with_its_variables():
  m = LBlock()
  variables = m.init(jax.random.key(0), X)
  r = jaxprec.check_module(m, variables, X, precisions=("bfloat16",),
                           shadow=True)
  assert [l.name for l in r.layers] == ["ln", "fc", "output"]
  assert r.layer("ln").metrics["bfloat16"].max_abs == 0
  assert r.layer("fc").metrics["bfloat16"].rel_rms > 1e-4


def test_shadow_refuses_what_it_cannot_do():
  with pytest.raises(ValueError, match="reference='float64' is not supported"):
    jaxprec.check_module(Net(), X, shadow=True, reference="float64")
  with pytest.raises(ValueError, match="method= and capture="):
    jaxprec.check_module(LBlock(), {"params": {}}, X, shadow=True,
                         capture=lambda m, n: True)


def test_shadow_shows_each_phase_with_progress(capsys):
  class Two(nnx.Module):
    def __init__(self):
      self.fc1 = nnx.Linear(D, F, rngs=nnx.Rngs(1))
      self.fc2 = nnx.Linear(F, D, rngs=nnx.Rngs(2))

    def __call__(self, x):
      return self.fc2(self.fc1(x))

  model = Two()
  jaxprec.check_module(model, X, precisions=("bfloat16", "float32"),
                       shadow=True)
  assert capsys.readouterr().err == ""  # without progress: nothing
  r = jaxprec.check_module(model, X, precisions=("bfloat16", "float32"),
                           shadow=True, progress=True)
  lines = capsys.readouterr().err.splitlines()  # stderr is not a terminal
  head = "jaxprec check_module(shadow): "
  assert lines[:-1] == [head + "the float32 run: each layer's input",
                        head + "3 layers alone at float32",
                        head + "3 layers alone at bfloat16 (1/2)",
                        head + "3 layers alone at float32 (2/2)"]
  assert lines[-1].startswith(head + "done in ")
  assert [l.name for l in r.layers] == ["fc1", "fc2", "output"]
