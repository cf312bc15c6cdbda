"""`import jaxprec` loads what resolving a precision needs; the rest on first use.

Module sets, not timings: benchmarks/bench_import.py measures the time.
"""

import ast
import os
import pathlib
import pickle
import subprocess
import sys

import jaxprec

INIT = pathlib.Path(jaxprec.__file__)

# What `import jaxprec` loads: the names, the one table, precisions, scopes and
# the flag (core), and the jaxpr seams core uses. Nothing of emulation, policy,
# the Flax glue, inspection, the checker, the search, models, torch or the CLI.
LOADED_BY_IMPORT = {
    "jaxprec",
    "jaxprec._src",
    "jaxprec._src.core",
    "jaxprec._src.core.algorithms",
    "jaxprec._src.core.context",
    "jaxprec._src.core.env",
    "jaxprec._src.core.names",
    "jaxprec._src.core.numerics",
    "jaxprec._src.core.precision",
    "jaxprec._src.core.resumable",
    "jaxprec._src.core.version",
    "jaxprec._src.jaxpr",
    "jaxprec._src.jaxpr.compat",
    "jaxprec._src.jaxpr.trees",
    "jaxprec._src.jaxpr.walker",
}


def _run(code: str) -> list[str]:
  """The stdout lines of ``code`` run in a fresh interpreter."""
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                     timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr
  return r.stdout.splitlines()


_LOADED = "sorted(m for m in sys.modules if m.startswith('jaxprec'))"


def test_import_jaxprec_loads_exactly_the_core_modules():
  out = _run(f"import sys, jaxprec; print({_LOADED}); "
             "print(sorted(m for m in ('flax', 'optax', 'torch', 'rich') if m in sys.modules))")
  assert eval(out[0]) == sorted(LOADED_BY_IMPORT)  # pylint: disable=eval-used
  assert out[1] == "[]"


def test_a_name_loads_its_module_on_first_use_and_is_the_same_object():
  out = _run(
      "import sys, jaxprec\n"
      "print('jaxprec._src.checker.check' in sys.modules)\n"
      "check = jaxprec.check\n"
      "from jaxprec._src.checker import check as m\n"
      "print('jaxprec._src.checker.check' in sys.modules, check is m.check)\n"
      "print('check' in vars(jaxprec), jaxprec.check is check)\n"
      "from jaxprec import audit\n"
      "print('jaxprec._src.inspect.audit' in sys.modules, 'jaxprec._src.search.search' in "
      "sys.modules)\n")
  assert out == ["False", "True True", "True True", "True False"]


def test_precision_scopes_load_nothing_more():
  out = _run(
      "import sys, jax.numpy as jnp, jaxprec\n"
      "@jaxprec.precision('bfloat16')\n"
      "def f(x):\n  return x @ x\n"
      "f(jnp.ones((2, 2)))\n"
      "with jaxprec.precision('highest'):\n  print(jaxprec.current().name)\n"
      f"print({_LOADED})\n")
  assert out[0] == "float32"
  assert eval(out[1]) == sorted(LOADED_BY_IMPORT)  # pylint: disable=eval-used


def _init_imports() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
  """``(module, name)`` that jaxprec/__init__.py imports at import (but
  private aliases) and under ``if _typing.TYPE_CHECKING:``."""
  tree = ast.parse(INIT.read_text())
  eager, guarded = set(), set()
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module.startswith("jaxprec._src"):
      eager.update((node.module, a.name) for a in node.names if not a.asname)
    elif isinstance(node, ast.If) and ast.unparse(node.test) == "_typing.TYPE_CHECKING":
      for sub in node.body:
        assert isinstance(sub, ast.ImportFrom), ast.unparse(sub)
        guarded.update((sub.module, a.name) for a in sub.names)
  return eager, guarded


def test_type_checkers_see_every_lazy_name_where_it_is_loaded_from():
  eager, guarded = _init_imports()
  table = {(m, n) for m, names in jaxprec._LAZY_NAMES.items() for n in names}  # pylint: disable=protected-access
  assert guarded == table
  names = [n for _, n in eager | guarded if n != "__version__"]
  assert sorted(names) == sorted(jaxprec.__all__)
  assert all(m.startswith("jaxprec._src.core.") for m, _ in eager)
  # A module __getattr__ that type checkers saw would make every misspelt
  # name Any: it is defined under `if not _typing.TYPE_CHECKING:` only.
  tree = ast.parse(INIT.read_text())
  assert not [f for f in tree.body if isinstance(f, ast.FunctionDef)]
  hidden = [n for n in tree.body if isinstance(n, ast.If)
            and ast.unparse(n.test) == "not _typing.TYPE_CHECKING"]
  assert [f.name for f in hidden[0].body] == ["__getattr__", "__dir__"]


def test_the_check_on_the_init_finds_a_name_missing_from_the_guarded_block(tmp_path,
                                                                           monkeypatch):
  text = INIT.read_text().replace(
      "  from jaxprec._src.inspect.cost import cost\n", "")
  (tmp_path / "__init__.py").write_text(text)
  monkeypatch.setattr(sys.modules[__name__], "INIT", tmp_path / "__init__.py")
  _, guarded = _init_imports()
  assert ("jaxprec._src.inspect.cost", "cost") not in guarded
  assert len(guarded) == sum(map(len, jaxprec._LAZY_NAMES.values())) - 1  # pylint: disable=protected-access


def test_every_public_name_resolves_to_its_module_s_object():
  import importlib  # pylint: disable=import-outside-toplevel
  _, guarded = _init_imports()
  for module, name in guarded:
    assert getattr(jaxprec, name) is getattr(importlib.import_module(module), name), name


def test_dir_star_import_and_help_see_every_name_before_any_is_loaded():
  out = _run(
      "import sys, pydoc, jaxprec\n"
      "print(sorted(set(jaxprec.__all__) - set(dir(jaxprec))))\n"
      "print(all(m in dir(jaxprec) for m in ('linen', 'nnx', 'models', 'testing', 'torch')))\n"
      f"print({_LOADED} == {sorted(LOADED_BY_IMPORT)!r})\n"
      "ns = {}\n"
      "exec('from jaxprec import *', ns)\n"
      "print(sorted(set(jaxprec.__all__) - set(ns)))\n"
      "text = pydoc.render_doc(jaxprec, renderer=pydoc.plaintext)\n"
      "print(all(n in text for n in ('check_module', 'search_policy', 'PolicyMatch')))\n")
  assert out == ["[]", "True", "True", "[]", "True"]


def test_unknown_names_raise_attribute_error():
  import pytest  # pylint: disable=import-outside-toplevel
  with pytest.raises(AttributeError, match="module 'jaxprec' has no attribute 'chek'"):
    jaxprec.chek  # pylint: disable=pointless-statement
  assert not hasattr(jaxprec, "_src_nothing")


def test_objects_unpickle_in_a_process_that_never_imported_their_module():
  p = jaxprec.Policy(rules=[jaxprec.Rule(path=".*attention.*", precision="float32")],
                     default="bf16")
  blob = pickle.dumps((p, jaxprec.audit, jaxprec.resolve("tf32")))
  out = _run(f"import pickle, sys; p, f, q = pickle.loads({blob!r}); "
             "print(p, f.__name__, q.name, 'jaxprec._src.inspect.audit' in sys.modules)")
  assert out == [f"{p} audit tensorfloat32 True"]


def test_python_m_jaxprec_info_loads_no_checker_search_or_flax():
  out = _run("import runpy, sys\n"
             "sys.argv = ['jaxprec', 'info', '--json']\n"
             "try:\n  runpy.run_module('jaxprec', run_name='__main__')\n"
             "except SystemExit as e:\n  assert not e.code, e.code\n"
             "print(sorted(m for m in ('flax', 'torch', 'jaxprec._src.checker', "
             "'jaxprec._src.search', 'jaxprec._src.models', "
             "'jaxprec._src.inspect.audit', 'jaxprec._src.flax', "
             "'jaxprec._src.policy', 'jaxprec._src.emulation.emulate') "
             "if m in sys.modules))\n")
  # explain needs the precision table, not the audit (and so no Flax glue).
  assert out[-1] == "[]"
