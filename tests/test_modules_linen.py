"""jaxprec.linen: drop-ins for Flax linen layers, native (zero overhead) and emulated."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxprec
import jaxprec.linen as jpl
from jaxprec._src.emulation import emulated_ops
from jaxprec._src.jaxpr import walker

import models

P = lax.Precision
# A value that is not a bfloat16 (nor a TF32) number, so one pass visibly rounds.
ODD = 1 + 2.0**-9 + 2.0**-13

# (class name, constructor args, input shape, is a convolution)
LAYERS = [
    ("Dense", (3,), (2, 4), False),
    ("DenseGeneral", ((2, 3),), (2, 4), False),
    ("Einsum", ((4, 3), "ab,bc->ac"), (2, 4), False),
    ("Conv", (3, (3,)), (2, 5, 4), True),
    ("ConvTranspose", (3, (3,)), (2, 5, 4), True),
    ("MultiHeadDotProductAttention", (2,), (2, 3, 4), False),
]
LAYER_IDS = [c for c, *_ in LAYERS]


def make_input(shape):
  x = jax.random.normal(jax.random.key(1), shape, jnp.float32)
  return x * ODD


def equivalent(precision, conv):
  """What Flax's own layer needs to compute at jaxprec's ``precision``."""
  p = jaxprec.resolve(precision)
  if p.flag is None:
    return None
  return p.level if conv else p.per_op


def lowered(module, params, x):
  return jax.jit(module.apply).lower(params, x).as_text()


@pytest.mark.parametrize("name, args, shape, conv", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("precision", [None, "bf16", "float32", "F32_F32_F32",
                                       "BF16_BF16_F32_X3"])
def test_native_lowers_to_flax_stablehlo_with_the_same_params(name, args, shape,
                                                              conv, precision):
  x = make_input(shape)
  ours = getattr(jpl, name)(*args, precision=precision)
  flax = getattr(nn, name)(*args, precision=equivalent(precision, conv))
  params = ours.init(jax.random.key(0), x)
  flax_params = flax.init(jax.random.key(0), x)
  assert jax.tree.structure(params) == jax.tree.structure(flax_params)
  jax.tree.map(np.testing.assert_array_equal, params, flax_params)
  text = lowered(ours, params, x)
  assert text == lowered(flax, params, x)
  if precision == "float32" or (conv and precision == "F32_F32_F32"):
    assert "HIGHEST" in text  # the precision really reaches the program
  if precision == "F32_F32_F32" and not conv:
    assert "algorithm" in text


def test_precision_names_are_stored_as_lax_values():
  assert jpl.Dense(2, precision="fp32").precision is P.HIGHEST
  assert jpl.Dense(2, precision="bf16_6x").precision is lax.DotAlgorithmPreset.BF16_BF16_F32_X6
  assert jpl.Dense(2, precision="backend-default").precision is None
  # Convolutions understand levels only: a preset becomes its level.
  assert jpl.Conv(2, (3,), precision="F32_F32_F32").precision is P.HIGHEST
  assert jpl.ConvTranspose(2, (3,), precision="BF16_BF16_F32").precision is P.DEFAULT
  # What Flax accepts and jaxprec cannot name passes through.
  pair = (P.DEFAULT, P.HIGHEST)
  assert jpl.Dense(2, precision=pair).precision == pair
  algo = lax.DotAlgorithm(lhs_precision_type=jnp.float32,
                          rhs_precision_type=jnp.float32,
                          accumulation_type=jnp.float32)
  assert jpl.Dense(2, precision=algo).precision is algo


def test_drop_in_models_match_flax_models():
  # Lowering needs the parameters' shapes only (each layer's values are
  # compared above): no init program is compiled.
  for kind in ("mlp", "cnn", "transformer"):
    ours = models.LINEN[kind](jpl, (("precision", "float32"),))
    x = models.inputs(kind)
    params = jax.eval_shape(ours.init, jax.random.key(0), x)
    flax = models.LINEN[kind](nn, (("precision", P.HIGHEST),))
    shapes = jax.eval_shape(flax.init, jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, shapes)
    assert lowered(ours, params, x) == lowered(flax, params, x)


# -- emulation ----------------------------------------------------------------------


@pytest.mark.parametrize("name, args, shape, conv", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("precision, target", [("bf16", "tpu"), ("tf32", "tpu"),
                                               ("float32", "gpu")])
def test_emulated_layers_equal_whole_function_emulation(name, args, shape, conv,
                                                        precision, target):
  x = make_input(shape)
  ours = getattr(jpl, name)(*args, precision=precision, emulate=True, target=target)
  flax = getattr(nn, name)(*args, precision=equivalent(precision, conv))
  params = flax.init(jax.random.key(0), x)
  got = jax.jit(ours.apply)(params, x)
  want = jax.jit(jaxprec.emulate(flax.apply, target=target))(params, x)
  np.testing.assert_array_equal(got, want)
  native = jax.jit(flax.apply)(params, x)
  if (precision, target) == ("float32", "gpu"):
    np.testing.assert_array_equal(got, native)  # GPU float32 is exact float32
  else:
    err = np.abs(np.asarray(got) - np.asarray(native)).max()
    scale = np.abs(np.asarray(native)).max()
    bits = 8 if precision == "bf16" and target == "tpu" else (
        16 if target == "tpu" else 11)
    assert 0 < err <= 64 * scale * 2.0**-bits, (err, scale)


def test_emulated_init_gives_flax_params_and_init_with_output_is_emulated():
  x = make_input((2, 4))
  for ours, flax in [(jpl.Einsum((4, 3), "ab,bc->ac", precision="bf16", emulate=True),
                      nn.Einsum((4, 3), "ab,bc->ac")),
                     (jpl.Dense(3, precision="bf16", emulate=True), nn.Dense(3))]:
    out, params = jax.jit(ours.init_with_output)(jax.random.key(0), x)
    flax_params = jax.jit(flax.init)(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, params, flax_params)
    np.testing.assert_array_equal(
        out, jax.jit(jaxprec.emulate(flax.apply, "bf16"))(flax_params, x))


def test_emulated_attention_fn_variants():
  x = make_input((2, 3, 4))
  ours = jpl.MultiHeadDotProductAttention(2, precision="bf16", emulate=True)
  assert ours.attention_fn is nn.dot_product_attention

  def my_attention(query, key, value, mask=None, precision=None, **unused):
    w = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", query, key,
                                  precision=precision))
    return jnp.einsum("...hqk,...khd->...qhd", w, value, precision=precision)

  custom = jpl.MultiHeadDotProductAttention(2, precision="bf16", emulate=True,
                                            attention_fn=my_attention)
  flax = nn.MultiHeadDotProductAttention(2, precision=P.DEFAULT,
                                         attention_fn=my_attention)
  params = jax.jit(flax.init)(jax.random.key(0), x)
  np.testing.assert_array_equal(jax.jit(custom.apply)(params, x),
                                jax.jit(jaxprec.emulate(flax.apply))(params, x))
  # The user's function, not a wrapper, in the module and its clones.
  assert custom.attention_fn is custom.clone().attention_fn is my_attention
  assert custom.clone(emulate=False).attention_fn is my_attention


def test_emulated_ops_carry_no_unset_precision_and_no_float32_dot():
  x = make_input((2, 3, 4))
  m = jpl.MultiHeadDotProductAttention(2, precision="bf16", emulate=True)
  params = m.init(jax.random.key(0), x)
  with jaxprec.use_kernel("bf16"):  # the kernel of bfloat16 dots, on any CPU
    closed = jax.make_jaxpr(m.apply)(params, x)
  closed = emulated_ops.written_out(closed)  # each emulated op as its passes
  dots = [w.eqn for w in walker.iter_eqns(closed) if w.eqn.primitive is lax.dot_general_p]
  assert len(dots) == 6  # q, k, v, scores, weighting, out: one pass each
  assert all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)


@pytest.mark.parametrize("name, args, shape, conv", LAYERS, ids=LAYER_IDS)
def test_emulated_gradients(name, args, shape, conv):
  x = make_input(shape)
  ours = getattr(jpl, name)(*args, precision="bf16", emulate=True)
  flax = getattr(nn, name)(*args, precision=equivalent("bf16", conv))
  params = flax.init(jax.random.key(0), x)
  loss = lambda apply: lambda p: jnp.sum(apply(p, x) ** 2)  # noqa: E731
  got = jax.jit(jax.grad(loss(ours.apply)))(params)
  want = jax.jit(jax.grad(loss(jaxprec.emulate(flax.apply))))(params)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_cpu_target_emulates_nothing():
  x = make_input((2, 4))
  ours = jpl.Dense(3, precision="bf16", emulate=True, target="cpu")
  params = ours.init(jax.random.key(0), x)
  assert ours.dot_general is None
  assert lowered(ours, params, x) == lowered(nn.Dense(3, precision=P.DEFAULT), params, x)


def test_clone_keeps_settings_and_switches_emulation_off():
  x = make_input((2, 4))
  m = jpl.Dense(3, precision="bf16", emulate=True, target="gpu")
  assert m.dot_general is None  # Flax's own op: the call is emulated
  c = m.clone()
  assert c.emulate and c.target == "gpu" and c.precision is P.DEFAULT
  params = m.init(jax.random.key(0), x)
  off = m.clone(emulate=False)
  np.testing.assert_array_equal(jax.jit(off.apply)(params, x),
                                jax.jit(nn.Dense(3, precision=P.DEFAULT).apply)(params, x))
  hash(m)  # fields stay hashable (nn.jit keys on them)


def test_bad_input():
  with pytest.raises(ValueError, match="Invalid precision 'bfloat61'.*Did you mean 'bfloat16'"):
    jpl.Dense(3, precision="bfloat61")
  with pytest.raises(ValueError, match="Unknown emulation target 'tpux'"):
    jpl.Conv(3, (3,), target="tpux")
  # The user's op functions are kept (and emulated with the rest).
  assert jpl.Dense(3, dot_general=lax.dot_general).dot_general is lax.dot_general


def test_user_op_functions_are_emulated_with_the_rest():
  x = make_input((2, 4))
  ours = jpl.Dense(3, precision="bf16", emulate=True, dot_general=lax.dot_general)
  flax = nn.Dense(3, precision=P.DEFAULT)
  params = flax.init(jax.random.key(0), x)
  want = jaxprec.emulate(flax.apply)(params, x)
  np.testing.assert_array_equal(jax.jit(ours.apply)(params, x), want)
  assert not np.array_equal(np.asarray(want), np.asarray(flax.apply(params, x)))
