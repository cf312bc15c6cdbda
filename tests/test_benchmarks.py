"""The benchmark scripts run (``--quick``) and print their side-by-side ratios."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def run(script, *args, ok=True, tmp_path=None):
  env = dict(os.environ, JAXPREC_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT,
                        capture_output=True, text=True, env=env, timeout=300)
  if ok:
    assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc


def test_bench_emulated_matmul_quick(tmp_path):
  out = run("bench_emulated_matmul.py", "--quick", tmp_path=tmp_path).stdout
  assert re.search(r"native float32\s+[\d.]+\s+1\.00", out), out
  for passes in ("1 pass", "3 pass", "6 pass"):
    for kernel in ("bf16", "f32"):
      assert re.search(rf"{passes} \(.*\)\s+{kernel}\s+[\d.]+\s+[\d.]+\s+<= ", out), out
  assert "(auto)" in out and "auto: " in out


def test_bench_emulate_bert_quick(tmp_path):
  pytest.importorskip("transformers")
  out = run("bench_emulate_bert.py", "--quick", tmp_path=tmp_path).stdout
  for kernel in ("bf16", "f32 "):
    assert re.search(rf"emulated 1 pass, {kernel} kernel: .* ratio [\d.]+x", out), out
    for precision in ("default", "high   ", "highest"):
      assert re.search(rf"compile time, emulated {precision} \({kernel}\): .* ratio "
                       rf"[\d.]+x", out), out
  assert "medians of 1 fresh compiles" in out, out


def test_bench_emulate_bert_multi_pass_times_both_forms(tmp_path):
  pytest.importorskip("transformers")
  out = run("bench_emulate_bert.py", "--quick", "--multi-pass", "--import-repeats=0",
            tmp_path=tmp_path).stdout
  ratio = r"run [\d.]+x \(CPU [\d.]+x\), compile [\d.]+x \(CPU [\d.]+x\)"
  for precision in ("high", "highest"):
    for kernel, default in (("bf16", "grouped by rhs part"), ("f32", "batched")):
      assert re.search(
          rf"forward at {precision} \({kernel} kernel; native run [\d.]+ ms\): "
          rf"{default}: {ratio}; dot per pass: {ratio}$", out, re.M), out


@pytest.mark.parametrize("arg", ["--compile-repeats=0", "--repeats=-1", "--layers=0"])
def test_bench_emulate_bert_refuses_a_count_below_one(tmp_path, arg):
  proc = run("bench_emulate_bert.py", arg, ok=False, tmp_path=tmp_path)
  assert proc.returncode == 2
  assert "must be at least 1" in proc.stderr, proc.stderr


def test_bench_render_quick(tmp_path):
  out = run("bench_render.py", "--quick", tmp_path=tmp_path).stdout
  assert "200 layers, median of 2" in out, out
  for form in ("rich.table.Table (before)", "report.table()",
               "report.to_text(width=40)", "report.to_markdown()"):
    assert re.search(rf"  {re.escape(form)} +[\d.]+ s +[\d.]+x rich", out), out
  assert re.search(r"report.table\(\): [\d.]+x rich's time", out), out


def test_bench_import_quick(tmp_path):
  out = run("bench_import.py", "--quick", tmp_path=tmp_path).stdout
  assert re.search(r"jaxprec adds [-+][\d.]+ s .* ratio [\d.]+x", out), out


def test_bench_sharded_check_quick(tmp_path):
  """Every check program's per-device bytes follow the per-device batch."""
  out = run("bench_sharded_check.py", "--quick", tmp_path=tmp_path).stdout
  assert "8 cpu devices" in out and "global batch 512 (64 per device)" in out, out
  for prog in ("forward", "check: reference", "check: bfloat16 layers",
               "check: bfloat16 metrics"):
    m = re.search(rf"  {prog} +([\d.]+) KiB +([\d.]+) KiB +([\d.]+) KiB +"
                  rf"([\d.]+)x +([\d.]+)x", out)
    assert m, out
    sharded, local, whole = map(float, m.groups()[:3])
    assert float(m[5]) <= 1.5 and sharded < whole / 2, out
  m = re.search(r"kept packed reference, bytes on the fullest device: computed +"
                r"([\d.]+) KiB, read from the host +([\d.]+) KiB \(whole: +([\d.]+) KiB; "
                r"local: +([\d.]+) KiB\)", out)
  assert m, out
  computed, host, whole, local = map(float, m.groups())
  assert computed == host == local == whole / 8, out
  assert re.search(r"largest sharded / local ratio: [\d.]+x", out), out


def test_gpu_fidelity_dry_run_and_no_gpu_message(tmp_path):
  out = run("gpu_fidelity.py", "--quick", tmp_path=tmp_path).stdout
  assert "dry run" in out
  for algorithm in ("bf16x1", "bf16x3", "bf16x6", "bf16x9", "tf32", "tf32x3"):
    assert f"| {algorithm} |" in out, out
  assert "| NO |" not in out  # the two CPU kernels agree within XLA's tolerances
  proc = run("gpu_fidelity.py", ok=False, tmp_path=tmp_path)
  assert proc.returncode == 2
  assert "no GPU here" in proc.stderr


def test_bench_chip_model_quick(tmp_path):
  out = run("bench_chip_model.py", "--quick", tmp_path=tmp_path).stdout
  assert "default model:" in out and "chip='h100'" in out, out
  assert "ratio to the default model" in out and "CPU: " in out, out


def test_every_benchmark_accepts_quick_and_a_test_runs_it_so():
  """Item: benchmarks cannot rot. A new script in benchmarks/ fails this test
  until it takes ``--quick`` and some test runs it that way."""
  scripts = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
  assert len(scripts) >= 8, scripts
  tests = {p.name: p.read_text() for p in (ROOT / "tests").glob("test_*.py")}
  for name in scripts:
    assert '"--quick"' in (BENCH / name).read_text(), f"{name}: no --quick"
    runners = [t for t, text in tests.items() if name in text and "--quick" in text]
    assert runners, f"no test runs benchmarks/{name} with --quick"


def test_the_shared_argument_types_refuse_what_they_name():
  """benchmarks/_args.py: the argparse types every script shares."""
  import argparse
  sys.path.insert(0, str(BENCH))
  try:
    import _args  # noqa: PLC0415
  finally:
    sys.path.remove(str(BENCH))
  assert _args.positive("3") == 3
  assert _args.positive_float("0.5") == 0.5
  assert _args.non_negative_float("0") == 0.0
  for fn, bad in [(_args.positive, "0"), (_args.positive, "-2"),
                  (_args.positive_float, "0"), (_args.positive_float, "inf"),
                  (_args.positive_float, "nan"), (_args.non_negative_float, "-1e-9"),
                  (_args.non_negative_float, "nan")]:
    with pytest.raises(argparse.ArgumentTypeError, match=f"got {bad}"):
      fn(bad)
  with pytest.raises(ValueError):
    _args.positive("two")



def test_wide_dot_bits_quick(tmp_path):
  # Exit 0 where every block stacked along M keeps its bits (jaxlib 0.10), 1
  # where some do not (jaxlib 0.12.1); a summary line per layout says how
  # many either way.
  proc = run("wide_dot_bits.py", "--quick", ok=False, tmp_path=tmp_path)
  assert proc.returncode in (0, 1), proc.stderr
  m = re.search(r"^stacked along M: (\d+) of 6 cases differ$", proc.stdout,
                re.M)
  assert m, proc.stdout
  assert re.search(r"^side by side along N too: \d+ of 6 cases differ$",
                   proc.stdout, re.M), proc.stdout
  assert (int(m.group(1)) == 0) == (proc.returncode == 0)
  assert proc.stdout.startswith("jax ")
