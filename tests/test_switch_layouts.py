"""Hostile probes of the prepared parts (jaxprec/_src/emulation/prepared.py).

The promise: the search's switched program reading the parameters' parts
prepared once (``served``) computes the same numbers, bit for bit, as the
program that splits them itself (``plain``) and as
``jax.jit(jaxprec.emulate(fn, policy))`` (``fixed``); the parts cost at most
three times the float32 weights; nothing outlives the search.

Findings (each failed before it was fixed):

* A dot whose weight the ``bf16`` kernel transposes (``einsum('bi,oi->bo')``,
  an ``(out, in)`` kernel, a tied embedding's ``attend``): the served
  program's dot reads a transposed part materialized by the prepare program,
  the plain one a transpose XLA folds into the dot; XLA:CPU sums them in
  another order (a few ulps; the search's worst values differ).
* A weight that is both operands of one dot (``w.T @ w``, ``f32`` kernel).
* A weight broadcast into a batched matmul: its parts are prepared at the
  broadcast shape, held for the whole search.
* (Not the prepared parts': ``jaxprec.emulate``) ``w.T @ w`` with the
  ``bf16`` kernel does not run under ``jax.jit`` on XLA:CPU.
* An NNX model's kernels are not program arguments: nothing of them is
  prepared (documented in docs/search.md; speed only, not numbers).

The other tests are regression tests of paths ``tests/test_prepared.py``
does not cover.
"""

import gc
import warnings
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprec
import switching
from jaxprec._src.emulation import prepared
from test_prepared import _args, _programs, _same_tree

NAMES = ("bfloat16", "bfloat16_3x", "float32")


def _random(seed, *shapes):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _assert_served_is_plain_and_fixed(f, args, names=NAMES, kernel="bf16"):
  with jaxprec.use_kernel(kernel):
    served, plain, requests = _programs(f, [""], names, args)
    for i, name in enumerate(names):
      fixed = jax.jit(jaxprec.emulate(f, name))(*args)
      got = jax.block_until_ready(served([i]))
      assert _same_tree(got, plain([i])), (name, kernel)
      assert _same_tree(got, fixed), (name, kernel)
  return requests


# ---------------------------------------------------------------------------
# Findings.


def test_a_kernel_the_bf16_kernel_transposes_is_served_bit_for_bit():
  """``einsum('bi,oi->bo')``: the rhs contracts on its last axis, so the
  ``bf16`` kernel moves it (``passes.move``, permutation (1, 0)). Fails now:
  served differs from plain and fixed by an ulp. The served dot reads the
  moved part as a bfloat16 parameter (XLA:CPU: a bfloat16 YNN dot); in the
  plain program XLA fuses the transpose's copy with a convert to float32
  and runs a float32 dot, which sums in another order (compiled HLO,
  measured with jax 0.10.2)."""
  x, w = _random(0, (4, 64), (64, 64))

  def f(x, w):
    return jnp.einsum("bi,oi->bo", x, w)

  requests = _assert_served_is_plain_and_fixed(f, (x, w))
  assert _args(requests) == {0}  # w reaches its dot transposed: not served


class _OutIn(nn.Module):
  """Kernels stored ``(out, in)`` (as a tied embedding's ``attend``)."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(1.0), (16, 8))
    h = jnp.einsum("bi,oi->bo", x, w)
    v = self.param("v", nn.initializers.normal(1.0), (16, 16))
    return {"h": h, "o": jnp.einsum("bi,oi->bo", jnp.tanh(h), v)}


def test_the_search_on_out_in_kernels_measures_what_fixed_programs_measure():
  """The finding above, seen by a user: the switched evaluation's worst
  value is not the per-policy search's (1.8054087e-05 against 1.8054203e-05
  on the second evaluation, measured)."""
  net = _OutIn()
  x = jax.random.normal(jax.random.key(0), (3, 8))
  params = net.init(jax.random.key(2), x)

  def fn(p, x):
    return net.apply(p, x)
  kw = dict(tolerance=1e-3, verbose=False, prepare_weights=True,
            candidates=("bfloat16", "bfloat16_3x"))
  with jaxprec.use_kernel("bf16"), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fast = jaxprec.search_policy(fn, params, x, **kw)
    slow = jaxprec.search_policy(fn, params, x, compile_once=False, **kw)
  assert "switched" in [s.program for s in fast.history]
  assert ([s.worst_value for s in fast.history]
          == [s.worst_value for s in slow.history])


def test_a_weight_that_is_both_operands_is_served_bit_for_bit():
  """``w.T @ w`` (a Gram matrix, the ``f32`` kernel). Fails now: served
  differs from plain and fixed (the lhs part, transposed, is materialized
  by the prepare program; the plain program shares one rounded array
  between both operands and XLA lays the dot out otherwise)."""
  (w,) = _random(0, (12, 12))
  requests = _assert_served_is_plain_and_fixed(lambda w: w.T @ w, (w,),
                                               kernel="f32")
  assert _args(requests) == set()  # one argument on both sides: not served


def test_emulate_runs_a_gram_matrix_with_the_bf16_kernel():
  """Not the prepared parts' (the fixed program fails alike): the ``bf16``
  kernel's ``w.T @ w`` under ``jax.jit`` raises on XLA:CPU ("Unsupported
  element type for DotThunk::Execute: BF16 x BF16 = F32"); the reduce_precision
  guard in emulated_ops._forward covers a transposed result, not operands
  that are one rounded array, transposed on one side."""
  (w,) = _random(0, (12, 12))
  f = lambda w: w.T @ w  # noqa: E731
  with jaxprec.use_kernel("bf16"):
    got = jax.block_until_ready(jax.jit(jaxprec.emulate(f, "bfloat16"))(w))
    want = jaxprec.emulate(f, "bfloat16")(w)  # op by op: runs
  assert switching.same(got, want)


def test_the_parts_of_a_broadcast_weight_cost_what_the_weight_costs():
  """The docstring's bound: at most three times the float32 weights (six
  bfloat16 values per element). A weight broadcast to a batched matmul is
  prepared at the broadcast shape (64 times here), and held while the
  search runs. Fails now."""
  x, w = _random(0, (4, 32), (32, 32))

  def f(x, w):
    xb = jnp.broadcast_to(x, (64, 4, 32))
    return jnp.einsum("bij,bjk->bik", xb, jnp.broadcast_to(w, (64, 32, 32)))

  requests = _assert_served_is_plain_and_fixed(f, (x, w))
  ready = prepared.prepare([x, w], requests)
  held = sum(p.nbytes for parts in ready.values() for ps in parts.values()
             for p in ps)
  assert held <= 3 * (x.nbytes + w.nbytes), held


class _Mlp(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(8, 16, rngs=rngs)
    self.b = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return {"h": self.b(jnp.tanh(self.a(x)))}


# ---------------------------------------------------------------------------
# Regression tests: paths tests/test_prepared.py does not take.


@pytest.mark.parametrize("kernel", ["bf16", "f32"])
def test_one_array_passed_twice_a_weight_output_and_empty_weights(kernel):
  """The same array as two arguments (two program arguments, each
  prepared), a weight that is also an output, and zero-size weights."""
  x, w = _random(1, (5, 12), (12, 12))
  empty = np.zeros((12, 0), np.float32)

  def f(x, a, b, e):
    return {"w": a, "y": x @ a, "z": jnp.tanh(x @ b.T), "e": x @ e}

  requests = _assert_served_is_plain_and_fixed(f, (x, w, w, empty),
                                               kernel=kernel)
  assert _args(requests) == {0, 1, 3}  # b reaches its dot transposed


def test_float32_weights_under_x64_are_served_bit_for_bit():
  """x64: float32 arguments are prepared, float64 ones are not (and the
  float64 dot is left as it is)."""
  x, w = _random(2, (5, 12), (12, 12))
  with jax.enable_x64(True):
    def f(x, w, d):
      return x @ w, x.astype(jnp.float64) @ d, x @ d.astype(jnp.float32)

    requests = _assert_served_is_plain_and_fixed(
        f, (x, w, w.astype(np.float64)))
  assert _args(requests) == {0, 1}


def test_an_emulated_call_inside_the_function_is_left_as_it_is():
  """``jaxprec.emulate`` and ``emulated_dot_general`` called by the
  function itself (emulated already: not served, not emulated again)."""
  x, w = _random(3, (4, 16), (16, 16))
  dn = (((1,), (0,)), ((), ()))

  def f(x, w):
    inner = jax.jit(jaxprec.emulate(lambda a, b: a @ b, "bfloat16_3x"))
    return (inner(x, w.T), x @ w,
            jaxprec.emulated_dot_general(x, w, dn, "bfloat16_3x"))

  _assert_served_is_plain_and_fixed(f, (x, w))


@pytest.mark.parametrize("target,names,options", [
    ("tpu", ("bfloat16", "bfloat16_3x", "BF16_BF16_F32_X9"), {}),
    ("gpu", ("tensorfloat32", "TF32_TF32_F32_X3"), {"tf32_rounding": "truncate"}),
])
@pytest.mark.parametrize("kernel", ["bf16", "f32"])
def test_nan_payloads_and_signed_subnormals_are_served_bit_for_bit(
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

  with jaxprec.use_kernel(kernel):
    served, plain, requests = _programs(f, [""], names, (x, w), target,
                                        **options)
    assert _args(requests) == {0, 1}
    for i, name in enumerate(names):
      fixed = jax.jit(jaxprec.emulate(f, name, target=target, **options))(x, w)
      assert _same_tree(served([i]), plain([i])), name
      assert _same_tree(served([i]), fixed), name


def test_nothing_of_the_search_outlives_it(monkeypatch):
  """The prepared parts (and every other array of the search) are freed
  once the search returns, and its result holds no argument."""
  from test_prepared import _Net
  net = _Net()
  x = jax.random.normal(jax.random.key(0), (3, 8))
  params = jax.tree.map(lambda a: a + 0, net.init(jax.random.key(1), x))

  def fn(p, x):
    return net.apply(p, x)
  parts = []
  real = prepared.prepare

  def keeping(dynamic, requests, *a, **k):
    ready = real(dynamic, requests, *a, **k)
    parts.extend(weakref.ref(p) for p in jax.tree.leaves(ready))
    return ready
  monkeypatch.setattr(prepared, "prepare", keeping)

  def live():
    return sorted((a.shape, str(a.dtype)) for a in jax.live_arrays())
  gc.collect()
  before = live()
  kernel = weakref.ref(jax.tree.leaves(params)[0])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    res = jaxprec.search_policy(fn, params, x, tolerance=1e-3, verbose=False,
                                prepare_weights=True)
  assert "switched" in [s.program for s in res.history]
  assert parts  # something was prepared
  assert prepared._STATE.mode is None and prepared._STATE.ready == {}
  del params
  gc.collect()
  assert kernel() is None and all(p() is None for p in parts)
  now = live()
  assert all(now.count(a) <= before.count(a) for a in now), (
      sorted(set(now) - set(before)))
