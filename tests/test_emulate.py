"""jaxprec.emulate: whole functions at TPU/GPU numerics on CPU, gradients included."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.jaxpr import walker

RNG = np.random.default_rng(0)
A = jnp.asarray(RNG.standard_normal((16, 32)), jnp.float32)
B = jnp.asarray(RNG.standard_normal((32, 8)), jnp.float32)


def bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def tf32(x):
  """Round-to-nearest-even to 10 explicit mantissa bits, by integer arithmetic."""
  u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  u = (u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000
  return u.astype(np.uint32).view(np.float32).astype(np.float64)


def f32_bound(a, b):
  """|f32 accumulation error| <= k * 2^-24 * sum_k |a_ik b_kj| (first-order bound)."""
  k = a.shape[-1]
  return k * 2.0**-24 * (np.abs(a) @ np.abs(b)) + 1e-30


def assert_matches_rounded(got, a_r, b_r):
  want = a_r @ b_r  # float64: the exact sum of exact products, up to 2^-53
  err = np.abs(np.asarray(got, np.float64) - want)
  assert np.all(err <= f32_bound(a_r, b_r)), err.max()


def mm(a, b):
  return a @ b


def test_tpu_default_is_one_bf16_pass():
  got = jaxprec.emulate(mm, "bfloat16")(A, B)
  assert_matches_rounded(got, bf16(A), bf16(B))
  native = np.asarray(A, np.float64) @ np.asarray(B, np.float64)
  rel = np.abs(np.asarray(got) - native).max() / np.abs(native).max()
  assert 1e-4 < rel < 3e-2  # bf16 level, and visibly not float32


def test_gpu_default_is_tf32():
  got = jaxprec.emulate(mm, "bfloat16", target="gpu")(A, B)
  assert_matches_rounded(got, tf32(A), tf32(B))
  got_hi = jaxprec.emulate(mm, "float32", target="gpu")(A, B)
  np.testing.assert_array_equal(got_hi, mm(A, B))


def test_levels_order_errors_on_the_same_inputs():
  exact = np.asarray(A, np.float64) @ np.asarray(B, np.float64)
  err = {p: np.abs(np.asarray(jaxprec.emulate(mm, p)(A, B)) - exact).max()
         for p in ("bfloat16", "bfloat16_3x", "float32")}
  assert err["bfloat16_3x"] < err["bfloat16"] / 100
  assert err["float32"] <= 1e-5


def test_explicit_precision_is_kept_and_none_takes_the_argument():
  def f(a, b):
    return jnp.dot(a, b, precision="highest"), a @ b
  hi, lo = jaxprec.emulate(f, "bfloat16")(A, B)
  assert_matches_rounded(lo, bf16(A), bf16(B))
  np.testing.assert_allclose(hi, mm(A, B), rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(hi) - np.asarray(lo)).max() > 1e-3


def test_none_uses_the_precision_in_force_at_trace_time():
  f = jaxprec.emulate(mm)  # precision from the scope
  with jaxprec.precision("bf16"):
    lo = f(A, B)
  with jaxprec.precision("fp32"):
    hi = f(A, B)
  assert_matches_rounded(lo, bf16(A), bf16(B))
  np.testing.assert_allclose(hi, mm(A, B), rtol=1e-5, atol=1e-5)
  lo2 = f(A, B)  # backend default on a TPU is one bf16 pass
  np.testing.assert_array_equal(lo2, lo)


def test_composes_with_jit_grad_vmap_either_order_and_traces_once():
  calls = []

  def g(a, b):
    calls.append(1)
    return jnp.sum(jnp.tanh(a @ b))

  e = jaxprec.emulate(g, "bfloat16")
  j = jax.jit(e)
  v1, v2 = j(A, B), j(A, B)
  assert len(calls) == 1 and v1 == v2
  e(A, B)
  e(A, B)
  assert len(calls) <= 3  # jit's trace, then one eager trace cached
  ga = jax.grad(e)(A, B)
  gb = jaxprec.emulate(jax.grad(g), "bfloat16")(A, B)
  gn = jax.grad(g)(A, B)
  assert np.abs(np.asarray(ga)).max() > 0  # rounding must not zero the gradient
  np.testing.assert_allclose(ga, gb, rtol=1e-6, atol=1e-7)
  assert np.abs(np.asarray(ga) - np.asarray(gn)).max() > 1e-4  # backward is emulated
  batched = jax.vmap(jaxprec.emulate(mm, "bfloat16"), in_axes=(0, None))(
      jnp.stack([A, -A]), B)
  np.testing.assert_array_equal(batched[1], -batched[0])
  assert_matches_rounded(batched[0], bf16(A), bf16(B))
  inner = jaxprec.emulate(jax.vmap(mm, in_axes=(0, None)), "bfloat16")(
      jnp.stack([A, -A]), B)
  np.testing.assert_allclose(inner, batched, rtol=1e-6)


def test_backward_matmuls_are_emulated_at_the_forward_precision():
  # d/da sum(a @ b) = ones @ b^T: on a TPU the transposed dot runs at the same
  # precision, so the gradient is the bf16-rounded b summed in float32.
  g = jax.grad(lambda a: jnp.sum(jaxprec.emulate(mm, "bfloat16")(a, B)))(A)
  want = np.ones((16, 8)) @ bf16(B).T
  np.testing.assert_allclose(g, want, rtol=1e-6)
  assert not np.allclose(g, np.ones((16, 8)) @ np.asarray(B, np.float64).T, rtol=1e-6)


def test_nested_structures_are_emulated_and_kept():
  def f(a, b):
    y = jax.jit(mm)(a, b)
    y2 = jax.checkpoint(mm)(a, b)
    y3, _ = lax.scan(lambda c, _: (c, mm(a, b)), 0.0, None, length=2)
    y4 = lax.cond(True, mm, lambda x, w: x @ w, a, b)
    y5 = jax.nn.relu(mm(a, b))  # relu is a custom_jvp
    return y, y2, y4, y5
  outs = jaxprec.emulate(f, "bfloat16")(A, B)
  for o in outs[:3]:
    assert_matches_rounded(o, bf16(A), bf16(B))
  closed = jax.make_jaxpr(jaxprec.emulate(f, "bfloat16"))(A, B)
  names = {w.eqn.primitive.name for w in walker.iter_eqns(closed)}
  assert {"jit", "remat2", "scan", "cond"} <= names


def test_conv_is_emulated_and_conv_level_follows_presets():
  x = jnp.asarray(RNG.standard_normal((1, 3, 9, 9)), jnp.float32)
  k = jnp.asarray(RNG.standard_normal((4, 3, 3, 3)), jnp.float32)
  conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "VALID")
  lo = jaxprec.emulate(conv, "bfloat16")(x, k)
  ref = lax.conv_general_dilated(jnp.asarray(bf16(x), jnp.float32),
                                 jnp.asarray(bf16(k), jnp.float32), (1, 1), "VALID",
                                 precision="highest")
  np.testing.assert_allclose(lo, ref, rtol=1e-5, atol=1e-5)
  # Under a preset given to emulate, convs run at the preset's level (HIGHEST):
  hi = jaxprec.emulate(conv, "F32_F32_F32")(x, k)
  np.testing.assert_allclose(hi, conv(x, k), rtol=1e-5, atol=1e-5)
  # ... but a conv whose code wrote a preset is emulated as JAX lowers it: DEFAULT.
  conv_p = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "VALID",
                                                 precision="F32_F32_F32")
  np.testing.assert_allclose(jaxprec.emulate(conv_p, "float32")(x, k), lo, rtol=1e-6)


def test_cpu_target_and_no_matmuls_run_unchanged():
  # Nothing emulated: on CPU the flag changes nothing (test_emulate_native.py
  # checks that the precision is applied as JAX's flag).
  for target in ("cpu", "native"):
    np.testing.assert_array_equal(
        jaxprec.emulate(mm, "bf16", target=target)(A, A.T), mm(A, A.T))
  f = lambda x: jnp.sin(x) * 2
  np.testing.assert_array_equal(jaxprec.emulate(f, "bf16")(A), f(A))


def test_integer_and_bf16_operands_keep_native_meaning():
  ai = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
  np.testing.assert_array_equal(jaxprec.emulate(mm, "bf16")(ai, ai.T), ai @ ai.T)
  ab = A.astype(jnp.bfloat16)
  np.testing.assert_array_equal(jaxprec.emulate(mm, "bf16")(ab, ab.T), ab @ ab.T)


@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_already_emulated_ops_are_not_emulated_twice(target):
  # The TF32 and conv paths run float32 passes at HIGHEST inside the emulated
  # op; emulating the function again must not round those a second time.
  dn = (((1,), (0,)), ((), ()))
  f = lambda a, b: jaxprec.emulated_dot_general(a, b, dn, target=target)
  once = f(A, B)
  twice = jaxprec.emulate(f, "bfloat16", target="tpu")(A, B)
  np.testing.assert_array_equal(once, twice)
  g = jax.grad(lambda a: jaxprec.emulate(f, "bf16")(a, B).sum())(A)
  np.testing.assert_array_equal(g, jax.grad(lambda a: f(a, B).sum())(A))


@pytest.mark.parametrize("precision", ["bfloat16", "bfloat16_3x", "float32"])
def test_jitted_transposes_of_emulated_dots_run_on_cpu(precision):
  # XLA's simplifier folds a transpose after a bf16 x bf16 -> f32 dot into the
  # dot, a form XLA:CPU cannot execute; the emulated ops must prevent it.
  # (The bf16 kernel's dots: `auto` may pick float32 dots on some CPUs.)
  f = lambda p, x: jnp.mean(x @ p)
  with jaxprec.use_kernel("bf16"):
    g = jax.jit(jax.grad(jaxprec.emulate(f, precision)))(B, A)
    np.testing.assert_allclose(g, jax.grad(f)(B, A), rtol=3e-2, atol=1e-3)
    t = jax.jit(jaxprec.emulate(lambda a, b: (a @ b).T, precision))(A, B)
    jax.block_until_ready(t)
    assert t.shape == (8, 16)
    np.testing.assert_array_equal(t, jaxprec.emulate(mm, precision)(A, B).T)


def test_bad_input():
  with pytest.raises(TypeError, match="expects a callable; got 3"):
    jaxprec.emulate(3, "bf16")
  with pytest.raises(ValueError, match="Unknown emulation target 'ipu'.*'tpu', 'gpu'"):
    jaxprec.emulate(mm, "bf16", target="ipu")
  with pytest.raises(ValueError, match="Did you mean 'bfloat16'"):
    jaxprec.emulate(mm, "bfloat61")


def test_does_not_leak_global_state():
  jaxprec.emulate(mm, "bf16")(A, B)
  assert jax.config.jax_default_matmul_precision is None


def test_multi_device_sharded_in_a_subprocess():
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np, ml_dtypes
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      import jaxprec
      assert jax.device_count() == 4, jax.devices()
      mesh = Mesh(np.array(jax.devices()), ("d",))
      rng = np.random.default_rng(1)
      a = rng.standard_normal((16, 32)).astype(np.float32)
      b = rng.standard_normal((32, 8)).astype(np.float32)
      sa = jax.device_put(a, NamedSharding(mesh, P("d", None)))
      f = jax.jit(jaxprec.emulate(lambda x, y: x @ y, "bfloat16"),
                  out_shardings=NamedSharding(mesh, P("d", None)))
      out = f(sa, b)
      assert len(out.sharding.device_set) == 4
      r = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float64)
      want = r(a) @ r(b)
      bound = 32 * 2.0**-24 * (np.abs(r(a)) @ np.abs(r(b)))
      assert np.all(np.abs(np.asarray(out, np.float64) - want) <= bound)
      print("ok", out.sharding)
  """)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.startswith("ok")


# ---------------------------------------------------------------------------
# Trace caches key on everything that changes the program.


def _conv_dense_model():
  import flax.linen as nn  # noqa: PLC0415

  class ConvDense(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(4, (3,), name="conv")(x)
      return nn.Dense(3, name="fc")(x)

  m = ConvDense()
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 8, 3)), jnp.float32)
  return m, m.init(jax.random.key(0), x), x


def test_policy_trace_follows_the_precision_in_force_for_unmatched_layers():
  # The policy sets only the conv; the Dense takes the precision in force.
  m, params, x = _conv_dense_model()
  f = jaxprec.emulate(m.apply, "conv=tensorfloat32")
  with jaxprec.precision("float32"):
    at32 = f(params, x)
    fresh32 = jaxprec.emulate(m.apply, "conv=tensorfloat32")(params, x)
  with jaxprec.precision("bfloat16"):
    at16 = f(params, x)  # was the float32 trace, reused
    fresh16 = jaxprec.emulate(m.apply, "conv=tensorfloat32")(params, x)
  np.testing.assert_array_equal(at32, fresh32)
  np.testing.assert_array_equal(at16, fresh16)
  # The same thing spelled as a policy default, and the bf16 level's size.
  spelled = jaxprec.emulate(m.apply, "conv=tensorfloat32,default=bfloat16")
  np.testing.assert_array_equal(at16, spelled(params, x))
  rel = np.abs(np.asarray(at16) - np.asarray(at32)).max() / np.abs(at32).max()
  assert 1e-4 < rel < 5e-2


def test_plain_function_follows_the_precision_in_force_each_call():
  f = jaxprec.emulate(mm)  # precision None: the precision in force
  with jaxprec.precision("bfloat16"):
    assert_matches_rounded(f(A, B), bf16(A), bf16(B))
  with jaxprec.precision("float32"):  # TPU HIGHEST: 6 passes, ~float32
    np.testing.assert_allclose(f(A, B), np.asarray(A, np.float64) @ B,
                               rtol=1e-5, atol=1e-5)
  with jaxprec.precision("bfloat16"):
    assert_matches_rounded(jax.jit(f)(A, B), bf16(A), bf16(B))


def test_trace_is_not_reused_across_x64():
  f = jaxprec.emulate(lambda a: a @ a + jnp.zeros(()), "bfloat16")
  x = np.full((2, 2), 1 + 2.0**-10, np.float32)
  assert f(x).dtype == np.float32
  with jax.enable_x64(True):
    y = f(x)
    assert y.dtype == np.float64  # jnp.zeros(()) is float64 under x64
  assert f(x).dtype == np.float32
  # bfloat16 operands: 1 + 2^-10 rounds to 1, so each entry is 2.
  np.testing.assert_array_equal(y, np.full((2, 2), 2.0))


def test_non_array_output_raises_as_jit_does():
  with pytest.raises(TypeError, match=r"returned a value of type <class 'str'> "
                     r"at output\[1\], which is not a valid JAX type: only "
                     r"arrays"):
    jaxprec.emulate(lambda a: (a @ a, "done"), "bf16")(A[:8, :8])
  with pytest.raises(TypeError, match="not a valid JAX type"):
    jax.jit(lambda a: (a @ a, "done"))(A[:8, :8])  # what jax.jit says


# ---------------------------------------------------------------------------
# jaxprec's own emulated ops carry an explicit marker.


def _marked_calls(fn, *args):
  from jaxprec._src.emulation import emulated_ops
  eqns = [w.eqn for w in walker.iter_eqns(jax.make_jaxpr(fn)(*args))
          if w.eqn.primitive.name in ("custom_vjp_call", emulated_ops.MARKER)]
  return eqns, [emulated_ops.is_emulated_call(e) for e in eqns]


def test_emulated_op_marker_survives_jit_grad_vmap_scan():
  dn = (((1,), (0,)), ((), ()))
  g = lambda a, b: jaxprec.emulated_dot_general(a, b, dn, "tensorfloat32",
                                                target="gpu")
  a8, b8 = A[:8, :8], B[:8, :8]
  cases = {
      "plain": (g, (a8, b8)),
      "jit": (jax.jit(g), (a8, b8)),
      "grad": (jax.grad(lambda a, b: g(a, b).sum()), (a8, b8)),
      "vmap": (jax.vmap(g), (jnp.stack([a8, a8]), jnp.stack([b8, b8]))),
      "scan": (lambda a, b: lax.scan(lambda c, _: (g(c, b), None), a, None,
                                     length=2)[0], (a8, b8)),
  }
  for name, (fn, args) in cases.items():
    eqns, marked = _marked_calls(fn, *args)
    assert eqns and all(marked), name
    # Emulating again (TPU bf16) leaves the GPU TF32 op as it is, bit for bit.
    np.testing.assert_array_equal(
        jaxprec.emulate(fn, "bfloat16", target="tpu")(*args), fn(*args),
        err_msg=name)
  # And the op is TF32: operands rounded to 10 bits, float32 sums.
  assert_matches_rounded(jaxprec.emulate(g, "bfloat16")(a8, b8), tf32(a8), tf32(b8))


def test_a_users_custom_vjp_is_not_taken_for_an_emulated_op():
  # The same function names as jaxprec's own (a name check would skip it).
  @jax.custom_vjp
  def _emulated(a, b):
    return a @ b

  def _emulated_fwd(a, b):
    return a @ b, (a, b)

  def _emulated_bwd(r, c):
    return c @ r[1].T, r[0].T @ c
  _emulated.defvjp(_emulated_fwd, _emulated_bwd)
  eqns, marked = _marked_calls(_emulated, A, B)
  assert eqns and not any(marked)
  assert_matches_rounded(jaxprec.emulate(_emulated, "bfloat16")(A, B),
                         bf16(A), bf16(B))


# ---------------------------------------------------------------------------
# Opaque ops.


def _opaque_fn():
  from jax.experimental import io_callback  # noqa: PLC0415
  from jax.experimental import pallas as pl  # noqa: PLC0415

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...])

  def f(x, y):
    sds = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    out = pl.pallas_call(kernel, out_shape=sds, interpret=True)(x, y)
    out = jax.pure_callback(lambda a: np.asarray(a) * 2, sds, out)
    out = io_callback(lambda a: np.asarray(a), sds, out)
    return out @ y
  return f


def test_emulate_warns_once_naming_opaque_ops_and_runs_them_natively():
  import warnings  # noqa: PLC0415
  f = _opaque_fn()
  x = np.full((8, 8), 1 + 2.0**-10, np.float32)
  g = jaxprec.emulate(f, "bfloat16")
  with pytest.warns(jaxprec.OpaqueOpWarning, match=r"pallas_call 'kernel', "
                    r"pure_callback '.*<lambda>'.*io_callback.*cannot be seen "
                    r"into") as record:
    got = g(x, x)
  assert len(record) == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    g(x, x)  # once per emulated function
  # The kernel's dot runs in exact float32 here (64 * (1+2^-10)^2 * 2); the
  # dot after the callbacks is emulated: bf16 operands, so 1 + 2^-10 -> 1.
  k = float(np.float32(8 * (1 + 2.0**-10) ** 2) * 2)
  np.testing.assert_allclose(got, np.full((8, 8), 8 * bf16(np.float32(k)) * 1.0),
                             rtol=0)


def test_check_warns_about_opaque_ops_through_emulate():
  f = _opaque_fn()
  x = np.ones((8, 8), np.float32)
  with pytest.warns(jaxprec.OpaqueOpWarning, match=r"pallas_call 'kernel'"):
    jaxprec.check(f, x, x, precisions=["bfloat16"], mode="emulate")


@pytest.mark.parametrize("kernel", ["bf16", "f32"])
@pytest.mark.parametrize("precision", ["bfloat16", "bfloat16_3x", "float32",
                                       "tensorfloat32"])
def test_jit_and_op_by_op_give_the_same_bits_when_a_tanh_follows(precision,
                                                                 kernel):
  """The emulated op's result is a fusion boundary: XLA:CPU (jax 0.12) gave
  tanh(x @ w.T) one ulp apart between the jitted emulated function and the
  same function run op by op, at every multi-pass algorithm."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((5, 12)).astype(np.float32)
  w = rng.standard_normal((12, 12)).astype(np.float32)
  f = lambda x, w: {"y": x @ w, "z": jnp.tanh(x @ w.T)}  # noqa: E731
  with jaxprec.use_kernel(kernel):
    g = jaxprec.emulate(f, precision, target="tpu")
    jitted, eager = jax.jit(g)(x, w), g(x, w)
    dot = jaxprec.emulate(lambda x, w: x @ w.T, precision, target="tpu")(x, w)
  for k in ("y", "z"):
    np.testing.assert_array_equal(np.asarray(jitted[k]), np.asarray(eager[k]))
  # And the tanh is the tanh of the emulated product, as computed alone.
  np.testing.assert_array_equal(np.asarray(eager["z"]),
                                np.asarray(jax.jit(jnp.tanh)(dot)))


def test_scatters_and_the_gradient_of_a_lookup_are_emulated():
  """Every scatter-add/-mul/-min/-max crashed emulate ("cannot rewrite inside
  the higher-order primitive 'scatter-add'"): .at[].add, segment_sum, and the
  gradient of every gather, so emulate(jax.grad(loss)) of any language model
  and an optax step with integer labels."""
  import optax  # noqa: PLC0415
  rng = np.random.default_rng(5)
  emb = rng.standard_normal((10, 8)).astype(np.float32)
  w = rng.standard_normal((8, 5)).astype(np.float32)
  ids, labels = np.array([1, 3, 3, 7]), np.array([0, 1, 2, 4])

  def loss(emb, w):
    logits = jnp.asarray(emb)[ids] @ w
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  g_emb, g_w = jaxprec.emulate(jax.grad(loss, argnums=(0, 1)), "bfloat16",
                               target="tpu")(emb, w)
  # The reference: the same gradient with the matmuls' operands rounded to
  # bfloat16 (one pass), computed in float64 with NumPy.
  e, wr = bf16(emb[ids]).astype(np.float64), bf16(w).astype(np.float64)
  z = e @ wr
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  dz = (p - np.eye(5)[labels]) / len(ids)
  want_w = bf16(e.T.astype(np.float32)).astype(np.float64) @ bf16(
      dz.astype(np.float32)).astype(np.float64)
  np.testing.assert_allclose(np.asarray(g_w), want_w, rtol=2e-2, atol=2e-4)
  rows = bf16(dz.astype(np.float32)).astype(np.float64) @ wr.T
  want_emb = np.zeros_like(emb, np.float64)
  np.add.at(want_emb, ids, rows)  # the scatter-add of the gather's gradient
  np.testing.assert_allclose(np.asarray(g_emb), want_emb, rtol=2e-2, atol=2e-4)
  # .at[].add / .mul / .min / .max and segment_sum around an emulated matmul.
  x = rng.standard_normal((4, 8)).astype(np.float32)
  for op in ("add", "multiply", "min", "max"):
    f = lambda x, w, op=op: getattr(jnp.zeros((3, 5)).at[jnp.array(  # noqa: E731
        [0, 2, 2, 1])], op)(x @ w)
    got = np.asarray(jaxprec.emulate(f, "bfloat16", target="tpu")(x, w))
    native = np.asarray(f(bf16(x), bf16(w)))
    np.testing.assert_allclose(got, native, rtol=1e-6, atol=1e-6)
  seg = jaxprec.emulate(lambda x, w: jax.ops.segment_sum(
      x @ w, jnp.array([0, 1, 1, 2]), num_segments=3), "bf16")(x, w)
  np.testing.assert_allclose(np.asarray(seg), np.asarray(jax.ops.segment_sum(
      bf16(x) @ bf16(w), jnp.array([0, 1, 1, 2]), num_segments=3)),
      rtol=1e-6, atol=1e-6)


def test_audit_and_cost_of_an_emulated_function_count_its_passes():
  # An emulated op is one primitive; audit and cost see the matmuls it runs.
  # The bf16 kernel runs each pass as one bfloat16 dot, whatever kernel this
  # CPU's flags choose ("auto" is f32 without AVX512-BF16).
  x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
  for name, passes in (("bfloat16", 1), ("bfloat16_3x", 3)):
    f = jaxprec.emulate(lambda a, b: a @ b, name)
    with jaxprec.use_kernel("bf16"):
      rows = jaxprec.audit(f, x, w).rows
      assert [(r.lhs_dtype, r.flops) for r in rows] == [("bfloat16", 192)] * passes
      assert jaxprec.cost(f, x, w).cost == 192 * passes
