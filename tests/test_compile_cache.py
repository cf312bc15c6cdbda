"""JAX's persistent compilation cache: the CLI, the Python opt-in, the benchmark."""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
from jaxprec._src.emulation import compile_cache

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETTINGS = compile_cache._SETTINGS

TARGET = '''
import jax, jax.numpy as jnp

def f(w, x):
  h = jnp.tanh(x @ w)
  return {"h": h, "out": h @ w}

def make():
  w = jax.random.normal(jax.random.key(0), (32, 32)) / 6
  x = jax.random.normal(jax.random.key(1), (4, 32))
  return f, (w, x)
'''


def _settings():
  return {name: getattr(jax.config, name) for name in SETTINGS}


def _entries(path) -> list[str]:
  if not os.path.isdir(path):
    return []
  return sorted(n for n in os.listdir(path) if not n.startswith("."))


def _cli(tmp_path, *args, cache_dir=None):
  (tmp_path / "target.py").write_text(TARGET)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             JAXPREC_CACHE_DIR=str(cache_dir or tmp_path / "cache"))
  return subprocess.run([sys.executable, "-m", "jaxprec", *args], cwd=tmp_path,
                        capture_output=True, text=True, env=env, timeout=300)


# ---------------------------------------------------------------------------
# The command line.


def test_cli_check_fills_the_cache_and_a_second_run_reads_it(tmp_path):
  jc = tmp_path / "cache" / "jax-compilation"
  first = _cli(tmp_path, "check", "target.py:make", "--precisions",
               "bfloat16,bfloat16_3x", "--out", "r1", "--json")
  assert first.returncode == 0, first.stderr
  entries = _entries(jc)
  # The reference and one program per precision at least.
  assert len(entries) >= 3, entries
  second = _cli(tmp_path, "check", "target.py:make", "--precisions",
                "bfloat16,bfloat16_3x", "--out", "r2", "--json")
  assert second.returncode == 0, second.stderr
  # Nothing new compiled: the same programs, loaded.
  assert _entries(jc) == entries
  r1 = json.loads((tmp_path / "r1" / "report.json").read_text())
  r2 = json.loads((tmp_path / "r2" / "report.json").read_text())
  assert r1["layers"] == r2["layers"]  # same numbers from the loaded programs
  rel = r1["layers"][1]["metrics"]["bfloat16"]["rel_rms"]
  assert 1e-4 < rel < 1e-1  # a real one-pass bfloat16 error


def test_cli_no_cache_leaves_the_cache_empty(tmp_path):
  proc = _cli(tmp_path, "check", "target.py:make", "--precisions", "bfloat16",
              "--out", "r", "--no-cache")
  assert proc.returncode == 0, proc.stderr
  assert _entries(tmp_path / "cache" / "jax-compilation") == []
  proc = _cli(tmp_path, "search", "target.py:make", "--tolerance", "1e-2",
              "--no-cache")
  assert proc.returncode == 0, proc.stderr
  assert _entries(tmp_path / "cache" / "jax-compilation") == []


def test_cli_search_fills_the_cache(tmp_path):
  proc = _cli(tmp_path, "search", "target.py:make", "--tolerance", "1e-2")
  assert proc.returncode == 0, proc.stderr
  assert "default=bfloat16" in proc.stdout
  assert len(_entries(tmp_path / "cache" / "jax-compilation")) >= 2


def test_cli_unusable_cache_dir_warns_and_checks_anyway(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  proc = _cli(tmp_path, "check", "target.py:make", "--precisions", "bfloat16",
              "--out", "r", cache_dir=blocker)
  assert proc.returncode == 0, proc.stderr
  assert "jaxprec: warning: compilation cache off:" in proc.stderr
  assert str(blocker / "jax-compilation") in proc.stderr
  assert (tmp_path / "r" / "report.json").exists()


def test_cli_main_in_process_restores_jax_settings(tmp_path, monkeypatch,
                                                  capsys):
  from jaxprec._src.cli.cli import main
  monkeypatch.setenv("JAXPREC_CACHE_DIR", str(tmp_path / "c"))
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
  # Other shapes than TARGET's: programs not compiled in this process yet.
  (tmp_path / "inproc_target.py").write_text(
      TARGET.replace("(32, 32)", "(40, 40)").replace("(4, 32)", "(4, 40)"))
  before = _settings()
  try:
    assert main(["check", "inproc_target:make", "--precisions", "bfloat16",
                 "--out", "r", "--no-cache"]) == 0
    assert _entries(tmp_path / "c" / "jax-compilation") == []
    assert _settings() == before
    assert main(["check", "inproc_target:make", "--precisions",
                 "bfloat16_3x", "--out", "r"]) == 0
    assert len(_entries(tmp_path / "c" / "jax-compilation")) >= 1
    assert _settings() == before
  finally:
    sys.modules.pop("inproc_target", None)
  capsys.readouterr()


def test_no_cache_is_in_the_help():
  from jaxprec._src.cli import cli
  for command in ("check", "search"):
    with pytest.raises(SystemExit):
      cli._parser().parse_args([command, "--help"])
  text = cli._parser()._subparsers._group_actions[0].choices["check"].format_help()
  assert "--no-cache" in text and "jax-compilation" in text


# ---------------------------------------------------------------------------
# Python: opt in per call, settings restored.


def _mlp(w, x):
  h1 = jnp.tanh(x @ w)
  return {"h1": h1, "h2": jnp.tanh(h1 @ w)}


def _args(n=24):
  w = jax.random.normal(jax.random.key(0), (n, n)) / 5
  x = jax.random.normal(jax.random.key(1), (3, n))
  return w, x


def test_check_cache_true_fills_default_dir_and_restores_settings(
    tmp_path, monkeypatch):
  monkeypatch.setenv("JAXPREC_CACHE_DIR", str(tmp_path))
  before = _settings()
  w, x = _args(24)

  def fresh(w, x):  # a new function: nothing compiled in memory yet
    return _mlp(w, x)
  report = jaxprec.check(fresh, w, x, precisions="bfloat16", mode="emulate",
                         cache=True)
  jc = tmp_path / "jax-compilation"
  assert len(_entries(jc)) >= 2  # the reference and the bfloat16 program
  assert _settings() == before
  # Afterwards, compiling writes nothing there.
  n = len(_entries(jc))
  jax.jit(lambda a: jnp.sin(a) * 3.0 + 0.25)(np.arange(5.0)).block_until_ready()
  assert len(_entries(jc)) == n
  # Same numbers as without the cache.
  plain = jaxprec.check(fresh, w, x, precisions="bfloat16", mode="emulate")
  assert report.metric("rel_rms", "bfloat16") == plain.metric(
      "rel_rms", "bfloat16")


def test_search_policy_cache_dir_and_restore(tmp_path):
  before = _settings()
  w, x = _args(20)

  def fresh(w, x):
    return _mlp(w, x)
  r = jaxprec.search_policy(fresh, w, x, tolerance=1e-2, verbose=False,
                            cache=tmp_path / "mine")
  assert str(r.policy) == "default=bfloat16"
  assert len(_entries(tmp_path / "mine")) >= 2
  assert _settings() == before


def test_settings_restored_when_the_call_fails(tmp_path):
  before = _settings()

  def broken(w, x):
    raise RuntimeError("boom")
  with pytest.raises(RuntimeError, match="boom"):
    jaxprec.check(broken, *_args(8), cache=tmp_path)
  assert _settings() == before


def test_an_enclosing_cache_gets_its_directory_back(tmp_path):
  outer, inner = tmp_path / "outer", tmp_path / "inner"
  with compile_cache.compilation_cache(outer):
    jaxprec.check(lambda w, x: _mlp(w, x), *_args(12), precisions="bfloat16",
                  mode="emulate", cache=inner)
    assert len(_entries(inner)) >= 2
    n_inner, n_outer = len(_entries(inner)), len(_entries(outer))
    assert jax.config.jax_compilation_cache_dir == str(outer)
    jax.jit(lambda a: jnp.cos(a) * 7.0 - 0.5)(np.arange(3.0)).block_until_ready()
    assert len(_entries(outer)) == n_outer + 1
    assert len(_entries(inner)) == n_inner


def test_enable_compilation_cache_stays_on(tmp_path):
  before = _settings()
  try:
    path = jaxprec.enable_compilation_cache(tmp_path / "on")
    assert path == str(tmp_path / "on")
    assert jax.config.jax_compilation_cache_dir == path
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    jax.jit(lambda a: jnp.tan(a) + 11.0)(np.arange(4.0)).block_until_ready()
    assert len(_entries(path)) == 1
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compile_cache._reset()


def test_default_dir_follows_jaxprec_cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXPREC_CACHE_DIR", str(tmp_path / "c"))
  assert compile_cache.default_dir() == str(tmp_path / "c" / "jax-compilation")
  assert compile_cache.resolve_cache(True, "x") == compile_cache.default_dir()
  assert compile_cache.resolve_cache(False, "x") is None


@pytest.mark.parametrize("bad", [3, 1.5, ["dir"], b"dir"])
def test_bad_cache_values_name_the_choices(bad):
  with pytest.raises(TypeError, match=r"jaxprec.check: cache must be True .*"
                                      r"False, or a directory .*got"):
    jaxprec.check(_mlp, *_args(8), cache=bad)
  with pytest.raises(TypeError, match="jaxprec.search_policy: cache must be"):
    jaxprec.search_policy(_mlp, *_args(8), tolerance=1e-2, cache=bad)
  with pytest.raises(TypeError, match="must be a str or os.PathLike"):
    jaxprec.enable_compilation_cache(bad)


def test_a_file_is_not_a_cache_dir(tmp_path):
  f = tmp_path / "f"
  f.write_text("x")
  before = _settings()
  with pytest.raises(ValueError, match=r"is a file, not a directory"):
    jaxprec.check(_mlp, *_args(8), cache=f)
  with pytest.raises(ValueError, match=r"cannot create the compilation cache "
                                       r"directory .*JAXPREC_CACHE_DIR"):
    jaxprec.enable_compilation_cache(f / "sub")
  with pytest.raises(ValueError, match="cache='' is not a directory"):
    jaxprec.check(_mlp, *_args(8), cache="")
  assert _settings() == before


# ---------------------------------------------------------------------------
# The benchmark.


def test_bench_cli_cache_quick(tmp_path):
  env = dict(os.environ, JAXPREC_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "bench_cli_cache.py"),
       "--quick"], cwd=ROOT, capture_output=True, text=True, env=env,
      timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  out = proc.stdout
  assert re.search(r"cold \(empty JAXPREC_CACHE_DIR\)\s+[\d.]+\s+1\.00x", out), out
  m = re.search(r"warm \(second run, same cache\)\s+[\d.]+\s+([\d.]+)x\s+<= 0.5",
                out)
  assert m, out
  assert float(m.group(1)) < 1.0  # loading beats compiling, even when busy
  assert re.search(r"--no-cache\s+[\d.]+\s+[\d.]+x", out), out
  assert re.search(r"cache: [1-9]\d* files", out), out
