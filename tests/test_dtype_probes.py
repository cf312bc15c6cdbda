"""Regressions found by probing the dtype axis as a new user."""

from __future__ import annotations

import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec

# ---------------------------------------------------------------- grammar


@pytest.mark.parametrize("text, meant", [
    ("dense_2=dtype=bf16", "dense_2=dtype:bf16"),
    ("default=dtype=float32", "default=dtype:float32"),
    ("Dense&enc.* = DTYPE = bf16", "Dense&enc.*=dtype:bf16"),
    ("a=precision=f32", "a=precision:f32"),
])
def test_a_value_item_written_with_equals_is_an_error(text, meant):
  # It used to parse as a rule for the path regex 'dense_2=dtype' (a precision).
  with pytest.raises(ValueError, match=f"Did you mean '{meant}'"):
    jaxprec.Policy.parse(text)


@pytest.mark.parametrize("path", ["a=dtype", "a=precision", "x=DType "])
def test_a_path_that_ends_like_an_item_still_round_trips(path):
  p = jaxprec.Policy(rules=[jaxprec.Rule(path=path, dtype="bf16")])
  assert str(p).startswith("path:")
  assert jaxprec.Policy.parse(str(p)) == p


def test_other_regexes_with_equals_plus_and_colon_are_paths():
  p = jaxprec.Policy.parse("a=b=f32,enc.+=dtype:bf16,a:b=dtype:f16")
  assert [r.path for r in p.rules] == ["a=b", "enc.+", "a:b"]
  assert jaxprec.Policy.parse(str(p)) == p


# ---------------------------------------------------------------- default dtype


class _Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="dense_0")(x)


def _unused(record) -> list[str]:
  return [str(w.message) for w in record
          if issubclass(w.category, jaxprec.UnusedRuleWarning)]


def test_a_default_dtype_that_reaches_no_module_warns():
  x = jnp.ones((2, 4))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    out = jaxprec.emulate(lambda v: jnp.tanh(v @ v.T), "default=dtype:bf16",
                          target="cpu")(x)
  assert out.dtype == jnp.float32  # a plain function: nothing to decide
  [msg] = _unused(record)
  assert "default dtype 'bfloat16' decided the dtype of nothing" in msg


def test_a_default_dtype_that_reaches_a_module_does_not_warn():
  model, x = _Model(), jnp.ones((2, 4))
  params = model.init(jax.random.key(0), x)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    out = jaxprec.swap(model, "default=dtype:bf16").apply(params, x)
  assert out.dtype == jnp.bfloat16 and not _unused(record)


# ---------------------------------------------------------------- search


class _Scale(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x * 1.0


class _Big(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _Scale(name="scale")(x) * 0.5


def test_search_does_not_accept_a_dtype_that_overflows_to_inf():
  # 7e4 is past float16's largest finite value (65504): the float16 rows hold
  # inf where the float32 reference is finite. The metrics skip non-finite
  # elements, so the search used to pass 'default=dtype:float16' (rel_rms 0).
  model = _Big()
  x = np.array([[1.0, -2.0, 7e4, 3.0]], np.float32)
  params = model.init(jax.random.key(0), x)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    r = jaxprec.search_policy(lambda p, v: model.apply(p, v), params, x,
                              tolerance=1e-2, axes=("dtype",),
                              dtypes=("float16", "float32"), target="gpu",
                              budget=6, verbose=False)
  assert r.meets_tolerance
  assert r.policy.dtype_for("scale") == "float32"
  assert r.policy.dtype_for("") == "float32"
  out = jaxprec.swap(model, r.policy).apply(params, x)
  assert np.isfinite(np.asarray(out)).all()


def test_search_rejects_float16_on_a_tpu_chip_before_running():
  def fn(x):
    raise AssertionError("the model ran")
  with pytest.raises(ValueError, match="'float16' has no peak figure on "
                                       "tpu-v5e"):
    jaxprec.search_policy(fn, np.ones(3, np.float32), tolerance=1e-2,
                          axes=("dtype",), dtypes=("float16", "float32"))


_CLI_MODEL = """
import jax, numpy as np
import flax.linen as nn


class M(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x)


def make():
  x = np.ones((2, 4), np.float32)
  m = M()
  return (lambda p, v: m.apply(p, v)), (m.init(jax.random.key(0), x), x)
"""


def test_cli_search_float16_on_tpu_exits_2(tmp_path, monkeypatch, capsys):
  from jaxprec._src.cli.cli import main  # noqa: PLC0415
  (tmp_path / "probe_f16_model.py").write_text(_CLI_MODEL)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("JAXPREC_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(sys, "path", list(sys.path))
  try:
    rc = main(["search", "probe_f16_model:make", "--tolerance", "0.02",
               "--axes", "dtype", "--dtypes", "f16,f32"])
  finally:
    sys.modules.pop("probe_f16_model", None)
  err = capsys.readouterr().err
  assert rc == 2, err
  lines = [l for l in err.splitlines() if l.startswith("jaxprec: error:")]
  assert len(lines) == 1 and "no peak figure on tpu-v5e" in lines[0], err
