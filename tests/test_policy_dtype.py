"""The dtype axis of policies: Rule(dtype=), Policy(default_dtype=), the grammar, errors."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
from jaxprec import Policy, Rule
from jaxprec._src.core import numerics
from jaxprec._src.policy.policy import reference_policy
from jaxprec._src.policy.policy_text import MODULE_TYPES, OP_KINDS

from conftest import policies

# -- the dtype table -----------------------------------------------------------------


@pytest.mark.parametrize("value, name", [
    ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("BF16", "bfloat16"),
    (jnp.bfloat16, "bfloat16"), (np.dtype(jnp.bfloat16), "bfloat16"),
    ("float16", "float16"), ("f16", "float16"), ("fp16", "float16"),
    ("half", "float16"), (np.float16, "float16"), (jnp.float16, "float16"),
    ("float32", "float32"), ("f32", "float32"), ("fp32", "float32"),
    (" Float32 ", "float32"), (np.float32, "float32"), (jnp.float32, "float32"),
    (np.dtype("float32"), "float32"),
])
def test_canonical_dtype_spellings(value, name):
  assert numerics.canonical_dtype(value) == name
  assert name in numerics.DTYPES


@pytest.mark.parametrize("value", ["float64", "f64", np.float64, jnp.float64, "double"])
def test_float64_only_for_reference_runs(value):
  with pytest.raises(ValueError, match="float64 is not a compute dtype a policy can give"):
    numerics.canonical_dtype(value)
  assert numerics.canonical_dtype(value, allow_float64=True) == "float64"


@pytest.mark.parametrize("value", ["int8", np.int32, "float8", 3, 1.5, None, True, "", object()])
def test_canonical_dtype_rejects_other_values_naming_the_choices(value):
  with pytest.raises(ValueError, match=r"Unknown dtype .*valid choices: 'bfloat16', "
                                       r"'float16', 'float32'"):
    numerics.canonical_dtype(value)


def test_dtype_bytes():
  assert numerics.DTYPE_BYTES == {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
  for name in numerics.DTYPES:
    assert numerics.DTYPE_BYTES[name] == np.dtype(jnp.dtype(name)).itemsize


# -- Rule and Policy values ------------------------------------------------------------


def test_rule_stores_the_dtype_name_and_needs_precision_or_dtype():
  r = Rule(path="dense_2", dtype=jnp.bfloat16)
  assert r.dtype == "bfloat16" and r.precision is None
  assert Rule(path="x", dtype="fp16") == Rule(path="x", dtype=np.float16)
  both = Rule(module_type="Dense", precision="f32", dtype="bf16")
  assert (both.precision.name, both.dtype) == ("float32", "bfloat16")
  with pytest.raises(ValueError, match="Rule 'dense_2' decides nothing: give precision=, "
                                       "dtype= or both"):
    Rule(path="dense_2")
  with pytest.raises(ValueError, match="needs at least one of path=, module_type=, op="):
    Rule(dtype="bf16")
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.dtype = "float32"


def test_unknown_dtypes_name_the_value_and_the_choices():
  with pytest.raises(ValueError, match=r"Rule 'x': Unknown dtype 'bflaot16'; valid choices: "
                                       r"'bfloat16', 'float16', 'float32'.*Did you mean "
                                       r"'bfloat16'\?"):
    Rule(path="x", dtype="bflaot16")
  with pytest.raises(ValueError, match=r"Policy default_dtype: Unknown dtype 'flaot32'.*"
                                       r"Did you mean 'float32'\?"):
    Policy(default_dtype="flaot32")
  with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
    Policy(default_dtype=np.int8)


def test_match_dtype_and_match_each_see_only_their_axis():
  p = Policy(rules=(Rule(path=".*LayerNorm.*", dtype="float32"),
                    Rule(module_type="Dense", precision="tf32"),
                    Rule(path="enc/.*", precision="f32", dtype="f16")),
             default="bf16", default_dtype="bfloat16")
  # dtype-only rule: decides no precision; precision-only rule: no dtype.
  assert p.match("enc/LayerNorm") == (p.rules[2].precision, p.rules[2])
  assert p.match_dtype("enc/LayerNorm") == ("float32", p.rules[0])
  assert p.match_dtype("dec/dense", "Dense") == ("bfloat16", None)
  assert p.match("dec/dense", "Dense") == (p.rules[1].precision, p.rules[1])
  assert p.match_dtype("enc/dense", "Dense", "dot") == ("float16", p.rules[2])
  assert p.dtype_for("x") == "bfloat16" and p.precision_for("x").name == "bfloat16"
  assert Policy(rules=(Rule(op="conv", precision="bf16"),)).match_dtype("x", None, "conv") == (
      None, None)
  assert Policy(rules=(Rule(op="conv", dtype="bf16"),)).precision_for("x", None, "conv") is None


def test_has_dtypes():
  assert not Policy.parse("default=bf16,conv=tf32").has_dtypes
  assert not Policy().has_dtypes
  assert Policy(default_dtype="bf16").has_dtypes
  assert Policy.parse("conv=tf32,dense_2=dtype:bf16").has_dtypes
  assert Policy.parse("Dense=f32+dtype:bf16").has_dtypes


# -- the grammar ------------------------------------------------------------------------


@pytest.mark.parametrize("text, rules, default, default_dtype, written", [
    ("dense_2=dtype:bfloat16", [Rule(path="dense_2", dtype="bfloat16")], None, None,
     "dense_2=dtype:bfloat16"),
    ("default=dtype:bfloat16,.*LayerNorm.*=dtype:float32",
     [Rule(path=".*LayerNorm.*", dtype="float32")], None, "bfloat16",
     "default=dtype:bfloat16,.*LayerNorm.*=dtype:float32"),
    ("default=bf16+dtype:float32", [], "bfloat16", "float32",
     "default=bfloat16+dtype:float32"),
    ("Dense=float32+dtype:bfloat16", [Rule(module_type="Dense", precision="f32", dtype="bf16")],
     None, None, "Dense=float32+dtype:bfloat16"),
    # Items in any order and spelling; 'precision:' is explicit.
    (" Dense = dtype:BF16 + precision:f32 ", [Rule(module_type="Dense", precision="f32",
                                                   dtype="bf16")],
     None, None, "Dense=float32+dtype:bfloat16"),
    ("default=dtype:half, conv=tf32", [Rule(op="conv", precision="tf32")], None, "float16",
     "default=dtype:float16,conv=tensorfloat32"),
    ("x=precision:bf16", [Rule(path="x", precision="bf16")], None, None, "x=bfloat16"),
    ("a+b=dtype:f32", [Rule(path="a+b", dtype="f32")], None, None, "a+b=dtype:float32"),
])
def test_parse_values(text, rules, default, default_dtype, written):
  p = Policy.parse(text)
  assert list(p.rules) == rules
  assert p.default == (None if default is None else jaxprec.resolve(default))
  assert p.default_dtype == default_dtype
  assert str(p) == written
  assert Policy.parse(str(p)) == p
  assert eval(repr(p), {"jaxprec": jaxprec}) == p  # noqa: S307 -- our own repr


def test_rule_repr_and_str():
  r = Rule(path="a", module_type="Dense", precision="bf16", dtype="f32")
  assert repr(r) == ("jaxprec.Rule(path='a', module_type='Dense', precision='bfloat16', "
                     "dtype='float32')")
  assert repr(Rule(path="a", dtype="f16")) == "jaxprec.Rule(path='a', dtype='float16')"
  assert str(r) == "a&Dense=bfloat16+dtype:float32"


@pytest.mark.parametrize("text, message", [
    ("dense_2=dtype:bflaot16", ("Invalid policy entry 'dense_2=dtype:bflaot16': Unknown dtype "
                                "'bflaot16'; valid choices: 'bfloat16', 'float16', 'float32'")),
    ("dense_2=dtype:bflaot16", "Did you mean 'bfloat16'?"),
    ("dense_2=dtyp:bfloat16", ("Invalid policy entry 'dense_2=dtyp:bfloat16': Invalid "
                               "precision 'dtyp:bfloat16': unknown name.")),
    ("dense_2=dtyp:bfloat16", "Did you mean 'dtype:bfloat16'?"),
    ("x=precison:f32", "Did you mean 'precision:f32'?"),
    ("default=dtype:float64", "float64 is not a compute dtype"),
    ("x=bf16+f32", "Invalid policy entry 'x=bf16+f32': two precisions."),
    ("x=dtype:bf16+dtype:f32", "Invalid policy entry 'x=dtype:bf16+dtype:f32': two dtypes."),
    ("x=bf16+", "Invalid policy entry 'x=bf16+': empty item"),
    ("x=+dtype:bf16", "empty item"),
    ("x=dtype:", "Unknown dtype ''"),
    ("x=", "Invalid policy entry 'x=': empty precision"),
    ("default=dtype:bf16,default=f32", "two 'default' entries"),
    ("default=bf16,default=dtype:f32", "two 'default' entries"),
])
def test_malformed_dtype_entries_name_the_bad_part(text, message):
  with pytest.raises(ValueError) as e:
    Policy.parse(text)
  assert message in str(e.value), str(e.value)


def test_a_misspelt_dtype_prefix_suggests_only_the_prefix():
  with pytest.raises(ValueError) as e:
    Policy.parse("x=dtyp:bfloat16")
  assert str(e.value).count("Did you mean") == 1


_REGEX_PIECES = st.sampled_from(
    ["enc", "layer", r"\d+", "/", ".*", "(a|b)", "[,&+]", "x{1,2}", ",", "&", "=", "+",
     "default", "conv", "Dense", "op:", "path:", "dtype:", " ", "LayerNorm"])
_DTYPES = st.sampled_from(["bfloat16", "bf16", "float16", "half", "float32", "fp32",
                           jnp.bfloat16, np.float32, np.dtype("float16")])


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(policies(_REGEX_PIECES, _DTYPES))
def test_str_round_trips_through_parse_with_dtypes(policy):
  text = str(policy)
  back = Policy.parse(text)
  assert back == policy and hash(back) == hash(policy)
  assert str(back) == text
  for r in policy.rules:  # precision first, then the dtype
    value = str(r)[len(r._selector()) + 1:]  # noqa: SLF001
    assert value == "+".join(
        ([r.precision.name] if r.precision else []) + ([f"dtype:{r.dtype}"] if r.dtype else []))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(policies(_REGEX_PIECES, _DTYPES), st.sampled_from(["enc/layer/0", "LayerNorm", "x", "", "a/Dense"]),
                  st.sampled_from((None, *MODULE_TYPES)), st.sampled_from(OP_KINDS))
def test_each_axis_is_decided_by_the_first_rule_that_sets_it(policy, path, mtype, op):
  dtype, rule = policy.match_dtype(path, mtype, op)
  want = next((r for r in policy.rules if r.dtype is not None and r.matches(path, mtype, op)),
              None)
  assert rule is want
  assert dtype == (policy.default_dtype if want is None else want.dtype)
  precision, prule = policy.match(path, mtype, op)
  want = next((r for r in policy.rules
               if r.precision is not None and r.matches(path, mtype, op)), None)
  assert prule is want
  assert precision == (policy.default if want is None else want.precision)


# -- the float64 reference policy -------------------------------------------------------


def test_reference_policy_runs_every_module_at_the_reference_dtype():
  base = Policy.parse("default=bf16+dtype:bf16,a=f32+dtype:f16,b=dtype:f32")
  p = reference_policy("float64", base)
  assert p.default_dtype == "float64" and p.default == base.default
  assert p.rules == (Rule(path="a", precision="f32"),)  # dtype rules dropped
  assert p.dtype_for("b") == "float64" and p.precision_for("a").name == "float32"
  assert str(p) == "default=bfloat16+dtype:float64,a=float32"
  assert reference_policy(jnp.float32) == Policy(default_dtype="float32")
  with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
    reference_policy("int8")
