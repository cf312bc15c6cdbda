"""float8 operands and lax.DotAlgorithm precisions, against NumPy + ml_dtypes,
float64 and JAX's own lowering.

- A float8 x float32 dot (weight-only fp8) is emulated as bfloat16 x float32
  and float16 x float32 are: the float8 operand widened exactly, the float32
  one rounded as the precision says.
- The ``ANY_F8_*`` presets on float8 operands (which JAX refuses on CPU) are
  emulated as one float32 dot of the widened operands: float8 products are
  exact in float32, so this is float32 accumulation of the exact products.
- A ``lax.DotAlgorithm`` resolves to the preset it spells, field for field.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.core import algorithms
from jaxprec._src.emulation.emulated_ops import NotModelledWarning

import reference as ref

D = lax.DotAlgorithmPreset
# The float8 types this JAX names and its XLA holds (jaxprec.float8_types):
# jaxlib 0.12.1's XLA:CPU has no float8_e5m3fnu, which jax 0.12.1 names.
FLOAT8 = [n for n in dir(jnp) if n.startswith("float8_")]
HELD = [n for n in FLOAT8 if n in jaxprec.float8_types()]
NOT_HELD = [n for n in FLOAT8 if n not in HELD]
DN = (((1,), (0,)), ((), ()))
F8_PRESETS = [p for p in D if p.name.startswith("ANY_F8")]


def _np(x) -> np.ndarray:
  """A JAX array as float32 NumPy, through ml_dtypes (not through JAX)."""
  return np.asarray(np.asarray(x), np.float32)


def test_every_float8_value_is_a_bfloat16_value():
  """Why rounding a widened float8 operand to bfloat16 changes nothing."""
  assert FLOAT8, "JAX names no float8 type"
  for name in FLOAT8:  # every one JAX names, held or not (through NumPy)
    dt = getattr(ml_dtypes, name)
    vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    vals = vals[np.isfinite(vals)]
    back = vals.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(back, vals, err_msg=name)


@pytest.mark.parametrize("name", HELD)
@pytest.mark.parametrize("precision,target,algorithm", [
    ("bfloat16", "tpu", "bf16x1"), ("bfloat16_3x", "tpu", "bf16x3"),
    ("float32", "tpu", "bf16x6"), ("tensorfloat32", "gpu", "tf32")])
def test_float8_times_float32_is_emulated(name, precision, target, algorithm):
  dt = getattr(jnp, name)
  rng = np.random.default_rng(0)
  a = (rng.standard_normal((6, 1)) * (1 + 2.0**-12)).astype(np.float32)
  w8 = jnp.asarray(np.abs(rng.standard_normal((1, 5))) + 0.5).astype(dt)
  f = lambda a, w: lax.dot_general(  # noqa: E731
      a, w, DN, preferred_element_type=jnp.float32)
  out = jaxprec.emulate(f, precision, target=target)(a, w8)
  # Contraction length 1: bit for bit the NumPy + ml_dtypes reference.
  want = ref.emulate(a, _np(w8), algorithm, ref.dot_general(DN))
  np.testing.assert_array_equal(ref.bits(out), ref.bits(want))
  if algorithm in ("bf16x1", "tf32"):  # not the exact float32 product
    assert not np.array_equal(_np(out), _np(f(a, w8)))
  # And the same bits as the float32 operand holding the same values.
  a2 = rng.standard_normal((3, 7)).astype(np.float32)
  w2 = jnp.asarray(rng.standard_normal((7, 4))).astype(dt)
  emu = jaxprec.emulate(f, precision, target=target)
  np.testing.assert_array_equal(
      ref.bits(emu(a2, w2)), ref.bits(emu(a2, w2.astype(jnp.float32))))


def test_float8_operand_is_audited_at_the_precision():
  w8 = jnp.ones((4, 3), jnp.float8_e4m3fn)
  f = lambda a, w: lax.dot_general(  # noqa: E731
      a, w, DN, preferred_element_type=jnp.float32)
  assert jaxprec.cost(f, jnp.ones((2, 4)), w8, policy="float32",
                      target="tpu").by_algorithm.keys() == {"bf16x6"}


@pytest.mark.parametrize("preset", F8_PRESETS, ids=lambda p: p.name)
@pytest.mark.parametrize("dtypes", [("float8_e4m3fn", "float8_e4m3fn"),
                                    ("float8_e5m2", "float8_e4m3fn"),
                                    ("float8_e4m3fnuz", "float8_e5m2fnuz")])
@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_any_f8_presets_are_emulated_on_cpu(preset, dtypes, target):
  rng = np.random.default_rng(1)
  lt, rt = (getattr(jnp, d) for d in dtypes)
  x = jnp.asarray(rng.standard_normal((5, 64)) * 4).astype(lt)
  y = jnp.asarray(rng.standard_normal((64, 3)) * 4).astype(rt)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotModelledWarning)
    out = jaxprec.emulated_dot_general(x, y, DN, preset, jnp.float32,
                                       target=target)
  assert out.dtype == jnp.float32
  # float64 reference: the exact sum of the exact products, within float32
  # accumulation of 64 terms.
  x64, y64 = _np(x).astype(np.float64), _np(y).astype(np.float64)
  exact, mag = x64 @ y64, np.abs(x64) @ np.abs(y64)
  assert np.all(np.abs(_np(out) - exact) <= 64 * 2.0**-24 * mag)
  # A length-1 contraction is one exact product: bit for bit.
  one = jaxprec.emulated_dot_general(x[:, :1], y[:1], DN, preset, jnp.float32,
                                     target="tpu")
  np.testing.assert_array_equal(_np(one), (x64[:, :1] * y64[:1]).astype(
      np.float32))


def test_any_f8_result_type_is_the_ops_own():
  x = jnp.asarray([[1.5, 3.0]], jnp.float8_e4m3fn)
  y = jnp.asarray([[2.0], [0.125]], jnp.float8_e4m3fn)
  f = lambda x, y: lax.dot_general(  # noqa: E731
      x, y, DN, precision=D.ANY_F8_ANY_F8_F32)
  out = jaxprec.emulate(f, target="tpu")(x, y)
  assert out.dtype == jnp.float8_e4m3fn
  assert float(out[0, 0]) == float(np.float32(3.375).astype(
      ml_dtypes.float8_e4m3fn))


def test_fast_accum_on_gpu_says_its_accumulator_is_not_modelled():
  x = jnp.ones((2, 4), jnp.float8_e4m3fn)
  f = lambda x: lax.dot_general(  # noqa: E731
      x, x.T, DN, precision=D.ANY_F8_ANY_F8_F32_FAST_ACCUM,
      preferred_element_type=jnp.float32)
  with pytest.warns(NotModelledWarning, match="as ANY_F8_ANY_F8_F32 computes"):
    jaxprec.emulate(f, target="gpu")(x)
  with warnings.catch_warnings():
    warnings.simplefilter("error", NotModelledWarning)
    jaxprec.emulate(f, target="tpu")(x)


def test_check_runs_an_any_f8_preset_on_cpu():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float8_e5m2)
  y = jnp.asarray(rng.standard_normal((16, 8)), jnp.float8_e5m2)

  def fn(x, y):
    return {"h": lax.dot_general(x, y, DN, preferred_element_type=jnp.float32)}
  report = jaxprec.check(fn, x, y, precisions=["ANY_F8_ANY_F8_F32"],
                         target="tpu")
  # Exact products, float32 sums: what the float32 reference computes.
  assert report.metric("max_abs", "ANY_F8_ANY_F8_F32") == [0.0]


def test_any_f8_on_float32_operands_is_still_refused():
  x = jnp.ones((2, 2), jnp.float32)
  with pytest.raises(ValueError, match="takes two float8 operands.*float32"):
    jaxprec.emulated_dot_general(x, x, DN, D.ANY_F8_ANY_F8_F32, target="tpu")
  # A float8 operand of a level (not a preset) is emulated, not refused.
  w8 = jnp.ones((2, 2), jnp.float8_e4m3fn)
  assert jaxprec.emulated_dot_general(x, w8, DN, "bfloat16",
                                      target="tpu").dtype == jnp.float32


def test_float8_types_are_those_the_backend_holds():
  held = jaxprec.float8_types()
  assert {"float8_e4m3fn", "float8_e5m2"} <= set(held)
  for name in held:  # each converts both ways on this backend
    x = jnp.asarray(np.array([1.5, -0.25], np.float32)).astype(getattr(jnp, name))
    assert x.astype(jnp.float32).dtype == jnp.float32
  assert set(held) | set(NOT_HELD) >= set(FLOAT8)


@pytest.mark.parametrize("name", NOT_HELD or [pytest.param(
    None, marks=pytest.mark.skip(
        reason=f"this JAX ({jax.__version__}) names no float8 type its XLA "
               f"cannot hold"))])
def test_a_float8_type_the_backend_cannot_hold_is_refused_by_name(name):
  # jax 0.12.1 names float8_e5m3fnu; its XLA:CPU has no such element type
  # ("cannot convert from f32[1,5] to PRIMITIVE_TYPE_INVALID").
  f = lambda a, w: lax.dot_general(  # noqa: E731
      a, w, DN, preferred_element_type=jnp.float32)
  a = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  w = jax.ShapeDtypeStruct((3, 4), getattr(jnp, name))
  with pytest.raises(ValueError, match=rf"{name}: this JAX names the type.*"
                     r"float8_e4m3fn"):
    jax.make_jaxpr(jaxprec.emulate(f, "bfloat16", target="tpu"))(a, w)


def _cpu_refuses(preset) -> bool:
  x = jnp.ones((2, 2), jnp.float8_e4m3fn if preset.name.startswith(
      "ANY_F8") else jnp.float32)
  try:
    jax.jit(lambda a: lax.dot(a, a, precision=preset)).lower(x)
  except ValueError as e:
    assert "not supported by dot_general on CPU" in str(e)
    return True
  return False


@pytest.mark.parametrize("preset", [p for p in D if p is not D.DEFAULT],
                         ids=lambda p: p.name)
def test_resolve_cpu_says_which_presets_a_cpu_refuses(preset):
  if jax.default_backend() != "cpu":
    pytest.skip("asks the CPU lowering")
  # Read from the installed JAX, not a table: jax 0.12.1 took F16_F16_F32.
  cpu = jaxprec.resolve(preset).cpu
  assert (not cpu.supported) == _cpu_refuses(preset)
  modelled = algorithms.record(algorithms.PRESETS[preset.name]).modelled
  # JAX converts float32 operands to float16 for the float16 presets
  # (DotAlgorithmPreset.supported_lhs_types): a CPU runs their algorithm.
  record = algorithms.record(algorithms.PRESETS[preset.name])
  converts = np.dtype(np.float32) not in [
      np.dtype(t) for t in preset.supported_lhs_types or (np.float32,)]
  ran = record if converts and record.pass_format == "float16" else (
      algorithms.CPU)
  assert cpu is (ran if not _cpu_refuses(preset) else
                 algorithms.CPU_UNSUPPORTED if modelled
                 else algorithms.CPU_UNMODELLED)
  # Where jaxprec does not model the preset, the CPU's line does not
  # promise an emulation.
  assert ("jaxprec.emulate computes it" in cpu.note) == (
      cpu is algorithms.CPU_UNSUPPORTED)


# ---------------------------------------------------------------------------
# lax.DotAlgorithm


def _algorithm_attr(precision, dtype) -> list[str]:
  """The ``algorithm = <...>`` JAX lowers a dot with, for a TPU (StableHLO)."""
  f = lambda a, b: lax.dot_general(  # noqa: E731
      a, b, DN, precision=precision, preferred_element_type=jnp.float32)
  s = jax.ShapeDtypeStruct((2, 2), dtype)
  # Lowered for a TPU, not exported: jax 0.12's export cannot serialize a
  # float8 algorithm to VHLO.
  text = jax.jit(f).trace(s, s).lower(lowering_platforms=("tpu",)).as_text()
  return re.findall(r"algorithm = <[^>]*>", text)


_ALGORITHMS = [
    lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, np.float32),
    lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, np.float32,
                     num_primitive_operations=3),
    lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, np.float32,
                     num_primitive_operations=6),
    lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, np.float32,
                     num_primitive_operations=9),
    lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    lax.DotAlgorithm(np.float16, np.float16, np.float32),
    lax.DotAlgorithm(np.float16, np.float16, np.float16),
    lax.DotAlgorithm(np.float32, np.float32, np.float32),
    lax.DotAlgorithm(np.float64, np.float64, np.float64),
    lax.DotAlgorithm(jnp.float8_e4m3fn, jnp.float8_e4m3fn, np.float32),
    lax.DotAlgorithm(jnp.float8_e4m3fn, jnp.float8_e4m3fn, np.float32,
                     allow_imprecise_accumulation=True),
]


@pytest.mark.parametrize("algorithm", _ALGORITHMS, ids=str)
@pytest.mark.parametrize("x64", [False, True])
def test_dot_algorithm_resolves_to_the_preset_jax_lowers_alike(algorithm, x64):
  with jax.enable_x64(x64), warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # float64 truncated
    p = jaxprec.resolve(algorithm)
    assert p.preset is not None
    dtype = jax.dtypes.canonicalize_dtype(algorithm.lhs_precision_type)
    attr = _algorithm_attr(algorithm, dtype)
    assert attr and attr == _algorithm_attr(p.preset, dtype), (attr, p.name)


@pytest.mark.parametrize("algorithm", [
    lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, np.float32,
                     num_primitive_operations=2),
    lax.DotAlgorithm(np.float16, np.float32, np.float32),
    lax.DotAlgorithm(np.float32, np.float32, None),
    lax.DotAlgorithm(np.float32, np.float32, np.float32, lhs_component_count=2),
    lax.DotAlgorithm(np.float32, np.float32, np.float32,
                     allow_imprecise_accumulation=True),
], ids=str)
def test_dot_algorithm_no_preset_spells_is_a_clear_error(algorithm):
  with pytest.raises(ValueError) as e:
    jaxprec.resolve(algorithm)
  msg = str(e.value)
  assert "DotAlgorithm(" in msg and "no lax.DotAlgorithmPreset spells" in msg
  assert "BF16_BF16_F32_X6 = (bfloat16, bfloat16, float32" in msg
  assert "pair" not in msg


def test_dot_algorithm_is_emulated_and_costed_as_its_preset():
  rng = np.random.default_rng(3)
  a = rng.standard_normal((4, 8)).astype(np.float32)
  b = rng.standard_normal((8, 5)).astype(np.float32)

  def f(precision):
    return lambda a, b: lax.dot_general(a, b, DN, precision=precision)
  x6 = lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, np.float32,
                        num_primitive_operations=3)
  got = jaxprec.emulate(f(x6), target="tpu")(a, b)
  want = jaxprec.emulate(f(D.BF16_BF16_F32_X3), target="tpu")(a, b)
  np.testing.assert_array_equal(ref.bits(got), ref.bits(want))
  assert not np.array_equal(_np(got), _np(f(None)(a, b)))
  report = jaxprec.cost(f(x6), a, b, target="tpu")
  assert set(report.by_algorithm) == {"bf16x3"}
  assert report.unknown_flops == 0
