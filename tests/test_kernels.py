"""The emulation kernel setting: precedence, errors, jit keys, auto's choice."""

import inspect
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import hlo_passes
import jaxprec
from jaxprec._src.emulation import kernels

MATMUL = (((1,), (0,)), ((), ()))


def _dots(fn, x):
  return hlo_passes.dot_lines(jax.jit(fn).lower(x, x).as_text())


def _passes(fn, x) -> int:
  return hlo_passes.passes(jax.jit(fn).lower(x, x).as_text())


def test_precedence_scope_global_env(monkeypatch):
  monkeypatch.setenv(kernels.ENV_VAR, "f32")
  assert (jaxprec.current_kernel().setting, jaxprec.current_kernel().source) == ("f32", "env")
  try:
    jaxprec.set_kernel("bf16")
    assert jaxprec.current_kernel().setting == "bf16"
    assert jaxprec.current_kernel().source == "global"
    with jaxprec.use_kernel("F32"):
      assert jaxprec.current_kernel().setting == "f32"
      assert jaxprec.current_kernel().source == "scope"
      assert jaxprec.current_kernel().reason == "set by jaxprec.use_kernel"
    assert jaxprec.current_kernel().setting == "bf16"
  finally:
    jaxprec.set_kernel(None)
  # JAXPREC_KERNEL is read once per process (it is not in jax.jit's key):
  # a later change warns and is not followed.
  monkeypatch.delenv(kernels.ENV_VAR)
  with pytest.warns(UserWarning, match=r"JAXPREC_KERNEL changed from 'f32' to "
                    r"None .* 'f32' stays in force\. Use jaxprec\.set_kernel"):
    assert jaxprec.current_kernel().setting == "f32"
  kernels._forget_environment()  # a new process
  assert jaxprec.current_kernel().source == "default"
  assert jaxprec.current_kernel().setting == "auto"


def test_bad_values_name_the_choices(monkeypatch):
  with pytest.raises(ValueError, match=r"Unknown emulation kernel 'f23'; valid "
                     r"choices: 'auto', 'bf16', 'f32'\. Did you mean 'f32'\?"):
    jaxprec.set_kernel("f23")
  with pytest.raises(ValueError, match=r"Unknown emulation kernel 3"):
    with jaxprec.use_kernel(3):
      pass
  monkeypatch.setenv(kernels.ENV_VAR, "bf61")
  with pytest.raises(ValueError, match=r"JAXPREC_KERNEL: Unknown emulation "
                     r"kernel 'bf61'.*Did you mean 'bf16'"):
    jaxprec.current_kernel()


def test_kernel_is_part_of_the_jit_key():
  x = np.ones((8, 8), np.float32)
  fn = jax.jit(lambda a, b: jaxprec.emulated_dot_general(a, b, MATMUL, "high"))
  with jaxprec.use_kernel("bf16"):
    # One bfloat16 dot per rhs part, the lhs parts it pairs with stacked
    # along M (emulated_ops._grouped_passes): [l; h]·h and h·l.
    dots = sorted(_dots(fn, x))
    assert len(dots) == 2, dots
    assert "tensor<16x8xbf16>, tensor<8x8xbf16>" in dots[0], dots
    assert "tensor<8x8xbf16>, tensor<8x8xbf16>" in dots[1], dots
  with jaxprec.use_kernel("f32"):
    assert _passes(fn, x) == 2 and not any("bf16" in d for d in _dots(fn, x))
  # The same jitted function gives each kernel's numbers, not a stale trace.
  rng = np.random.default_rng(0)
  a = rng.standard_normal((16, 64)).astype(np.float32)
  b = rng.standard_normal((64, 16)).astype(np.float32)
  with jaxprec.use_kernel("bf16"):
    via_bf16 = np.asarray(fn(a, b))
  with jaxprec.use_kernel("f32"):
    via_f32 = np.asarray(fn(a, b))
  assert (via_bf16 != via_f32).any()
  np.testing.assert_allclose(via_bf16, via_f32, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ratio,expected", [
    (0.3, {"bf16x1": "bf16", "bf16x3": "bf16", "bf16x6": "bf16", "bf16x9": "bf16"}),
    (0.56, {"bf16x1": "bf16", "bf16x3": "bf16", "bf16x6": "f32", "bf16x9": "f32"}),
    # One pass stays on bf16 at any ratio (the whole op, rounding included,
    # measured 0.98-1.07x with Eigen's dots).
    (1.6, {"bf16x1": "bf16", "bf16x3": "f32", "bf16x6": "f32", "bf16x9": "f32"}),
])
def test_auto_picks_the_fewer_float32_dot_equivalents(ratio, expected):
  choice = kernels.KernelChoice(setting="auto", source="default", backend="cpu",
                                device_kind="cpu", ratio=ratio, reason="")
  got = choice.per_algorithm()
  assert {a: got[a] for a in expected} == expected
  assert got["tf32x3"] == "f32"  # float32 passes either way: merged is fewer
  assert choice.kernel_for("bf16x3", "conv_general_dilated") == "f32"
  assert choice.kernel_for("bf16x1", "conv_general_dilated") == "f32"


def test_gpu_and_tpu_use_bf16_dots():
  for backend in ("gpu", "tpu"):
    choice = kernels.KernelChoice(setting="auto", source="default",
                                  backend=backend, device_kind="x", ratio=None,
                                  reason="")
    assert set(choice.per_algorithm().values()) == {"bf16"}


def _cpu(monkeypatch, flags, model="Test CPU"):
  """A CPU whose /proc/cpuinfo lists ``flags``; kernels has no timing to run."""
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)  # the tests are about 'auto'
  fields = {"flags": flags, "model name": model}
  monkeypatch.setattr(kernels, "_cpuinfo", fields.get)
  assert "perf_counter" not in inspect.getsource(kernels)  # never timed


# Float32 passes in both kernels (TF32, float16): the fewer dots, or f32 on
# a tie.
WITH_UNITS = {"bf16x1": "bf16", "bf16_bf16_bf16": "bf16", "bf16x3": "bf16",
              "bf16x6": "bf16", "bf16x9": "f32", "tf32": "f32",
              "tf32x3": "f32", "f16": "f32", "f16_f16_f16": "f32"}
WITHOUT_UNITS = {**WITH_UNITS, "bf16x3": "f32", "bf16x6": "f32"}


@pytest.mark.parametrize("flags, units, expected", [
    ("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", ("avx512_bf16",), WITH_UNITS),
    ("fpu sse2 avx2 amx_tile amx_bf16", ("amx_bf16",), WITH_UNITS),
    ("fpu sse2 avx2 fma", (), WITHOUT_UNITS),
    ("fp asimd bf16 i8mm", ("bf16",), WITH_UNITS),  # Arm's Features line
    (None, (), WITHOUT_UNITS),  # no /proc/cpuinfo
])
def test_auto_on_cpu_follows_the_feature_flags_and_times_nothing(
    monkeypatch, flags, units, expected):
  if jax.default_backend() != "cpu":
    pytest.skip("auto on CPU")
  _cpu(monkeypatch, flags)
  choice = jaxprec.current_kernel()
  assert choice.bf16_units == units == jaxprec.bf16_dot_units()
  assert choice.ratio == kernels.NOMINAL_RATIO[bool(units)]
  assert choice.per_algorithm() == expected
  assert "not timed" in choice.reason and "Test CPU" in choice.reason
  assert ("has bfloat16 dot units" in choice.reason) == bool(units)
  d = choice.to_dict()
  assert d["bf16_units"] == list(units) and d["per_algorithm"] == expected


_SAME_BITS = textwrap.dedent("""
    import json, numpy as np, jax, jaxprec
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 4096)).astype(np.float32)
    b = rng.standard_normal((4096, 64)).astype(np.float32)
    out = {}
    for p in ("bfloat16", "bfloat16_3x", "float32"):
      y = jax.jit(jaxprec.emulate(lambda x, w: x @ w, p, target="tpu"))(a, b)
      out[p] = np.asarray(y).tobytes().hex()
    out["kernels"] = jaxprec.current_kernel().per_algorithm()
    print(json.dumps(out))
""")


def test_auto_gives_the_same_bits_in_every_process_whatever_the_load(tmp_path):
  """Two fresh processes, one of them beside a busy loop on every core,
  choose the same kernels and compute the same bits of a long contraction,
  on which the two kernels differ."""
  env = {k: v for k, v in os.environ.items() if k != kernels.ENV_VAR}
  env[kernels.CACHE_ENV_VAR] = str(tmp_path)  # a fresh machine's caches
  run = lambda: subprocess.run(  # noqa: E731
      [sys.executable, "-c", _SAME_BITS], env=env, capture_output=True,
      text=True, timeout=300)
  quiet = run()
  busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
          for _ in range(os.cpu_count() or 2)]
  try:
    loaded = run()
  finally:
    for p in busy:
      p.kill()
      p.wait()
  assert quiet.returncode == 0 and loaded.returncode == 0, (quiet.stderr,
                                                            loaded.stderr)
  assert json.loads(quiet.stdout) == json.loads(loaded.stdout)
  # The kernels differ on this contraction, so a kernel that followed the
  # load would show above.
  rng = np.random.default_rng(0)
  a = rng.standard_normal((64, 4096)).astype(np.float32)
  b = rng.standard_normal((4096, 64)).astype(np.float32)
  fn = jax.jit(jaxprec.emulate(lambda x, w: x @ w, "bfloat16_3x", target="tpu"))
  with jaxprec.use_kernel("bf16"):
    via_bf16 = np.asarray(fn(a, b))
  with jaxprec.use_kernel("f32"):
    via_f32 = np.asarray(fn(a, b))
  assert (via_bf16 != via_f32).any()


def test_auto_opens_no_cache_file(monkeypatch, tmp_path):
  """Nothing under the cache dir is opened to choose a kernel: a named pipe
  where a figure was once cached cannot block the first emulated op."""
  _cpu(monkeypatch, "avx512_bf16")
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(tmp_path))
  if hasattr(os, "mkfifo"):
    os.mkfifo(tmp_path / "kernel_benchmark.json")
  opened = []
  real_open = open
  monkeypatch.setattr("builtins.open", lambda f, *a, **k: opened.append(str(f))
                      or real_open(f, *a, **k))
  x = np.ones((4, 4), np.float32)
  jaxprec.emulated_dot_general(x, x, MATMUL, "high")
  jaxprec.current_kernel()
  assert not [f for f in opened if f.startswith(str(tmp_path))]


def test_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(tmp_path))
  assert kernels.cache_dir() == str(tmp_path)
  monkeypatch.delenv(kernels.CACHE_ENV_VAR)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  if kernels.platform.system() == "Linux":
    assert kernels.cache_dir() == str(tmp_path / "xdg" / "jaxprec")


@pytest.mark.parametrize("flags,bf16", [("fpu avx2", False), ("avx512_bf16", True)])
def test_auto_decides_from_the_features_inside_jit(monkeypatch, flags, bf16):
  # The first emulated op traced under jit asks for the kernel, for X3: with
  # bfloat16 dot units, 3 bfloat16 passes in 2 dots; without, 2 float32
  # passes (one batched dot).
  _cpu(monkeypatch, flags)
  x = np.ones((8, 8), np.float32)
  fn = lambda a, b: jaxprec.emulated_dot_general(a, b, MATMUL, "high")  # noqa: E731
  found = _dots(fn, x)
  assert all(("bf16>" in d) == bf16 for d in found), found
  assert len(found) == (2 if bf16 else 1), found


def test_emulate_under_jit_follows_the_kernel():
  # jax.jit(jaxprec.emulate(f)) is traced again when the kernel changes: the
  # kernel is in JAX's trace context, which keys jit's cache and emulate's.
  rng = np.random.default_rng(1)
  a = rng.standard_normal((16, 64)).astype(np.float32)
  b = rng.standard_normal((64, 16)).astype(np.float32)
  fn = jax.jit(jaxprec.emulate(lambda x, y: x @ y, "highest", target="tpu"))
  got = {}
  for kernel in ("bf16", "f32", "bf16"):
    with jaxprec.use_kernel(kernel):
      got.setdefault(kernel, []).append(np.asarray(fn(a, b)))
      direct = jaxprec.emulated_dot_general(a, b, MATMUL, "highest")
      np.testing.assert_array_equal(got[kernel][-1], direct)
  np.testing.assert_array_equal(got["bf16"][0], got["bf16"][1])
  assert (got["bf16"][0] != got["f32"][0]).any()  # so a stale trace would show


def test_a_report_records_the_kernel_in_force_and_round_trips(tmp_path):
  a = np.ones((4, 8), np.float32)
  f = lambda x: {"h": x @ x.T}  # noqa: E731
  with jaxprec.use_kernel("f32"):
    r = jaxprec.check(f, a, precisions=["bfloat16_3x"], mode="emulate")
  d = json.loads(r.to_json())["kernel"]
  assert (d["setting"], d["source"]) == ("f32", "scope")
  assert set(d["per_algorithm"].values()) == {"f32"}
  assert jaxprec.DivergenceReport.from_json(r.to_json()).kernel == d
  plain = jaxprec.check(f, a, precisions=["bfloat16_3x"], mode="emulate")
  assert plain.kernel == jaxprec.current_kernel().to_dict()
  # A file written before the field existed reads as {}.
  old = json.loads(r.to_json())
  del old["kernel"]
  assert jaxprec.DivergenceReport.from_dict(old).kernel == {}
