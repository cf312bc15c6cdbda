"""jaxprec.torch.port_check names layers as jaxprec.check_module does.

A submodule named ``output`` at the top of either model keeps its name, and
the root's own output is then ``'(root)'``; the linen modules inside an
NNX model's ``nnx.bridge.ToNNX`` are layers under its path, paired with
their PyTorch partners and checked alone. The ports copy their PyTorch
original's weights; the bugs are a GELU's tanh approximation where PyTorch
computes the exact GELU.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxprec.torch as jt  # noqa: E402
from jaxprec._src.checker import check as check_lib  # noqa: E402

D = 8
X = np.random.default_rng(0).normal(size=(4, D)).astype(np.float32)
F32 = dict(precisions=["float32"])


def _np(t):
  return t.detach().numpy().copy()


def _linear(t):
  """A torch Linear's weights as a Dense's params."""
  return {"kernel": jnp.asarray(_np(t.weight).T),
          "bias": jnp.asarray(_np(t.bias))}


def _copy(j, t):
  for k, v in _linear(t).items():
    getattr(j, k)[...] = v


# ---------------------------------------------------------------------------
# A child named 'output' (as Hugging Face's BERT layers have one) at the top.


class TOut(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.dense = torch.nn.Linear(D, D)

  def forward(self, x):
    return torch.nn.functional.gelu(self.dense(x))


class THead(torch.nn.Module):
  """``a``, then the child named ``child`` (``'output'``), then the root's
  own GELU and scale."""

  def __init__(self, child="output"):
    super().__init__()
    self.a = torch.nn.Linear(D, D)
    self.child = child
    self.add_module(child, TOut())

  def forward(self, x):
    h = getattr(self, self.child)(torch.tanh(self.a(x)))
    return 2 * torch.nn.functional.gelu(h)


class JOut(nnx.Module):
  def __init__(self, tanh_gelu, rngs):
    self.dense = nnx.Linear(D, D, rngs=rngs)
    self.tanh_gelu = tanh_gelu

  def __call__(self, x):
    return jax.nn.gelu(self.dense(x), approximate=self.tanh_gelu)


class JHead(nnx.Module):
  def __init__(self, child="output", bug_child=False, bug_root=False, *,
               rngs):
    self.a = nnx.Linear(D, D, rngs=rngs)
    self.child, self.bug_root = child, bug_root
    setattr(self, child, JOut(bug_child, rngs))

  def __call__(self, x):
    h = getattr(self, self.child)(jnp.tanh(self.a(x)))
    return 2 * jax.nn.gelu(h, approximate=self.bug_root)


class LOut(nn.Module):
  tanh_gelu: bool = False

  @nn.compact
  def __call__(self, x):
    return jax.nn.gelu(nn.Dense(D, name="dense")(x),
                       approximate=self.tanh_gelu)


class LHead(nn.Module):
  bug_child: bool = False
  bug_root: bool = False

  @nn.compact
  def __call__(self, x):
    h = LOut(self.bug_child, name="output")(jnp.tanh(nn.Dense(D, name="a")(x)))
    return 2 * jax.nn.gelu(h, approximate=self.bug_root)


@pytest.fixture(scope="module")
def thead():
  torch.manual_seed(0)
  return THead().eval()


def _port(t, api, child="output", **bugs):
  """The JAX port of ``t`` in ``api`` (``'nnx'`` or ``'linen'``)."""
  if api == "linen":
    return LHead(**bugs), {"params": {
        "a": _linear(t.a), "output": {"dense": _linear(t.output.dense)}}}
  m = JHead(child, rngs=nnx.Rngs(0), **bugs)
  _copy(m.a, t.a)
  _copy(getattr(m, child).dense, getattr(t, t.child).dense)
  return m


def _names(r):
  return [l.name for l in r.layers]


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_child_named_output_keeps_its_name_and_the_root_is_root(thead, api):
  port = _port(thead, api)
  r = jt.port_check(port, thead, X, **F32)
  assert _names(r) == ["a", "output/dense", "output", "(root)"]
  # As check_module names the same model's layers.
  module, args = (port, (X,)) if api == "nnx" else (port[0], (port[1], X))
  fn, _, args = check_lib.module_outputs(module, args, {})
  assert _names(r) == list(fn(*args))
  assert r.alignment == {"a": "a", "output/dense": "output.dense",
                         "output": "output", "(root)": "(root)"}
  assert r.suspects() == [] and not r.unpaired_jax and not r.unpaired_torch
  # A pin names the layers so.
  pinned = jt.port_check(port, thead, X, alignment={"output": "output"}, **F32)
  assert pinned.alignment == r.alignment


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_bug_in_a_child_named_output_is_the_suspect(thead, api):
  r = jt.port_check(_port(thead, api, bug_child=True), thead, X, **F32)
  assert r.suspects("float32") == ["output"]
  verdicts = {l.name: l.verdict["float32"] for l in r.layers}
  # The root holds the child: its error is inherited; 'output' holds no 'a'.
  assert verdicts == {"a": "ok", "output/dense": "ok", "output": "SUSPECT",
                      "(root)": "inside"}
  # GELU's tanh approximation against the exact one, on PyTorch's input.
  x = np.asarray(thead.output.dense(torch.tanh(thead.a(
      torch.from_numpy(X)))).detach(), np.float64)
  tanh = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
  exact = np.asarray(torch.nn.functional.gelu(torch.from_numpy(x)))
  want = np.linalg.norm(tanh - exact) / np.linalg.norm(exact)
  np.testing.assert_allclose(r.layer("output").local["float32"], want,
                             rtol=1e-2)


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_bug_in_the_roots_own_code_is_the_root(thead, api):
  r = jt.port_check(_port(thead, api, bug_root=True), thead, X, **F32)
  assert r.suspects("float32") == ["(root)"]
  assert r.layer("output").verdict["float32"] == "ok"


def test_a_pytorch_child_named_output_is_not_the_root(thead):
  """The port names the child ``head``: PyTorch's ``output`` is its partner,
  PyTorch's root (``'(root)'``) the port's root (``'output'``)."""
  r = jt.port_check(_port(thead, "nnx", child="head", bug_child=True),
                    thead, X, **F32)
  assert r.alignment == {"a": "a", "head/dense": "output.dense",
                         "head": "output", "output": "(root)"}
  assert r.suspects("float32") == ["head"]


def test_inputs_in_pytorchs_layout_reach_the_root_beside_a_child_output():
  """With ``torch_inputs=``, the root runs alone on the JAX model's own
  inputs (PyTorch's root takes them transposed), a child ``output`` or not."""

  class TTransposed(THead):
    def forward(self, xt):
      return super().forward(xt.T)
  torch.manual_seed(0)
  t = TTransposed().eval()
  r = jt.port_check(_port(t, "nnx"), t, X, torch_inputs=[X.T.copy()], **F32)
  assert r.suspects() == [] and not r.notes
  assert r.layer("(root)").floor < 1e-6


def test_nested_outputs_keep_the_roots_name(thead):
  """A module named ``output`` below the top (``block/output``) leaves the
  root its name ``'output'``."""

  class TNested(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.block = thead

    def forward(self, x):
      return torch.tanh(self.block(x))

  class JNested(nnx.Module):
    def __init__(self):
      self.block = _port(thead, "nnx")

    def __call__(self, x):
      return jnp.tanh(self.block(x))
  r = jt.port_check(JNested(), TNested().eval(), X, **F32)
  assert _names(r) == ["block/a", "block/output/dense", "block/output",
                       "block", "output"]
  assert list(r.alignment.values()) == [
      "block.a", "block.output.dense", "block.output", "block", "output"]
  assert r.suspects() == []


# ---------------------------------------------------------------------------
# Linen inside NNX (nnx.bridge.ToNNX).


class TFc(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.dense = torch.nn.Linear(D, D)

  def forward(self, x):
    return torch.nn.functional.gelu(self.dense(x))


class TBlk(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.fc = TFc()

  def forward(self, x):
    return torch.tanh(self.fc(x))


class TBridged(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.blk = TBlk()
    self.head = torch.nn.Linear(D, D)

  def forward(self, x):
    return self.head(self.blk(x))


class LFc(nn.Module):
  tanh_gelu: bool = False

  @nn.compact
  def __call__(self, x):
    return jax.nn.gelu(nn.Dense(D, name="dense")(x),
                       approximate=self.tanh_gelu)


class LBlk(nn.Module):
  tanh_gelu: bool = False

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(LFc(self.tanh_gelu, name="fc")(x))


class JBridged(nnx.Module):
  def __init__(self, tanh_gelu, rngs):
    self.blk = nnx.bridge.ToNNX(LBlk(tanh_gelu), rngs=rngs)
    self.head = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return self.head(self.blk(x))


@pytest.fixture(scope="module")
def tbridged():
  torch.manual_seed(1)
  return TBridged().eval()


def _bridged(t, tanh_gelu=False):
  m = JBridged(tanh_gelu, nnx.Rngs(0))
  nnx.bridge.lazy_init(m.blk, X)
  for k, v in _linear(t.blk.fc.dense).items():
    m.blk.fc["dense"][k][...] = v
  _copy(m.head, t.head)
  return m


def test_linen_layers_inside_to_nnx_are_paired_and_checked_alone(tbridged):
  model = _bridged(tbridged)
  r = jt.port_check(model, tbridged, X, **F32)
  fn, _, args = check_lib.module_outputs(model, (X,), {})
  assert _names(r) == list(fn(*args)) == [
      "blk/fc/dense", "blk/fc", "blk", "head", "output"]
  assert r.alignment == {n: n.replace("/", ".") for n in _names(r)[:-1]} | {
      "output": "output"}
  assert r.suspects() == [] and not r.notes
  # Alone on PyTorch's input: the float32 floor of one Dense, not NaN.
  assert 0 <= r.layer("blk/fc/dense").floor < 1e-6


def test_a_bug_in_a_linen_layer_inside_to_nnx_is_the_suspect(tbridged):
  r = jt.port_check(_bridged(tbridged, tanh_gelu=True), tbridged, X, **F32)
  assert r.suspects("float32") == ["blk/fc"]
  assert r.layer("blk").verdict["float32"] == "inside"
  assert r.layer("blk/fc/dense").verdict["float32"] == "ok"


def test_the_model_and_its_bridge_are_unchanged(tbridged):
  def values(model):
    return [np.array(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree_util.tree_leaves(nnx.state(model))]
  model = _bridged(tbridged)
  before = values(model)
  jt.port_check(model, tbridged, X, **F32)
  for a, b in zip(before, values(model), strict=True):
    np.testing.assert_array_equal(a, b)
  assert type(model.blk) is nnx.bridge.ToNNX


def test_children_named_output_and_root_leave_the_root_a_name_of_its_own():
  """Beside children named ``output`` and ``(root)`` the root is
  ``'((root))'``: no layer is lost or named twice, here or in
  check_module."""

  class TRoot(THead):
    def __init__(self):
      super().__init__()
      self.add_module("(root)", torch.nn.Linear(D, D))

    def forward(self, x):
      return getattr(self, "(root)")(super().forward(x))

  class JRoot(JHead):
    def __init__(self, rngs):
      super().__init__(rngs=rngs)
      setattr(self, "(root)", nnx.Linear(D, D, rngs=rngs))

    def __call__(self, x):
      return getattr(self, "(root)")(super().__call__(x))
  torch.manual_seed(0)
  t = TRoot().eval()
  j = JRoot(nnx.Rngs(0))
  for name in ("a", "(root)"):
    _copy(getattr(j, name), getattr(t, name))
  _copy(j.output.dense, t.output.dense)
  names = ["a", "output/dense", "output", "(root)", "((root))"]
  fn, _, args = check_lib.module_outputs(j, (X,), {})
  assert list(fn(*args)) == names
  r = jt.port_check(j, t, X, **F32)
  assert _names(r) == names
  assert r.alignment == {n: n.replace("/", ".") for n in names}
  assert r.suspects() == []


def test_a_function_port_pairs_its_output_with_the_pytorch_root(thead):
  """A function's output pairs with PyTorch's root, ``'(root)'`` beside
  its child ``output``, which is left unpaired with the other modules."""
  graphdef, state = nnx.split(_port(thead, "nnx"))

  def fn(x):
    return nnx.merge(graphdef, state)(x)
  r = jt.port_check(fn, thead, X, **F32)
  assert r.alignment == {"output": "(root)"}
  assert r.unpaired_torch == ("a", "output.dense", "output")
  assert r.suspects() == []
