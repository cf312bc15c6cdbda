"""jaxprec.nnx: drop-ins for Flax NNX layers, native (zero overhead) and emulated."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxprec
import jaxprec.nnx as jpn
from jaxprec._src.modules.nnx import PrecisionScoped
from jaxprec._src.jaxpr import walker

import models

P = lax.Precision
ODD = 1 + 2.0**-9 + 2.0**-13

# (class name, constructor args, extra kwargs, input shape, is a convolution)
LAYERS = [
    ("Linear", (4, 3), {}, (2, 4), False),
    ("LinearGeneral", (4, (2, 3)), {}, (2, 4), False),
    ("Einsum", ("ab,bc->ac", (4, 3), (3,)), {}, (2, 4), False),
    ("Conv", (4, 3, (3,)), {}, (2, 5, 4), True),
    ("ConvTranspose", (4, 3, (3,)), {}, (2, 5, 4), True),
    ("MultiHeadAttention", (2, 4), {"decode": False}, (2, 3, 4), False),
]
LAYER_IDS = [c for c, *_ in LAYERS]


def make(namespace, name, args, kw, **extra):
  return getattr(namespace, name)(*args, **kw, **extra, rngs=nnx.Rngs(0))


def make_input(shape):
  return jax.random.normal(jax.random.key(1), shape, jnp.float32) * ODD


def equivalent(precision, conv):
  p = jaxprec.resolve(precision)
  if p.flag is None:
    return None
  return p.level if conv else p.per_op


def lowered(module, x, flag=None):
  apply, state = models.nnx_apply(module)
  with jax.default_matmul_precision(flag):
    return jax.jit(apply).lower(state, x).as_text()


def flag(name, precision):
  # NNX's attention ignores precision= for its scores (it calls
  # jax.nn.dot_product_attention); jaxprec's scopes the flag: compare with NNX
  # under that flag.
  return jaxprec.resolve(precision).flag if name == "MultiHeadAttention" else None


@pytest.mark.parametrize("name, args, kw, shape, conv", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("precision", [None, "bf16", "float32", "F32_F32_F32"])
def test_native_lowers_to_nnx_stablehlo_with_the_same_state(name, args, kw, shape,
                                                            conv, precision):
  x = make_input(shape)
  ours = make(jpn, name, args, kw, precision=precision)
  flax = make(nnx, name, args, kw, precision=equivalent(precision, conv))
  s1, s2 = nnx.state(ours, nnx.Param), nnx.state(flax, nnx.Param)
  assert jax.tree.structure(s1) == jax.tree.structure(s2)
  jax.tree.map(np.testing.assert_array_equal, s1, s2)
  text = lowered(ours, x)
  assert text == lowered(flax, x, flag(name, precision))
  if precision == "float32":
    assert "HIGHEST" in text


@pytest.mark.parametrize("name, args, kw, shape, conv", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("precision, target", [("bf16", "tpu"), ("float32", "gpu")])
def test_emulated_layers_equal_whole_function_emulation(name, args, kw, shape, conv,
                                                        precision, target):
  x = make_input(shape)
  ours = make(jpn, name, args, kw, precision=precision, emulate=True, target=target)
  flax = make(nnx, name, args, kw, precision=equivalent(precision, conv))
  ours_apply, state = models.nnx_apply(ours)
  flax_apply, _ = models.nnx_apply(flax)
  got = jax.jit(ours_apply)(state, x)
  np.testing.assert_array_equal(  # precision: for NNX's attention scores
      got, jax.jit(jaxprec.emulate(flax_apply, precision, target=target))(state, x))
  native = jax.jit(flax_apply)(state, x)
  if target == "gpu":
    np.testing.assert_array_equal(got, native)
  else:
    err = np.abs(np.asarray(got) - np.asarray(native)).max()
    assert 0 < err <= 64 * np.abs(np.asarray(native)).max() * 2.0**-8


def test_eager_calls_and_gradients():
  x = make_input((2, 4))
  ours = jpn.Linear(4, 3, precision="bf16", emulate=True, rngs=nnx.Rngs(0))
  flax = nnx.Linear(4, 3, precision=P.DEFAULT, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(ours(x), jaxprec.emulate(flax)(x))  # eager
  for m, shape in [(jpn.MultiHeadAttention(2, 4, precision="bf16", emulate=True,
                                           decode=False, rngs=nnx.Rngs(0)), (2, 3, 4)),
                   (jpn.ConvTranspose(4, 3, (3,), precision="bf16", emulate=True,
                                      rngs=nnx.Rngs(0)), (2, 5, 4))]:
    x = make_input(shape)
    grad = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(m)  # noqa: B023
    leaves = jax.tree.leaves(nnx.state(grad, nnx.Param))
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)


def test_attention_precision_reaches_the_scores_unlike_nnx():
  x = make_input((2, 3, 4))
  kw = dict(decode=False, rngs=nnx.Rngs(0))

  def precisions(m):
    closed = jax.make_jaxpr(models.nnx_apply(m)[0])(nnx.state(m), x)
    return [w.eqn.params["precision"] for w in walker.iter_eqns(closed)
            if w.eqn.primitive is lax.dot_general_p]

  highest = (P.HIGHEST, P.HIGHEST)
  assert precisions(jpn.MultiHeadAttention(2, 4, precision="float32", **kw)) == [highest] * 6
  # NNX's own: the score and weighting matmuls ignore precision=.
  assert precisions(nnx.MultiHeadAttention(2, 4, precision=P.HIGHEST, **kw)).count(None) == 2


def test_stored_settings_and_flax_op_functions_untouched():
  lin = jpn.Linear(2, 3, precision="bf16", emulate=True, target="gpu", rngs=nnx.Rngs(0))
  flax = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  assert lin.precision is P.DEFAULT and lin.dot_general is flax.dot_general
  assert lin.emulate and lin.target == "gpu"
  assert jpn.Conv(1, 2, (3,), precision="BF16_BF16_F32_X3", rngs=nnx.Rngs(0)).precision is P.HIGH
  ours = jpn.Einsum("ab,bc->ac", (2, 3), emulate=True, rngs=nnx.Rngs(0))
  assert ours.einsum_op is nnx.Einsum("ab,bc->ac", (2, 3), rngs=nnx.Rngs(0)).einsum_op
  mha = jpn.MultiHeadAttention(2, 4, emulate=True, decode=False, rngs=nnx.Rngs(0))
  assert isinstance(mha.attention_fn, PrecisionScoped)
  assert mha.attention_fn.fn is nnx.dot_product_attention
  # Constructors keep NNX's signature, plus emulate= and target=.
  sig = inspect.signature(jpn.Linear.__init__)
  base = inspect.signature(nnx.Linear.__init__)
  assert set(sig.parameters) == set(base.parameters) | {"emulate", "target"}


def test_bad_input():
  with pytest.raises(ValueError, match="Invalid precision 'fp31'"):
    jpn.Linear(2, 3, precision="fp31", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="Unknown emulation target 'tpu2'"):
    jpn.Conv(1, 2, (3,), target="tpu2", rngs=nnx.Rngs(0))


def test_user_op_functions_are_emulated_with_the_rest():
  # The call runs under jaxprec.emulate: a dot_general the user passes is
  # emulated too.
  x = make_input((2, 4))
  ours = jpn.Linear(4, 3, precision="bf16", emulate=True, rngs=nnx.Rngs(0),
                    dot_general=lambda *a, **k: lax.dot_general(*a, **k))
  flax = nnx.Linear(4, 3, precision=P.DEFAULT, rngs=nnx.Rngs(0))
  want = jaxprec.emulate(flax)(x)
  np.testing.assert_array_equal(ours(x), want)
  assert not np.array_equal(np.asarray(want), np.asarray(flax(x)))


def test_drop_in_models_match_nnx_models():
  for kind in ("mlp", "cnn", "transformer"):
    ours, x = models.nnx_model(kind, jpn, precision="float32")
    flax, _ = models.nnx_model(kind, nnx, precision=P.HIGHEST)
    assert lowered(ours, x) == lowered(flax, x, "float32" if kind == "transformer" else None)
