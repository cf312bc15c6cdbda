"""jaxprec.torch.port_check: is a JAX port wrong, or is it precision?

Small PyTorch models and hand-written JAX ports with copied weights: a
correct port, a port whose block 2 uses GELU's tanh approximation (PyTorch
computes the exact GELU), a port whose block 1 LayerNorm lost its bias. The
errors the report shows are checked against NumPy float64 computations of the
same layers (the bug's size, the bfloat16 envelope of a matmul).
"""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from scipy import special  # noqa: E402

import jaxprec.torch as jt  # noqa: E402
from jaxprec._src.checker import port_check as pc  # noqa: E402

D_IN, D, F, N = 8, 16, 32, 4


class TBlock(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.ln1 = torch.nn.LayerNorm(D)
    self.fc1 = torch.nn.Linear(D, F)
    self.fc2 = torch.nn.Linear(F, D)

  def forward(self, x):
    return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln1(x))))


class TNet(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(D_IN, D)
    self.blocks = torch.nn.ModuleList([TBlock() for _ in range(N)])
    self.norm = torch.nn.LayerNorm(D)

  def forward(self, x):
    h = self.proj(x)
    for b in self.blocks:
      h = b(h)
    return self.norm(h)


def _tnet() -> TNet:
  torch.manual_seed(0)
  m = TNet()
  with torch.no_grad():  # LayerNorm's own init (ones, zeros) hides a lost bias
    for mod in m.modules():
      if isinstance(mod, torch.nn.LayerNorm):
        mod.weight.normal_(1.0, 0.2)
        mod.bias.normal_(0.0, 0.5)
  return m.eval()


class JBlock(nnx.Module):
  def __init__(self, approximate=False, ln_bias=True, *, rngs):
    self.ln1 = nnx.LayerNorm(D, epsilon=1e-5, use_bias=ln_bias,
                             use_fast_variance=False, rngs=rngs)
    self.fc1 = nnx.Linear(D, F, rngs=rngs)
    self.fc2 = nnx.Linear(F, D, rngs=rngs)
    self.approximate = approximate

  def __call__(self, x):
    h = jax.nn.gelu(self.fc1(self.ln1(x)), approximate=self.approximate)
    return x + self.fc2(h)


class JNet(nnx.Module):
  def __init__(self, tanh_block=None, nobias_block=None, *, rngs):
    self.proj = nnx.Linear(D_IN, D, rngs=rngs)
    self.blocks = nnx.List([
        JBlock(approximate=i == tanh_block, ln_bias=i != nobias_block,
               rngs=rngs) for i in range(N)])
    self.norm = nnx.LayerNorm(D, epsilon=1e-5, use_fast_variance=False,
                              rngs=rngs)

  def __call__(self, x):
    h = self.proj(x)
    for b in self.blocks:
      h = b(h)
    return self.norm(h)


def _np(t):
  return t.detach().numpy().copy()


def _copy_linear(j, t):
  j.kernel[...] = jnp.asarray(_np(t.weight).T)
  j.bias[...] = jnp.asarray(_np(t.bias))


def _copy_ln(j, t):
  j.scale[...] = jnp.asarray(_np(t.weight))
  if j.bias is not None:
    j.bias[...] = jnp.asarray(_np(t.bias))


def _jnet(t: TNet, **kw) -> JNet:
  m = JNet(rngs=nnx.Rngs(0), **kw)
  _copy_linear(m.proj, t.proj)
  _copy_ln(m.norm, t.norm)
  for jb, tb in zip(m.blocks, t.blocks):
    _copy_ln(jb.ln1, tb.ln1)
    _copy_linear(jb.fc1, tb.fc1)
    _copy_linear(jb.fc2, tb.fc2)
  return m


X = np.random.default_rng(0).normal(size=(2, 8, D_IN)).astype(np.float32)


@pytest.fixture(scope="module")
def tnet():
  return _tnet()


@pytest.fixture(scope="module")
def correct(tnet):
  return jt.port_check(_jnet(tnet), tnet, X)


@pytest.fixture(scope="module")
def tanh2(tnet):
  return jt.port_check(_jnet(tnet, tanh_block=2), tnet, X)


@pytest.fixture(scope="module")
def nobias1(tnet):
  return jt.port_check(_jnet(tnet, nobias_block=1), tnet, X)


def _inputs_of(model, name):
  """The float64 input and output of a PyTorch submodule's call."""
  got = {}
  sub = dict(model.named_modules())[name]
  h = sub.register_forward_hook(
      lambda m, a, out: got.update(x=_np(a[0]).astype(np.float64),
                                   y=_np(out).astype(np.float64)))
  try:
    with torch.no_grad():
      model(torch.from_numpy(X))
  finally:
    h.remove()
  return got["x"], got["y"]


def _rel_rms(c, r):
  return float(np.sqrt(np.sum((c - r) ** 2) / np.sum(r ** 2)))


def _block64(tb, x, approximate):
  """A block in float64 NumPy: exact GELU (erf) or its tanh approximation."""
  w = {k: _np(v).astype(np.float64) for k, v in tb.state_dict().items()}
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  h = (x - mu) / np.sqrt(var + 1e-5) * w["ln1.weight"] + w["ln1.bias"]
  h = h @ w["fc1.weight"].T + w["fc1.bias"]
  if approximate:
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
  else:
    h = 0.5 * h * (1 + special.erf(h / np.sqrt(2)))
  return x + h @ w["fc2.weight"].T + w["fc2.bias"]


# ---------------------------------------------------------------------------
# The three ports of the issue.


def test_a_correct_port_has_no_suspect_and_its_bfloat16_drift_is_explained(
    correct):
  assert correct.suspects("float32") == []
  assert correct.suspects("bfloat16") == []
  assert correct.kind == "nnx"
  # Paired by order, shapes and closeness: every module with its twin.
  want = {"proj": "proj", "norm": "norm", "output": "output"}
  for i in range(N):
    for sub in ("ln1", "fc1", "fc2"):
      want[f"blocks/{i}/{sub}"] = f"blocks.{i}.{sub}"
    want[f"blocks/{i}"] = f"blocks.{i}"
  assert correct.alignment == want
  assert correct.unpaired_jax == () and correct.unpaired_torch == ()
  for layer in correct.layers:
    assert layer.floor < 1e-6, layer  # the two frameworks' own disagreement
    assert layer.floor <= 2.5 * layer.noise + pc.SLACK, layer
    assert layer.verdict == {"float32": "ok", "bfloat16": "ok"}
  # bfloat16 is a real drift, three to four orders above the floor, and
  # every bit of it is the precision's own (the envelope).
  fc1 = correct.layer("blocks/1/fc1")
  assert fc1.local["bfloat16"] > 1000 * fc1.floor + 1e-4
  assert abs(fc1.local["bfloat16"] - fc1.envelope["bfloat16"]) <= (
      fc1.floor + 1e-7)
  assert correct.layer("output").propagated["bfloat16"] > 1e-3


def test_the_envelope_is_one_bfloat16_pass_as_numpy_computes_it(tnet,
                                                                correct):
  # fc1 of block 1 on PyTorch's input: operands rounded to bfloat16 (round to
  # nearest even), exact products and sums in float64.
  x, _ = _inputs_of(tnet, "blocks.1.fc1")
  lin = tnet.blocks[1].fc1
  w, b = _np(lin.weight).T.astype(np.float64), _np(lin.bias).astype(np.float64)
  bf = lambda a: a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
  exact = x @ w + b
  one_pass = bf(x) @ bf(w) + b
  want = _rel_rms(one_pass, exact)
  got = correct.layer("blocks/1/fc1").envelope["bfloat16"]
  assert got == pytest.approx(want, rel=2e-3)


def test_gelu_tanh_in_block_2_is_the_only_suspect_at_float32(tnet, tanh2):
  assert tanh2.suspects("float32") == ["blocks/2"]
  blk = tanh2.layer("blocks/2")
  # The size of the bug, computed in float64 NumPy on PyTorch's input.
  x, y = _inputs_of(tnet, "blocks.2")
  want = _rel_rms(_block64(tnet.blocks[2], x, approximate=True),
                  _block64(tnet.blocks[2], x, approximate=False))
  assert _rel_rms(_block64(tnet.blocks[2], x, False), y) < 1e-6
  assert blk.floor == pytest.approx(want, rel=1e-2)
  assert blk.floor > 20 * (pc.PORT_FACTOR * blk.noise + pc.SLACK)
  # Its children are right: the bug is in its own code, between them.
  for sub in ("ln1", "fc1", "fc2"):
    assert tanh2.layer(f"blocks/2/{sub}").verdict["float32"] == "ok"
  # The layers after it drift (propagated), but run on PyTorch's input they
  # are right (local): they are not suspects.
  for name in ("blocks/3", "blocks/3/fc2", "norm"):
    later = tanh2.layer(name)
    assert later.propagated["float32"] > later.bound["float32"]
    assert later.local["float32"] < 1e-6
    assert later.verdict["float32"] == "ok"
  assert tanh2.layer("output").verdict["float32"] == "inside"
  # A bug of 1e-4 hides under one bfloat16 pass (1e-3): not a suspect there.
  assert tanh2.suspects("bfloat16") == []
  assert blk.local["bfloat16"] < blk.bound["bfloat16"]


def test_a_lost_layernorm_bias_in_block_1_is_the_suspect_at_both_rows(
    tnet, nobias1):
  # The innermost module whose local error is not explained: block 1's
  # LayerNorm (its block is "inside": the suspect in it explains it).
  assert nobias1.suspects("float32") == ["blocks/1/ln1"]
  assert nobias1.suspects("bfloat16") == ["blocks/1/ln1"]
  assert nobias1.layer("blocks/1").verdict == {"float32": "inside",
                                               "bfloat16": "inside"}
  x, y = _inputs_of(tnet, "blocks.1.ln1")
  bias = _np(tnet.blocks[1].ln1.bias).astype(np.float64)
  want = _rel_rms(y - bias, y)
  assert nobias1.layer("blocks/1/ln1").floor == pytest.approx(want, rel=1e-4)
  assert nobias1.suspects() == ["blocks/1/ln1"]


# ---------------------------------------------------------------------------
# Pairing.


class JNamedOtherwise(nnx.Module):
  """The correct port with names of its own (nothing like PyTorch's)."""

  def __init__(self, t: TNet):
    rngs = nnx.Rngs(0)
    self.embed_in = nnx.Linear(D_IN, D, rngs=rngs)
    self.stack = nnx.List([JBlock(rngs=rngs) for _ in range(N)])
    self.final = nnx.LayerNorm(D, epsilon=1e-5, use_fast_variance=False,
                               rngs=rngs)
    _copy_linear(self.embed_in, t.proj)
    _copy_ln(self.final, t.norm)
    for jb, tb in zip(self.stack, t.blocks):
      _copy_ln(jb.ln1, tb.ln1)
      _copy_linear(jb.fc1, tb.fc1)
      _copy_linear(jb.fc2, tb.fc2)

  def __call__(self, x):
    h = self.embed_in(x)
    for b in self.stack:
      h = b(h)
    return self.final(h)


def test_pairing_needs_no_names_and_pins_override_it(tnet):
  r = jt.port_check(JNamedOtherwise(tnet), tnet, X, precisions="float32")
  assert r.alignment["embed_in"] == "proj"
  assert r.alignment["final"] == "norm"
  assert r.alignment["stack/3"] == "blocks.3"
  assert r.alignment["stack/0/fc2"] == "blocks.0.fc2"
  assert r.suspects("float32") == []
  lines = r.to_text().splitlines()  # the PyTorch name under a JAX name unlike it
  assert lines[lines.index(next(l for l in lines if l.startswith("stack/3 ")))
               + 1] == "↳ blocks.3"
  # A regex pin (with a template) and a mapping: both obeyed; None unpairs.
  pinned = jt.port_check(
      JNamedOtherwise(tnet), tnet, X, precisions="float32",
      alignment=[(r"stack/(\d+)/ln1", r"blocks.\1.ln1"), ("final", None)])
  assert pinned.alignment["stack/2/ln1"] == "blocks.2.ln1"
  assert "final" in pinned.unpaired_jax and "final" not in pinned.alignment
  assert "norm" in pinned.unpaired_torch


def test_a_bad_pin_is_refused_naming_the_closest_layer(tnet):
  with pytest.raises(ValueError, match=r"'blocks\.1\.fcl'.*closest: .*"
                                       r"'blocks\.1\.fc1'"):
    jt.port_check(_jnet(tnet), tnet, X, alignment={"blocks/1/fc1":
                                                   "blocks.1.fcl"})
  with pytest.raises(ValueError, match=r"'blocks/9/fc1'.*no layer of the JAX"):
    jt.port_check(_jnet(tnet), tnet, X, alignment={"blocks/9/fc1": "proj"})
  with pytest.raises(ValueError, match="shapes differ"):
    jt.port_check(_jnet(tnet), tnet, X, alignment={"blocks/1/fc1": "proj"})
  with pytest.raises(TypeError, match="alignment must be"):
    jt.port_check(_jnet(tnet), tnet, X, alignment=3)


class TConv(torch.nn.Module):
  """A convolution over (batch, channels, time), then a Linear."""

  def __init__(self):
    super().__init__()
    self.conv = torch.nn.Conv1d(3, 5, 3)
    self.fc = torch.nn.Linear(5, 4)

  def forward(self, x):
    return self.fc(self.conv(x).transpose(1, 2))


class JConv(nnx.Module):
  """TConv over (batch, time, channels), as flax.nnx.Conv takes it."""

  def __init__(self, t: TConv):
    self.conv = nnx.Conv(3, 5, (3,), padding="VALID", rngs=nnx.Rngs(0))
    self.fc = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
    self.conv.kernel[...] = _np(t.conv.weight).transpose(2, 1, 0)
    self.conv.bias[...] = _np(t.conv.bias)
    _copy_linear(self.fc, t.fc)

  def __call__(self, x):
    return self.fc(self.conv(x))


def test_layouts_pair_a_convolution_across_ncw_and_nwc():
  torch.manual_seed(0)
  t = TConv().eval()
  x = np.random.default_rng(0).normal(size=(2, 10, 3)).astype(np.float32)
  ncw = (x.transpose(0, 2, 1),)
  plain = jt.port_check(JConv(t), t, x, torch_inputs=ncw)
  assert "conv" in plain.unpaired_jax  # (2, 8, 5) against (2, 5, 8)
  r = jt.port_check(JConv(t), t, x, torch_inputs=ncw,
                    layouts={"con.": (0, 2, 1)})
  assert r.alignment["conv"] == "conv" and r.suspects() == []
  assert r.layer("conv").floor < 1e-6 < r.layer("conv").local["bfloat16"]
  # A bug in the convolution is found there; a function pins the pairs.
  wrong = JConv(t)
  wrong.conv.bias[...] = wrong.conv.bias[...] + 0.1
  r = jt.port_check(wrong, t, x, torch_inputs=ncw, layouts={"conv": [0, 2, 1]},
                    alignment=lambda j, t: {n: n for n in j if n in t})
  assert r.suspects("float32") == ["conv"]
  assert r.alignment == {"conv": "conv", "fc": "fc", "output": "output"}
  with pytest.raises(ValueError, match=r"'conx' matches no layer.*'conv'"):
    jt.port_check(JConv(t), t, x, torch_inputs=ncw, layouts={"conx": (0, 2, 1)})
  with pytest.raises(ValueError, match="no axes permutation"):
    jt.port_check(JConv(t), t, x, torch_inputs=ncw, layouts={"conv": (0, 2)})
  with pytest.raises(TypeError, match="layouts must be a dict"):
    jt.port_check(JConv(t), t, x, torch_inputs=ncw,
                  layouts=[("conv", (0, 2, 1))])
  with pytest.raises(TypeError, match="the function must return a dict"):
    jt.port_check(JConv(t), t, x, torch_inputs=ncw, alignment=lambda j, t: 3)


class TTwo(torch.nn.Module):
  def __init__(self, inner=torch.nn.Linear):
    super().__init__()
    self.a = inner(4, 4)
    self.b = inner(4, 4)
    self.fc = torch.nn.Linear(4, 4)

  def forward(self, x):
    return self.fc(self.b(self.a(x)))


class JOne(nnx.Module):
  """One module ``c`` where PyTorch has two of the same shapes, ``a`` and
  ``b``: ``c`` computes something else than both (a constant) or the same
  as both (the identity)."""

  class Const(nnx.Module):
    def __call__(self, x):
      return x * 0 + 100.0

  class Same(nnx.Module):
    def __call__(self, x):
      return x

  def __init__(self, t, inner):
    self.c = inner()
    self.fc = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    _copy_linear(self.fc, t.fc)

  def __call__(self, x):
    return self.fc(self.c(x))


def test_an_ambiguous_pairing_is_refused_naming_the_candidates():
  torch.manual_seed(0)
  t = TTwo().eval()
  x = np.ones((2, 4), np.float32)
  # 'c' is as far from 'a' as from 'b', whichever input it runs on.
  with pytest.raises(ValueError, match=r"JAX layer 'c'.*'a', 'b'.*"
                                       r"alignment=\{'c': 'a'\}"):
    jt.port_check(JOne(t, JOne.Const), t, x, precisions="float32")
  r = jt.port_check(JOne(t, JOne.Const), t, x, precisions="float32",
                    alignment={"c": "b"})
  assert r.alignment == {"c": "b", "fc": "fc", "output": "output"}
  assert r.unpaired_torch == ("a",)
  assert r.suspects("float32") == ["c"]  # the constant is wrong
  # Two identities have the same inputs and outputs: no figure depends on
  # the choice, and none is refused.
  same = TTwo(inner=lambda *_: torch.nn.Identity()).eval()
  r = jt.port_check(JOne(same, JOne.Same), same, x, precisions="float32")
  assert r.alignment["c"] in ("a", "b") and r.suspects() == []


class TTwiceFc(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(4, 4)

  def forward(self, x):
    return self.fc(torch.tanh(self.fc(x)))


class JScanned(nnx.Module):
  """The same, its two steps in a ``jax.lax.scan``: ``fc`` runs inside the
  scan's trace, where a port check cannot take its values out."""

  def __init__(self, t):
    self.fc = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    _copy_linear(self.fc, t.fc)

  def __call__(self, x):
    def step(h, i):
      h = self.fc(h)
      return jnp.where(i == 0, jnp.tanh(h), h), None
    return jax.lax.scan(step, x, jnp.arange(2))[0]


def test_a_module_called_inside_a_scan_is_named_not_checked():
  torch.manual_seed(0)
  t = TTwiceFc().eval()
  x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
  r = jt.port_check(JScanned(t), t, x)
  assert r.alignment == {"output": "output"}
  assert r.suspects() == []
  assert any("not checked: fc" in n for n in r.notes)
  assert r.unpaired_torch == ("fc#0", "fc#1")


# ---------------------------------------------------------------------------
# Linen, a function, the built-in Llama and Wav2Vec2 ports.


class LBlock(nn.Module):
  approximate: bool = False

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name="ln1")(x)
    h = jax.nn.gelu(nn.Dense(F, name="fc1")(h), approximate=self.approximate)
    return x + nn.Dense(D, name="fc2")(h)


class LNet(nn.Module):
  tanh_block: int = -1

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, name="proj")(x)
    for i in range(N):
      h = LBlock(approximate=i == self.tanh_block, name=f"blocks_{i}")(h)
    return nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name="norm")(h)


def _linen_variables(t: TNet):
  def dense(m):
    return {"kernel": _np(m.weight).T, "bias": _np(m.bias)}

  def ln(m):
    return {"scale": _np(m.weight), "bias": _np(m.bias)}
  params = {"proj": dense(t.proj), "norm": ln(t.norm)}
  for i, b in enumerate(t.blocks):
    params[f"blocks_{i}"] = {"ln1": ln(b.ln1), "fc1": dense(b.fc1),
                             "fc2": dense(b.fc2)}
  return {"params": params}


def test_a_linen_port_with_its_variables(tnet):
  variables = _linen_variables(tnet)
  before = jax.tree_util.tree_map(np.copy, variables)
  r = jt.port_check((LNet(tanh_block=2), variables), tnet, X)
  assert r.kind == "linen"
  assert r.suspects("float32") == ["blocks_2"]
  assert r.suspects("bfloat16") == []
  assert r.alignment["blocks_2/fc1"] == "blocks.2.fc1"
  assert r.layer("blocks_3").propagated["float32"] > 1e-5  # drift, not a bug
  jax.tree_util.tree_map(np.testing.assert_array_equal, variables, before)
  ok = jt.port_check((LNet(), variables), tnet, X, precisions="float32")
  assert ok.suspects() == []


def test_a_function_port_names_the_first_unexplained_output(tnet):
  model = _jnet(tnet, tanh_block=2)
  graphdef, state = nnx.split(model)

  def hidden_states(x):
    m = nnx.merge(graphdef, state)
    h, out = m.proj(x), []
    for b in m.blocks:
      h = b(h)
      out.append(h)
    return {"hidden_states": out, "last_hidden_state": m.norm(h)}
  r = jt.port_check(hidden_states, tnet, X)
  assert r.kind == "function"
  assert r.alignment["hidden_states[2]"] == "blocks.2"
  assert r.suspects("float32") == ["hidden_states[2]"]
  assert r.layer("hidden_states[3]").verdict["float32"] == "after"
  assert math.isnan(r.layer("hidden_states[2]").local["float32"])
  assert r.suspects("bfloat16") == []


def test_the_llama_port_has_no_suspect_and_its_logits_gates():
  transformers = pytest.importorskip("transformers")
  import jaxprec.models  # noqa: PLC0415
  cfg = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      initializer_range=0.2, tie_word_embeddings=False)
  torch.manual_seed(0)
  pt = transformers.LlamaForCausalLM(cfg).eval()
  model = jaxprec.models.LlamaForCausalLM.from_pytorch(pt)
  ids = (np.arange(8, dtype=np.int32)[None] * 7) % 64
  r = jt.port_check(model, pt, ids, torch_inputs=(ids.astype(np.int64),),
                    logits="lm_head", top_k=3)
  assert r.suspects() == []
  for name in ("model/layers/0/self_attn", "model/layers/1/mlp",
               "model/layers/1"):
    assert r.alignment[name] == name.replace("/", ".")
    layer = r.layer(name)
    assert layer.floor < 1e-5
    assert layer.local["bfloat16"] > 1e-3  # one bfloat16 pass, explained
  assert r.layer("model/layers/1").propagated["bfloat16"] > 1e-3
  # PyTorch's modules without a JAX twin are listed, not dropped.
  assert "model.rotary_emb" in r.unpaired_torch
  # The gates: the full JAX run's distributions against PyTorch's.
  with torch.no_grad():
    ref = pt(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
  want = jt.logits_gates(np.asarray(model(ids)["logits"]), ref, k=3)
  f32, bf16 = r.logits["float32"], r.logits["bfloat16"]
  assert f32.max_logprob_diff == pytest.approx(want.max_logprob_diff,
                                               abs=1e-6)
  assert f32.kl_max < 1e-10 and f32.top1_agreement == 1.0
  assert bf16.kl_mean > 100 * f32.kl_mean
  assert bf16.max_logprob_diff > 1e-3
  assert "logits (lm_head) at bfloat16: KL mean" in r.table()
  assert json.loads(r.to_json())["logits"]["bfloat16"]["k"] == 3


# ---------------------------------------------------------------------------
# The report.


def test_the_table_fits_100_columns_and_names_the_suspects(tanh2):
  text = tanh2.table(width=100)
  assert max(map(len, text.splitlines())) <= 100
  assert "suspects at float32: blocks/2" in text
  assert "suspects at bfloat16: none" in text
  narrow = tanh2.table(width=80)
  assert max(map(len, narrow.splitlines())) <= 80
  assert str(tanh2) == tanh2.table()


def test_the_json_holds_every_figure(tanh2):
  d = json.loads(tanh2.to_json())
  assert d["suspects"] == {"float32": ["blocks/2"], "bfloat16": []}
  assert d["alignment"]["blocks/2"] == "blocks.2"
  assert d["factor"] == pc.PORT_FACTOR
  blk = next(l for l in d["layers"] if l["name"] == "blocks/2")
  assert blk["verdict"]["float32"] == "SUSPECT"
  assert blk["floor"] == tanh2.layer("blocks/2").floor


def test_neither_model_nor_input_is_changed(tnet):
  model = _jnet(tnet)
  before = jax.tree_util.tree_map(np.copy, nnx.state(model))
  x = X.copy()
  tnet.train()
  try:
    jt.port_check(model, tnet, x, precisions="float32")
    assert tnet.training and all(m.training for m in tnet.modules())
  finally:
    tnet.eval()
  jax.tree_util.tree_map(np.testing.assert_array_equal, nnx.state(model),
                         before)
  np.testing.assert_array_equal(x, X)
  assert type(model.blocks[0]) is JBlock  # no recording class left behind


def test_bad_arguments_are_refused():
  t = TTwo().eval()
  x = np.ones((2, 4), np.float32)
  with pytest.raises(ValueError, match="factor"):
    jt.port_check(JOne(t, JOne.Same), t, x, factor=0.5)
  with pytest.raises(ValueError, match="target"):
    jt.port_check(JOne(t, JOne.Same), t, x, target="abacus")
  with pytest.raises(TypeError, match="torch.nn.Module"):
    jt.port_check(JOne(t, JOne.Same), "not a model", x)
  with pytest.raises(TypeError, match=r"\(module, variables\)"):
    jt.port_check(LNet(), t, x)


def test_the_plot_draws_the_bands_and_the_suspect(tanh2, tmp_path):
  pytest.importorskip("matplotlib")
  fig = tanh2.plot(tmp_path / "port.png")
  assert (tmp_path / "port.png").stat().st_size > 1000
  top = fig.axes[0]
  assert top.get_title().startswith("float32")
  labels = [t.get_text() for t in top.get_legend().get_texts()]
  # float32 against float32 has no envelope: no band, no legend entry for one.
  assert labels == ["explained by float32 noise", "propagated", "local",
                    "suspect"]
  bottom = fig.axes[1]
  below = [t.get_text() for t in bottom.get_legend().get_texts()]
  assert "suspect" not in below
  assert "explained by bfloat16's envelope" in below


def test_the_logits_gates_of_a_vocabulary_under_five_take_k_from_it():
  # port_check's top_k defaults as check's logits_k: 5, or the vocabulary.
  torch.manual_seed(0)

  class Torch(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.body, self.lm_head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
      return self.lm_head(torch.tanh(self.body(x)))

  class Jax(nnx.Module):
    def __init__(self, t):
      for name in ("body", "lm_head"):
        tm = getattr(t, name)
        m = nnx.Linear(*tm.weight.shape[::-1], rngs=nnx.Rngs(0))
        m.kernel.value = jnp.asarray(tm.weight.detach().numpy().T)
        m.bias.value = jnp.asarray(tm.bias.detach().numpy())
        setattr(self, name, m)

    def __call__(self, x):
      return self.lm_head(jnp.tanh(self.body(x)))

  t = Torch()
  x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
  r = jt.port_check(Jax(t), t, x, logits="lm_head")
  assert {g.k for g in r.logits.values()} == {3}
  assert r.logits["float32"].top1_agreement == 1.0
  with pytest.raises(ValueError, match=r"k must be an integer in 1\.\.3"):
    jt.port_check(Jax(t), t, x, logits="lm_head", top_k=5)


def test_inputs_that_are_all_nan_are_said_out_loud(tnet):
  x = np.full_like(X, np.nan)
  r = jt.port_check(_jnet(tnet), tnet, x)
  (note,) = [n for n in r.notes if n.startswith("the inputs hold NaN or inf")]
  assert f"({x.size} of {x.size} floating-point values)" in note
  assert "the inputs hold NaN or inf" in r.table()
  assert not any(n.startswith("the inputs hold") for n in
                 jt.port_check(_jnet(tnet), tnet, X).notes)


# ---------------------------------------------------------------------------
# A layer without elements compares nothing, and the report says so.


class TEmpty(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.fc1 = torch.nn.Linear(4, 4)
    self.fc2 = torch.nn.Linear(4, 4)

  def forward(self, x):
    h = self.fc1(x)
    return h + self.fc2(h[:0]).sum()


class JEmpty(nnx.Module):
  def __init__(self, t):
    self.fc1 = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    self.fc2 = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
    _copy_linear(self.fc1, t.fc1)
    _copy_linear(self.fc2, t.fc2)

  def __call__(self, x):
    h = self.fc1(x)
    return h + self.fc2(h[:0]).sum()


def test_an_empty_layer_is_named_as_comparing_nothing():
  torch.manual_seed(0)
  t = TEmpty().eval()
  x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
  r = jt.port_check(JEmpty(t), t, x)
  assert r.alignment == {"fc1": "fc1", "fc2": "fc2", "output": "output"}
  note = [n for n in r.notes if "'fc2'" in n]
  assert note == ["'fc2' (0, 4) has no elements and compared nothing: no "
                  "error is counted there, and such a layer is never a "
                  "suspect"], r.notes
  fc2 = next(l for l in r.layers if l.name == "fc2")
  assert fc2.local == {"float32": 0.0, "bfloat16": 0.0}
  assert r.suspects() == []
  assert f"note: {note[0]}" in " ".join(str(r).split())  # folded lines
  assert note[0] in json.loads(r.to_json())["notes"]
  assert not any("'fc1'" in n or "'output'" in n for n in r.notes)
