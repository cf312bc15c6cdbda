"""jaxprec check MODULE:FUNCTION --reference pytorch:MODULE:FUNCTION.

Two small files make the models: an NNX port (with GELU's tanh
approximation, or right) and its PyTorch original with the same weights.
"""

import json
import re
import textwrap

import pytest

pytest.importorskip("torch")

from conftest import one_line_error, run_cli  # noqa: E402


def _cells(line: str) -> list[str]:
  """A table line's cells, drawn by rich (in a box) or as plain text."""
  return [c for c in re.split(r"[┃│]|\s{2,}", line.strip(" ┃│")) if c.strip()]

MODELS = textwrap.dedent('''
    import jax
    import numpy as np
    import torch
    from flax import nnx

    torch.manual_seed(0)
    PT = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                             torch.nn.Linear(16, 8)).eval()
    X = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)


    class Port(nnx.Module):
      def __init__(self, approximate):
        self.fc1 = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
        self.fc2 = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
        for j, t in ((self.fc1, PT[0]), (self.fc2, PT[2])):
          j.kernel[...] = t.weight.detach().numpy().T
          j.bias[...] = t.bias.detach().numpy()
        self.approximate = approximate

      def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=self.approximate))


    def right():
      return Port(False), (X,)


    def tanh():
      return Port(True), (X,)


    def original():
      return PT, (X,)
''')


@pytest.fixture
def models(tmp_path, monkeypatch):
  (tmp_path / "ports.py").write_text(MODELS)
  monkeypatch.chdir(tmp_path)
  return tmp_path


def test_a_suspect_exits_1_and_names_it(models, capsys):
  rc, out, err = run_cli(capsys, "check", "ports.py:tanh", "--reference",
                         "pytorch:ports.py:original", "--out", "rep")
  one_line_error(rc, err, 1, "suspects", "float32: output")
  assert "suspects at float32: output" in out
  report = json.loads((models / "rep" / "report.json").read_text())
  assert report["suspects"]["float32"] == ["output"]
  assert report["alignment"] == {"fc1": "0", "fc2": "2", "output": "output"}


def test_a_correct_port_exits_0(models, capsys):
  rc, out, err = run_cli(capsys, "check", "ports.py:right", "--reference",
                         "pytorch:ports.py:original", "--out", "rep",
                         "--precisions", "float32,bfloat16", "--json")
  assert rc == 0, err
  report = json.loads(out)
  assert report["suspects"] == {"float32": [], "bfloat16": []}
  assert report["unpaired_torch"] == ["1"]  # the GELU module


def test_progress_on_a_pipe_and_parameterless_layers_counted_unless_full(
    models, capsys):
  rc, out, err = run_cli(capsys, "check", "ports.py:right", "--reference",
                         "pytorch:ports.py:original", "--out", "rep")
  assert rc == 0, err
  phases = [l for l in err.splitlines()
            if l.startswith("jaxprec port check: ")]
  assert any("full run at bfloat16 (row 2/2)" in l for l in phases), err
  assert any("layers alone at bfloat16" in l for l in phases), err
  assert phases[-1].startswith("jaxprec port check: done in ")
  assert ("PyTorch layers without a JAX partner: 1 without parameters "
          "(activations, dropout, identities; full=True or --full lists "
          "them)") in " ".join(out.split()), out
  rc, out, err = run_cli(capsys, "check", "ports.py:right", "--reference",
                         "pytorch:ports.py:original", "--out", "rep",
                         "--full")
  assert rc == 0, err
  assert "PyTorch layers without a JAX partner: 1" in out.splitlines()


def test_options_that_do_not_apply_are_refused(models, capsys):
  rc, _, err = run_cli(capsys, "check", "ports.py:right", "--reference",
                       "pytorch:ports.py:original", "--atol", "1e-3")
  one_line_error(rc, err, 2, "--atol does not apply")
  rc, _, err = run_cli(capsys, "check", "ports.py:right", "--reference",
                       "pytorch:ports.py:nothing")
  one_line_error(rc, err, 2, "'ports.py' has no attribute 'nothing'")


# ---------------------------------------------------------------------------
# The built-in ports: jaxprec check --model hf-... --reference pytorch.


@pytest.fixture
def one_layer(monkeypatch, tmp_path):
  """Built-in ports of one transformer layer by default, run in
  ``tmp_path``."""
  pytest.importorskip("transformers")
  from jaxprec._src.torch import torch_ports  # noqa: PLC0415
  monkeypatch.setattr(torch_ports, "_LAYERS", 1)
  monkeypatch.chdir(tmp_path)
  return tmp_path


def test_a_builtin_port_prints_the_port_check_table_and_exits_0(one_layer,
                                                                 capsys):
  rc, out, err = run_cli(capsys, "check", "--model", "hf-llama",
                         "--reference", "pytorch", "--out", "rep")
  assert rc == 0, err
  lines = out.splitlines()
  assert lines[0] == ("model: hf-llama (jaxprec's NNX port, seed 0) against "
                      "the PyTorch LlamaModel")
  # piped: the table as `jaxprec check` draws any report, as wide as it needs
  assert [c.strip() for c in _cells(lines[3])] == [
      "layer", "row", "floor", "noise", "envelope", "local", "propagated",
      "verdict"]
  assert "suspects at float32: none" in lines
  assert "suspects at bfloat16: none" in lines
  assert any(_cells(l)[0].strip() == "layers/0/mlp"
             and _cells(l)[-1].strip() == "ok" for l in lines), out
  assert "…" not in out
  report = json.loads((one_layer / "rep" / "report.json").read_text())
  assert report["alignment"]["layers/0/mlp"] == "layers.0.mlp"


def test_a_bug_planted_in_a_builtin_port_exits_1_and_names_it(
    one_layer, capsys, monkeypatch):
  from jaxprec._src.torch import torch_ports  # noqa: PLC0415
  build = torch_ports.port

  def with_a_wrong_bias(name, seed=0, **kwargs):
    port = build(name, seed, layers=2)
    ln = port.model.encoder.layer[1].output.LayerNorm
    ln.bias[...] = ln.bias[...] + 0.5
    return port
  monkeypatch.setattr(torch_ports, "port", with_a_wrong_bias)
  rc, out, err = run_cli(capsys, "check", "--model", "hf-bert",
                         "--reference", "pytorch", "--precisions", "bfloat16",
                         "--out", "rep")
  one_line_error(rc, err, 1, "suspects",
                 "bfloat16: encoder/layer/1/output/LayerNorm")
  assert any(_cells(l)[0].strip() == "encoder/layer/1/output/LayerNorm"
             and _cells(l)[-1].strip() == "SUSPECT"
             for l in out.splitlines() if _cells(l)), out
  assert "…" not in out


@pytest.mark.parametrize("flag", [["--atol", "1e-3"], ["--rtol", "0"],
                                  ["--policy", "default=bfloat16"],
                                  ["--mode", "emulate"]])
def test_options_a_builtin_port_check_has_no_use_for_are_refused(
    one_layer, capsys, flag):
  rc, _, err = run_cli(capsys, "check", "--model", "hf-bert", "--reference",
                       "pytorch", *flag)
  one_line_error(rc, err, 2, f"{flag[0]} does not apply", "port_check_builtin")
