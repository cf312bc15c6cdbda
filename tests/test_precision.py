"""jaxprec.resolve and jaxprec.Precision: every spelling, every error."""

import jax
import pytest
from jax import lax

import jaxprec
from jaxprec._src.core import names

P = lax.Precision
D = lax.DotAlgorithmPreset

# The flag's values on the installed JAX (names.PRESETS_SINCE: a preset of
# a newer release is refused, tested below).
JAX_FLAG_VALUES = sorted(v for v in names.JAX_FLAG_VALUES if not names.too_new(v))
NEWER_PRESETS = sorted(names.PRESETS_SINCE)


@pytest.mark.parametrize("value", JAX_FLAG_VALUES)
def test_every_jax_flag_value_resolves_and_round_trips_through_jax(value):
  p = jaxprec.resolve(value)
  # The value jaxprec hands back to JAX is accepted by JAX and means the same.
  with jax.default_matmul_precision(p.flag):
    assert jax.config.jax_default_matmul_precision == p.flag
  from jax._src.lax.lax import canonicalize_precision
  assert canonicalize_precision(p.per_op) == canonicalize_precision(value)


@pytest.mark.parametrize("value,name", [
    ("fastest", "bfloat16"), ("default", "bfloat16"), ("bfloat16", "bfloat16"),
    ("bfloat16_3x", "bfloat16_3x"), ("tensorfloat32", "tensorfloat32"),
    ("high", "tensorfloat32"), ("highest", "float32"), ("float32", "float32"),
    ("HIGHEST", "float32"), ("High", "tensorfloat32"), ("DEFAULT", "bfloat16"),
    (P.DEFAULT, "bfloat16"), (P.HIGH, "tensorfloat32"), (P.HIGHEST, "float32"),
    ((P.HIGHEST, P.HIGHEST), "float32"), (("highest", "highest"), "float32"),
    ((P.DEFAULT, P.HIGHEST), "float32"),
    ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("tf32", "tensorfloat32"),
    ("fp32", "float32"), ("F32", "float32"), ("bf16_3x", "bfloat16_3x"),
    ("bf16_6x", "BF16_BF16_F32_X6"), ("medium", "bfloat16"),
    (D.F32_F32_F32, "F32_F32_F32"), ("f32_f32_f32", "F32_F32_F32"),
    ("bf16_bf16_f32_x3", "BF16_BF16_F32_X3"), (D.BF16_BF16_F32_X9, "BF16_BF16_F32_X9"),
    (None, "backend-default"), (D.DEFAULT, "backend-default"), ("  fp32 ", "float32"),
])
def test_spellings(value, name):
  assert jaxprec.resolve(value).name == name


@pytest.mark.parametrize("preset", [p for p in D if p is not D.DEFAULT])
def test_every_preset_member_and_name(preset):
  a, b = jaxprec.resolve(preset), jaxprec.resolve(preset.name)
  assert a is b and a.preset is preset and a.flag == preset.name
  assert a.per_op is preset


def test_per_op_value_is_what_lax_records():
  # The per-op value of every level lowers exactly as JAX's own spelling.
  for name, level in [("bfloat16", P.DEFAULT), ("bfloat16_3x", P.HIGH),
                      ("float32", P.HIGHEST)]:
    assert jaxprec.resolve(name).per_op is level
  assert jaxprec.resolve(None).per_op is None
  # JAX's flag rejects 'bfloat16_3x': jaxprec hands it the level's flag spelling.
  assert jaxprec.resolve("bfloat16_3x").flag == "tensorfloat32"


def test_conv_level_of_presets_never_downgrades():
  assert jaxprec.resolve("F32_F32_F32").level is P.HIGHEST
  assert jaxprec.resolve("BF16_BF16_F32_X6").level is P.HIGHEST
  assert jaxprec.resolve("BF16_BF16_F32_X3").level is P.HIGH
  assert jaxprec.resolve("BF16_BF16_F32").level is P.DEFAULT


def test_meaning_per_backend():
  bf16 = jaxprec.resolve("bfloat16")
  assert (bf16.tpu.passes, bf16.tpu.operand_bits) == (1, 8)
  assert bf16.gpu.algorithm == "tf32" and bf16.gpu.operand_bits == 11
  assert bf16.cpu.algorithm == "f32" and bf16.cpu.operand_bits == 24
  assert bf16.tpu.rel_error == pytest.approx(2 * 2.0**-8)
  hi = jaxprec.resolve("float32")
  assert hi.tpu.passes == 6 and hi.gpu.algorithm == "f32"
  assert jaxprec.resolve("bf16_3x").tpu.passes == 3
  assert jaxprec.resolve("bf16_3x").on("TPU") is jaxprec.resolve("bf16_3x").tpu
  assert jaxprec.resolve("bf16").on("cuda") is bf16.gpu
  with pytest.raises(ValueError, match="Unknown backend 'mps'.*'tpu', 'gpu', 'cpu'"):
    bf16.on("mps")


def test_frozen_hashable_and_equal_ignoring_source():
  a = jaxprec.resolve("fp32")
  b = a.with_source("env")
  assert a == b and hash(a) == hash(b) and b.source == "env"
  assert {a: 1}[b] == 1
  with pytest.raises(AttributeError):
    a.name = "x"  # type: ignore[misc]
  assert jaxprec.resolve(b) is b  # a Precision passes through with its source
  assert repr(a) == "jaxprec.Precision('float32')" and str(a) == "float32"


def test_canonical_tables_agree():
  from jaxprec._src.core.precision import _CANONICAL
  # Every name but the presets of a newer JAX than the installed one.
  assert set(_CANONICAL) == {n for n in names.FLAGS if not names.too_new(n)}
  for n, p in _CANONICAL.items():
    assert p.flag == names.FLAGS[n]
    assert p.flag is None or p.flag in names.JAX_FLAG_VALUES
  for alias, canon in names.ALIASES.items():
    if not names.too_new(canon):
      assert jaxprec.resolve(alias).name == canon


@pytest.mark.parametrize("bad,expect", [
    ("bfloat61", "Did you mean 'bfloat16'?"),
    ("flaot32", "Did you mean 'float32'?"),
    ("F32_F32_F3", "Did you mean 'F32_F32_F32'?"),
    ("tf23", "Invalid precision 'tf23': unknown name"),
])
def test_unknown_name_lists_valid_names_and_suggests(bad, expect):
  with pytest.raises(ValueError) as e:
    jaxprec.resolve(bad)
  msg = str(e.value)
  assert expect in msg
  assert "Valid names:" in msg and "float32" in msg and "BF16_BF16_F32_X3" in msg


@pytest.mark.parametrize("bad,why", [
    (3, "got int"), (1.5, "got float"), ("", "empty string"), ("   ", "empty string"),
    (True, "got bool"), ((P.HIGH,), "a pair must hold two precision levels"),
    (("F32_F32_F32", "BF16_BF16_F32"), "a pair must hold two precision levels"),
    (object(), "got object"),
])
def test_wrong_types_get_the_same_clear_error(bad, why):
  with pytest.raises(ValueError, match="Invalid precision") as e:
    jaxprec.resolve(bad)
  assert why in str(e.value) and "Valid names:" in str(e.value)


def test_valid_names_contains_aliases_and_presets():
  v = jaxprec.valid_names()
  assert v == sorted(v)
  for n in ("bf16", "float32", "F32_F32_F32", "medium", "backend-default"):
    assert n in v


def test_a_policy_is_not_a_precision():
  policy = jaxprec.Policy.parse("default=bf16,conv=fp32")
  with pytest.raises(ValueError, match="a Policy is not one precision; pass it to "
                                       "jaxprec.swap or jaxprec.emulate"):
    jaxprec.resolve(policy)


@pytest.mark.parametrize("name", NEWER_PRESETS)
def test_a_preset_of_a_newer_jax_is_named_with_its_release(name):
  # jax 0.12.1 added the float8 split presets; an older JAX rejects them.
  assert names.too_new(name, (0, 12, 0)) == (
      f"{name} is a lax.DotAlgorithmPreset of jax 0.12.1 and newer; this JAX "
      f"is 0.12.0")
  assert names.too_new(name, (0, 12, 1)) is None
  env = {names.ENV_VAR: name}
  if hasattr(D, name):
    assert jaxprec.resolve(name).preset is getattr(D, name)
    names.check_env_before_jax(env)  # JAX's flag takes it
    assert env == {names.ENV_VAR: name}
    return
  with pytest.raises(ValueError, match=rf"Invalid precision '{name.lower()}': {name} "
                     r"is a lax.DotAlgorithmPreset of jax 0.12.1 and newer; "
                     r"this JAX is 0\.10") as e:
    jaxprec.resolve(name.lower())
  assert "Did you mean" not in str(e.value)
  with pytest.raises(ValueError, match=rf"JAX_DEFAULT_MATMUL_PRECISION: .*"
                     rf"{name} is a lax.DotAlgorithmPreset of jax 0.12.1"):
    names.check_env_before_jax(env)
  assert name not in jaxprec.valid_names()


@pytest.mark.parametrize("name", NEWER_PRESETS)
def test_the_float8_split_presets_are_named_and_refused_as_not_modelled(name):
  if not hasattr(D, name):
    pytest.skip(f"jax {jax.__version__} has no DotAlgorithmPreset {name}")
  import jax.numpy as jnp
  p = jaxprec.resolve(getattr(D, name))
  for n in (p.tpu, p.gpu):
    assert not n.supported and not n.modelled and n.pass_format == "float8"
    assert n.passes == (3 if name.endswith("X3") else 4)
  assert not p.cpu.supported  # JAX refuses it on CPU
  x = jnp.ones((4, 4), jnp.float32)
  f = lambda a: lax.dot(a, a, precision=getattr(D, name))  # noqa: E731
  for target in ("tpu", "gpu"):
    with pytest.raises(jaxprec.UnsupportedAlgorithmError,
                       match=rf"{name} .*jaxprec does not model this "
                             rf"algorithm.*{target.upper()}"):
      jaxprec.emulate(f, target=target)(x)
  (row,) = jaxprec.audit(f, x).rows
  assert row.risky and "not modelled" in row.reason
