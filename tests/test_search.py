"""Tests for jaxprec.search_policy: the cheapest per-layer policy within a tolerance.

The main model is a 6-layer MLP whose layer ``dense_3`` is ill-conditioned on
purpose: its input carries a large common offset that the next step removes
(``y - mean(y)`` over the batch), so rounding that layer's operands to
bfloat16 destroys the signal (the offset's bfloat16 spacing is larger than
the signal), three bfloat16 passes keep it at offset 100 and lose it at
offset 1e4, and six passes (``float32``) keep it at both. Every other layer
is well conditioned and fine in bfloat16 at a 2% tolerance.
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
from jaxprec._src.checker import metrics as metrics_lib

from conftest import assert_same_figures

TOL = 2e-2


class OffsetMLP(nn.Module):
  offset: float = 100.0
  bad: int = 3
  layers: int = 6

  @nn.compact
  def __call__(self, x):
    out = {}
    h = x
    for i in range(self.layers):
      if i == self.bad and self.offset:
        y = nn.Dense(32, name=f"dense_{i}")(h + self.offset)
        y = y - y.mean(axis=0, keepdims=True)
      else:
        y = nn.Dense(32, name=f"dense_{i}")(h)
      h = jnp.tanh(y)
      out[f"layer_{i}"] = h
    return out


def make(offset):
  model = OffsetMLP(offset=offset)
  x = jax.random.normal(jax.random.key(1), (16, 32))
  return model, model.apply, (model.init(jax.random.key(0), x), x)


MODELS = {offset: make(offset) for offset in (0.0, 100.0, 1e4)}


def search(offset, **kw):
  _, fn, args = MODELS[offset]
  kw.setdefault("tolerance", TOL)
  kw.setdefault("verbose", False)
  return jaxprec.search_policy(fn, *args, **kw)


@pytest.fixture(scope="module")
def bad100():
  return search(100.0)


@pytest.fixture(scope="module")
def bad1e4():
  return search(1e4)


def recheck(offset, policy_text, **emulate_kw):
  """Each layer's rel_rms under the policy, computed independently of the search."""
  _, fn, args = MODELS[offset]
  policy = jaxprec.Policy.parse(policy_text)
  with jax.default_matmul_precision("float32"):
    ref = jax.jit(fn)(*args)
  got = jax.jit(jaxprec.emulate(fn, policy, **emulate_kw))(*args)
  return {k: metrics_lib.compare(got[k], np.asarray(ref[k])).rel_rms for k in ref}


def levels(result):
  return result.precision_by_path()


# -- finding the ill-conditioned layer -----------------------------------------


@pytest.mark.parametrize("offset,needs", [(100.0, "bfloat16_3x"), (1e4, "float32")])
def test_finds_the_ill_conditioned_layer(offset, needs, bad100, bad1e4):
  r = {100.0: bad100, 1e4: bad1e4}[offset]
  assert r.meets_tolerance
  assert str(r.policy) == f"default=bfloat16,dense_3={needs}"
  assert levels(r) == {f"dense_{i}": "bfloat16" if i != 3 else needs
                       for i in range(6)}
  # Every layer meets the tolerance when re-checked from the policy's text.
  values = recheck(offset, str(r.policy))
  assert max(values.values()) <= TOL
  assert values == pytest.approx(dict(r.values), rel=1e-5)
  # ... and the search measured that the layer needs it: one step lower fails.
  lower = str(r.policy).replace(needs, {"bfloat16_3x": "bfloat16",
                                        "float32": "bfloat16_3x"}[needs])
  assert max(recheck(offset, lower).values()) > TOL
  # Cheaper than float32 everywhere, by the cost model's numbers.
  passes = {"bfloat16_3x": 3, "float32": 6}[needs]
  assert r.cost.relative == pytest.approx((5 + passes) / 36)
  assert r.cost.relative < 1


def test_evaluations_stay_near_logarithmic(bad100, bad1e4):
  # 6 paths; all-bf16, uniform levels, log2(6) bisection steps, a choice,
  # a last try and a re-check at most.
  assert bad100.evaluations <= 8 and bad1e4.evaluations <= 9
  assert len(bad100.history) == bad100.evaluations
  assert [s.index for s in bad100.history] == list(range(1, bad100.evaluations + 1))


def test_sixteen_layers_one_bad_logarithmic():
  model = OffsetMLP(offset=100.0, bad=11, layers=16)
  x = jax.random.normal(jax.random.key(1), (16, 32))
  r = jaxprec.search_policy(model.apply, model.init(jax.random.key(0), x), x,
                            tolerance=TOL, verbose=False)
  assert str(r.policy) == "default=bfloat16,dense_11=bfloat16_3x"
  assert r.evaluations <= 4 + 5  # log2(16) + 5


def test_result_report_cost_and_history(bad100):
  r = bad100
  assert r.report is not None and r.report.precisions == ("policy",)
  assert [l.name for l in r.report.layers] == [f"layer_{i}" for i in range(6)]
  assert r.report.metric("rel_rms", "policy") == pytest.approx(
      [r.values[f"layer_{i}"] for i in range(6)])
  assert r.units == tuple(f"dense_{i}" for i in range(6))
  # The last evaluation is of the returned policy, and the search's cost
  # prediction is the cost model's.
  last = r.history[-1]
  assert last.policy == r.policy and last.passed
  assert last.relative_cost == pytest.approx(r.cost.relative)
  assert r.history[0].phase == "all bfloat16" and not r.history[0].passed
  for step in r.history:
    assert jaxprec.Policy.parse(str(step.policy)) == step.policy
    assert sum(step.counts.values()) == 6
  d = r.to_dict()
  assert d["policy"] == str(r.policy) and d["evaluations"] == r.evaluations
  assert r.to_json()  # strict JSON
  text = str(r)
  assert f"policy: {r.policy}" in text
  assert f"evaluations: {r.evaluations} " in text
  assert re.search(r"cost: 0\.\d{3} of float32", text)


def test_jitted_function(bad100):
  # jax.jit keeps one trace per signature, whatever the policy: the search
  # looks through it, so each policy is traced anew.
  _, fn, args = MODELS[100.0]
  r = jaxprec.search_policy(jax.jit(fn), *args, tolerance=TOL, verbose=False)
  assert r.policy == bad100.policy
  assert [s.passed for s in r.history] == [s.passed for s in bad100.history]


def test_policy_works_through_swap(bad100):
  model, fn, args = MODELS[100.0]
  swapped = jaxprec.swap(model, str(bad100.policy), emulate=True)
  got = jax.jit(swapped.apply)(*args)
  want = jax.jit(jaxprec.emulate(fn, bad100.policy))(*args)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])


def test_ops_outside_modules_are_path_top():
  # An ill-conditioned matmul outside any module: its unit is path ''.
  _, fn, args = MODELS[0.0]
  w = jax.random.normal(jax.random.key(3), (32, 32)) / 6

  def f(v, x, w):
    out = dict(fn(v, x))
    y = (out["layer_5"] + 100.0) @ w
    out["raw"] = jnp.tanh(y - y.mean(axis=0, keepdims=True))
    return out
  r = jaxprec.search_policy(f, *args, w, tolerance=TOL, verbose=False)
  assert r.units[-1] == ""
  assert str(r.policy) == "default=bfloat16,path:=bfloat16_3x"
  assert jaxprec.Policy.parse(str(r.policy)) == r.policy
  assert r.cost.row("").algorithms == ("bf16x3",)


def test_all_cheapest_after_exactly_one_evaluation():
  r = search(0.0)
  assert str(r.policy) == "default=bfloat16"
  assert r.evaluations == 1 and len(r.history) == 1
  assert r.meets_tolerance and r.cost.relative == pytest.approx(1 / 6)


def test_checked_layers_only():
  # dense_3 does not reach layers 0-2: all-bfloat16 passes on them.
  r = search(100.0, layers=["layer_0", "layer_1", "layer_2"])
  assert str(r.policy) == "default=bfloat16" and r.evaluations == 1
  assert list(r.values) == ["layer_0", "layer_1", "layer_2"]


# -- budget ---------------------------------------------------------------------


def test_budget_respected_returns_best_found_with_warning():
  with pytest.warns(UserWarning, match="budget of 3 evaluations ran out"):
    r = search(100.0, budget=3)
  assert r.evaluations <= 3
  assert r.meets_tolerance  # all-bfloat16_3x, found at evaluation 2
  assert max(recheck(100.0, str(r.policy)).values()) <= TOL
  assert r.cost.relative <= 0.5


def test_budget_of_one_returns_float32_unverified():
  with pytest.warns(UserWarning, match="budget of 1 evaluations ran out"):
    r = search(1e4, budget=1)
  assert r.evaluations == 1
  assert str(r.policy) == "default=float32"
  assert not r.meets_tolerance and r.report is None
  assert r.cost.relative == 1.0


def test_no_candidate_meets_the_tolerance():
  with pytest.warns(UserWarning, match="no policy of the candidates met"):
    r = search(1e4, candidates=("bfloat16", "bfloat16_3x"))
  # The fallback, all-float32, is measured (and passes here).
  assert str(r.policy) == "default=float32" and r.report is not None
  assert r.meets_tolerance and max(r.values.values()) <= TOL
  assert r.history[-1].phase == "all float32"


def test_even_float32_outside_the_tolerance():
  with pytest.warns(UserWarning, match="no policy of the candidates met"):
    r = search(1e4, tolerance=1e-6, candidates=("bfloat16", "float32"))
  assert str(r.policy) == "default=float32"
  assert not r.meets_tolerance and max(r.values.values()) > 1e-6


# -- metrics, references, targets ------------------------------------------------


def small():
  w = jax.random.normal(jax.random.key(0), (32, 32)) / 6
  x = jax.random.normal(jax.random.key(1), (8, 32))

  def f(w, x):
    h = jnp.tanh(x @ w)
    return {"h": h, "out": h @ w}
  return f, w, x


@pytest.mark.parametrize("metric,tolerance", [
    ("rel_rms", 1e-4), ("max_abs", 1e-4), ("cosine", 1e-9), ("sqnr_db", 80.0),
    ("ulp_median", 1000.0), ("max_rel", 0.05), ("ulp_max", 1e6),
])
def test_metrics(metric, tolerance):
  # One bfloat16 pass is outside these tolerances, three passes within.
  f, w, x = small()
  r = jaxprec.search_policy(f, w, x, tolerance=tolerance, metric=metric,
                            verbose=False)
  assert r.meets_tolerance and str(r.policy) == "default=bfloat16_3x"
  assert [s.passed for s in r.history] == [False, True]
  first = r.history[0].worst_value
  if metric == "sqnr_db":
    assert min(r.values.values()) >= tolerance > first
  elif metric == "cosine":
    # The cosine itself, as check reports it; the tolerance bounds 1 - cosine.
    assert 1 - min(r.values.values()) <= tolerance < 1 - first
    assert all(0.99 < v <= 1 for v in r.values.values())
    report = jaxprec.check(f, w, x, precisions=[str(r.policy)],
                           mode="emulate")
    for layer in report.layers:
      assert r.values[layer.name] == layer.metrics[str(r.policy)].cosine
    assert f"(cosine {min(r.values.values()):.9f})" in str(r)
  else:
    assert max(r.values.values()) <= tolerance < first


def test_reference_pytree_and_gpu_target():
  f, w, x = small()
  with jax.default_matmul_precision("float32"):
    ref = jax.jit(f)(w, x)
  a = jaxprec.search_policy(f, w, x, tolerance=1e-4, verbose=False)
  b = jaxprec.search_policy(f, w, x, tolerance=1e-4, reference=ref,
                            verbose=False)
  assert a.policy == b.policy and a.values == b.values
  g = jaxprec.search_policy(f, w, x, tolerance=1e-4, target="gpu",
                            verbose=False)
  assert g.candidates == ("tensorfloat32", "TF32_TF32_F32_X3", "float32")
  assert str(g.policy) == "default=TF32_TF32_F32_X3"
  assert g.cost.relative == pytest.approx(3 / 8)


def test_progress_lines_on_stderr(capsys):
  f, w, x = small()
  jaxprec.search_policy(f, w, x, tolerance=1e-4)
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 2
  assert err[0].startswith("jaxprec search [1/24] all bfloat16 ")
  assert "FAIL" in err[0] and "pass" in err[1]
  jaxprec.search_policy(f, w, x, tolerance=1e-4, verbose=False)
  assert capsys.readouterr().err == ""


def test_native_mode_on_cpu_warns():
  f, w, x = small()
  with pytest.warns(UserWarning, match="native mode on cpu"):
    r = jaxprec.search_policy(f, w, x, tolerance=1e-6, mode="native",
                              verbose=False)
  assert r.mode == "native" and str(r.policy) == "default=bfloat16"


def test_builtin_wav2vec2_tiny():
  import jaxprec.models
  fn, args = jaxprec.models.wav2vec2("tiny")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no UnusedRuleWarning on a built-in model
    r = jaxprec.search_policy(fn, *args, tolerance=0.05, verbose=False)
  assert str(r.policy) == "default=bfloat16" and r.evaluations == 1
  assert len(r.units) == 23 and r.units[0] == "conv_layers_0/conv"
  # check re-checks the searched policy and reproduces the search's figures.
  c = jaxprec.check(fn, *args, precisions=[r.policy])
  assert_same_figures(c, r)


def test_check_rechecks_a_mixed_searched_policy(bad100):
  _, fn, args = MODELS[100.0]
  assert len(set(levels(bad100).values())) == 2  # a mixed policy
  c = jaxprec.check(fn, *args, precisions=[bad100.policy])
  assert_same_figures(c, bad100)
  # And as the user would paste it: the policy string.
  c2 = jaxprec.check(fn, *args, precisions=str(bad100.policy))
  assert c2.metric("rel_rms", str(bad100.policy)) == c.metric(
      "rel_rms", str(bad100.policy))


def test_search_reads_every_reference_check_reads(tmp_path, bad100):
  _, fn, args = MODELS[100.0]
  with jax.default_matmul_precision("float32"):
    ref = jax.jit(fn)(*args)
  # A file (suffix in upper case), with float64 values and names as
  # another framework writes them ('/'-separated, matched as check matches).
  path = tmp_path / "torch.NPZ"
  with open(path, "wb") as f:
    np.savez(f, **{f"/{k}": np.asarray(v, np.float64) for k, v in ref.items()})
  r = search(100.0, reference=path)
  assert str(r.policy) == str(bad100.policy)
  assert r.report.reference == f"file:{path}"
  np.testing.assert_allclose(list(r.values.values()),
                             list(bad100.values.values()), rtol=1e-5)
  # float64, computed.
  r64 = search(100.0, reference="float64", layers=["layer_5"])
  assert list(r64.values) == ["layer_5"]
  np.testing.assert_allclose(r64.values["layer_5"], bad100.values["layer_5"],
                             rtol=1e-2)
  with pytest.raises(ValueError, match=r"Cannot read the reference file"):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    search(100.0, reference=bad)


def test_numpy_float64_arguments_with_x64_off():
  _, fn, (params, x) = MODELS[100.0]
  params64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  r = search(100.0)
  r64 = jaxprec.search_policy(fn, params64, np.asarray(x, np.float64),
                              tolerance=TOL, verbose=False)
  assert str(r64.policy) == str(r.policy)
  assert r64.values == r.values


def test_search_keeps_no_argument_alive():
  import gc
  import weakref
  _, fn, (params, x) = MODELS[0.0]
  x = jnp.asarray(np.asarray(x)) + 0
  ref = weakref.ref(x)
  jaxprec.search_policy(fn, params, x, tolerance=TOL, verbose=False)
  del x
  gc.collect()
  assert ref() is None


def test_builtin_bert_tiny_cheaper_than_uniform():
  import jaxprec.models
  fn, args = jaxprec.models.bert("tiny")
  with pytest.warns(UserWarning, match="budget of 5 evaluations ran out"):
    r = jaxprec.search_policy(fn, *args, tolerance=3e-3, budget=5,
                              verbose=False)
  assert r.meets_tolerance and r.evaluations <= 5
  by_path = levels(r)
  assert set(by_path.values()) == {"bfloat16", "bfloat16_3x"}
  # Cheaper than float32, and than the cheapest uniform policy that passes.
  assert r.cost.relative < 0.5
  values = {}
  with jax.default_matmul_precision("float32"):
    ref = jax.jit(fn)(*args)
  got = jax.jit(jaxprec.emulate(fn, jaxprec.Policy.parse(str(r.policy))))(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    values[len(values)] = metrics_lib.compare(a, np.asarray(b)).rel_rms
  assert max(values.values()) <= 3e-3


# -- bad input --------------------------------------------------------------------


@pytest.mark.parametrize("kw,error,match", [
    ({"metric": "rms"}, ValueError,
     r"Unknown metric 'rms'; valid choices: 'rel_rms', .*Did you mean 'rel_rms'"),
    ({"candidates": ("bfloat16", "bf17")}, ValueError,
     r"Unknown candidate 'bf17': unknown name\. Did you mean"),
    ({"candidates": ()}, ValueError, "candidates is empty"),
    ({"candidates": ("bfloat16", "BF16_BF16_F32_X9")}, ValueError,
     r"costs 9 per FLOP, more than float32 \(6\)"),
    ({"candidates": ("bfloat16", "tensorfloat32"), "target": "gpu"}, ValueError,
     "'bfloat16' and 'tensorfloat32' both run tf32 on gpu"),
    ({"candidates": ("TF32_TF32_F32",)}, ValueError,
     r"Candidate 'TF32_TF32_F32': TF32_TF32_F32 .* does not run on a TPU"),
    ({"candidates": (None,)}, ValueError, "backend default"),
    ({"tolerance": -1e-3}, ValueError, r"tolerance must be a finite number >= 0"),
    ({"tolerance": float("nan")}, ValueError, "tolerance must be"),
    ({"tolerance": "1e-3"}, TypeError, "tolerance must be a number"),
    ({"target": "cpu"}, ValueError,
     r"Unknown target 'cpu'; valid choices: 'tpu', 'gpu'"),
    ({"mode": "fast"}, ValueError, "Unknown mode 'fast'"),
    ({"budget": 0}, ValueError, "budget must be >= 1"),
    ({"budget": 2.5}, TypeError, "budget must be an int"),
    ({"layers": ["layer_9"]}, ValueError, r"Unknown layer 'layer_9'.*Did you mean"),
])
def test_bad_input(kw, error, match):
  _, fn, args = MODELS[0.0]
  kw = {"tolerance": TOL, **kw}
  with pytest.raises(error, match=match):
    jaxprec.search_policy(fn, *args, verbose=False, **kw)


def test_not_callable():
  with pytest.raises(TypeError, match="expects a callable; got 3"):
    jaxprec.search_policy(3, tolerance=1e-3)


def test_shape_dtype_struct_arguments_are_rejected():
  f, w, _ = small()
  with pytest.raises(TypeError, match="pass arrays, not jax.ShapeDtypeStruct"):
    jaxprec.search_policy(f, w, jax.ShapeDtypeStruct((8, 32), jnp.float32),
                          tolerance=1e-3, verbose=False)


def test_no_warning_when_search_completes(bad100):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    search(0.0)
