"""The layout rules of docs/architecture.md, checked on the source."""

from __future__ import annotations

import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxprec"


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
    if module == "jaxprec._src.jaxpr.compat":
      continue
    text = path.read_text()
    if "jax._src" in text:
      lines = [i + 1 for i, line in enumerate(text.splitlines())
               if "jax._src" in line and not line.lstrip().startswith("#")]
      if lines:
        offenders.append((module, lines))
  assert not offenders


# The packages of jaxprec/_src, lowest first (docs/architecture.md). A module
# imports only modules of its own package or of a package below it, at any
# depth of its code (an import inside a function counts).
LAYERS = ("jaxpr", "core", "policy", "flax", "emulation", "modules", "inspect",
          "models", "torch", "checker", "search", "cli")
# Packages that never import Flax, not even inside a function: they work on
# any JAX function. (Flax models reach the emulation through the flax
# package, which imports Flax only when it is given a Flax object.)
FLAX_FREE = ("jaxpr", "core", "policy", "emulation")


def _package(module: str) -> str | None:
  parts = module.split(".")
  if parts[:2] != ["jaxprec", "_src"] or len(parts) < 3:
    return None
  return parts[2]


def _third_party_imports(module: str) -> set[str]:
  tree = ast.parse(MODULES[module].read_text())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      out.add(node.module.split(".")[0])
  return out


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
  """``(importer, imported)`` pairs where a module imports above its package.

  The public namespace (``jaxprec``, ``jaxprec.models``, ...) is above every
  package.
  """
  bad = []
  for module, imported in graph.items():
    here = _package(module)
    if here is None:
      continue
    for other in imported:
      there = _package(other)
      if there is None:
        if other != "jaxprec._src":
          bad.append((module, other))
      elif LAYERS.index(there) > LAYERS.index(here):
        bad.append((module, other))
  return sorted(bad)


def test_every_module_lives_in_a_package_of_the_layers():
  loose = [m for m in MODULES
           if m.startswith("jaxprec._src.") and _package(m) not in LAYERS]
  assert not loose, loose
  files = [p.name for p in (ROOT / "_src").glob("*.py")]
  assert files == ["__init__.py"], files
  assert sorted(p.name for p in (ROOT / "_src").iterdir()
                if p.is_dir() and p.name != "__pycache__") == sorted(LAYERS)


def test_each_package_imports_only_packages_below_it():
  graph = {m: _imports(m) for m in MODULES}
  assert not layer_violations(graph), layer_violations(graph)


def test_the_layer_rule_finds_an_import_that_runs_up():
  graph = {"jaxprec._src.core.numerics": {"jaxprec._src.emulation.kernels"},
           "jaxprec._src.emulation.kernels": {"jaxprec._src.core.numerics"},
           "jaxprec._src.cli.cli": {"jaxprec._src.checker.check"}}
  assert layer_violations(graph) == [("jaxprec._src.core.numerics",
                                      "jaxprec._src.emulation.kernels")]
  assert layer_violations({"jaxprec._src.core.env": {"jaxprec.models"}}) == [
      ("jaxprec._src.core.env", "jaxprec.models")]


def test_the_layer_rule_counts_imports_inside_functions(tmp_path, monkeypatch):
  source = tmp_path / "m.py"
  source.write_text("def f():\n  from jaxprec._src.cli import cli\n")
  monkeypatch.setitem(MODULES, "jaxprec._src.core.m", source)
  assert "jaxprec._src.cli.cli" in _imports("jaxprec._src.core.m")
  assert layer_violations({"jaxprec._src.core.m": {"jaxprec._src.cli.cli"}})


def test_emulation_and_policies_never_import_flax():
  offenders = {m: sorted(_third_party_imports(m) & {"flax"})
               for m in MODULES if _package(m) in FLAX_FREE}
  assert not {m: v for m, v in offenders.items() if v}


# The modules of jaxprec/_src/flax, lowest first (docs/architecture.md): each
# imports only those before it.
FLAX_ORDER = ("paths", "state", "hook", "interception", "scope", "nnx_policy")


def test_flax_modules_import_only_those_listed_before_them():
  flax = {m.rpartition(".")[2]: m for m in MODULES
          if _package(m) == "flax" and not m.endswith("._src.flax")}
  assert sorted(flax) == sorted(FLAX_ORDER)
  bad = [(name, other.rpartition(".")[2])
         for name, module in flax.items()
         for other in _imports(module) if _package(other) == "flax"
         and other.rpartition(".")[2] in FLAX_ORDER
         and FLAX_ORDER.index(other.rpartition(".")[2])
         >= FLAX_ORDER.index(name)]
  assert not bad, bad


# Class generation: only the one per-module hook (flax/hook.py) makes
# subclasses of a user's module classes and puts them on module objects.
# swap's linen module is a new module of its own (a subclass it builds
# anew, never set on an existing object), not a hook.
CLASS_MAKERS = {("jaxprec._src.flax.hook", None),
                ("jaxprec._src.modules.swap", "_swapped_class")}


def class_generation(tree: ast.AST) -> list[tuple[str | None, int, str]]:
  """``(function, line, what)`` of each class made or swapped at run time:
  a three-argument ``type(...)``, ``types.new_class``, and a write of
  ``__class__`` (``object.__setattr__(x, '__class__', c)`` or
  ``x.__class__ = c``)."""
  found = []

  def visit(node: ast.AST, where: str | None) -> None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      where = where or node.name
    if isinstance(node, ast.Call):
      f = node.func
      name = f.id if isinstance(f, ast.Name) else (
          f.attr if isinstance(f, ast.Attribute) else "")
      if name == "type" and len(node.args) == 3:
        found.append((where, node.lineno, "type(name, bases, namespace)"))
      elif name == "new_class":
        found.append((where, node.lineno, "types.new_class"))
      elif (name == "__setattr__" and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "__class__"):
        found.append((where, node.lineno, "__class__ set"))
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Attribute) and t.attr == "__class__"
        for t in node.targets):
      found.append((where, node.lineno, "__class__ assigned"))
    for child in ast.iter_child_nodes(node):
      visit(child, where)
  visit(tree, None)
  return found


def test_only_the_hook_makes_module_classes():
  bad = []
  for module, path in MODULES.items():
    for where, line, what in class_generation(ast.parse(path.read_text())):
      if ((module, None) not in CLASS_MAKERS
          and (module, where) not in CLASS_MAKERS):
        bad.append(f"{module}:{line} ({where}): {what}")
  assert not bad, bad


def test_the_class_generation_finder_finds_each_form():
  src = ("def f(c):\n  return type('C', (c,), {})\n"
         "def g(m, c):\n  object.__setattr__(m, '__class__', c)\n"
         "def h(m, c):\n  m.__class__ = c\n"
         "def k(c):\n  import types\n  return types.new_class('C', (c,))\n"
         "def ok(x):\n  return type(x)\n")
  found = class_generation(ast.parse(src))
  assert [(w, what) for w, _, what in found] == [
      ("f", "type(name, bases, namespace)"), ("g", "__class__ set"),
      ("h", "__class__ assigned"), ("k", "types.new_class")]
