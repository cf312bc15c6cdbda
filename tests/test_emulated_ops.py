"""Emulated dot_general / conv_general_dilated against tests/reference.py."""

import functools
import re

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.emulation.emulated_ops import algorithm_for

import hlo_passes
import reference as ref

D = lax.DotAlgorithmPreset
P = lax.Precision
MATMUL = (((1,), (0,)), ((), ()))
F32 = np.float32

# How to ask for each algorithm: (target, precision).
HOW = {
    "bf16x1": ("tpu", "default"),
    "bf16x3": ("tpu", "high"),
    "bf16x6": ("tpu", "highest"),
    "bf16x9": ("tpu", "BF16_BF16_F32_X9"),
    "tf32": ("gpu", "default"),
    "tf32x3": ("gpu", "TF32_TF32_F32_X3"),
    "f16": ("tpu", "F16_F16_F32"),
    "f16_f16_f16": ("gpu", "F16_F16_F16"),
    "bf16_bf16_bf16": ("gpu", "BF16_BF16_BF16"),
    "f32": ("gpu", "highest"),
}
ALGORITHMS = tuple(HOW)
KERNELS = ("bf16", "f32")


@pytest.fixture(autouse=True, params=KERNELS)
def kernel(request):
  """Every test here runs on both kernels, whatever the CPU."""
  with jaxprec.use_kernel(request.param):
    yield request.param


@functools.cache
def host_flushes_subnormals() -> bool:
  """XLA:CPU float arithmetic flushes subnormals to zero."""
  return float(jax.jit(lambda a: a * a)(np.float32(2.0**-70))) == 0.0


def assert_same(actual, expected):
  """Bit-identical, except that NaN matches NaN and +0 matches -0.

  Zero signs are not compared: a float32 accumulator starts at +0, so
  ``0 + (-0) = +0`` may or may not happen depending on the kernel.
  """
  a, e = np.asarray(actual, F32), np.asarray(expected, F32)
  assert a.shape == e.shape
  same = (ref.bits(a) == ref.bits(e)) | (np.isnan(a) & np.isnan(e)) | (
      (a == 0) & (e == 0))
  if not same.all():
    i = np.flatnonzero(~same)[:6]
    raise AssertionError(f"{(~same).sum()} of {same.size} differ: got "
                         f"{a.ravel()[i]} expected {e.ravel()[i]}")


def assert_k1(got, lhs, rhs, algorithm, contract, kernel, *,
              tf32_rounding="nearest"):
  """Contraction length 1: XLA's bits (bf16 kernel, or one pass), else close.

  The f32 kernel merges passes: its finite results are within the bound of
  the exact sum of XLA's products, and its NaN and infinities are XLA's
  except where that exact sum overflows float32 (documented in
  jaxprec/_src/emulation/passes.py).
  """
  want = ref.emulate(lhs, rhs, algorithm, contract, tf32_rounding=tf32_rounding,
                     ftz=host_flushes_subnormals())
  if kernel == "bf16" or algorithm not in ("bf16x3", "bf16x6", "bf16x9",
                                           "tf32x3"):
    assert_same(got, want)
    return
  got = np.asarray(got, F32)
  with np.errstate(invalid="ignore", over="ignore"):
    total, mag = ref.exact(lhs, rhs, algorithm, contract,
                           tf32_rounding=tf32_rounding)
    overflow = np.abs(total) > np.finfo(F32).max
  np.testing.assert_array_equal(np.isnan(got) | overflow,
                                np.isnan(want) | overflow)
  np.testing.assert_array_equal(np.isinf(got) | overflow,
                                np.isinf(want) | overflow)
  both = np.isfinite(got) & np.isfinite(want)
  err = np.where(both, np.abs(got.astype(np.float64) - np.where(both, want, 0)), 0)
  assert (err[both] <= ref.error_bound(1, algorithm, mag)[both]).all()


def emulated(algorithm, *, jit=True, tf32_rounding="nearest", dn=MATMUL):
  target, precision = HOW[algorithm]
  # The algorithm's definition on every shape: a TPU's matrix-vector rule
  # (float32 at DEFAULT) is off here; tests/test_shape_rules.py tests it.
  rule = {"tpu_matvec_f32": False} if target == "tpu" else {}
  fn = functools.partial(jaxprec.emulated_dot_general, dimension_numbers=dn,
                         precision=precision, target=target,
                         tf32_rounding=tf32_rounding, **rule)
  return jax.jit(fn) if jit else fn


# Operand values that exercise every branch: split bits, signed zeros,
# infinities, NaN, overflow, products that underflow, subnormals, and the
# float16 range.
_BASE = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3e38, -2.5e38, 1e20,
         1e-20, 2.0**-62, 2.0**-120 * 1.37, 1e-40, -3e-39, 1 + 2.0**-8,
         1 + 2.0**-12 + 2.0**-20, 70000.0, 65519.0, 6e-8, 2.0**-20,
         -7.123456789, 1234.5678, 3.3961776e38]


@pytest.fixture(scope="module")
def k1_operands():
  rng = np.random.default_rng(0)
  rand = rng.standard_normal(16) * np.exp2(rng.integers(-30, 30, 16))
  vals = np.concatenate([_BASE, rand]).astype(F32)
  return vals[:, None], vals[None, ::-1].copy()  # (m, 1) and (1, n)


# ---------------------------------------------------------------------------
# Which algorithm.


@pytest.mark.parametrize("precision,target,expected", [
    (None, "tpu", "bf16x1"), ("default", "tpu", "bf16x1"),
    ("bfloat16", "tpu", "bf16x1"), (P.HIGH, "tpu", "bf16x3"),
    ("tensorfloat32", "tpu", "bf16x3"), ("bf16_3x", "tpu", "bf16x3"),
    ((P.HIGHEST, P.HIGHEST), "tpu", "bf16x6"), ("float32", "tpu", "bf16x6"),
    (None, "gpu", "tf32"), ("high", "gpu", "tf32"), ("highest", "gpu", "f32"),
    (D.BF16_BF16_F32, "gpu", "bf16x1"), ("BF16_BF16_F32_X3", "gpu", "bf16x3"),
    ("BF16_BF16_F32_X6", "gpu", "bf16x6"), ("BF16_BF16_F32_X9", "tpu", "bf16x9"),
    ("TF32_TF32_F32", "gpu", "tf32"), ("TF32_TF32_F32_X3", "gpu", "tf32x3"),
    ("F16_F16_F32", "gpu", "f16"), ("F16_F16_F16", "gpu", "f16_f16_f16"),
    ("BF16_BF16_BF16", "tpu", "bf16_bf16_bf16"), ("F32_F32_F32", "gpu", "f32"),
    ("F64_F64_F64", "gpu", "native"), ("ANY_F8_ANY_F8_F32", "gpu", "f8"),
    ("highest", "cpu", "native"), ("default", "native", "native"),
    ("high", "TPU", "bf16x3"),
])
def test_algorithm_for(precision, target, expected):
  assert algorithm_for(precision, target, F32, F32) == expected


def test_algorithm_for_dtypes():
  bf, f16, i8 = jnp.bfloat16, jnp.float16, jnp.int8
  assert algorithm_for("high", "tpu", bf, bf) == "native"
  assert algorithm_for("high", "tpu", f16, f16) == "native"
  assert algorithm_for("high", "tpu", i8, i8) == "native"
  assert algorithm_for("high", "tpu", i8, F32) == "native"
  assert algorithm_for("high", "tpu", F32, bf) == "bf16x3"  # upcast exactly
  for f8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):  # weight-only fp8 too
    assert algorithm_for("high", "tpu", F32, f8) == "bf16x3"
    assert algorithm_for("high", "gpu", f8, F32) == "tf32"
    assert algorithm_for("high", "tpu", f8, f8) == "native"


def test_algorithm_for_conv_takes_levels_only():
  conv = functools.partial(algorithm_for, op="conv_general_dilated")
  assert conv("BF16_BF16_F32_X6", "tpu", F32, F32) == "bf16x1"  # as JAX lowers it
  assert conv("F32_F32_F32", "gpu", F32, F32) == "tf32"
  assert conv("highest", "tpu", F32, F32) == "bf16x6"


def test_algorithm_for_reads_the_config():
  with jax.default_matmul_precision("float32"):
    assert algorithm_for(None, "tpu", F32, F32) == "bf16x6"
  with jax.default_matmul_precision("BF16_BF16_F32_X3"):
    assert algorithm_for(None, "gpu", F32, F32) == "bf16x3"


# ---------------------------------------------------------------------------
# Contraction length 1: bit for bit.


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_k1_bit_exact(algorithm, jit, k1_operands, kernel):
  lhs, rhs = k1_operands
  got = emulated(algorithm, jit=jit)(lhs, rhs)
  assert got.dtype == jnp.float32
  assert_k1(got, lhs, rhs, algorithm, ref.dot_general(MATMUL), kernel)


@pytest.mark.parametrize("algorithm", ["tf32", "tf32x3"])
@pytest.mark.parametrize("rounding", ["nearest_away", "truncate"])
def test_k1_bit_exact_tf32_roundings(algorithm, rounding, k1_operands, kernel):
  lhs, rhs = k1_operands
  got = emulated(algorithm, tf32_rounding=rounding)(lhs, rhs)
  assert_k1(got, lhs, rhs, algorithm, ref.dot_general(MATMUL), kernel,
            tf32_rounding=rounding)


def test_nan_replacement_matters():
  # XLA's comment (b/115844437): 1.0 x inf has lo(1.0) = 0 and lo(inf) = NaN,
  # so the small passes are NaN; replacing them keeps the answer inf.
  lhs, rhs = np.array([[1.0]], F32), np.array([[np.inf]], F32)
  for algorithm in ("bf16x3", "bf16x6", "bf16x9", "tf32x3"):
    assert float(emulated(algorithm)(lhs, rhs)[0, 0]) == np.inf
  # ... where a plain sum of the three passes would give NaN.
  split = jaxprec._src.emulation.rounding.split_bf16
  (lh, ll), (rh, rl) = ([np.asarray(p, F32) for p in split(v, 2)] for v in (lhs, rhs))
  with np.errstate(invalid="ignore"):
    assert np.isnan(ll * rh + lh * rl + lh * rh)


@pytest.mark.parametrize("algorithm", ["bf16x1", "bf16x3", "bf16x6", "tf32x3"])
def test_k1_bit_exact_with_batch_dims(algorithm, kernel):
  rng = np.random.default_rng(5)
  lhs = (rng.standard_normal((3, 1, 5)) * 10).astype(F32)  # (batch, k, m)
  rhs = rng.standard_normal((4, 3, 1)).astype(F32)          # (n, batch, k)
  dn = (((1,), (2,)), ((0,), (1,)))
  got = emulated(algorithm, dn=dn, jit=True)(lhs, rhs)
  assert got.shape == (3, 5, 4)
  assert_k1(got, lhs, rhs, algorithm, ref.dot_general(dn), kernel)


# ---------------------------------------------------------------------------
# General shapes: within the bound of the exact sum of the same products.


@st.composite
def dot_problems(draw):
  batch = draw(st.lists(st.integers(1, 3), max_size=2))
  lfree = draw(st.lists(st.integers(1, 7), max_size=1))
  rfree = draw(st.lists(st.integers(1, 7), max_size=2))
  contract = draw(st.lists(st.integers(1, 33), min_size=1, max_size=2))
  nb, nl, nc = len(batch), len(lfree), len(contract)
  # lhs axes: batch, free, contracting, in a random order (rhs likewise)
  lperm = draw(st.permutations(range(nb + nl + nc)))
  rperm = draw(st.permutations(range(nb + len(rfree) + nc)))
  lshape_canon = batch + lfree + contract
  rshape_canon = batch + contract + rfree
  lshape = [lshape_canon[p] for p in lperm]
  rshape = [rshape_canon[p] for p in rperm]
  lpos = {p: i for i, p in enumerate(lperm)}
  rpos = {p: i for i, p in enumerate(rperm)}
  dn = ((tuple(lpos[nb + nl + i] for i in range(nc)),
         tuple(rpos[nb + i] for i in range(nc))),
        (tuple(lpos[i] for i in range(nb)), tuple(rpos[i] for i in range(nb))))
  seed = draw(st.integers(0, 2**32 - 1))
  return lshape, rshape, dn, seed


def _random(rng, shape):
  # random significands and exponents, so that the splits' low bits matter
  return (rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, shape))).astype(F32)


@pytest.mark.parametrize("algorithm", ["bf16x1", "bf16x3", "bf16x6", "bf16x9",
                                       "tf32x3", "f16"])
@hypothesis.settings(max_examples=8, deadline=None, derandomize=True,
                     suppress_health_check=[
                         hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(problem=dot_problems())
def test_general_shapes_within_bound(algorithm, problem):
  lshape, rshape, dn, seed = problem
  rng = np.random.default_rng(seed)
  lhs, rhs = _random(rng, lshape), _random(rng, rshape)
  got = np.asarray(emulated(algorithm, dn=dn, jit=True)(lhs, rhs), np.float64)
  total, mag = ref.exact(lhs, rhs, algorithm, ref.dot_general(dn))
  k = int(np.prod([lshape[d] for d in dn[0][0]]))
  assert got.shape == total.shape
  assert (np.abs(got - total) <= ref.error_bound(k, algorithm, mag)).all()


def test_bound_is_tight_enough_to_fail():
  # The same check rejects a result from the wrong algorithm.
  rng = np.random.default_rng(9)
  lhs, rhs = _random(rng, (16, 64)), _random(rng, (64, 8))
  total, mag = ref.exact(lhs, rhs, "bf16x3", ref.dot_general(MATMUL))
  wrong = np.asarray(emulated("bf16x1")(lhs, rhs), np.float64)
  assert (np.abs(wrong - total) > ref.error_bound(64, "bf16x3", mag)).any()


@pytest.fixture(scope="module")
def accuracy():
  """Max error of each algorithm vs the exact float64 product of the inputs."""
  rng = np.random.default_rng(1)
  lhs = rng.standard_normal((128, 256)).astype(F32)
  rhs = rng.standard_normal((256, 64)).astype(F32)
  exact = lhs.astype(np.float64) @ rhs.astype(np.float64)
  scale = np.abs(exact).max()
  err = {a: np.abs(np.asarray(emulated(a, jit=True)(lhs, rhs)) - exact).max() / scale
         for a in ("bf16x1", "bf16x3", "bf16x6", "bf16x9", "tf32", "tf32x3")}
  native = jax.jit(lambda a, b: lax.dot_general(a, b, MATMUL))(lhs, rhs)
  err["native"] = np.abs(np.asarray(native) - exact).max() / scale
  # No float32 result is nearer than the exact product rounded once.
  err["rounded"] = np.abs(exact.astype(F32) - exact).max() / scale
  return err


def test_error_levels(accuracy):
  e = accuracy
  assert 1e-4 < e["bf16x1"] < 1e-2      # bfloat16 operands: 8 bits
  assert e["bf16x3"] < e["bf16x1"] / 100  # about 16 bits
  # Float32 level: within 4x of the CPU's own float32 dot, whose summation
  # order depends on the CPU's dot kernel (it may be the less accurate one).
  assert e["rounded"] <= e["bf16x6"] < 4 * e["native"]
  assert e["bf16x9"] < 4 * e["native"]
  assert e["bf16x1"] / 30 < e["tf32"] < e["bf16x1"] / 3  # 11 bits
  assert e["tf32x3"] < 4 * e["native"]


def test_emulation_differs_from_native():
  rng = np.random.default_rng(2)
  lhs, rhs = _random(rng, (8, 32)), _random(rng, (32, 8))
  native = np.asarray(lax.dot_general(lhs, rhs, MATMUL))
  for algorithm in ("bf16x1", "bf16x3", "bf16x6", "tf32"):
    assert (np.asarray(emulated(algorithm)(lhs, rhs)) != native).any(), algorithm
  np.testing.assert_array_equal(emulated("f32")(lhs, rhs), native)


# ---------------------------------------------------------------------------
# Convolutions, against an explicit im2col reference.

CONV_CASES = [  # strides, padding, lhs_dilation, rhs_dilation, groups
    ((1, 1), ((0, 0), (0, 0)), (1, 1), (1, 1), 1),
    ((2, 1), ((1, 1), (0, 2)), (1, 1), (1, 1), 1),
    ((1, 2), ((2, 1), (1, 1)), (1, 1), (2, 1), 2),
    ((1, 1), ((1, 0), (0, 1)), (2, 1), (1, 2), 1),
]


def _conv(algorithm, strides, padding, lhs_dil, rhs_dil, groups, *, jit=False):
  target, precision = HOW[algorithm]
  fn = functools.partial(
      jaxprec.emulated_conv_general_dilated, window_strides=strides,
      padding=padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil,
      feature_group_count=groups, precision=precision, target=target)
  return jax.jit(fn) if jit else fn


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("algorithm", ["bf16x1", "bf16x3", "bf16x6", "tf32"])
def test_conv_within_bound_of_im2col(algorithm, case):
  strides, padding, lhs_dil, rhs_dil, groups = case
  rng = np.random.default_rng(3)
  x = _random(rng, (2, 4, 7, 6))
  w = _random(rng, (6, 4 // groups, 3, 2))
  got = np.asarray(_conv(algorithm, *case, jit=True)(x, w), np.float64)
  contract = ref.conv2d_nchw(strides, padding, lhs_dil, rhs_dil, groups)
  total, mag = ref.exact(x, w, algorithm, contract)
  assert got.shape == total.shape
  k = (4 // groups) * 3 * 2
  assert (np.abs(got - total) <= ref.error_bound(k, algorithm, mag)).all()


@pytest.mark.parametrize("algorithm", ["bf16x1", "bf16x3", "bf16x6", "tf32"])
def test_conv_k1_bit_exact(algorithm, k1_operands, kernel):
  vals = k1_operands[0].ravel()
  x = vals.reshape(1, 1, 5, 8)  # one channel, 1x1 kernel: one product each
  w = np.array([1 + 2.0**-9, -3.0000002, np.inf, 2.0**-100], F32).reshape(4, 1, 1, 1)
  got = _conv(algorithm, (1, 1), ((0, 0), (0, 0)), (1, 1), (1, 1), 1)(x, w)
  assert_k1(got, x, w, algorithm, ref.conv2d_nchw((1, 1), ((0, 0), (0, 0))),
            kernel)


def test_conv_under_a_preset_runs_at_default():
  # JAX's conv_general_dilated lowering, jax/_src/lax/convolution.py: JAX lowers a conv under a preset at DEFAULT.
  rng = np.random.default_rng(4)
  x, w = _random(rng, (1, 2, 5, 5)), _random(rng, (3, 2, 3, 3))
  conv = functools.partial(jaxprec.emulated_conv_general_dilated,
                           window_strides=(1, 1), padding="SAME")
  default = conv(x, w, precision="default")
  np.testing.assert_array_equal(conv(x, w, precision="BF16_BF16_F32_X6"), default)
  with jax.default_matmul_precision("BF16_BF16_F32_X3"):
    np.testing.assert_array_equal(conv(x, w), default)
  assert (np.asarray(conv(x, w, precision="highest")) != np.asarray(default)).any()


# ---------------------------------------------------------------------------
# Gradients: the backward matmuls are emulated at the forward's algorithm.


@pytest.mark.parametrize("algorithm,jit", [
    ("bf16x1", True), ("bf16x3", True), ("bf16x6", True), ("tf32", True),
    ("bf16x3", False)])
def test_grad_is_the_emulated_transpose(algorithm, jit):
  rng = np.random.default_rng(6)
  lhs, rhs = _random(rng, (5, 7)), _random(rng, (7, 3))
  op = emulated(algorithm, jit=jit)
  grad = jax.grad(lambda a, b: op(a, b).sum(), argnums=(0, 1))
  if jit:
    grad = jax.jit(grad)
  gl, gr = grad(lhs, rhs)
  ones = np.ones((5, 3), F32)
  # d/dlhs sum(lhs @ rhs) = ones @ rhs^T, as JAX's transpose rule writes it
  want_l = emulated(algorithm, dn=(((1,), (1,)), ((), ())))(ones, rhs)
  want_r = emulated(algorithm, dn=(((0,), (0,)), ((), ())))(lhs, ones)
  assert_same(gl, want_l)
  np.testing.assert_allclose(gr, want_r, rtol=1e-6)
  assert (np.asarray(gl) != 0).all()
  native = ones @ rhs.T
  if algorithm != "bf16x6":  # 6 passes of exact-ones products: float32 exact
    assert (np.asarray(gl) != native).any()


def test_grad_under_vmap_and_jit():
  rng = np.random.default_rng(7)
  lhs, rhs = _random(rng, (4, 5, 6)), _random(rng, (6, 3))
  op = emulated("bf16x3")
  per_example = jax.jit(jax.grad(lambda a: (op(a, rhs) ** 2).sum()))
  batched = jax.jit(jax.vmap(per_example))(lhs)
  # A batched dot may sum in another order than four small ones: equal up to
  # float32 accumulation, not bit for bit.
  loop = np.stack([per_example(lhs[i]) for i in range(4)])
  np.testing.assert_allclose(batched, loop, rtol=1e-5, atol=1e-5 * np.abs(loop).max())
  native = jax.vmap(jax.grad(lambda a: (lax.dot_general(a, rhs, MATMUL) ** 2).sum()))(lhs)
  assert np.abs(batched - native).max() > 1e-6 * np.abs(native).max()  # 3 passes: ~2**-17
  values = jax.vmap(lambda a: op(a, rhs))(lhs)
  np.testing.assert_allclose(values[2], op(lhs[2], rhs), rtol=1e-5, atol=1e-4)


def test_second_derivative():
  rng = np.random.default_rng(15)
  lhs, rhs = _random(rng, (3, 4)), _random(rng, (4, 2))
  op = emulated("bf16x3")
  f = lambda a: (op(a, rhs) ** 2).sum()  # noqa: E731
  hess_diag = jax.jit(jax.grad(lambda a: jax.grad(f)(a).sum()))(lhs)
  native = jax.grad(lambda a: jax.grad(
      lambda x: (lax.dot_general(x, rhs, MATMUL, P.HIGHEST) ** 2).sum())(a).sum())(lhs)
  np.testing.assert_allclose(hess_diag, native, rtol=1e-3, atol=1e-3)


def test_forward_mode_is_the_emulated_op_of_the_tangents():
  # The op is bilinear: its tangent is op(dx, w) + op(x, dw), each emulated.
  rng = np.random.default_rng(5)
  x, w = _random(rng, (4, 9)), _random(rng, (9, 3))
  dx, dw = _random(rng, (4, 9)), _random(rng, (9, 3))
  op = emulated("bf16x3")
  out, tangent = jax.jvp(op, (x, w), (dx, dw))
  np.testing.assert_array_equal(out, op(x, w))
  np.testing.assert_array_equal(tangent, op(dx, w) + op(x, dw))
  assert not np.array_equal(tangent, dx @ w + x @ dw)  # emulated, not native


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_grads_use_rounded_operands(groups):
  # bf16x1: each backward conv multiplies bfloat16-rounded operands exactly
  # and sums in float32, which is what the native backward conv computes on
  # rounded inputs; with the unrounded weights it differs.
  rng = np.random.default_rng(8)
  x, w = _random(rng, (2, 4, 6, 6)), _random(rng, (4, 4 // groups, 3, 3))
  kw = dict(window_strides=(2, 1), padding="SAME", feature_group_count=groups)
  emu = functools.partial(jaxprec.emulated_conv_general_dilated,
                          precision="default", target="tpu", **kw)
  nat = functools.partial(lax.conv_general_dilated, precision=P.HIGHEST, **kw)
  gx, gw = jax.grad(lambda a, b: emu(a, b).sum(), argnums=(0, 1))(x, w)
  rx, rw = (np.asarray(jaxprec.round_to(v, "bf16")) for v in (x, w))
  _, vjp = jax.vjp(nat, rx, rw)
  want_x, want_w = vjp(np.ones(emu(x, w).shape, F32))
  np.testing.assert_allclose(gx, want_x, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gw, want_w, rtol=1e-5, atol=1e-5)
  _, vjp_unrounded = jax.vjp(nat, x, w)
  ct = np.ones(emu(x, w).shape, F32)
  assert np.abs(gx - vjp_unrounded(ct)[0]).max() > 1e-3


# ---------------------------------------------------------------------------
# Drop-in use.


def test_flax_dense_and_conv_injections():
  rng = np.random.default_rng(10)
  x = _random(rng, (2, 5, 5, 3))
  dg = functools.partial(jaxprec.emulated_dot_general, target="tpu")
  cg = functools.partial(jaxprec.emulated_conv_general_dilated, target="tpu")
  dense = nn.Dense(4, dot_general=dg, precision="highest")
  params = dense.init(jax.random.key(0), x)
  y = dense.apply(params, x)
  kernel, bias = params["params"]["kernel"], params["params"]["bias"]
  want = jaxprec.emulated_dot_general(x, kernel, (((3,), (0,)), ((), ())),
                                      "highest") + bias
  np.testing.assert_array_equal(y, want)
  conv = nn.Conv(4, (3, 3), conv_general_dilated=cg, padding="SAME")
  cparams = conv.init(jax.random.key(1), x)
  yc = jax.jit(conv.apply)(cparams, x)
  native = nn.Conv(4, (3, 3), padding="SAME").apply(cparams, x)
  assert yc.shape == native.shape
  rel = np.abs(np.asarray(yc) - native).max() / np.abs(native).max()
  assert 1e-5 < rel < 1e-2  # bfloat16 level


def test_native_paths_are_lax():
  rng = np.random.default_rng(11)
  a, b = _random(rng, (4, 6)), _random(rng, (6, 2))
  np.testing.assert_array_equal(
      jaxprec.emulated_dot_general(a, b, MATMUL, "default", target="cpu"),
      lax.dot_general(a, b, MATMUL))
  ab, bb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  np.testing.assert_array_equal(
      jaxprec.emulated_dot_general(ab, bb, MATMUL, "high",
                                   preferred_element_type=F32),
      lax.dot_general(ab, bb, MATMUL, preferred_element_type=F32))
  ai, bi = np.arange(6).reshape(2, 3), np.arange(6).reshape(3, 2)
  np.testing.assert_array_equal(jaxprec.emulated_dot_general(ai, bi, MATMUL),
                                ai @ bi)


def test_mixed_dtypes_and_result_dtype():
  rng = np.random.default_rng(12)
  a, b = _random(rng, (4, 6)), _random(rng, (6, 2))
  bb = b.astype(jnp.bfloat16)
  np.testing.assert_array_equal(
      jaxprec.emulated_dot_general(a, bb, MATMUL, "high"),
      jaxprec.emulated_dot_general(a, bb.astype(F32), MATMUL, "high"))
  out = jaxprec.emulated_dot_general(a, b, MATMUL, "high",
                                     preferred_element_type=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16


def test_precision_none_reads_the_config():
  rng = np.random.default_rng(13)
  a, b = _random(rng, (4, 6)), _random(rng, (6, 2))
  op = functools.partial(jaxprec.emulated_dot_general, dimension_numbers=MATMUL)
  with jax.default_matmul_precision("float32"):
    np.testing.assert_array_equal(op(a, b), op(a, b, precision="highest"))
  np.testing.assert_array_equal(op(a, b), op(a, b, precision="default"))


@pytest.mark.parametrize("algorithm,bf16_dots,f32_dots", [
    ("bf16x1", 1, 1), ("bf16x3", 3, 2), ("bf16x6", 6, 3), ("bf16x9", 9, 3),
    ("tf32x3", 3, 2)])
def test_lowering_dots_per_kernel(algorithm, bf16_dots, f32_dots, kernel):
  x = np.ones((8, 8), F32)
  txt = jax.jit(emulated(algorithm)).lower(x, x).as_text()
  dots = hlo_passes.dot_lines(txt)
  if kernel == "f32" or algorithm == "tf32x3":
    n = f32_dots if kernel == "f32" else bf16_dots
    assert hlo_passes.passes(txt) == n and not any("bf16" in d for d in dots)
    # The f32 kernel runs its passes as one batched dot.
    assert len(dots) == (1 if kernel == "f32" else n)
  elif algorithm == "bf16x1":
    assert len(dots) == 1 and "bf16>" in dots[0]
  else:
    # An 8 x 8 dot: one bfloat16 dot per rhs part, of the lhs parts it
    # pairs with stacked along M (emulated_ops._grouped_passes): every block
    # a pass.
    assert len(dots) == (2 if algorithm == "bf16x3" else 3), dots
    rows = [int(re.search(r"tensor<(\d+)x8xbf16>, tensor<8x8xbf16>", d).group(1))
            for d in dots]
    assert sum(rows) == 8 * {"bf16x3": 3, "bf16x6": 6, "bf16x9": 9}[algorithm]


@pytest.mark.parametrize("algorithm", ["bf16x1", "bf16x3", "bf16x6"])
def test_lowering_rounds_before_every_narrowing_convert(algorithm, kernel):
  # The rounding is a reduce_precision or a bit mask; a convert to bfloat16
  # only changes the dtype of a value that is already a bfloat16 value, so
  # XLA cannot change the numbers by folding it with a widening convert.
  x = np.ones((8, 8), F32)
  txt = jax.jit(emulated(algorithm)).lower(x, x).as_text()
  defs = {name: (op, re.findall(r"%\w+", rest.split(" : ")[0]))
          for name, op, rest in re.findall(
              r"(%\w+) = (stablehlo\.\w+) ?(.*)", txt)}
  narrowing = re.findall(r"stablehlo.convert (%\w+) : \(tensor<[0-9x]*f32>\) -> "
                         r"tensor<[0-9x]*bf16>", txt)
  # One convert per group of lhs parts stacked along M (a concatenate) or
  # lone lhs part, and per rhs part (X3: 2 + 2, X6: 3 + 3).
  assert len(narrowing) == (0 if kernel == "f32" else {
      "bf16x1": 2, "bf16x3": 4, "bf16x6": 6}[algorithm]), txt

  def rounded(name):
    op, operands = defs[name]
    if op in ("stablehlo.reduce_precision", "stablehlo.bitcast_convert"):
      return True
    if op == "stablehlo.select":
      operands = operands[1:]  # the part's index decides, no value
    return (op in ("stablehlo.concatenate", "stablehlo.reshape",
                   "stablehlo.select", "stablehlo.broadcast_in_dim") and
            all(rounded(o) for o in operands))

  for operand in narrowing:
    assert rounded(operand), (operand, txt)
  compiled = jax.jit(emulated(algorithm)).lower(x, x).compile().as_text()
  assert "reduce-precision(" in compiled


# ---------------------------------------------------------------------------
# Bad input.


def test_bad_target():
  x = np.ones((2, 2), F32)
  with pytest.raises(ValueError, match=r"Unknown emulation target 'tpuu'; valid "
                     r"choices: 'tpu', 'gpu', 'cpu', 'native'\. Did you mean 'tpu'"):
    jaxprec.emulated_dot_general(x, x, MATMUL, target="tpuu")
  with pytest.raises(ValueError, match=r"Unknown emulation target None"):
    jaxprec.emulated_conv_general_dilated(x[None, None], x[None, None], (1, 1),
                                          "SAME", target=None)


def test_bad_precision():
  x = np.ones((2, 2), F32)
  with pytest.raises(ValueError, match=r"Invalid precision 'bfloat61'.*Did you "
                     r"mean 'bfloat16'"):
    jaxprec.emulated_dot_general(x, x, MATMUL, "bfloat61")
  with pytest.raises(ValueError, match=r"Invalid precision 'fastest_3x'"):
    algorithm_for("fastest_3x", "tpu", F32, F32)


def test_bad_options():
  x = np.ones((2, 2), F32)
  with pytest.raises(ValueError, match=r"Unknown tf32_rounding 'round'; valid "
                     r"choices: 'nearest', 'nearest_away', 'truncate'"):
    jaxprec.emulated_dot_general(x, x, MATMUL, target="gpu", tf32_rounding="round")
  with pytest.raises(ValueError, match=r"Unknown op 'matmul'; valid choices: "
                     r"'dot_general', 'conv_general_dilated'"):
    algorithm_for("high", "tpu", F32, F32, op="matmul")
