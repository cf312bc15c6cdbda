"""The layout rules of docs/architecture.md, checked on the source."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxprec"
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
  """The jaxprec module an import of ``name`` runs (None: not jaxprec's)."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _imports(module: str) -> set[str]:
  """Every jaxprec module ``module`` imports, at any depth of its code."""
  path = MODULES[module]
  tree = ast.parse(path.read_text(), str(path))
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        pkg = package
        for _ in range(node.level - 1):
          pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
      names = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    for n in names:
      if n.startswith("jaxprec"):
        target = _resolve(n)
        if target and target != module:
          out.add(target)
  return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component with more than one module."""
  index, low, stack, on, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        found.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_import_graph_has_no_cycles_function_level_imports_included():
  graph = {m: _imports(m) for m in MODULES}
  # A package's __init__ is imported whenever a module inside it is: an import
  # of jaxprec.* from inside jaxprec/_src that reaches jaxprec/__init__.py
  # closes a loop through the public namespace.
  assert not _cycles(graph), _cycles(graph)


def test_the_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_private_jax_is_imported_only_in_compat():
  offenders = []
  for module, path in MODULES.items():
    if module == "jaxprec._src.compat":
      continue
    text = path.read_text()
    if "jax._src" in text:
      lines = [i + 1 for i, line in enumerate(text.splitlines())
               if "jax._src" in line and not line.lstrip().startswith("#")]
      if lines:
        offenders.append((module, lines))
  assert not offenders


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_file_is_at_most_about_600_lines(module):
  n = len(MODULES[module].read_text().splitlines())
  assert n <= MAX_LINES, f"{MODULES[module]} has {n} lines"
