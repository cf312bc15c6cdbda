"""set_default, current().source, env_for, validate_env, and the env var at import."""

import os
import subprocess
import sys

import jax
import pytest

import jaxprec


def test_set_default_and_sources():
  assert jaxprec.current().source == "backend-default"
  prev = jaxprec.set_default("fp32")
  assert prev.name == "backend-default"
  assert jax.config.jax_default_matmul_precision == "float32"
  cur = jaxprec.current()
  assert (cur.name, cur.source) == ("float32", "config")
  with jaxprec.precision("bf16"):
    assert jaxprec.current().source == "context"
  assert jaxprec.set_default(prev).name == "float32"
  assert jaxprec.current().source == "backend-default"


def test_set_default_validates():
  with pytest.raises(ValueError, match="Did you mean 'bfloat16'"):
    jaxprec.set_default("bfloat61")
  assert jax.config.jax_default_matmul_precision is None


def test_env_for_does_not_touch_os_environ():
  before = dict(os.environ)
  env = jaxprec.env_for("bf16_3x")
  assert env["JAX_DEFAULT_MATMUL_PRECISION"] == "tensorfloat32"
  assert dict(os.environ) == before
  base = {"A": "1", "JAX_DEFAULT_MATMUL_PRECISION": "float32"}
  env = jaxprec.env_for(None, base)
  assert env == {"A": "1"} and base["JAX_DEFAULT_MATMUL_PRECISION"] == "float32"
  assert jaxprec.env_for("F32_F32_F32", {})["JAX_DEFAULT_MATMUL_PRECISION"] == "F32_F32_F32"


def test_validate_env():
  assert jaxprec.validate_env({}) is None
  assert jaxprec.validate_env({"JAX_DEFAULT_MATMUL_PRECISION": "highest"}).name == "float32"
  with pytest.raises(ValueError, match=r"JAX_DEFAULT_MATMUL_PRECISION: Invalid precision "
                                       r"'flaot32'.*Did you mean 'float32'"):
    jaxprec.validate_env({"JAX_DEFAULT_MATMUL_PRECISION": "flaot32"})


def _run(code, value):
  env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION=value, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=120)


def test_env_var_source_and_jaxprec_spellings_in_a_subprocess():
  r = _run("import jaxprec, jax; p = jaxprec.current(); "
           "print(p.name, p.source, jax.config.jax_default_matmul_precision)", "fp32")
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["float32", "env", "float32"]


def test_bad_env_var_gets_a_clear_error_at_import():
  r = _run("import jaxprec", "bfloat61")
  assert r.returncode != 0
  assert ("ValueError: JAX_DEFAULT_MATMUL_PRECISION: Invalid precision 'bfloat61'"
          in r.stderr)
  assert "Did you mean 'bfloat16'?" in r.stderr


def test_import_starts_no_backend_and_loads_no_heavy_modules():
  code = ("import sys, jaxprec; from jax._src import xla_bridge as xb; "
          "print(bool(xb._backends), 'flax' in sys.modules, "
          "'transformers' in sys.modules)")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                     timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["False", "False", "False"]
