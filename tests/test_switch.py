"""The search's switched program: one compiled program for every policy.

:func:`jaxprec._src.search.switch.switched` emulates each unit's matmuls as a
``lax.switch`` among the candidates, indexed at run time. Its emulated ops
must be bit for bit those of the fixed-policy program
(``jax.jit(jaxprec.emulate(fn, policy))``); the search must compile it once,
return the same answers as the per-policy search, and measure the returned
policy's report with the policy's own program.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxprec
import jaxprec.models
import switching
from jaxprec._src.core.precision import resolve
from jaxprec._src.inspect import cost as cost_lib
from jaxprec._src.search import search as search_lib
from jaxprec._src.search import switch

CHOICES = {
    "tpu": ("bfloat16", "bfloat16_3x", "float32", "BF16_BF16_F32_X9"),
    "gpu": ("tensorfloat32", "TF32_TF32_F32_X3", "float32"),
}


def _special_operands(k):
  """(12, k) x (k, 12) float32 operands with NaN, inf, subnormals, ties to even,
  the bfloat16 maximum and values that are not bfloat16 or TF32 values."""
  rng = np.random.default_rng(k)
  x = rng.standard_normal((12, k)).astype(np.float32) * np.float32(3.7)
  w = rng.standard_normal((k, 12)).astype(np.float32)
  bf16_max = np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  special = np.array([np.nan, np.inf, -np.inf, 1e-40, -3e-39, 1 + 2.0**-8,
                      1 + 3 * 2.0**-8, bf16_max, 3e38, 1e-30, 1 + 2.0**-20,
                      -0.0], np.float32)
  x.reshape(-1)[:special.size] = special
  w.reshape(-1)[-special.size:] = special[::-1]
  return x, w


@pytest.mark.parametrize("kernel", ["bf16", "f32"])
@pytest.mark.parametrize("target", ["tpu", "gpu"])
@pytest.mark.parametrize("k", [1, 24])
def test_each_emulated_dot_is_bit_for_bit_the_fixed_programs(target, kernel, k):
  x, w = _special_operands(k)

  def f(x, w):
    return {"y": jnp.tanh(x @ w) + (x @ w) * 0.5}

  names = CHOICES[target]
  with jaxprec.use_kernel(kernel):
    g = jax.jit(switch.switched(f, [""], [resolve(n) for n in names],
                                target=target))
    for i, name in enumerate(names):
      fixed = jax.jit(jaxprec.emulate(f, jaxprec.Policy(default=name),
                                      target=target))(x, w)
      got = g(switch.index_of([i]), x, w)
      assert switching.same(got["y"], fixed["y"]), (target, kernel, k, name)


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_each_emulated_conv_is_bit_for_bit_the_fixed_programs(target):
  rng = np.random.default_rng(3)
  x = rng.standard_normal((2, 20, 8)).astype(np.float32) * np.float32(1e3)
  x[0, 0, :3] = (np.inf, 1e-40, 1 + 2.0**-9)
  w = rng.standard_normal((3, 8, 8)).astype(np.float32)
  b = rng.standard_normal((8,)).astype(np.float32)

  def f(x, w, b):
    y = jax.lax.conv_general_dilated(x, w, (2,), "VALID",
                                     dimension_numbers=("NWC", "WIO", "NWC"))
    y = y + b  # a bias and a layer norm after it, as in Wav2Vec2's conv stack
    y = y - y.mean(-1, keepdims=True)
    return y * jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + 1e-5)

  names = CHOICES[target]
  g = jax.jit(switch.switched(f, [""], [resolve(n) for n in names],
                              target=target))
  for i, name in enumerate(names):
    fixed = jax.jit(jaxprec.emulate(f, jaxprec.Policy(default=name),
                                    target=target))
    # The conv alone: what the switch changes is bit for bit the same.
    conv_only = jax.jit(jaxprec.emulate(
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (2,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")),
        jaxprec.Policy(default=name), target=target))
    got_conv = jax.jit(switch.switched(
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (2,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")),
        [""], [resolve(n) for n in names], target=target))(
            switch.index_of([i]), x, w)
    assert switching.same(got_conv, conv_only(x, w)), (target, name)
    # With a layer norm reading it: XLA would fuse the norm's sums into the
    # fixed program's last addition and round them in another order, were
    # that addition not computed where nothing is fused in (passes._last).
    assert switching.same(g(switch.index_of([i]), x, w, b), fixed(x, w, b)), name


# ``count`` random policies after the uniform ones: the first draw (seed 0)
# mixes all three candidates over BERT's 14 units, as wav2vec2's (seed 1)
# over its 23; each policy is one more compiled model.
@pytest.mark.parametrize("target,count", [("tpu", 1), ("gpu", 1)])
def test_bert_switched_program_is_the_fixed_policy_program_bit_for_bit(
    target, count):
  fn, args = jaxprec.models.bert("tiny")
  units = switching.assert_switched_is_fixed(
      cost_lib.unjit(fn), args, count, target=target, uniform=target == "tpu")
  assert len(units) > 8


def test_wav2vec2_switched_program_is_the_fixed_policy_program_bit_for_bit():
  """Its conv stack's layer norms read emulated convolutions (passes._last)."""
  fn, args = jaxprec.models.wav2vec2("tiny")
  switching.assert_switched_is_fixed(cost_lib.unjit(fn), args, 1, seed=1,
                                     uniform=False)


# ---------------------------------------------------------------------------
# The search.


class OffsetMLP(nn.Module):
  """``dense_3`` reads its input plus a common offset of 100 that the next
  step removes: one bfloat16 pass loses the signal, three keep it (as in
  tests/test_search.py); the other layers are fine in bfloat16."""

  @nn.compact
  def __call__(self, x):
    out = {}
    h = x
    for i in range(6):
      y = nn.Dense(32, name=f"dense_{i}")(h + (100.0 if i == 3 else 0.0))
      if i == 3:
        y = y - y.mean(axis=0, keepdims=True)
      h = jnp.tanh(y)
      out[f"layer_{i}"] = h
    return out


TRACES = []


def _model():
  model = OffsetMLP()
  x = jax.random.normal(jax.random.key(1), (16, 32))
  params = model.init(jax.random.key(0), x)

  def fn(params, x):
    TRACES.append(1)
    return model.apply(params, x)
  return fn, (params, x)


def _search(compile_once, **kw):
  fn, args = _model()
  TRACES.clear()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    r = jaxprec.search_policy(fn, *args, tolerance=kw.pop("tolerance", 2e-2),
                              verbose=False, compile_once=compile_once, **kw)
  return r, len(TRACES)


@pytest.fixture(scope="module")
def both():
  return _search(True), _search(False)


def test_search_compiles_one_program_for_every_policy_after_the_first(both):
  (once, traces_once), (per_policy, traces_per_policy) = both
  assert once.evaluations >= 5
  programs = [s.program for s in once.history]
  assert programs[0] == "fixed" and set(programs[1:]) == {"switched"}
  assert {s.program for s in per_policy.history} == {"fixed"}
  # fn is traced once per program it is compiled into (and by the audits
  # and the reference, alike in both): per policy once per evaluation; with
  # the switch for the first evaluation, the switched program and the
  # returned policy's own program, however many evaluations there are.
  overhead = traces_per_policy - per_policy.evaluations
  assert overhead >= 1
  assert traces_once <= overhead + 3 < traces_per_policy
  assert once.history[-1].to_dict()["program"] == "switched"


def test_switched_search_gives_the_per_policy_search_answers(both):
  (once, _), (per_policy, _) = both
  assert str(once.policy) == str(per_policy.policy)
  assert "dense_3" in str(once.policy)
  assert [str(s.policy) for s in once.history] == [
      str(s.policy) for s in per_policy.history]
  assert [s.worst_value for s in once.history] == [
      s.worst_value for s in per_policy.history]
  assert once.values == per_policy.values


def test_returned_report_is_measured_by_the_policys_own_program(both):
  (once, _), _ = both
  fn, args = _model()
  report = jaxprec.check(fn, *args, precisions=[once.policy])
  label = str(once.policy)
  for layer in report.layers:
    assert once.values[layer.name] == layer.metrics[label].rel_rms


def test_a_unit_the_switched_trace_cannot_find_falls_back_and_says_so(
    monkeypatch):
  fn, args = _model()
  monkeypatch.setattr(switch, "unit_eqns", lambda closed, found, position: {})
  with pytest.warns(UserWarning, match="compiles a program of its own"):
    r = jaxprec.search_policy(fn, *args, tolerance=2e-2, verbose=False)
  assert {s.program for s in r.history} == {"fixed"}
  assert "dense_3" in str(r.policy) and r.meets_tolerance


def test_dtype_axis_and_native_runs_compile_per_policy():
  fn, args = _model()
  with pytest.warns(UserWarning, match="no policy of the candidates"):
    r = jaxprec.search_policy(fn, *args, tolerance=2e-2, verbose=False,
                              axes=("dtype",))
  assert len(r.history) >= 2
  assert {s.program for s in r.history} == {"fixed"}
  with pytest.warns(UserWarning, match="native mode on cpu"):
    r = jaxprec.search_policy(fn, *args, tolerance=1.0, verbose=False,
                              mode="native")
  assert {s.program for s in r.history} == {"fixed"}


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_compile_once_must_be_a_bool(bad):
  fn, args = _model()
  with pytest.raises(TypeError, match="compile_once must be True or False"):
    jaxprec.search_policy(fn, *args, tolerance=1e-3, compile_once=bad)


def test_switched_requires_every_unit_in_its_trace():
  def f(x, w):
    return x @ w

  g = jax.jit(switch.switched(f, ["", "no/such/module"],
                              [resolve("bfloat16")], target="tpu"))
  with pytest.raises(switch.SwitchError, match="no/such/module"):
    g(switch.index_of([0, 0]), jnp.ones((2, 2)), jnp.ones((2, 2)))


# ---------------------------------------------------------------------------
# Structure: units inside jit, remat, scan and custom-derivative bodies.


@jax.jit
def _jitted_layer(w, x):
  return jnp.tanh(x @ w + 100.0) - jnp.tanh(x @ w)


@jax.custom_jvp
def _custom(w, x):
  return jnp.tanh(x @ w)


@_custom.defjvp
def _custom_jvp(primals, tangents):
  w, x = primals
  dw, dx = tangents
  y = _custom(w, x)
  return y, (1 - y * y) * (x @ dw + dx @ w)


class _Inner(nn.Module):
  @nn.compact
  def __call__(self, c, _=None):
    y = jnp.tanh(nn.Dense(16, name="d")(c + 100.0) - 100.0)
    return y, None


class _Structured(nn.Module):
  @nn.compact
  def __call__(self, x):
    out = {"pre": nn.Dense(16, name="pre")(x)}
    h, _ = nn.remat(_Inner)(name="rem")(out["pre"])
    h = nn.jit(nn.Dense)(16, name="jd")(h + 10.0)
    scan = nn.scan(_Inner, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=3)
    h, _ = scan(name="layers")(h, None)
    h = jax.lax.cond(True, lambda v: v + 1.0, lambda v: v - 1.0, h)
    out["h"] = h
    out["explicit"] = jnp.dot(h, h.T, precision="highest")  # fixed: not a unit
    out["post"] = nn.Dense(16, name="post")(h)
    return out


def _plain(w1, w2, x):
  h = _jitted_layer(w1, x)
  return {"h": h, "c": _custom(w2, h)}


def _structured():
  x = np.asarray(jax.random.normal(jax.random.key(2), (8, 16)))  # NumPy input
  model = _Structured()
  return model.apply, (model.init(jax.random.key(0), jnp.asarray(x)), x)


def _plain_args():
  k = jax.random.split(jax.random.key(3), 3)
  return _plain, (jax.random.normal(k[0], (16, 16)),
                  jax.random.normal(k[1], (16, 16)) / 4,
                  jax.random.normal(k[2], (4, 16)))


@pytest.mark.parametrize("make", [_structured, _plain_args],
                         ids=["remat-jit-scan-cond", "jit-custom_jvp"])
def test_units_inside_bodies_are_switched_bit_for_bit(make):
  fn, args = make()
  # Two random policies: with seed 4 they mix all three candidates over the
  # structured model's five units (the plain function has one unit).
  switching.assert_switched_is_fixed(fn, args, 2, seed=4)


@pytest.mark.parametrize("make", [_structured, _plain_args],
                         ids=["remat-jit-scan-cond", "jit-custom_jvp"])
def test_structured_search_switches_and_agrees_with_per_policy(make):
  fn, args = make()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    once = jaxprec.search_policy(fn, *args, tolerance=1e-4, verbose=False)
    per = jaxprec.search_policy(fn, *args, tolerance=1e-4, verbose=False,
                                compile_once=False)
  assert once.evaluations >= 2
  assert "switched" in {s.program for s in once.history}
  assert str(once.policy) == str(per.policy)
  assert [s.worst_value for s in once.history] == [
      s.worst_value for s in per.history]


def test_nnx_model_search_switches():
  from flax import nnx  # noqa: PLC0415

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(16, 16, rngs=rngs)
      self.b = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
      h = jnp.tanh(self.a(x + 100.0))
      return {"h": h, "o": self.b(h)}

  x = jax.random.normal(jax.random.key(2), (8, 16))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    once = jaxprec.search_policy(Model(nnx.Rngs(0)), x, tolerance=1e-4,
                                 verbose=False)
    per = jaxprec.search_policy(Model(nnx.Rngs(0)), x, tolerance=1e-4,
                                verbose=False, compile_once=False)
  assert "switched" in {s.program for s in once.history}
  assert str(once.policy) == str(per.policy) and "a=" in str(once.policy)
  assert once.values == per.values


def test_all_float32_fallback_is_a_branch_of_the_switched_program():
  """Candidates without float32: the fallback's float32 is the switch's last
  choice, and the reported values are still the policy's own program's."""
  fn, args = _model()
  kw = dict(candidates=("bfloat16", "bfloat16_3x"), tolerance=1e-7,
            verbose=False)
  with pytest.warns(UserWarning, match="no policy of the candidates"):
    once = jaxprec.search_policy(fn, *args, **kw)
  with pytest.warns(UserWarning, match="no policy of the candidates"):
    per = jaxprec.search_policy(fn, *args, compile_once=False, **kw)
  assert [s.program for s in once.history] == ["fixed", "switched", "switched"]
  assert str(once.history[-1].policy) == "default=float32"
  assert str(once.policy) == "default=float32" and not once.meets_tolerance
  assert once.values == per.values
  assert search_lib._choices(search_lib._candidates(
      kw["candidates"], "tpu", cost_lib.weights_for("tpu")))[-1].name == "float32"


def test_a_switched_result_the_policys_own_program_does_not_repeat_warns(
    monkeypatch):
  import dataclasses  # noqa: PLC0415
  from jaxprec._src.checker import harness

  real = harness.run_indexed

  def off_by_a_little(*a, **k):  # as if the two programs rounded differently
    return [dataclasses.replace(m, rel_rms=m.rel_rms * 0.5) for m in real(*a, **k)]

  monkeypatch.setattr(harness, "run_indexed", off_by_a_little)
  fn, args = _model()
  with pytest.warns(UserWarning, match="measured differently"):
    r = jaxprec.search_policy(fn, *args, tolerance=2e-2, verbose=False)
  report = jaxprec.check(fn, *args, precisions=[r.policy])
  for layer in report.layers:  # the report is the policy's own program's
    assert r.values[layer.name] == layer.metrics[str(r.policy)].rel_rms
