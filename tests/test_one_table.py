"""One table: the audit, the emulation and the cost model give every op one answer.

For every level and preset on each target, what the audit's column says, what
``jaxprec.emulate`` computes (against the NumPy + ml_dtypes reference of
``tests/reference.py``) and what ``jaxprec.cost`` charges agree: the same
passes in the same format, and an algorithm the target does not run refused
by all three. The record in ``jaxprec._src.core.algorithms`` is the only table:
no other module writes a fact per algorithm.
"""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec._src.core import algorithms, numerics
from jaxprec._src.core.precision import resolve
from jaxprec._src.emulation import kernels
from jaxprec._src.inspect import cost
from jaxprec._src.search import search

import reference

DN = (((1,), (0,)), ((), ()))
# A contraction of length 1: every pass is one product, so the emulation is
# bit for bit the reference. Values with bits below bfloat16, TF32 and float16.
X = np.array([[1 + 2.0**-9 + 2.0**-20], [-3 - 2.0**-12], [0.1]], np.float32)
W = np.array([[1 + 2.0**-8 + 2.0**-17, 2 - 2.0**-11, -1.7, 1 / 3]], np.float32)
CONTRACT = reference.dot_general(DN)
# What JAX's own test matrix (tests/lax_test.py, testDotAlgorithm) says a TPU
# does not run; XLA's IsSupportedDotAlgorithmOnGpu (algorithm_util.cc) runs
# all of these on an Ampere+ GPU.
NOT_ON_TPU = {"F32_F32_F32", "TF32_TF32_F32", "TF32_TF32_F32_X3", "F64_F64_F64"}
# The format of each pass: the ml_dtypes (or NumPy) type its operand parts are
# exact in, and the reference's rounding of it.
FORMATS = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
           "float32": np.float32}
# Algorithms not emulated on X and W: JAX computes f64 itself, and the f8
# presets take float8 operands only (tests/test_fp8_and_algorithms.py).
NOT_EMULATED = algorithms.NATIVE + ("f8",)


def _precisions():
  names = sorted({resolve(n).name for n in jaxprec.valid_names()})
  return [resolve(n) for n in names]


def _in_format(parts, fmt: str) -> bool:
  """Whether every part is a value of ``fmt`` (an explicit grid for TF32)."""
  for p in parts:
    p = np.asarray(p, np.float32)
    if fmt == "tensorfloat32":
      lo, hi = reference.neighbours(p, "tensorfloat32")
      if not np.all((lo == p) | (hi == p)):
        return False
    elif not np.array_equal(p.astype(FORMATS[fmt]).astype(np.float32), p):
      return False
  return True


def _answers(p, target):
  """(audit row, emulation result or the error, cost report or the error)."""
  f = lambda x, w: lax.dot_general(x, w, DN, precision=p.per_op)  # noqa: E731
  row = jaxprec.audit(f, X, W).rows[0]
  try:
    if getattr(row, target) in NOT_EMULATED:
      got = numerics.algorithm_for(p.per_op, target, jnp.float32, jnp.float32)
    else:
      with jaxprec.use_kernel("bf16"):  # XLA's passes, bit for bit
        got = np.asarray(jaxprec.emulate(f, target=target)(X, W))
  except jaxprec.UnsupportedAlgorithmError as e:
    got = e
  try:
    report = jaxprec.cost(f, X, W, target=target)
  except jaxprec.UnsupportedAlgorithmError as e:
    report = e
  return row, got, report


@pytest.mark.parametrize("target", algorithms.TARGETS)
def test_audit_emulation_and_cost_agree_on_every_precision(target):
  unsupported = set()
  for p in _precisions():
    row, got, report = _answers(p, target)
    column, meaning = getattr(row, target), getattr(row, f"{target}_numerics")
    assert meaning == p.on(target), p.name  # the audit reads precision's meaning
    if not meaning.modelled:  # jax 0.12.1's float8 split presets
      assert column == meaning.algorithm and row.risky, p.name
      assert row.reason.startswith("not modelled"), row.reason
      for e in (got, report):
        assert isinstance(e, jaxprec.UnsupportedAlgorithmError), (p.name, e)
        assert "jaxprec does not model this algorithm" in str(e), str(e)
      continue
    if column == "unsupported":
      unsupported.add(p.name)
      assert isinstance(got, jaxprec.UnsupportedAlgorithmError), p.name
      assert isinstance(report, jaxprec.UnsupportedAlgorithmError), p.name
      for e in (got, report):
        assert f"{p.name} " in str(e) and "'float32'" in str(e), str(e)
      if target == "tpu":
        assert row.risky and row.reason.startswith("unsupported on TPU"), p.name
      continue
    # Supported: never refused, never costed 0.
    assert not isinstance(got, Exception), (p.name, got)
    assert not isinstance(report, Exception), (p.name, report)
    assert column == meaning.algorithm
    if column in NOT_EMULATED:  # JAX computes it as recorded
      key = "native float32" if column in algorithms.NATIVE else column
      assert got == key.split()[0] and report.by_algorithm.keys() == {key}
      continue
    if meaning.pass_format in cost.PASS_COSTS[target]:
      assert report.cost > 0 and report.unknown_flops == 0, p.name
    else:  # a format without a cost figure there: unknown, no ratio
      assert report.unknown_flops == row.flops and report.relative is None
    assert report.by_algorithm.keys() == {column}, p.name
    # The passes the record names are the reference's passes, in its format.
    assert len(reference.passes(column)) == meaning.passes, p.name
    assert _in_format(reference.operand_parts(X, column), meaning.pass_format)
    assert _in_format(reference.operand_parts(W, column), meaning.pass_format)
    assert algorithms.pass_type(column, target) == (meaning.pass_format,
                                                    meaning.passes)
    # What the emulation computes is those passes, bit for bit.
    want = reference.emulate(X, W, column, CONTRACT)
    np.testing.assert_array_equal(got, want, err_msg=f"{p.name} on {target}")
  assert unsupported == (NOT_ON_TPU if target == "tpu" else set())


def test_unsupported_error_names_the_alternatives():
  f = lambda x, w: lax.dot_general(x, w, DN)  # noqa: E731
  with pytest.raises(jaxprec.UnsupportedAlgorithmError) as e:
    jaxprec.emulate(f, "F32_F32_F32", target="tpu")(X, W)
  msg = str(e.value)
  assert "F32_F32_F32" in msg and "does not run on a TPU" in msg
  assert "'float32' (bf16x6" in msg and "'bfloat16_3x' (bf16x3" in msg
  assert "target='gpu'" in msg and "lax_test.py" in msg
  assert isinstance(e.value, ValueError)
  np.testing.assert_array_equal(  # the GPU runs it: exact float32
      jaxprec.emulate(f, "F32_F32_F32", target="gpu")(X, W),
      reference.emulate(X, W, "f32", CONTRACT))


# ---------------------------------------------------------------------------
# Mixed operands: a float32 and a bfloat16 operand.


@pytest.mark.parametrize("target, precision, algorithm", [
    ("tpu", None, "bf16x1"), ("tpu", "highest", "bf16x6"), ("gpu", None, "tf32")])
def test_mixed_operands_one_answer(target, precision, algorithm):
  w16 = jnp.asarray(W, jnp.bfloat16)
  f = lambda x, w: lax.dot_general(x, w, DN, precision=precision)  # noqa: E731
  (row,) = jaxprec.audit(f, X, w16).rows
  assert getattr(row, target) == algorithm
  assert row.risky == (algorithm != "bf16x6")
  if row.risky:
    assert row.reason.startswith("float32 x bfloat16 operands")
  assert jaxprec.cost(f, X, w16, target=target).by_algorithm == {algorithm: row.flops}
  got = jaxprec.emulate(f, target=target)(X, w16)
  want = reference.emulate(X, np.asarray(w16, np.float32), algorithm, CONTRACT)
  np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------
# The record is the only table.


def test_every_module_reads_the_record():
  for name, r in algorithms.RECORDS.items():
    for target in algorithms.TARGETS:
      runs = target in r.targets
      assert algorithms.pass_type(name, target) == (
          (r.pass_format, r.passes) if runs else None), (name, target)
      weight = cost.WEIGHTS[target].get(name)
      if name in numerics.ALGORITHMS and runs and (
          r.pass_format in cost.PASS_COSTS[target]):
        assert weight == r.passes * cost.PASS_COSTS[target][r.pass_format]
      else:
        assert weight is None, (name, target)
    if name in numerics.ALGORITHMS:
      assert numerics.PASSES[name] == r.passes
    if r.dots is not None:  # an emulation kernel runs it
      bf16, f32, merged = r.dots
      assert bf16 + f32 == r.passes and 1 <= merged <= r.passes
      assert (bf16 > 0) == (r.pass_format == "bfloat16")
  # Native float32 is the target's HIGHEST, and HIGHEST is the search's top.
  for target in algorithms.TARGETS:
    f32 = resolve("float32").on(target)
    assert algorithms.float32_algorithm(target) == f32.algorithm
    assert cost.WEIGHTS[target]["native float32"] == cost.WEIGHTS[target][f32.algorithm]
    algos = [resolve(c).on(target) for c in search.DEFAULT_CANDIDATES[target]]
    assert all(a.supported for a in algos) and algos[-1] == f32
  choice = kernels.KernelChoice(setting="auto", source="default", backend="cpu",
                                device_kind="cpu", ratio=1.16, reason="")
  assert set(choice.per_algorithm()) == {
      a for a, r in algorithms.RECORDS.items() if r.dots is not None}


def _fact_tables(source: str) -> list[int]:
  """Lines of dict literals keyed by two or more algorithm names whose values
  are plain data (numbers, strings, tuples of them): a table of facts."""
  # Names that are no dtype alias too ('f16', 'f32' are).
  names = {a for a in algorithms.RECORDS if "x" in a or "_" in a or a == "tf32"}
  out = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Dict):
      continue
    keys = [k.value for k in node.keys
            if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    data = all(isinstance(v, ast.Constant) or (
        isinstance(v, ast.Tuple)
        and all(isinstance(e, ast.Constant) for e in v.elts)) for v in node.values)
    if len(names.intersection(keys)) >= 2 and data:
      out.append(node.lineno)
  return out


def test_no_other_module_writes_a_table_of_algorithms():
  root = pathlib.Path(jaxprec.__file__).parent
  found = {str(p.relative_to(root)): _fact_tables(p.read_text())
           for p in root.rglob("*.py") if p.name != "algorithms.py"}
  assert {k: v for k, v in found.items() if v} == {}
  # The check finds the tables that were deleted (passes, dots, pass types).
  assert _fact_tables('PASSES = {"bf16x1": 1, "bf16x3": 3}') == [1]
  assert _fact_tables('T = {"tf32": ("tensorfloat32", 1), "tf32x3": ("t", 3)}')
  assert not _fact_tables('F = {"bf16x1": one_pass, "bf16x3": three}')


def test_jax_flag_reaches_the_same_answer():
  # The precision in force (no per-op precision) gives the same refusal.
  f = lambda x, w: x @ w  # noqa: E731
  with jax.default_matmul_precision("TF32_TF32_F32"):
    (row,) = jaxprec.audit(f, X, W).rows
    with pytest.raises(jaxprec.UnsupportedAlgorithmError):
      jaxprec.emulate(f, target="tpu")(X, W)
  assert row.tpu == "unsupported" and row.gpu == "tf32"
