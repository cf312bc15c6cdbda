"""jaxprec.audit lists every op that adds in bfloat16 or float16.

Sums, cumulative and windowed sums, scatter-adds, collectives, loop carries
and 16-bit dots, forward and backward, at any depth (scan, while, cond, jit,
custom_vjp, shard_map), with their module paths; and what JAX's
jax_allow_f16_reductions does to them (jax/_src/lax/lax.py,
_reduce_sum_dtype_rule): it rejects a bfloat16 reduce_sum at trace time and
nothing else.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

import jaxprec
from jaxprec._src.inspect import audit as audit_lib
from jaxprec._src.inspect.audit import AuditError, audit
from jaxprec._src.jaxpr import walker

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def sds(*shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def reductions(fn, *args):
  return audit(fn, *args).reductions


def one(fn, *args):
  (row,) = reductions(fn, *args)
  return row


# ---------------------------------------------------------------------------
# Which ops: sums in a narrow dtype, not in float32.


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_a_narrow_sum_is_listed_with_its_terms(dtype):
  row = one(lambda x: jnp.sum(x, axis=0, dtype=dtype), sds(6, 8, dtype=dtype))
  name = np.dtype(dtype).name
  assert (row.primitive, row.kind, row.dtype) == ("reduce_sum", "sum", name)
  assert (row.operand_shape, row.out_shape, row.terms) == ((6, 8), (8,), 6)
  assert (row.direction, row.matmul_row, row.rejected_by_flag) == (
      "forward", 0, True)
  assert row.reason.startswith(f"adds 6 {name} values into each result")
  assert row.source.endswith("test_audit_reductions.py:" + str(
      test_a_narrow_sum_is_listed_with_its_terms.__code__.co_firstlineno + 2))


def test_float32_sums_and_jnp_sum_of_bfloat16_are_not_listed():
  # jnp.sum of bfloat16 casts to float32 first (jax/_src/numpy/reductions.py,
  # upcast_f16_for_computation): nothing adds in bfloat16.
  assert not reductions(lambda x: jnp.sum(x), sds(64, dtype=F32))
  assert not reductions(lambda x: jnp.sum(x) + jnp.mean(x), sds(64))
  assert not reductions(lambda x: lax.reduce_sum(x.astype(F32), (0,)), sds(64))


def test_a_sum_over_an_axis_of_size_one_adds_nothing():
  assert not reductions(lambda x: lax.reduce_sum(x, (0,)), sds(1, 8))


def test_maxima_products_and_reduce_precision_are_not_accumulation():
  def f(x):
    return (jnp.max(x, axis=0), jnp.prod(x, axis=0, dtype=BF16),
            lax.cummax(x, axis=0), lax.reduce_precision(x, 5, 2))
  assert not reductions(f, sds(4, 8))


@pytest.mark.parametrize("op, terms", [(jnp.cumsum, 32),
                                       (lax.cumlogsumexp, 32)])
def test_cumulative_sums(op, terms):
  row = one(lambda x: op(x, axis=0), sds(32, 4))
  assert (row.kind, row.terms, row.out_shape) == ("cumulative", terms, (32, 4))
  assert not row.rejected_by_flag


def test_windowed_scattered_and_generic_sums():
  def f(x, ids):
    pooled = lax.reduce_window(x, 0.0, lax.add, (2, 2), (2, 2), "VALID")
    # An init JAX does not recognise as add's identity: the generic op.
    own = lax.reduce_window(x, BF16(0), lax.add, (4, 1), (1, 1), "VALID")
    segments = jax.ops.segment_sum(x, ids, num_segments=3)
    generic = lax.reduce(x, BF16(0), lambda a, b: a + b * 1, (1,))
    maxima = lax.reduce(x, BF16(0), lambda a, b: lax.max(a, b * 1), (1,))
    return pooled, own, segments, generic, maxima
  rows = reductions(f, sds(8, 4), sds(8, dtype=jnp.int32))
  assert [(r.primitive, r.kind, r.terms) for r in rows] == [
      ("reduce_window_sum", "window", 4), ("reduce_window", "window", 4),
      ("scatter-add", "scatter", 9), ("reduce", "sum", 4)]


def test_max_pooling_gradient_scatters_into_overlapping_windows():
  def loss(x):
    pooled = lax.reduce_window(x, -jnp.inf, lax.max, (3, 3), (1, 1), "VALID")
    return jnp.sum(pooled.astype(F32))
  (row,) = reductions(jax.grad(loss), sds(8, 8))
  assert (row.primitive, row.kind, row.terms, row.direction) == (
      "select_and_scatter_add", "scatter", 9, "backward")


def test_dot_with_a_16_bit_preferred_element_type_points_at_its_row():
  def f(x, w):
    return (lax.dot(x, w, preferred_element_type=BF16),
            lax.dot(x, w, preferred_element_type=F32))
  report = audit(f, sds(4, 16), sds(16, 2))
  (row,) = report.reductions
  assert (row.primitive, row.kind, row.terms, row.matmul_row) == (
      "dot_general", "dot", 16, 1)
  assert report.rows[0].accumulation_dtype == "bfloat16"
  assert report.rows[1].accumulation_dtype == "float32"
  assert "preferred_element_type=float32" in row.reason


def test_conv_in_float16_is_listed_with_kernel_size_times_features():
  def f(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))
  row = one(f, sds(1, 8, 8, 3, dtype=F16), sds(3, 3, 3, 4, dtype=F16))
  assert (row.kind, row.dtype, row.terms, row.matmul_row) == (
      "conv", "float16", 27, 1)


# ---------------------------------------------------------------------------
# Collectives.


def test_psum_in_shard_map_is_a_collective_over_its_mesh_axes():
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

  def body(g, h):
    return lax.psum((g, h), "data"), lax.psum(g.astype(F32), "data")
  f = jax.shard_map(body, mesh=mesh,
                    in_specs=(PartitionSpec("data"), PartitionSpec()),
                    out_specs=((PartitionSpec(), PartitionSpec()),
                               PartitionSpec()))
  report = audit(f, sds(4, 8), sds(3))
  rows = report.reductions  # one per leaf; the float32 psum is not listed
  assert [r.operand_shape for r in rows] == [(4, 8), (3,)]
  for row in rows:
    assert row.primitive in ("psum", "psum_invariant")
    assert (row.kind, row.axes, row.terms, row.operands) == (
        "collective", ("data",), 1, 1)
    assert row.scope[-1] == "shard_map" and not row.rejected_by_flag
    assert "jax issue 27496" in row.reason
  assert "1 device " in str(report)


def test_psum_scatter_and_pmean():
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

  def body(g):
    return lax.psum_scatter(g, "data", tiled=True), lax.pmean(g, "data")
  f = jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("data"),
                    out_specs=(PartitionSpec("data"), PartitionSpec()))
  rows = reductions(f, sds(4, 8))
  assert [r.kind for r in rows] == ["collective", "collective"]
  assert rows[0].primitive == "reduce_scatter" and rows[0].terms == 1


def test_psum_under_pmap_knows_its_axis_size():
  f = jax.pmap(lambda g: lax.psum(g, "devices"), axis_name="devices")
  (row,) = reductions(f, sds(1, 8))
  assert (row.kind, row.axes, row.terms, row.operand_shape) == (
      "collective", ("devices",), 1, (8,))


# ---------------------------------------------------------------------------
# Forward and backward.


def test_grad_of_a_bfloat16_mask_sum_is_a_backward_row():
  # d/dmask of sum(x * mask): the cotangent of the broadcast mask is summed
  # over the batch, in bfloat16, in the backward pass.
  def loss(mask, x):
    return jnp.sum((x * mask).astype(F32))
  (row,) = reductions(jax.grad(loss), sds(8), sds(16, 8))
  assert (row.primitive, row.direction, row.terms) == ("reduce_sum",
                                                       "backward", 16)
  assert "transpose(" in row.name_stack and row.rejected_by_flag


def test_grad_of_jnp_max_counts_ties_in_bfloat16():
  # jax issue 38885: jnp.max's derivative counts the maxima in the input's
  # dtype, in the forward sweep of the differentiated function.
  (row,) = reductions(jax.grad(jnp.max), sds(100))
  assert (row.primitive, row.direction, row.terms) == ("reduce_sum", "jvp",
                                                       100)


def test_scan_over_shared_weights_accumulates_the_gradient_in_the_carry():
  def loss(w, xs):
    def step(h, x):
      return jnp.tanh(x @ w + h), None
    h, _ = lax.scan(step, jnp.zeros((2, 4), BF16), xs)
    return jnp.sum(h.astype(F32))
  rows = reductions(jax.grad(loss), sds(4, 4), sds(5, 2, 4))
  loop = [r for r in rows if r.kind == "loop"]
  assert [(r.primitive, r.direction, r.terms, r.scope) for r in loop] == [
      ("add_any", "backward", 5, ("scan",))]
  dots = [r for r in rows if r.kind == "dot"]
  assert {r.direction for r in dots} == {"jvp", "backward"}


# ---------------------------------------------------------------------------
# Nothing nested is skipped.


def bf16_sum(x):
  return lax.reduce_sum(x, (0,))


def test_inside_scan_while_and_cond():
  def f(x, n, p):
    s = lax.scan(lambda c, xi: (c, bf16_sum(xi)), 0, x)[1]
    w = lax.fori_loop(0, n, lambda i, c: c * bf16_sum(x[0]), jnp.ones(8, BF16))
    c = lax.cond(p, lambda: bf16_sum(x[0]), lambda: x[0, 0])
    return s, w, c
  rows = reductions(f, sds(3, 4, 8), sds(dtype=jnp.int32), sds(dtype=bool))
  assert [(r.scope[-1], r.trip_count) for r in rows] == [
      ("scan", 3), ("while", 1), ("cond", 1)]
  assert all(r.primitive == "reduce_sum" and r.terms == 4 for r in rows)


def test_loop_carries_in_scan_and_while():
  def f(x, n):
    total = lax.scan(lambda c, xi: (c + xi, None), jnp.zeros(8, BF16), x)[0]
    count = lax.fori_loop(0, n, lambda i, c: c + x[0], jnp.zeros(8, BF16))
    exact = lax.scan(lambda c, xi: (c + xi.astype(F32), None),
                     jnp.zeros(8, F32), x)[0]
    return total, count, exact
  rows = reductions(f, sds(6, 8), sds(dtype=jnp.int32))
  assert [(r.kind, r.primitive, r.terms, r.scope[-1]) for r in rows] == [
      ("loop", "add", 6, "scan"), ("loop", "add", 0, "while")]
  assert "terms unknown" in str(audit(f, sds(6, 8), sds(dtype=jnp.int32)))


def test_inside_jit_and_custom_vjp():
  @jax.custom_vjp
  def g(x):
    return bf16_sum(x)
  g.defvjp(lambda x: (g(x), None),
           lambda _, ct: (jnp.broadcast_to(ct, (4, 8)),))
  rows = reductions(lambda x: (jax.jit(bf16_sum)(x), g(x)), sds(4, 8))
  assert [r.scope for r in rows] == [("jit",), ("custom_vjp_call",)]
  assert rows[0].name_stack == "jit(bf16_sum)"


# ---------------------------------------------------------------------------
# Module paths.


class Pool(nn.Module):
  @nn.compact
  def __call__(self, x):
    return lax.reduce_sum(x, (1,))


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, dtype=BF16, name="proj")(x)
    return Pool(name="pool")(x)


def test_linen_module_paths():
  x = sds(2, 4)
  params = jax.eval_shape(Net().init, jax.random.key(0), x)
  rows = reductions(Net().apply, params, x)
  assert [(r.kind, r.module_path) for r in rows] == [("dot", "proj"),
                                                    ("sum", "pool")]
  assert rows[1].name_stack.endswith("Net/pool")


class Block(nnx.Module):
  def __init__(self, rngs):
    self.inner = nnx.Linear(4, 8, dtype=BF16, rngs=rngs)
    self.outer = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.outer(self.inner(x).astype(F32))


def test_nnx_module_path():
  model = Block(nnx.Rngs(0))
  (row,) = reductions(model, sds(3, 4, dtype=F32))
  assert (row.kind, row.dtype, row.module_path, row.terms) == (
      "dot", "bfloat16", "inner", 4)


# ---------------------------------------------------------------------------
# jax_allow_f16_reductions.


def test_the_flag_rejects_reduce_sum_only_at_trace_time():
  with jax.allow_f16_reductions(False):
    with pytest.raises(AuditError, match="jax_allow_f16_reductions=False"):
      audit(bf16_sum, sds(4, 8))
    # Every other accumulation traces as before: the flag checks reduce_sum.
    rows = reductions(
        lambda x, w: (jnp.cumsum(x), x @ w, lax.reduce_sum(x[:1], (0,))),
        sds(4, 8), sds(8, 2))
  assert [r.kind for r in rows] == ["cumulative", "dot"]
  assert not any(r.rejected_by_flag for r in rows)


def test_flag_note_cites_the_jax_source():
  assert "_reduce_sum_dtype_rule, jax/_src/lax/lax.py" in audit_lib.FLAG_NOTE


# ---------------------------------------------------------------------------
# Output.


def mixed(x, w, mask):
  y = jnp.cumsum(x, axis=0) @ w
  return jnp.sum((y * mask).astype(F32))


def test_text_lines_fit_100_columns_and_name_each_reduction():
  with jax.named_scope("a_rather_long_scope_name_that_makes_the_name_stack_long"):
    report = audit(jax.grad(mixed, argnums=2), sds(64, 32), sds(32, 16),
                   sds(16))
  text = str(report)
  start = text.index("low-precision accumulation:")
  section = text[start:].splitlines()
  assert section[0] == ("low-precision accumulation: 3 ops add in bfloat16, "
                        "each partial sum rounded to it:")
  assert all(len(line) <= 100 for line in section)
  labels = [line.split()[0] for line in section if line.startswith("  R")]
  assert labels[:3] == ["R1", "R2", "R3"]
  assert "dot_general #1" in text and "backward" in text
  assert any("jax_allow_f16_reductions=False" in line for line in section)


def test_json_holds_the_reductions():
  report = audit(jax.grad(mixed, argnums=2), sds(64, 32), sds(32, 16), sds(16))
  d = json.loads(report.to_json())
  assert d == report.to_dict()
  assert d["num_reductions"] == 3 == len(d["reductions"])
  first = d["reductions"][0]
  assert (first["primitive"], first["operand_shape"], first["terms"]) == (
      "cumsum", [64, 32], 64)
  assert d["reductions"][1]["matmul_row"] == 1


def test_empty_report_has_no_section():
  report = audit(lambda x: jnp.sum(x), sds(8, dtype=F32))
  assert report.reductions == ()
  assert "low-precision accumulation" not in str(report)


def test_cli_audit_prints_the_section(tmp_path, monkeypatch, capsys):
  from jaxprec._src.cli.cli import main
  (tmp_path / "red_model.py").write_text(
      "import jax, jax.numpy as jnp\n"
      "def target():\n"
      "  return (lambda x: jnp.cumsum(x),\n"
      "          (jax.ShapeDtypeStruct((16,), jnp.bfloat16),))\n")
  monkeypatch.chdir(tmp_path)
  assert main(["audit", "red_model.py:target"]) == 0
  out = capsys.readouterr().out
  assert "low-precision accumulation: 1 op adds in bfloat16" in out
  assert main(["audit", "--json", "red_model.py:target"]) == 0
  assert json.loads(capsys.readouterr().out)["num_reductions"] == 1


def test_every_accumulating_primitive_is_in_the_walkers_table():
  for name in audit_lib.ACCUMULATING:
    assert walker.classify(name) == "no_matmul", name
  assert set(audit_lib.ACCUMULATING.values()) | {"loop", "dot", "conv"} == set(
      audit_lib._FIXES)
