"""jaxprec.Policy and jaxprec.Rule: matching, the text grammar, errors, emulate(fn, policy)."""

import dataclasses
import re
import warnings

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxprec
from jaxprec import Policy, Rule
from jaxprec._src.emulation import emulated_ops
from jaxprec._src.jaxpr import walker
from jaxprec._src.policy.policy import as_policy
from jaxprec._src.policy.policy_text import TYPE_ALIASES

from conftest import policies

# -- matching -------------------------------------------------------------------


def test_first_matching_rule_wins_then_default():
  p = Policy(rules=(Rule(path=r"encoder/layer/\d+/attention/.*", precision="f32"),
                    Rule(module_type="Dense", precision="tf32"),
                    Rule(op="conv", precision="bf16_3x")),
             default="bf16")
  assert p.precision_for("encoder/layer/3/attention/self/query", "Dense").name == "float32"
  assert p.precision_for("encoder/layer/3/output/dense", "Dense").name == "tensorfloat32"
  assert p.precision_for("stem/conv", "Conv", "conv").name == "bfloat16_3x"
  assert p.precision_for("pooler", None, "dot").name == "bfloat16"
  prec, rule = p.match("encoder/layer/3/output/dense", "Dense", "dot")
  assert rule is p.rules[1] and prec is rule.precision
  assert p.match("pooler") == (p.default, None)


def test_paths_match_whole_path_not_a_substring():
  p = Policy(rules=(Rule(path="attention", precision="f32"),))
  assert p.precision_for("attention") is not None
  assert p.precision_for("encoder/attention") is None  # fullmatch, not search
  assert p.precision_for("attention/query") is None


def test_all_criteria_of_a_rule_must_match():
  r = Rule(path="enc/.*", module_type="Dense", op="dot", precision="bf16")
  assert r.matches("enc/a", "Dense", "dot")
  assert not r.matches("dec/a", "Dense", "dot")
  assert not r.matches("enc/a", "Conv", "dot")
  assert not r.matches("enc/a", "Dense", "attention")


def test_no_rule_and_no_default_leaves_the_op_alone():
  assert Policy().match("any", "Dense", "dot") == (None, None)
  assert Policy(rules=(Rule(op="conv", precision="bf16"),)).precision_for("x") is None


def test_types_ops_and_precisions_are_canonicalised():
  r = Rule(module_type="linear", op="CONV", precision="FP32")
  assert (r.module_type, r.op, r.precision) == ("Dense", "conv",
                                                 jaxprec.resolve("float32"))
  for alias, canon in TYPE_ALIASES.items():
    assert Rule(module_type=alias, precision="bf16").module_type == canon
  assert Policy(default=lax.Precision.HIGHEST).default.name == "float32"


def test_values_are_frozen_hashable_and_compare_by_value():
  a = Policy.parse("default=bf16,conv=tf32,.*attention.*=f32")
  b = Policy.parse("default = bfloat16 , conv = tensorfloat32, .*attention.* = float32")
  assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.default = None
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.rules[0].precision = None
  assert Policy(rules=[Rule(op="dot", precision="bf16")]).rules == (
      Rule(op="dot", precision="bf16"),)  # a list becomes a tuple


# -- the text grammar -------------------------------------------------------------


def test_parse_the_documented_example():
  p = Policy.parse("default=bfloat16,conv=tensorfloat32,.*attention.*=float32")
  assert p.default.name == "bfloat16"
  assert p.rules == (Rule(op="conv", precision="tensorfloat32"),
                     Rule(path=".*attention.*", precision="float32"))
  assert str(p) == "default=bfloat16,conv=tensorfloat32,.*attention.*=float32"


@pytest.mark.parametrize("text, rules", [
    ("Conv=tf32", [Rule(module_type="Conv", precision="tf32")]),
    ("conv=tf32", [Rule(op="conv", precision="tf32")]),
    ("Attention=f32,attention=bf16", [Rule(module_type="Attention", precision="f32"),
                                      Rule(op="attention", precision="bf16")]),
    ("type:conv=tf32", [Rule(module_type="Conv", precision="tf32")]),
    ("op:Conv=tf32", [Rule(op="conv", precision="tf32")]),
    ("path:conv=tf32", [Rule(path="conv", precision="tf32")]),
    ("path:default=tf32", [Rule(path="default", precision="tf32")]),
    ("dense=tf32", [Rule(path="dense", precision="tf32")]),  # lower case: a path
    ("Dense&encoder/.*&dot=bf16", [Rule(path="encoder/.*", module_type="Dense",
                                        op="dot", precision="bf16")]),
    (r"layers_\d{1,2}/(a|b)=bf16", [Rule(path=r"layers_\d{1,2}/(a|b)", precision="bf16")]),
    (r"x[,&=]y=bf16", [Rule(path="x[,&=]y", precision="bf16")]),
    (r"a\,b\&c=bf16", [Rule(path="a,b&c", precision="bf16")]),
    ("(?=enc).*=bf16", [Rule(path="(?=enc).*", precision="bf16")]),
    ("a=b=bf16", [Rule(path="a=b", precision="bf16")]),  # the last '=' splits
    ("Linear=F32_F32_F32", [Rule(module_type="Dense", precision="F32_F32_F32")]),
])
def test_parse_terms(text, rules):
  p = Policy.parse(text)
  assert list(p.rules) == rules and p.default is None
  assert Policy.parse(str(p)) == p


def test_empty_string_is_the_empty_policy_and_a_policy_parses_to_itself():
  assert Policy.parse("") == Policy() and str(Policy()) == ""
  p = Policy.parse("conv=bf16")
  assert Policy.parse(p) is p


def test_default_may_come_anywhere_and_is_written_first():
  p = Policy.parse("conv=bf16, default=f32, Dense=tf32")
  assert str(p) == "default=float32,conv=bfloat16,Dense=tensorfloat32"


def test_repr_round_trips():
  p = Policy.parse(r"default=bf16,a\,b=f32")
  assert repr(p) == r"jaxprec.Policy.parse('default=bfloat16,a\\,b=float32')"
  assert eval(repr(p), {"jaxprec": jaxprec}) == p  # noqa: S307 -- our own repr


_REGEX_PIECES = st.sampled_from(
    ["enc", "layer", r"\d+", "/", ".*", "(a|b)", "[,&]", "x{1,2}", ",", "&", "=",
     "default", "conv", "Dense", "op:", "path:", " ", "é"])


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(policies(_REGEX_PIECES))
def test_str_round_trips_through_parse(policy):
  assert Policy.parse(str(policy)) == policy


@pytest.mark.parametrize("path", [
    r"a\,b", r"a\&b", r"enc\,oder/.*\&x", r"\\,x", r"\\&x", r"[]a,]", r"\\[]a,]",
    r"[^],&]b", "a{", "a{,b", r"a{1\,2}", "a{1,2}", "x{a,b}", r"(a\,b)", "a}=,b",
    r"\{,\}", "a=,", "[=]=",
])
def test_escaped_separators_round_trip(path):
  # Issue 12 item 12: `\,` and `\&` in a path came back as `,` and `&`.
  rule = Rule(path=path, precision="bf16")
  p = Policy(rules=(rule, Rule(path="b}", precision="f32")), default="tf32")
  assert Policy.parse(str(p)) == p
  # The stored regex means what the one given means.
  for s in ["a,b", "a&b", r"\,x", r"\&x", "a{1,2}", "a{1\\,2}", "aa", "a{", "]",
            "a", ",", "b", "x{a,b}", "a,", "a}=,b", "{,}", "a=,", "="]:
    assert bool(re.fullmatch(rule.path, s)) == bool(re.fullmatch(path, s)), s


_REGEX_CHARS = st.sampled_from(
    ["a", "b", "/", ".", "*", "+", "?", "|", "\\", ",", "&", "=", "(", ")", "[",
     "]", "{", "}", "^", "1", "2", " ", r"\,", r"\&", r"\\", r"\d", "{1,2}"])


@st.composite
def regexes(draw):
  path = "".join(draw(st.lists(_REGEX_CHARS, min_size=0, max_size=10)))
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # FutureWarning on possible set ops
      re.compile(path)
  except re.error:
    hypothesis.assume(False)
  return path


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(st.lists(regexes(), min_size=1, max_size=3),
                  st.lists(st.text(alphabet="ab,&\\{}12=", max_size=6),
                           max_size=6))
def test_str_round_trips_over_regexish_paths(paths, samples):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rules = tuple(Rule(path=p, precision="bf16") for p in paths)
    policy = Policy(rules=rules)
    assert Policy.parse(str(policy)) == policy
    for p, r in zip(paths, rules):
      for s in samples:
        assert bool(re.fullmatch(r.path, s)) == bool(re.fullmatch(p, s))


# -- bad input --------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("conv", "Invalid policy entry 'conv': expected SELECTOR=PRECISION"),
    ("default=bf16,,conv=tf32", "Invalid policy entry '': expected SELECTOR=PRECISION"),
    ("conv=", "Invalid policy entry 'conv=': empty precision"),
    ("=bf16", "Invalid policy entry '=bf16': empty selector"),
    ("default=bf16,default=f32", "two 'default' entries"),
    ("conv=bfloat61", "Invalid policy entry 'conv=bfloat61': Invalid precision "
                      "'bfloat61': unknown name."),
    ("default=fastest32", "Invalid policy entry 'default=fastest32'"),
    ("enc(oder=bf16", "Invalid module path regex 'enc(oder'"),
    ("type:Dnese=bf16", "Unknown module type 'Dnese'"),
    ("op:matmul=bf16", "Unknown op kind 'matmul'"),
    ("Dense&Conv=bf16", "two module_type terms"),
    ("Dense&&dot=bf16", "empty term"),
])
def test_malformed_strings_name_the_bad_part(text, message):
  with pytest.raises(ValueError, match=None) as e:
    Policy.parse(text)
  assert message in str(e.value), str(e.value)


def test_unknown_type_suggests_the_closest():
  with pytest.raises(ValueError, match=r"Unknown module type 'Dnese'.*Did you mean 'Dense'\?"):
    Rule(module_type="Dnese", precision="bf16")
  with pytest.raises(ValueError, match=r"Unknown op kind 'cnov'.*'dot', 'conv', "
                                       r"'attention'.*Did you mean 'conv'\?"):
    Rule(op="cnov", precision="bf16")


def test_rule_and_policy_constructor_errors():
  with pytest.raises(ValueError, match="needs at least one of path=, module_type=, op="):
    Rule(precision="bf16")
  with pytest.raises(ValueError, match=r"Invalid module path regex '\[': unterminated"):
    Rule(path="[", precision="bf16")
  with pytest.raises(ValueError, match="must be a regex string"):
    Rule(path=3, precision="bf16")
  with pytest.raises(ValueError, match="Invalid precision 'f31'"):
    Rule(op="dot", precision="f31")
  with pytest.raises(ValueError, match="Policy rules must be jaxprec.Rule values"):
    Policy(rules=("conv=bf16",))
  with pytest.raises(ValueError, match="must be a sequence of jaxprec.Rule"):
    Policy(rules=Rule(op="dot", precision="bf16"))
  with pytest.raises(ValueError, match="Policy default: Invalid precision"):
    Policy(default="nope")
  with pytest.raises(ValueError, match="expects a string"):
    Policy.parse(3)


def test_resolve_rejects_a_policy():
  # A policy is not one precision: resolve() says where it belongs.
  with pytest.raises(ValueError, match="a Policy is not one precision"):
    jaxprec.resolve(Policy.parse("default=bf16"))


def test_as_policy():
  assert as_policy("float32") == Policy(default="float32")
  assert as_policy(None) == Policy(default=jaxprec.resolve(None))
  assert as_policy("conv=bf16") == Policy.parse("conv=bf16")


# -- policies on plain functions: jaxprec.emulate(fn, policy) ------------------------

X = jnp.full((1, 4, 4, 1), 1 + 2.0**-9)  # not a bfloat16 value
K = jnp.ones((3, 3, 1, 1))


def conv_then_dot(x, k):
  y = lax.conv_general_dilated(x, k, (1, 1), "SAME",
                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return y.reshape(1, -1) @ jnp.full((16, 1), 1 + 2.0**-9)


def test_emulate_with_a_policy_gives_each_op_kind_its_precision():
  exact = conv_then_dot(X, K)
  p = Policy.parse("conv=bfloat16,default=BF16_BF16_F32_X6")
  got = jaxprec.emulate(conv_then_dot, p)(X, K)
  # conv at one bf16 pass: x rounds to 1.0; the dot's six passes are exact
  # here (small integers times 1 + 2**-9). A TPU does not run F32_F32_F32.
  conv_only = lax.conv_general_dilated(jnp.ones_like(X), K, (1, 1), "SAME",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
  want = conv_only.reshape(1, -1) @ jnp.full((16, 1), 1 + 2.0**-9)
  assert np.array_equal(got, want)
  assert not np.array_equal(got, exact)
  # The same policy as a string; and the other way round.
  got2 = jaxprec.emulate(conv_then_dot, "default=bf16,conv=F32_F32_F32")(X, K)
  y = lax.conv_general_dilated(X, K, (1, 1), "SAME",
                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
  want2 = y.reshape(1, -1).astype(jnp.bfloat16).astype(jnp.float32) @ jnp.ones((16, 1))
  np.testing.assert_allclose(got2, want2, rtol=2**-20)


def test_emulate_policy_report_and_unused_rule_warning():
  f = jaxprec.emulate(conv_then_dot, "default=bf16,Dense=f32,conv=tf32")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(f)(X, K)
  report = jaxprec.policy_report(f)
  assert [str(r) for r in report.unused_rules] == ["Dense=float32"]
  assert report.default_used
  decided = {(m.op, m.precision.name) for m in report.matches}
  assert decided == {("dot", "bfloat16"), ("conv", "tensorfloat32")}
  unused = [w for w in caught if issubclass(w.category, jaxprec.UnusedRuleWarning)]
  assert len(unused) == 1 and "'Dense=float32'" in str(unused[0].message)
  assert "Dense=float32" in str(report) and "unused rules" in str(report)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # warned once per rule, not at every call
    f(X, K)


def test_emulate_policy_keeps_explicit_precisions_and_traces_once():
  calls = []

  def fn(a, b):
    calls.append(1)
    return jnp.dot(a, b, precision="highest") + a @ b

  a = jnp.full((2, 2), 1 + 2.0**-9)
  f = jaxprec.emulate(fn, Policy(default="bfloat16"))
  with jaxprec.use_kernel("bf16"):  # counts bf16 passes (f32 merges them)
    closed = jax.make_jaxpr(f)(a, a)
    got = f(a, a)
    f(a, a)
  closed = emulated_ops.written_out(closed)  # each emulated op as its passes
  precisions = [w.eqn.params["precision"] for w in walker.iter_eqns(closed)
                if w.eqn.primitive is lax.dot_general_p]
  # HIGHEST: six bf16 passes; bfloat16: one. Every pass is a DEFAULT bf16 dot.
  assert len(precisions) == 7
  assert len(calls) == 1  # traced once per signature
  # The explicit 'highest' op: six passes, exact here; the other: one pass.
  assert float(got[0, 0]) == 2 * (1 + 2.0**-9) ** 2 + 2
