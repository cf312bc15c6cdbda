"""The search's switched program computes what the per-policy program
computes, bit for bit, where XLA could lay the dots out otherwise: operands
that reach a dot transposed (``einsum('bi,oi->bo')``, an ``(out, in)`` kernel,
a tied embedding's ``attend``), a weight on both sides of one dot
(``w.T @ w``), one array passed twice, float32 weights under x64, emulated
calls inside the function, and NaN payloads and signed subnormals."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
import switching
from jaxprec._src.core.precision import resolve
from jaxprec._src.search import switch

NAMES = ("bfloat16", "bfloat16_3x", "float32")


def _random(seed, *shapes):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _same_tree(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(switching.same(x, y) for x, y in zip(la, lb))


def _switched(fn, names, args, target="tpu", **options):
  """The switched program (one unit, ``''``) over ``names``, jitted."""
  g = switch.switched(fn, [""], [resolve(n) for n in names], target=target,
                      **options)
  leaves, tree = jax.tree_util.tree_flatten(tuple(args))
  run = jax.jit(lambda index, dynamic: g(
      index, *jax.tree_util.tree_unflatten(tree, dynamic)))
  return lambda i: run(switch.index_of([i]), leaves)


def _assert_switched_is_fixed(f, args, names=NAMES, kernel="bf16",
                              target="tpu", **options):
  with jaxprec.use_kernel(kernel):
    switched = _switched(f, names, args, target, **options)
    for i, name in enumerate(names):
      fixed = jax.jit(jaxprec.emulate(f, name, target=target, **options))(
          *args)
      assert _same_tree(jax.block_until_ready(switched(i)), fixed), (
          name, kernel)


# ---------------------------------------------------------------------------
# Findings.


def test_a_kernel_the_bf16_kernel_transposes_is_switched_bit_for_bit():
  """``einsum('bi,oi->bo')``: the rhs contracts on its last axis, so the
  ``bf16`` kernel moves it (``passes.move``, permutation (1, 0))."""
  x, w = _random(0, (4, 64), (64, 64))

  def f(x, w):
    return jnp.einsum("bi,oi->bo", x, w)

  _assert_switched_is_fixed(f, (x, w))


class _OutIn(nn.Module):
  """Kernels stored ``(out, in)`` (as a tied embedding's ``attend``)."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(1.0), (16, 8))
    h = jnp.einsum("bi,oi->bo", x, w)
    v = self.param("v", nn.initializers.normal(1.0), (16, 16))
    return {"h": h, "o": jnp.einsum("bi,oi->bo", jnp.tanh(h), v)}


def test_the_search_on_out_in_kernels_measures_what_fixed_programs_measure():
  """Seen by a user: the switched evaluations' worst values are the
  per-policy search's."""
  net = _OutIn()
  x = jax.random.normal(jax.random.key(0), (3, 8))
  params = net.init(jax.random.key(2), x)

  def fn(p, x):
    return net.apply(p, x)
  kw = dict(tolerance=1e-3, verbose=False,
            candidates=("bfloat16", "bfloat16_3x"))
  with jaxprec.use_kernel("bf16"), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fast = jaxprec.search_policy(fn, params, x, **kw)
    slow = jaxprec.search_policy(fn, params, x, compile_once=False, **kw)
  assert "switched" in [s.program for s in fast.history]
  assert ([s.worst_value for s in fast.history]
          == [s.worst_value for s in slow.history])


def test_a_weight_that_is_both_operands_is_switched_bit_for_bit():
  """``w.T @ w`` (a Gram matrix, the ``f32`` kernel)."""
  (w,) = _random(0, (12, 12))
  _assert_switched_is_fixed(lambda w: w.T @ w, (w,), kernel="f32")


def test_emulate_runs_a_gram_matrix_with_the_bf16_kernel():
  """The ``bf16`` kernel's ``w.T @ w`` under ``jax.jit`` raises on XLA:CPU ("Unsupported
  element type for DotThunk::Execute: BF16 x BF16 = F32"); the reduce_precision
  guard in emulated_ops._forward covers a transposed result, not operands
  that are one rounded array, transposed on one side."""
  (w,) = _random(0, (12, 12))
  f = lambda w: w.T @ w  # noqa: E731
  with jaxprec.use_kernel("bf16"):
    got = jax.block_until_ready(jax.jit(jaxprec.emulate(f, "bfloat16"))(w))
    want = jaxprec.emulate(f, "bfloat16")(w)  # op by op: runs
  assert switching.same(got, want)


# ---------------------------------------------------------------------------
# More paths.


@pytest.mark.parametrize("kernel", ["bf16", "f32"])
def test_one_array_passed_twice_a_weight_output_and_empty_weights(kernel):
  """The same array as two arguments, a weight that is also an output, and
  zero-size weights."""
  x, w = _random(1, (5, 12), (12, 12))
  empty = np.zeros((12, 0), np.float32)

  def f(x, a, b, e):
    return {"w": a, "y": x @ a, "z": jnp.tanh(x @ b.T), "e": x @ e}

  _assert_switched_is_fixed(f, (x, w, w, empty), kernel=kernel)


def test_float32_weights_under_x64_are_switched_bit_for_bit():
  """x64: float32 dots are emulated, the float64 dot is left as it is."""
  x, w = _random(2, (5, 12), (12, 12))
  with jax.enable_x64(True):
    def f(x, w, d):
      return x @ w, x.astype(jnp.float64) @ d, x @ d.astype(jnp.float32)

    _assert_switched_is_fixed(f, (x, w, w.astype(np.float64)))


def test_an_emulated_call_inside_the_function_is_left_as_it_is():
  """``jaxprec.emulate`` and ``emulated_dot_general`` called by the
  function itself (emulated already: not emulated again)."""
  x, w = _random(3, (4, 16), (16, 16))
  dn = (((1,), (0,)), ((), ()))

  def f(x, w):
    inner = jax.jit(jaxprec.emulate(lambda a, b: a @ b, "bfloat16_3x"))
    return (inner(x, w.T), x @ w,
            jaxprec.emulated_dot_general(x, w, dn, "bfloat16_3x"))

  _assert_switched_is_fixed(f, (x, w))


@pytest.mark.parametrize("target,names,options", [
    ("tpu", ("bfloat16", "bfloat16_3x", "BF16_BF16_F32_X9"), {}),
    ("gpu", ("tensorfloat32", "TF32_TF32_F32_X3"), {"tf32_rounding": "truncate"}),
])
@pytest.mark.parametrize("kernel", ["bf16", "f32"])
def test_nan_payloads_and_signed_subnormals_are_switched_bit_for_bit(
    target, names, options, kernel):
  """Signaling NaN, NaN with a payload only in the bits that bfloat16 and
  TF32 drop, negative NaN, the smallest subnormals, in both operands."""
  x, w = _random(4, (4, 8), (8, 8))
  bits = np.array([0x7F800001, 0x7FC00001, 0xFFC00000, 0x7F80FFFF,
                   0xFF800001, 0x7FBFFFFF, 0x00000001, 0x80000001], np.uint32)
  w.reshape(-1)[:8] = bits.view(np.float32)
  x.reshape(-1)[-8:] = bits.view(np.float32)

  def f(x, w):
    return {"a": x @ w, "b": x @ w.T}

  _assert_switched_is_fixed(f, (x, w), names, kernel, target, **options)
