"""One per-module hook: a policy gives a linen model and its NNX twin the same numbers.

The twins hold the same weights and run the same code: a raw ``x @ w`` on a
parameter, a Dense/Linear, an einsum, multi-head attention, BatchNorm and
Dropout. ``swap`` (native and emulated) and ``emulate`` with a policy must give
both the same bits, and NNX calls must write the state the native call writes.
"""

import dataclasses
import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprec

F = 4


def _attention(q, k, v, mask=None, is_causal=False, module=None, **kw):
  # linen's attention function in the NNX module, so that both twins compute
  # the scores with the same code (NNX's default calls
  # jax.nn.dot_product_attention, whose float32 sums round differently).
  del is_causal, module
  return nn.dot_product_attention(q, k, v, mask=mask, dtype=kw.get("dtype"),
                                  precision=kw.get("precision"))


class LinenNet(nn.Module):
  rate: float = 0.5

  @nn.compact
  def __call__(self, x, train: bool = False):
    w = self.param("w", nn.initializers.normal(1.0), (F, F))
    h = x @ w
    h = nn.Dense(F, name="dense")(h)
    e = self.param("e", nn.initializers.normal(1.0), (F, F))
    h = jnp.einsum("bli,ij->blj", h, e)
    h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=F, name="attn")(h)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(h)
    return nn.Dropout(self.rate, deterministic=not train, name="drop")(h)


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, rate: float = 0.5, attention_fn=_attention):
    self.w = nnx.Param(jnp.zeros((F, F)))
    self.dense = nnx.Linear(F, F, rngs=rngs)
    self.e = nnx.Param(jnp.zeros((F, F)))
    self.attn = nnx.MultiHeadAttention(2, F, qkv_features=F, decode=False,
                                       attention_fn=attention_fn, rngs=rngs)
    self.bn = nnx.BatchNorm(F, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)

  def __call__(self, x):
    h = x @ self.w[...]
    h = self.dense(h)
    h = jnp.einsum("bli,ij->blj", h, self.e[...])
    return self.drop(self.bn(self.attn(h)))


def twins(rate=0.5):
  """(linen module, its variables, the NNX twin with the same weights, x)."""
  x = jax.random.normal(jax.random.key(1), (2, 3, F))
  x = x + 2.0**-9  # values that round away in bfloat16
  lin = LinenNet(rate)
  v = lin.init(jax.random.key(0), x)
  p = v["params"]
  net = NnxNet(nnx.Rngs(0), rate)
  net.w[...], net.e[...] = p["w"], p["e"]
  net.dense.kernel[...], net.dense.bias[...] = p["dense"]["kernel"], p["dense"]["bias"]
  for name in ("query", "key", "value", "out"):
    getattr(net.attn, name).kernel[...] = p["attn"][name]["kernel"]
    getattr(net.attn, name).bias[...] = p["attn"][name]["bias"]
  return lin, v, net, x


def quiet(fn, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxprec.UnusedRuleWarning)
    return fn(*args, **kwargs)


def _eq(a, b):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_linen_and_nnx_twins_give_the_same_bits():
  policy = "default=bf16,attn=float32,Dense=tf32"
  lin, v, net, x = twins()
  net.eval()
  _eq(lin.apply(v, x), net(x))  # natively the twins agree
  swap_l, swap_n = quiet(jaxprec.swap, lin, policy), quiet(jaxprec.swap, net, policy)
  _eq(swap_l.apply(v, x), swap_n(x))
  emu_l = quiet(jaxprec.swap, lin, policy, emulate=True)
  emu_n = quiet(jaxprec.swap, net, policy, emulate=True)
  want = quiet(jaxprec.emulate(lin.apply, policy), v, x)
  for got in (emu_l.apply(v, x), emu_n(x), quiet(jaxprec.emulate(net, policy), x)):
    _eq(got, want)
  # The policy changed the numbers: bfloat16 passes round the inputs.
  assert not np.array_equal(np.asarray(want), np.asarray(lin.apply(v, x)))


def test_nnx_swap_emulated_computes_what_emulate_computes():
  # One bfloat16 pass: (1 + 2**-9) rounds to 1 in both operands.
  class Net(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.full((4, 1), 1 + 2.0**-9))

    def __call__(self, x):
      return x @ self.w[...]

  net, x = Net(), jnp.full((1, 4), 1 + 2.0**-9)
  want = jaxprec.emulate(net, "bfloat16")(x)
  assert float(want[0, 0]) == 4.0
  _eq(jaxprec.swap(net, "bfloat16", emulate=True)(x), want)
  assert float(jaxprec.swap(net, "bfloat16")(x)[0, 0]) != 4.0  # CPU: float32


def _dots(text):
  return re.findall(r"stablehlo\.dot_general[^\n]*", text)


@pytest.mark.parametrize("policy,mark", [
    ("float32", "precision = [HIGHEST, HIGHEST]"),
    ("BF16_BF16_F32_X3", "num_primitive_operations = 3"),
])
def test_nnx_swap_reaches_raw_matmuls_einsums_and_attention_scores(policy, mark):
  # NNX's own attention function: jax.nn.dot_product_attention, which takes
  # no precision argument.
  net = NnxNet(nnx.Rngs(0), attention_fn=nnx.dot_product_attention)
  net.eval()
  x = jnp.ones((2, 3, F))
  swapped = jaxprec.swap(net, policy)
  dots = _dots(jax.jit(lambda x: swapped(x)).lower(x).as_text())
  # raw @, Linear, einsum, q/k/v, two score matmuls, out projection
  assert len(dots) == 9
  assert all(mark in d for d in dots), dots
  lin, v, _, _ = twins()
  linen_dots = _dots(jax.jit(jaxprec.swap(lin, policy).apply).lower(v, x).as_text())
  assert [mark in d for d in linen_dots] == [True] * 9
  assert type(net.dense) is nnx.Linear  # the user's model keeps its classes


def _bn_dropout():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.bn = nnx.BatchNorm(F, momentum=0.5, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.bn(x))
  return Net(nnx.Rngs(0)), jax.random.normal(jax.random.key(2), (8, F))


def _state(module):
  return jax.tree.map(np.asarray, nnx.state(module, nnx.BatchStat, nnx.RngCount))


def test_nnx_calls_write_batch_statistics_and_rng_counters_as_natively():
  net, x = _bn_dropout()
  native = nnx.clone(net)
  swapped = jaxprec.swap(net, "float32", emulate=True)
  emulated = jaxprec.emulate(net, "float32")
  outs = []
  for _ in range(2):
    want = native(x)
    _eq(emulated(x), want)
    _eq(swapped(x), want)
    outs.append(want)
    for holder in (net, swapped):
      jax.tree.map(np.testing.assert_array_equal, _state(holder), _state(native))
  assert not np.array_equal(outs[0], outs[1])  # a new dropout mask per call
  assert int(net.drop.rngs.count[...]) == int(swapped.drop.rngs.count[...]) == 2


def test_train_mode_twins_agree_on_outputs_and_batch_statistics():
  lin, v, net, x = twins(rate=0.0)
  net.train()
  policy = "default=bf16,attn=float32"
  linen_fn = functools.partial(lin.apply, mutable=["batch_stats"], train=True)
  out_l, new_l = quiet(jaxprec.emulate(linen_fn, policy), v, x)
  emu_n = quiet(jaxprec.swap, net, policy, emulate=True)
  out_n = emu_n(x)
  _eq(out_n, out_l)
  _eq(emu_n.bn.mean[...], new_l["batch_stats"]["bn"]["mean"])
  _eq(emu_n.bn.var[...], new_l["batch_stats"]["bn"]["var"])
  assert float(jnp.abs(net.bn.mean[...]).max()) == 0.0  # the user's: untouched


def test_an_rngs_argument_advances_as_natively():
  class Net(nnx.Module):
    def __init__(self):
      self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs):
      return self.drop(x, rngs=rngs)

  net, x = Net(), jnp.arange(1.0, 9.0)
  ours, theirs = nnx.Rngs(0), nnx.Rngs(0)
  for run in (jaxprec.emulate(net, "float32"),
              jaxprec.emulate(net, "float32", target="cpu")):
    for _ in range(2):
      _eq(run(x, rngs=ours), net(x, rngs=theirs))
  assert int(ours.default.count[...]) == int(theirs.default.count[...]) == 4


class _TrainBlock(nnx.Module):
  """Linear, BatchNorm and Dropout: a call in train mode writes state."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.do = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.do(self.bn(self.lin(x)))


def _numbers(tree):
  """The state's values as NumPy (typed PRNG keys by their key data)."""
  def leaf(v):
    if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
      v = jax.random.key_data(v)
    return np.asarray(v)
  return jax.tree.map(leaf, tree)


def _train_block():
  m = _TrainBlock(nnx.Rngs(0, dropout=1))
  m.train()
  return m


def test_check_and_search_on_a_train_mode_nnx_model_leave_it_as_it_was():
  m = _train_block()
  before = _numbers(nnx.state(m))
  x = jax.random.normal(jax.random.key(2), (4, 8))
  report = jaxprec.check(m, x, precisions=["bfloat16"])
  assert "bfloat16" in report.precisions and report.layers
  result = jaxprec.search_policy(m, x, tolerance=1e-1, budget=2, verbose=False)
  assert result.policy is not None
  after = _numbers(nnx.state(m))
  jax.tree.map(np.testing.assert_array_equal, before, after)


def test_writing_state_across_a_trace_says_what_to_do():
  m = _train_block()
  x = jnp.ones((4, 8))
  with pytest.raises(Exception, match=r"Use nnx\.jit") as info:
    jax.jit(jaxprec.emulate(m, "bfloat16"))(x)
  assert type(info.value).__name__ == "TraceContextError"
  with pytest.raises(Exception, match=r"Emulate the model itself"):
    jaxprec.emulate(lambda x: m(x), "bfloat16")(x)
  # The way the message names works, and writes the statistics.
  mean = np.asarray(m.bn.mean.value)
  nnx.jit(lambda mod, x: jaxprec.emulate(mod, "bfloat16")(x))(m, x)
  assert not np.array_equal(mean, np.asarray(m.bn.mean.value))


def _audit_rows(report):
  return [(r.primitive, r.module_path, r.precision_name, r.tpu, r.gpu, r.flops)
          for r in report.rows]


def test_linen_and_nnx_twins_give_the_same_audit_check_and_search():
  lin, v, net, x = twins()
  net.eval()
  policy = "default=bf16,attn=float32"
  run = lambda p, x: lin.apply(p, x)  # noqa: E731
  # The audit: every dot, in order, with the same path and precisions.
  got_l = quiet(jaxprec.audit, jaxprec.swap(lin, policy).apply, v, x)
  got_n = quiet(jaxprec.audit, jaxprec.swap(net, policy), x)
  assert _audit_rows(got_l) == _audit_rows(got_n)
  assert {r.precision_name for r in got_l.rows} == {"DEFAULT", "HIGHEST"}
  # check: the same rows, bit for bit.
  rows = ["bfloat16", "tensorfloat32", policy]
  rep_l = jaxprec.check(run, v, x, precisions=rows)
  rep_n = jaxprec.check(net, x, precisions=rows)
  assert rep_l.precisions == rep_n.precisions
  metrics = lambda rep: [(layer.name, label, dataclasses.astuple(m))  # noqa: E731
                         for layer in rep.layers
                         for label, m in layer.metrics.items()]
  assert metrics(rep_l) == metrics(rep_n)
  assert rep_l.layers[0].metrics["bfloat16"].rel_rms > 0
  # search_policy: the same policy and the same value at every step.
  kw = dict(tolerance=1e-3, verbose=False, budget=8)
  res_l = quiet(jaxprec.search_policy, run, v, x, **kw)
  res_n = quiet(jaxprec.search_policy, net, x, **kw)
  assert str(res_l.policy) == str(res_n.policy)
  assert ([s.worst_value for s in res_l.history]
          == [s.worst_value for s in res_n.history])


class _LinenCell(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(F, name="dense")(h)), None


class _LinenStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(_LinenCell, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=3)
    return scan(name="layers")(x, None)[0]


class _NnxCell(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(F, F, rngs=rngs)


class _NnxStack(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _NnxCell(rngs)
    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def step(h, cell):
      return jnp.tanh(cell.dense(h))
    return step(x, self.layers)


def test_scanned_stacks_give_the_same_bits_in_linen_and_nnx():
  x = jax.random.normal(jax.random.key(1), (2, F)) + 2.0**-9
  lin = _LinenStack()
  v = lin.init(jax.random.key(0), x)
  net = _NnxStack(nnx.Rngs(0))
  p = v["params"]["layers"]["dense"]
  net.layers.dense.kernel[...] = p["kernel"]
  net.layers.dense.bias[...] = p["bias"]
  _eq(lin.apply(v, x), net(x))
  for policy in ("bfloat16", "default=bf16,.*dense.*=float32"):
    want = quiet(jaxprec.emulate(lin.apply, policy), v, x)
    _eq(quiet(jaxprec.emulate(net, policy), x), want)
    _eq(quiet(jaxprec.swap, lin, policy, emulate=True).apply(v, x), want)
    _eq(quiet(jaxprec.swap, net, policy, emulate=True)(x), want)
  assert not np.array_equal(
      np.asarray(quiet(jaxprec.emulate(lin.apply, "bfloat16"), v, x)),
      np.asarray(lin.apply(v, x)))


def test_check_and_search_read_an_nnx_models_state_at_each_call():
  # Programs are kept per model structure, never with its weights in them:
  # after an in-place update, the figures are those of the new weights.
  lin, v, net, x = twins()
  net.eval()
  first = jaxprec.check(net, x, precisions=["bfloat16"])
  net.dense.kernel[...] = net.dense.kernel[...] * 3.0 + 0.25
  again = jaxprec.check(net, x, precisions=["bfloat16"])
  _, _, fresh, _ = twins()
  fresh.eval()
  nnx.update(fresh, nnx.state(net))
  want = jaxprec.check(fresh, x, precisions=["bfloat16"])
  value = lambda r: r.layers[0].metrics["bfloat16"].rel_rms  # noqa: E731
  assert value(again) == value(want) != value(first)
  kw = dict(tolerance=1e-3, verbose=False, budget=4)
  got = quiet(jaxprec.search_policy, net, x, **kw)
  want = quiet(jaxprec.search_policy, fresh, x, **kw)
  assert [s.worst_value for s in got.history] == [
      s.worst_value for s in want.history]


class _Configured(nnx.Module):
  """Lists and dicts among its attributes (an unhashable graph definition)
  and a call keyword named ``state``."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(F, F, rngs=rngs)
    self.sizes, self.cfg = [1, 2], {"a": 1}

  def __call__(self, x, state=None):
    return self.lin(x) + (0 if state is None else state)


def test_nnx_models_with_list_attributes_and_a_state_keyword():
  m = _Configured(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, F)) + 2.0**-9
  value = lambda r: r.layers[0].metrics["bfloat16"].rel_rms  # noqa: E731
  first = value(jaxprec.check(m, x, precisions=["bfloat16"]))
  m.lin.kernel[...] = m.lin.kernel[...] * 3 + 0.1
  again = value(jaxprec.check(m, x, precisions=["bfloat16"]))
  fresh = _Configured(nnx.Rngs(0))
  nnx.update(fresh, nnx.state(m))
  assert again == value(jaxprec.check(fresh, x, precisions=["bfloat16"])) != first
  # The user's keyword named `state` reaches the model's call.
  s = x * 0.5
  got = jaxprec.check(m, x, state=s, precisions=["bfloat16"])
  want = jaxprec.check(lambda x, s: m(x, state=s), x, s, precisions=["bfloat16"])
  assert value(got) == value(want)
  _eq(jaxprec.emulate(m, "bfloat16")(x, state=s),
      jaxprec.emulate(lambda x, s: m(x, state=s), "bfloat16")(x, s))
  result = quiet(jaxprec.search_policy, m, x, state=s, tolerance=1e-3,
                 verbose=False, budget=4)
  assert result.evaluations >= 1
  assert jaxprec.check_module(m, x, state=s, precisions=["bfloat16"]).layers


def test_an_nnx_models_output_error_names_the_users_module():
  class Tagged(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(F, F, rngs=rngs)

    def __call__(self, x):
      return {"h": self.lin(x), "tag": "not an array"}
  with pytest.raises(TypeError) as e:
    jaxprec.check(Tagged(nnx.Rngs(0)), jnp.ones((2, F)))
  assert "Tagged.__call__" in str(e.value) and "jaxprec._src" not in str(e.value)


def test_models_whose_static_attributes_compare_equal_share_no_program():
  # 2 == 2.0, but x ** 2 and x ** 2.0 trace to different programs.
  class Power(nnx.Module):
    def __init__(self, p, rngs):
      self.lin, self.p = nnx.Linear(F, F, rngs=rngs), p

    def __call__(self, x):
      return self.lin(x) ** self.p
  from jaxprec._src.flax import nnx_policy
  x = jnp.ones((2, F))
  same = [nnx_policy.stateful(Power(2, nnx.Rngs(0)), (x,))[0] for _ in range(2)]
  assert same[0] is same[1]  # one structure: one program cache
  other = nnx_policy.stateful(Power(2.0, nnx.Rngs(0)), (x,))[0]
  assert other is not same[0]



class _Shifted(nnx.Module):
  """Adds pi or -pi, the angle of ``(-1, s)``: for ``s`` 0.0 or -0.0, which
  compare equal."""

  def __init__(self, s, rngs):
    self.lin, self.s = nnx.Linear(F, F, rngs=rngs), s

  def __call__(self, x):
    return self.lin(x) + jnp.arctan2(self.s, -1.0)


def test_no_trace_serves_a_model_whose_static_attribute_differs():
  # Graph definitions compare static attributes with ==: 0.0 == -0.0, yet
  # the programs differ. A reused trace would give the first model's numbers.
  class Apply(nnx.Module):
    def __call__(self, inner, x):
      return inner(x)
  x = jnp.ones((2, F))
  plus, minus = _Shifted(0.0, nnx.Rngs(0)), _Shifted(-0.0, nnx.Rngs(0))
  emulated = jaxprec.emulate(Apply(), "float32")
  assert (np.asarray(emulated(plus, x)) > 0).all()
  got = emulated(minus, x)
  assert (np.asarray(got) < 0).all()
  _eq(got, jaxprec.emulate(Apply(), "float32")(minus, x))
  swapped = jaxprec.swap(_Shifted(0.0, nnx.Rngs(0)), "float32", emulate=True)
  assert (np.asarray(swapped(x)) > 0).all()
  swapped.s = -0.0  # the same swapped model, its attribute changed
  _eq(swapped(x), jaxprec.emulate(minus, "float32")(x))
  for model in (plus, minus):  # check_module keeps one program per structure
    report = jaxprec.check_module(model, x, precisions=["float32"])
    want = float(np.abs(np.asarray(model(x))).max())
    assert report.layers[-1].metrics["float32"].ref_max_abs == pytest.approx(
        want, rel=1e-6)
