"""The text grammar of policies: names, selectors, values, escapes.

Pure string handling for :mod:`jaxprec._src.policy.policy` (which documents the
grammar on :meth:`jaxprec.Policy.parse`): the module types and op kinds a
selector names, the scan that finds top-level separators in a regex, the
escapes of ``,`` and ``&``, and the value of an entry (a precision, a
``dtype:``, or both joined by ``+``). Imports no Flax and no runtime.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from jaxprec._src.core import names
from jaxprec._src.core import numerics
from jaxprec._src.core.precision import Precision, resolve

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
# The prefixes of a value's items (a bare item is a precision).
_ITEM_PREFIXES = ("dtype:", "precision:")
# A selector that ends so reads as a value item typo (check_item_typo).
_ITEM_TYPO = re.compile(r"=\s*(dtype|precision)\s*$", re.IGNORECASE)


def canonical_op(op: Any) -> str:
  """``'dot'``, ``'conv'`` or ``'attention'`` (any case); ValueError otherwise."""
  return names.check_choice(op, OP_KINDS, "op kind")


def canonical_type(module_type: Any) -> str:
  """One of :data:`MODULE_TYPES` for a type name or alias (any case)."""
  if isinstance(module_type, str):
    key = module_type.strip().lower()
    for name in (*MODULE_TYPES, *TYPE_ALIASES):
      if name.lower() == key:
        return TYPE_ALIASES.get(name, name)
  raise names.unknown("module type", module_type, (*MODULE_TYPES, *TYPE_ALIASES))


@functools.lru_cache(maxsize=1024)
def compile_path(pattern: str) -> re.Pattern:
  """The compiled module-path regex; ValueError naming it if invalid."""
  try:
    return re.compile(pattern)
  except re.error as e:
    raise ValueError(f"Invalid module path regex {pattern!r}: {e}.") from None


def to_precision(value: Any, where: str) -> Precision:
  """``resolve(value)``, its error prefixed with ``where``."""
  try:
    return resolve(value)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def to_dtype(value: Any, where: str) -> str:
  """:func:`jaxprec._src.core.numerics.canonical_dtype`, its error prefixed."""
  try:
    return numerics.canonical_dtype(value)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------
# Selectors: top-level separators and escapes in regexes.


# What the scan skips whole: a character class (a ``]`` first in it is
# literal; unterminated, it runs to the end), or a repetition ``{m,n}`` (its
# comma may be escaped: then a literal text that must stay as written). Any
# other brace is a literal character in a regex.
_SKIP = re.compile(r"\[\^?\]?(?:\\.|[^\\\]])*\]?|\{\d*(?:\\?,\d*)?\}", re.S)


def scan(text: str, seps: str, *, escaped: bool = False
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
    skip = _SKIP.match(text, i) if c in "[{" else None
    if skip:
      i = skip.end()
      continue
    if c == "(":
      depth += 1
    elif c == ")":
      depth = max(0, depth - 1)
    elif depth == 0 and c in seps and not escaped:
      out.append((i, c))
    i += 1
  return out


def split(text: str, sep: str) -> list[str]:
  """``text`` split at its top-level ``sep`` characters (:func:`scan`)."""
  cuts = [i for i, _ in scan(text, sep)]
  return [text[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(text)])]


def unescape(regex: str) -> str:
  r"""Top-level ``\,`` and ``\&`` become ``,`` and ``&`` (same regex).

  Inside (), [] and ``{m,n}`` they are kept as written: there they need no
  escape in a policy string, and ``{1\,2}`` (literal text) must not become
  the repetition ``{1,2}``. This is also the canonical form a rule stores,
  so that ``Policy.parse(str(p)) == p``.
  """
  out = list(regex)
  for i, _ in reversed(scan(regex, ",&", escaped=True)):
    del out[i]
  return "".join(out)


def format_path(regex: str) -> str:
  """A regex as a policy-string term that parses back to the same regex."""
  escaped = list(regex)
  for i, _ in reversed(scan(regex, ",&")):
    escaped[i] = "\\" + regex[i]
  text = "".join(escaped)
  if (text in _RESERVED or text.startswith(_PREFIXES) or text != text.strip()
      or not text or _ITEM_TYPO.search(text)):
    text = "path:" + text
  return text


def parse_selector(selector: str, entry: str) -> dict[str, str]:
  """The ``path``/``module_type``/``op`` fields of a selector's terms."""
  fields: dict[str, str] = {}
  for raw in split(selector, "&"):
    term = raw.strip()
    if not term:
      raise ValueError(f"Invalid policy entry {entry!r}: empty term in {selector!r}.")
    if term.startswith("op:"):
      key, value = "op", term[3:].strip()
    elif term.startswith("type:"):
      key, value = "module_type", term[5:].strip()
    elif term.startswith("path:"):
      key, value = "path", unescape(raw.lstrip()[5:])
    elif term in OP_KINDS:
      key, value = "op", term
    elif term in MODULE_TYPES or term in TYPE_ALIASES:
      key, value = "module_type", term
    else:
      key, value = "path", unescape(term)
    if key in fields:
      raise ValueError(f"Invalid policy entry {entry!r}: two {key} terms.")
    fields[key] = value
  return fields


# ---------------------------------------------------------------------------
# Values: PRECISION | "dtype:" DTYPE | "precision:" PRECISION, joined by "+".


def parse_value(value: str, entry: str) -> tuple[Precision | None, str | None]:
  """``(precision, dtype)`` of an entry's value; either may be None, not both.

  Raises:
    ValueError: naming the entry: an empty item, two precisions or two
      dtypes, an unknown precision (with "did you mean" for a misspelt
      ``dtype:`` prefix) or dtype.
  """
  where = f"Invalid policy entry {entry!r}"
  if not value.strip():
    raise ValueError(f"{where}: empty precision or dtype.")
  precision: Precision | None = None
  dtype: str | None = None
  for raw in value.split("+"):
    item = raw.strip()
    if not item:
      raise ValueError(f"{where}: empty item in {value.strip()!r} (items are "
                       f"joined by '+', e.g. 'bf16+dtype:float32').")
    if item.lower().startswith("dtype:"):
      if dtype is not None:
        raise ValueError(f"{where}: two dtypes.")
      dtype = to_dtype(item[6:].strip(), where)
      continue
    if item.lower().startswith("precision:"):
      item = item[10:].strip()
    if precision is not None:
      raise ValueError(f"{where}: two precisions.")
    precision = _item_precision(item, where)
  return precision, dtype


def check_item_typo(selector: str, value: str, entry: str) -> None:
  """ValueError for ``X=dtype=NAME`` (or ``X=precision=NAME``): a value item
  written with ``=`` instead of ``:``, which would read as a path ``X=dtype``."""
  head, sep, tail = selector.rpartition("=")
  name = tail.strip().lower()
  # A last term "path:..." is explicit: a regex that ends with "=dtype"
  # (format_path writes it).
  if (sep and name in ("dtype", "precision")
      and not split(selector, "&")[-1].strip().startswith("path:")):
    raise ValueError(
        f"Invalid policy entry {entry!r}: a value item is written "
        f"'{name}:NAME', with ':'. Did you mean "
        f"'{head.strip()}={name}:{value.strip()}'?")


def _item_precision(item: str, where: str) -> Precision:
  try:
    return to_precision(item, where)
  except ValueError as e:
    head, sep, rest = item.partition(":")
    if not sep:
      raise
    close = names.close_name(head + ":", _ITEM_PREFIXES)
    if close is None:
      raise
    # The precision's own suggestion gives way to the prefix's.
    msg = re.sub(r" Did you mean '[^']*'\?", "", str(e), count=1)
    raise ValueError(
        f"{msg} Items are a precision, 'dtype:NAME' or 'precision:NAME'. "
        f"Did you mean '{close}{rest.strip()}'?") from None


def format_value(precision: Precision | None, dtype: str | None) -> str:
  """The text of a value: the precision first, then ``dtype:NAME``."""
  items = [] if precision is None else [precision.name]
  if dtype is not None:
    items.append(f"dtype:{dtype}")
  return "+".join(items)
