"""Probes of the kernel setting, as a hostile user.

Each test pins one behaviour a user can reach through the public API
(``JAXPREC_KERNEL``, ``JAXPREC_CACHE_DIR``, ``set_kernel``, ``use_kernel``,
``current_kernel``, ``explain``, ``jaxprec info``). The bugs they found
are fixed (CHANGELOG, "Fixed"); each test here failed before its fix.
"""

import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import hlo_passes
import jaxprec
from jaxprec._src.core import algorithms, numerics
from jaxprec._src.emulation import kernels

MATMUL = (((1,), (0,)), ((), ()))


@pytest.fixture
def auto(monkeypatch):
  """'auto' from nothing: no setting; a CPU whose flags ``cpu(flags)`` sets
  (default: with AVX512-BF16). Nothing may be timed."""
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)
  fields = {"flags": "avx512f avx512_bf16", "model name": "Probe CPU"}
  monkeypatch.setattr(kernels, "_cpuinfo", fields.get)
  assert not hasattr(kernels, "measure")  # nothing to time with

  def cpu(flags):
    fields["flags"] = flags
  return cpu


WITH_UNITS, WITHOUT_UNITS = "avx512f avx512_bf16", "avx2 fma"


def _dots(fn, x) -> int:
  """The passes of ``fn``'s emulated dots (tests/hlo_passes.py); ``x`` is
  4 x 4, a dot the bf16 kernel runs as one dot per pass (a larger one runs
  as one wider dot: emulated_ops._wide_passes)."""
  assert max(x.shape) < 8, x.shape
  return hlo_passes.passes(fn.lower(x, x).as_text())


def _operands():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((16, 64)).astype(np.float32),
          rng.standard_normal((64, 16)).astype(np.float32))


# ---------------------------------------------------------------------------
# JAXPREC_CACHE_DIR.


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
  auto(WITH_UNITS)  # X3: 3 bf16 dots
  fn = jax.jit(lambda a, b: jaxprec.emulated_dot_general(a, b, MATMUL, "high"))
  x = np.ones((4, 4), np.float32)
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
  dots = {a for a, r in algorithms.RECORDS.items() if r.dots is not None}
  # Exact float32 and 8-bit floats (widened exactly) are one native float32
  # dot: no kernel runs them.
  assert dots == set(numerics.ALGORITHMS) - {"native", "f32", "f8"}


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


@pytest.mark.parametrize("flags", [WITH_UNITS, WITHOUT_UNITS])
def test_auto_computes_what_the_kernel_it_picks_computes(monkeypatch, auto,
                                                         flags):
  # Traced under 'auto', then under each explicit kernel: jit traces again
  # on each change (so the 2-dot and 3-dot programs both show), and 'auto'
  # gives bit for bit the numbers of the kernel it reports.
  auto(flags)
  a, b = _operands()
  x = np.ones((4, 4), np.float32)
  fn = jax.jit(lambda p, q: jaxprec.emulated_dot_general(p, q, MATMUL, "high"))
  via_auto = np.asarray(fn(a, b))
  picked = jaxprec.current_kernel().kernel_for("bf16x3")
  assert picked == ("f32" if flags == WITHOUT_UNITS else "bf16")
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
  auto(WITHOUT_UNITS)
  text = jaxprec.explain()
  assert ("emulation kernel: auto (source: default): bf16 dots for bf16x1; "
          "f32 dots for bf16x3, bf16x6, bf16x9, tf32x3") in text
  assert ("why: chosen from the CPU's feature flags, not timed: Probe CPU "
          "has no bfloat16 dot units") in text
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
