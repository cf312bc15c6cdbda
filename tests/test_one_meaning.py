"""One name, one meaning per target, at every entry point.

A precision name means what ``jax.default_matmul_precision(name)`` makes a
target compute (docs/semantics.md): on a TPU ``DEFAULT``/``HIGH``/``HIGHEST``
are 1/3/6 bfloat16 passes, on an Ampere+ GPU TF32/TF32/float32 (the
``jax.lax.Precision`` docs), on a CPU exact float32 (but for the float16
presets, whose operands JAX converts); a preset names its algorithm. For
every public name (``jaxprec.valid_names()``) and target, ``emulate``,
``check``, ``check_module``, ``search_policy``, ``audit``, ``explain``,
``cost`` and the command line's ``check`` must compute (and label) that
algorithm.

The expected algorithm comes from JAX (the precision its dot records under
the flag) and this file's own table of levels; the expected numbers from the
NumPy + ml_dtypes reference (tests/reference.py) on a diagonal matmul: every
output is one product, so the emulation is bit for bit, and the six probes
(products built from chosen mantissa bits) give each algorithm its own
numbers. Whether a target runs an algorithm at all is the one table's
answer (``Precision.on(target).supported``); the ``ANY_F8_*`` presets, which
need float8 operands, are left out.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxprec
import reference as ref
from conftest import run_cli
from jaxprec._src.core import numerics
from jaxprec._src.emulation import kernels
from jaxprec._src.inspect.explain import explain_dict

# a_i * b_i, chosen bit by bit:
#  0: 1 + 2^-9 + 2^-12 + 2^-17: 1 pass 1; TF32 and float16 1 + 2^-9;
#     3 passes 1 + 2^-9 + 2^-12; 6 and 9 passes, TF32x3, float32 exact.
#  1: 1 + 2^-12 + 2^-23: 3 TF32 passes drop 2^-23, 6 bfloat16 passes keep it.
#  2: 2^-120 (1 + 2^-20) x 2^15: the split's remainder is subnormal, flushed
#     (XLA:CPU), so every multi-pass algorithm drops it; float32 keeps it;
#     float16 operands underflow to 0.
#  3: (1 + 2^-7)^2: a bfloat16 (float16) result drops the 2^-14.
#  4: 2^-20 (1 + 2^-9): float16 subnormal, TF32 keeps it.
#  5: (1 + 2^-12 + 2^-21)^2: the lo x mid terms 6 passes drop tip a tie
#     to round up; 9 passes and float32 keep them.
A = np.array([1 + 2**-9 + 2**-12 + 2**-17, 1 + 2**-12 + 2**-23,
              2.0**-120 * (1 + 2**-20), 1 + 2**-7, 2.0**-20 * (1 + 2**-9),
              1 + 2**-12 + 2**-21], np.float32)
B = np.array([1, 1, 2.0**15, 1 + 2**-7, 1, 1 + 2**-12 + 2**-21], np.float32)
LHS, RHS = np.diag(A), np.diag(B)
N = len(A)
LAYERS = [f"p{i}" for i in range(N)]

# What each level computes per target (the jax.lax.Precision docs; a CPU
# ignores the level) and what each preset names (its docstring in
# jax/_src/lax/lax.py).
LEVELS = {"tpu": {"DEFAULT": "bf16x1", "HIGH": "bf16x3", "HIGHEST": "bf16x6"},
          "gpu": {"DEFAULT": "tf32", "HIGH": "tf32", "HIGHEST": "f32"},
          "cpu": {"DEFAULT": "f32", "HIGH": "f32", "HIGHEST": "f32"}}
PRESETS = {"BF16_BF16_F32": "bf16x1", "BF16_BF16_F32_X3": "bf16x3",
           "BF16_BF16_F32_X6": "bf16x6", "BF16_BF16_F32_X9": "bf16x9",
           "BF16_BF16_BF16": "bf16_bf16_bf16", "TF32_TF32_F32": "tf32",
           "TF32_TF32_F32_X3": "tf32x3", "F16_F16_F32": "f16",
           "F16_F16_F16": "f16_f16_f16", "F32_F32_F32": "f32"}
ALGORITHMS = sorted(set(PRESETS.values()))
EXPECTED = {a: np.diag(ref.emulate(LHS, RHS, a, ref.dot_general(
    (((1,), (0,)), ((), ()))))) for a in ALGORITHMS}
# |algorithm - float32| per probe: what a check against float32 measures.
ERRORS = {a: np.abs(EXPECTED[a].astype(np.float64) - EXPECTED["f32"])
          for a in ALGORITHMS}


def test_the_probes_tell_every_algorithm_apart():
  assert len({tuple(v) for v in EXPECTED.values()}) == len(ALGORITHMS)
  assert len({tuple(v) for v in ERRORS.values()}) == len(ALGORITHMS)
  assert np.isfinite(np.stack(list(EXPECTED.values()))).all()


def jax_meaning(name: str, target: str) -> str:
  """The algorithm ``target`` computes under ``jax.default_matmul_precision``
  set to ``name`` (its spelling for JAX's flag: ``jaxprec.resolve``), read
  from the precision JAX records in the dot."""
  flag = jaxprec.resolve(name).flag
  with jax.default_matmul_precision(flag):
    jaxpr = jax.make_jaxpr(jnp.matmul)(LHS, RHS)
  recorded, = [e.params["precision"] for e in jaxpr.jaxpr.eqns
               if e.primitive.name == "dot_general"]
  if isinstance(recorded, lax.DotAlgorithmPreset):
    # A CPU runs a preset as float32, unless JAX converts float32 operands
    # to another type first (its supported input types: float16 alone for
    # the float16 presets; _handle_dot_precision in jax/_src/lax/lax.py).
    converts = np.dtype(np.float32) not in [
        np.dtype(t) for t in recorded.supported_lhs_types]
    if target == "cpu" and not converts:
      return LEVELS["cpu"]["DEFAULT"]
    return PRESETS[recorded.name]
  level = lax.Precision.DEFAULT if recorded is None else recorded[0]
  return LEVELS[target][level.name]


def names_for(target: str) -> list[str]:
  """Every public name whose algorithm ``target`` runs on float32 operands."""
  return [n for n in jaxprec.valid_names()
          if not n.upper().startswith("ANY_F8")
          and not n.upper().startswith("F64")
          and jaxprec.resolve(n).on(target).supported]


def unsupported_for(target: str) -> list[str]:
  return [n for n in jaxprec.valid_names()
          if not n.upper().startswith("ANY_F8")
          and not jaxprec.resolve(n).on(target).supported]


def probes(lhs, rhs):
  out = lhs @ rhs
  return {f"p{i}": out[:, i] for i in range(N)}


class Column(nnx.Module):

  def __init__(self, w):
    self.w = nnx.Param(jnp.asarray(w))

  def __call__(self, x):
    return (x @ self.w[...])[:, 0]


class Probes(nnx.Module):

  def __init__(self):
    for i in range(N):
      setattr(self, f"p{i}", Column(RHS[:, i:i + 1]))

  def __call__(self, x):
    return [getattr(self, f"p{i}")(x) for i in range(N)]


@pytest.fixture(params=["bf16", "f32"])
def kernel(request):
  """Both emulation kernels: bit for bit here, as every output is one
  product."""
  before = kernels.current_kernel().setting
  jaxprec.set_kernel(request.param)
  try:
    yield request.param
  finally:
    jaxprec.set_kernel(before)


def _metric(report, name):
  return np.array(report.metric("max_abs", name))


@pytest.mark.parametrize("target", ["tpu", "gpu", "cpu"])
def test_emulate_computes_what_the_flag_makes_the_target_compute(target,
                                                                 kernel):
  for name in names_for(target):
    want = jax_meaning(name, target)
    got = np.diag(np.asarray(jaxprec.emulate(jnp.matmul, name,
                                             target=target)(LHS, RHS)))
    np.testing.assert_array_equal(got, EXPECTED[want], err_msg=(
        f"emulate({name!r}, target={target!r}) is not {want}"))


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_check_and_check_module_rows_compute_and_name_the_same(target):
  names = names_for(target)
  r = jaxprec.check(probes, LHS, RHS, precisions=names, target=target,
                    mode="emulate")
  m = jaxprec.check_module(Probes(), LHS, precisions=names, target=target,
                           mode="emulate")
  for name in names:
    want = jax_meaning(name, target)
    assert r.numerics[name] == f"{want} ({target}, emulated)", name
    assert m.numerics[name] == f"{want} ({target}, emulated)", name
    np.testing.assert_array_equal(_metric(r, name), ERRORS[want],
                                  err_msg=f"check {name!r} on {target}")
    by_layer = dict(zip([l.name for l in m.layers], _metric(m, name)))
    np.testing.assert_array_equal([by_layer[l] for l in LAYERS],
                                  ERRORS[want],
                                  err_msg=f"check_module {name!r} on {target}")
    assert "tpu numerics" not in r.numerics[name] + m.numerics[name]


@pytest.mark.filterwarnings("ignore::jaxprec.PresetConvWarning")
@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_search_candidates_audit_explain_and_cost_agree(target):
  for name in names_for(target):
    want = jax_meaning(name, target)
    with jaxprec.precision(name):
      row, = jaxprec.audit(jnp.matmul, LHS, RHS).rows
      explained = explain_dict()["numerics"][target]["algorithm"]
    assert getattr(row, target) == want, (name, target)
    assert explained == want, (name, target)  # jaxprec info's line
    costed, = jaxprec.cost(jnp.matmul, LHS, RHS, policy=f"default={name}",
                           target=target).rows
    assert costed.algorithms == (want,), (name, target)
    if jaxprec.resolve(name).flag is None:
      continue  # a search refuses the backend default (it is no choice)
    try:
      result = jaxprec.search_policy(
          probes, LHS, RHS, tolerance=1e30, metric="max_abs",
          candidates=(name,), target=target, mode="emulate", verbose=False)
    except ValueError as e:  # a format without a cost figure on the target
      assert f"runs {want} on {target}" in str(e), (name, str(e))
      continue
    assert str(result.policy) == f"default={jaxprec.resolve(name).name}"
    assert result.cost.rows[0].algorithms == (want,), (name, target)
    np.testing.assert_array_equal([result.values[l] for l in LAYERS],
                                  ERRORS[want],
                                  err_msg=f"search {name!r} on {target}")


@pytest.mark.filterwarnings("ignore::jaxprec.PresetConvWarning")
@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_every_entry_point_refuses_what_the_target_does_not_run(target):
  for name in unsupported_for(target):
    if name.upper().startswith("F64"):
      continue  # float64: emulate runs the op as written (no algorithm)
    with pytest.raises(numerics.UnsupportedAlgorithmError):
      jaxprec.emulate(jnp.matmul, name, target=target)(LHS, RHS)
    # A target that runs no such algorithm, or one jaxprec does not model
    # (jax 0.12.1's float8 presets).
    refused = "does not run on a|does not model this algorithm"
    with pytest.raises(ValueError, match=refused):
      jaxprec.check(probes, LHS, RHS, precisions=(name,), target=target,
                    mode="emulate")
    with pytest.raises(ValueError, match=refused):
      jaxprec.search_policy(probes, LHS, RHS, tolerance=1.0,
                            candidates=(name,), target=target,
                            mode="emulate", verbose=False)
    with pytest.raises(numerics.UnsupportedAlgorithmError):
      jaxprec.cost(jnp.matmul, LHS, RHS, policy=f"default={name}",
                   target=target)
    with jaxprec.precision(name):
      row, = jaxprec.audit(jnp.matmul, LHS, RHS).rows
    record = jaxprec.resolve(name).on(target)
    # An algorithm jaxprec names but does not model is named as it is.
    want = "unsupported" if record.modelled else record.algorithm
    assert getattr(row, target) == want, (name, target)


def make():
  """The command line's model (``test_one_meaning:make``): ``probes`` itself,
  so that its rows run the programs the Python API's rows compiled."""
  return probes, (LHS, RHS)


# This module as the command line imports it (the same functions).
MODEL = f"{__name__}:make"


@pytest.fixture
def cli_dir(tmp_path, monkeypatch):
  """The command line's current directory, a fresh one; sys.path as it was
  after the test (the command line puts its directory first)."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  return tmp_path


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_the_command_line_check_rows_compute_and_name_the_same(
    target, cli_dir, capsys):
  # The command line refuses two spellings of one precision: a run for each
  # spelling of a precision, every precision in each.
  spellings: dict[str, list[str]] = {}
  for name in names_for(target):
    spellings.setdefault(jaxprec.resolve(name).name, []).append(name)
  for k in range(max(map(len, spellings.values()))):
    names = [s[k] for s in spellings.values() if k < len(s)]
    rc, out, err = run_cli(capsys, "check", MODEL,
                           "--precisions", ",".join(names), "--target",
                           target, "--mode", "emulate", "--json", "--out",
                           str(cli_dir / "o"))
    assert rc == 0, err
    d = json.loads(out)
    for name in names:
      want = jax_meaning(name, target)
      assert d["numerics"][name] == f"{want} ({target}, emulated)", name
      got = [next(l for l in d["layers"] if l["name"] == layer)["metrics"]
             [name]["max_abs"] for layer in LAYERS]
      np.testing.assert_array_equal(got, ERRORS[want],
                                    err_msg=f"jaxprec check {name!r} {target}")


GPU_ALGORITHMS = {"bf16x1", "bf16x3", "bf16x6", "bf16x9", "tf32", "tf32x3",
                  "f32"}


@pytest.mark.parametrize("chip", [None, "h100"])
def test_a_gpu_checks_default_rows_are_gpu_numerics(chip, cli_dir, capsys):
  """``check`` and ``jaxprec check --target gpu [--chip]`` without
  precisions: every row is a GPU's, its algorithm one a GPU runs, no two
  alike."""
  r = jaxprec.check(probes, LHS, RHS, target="gpu", mode="emulate", chip=chip)
  argv = ["check", MODEL, "--target", "gpu", "--json",
          "--out", str(cli_dir / "o")] + (["--chip", chip] if chip else [])
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 0, err
  cli = json.loads(out)["numerics"]
  tail = "" if chip is None else f", {chip} tensor cores"
  algos = []
  for name in r.precisions:
    algo = jax_meaning(name, "gpu")
    assert algo in GPU_ALGORITHMS and algo != "f32", name
    assert r.numerics[name] == f"{algo} (gpu, emulated{tail})"
    assert cli[name] == r.numerics[name]
    algos.append(algo)
  assert len(set(algos)) == len(algos) >= 3 and "tf32" in algos
  assert list(cli) == [*r.precisions, "(reference)"]


def test_a_tpu_checks_default_rows_are_tpu_numerics():
  r = jaxprec.check(probes, LHS, RHS, mode="emulate")
  algos = [jax_meaning(n, "tpu") for n in r.precisions]
  assert algos == ["bf16x1", "bf16x3", "bf16x6"]
  assert [r.numerics[n] for n in r.precisions] == [
      f"{a} (tpu, emulated)" for a in algos]
  for name, algo in zip(r.precisions, algos):
    np.testing.assert_array_equal(_metric(r, name), ERRORS[algo])


def cpu_names() -> list[str]:
  """The names a CPU runs, one spelling each."""
  seen, out = set(), []
  for n in jaxprec.valid_names():
    p = jaxprec.resolve(n)
    if p.cpu.supported and p.name not in seen and not n.upper().startswith(
        ("ANY_F8", "F64")):
      seen.add(p.name)
      out.append(n)
  return out


def test_on_a_cpu_native_rows_and_the_table_say_what_jax_computes():
  """Natively on this CPU a row runs under JAX's flag: its label, the one
  table's CPU entry (``jaxprec info``'s "here" line) and its numbers agree
  with what JAX computes (float16 operands for the float16 presets)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the native rows of this test run on a CPU")
  names = cpu_names()
  r = jaxprec.check(probes, LHS, RHS, precisions=names, mode="native")
  for name in names:
    want = jax_meaning(name, "cpu")
    assert jaxprec.resolve(name).cpu.algorithm == want, name
    assert r.numerics[name] == f"{want} (native cpu)", name
    np.testing.assert_array_equal(_metric(r, name), ERRORS[want],
                                  err_msg=f"native {name!r}")


def test_the_table_in_docs_semantics_is_the_codes():
  """docs/semantics.md's "One name, one meaning on a target": each cell is
  what the code answers for that name on that target."""
  import pathlib
  import re
  text = (pathlib.Path(__file__).parent.parent / "docs" / "semantics.md"
          ).read_text()
  section = text.split("## One name, one meaning on a target")[1].split(
      "\n## ")[0]
  rows = [l for l in section.splitlines() if l.startswith("| `")]
  assert len(rows) >= 10
  seen = set()
  for line in rows:
    names_cell, *cells = [c.strip() for c in line.strip("|").split("|")]
    for name in re.findall(r"`([^`]+)`", names_cell):
      seen.add(jaxprec.resolve(name).name)
      p = jaxprec.resolve(name)
      for target, cell in zip(("tpu", "gpu", "cpu"), cells):
        if target == "cpu":
          got = p.cpu.algorithm
        else:
          try:
            got = numerics.algorithm_for(p, target, np.float32, np.float32)
          except numerics.UnsupportedAlgorithmError:
            got = "unsupported"
        ok = (got in re.findall(r"`([^`]+)`", cell)
              or got == "unsupported" and "refused" in cell)
        assert ok, (name, target, cell, got)
  assert {"bfloat16", "bfloat16_3x", "tensorfloat32", "float32",
          "backend-default"} <= seen
