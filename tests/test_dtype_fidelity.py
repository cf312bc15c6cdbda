"""bfloat16 compute under jaxprec.emulate: one rounding per op, float32 dots.

The references are NumPy + ml_dtypes, independent of JAX: each op in float32
(or exactly, in float64), its result rounded to bfloat16 once. The bound
(docs/fidelity.md, "bfloat16 compute"):

* an op whose float32 result is correctly rounded (+ - * / sqrt) and a dot
  whose sums are exact in float32: bit for bit;
* otherwise the float32 value before the rounding is within a known slack of
  the reference's (a dot: ``k * 2**-24 * sum|products|``; a LayerNorm's
  reductions and rsqrt: an error model, stated below), and the bfloat16 result
  is bit for bit the reference's unless that slack straddles a rounding
  midpoint, where it is one of the two neighbours (within 1 bfloat16 ulp).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.jaxpr import walker

BF16 = ml_dtypes.bfloat16
EPS32 = 2.0**-24


def rb(v) -> np.ndarray:
  """float32 values rounded once to bfloat16 (float64 holding them).

  ``v`` must already be float32 (the op's float32 result): rounding float64 to
  float32 and then to bfloat16 would be two roundings.
  """
  v = np.asarray(v)
  assert v.dtype == np.float32, v.dtype
  return v.astype(BF16).astype(np.float64)


def rb64(v) -> np.ndarray:
  """Exact (float64) values rounded once to bfloat16, via ml_dtypes."""
  return np.asarray(v, np.float64).astype(BF16).astype(np.float64)


def f32(v) -> np.ndarray:
  return np.asarray(v, np.float64).astype(np.float32)


def bits(x) -> np.ndarray:
  return np.asarray(x).astype(BF16).view(np.uint16)


def assert_rounded_within(got, lo, hi) -> float:
  """``got`` (bfloat16) is a rounding of a value in ``[lo, hi]`` (float64).

  Bit for bit ``round(lo)`` wherever ``round(lo) == round(hi)``; elsewhere one
  of the values between them (1 ulp apart when the slack is below half an
  ulp). Returns the fraction of elements whose rounding is determined.
  """
  got = np.asarray(got).astype(np.float64)
  r_lo, r_hi = rb64(lo), rb64(hi)
  sure = r_lo == r_hi
  np.testing.assert_array_equal(got[sure], r_lo[sure])
  assert np.all((got >= r_lo) & (got <= r_hi)), np.argwhere(
      (got < r_lo) | (got > r_hi))[:5]
  return float(np.mean(sure))


def variants(fn):
  """``fn`` run jitted and eagerly (jaxprec.emulate keeps a trace cache)."""
  return {"jit": jax.jit(fn), "eager": fn}


# ---------------------------------------------------------------------------
# Elementwise ops: float32 math, one rounding per jaxpr op.


def _chain(x, y):
  a = x * y + x                 # mul, add
  b = lax.integer_pow(a, 3)     # x**3 (gelu's tanh form): ONE rounding
  c = b / (y * y + 1)           # square-ish, add, div
  d = jnp.sqrt(jnp.abs(c)) - a  # sqrt, sub
  return lax.square(d) + jnp.float32(0.5).astype(jnp.bfloat16)


def _chain_ref(x, y):
  X, Y = (np.asarray(v).astype(np.float32) for v in (x, y))
  o = lambda v: rb(v).astype(np.float32)  # noqa: E731  one op, one rounding
  a = o(o(X * Y) + X)
  b = o(a * a * a)                        # float32 product, rounded once
  c = o(b / o(o(Y * Y) + np.float32(1)))
  d = o(o(np.sqrt(np.abs(c))) - a)
  return rb(o(d * d) + np.float32(0.5))


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("seed", [0, 1])
def test_elementwise_bf16_ops_round_once_each_bit_for_bit(mode, seed):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(20000) * 3).astype(BF16)
  y = rng.standard_normal(20000).astype(BF16)
  emulated = variants(jaxprec.emulate(_chain, target="tpu"))[mode]
  got = emulated(jnp.asarray(x), jnp.asarray(y))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(bits(got), bits(_chain_ref(x, y)))


def test_xla_cpu_rounds_inside_integer_pow_and_logistic_natively():
  """What XLA:CPU does (jax 0.10.2, docs/fidelity.md): ``integer_pow`` and
  ``logistic`` lower to several bfloat16 HLO ops, each rounded, so native
  results differ from one rounding per jaxpr op; the emulation rounds once."""
  if jax.default_backend() != "cpu":
    pytest.skip("measures XLA:CPU")
  x = (np.random.default_rng(3).standard_normal(20000) * 3).astype(BF16)
  X = x.astype(np.float32)
  pow_ref = rb(X * X * X)
  native = np.asarray(jax.jit(lambda a: a**3)(x)).astype(np.float64)
  emulated = np.asarray(jax.jit(jaxprec.emulate(lambda a: a**3))(x))
  assert np.sum(native != pow_ref) > 1000     # two roundings natively
  np.testing.assert_array_equal(emulated.astype(np.float64), pow_ref)
  sig = lambda a: jax.nn.sigmoid(a)  # noqa: E731
  exact = 1 / (1 + np.exp(-x.astype(np.float64)))
  slack = 4 * EPS32 * exact  # XLA's float32 logistic: a few float32 ulps
  got = jax.jit(jaxprec.emulate(sig))(x)
  assert assert_rounded_within(got, exact - slack, exact + slack) > 0.99
  native = np.asarray(jax.jit(sig)(x)).astype(np.float64)
  assert np.sum(native != rb64(exact)) > 1000


def _widened(a, b):
  m = a * b + b                 # bfloat16 ops
  n = m.astype(jnp.float32)     # widened, as Flax's LayerNorm and jnp.mean do
  return n - jnp.mean(n, axis=1, keepdims=True)


def test_xla_cpu_keeps_excess_precision_where_a_bf16_result_is_widened():
  """What XLA:CPU does (jax 0.10.2, docs/fidelity.md): under the default
  ``xla_allow_excess_precision`` the rounding of ``m`` cancels against the
  widening convert, so ``n`` is the unrounded float32 sum; the emulation
  rounds ``m`` as the program says."""
  rng = np.random.default_rng(12)
  a = rng.standard_normal((64, 16)).astype(BF16)
  b = rng.standard_normal(16).astype(BF16)
  A, B = a.astype(np.float32), b.astype(np.float32)
  m = rb(rb(A * B).astype(np.float32) + B).astype(np.float32)
  ref = m - np.mean(m, axis=1, keepdims=True, dtype=np.float32)
  got = np.asarray(jax.jit(jaxprec.emulate(_widened))(a, b))
  np.testing.assert_allclose(got, ref, rtol=0, atol=4 * EPS32 * np.abs(m).max())
  np.testing.assert_array_equal(rb(got + np.mean(m, 1, keepdims=True,
                                                  dtype=np.float32)), m)
  if jax.default_backend() == "cpu":
    native = np.asarray(jax.jit(_widened)(a, b))
    assert np.abs(native - ref).max() > 1e-3


def test_float16_compute_rounds_once_per_op():
  rng = np.random.default_rng(13)
  x = (rng.standard_normal(20000) * 100).astype(np.float16)
  y = rng.standard_normal(20000).astype(np.float16)
  f = lambda u, v: lax.integer_pow(u * v + u, 2) / (v + 3)  # noqa: E731
  X, Y = x.astype(np.float32), y.astype(np.float32)
  o = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
  with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
    a = o(o(X * Y) + X)
    ref = o(o(a * a) / o(Y + np.float32(3))).astype(np.float16)
  got = np.asarray(jax.jit(jaxprec.emulate(f))(x, y))
  assert got.dtype == np.float16 and np.isinf(ref).any()  # overflow exercised
  np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
  k = 256
  a = rng.integers(-64, 65, (4, k)).astype(np.float16)
  b = rng.integers(-64, 65, (k, 3)).astype(np.float16)
  exact = a.astype(np.float64) @ b.astype(np.float64)  # exact in float32
  got = np.asarray(jax.jit(jaxprec.emulate(lambda u, v: u @ v))(a, b))
  np.testing.assert_array_equal(got, exact.astype(np.float32).astype(np.float16))


def test_narrowing_convert_keeps_its_rounding_in_the_compiled_program():
  f = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32) * 3  # noqa: E731
  x = np.random.default_rng(4).standard_normal(4096).astype(np.float32)
  emulated = jax.jit(jaxprec.emulate(f))
  hlo = emulated.lower(x).compile().as_text()
  assert "reduce-precision(" in hlo and "exponent_bits=8, mantissa_bits=7" in hlo
  np.testing.assert_array_equal(np.asarray(emulated(x)),
                                rb(x).astype(np.float32) * np.float32(3))


def _drop_convert_pairs(eqn, invals):
  """A walker rule that computes as XLA with excess precision may: every value
  stays float32 (``f32 -> bf16 -> f32`` convert pairs dropped, as XLA's
  ``simplify-fp-conversions`` does under ``xla_allow_excess_precision``)."""
  wide = [v.astype(jnp.float32) if getattr(v, "dtype", None) == jnp.bfloat16
          else v for v in invals]
  if eqn.primitive.name == "convert_element_type":
    return [wide[0].astype(jnp.float32)]
  return walker.bind_unchanged(eqn, wide)


def test_rounding_survives_excess_precision():
  """The emulation's roundings are ``reduce_precision`` ops, which no
  simplifier drops: with every convert pair removed (what XLA:GPU and
  XLA:CPU's oneDNN path may do) it is still bit for bit the per-op reference,
  while the native program computes in float32 throughout."""
  rng = np.random.default_rng(5)
  x = (rng.standard_normal(20000) * 3).astype(BF16)
  y = rng.standard_normal(20000).astype(BF16)
  ref = bits(_chain_ref(x, y))

  def excess(fn):
    closed = jax.make_jaxpr(fn)(x, y)
    (out,) = walker.interpret(closed, _drop_convert_pairs, jnp.asarray(x),
                              jnp.asarray(y))
    return bits(out)

  np.testing.assert_array_equal(excess(jaxprec.emulate(_chain)), ref)
  assert np.mean(excess(_chain) != ref) > 0.1


# ---------------------------------------------------------------------------
# Dots and reductions: float32 accumulation, one rounding.


def test_bf16_dot_accumulates_in_float32_and_rounds_once():
  rng = np.random.default_rng(6)
  k = 2048
  # Exact sums: integers below 2**24 in every order; the result needs up to
  # 14 significant bits, so the one rounding to bfloat16 is exercised.
  a = rng.integers(-16, 17, (8, k)).astype(BF16)
  b = rng.integers(-16, 17, (k, 4)).astype(BF16)
  exact = a.astype(np.float64) @ b.astype(np.float64)
  emulated = jax.jit(jaxprec.emulate(lambda u, v: u @ v, target="tpu"))
  got = emulated(a, b)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(bits(got), bits(rb64(exact)))
  # A bfloat16 accumulator (rounding every partial sum) would not match.
  acc = np.zeros((8, 4))
  for i in range(k):
    acc = rb64(acc + np.outer(a[:, i], b[i]).astype(np.float64))
  assert np.any(acc != rb64(exact))
  # Random values: within the float32 accumulation slack, then one rounding
  # (a shorter contraction, so that the worst-case slack decides most).
  k = 64
  a = rng.standard_normal((64, k)).astype(BF16)
  b = rng.standard_normal((k, 32)).astype(BF16)
  A, B = a.astype(np.float64), b.astype(np.float64)
  exact, mag = A @ B, np.abs(A) @ np.abs(B)
  slack = k * EPS32 * mag
  assert assert_rounded_within(emulated(a, b), exact - slack, exact + slack) > 0.9


def test_bf16_dot_with_float32_output_is_not_rounded():
  rng = np.random.default_rng(7)
  a = rng.integers(-100, 101, (4, 64)).astype(BF16)
  b = rng.integers(-100, 101, (64, 3)).astype(BF16)
  f = lambda u, v: lax.dot(u, v, preferred_element_type=jnp.float32)  # noqa: E731
  got = jax.jit(jaxprec.emulate(f))(a, b)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(
      np.asarray(got), a.astype(np.float64) @ b.astype(np.float64))


def test_bf16_reduce_sum_accumulates_in_float32_and_rounds_once():
  """``lax.reduce_sum`` on bfloat16 (``jnp.sum`` widens by itself): float32
  sums and one rounding, as on a TPU; XLA:CPU would add in bfloat16."""
  x = np.random.default_rng(8).integers(-64, 65, (4, 1024)).astype(BF16)
  f = lambda v: lax.reduce_sum(v, (1,))  # noqa: E731
  exact = x.astype(np.float64).sum(axis=1)  # exact in float32 in any order
  got = jax.jit(jaxprec.emulate(f))(x)
  np.testing.assert_array_equal(bits(got), bits(rb64(exact)))
  assert got.dtype == jnp.bfloat16
  if jax.default_backend() == "cpu":
    assert np.any(bits(jax.jit(f)(x)) != bits(rb64(exact)))


# ---------------------------------------------------------------------------
# A small MLP with a LayerNorm, linen, dtype=bfloat16, float32 parameters.


class MLP(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
    x = nn.LayerNorm(epsilon=self.eps, dtype=jnp.bfloat16,
                     param_dtype=jnp.float32)(x)
    x = nn.relu(x)
    return nn.Dense(8, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)


def _hadamard(n: int) -> np.ndarray:
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def _exact_mlp_case(rng):
  """Inputs and parameters whose every float32 sum, mean and variance is
  exact, and whose LayerNorm variances are powers of 4 (exact rsqrt)."""
  n, f = 32, 16
  w0 = _hadamard(f) / 4                      # orthogonal, entries +-1/4
  b0 = np.full(f, 0.5)
  signs = np.array([rng.permutation([1.0] * 8 + [-1.0] * 8) for _ in range(n)])
  d = 2.0 ** rng.integers(-1, 2, (n, 1))     # row spread: variance d**2
  c = rng.integers(-8, 9, (n, 1)) / 4        # row mean
  h = c + d * signs                          # the first Dense's output
  x = (h - b0) @ w0.T                        # so that x @ w0 + b0 == h
  params = {"params": {
      "Dense_0": {"kernel": w0, "bias": b0},
      "LayerNorm_0": {"scale": rng.integers(1, 9, f) / 4,
                      "bias": rng.integers(-8, 9, f) / 8},
      "Dense_1": {"kernel": rng.integers(-64, 65, (f, 8)) / 64,
                  "bias": rng.standard_normal(8)},
  }}
  params = jax.tree.map(lambda v: np.asarray(v, np.float32), params)
  assert np.array_equal(x.astype(BF16).astype(np.float64), x)  # x is bf16
  return x.astype(np.float32), params


def _mlp_ref(x, p):
  """Per-op NumPy reference of MLP (Flax's op order, float32 LayerNorm).

  Returns the output and Dense_1's exact dot (float64), before its rounding.
  """
  p = p["params"]
  o = lambda v: rb(v).astype(np.float32)  # noqa: E731
  dots = []

  def dense(v, q):
    s = v.astype(np.float64) @ rb(q["kernel"])  # exact here (see the case)
    dots.append(s)
    return o(o(s.astype(np.float32)) + o(q["bias"]))

  h = dense(o(x), p["Dense_0"])
  mean = np.mean(h, axis=1, keepdims=True, dtype=np.float32)
  var = np.maximum(0, np.mean(h * h, axis=1, keepdims=True, dtype=np.float32)
                   - mean * mean)
  mul = (np.float32(1) / np.sqrt(var)) * p["LayerNorm_0"]["scale"]
  y = o((h - mean) * mul + p["LayerNorm_0"]["bias"])
  return rb(dense(np.maximum(y, 0), p["Dense_1"])), dots[-1]


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_mlp_with_layernorm_bit_for_bit_where_sums_are_exact(mode):
  x, params = _exact_mlp_case(np.random.default_rng(9))
  fn = variants(jaxprec.emulate(MLP(eps=0.0).apply, target="tpu"))[mode]
  got = fn(params, x)
  assert got.dtype == jnp.bfloat16
  ref, dot = _mlp_ref(x, params)
  np.testing.assert_array_equal(bits(got), bits(ref))
  assert np.mean(rb64(dot) != dot) > 0.2  # not vacuous: Dense_1's dot rounds


def _module_io(params, x):
  fn = lambda p, v: MLP().apply(p, v, capture_intermediates=True)  # noqa: E731
  out, state = jax.jit(jaxprec.emulate(fn, target="tpu"))(params, x)
  inter = state["intermediates"]
  return out, {k: np.asarray(inter[k]["__call__"][0]).astype(np.float64)
               for k in ("Dense_0", "LayerNorm_0", "Dense_1")}


def _dense_bounds(v, q):
  """[lo, hi] of a bfloat16 Dense's result: its dot (float32 sums, slack
  ``k * 2**-24 * sum|products|``) rounded once, then ``+ bias`` rounded."""
  w = rb(q["kernel"])
  exact, mag = v @ w, np.abs(v) @ np.abs(w)
  slack = v.shape[-1] * EPS32 * mag
  b = rb(q["bias"])
  return tuple(rb(f32(rb64(s)) + f32(b)) for s in (exact - slack, exact + slack))


def test_mlp_with_layernorm_random_inputs_within_one_bf16_ulp():
  """Random inputs, each module checked from the inputs it got: its result is
  bit for bit the per-op reference except where the float32 slack straddles
  a bfloat16 rounding midpoint, and there within 1 ulp.

  The Dense slack is proven (float32 accumulation of exact products). The
  LayerNorm slack is an error model: its float32 value is within
  ``16 * 2**-24 * (|normalized| + |bias| + |scale| * (1 + |mean| / sigma))``
  of the exact one (measured on 65,536 rows: at most 2.04 of those units, so
  the model has a margin of 8), far below half a bfloat16 ulp.
  """
  rng = np.random.default_rng(10)
  x = (rng.standard_normal((64, 12)) * 2).astype(np.float32)
  model = MLP()
  params = model.init(jax.random.key(0), x)
  params = jax.tree.map(  # non-trivial LayerNorm scale and bias
      lambda v: v + np.float32(rng.standard_normal(v.shape) * 0.5), params)
  out, io = _module_io(params, x)
  p = jax.tree.map(lambda v: np.asarray(v, np.float32), params["params"])
  # Dense_0 from the input rounded to bfloat16 (Flax casts it).
  lo, hi = _dense_bounds(rb(x), p["Dense_0"])
  assert assert_rounded_within(io["Dense_0"], lo, hi) > 0.95
  # LayerNorm from the Dense_0 output it got: exact float64, then slack.
  h = io["Dense_0"]
  mean, var = h.mean(1, keepdims=True), h.var(1, keepdims=True)
  norm = (h - mean) / np.sqrt(var + 1e-6) * p["LayerNorm_0"]["scale"]
  y = norm + p["LayerNorm_0"]["bias"]
  scale, sigma = np.abs(p["LayerNorm_0"]["scale"]), np.sqrt(var + 1e-6)
  slack = 2.0**-20 * (np.abs(norm) + np.abs(p["LayerNorm_0"]["bias"])
                      + scale * (1 + np.abs(mean) / sigma))
  assert assert_rounded_within(io["LayerNorm_0"], y - slack, y + slack) > 0.95
  # Dense_1 from relu(LayerNorm output).
  lo, hi = _dense_bounds(np.maximum(io["LayerNorm_0"], 0), p["Dense_1"])
  assert assert_rounded_within(io["Dense_1"], lo, hi) > 0.95
  np.testing.assert_array_equal(bits(out), bits(io["Dense_1"]))


def test_gradients_of_a_bf16_model_run_emulated():
  x, params = _exact_mlp_case(np.random.default_rng(11))
  loss = lambda p, v: jnp.sum(MLP(eps=0.0).apply(p, v).astype(jnp.float32))  # noqa: E731
  g = jax.jit(jax.grad(jaxprec.emulate(loss)))(params, x)
  g2 = jax.jit(jaxprec.emulate(jax.grad(loss)))(params, x)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g2)):
    assert a.dtype == jnp.float32 and np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=2**-7, atol=2**-7)


@pytest.mark.skipif(not hasattr(lax, "fmuladd"),
                    reason=f"jax {jax.__version__} has no lax.fmuladd (0.12.1+)")
def test_bf16_fmuladd_is_a_float32_fma_rounded_once_and_fma_runs_as_written():
  # A TPU computes a bfloat16 fmuladd as a float32 fma rounded to bfloat16
  # (jax.lax.fmuladd's docstring): exact in float64 here (the products of
  # bfloat16 values have 16 bits, and the sums below lose none), then float32,
  # then bfloat16.
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(512).astype(BF16) for _ in range(3))
  got = jax.jit(jaxprec.emulate(lax.fmuladd))(a, b, c)
  exact = (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64))
  np.testing.assert_array_equal(bits(got), bits(rb(f32(exact))))
  # fma rounds once in its own dtype: widening would round twice, so the
  # emulation leaves it as written (XLA:CPU rejects a bfloat16 fma).
  jaxpr = jax.make_jaxpr(jaxprec.emulate(lax.fma))(a, b, c)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "fma"]
  assert all(v.aval.dtype == jnp.bfloat16 for v in eqn.invars)
  assert walker.classify("fma") == walker.classify("fmuladd") == "no_matmul"
