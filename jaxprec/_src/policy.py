"""Precision policies: a precision per Flax module path, module type and op kind.

A :class:`Policy` is an ordered list of :class:`Rule` values plus a default.
Each matmul or convolution is attributed to the innermost Flax module whose
code runs it, and gets the precision of the first rule that matches

* that module's **path** (``'/'``-joined, e.g. ``'encoder/layer/0/attention/self'``;
  ``''`` for the top module and for ops outside any module), by
  :func:`re.fullmatch`;
* that module's **type**, one of :data:`MODULE_TYPES`;
* the op's **kind**: ``'dot'``, ``'conv'``, or ``'attention'`` (the
  score and weighting matmuls that an attention module runs itself);

then, if no rule matches, the policy's default; with no default either, the op
keeps the precision in force outside the model. Precisions the model's code
passes explicitly (``precision=`` on a module or an op) are kept.

The text form, :meth:`Policy.parse` and ``str(policy)``, is the one grammar
that every entry point (Python, the command line, the environment) accepts; it
is documented on :meth:`Policy.parse` and in ``docs/modules.md``.

This module is data and grammar only: it imports neither Flax nor jaxprec's
Flax side. The runtime side (the scope in which a policy applies, module
paths, interception, swap) lives in :mod:`jaxprec._src.flax`, which imports
this module and never the other way round.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Sequence
from typing import Any, Union

from jaxprec._src.precision import Precision, PrecisionLike, resolve

__all__ = ["MODULE_TYPES", "OP_KINDS", "Policy", "PolicyLike", "PolicyMatch",
           "PolicyReport", "Rule", "UnusedRuleWarning", "as_policy"]

OP_KINDS = ("dot", "conv", "attention")
MODULE_TYPES = ("Dense", "DenseGeneral", "Conv", "ConvTranspose", "Einsum",
                "Attention")
# Other spellings of the module types: Flax NNX's class names and the attention
# classes of Flax linen. Matching is exact in policy strings, any case elsewhere.
TYPE_ALIASES = {
    "Linear": "Dense", "LinearGeneral": "DenseGeneral", "ConvLocal": "Conv",
    "MultiHeadDotProductAttention": "Attention", "MultiHeadAttention": "Attention",
    "SelfAttention": "Attention",
}
_PREFIXES = ("op:", "type:", "path:")
_RESERVED = frozenset(("default", *OP_KINDS, *MODULE_TYPES, *TYPE_ALIASES))


class UnusedRuleWarning(UserWarning):
  """Some rules of a policy decided the precision of no op of the model."""


def _choices(values: Sequence[str]) -> str:
  return ", ".join(repr(v) for v in values)


def _unknown(what: str, value: Any, choices: Sequence[str]) -> ValueError:
  msg = f"Unknown {what} {value!r}; valid choices: {_choices(choices)}."
  if isinstance(value, str):
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    if not close:
      lower = {c.lower(): c for c in choices}
      close = [lower[c] for c in difflib.get_close_matches(
          value.lower(), list(lower), n=1, cutoff=0.6)]
    if close:
      msg += f" Did you mean {close[0]!r}?"
  return ValueError(msg)


def canonical_op(op: Any) -> str:
  """``'dot'``, ``'conv'`` or ``'attention'`` (any case); ValueError otherwise."""
  if isinstance(op, str) and op.strip().lower() in OP_KINDS:
    return op.strip().lower()
  raise _unknown("op kind", op, OP_KINDS)


def canonical_type(module_type: Any) -> str:
  """One of :data:`MODULE_TYPES` for a type name or alias (any case)."""
  if isinstance(module_type, str):
    key = module_type.strip().lower()
    for name in (*MODULE_TYPES, *TYPE_ALIASES):
      if name.lower() == key:
        return TYPE_ALIASES.get(name, name)
  raise _unknown("module type", module_type, (*MODULE_TYPES, *TYPE_ALIASES))


@functools.lru_cache(maxsize=1024)
def _compile(pattern: str) -> re.Pattern:
  try:
    return re.compile(pattern)
  except re.error as e:
    raise ValueError(f"Invalid module path regex {pattern!r}: {e}.") from None


def _precision(value: Any, where: str) -> Precision:
  try:
    return resolve(value)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """One rule of a :class:`Policy`: which ops, and their precision. Frozen, hashable.

  A rule matches an op when every criterion it sets matches; at least one must
  be set (a rule for everything is the policy's ``default``).

  Attributes:
    path: a regular expression that must match the whole module path
      (:func:`re.fullmatch`), e.g. ``r'encoder/layer/\\d+/attention/.*'``.
      Paths join Flax's module names with ``'/'``, without the top module's
      class name: what :attr:`jaxprec.AuditRow.module_path` shows. Stored
      with ``\\,`` and ``\\&`` outside groups read as ``,`` and ``&`` (the same
      regex), as :meth:`Policy.parse` reads them.
    module_type: one of :data:`MODULE_TYPES` (``'Dense'``, ``'DenseGeneral'``,
      ``'Conv'``, ``'ConvTranspose'``, ``'Einsum'``, ``'Attention'``) or an
      alias (NNX's ``'Linear'``, ``'LinearGeneral'``; ``'ConvLocal'``;
      ``'MultiHeadDotProductAttention'``, ``'MultiHeadAttention'``), any case.
    op: ``'dot'``, ``'conv'`` or ``'attention'``.
    precision: any spelling :func:`jaxprec.resolve` accepts; stored resolved.

  Raises:
    ValueError: invalid regex, unknown type, op kind or precision, or no
      criterion.

  Examples:
    >>> import jaxprec
    >>> r = jaxprec.Rule(module_type="conv", precision="tf32")
    >>> r.module_type, r.precision.name
    ('Conv', 'tensorfloat32')
    >>> r.matches("features/conv_0", "Conv", "conv")
    True
    >>> jaxprec.Rule(path="enc(oder", precision="bf16")
    Traceback (most recent call last):
    ...
    ValueError: Invalid module path regex 'enc(oder': missing ), unterminated subpattern ...
  """

  path: str | None = None
  module_type: str | None = None
  op: str | None = None
  precision: Precision

  def __post_init__(self):
    if self.path is not None:
      if not isinstance(self.path, str):
        raise ValueError(f"Rule path must be a regex string; got {self.path!r}.")
      _compile(self.path)
      object.__setattr__(self, "path", _unescape(self.path))
    if self.module_type is not None:
      object.__setattr__(self, "module_type", canonical_type(self.module_type))
    if self.op is not None:
      object.__setattr__(self, "op", canonical_op(self.op))
    if self.path is None and self.module_type is None and self.op is None:
      raise ValueError(
          "A Rule needs at least one of path=, module_type=, op=; for every op "
          "use the policy's default (Policy(default=...), 'default=' in text).")
    object.__setattr__(self, "precision", _precision(
        self.precision, f"Rule {self._selector()!r}"))

  def matches(self, path: str, module_type: str | None, op: str) -> bool:
    """Whether the rule applies to an op of kind ``op`` in such a module."""
    if self.op is not None and self.op != op:
      return False
    if self.module_type is not None and self.module_type != module_type:
      return False
    return self.path is None or _compile(self.path).fullmatch(path) is not None

  def _selector(self) -> str:
    terms = []
    if self.path is not None:
      terms.append(_format_path(self.path))
    if self.module_type is not None:
      terms.append(str(self.module_type))
    if self.op is not None:
      terms.append(str(self.op))
    return "&".join(terms)

  def __str__(self) -> str:
    return f"{self._selector()}={self.precision.name}"

  def __repr__(self) -> str:
    parts = [f"{k}={getattr(self, k)!r}" for k in ("path", "module_type", "op")
             if getattr(self, k) is not None]
    return f"jaxprec.Rule({', '.join(parts)}, precision={self.precision.name!r})"


# ---------------------------------------------------------------------------
# The text grammar.


# A repetition ``{m,n}`` (its comma may be escaped: then a literal text that
# must stay as written). Any other brace is a literal character in a regex.
_REPEAT = re.compile(r"\{\d*(?:\\?,\d*)?\}")


def _scan(text: str, seps: str, *, escaped: bool = False
          ) -> list[tuple[int, str]]:
  r"""Top-level separator positions: not inside (), [] or a ``{m,n}``.

  With ``escaped=False``, unescaped separators; with ``escaped=True``, the
  backslashes of top-level ``\<sep>`` pairs. Inserting or removing such a
  backslash changes the scan of nothing else, so the formatter and the parser
  agree on what is top level.
  """
  out = []
  depth = 0
  i = 0
  while i < len(text):
    c = text[i]
    if c == "\\":
      if escaped and depth == 0 and text[i + 1:i + 2] in tuple(seps):
        out.append((i, text[i + 1]))
      i += 2
      continue
    if c == "[":
      i = _class_end(text, i)
      continue
    repeat = _REPEAT.match(text, i) if c == "{" else None
    if repeat:
      i = repeat.end()
      continue
    if c == "(":
      depth += 1
    elif c == ")":
      depth = max(0, depth - 1)
    elif depth == 0 and c in seps and not escaped:
      out.append((i, c))
    i += 1
  return out


def _class_end(text: str, i: int) -> int:
  """The index after the character class that opens at ``text[i]`` (``[``)."""
  j = i + 1
  if text[j:j + 1] == "^":
    j += 1
  if text[j:j + 1] == "]":  # first in the class: a literal ']'
    j += 1
  while j < len(text):
    if text[j] == "\\":
      j += 2
      continue
    if text[j] == "]":
      return j + 1
    j += 1
  return len(text)


def _split(text: str, sep: str) -> list[str]:
  parts, start = [], 0
  for i, _ in _scan(text, sep):
    parts.append(text[start:i])
    start = i + 1
  parts.append(text[start:])
  return parts


def _unescape(regex: str) -> str:
  r"""Top-level ``\,`` and ``\&`` become ``,`` and ``&`` (same regex).

  Inside (), [] and ``{m,n}`` they are kept as written: there they need no
  escape in a policy string, and ``{1\,2}`` (literal text) must not become
  the repetition ``{1,2}``. This is also the canonical form a :class:`Rule`
  stores, so that ``Policy.parse(str(p)) == p``.
  """
  out = list(regex)
  for i, _ in reversed(_scan(regex, ",&", escaped=True)):
    del out[i]
  return "".join(out)


def _format_path(regex: str) -> str:
  """A regex as a policy-string term that parses back to the same regex."""
  escaped = list(regex)
  for i, _ in reversed(_scan(regex, ",&")):
    escaped[i] = "\\" + regex[i]
  text = "".join(escaped)
  if (text in _RESERVED or text.startswith(_PREFIXES) or text != text.strip()
      or not text):
    text = "path:" + text
  return text


def _parse_selector(selector: str, entry: str) -> dict[str, str]:
  fields: dict[str, str] = {}
  for raw in _split(selector, "&"):
    term = raw.strip()
    if not term:
      raise ValueError(f"Invalid policy entry {entry!r}: empty term in {selector!r}.")
    if term.startswith("op:"):
      key, value = "op", term[3:].strip()
    elif term.startswith("type:"):
      key, value = "module_type", term[5:].strip()
    elif term.startswith("path:"):
      key, value = "path", _unescape(raw.lstrip()[5:])
    elif term in OP_KINDS:
      key, value = "op", term
    elif term in MODULE_TYPES or term in TYPE_ALIASES:
      key, value = "module_type", term
    else:
      key, value = "path", _unescape(term)
    if key in fields:
      raise ValueError(f"Invalid policy entry {entry!r}: two {key} terms.")
    fields[key] = value
  return fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
  """Which precision each matmul and convolution of a Flax model gets. Frozen, hashable.

  Rules are tried in order and the first that matches an op wins; ops no rule
  matches get ``default``; with ``default=None`` they keep the precision in
  force where the model runs (a ``jaxprec.precision`` scope, the global
  setting, the backend default). See the module docstring of
  ``jaxprec._src.policy`` for how an op is matched, and :meth:`parse` for the
  text form. Pass a policy to :func:`jaxprec.swap` or :func:`jaxprec.emulate`.

  ``jaxprec.resolve(policy)`` raises ValueError: a policy is not one precision.

  Attributes:
    rules: the rules, in order (a sequence of :class:`Rule`).
    default: precision for ops no rule matches (any spelling; stored
      resolved), or None.

  Examples:
    >>> import jaxprec
    >>> p = jaxprec.Policy(
    ...     rules=[jaxprec.Rule(path=r".*attention.*", precision="float32"),
    ...            jaxprec.Rule(op="conv", precision="tf32")],
    ...     default="bf16")
    >>> str(p)
    'default=bfloat16,.*attention.*=float32,conv=tensorfloat32'
    >>> p == jaxprec.Policy.parse(str(p))
    True
    >>> p.precision_for("encoder/layer/0/attention/self", "Attention", "attention").name
    'float32'
    >>> p.precision_for("feature_extractor/conv_layers/0/conv", "Conv", "conv").name
    'tensorfloat32'
    >>> p.precision_for("pooler/dense", "Dense").name
    'bfloat16'
  """

  rules: tuple[Rule, ...] = ()
  default: Precision | None = None

  def __post_init__(self):
    rules = self.rules
    if isinstance(rules, (Rule, str)) or not isinstance(rules, Sequence):
      raise ValueError(
          f"Policy rules must be a sequence of jaxprec.Rule; got {rules!r}.")
    for r in rules:
      if not isinstance(r, Rule):
        raise ValueError(f"Policy rules must be jaxprec.Rule values; got {r!r}.")
    object.__setattr__(self, "rules", tuple(rules))
    if self.default is not None:
      object.__setattr__(self, "default",
                         _precision(self.default, "Policy default"))

  # -- matching ---------------------------------------------------------------
  def match(self, path: str = "", module_type: str | None = None,
            op: str = "dot") -> tuple[Precision | None, Rule | None]:
    """The precision for an op and the rule that gave it.

    Args:
      path: the module path (``'/'``-joined names; ``''`` for none).
      module_type: one of :data:`MODULE_TYPES`, or None for other modules.
      op: ``'dot'``, ``'conv'`` or ``'attention'``.

    Returns:
      ``(precision, rule)``: the first matching rule's precision and the rule;
      ``(default, None)`` when none matches; ``(None, None)`` when none
      matches and there is no default.
    """
    op = canonical_op(op)
    for r in self.rules:
      if r.matches(path, module_type, op):
        return r.precision, r
    return self.default, None

  def precision_for(self, path: str = "", module_type: str | None = None,
                    op: str = "dot") -> Precision | None:
    """The precision :meth:`match` gives (None: leave as is)."""
    return self.match(path, module_type, op)[0]

  # -- text -------------------------------------------------------------------
  @classmethod
  def parse(cls, text: str | Policy) -> Policy:
    r"""Reads a policy string (a Policy is returned unchanged).

    Grammar (the one every jaxprec entry point accepts)::

      policy    := entry ("," entry)*        (the empty string: no rules)
      entry     := selector "=" precision
      selector  := "default" | term ("&" term)*
      term      := KIND | TYPE | "op:" KIND | "type:" TYPE | "path:" REGEX | REGEX
      KIND      := dot | conv | attention
      TYPE      := Dense | DenseGeneral | Conv | ConvTranspose | Einsum | Attention
                   | Linear | LinearGeneral | ConvLocal | MultiHeadDotProductAttention
                   | MultiHeadAttention | SelfAttention
      precision := any name jaxprec.resolve accepts (bf16, tf32, float32, F32_F32_F32, ...)

    * A bare term that is exactly an op kind (lower case) is an op kind, exactly
      a type name (as written above) is a module type, and anything else is a
      module-path regex, matched against the whole path (``re.fullmatch``).
      With a prefix (``op:``, ``type:``, ``path:``) the meaning is explicit and
      kinds and types may be in any case.
    * Terms joined by ``&`` must all match: ``Dense&encoder/.*=bf16``.
    * An entry splits at its last ``=`` (precision names have none), so a
      regex may contain ``=``. Entries split at ``,`` and terms at ``&`` only
      outside ``()``, ``[]`` and ``{m,n}`` repetitions; elsewhere in a regex
      write ``\,`` and ``\&`` (read as ``,`` and ``&``: a rule stores its path
      so, and ``str`` writes them back escaped).
    * Spaces around entries, terms and names are ignored.
    * Rules keep their order (first match wins); ``default`` may appear
      anywhere, at most once.

    ``str(policy)`` writes this form (default first, canonical names) and
    ``Policy.parse(str(policy)) == policy``.

    Args:
      text: the policy string.

    Returns:
      The :class:`Policy`.

    Raises:
      ValueError: naming the bad entry: no ``=``, an empty part, an unknown
        precision, type or kind, an invalid regex, two defaults.

    Examples:
      >>> import jaxprec
      >>> p = jaxprec.Policy.parse(
      ...     "default=bfloat16, conv=tensorfloat32, .*attention.*=float32")
      >>> p.default.name, [str(r) for r in p.rules]
      ('bfloat16', ['conv=tensorfloat32', '.*attention.*=float32'])
      >>> str(jaxprec.Policy.parse(r"Dense&layers_\d{1,2}=fp32"))
      'layers_\\d{1,2}&Dense=float32'
      >>> jaxprec.Policy.parse("conv=tf32,attention")
      Traceback (most recent call last):
      ...
      ValueError: Invalid policy entry 'attention': expected SELECTOR=PRECISION ...
    """
    if isinstance(text, Policy):
      return text
    if not isinstance(text, str):
      raise ValueError(f"Policy.parse expects a string; got {text!r} of type "
                       f"{type(text).__name__}.")
    rules: list[Rule] = []
    default = None
    if not text.strip():
      return cls()
    for entry in _split(text, ","):
      stripped = entry.strip()
      eqs = [i for i, _ in _scan(entry, "=")] or [
          i for i, c in enumerate(entry) if c == "="]  # unbalanced: regex error
      if not stripped or not eqs:
        raise ValueError(
            f"Invalid policy entry {stripped!r}: expected SELECTOR=PRECISION "
            f"(e.g. 'default=bfloat16', 'conv=tf32', '.*attention.*=float32'); "
            f"entries are separated by ','.")
      selector, name = entry[:eqs[-1]], entry[eqs[-1] + 1:].strip()
      if not name:
        raise ValueError(f"Invalid policy entry {stripped!r}: empty precision.")
      if selector.strip() == "default":
        if default is not None:
          raise ValueError(f"Invalid policy {text!r}: two 'default' entries.")
        default = _precision(name, f"Invalid policy entry {stripped!r}")
        continue
      if not selector.strip():
        raise ValueError(f"Invalid policy entry {stripped!r}: empty selector.")
      fields = _parse_selector(selector, stripped)
      precision = _precision(name, f"Invalid policy entry {stripped!r}")
      try:
        rules.append(Rule(precision=precision, **fields))
      except ValueError as e:
        raise ValueError(f"Invalid policy entry {stripped!r}: {e}") from None
    return cls(rules=tuple(rules), default=default)

  def __str__(self) -> str:
    entries = [] if self.default is None else [f"default={self.default.name}"]
    return ",".join(entries + [str(r) for r in self.rules])

  def __repr__(self) -> str:
    return f"jaxprec.Policy.parse({str(self)!r})"


PolicyLike = Union[Policy, str, PrecisionLike]


def as_policy(value: PolicyLike) -> Policy:
  """A :class:`Policy` from a Policy, a policy string, or one precision.

  A string with ``=`` is a policy string; any other value is a precision,
  which becomes ``Policy(default=value)``.

  Examples:
    >>> import jaxprec
    >>> from jaxprec._src.policy import as_policy
    >>> str(as_policy("bf16")), str(as_policy("conv=tf32"))
    ('default=bfloat16', 'conv=tensorfloat32')
  """
  if isinstance(value, Policy):
    return value
  if isinstance(value, str) and "=" in value:
    return Policy.parse(value)
  return Policy(default=resolve(value))


# ---------------------------------------------------------------------------
# What a policy did: matches, unused rules.


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyMatch:
  """What a policy decided for one module (or for ops outside modules).

  Attributes:
    path: the module path (``''`` for the top module or no module).
    module_type: one of :data:`MODULE_TYPES`, or None.
    op: the op kind the decision is for.
    precision: the precision given, or None (left as it was); when
      :attr:`kept`, the module's own.
    rule: the rule that gave it; None for the default or no decision.
    calls: how many module method calls (or traced ops) it covered.
    kept: the module's code set its own ``precision=``, which it keeps:
      ``rule`` (or the default) matched it but decided nothing.
  """

  path: str
  module_type: str | None
  op: str
  precision: Precision | None
  rule: Rule | None
  calls: int = 1
  kept: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyReport:
  """What a policy did to a model: returned by :func:`jaxprec.policy_report`.

  Filled while the model is traced (for linen models and ``jaxprec.emulate``)
  or when it is swapped (NNX), so it covers what has run so far.

  Attributes:
    policy: the policy.
    matches: one :class:`PolicyMatch` per distinct decision, in first-seen
      order.
  """

  policy: Policy
  matches: tuple[PolicyMatch, ...] = ()

  @property
  def unused_rules(self) -> tuple[Rule, ...]:
    """Rules that decided nothing: they matched no module, or only modules
    that an earlier rule had already matched, or only modules that keep their
    own ``precision=``."""
    used = {m.rule for m in self.matches if m.rule is not None and not m.kept}
    return tuple(r for r in self.policy.rules if r not in used)

  @property
  def default_used(self) -> bool:
    return any(m.rule is None and m.precision is not None and not m.kept
               for m in self.matches)

  def __str__(self) -> str:
    lines = [f"policy: {self.policy}"]
    for m in self.matches:
      what = "-" if m.precision is None else m.precision.name
      why = str(m.rule) if m.rule is not None else (
          "default" if m.precision is not None else "no rule, no default")
      if m.kept:
        why = f"its own precision= (kept; {why} not applied)"
      lines.append(f"  {m.path or '(top)'} [{m.module_type or '-'}, {m.op}]: "
                   f"{what}  <- {why}")
    unused = self.unused_rules
    lines.append("unused rules: " + (", ".join(str(r) for r in unused)
                                     if unused else "none"))
    return "\n".join(lines)
