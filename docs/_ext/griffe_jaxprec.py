"""Griffe extension for the docs site: jaxprec's docstring habits, in Markdown.

Two habits of jaxprec's Google-style docstrings that griffe's Google parser
does not read, rewritten before mkdocstrings renders a docstring (the sources
are not changed):

* Sphinx roles (``:func:`resolve```, ``:class:`~jaxprec.Numerics```), which
  Markdown would show verbatim (":func:resolve"). Each becomes inline code,
  linked to the API page (``[`resolve()`][jaxprec.resolve]``) when it names
  something in ``jaxprec.__all__``; other targets (private functions, other
  libraries) stay plain code, so a strict build never sees a dangling link.
* Grouped entries in Args/Attributes sections (``atol, rtol: the tolerance.``,
  possibly with the names over several lines). Each name gets its own entry
  with the shared description, so griffe matches them to the signature.

Loaded by ``mkdocs.yml`` (``extensions:`` of the mkdocstrings python handler).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?P<kind>func|meth|class|attr|mod|data|obj|exc|const):"
    r"`(?P<tilde>~?)(?P<target>[^`<>]+?)`")
_CALLABLE = ("func", "meth")
_NAME_SECTIONS = re.compile(
    r"^(?P<indent>\s*)(Args|Arguments|Params|Parameters|Attributes|Keyword Args|"
    r"Keyword Arguments|Other Parameters):\s*$")
_NAME = r"\*{0,2}\w+"
_GROUP = re.compile(
    rf"^(?P<names>{_NAME}(?:\s*,\s*{_NAME})+)\s*(?P<type>\([^)]*\))?\s*:(?P<rest>.*)$")
_NAMES_LINE = re.compile(rf"^{_NAME}(?:\s*,\s*{_NAME})*\s*,\s*$")


def convert_roles(text: str, exports: Iterable[str], package: str = "jaxprec") -> str:
  """Replaces Sphinx roles in ``text`` by Markdown code and autorefs links.

  Args:
    text: a docstring.
    exports: the package's public names (``__all__``); roles naming one of
      them are linked to ``package.name``.
    package: the package name, optional in role targets.

  Returns:
    ``text`` with every role replaced.
  """
  public = set(exports)

  def repl(m: re.Match) -> str:
    target = m["target"].strip()
    shown = target.rsplit(".", 1)[-1] if m["tilde"] else target
    if m["kind"] in _CALLABLE:
      shown += "()"
    name = target[len(package) + 1:] if target.startswith(package + ".") else target
    if name in public:
      return f"[`{shown}`][{package}.{name}]"
    return f"`{shown}`"

  return ROLE.sub(repl, text)


def split_grouped_names(text: str) -> str:
  """Gives each name of a grouped Args/Attributes entry its own entry.

  Args:
    text: a docstring.

  Returns:
    ``text`` where ``a, b (int): desc`` (names possibly spread over lines that
    end with a comma) is one ``a (int): desc`` entry per name, continuation
    lines repeated.
  """
  lines = text.split("\n")
  out: list[str] = []
  i = 0
  while i < len(lines):
    header = _NAME_SECTIONS.match(lines[i])
    out.append(lines[i])
    i += 1
    if not header:
      continue
    base = len(header["indent"])
    item_indent = None
    while i < len(lines):
      line = lines[i]
      indent = len(line) - len(line.lstrip())
      if line.strip() and indent <= base:
        break  # the section ended
      if not line.strip() or (item_indent is not None and indent > item_indent):
        out.append(line)
        i += 1
        continue
      item_indent = indent if item_indent is None else item_indent
      # An entry: its names may run over several lines ending with a comma.
      j, head = i, line.strip()
      while _NAMES_LINE.match(head) and j + 1 < len(lines):
        j += 1
        head += " " + lines[j].strip()
      group = _GROUP.match(head)
      if not group:
        out.append(line)
        i += 1
        continue
      body = []
      k = j + 1
      while k < len(lines) and (not lines[k].strip() or
                                len(lines[k]) - len(lines[k].lstrip()) > indent):
        body.append(lines[k])
        k += 1
      while body and not body[-1].strip():
        k -= 1
        body.pop()
      pad = " " * indent
      kind = f" {group['type']}" if group["type"] else ""
      for name in re.split(r"\s*,\s*", group["names"]):
        out.append(f"{pad}{name}{kind}:{group['rest']}")
        out.extend(body)
      i = k
  return "\n".join(out)


class JaxprecDocstrings(griffe.Extension):
  """Rewrites the docstrings of a loaded package (roles, grouped names)."""

  def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
    exports = [str(e) for e in (pkg.exports or ())]
    stack: list[Any] = [pkg]
    while stack:
      obj = stack.pop()
      if obj.docstring is not None:
        value = split_grouped_names(obj.docstring.value)
        obj.docstring.value = convert_roles(value, exports, pkg.name)
      stack.extend(m for m in obj.members.values() if not m.is_alias)
