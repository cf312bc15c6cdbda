"""Probes of the emulation kernels, the compilation cache and the benchmarks.

Each test but one failed before its fix: the ``f32`` kernel at the top of the
float32 range, a cache directory written by a call refused for bad
arguments, ``~`` in a cache path, the source of a kernel figure read from
disk, and the benchmarks' bad arguments. The exception,
``test_search_with_a_cache_still_runs_normalised_arguments``, pins the
arguments that a cached search now checks before the cache is on.
"""

import importlib.util
import os
import pathlib
import sys
import types

import jax
import numpy as np
import pytest

import jaxprec
from jaxprec._src.cli.cli import main
from jaxprec._src.emulation import compile_cache

import reference as ref

F32 = np.float32
MATMUL = (((1,), (0,)), ((), ()))


def _from_bits(*words):
  return np.array(words, np.uint32).view(F32)


# Finite values whose parts the f32 kernel merges past float32's maximum: the
# top 128 float32 values round to 2**128 in 16 bits (X3's h + l), and the
# top 4096 round to inf in TF32.
HUGE = _from_bits(0x7F7FFFFF, 0x7F7FFF80, 0x7F7FF000, 0xFF7FFFFF)
# Just below: their rounded sums stay finite.
BELOW = _from_bits(0x7F7FFF7F, 0x7F7FEFFF)
SMALL = np.array([0.0, -0.0, 1e-30, 1.0, -1.5, 1 + 2.0**-9 + 2.0**-20, 7e4,
                  np.inf, np.nan], F32)


@pytest.mark.parametrize("precision,target,algorithm", [
    ("bfloat16_3x", "tpu", "bf16x3"), ("TF32_TF32_F32_X3", "gpu", "tf32x3")])
@pytest.mark.parametrize("huge_side", ["rhs", "lhs"])
def test_f32_kernel_keeps_xla_nan_and_inf_at_the_top_of_the_range(
    precision, target, algorithm, huge_side):
  """Contraction length 1: the f32 kernel's NaN and inf are XLA's wherever
  the exact sum of the products fits float32, and its finite results are
  within the documented bound. It made 0 * 3.4028235e38 NaN (X3) and
  1 * 3.4028235e38 NaN (TF32x3), where XLA gives 0 and inf."""
  big = np.concatenate([HUGE, BELOW, -BELOW])
  a, b = (SMALL[:, None], big[None, :])
  if huge_side == "lhs":
    a, b = big[:, None], SMALL[None, :]
  with jaxprec.use_kernel("f32"):
    got = np.asarray(jaxprec.emulated_dot_general(
        a, b, MATMUL, precision=precision, target=target))
  contract = ref.dot_general(MATMUL)
  want = ref.emulate(a, b, algorithm, contract)
  with np.errstate(invalid="ignore", over="ignore"):
    total, mag = ref.exact(a, b, algorithm, contract)
    # Where the true product exceeds float32 (XLA's NaN can be the f32
    # kernel's inf, as documented), or the exact sum of the parts does.
    true = a.astype(np.float64) * b
    overflow = (np.abs(total) > np.finfo(F32).max) | (
        np.isfinite(a) & np.isfinite(b) & (np.abs(true) > np.finfo(F32).max))
  np.testing.assert_array_equal(np.isnan(got) & ~overflow,
                                np.isnan(want) & ~overflow)
  np.testing.assert_array_equal(np.isinf(got) & ~overflow,
                                np.isinf(want) & ~overflow)
  both = np.isfinite(got) & np.isfinite(want) & np.isfinite(total)
  err = np.abs(got[both].astype(np.float64) - total[both])
  assert (err <= ref.error_bound(1, algorithm, mag)[both]).all()


def test_f32_kernel_zero_times_the_float32_maximum_is_zero():
  """The case as a user meets it: jaxprec.emulate on NumPy inputs."""
  a = np.zeros((2, 3), F32)
  b = np.full((3, 2), np.finfo(F32).max, F32)
  outs = {}
  for kernel in ("bf16", "f32"):
    with jaxprec.use_kernel(kernel):
      outs[kernel] = np.asarray(jaxprec.emulate(
          lambda x, y: x @ y, "bfloat16_3x", target="tpu")(a, b))
  np.testing.assert_array_equal(outs["bf16"], np.zeros((2, 2), F32))
  np.testing.assert_array_equal(outs["f32"], outs["bf16"])


# ---------------------------------------------------------------------------
# The benchmarks: a bad argument is argparse's one line and exit status 2,
# before any work (they raised tracebacks, or printed NaN timings, or wrote
# gpu_fidelity's --markdown file only after the whole run).

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _benchmark(name: str):
  spec = importlib.util.spec_from_file_location(
      f"_probe_s7_{name[:-3]}", BENCHMARKS / name)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # for its dataclasses
  sys.path.insert(0, str(BENCHMARKS))  # as `python benchmarks/x.py` has it
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(BENCHMARKS))
  return module


@pytest.mark.parametrize("name,argv,named", [
    ("bench_check.py", ["--model", "mlp", "--repeats", "0"], "--repeats"),
    ("bench_check.py", ["--sizes", "tiny,bogus"], "--sizes"),
    ("bench_check.py", ["--seconds", "-1"], "--seconds"),
    ("bench_cli_cache.py", ["--repeats", "0"], "--repeats"),
    ("bench_emulated_matmul.py", ["--size", "-5"], "--size"),
    ("bench_emulated_matmul.py", ["--repeats", "0"], "--repeats"),
    ("bench_import.py", ["--repeats", "0"], "--repeats"),
    ("bench_search.py", ["--tolerance", "nan"], "--tolerance"),
    ("bench_search.py", ["--policies", "0"], "--policies"),
])
def test_benchmarks_refuse_bad_numbers_with_exit_status_2(
    monkeypatch, capsys, name, argv, named):
  module = _benchmark(name)
  monkeypatch.setattr(sys, "argv", [name, *argv])
  with pytest.raises(SystemExit) as e:
    module.main()
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"error: argument {named}" in err and "Traceback" not in err


def test_bench_search_accepts_a_zero_tolerance(monkeypatch):
  """0 is a valid tolerance for search_policy: only the parse is run."""
  module = _benchmark("bench_search.py")
  assert module._tolerance("0") == 0.0


@pytest.mark.parametrize("where", ["missing_dir/table.md", "."])
def test_gpu_fidelity_checks_markdown_before_the_run(tmp_path, capsys, where):
  module = _benchmark("gpu_fidelity.py")
  built = []
  module.build_cases = lambda quick: built.append(quick) or []
  with pytest.raises(SystemExit) as e:
    module.main(["--quick", "--markdown", str(tmp_path / where)])
  assert e.value.code == 2 and built == []
  assert "--markdown" in capsys.readouterr().err
  assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# The compilation cache: a refused call writes nothing, and `~` is the home
# directory (it made a directory named `~` in the working directory).


def _settings():
  return {n: getattr(jax.config, n) for n in compile_cache._SETTINGS}


def _mlp(w, x):
  return {"h": x @ w}


_W, _X = np.eye(4, dtype=F32), np.ones((2, 4), F32)


@pytest.mark.parametrize("call", [
    lambda d: jaxprec.check(_mlp, _W, _X, cache=d, target="cuda"),
    lambda d: jaxprec.check(_mlp, _W, _X, cache=d, precisions="bf17"),
    lambda d: jaxprec.check(_mlp, _W, _X, cache=d, atol=-1.0),
    lambda d: jaxprec.search_policy(_mlp, _W, _X, cache=d, tolerance=-1),
    lambda d: jaxprec.search_policy(_mlp, _W, _X, cache=d, tolerance=1e-3,
                                    metric="rel_rsm"),
])
def test_a_refused_call_creates_no_cache_directory(tmp_path, call):
  before = _settings()
  with pytest.raises(ValueError):
    call(tmp_path / "cache")
  assert not (tmp_path / "cache").exists()
  assert _settings() == before


def test_search_with_a_cache_still_runs_normalised_arguments(tmp_path):
  before = _settings()
  r = jaxprec.search_policy(_mlp, _W, _X, tolerance=1e-2, metric="rel_rms",
                            target="TPU", candidates=("bf16", "float32"),
                            budget=4, verbose=False, cache=tmp_path / "c")
  assert r.meets_tolerance and str(r.policy) == "default=bfloat16"
  assert _settings() == before


def test_a_tilde_cache_path_is_under_home(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  path = compile_cache.checked_dir("~/jc")
  assert path == str(tmp_path / "home" / "jc") and os.path.isdir(path)
  assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("argv", [
    ["check", "--model", "wav2vec2", "--precisions", "bf17"],
    ["check", "--model", "wav2vec2", "--atol", "-1"],
    ["check", "--model", "wav2vec2", "--out", os.devnull + "/r"],
    ["search", "--model", "wav2vec2", "--tolerance", "-1"],
    ["search", "--model", "wav2vec2", "--tolerance", "1e-3",
     "--candidates", ","],
])
def test_cli_bad_usage_creates_no_cache_directory(tmp_path, monkeypatch,
                                                  capsys, argv):
  monkeypatch.setenv("JAXPREC_CACHE_DIR", "rel_cache")  # in the cwd
  monkeypatch.chdir(tmp_path)
  before = _settings()
  assert main(argv) == 2
  assert "jaxprec: error:" in capsys.readouterr().err
  assert os.listdir(tmp_path) == []
  assert _settings() == before


def test_gpu_fidelity_reports_a_gpu_that_refuses_every_case(monkeypatch,
                                                           capsys):
  """Its table named the GPU only after a case ran on it: a GPU refusing
  every case raised UnboundLocalError instead of printing the refusals."""
  module = _benchmark("gpu_fidelity.py")

  class Gpu:
    platform, device_kind = "gpu", "Fake GPU"

  monkeypatch.setattr(module, "jax", types.SimpleNamespace(
      default_backend=lambda: "gpu", __version__=jax.__version__,
      devices=lambda *kind: jax.devices(*kind) if kind else [Gpu()]))

  def refuse(case, device):
    raise RuntimeError("refused")
  monkeypatch.setattr(module, "_native", refuse)
  cases = module.build_cases(True)[:2]
  monkeypatch.setattr(module, "build_cases", lambda quick: cases)
  assert module.main([]) == 0
  out = capsys.readouterr().out
  assert "GPU: Fake GPU" in out
  assert out.count("not accepted by the GPU: RuntimeError") == 2


@pytest.mark.parametrize("scale,status", [(1.0, 0), (1.0 + 2.0**-10, 1)])
def test_gpu_fidelity_exits_1_when_a_row_is_outside_xlas_tolerance(
    monkeypatch, capsys, scale, status):
  """A fake GPU that computes what the bf16 kernel computes passes (exit 0);
  one off by 2**-10 relative is outside every tolerance below TF32's (exit 1,
  the rows marked NO and counted last)."""
  module = _benchmark("gpu_fidelity.py")

  class Gpu:
    platform, device_kind = "gpu", "Fake GPU"

  monkeypatch.setattr(module, "jax", types.SimpleNamespace(
      default_backend=lambda: "gpu", __version__=jax.__version__,
      jit=jax.jit, device_put=jax.device_put,
      devices=lambda *kind: jax.devices(*kind) if kind else [Gpu()]))
  cpu = jax.devices("cpu")[0]
  monkeypatch.setattr(module, "_native", lambda case, device: (
      module._emulated(case, "bf16", cpu) * np.float32(scale)))
  cases = [c for c in module.build_cases(True)
           if c.algorithm in ("bf16x3", "tf32")][:4]
  assert {c.algorithm for c in cases} == {"bf16x3", "tf32"}, cases
  monkeypatch.setattr(module, "build_cases", lambda quick: cases)
  assert module.main([]) == status
  out = capsys.readouterr().out
  if status:
    assert "| NO |" in out and "rows outside XLA's tolerance" in out
  else:
    assert "| NO |" not in out and "every row with a tolerance is within it" in out
