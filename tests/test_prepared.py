"""Weights rounded once (jaxprec/_src/emulation/prepared.py): the search's switched
program reads the parameters' parts prepared once, and computes the same
numbers, bit for bit, as the program that splits them itself."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
import switching
from jaxprec._src.checker import harness
from jaxprec._src.core.precision import resolve
from jaxprec._src.emulation import passes
from jaxprec._src.emulation import prepared
from jaxprec._src.search import switch
from test_switch import _special_operands

CHOICES = {
    "tpu": ("bfloat16", "bfloat16_3x", "BF16_BF16_F32_X6", "BF16_BF16_F32_X9",
            "float32", "F16_F16_F32", "BF16_BF16_BF16"),
    "gpu": ("tensorfloat32", "TF32_TF32_F32_X3", "float32", "F16_F16_F16"),
}


def _programs(fn, units, names, args, target="tpu", **options):
  """(served, plain, requests): the switched program reading prepared parts,
  the same program splitting them itself, and what was prepared."""
  g = switch.switched(fn, units, [resolve(n) for n in names], target=target,
                      **options)
  leaves, tree = jax.tree_util.tree_flatten(tuple(args))

  def body(index, dynamic):
    return g(index, *jax.tree_util.tree_unflatten(tree, dynamic))

  requests: prepared.Requests = {}

  def record(index, dynamic):
    with prepared.recording(dynamic) as asked:
      out = body(index, dynamic)
      requests.update(asked)
    return out

  jax.eval_shape(record, switch.index_of([0] * len(units)), leaves)
  ready = prepared.prepare(leaves, requests)

  def served(index, ready, dynamic):
    with prepared.serving(dynamic, ready):
      return body(index, dynamic)
  fast, slow = jax.jit(served), jax.jit(body)
  return ((lambda i: fast(switch.index_of(i), ready, leaves)),
          (lambda i: slow(switch.index_of(i), leaves)), requests)


def _args(requests):
  return {arg for arg, *_ in requests.values()}


def _same_tree(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(switching.same(x, y) for x, y in zip(la, lb))


# Every pair of (target and TF32 rounding, kernel, contraction length) once:
# the TPU's 7 algorithms in all four (kernel, k) cases, each GPU rounding with
# both kernels and both lengths (the full cross product of the GPU roundings
# compiled 6 more programs of 4 algorithms each for no other pair).
_GPU = {"": {}, "away": {"tf32_rounding": "nearest_away"},
        "truncate": {"tf32_rounding": "truncate"}}
DOT_CASES = [
    *[("tpu", {}, kernel, k) for k in (1, 24) for kernel in ("bf16", "f32")],
    *[("gpu", _GPU[o], kernel, k) for o, kernel, k in (
        ("", "bf16", 1), ("", "f32", 24), ("away", "bf16", 24),
        ("away", "f32", 1), ("truncate", "bf16", 1), ("truncate", "f32", 24))]]
assert {(k, kernel) for t, _, kernel, k in DOT_CASES if t == "gpu"} == {
    (k, kernel) for k in (1, 24) for kernel in ("bf16", "f32")}


@pytest.mark.parametrize("target,options,kernel,k", DOT_CASES, ids=[
    "-".join([t, *o.values(), kernel, f"k{k}"]) for t, o, kernel, k in DOT_CASES])
def test_prepared_dot_operands_are_bit_for_bit_the_split_ones(kernel, target,
                                                              options, k):
  x, w = _special_operands(k)
  wt = np.ascontiguousarray(w.T)

  def f(x, w, wt):
    # The weight directly, transposed and reshaped: data movement only.
    return {"y": x @ w, "z": jnp.tanh(x @ wt.T),
            "v": jnp.einsum("ik,kj->ij", x, w.reshape(k, 3, 4).reshape(k, 12))}

  names = CHOICES[target]
  with jaxprec.use_kernel(kernel):
    served, plain, requests = _programs(f, [""], names, (x, w, wt), target,
                                        **options)
    # x is an argument too: prepared. wt reaches its dot transposed: not
    # prepared (XLA may run another dot kernel on a transposed argument).
    assert _args(requests) == {0, 1}
    for i, name in enumerate(names):
      fixed = jax.jit(jaxprec.emulate(f, jaxprec.Policy(default=name),
                                      target=target, **options))(x, w, wt)
      got = served([i])
      assert _same_tree(got, plain([i])), (name, kernel, k)
      assert _same_tree(got, fixed), (name, kernel, k)
      assert np.isnan(np.asarray(got["y"])).any()  # the special values ran


@pytest.mark.parametrize("kernel", ["bf16", "f32"])
def test_prepared_conv_kernels_are_bit_for_bit_the_split_ones(kernel):
  rng = np.random.default_rng(3)
  x = rng.standard_normal((2, 20, 8)).astype(np.float32) * np.float32(1e3)
  w = rng.standard_normal((3, 8, 8)).astype(np.float32)
  w[0, 0, :4] = (np.inf, 1e-40, 1 + 2.0**-9, 3e38)

  def f(x, w):
    y = jax.lax.conv_general_dilated(x, w, (2,), "VALID",
                                     dimension_numbers=("NWC", "WIO", "NWC"))
    return y - y.mean(-1, keepdims=True)

  names = ("bfloat16", "bfloat16_3x", "float32", "BF16_BF16_F32_X9")
  with jaxprec.use_kernel(kernel):
    served, plain, requests = _programs(f, [""], names, (x, w))
    assert _args(requests) == {0, 1}
    for i, name in enumerate(names):
      fixed = jax.jit(jaxprec.emulate(f, jaxprec.Policy(default=name)))(x, w)
      assert switching.same(served([i]), plain([i])), name
      assert switching.same(served([i]), fixed), name


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, name="a")(x)
    x = nn.LayerNorm(name="ln")(x)
    scale = self.param("scale", nn.initializers.ones, (16, 16))
    x = x @ (scale * 0.5)  # a weight computed from a parameter: not prepared
    x = nn.Dense(16, name="b")(jnp.tanh(x))
    return nn.Dense(4, name="c", precision="highest")(x)  # a fixed op


def _applied(net):
  """``(fn, params, x, where)``: ``net`` applied, its arguments, and the
  index of each argument leaf by its path."""
  x = jax.random.normal(jax.random.key(0), (3, 8))
  params = net.init(jax.random.key(1), x)

  def fn(p, x):
    return net.apply(p, x)
  paths, _ = jax.tree_util.tree_flatten_with_path((params, x))
  where = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(paths)}
  return fn, params, x, where


def test_requests_name_the_parameters_that_feed_matmuls():
  fn, params, x, where = _applied(_Net())
  leaves = jax.tree_util.tree_leaves((params, x))
  kernels = {i for k, i in where.items() if k.endswith("['kernel']")}
  scale = where["[0]['params']['scale']"]
  assert len(kernels) == 3
  with jaxprec.use_kernel("bf16"):  # "auto" may choose f32 for some
    served, plain, requests = _programs(fn, ["a", "b"],
                                        ("bfloat16", "bfloat16_3x", "float32"),
                                        (params, x))
  args = _args(requests)
  assert kernels <= args  # a, b and the fixed op c
  assert scale not in args  # scale * 0.5 is computed: split where used
  assert all(leaves[i].ndim >= 2 for i in args)  # no bias: added, not multiplied
  a_kernel = where["[0]['params']['a']['kernel']"]
  (keys,) = [r[3] for r in requests.values() if r[0] == a_kernel]
  # One per candidate: 1, 3 and 6 passes (float32 on a TPU is 6 passes).
  assert keys == {"bf16/1/bfloat16", "bf16/2/bfloat16", "bf16/3/bfloat16"}
  for levels in ([0, 0], [1, 2], [2, 1]):
    assert _same_tree(served(levels), plain(levels)), levels


def test_provenance_follows_data_movement_only():
  def f(w, v, h):
    a = w.reshape(2, 12)[None]  # moves
    b = w * 2.0  # arithmetic
    c = v.astype(jnp.float32)  # a float16 argument: not float32
    return (a, b, c, jax.jit(lambda t: t.T)(w), h.astype(jnp.float32), w.T,
            jnp.broadcast_to(h, (2, 3)))

  closed = jax.make_jaxpr(f)(jnp.ones((6, 4)), jnp.ones((2,), jnp.float16),
                             jnp.ones((3,)))
  where = prepared.provenance(closed)
  outs = closed.jaxpr.outvars
  assert where[outs[0]][0] == 0
  assert [e.primitive.name for e in where[outs[0]][1]] == [
      "reshape", "broadcast_in_dim"]
  assert prepared._served(where[outs[0]][1])
  assert outs[1] not in where and outs[2] not in where
  assert outs[3] not in where  # a nested jit: its own jaxpr, not followed
  assert where[outs[4]] == (2, ())  # a float32-to-float32 convert moves nothing
  # Followed (one argument on both sides of a matmul is seen as one), but
  # not served: a transpose, and a broadcast that adds elements (_MOVES).
  assert where[outs[5]][0] == 0 and not prepared._served(where[outs[5]][1])
  assert where[outs[6]][0] == 2 and not prepared._served(where[outs[6]][1])


def test_parts_of_every_key_match_the_split_functions():
  """:func:`passes.compute` is the split the pass functions used before."""
  from jaxprec._src.emulation.rounding import round_to, split_bf16, split_tf32
  x, _ = _special_operands(24)
  x = jnp.asarray(x)
  for n in (1, 2, 3):
    for dtype in (jnp.bfloat16, jnp.float32):
      got = passes.compute(f"bf16/{n}/{jnp.dtype(dtype).name}", x)
      want = split_bf16(x, n, dtype=dtype)
      assert all(switching.same(np.asarray(a, np.float32), np.asarray(b, np.float32))
                 for a, b in zip(got, want))
  for mode in ("nearest", "nearest_away", "truncate"):
    assert all(switching.same(a, b) for a, b in zip(
        passes.compute(f"tf32x3/{mode}", x), split_tf32(x, mode)))
    assert switching.same(passes.compute(f"tf32/{mode}", x)[0],
                          round_to(x, "tensorfloat32", mode))
  with pytest.raises(KeyError):
    passes.compute("bf17/2/bfloat16", x)


def test_state_is_restored_after_an_exception():
  x = jnp.ones((2, 2))
  with pytest.raises(RuntimeError):
    with prepared.recording([x]):
      raise RuntimeError("inside")
  assert prepared._STATE.mode is None and prepared._STATE.index == {}
  assert prepared.sources(None, [x]) is None  # outside any scope
  with prepared.serving([x], {}):  # nothing prepared: nothing served
    assert prepared._STATE.mode is None


def test_gradients_inside_the_served_program_are_the_split_ones():
  """A function that differentiates itself (a training step): the prepared
  parts carry no cotangent; the weights' gradients are the same."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 8)).astype(np.float32)
  w = rng.standard_normal((8, 8)).astype(np.float32)

  def step(x, w):
    loss = lambda w: jnp.sum(jnp.tanh(x @ w) ** 2)  # noqa: E731
    g = jax.grad(loss)(w)
    return {"loss": loss(w), "grad": g, "w": w - 0.1 * g}

  served, plain, _ = _programs(step, [""], ("bfloat16", "bfloat16_3x"), (x, w))
  for i in (0, 1):
    assert _same_tree(served([i]), plain([i]))
  fixed = jax.jit(jaxprec.emulate(step, "bfloat16_3x"))(x, w)
  assert _same_tree(served([1]), fixed)


def test_the_search_prepares_once_and_its_program_reads_the_parts(monkeypatch):
  fn, params, x, _ = _applied(_Net())
  calls = []
  real = prepared.prepare

  def counting(dynamic, requests):
    calls.append(dict(requests))
    return real(dynamic, requests)
  monkeypatch.setattr(prepared, "prepare", counting)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    plain = jaxprec.search_policy(fn, params, x, tolerance=1e-3,
                                  verbose=False)
    assert calls == []  # off by default
    res = jaxprec.search_policy(fn, params, x, tolerance=1e-3,
                                prepare_weights=True, verbose=False)
    slow = jaxprec.search_policy(fn, params, x, tolerance=1e-3,
                                 compile_once=False, verbose=False)
  switched = [s for s in res.history if s.program == "switched"]
  assert switched and len(calls) == 1 and calls[0]
  assert str(res.policy) == str(plain.policy)
  assert [s.worst_value for s in res.history] == [
      s.worst_value for s in plain.history]
  assert str(res.policy) == str(slow.policy)
  assert [s.worst_value for s in res.history] == [s.worst_value for s in slow.history]


def test_a_switched_program_without_parameters_runs_unserved():
  """Nothing to prepare (no float32 argument feeds a matmul): no program."""
  def f(x):
    return jnp.tanh(x * 2.0) @ jnp.tanh(x.T)
  x = jnp.ones((4, 4))
  served, plain, requests = _programs(f, [""], ("bfloat16", "float32"), (x,))
  assert requests == {}
  assert prepared.prepare([x], requests) == {}
  assert switching.same(served([0]), plain([0]))


def test_run_indexed_reads_what_prepare_indexed_prepared():
  fn, params, x, _ = _applied(_Net())
  call = harness.Args((params, x), {}, who="test")
  ref = harness.build_reference(fn, call, "float32", target="tpu",
                                mode="emulate")
  units = ("a", "b")
  choices = (resolve("bfloat16"), resolve("bfloat16_3x"), resolve("float32"))

  def wrap(f, index):
    return lambda *a, **k: switch.switched(f, units, choices, target="tpu")(
        index, *a, **k)
  cache: dict = {}
  index = switch.index_of([0, 1])
  ready = harness.prepare_indexed(fn, call, wrap, index, ref)
  assert ready and all(isinstance(v, dict) for v in ready.values())
  with_parts = harness.run_indexed(fn, call, wrap, "k", index, ref, cache,
                                   ready)
  without = harness.run_indexed(fn, call, wrap, "k2", index, ref, {})
  assert [m.rel_rms for m in with_parts] == [m.rel_rms for m in without]


class _Shared(nn.Module):
  """Two modules call one jitted function (JAX's trace cache gives both
  calls one body): with a parameter at one call, a computed weight at the
  other."""

  @nn.compact
  def __call__(self, x):
    mm = jax.jit(lambda a, b: jnp.tanh(a @ b))
    w1 = self.param("w1", nn.initializers.normal(), (8, 8))
    w2 = self.param("w2", nn.initializers.normal(), (8, 8))
    h = _Call(name="first")(mm, x, w1)
    return _Call(name="second")(mm, h, w2 * 2.0)


class _Call(nn.Module):
  @nn.compact
  def __call__(self, mm, a, b):
    return mm(a, b)


def test_a_body_shared_by_two_calls_serves_each_call_its_own_parts():
  fn, params, x, where = _applied(_Shared())
  with jaxprec.use_kernel("bf16"):
    served, plain, requests = _programs(
        jax.jit(fn), ["first", "second"],
        ("bfloat16", "bfloat16_3x", "float32"), (params, x))
  args = _args(requests)
  assert where["[0]['params']['w1']"] in args  # followed into the jit body
  assert where["[0]['params']['w2']"] not in args  # w2 * 2.0: computed
  for levels in ([0, 1], [1, 0], [2, 2], [0, 0]):
    assert _same_tree(served(levels), plain(levels)), levels
    fixed = jax.jit(jaxprec.emulate(fn, jaxprec.Policy.parse(
        f"default=float32,first={('bfloat16', 'bfloat16_3x', 'float32')[levels[0]]},"
        f"second={('bfloat16', 'bfloat16_3x', 'float32')[levels[1]]}")))
    assert _same_tree(served(levels), fixed(params, x)), levels


def test_parts_over_the_memory_limit_are_not_prepared():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 16)).astype(np.float32)
  w = rng.standard_normal((16, 16)).astype(np.float32)
  f = lambda x, w: x @ w  # noqa: E731
  with jaxprec.use_kernel("bf16"):
    served, plain, requests = _programs(f, [""], ("bfloat16", "bfloat16_3x"),
                                        (x, w))
  leaves = [x, w]
  need = prepared.nbytes(jax.eval_shape(prepared.preparer(requests), leaves))
  # x and w, each in 1 and 2 bfloat16 parts: 3 bfloat16 values per element.
  assert need == 3 * 2 * (x.size + w.size)
  assert prepared.prepare(leaves, requests, limit=need - 1) == {}
  ready = prepared.prepare(leaves, requests, limit=need)
  assert prepared.nbytes(ready) == need
  assert prepared.prepare(leaves, requests, limit=None).keys() == ready.keys()
  assert prepared.LIMIT_BYTES == 1 << 30


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_prepare_weights_must_be_a_bool(bad):
  with pytest.raises(TypeError, match="prepare_weights must be True or False"):
    jaxprec.search_policy(lambda x: x @ x, jnp.ones((2, 2)), tolerance=1e-3,
                          prepare_weights=bad)


def test_bench_prepared_quick(tmp_path):
  from test_benchmarks import run
  out = run("bench_prepared.py", "--quick", tmp_path=tmp_path).stdout
  for kernel in ("bf16", "f32"):
    assert re.search(rf"{kernel} kernel: \d+ arrays prepared once", out), out
  lines = re.findall(r"ratio ([\d.]+)x; prepared / native [\d.]+x; "
                     r"bit-identical: (\w+)", out)
  assert len(lines) == 4 and all(same == "True" for _, same in lines), out


@pytest.mark.parametrize("kw,why", [
    ({"compile_once": False}, "compile_once=False"),
    ({"axes": "dtype"}, "the dtype axis"),
    ({"mode": "native", "target": "tpu"}, "natively")])
def test_prepare_weights_where_it_cannot_apply_says_so(kw, why):
  fn, params, x, _ = _applied(_Net())
  with pytest.warns(UserWarning, match=f"prepare_weights=True has no effect "
                                       f"here \\(.*{why}"):
    jaxprec.search_policy(fn, params, x, tolerance=1e-2, verbose=False,
                          prepare_weights=True, budget=2, **kw)
