"""Policies: a precision and a compute dtype per Flax module path, module type and op kind.

A :class:`Policy` is an ordered list of :class:`Rule` values plus a default
(and a default compute dtype: see :meth:`Policy.match_dtype`).
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

The compute dtype is decided per module the same way, by the first rule that
sets a ``dtype`` and matches the module, else ``default_dtype``
(:meth:`Policy.match_dtype`); the two axes never decide for each other.

The text form, :meth:`Policy.parse` and ``str(policy)``, is the one grammar
that every entry point (Python, the command line, the environment) accepts.
The runtime side (the scope in which a policy applies) is
:mod:`jaxprec._src.flax`, which imports this module, never the other way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Union

from jaxprec._src.core import numerics
from jaxprec._src.policy.policy_text import (
                                      canonical_op, canonical_type,
                                      check_item_typo,
                                      compile_path, format_path, format_value,
                                      parse_selector, parse_value, scan, split,
                                      to_dtype, to_precision, unescape)
from jaxprec._src.core.precision import Precision, PrecisionLike, resolve

class UnusedRuleWarning(UserWarning):
  """Some rules of a policy decided the precision or dtype of nothing in the model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """One rule of a :class:`Policy`: which modules, their precision and dtype. Frozen, hashable.

  A rule matches an op (or a module) when every criterion it sets matches; at
  least one must be set (a rule for everything is the policy's ``default``).
  It decides a precision, a compute dtype, or both: at least one of
  ``precision`` and ``dtype`` must be set.

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
      None: the rule decides no precision.
    dtype: the compute dtype of the matched modules: ``'bfloat16'``,
      ``'float16'`` or ``'float32'`` (aliases ``bf16``, ``f16``/``fp16``/
      ``half``, ``f32``/``fp32``; numpy dtypes, ``jnp.bfloat16``); stored as
      the name. None: the rule decides no dtype.

  Raises:
    ValueError: invalid regex, unknown type, op kind, precision or dtype, no
      criterion, or neither precision nor dtype.

  Examples:
    >>> import jaxprec, jax.numpy as jnp
    >>> r = jaxprec.Rule(module_type="conv", precision="tf32")
    >>> r.module_type, r.precision.name
    ('Conv', 'tensorfloat32')
    >>> r.matches("features/conv_0", "Conv", "conv")
    True
    >>> str(jaxprec.Rule(path=".*LayerNorm.*", dtype=jnp.float32))
    '.*LayerNorm.*=dtype:float32'
    >>> jaxprec.Rule(path="enc(oder", precision="bf16")
    Traceback (most recent call last):
    ...
    ValueError: Invalid module path regex 'enc(oder': missing ), unterminated subpattern ...
  """

  path: str | None = None
  module_type: str | None = None
  op: str | None = None
  precision: Precision | None = None
  dtype: str | None = None

  def __post_init__(self):
    if self.path is not None:
      if not isinstance(self.path, str):
        raise ValueError(f"Rule path must be a regex string; got {self.path!r}.")
      compile_path(self.path)
      object.__setattr__(self, "path", unescape(self.path))
    if self.module_type is not None:
      object.__setattr__(self, "module_type", canonical_type(self.module_type))
    if self.op is not None:
      object.__setattr__(self, "op", canonical_op(self.op))
    if self.path is None and self.module_type is None and self.op is None:
      raise ValueError(
          "A Rule needs at least one of path=, module_type=, op=; for every op "
          "use the policy's default (Policy(default=..., default_dtype=...), "
          "'default=' in text).")
    if self.precision is None and self.dtype is None:
      raise ValueError(
          f"Rule {self._selector()!r} decides nothing: give precision=, dtype= "
          f"or both.")
    where = f"Rule {self._selector()!r}"
    if self.precision is not None:
      object.__setattr__(self, "precision", to_precision(self.precision, where))
    if self.dtype is not None:
      object.__setattr__(self, "dtype", to_dtype(self.dtype, where))

  def matches(self, path: str, module_type: str | None, op: str) -> bool:
    """Whether the rule applies to an op of kind ``op`` in such a module."""
    if self.op is not None and self.op != op:
      return False
    if self.module_type is not None and self.module_type != module_type:
      return False
    return self.path is None or compile_path(self.path).fullmatch(path) is not None

  def _selector(self) -> str:
    terms = [] if self.path is None else [format_path(self.path)]
    return "&".join(terms + [str(t) for t in (self.module_type, self.op)
                             if t is not None])

  def __str__(self) -> str:
    return f"{self._selector()}={format_value(self.precision, self.dtype)}"

  def __repr__(self) -> str:
    parts = [f"{k}={getattr(self, k)!r}" for k in ("path", "module_type", "op")
             if getattr(self, k) is not None]
    if self.precision is not None:
      parts.append(f"precision={self.precision.name!r}")
    if self.dtype is not None:
      parts.append(f"dtype={self.dtype!r}")
    return f"jaxprec.Rule({', '.join(parts)})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
  """Which precision and compute dtype each part of a Flax model gets. Frozen, hashable.

  Two axes, decided separately. **Precision**: for each matmul and
  convolution, the first rule that sets a precision and matches the op wins;
  ops no such rule matches get ``default``; with ``default=None`` they keep
  the precision in force where the model runs (a ``jaxprec.precision`` scope,
  the global setting, the backend default). **Dtype**: for each module, the
  first rule that sets a dtype and matches the module wins, else
  ``default_dtype``; with neither, the module keeps its own dtype (see
  ``docs/modules.md``: a module with a ``dtype`` field computes in the
  decided dtype; one without has its floating inputs and outputs cast by a
  rule that matches it, and is left as built under ``default_dtype``). See
  the module docstring of ``jaxprec._src.policy.policy`` for how an op is matched,
  and :meth:`parse` for the text form. Pass a policy to :func:`jaxprec.swap`
  or :func:`jaxprec.emulate`.

  ``jaxprec.resolve(policy)`` raises ValueError: a policy is not one precision.

  Attributes:
    rules: the rules, in order (a sequence of :class:`Rule`).
    default: precision for ops no rule matches (any spelling; stored
      resolved), or None.
    default_dtype: compute dtype for modules no dtype rule matches
      (``'bfloat16'``, ``'float16'``, ``'float32'`` or their spellings; stored
      as the name), or None. ``default_dtype='float32'`` on a bfloat16 model
      runs every module in float32: the "undo mixed precision" switch.

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
    >>> d = jaxprec.Policy(rules=[jaxprec.Rule(path=".*LayerNorm.*", dtype="f32")],
    ...                    default_dtype="bf16")
    >>> str(d), d.dtype_for("encoder/LayerNorm"), d.dtype_for("encoder/dense")
    ('default=dtype:bfloat16,.*LayerNorm.*=dtype:float32', 'float32', 'bfloat16')
  """

  rules: tuple[Rule, ...] = ()
  default: Precision | None = None
  default_dtype: str | None = None

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
                         to_precision(self.default, "Policy default"))
    if self.default_dtype is not None:
      object.__setattr__(self, "default_dtype",
                         to_dtype(self.default_dtype, "Policy default_dtype"))

  # -- matching ---------------------------------------------------------------
  def match(self, path: str = "", module_type: str | None = None,
            op: str = "dot") -> tuple[Precision | None, Rule | None]:
    """The precision for an op and the rule that gave it.

    Only rules that set a precision take part (a dtype-only rule never
    decides a precision).

    Args:
      path: the module path (``'/'``-joined names; ``''`` for none).
      module_type: one of :data:`MODULE_TYPES`, or None for other modules.
      op: ``'dot'``, ``'conv'`` or ``'attention'``.

    Returns:
      ``(precision, rule)``: the first matching rule's precision and the rule;
      ``(default, None)`` when none matches; ``(None, None)`` when none
      matches and there is no default.
    """
    return self._first("precision", self.default, path, module_type, op)

  def precision_for(self, path: str = "", module_type: str | None = None,
                    op: str = "dot") -> Precision | None:
    """The precision :meth:`match` gives (None: leave as is)."""
    return self.match(path, module_type, op)[0]

  def match_dtype(self, path: str = "", module_type: str | None = None,
                  op: str = "dot") -> tuple[str | None, Rule | None]:
    """The compute dtype for a module and the rule that gave it.

    Only rules that set a dtype take part (a precision-only rule never
    decides a dtype).

    Args:
      path: the module path (``'/'``-joined names; ``''`` for the top one).
      module_type: one of :data:`MODULE_TYPES`, or None for other modules.
      op: the module's op kind: ``'dot'``, ``'conv'`` or ``'attention'``.

    Returns:
      ``(dtype, rule)``: the first matching dtype rule's dtype name and the
      rule; ``(default_dtype, None)`` when none matches (``(None, None)``
      without a default dtype: the module keeps its own).
    """
    return self._first("dtype", self.default_dtype, path, module_type, op)

  def dtype_for(self, path: str = "", module_type: str | None = None,
                op: str = "dot") -> str | None:
    """The dtype :meth:`match_dtype` gives (None: leave as is)."""
    return self.match_dtype(path, module_type, op)[0]

  def _first(self, axis: str, default: Any, path: str,
             module_type: str | None, op: str) -> tuple[Any, Rule | None]:
    """The first matching rule that sets ``axis`` (``'precision'`` or
    ``'dtype'``) with its value; ``(default, None)`` when none matches."""
    op = canonical_op(op)
    for r in self.rules:
      value = getattr(r, axis)
      if value is not None and r.matches(path, module_type, op):
        return value, r
    return default, None

  @property
  def has_dtypes(self) -> bool:
    """Whether any rule or the default sets a compute dtype."""
    return self.default_dtype is not None or any(
        r.dtype is not None for r in self.rules)

  # -- text -------------------------------------------------------------------
  @classmethod
  def parse(cls, text: str | Policy) -> Policy:
    r"""Reads a policy string (a Policy is returned unchanged).

    Grammar (the one every jaxprec entry point accepts)::

      policy    := entry ("," entry)*        (the empty string: no rules)
      entry     := selector "=" value
      selector  := "default" | term ("&" term)*
      term      := KIND | TYPE | "op:" KIND | "type:" TYPE | "path:" REGEX | REGEX
      KIND      := dot | conv | attention
      TYPE      := Dense | DenseGeneral | Conv | ConvTranspose | Einsum | Attention
                   | Linear | LinearGeneral | ConvLocal | MultiHeadDotProductAttention
                   | MultiHeadAttention | SelfAttention
      value     := item ("+" item)*         (at most one precision, one dtype)
      item      := PRECISION | "dtype:" DTYPE | "precision:" PRECISION
      PRECISION := any name jaxprec.resolve accepts (bf16, tf32, float32, F32_F32_F32, ...)
      DTYPE     := bfloat16 | float16 | float32 (aliases bf16, f16, fp16, half, f32, fp32)

    * A bare term that is exactly an op kind (lower case) is an op kind, exactly
      a type name (as written above) is a module type, and anything else is a
      module-path regex, matched against the whole path (``re.fullmatch``).
      With a prefix (``op:``, ``type:``, ``path:``) the meaning is explicit and
      kinds and types may be in any case.
    * Terms joined by ``&`` must all match: ``Dense&encoder/.*=bf16``.
    * A bare item is a precision; ``dtype:NAME`` is a compute dtype:
      ``dense_2=dtype:bfloat16``, ``Dense=float32+dtype:bfloat16``,
      ``default=bf16+dtype:float32``.
    * An entry splits at its last ``=`` (values have none), so a
      regex may contain ``=``. Entries split at ``,`` and terms at ``&`` only
      outside ``()``, ``[]`` and ``{m,n}`` repetitions; elsewhere in a regex
      write ``\,`` and ``\&`` (read as ``,`` and ``&``: a rule stores its path
      so, and ``str`` writes them back escaped).
    * Spaces around entries, terms, items and names are ignored.
    * Rules keep their order (first match wins, per axis); ``default`` may
      appear anywhere, at most once, with a precision, a dtype or both.

    ``str(policy)`` writes this form (default first, canonical names, the
    precision before the dtype) and ``Policy.parse(str(policy)) == policy``.

    Args:
      text: the policy string.

    Returns:
      The :class:`Policy`.

    Raises:
      ValueError: naming the bad entry: no ``=``, an empty part, an unknown
        precision, dtype, type or kind, an invalid regex, two defaults, two
        precisions or two dtypes in one value, ``x=dtype=bf16`` (for ``:``).

    Examples:
      >>> import jaxprec
      >>> p = jaxprec.Policy.parse(
      ...     "default=bfloat16, conv=tensorfloat32, .*attention.*=float32")
      >>> p.default.name, [str(r) for r in p.rules]
      ('bfloat16', ['conv=tensorfloat32', '.*attention.*=float32'])
      >>> str(jaxprec.Policy.parse(r"Dense&layers_\d{1,2}=fp32"))
      'layers_\\d{1,2}&Dense=float32'
      >>> str(jaxprec.Policy.parse("dense_2 = dtype:bf16, default=f32+dtype:fp32"))
      'default=float32+dtype:float32,dense_2=dtype:bfloat16'
      >>> jaxprec.Policy.parse("conv=tf32,attention")
      Traceback (most recent call last):
      ...
      ValueError: Invalid policy entry 'attention': expected SELECTOR=PRECISION ...
      >>> jaxprec.Policy.parse("dense_2=dtype:bflaot16")
      Traceback (most recent call last):
      ...
      ValueError: Invalid policy entry 'dense_2=dtype:bflaot16': Unknown dtype 'bflaot16'; ... Did you mean 'bfloat16'?
    """
    if isinstance(text, Policy):
      return text
    if not isinstance(text, str):
      raise ValueError(f"Policy.parse expects a string; got {text!r} of type "
                       f"{type(text).__name__}.")
    rules: list[Rule] = []
    default: tuple[Precision | None, str | None] | None = None
    if not text.strip():
      return cls()
    for entry in split(text, ","):
      stripped = entry.strip()
      eqs = [i for i, _ in scan(entry, "=")] or [
          i for i, c in enumerate(entry) if c == "="]  # unbalanced: regex error
      if not stripped or not eqs:
        raise ValueError(
            f"Invalid policy entry {stripped!r}: expected SELECTOR=PRECISION "
            f"or SELECTOR=dtype:DTYPE (e.g. 'default=bfloat16', 'conv=tf32', "
            f"'.*attention.*=float32', '.*LayerNorm.*=dtype:float32'); "
            f"entries are separated by ','.")
      selector, value = entry[:eqs[-1]], entry[eqs[-1] + 1:]
      check_item_typo(selector, value, stripped)
      if selector.strip() == "default":
        if default is not None:
          raise ValueError(f"Invalid policy {text!r}: two 'default' entries.")
        default = parse_value(value, stripped)
        continue
      if not value.strip():
        parse_value(value, stripped)  # raises: empty
      if not selector.strip():
        raise ValueError(f"Invalid policy entry {stripped!r}: empty selector.")
      fields = parse_selector(selector, stripped)
      precision, dtype = parse_value(value, stripped)
      try:
        rules.append(Rule(precision=precision, dtype=dtype, **fields))
      except ValueError as e:
        raise ValueError(f"Invalid policy entry {stripped!r}: {e}") from None
    precision, dtype = default or (None, None)
    return cls(rules=tuple(rules), default=precision, default_dtype=dtype)

  def __str__(self) -> str:
    entries = []
    if self.default is not None or self.default_dtype is not None:
      entries.append(f"default={format_value(self.default, self.default_dtype)}")
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
    >>> from jaxprec._src.policy.policy import as_policy
    >>> str(as_policy("bf16")), str(as_policy("conv=tf32"))
    ('default=bfloat16', 'conv=tensorfloat32')
  """
  if isinstance(value, Policy):
    return value
  if isinstance(value, str) and "=" in value:
    return Policy.parse(value)
  return Policy(default=resolve(value))


def attending(body: PolicyLike | None, attention: PolicyLike | None
              ) -> PolicyLike | None:
  """``body`` (a policy, a precision or None) with the matmuls attention
  modules run in their own code (the op kind ``'attention'``: scores and
  values, not the projections, modules of their own) at ``attention``'s
  precision: a policy whose first rules say so. A policy ``attention`` gives
  its precision rules that can match those matmuls, then its default;
  ``body`` comes back as it is where that adds no rule.

  Examples:
    >>> from jaxprec._src.policy.policy import attending
    >>> str(attending("float32", "bf16"))
    'default=float32,attention=bfloat16'
    >>> str(attending("default=dtype:bfloat16", "layers/0/.*=bf16,Dense=tf32"))
    'default=dtype:bfloat16,layers/0/.*&attention=bfloat16'
  """
  attention = Policy() if attention is None else as_policy(attention)
  rules = [dataclasses.replace(r, op="attention", dtype=None)
           for r in attention.rules
           if r.precision is not None and r.op in (None, "attention")
           and r.module_type in (None, "Attention")]
  if attention.default is not None:
    rules.append(Rule(op="attention", precision=attention.default))
  if not rules:
    return body
  base = Policy() if body is None else as_policy(body)
  return dataclasses.replace(base, rules=(*rules, *base.rules))


def reference_policy(dtype: Any, base: Policy | None = None) -> Policy:
  """A policy that runs every module at ``dtype``, for jaxprec's reference runs.

  ``dtype`` may be ``'float64'`` (with ``jax_enable_x64``), which no user
  policy holds; such a policy's string (``default=dtype:float64``) is for
  cache keys and labels, and does not parse back. ``base``'s precisions are
  kept (its dtype rules are dropped).
  """
  name = numerics.canonical_dtype(dtype, allow_float64=True)
  base = base or Policy()
  rules = tuple(dataclasses.replace(r, dtype=None) for r in base.rules
                if r.precision is not None)
  policy = Policy(rules=rules, default=base.default)
  object.__setattr__(policy, "default_dtype", name)
  return policy


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
    rule: the rule that gave the precision; None for the default or no
      decision.
    calls: how many module method calls (or traced ops) it covered.
    kept: the module's code set its own ``precision=``, which it keeps:
      ``rule`` (or the default) matched it but decided nothing.
    dtype: the compute dtype given (``'bfloat16'``, ``'float16'``,
      ``'float32'``), or None (left as it was).
    dtype_how: how the dtype was applied: ``'field'`` (the module's
      ``dtype`` attribute was set), ``'boundary'`` (a linen module without
      one that a rule matched: its floating inputs and outputs were cast),
      ``'skipped'`` (a module without one under ``default_dtype``: left as
      it is, so the default is the model as built); None: no dtype decision.
    dtype_rule: the rule that gave the dtype; None for the default dtype or
      no decision.
  """

  path: str
  module_type: str | None
  op: str
  precision: Precision | None
  rule: Rule | None
  calls: int = 1
  kept: bool = False
  dtype: str | None = None
  dtype_how: str | None = None
  dtype_rule: Rule | None = None


def _precision_text(m: PolicyMatch) -> str:
  what = "-" if m.precision is None else m.precision.name
  why = str(m.rule) if m.rule is not None else (
      "default" if m.precision is not None else "no rule, no default")
  if m.kept:
    why = f"its own precision= (kept; {why} not applied)"
  return f"{what}  <- {why}"


def _dtype_text(m: PolicyMatch) -> str:
  why = str(m.dtype_rule) if m.dtype_rule is not None else "default"
  if m.dtype_how == "skipped":
    return f"dtype - (no dtype attribute; {why} not applied)"
  return f"dtype {m.dtype} ({m.dtype_how})  <- {why}"


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
    own ``precision=`` (or, for a dtype rule, cannot take a dtype)."""
    used = {m.rule for m in self.matches if m.rule is not None and not m.kept}
    used |= {m.dtype_rule for m in self.matches
             if m.dtype_rule is not None and m.dtype_how in ("field", "boundary")}
    return tuple(r for r in self.policy.rules if r not in used)

  @property
  def default_used(self) -> bool:
    return any((m.rule is None and m.precision is not None and not m.kept)
               or (m.dtype_rule is None and m.dtype_how in ("field", "boundary"))
               for m in self.matches)

  def __str__(self) -> str:
    lines = [f"policy: {self.policy}"]
    precisions = self.policy.default is not None or any(
        r.precision is not None for r in self.policy.rules)
    for m in self.matches:
      parts = [_precision_text(m)] if (
          precisions or m.precision is not None or m.kept) else []
      if m.dtype_how is not None:
        parts.append(_dtype_text(m))
      lines.append(f"  {m.path or '(top)'} [{m.module_type or '-'}, {m.op}]: "
                   + ("; ".join(parts) or _precision_text(m)))
    unused = self.unused_rules
    lines.append("unused rules: " + (", ".join(str(r) for r in unused)
                                     if unused else "none"))
    return "\n".join(lines)

  def to_markdown(self) -> str:
    """The report as a markdown table: one row per decision."""
    def cell(text: str) -> str:
      return text.replace("|", "\\|")

    lines = [f"Policy `{cell(str(self.policy))}`", "",
             "| module | type | op | precision | dtype | how | rule |",
             "|---|---|---|---|---|---|---|"]
    for m in self.matches:
      rules = [str(r) for r in (m.rule, m.dtype_rule) if r is not None]
      lines.append("| " + " | ".join(cell(x) for x in (
          m.path or "(top)", m.module_type or "-", m.op,
          "-" if m.precision is None else m.precision.name
          + (" (kept)" if m.kept else ""),
          m.dtype or "-", m.dtype_how or "-", ", ".join(rules) or "default"))
                   + " |")
    unused = self.unused_rules
    lines += ["", "Unused rules: " + (", ".join(f"`{cell(str(r))}`" for r in unused)
                                      if unused else "none")]
    return "\n".join(lines)
