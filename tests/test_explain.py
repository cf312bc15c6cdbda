"""Tests for jaxprec.explain and explain_dict."""

import json
import os

import jax
import pytest

import jaxprec
from jaxprec._src.inspect.explain import explain, explain_dict

pytestmark = pytest.mark.filterwarnings("ignore::jaxprec.PresetConvWarning")


@pytest.fixture
def backend_default():
  """No scope and no global setting: the backend default is in force."""
  before = jaxprec.set_default(None)
  try:
    yield
  finally:
    jaxprec.set_default(before)


def test_dict_is_json_and_describes_the_backend():
  d = json.loads(json.dumps(explain_dict()))
  assert d["backend"] == jax.default_backend() == "cpu"
  assert d["jax_version"] == jax.__version__
  assert d["jaxprec_version"] == jaxprec.__version__
  assert [x["id"] for x in d["devices"]] == [x.id for x in jax.devices()]
  assert d["devices"][0]["platform"] == "cpu"
  assert d["env"]["name"] == "JAX_DEFAULT_MATMUL_PRECISION"


@pytest.mark.parametrize("p, name, flag, tpu_bits, gpu_alg", [
    ("bf16", "bfloat16", "bfloat16", 8, "tf32"),
    ("highest", "float32", "float32", 24, "f32"),
    ("BF16_BF16_F32_X3", "BF16_BF16_F32_X3", "BF16_BF16_F32_X3", 16, "bf16x3"),
])
def test_dict_in_a_scope(p, name, flag, tpu_bits, gpu_alg):
  with jaxprec.precision(p):
    d = explain_dict()
  assert d["precision"]["name"] == name
  assert d["precision"]["source"] == "context"
  assert d["precision"]["flag"] == flag
  assert d["numerics"]["tpu"]["operand_bits"] == tpu_bits
  assert d["numerics"]["gpu"]["algorithm"] == gpu_alg
  # CPU computes exact float32 whatever the setting.
  assert d["numerics"]["here"] == d["numerics"]["cpu"]
  assert d["numerics"]["cpu"]["algorithm"] == "f32"


def test_preset_is_reported_with_its_level():
  with jaxprec.precision("F32_F32_F32"):
    d = explain_dict()
  assert (d["precision"]["preset"], d["precision"]["level"]) == ("F32_F32_F32",
                                                                 "HIGHEST")


def test_backend_default_source(backend_default):
  d = explain_dict()
  assert (d["precision"]["name"], d["precision"]["source"]) == (
      "backend-default", "backend-default")
  assert d["precision"]["flag"] is None
  assert d["numerics"]["tpu"]["algorithm"] == "bf16x1"
  text = explain()
  assert "precision in force: backend-default (source: backend-default, " \
         "nothing is set" in text


def test_config_source(backend_default):
  jaxprec.set_default("tf32")
  d = explain_dict()
  assert (d["precision"]["name"], d["precision"]["source"]) == ("tensorfloat32",
                                                                "config")


def test_text_lines():
  with jaxprec.precision("float32"):
    lines = explain().splitlines()
  assert lines[0] == f"jaxprec {jaxprec.__version__}, jax {jax.__version__}"
  assert lines[1].startswith("backend: cpu, 1 device(s): cpu")
  assert lines[2].startswith("precision in force: float32 (source: context, ")
  assert lines[3].endswith("value for jax.default_matmul_precision: 'float32'")
  text = "\n".join(lines)
  assert "  here (cpu): f32: exact float32: CPU ignores every precision level" in text
  assert "  TPU: bf16x6: 6 bfloat16 passes" in text
  assert "  GPU: f32: exact float32 (24 significand bits" in text


def test_text_says_how_to_change_and_the_pitfalls():
  text = explain()
  for how in ("@jaxprec.precision('float32')", "JAX_DEFAULT_MATMUL_PRECISION=float32",
              "jaxprec run -p float32 -- python train.py",
              "jaxprec.set_default('float32')", "precision='float32'"):
    assert how in text
  pitfalls = text.split("pitfalls:\n")[1]
  assert "CPU ignores the precision entirely" in pitfalls
  assert "jaxprec.emulate" in pitfalls
  assert "Presets downgrade convolutions" in pitfalls
  assert "Attention-score matmuls" in pitfalls


def _cell(n):
  return n.algorithm if n.passes == 0 else f"{n.algorithm} ({n.operand_bits} bits)"


def test_docs_precision_table_matches_resolve():
  path = os.path.join(os.path.dirname(__file__), "..", "docs", "precision.md")
  with open(path) as f:
    rows = [line for line in f if line.startswith("| `") and line.count("|") == 7]
  seen = set()
  for line in rows:
    name, flag, level, tpu, gpu, cpu = [c.strip() for c in line.strip("|\n").split("|")]
    p = jaxprec.resolve(name.strip("`"))
    assert p.name == name.strip("`")
    assert flag == (f"`{p.flag}`" if p.flag else "(unset)"), line
    assert (level, tpu, gpu, cpu) == (p.level.name, _cell(p.tpu), _cell(p.gpu),
                                      _cell(p.cpu)), line
    seen.add(p.name)
  # Every canonical name is documented.
  canonical = {jaxprec.resolve(n).name for n in jaxprec.valid_names()}
  assert seen == canonical


def test_explain_names_the_kernel_and_why():
  with jaxprec.use_kernel("f32"):
    d = explain_dict()
    text = jaxprec.explain()
  assert d["kernel"]["setting"] == "f32" and d["kernel"]["source"] == "scope"
  assert set(d["kernel"]["per_algorithm"].values()) == {"f32"}
  assert ("emulation kernel: f32 (source: scope): f32 dots for bf16x1, bf16x3, "
          "bf16x6, bf16x9, tf32x3") in text
  assert "why: set by jaxprec.use_kernel" in text
  auto = explain_dict()["kernel"]
  if auto["setting"] == "auto" and d["backend"] == "cpu":
    assert auto["ratio"] in (0.55, 1.16)
    assert "chosen from the CPU's feature flags, not timed" in auto["reason"]
    assert auto["bf16_units"] == list(jaxprec.bf16_dot_units())
