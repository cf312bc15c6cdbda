"""The emulation kernel setting: precedence, errors, jit keys, the measurement."""

import json
import re

import jax
import numpy as np
import pytest

import jaxprec
from jaxprec._src import kernels

MATMUL = (((1,), (0,)), ((), ()))


def _dots(fn, x):
  return re.findall(r"stablehlo.dot_general.*", jax.jit(fn).lower(x, x).as_text())


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
    assert len(_dots(fn, x)) == 3
  with jaxprec.use_kernel("f32"):
    assert len(_dots(fn, x)) == 2
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
    (1.6, {"bf16x1": "f32", "bf16x3": "f32", "bf16x6": "f32", "bf16x9": "f32"}),
])
def test_auto_picks_the_fewer_float32_dot_equivalents(ratio, expected):
  choice = kernels.KernelChoice(setting="auto", source="default", backend="cpu",
                                device_kind="cpu", ratio=ratio, reason="")
  got = choice.per_algorithm()
  assert {a: got[a] for a in expected} == expected
  assert got["tf32x3"] == "f32"  # float32 passes either way: merged is fewer
  assert choice.kernel_for("bf16x3", "conv_general_dilated") == "f32"


def test_gpu_and_tpu_use_bf16_dots():
  for backend in ("gpu", "tpu"):
    choice = kernels.KernelChoice(setting="auto", source="default",
                                  backend=backend, device_kind="x", ratio=None,
                                  reason="")
    assert set(choice.per_algorithm().values()) == {"bf16"}


def test_auto_measures_once_and_caches_on_disk(monkeypatch, tmp_path):
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)  # the test is about 'auto'
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(tmp_path))
  monkeypatch.setattr(kernels, "_MEASURED", {})
  calls = []
  real = kernels.measure
  monkeypatch.setattr(kernels, "measure",
                      lambda: calls.append(1) or real(size=64, repeats=2))
  monkeypatch.setattr(kernels, "measure_one_pass",
                      lambda: calls.append(2) or 0.75)
  first = jaxprec.current_kernel()
  assert first.setting == "auto" and first.ratio > 0 and calls == [1, 2]
  assert first.one_pass_ratio == 0.75
  assert "measured in this process" in first.reason
  assert jaxprec.current_kernel().ratio == first.ratio and calls == [1, 2]
  data = json.loads((tmp_path / "kernel_benchmark.json").read_text())
  key = kernels._disk_key(first.device_kind)
  assert data == {key: first.ratio, key + kernels._ONE_PASS_KEY: 0.75}
  assert "jaxlib" in key
  monkeypatch.setattr(kernels, "_MEASURED", {})  # a new process: read the disk
  again = jaxprec.current_kernel()
  assert again.ratio == first.ratio and again.one_pass_ratio == 0.75
  assert calls == [1, 2] and again.reason.count("cached in") == 2


def test_the_disk_cache_keys_on_xla_flags_and_cpu_features(monkeypatch, tmp_path):
  # A figure measured under other XLA flags (which pick the dot library) or on
  # a CPU with other feature flags but the same model name is not reused.
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(tmp_path))
  monkeypatch.setattr(kernels, "_MEASURED", {})
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setattr(kernels, "_XLA_FLAGS_AT_START", "")
  figures = iter([0.5, 1.25, 0.75])
  monkeypatch.setattr(kernels, "measure", lambda: next(figures))
  monkeypatch.setattr(kernels, "measure_one_pass", lambda: 0.5)
  assert jaxprec.current_kernel().ratio == 0.5
  plain = kernels._disk_key("cpu")
  assert "XLA_FLAGS=''" in plain and "flags " in plain
  monkeypatch.setattr(kernels, "_MEASURED", {})  # a new process, other flags
  monkeypatch.setenv("XLA_FLAGS", " --xla_cpu_experimental_ynn_fusion_type= ")
  monkeypatch.setattr(kernels, "_XLA_FLAGS_AT_START", kernels._xla_flags())
  other = jaxprec.current_kernel()
  assert other.ratio == 1.25 and "measured in this process" in other.reason
  assert other.kernel_for("bf16x3") == "f32"
  monkeypatch.setattr(kernels, "_MEASURED", {})  # same flags again: cached
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")
  assert jaxprec.current_kernel().ratio == 1.25
  monkeypatch.delenv("XLA_FLAGS")
  monkeypatch.setattr(kernels, "_XLA_FLAGS_AT_START", "")
  monkeypatch.setattr(kernels, "_MEASURED", {})
  assert jaxprec.current_kernel().ratio == 0.5
  # Same model name, another feature list: measured again.
  real = kernels._cpuinfo
  monkeypatch.setattr(kernels, "_cpuinfo", lambda field: (
      "fpu sse2 avx2" if field == "flags" else real(field)))
  monkeypatch.setattr(kernels, "_MEASURED", {})
  assert kernels._disk_key("cpu") != plain
  assert jaxprec.current_kernel().ratio == 0.75
  data = json.loads((tmp_path / "kernel_benchmark.json").read_text())
  dots = [v for k, v in data.items() if not k.endswith(kernels._ONE_PASS_KEY)]
  assert sorted(dots) == [0.5, 0.75, 1.25] and len(data) == 6


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"other": "x"}', "",
                                     "KEY: NaN", "KEY: 0", "KEY: -1", 'KEY: "x"',
                                     "KEY: Infinity", "KEY: null"])
def test_a_damaged_cache_file_is_measured_again_and_repaired(monkeypatch, tmp_path,
                                                              content):
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(tmp_path))
  monkeypatch.setattr(kernels, "_MEASURED", {})
  monkeypatch.setattr(kernels, "measure", lambda: 0.625)
  if content.startswith("KEY"):  # this machine's key, holding no measurement
    value = content.split(": ", 1)[1]
    content = "{" + json.dumps(kernels._disk_key(jax.devices()[0].device_kind)) + \
        ": " + value + "}"
  (tmp_path / "kernel_benchmark.json").write_text(content)
  choice = jaxprec.current_kernel()
  assert choice.ratio == 0.625 and "measured in this process" in choice.reason
  data = json.loads((tmp_path / "kernel_benchmark.json").read_text())
  assert data[kernels._disk_key(choice.device_kind)] == 0.625
  if "other" in content:  # another key's figure is kept
    assert data["other"] == "x"


@pytest.mark.parametrize("ratio,expected", [
    # A CPU with bfloat16 dot units: X6 costs 3.12 against 3 float32 dots, a
    # near tie kept on bf16; X9 (4.68 against 3) runs on f32.
    (0.52, {"bf16x1": "bf16", "bf16x3": "bf16", "bf16x6": "bf16",
            "bf16x9": "f32"}),
    (0.3, {"bf16x1": "bf16", "bf16x3": "bf16", "bf16x6": "bf16",
           "bf16x9": "bf16"}),
    # No bfloat16 dot units (a bfloat16 dot as dear as a float32 one): one
    # pass stays on bf16, the multi-pass algorithms run on f32.
    (1.0, {"bf16x1": "bf16", "bf16_bf16_bf16": "bf16", "bf16x3": "f32",
           "bf16x6": "f32", "bf16x9": "f32"}),
    (1.2, {"bf16x1": "f32", "bf16x3": "f32"}),
])
def test_auto_keeps_bf16_unless_f32_is_clearly_cheaper(ratio, expected):
  choice = kernels.KernelChoice(setting="auto", source="default", backend="cpu",
                                device_kind="cpu", ratio=ratio, reason="")
  assert {a: choice.kernel_for(a) for a in expected} == expected
  # The one-pass figure, where measured, decides the one-pass algorithms
  # only: Eigen's dots measured 1.16x for the dots, 1.00x for the whole op.
  for one, kernel in ((1.0, "bf16"), (1.2, "f32"), (0.3, "bf16")):
    two = kernels.KernelChoice(setting="auto", source="default", backend="cpu",
                               device_kind="cpu", ratio=ratio, reason="",
                               one_pass_ratio=one)
    assert two.kernel_for("bf16x1") == two.kernel_for("bf16_bf16_bf16") == kernel
    assert two.kernel_for("bf16x1", op="conv_general_dilated") == "f32"
    for algorithm in set(expected) - {"bf16x1", "bf16_bf16_bf16"}:
      assert two.kernel_for(algorithm) == expected[algorithm]
  # Float32 passes in both kernels: the one with fewer dots, whatever ratio.
  assert choice.kernel_for("tf32x3") == "f32"
  assert choice.kernel_for("tf32") == "f32"
  assert choice.kernel_for("bf16x3", op="conv_general_dilated") == "f32"
  assert choice.kernel_for("bf16x1", op="conv_general_dilated") == "f32"


def test_both_measurements_run_their_ops_even_inside_a_trace(monkeypatch):
  # From inside a jax.jit trace (where the first emulated op usually asks for
  # them), both figures time ops that ran, not their tracing.
  got, waited_on, ready = [], [], jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waited_on.extend(
      jax.tree_util.tree_leaves(x)) or ready(x))

  def fn(x):
    got.append(kernels.measure_one_pass(shape=(16, 32, 64), repeats=2))
    got.append(kernels.measure(size=64, repeats=2))
    return x
  jax.jit(fn)(np.ones(2, np.float32))
  assert all(isinstance(r, float) and 0.01 < r < 100 for r in got), got
  assert waited_on and not [v for v in waited_on
                            if isinstance(v, jax.core.Tracer)]


def test_measure_is_a_time_ratio():
  r = kernels.measure(size=64, repeats=2)
  assert 0.01 < r < 100


def test_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(tmp_path))
  assert kernels.cache_dir() == str(tmp_path)
  monkeypatch.delenv(kernels.CACHE_ENV_VAR)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  if kernels.platform.system() == "Linux":
    assert kernels.cache_dir() == str(tmp_path / "xdg" / "jaxprec")


@pytest.mark.parametrize("ratio,dots", [(2.0, 2), (0.3, 3)])
def test_auto_decides_from_the_measurement_inside_jit(monkeypatch, tmp_path, ratio,
                                                      dots):
  # The first emulated op traced under jit runs the measurement; its figure
  # decides the kernel: 3 bfloat16 dots, or 2 float32 dots, for X3.
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)  # the test is about 'auto'
  monkeypatch.setenv(kernels.CACHE_ENV_VAR, str(tmp_path))
  monkeypatch.setattr(kernels, "_MEASURED", {})
  monkeypatch.setattr(kernels, "measure", lambda: ratio)
  x = np.ones((8, 8), np.float32)
  fn = lambda a, b: jaxprec.emulated_dot_general(a, b, MATMUL, "high")  # noqa: E731
  found = _dots(fn, x)
  assert len(found) == dots
  assert all(("bf16>" in d) == (dots == 3) for d in found)


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
