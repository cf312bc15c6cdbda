"""A port check's report and progress are readable.

* Parameterless PyTorch layers (activations, dropout, identity: modules with
  no parameters, their children's included) left unpaired are counted, not
  listed, unless ``full=True``; the JSON lists them all.
* Layer names are never cut: a name longer than its column is folded onto
  the following lines, never shortened with an ellipsis.
* ``progress=True`` says every long phase: a line per phase on a pipe.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxprec.torch as jt  # noqa: E402

D = 8


class TBlock(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(D, D)
    self.act = torch.nn.GELU()
    self.drop = torch.nn.Dropout(0.1)
    self.skip = torch.nn.Identity()
    self.tail = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Identity())

  def forward(self, x):
    return self.skip(x) + self.tail(self.drop(self.act(self.fc(x))))


class TNet(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.blocks = torch.nn.ModuleList([TBlock() for _ in range(2)])
    # A module with parameters (its child's) that the JAX port does not have.
    self.extra = torch.nn.Sequential(torch.nn.Linear(D, D))

  def forward(self, x):
    for b in self.blocks:
      x = b(x)
    return x + 0.0 * self.extra(x)


class JBlock(nnx.Module):
  def __init__(self, t):
    self.fc = nnx.Linear(D, D, rngs=nnx.Rngs(0))
    self.fc.kernel[...] = t.fc.weight.detach().numpy().T
    self.fc.bias[...] = t.fc.bias.detach().numpy()

  def __call__(self, x):
    return x + jax.nn.relu(jax.nn.gelu(self.fc(x), approximate=False))


class JNet(nnx.Module):
  def __init__(self, t):
    self.blocks = nnx.List([JBlock(b) for b in t.blocks])

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return x


PARAMETERLESS = [f"blocks.{i}.{n}" for i in range(2)
                 for n in ("skip", "act", "drop", "tail.0", "tail.1", "tail")]


@pytest.fixture(scope="module")
def report():
  torch.manual_seed(0)
  t = TNet().eval()
  x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
  return jt.port_check(JNet(t), t, x, precisions=("float32",))


def test_parameterless_torch_layers_are_counted_not_listed(report):
  unpaired = set(report.unpaired_torch)
  assert set(PARAMETERLESS) <= unpaired
  assert {"extra", "extra.0"} <= unpaired
  assert set(report.parameterless_torch) == set(PARAMETERLESS)
  text = report.table()
  listed = next(l for l in text.splitlines()
                if l.startswith("PyTorch layers without a JAX partner"))
  assert "extra" in text
  assert not any(n in text.replace("extra.0", "") for n in
                 ("blocks.0.act", "blocks.1.drop", "blocks.0.skip"))
  assert f"{len(PARAMETERLESS)} without parameters" in text
  assert listed
  full = report.table(full=True)
  assert all(n in full for n in PARAMETERLESS)
  js = json.loads(report.to_json())
  assert set(PARAMETERLESS) <= set(js["unpaired_torch"])
  assert set(js["parameterless_torch"]) == set(PARAMETERLESS)


def _name_column(text: str) -> list[str]:
  lines = text.splitlines()
  head = next(i for i, l in enumerate(lines) if l.startswith("layer "))
  width = lines[head].index(" row") - 1
  body = []
  for l in lines[head + 2:]:
    if l.startswith("suspects at "):
      break
    body.append(l[:width].strip())
  return body


def _folded(name: str, column: list[str]) -> bool:
  """Whether ``name`` is the text of consecutive lines of the column."""
  for i in range(len(column)):
    joined = ""
    for piece in column[i:]:
      joined += piece
      if joined == name:
        return True
      if not name.startswith(joined):
        break
  return False


@pytest.mark.parametrize("width", [80, 100, 140])
def test_long_names_are_folded_whole_never_cut(width):
  long = "a_rather_long_module_name_that_keeps_going"
  torch.manual_seed(0)

  class Deep(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.add_module(long, torch.nn.Sequential(torch.nn.Linear(D, D)))

    def forward(self, x):
      return getattr(self, long)(x)

  class JDeep(nnx.Module):
    def __init__(self, t):
      inner = nnx.Module()
      inner.dense_projection_with_a_long_name = nnx.Linear(D, D,
                                                           rngs=nnx.Rngs(0))
      lin = t.get_submodule(f"{long}.0")
      inner.dense_projection_with_a_long_name.kernel[...] = (
          lin.weight.detach().numpy().T)
      inner.dense_projection_with_a_long_name.bias[...] = (
          lin.bias.detach().numpy())
      setattr(self, long, inner)

    def __call__(self, x):
      return getattr(self, long).dense_projection_with_a_long_name(x)

  t = Deep().eval()
  x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
  r = jt.port_check(JDeep(t), t, x, precisions=("float32", "bfloat16"))
  text = r.table(width=width)
  assert "…" not in text
  assert max(map(len, text.splitlines())) <= width
  name = f"{long}/dense_projection_with_a_long_name"
  assert name in r.alignment
  column = _name_column(text)
  assert _folded(name, column), column
  assert _folded(f"↳ {long}.0", column) or _folded(f"↳{long}.0", column)


def test_progress_says_each_phase_on_a_pipe(capsys):
  torch.manual_seed(0)
  t = TNet().eval()
  x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
  jt.port_check(JNet(t), t, x, precisions=("float32", "bfloat16"))
  assert capsys.readouterr().err == ""
  jt.port_check(JNet(t), t, x, precisions=("float32", "bfloat16"),
                progress=True)
  err = capsys.readouterr().err.splitlines()
  assert all(l.startswith("jaxprec port check: ") for l in err), err
  text = "\n".join(err)
  for phase in ("running PyTorch", "running JAX at float32", "pairing",
                "full run at float32",
                "full run at bfloat16 (row 2/2)",
                "alone at bfloat16"):
    assert phase in text, text
  assert err[-1].startswith("jaxprec port check: done in ")


def test_a_policy_row_reaches_each_nnx_module_of_the_port():
  # The port's modules run through the one per-module hook, so a policy's
  # path rule decides for them, as it does for linen modules.
  torch.manual_seed(0)
  t = TNet().eval()
  x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
  policy = "default=bfloat16,blocks/0/fc=float32"
  r = jt.port_check(JNet(t), t, x, precisions=("bfloat16", policy))
  fc0, fc1 = r.layer("blocks/0/fc"), r.layer("blocks/1/fc")
  assert fc0.envelope["bfloat16"] > 1e-3
  assert fc0.envelope[policy] < 1e-6  # float32 (six bfloat16 passes)
  assert fc1.envelope[policy] == fc1.envelope["bfloat16"] > 1e-3
