"""Small Flax models for the module, policy and swap tests (linen and NNX).

Each linen model takes ``layers``: the namespace its layers come from
(``flax.linen`` or ``jaxprec.linen``) and ``kw``: extra layer arguments as a
tuple of pairs (module fields must be hashable), so the same model is built
from Flax's layers or jaxprec's drop-ins.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

# --------------------------------------------------------------------------- linen


class _Layers(nn.Module):
  """A model built from ``layers`` with the extra arguments ``kw``."""

  layers: Any = nn
  kw: tuple = ()


class MLP(_Layers):
  """Dense -> relu -> Dense -> DenseGeneral, auto-named (Dense_0, Dense_1, ...)."""

  @nn.compact
  def __call__(self, x):
    kw = dict(self.kw)
    x = nn.relu(self.layers.Dense(16, **kw)(x))
    x = nn.relu(self.layers.Dense(16, **kw)(x))
    return self.layers.DenseGeneral((2, 3), **kw)(x)


class CNN(_Layers):
  """Conv -> Conv (strided) -> ConvTranspose -> Einsum head, made in setup."""

  def setup(self):
    kw = dict(self.kw)
    self.features = [self.layers.Conv(4, (3, 3), name=f"conv_{i}", **kw)
                     for i in range(2)]
    self.up = self.layers.ConvTranspose(4, (3, 3), **kw)
    self.head = self.layers.Einsum((4, 5), "bhwc,cd->bhwd", **kw)

  def __call__(self, x):
    for conv in self.features:
      x = nn.relu(conv(x))
    return self.head(nn.relu(self.up(x)))


class Block(_Layers):
  """Pre-LN transformer block: Flax attention (scores via jnp.einsum) + MLP."""

  @nn.compact
  def __call__(self, x):
    kw = dict(self.kw)
    h = nn.LayerNorm()(x)
    x = x + self.layers.MultiHeadDotProductAttention(
        num_heads=2, name="attention", **kw)(h, h)
    h = nn.LayerNorm()(x)
    h = nn.gelu(self.layers.Dense(32, name="up", **kw)(h))
    return x + self.layers.Dense(x.shape[-1], name="down", **kw)(h)


class Transformer(_Layers):
  """Dense embedding, two blocks (layers/0, layers/1), Dense readout."""

  def setup(self):
    kw = dict(self.kw)
    self.embed = self.layers.Dense(16, **kw)
    self.blocks = [Block(self.layers, self.kw, name=f"layers_{i}")
                   for i in range(2)]
    self.readout = self.layers.Dense(3, **kw)

  def __call__(self, x):
    x = self.embed(x)
    for block in self.blocks:
      x = block(x)
    return self.readout(x)


class Cell(nn.Module):
  """A scan cell: ``(c, x) -> (Dense(c) + x, None)``, its Dense named ``inner``."""

  @nn.compact
  def __call__(self, c, x):
    return nn.Dense(4, name="inner")(c) + x, None


def inputs(kind: str, batch: int = 2):
  """Deterministic inputs for 'mlp', 'cnn' or 'transformer'."""
  key = jax.random.key({"mlp": 1, "cnn": 2, "transformer": 3}[kind])
  shape = {"mlp": (batch, 8), "cnn": (batch, 8, 8, 3),
           "transformer": (batch, 6, 8)}[kind]
  return jax.random.normal(key, shape, jnp.float32)


LINEN = {"mlp": MLP, "cnn": CNN, "transformer": Transformer}


def linen_model(kind: str, layers=nn, kw: dict | None = None):
  """(model, params, x) for one of the linen models."""
  model = LINEN[kind](layers, tuple(sorted((kw or {}).items())))
  x = inputs(kind)
  params = jax.jit(model.init)(jax.random.key(0), x)
  return model, params, x


# --------------------------------------------------------------------------- NNX


class NnxMLP(nnx.Module):
  def __init__(self, layers=nnx, *, rngs: nnx.Rngs, **kw):
    self.l1 = layers.Linear(8, 16, rngs=rngs, **kw)
    self.l2 = layers.Linear(16, 16, rngs=rngs, **kw)
    self.out = layers.LinearGeneral(16, (2, 3), rngs=rngs, **kw)

  def __call__(self, x):
    return self.out(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


class NnxCNN(nnx.Module):
  def __init__(self, layers=nnx, *, rngs: nnx.Rngs, **kw):
    self.convs = nnx.List([layers.Conv(3, 4, (3, 3), rngs=rngs, **kw),
                           layers.Conv(4, 4, (3, 3), rngs=rngs, **kw)])
    self.up = layers.ConvTranspose(4, 4, (3, 3), rngs=rngs, **kw)
    self.head = layers.Einsum("bhwc,cd->bhwd", (4, 5), (5,), rngs=rngs, **kw)

  def __call__(self, x):
    for conv in self.convs:
      x = nnx.relu(conv(x))
    return self.head(nnx.relu(self.up(x)))


class NnxTransformer(nnx.Module):
  def __init__(self, layers=nnx, *, rngs: nnx.Rngs, **kw):
    self.embed = layers.Linear(8, 16, rngs=rngs, **kw)
    self.attention = layers.MultiHeadAttention(2, 16, decode=False, rngs=rngs,
                                               **kw)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.readout = layers.Linear(16, 3, rngs=rngs, **kw)

  def __call__(self, x):
    x = self.embed(x)
    x = x + self.attention(self.norm(x))
    return self.readout(x)


NNX = {"mlp": NnxMLP, "cnn": NnxCNN, "transformer": NnxTransformer}


def nnx_model(kind: str, layers=nnx, **kw):
  """(model, x) for one of the NNX models (same seed: same state)."""
  return NNX[kind](layers, rngs=nnx.Rngs(0), **kw), inputs(kind)


def nnx_apply(model):
  """A pure function (state, x) -> y of an NNX model, for jit and lowering."""
  graphdef, state = nnx.split(model)

  def apply(state, x):
    return nnx.merge(graphdef, state)(x)
  return apply, state


# --------------------------------------------------------------------------- Hugging Face


def tiny_bert(dtype=jnp.float32, seed: int = 0):
  """(model, params, ids): a tiny transformers ``FlaxBertModel`` computing in ``dtype``.

  hidden 32, 2 layers, 2 heads, intermediate 37, vocabulary 99; random weights
  (float32, the same for every ``dtype`` and ``seed``-determined), nothing
  downloaded. Skips the test when transformers is not installed.
  """
  import numpy as np  # noqa: PLC0415
  import pytest  # noqa: PLC0415
  transformers = pytest.importorskip("transformers")
  config = transformers.BertConfig(
      vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
      intermediate_size=37)
  model = transformers.FlaxBertModel(config, dtype=dtype, _do_init=False)
  params = jax.jit(model.init_weights, static_argnums=1)(jax.random.key(seed), (1, 7))
  ids = jnp.asarray(np.random.default_rng(seed).integers(3, 99, (2, 7)), jnp.int32)
  return model, params, ids
