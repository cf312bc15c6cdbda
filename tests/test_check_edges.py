"""The checker's edges: a float64 reference beyond float32's range, tolerances
that are not finite, and references that the writer or the reader refuses."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
from jaxprec._src.checker import metrics as metrics_lib

F32_MAX = float(np.finfo(np.float32).max)


# -- A float64 reference beyond float32's range --------------------------------


def overflowing(x):
  """'big' is 4e38 in exact arithmetic (inf in float32); 'later' is finite
  in float32 but x64 changes nothing there, so only 'big' diverges."""
  big = x @ x.T  # 2e19 * 2e19 = 4e38
  later = jnp.tanh(x * 1e-19)
  return {"big": big, "later": later}


X_BIG = jnp.full((2, 1), 2e19, jnp.float32)


def test_float64_reference_beyond_float32_fails_that_layer():
  r = jaxprec.check(overflowing, X_BIG, precisions=["bfloat16_3x"],
                    reference="float64", mode="emulate")
  big, later = (l.metrics["bfloat16_3x"] for l in r.layers)
  # The float32 program overflows to inf where the true value is 4e38.
  assert big.inf == 4 and big.ref_overflow == 4 and big.ref_inf == 0
  assert big.required_atol == math.inf and big.frac_outside == 1.0
  assert not big.passes(1e30)
  assert later.ref_overflow == 0 and later.required_atol < 1e-6
  first = r.first_divergence(precision="bfloat16_3x")
  assert (first.layer, first.index) == ("big", 0)
  assert not r.passes()
  note = [n for n in r.notes if "beyond float32's range" in n]
  assert len(note) == 1 and "'big' (4 elements)" in note[0]
  assert "'later'" not in note[0]
  d = r.to_dict()
  assert d["layers"][0]["reference"]["overflow"] == 4
  back = jaxprec.DivergenceReport.from_dict(d)
  assert back.layers[0].metrics["bfloat16_3x"].ref_overflow == 4


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_external_float64_reference_beyond_float32_fails(sign):
  x = X_BIG * sign
  exact = np.asarray(x, np.float64) @ np.asarray(x, np.float64).T  # 4e38
  ref = {"big": exact, "later": np.tanh(np.asarray(x, np.float64) * 1e-19)}
  r = jaxprec.check(overflowing, x, precisions=["bfloat16_3x"],
                    reference=ref, mode="emulate")
  for p in r.precisions:  # the float32 floor too
    m = r.layers[0].metrics[p]
    assert m.ref_overflow == 4 and m.required_atol == math.inf, p
    assert r.first_divergence(precision=p).layer == "big"


def test_compare_beyond_float32():
  # inf against 4e38 (finite) fails; against a true inf it matches.
  m = metrics_lib.compare(np.float32([np.inf, 1.0]), np.array([4e38, 1.0]))
  assert (m.ref_overflow, m.ref_inf, m.required_atol) == (1, 0, math.inf)
  m = metrics_lib.compare(np.float32([np.inf, 1.0]), np.array([np.inf, 1.0]))
  assert (m.ref_overflow, m.ref_inf, m.required_atol) == (0, 1, 0.0)
  # float32's largest value is not an overflow; a finite candidate near it
  # against 4e38 is outside any tolerance too.
  m = metrics_lib.compare(np.float32([F32_MAX]), np.array([F32_MAX]))
  assert (m.ref_overflow, m.required_atol) == (0, 0.0)
  m = metrics_lib.compare(np.float32([F32_MAX]), np.array([-4e38]))
  assert (m.ref_overflow, m.required_atol) == (1, math.inf)


def test_split_reference_marks_overflow_only():
  ref = np.array([4e38, -4e38, np.inf, np.nan, 1.0 + 2**-30, F32_MAX])
  hi, lo = metrics_lib.split_reference(ref)
  assert np.isnan(lo[:2]).all() and np.isinf(hi[:2]).all()
  np.testing.assert_array_equal(lo[2:4], [0, 0])
  assert hi[4] == 1 and np.float64(lo[4]) == 2**-30
  assert lo[5] == 0 and hi[5] == np.float32(F32_MAX)


# -- Tolerances: finite numbers within float32, everywhere ---------------------


BAD = [math.inf, -math.inf, math.nan, 1e39, -1e-3]


def _mlp(x):
  return {"h": jnp.tanh(x @ x.T)}


@pytest.mark.parametrize("bad", BAD)
def test_check_refuses_tolerances_that_are_not_finite(bad):
  x = jnp.ones((2, 2))
  for name in ("atol", "rtol"):
    with pytest.raises(ValueError, match=rf"{name} must be a finite number "
                       rf">= 0.*got {re.escape(repr(bad))}"):
      jaxprec.check(_mlp, x, mode="emulate", **{name: bad})
    with pytest.raises(ValueError, match=rf"{name} must be a finite"):
      jaxprec.testing.assert_precision_robust(_mlp, x, mode="emulate",
                                              **{name: bad})
    with pytest.raises(ValueError, match=rf"{name} must be a finite"):
      metrics_lib.compare(np.ones(2, np.float32), np.ones(2), **{name: bad})


def test_check_module_refuses_infinite_rtol():
  from flax import nnx
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"rtol must be a finite.*got inf"):
    jaxprec.check_module(model, jnp.ones((1, 2)), rtol=math.inf,
                         mode="emulate")


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0.0, -1.0, "0.1", True])
def test_check_training_refuses_bad_thresholds(bad):
  optax = pytest.importorskip("optax")
  with pytest.raises(ValueError, match=r"threshold must be a finite number "
                     r"> 0.*got " + re.escape(repr(bad))):
    jaxprec.check_training(lambda w, b: jnp.sum(w * b), jnp.ones(2),
                           [jnp.ones(2)], optax.sgd(0.1), threshold=bad)


def test_largest_tolerance_is_accepted():
  m = metrics_lib.compare(np.float32([1, 2]), np.array([1.0, 3.0]),
                          atol=F32_MAX, rtol=F32_MAX)
  assert m.frac_outside == 0 and m.max_abs == 1.0


# -- check_module with a partial reference --------------------------------------


def _nnx_mlp():
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.fc(x))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([Block(rngs), Block(rngs)])
      self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
      for layer in self.layers:
        x = layer(x)
      return {"logits": self.head(x)}
  return Net(nnx.Rngs(0))


def _exact(model, x):
  """Each module's output in float64 NumPy, named as PyTorch names a module
  tree (dots), the root's output as capture(modules=) names it."""
  def dense(m, h):
    return h @ np.asarray(m.kernel[...], np.float64) + np.asarray(
        m.bias[...], np.float64)
  h, out = np.asarray(x, np.float64), {}
  for i, block in enumerate(model.layers):
    out[f"layers.{i}.fc"] = dense(block.fc, h)
    h = out[f"layers.{i}"] = np.tanh(out[f"layers.{i}.fc"])
  out["head"] = out["output.logits"] = dense(model.head, h)
  return out


X8 = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)


def test_check_module_compares_the_layers_a_partial_reference_holds():
  model = _nnx_mlp()
  exact = _exact(model, X8)
  full = jaxprec.check_module(model, X8, reference=exact,
                              precisions=["bfloat16"], mode="emulate")
  assert full.unchecked == ()
  names = [l.name for l in full.layers]
  assert names == ["layers/0/fc", "layers/0", "layers/1/fc", "layers/1",
                   "head", "output.logits"]
  part = {k: exact[k] for k in ("layers.1", "output.logits")}
  r = jaxprec.check_module(model, X8, reference=part, precisions=["bfloat16"],
                           mode="emulate")
  assert [l.name for l in r.layers] == ["layers/1", "output.logits"]
  assert r.unchecked == ("layers/0/fc", "layers/0", "layers/1/fc", "head")
  # The same figures as the full check, against the same float64 values.
  for l in r.layers:
    assert l.metrics["bfloat16"] == full.layer(l.name).metrics["bfloat16"]
    assert 1e-4 < l.metrics["bfloat16"].rel_rms < 3e-2
  line = ("unchecked: 4 layers have no reference and were not compared: "
          "layers/0/fc, layers/0, layers/1/fc, head")
  assert line in r.to_text() and line in str(r) and line in r.to_markdown()
  d = r.to_dict()
  assert d["unchecked"] == list(r.unchecked)
  assert jaxprec.DivergenceReport.from_dict(d).unchecked == r.unchecked


def test_check_module_partial_reference_from_a_file(tmp_path):
  model = _nnx_mlp()
  exact = _exact(model, X8)
  path = tmp_path / "ref.npz"
  jaxprec.save_layers(path, {"layers": [exact["layers.0"]]})  # 'layers[0]'
  r = jaxprec.check_module(model, X8, reference=path, precisions=["bfloat16"],
                           mode="emulate")
  assert [l.name for l in r.layers] == ["layers/0"]
  assert len(r.unchecked) == 5 and r.reference == f"file:{path}"


def test_check_module_refuses_a_reference_layer_it_does_not_have():
  model = _nnx_mlp()
  exact = _exact(model, X8)
  bad = {"layers.0.fcc": exact["layers.0.fc"]}
  with pytest.raises(ValueError, match=r"Unknown reference layer "
                     r"'layers.0.fcc'; valid choices: 'layers/0/fc', "
                     r".*Did you mean 'layers/0/fc'\?"):
    jaxprec.check_module(model, X8, reference=bad, mode="emulate")
  with pytest.raises(ValueError, match=r"reference does not match the "
                     r"output: first mismatch at 'layers/0/fc'.*\(4, 8\).*"
                     r"\(4, 3\)"):
    jaxprec.check_module(model, X8, reference={"layers.0.fc": np.zeros((4, 3))},
                         mode="emulate")


def test_check_module_partial_reference_on_linen():
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jnp.tanh(nn.Dense(8, name="fc")(x))
      return nn.Dense(4, name="head")(h)

  params = Net().init(jax.random.key(0), X8)
  k = np.asarray(params["params"]["fc"]["kernel"], np.float64)
  b = np.asarray(params["params"]["fc"]["bias"], np.float64)
  ref = {"fc": X8.astype(np.float64) @ k + b}
  r = jaxprec.check_module(Net(), params, X8, reference=ref,
                           precisions=["float32", "bfloat16"], mode="emulate")
  assert [l.name for l in r.layers] == ["fc"]
  assert r.unchecked == ("head", "output")
  assert r.layers[0].metrics["float32"].rel_rms < 1e-6
  assert r.layers[0].metrics["bfloat16"].rel_rms > 1e-4


def test_check_of_a_function_still_wants_every_layer():
  with pytest.raises(ValueError, match="first mismatch at 'b'"):
    jaxprec.check(lambda x: {"a": x * 2, "b": x * 3}, X8,
                  reference={"a": X8 * 2.0}, mode="emulate")


# -- save_layers refuses what a check would refuse -------------------------------


@pytest.mark.parametrize("tree", [
    {"a.0": np.ones(2), "a/0": np.ones(2)},
    {"a": [np.ones(2)], "a.0": np.ones(2)},
])
def test_save_layers_refuses_names_a_check_reads_as_one(tmp_path, tree):
  path = tmp_path / "ref.npz"
  with pytest.raises(ValueError, match=r"would be read back as one layer.*"
                     r"Nothing was written"):
    jaxprec.save_layers(path, tree)
  assert not path.exists()


def test_save_layers_refuses_a_tree_without_floating_arrays(tmp_path):
  with pytest.raises(ValueError, match="holds no floating arrays"):
    jaxprec.save_layers(tmp_path / "ref.npz", {"ids": np.ones(2, int)})
  assert not (tmp_path / "ref.npz").exists()


# -- An empty floating layer compares nothing, and is said to ---------------------


def _with_empty(x):
  """'empty' has no elements (0 rows): 'a' and 'b' are the layers compared."""
  h = x @ x
  return {"a": h, "empty": x[:0] @ x, "b": jnp.tanh(h) @ x}


def _assert_no_errors(m):
  """The figures of an empty layer: no error, no NaN (nothing to compare)."""
  assert (m.size, m.max_abs, m.max_rel, m.rel_rms, m.frac_outside) == (
      0, 0.0, 0.0, 0.0, 0.0)
  assert (m.cosine, m.sqnr_db, m.ulp_median, m.ulp_max) == (
      1.0, math.inf, 0.0, 0.0)
  assert (m.nan, m.inf, m.required_atol) == (0, 0, 0.0)
  assert (m.ref_rms, m.ref_max_abs, m.ref_nan, m.ref_inf) == (0.0, 0.0, 0, 0)


def _assert_empty_said(r, shape="(0, 8)"):
  """``r`` names 'empty' in a note (text, Markdown, JSON), never as the worst
  or first divergence, and marks its row."""
  p = r.candidates[0]
  _assert_no_errors(r.layer("empty").metrics[p])
  worst = r.worst(5)
  assert [f.layer for f in worst] and "empty" not in [f.layer for f in worst]
  # The worst is the largest rel_rms among the layers compared.
  rel = {l.name: l.metrics[p].rel_rms for l in r.layers if l.name != "empty"}
  assert worst[0].layer == max(rel, key=rel.get)
  for q, s in r.summary().items():
    assert s["worst_layer"] != "empty" and math.isfinite(s["worst_rel_rms"])
  first = r.first_divergence(0.0, 0.0, precision=p)
  assert first is not None and first.layer != "empty"
  assert r.required_atol(p) == max(l.metrics[p].required_atol
                                   for l in r.layers)
  note = [n for n in r.notes if "'empty'" in n]
  assert len(note) == 1, r.notes
  assert f"'empty' {shape}" in note[0] and "no elements" in note[0]
  assert "compared nothing" in note[0]
  assert not any("all zeros" in n and "'empty'" in n for n in r.notes)
  text, md, d = str(r), r.to_markdown(), r.to_dict()
  assert f"note: {note[0]}" in text
  assert note[0].replace("|", "\\|") in md
  assert note[0] in d["notes"]
  row = next(line for line in text.splitlines() if " empty " in line)
  assert "empty" in row.split("empty", 1)[1], row  # the verdict cell
  assert "exact" not in row and "in rtol" not in row, row
  full = next(line for line in r.to_text(full=True).splitlines()
              if " empty " in line)
  assert full.split()[-3:] == ["-", "-", "empty"], full
  back = jaxprec.DivergenceReport.from_dict(json.loads(r.to_json()))
  assert back.worst(5) == worst and back.notes == r.notes


@pytest.mark.parametrize("precision", ["bfloat16", "bfloat16_3x", "float32",
                                       "tensorfloat32", "F16_F16_F32"])
def test_an_empty_layer_is_no_candidate_at_every_precision(precision):
  x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)  # NumPy input
  r = jaxprec.check(_with_empty, x, precisions=[precision], mode="emulate")
  _assert_empty_said(r)


def test_an_empty_layer_against_float64_and_jax_inputs():
  x = jnp.linspace(-1, 1, 64, dtype=jnp.float32).reshape(8, 8)
  r = jaxprec.check(_with_empty, x, precisions=["bfloat16"],
                    reference="float64", mode="emulate")
  _assert_empty_said(r)


def test_an_empty_layer_in_an_external_reference_file(tmp_path):
  x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
  x64 = x.astype(np.float64)
  h = x64 @ x64
  path = tmp_path / "ref.npz"
  np.savez(path, a=h, empty=np.zeros((0, 8)), b=np.tanh(h) @ x64)
  r = jaxprec.check(_with_empty, x, precisions=["float32", "bfloat16"],
                    reference=path, mode="emulate")
  assert r.floor == "float32"
  _assert_empty_said(r)
  _assert_no_errors(r.layer("empty").metrics[r.floor])


def test_every_layer_empty_is_refused_by_name():
  x = np.ones((4, 8), np.float32)
  with pytest.raises(ValueError, match=re.escape(
      "f(...) returned only empty floating arrays, nothing to compare: "
      "'e' (0, 8), 'f' (8, 0)")):
    def f(x):
      return {"e": x[:0] @ x.T @ x, "f": x.T[:, :0]}
    jaxprec.check(f, x, precisions=["bfloat16"], mode="emulate")


def test_an_empty_layer_of_an_older_report_is_no_candidate():
  # A report written with NaN figures for an empty layer reads back with
  # that layer out of worst() and first_divergence().
  x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
  d = jaxprec.check(_with_empty, x, precisions=["bfloat16"],
                    mode="emulate").to_dict()
  d["notes"] = []
  d["layers"][1]["metrics"]["bfloat16"] = {
      k: ("nan" if k not in ("frac_outside", "nan", "inf", "required_atol")
          else 0) for k in d["layers"][1]["metrics"]["bfloat16"]}
  r = jaxprec.DivergenceReport.from_dict(d)
  assert math.isnan(r.layer("empty").metrics["bfloat16"].rel_rms)
  assert "empty" not in [f.layer for f in r.worst(5)]
  assert r.first_divergence(10.0, 0.0, precision="bfloat16") is None
  rel = {n: r.layer(n).metrics["bfloat16"].rel_rms for n in ("a", "b")}
  assert r.summary()["bfloat16"]["worst_layer"] == max(rel, key=rel.get)


def test_compare_of_empty_arrays_has_no_errors():
  _assert_no_errors(metrics_lib.compare(np.zeros((0, 3), np.float32),
                                        np.zeros((0, 3))))


@pytest.mark.parametrize("shadow", [False, True])
def test_check_module_names_an_empty_submodule_output(shadow):
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(8, 8, rngs=rngs)
      self.empty = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
      h = self.fc(x)
      return h + self.empty(h[:0]).sum()

  r = jaxprec.check_module(Net(nnx.Rngs(0)), X8, precisions=["bfloat16"],
                           mode="emulate", shadow=shadow)
  assert [l.name for l in r.layers] == ["fc", "empty", "output"]
  _assert_empty_said(r)


@pytest.mark.parametrize("shadow", [False, True])
def test_check_module_refuses_a_module_whose_every_output_is_empty(shadow):
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
      return self.fc(x[:0])

  # with shadow or without: nothing to compare is an error, not a pass
  with pytest.raises(ValueError, match=re.escape(
      "Net.__call__(...) returned only empty floating arrays, nothing to "
      "compare: 'fc' (0, 8), 'output' (0, 8)")):
    jaxprec.check_module(Net(nnx.Rngs(0)), X8, precisions=["bfloat16"],
                         mode="emulate", shadow=shadow)


def test_check_module_names_an_empty_submodule_output_on_linen():
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(8, name="fc")(x)
      return h + nn.Dense(8, name="empty")(h[:0]).sum()

  params = Net().init(jax.random.key(0), X8)
  r = jaxprec.check_module(Net(), params, X8, precisions=["bfloat16"],
                           mode="emulate")
  assert [l.name for l in r.layers] == ["fc", "empty", "output"]
  _assert_empty_said(r)


@pytest.mark.parametrize("metric", ["rel_rms", "max_abs", "cosine"])
def test_an_empty_layer_is_not_drawn(metric):
  pytest.importorskip("matplotlib")
  x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
  r = jaxprec.check(_with_empty, x, precisions=["bfloat16"], mode="emulate")
  ax, = r.plot(metric=metric).axes
  lines = {l.get_label(): l for l in ax.get_lines()}
  assert "_exact" not in lines  # no 'exact (0)' marker for 'empty' (#1)
  ys = lines[next(k for k in lines if k.startswith("bfloat16"))].get_ydata()
  assert math.isnan(ys[1]) and np.isfinite(ys[[0, 2]]).all()


def test_search_policy_refuses_every_layer_empty():
  w = jax.random.normal(jax.random.key(0), (8, 8))
  x = jax.random.normal(jax.random.key(1), (4, 8))

  def f(w, x):
    return {"z": jnp.tanh(x @ w)[:0]}

  with pytest.raises(ValueError, match=re.escape(
      "f(...) returned only empty floating arrays, nothing to compare: "
      "'z' (0, 8)")):
    jaxprec.search_policy(f, w, x, tolerance=1e-2, verbose=False)

  def g(w, x):
    return {"y": jnp.tanh(x @ w), "z": jnp.tanh(x @ w)[:0]}

  with pytest.raises(ValueError, match=re.escape(
      "jaxprec.search_policy: layers=['z'] names only empty layers, nothing "
      "to compare; name one with elements")):
    jaxprec.search_policy(g, w, x, tolerance=1e-2, layers=["z"],
                          verbose=False)
