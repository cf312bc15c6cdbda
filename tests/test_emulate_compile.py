"""Each distinct emulated op is traced once (compile time).

``emulated_ops._marked`` binds the emulation through a ``jax.jit`` keyed on
the op's static spec: a model's identical layers reuse one trace and one
lowered function, which XLA inlines before it optimizes. These tests prove
that the compiled numbers are those of the unjitted emulation, bit for bit,
and that the marker still identifies the (now jitted) emulated ops.
"""

import math
import re

import jax
import jaxlib.version
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.emulation import emulated_ops
from jaxprec._src.emulation import passes
from jaxprec._src.jaxpr import walker

MATMUL = (((1,), (0,)), ((), ()))
# (target, precision) for each algorithm (as tests/test_emulated_ops.py).
HOW = [("tpu", "default"), ("tpu", "high"), ("tpu", "highest"),
       ("tpu", "BF16_BF16_F32_X9"), ("gpu", "default"),
       ("gpu", "TF32_TF32_F32_X3"), ("tpu", "F16_F16_F32")]
KERNELS = ("bf16", "f32")


def _unjitted(spec, lhs, rhs):
  """What ``_marked`` bound before it went through ``jax.jit``."""
  with jax.named_scope(emulated_ops.MARKER):
    return emulated_ops._emulated(spec, lhs, rhs)


def _operands():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 16, 24)).astype(np.float32)
  w = (rng.standard_normal((24, 24)) * 0.2).astype(np.float32)
  # Special values, one row each: inf, NaN, overflowing products, values
  # whose lower parts fall below float32's normal range.
  s = rng.standard_normal((8, 24)).astype(np.float32)
  s[0, 0], s[1, 1], s[2, 2], s[3, :] = np.inf, -np.inf, np.nan, 3e38
  s[4, :3] = [1 + 2.0**-9 + 2.0**-20, 2.0**-126, -1e-30]
  s[5, :] = 2.0**-120 * (1 + 2.0**-12)
  return x, w, s


def _model(x, ws, s):
  """Four identical layers, an einsum with a batch axis, a length-1
  contraction and the special values."""
  for w in ws:
    x = jnp.tanh(x @ w)
  att = jnp.einsum("bqd,bkd->bqk", x, x)
  one = lax.dot_general(x[:, :, :1], x[:, :1, :], (((2,), (1,)), ((0,), (0,))))
  return att, one, s @ ws[0], s[:, :1] @ s[:1, :]


def _run(fn, x, w, s):
  ws = [w * (1 + i / 4) for i in range(4)]

  def loss(a, b):
    return sum(jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0)) for o in fn(a, b, s))

  out = jax.jit(fn)(x, ws, s)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, ws)
  return jax.tree_util.tree_leaves((out, grads))


# Every algorithm once, each kernel on one-pass and multi-pass algorithms
# (a full cross product took a minute of the suite for no other path).
CASES = [("tpu", "default", "bf16"), ("tpu", "default", "f32"),
         ("tpu", "high", "bf16"), ("tpu", "high", "f32"),
         ("tpu", "highest", "f32"), ("tpu", "BF16_BF16_F32_X9", "bf16"),
         ("gpu", "default", "bf16"), ("gpu", "TF32_TF32_F32_X3", "f32"),
         ("tpu", "F16_F16_F32", "f32")]
assert {(t, p) for t, p, _ in CASES} == set(HOW)
assert {k for _, _, k in CASES} == set(KERNELS)


@pytest.mark.parametrize("target,precision,kernel", CASES)
def test_jitted_emulation_is_bit_identical_to_the_unjitted_one(
    monkeypatch, kernel, target, precision):
  x, w, s = _operands()
  with jaxprec.use_kernel(kernel):
    fn = jaxprec.emulate(_model, precision, target=target)
    jitted = _run(fn, x, w, s)
    with monkeypatch.context() as m:
      m.setattr(emulated_ops, "_traced_once", _unjitted)
      fn = jaxprec.emulate(_model, precision, target=target)  # a fresh trace
      plain = _run(fn, x, w, s)
  assert len(jitted) == len(plain) == 9
  assert np.isnan(jitted[2]).any() and np.isfinite(jitted[0]).all()
  for a, b in zip(jitted, plain):
    # Bit for bit, NaN payloads and zero signs included.
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32),
                                  np.asarray(b).view(np.uint32))


def test_emulated_conv_is_bit_identical_to_the_unjitted_one(monkeypatch):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
  k = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
  conv = lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME")  # noqa: E731
  f = jax.jit(jax.value_and_grad(
      lambda a, b: jnp.sum(jaxprec.emulate(conv, "high")(a, b) ** 2), (0, 1)))
  jitted = jax.tree_util.tree_leaves(f(x, k))
  monkeypatch.setattr(emulated_ops, "_traced_once", _unjitted)
  f = jax.jit(jax.value_and_grad(
      lambda a, b: jnp.sum(jaxprec.emulate(conv, "high")(a, b) ** 2), (0, 1)))
  for a, b in zip(jitted, jax.tree_util.tree_leaves(f(x, k))):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32),
                                  np.asarray(b).view(np.uint32))


@pytest.fixture(autouse=True)
def _bf16_kernel():
  """A fixed kernel: ``auto`` would measure, inside the first trace."""
  with jaxprec.use_kernel("bf16"):
    yield


def test_identical_layers_share_one_trace_and_one_lowered_function():
  x, w, _ = _operands()
  ws = [w + i for i in range(4)]

  def layers(a, bs):
    for b in bs:
      a = jnp.tanh(a @ b)
    return jnp.einsum("bqd,bkd->bqk", a, a)

  f = jaxprec.emulate(layers, "highest")
  closed = jax.make_jaxpr(f)(x, ws)
  calls = [e for e in closed.jaxpr.eqns if emulated_ops.is_emulated_call(e)]
  # 4 layers and the einsum: the layers' calls hold one and the same jaxpr.
  assert len(calls) == 5
  assert len({id(e.params["jaxpr"]) for e in calls}) == 2
  text = jax.jit(f).lower(x, ws).as_text()
  assert len(re.findall(r"func.func private @_traced_once(_\d+)?\(", text)) == 2
  assert len(re.findall(r"call @_traced_once(_\d+)?\(", text)) == 5


def test_the_jit_wrapper_is_marked_and_emulating_again_keeps_it():
  x, w, _ = _operands()
  f = jaxprec.emulate(lambda a, b: a @ b, "high")
  closed = jax.make_jaxpr(f)(x[1], w)
  (call,) = closed.jaxpr.eqns
  assert call.primitive.name in ("jit", "pjit")
  assert emulated_ops.is_emulated_call(call)
  inner = call.params["jaxpr"].jaxpr.eqns
  assert [e.primitive.name for e in inner] == [emulated_ops.MARKER]
  assert emulated_ops.is_emulated_call(inner[0])
  # Emulating the emulated function again binds the same call unchanged.
  again = jax.make_jaxpr(jaxprec.emulate(f, "bfloat16"))(x[1], w)
  (call2,) = again.jaxpr.eqns
  assert call2.params["jaxpr"] is call.params["jaxpr"]
  np.testing.assert_array_equal(jaxprec.emulate(f, "bfloat16")(x[1], w),
                                f(x[1], w))


def test_a_users_jit_around_a_marked_scope_is_not_an_emulated_call():
  # A jit whose body is not one marked emulated op is walked into, as before.
  x, w, _ = _operands()
  g = jaxprec.emulate(lambda a, b: a @ b, "high")

  @jax.jit
  def user(a, b):
    with jax.named_scope(emulated_ops.MARKER):
      return g(a, b) + a @ b

  closed = jax.make_jaxpr(user)(x[1], w)
  (outer,) = closed.jaxpr.eqns
  assert not emulated_ops.is_emulated_call(outer)
  marked = [w_.eqn for w_ in walker.iter_eqns(closed)
            if emulated_ops.is_emulated_call(w_.eqn)]
  assert marked  # the emulated op inside is still found


# Compiled HLO instructions that one more emulated matmul adds (x: 16 x 32,
# w: 32 x 32), measured with jax 0.10.2 plus about 15%: every pass, operand
# part and fusion the emulation adds costs XLA compile time, which a cold
# `jaxprec check` mostly is. Native: 8. The f32 kernel's passes run as one
# batched dot (63 and 73 at 3 and 6 passes, 77 and 125 one dot per pass).
PER_OP_BUDGET = {("bf16", "default"): 18, ("bf16", "high"): 80,
                 ("bf16", "highest"): 140, ("f32", "default"): 14,
                 ("f32", "high"): 73, ("f32", "highest"): 85}


def _compiled(kernel, precision, n):
  x = jnp.ones((16, 32))
  ws = [jnp.full((32, 32), 0.1 * (i + 1)) for i in range(n)]

  def layers(a, bs):
    for b in bs:
      a = jnp.tanh(a @ b)
    return a

  with jaxprec.use_kernel(kernel):
    lowered = jax.jit(jaxprec.emulate(layers, precision)).lower(x, ws)
  return lowered.as_text(), lowered.compile().as_text()


@pytest.mark.parametrize("kernel,precision", sorted(PER_OP_BUDGET))
def test_each_emulated_op_adds_a_bounded_compiled_program(kernel, precision):
  def count(text):
    return len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", text, re.M))

  lowered, four = _compiled(kernel, precision, 4)
  _, eight = _compiled(kernel, precision, 8)
  per_op = (count(eight) - count(four)) / 4
  assert 8 < per_op <= PER_OP_BUDGET[kernel, precision], per_op
  # The result is stored through a dynamic-update-slice (passes.stored): a
  # scatter would make XLA expand it and rerun its simplification passes
  # over the whole module.
  assert "scatter" not in lowered and "scatter(" not in four
  assert " while(" not in four
  if precision != "default":
    assert "stablehlo.dynamic_update_slice" in lowered


# The f32 kernel runs the passes of one small dot as one batched dot
# (emulated_ops.BATCH_MACS): the same bits as one dot per pass, in every
# form of dot_general, its derivatives and under vmap, special values included.
_DOT_FORMS = [
    ("ij,jk->ik", (16, 24), (24, 20)),       # a plain matmul
    ("bij,bjk->bik", (3, 16, 24), (3, 24, 20)),  # a batch axis
    ("ji,jk->ik", (24, 16), (24, 20)),       # lhs contracted on its first axis
    ("ijk,jkl->il", (8, 6, 4), (6, 4, 12)),  # two contracted axes
    ("i,i->", (24,), (24,)),                 # a vector dot
    ("ij,j->i", (16, 24), (24,)),            # a matvec
]
_MULTI_PASS = [("tpu", "high"), ("tpu", "highest"), ("tpu", "BF16_BF16_F32_X9"),
               ("gpu", "TF32_TF32_F32_X3")]


def _special(shape, seed):
  rng = np.random.default_rng(seed)
  a = rng.standard_normal(shape).astype(np.float32)
  flat = a.reshape(-1)
  flat[:7] = [np.inf, -np.inf, np.nan, 3e38, 2.0**-126, -1e-30,
              1 + 2.0**-9 + 2.0**-20]
  return a


def _both_forms(monkeypatch, kernel, f, precision, target, a, b):
  """``f`` emulated as the kernel computes it by default (passes batched on
  ``f32``, grouped by rhs part on ``bf16``) and with one dot per pass
  (``BATCH_MACS`` = -1): jitted, eager, under ``vmap`` and both gradients,
  each a list of 5 arrays."""

  def run():
    g = jaxprec.emulate(f, precision, target=target)
    loss = lambda x, y: jnp.sum(jnp.where(jnp.isfinite(g(x, y)), g(x, y), 0))  # noqa: E731
    return jax.tree_util.tree_leaves((
        jax.jit(g)(a, b), g(a, b),
        jax.vmap(g, in_axes=(0, None))(jnp.stack([a, a * 0.5]), b),
        jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)))

  with jaxprec.use_kernel(kernel):
    default = run()
    monkeypatch.setattr(emulated_ops, "BATCH_MACS", -1)
    # The eager path's compiled op is cached by its spec: compile it again.
    emulated_ops._forward_jit.clear_cache()
    try:
      apart = run()
    finally:
      emulated_ops._forward_jit.clear_cache()
  assert len(default) == len(apart) == 5
  return default, apart


# Every form at 6 passes (three parts of each operand), every other
# multi-pass algorithm on a plain matmul and on a batch axis.
_BATCHED_CASES = ([(f, "tpu", "highest") for f in _DOT_FORMS] +
                  [(f, t, p) for f in _DOT_FORMS[:2] for t, p in _MULTI_PASS
                   if p != "highest"])


@pytest.mark.parametrize("form,target,precision", _BATCHED_CASES,
                         ids=lambda v: v[0] if isinstance(v, tuple) else str(v))
def test_f32_kernel_batched_passes_are_bit_identical_to_one_dot_per_pass(
    monkeypatch, form, target, precision):
  spec, ls, rs = form
  a, b = _special(ls, 0), _special(rs, 1)
  assert emulated_ops.BATCH_MACS >= 20 * 24 * 24
  batched, apart = _both_forms(monkeypatch, "f32",
                               lambda x, y: jnp.einsum(spec, x, y),
                               precision, target, a, b)
  for x, y in zip(batched, apart):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint32),
                                  np.asarray(y).view(np.uint32))


def _dot_lines(kernel, precision):
  x, w = jnp.ones((16, 32)), jnp.full((32, 32), 0.1)
  with jaxprec.use_kernel(kernel):
    hlo = jax.jit(jaxprec.emulate(jnp.matmul, precision)).lower(x, w).as_text()
  return [l for l in hlo.splitlines() if "stablehlo.dot_general" in l]


@pytest.mark.parametrize("precision", ["high", "highest"])
def test_f32_kernel_runs_a_multi_pass_dot_as_one_batched_dot(precision):
  (one,) = _dot_lines("f32", precision)
  assert "batching_dims = [0] x [0]" in one, one


@pytest.mark.parametrize("precision,dots", [
    ("high", 2), ("highest", 3), ("BF16_BF16_F32_X9", 3)])
def test_bf16_kernel_runs_a_small_multi_pass_dot_as_one_dot_per_rhs_part(
    precision, dots):
  # (16, 32) x (32, 32): one bfloat16 dot per rhs part, of the lhs parts it
  # pairs with stacked along M: X3's 3 blocks in 2 dots, X6's 6 and X9's 9
  # in 3; every block a pass, none wasted.
  lines = _dot_lines("bf16", precision)
  assert len(lines) == dots, lines
  rows = [int(re.search(r"\(tensor<(\d+)x32xbf16>, tensor<32x32xbf16>\) -> "
                        r"tensor<\d+x32xf32>", l).group(1)) for l in lines]
  passes_n = {"high": 3, "highest": 6, "BF16_BF16_F32_X9": 9}[precision]
  assert sum(rows) == 16 * passes_n, rows


def _bf16_dots(f, *args, precision="high"):
  with jaxprec.use_kernel("bf16"):
    hlo = jax.jit(jaxprec.emulate(f, precision)).lower(*args).as_text()
  return [l for l in hlo.splitlines() if "stablehlo.dot_general" in l]


def test_bf16_kernel_keeps_one_dot_per_pass_where_grouping_would_change_path(
    monkeypatch):
  # A matrix-vector product and a dot of dimensions under 8 are computed in
  # XLA's own loops, not its library; a length-1 contraction is a multiply.
  # M and N both under 4 (jaxlib 0.10.2) sum otherwise once stacked. X6 runs
  # its 6 passes in 3 dots where it groups them.
  x, v, s = jnp.ones((16, 32)), jnp.ones((32,)), jnp.ones((4, 4))
  dots = lambda *a: len(_bf16_dots(jnp.matmul, *a, precision="highest"))  # noqa: E731
  assert dots(x, x.T) == 3
  assert dots(x, v) == dots(v, x.T) == dots(s, s) == 6
  assert dots(x[:, :1], x[:1, :]) == 6
  assert dots(x[:3], x[:3].T) == 6
  assert dots(x[:3], x[:4].T) == 3
  # Above BATCH_MACS run time counts, above GROUPED_ELEMENTS memory: one dot
  # per pass.
  monkeypatch.setattr(emulated_ops, "BATCH_MACS", 16 * 32 * 16 - 1)
  assert dots(x, x.T) == 6
  monkeypatch.undo()
  monkeypatch.setattr(emulated_ops, "GROUPED_ELEMENTS", 6 * 16 * 16 - 1)
  assert dots(x, x.T) == 6
  assert dots(x[:15], x.T) == 3


def test_f32_kernel_runs_the_passes_of_a_large_dot_apart(monkeypatch):
  # Above BATCH_MACS run time counts more than compile time: one dot per
  # pass, the same bits.
  assert 16 * 32 * 32 <= emulated_ops.BATCH_MACS < 1024**3
  (one,) = _dot_lines("f32", "highest")
  monkeypatch.setattr(emulated_ops, "BATCH_MACS", 16 * 32 * 32 - 1)
  apart = _dot_lines("f32", "highest")
  assert len(apart) == 3 and not any("batching_dims" in d for d in apart)
  assert "batching_dims = [0] x [0]" in one


# Every form at 3 and 6 passes, X9 on a plain matmul and a batch axis.
_WIDE_CASES = ([(f, p) for f in _DOT_FORMS for p in ("high", "highest")] +
               [(f, "BF16_BF16_F32_X9") for f in _DOT_FORMS[:2]] +
               # A long contraction and a narrow N: XLA:CPU (jaxlib 0.10.2)
               # blocks K by N, so a dot of the rhs parts side by side along
               # N (as X3 once ran) sums in another order than each pass.
               [(("ij,jk->ik", (8, 3072), (3072, 9)), p)
                for p in ("high", "highest")])
_ALGORITHM = {"high": "bf16x3", "highest": "bf16x6",
              "BF16_BF16_F32_X9": "bf16x9"}


# jaxlib releases from 0.12 on: XLA:CPU's bfloat16 dots sum in an order that
# depends on the whole shape (benchmarks/wide_dot_bits.py).
_SHAPE_DEPENDENT_SUMS = tuple(
    int(v) for v in jaxlib.version.__version__.split(".")[:2]) >= (0, 12)


def _one_dot_per_pass(spec, precision, a, b):
  """The bf16 kernel's result, each pass its own program: a bfloat16 dot of
  parts already in the canonical form, so that XLA sees two arrays and no
  transpose to fold (its library's dot), the passes combined eagerly."""
  dims = jax.eval_shape(lambda x, y: jnp.einsum(spec, x, y), a, b)
  closed = jax.make_jaxpr(lambda x, y: jnp.einsum(spec, x, y))(a, b)
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
  lmove, rmove, dn, out_shape = emulated_ops._canonical_dot(
      a.shape, b.shape, eqn.params["dimension_numbers"])
  lhs = passes.move(jnp.asarray(a), lmove)
  rhs = passes.move(jnp.asarray(b), rmove)
  dot = jax.jit(lambda l, r: lax.dot_general(
      l, r, dn, preferred_element_type=jnp.float32))

  def ops(pairs):
    return [dot(jax.device_put(l), jax.device_put(r)) for l, r in pairs]

  out = passes.BF16[_ALGORITHM[precision]](ops, lhs, rhs, "nearest",
                                           jnp.bfloat16)
  assert out_shape == dims.shape
  return out.reshape(out_shape)


@pytest.mark.parametrize("form,precision", _WIDE_CASES,
                         ids=lambda v: v[0] if isinstance(v, tuple) else str(v))
def test_bf16_kernel_passes_are_the_library_dots_of_their_parts(
    form, precision):
  # Each block of a grouped dot (and each pass of a dot that keeps its
  # passes apart) is the bfloat16 dot its pass runs alone, special values
  # included: jitted, eager and under vmap.
  spec, ls, rs = form
  a, b = _special(ls, 0), _special(rs, 1)
  want = _one_dot_per_pass(spec, precision, a, b)
  g = jaxprec.emulate(lambda x, y: jnp.einsum(spec, x, y), precision,
                      target="tpu")
  with jaxprec.use_kernel("bf16"):
    got = [jax.jit(g)(a, b), g(a, b),
           *jax.vmap(g, in_axes=(0, None))(jnp.stack([a, a]), b)]
  # Jitted, eager and under vmap: one program's bits, on every JAX.
  for x in got[1:]:
    np.testing.assert_array_equal(np.asarray(x).view(np.uint32),
                                  np.asarray(got[0]).view(np.uint32))
  if _SHAPE_DEPENDENT_SUMS:
    # jaxlib 0.12.1's XLA:CPU sums a bfloat16 dot in an order that depends on
    # the whole shape (benchmarks/wide_dot_bits.py: 662 of 1928 cases differ
    # there, none on 0.10.2): no form of the passes keeps the bits of each
    # pass run alone (one dot per pass differs for 'ji,jk->ik' jitted and for
    # 'ijk,jkl->il' under vmap; a grouped dot where M = 8).
    # What holds: non-finite results bit for bit, and the finite ones within
    # float32 accumulation of the same exact products.
    _assert_same_products_summed(got[0], want, spec, a, b, precision)
    return
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint32),
                                np.asarray(want).view(np.uint32))


@pytest.mark.parametrize("form,precision", [
    (_DOT_FORMS[0], "high"), (_DOT_FORMS[1], "highest"),
    (_DOT_FORMS[3], "high"), (_DOT_FORMS[0], "BF16_BF16_F32_X9")],
                         ids=lambda v: v[0] if isinstance(v, tuple) else str(v))
def test_bf16_kernel_grouped_passes_are_one_dot_per_pass_with_gradients(
    monkeypatch, form, precision):
  # The passes grouped by rhs part give the bits of one dot per pass:
  # forward, both gradients, jitted, eager and under vmap, special values
  # included.
  spec, ls, rs = form
  a, b = _special(ls, 0), _special(rs, 1)
  grouped, apart = _both_forms(monkeypatch, "bf16",
                               lambda x, y: jnp.einsum(spec, x, y),
                               precision, "tpu", a, b)
  for x, y in zip(grouped, apart):
    if _SHAPE_DEPENDENT_SUMS:
      # Stacked along M, XLA:CPU (jaxlib 0.12.1) may sum in another order.
      finite = np.isfinite(np.asarray(y))
      np.testing.assert_array_equal(np.asarray(x).view(np.uint32)[~finite],
                                    np.asarray(y).view(np.uint32)[~finite])
      np.testing.assert_allclose(np.asarray(x)[finite], np.asarray(y)[finite],
                                 rtol=2e-5, atol=1e-5)
    else:
      np.testing.assert_array_equal(np.asarray(x).view(np.uint32),
                                    np.asarray(y).view(np.uint32))


def _assert_same_products_summed(got, want, spec, a, b, precision):
  """``got`` and ``want`` sum the same exact products in float32, in other
  orders: the same non-finite values, and finite ones apart by at most two
  float32 accumulations of K + passes terms (``2 * (K + P) * 2**-24 *
  sum |a| |b|``, the standard bound, float64)."""
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  finite = np.isfinite(w)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32)[~finite],
                                np.asarray(want).view(np.uint32)[~finite])
  mag = np.einsum(spec, np.abs(np.nan_to_num(a.astype(np.float64), posinf=0,
                                             neginf=0)),
                  np.abs(np.nan_to_num(b.astype(np.float64), posinf=0,
                                       neginf=0)))
  ins, out = spec.split("->")
  sa, sb = ins.split(",")
  sizes = dict(zip(sa, a.shape)) | dict(zip(sb, b.shape))
  k = math.prod(sizes[c] for c in sa if c in sb and c not in out)
  passes_n = {"high": 3, "highest": 6, "BF16_BF16_F32_X9": 9}[precision]
  bound = 2 * (k + passes_n) * 2.0**-24 * mag
  assert np.all(np.abs(g - w)[finite] <= bound[finite]), (
      np.abs(g - w)[finite].max(), spec, precision)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("target,precision",
                         [("tpu", "default"), ("gpu", "default")] + _MULTI_PASS,
                         ids=lambda v: str(v))
@pytest.mark.parametrize("approximate", [False, True], ids=["erf", "tanh"])
def test_a_multi_pass_dot_keeps_its_operands_producer_apart(
    kernel, target, precision, approximate):
  # The user's op that makes an operand (a GELU) is computed to the bits it
  # has in a program of its own, as across the search's lax.switch: XLA:CPU
  # (jax 0.12.0.1) fused an exact GELU into the fusion that stacks the
  # parts and computed it to other bits (TF32_TF32_F32_X3 on a (1, 32, 128)
  # x (128, 64) dot), unless the operands are behind an optimization barrier.
  rng = np.random.default_rng(0)
  h = rng.standard_normal((1, 32, 128)).astype(np.float32) + 0.5
  w = (rng.standard_normal((128, 64)) * 0.1).astype(np.float32)
  b = rng.standard_normal((128,)).astype(np.float32)
  gelu = lambda h, b: jax.nn.gelu(h + b, approximate=approximate)  # noqa: E731
  with jaxprec.use_kernel(kernel):
    assert 32 * 128 * 64 <= emulated_ops.BATCH_MACS
    dots = [l for l in jax.jit(jaxprec.emulate(
        lambda h, w, b: gelu(h, b) @ w, precision, target=target)).lower(
            h, w, b).as_text().splitlines() if "stablehlo.dot_general" in l]
    if precision == "default":
      assert len(dots) == 1
    elif kernel == "f32":
      assert "batching_dims = [0] x [0]" in dots[0]
    elif precision != "TF32_TF32_F32_X3":  # float32 passes: one dot each
      # One bfloat16 dot per rhs part (emulated_ops._grouped_passes).
      assert len(dots) == (2 if precision == "high" else 3), dots
      assert all("bf16" in d for d in dots), dots
    fused = jax.jit(jaxprec.emulate(lambda h, w, b: gelu(h, b) @ w, precision,
                                    target=target))(h, w, b)
    apart = jax.jit(jaxprec.emulate(jnp.matmul, precision, target=target))(
        jax.jit(gelu)(h, b), w)
  np.testing.assert_array_equal(np.asarray(fused).view(np.uint32),
                                np.asarray(apart).view(np.uint32))


@pytest.mark.parametrize("kernel", ["bf16", "f32"])
@pytest.mark.parametrize("precision", ["high", "highest"])
def test_a_multi_pass_result_is_stored_in_place(monkeypatch, kernel, precision):
  # passes.stored writes back a first element added again from the last
  # addition's operands: XLA fuses the sum into the dynamic-update-slice and
  # updates in place. Written from the sum's own first element, XLA:CPU
  # (jax 0.10.2) copied the sum and updated the copy in a fusion of its own
  # wherever the result had more than one reader, as BERT's query, key and
  # value have (72 copies in BERT-base at three passes). The same bits.
  rng = np.random.default_rng(0)
  x = _special((1, 16, 32), 2)
  w = rng.standard_normal((32, 32)).astype(np.float32)

  def run():
    def f(x, w):  # a new function each time: traced and lowered afresh
      y = (x @ w).reshape(16, 32)
      return jnp.tanh(y) @ w, jnp.exp(y).sum(axis=0)

    with jaxprec.use_kernel(kernel):
      g = jax.jit(jaxprec.emulate(f, precision))
      text = g.lower(x, w).compile().as_text()
      return text[text.index("ENTRY"):], g(x, w)

  entry, got = run()
  copy = re.compile(r" = \S+ copy\(")
  assert not copy.search(entry), entry
  dus = re.findall(r"^\s*(?:ROOT )?%\S*dynamic-update-slice\S* = .*$", entry,
                   re.M)
  assert len(dus) >= 2 and all(" fusion(" in d for d in dus), dus
  # The element written back from the sum itself: a copy, the same bits.
  stored = passes.stored
  monkeypatch.setattr(passes, "stored",
                      lambda total, parts=None: stored(total))
  old_entry, old = run()
  if kernel == "bf16":  # (the f32 kernel's batched passes had no copy here)
    assert copy.search(old_entry)
  for a, b in zip(got, old):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32),
                                  np.asarray(b).view(np.uint32))
