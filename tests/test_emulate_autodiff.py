"""Gradients of emulated functions: matmuls in custom_jvp rules, custom_vjp rules, both passes."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxprec

DN = (((1,), (0,)), ((), ()))
_RNG = np.random.default_rng(23)
W = _RNG.standard_normal((5, 4)).astype(np.float32)
X = _RNG.standard_normal((3, 5)).astype(np.float32)


def _bf16(a) -> np.ndarray:
  """ml_dtypes' round to nearest even bfloat16, as float64."""
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _within_f32_sums(got, want, lhs, rhs) -> None:
  """``got`` is ``want`` (float64 sum of the same products) up to float32
  accumulation: ``k * 2**-24 * sum|products|``."""
  bound = lhs.shape[-1] * 2.0**-24 * (np.abs(lhs) @ np.abs(rhs))
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-30)


@jax.custom_jvp
def _linear(x):
  return x @ W


@_linear.defjvp
def _linear_jvp(primals, tangents):
  return _linear(primals[0]), tangents[0] @ W


def _loss(fn):
  return lambda x: jnp.sin(fn(x)).sum()


@pytest.mark.parametrize("precision", ["bfloat16", "high"])
def test_grad_through_a_matmul_in_a_custom_jvp_rule(precision):
  # jax.grad transposes the rule's tangent matmul: each transposed matmul is
  # emulated, as the same matmul outside a custom_jvp is.
  emulated = jaxprec.emulate(_linear, precision, target="tpu")
  got = jax.jit(jax.grad(_loss(emulated)))(X)
  plain = jax.jit(jax.grad(_loss(jaxprec.emulate(lambda x: x @ W, precision,
                                                 target="tpu"))))(X)
  np.testing.assert_array_equal(got, plain)
  if precision == "bfloat16":  # NumPy: cos(y) @ w.T on bfloat16 operands
    ct = np.asarray(jnp.cos(emulated(X)))  # the cotangent, as JAX computes it
    _within_f32_sums(got, _bf16(ct) @ _bf16(W).T, _bf16(ct), _bf16(W).T)
    assert np.abs(got - ct @ W.T).max() > 1e-3  # the float32 gradient differs


def test_grad_through_a_custom_jvp_rule_with_primal_and_tangent_matmuls():
  @jax.custom_jvp
  def layer(x, w):
    return jnp.tanh(x @ w)

  @functools.partial(layer.defjvp, symbolic_zeros=True)
  def layer_jvp(primals, tangents):
    (x, w), (tx, tw) = primals, tangents
    y = layer(x, w)
    dy = 0.0
    if type(tx) is not jax.custom_derivatives.SymbolicZero:
      dy = dy + tx @ w
    if type(tw) is not jax.custom_derivatives.SymbolicZero:
      dy = dy + x @ tw
    return y, (1 - y * y) * dy

  def same(x, w):  # the same math without a custom rule
    return jnp.tanh(jaxprec.emulated_dot_general(x, w, DN, "bfloat16"))

  loss = lambda f: lambda x, w: jnp.cos(f(x, w)).sum()  # noqa: E731
  got = jax.jit(jax.grad(loss(jaxprec.emulate(layer, "bfloat16")), (0, 1)))(
      X, W)
  # The rule's ct (1 - y*y) * g, then the emulated transposed matmuls.
  y = np.asarray(same(X, W))
  ct = np.asarray((1 - y * y) * -jnp.sin(y))
  _within_f32_sums(got[0], _bf16(ct) @ _bf16(W).T, _bf16(ct), _bf16(W).T)
  _within_f32_sums(got[1], _bf16(X).T @ _bf16(ct), _bf16(X).T, _bf16(ct))
  assert np.abs(got[1] - X.T @ ct).max() > 1e-4  # float32 operands differ


def test_jvp_linearize_and_transpose_through_a_custom_jvp_rule():
  emulated = jaxprec.emulate(_linear, "bfloat16", target="tpu")
  t = _RNG.standard_normal(X.shape).astype(np.float32)
  _, tangent = jax.jvp(emulated, (X,), (t,))
  _within_f32_sums(tangent, _bf16(t) @ _bf16(W), _bf16(t), _bf16(W))
  _, lin = jax.linearize(emulated, X)
  np.testing.assert_array_equal(lin(t), tangent)
  ct = _RNG.standard_normal((3, 4)).astype(np.float32)
  (back,) = jax.linear_transpose(lin, X)(ct)
  _within_f32_sums(back, _bf16(ct) @ _bf16(W).T, _bf16(ct), _bf16(W).T)
  assert np.abs(back - ct @ W.T).max() > 1e-3
  # jax.jacfwd batches the rule: d out[i, j] / d x[k, l] = (i == k) * w[l, j]
  # rounded to bfloat16 (a one-hot tangent's products are exact).
  jac = jax.jit(jax.jacfwd(emulated))(X)
  want = np.einsum("ik,lj->ijkl", np.eye(3), _bf16(W))
  np.testing.assert_array_equal(jac, want)


def test_custom_vjp_forward_and_backward_matmuls_are_emulated():
  @jax.custom_vjp
  def layer(x):
    return x @ W

  layer.defvjp(lambda x: (x @ W, None), lambda _, ct: (ct @ W.T,))
  emulated = jaxprec.emulate(layer, "bfloat16", target="tpu")
  np.testing.assert_array_equal(emulated(X), jaxprec.emulate(
      lambda x: x @ W, "bfloat16", target="tpu")(X))
  got = jax.grad(_loss(emulated))(X)
  ct = np.asarray(jnp.cos(emulated(X)))
  _within_f32_sums(got, _bf16(ct) @ _bf16(W).T, _bf16(ct), _bf16(W).T)
  assert np.abs(got - ct @ W.T).max() > 1e-3


def test_vmap_of_grad_through_custom_jvp_without_tangent_matmuls():
  # relu is a custom_jvp whose rule has no matmul: its gradient stays
  # batchable (per-example gradients of a model).
  f = jaxprec.emulate(lambda x: jax.nn.relu(x @ W), "bfloat16", target="tpu")
  grad = jax.grad(lambda x: f(x).sum())
  per_example = jax.jit(jax.vmap(grad))(X[:, None])
  np.testing.assert_allclose(per_example[:, 0], jax.jit(grad)(X), rtol=1e-6,
                             atol=1e-6)


def test_grad_through_a_custom_jvp_rule_with_an_integer_input():
  # The integer's tangent is float0: not a linear input of the rule's
  # tangent computation.
  @functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
  def scaled(x, n, k):
    return (x @ W) * n * k

  @scaled.defjvp
  def scaled_jvp(k, primals, tangents):
    (x, n), (tx, _) = primals, tangents
    return scaled(x, n, k), (tx @ W) * n * k

  n = np.int32(3)
  got = jax.jit(jax.grad(_loss(jaxprec.emulate(
      lambda x: scaled(x, n, 0.5), "bfloat16"))))(X)
  plain = jax.jit(jax.grad(_loss(jaxprec.emulate(
      lambda x: (x @ W) * n * 0.5, "bfloat16"))))(X)
  np.testing.assert_array_equal(got, plain)


def test_second_derivatives_in_reverse_mode_and_of_an_emulated_hessian():
  # f(x) = sum(sin(x @ w)). Each row of x is its own problem, and with
  # s = -sin(y): d2f / dx[i, j] dx[i, l] = sum_n R(s[i, n] R(w[l, n])) R(w[j, n])
  # (R: bfloat16 rounding of a matmul operand) when the derivative's matmuls
  # are emulated, as in the hessian's forward-over-reverse order; the
  # reverse-over-reverse order rounds the other factor: j and l swap.
  f = lambda x: jnp.sin(x @ W).sum()  # noqa: E731
  s = np.asarray(-jnp.sin(jaxprec.emulate(lambda x: x @ W, "bfloat16")(X)))
  inner = _bf16(s[:, None, :] * np.asarray(_bf16(W), np.float32)[None])
  want = np.einsum("iln,jn->ijl", inner, _bf16(W))
  hessian = jax.jit(jaxprec.emulate(jax.hessian(f), "bfloat16"))(X)
  reverse = jax.jit(jax.jacrev(jax.jacrev(jaxprec.emulate(f, "bfloat16"))))(X)
  for h, got in ((hessian, want), (reverse, want.transpose(0, 2, 1))):
    h = np.asarray(h, np.float64)
    blocks = np.stack([h[i, :, i, :] for i in range(3)])
    np.testing.assert_allclose(blocks, got, rtol=1e-6, atol=1e-7)
    for i in range(3):
      h[i, :, i, :] = 0
    assert not h.any()
  native = np.einsum("in,jn,ln->ijl", s, W, W)
  assert np.abs(want - native).max() > 1e-3


# ---------------------------------------------------------------------------
# Forward mode, batching and every composition of an emulated op.

_K = _RNG.standard_normal((3, 4, 6)).astype(np.float32)  # conv kernel, WIO
_IMG = _RNG.standard_normal((2, 9, 4)).astype(np.float32)  # NWC


def _layers(x, w, k, img):
  """A matmul, an einsum of the transposed weight, a Gram matrix and a conv."""
  y = jnp.tanh(x @ w)
  z = jnp.einsum("bi,ij->bj", y, w.T)
  c = jax.lax.conv_general_dilated(img * x[0, 0], k, (1,), "SAME",
                                   dimension_numbers=("NWC", "WIO", "NWC"))
  return {"y": y, "z": z, "c": c, "gram": x.T @ x}


def _model(x, w, k, img):
  h = _layers(x, w, k, img)
  return (h["z"] ** 2).sum() + jnp.sin(h["c"]).sum() + h["gram"].sum()


_HOW = [("bfloat16", "tpu", "bf16"), ("bfloat16_3x", "tpu", "f32"),
        ("tensorfloat32", "gpu", "bf16"), ("TF32_TF32_F32_X3", "gpu", "f32")]


def _same(a, b):
  for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("precision,target,kernel", _HOW)
def test_forward_mode_of_an_emulated_function_is_the_emulated_jvp(
    precision, target, kernel):
  # jax.jvp / jax.linearize of emulate(f) computes what emulating f's JVP
  # computes: every tangent matmul emulated at the forward's algorithm.
  args = (X, W, _K, _IMG)
  tans = tuple(_RNG.standard_normal(a.shape).astype(np.float32) for a in args)
  with jaxprec.use_kernel(kernel):
    g = jaxprec.emulate(_layers, precision, target=target)
    emulated_jvp = jaxprec.emulate(lambda a, t: jax.jvp(_layers, a, t),
                                   precision, target=target)
    # Jitted, and op by op (where XLA fuses the elementwise ops otherwise).
    want = jax.jit(emulated_jvp)(args, tans)
    _same(jax.jit(lambda a, t: jax.jvp(g, a, t))(args, tans), want)
    eager = emulated_jvp(args, tans)
    _same(jax.jvp(g, args, tans), eager)
    out, lin = jax.linearize(g, *args)
    _same((out, lin(*tans)), eager)
    native = jax.jvp(_layers, args, tans)[1]
  for name in ("y", "z", "c", "gram"):  # one pass: the tangents differ
    assert precision.endswith("X3") or not np.array_equal(
        want[1][name], native[name]), name


@pytest.mark.parametrize("precision,target,kernel", _HOW[:2])
def test_jacfwd_hessian_and_vmap_of_grad_are_the_emulated_derivatives(
    precision, target, kernel):
  f = lambda x: _model(x, W, _K, _IMG)  # noqa: E731
  with jaxprec.use_kernel(kernel):
    g = jaxprec.emulate(f, precision, target=target)
    for derivative in (jax.jacfwd, jax.hessian):
      want = jax.jit(jaxprec.emulate(derivative(f), precision,
                                     target=target))(X)
      _same(jax.jit(derivative(g))(X), want)
    # Per-example gradients: a vmap of the gradient (of a Gram matrix too).
    per = lambda h: jax.vmap(jax.grad(lambda r: h(r[None])))  # noqa: E731
    want = jax.jit(jaxprec.emulate(per(f), precision, target=target))(X)
    _same(jax.jit(per(g))(X), want)
    loop = np.stack([jax.grad(lambda r: g(r[None]))(X[i]) for i in range(3)])
    np.testing.assert_allclose(per(g)(X), loop, rtol=1e-6, atol=1e-6)


def test_forward_mode_against_bfloat16_products():
  # Independent reference: the tangent of x @ w at bfloat16 is
  # R(dx) @ R(w) + R(x) @ R(dw) in float32 sums (R: round to bfloat16).
  g = jaxprec.emulate(lambda x, w: x @ w, "bfloat16", target="tpu")
  dx = _RNG.standard_normal(X.shape).astype(np.float32)
  dw = _RNG.standard_normal(W.shape).astype(np.float32)
  _, (t,) = jax.jvp(lambda x, w: (g(x, w),), (X, W), (dx, dw))
  first = np.asarray(g(dx, W), np.float64)
  second = np.asarray(g(X, dw), np.float64)
  _within_f32_sums(first, _bf16(dx) @ _bf16(W), _bf16(dx), _bf16(W))
  _within_f32_sums(second, _bf16(X) @ _bf16(dw), _bf16(X), _bf16(dw))
  np.testing.assert_array_equal(t, (first + second).astype(np.float32))


def test_vmap_of_grad_through_a_custom_jvp_rule_with_tangent_matmuls():
  # The rule's tangent matmul is an emulated op JAX transposes and batches.
  emulated = jaxprec.emulate(_linear, "bfloat16", target="tpu")
  grad = jax.grad(_loss(emulated))
  per_example = jax.jit(jax.vmap(grad))(X[:, None])
  for i in range(3):
    np.testing.assert_array_equal(per_example[i], grad(X[i:i + 1]))
  hess = jax.jit(jax.hessian(_loss(emulated)))(X)
  want = jax.jit(jaxprec.emulate(jax.hessian(_loss(lambda x: x @ W)),
                                 "bfloat16"))(X)
  np.testing.assert_array_equal(hess, want)


def test_derivatives_of_float16_compute_are_not_zero():
  # float16 compute is rounded once per op by bit arithmetic, whose own
  # derivative is zero: the rounding's derivative is a convert's.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float16)
  w = jnp.asarray(rng.standard_normal((8, 3)), jnp.float16)
  loss = lambda a, b: jnp.sum(jnp.sin(a @ b).astype(jnp.float32))  # noqa: E731
  got = jax.grad(jaxprec.emulate(loss, "bfloat16"), (0, 1))(x, w)
  want = jaxprec.emulate(jax.grad(loss, (0, 1)), "bfloat16")(x, w)
  _same(got, want)
  native = jax.grad(loss, (0, 1))(x, w)
  for g, n in zip(got, native):
    assert np.abs(np.asarray(g, np.float32)).min() > 0
    np.testing.assert_allclose(np.asarray(g, np.float32),
                               np.asarray(n, np.float32), rtol=2e-2, atol=2e-2)
  # Forward mode rounds the tangent once per op of f; emulating f's JVP
  # rounds once per op of the JVP (two products and their sum here): a
  # float16 rounding apart (docs/emulation.md, Gradients).
  mm = lambda a, b: a @ b  # noqa: E731
  got = jax.jvp(jaxprec.emulate(mm, "bfloat16"), (x, w), (x, w))[1]
  want = jaxprec.emulate(lambda *a: jax.jvp(mm, a[:2], a[2:]),
                         "bfloat16")(x, w, x, w)[1]
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.abs(got - want).max() <= 2 * 2.0**-11 * np.abs(want).max()
  assert np.abs(got).min() > 0


# ---------------------------------------------------------------------------
# A custom_vjp rule declared with symbolic_zeros=True (Equinox's
# filter_custom_vjp, diffrax's adjoints): its bwd is given SymbolicZero
# cotangents for unused outputs and returns None for inputs it skips.

_SZ = jax.custom_derivatives.SymbolicZero


@jax.custom_vjp
def _mm_and_x(x, w):
  return x @ w, x


def _mm_fwd(x, w):  # symbolic_zeros: CustomVJPPrimal arguments
  x, w = x.value, w.value
  return (x @ w, x), (x, w)


def _mm_bwd(res, cts):
  (x, w), (g, gx) = res, cts
  dx = g @ w.T
  if type(gx) is not _SZ:  # the second output unused: a symbolic zero
    dx = dx + gx
  return dx, x.T @ g


_mm_and_x.defvjp(_mm_fwd, _mm_bwd, symbolic_zeros=True)


def _sz_loss(mm):
  return lambda x, w: jnp.sin(mm(x, w)[0]).sum()


def _grads_of(mm, how):
  """The gradient of ``_sz_loss(mm)`` at bfloat16 on TPU, by path ``how``."""
  emulate = functools.partial(jaxprec.emulate, precision="bfloat16",
                              target="tpu")
  loss = _sz_loss(mm)
  if how == "grad of emulate":
    return jax.grad(emulate(loss), (0, 1))(X, W)
  if how == "emulate of grad":
    return emulate(jax.grad(loss, (0, 1)))(X, W)
  if how == "jit":
    return jax.jit(jax.grad(emulate(loss), (0, 1)))(X, W)
  assert how == "vmap"  # per-example gradients, summed: the batch's gradient
  per = jax.vmap(jax.grad(lambda r, w: emulate(loss)(r[None], w), (0, 1)),
                 (0, None))(X, W)
  return per[0], per[1]


@pytest.mark.parametrize("how", ["grad of emulate", "emulate of grad", "jit",
                                 "vmap"])
def test_custom_vjp_with_symbolic_zeros_emulates_the_users_backward_rule(how):
  # The rule's two matmuls are emulated as JAX's own transposes of the same
  # math written without a custom_vjp are.
  got = _grads_of(_mm_and_x, how)
  plain = _grads_of(lambda x, w: (x @ w, x), how)
  if how == "vmap":  # each example's gradient: sum them
    got, plain = (got[0], got[1].sum(0)), (plain[0], plain[1].sum(0))
  _same(got, plain)
  # Independent reference: ct = cos(y) (y the emulated forward), then
  # R(ct) @ R(w).T and R(x).T @ R(ct) in float32 sums (R: bfloat16).
  ct = np.asarray(jnp.cos(jaxprec.emulate(lambda x, w: x @ w, "bfloat16")(
      X, W)))
  _within_f32_sums(got[0], _bf16(ct) @ _bf16(W).T, _bf16(ct), _bf16(W).T)
  if how != "vmap":  # summed per-example weight gradients: float32 adds more
    _within_f32_sums(got[1], _bf16(X).T @ _bf16(ct), _bf16(X).T, _bf16(ct))
  native = jax.grad(_sz_loss(_mm_and_x), (0, 1))(X, W)
  assert np.abs(got[0] - native[0]).max() > 1e-3  # float32 differs


def test_custom_vjp_backward_rule_sees_constants_as_jax_gives_them():
  # A residual that is a constant reaches the rule as a concrete array, also
  # under jax.jit, and a rule may branch on it (Equinox's adjoints do).
  # Emulated, it still may, and the rule's matmul is emulated.
  @jax.custom_vjp
  def layer(x):
    return x @ W

  def bwd(res, ct):
    x, transpose = res
    if transpose:  # Python control flow on a constant residual
      return (ct @ W.T,)
    return (x * 0,)

  layer.defvjp(lambda x: (x @ W, (x, np.bool_(True))), bwd)
  want = jax.grad(_loss(jaxprec.emulate(lambda x: x @ W, "bfloat16",
                                        target="tpu")))(X)
  emulated = jaxprec.emulate(layer, "bfloat16", target="tpu")
  for grad in (jax.grad(_loss(emulated)), jax.jit(jax.grad(_loss(emulated)))):
    np.testing.assert_array_equal(grad(X), want)
  assert np.abs(want - jax.grad(_loss(layer))(X)).max() > 1e-3


def test_diffrax_default_adjoint_gradient_is_emulated():
  # diffrax's default adjoint (RecursiveCheckpointAdjoint) differentiates
  # through Equinox's custom_vjp with symbolic zeros. The reference: the
  # same solve with the vector field's matmul written as the emulated op.
  diffrax = pytest.importorskip("diffrax")
  a = (_RNG.standard_normal((4, 4)) / 3).astype(np.float32)
  y0 = _RNG.standard_normal(4).astype(np.float32)

  def solve(mm):
    def f(a, y0):
      term = diffrax.ODETerm(lambda t, y, a: jnp.tanh(mm(a, y)))
      sol = diffrax.diffeqsolve(
          term, diffrax.Tsit5(), 0.0, 1.0, 0.25, y0, args=a,
          stepsize_controller=diffrax.ConstantStepSize())
      return jnp.sum(sol.ys[-1] ** 2)
    return f

  plain = solve(lambda a, y: a @ y)
  explicit = solve(lambda a, y: jaxprec.emulated_dot_general(
      a, y, DN, "bfloat16", target="tpu"))
  want = jax.grad(explicit, (0, 1))(a, y0)
  got = jax.jit(jax.grad(jaxprec.emulate(plain, "bfloat16", target="tpu"),
                         (0, 1)))(a, y0)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
  assert np.abs(got[0] - jax.grad(plain)(a, y0)).max() > 1e-3


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_gradient_of_a_vmapped_linear_layer_runs_on_the_bf16_kernel(jit):
  # vmap moves the batch axis with a transpose, whose transpose reaches the
  # weight gradient's dot as a transposed cotangent. XLA folded it into the
  # bfloat16 dot, a lhs contracted on its first axis that XLA:CPU's library
  # calls refuse, and DotThunk raised "Unsupported element type for
  # DotThunk::Execute: BF16 x BF16 = F32" when the gradient was read.
  def loss(p, x):
    h = jnp.tanh(jax.vmap(lambda v: p["w1"] @ v)(x))
    return jnp.sum(jax.vmap(lambda v: p["w2"] @ v)(h) ** 2)

  rng = np.random.default_rng(0)
  p = {"w1": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32),
       "w2": jnp.asarray(rng.standard_normal((10, 32)), jnp.float32)}
  x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  grads = {}
  for kernel in ("bf16", "f32"):
    with jaxprec.use_kernel(kernel):
      g = jax.grad(jaxprec.emulate(loss, "bfloat16", target="tpu"))
      grads[kernel] = jax.tree.map(np.asarray, (jax.jit(g) if jit else g)(p, x))
  native = jax.grad(loss)(p, x)
  for name in p:
    got, f32 = grads["bf16"][name], grads["f32"][name]
    scale = np.max(np.abs(f32))
    # The kernels differ only in the order each pass sums its products.
    np.testing.assert_allclose(got, f32, rtol=0, atol=1e-6 * scale)
    assert np.max(np.abs(got - np.asarray(native[name]))) > 1e-4 * scale
