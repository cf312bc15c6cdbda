"""jaxprec.check and jaxprec.check_module: layers, references, modes, errors."""

import dataclasses
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.checker import reference as reference_lib
from jaxprec._src.checker import rows

KEY = jax.random.key(0)
W = jax.random.normal(KEY, (4, 48, 48), jnp.float32) / np.sqrt(48)
X = jax.random.normal(jax.random.key(1), (8, 48), jnp.float32)
CALLS = {"mlp": 0}


def mlp(w, x):
  """Four tanh layers; a dict in depth order whose keys JAX would sort wrongly."""
  CALLS["mlp"] += 1
  out = {}
  for i in range(4):
    x = jnp.tanh(x @ w[i])
    out[f"layer_{i * 5}"] = x  # layer_0, layer_5, layer_10, layer_15
  return out


def broken(w, x):
  """Like mlp, but layer 2 runs one matmul at bfloat16 whatever the setting."""
  out = {}
  for i in range(4):
    prec = lax.Precision.DEFAULT if i == 2 else None
    x = jnp.tanh(jnp.dot(x, w[i], precision=prec))
    out[f"layer_{i}"] = x
  return out


def rounded(w, x):
  """Like mlp, but layer 1's output is rounded to bfloat16 (a cast bug)."""
  out = {}
  for i in range(4):
    x = jnp.tanh(x @ w[i])
    if i == 1:
      x = jaxprec.round_to(x, "bfloat16")
    out[f"layer_{i}"] = x
  return out


@pytest.fixture(scope="module")
def mlp_report():
  return jaxprec.check(mlp, W, X, mode="emulate")


def test_layers_are_named_by_path_in_depth_order(mlp_report):
  r = mlp_report
  assert [l.name for l in r.layers] == ["layer_0", "layer_5", "layer_10", "layer_15"]
  assert all(l.shape == (8, 48) and l.dtype == "float32" for l in r.layers)
  assert r.precisions == ("bfloat16", "bfloat16_3x", "float32")
  assert (r.reference, r.target, r.mode, r.backend) == ("float32", "tpu",
                                                        "emulate", "cpu")


def test_default_trio_is_a_tpus_three_levels_when_emulating(mlp_report):
  r = mlp_report
  assert r.numerics["bfloat16"] == "bf16x1 (tpu, emulated)"
  assert r.numerics["bfloat16_3x"] == "bf16x3 (tpu, emulated)"
  assert r.numerics["float32"] == "bf16x6 (tpu, emulated)"
  bf16, x3, x6 = (r.metric("rel_rms", p) for p in r.precisions)
  for a, b, c in zip(bf16, x3, x6):
    assert a > 50 * b  # 8 vs ~16 significant bits
    assert b > 4 * c  # ~16 vs ~24 significant bits


def test_a_gpu_check_reads_every_name_as_a_gpu_computes_it():
  r = jaxprec.check(mlp, W, X, target="gpu", mode="emulate")
  assert r.precisions == ("BF16_BF16_F32", "tensorfloat32",
                          "TF32_TF32_F32_X3")
  assert [r.numerics[p] for p in r.precisions] == [
      "bf16x1 (gpu, emulated)", "tf32 (gpu, emulated)",
      "tf32x3 (gpu, emulated)"]
  bf16, tf32, x3 = (r.metric("rel_rms", p) for p in r.precisions)
  for a, b, c in zip(bf16, tf32, x3):
    assert a > 4 * b > 16 * c  # 8, 11, ~21 significant bits
  g = jaxprec.check(mlp, W, X, precisions=["bfloat16", "bfloat16_3x"],
                    target="gpu", mode="emulate")
  # On a GPU both are DEFAULT/HIGH: TF32, the same numbers as the TF32 row.
  assert g.numerics["bfloat16"] == g.numerics["bfloat16_3x"] == (
      "tf32 (gpu, emulated)")
  assert g.metric("rel_rms", "bfloat16") == tf32


def test_second_check_reuses_compiled_programs(mlp_report):
  before = CALLS["mlp"]
  r = jaxprec.check(mlp, W, X, mode="emulate")
  assert CALLS["mlp"] == before  # nothing traced again
  assert r.metric("max_abs", "bfloat16") == mlp_report.metric("max_abs", "bfloat16")


def test_pytree_kinds_and_names():
  @dataclasses.dataclass
  class Out:
    hidden: tuple
    logits: jax.Array

  jax.tree_util.register_dataclass(Out, data_fields=["hidden", "logits"],
                                   meta_fields=[])

  def f(x):
    h = jnp.tanh(x @ W[0])
    return {"model": Out(hidden=(x, h), logits=h @ W[1]), "ids": jnp.arange(3),
            "list": [h, None]}
  names = list(jaxprec.named_layers(f(X)))
  assert names == ["model.hidden[0]", "model.hidden[1]", "model.logits", "list[0]"]
  r = jaxprec.check(f, X, precisions="bf16", mode="emulate")
  assert [l.name for l in r.layers] == names
  assert r.layer("model.hidden[0]").metrics["bf16"].max_abs == 0  # the input
  assert jaxprec.check(lambda x: x @ W[0], X, precisions=["bf16"],
                       mode="emulate").layers[0].name == "output"


def test_deliberately_broken_layer_is_found():
  # At float32 (6 bf16 passes on TPU) only the DEFAULT-precision layer drifts.
  r = jaxprec.check(broken, W, X, precisions=["float32"], mode="emulate")
  first = r.first_divergence(1e-5, 0, precision="float32")
  assert (first.layer, first.index, first.exact) == ("layer_2", 2, True)
  m = r.metric("max_abs", "float32")
  assert max(m[:2]) < 1e-6 < m[2] / 100


def test_a_cast_to_bfloat16_is_where_the_check_first_diverges():
  # Layer 1's bfloat16 rounding turns the float32 check's differences of
  # about 3e-7 into whole bfloat16 steps wherever they cross a rounding
  # midpoint, which takes many elements: 1024 rows flip 15 of them on jax
  # 0.10.2 and 5 on 0.12.1 (8 rows flipped one on 0.10.2 and none on 0.12.1).
  # NumPy's inputs: jax.random.normal's bits changed in jax 0.12.1 (XLA:CPU's
  # erf_inv did; jax.random.bits did not).
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((4, 48, 48)) / np.sqrt(48)).astype(np.float32)
  x = rng.standard_normal((1024, 48)).astype(np.float32)
  r = jaxprec.check(rounded, w, x, precisions=["float32"], mode="emulate")
  assert r.first_divergence(1e-5, 1e-5, precision="float32").layer == "layer_1"
  m = r.metric("max_abs", "float32")
  assert m[0] < 1e-6 and m[1] >= 2.0**-9  # at least half a bfloat16 step


def test_first_divergence_with_other_tolerances(mlp_report):
  r = mlp_report
  assert r.first_divergence(10.0, 0, precision="bfloat16") is None
  all_first = r.first_divergence(1e-4, 0)
  assert all_first["bfloat16"].layer == "layer_0"
  assert all_first["bfloat16_3x"] is None
  # An rtol other than 0 and the check's is decided from bounds.
  f = r.first_divergence(1e-9, 0.5, precision="bfloat16")
  assert f is not None and f.layer == "layer_0"
  assert r.passes(1.0, 0.5)


def test_float64_reference_runs_in_a_scope_that_does_not_leak():
  assert not jax.config.jax_enable_x64
  seen = {}

  def f(w, x):
    seen[x.dtype.name] = True
    return {"h": jnp.tanh(x @ w[0])}
  r = jaxprec.check(f, W, X, precisions=["float32", "bf16"],
                    reference="float64", mode="emulate")
  assert not jax.config.jax_enable_x64
  assert "float64" in seen and "float32" in seen
  m = r.layers[0].metrics
  assert 0 < m["float32"].max_abs < 1e-5 < m["bf16"].max_abs
  assert r.reference == "float64"
  assert jnp.ones(1).dtype == jnp.float32

  def fails(w, x):
    if x.dtype == jnp.float64:
      assert jax.config.jax_enable_x64
      raise RuntimeError("boom in the float64 run")
    return {"h": x @ w[0]}
  with pytest.raises(RuntimeError, match="boom"):
    jaxprec.check(fails, W, X, reference="float64", mode="emulate")
  assert not jax.config.jax_enable_x64


@pytest.mark.parametrize("ext", ["npz", "safetensors"])
def test_external_reference_round_trips_through_files(tmp_path, mlp_report, ext):
  outs = jax.jit(mlp)(W, X)
  path = tmp_path / f"ref.{ext}"
  jaxprec.save_layers(path, outs)
  r = jaxprec.check(mlp, W, X, reference=path, mode="emulate")
  assert r.reference == f"file:{path}"
  # An external reference puts the framework floor first: JAX's own float32,
  # here the very program that wrote the file (a default row already).
  assert r.precisions == ("float32", "bfloat16", "bfloat16_3x")
  for a, b in zip(r.layers, mlp_report.layers):
    assert a.name == b.name
    assert a.metrics["float32"].max_abs == 0
    for p in r.precisions[1:]:
      assert a.metrics[p] == b.metrics[p]
  # Also as a plain string path.
  assert jaxprec.check(mlp, W, X, reference=str(path), precisions=["bf16"],
                       mode="emulate").layers[0].name == "layer_0"


@pytest.mark.parametrize("ext", ["npz", "safetensors"])
def test_bfloat16_layers_saved_now_are_checked_later(tmp_path, ext):
  """save_layers wrote bfloat16 layers to .npz as raw bytes (|V2), which
  check(reference=path) then refused: the layers are written as float32,
  which holds every bfloat16 value exactly."""
  if ext == "safetensors":
    pytest.importorskip("safetensors")
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((8, 8)), jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16)
  f = lambda w, x: {"h": jnp.tanh(x @ w), "out": x @ w @ w}  # noqa: E731
  outs = jax.jit(f)(w, x)
  path = tmp_path / f"ref.{ext}"
  jaxprec.save_layers(path, outs)
  loaded = reference_lib.load(path)
  for k in ("h", "out"):
    assert loaded[k].dtype == np.float32
    np.testing.assert_array_equal(loaded[k], np.asarray(outs[k], np.float32))
  from_file = jaxprec.check(f, w, x, reference=path, precisions=["bf16"],
                            mode="emulate")
  from_tree = jaxprec.check(f, w, x, reference=outs, precisions=["bf16"],
                            mode="emulate")
  assert [l.metrics for l in from_file.layers] == [
      l.metrics for l in from_tree.layers]


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3fn", "bfloat16"])
def test_ml_dtypes_layers_are_saved_as_float32_whatever_their_kind(tmp_path,
                                                                    dtype):
  """float8_e5m2 is NumPy kind 'f' (the others 'V'): it was stored as is, in
  a file that jaxprec then could not read."""
  a = jnp.array([1.0, 0.5, -3.0, 0.0], getattr(jnp, dtype))
  path = tmp_path / "r.npz"
  jaxprec.save_layers(path, {"a": a})
  got = reference_lib.load(path)["a"]
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, np.asarray(a, np.float32))
  r = jaxprec.check(lambda x: {"a": x * 1}, a, reference=path,
                    precisions=["bf16"], mode="emulate")
  assert [l.name for l in r.layers] == ["a"]


def test_a_reference_file_of_raw_bytes_names_the_layer_and_the_fix(tmp_path):
  rng = np.random.default_rng(4)
  w = np.asarray(rng.standard_normal((8, 8)), np.float32)
  raw = np.asarray(jnp.asarray(w, jnp.bfloat16))  # savez writes its bytes
  np.savez(tmp_path / "old.npz", h=raw)
  assert np.load(tmp_path / "old.npz")["h"].dtype.kind == "V"
  with pytest.raises(ValueError, match=r"'h' holds raw bytes .*save_layers"):
    jaxprec.check(lambda w: {"h": w * 2}, w, reference=tmp_path / "old.npz",
                  precisions=["bf16"], mode="emulate")


def test_external_reference_from_pytorch_style_names_and_float64(tmp_path):
  outs = {k: np.asarray(v) for k, v in mlp(W, X).items()}  # in depth order
  # Names as another framework might write them; float64 values.
  np.savez(tmp_path / "torch.npz",
           **{k.replace("_", "."): v.astype(np.float64) for k, v in outs.items()})
  with pytest.raises(reference_lib.ReferenceMismatchError, match="layer_0"):
    jaxprec.check(mlp, W, X, reference=tmp_path / "torch.npz", mode="emulate")
  ref = {f"layer/{k.split('_')[1]}": v for k, v in outs.items()}
  with pytest.raises(ValueError, match="layer_0"):
    jaxprec.check(mlp, W, X, reference=ref, mode="emulate")
  # hidden_states[3] / hidden_states.3 / hidden_states/3 are one name.

  def hs(w, x):
    return {"hidden_states": tuple(mlp(w, x).values())}
  ref = {f"hidden_states.{i}": v.astype(np.float64)
         for i, v in enumerate(outs.values())}
  r = jaxprec.check(hs, W, X, reference=ref, precisions=["float32", "highest"],
                    mode="emulate")
  assert [l.name for l in r.layers] == [f"hidden_states[{i}]" for i in range(4)]
  # float32 against an external reference is the floor, computed as JAX's
  # float32 (exact here: the reference is those very values, widened); a
  # TPU's 'highest' (6 bfloat16 passes) is not exact.
  assert r.metric("max_abs", "float32") == [0.0] * 4
  assert all(0 < v < 1e-5 for v in r.metric("max_abs", "highest"))


def test_reference_mismatch_names_first_path_and_both_shapes(tmp_path):
  outs = {k: np.asarray(v) for k, v in mlp(W, X).items()}
  bad = dict(outs, layer_10=outs["layer_10"][:, :5])
  with pytest.raises(ValueError, match=r"'layer_10'.*\(8, 48\).*\(8, 5\)"):
    jaxprec.check(mlp, W, X, reference=bad, mode="emulate")
  missing = {k: v for k, v in outs.items() if k != "layer_5"}
  with pytest.raises(ValueError, match=r"'layer_5'.*\(8, 48\).*missing"):
    jaxprec.check(mlp, W, X, reference=missing, mode="emulate")
  extra = dict(outs, layer_99=np.zeros(3, np.float32))
  with pytest.raises(ValueError, match=r"'layer_99'.*missing.*\(3,\)"):
    jaxprec.check(mlp, W, X, reference=extra, mode="emulate")


def test_npz_is_loaded_without_pickle(tmp_path):
  path = tmp_path / "pickled.npz"
  np.savez(path, layer_0=np.array([{"a": 1}], dtype=object))
  with pytest.raises(ValueError, match="allow_pickle"):
    jaxprec.check(mlp, W, X, reference=path, mode="emulate")
  with pytest.raises(FileNotFoundError):
    jaxprec.check(mlp, W, X, reference=tmp_path / "nope.npz", mode="emulate")


def test_nans_in_a_layer_are_counted_not_crashed_on():
  def f(x):
    h = x @ W[0]
    return {"ok": h, "log": jnp.log(h), "after": jnp.tanh(h)}
  r = jaxprec.check(f, X, precisions=["bf16"], mode="emulate")
  log = r.layer("log").metrics["bf16"]
  assert log.nan > 0 and log.ref_nan > 0
  assert math.isfinite(log.max_abs)
  assert r.layer("after").metrics["bf16"].nan == 0
  text = str(r)
  assert "nan" in text


def test_nan_only_in_candidate_is_the_first_divergence():
  x = jnp.full((4, 4), 1 + 2.0**-9, jnp.float32)

  def f(x):
    d = x @ x - 4 * (1 + 2.0**-9) ** 2  # ~1e-2 exact, < 0 in one bf16 pass
    return {"d": d, "sqrt": jnp.sqrt(d + 0.015)}
  r = jaxprec.check(f, x, precisions=["bf16"], mode="emulate", atol=1.0)
  m = r.layer("sqrt").metrics["bf16"]
  assert m.nan == 16 and m.ref_nan == 0 and math.isinf(m.required_atol)
  assert r.first_divergence(precision="bf16").layer == "sqrt"


def test_modes_and_targets():
  r = jaxprec.check(mlp, W, X, precisions=["bf16"], mode="native")
  assert r.mode == "native" and r.numerics["bf16"] == "f32 (native cpu)"
  assert r.metric("max_abs", "bf16") == [0.0] * 4  # CPU ignores precision
  assert any("CPU ignores" in n for n in r.notes)
  r = jaxprec.check(mlp, W, X, precisions=["bf16", "float32"], mode="AUTO",
                    target="gpu")
  assert r.mode == "emulate" and r.target == "gpu"
  assert r.numerics["float32"] == "f32 (gpu, emulated)"
  assert r.numerics["bf16"] == "tf32 (gpu, emulated)"
  assert r.metric("max_abs", "float32") == [0.0] * 4


def test_plan_names():
  plan = rows.plan
  assert plan("bf16", "gpu", "emulate").algorithm == "tf32"
  assert plan("BF16_BF16_F32", "gpu", "emulate").algorithm == "bf16x1"
  assert plan("bfloat16_3x", "gpu", "emulate").description == (
      "tf32 (gpu, emulated)")
  assert plan("tf32", "tpu", "emulate").algorithm == "bf16x3"
  assert plan("high", "tpu", "emulate").algorithm == "bf16x3"
  assert plan("default", "gpu", "emulate").algorithm == "tf32"
  assert plan("BF16_BF16_F32_X6", "gpu", "emulate").algorithm == "bf16x6"
  assert plan(lax.Precision.HIGHEST, "tpu", "emulate").label == "highest"
  assert plan("tensorfloat32", "tpu", "native", backend="tpu").algorithm == "bf16x3"


@pytest.mark.parametrize("kwargs, match", [
    ({"precisions": ["bfloat61"]}, "Did you mean 'bfloat16'"),
    ({"precisions": []}, "empty"),
    ({"precisions": ["bf16", "bf16"]}, "repeats"),
    ({"target": "tpv"}, "Did you mean 'tpu'"),
    ({"mode": "emulated"}, "Did you mean 'emulate'"),
    ({"atol": -1}, ">= 0"),
    ({"reference": "floaty"}, "Invalid precision"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxprec.check(mlp, W, X, **kwargs)


def test_other_errors():
  with pytest.raises(TypeError, match="callable"):
    jaxprec.check(3, X)
  with pytest.raises(TypeError, match="ShapeDtypeStruct"):
    jaxprec.check(mlp, W, jax.ShapeDtypeStruct((8, 48), jnp.float32))
  with pytest.raises(ValueError, match="no floating"):
    jaxprec.check(lambda x: jnp.arange(3), X, mode="emulate")


def test_kwargs_and_static_arguments_reach_fn():
  def f(x, *, scale, name, w=None):
    assert isinstance(scale, float) and name == "n"
    return {name: (x * scale) @ w}
  r = jaxprec.check(f, X, precisions=["bf16"], mode="emulate", scale=2.0,
                    name="n", w=W[0])
  assert r.layers[0].name == "n"


def test_progress_without_a_terminal_is_a_line_per_phase(capsys):
  jaxprec.check(mlp, W, X, precisions=["bf16"], mode="emulate", progress=True)
  out, err = capsys.readouterr()
  lines = err.splitlines()
  assert out == "" and "\r" not in err and "\x1b" not in err
  assert lines[:2] == ["jaxprec check: reference at float32",
                       "jaxprec check: compiling+running bf16 (1/1)"]
  assert re.fullmatch(r"jaxprec check: done in \d+\.\d s", lines[2])
  assert len(lines) == 3
  jaxprec.check(mlp, W, X, precisions=["bf16"], mode="emulate")
  assert capsys.readouterr() == ("", "")  # progress=False: nothing


def test_global_precision_state_is_untouched():
  with jaxprec.precision("bfloat16"):
    r = jaxprec.check(mlp, W, X, precisions=["bf16_3x"], mode="emulate")
    assert jax.config.jax_default_matmul_precision == "bfloat16"
  assert r.metric("rel_rms", "bf16_3x")[0] < 1e-4  # the reference is float32


# -- Flax modules ---------------------------------------------------------------


def test_check_module_linen():
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.LayerNorm()(jnp.tanh(nn.Dense(32, name="dense")(x)))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = Block(name=f"block_{i}")(x)
      return nn.Dense(4, name="head")(x)
  net = Net()
  variables = net.init(KEY, X)
  r = jaxprec.check_module(net, variables, X, precisions=["bf16"],
                           mode="emulate")
  assert [l.name for l in r.layers] == [
      "block_0/dense", "block_0/LayerNorm_0", "block_0", "block_1/dense",
      "block_1/LayerNorm_0", "block_1", "head", "output"]
  assert r.layer("output").metrics["bf16"].max_abs > 0
  again = jaxprec.check_module(net, variables, X, precisions=["bf16"],
                               mode="emulate")
  assert again.metric("max_abs", "bf16") == r.metric("max_abs", "bf16")
  with pytest.raises(TypeError, match="variables"):
    jaxprec.check_module(net, X)


def test_check_module_nnx():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([nnx.Linear(48, 48, rngs=rngs) for _ in range(2)])
      self.head = nnx.Linear(48, 4, rngs=rngs)

    def __call__(self, x):
      for b in self.blocks:
        x = jnp.tanh(b(x))
      return self.head(x)
  net = Net(nnx.Rngs(0))
  before = jax.tree_util.tree_map(np.asarray, nnx.state(net))
  r = jaxprec.check_module(net, X, precisions=["bf16"], mode="emulate")
  assert [l.name for l in r.layers] == ["blocks/0", "blocks/1", "head", "output"]
  assert all(v > 0 for v in r.metric("max_abs", "bf16"))
  after = jax.tree_util.tree_map(np.asarray, nnx.state(net))
  jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)
  with pytest.raises(TypeError, match="Flax"):
    jaxprec.check_module(lambda x: x, X)


# -- Hugging Face transformers -------------------------------------------------


@pytest.fixture(scope="module")
def hf():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return pytest.importorskip("transformers")


def test_transformers_flax_wav2vec2_hidden_states(hf):
  config = hf.Wav2Vec2Config(
      hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
      intermediate_size=37, conv_dim=(32, 32), conv_stride=(4, 4),
      conv_kernel=(8, 8), num_conv_pos_embeddings=16,
      num_conv_pos_embedding_groups=2, do_stable_layer_norm=True,
      feat_extract_norm="layer", vocab_size=32)
  model = hf.FlaxWav2Vec2Model(config, _do_init=False)
  params = jax.jit(model.init_weights, static_argnums=1)(KEY, (1, 1024))
  audio = jax.random.normal(jax.random.key(2), (1, 1600), jnp.float32)

  def fn(params, audio):
    return model(audio, params=params, output_hidden_states=True)
  r = jaxprec.check(fn, params, audio, precisions=["bfloat16"], mode="emulate")
  names = [l.name for l in r.layers]
  assert names == ["last_hidden_state", "extract_features", "hidden_states[0]",
                   "hidden_states[1]", "hidden_states[2]"]
  assert all(1e-3 < v < 3e-2 for v in r.metric("rel_rms", "bfloat16"))
  assert r.first_divergence(1e-5, 1e-5, precision="bfloat16").layer == (
      "last_hidden_state")


def test_transformers_flax_bert_hidden_states(hf):
  config = hf.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=37)
  model = hf.FlaxBertModel(config, _do_init=False)
  params = jax.jit(model.init_weights, static_argnums=1)(KEY, (1, 7))
  ids = jnp.asarray(np.random.default_rng(0).integers(3, 99, (2, 7)), jnp.int32)
  r = jaxprec.check(
      lambda p, ids: model(ids, params=p, output_hidden_states=True).hidden_states,
      params, ids, precisions=["bfloat16"], mode="emulate")
  assert [l.name for l in r.layers] == [f"[{i}]" for i in range(3)]
  bf16 = r.metric("rel_rms", "bfloat16")
  assert bf16[0] == 0  # embeddings: no matmul
  assert all(1e-5 < v < 3e-2 for v in bf16[1:])
  assert r.first_divergence(0, 0, precision="bfloat16").layer == "[1]"


def test_transposed_bf16_matmul_runs_on_xla_cpu():
  # XLA:CPU would fold the transpose into the emulated bfloat16 dot and then
  # refuse to run it ("Unsupported element type for DotThunk"); the
  # emulation's reduce_precision guard (emulated_ops) prevents the fold, so
  # the checker needs no retry without XLA's algebraic simplifier.
  r = jaxprec.check(lambda x: {"t": (x @ W[0]).T}, X, precisions=["bf16"],
                    mode="emulate")
  assert 1e-4 < r.layers[0].metrics["bf16"].rel_rms < 1e-2


# -- Policy rows -----------------------------------------------------


def _rel_rms(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.sum((got - ref) ** 2) / np.sum(ref ** 2)))


def test_policy_rows_on_a_plain_function():
  # A policy string and a Policy are rows labelled by the policy string; off
  # modules a policy's default applies, so 'default=bf16' is bfloat16.
  policy = jaxprec.Policy.parse("default=bf16")
  r = jaxprec.check(mlp, W, X, precisions=["bf16", policy, "dot=bf16_3x"],
                    mode="emulate")
  assert r.precisions == ("bf16", "default=bfloat16", "dot=bfloat16_3x")
  assert r.numerics["default=bfloat16"] == "policy (tpu, emulated)"
  assert r.metric("rel_rms", "default=bfloat16") == r.metric("rel_rms", "bf16")
  with jax.default_matmul_precision("float32"):
    ref = mlp(W, X)
  got = jaxprec.emulate(mlp, "dot=bf16_3x")(W, X)
  want = [_rel_rms(got[k], ref[k]) for k in ref]
  np.testing.assert_allclose(r.metric("rel_rms", "dot=bfloat16_3x"), want,
                             rtol=1e-4)
  assert all(1e-6 < v < 1e-4 for v in want)


def test_policy_rows_on_a_linen_model_match_emulate():
  import flax.linen as nn

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jnp.tanh(nn.Dense(48, name="a")(x))
      return {"a": h, "b": jnp.tanh(nn.Dense(48, name="b")(h))}
  model = Two()
  params = model.init(KEY, X)
  text = "default=bfloat16,b=float32"
  r = jaxprec.check(model.apply, params, X, precisions=[text], mode="emulate")
  with jax.default_matmul_precision("float32"):
    ref = model.apply(params, X)
  got = jaxprec.emulate(model.apply, text)(params, X)
  np.testing.assert_allclose(r.metric("rel_rms", text),
                             [_rel_rms(got[k], ref[k]) for k in ("a", "b")],
                             rtol=1e-4)
  # 'b' at float32 (6 passes) adds little to what 'a' at bfloat16 brought in.
  a, b = r.metric("rel_rms", text)
  assert 1e-4 < a < 1e-2 and b < 2 * a


def test_policy_rows_on_an_nnx_model_match_emulate():
  from flax import nnx

  class Two(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(48, 48, rngs=rngs)
      self.b = nnx.Linear(48, 48, rngs=rngs)

    def __call__(self, x):
      h = jnp.tanh(self.a(x))
      return {"b": jnp.tanh(self.b(h)), "a": h}  # not in sorted order
  model = Two(nnx.Rngs(0))
  text = "default=bfloat16,a=float32"
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the rule 'a' is used
    r = jaxprec.check(model, X, precisions=[text, "bf16"], mode="emulate")
  assert [l.name for l in r.layers] == ["b", "a"]
  with jax.default_matmul_precision("float32"):
    ref = model(X)
  got = jaxprec.emulate(model, text)(X)
  np.testing.assert_allclose(r.metric("rel_rms", text),
                             [_rel_rms(got[k], ref[k]) for k in ("b", "a")],
                             rtol=1e-4)
  # 'a' at float32 (6 passes) is far closer than all-bfloat16.
  assert r.metric("rel_rms", text)[1] < 1e-3 * r.metric("rel_rms", "bf16")[1]
  # check_module too: submodule by submodule, the model left as it was.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    m = jaxprec.check_module(model, X, precisions=[text], mode="emulate")
  assert model.a.precision is None
  by_name = {l.name: l.metrics[text].rel_rms for l in m.layers}
  np.testing.assert_allclose(by_name["output.b"], r.metric("rel_rms", text)[0],
                             rtol=1e-4)
  assert by_name["a"] < 1e-6 < 1e-3 < by_name["b"]


# -- Caches hold no user arrays -----------------------------


# One precision row below: every row is built alike, and each compiles.
def _freed(make, run):
  import gc
  import weakref
  x = make()
  ref = weakref.ref(x)
  run(x)
  del x
  gc.collect()
  return ref() is None


def _np_x():
  return np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)


def _jax_x():
  return jnp.asarray(_np_x())


@pytest.mark.parametrize("make", [_np_x, _jax_x], ids=["numpy", "jax"])
@pytest.mark.parametrize("reference", ["float32", "float64", "mapping"])
def test_check_keeps_no_argument_alive(make, reference):
  def run(x):
    ref = {"output": np.asarray(x) @ np.asarray(x)} if reference == "mapping" \
        else reference
    jaxprec.check(jnp.matmul, x, x, reference=ref, precisions=["bf16"],
                  mode="emulate")
  assert _freed(make, run)


def test_check_module_keeps_no_argument_alive():
  import flax.linen as nn
  from flax import nnx
  dense = nn.Dense(16)
  variables = dense.init(KEY, jnp.ones((2, 16)))
  assert _freed(_jax_x, lambda x: jaxprec.check_module(
      dense, variables, x, precisions=["bf16"], mode="emulate"))
  linear = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
  assert _freed(_jax_x, lambda x: jaxprec.check_module(
      linear, x, precisions=["bf16"], mode="emulate"))
  # The parameters too.
  kernel = variables["params"]["kernel"] + 1

  def run(k):
    v = {"params": {**variables["params"], "kernel": k}}
    jaxprec.check_module(dense, v, X[:, :16], precisions=["bf16"],
                         mode="emulate")
  assert _freed(lambda: kernel + 0, run)


# -- NumPy float64/int64 arguments with x64 off --------------


def test_numpy_float64_and_int64_arguments_are_converted_as_jit_does():
  w = np.asarray(W[0], np.float64)
  x = np.asarray(X, np.float64)
  idx = np.arange(8, dtype=np.int64)

  def f(w, x, idx):
    return {"h": jnp.tanh(x[idx] @ w)}
  r = jaxprec.check(f, w, x, idx, precisions=["bf16"], mode="emulate")
  want = jaxprec.check(f, w.astype(np.float32), x.astype(np.float32),
                       idx.astype(np.int32), precisions=["bf16"], mode="emulate")
  assert r.layers[0].dtype == "float32"
  assert r.metric("rel_rms", "bf16") == want.metric("rel_rms", "bf16")
  assert 1e-4 < r.metric("rel_rms", "bf16")[0] < 1e-2
  # And with a float64 reference (x64 on inside): the arguments keep float64.
  r64 = jaxprec.check(f, w, x, idx, precisions=["bf16"], reference="float64",
                      mode="emulate")
  assert 1e-4 < r64.metric("rel_rms", "bf16")[0] < 1e-2
  jaxprec.testing.assert_precision_robust(f, w, x, idx, precision="bf16_3x",
                                          atol=1e-3, rtol=0)


# -- Reference files and objects ----------------------------


def _outs():
  return {k: np.asarray(v) for k, v in mlp(W, X).items()}


@pytest.mark.parametrize("name", ["ref.NPZ", "ref.Npz"])
def test_reference_suffixes_in_any_case_and_pathlike(tmp_path, name):
  path = tmp_path / name
  jaxprec.save_layers(path, _outs())
  assert path.exists()  # not 'ref.NPZ.npz'
  for ref in (path, str(path)):
    r = jaxprec.check(mlp, W, X, reference=ref, precisions=["float32", "bf16"],
                      mode="emulate")
    assert r.reference == f"file:{path}"
    assert r.metric("max_abs", "float32") == [0.0] * 4


def test_npy_reference_is_one_layer(tmp_path):
  x = np.asarray(X)
  w = np.asarray(W[0])
  with open(tmp_path / "out.NPY", "wb") as f:
    np.save(f, x @ w)
  r = jaxprec.check(jnp.matmul, x, w, reference=tmp_path / "out.NPY",
                    precisions=["bf16"], mode="emulate")
  ref = x.astype(np.float64) @ w.astype(np.float64)
  got = jaxprec.emulate(jnp.matmul, "bfloat16")(x, w)
  assert r.layers[0].name == "output"
  np.testing.assert_allclose(r.metric("rel_rms", "bf16")[0],
                             _rel_rms(got, (x @ w)), rtol=1e-4)
  assert _rel_rms(x @ w, ref) < 1e-6


@pytest.mark.parametrize("suffix,content", [
    (".npz", b"this is not a zip file"),
    (".npz", b"PK\x03\x04 truncated"),
    (".npy", b"\x93NUMPY garbage"),
    (".safetensors", b"\x00\x01garbage"),
])
def test_corrupt_reference_file_names_the_file_and_the_types(tmp_path, suffix,
                                                             content):
  path = tmp_path / f"bad{suffix}"
  path.write_bytes(content)
  with pytest.raises(ValueError) as e:
    jaxprec.check(mlp, W, X, reference=path, mode="emulate")
  msg = str(e.value)
  assert str(path) in msg and ".npz" in msg and ".safetensors" in msg
  assert "pickle" not in msg


def test_unsupported_reference_objects(tmp_path):
  for bad in (None, 3, "x.csv"):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
      jaxprec.check(mlp, W, X, reference=bad, mode="emulate")
    assert "layer" not in str(e.value)
  with pytest.raises(ValueError, match=r"reference=None .*\.npz"):
    jaxprec.check(mlp, W, X, reference=None, mode="emulate")
  with pytest.raises(ValueError, match=r"reference=3 \(int\)"):
    jaxprec.check(mlp, W, X, reference=3, mode="emulate")
  (tmp_path / "x.csv").write_text("1,2")
  with pytest.raises(ValueError, match=r"x\.csv.*\.npz, \.npy, \.safetensors"):
    jaxprec.check(mlp, W, X, reference=tmp_path / "x.csv", mode="emulate")
  with pytest.raises(FileNotFoundError, match="missing.npy"):
    jaxprec.check(mlp, W, X, reference=tmp_path / "missing.npy", mode="emulate")


# -- Argument checks ---------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"precisions": 3}, TypeError, r"precisions must be .* got 3 of type int"),
    ({"atol": "a"}, TypeError, r"atol must be a finite number >= 0.*'a' of type str"),
    ({"rtol": None}, TypeError, r"rtol must be a finite number >= 0.*None"),
    ({"rtol": -1e-3}, ValueError, r"rtol must be a finite number >= 0.*-0.001"),
    ({"atol": float("nan")}, ValueError, r"atol must be a finite number >= 0.*nan"),
    ({"rtol": float("inf")}, ValueError, r"rtol must be a finite number >= 0.*got inf"),
    ({"atol": 1e39}, ValueError, r"atol must be a finite.*float32's largest.*1e\+39"),
])
def test_bad_precisions_and_tolerances(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxprec.check(mlp, W, X, mode="emulate", **kwargs)


# -- The framework floor ------------------------------------


def test_external_reference_puts_the_float32_floor_first():
  ref = {k: v.astype(np.float64) + 1e-6 for k, v in _outs().items()}
  r = jaxprec.check(mlp, W, X, reference=ref, mode="emulate")
  assert r.precisions == ("float32", "bfloat16", "bfloat16_3x")
  assert r.numerics["float32"].endswith("(native cpu)")
  assert "[floor]" in str(r)
  assert r.floor == "float32"
  assert '"floor": "float32"' in r.to_json()
  # The floor is the 1e-6 offset the other framework added, no more.
  np.testing.assert_allclose(r.metric("max_abs", "float32"), 1e-6, rtol=1e-3)
  # No floor without an external reference, or without a float32 row.
  r = jaxprec.check(mlp, W, X, precisions=["bf16"], reference=ref,
                    mode="emulate")
  assert r.precisions == ("bf16",)
  assert r.floor is None
  r = jaxprec.check(mlp, W, X, precisions=["float32"], mode="emulate")
  assert r.numerics["float32"] == "bf16x6 (tpu, emulated)"
  assert r.floor is None


def test_the_rows_share_one_metrics_program_and_compile_the_layers_alone():
  # A row runs as its layers, then one metrics program per layout that
  # every row shares: the rows' programs compile without the metrics (a
  # first check of the default rows compiles several times faster so,
  # benchmarks/bench_check.py --forms), and the metrics read the values the
  # row returned.
  from jaxprec._src.checker import harness

  def fn(w, x):  # a layout of its own: (3, 5) and (3, 7)
    h = jnp.tanh(x @ w)
    return {"h": h, "g": jnp.concatenate([h, h[:, :2]], axis=1)}
  w = jax.random.normal(jax.random.key(0), (4, 5))
  x = jax.random.normal(jax.random.key(1), (3, 4))
  before = harness._metrics_program.cache_info()
  r = jaxprec.check(fn, w, x, mode="emulate", target="tpu",
                    precisions=["bfloat16", "bfloat16_3x", "float32"])
  after = harness._metrics_program.cache_info()
  assert after.misses - before.misses == 1  # one metrics program
  assert after.hits - before.hits == 2      # shared by the other two rows
  # Its figures are the returned values' (float64 reference, NumPy).
  ref = {k: np.asarray(v, np.float64) for k, v in fn(w, x).items()}
  got = jaxprec.emulate(fn, "bfloat16", target="tpu")(w, x)
  for name in ("h", "g"):
    d = np.asarray(got[name], np.float64) - ref[name]
    want = np.sqrt((d ** 2).mean() / (ref[name] ** 2).mean())
    np.testing.assert_allclose(r.layer(name).metrics["bfloat16"].rel_rms,
                               want, rtol=1e-5)


def test_a_second_check_of_one_row_does_not_trace_the_function_again():
  # With one row, "every row is the same" holds trivially, and the check
  # asked whether fn holds a matmul by tracing it again on every call
  # (300 ms of a 450 ms check of wav2vec2-small after compile); the answer
  # now comes from the trace the reference already made, cached.
  traces = []

  def fn(w, x):
    traces.append(1)
    return {"h": jnp.tanh(x @ w)}
  w = jax.random.normal(jax.random.key(0), (4, 5))
  x = jax.random.normal(jax.random.key(1), (3, 4))
  first = jaxprec.check(fn, w, x, precisions=["bfloat16"], mode="emulate")
  n = len(traces)
  again = jaxprec.check(fn, w, x, precisions=["bfloat16"], mode="emulate")
  assert len(traces) == n
  assert repr(first.layers) == repr(again.layers)

  def no_matmul(x):  # the note still comes, from the cached trace
    return {"h": jnp.tanh(x)}
  for _ in range(2):
    r = jaxprec.check(no_matmul, x, precisions=["bfloat16"], mode="emulate")
    assert any("has no matmul or convolution" in n for n in r.notes), r.notes


def test_rows_that_agree_on_a_function_with_matmuls_are_said_to():
  # Under x64 a float64 matmul is computed exactly at every precision: the
  # rows gave the same figures with no word on why.
  def fn(w, x):
    return {"h": jnp.tanh(x @ w)}
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    w, x = rng.standard_normal((4, 5)), rng.standard_normal((3, 4))
    r = jaxprec.check(fn, w, x, precisions=["bfloat16", "float32"],
                      mode="emulate")
  assert any("every row is the same: at these inputs the precision changes "
             "nothing" in n for n in r.notes), r.notes
  # float32 operands: the rows differ, and nothing is said
  r = jaxprec.check(fn, w.astype(np.float32), x.astype(np.float32),
                    precisions=["bfloat16", "float32"], mode="emulate")
  assert not any("every row is the same" in n for n in r.notes), r.notes


# -- Benchmarks (they import the harness's internals) ---------------------------


@pytest.mark.parametrize("script", ["bench_check.py", "bench_search.py",
                                    "bench_check.py --forms"])
def test_benchmark_runs_quick(script):
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run(
      [sys.executable, str(root / "benchmarks" / script.split()[0]),
       *script.split()[1:], "--quick"],
      capture_output=True, text=True, timeout=300, cwd=root,
      env={**os.environ, "PYTHONPATH": str(root)})
  assert out.returncode == 0, out.stderr[-2000:]
  assert "ratio" in out.stdout


def _log_layer(w, x):
  h = x @ w[0]
  return {"ok": h, "log": jnp.log(h), "after": jnp.tanh(h)}


def _nan_in_candidate_only(x):
  d = x @ x - 4 * (1 + 2.0**-9) ** 2  # < 0 in one bfloat16 pass only
  return {"d": d, "sqrt": jnp.sqrt(d + 0.015)}


_FINITE_CASES = [
    (mlp, (W, X)), (_log_layer, (W, X)),
    (_nan_in_candidate_only, (jnp.full((4, 4), 1 + 2.0**-9, jnp.float32),))]


@pytest.mark.parametrize("fn, args", _FINITE_CASES)
def test_candidate_metrics_are_those_of_the_masked_path(fn, args):
  # A row's metrics program (check's and the search's rows) compiles the
  # all-finite metrics only and falls back to the masked metrics program on
  # a NaN or an infinity: the numbers of the masked path alone, bit for bit
  # (repr is exact for floats and keeps NaN).
  import jax as jax_
  from jaxprec._src.checker import harness, metrics as metrics_lib
  call = harness.Args(args, {}, who="test")
  ref = harness.build_reference(fn, call, "float32", target="tpu",
                                mode="emulate")
  p = rows.plan("bfloat16", "tpu", "emulate")
  got = harness.run_candidate(fn, call, p, ref, 1e-3, 1e-3)
  hi, lo, stats, dynamic, atol, rtol = harness.candidate_args(
      call, ref, 1e-3, 1e-3)
  values = harness._layers_program(fn, call, lambda f, _: p.wrap(f), p.key,
                                   tuple(ref.names), None, p.label)(None,
                                                                     dynamic)
  masked = harness._metrics_program(ref.layout)(values, hi, lo, stats, atol,
                                                rtol)
  want = metrics_lib.finish(jax_.device_get(masked), ref.layout)
  assert repr(got) == repr(want)
  if fn is not mlp:  # the fallback ran: the fast path counts no NaN
    assert any(m.nan > 0 for m in got)


def _tagged(x):
  return {"h": jnp.tanh(x), "tag": "done"}


def test_a_string_output_names_the_function_and_the_output():
  """jit's own error named jaxprec's tracing lambda, not the user's
  function."""
  with pytest.raises(TypeError) as info:
    jaxprec.check(_tagged, jnp.ones((2, 3)))
  message = str(info.value)
  assert message.startswith(f"{__name__}._tagged returned a str at "
                            f"output['tag']"), message
  assert "harness" not in message


def test_a_float64_reference_of_random_draws_is_said_out_loud():
  # Under x64 jax.random samples float64 from other bits: the reference's
  # dropout mask is not the rows'. Said out loud, in a warning and the
  # reference's description.
  def dropout(k, x, key):
    h = x @ k
    return jnp.where(jax.random.bernoulli(key, 0.7, h.shape), h / 0.7, 0)
  k = np.ones((8, 8), np.float32)
  x = np.ones((2, 8), np.float32)
  with pytest.warns(UserWarning, match="other random numbers"):
    report = jaxprec.check(dropout, k, x, jax.random.key(0),
                           precisions=["bfloat16"], reference="float64")
  assert "random" in report.numerics["(reference)"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no random draw: no warning
    jaxprec.check(lambda k, x: x @ k, k, x, precisions=["bfloat16"],
                  reference="float64")


def test_the_terminal_bar_counts_the_rows_as_its_text_does(monkeypatch):
  # On a terminal the bar's counter and the phase's '(i/n)' agree: the
  # reference is step 0, row i is step i of n.
  import io
  import sys

  class Tty(io.StringIO):
    def isatty(self):
      return True
  tty = Tty()
  monkeypatch.setattr(sys, "stderr", tty)
  monkeypatch.setitem(sys.modules, "rich.progress", None)  # the plain line
  jaxprec.check(mlp, W, X, precisions=["bf16", "bf16_3x"], mode="emulate",
                progress=True)
  shown = [s for s in tty.getvalue().split("\r") if s.startswith("jaxprec")]
  counted = [re.match(r"jaxprec check: \[(\d)/2\] (.*?)(\x1b\[K)?$", s)
             for s in shown]
  assert all(counted), shown
  for m in counted:
    row = re.search(r"\((\d)/2\)$", m.group(2))
    if row:
      assert row.group(1) == m.group(1), m.group(0)
  assert [m.group(1) for m in counted][-1] == "2"
  assert any("reference" in m.group(2) and m.group(1) == "0" for m in counted)


def test_outputs_that_are_not_compared_are_named_in_a_note():
  def f(w, x):
    h = x @ w[0]
    return {"h": h, "n": 3, "ids": jnp.argmax(h, -1)}
  r = jaxprec.check(f, W, X, precisions=["bf16"], mode="emulate")
  assert [l.name for l in r.layers] == ["h"]
  (note,) = [n for n in r.notes if n.startswith("not compared:")]
  assert note.startswith("not compared: 'n' (int), 'ids' (int32), outputs "
                         "that are not floating-point arrays")
  assert not any(n.startswith("not compared") for n in jaxprec.check(
      lambda w, x: {"h": x @ w[0]}, W, X, precisions=["bf16"],
      mode="emulate").notes)
