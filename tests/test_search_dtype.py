"""search_policy(..., axes=...): the dtype axis."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
from jaxprec._src.search import search_dtype


class Fragile(nn.Module):
  """dense_2 cancels a large common offset of its input (its kernel's columns
  sum to zero): in bfloat16, or at one bfloat16 pass, the signal is lost."""

  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(32, dtype=self.dtype, name="dense_0")(x))
    h = jnp.tanh(nn.Dense(32, dtype=self.dtype, name="dense_1")(h))
    y = nn.Dense(32, dtype=self.dtype, name="dense_2")(
        h.astype(jnp.float32) + 100.0)
    y = nn.LayerNorm(dtype=self.dtype, name="norm")(y)
    return {"h1": h, "h2": y,
            "out": nn.Dense(8, dtype=self.dtype, name="dense_3")(y)}


@pytest.fixture(scope="module")
def fragile():
  model = Fragile()
  x = jax.random.normal(jax.random.key(1), (16, 16))
  params = model.init(jax.random.key(0), x)
  k = params["params"]["dense_2"]["kernel"]
  params["params"]["dense_2"]["kernel"] = k - k.mean(axis=0, keepdims=True)
  return model, params, x


def _rel_rms(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.sum((got - ref) ** 2) / np.sum(ref ** 2)))


def test_fragile_model_is_fragile_in_bfloat16_only_at_dense_2(fragile):
  # The premise, against an independent float64 NumPy reference: every layer
  # in bfloat16 but dense_2 is fine; dense_2 in bfloat16 loses the signal.
  model, params, x = fragile
  with jax.default_matmul_precision("float32"):
    ref = jax.tree.map(lambda a: np.asarray(a, np.float64),
                       model.apply(params, x))
  good = jaxprec.swap(model, "default=dtype:bf16,dense_2=dtype:float32")
  bad = jaxprec.swap(model, "dense_2=dtype:bf16")
  with jax.default_matmul_precision("float32"):
    good_out, bad_out = good.apply(params, x), bad.apply(params, x)
  assert good_out["out"].dtype == jnp.bfloat16
  assert _rel_rms(good_out["out"], ref["out"]) < 2e-2
  assert _rel_rms(bad_out["h2"], ref["h2"]) > 0.2


def test_search_over_precision_and_dtype_keeps_the_fragile_layer_float32(
    fragile):
  model, params, x = fragile
  r = jaxprec.search_policy(model.apply, params, x, tolerance=2e-2,
                            axes=("precision", "dtype"), mode="emulate",
                            verbose=False)
  assert r.meets_tolerance and r.axes == ("precision", "dtype")
  assert r.policy.default_dtype == "bfloat16"
  assert r.policy.dtype_for("dense_2") == "float32"
  # On a TPU a float32 dense_2 also needs more than one bfloat16 pass.
  assert r.policy.precision_for("dense_2").name != "bfloat16"
  dtypes = r.dtype_by_path()
  assert set(dtypes) == {"dense_0", "dense_1", "dense_2", "norm", "dense_3"}
  assert {p for p, d in dtypes.items() if d == "bfloat16"} == {
      "dense_0", "dense_1", "norm", "dense_3"}
  assert r.candidates == ("bfloat16+dtype:bfloat16", "bfloat16+dtype:float32",
                          "bfloat16_3x+dtype:float32", "float32+dtype:float32")
  assert 0 < r.relative_cost < 1 and r.cost.chip == "tpu-v5e"
  assert r.evaluations <= 8
  assert jaxprec.Policy.parse(str(r.policy)) == r.policy
  d = r.to_dict()
  assert d["axes"] == ["precision", "dtype"] and d["dtype_by_path"] == dtypes
  assert "bfloat16+dtype:bfloat16" in str(r)
  # check(..., precisions=[result.policy]) reproduces the search's figures.
  c = jaxprec.check(model.apply, params, x, precisions=[r.policy],
                    mode="emulate")
  assert c.precisions == (str(r.policy),)
  np.testing.assert_allclose(
      c.metric("rel_rms", str(r.policy)), [r.values[n] for n in ("h1", "h2", "out")],
      rtol=1e-5)


def test_search_over_dtype_alone_on_a_model_fine_in_bfloat16(fragile):
  # Without the fragile kernel nothing cancels: every module goes bfloat16.
  model, params, x = fragile
  params = jax.tree.map(lambda a: a, params)  # a copy
  params["params"]["dense_2"]["kernel"] = jax.random.normal(
      jax.random.key(3), (32, 32)) / 6
  r = jaxprec.search_policy(model.apply, params, x, tolerance=5e-2, axes="dtype", mode="emulate",
                            verbose=False)
  assert str(r.policy) == "default=dtype:bfloat16" and r.evaluations == 1
  assert r.candidates == ("dtype:bfloat16", "dtype:float32")
  assert r.policy.precision_for("dense_0") is None


def test_search_over_dtype_alone_keeps_a_fragile_layer_norm_float32():
  # A layer norm that computes its statistics in its own dtype (no matmul):
  # its input's large mean cancels in bfloat16. The dtype axis finds it.
  class NaiveNorm(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
      x = x.astype(self.dtype or x.dtype) + 30.0
      mean = jnp.mean(x, -1, keepdims=True)
      var = jnp.mean(x * x, -1, keepdims=True) - mean ** 2
      return (x - mean) / jnp.sqrt(var + 1e-3)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = NaiveNorm(name="norm")(nn.Dense(32, name="dense_0")(x))
      return {"out": nn.Dense(8, name="dense_1")(h)}

  model, x = Net(), jax.random.normal(jax.random.key(1), (8, 16))
  params = model.init(jax.random.key(0), x)
  r = jaxprec.search_policy(model.apply, params, x, tolerance=5e-2,
                            axes=("dtype",), mode="emulate", verbose=False)
  assert r.meets_tolerance
  assert r.policy.dtype_for("norm") == "float32"
  assert r.policy.dtype_for("dense_0") == r.policy.dtype_for("dense_1") == (
      "bfloat16")


def test_precision_axis_alone_is_unchanged(fragile):
  model, params, x = fragile
  r = jaxprec.search_policy(model.apply, params, x, tolerance=2e-2,
                            mode="emulate", verbose=False)
  assert r.axes == ("precision",)
  assert str(r.policy) == "default=bfloat16,dense_2=bfloat16_3x"
  assert "axes" not in r.to_dict() and r.relative_cost == r.cost.relative
  assert r.units == ("dense_0", "dense_1", "dense_2", "dense_3")


@pytest.mark.parametrize("axes, fragment", [
    ("dtpye", "Unknown axis 'dtpye'; valid choices: 'precision', 'dtype'. Did "
              "you mean 'dtype'?"),
    (("precision", "layout"), "Unknown axis 'layout'"),
    ((), "axes is empty"),
    (3, "Unknown axes 3"),
])
def test_bad_axes(fragile, axes, fragment):
  model, params, x = fragile
  with pytest.raises(ValueError, match="valid choices|empty") as e:
    jaxprec.search_policy(model.apply, params, x, tolerance=1e-2, axes=axes,
                          verbose=False)
  assert fragment in str(e.value)


def test_bad_dtypes_and_chip(fragile):
  model, params, x = fragile
  with pytest.raises(ValueError, match="Did you mean 'bfloat16'"):
    jaxprec.search_policy(model.apply, params, x, tolerance=1e-2,
                          axes="dtype", dtypes=("bflaot16",), verbose=False)
  with pytest.raises(ValueError, match="h100.*gpu chip"):
    jaxprec.search_policy(model.apply, params, x, tolerance=1e-2,
                          axes="dtype", chip="h100", verbose=False)
  with pytest.raises(ValueError, match="dtypes= and chip= apply to the dtype"):
    jaxprec.search_policy(model.apply, params, x, tolerance=1e-2,
                          dtypes=("bfloat16",), verbose=False)
  with pytest.raises(ValueError, match="float16.*no peak"):
    jaxprec.search_policy(model.apply, params, x, tolerance=1e-2,
                          axes="dtype", dtypes=("float16", "float32"),
                          verbose=False)


def test_check_axes_and_dtypes():
  assert search_dtype.check_axes("dtype, precision") == ("precision", "dtype")
  assert search_dtype.check_dtypes(["f32", jnp.bfloat16, "bf16"]) == (
      "bfloat16", "float32")


# -- the command line ------------------------------------------------------------

CLI_MODEL = '''\
import jax, jax.numpy as jnp
import flax.linen as nn

class Fragile(nn.Module):
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(32, dtype=self.dtype, name="dense_0")(x))
    y = nn.Dense(32, dtype=self.dtype, name="dense_1")(h.astype(jnp.float32) + 100.0)
    return {"h": h, "out": nn.Dense(8, dtype=self.dtype, name="dense_2")(y)}

def make():
  model, x = Fragile(), jax.random.normal(jax.random.key(1), (16, 16))
  params = model.init(jax.random.key(0), x)
  k = params["params"]["dense_1"]["kernel"]
  params["params"]["dense_1"]["kernel"] = k - k.mean(axis=0, keepdims=True)
  return model.apply, (params, x)
'''


@pytest.fixture
def cli_project(tmp_path, monkeypatch):
  import sys  # noqa: PLC0415
  (tmp_path / "dtype_search_model.py").write_text(CLI_MODEL)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("JAXPREC_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(sys, "path", list(sys.path))
  yield tmp_path
  sys.modules.pop("dtype_search_model", None)


def test_cli_search_axes_precision_dtype(cli_project, capsys):
  import json  # noqa: PLC0415

  from jaxprec._src.cli.cli import main  # noqa: PLC0415
  rc = main(["search", "dtype_search_model:make", "--tolerance", "0.02",
             "--axes", "precision,dtype", "--json", "--no-cache"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  d = json.loads(out)
  assert d["axes"] == ["precision", "dtype"]
  assert d["dtype_by_path"] == {"dense_0": "bfloat16", "dense_1": "float32",
                                "dense_2": "bfloat16"}
  policy = jaxprec.Policy.parse(d["policy"])
  assert policy.default_dtype == "bfloat16"
  # The first evaluation, after the command's phase lines.
  evaluations = [l for l in err.splitlines() if not l.startswith("jaxprec search:")]
  assert "all bfloat16+dtype:bfloat16" in evaluations[0], err


@pytest.mark.parametrize("argv, fragment", [
    (["--axes", "precision,dtpye"], "Unknown axis 'dtpye'; valid choices: "
                                    "'precision', 'dtype'. Did you mean 'dtype'?"),
    (["--axes", "dtype", "--dtypes", "bf17"], "Unknown dtype 'bf17'"),
    (["--axes", "dtype", "--chip", "tpu-v6"], "Unknown chip 'tpu-v6'"),
    (["--axes", "dtype", "--chip", "a100"], "'a100' is a gpu chip"),
    (["--dtypes", "bfloat16"], "--dtypes and --chip apply to --axes with dtype"),
])
def test_cli_search_bad_axes_exit_2(cli_project, capsys, argv, fragment):
  from jaxprec._src.cli.cli import main  # noqa: PLC0415
  rc = main(["search", "dtype_search_model:make", "--tolerance", "0.02",
             *argv])
  err = capsys.readouterr().err
  assert rc == 2, err
  lines = [l for l in err.splitlines() if l.startswith("jaxprec: error:")]
  assert len(lines) == 1 and fragment in lines[0], err
