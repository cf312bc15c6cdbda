"""jaxprec.swap: policies on existing linen, Hugging Face and NNX models."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxprec
from jaxprec._src.core.version import install_hint
from jaxprec._src.emulation.emulated_ops import is_emulated_call

import models

P = lax.Precision


def rows(fn, *args):
  """(module path, precision) of every matmul and conv, via jaxprec.audit."""
  return [(r.module_path, r.precision_name) for r in jaxprec.audit(fn, *args)]


def quiet(fn, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxprec.UnusedRuleWarning)
    return fn(*args, **kwargs)


# -- linen: the policy reaches every op ---------------------------------------------

EXPECTED = {
    "mlp": ("default=bf16,Dense_1=float32,DenseGeneral=tf32", [
        ("Dense_0", "DEFAULT"), ("Dense_1", "HIGHEST"), ("DenseGeneral_0", "HIGH")]),
    "cnn": ("ConvTranspose=F32_F32_F32,conv=bf16,default=float32", [
        ("conv_0", "DEFAULT"), ("conv_1", "DEFAULT"),
        ("up", "HIGHEST"),  # a convolution gets a preset's level
        ("head", "HIGHEST")]),
    "transformer": ("default=bf16,attention=float32,layers_1/.*=tf32", [
        ("embed", "DEFAULT"),
        ("layers_0/attention/query", "DEFAULT"), ("layers_0/attention/key", "DEFAULT"),
        ("layers_0/attention/value", "DEFAULT"),
        ("layers_0/attention", "HIGHEST"), ("layers_0/attention", "HIGHEST"),
        ("layers_0/attention/out", "DEFAULT"),
        ("layers_0/up", "DEFAULT"), ("layers_0/down", "DEFAULT"),
        ("layers_1/attention/query", "HIGH"), ("layers_1/attention/key", "HIGH"),
        ("layers_1/attention/value", "HIGH"),
        ("layers_1/attention", "HIGHEST"), ("layers_1/attention", "HIGHEST"),
        ("layers_1/attention/out", "HIGH"),
        ("layers_1/up", "HIGH"), ("layers_1/down", "HIGH"),
        ("readout", "DEFAULT")]),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def linen(request):
  return (request.param, *models.linen_model(request.param))


def test_policy_reaches_every_op_in_the_audit(linen):
  kind, model, params, x = linen
  text, expected = EXPECTED[kind]
  swapped = jaxprec.swap(model, text)
  assert rows(swapped.apply, params, x) == expected
  assert rows(jax.jit(swapped.apply), params, x) == expected
  # The user's model is untouched: same class, no precision recorded.
  assert type(model) is models.LINEN[kind]
  assert rows(model.apply, params, x) == [(p, "None") for p, _ in expected]


def test_float32_everywhere_equals_the_model_bit_for_bit(linen):
  kind, model, params, x = linen
  want = jax.jit(model.apply)(params, x)
  # F32_F32_F32 runs on a GPU only (a TPU refuses it); a convolution under
  # it runs at its level, HIGHEST: exact float32 there too.
  for text, emulate, target in [("float32", False, "tpu"), ("float32", True, "gpu"),
                                ("F32_F32_F32", True, "gpu")]:
    swapped = jaxprec.swap(model, text, emulate=emulate, target=target)
    got = jax.jit(swapped.apply)(params, x)
    np.testing.assert_array_equal(got, want)
  with pytest.raises(jaxprec.UnsupportedAlgorithmError, match="does not run on a TPU"):
    jax.jit(jaxprec.swap(model, "F32_F32_F32", emulate=True, target="tpu").apply)(
        params, x)


def test_init_gives_the_same_variables(linen):
  kind, model, params, x = linen
  for emulate in (False, True):
    swapped = jaxprec.swap(model, "bf16", emulate=emulate)
    got = jax.jit(swapped.init)(jax.random.key(0), x)
    assert jax.tree.structure(got) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, got, params)


def test_emulated_outputs_differ_exactly_where_the_policy_lowers_precision():
  model, params, x = models.linen_model("mlp")
  swapped = jaxprec.swap(model, "default=F32_F32_F32,Dense_1=BF16_BF16_F32",
                         emulate=True, target="gpu")

  def intermediates(apply):
    _, state = jax.jit(apply, static_argnames=("capture_intermediates", "mutable"))(
        params, x, capture_intermediates=True, mutable=("intermediates",))
    return state["intermediates"]

  got, want = intermediates(swapped.apply), intermediates(model.apply)
  # Dense_0 at F32_F32_F32: exact float32, as natively.
  np.testing.assert_array_equal(got["Dense_0"]["__call__"][0],
                                want["Dense_0"]["__call__"][0])
  # Dense_1 at one bfloat16 pass: a bfloat16-sized difference.
  a, b = (np.asarray(d["Dense_1"]["__call__"][0]) for d in (got, want))
  rel = np.abs(a - b).max() / np.abs(b).max()
  assert 2.0**-14 < rel < 2.0**-5, rel


def test_emulated_attention_only_at_bfloat16():
  model, params, x = models.linen_model("transformer")
  want = jax.jit(model.apply)(params, x)
  swapped = jaxprec.swap(model, "default=F32_F32_F32,attention=BF16_BF16_F32",
                         emulate=True, target="gpu")
  got = jax.jit(swapped.apply)(params, x)
  rel = np.abs(np.asarray(got - want)).max() / np.abs(np.asarray(want)).max()
  assert 2.0**-16 < rel < 2.0**-5, rel
  # Only the 4 attention einsums (2 per layer) are emulated passes; the 14
  # other matmuls run as exact float32 dots.
  closed = jax.make_jaxpr(swapped.apply)(params, x)
  emulated = [e for e in closed.jaxpr.eqns if is_emulated_call(e)]
  names = [e.primitive.name for e in closed.jaxpr.eqns]
  assert len(emulated) == 4 and names.count("dot_general") == 14


def test_gradients_through_a_swapped_model():
  model, params, x = models.linen_model("mlp")
  swapped = jaxprec.swap(model, "default=bf16,Dense_1=float32")
  loss = lambda apply: lambda p: jnp.sum(apply(p, x) ** 2)  # noqa: E731
  closed = jax.make_jaxpr(jax.grad(loss(swapped.apply)))(params)
  precisions = {e.params["precision"] for e in closed.jaxpr.eqns
                if e.primitive is lax.dot_general_p}
  assert precisions == {(P.DEFAULT, P.DEFAULT), (P.HIGHEST, P.HIGHEST)}
  g_native = jax.jit(jax.grad(loss(model.apply)))(params)
  g = jax.jit(jax.grad(loss(swapped.apply)))(params)  # exact on CPU
  jax.tree.map(np.testing.assert_array_equal, g, g_native)
  g_emulated = jax.jit(jax.grad(loss(jaxprec.swap(model, "bf16", emulate=True).apply)))(params)
  assert not np.array_equal(g_emulated["params"]["Dense_0"]["kernel"],
                            g_native["params"]["Dense_0"]["kernel"])


def test_swapped_class_and_reswapping():
  model = models.MLP()
  a = jaxprec.swap(model, "bf16")
  b = jaxprec.swap(a, "float32")
  assert isinstance(a, models.MLP) and type(a).__name__ == "MLP"
  assert type(b).__mro__[1] is models.MLP  # re-swapping replaces the policy
  x = models.inputs("mlp")
  params = jax.jit(model.init)(jax.random.key(0), x)
  assert {p for _, p in rows(b.apply, params, x)} == {"HIGHEST"}
  assert {p for _, p in rows(a.apply, params, x)} == {"DEFAULT"}


class Parent(nn.Module):
  body: nn.Module

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="head")(self.body(x).reshape(x.shape[0], -1))


def test_a_swapped_submodule_and_bind():
  model = models.MLP()
  x = models.inputs("mlp")
  # Policy paths are relative to the module that is swapped.
  parent = Parent(jaxprec.swap(model, "default=bf16,Dense_1=float32"))
  variables = jax.jit(parent.init)(jax.random.key(0), x)
  assert rows(parent.apply, variables, x) == [
      ("body/Dense_0", "DEFAULT"), ("body/Dense_1", "HIGHEST"),
      ("body/DenseGeneral_0", "DEFAULT"), ("head", "None")]
  params = jax.jit(model.init)(jax.random.key(0), x)
  bound = jaxprec.swap(model, "float32").bind(params)
  assert {p for _, p in rows(lambda x: bound(x), x)} == {"HIGHEST"}


class Lifted(nn.Module):
  """Layers under Flax's lifted transforms, which make new root scopes."""

  @nn.compact
  def __call__(self, x):
    x = nn.remat(nn.Dense)(4, name="rem")(x)
    x = nn.jit(nn.Dense)(4, name="jitted")(x)
    x, _ = nn.scan(models.Cell, variable_broadcast="params", split_rngs={"params": False},
                   length=3)(name="scan")(x, jnp.ones((3, *x.shape)))
    return nn.vmap(nn.Dense, variable_axes={"params": None},
                   split_rngs={"params": False})(4, name="vm")(x[None])[0]


def test_lifted_transforms_keep_module_paths():
  model, x = Lifted(), jnp.ones((2, 4))
  params = jax.jit(model.init)(jax.random.key(0), x)
  swapped = jaxprec.swap(model, "default=bf16,rem=float32,jitted=tf32,"
                                "scan/inner=F32_F32_F32,vm=BF16_BF16_F32_X3")
  assert rows(swapped.apply, params, x) == [
      ("rem", "HIGHEST"), ("jitted", "HIGH"), ("scan/inner", "F32_F32_F32"),
      ("vm", "BF16_BF16_F32_X3")]
  assert not jaxprec.policy_report(swapped).unused_rules


def test_explicit_precisions_are_kept():
  model, params, x = models.linen_model("mlp", nn, {"precision": P.HIGH})
  assert {p for _, p in rows(jaxprec.swap(model, "bf16").apply, params, x)} == {"HIGH"}


def test_unused_rules_warn_once_and_are_reported():
  model, params, x = models.linen_model("mlp")
  swapped = jaxprec.swap(model, "default=bf16,conv=tf32,Dense_9=float32,Dense=f32,Dense_0=bf16")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    swapped.apply(params, x)
    swapped.apply(params, x)
  unused = [str(w.message) for w in caught
            if issubclass(w.category, jaxprec.UnusedRuleWarning)]
  assert len(unused) == 1
  # 'Dense_0=bf16' is shadowed by 'Dense=f32': it decides nothing either.
  for rule in ("'conv=tensorfloat32'", "'Dense_9=float32'", "'Dense_0=bfloat16'"):
    assert rule in unused[0]
  report = jaxprec.policy_report(swapped)
  assert [str(r) for r in report.unused_rules] == [
      "conv=tensorfloat32", "Dense_9=float32", "Dense_0=bfloat16"]
  dense = {(m.path, m.module_type, m.precision.name, str(m.rule))
           for m in report.matches if m.module_type}
  assert dense == {("Dense_0", "Dense", "float32", "Dense=float32"),
                   ("Dense_1", "Dense", "float32", "Dense=float32"),
                   ("DenseGeneral_0", "DenseGeneral", "bfloat16", "None")}


def test_bad_input():
  with pytest.raises(TypeError, match=r"jaxprec.swap accepts a flax.linen.Module "
                                      r"instance, a flax.nnx.Module, or a Hugging Face"):
    jaxprec.swap(lambda x: x, "bf16")
  with pytest.raises(TypeError, match="got a class"):
    jaxprec.swap(nn.Dense, "bf16")
  with pytest.raises(ValueError, match="Invalid policy entry 'conv'"):
    jaxprec.swap(nn.Dense(2), "default=bf16,conv")
  with pytest.raises(ValueError, match="Unknown emulation target 'tpu3'"):
    jaxprec.swap(nn.Dense(2), "bf16", emulate=True, target="tpu3")
  with pytest.raises(TypeError, match="expects a model returned by jaxprec.swap"):
    jaxprec.policy_report(nn.Dense(2))


# -- Hugging Face Flax models ------------------------------------------------------------


def _hf(name):
  transformers = pytest.importorskip("transformers")
  if name == "bert":
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16)
    model = transformers.FlaxBertModel(config, input_shape=(1, 8), _do_init=False)
    x = (jnp.arange(16).reshape(2, 8) * 7) % 64
  else:
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(2, 2),
        conv_kernel=(3, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, do_stable_layer_norm=True,
        feat_extract_norm="layer", vocab_size=8)
    model = transformers.FlaxWav2Vec2Model(config, input_shape=(1, 64), _do_init=False)
    x = jax.random.normal(jax.random.key(0), (2, 64))
  params = jax.jit(model.init_weights, static_argnums=1)(jax.random.key(0), x.shape)
  return model, params, x


@pytest.fixture(scope="module")
def bert():
  return _hf("bert")


@pytest.fixture(scope="module")
def wav2vec2():
  return _hf("wav2vec2")


def bert_apply(model):
  """The inner module's apply, as a user who holds ``model.module`` calls it."""
  def apply(params, ids):
    ones = jnp.ones_like(ids)
    return model.module.apply({"params": params}, ids, ones, jnp.zeros_like(ids),
                              jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape),
                              None).last_hidden_state
  return apply


def wrapper_call(model):
  return lambda params, x: model(x, params=params).last_hidden_state


def test_bert_policy_reaches_every_op_both_call_styles(bert):
  model, params, ids = bert
  swapped = jaxprec.swap(model, "default=bf16,attention=float32,pooler/dense=tf32")
  assert type(swapped) is type(model) and swapped.config is model.config
  for fn in (bert_apply(swapped), wrapper_call(swapped)):
    got = quiet(rows, fn, params, ids)
    assert len(got) >= 17
    for path, precision in got:
      if path.endswith("attention/self"):  # the score and weighting einsums
        assert precision == "HIGHEST", path
      elif path == "pooler/dense":
        assert precision == "HIGH"
      else:
        assert precision == "DEFAULT", path
    assert sum(p.endswith("attention/self") for p, _ in got) >= 4
  # The original is untouched.
  assert model.module is not swapped.module and type(model.module).__mro__[0] is not type(
      swapped.module)
  assert {p for _, p in rows(wrapper_call(model), params, ids)} == {"None"}


def test_bert_float32_is_bitwise_and_bfloat16_attention_is_emulated(bert):
  model, params, ids = bert
  want = jax.jit(wrapper_call(model))(params, ids)
  same = jaxprec.swap(model, "F32_F32_F32", emulate=True, target="gpu")
  np.testing.assert_array_equal(jax.jit(wrapper_call(same))(params, ids), want)
  np.testing.assert_array_equal(
      jax.jit(bert_apply(jaxprec.swap(model, "float32")))(params, ids),
      jax.jit(bert_apply(model))(params, ids))
  low = jaxprec.swap(model, "default=F32_F32_F32,attention=BF16_BF16_F32", emulate=True,
                     target="gpu")
  got = jax.jit(wrapper_call(low))(params, ids)
  assert 0 < np.abs(np.asarray(got - want)).max() < 0.05
  module_style = jax.jit(bert_apply(low))(params, ids)
  assert 0 < np.abs(np.asarray(module_style - want)).max() < 0.05


def test_wav2vec2_convs_including_the_nested_apply_get_the_conv_rule(wav2vec2):
  model, params, x = wav2vec2
  swapped = jaxprec.swap(model, "default=bf16,conv=float32,attention=tf32")

  def module_apply(params, x):
    return swapped.module.apply({"params": params}, x, jnp.ones(x.shape, "i4"))[0]

  for fn in (module_apply, wrapper_call(swapped)):
    got = quiet(rows, fn, params, x)
    convs = [(p, q) for p, q in got if "conv" in p]
    assert ("encoder/pos_conv_embed/conv/conv", "HIGHEST") in convs
    assert ("feature_extractor/conv_layers/0/conv", "HIGHEST") in convs
    assert all(q == "HIGHEST" for _, q in convs) and len(convs) == 3
    attention = [q for p, q in got if p.endswith("/attention")]
    assert attention == ["HIGH", "HIGH"]
    rest = [q for p, q in got if "conv" not in p and not p.endswith("/attention")]
    assert rest and set(rest) == {"DEFAULT"}
  want = jax.jit(wrapper_call(model))(params, x)
  low = jaxprec.swap(model, "default=F32_F32_F32,conv=BF16_BF16_F32", emulate=True,
                     target="gpu")
  got = quiet(jax.jit(wrapper_call(low)), params, x)
  assert 0 < np.abs(np.asarray(got - want)).max() < 0.1


# -- NNX -----------------------------------------------------------------------------------


def test_nnx_swap_runs_each_module_at_its_precision_on_a_clone():
  model, x = models.nnx_model("transformer")
  before = nnx.graphdef(model)
  swapped = jaxprec.swap(model, "default=bf16,attention=float32,readout=tf32")
  assert nnx.graphdef(model) == before and model.embed.precision is None
  assert swapped is not model and swapped.embed.kernel is not model.embed.kernel
  assert swapped.embed.precision is None  # the hook decides, not an attribute
  jax.tree.map(np.testing.assert_array_equal, nnx.state(swapped), nnx.state(model))
  apply, state = models.nnx_apply(swapped)
  closed = jax.make_jaxpr(apply)(state, x)
  precisions = [e.params["precision"] for e in closed.jaxpr.eqns
                if e.primitive is lax.dot_general_p]
  # embed, query, key, value (dots), the two score matmuls (attention), the
  # attention output projection (a dot), readout.
  d, hi = (P.DEFAULT, P.DEFAULT), (P.HIGHEST, P.HIGHEST)
  assert precisions == [d, d, d, d, hi, hi, d, (P.HIGH, P.HIGH)]
  report = jaxprec.policy_report(swapped)
  assert not report.unused_rules
  assert {m.path for m in report.matches} >= {"embed", "attention", "attention/query",
                                              "readout"}


def test_nnx_float32_is_bitwise_and_emulation_differs():
  model, x = models.nnx_model("cnn")
  apply, state = models.nnx_apply(model)
  want = jax.jit(apply)(state, x)
  for swapped in (jaxprec.swap(model, "float32"),
                  jaxprec.swap(model, "float32", emulate=True, target="gpu")):
    a, s = models.nnx_apply(swapped)
    np.testing.assert_array_equal(jax.jit(a)(s, x), want)
  low = jaxprec.swap(model, "default=F32_F32_F32,conv=BF16_BF16_F32", emulate=True,
                     target="gpu")
  a, s = models.nnx_apply(low)
  got = jax.jit(a)(s, x)
  rel = np.abs(np.asarray(got - want)).max() / np.abs(np.asarray(want)).max()
  assert 2.0**-16 < rel < 2.0**-4, rel
  assert isinstance(low.up, nnx.ConvTranspose)
  assert type(low.up).__name__ == "ConvTranspose"
  assert type(model.up) is nnx.ConvTranspose  # the original keeps its class


def test_nnx_unused_rules_warn_at_swap_time():
  model, x = models.nnx_model("mlp")
  with pytest.warns(jaxprec.UnusedRuleWarning, match="'conv=bfloat16'"):
    swapped = jaxprec.swap(model, "conv=bf16,l1=float32")
  apply, state = models.nnx_apply(swapped)
  closed = jax.make_jaxpr(apply)(state, x)
  precisions = [e.params["precision"] for e in closed.jaxpr.eqns
                if e.primitive is lax.dot_general_p]
  assert precisions == [(P.HIGHEST, P.HIGHEST), None, None]


def test_a_jitted_function_is_retraced_under_each_policy():
  # jax.jit caches a trace per input signature and precision flag; the policy
  # is part of its key too, so a second policy never reuses the first's trace.
  module, variables, x = models.linen_model("mlp")
  f = jax.jit(module.apply)
  lo = quiet(jaxprec.emulate(f, "default=float32,Dense=bfloat16"), variables, x)
  hi = quiet(jaxprec.emulate(f, "default=float32,Dense=float32"), variables, x)
  # float32 on a TPU is six bfloat16 passes: float32-level agreement.
  np.testing.assert_allclose(hi, module.apply(variables, x), rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(lo) - np.asarray(hi)).max() > 1e-4


def test_a_pytorch_model_is_refused_saying_what_transformers_5_has():
  """transformers 5 has no Flax models: a newcomer passes its PyTorch one."""
  BertModel = type("BertModel", (), {"__module__":
                                     "transformers.models.bert.modeling_bert"})
  with pytest.raises(TypeError) as e:
    jaxprec.swap(BertModel(), "default=bf16")
  message = str(e.value)
  assert "got transformers.models.bert.modeling_bert.BertModel." in message
  assert "It is a PyTorch model" in message
  assert "transformers 4.x only" in message and "transformers 5 removed" in message
  assert install_hint("hf-flax") in message
  assert "jaxprec.models.BertModel.from_pytorch(model)" in message
  with pytest.raises(TypeError) as e:  # anything else: no such sentence
    jaxprec.swap(object(), "default=bf16")
  assert "PyTorch" not in str(e.value)
