"""The one "Unknown X ...; valid choices: ...; Did you mean" message
(jaxprec._src.core.names.unknown) and the entry points that raise it."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest

import jaxprec
from jaxprec._src.core import names


def _format(kind, value, choices, close=None):
  """The one message, as a regex."""
  listed = ", ".join(map(repr, choices))
  tail = "" if close is None else f" Did you mean {close!r}\\?"
  return (f"^Unknown {re.escape(kind)} {re.escape(repr(value))}; valid choices: "
          f"{re.escape(listed)}.*\\.{tail}$")


def test_message_names_the_value_and_every_choice():
  e = names.unknown("target", "tpuu", ("tpu", "gpu"))
  assert type(e) is ValueError
  assert str(e) == ("Unknown target 'tpuu'; valid choices: 'tpu', 'gpu'. "
                    "Did you mean 'tpu'?")
  e = names.unknown("size", 3, ("tiny", "small"), error=TypeError,
                    hint=" (or None)")
  assert type(e) is TypeError
  assert str(e) == "Unknown size 3; valid choices: 'tiny', 'small' (or None)."


def test_long_lists_are_cut_and_counted():
  choices = [f"layer_{i}" for i in range(20)]
  msg = str(names.unknown("layer", "nope", choices))
  assert "'layer_11', ... (20 in all)." in msg and "'layer_12'" not in msg


def test_the_error_type_is_kept():
  class MyKeyError(KeyError):
    pass
  with pytest.raises(MyKeyError, match="Unknown layer 'x'"):
    raise names.unknown("layer", "x", ("a",), error=MyKeyError)


@pytest.mark.parametrize("value, choices, close", [
    ("tpuu", ("tpu", "gpu"), "tpu"),          # a letter added
    ("tpv", ("tpu", "gpu"), "tpu"),           # a letter changed, short name
    ("f23", ("auto", "bf16", "f32"), "f32"),  # two letters swapped
    ("bf61", ("auto", "bf16", "f32"), "bf16"),
    ("DNESE", ("Dense", "Conv"), "Dense"),   # any letter case; offers the choice
    (" emulated ", ("auto", "emulate", "native"), "emulate"),
    ("rms", ("rel_rms", "max_abs"), "rel_rms"),  # one word of the name
    ("nonsense", ("none", "bf16"), None),    # 0.67 alike: not close
    ("xyz", ("tpu", "gpu"), None),
    ("x", ("y", "z"), None),                 # one edit of one letter is no hint
    ("", ("tpu",), None),
    (3, ("3", "4"), None),                   # only strings get a suggestion
])
def test_suggests_only_a_close_name(value, choices, close):
  assert names.close_name(value, choices) == close
  msg = str(names.unknown("thing", value, choices))
  assert ("Did you mean" in msg) == (close is not None)
  assert re.match(_format("thing", value, choices, close), msg), msg


def test_near_offers_an_aliases_canonical_name_or_nothing():
  aliases = {"bf16": "bfloat16", "bfloat16": "bfloat16", "half": "float16"}
  assert names.close_name("bf61", aliases) == "bfloat16"
  msg = str(names.unknown("format", "bf61", ("bfloat16", "float16"), near=aliases))
  assert msg.endswith("Did you mean 'bfloat16'?")
  msg = str(names.unknown("format", "bf61", ("bfloat16", "float16"), near=()))
  assert "Did you mean" not in msg


def test_check_choice_returns_the_choice_any_case():
  assert names.check_choice(" TPU ", ("tpu", "gpu"), "target") == "tpu"
  assert names.check_choice("dense", ("Dense",), "type") == "Dense"
  with pytest.raises(TypeError, match=_format("target", None, ("tpu", "gpu"))):
    names.check_choice(None, ("tpu", "gpu"), "target", error=TypeError)


def test_precision_names_share_the_suggestion():
  msg = names.invalid_message("F32_F32_F3", "unknown name")
  assert msg.startswith("Invalid precision 'F32_F32_F3': unknown name. "
                        "Did you mean 'F32_F32_F32'? Valid names: ")
  assert "Did you mean" not in names.invalid_message("nonsense", "unknown name")
  with pytest.raises(ValueError, match=r"^Invalid precision 'flaot32': unknown "
                                       r"name\. Did you mean 'float32'\? Valid names: "):
    jaxprec.resolve("flaot32")


def test_invalid_precision_message_is_short_and_grouped():
  """The suggestion within the first line's reach, the names grouped: every
  level and alias, the presets by count; valid_names() for the rest."""
  msg = names.invalid_message("bfloat61", "unknown name")
  assert msg.index("Did you mean 'bfloat16'?") < 60
  assert len(msg) < 500
  for level in ("bfloat16", "bfloat16_3x", "tensorfloat32", "float32",
                "backend-default"):
    assert level in msg
  for alias in ("bf16", "tf32", "fp32", "f32", "bf16_3x", "bf16_6x", "default",
                "fastest", "high", "highest", "medium"):
    assert re.search(rf"[(, ]{alias}[,); ]", msg), alias
  # The presets this JAX has (names.PRESETS_SINCE: newer ones are not).
  here = [p for p in names.PRESETS if not names.too_new(p)]
  assert f"{len(here)} lax.DotAlgorithmPreset names" in msg
  assert "jaxprec.valid_names()" in msg
  # Not every preset is spelled out: the count stands for them.
  assert "ANY_F8_ANY_F8_ANY_FAST_ACCUM" not in msg


def _report():
  from jaxprec._src.checker.metrics import LayerMetrics
  from jaxprec._src.checker.report import DivergenceReport, LayerResult
  m = LayerMetrics(max_abs=0.0, max_rel=0.0, rel_rms=0.0, cosine=1.0,
                   sqnr_db=40.0, ulp_median=0.0, ulp_max=0.0, frac_outside=0.0,
                   nan=0, inf=0, required_atol=0.0, size=1, ref_rms=1.0,
                   ref_max_abs=1.0)
  layers = tuple(LayerResult(name=n, shape=(1,), dtype="float32",
                             metrics={"bf16": m, "f32": m})
                 for n in ("emb", "hidden_states[1]"))
  return DivergenceReport(layers=layers, precisions=("bf16", "f32"),
                          reference="float64", target="tpu", mode="emulate",
                          backend="cpu", atol=1e-3, rtol=1e-3)


def _entry_points():
  from jaxprec._src.checker import metrics as metrics_lib
  from jaxprec._src.core import algorithms, numerics
  from jaxprec._src.emulation import kernels, rounding
  from jaxprec._src.inspect import chips
  from jaxprec._src.models.encoders import BertConfig
  from jaxprec._src.models.llama import LlamaConfig
  from jaxprec._src.policy import policy_text
  from jaxprec._src.search import search_dtype
  from jaxprec._src.torch import torch_ports
  x = jnp.ones((2,), jnp.float32)
  report = _report()
  return [
      # (id, call, error type, kind, bad value, choices, "did you mean")
      ("kernel", lambda: kernels.check_kernel("bf61"), ValueError,
       "emulation kernel", "bf61", kernels.KERNELS, "bf16"),
      ("kernel_for", lambda: kernels.kernel_for("tf33"), ValueError,
       "emulated algorithm", "tf33", algorithms.emulated(), "tf32"),
      ("target", lambda: numerics.check_target("tpuu"), ValueError, "target",
       "tpuu", numerics.TARGETS, "tpu"),
      ("emulation target", lambda: numerics.check_target("tpux", emulation=True),
       ValueError, "emulation target", "tpux", numerics.EMULATION_TARGETS, "tpu"),
      ("mode", lambda: numerics.resolve_mode("emulated", "tpu"), ValueError,
       "mode", "emulated", numerics.MODES, "emulate"),
      ("dtype", lambda: numerics.canonical_dtype("bflaot16"), ValueError,
       "dtype", "bflaot16", numerics.DTYPES, "bfloat16"),
      ("op", lambda: numerics.op_kind("dot"), ValueError, "op", "dot",
       ("dot_general", "conv_general_dilated"), "dot_general"),
      ("algorithm", lambda: algorithms.record("bf16x33"), ValueError,
       "algorithm", "bf16x33", tuple(algorithms.RECORDS)[:names._LISTED],
       "bf16x3"),
      ("backend", lambda: jaxprec.resolve("bf16").on("cuad"), ValueError,
       "backend", "cuad", ("tpu", "gpu", "cpu"), "gpu"),
      ("format", lambda: rounding.canonical_format("bfloat61"), ValueError,
       "format", "bfloat61", ("bfloat16", "tensorfloat32", "float16"), "bfloat16"),
      ("rounding mode", lambda: rounding.round_to(x, "bfloat16", "nearst"),
       ValueError, "rounding mode", "nearst", rounding.MODES, "nearest"),
      ("tf32 rounding", lambda: rounding.split_tf32(x, "truncat"), ValueError,
       "TF32 rounding", "truncat", ("nearest", "nearest_away", "truncate"),
       "truncate"),
      ("chip", lambda: chips.check_chip("tpu-v5ee"), ValueError, "chip",
       "tpu-v5ee", tuple(chips.CHIPS), "tpu-v5e"),
      ("op kind", lambda: policy_text.canonical_op("cnov"), ValueError,
       "op kind", "cnov", policy_text.OP_KINDS, "conv"),
      ("module type", lambda: jaxprec.Policy.parse("type:Dnese=bf16"),
       ValueError, "module type", "Dnese",
       (*policy_text.MODULE_TYPES, *policy_text.TYPE_ALIASES), "Dense"),
      ("axis", lambda: search_dtype.check_axes("precision,dtpye"), ValueError,
       "axis", "dtpye", search_dtype.AXES, "dtype"),
      ("axes", lambda: search_dtype.check_axes(3), ValueError, "axes", 3,
       search_dtype.AXES, None),
      ("report metric", lambda: report.metric("rel_rsm"), ValueError, "metric",
       "rel_rsm", (*metrics_lib.METRICS, "required_atol"), "rel_rms"),
      ("report precision", lambda: report.metric("max_abs", "bf61"), ValueError,
       "precision", "bf61", ("bf16", "f32"), "bf16"),
      ("report layer", lambda: report.layer("emd"), KeyError, "layer", "emd",
       ("emb", "hidden_states[1]"), "emb"),
      ("report floor", lambda: dataclasses.replace(report, floor="fp32"),
       ValueError, "floor", "fp32", ("bf16", "f32"), "f32"),
      ("model size", lambda: LlamaConfig.of_size("base"), ValueError, "size",
       "base", LlamaConfig.SIZES, None),
      ("model size typo", lambda: BertConfig.of_size("smal"), ValueError,
       "size", "smal", BertConfig.SIZES, "small"),
      ("twin", lambda: torch_ports.twin("hf-bret"), ValueError, "twin",
       "hf-bret", tuple(torch_ports.TWINS), "hf-bert"),
      ("port", lambda: torch_ports.port("hf-lama"), ValueError, "port",
       "hf-lama", tuple(torch_ports.PORTS), "hf-llama"),
  ]


_IDS = ["kernel", "kernel_for", "target", "emulation target", "mode", "dtype",
        "op", "algorithm", "backend", "format", "rounding mode", "tf32 rounding",
        "chip", "op kind", "module type", "axis", "axes", "report metric",
        "report precision", "report layer", "report floor", "model size",
        "model size typo", "twin", "port"]


@pytest.mark.parametrize("which", _IDS)
def test_every_entry_point_raises_the_one_message(which):
  cases = {c[0]: c[1:] for c in _entry_points()}
  assert sorted(cases) == sorted(_IDS)
  call, error, kind, value, choices, close = cases[which]
  with pytest.raises(error) as e:
    call()
  assert type(e.value) is error
  msg = e.value.args[0]
  if kind == "module type":  # inside the policy entry it came from
    msg = msg.split(": ", 1)[1]
  assert re.match(_format(kind, value, choices, close), msg), msg


@pytest.mark.parametrize("argv, kind, value, close", [
    (["check", "--model", "llama", "--size", "base"], "size", "base", None),
    (["search", "--model", "bert", "--tolerance", "0.02", "--axes", "dtpye"],
     "axis", "dtpye", "dtype"),
    (["search", "--model", "bert", "--tolerance", "0.02", "--axes", "dtype",
      "--chip", "tpu-v5ee"], "chip", "tpu-v5ee", "tpu-v5e"),
])
def test_cli_flags_report_the_one_message_on_one_line(capsys, argv, kind,
                                                       value, close):
  from jaxprec._src.cli.cli import main
  rc = main(argv)
  err = capsys.readouterr().err
  assert rc == 2, err
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxprec: error: "), err
  assert f"Unknown {kind} {value!r}; valid choices: " in lines[0]
  assert lines[0].endswith(f"Did you mean {close!r}?" if close else ".")
