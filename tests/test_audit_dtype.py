"""The dtype story of each audited op: storage, compute and
accumulation dtypes, and dots that accumulate in bfloat16/float16 flagged risky."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxprec
import models

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
X = jax.ShapeDtypeStruct((4, 16), F32)
F32_DOT = functools.partial(lax.dot_general, preferred_element_type=F32)


def sds(*shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def dense_row(jit: bool, **fields):
  """The one row of a linen Dense(8, **fields) on float32 input."""
  model = nn.Dense(8, **fields)
  params = jax.eval_shape(model.init, jax.random.key(0), X)
  fn = jax.jit(model.apply) if jit else model.apply
  (row,) = jaxprec.audit(fn, params, X).rows
  return row


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_dense_bfloat16_compute_float32_params_is_risky(jit):
  row = dense_row(jit, dtype=BF16, param_dtype=F32)
  assert (row.lhs_storage, row.rhs_storage) == ("float32", "float32")
  assert (row.lhs_dtype, row.rhs_dtype) == ("bfloat16", "bfloat16")
  assert (row.out_dtype, row.accumulation_dtype) == ("bfloat16", "bfloat16")
  assert row.risky
  assert row.reason.startswith("accumulates in bfloat16, its result dtype")
  assert "8 significand bits" in row.reason
  assert "preferred_element_type=float32" in row.reason
  assert row.dtype_story == "f32->bf16 x f32->bf16 -> bf16"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_dense_with_preferred_element_type_float32_is_not_risky(jit):
  row = dense_row(jit, dtype=BF16, param_dtype=F32, dot_general=F32_DOT)
  assert (row.lhs_dtype, row.rhs_dtype) == ("bfloat16", "bfloat16")
  assert (row.lhs_storage, row.rhs_storage) == ("float32", "float32")
  assert (row.out_dtype, row.accumulation_dtype) == ("float32", "float32")
  assert (row.risky, row.reason) == (False, "")
  assert row.dtype_story == "f32->bf16 x f32->bf16 -> f32"


def test_plain_float32_dot_casts_nothing():
  with jaxprec.precision("float32"):
    row = dense_row(False)
  assert (row.lhs_storage, row.lhs_dtype, row.rhs_storage, row.rhs_dtype,
          row.accumulation_dtype) == ("float32",) * 5
  assert (row.risky, row.dtype_story) == (False, "f32 x f32 -> f32")


def test_stored_bfloat16_params_are_not_cast():
  row = dense_row(False, dtype=BF16, param_dtype=BF16)
  assert (row.lhs_storage, row.rhs_storage) == ("float32", "bfloat16")
  assert row.dtype_story == "f32->bf16 x bf16 -> bf16"


def test_explicit_narrow_preferred_element_type_and_float16():
  def f(a, b):
    return jnp.dot(a, b, preferred_element_type=BF16)
  (row,) = jaxprec.audit(f, sds(4, 8, dtype=BF16), sds(8, 2, dtype=BF16)).rows
  assert row.accumulation_dtype == "bfloat16" and row.risky
  assert row.reason.startswith("accumulates in bfloat16")
  (row,) = jaxprec.audit(lambda a, b: a @ b, sds(4, 8, dtype=F16),
                         sds(8, 2, dtype=F16)).rows
  assert row.accumulation_dtype == "float16"
  assert row.reason.startswith("accumulates in float16")
  assert "11 significand bits" in row.reason


def test_int8_accumulation_is_not_flagged():
  def f(a, b):
    return lax.dot(a, b, preferred_element_type=jnp.int32)
  (row,) = jaxprec.audit(f, sds(4, 8, dtype=jnp.int8),
                         sds(8, 2, dtype=jnp.int8)).rows
  assert (row.accumulation_dtype, row.risky) == ("int32", False)


def test_float32_operands_at_one_pass_and_bf16_accumulation_give_both_reasons():
  def f(a, b):
    return jnp.dot(a, b, preferred_element_type=BF16)
  (row,) = jaxprec.audit(f, sds(4, 8), sds(8, 2)).rows
  first, second = row.reason.split("; ")
  assert first.startswith("float32 operands, no precision set")
  assert second.startswith("accumulates in bfloat16")


def test_storage_is_followed_through_layout_ops_and_nested_jaxprs():
  cast = jax.jit(lambda w: w.astype(BF16))  # a cast inside a jit body

  def f(x, w, v):
    w16 = w.astype(BF16).reshape(8, 8).T  # layout ops
    v16 = cast(v)

    def body(c, _):  # the scan's body reads w16 as a constant
      return jnp.tanh(c @ w16), None
    h = lax.scan(body, x.astype(BF16), None, length=3)[0]
    return lax.cond(x[0, 0] > 0, lambda a: a @ v16, lambda a: a @ v16 * 2, h)

  rows = jaxprec.audit(f, sds(2, 8), sds(64), sds(8, 4)).rows
  assert len(rows) == 3  # the scan body, the two cond branches
  scan_row = rows[0]
  assert scan_row.scope == ("scan",) and scan_row.trip_count == 3
  assert (scan_row.lhs_storage, scan_row.lhs_dtype) == ("float32", "bfloat16")
  assert (scan_row.rhs_storage, scan_row.rhs_dtype) == ("float32", "bfloat16")
  for row in rows[1:]:  # h is the scan's output: computed, stored as bf16
    assert row.scope == ("cond",)
    assert (row.lhs_storage, row.rhs_storage) == ("bfloat16", "float32")


def test_a_cast_after_arithmetic_is_storage_of_its_own_dtype():
  def f(x, w):
    h = (x * 2).astype(BF16)  # the multiply makes a new float32 value
    return h @ w.astype(BF16)
  (row,) = jaxprec.audit(f, sds(2, 8), sds(8, 4)).rows
  assert (row.lhs_storage, row.rhs_storage) == ("float32", "float32")
  (row,) = jaxprec.audit(lambda x, w: (x * 2) @ w, sds(2, 8, dtype=BF16),
                         sds(8, 4, dtype=BF16)).rows
  assert (row.lhs_storage, row.rhs_storage) == ("bfloat16", "bfloat16")


class Mixed(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, dtype=BF16, name="bf16")(x)
    x = nn.Dense(8, dtype=BF16, dot_general=F32_DOT, name="acc32")(x)
    return nn.Dense(4, precision="highest", name="f32")(x)


def test_text_shows_the_dtype_story_and_counts_risky_accumulations():
  model = Mixed()
  params = jax.eval_shape(model.init, jax.random.key(0), X)
  report = jaxprec.audit(model.apply, params, X)
  text = str(report)
  lines = text.splitlines()
  assert lines[1].split()[7] == "dtypes"  # "name stack" is two words
  assert "f32->bf16 x f32->bf16 -> bf16" in lines[3] and "RISKY" in lines[3]
  assert "bf16 x f32->bf16 -> f32" in lines[4] and "RISKY" not in lines[4]
  assert "f32 x f32 -> f32" in lines[5] and "RISKY" not in lines[5]
  assert ("dtypes: of 3 ops, 2 compute in bfloat16, 1 computes in float32; "
          "2 cast an operand from its stored dtype; 1 accumulates in "
          "bfloat16/float16 (risky: ask preferred_element_type=float32)"
          ) in lines
  assert "  #1: accumulates in bfloat16" in text
  d = json.loads(report.to_json())
  assert d["num_risky"] == 1
  assert {k: d["rows"][0][k] for k in (
      "lhs_storage", "lhs_dtype", "rhs_storage", "rhs_dtype",
      "accumulation_dtype")} == {
          "lhs_storage": "float32", "lhs_dtype": "bfloat16",
          "rhs_storage": "float32", "rhs_dtype": "bfloat16",
          "accumulation_dtype": "bfloat16"}


def test_float32_report_has_no_dtype_summary():
  with jaxprec.precision("float32"):
    text = str(jaxprec.audit(lambda a, b: a @ b, sds(4, 8), sds(8, 2)))
  assert "dtypes:" not in text and "f32 x f32 -> f32" in text


def test_hugging_face_bert_in_bfloat16_computes_every_dense_in_bfloat16():
  model, params, ids = models.tiny_bert(dtype=BF16)
  report = jaxprec.audit(lambda p, i: model(i, params=p).last_hidden_state,
                         params, ids)
  dense = [r for r in report.rows if r.op.startswith("Dense.__call__")]
  # 2 layers x (q, k, v, attention output, intermediate, output) + pooler.
  assert len(dense) == 2 * 6 + 1
  for r in dense:
    assert (r.lhs_dtype, r.rhs_dtype) == ("bfloat16", "bfloat16"), r.name_stack
    assert r.rhs_storage == "float32"  # the kernels are stored in float32
    assert r.accumulation_dtype == "bfloat16" and r.risky
  # The attention einsums compute in bfloat16 too (the head mask is int32).
  assert {d for r in report.rows for d in (r.lhs_dtype, r.rhs_dtype)} == {
      "bfloat16", "int32"}
  assert all(r.accumulation_dtype == "bfloat16" for r in report.rows)
  n = len(report.rows)
  assert (f"dtypes: of {n} ops, {n} compute in bfloat16, 2 compute in int32; "
          f"{len(dense)} cast an operand from its stored dtype; {n} accumulate "
          f"in bfloat16/float16") in str(report)
