"""The tensor-core model per GPU chip (``chip=``), bit for bit against MMA-Sim.

MMA-Sim (arXiv 2511.10909, ``mmasim`` on PyPI, which needs torch) is the
reference where it is installed (the torch CI stage); the properties below it
need nothing but jaxprec.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.emulation import tensor_cores
from jaxprec._src.emulation.emulated_ops import NotModelledWarning

DN = (((1,), (0,)), ((), ()))
_F8 = ml_dtypes.float8_e4m3fn


def _bits(x) -> np.ndarray:
  return np.asarray(x, np.float32).view(np.uint32)


# ---------------------------------------------------------------------------
# Operands already representable in the input format, special values among
# them.

# (format, exponent range of the random values, special values)
_SPECIALS = {
    "tf32": [np.inf, -np.inf, np.nan, 0.0, -0.0, 2.0**-130, -2.0**-140,
             3e38, 2.0**127, 2.0**-126, 2.0**64],
    "bf16": [np.inf, -np.inf, np.nan, 0.0, -0.0, 2.0**-130, -2.0**-133,
             3e38, 2.0**127, 2.0**-126, 2.0**64],
    "e4m3": [np.nan, 0.0, -0.0, 2.0**-9, -2.0**-8, 448.0, -448.0, 2.0**-6],
}
_EXPONENTS = {"tf32": (-70, 62), "bf16": (-70, 62), "e4m3": (-8, 6)}


def _operand(rng, shape, fmt: str, specials: float) -> np.ndarray:
  lo, hi = _EXPONENTS[fmt]
  if specials:
    x = rng.standard_normal(shape) * np.exp2(rng.integers(lo, hi, shape))
    mask = rng.random(shape) < specials
    x[mask] = rng.choice(_SPECIALS[fmt], mask.sum())
  else:
    x = rng.standard_normal(shape)
  x = x.astype(np.float32)
  if fmt == "tf32":
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
  if fmt == "bf16":
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)
  return x.astype(_F8).astype(np.float32)


# (MMA-Sim class, architecture, instruction, chip, format, precision, k, m)
_INSTRUCTIONS = [
    ("MMA", "Ampere", "m16n8k8.f32.tf32.tf32.f32", "a100", "tf32",
     "TF32_TF32_F32", 8, 16),
    ("MMA", "Ampere", "m16n8k16.f32.bf16.bf16.f32", "a100", "bf16",
     "BF16_BF16_F32", 16, 16),
    ("WGMMA", "Hopper", "m64n8k8.f32.tf32.tf32", "h100", "tf32",
     "TF32_TF32_F32", 8, 64),
    ("WGMMA", "Hopper", "m64n8k16.f32.bf16.bf16", "h100", "bf16",
     "BF16_BF16_F32", 16, 64),
    ("WGMMA", "Hopper", "m64n8k32.f32.e4m3.e4m3", "h100", "e4m3",
     "ANY_F8_ANY_F8_F32_FAST_ACCUM", 32, 64),
    ("TCGen05MMA", "Blackwell", "m64n8k16.kind::f16.f32.bf16.bf16", "b200",
     "bf16", "BF16_BF16_F32", 16, 64),
    ("TCGen05MMA", "Blackwell", "m64n8k32.kind::f8f6f4.f32.e4m3.e4m3", "b200",
     "e4m3", "ANY_F8_ANY_F8_F32_FAST_ACCUM", 32, 64),
]


@pytest.mark.parametrize("instr", _INSTRUCTIONS, ids=lambda i: i[2])
@pytest.mark.parametrize("steps,specials", [(1, 0.0), (8, 0.0), (4, 0.15)])
def test_chip_model_is_mmasim_bit_for_bit(instr, steps, specials):
  pytest.importorskip("mmasim")
  torch = pytest.importorskip("torch")
  from mmasim import nv_ptx

  kind, arch, name, chip, fmt, precision, k, m = instr
  sim = getattr(nv_ptx, kind)(arch, name)
  n, kk = 8, k * steps
  rng = np.random.default_rng(steps * 7 + int(specials * 100))
  a = _operand(rng, (m, kk), fmt, specials)
  b = _operand(rng, (kk, n), fmt, specials)
  tdtype = {"tf32": torch.float32, "bf16": torch.bfloat16,
            "e4m3": torch.float8_e4m3fn}[fmt]
  ta, tb = torch.from_numpy(a).to(tdtype), torch.from_numpy(b).to(tdtype)
  c = torch.zeros((m, n), dtype=torch.float32)
  for i in range(0, kk, k):  # the instructions chained over K
    c = sim(ta[:, i:i + k], tb[i:i + k, :], c)
  want = c.numpy().view(np.uint32)

  if fmt == "e4m3":
    x, y = jnp.asarray(a.astype(_F8)), jnp.asarray(b.astype(_F8))
  else:
    x, y = jnp.asarray(a), jnp.asarray(b)
  got = jaxprec.emulated_dot_general(
      x, y, DN, precision=precision, preferred_element_type=jnp.float32,
      target="gpu", chip=chip)
  np.testing.assert_array_equal(_bits(got), want)
  # The default model rounds to nearest: it differs in the last bits (but
  # for a B200's float8, whose short products its 25 bits sum exactly here).
  if specials == 0.0 and steps > 1 and (chip, fmt) != ("b200", "e4m3"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", NotModelledWarning)  # said below
      default = jaxprec.emulated_dot_general(
          x, y, DN, precision=precision.replace("_FAST_ACCUM", ""),
          preferred_element_type=jnp.float32, target="gpu")
    assert np.any(_bits(default) != want)


def test_subnormal_operands_and_results_are_mmasim_bit_for_bit():
  """Tiny operands whose products and sums are float32 subnormals, through
  the integer kernel (no float operation that a CPU could flush)."""
  pytest.importorskip("mmasim")
  torch = pytest.importorskip("torch")
  from mmasim import nv_ptx

  rng = np.random.default_rng(5)
  a = (rng.standard_normal((16, 32)) * 2.0**-70).astype(np.float32)
  b = (rng.standard_normal((32, 8)) * 2.0**-60).astype(np.float32)
  a[:, ::3] = (rng.standard_normal((16, 11)) * 2.0**-128).astype(np.float32)
  a = (a.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
  b = (b.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
  for chip, arch, kind, name in [
      ("a100", "Ampere", "MMA", "m16n8k8.f32.tf32.tf32.f32"),
      ("h100", "Hopper", "WGMMA", "m64n8k8.f32.tf32.tf32")]:
    sim = getattr(nv_ptx, kind)(arch, name)
    c = torch.zeros((16, 8), dtype=torch.float32)
    for i in range(0, 32, 8):
      c = sim(torch.from_numpy(a[:, i:i + 8]), torch.from_numpy(b[i:i + 8]), c)
    got = jax.jit(lambda x, y, chip=chip: tensor_cores.chip_dot(
        x, y, chip, "tf32"))(a, b)
    want = c.numpy().view(np.uint32)
    assert np.any((want & 0x7F800000) == 0) and np.any(want != 0)
    np.testing.assert_array_equal(_bits(got), want)


# ---------------------------------------------------------------------------
# Properties that need no MMA-Sim.

_CHIP_FORMATS = [("a100", "tf32"), ("a100", "bf16"), ("h100", "tf32"),
                 ("h100", "bf16"), ("h100", "e4m3"), ("b200", "bf16")]


@pytest.mark.parametrize("chip,fmt", _CHIP_FORMATS)
def test_round_toward_zero_never_rounds_away_from_zero(chip, fmt):
  """All products of one sign: each term truncated toward zero, the sum
  rounded toward zero, so ``|chip| <= |exact|``; and within the truncation
  bound of it."""
  rng = np.random.default_rng(3)
  k = 256
  a = np.abs(_operand(rng, (8, k), fmt, 0.0))
  b = np.abs(_operand(rng, (k, 8), fmt, 0.0))
  exact = a.astype(np.float64) @ b.astype(np.float64)
  acc = tensor_cores.accumulation(chip, fmt)
  for sign in (1.0, -1.0):
    got = np.asarray(jax.jit(lambda x, y: tensor_cores.chip_dot(
        x, y, chip, fmt))(sign * a, b), np.float64)
    assert np.all(np.abs(got) <= exact)
    # Every group loses below 2**-F of the running sum per term, and the
    # rounding below 2**-result_bits of it.
    bound = (k * 2.0**-acc.fraction_bits * 4
             + (k // acc.group) * 2.0**-acc.result_bits) * exact
    assert np.all(exact - np.abs(got) <= bound)


@pytest.mark.parametrize("precision,chip,derived", [
    ("TF32_TF32_F32", "a100", True), ("BF16_BF16_F32", "h100", False),
    ("F16_F16_F32", "b200", False), ("BF16_BF16_F32_X3", "a100", False),
    ("TF32_TF32_F32_X3", "h100", False), ("BF16_BF16_F32_X6", "b200", False)])
def test_chip_equals_the_default_model_where_every_sum_is_exact(
    precision, chip, derived):
  """Small integers: exact products and exact sums, so every model gives
  the same bits, jitted or not, and the same gradients."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.integers(-8, 9, (2, 6, 40)).astype(np.float32))
  y = jnp.asarray(rng.integers(-8, 9, (2, 40, 5)).astype(np.float32))
  dn = (((2,), (1,)), ((0,), (0,)))
  f = lambda c: (lambda a, b: jaxprec.emulated_dot_general(  # noqa: E731
      a, b, dn, precision, target="gpu", chip=c))
  want = f(None)(x, y)
  np.testing.assert_array_equal(_bits(f(chip)(x, y)), _bits(want))
  np.testing.assert_array_equal(_bits(jax.jit(f(chip))(x, y)), _bits(want))
  if not derived:
    return
  loss = lambda c: lambda a, b: jnp.sum(f(c)(a, b) ** 2)  # noqa: E731
  for g, h in zip(jax.grad(loss(chip), (0, 1))(x, y),
                  jax.grad(loss(None), (0, 1))(x, y)):
    np.testing.assert_array_equal(_bits(g), _bits(h))
  batched = jax.vmap(f(chip), in_axes=(None, 2), out_axes=2)(x, y[..., None])
  np.testing.assert_array_equal(_bits(batched[..., 0]), _bits(want))


def _three_models():
  """Inputs on which the default model, an A100 and an H100 all differ:
  column 0 is ``1 + 3 * 2**-25`` (nearest: up; truncated: down), column 1
  ``1 + 2**-25 + 2**-25 + 2**-24`` (25 fraction bits keep the small terms,
  24 do not)."""
  a = np.array([[1.0, 2.0**-12, 2.0**-13, 2.0**-12]], np.float32)
  b = np.array([[1.0, 1.0], [3 * 2.0**-13, 2.0**-13], [0.0, 2.0**-12],
                [0.0, 2.0**-12]], np.float32)
  one, up = np.float32(1), np.nextafter(np.float32(1), np.float32(2))
  want = {None: [up, one], "a100": [one, one], "h100": [one, up]}
  return jnp.asarray(a), jnp.asarray(b), want


def test_chip_is_part_of_every_cache_key():
  """One function, one process: the default model, an A100 and an H100 give
  different programs and their own bits, whichever ran first, eagerly, under
  ``jax.jit``, through ``emulate`` and through its gradient."""
  a, b, want = _three_models()
  f = lambda x, y: x @ y  # noqa: E731
  texts = {}
  for chip in (None, "a100", "h100", None, "h100", "a100"):
    eager = jaxprec.emulated_dot_general(a, b, DN, "tensorfloat32",
                                         target="gpu", chip=chip)
    np.testing.assert_array_equal(np.asarray(eager)[0], want[chip])
    g = jaxprec.emulate(f, target="gpu", chip=chip)
    np.testing.assert_array_equal(np.asarray(jax.jit(g)(a, b))[0], want[chip])
    np.testing.assert_array_equal(np.asarray(g(a, b))[0], want[chip])
    # The gradient's dot (a.T @ ct, ct = ones) reads b's rows as products:
    # it runs on the chip too.
    grad = jax.grad(lambda y, g=g: jnp.sum(g(b.T, y)))(a.T)
    assert grad.shape == a.T.shape
    texts.setdefault(chip, jax.jit(g).lower(a, b).as_text())
  assert len(set(texts.values())) == 3


def test_fp8_fast_accum_keeps_a_narrow_accumulator_and_promotion_fixes_it():
  """An H100's float8 accumulator keeps 13 fraction bits over the whole K
  under FAST_ACCUM (DeepSeek-V3: "around 14 bits"): with positive terms at
  K = 4096 the sum is 7% low here, each product truncated against a sum
  2**11 times larger; the other presets add it to a float32 sum every 128
  elements (or the interval given), which leaves below 1e-3."""
  rng = np.random.default_rng(6)
  k = 4096
  a = np.abs(rng.standard_normal((4, k))).astype(_F8)
  b = np.abs(rng.standard_normal((k, 4))).astype(_F8)
  exact = a.astype(np.float64) @ b.astype(np.float64)
  x, y = jnp.asarray(a), jnp.asarray(b)
  run = lambda p, chip="h100", **kw: np.asarray(  # noqa: E731
      jaxprec.emulated_dot_general(x, y, DN, p, jnp.float32, target="gpu",
                                   chip=chip, **kw), np.float64)
  fast = run("ANY_F8_ANY_F8_F32_FAST_ACCUM")
  promoted = run("ANY_F8_ANY_F8_F32")
  assert np.all((exact - fast) / exact > 1e-2)  # truncation: always below
  assert np.all((exact - promoted) / exact < 1e-3)
  assert np.all(promoted <= exact)
  # One interval of the whole K is FAST_ACCUM; promotion every 256 is the
  # float32 sum of 256-element chunks.
  np.testing.assert_array_equal(
      run("ANY_F8_ANY_F8_F32", fp8_promotion_interval=k), fast)
  chunks = [np.asarray(jaxprec.emulated_dot_general(
      x[:, i:i + 256], y[i:i + 256], DN, "ANY_F8_ANY_F8_F32_FAST_ACCUM",
      jnp.float32, target="gpu", chip="h100")) for i in range(0, k, 256)]
  total = np.zeros((4, 4), np.float32)
  for c in chunks:
    total = total + c
  np.testing.assert_array_equal(
      run("ANY_F8_ANY_F8_F32", fp8_promotion_interval=256),
      total.astype(np.float64))
  # A B200 accumulates float8 at 25 bits (MMA-Sim's TCGen05MMA).
  assert np.all(np.abs(run("ANY_F8_ANY_F8_F32_FAST_ACCUM", "b200") - exact)
                / exact < 1e-5)


def test_vector_dot_is_float32_on_a_gpu():
  """XLA:GPU strength-reduces a vector·vector dot (and a small matrix·vector
  one) to multiply + reduce, float32 at a precision level; an explicit TF32
  algorithm keeps TF32."""
  rng = np.random.default_rng(7)
  v = jnp.asarray(rng.standard_normal((64, 96)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((64, 96)).astype(np.float32))
  dn = (((1,), (1,)), ((0,), (0,)))  # 64 batched vector·vector dots
  exact = lax.dot_general(v, w, dn, precision=lax.Precision.HIGHEST)
  for chip in (None, "h100"):
    got = jaxprec.emulated_dot_general(v, w, dn, target="gpu", chip=chip)
    np.testing.assert_array_equal(_bits(got), _bits(exact))
  tf32 = jaxprec.emulated_dot_general(v, w, dn, "TF32_TF32_F32", target="gpu")
  assert np.any(_bits(tf32) != _bits(exact))
  # A small matrix·vector dot ((64 + 1) * 96 < 1e7) is strength-reduced
  # too (dot_strength_reduction.cc); a matrix·matrix dot keeps TF32.
  mv = jaxprec.emulated_dot_general(v, w[0], DN, target="gpu")
  np.testing.assert_array_equal(
      _bits(mv), _bits(lax.dot(v, w[0], precision=lax.Precision.HIGHEST)))
  mm = jaxprec.emulated_dot_general(v, w[:2].T, DN, target="gpu")
  assert np.any(_bits(mm) != _bits(v @ w[:2].T))


def test_bad_chips_are_named():
  a = jnp.ones((2, 8))
  with pytest.raises(ValueError, match="Unknown chip 'h200'.*'a100', 'h100', "
                     "'b200'.*Did you mean 'h100'"):
    jaxprec.emulated_dot_general(a, a.T, DN, target="gpu", chip="h200")
  with pytest.raises(ValueError, match="needs target='gpu'"):
    jaxprec.emulated_dot_general(a, a.T, DN, target="tpu", chip="a100")
  with pytest.raises(ValueError, match="Unknown chip"):
    jaxprec.emulate(lambda x: x @ x.T, target="gpu", chip="v100")
  with pytest.raises(ValueError, match="multiple of 32"):
    jaxprec.emulate(lambda x: x @ x.T, target="gpu", chip="h100",
                    fp8_promotion_interval=100)
  f8 = a.astype(jnp.float8_e4m3fn)
  with pytest.raises(NotImplementedError, match="no float8 tensor-core"):
    jaxprec.emulated_dot_general(f8, f8.T, DN, "ANY_F8_ANY_F8_F32",
                                 target="gpu", chip="a100")
  with pytest.warns(NotModelledWarning, match="chip='h100'"):
    jaxprec.emulated_dot_general(f8, f8.T, DN, "ANY_F8_ANY_F8_F32_FAST_ACCUM",
                                 target="gpu")
  conv = jaxprec.emulate(
      lambda p, q: lax.conv_general_dilated(p, q, (1,), "VALID"),
      target="gpu", chip="a100")
  with pytest.warns(NotModelledWarning, match="dots only"):
    conv(jnp.ones((1, 1, 8)), jnp.ones((1, 1, 3)))


def test_bfloat16_operands_run_on_the_chip():
  """Two bfloat16 operands (native without a chip) take the chip's bfloat16
  instruction; the result type stays the op's own."""
  a, b, want = _three_models()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = jaxprec.emulated_dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), DN,
        preferred_element_type=jnp.float32, target="gpu", chip="h100")
  assert out.dtype == jnp.float32
  # bfloat16 operands: 2**-12, 3 * 2**-13 etc. are bfloat16 values.
  np.testing.assert_array_equal(np.asarray(out)[0], want["h100"])
  plain = jaxprec.emulated_dot_general(
      a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), DN, target="gpu",
      chip="h100")
  assert plain.dtype == jnp.bfloat16


def test_audit_shows_the_vector_dot_rule():
  r = jaxprec.audit(lambda v, w, m: (v @ w, m @ w), jnp.ones(8), jnp.ones(8),
                    jnp.ones((4, 8)))
  vv, mv = r.rows
  assert (vv.gpu, vv.shape_rule) == ("f32",
                                     "f32: vector·vector, strength-reduced")
  # A small matrix·vector dot is strength-reduced too ((4 + 1) * 8 < 1e7).
  assert (mv.gpu, mv.shape_rule) == ("f32",
                                     "f32: matrix·vector, strength-reduced")
  assert "f32: vector·vector, strength-reduced" in str(r)
