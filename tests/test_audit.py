"""Tests for jaxprec.audit: rows, precisions, FLOPs, nesting, errors, output."""

import dataclasses
import json
import os
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

import jaxprec
from jaxprec._src.inspect.audit import AuditError, AuditReport, AuditRow, audit

F32 = jnp.float32
P = lax.Precision
D = lax.DotAlgorithmPreset


def sds(*shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def matmul(a, b):
  return a @ b


MATMUL_LINE = matmul.__code__.co_firstlineno + 1
HERE = os.path.abspath(__file__)


class MLP(nn.Module):
  """One conv and two dense layers."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), name="conv")(x)
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(8, name="dense1")(x))
    return nn.Dense(2, name="dense2")(x)


def line_of(snippet):
  with open(HERE) as f:
    return next(i for i, line in enumerate(f, 1) if snippet in line)


CONV_LINE = line_of('x = nn.Conv(4, (3, 3), name="conv")(x)')


@pytest.fixture(scope="module")
def mlp():
  model = MLP()
  x = sds(2, 8, 8, 3)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  return (lambda p, x: model.apply(p, x)), params, x


# conv: out 2*8*8*4 = 512 elements, each 3*3 kernel * 3 in-features, 2 flops.
MLP_FLOPS = [2 * 512 * 9 * 3, 2 * 2 * 256 * 8, 2 * 2 * 8 * 2]


# ---------------------------------------------------------------------------
# The acceptance test: two-layer MLP plus one conv.


def test_mlp_under_bfloat16_context_all_risky(mlp):
  fn, params, x = mlp
  with jaxprec.precision("bfloat16"):
    report = audit(fn, params, x)
  assert len(report) == 3
  assert [r.primitive for r in report] == [
      "conv_general_dilated", "dot_general", "dot_general"]
  assert [r.name_stack for r in report] == ["MLP/conv", "MLP/dense1", "MLP/dense2"]
  assert all(r.precision == (P.DEFAULT, P.DEFAULT) for r in report)
  assert all(r.risky for r in report)
  assert report.risky == report.rows
  assert all(r.tpu == "bf16x1" and r.gpu == "tf32" for r in report)
  assert all("precision DEFAULT" in r.reason for r in report)
  assert [r.flops for r in report] == MLP_FLOPS
  assert report.precision_in_force == "bfloat16 (context)"


def test_mlp_under_preset_context_dots_keep_preset_conv_flagged(mlp):
  fn, params, x = mlp
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxprec.PresetConvWarning)
    with jaxprec.precision("F32_F32_F32"):
      report = audit(fn, params, x)
  conv, *dots = report.rows
  for r in dots:
    assert r.precision is D.F32_F32_F32
    assert r.precision_name == "F32_F32_F32"
    # A TPU does not run F32_F32_F32 (JAX's tests/lax_test.py): the audit
    # says so, as the emulation and the cost model do.
    assert (r.tpu, r.gpu, r.risky) == ("unsupported", "f32", True)
    assert r.reason.startswith("unsupported on TPU: F32_F32_F32")
    assert "'float32' (bf16x6" in r.reason
  # The with-form cannot fix convolutions: the audit shows the downgrade.
  assert conv.precision is D.F32_F32_F32
  assert conv.risky and conv.tpu == "bf16x1" and conv.gpu == "tf32"
  assert "preset F32_F32_F32" in conv.reason and "DEFAULT" in conv.reason


def test_mlp_under_preset_decorator_has_no_conv_at_default(mlp):
  fn, params, x = mlp
  report = audit(jaxprec.precision("BF16_BF16_F32_X6")(fn), params, x)
  conv, *dots = report.rows
  assert conv.precision == (P.HIGHEST, P.HIGHEST)
  assert (conv.tpu, conv.gpu) == ("bf16x6", "f32")
  assert all(r.precision is D.BF16_BF16_F32_X6 for r in dots)
  assert not report.risky


def test_plain_jax_preset_conv_is_risky(mlp):
  fn, params, x = mlp
  with jax.default_matmul_precision("BF16_BF16_F32_X6"):
    report = audit(fn, params, x)
  assert [r.risky for r in report] == [True, False, False]
  assert report.risky[0].primitive == "conv_general_dilated"
  assert report.risky[0].precision is D.BF16_BF16_F32_X6


def test_mlp_source_is_user_line_and_op_is_flax_method(mlp):
  fn, params, x = mlp
  conv, dense1, _ = audit(fn, params, x).rows
  assert conv.source == f"{HERE}:{CONV_LINE}"
  assert dense1.source == f"{HERE}:{CONV_LINE + 2}"
  assert conv.op.startswith("_Conv.__call__ (") and "flax" in conv.op
  assert dense1.op.startswith("Dense.__call__ (")


# ---------------------------------------------------------------------------
# Precisions.


@pytest.mark.parametrize("flag, recorded, name, tpu, gpu, risky", [
    (None, None, "None", "bf16x1", "tf32", True),
    ("default", (P.DEFAULT, P.DEFAULT), "DEFAULT", "bf16x1", "tf32", True),
    ("high", (P.HIGH, P.HIGH), "HIGH", "bf16x3", "tf32", False),
    ("float32", (P.HIGHEST, P.HIGHEST), "HIGHEST", "bf16x6", "f32", False),
    ("BF16_BF16_F32", D.BF16_BF16_F32, "BF16_BF16_F32", "bf16x1", "bf16x1", True),
    ("BF16_BF16_F32_X3", D.BF16_BF16_F32_X3, "BF16_BF16_F32_X3", "bf16x3",
     "bf16x3", False),
    ("F16_F16_F32", D.F16_F16_F32, "F16_F16_F32", "f16", "f16", True),
    ("TF32_TF32_F32", D.TF32_TF32_F32, "TF32_TF32_F32", "unsupported", "tf32",
     True),
])
def test_dot_precision_per_flag(flag, recorded, name, tpu, gpu, risky):
  with jax.default_matmul_precision(flag):
    (row,) = audit(matmul, sds(4, 8), sds(8, 2)).rows
  assert row.precision == recorded
  assert (row.precision_name, row.tpu, row.gpu, row.risky) == (name, tpu, gpu, risky)
  assert row.tpu_numerics.algorithm == tpu
  assert bool(row.reason) == risky


def test_backend_default_reason_names_it():
  (row,) = audit(matmul, sds(4, 8), sds(8, 2)).rows
  assert "no precision set" in row.reason and "8 significand bits" in row.reason
  assert row.tpu_numerics.operand_bits == 8 and row.gpu_numerics.operand_bits == 11


def test_per_op_precision_beats_the_context():
  def f(a, b):
    return jnp.dot(a, b, precision="highest") + jnp.dot(a, b)

  with jaxprec.precision("bf16"):
    r1, r2 = audit(f, sds(4, 4), sds(4, 4)).rows
  assert r1.precision == (P.HIGHEST, P.HIGHEST) and not r1.risky
  assert r2.precision == (P.DEFAULT, P.DEFAULT) and r2.risky


def test_mixed_level_pair_reads_as_the_more_precise():
  f = lambda a, b: lax.dot(a, b, precision=(P.HIGHEST, P.DEFAULT))
  (row,) = audit(f, sds(4, 4), sds(4, 4)).rows
  assert row.precision == (P.HIGHEST, P.DEFAULT)
  assert (row.precision_name, row.tpu, row.risky) == ("HIGHEST,DEFAULT", "bf16x6",
                                                       False)


@pytest.mark.parametrize("dtype, native", [
    (jnp.bfloat16, "native bfloat16"), (jnp.float16, "native float16"),
    (jnp.int8, "native int8")])
def test_non_float32_operands_are_native_and_the_precision_is_no_risk(
    dtype, native):
  with jax.default_matmul_precision("F32_F32_F32"):
    (row,) = audit(matmul, sds(4, 8, dtype=dtype), sds(8, 2, dtype=dtype)).rows
  assert (row.tpu, row.gpu) == (native, native)
  assert row.tpu_numerics is None and row.lhs_dtype == np.dtype(dtype).name
  # The precision flag is no risk; accumulating in a 16-bit float is
  # (tests/test_audit_dtype.py), and int8 accumulates in int8: not flagged.
  assert "precision" not in row.reason
  assert row.risky == (dtype != jnp.int8)
  assert row.risky == row.reason.startswith("accumulates in ")


def test_bf16_conv_with_preset_is_not_risky():
  f = lambda x, k: lax.conv(x, k, (1, 1), "SAME", precision="F32_F32_F32")
  (row,) = audit(f, sds(1, 2, 4, 4, dtype=jnp.bfloat16),
                 sds(3, 2, 3, 3, dtype=jnp.bfloat16)).rows
  assert row.precision is D.F32_F32_F32
  assert row.tpu == "native bfloat16"
  # Not the preset: bfloat16 operands run natively. Risky only because it
  # accumulates in bfloat16 (its result dtype).
  assert "preset" not in row.reason
  assert row.reason.startswith("accumulates in bfloat16")


# ---------------------------------------------------------------------------
# FLOPs and shapes.


def test_dot_flops_with_batch_dims():
  f = lambda a, b: jnp.einsum("bij,bjk->bik", a, b)
  (row,) = audit(f, sds(3, 4, 5), sds(3, 5, 6)).rows
  assert row.flops == 2 * 3 * 4 * 5 * 6
  assert (row.lhs_shape, row.rhs_shape, row.out_shape) == ((3, 4, 5), (3, 5, 6),
                                                           (3, 4, 6))
  assert (row.lhs_dtype, row.rhs_dtype, row.out_dtype) == ("float32",) * 3


def test_conv_flops_with_groups_and_strides():
  def f(x, k):
    return lax.conv_general_dilated(
        x, k, window_strides=(2, 2), padding="VALID", feature_group_count=2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"))

  # in 4 features in 2 groups, kernel HWIO (3, 3, 2, 6); out (1, 4, 4, 6).
  (row,) = audit(f, sds(1, 9, 9, 4), sds(3, 3, 2, 6)).rows
  assert row.out_shape == (1, 4, 4, 6)
  assert row.flops == 2 * (4 * 4 * 6) * (3 * 3) * 2


# ---------------------------------------------------------------------------
# Nested jaxprs.


def test_jit_and_named_scope_build_the_name_stack():
  @jax.jit
  def inner(a, b):
    with jax.named_scope("blk"):
      return a @ b

  @jax.jit
  def outer(a, b):
    return inner(a, b)

  (row,) = audit(outer, sds(2, 2), sds(2, 2)).rows
  assert row.name_stack == "jit(outer)/jit(inner)/blk"
  assert row.scope == ("jit", "jit")


def test_checkpoint():
  f = jax.checkpoint(matmul)
  (row,) = audit(f, sds(3, 3), sds(3, 3)).rows
  assert row.scope in (("remat2",), ("checkpoint",))
  assert row.source == f"{HERE}:{MATMUL_LINE}"
  assert row.op.startswith("matmul (")


def test_scan_multiplies_flops_by_length_nested():
  def f(c, w):
    def outer(c, _):
      def inner(c, _):
        return c @ w, None
      return lax.scan(inner, c, None, length=5)[0], None
    return lax.scan(outer, c, None, length=3)[0]

  (row,) = audit(f, sds(4, 4), sds(4, 4)).rows
  assert row.scope == ("scan", "scan")
  assert row.trip_count == 15
  assert row.flops == 15 * 2 * 4 * 4 * 4


def test_while_counts_once():
  def f(a):
    return lax.while_loop(lambda c: c[1] < 3,
                          lambda c: (c[0] @ c[0], c[1] + 1), (a, 0))[0]

  (row,) = audit(f, sds(4, 4)).rows
  assert row.scope == ("while",) and row.trip_count == 1 and row.flops == 128


def test_cond_lists_every_branch():
  def f(p, a):
    return lax.cond(p, lambda a: a @ a, lambda a: (a @ a) @ a, a)

  rows = audit(f, True, sds(4, 4)).rows
  assert len(rows) == 3 and all(r.scope == ("cond",) for r in rows)


def test_custom_jvp_and_custom_vjp_bodies():
  @jax.custom_jvp
  def f(a):
    return a @ a
  f.defjvp(lambda p, t: (f(p[0]), t[0] @ p[0]))

  @jax.custom_vjp
  def g(a):
    return a @ a
  g.defvjp(lambda a: (g(a), a), lambda a, ct: (ct @ a.T,))

  with jaxprec.precision("float32"):
    r1, r2 = audit(lambda a: g(f(a)), sds(2, 2)).rows
  assert r1.scope == ("custom_jvp_call",) and r2.scope == ("custom_vjp_call",)
  assert r1.precision == r2.precision == (P.HIGHEST, P.HIGHEST)


def test_grad_lists_backward_matmuls():
  loss = lambda a, b: (a @ b).sum()
  rows = audit(jax.grad(loss, argnums=(0, 1)), sds(4, 8), sds(8, 2)).rows
  assert len(rows) == 3
  assert rows[0].name_stack == "jvp()"
  assert rows[1].name_stack.startswith("transpose(")


def test_shard_map_on_one_device():
  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
  f = jax.shard_map(matmul, mesh=mesh, in_specs=(PartitionSpec("x"), PartitionSpec()),
                    out_specs=PartitionSpec("x"))
  (row,) = audit(f, sds(4, 8), sds(8, 2)).rows
  assert row.scope[-1] == "shard_map" and row.flops == 2 * 4 * 8 * 2


def test_nnx_module_as_argument():
  model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  (row,) = audit(lambda m, x: m(x), model, sds(2, 3)).rows
  # NNX pushes no name scope; the method names the module class.
  assert row.name_stack == ""
  assert row.op.startswith("Linear.__call__ (")
  assert row.lhs_shape == (2, 3) and row.rhs_shape == (3, 4)


# ---------------------------------------------------------------------------
# Arguments, tracing, errors.


def test_never_runs_the_function():
  calls = []

  def f(a, b):
    jax.debug.callback(lambda: calls.append(1))
    return a @ b

  report = audit(jax.jit(f), jnp.ones((2, 2)), jnp.ones((2, 2)))
  assert len(report) == 1 and calls == []
  assert report.function == "test_never_runs_the_function.<locals>.f"


def test_kwargs_and_static_python_leaves():
  def f(x, *, w, layers, act):
    for _ in range(layers):
      x = act(x @ w)
    return x

  report = audit(f, sds(2, 4), w=sds(4, 4), layers=3, act=jnp.tanh)
  assert len(report) == 3


def test_no_matmuls_gives_an_empty_report():
  report = audit(lambda x: jnp.sin(x) + 1, sds(3))
  assert len(report) == 0 and report.rows == () and report.risky == ()
  assert report.flops_by_precision() == {"tpu": {}, "gpu": {}}
  assert "no matmuls or convolutions" in str(report)
  assert report.to_dict()["rows"] == []


def test_tracing_error_is_an_audit_error_naming_the_function():
  def broken_model(x):
    raise ValueError("boom")

  with pytest.raises(AuditError) as info:
    audit(broken_model, sds(2))
  assert isinstance(info.value, RuntimeError)
  msg = str(info.value)
  assert "test_tracing_error_is_an_audit_error_naming_the_function.<locals>." \
         "broken_model" in msg
  assert "ValueError: boom" in msg
  assert isinstance(info.value.__cause__, ValueError)


def test_shape_error_is_an_audit_error():
  with pytest.raises(AuditError, match=r"tracing matmul failed: TypeError"):
    audit(matmul, sds(2, 3), sds(4, 5))


def test_non_callable_is_a_type_error():
  with pytest.raises(TypeError, match=r"got 42 of type int"):
    audit(42)


# ---------------------------------------------------------------------------
# The report.


@pytest.fixture(scope="module")
def mixed_report(mlp):
  fn, params, x = mlp
  with jax.default_matmul_precision("BF16_BF16_F32_X6"):
    return audit(fn, params, x)


def test_flops_by_precision(mixed_report):
  conv, d1, d2 = MLP_FLOPS
  assert mixed_report.flops_by_precision() == {
      "tpu": {"bf16x1": conv, "bf16x6": d1 + d2},
      "gpu": {"tf32": conv, "bf16x6": d1 + d2},
  }
  assert mixed_report.total_flops == sum(MLP_FLOPS)


def test_to_json_round_trips(mixed_report):
  d = json.loads(mixed_report.to_json())
  assert d == mixed_report.to_dict()
  assert (d["num_ops"], d["num_risky"], d["total_flops"]) == (3, 1, sum(MLP_FLOPS))
  conv = d["rows"][0]
  assert conv["primitive"] == "conv_general_dilated"
  assert conv["precision"] == "BF16_BF16_F32_X6" and conv["risky"] is True
  assert conv["lhs_shape"] == [2, 8, 8, 3] and conv["tpu_numerics"]["passes"] == 1
  assert d["rows"][1]["tpu_numerics"]["operand_bits"] == 24


def test_str_is_an_aligned_table_with_totals(mixed_report):
  text = str(mixed_report)
  lines = text.splitlines()
  header = lines[1]
  assert header.split() == ["#", "op", "name", "stack", "function", "source",
                            "operands", "dtypes", "precision", "TPU", "GPU",
                            "FLOPs", "risky"]
  col = header.index("TPU")
  assert [line[col:col + 6] for line in lines[3:6]] == ["bf16x1", "bf16x6", "bf16x6"]
  assert lines[3].rstrip().endswith("RISKY") and not lines[4].endswith("RISKY")
  assert lines[6].startswith("total: 3 ops, 1 risky, 35.9k FLOPs per call; "
                             "TPU: bf16x1 77%, bf16x6 23%; GPU: tf32 77%, bf16x6 23%")
  assert lines[7] == "risky:" and lines[8].startswith("  #1: convolution recorded")


def test_rows_are_frozen(mixed_report):
  row = mixed_report.rows[0]
  assert isinstance(row, AuditRow) and isinstance(mixed_report, AuditReport)
  with pytest.raises(dataclasses.FrozenInstanceError):
    row.risky = False


# ---------------------------------------------------------------------------
# Opaque ops.


def test_opaque_ops_are_listed_and_pallas_dots_are_not_emulated():
  from jax.experimental import io_callback
  from jax.experimental import pallas as pl

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...])

  def f(x, y):
    out = pl.pallas_call(kernel, out_shape=sds(8, 8), interpret=True,
                         name="mm_kernel")(x, y)
    out = jax.pure_callback(lambda a: np.asarray(a), sds(8, 8), out)
    out = io_callback(lambda a: np.asarray(a), sds(8, 8), out)
    out = jax.ffi.ffi_call("my_ffi_target", sds(8, 8))(out)
    return out @ y

  r = audit(f, sds(8, 8), sds(8, 8))
  assert [o.primitive for o in r.opaque] == [
      "pallas_call", "pure_callback", "io_callback", "ffi_call"]
  assert r.opaque[0].name == "pallas_call 'mm_kernel'"
  assert r.opaque[3].name == "ffi_call 'my_ffi_target'"
  assert "<lambda>" in r.opaque[1].name
  assert {os.path.basename(o.source.rsplit(":", 1)[0]) for o in r.opaque} == {
      "test_audit.py"}  # the user's line
  # The kernel's own dot is seen (inside pallas_call) but not emulated.
  assert [(row.scope, row.emulated) for row in r.rows] == [
      (("pallas_call",), False), ((), True)]
  assert r.rows[0].flops == 2 * 8 * 8 * 8
  text = str(r)
  assert "dot (not emulated)" in text
  assert "opaque: 4 op(s) jaxprec cannot see into" in text
  assert "ffi_call 'my_ffi_target'" in text
  d = json.loads(r.to_json())
  assert [o["primitive"] for o in d["opaque"]][0] == "pallas_call"
  assert d["rows"][0]["emulated"] is False
  assert audit(matmul, sds(2, 2), sds(2, 2)).opaque == ()


def test_opaque_ops_are_listed_when_there_is_no_matmul():
  r = audit(lambda x: jax.pure_callback(np.sin, sds(3), x), sds(3))
  assert not r.rows and [o.primitive for o in r.opaque] == ["pure_callback"]
  assert "pure_callback 'sin'" in str(r)


def test_an_output_that_is_no_array_names_the_users_function_not_jaxprecs():
  import numpy as np
  def returns_text(x):
    return x @ x.T, "text"
  with pytest.raises(jaxprec.AuditError, match=r"returns_text returned a str "
                     r"at output\[1\]") as e:
    jaxprec.audit(returns_text, np.ones((2, 3), np.float32))
  assert "jaxprec/_src" not in str(e.value)
