"""Probes of the kernel setting and its benchmark cache, as a hostile user.

Each test pins one behaviour a user can reach through the public API
(``JAXPREC_KERNEL``, ``JAXPREC_CACHE_DIR``, ``XLA_FLAGS``, ``set_kernel``,
``use_kernel``, ``current_kernel``, ``explain``, ``jaxprec info``). The bugs they found
are fixed (CHANGELOG, "Fixed"); each test here failed before its fix.
"""

import json
import os
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import jaxprec
from jaxprec._src import kernels, numerics

MATMUL = (((1,), (0,)), ((), ()))
YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="


@pytest.fixture
def auto(monkeypatch, tmp_path):
  """'auto' from nothing: no setting, an empty cache dir, no figure in memory.

  Returns the cache file's path (absent until something writes it).
  """
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(tmp_path))
  monkeypatch.setattr(kernels, "_MEASURED", {})
  # The one-pass figure follows whatever a test makes `measure` return.
  monkeypatch.setattr(kernels, "measure_one_pass", lambda: kernels.measure())
  return tmp_path / "kernel_benchmark.json"


def _key() -> str:
  return kernels._disk_key(jax.devices()[0].device_kind)


def _dots(fn, x) -> int:
  return len(re.findall(r"stablehlo.dot_general", fn.lower(x, x).as_text()))


def _operands():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((16, 64)).astype(np.float32),
          rng.standard_normal((64, 16)).astype(np.float32))


# ---------------------------------------------------------------------------
# The measurement and its disk cache.


def test_the_measurement_runs_dots_even_inside_a_jit_trace(monkeypatch, auto):
  # Repro: JAXPREC_CACHE_DIR=$(mktemp -d) python -c 'import jax, numpy as np,
  # jaxprec; from jaxprec._src import kernels; x = np.ones((8, 8), "f4");
  # jax.jit(jaxprec.emulate(lambda a, b: a @ b, "high", target="tpu"))(x, x);
  # print(kernels._MEASURED)'  -> ~0.93; without jax.jit: ~0.5.
  del auto
  real_measure, real_ready = kernels.measure, jax.block_until_ready
  waited_on = []
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waited_on.extend(
      jax.tree_util.tree_leaves(x)) or real_ready(x))
  monkeypatch.setattr(kernels, "measure",
                      lambda: real_measure(size=64, repeats=2))
  x = np.ones((8, 8), np.float32)
  jax.jit(lambda a, b: jaxprec.emulated_dot_general(a, b, MATMUL, "high")
          ).lower(x, x)
  assert waited_on, "no measurement ran"
  tracers = [type(v).__name__ for v in waited_on
             if isinstance(v, jax.core.Tracer)]
  assert not tracers, f"timed the tracing of {tracers}"


def test_xla_flags_set_after_the_backend_started_do_not_key_a_figure(
    monkeypatch, auto):
  # Repro: (1) python -c "import os, jax, jaxprec; jax.devices();
  # os.environ['XLA_FLAGS'] = '--xla_cpu_experimental_ynn_fusion_type=';
  # jaxprec.current_kernel()" measures 0.49 with YNN on and stores it under
  # the YNN-off key; (2) XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=
  # python -c "import jaxprec; print(jaxprec.current_kernel().reason)" reads
  # that 0.49 ("cached in"), where a fresh cache measures 0.99.
  jax.devices()  # the backend runs, with the flags it started with
  monkeypatch.setenv("XLA_FLAGS", YNN_OFF)
  monkeypatch.setattr(kernels, "measure", lambda: 0.5)
  assert jaxprec.current_kernel().ratio == 0.5
  keys = list(json.loads(auto.read_text())) if auto.exists() else []
  assert not [k for k in keys if "ynn_fusion_type" in k], keys


def test_two_threads_starting_at_once_measure_once_and_agree(monkeypatch, auto):
  del auto
  figures, second = iter([0.5, 1.5]), threading.Event()
  calls = []

  def measure():
    calls.append(1)
    if len(calls) == 1:
      second.wait(timeout=1.5)  # a second measurement, if any, starts now
    else:
      second.set()
    return next(figures)

  monkeypatch.setattr(kernels, "measure", measure)
  monkeypatch.setattr(kernels, "measure_one_pass", lambda: 0.5)
  got = []
  threads = [threading.Thread(
      target=lambda: got.append(jaxprec.current_kernel().ratio))
             for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(calls) == 1 and got == [0.5, 0.5], (calls, got)


def test_a_figure_another_process_stored_meanwhile_is_kept(monkeypatch, auto):
  auto.write_text(json.dumps({"first": 0.5}))

  def measure():  # another process finishes its own measurement meanwhile
    auto.write_text(json.dumps({"first": 0.5, "other": 0.75}))
    return 0.625

  monkeypatch.setattr(kernels, "measure", measure)
  monkeypatch.setattr(kernels, "measure_one_pass", lambda: 0.5)
  assert jaxprec.current_kernel().ratio == 0.625
  data = json.loads(auto.read_text())
  assert data[_key()] == 0.625 and data["first"] == 0.5
  assert data.get("other") == 0.75, data


def test_every_write_leaves_one_valid_file_and_no_temporary(monkeypatch, auto):
  monkeypatch.setattr(kernels, "measure", lambda: 0.625)
  jaxprec.current_kernel()
  assert os.listdir(auto.parent) == [auto.name]
  assert json.loads(auto.read_text()) == {
      _key(): 0.625, _key() + kernels._ONE_PASS_KEY: 0.625}


def test_a_failed_write_leaves_no_temporary_file(monkeypatch, auto):
  auto.mkdir()  # a directory where the file should be: os.replace fails
  monkeypatch.setattr(kernels, "measure", lambda: 0.625)
  choice = jaxprec.current_kernel()
  assert choice.ratio == 0.625 and "measured in this process" in choice.reason
  assert sorted(p.name for p in auto.parent.iterdir()) == [auto.name]


@pytest.mark.parametrize("value", [
    "1" + "0" * 400,  # an integer float() cannot hold: OverflowError
    "[" * 100_000 + "]" * 100_000,  # json.load: RecursionError
    "true",  # float(True) == 1.0, read as a measurement
])
def test_a_hostile_cache_file_is_measured_again(monkeypatch, auto, value):
  monkeypatch.setattr(kernels, "measure", lambda: 0.625)
  if value.startswith("["):
    auto.write_text(value)
  else:
    auto.write_text("{" + json.dumps(_key()) + ": " + value + "}")
  choice = jaxprec.current_kernel()
  assert choice.ratio == 0.625 and "measured in this process" in choice.reason
  assert json.loads(auto.read_text())[_key()] == 0.625


@pytest.mark.parametrize("preset", ["TF32_TF32_F32", "F16_F16_F32"])
def test_the_measurement_ignores_the_ambient_matmul_precision(monkeypatch, auto,
                                                              preset):
  # Repro: python -c 'import jax, numpy as np, jaxprec; x = np.ones((8, 8),
  # "f4"); jax.config.update("jax_default_matmul_precision", "TF32_TF32_F32");
  # jaxprec.emulate(lambda a, b: a @ b, target="gpu")(x, x)'  -> ValueError.
  del auto
  real_measure = kernels.measure
  monkeypatch.setattr(kernels, "measure",
                      lambda: real_measure(size=64, repeats=2))
  with jax.default_matmul_precision(preset):
    assert jaxprec.current_kernel().ratio > 0


@pytest.mark.parametrize("ratio,kernel", [(1e300, "f32"), (1e-300, "bf16")])
def test_extreme_cached_figures_decide_without_overflow(monkeypatch, auto,
                                                        ratio, kernel):
  # Documented: any positive finite figure is a measurement. 1e300 * 9 dots
  # stays finite, and even an infinite cost would compare cleanly.
  monkeypatch.setattr(kernels, "measure", lambda: pytest.fail("measured"))
  auto.write_text(json.dumps({_key(): ratio,
                              _key() + kernels._ONE_PASS_KEY: ratio}))
  choice = jaxprec.current_kernel()
  assert choice.ratio == ratio and "cached in" in choice.reason
  for algorithm in ("bf16x1", "bf16x3", "bf16x6", "bf16x9", "bf16_bf16_bf16"):
    assert choice.kernel_for(algorithm) == kernel
  big = kernels.KernelChoice(setting="auto", source="default", backend="cpu",
                             device_kind="cpu", ratio=1.7e308, reason="")
  assert big.kernel_for("bf16x9") == "f32"  # 9 * 1.7e308 is inf: still f32


# ---------------------------------------------------------------------------
# JAXPREC_CACHE_DIR.


def test_a_cache_dir_with_spaces_and_unicode(monkeypatch, auto):
  where = auto.parent / "cache dir é ✓ 缓存"
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(where))
  monkeypatch.setattr(kernels, "measure", lambda: 0.625)
  assert "measured in this process" in jaxprec.current_kernel().reason
  monkeypatch.setattr(kernels, "_MEASURED", {})
  again = jaxprec.current_kernel()
  assert again.ratio == 0.625 and str(where) in again.reason


def test_a_cache_dir_that_is_a_file_measures_and_leaves_it(monkeypatch, auto):
  not_a_dir = auto.parent / "a-file"
  not_a_dir.write_text("mine")
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(not_a_dir))
  monkeypatch.setattr(kernels, "measure", lambda: 0.625)
  choice = jaxprec.current_kernel()
  assert choice.ratio == 0.625 and "measured in this process" in choice.reason
  assert not_a_dir.read_text() == "mine"
  assert sorted(p.name for p in auto.parent.iterdir()) == ["a-file"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into read-only directories")
def test_a_read_only_cache_dir_measures_each_process(monkeypatch, auto):
  ro = auto.parent / "ro"
  ro.mkdir()
  ro.chmod(0o500)
  try:
    monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(ro))
    monkeypatch.setattr(kernels, "measure", lambda: 0.625)
    assert jaxprec.current_kernel().ratio == 0.625
    assert not list(ro.iterdir())
  finally:
    ro.chmod(0o700)


def test_a_cache_dir_with_a_tilde_is_under_home(monkeypatch, tmp_path):
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, "~/jaxprec-cache")
  assert kernels.cache_dir() == str(tmp_path / "jaxprec-cache")


# ---------------------------------------------------------------------------
# The setting: JAXPREC_KERNEL, set_kernel, use_kernel.


@pytest.mark.parametrize("value,expected", [
    (" F32 ", ("f32", "env")), ("Bf16", ("bf16", "env")),
    ("AUTO", ("auto", "env")),
    ("", ("auto", "default")),  # empty: unset, as for most variables
])
def test_env_spellings_that_are_accepted(monkeypatch, auto, value, expected):
  del auto
  monkeypatch.setattr(kernels, "measure", lambda: 0.625)
  monkeypatch.setenv(kernels.ENV_VAR, value)
  choice = jaxprec.current_kernel()
  assert (choice.setting, choice.source) == expected


@pytest.mark.parametrize("value,hint", [
    ("bf-16", "Did you mean 'bf16'?"), ("fp32", "Did you mean 'f32'?"),
    ("   ", ""), ("bf16,f32", ""),
])
def test_env_spellings_that_are_refused(monkeypatch, value, hint):
  monkeypatch.setenv(kernels.ENV_VAR, value)
  with pytest.raises(ValueError) as e:
    jaxprec.current_kernel()
  msg = str(e.value)
  assert msg.startswith(f"JAXPREC_KERNEL: Unknown emulation kernel {value!r}")
  assert "'auto', 'bf16', 'f32'" in msg and hint in msg


def test_set_kernel_none_goes_back_to_the_environment(monkeypatch):
  monkeypatch.setenv(kernels.ENV_VAR, "bf16")
  jaxprec.set_kernel("f32")
  assert jaxprec.current_kernel().source == "global"
  jaxprec.set_kernel(None)
  choice = jaxprec.current_kernel()
  assert (choice.setting, choice.source) == ("bf16", "env")
  assert choice.reason == "set by JAXPREC_KERNEL=bf16"
  jaxprec.set_kernel("auto")  # an explicit 'auto' beats the environment
  assert jaxprec.current_kernel().source == "global"
  # A scope needs a name; None is set_kernel's.
  with (pytest.raises(ValueError, match="Unknown emulation kernel None"),
        jaxprec.use_kernel(None)):
    pass


def test_scopes_nest_and_unwind_on_exceptions():
  jaxprec.set_kernel("bf16")
  with pytest.raises(RuntimeError, match="inner"), jaxprec.use_kernel("f32"):
    with pytest.raises(KeyError), jaxprec.use_kernel("auto"):
      assert jaxprec.current_kernel().setting == "auto"
      raise KeyError("x")
    assert jaxprec.current_kernel().setting == "f32"
    with jaxprec.use_kernel("bf16"):
      raise RuntimeError("inner")
  choice = jaxprec.current_kernel()
  assert (choice.setting, choice.source) == ("bf16", "global")


def test_use_kernel_refuses_a_bad_name_at_once():
  with pytest.raises(ValueError, match="Did you mean 'f32'"):
    jaxprec.use_kernel("f23")


def test_a_scope_is_this_threads_only():
  seen = []
  with jaxprec.use_kernel("f32"):
    t = threading.Thread(target=lambda: seen.append(
        jaxprec.current_kernel().source))
    t.start()
    t.join()
    assert jaxprec.current_kernel().source == "scope"
  assert seen and seen[0] != "scope"  # documented: "(this thread)"


def test_what_current_kernel_reports_is_what_a_jitted_function_runs(
    monkeypatch, auto):
  del auto
  monkeypatch.setattr(kernels, "measure", lambda: 0.5)  # X3: 3 bf16 dots
  fn = jax.jit(lambda a, b: jaxprec.emulated_dot_general(a, b, MATMUL, "high"))
  x = np.ones((8, 8), np.float32)
  assert _dots(fn, x) == 3
  monkeypatch.setenv(kernels.ENV_VAR, "f32")  # a notebook cell, say
  with pytest.warns(UserWarning, match="read once per process"):
    reported = jaxprec.current_kernel().kernel_for("bf16x3")
  assert _dots(fn, x) == {"f32": 2, "bf16": 3}[reported]
  jaxprec.set_kernel("f32")  # the way that is followed, and retraces
  assert jaxprec.current_kernel().kernel_for("bf16x3") == "f32"
  assert _dots(fn, x) == 2


# ---------------------------------------------------------------------------
# kernel_for, and what 'auto' computes.


def test_every_emulated_algorithm_has_a_dot_count():
  assert set(kernels.DOTS) == set(numerics.ALGORITHMS) - {"native", "f32"}


@pytest.mark.parametrize("algorithm,op", [
    ("BF16X3", "dot_general"), ("bf16x12", "dot_general"), ("", "dot_general"),
    ("bf16x3", "dot"),
])
def test_kernel_for_refuses_unknown_algorithms_and_ops(algorithm, op):
  choice = kernels.KernelChoice(setting="auto", source="default", backend="cpu",
                                device_kind="cpu", ratio=0.52, reason="")
  assert choice.kernel_for("bf16x3") == "bf16"
  with pytest.raises(ValueError):
    choice.kernel_for(algorithm, op)


@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_auto_computes_what_the_kernel_it_picks_computes(monkeypatch, auto,
                                                         ratio):
  # Traced under 'auto', then under each explicit kernel: jit traces again
  # on each change (so the 2-dot and 3-dot programs both show), and 'auto'
  # gives bit for bit the numbers of the kernel it reports.
  del auto
  monkeypatch.setattr(kernels, "measure", lambda: ratio)
  a, b = _operands()
  x = np.ones((8, 8), np.float32)
  fn = jax.jit(lambda p, q: jaxprec.emulated_dot_general(p, q, MATMUL, "high"))
  via_auto = np.asarray(fn(a, b))
  picked = jaxprec.current_kernel().kernel_for("bf16x3")
  assert picked == ("f32" if ratio == 2.0 else "bf16")
  assert _dots(fn, x) == {"f32": 2, "bf16": 3}[picked]
  got = {}
  for kernel in ("f32", "bf16"):
    jaxprec.set_kernel(kernel)
    assert _dots(fn, x) == {"f32": 2, "bf16": 3}[kernel]
    got[kernel] = np.asarray(fn(a, b))
  jaxprec.set_kernel(None)
  assert (got["f32"] != got["bf16"]).any()  # a stale trace would show
  np.testing.assert_array_equal(via_auto, got[picked])
  np.testing.assert_array_equal(np.asarray(fn(a, b)), via_auto)


# ---------------------------------------------------------------------------
# What explain() and `jaxprec info` say.


def test_explain_names_the_kernel_and_why(monkeypatch, auto):
  del auto
  monkeypatch.setattr(kernels, "measure", lambda: 2.0)
  text = jaxprec.explain()
  assert ("emulation kernel: auto (source: default): f32 dots for bf16x1, "
          "bf16x3, bf16x6, bf16x9, tf32x3") in text
  assert ("why: measured on " in text
          and "a bfloat16 dot takes 2.00x a float32 dot (measured in this "
          "process)" in text)
  assert "JAXPREC_KERNEL=auto|bf16|f32" in text
  with jaxprec.use_kernel("bf16"):
    text = jaxprec.explain()
  assert ("emulation kernel: bf16 (source: scope): bf16 dots for bf16x1, "
          "bf16x3, bf16x6, bf16x9, tf32x3") in text
  assert "why: set by jaxprec.use_kernel" in text


def _cli(*argv, kernel):
  env = dict(os.environ, JAXPREC_KERNEL=kernel)
  env.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
  return subprocess.run([sys.executable, "-m", "jaxprec", *argv],
                        capture_output=True, text=True, env=env, timeout=120,
                        check=False)


def test_info_under_an_odd_but_valid_spelling():
  proc = _cli("info", kernel=" F32 ")
  assert proc.returncode == 0, proc.stderr
  assert "emulation kernel: f32 (source: env): f32 dots for" in proc.stdout
  assert "why: set by JAXPREC_KERNEL=f32" in proc.stdout
  proc = _cli("--help", kernel="bf-16")  # help never reads the setting
  assert proc.returncode == 0 and proc.stdout.startswith("usage: jaxprec")


def test_info_under_a_bad_setting_is_a_usage_error():
  proc = _cli("info", kernel="bf-16")
  assert proc.returncode == 2, proc.stderr
  assert proc.stdout == "" and "Traceback" not in proc.stderr
  lines = proc.stderr.splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("jaxprec: error: JAXPREC_KERNEL: Unknown "
                             "emulation kernel 'bf-16'")
  assert "Did you mean 'bf16'?" in lines[0]
