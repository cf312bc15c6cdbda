"""Tests for the documentation: the mkdocs site, its nav, links and examples.

* Every page in ``docs/`` is in ``mkdocs.yml``'s nav, and every nav entry exists.
* ``docs/api.md`` documents exactly ``__all__`` of jaxprec and of its public
  submodules (``jaxprec.linen``, ``jaxprec.nnx``).
* Every relative link in README.md and docs/*.md points to an existing file.
* ``mkdocs build --strict`` succeeds (broken links, anchors and missing
  docstring references fail it) when the ``docs`` extra is installed.
* The ``python`` code blocks of the hand-written pages run.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

import jaxprec

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
# Pages whose ```python blocks are run (the others show output or shell sessions,
# or are checked by their own tests and doctests).
RUNNABLE_PAGES = ("index.md", "getting-started.md", "pytorch.md")
DOCS_EXTRA = 'pip install -e ".[docs]"'


def _docs_pages() -> set[str]:
  return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}


def _nav_pages(nav) -> list[str]:
  """The .md files named anywhere in a mkdocs nav (nested sections included)."""
  out: list[str] = []
  if isinstance(nav, str):
    if not re.match(r"^[a-z]+://", nav):
      out.append(nav)
  elif isinstance(nav, list):
    for item in nav:
      out += _nav_pages(item)
  elif isinstance(nav, dict):
    for value in nav.values():
      out += _nav_pages(value)
  return out


def _load_mkdocs_yml() -> dict:
  yaml = pytest.importorskip(
      "yaml", reason=f"PyYAML is needed to read mkdocs.yml; {DOCS_EXTRA}")
  # mkdocs.yml may use tags such as !ENV or !!python/name; ignore them.
  class Loader(yaml.SafeLoader):
    pass
  Loader.add_multi_constructor("", lambda loader, suffix, node: None)
  Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
  with open(MKDOCS_YML, encoding="utf-8") as f:
    return yaml.load(f, Loader=Loader)  # noqa: S506 -- safe loader subclass


# -- nav ----------------------------------------------------------------------


def test_nav_lists_every_page_and_only_existing_pages():
  config = _load_mkdocs_yml()
  assert config.get("docs_dir", "docs") == "docs"
  nav = _nav_pages(config["nav"])
  assert len(nav) == len(set(nav)), f"pages listed twice in mkdocs.yml nav: {nav}"
  pages = _docs_pages()
  missing_from_nav = sorted(pages - set(nav))
  missing_files = sorted(set(nav) - pages)
  assert not missing_from_nav, (
      f"docs/ pages not in mkdocs.yml nav: {missing_from_nav}; add a line such as "
      f"'  - Page title: {missing_from_nav[0]}' under nav: in mkdocs.yml")
  assert not missing_files, (
      f"mkdocs.yml nav names pages that do not exist in docs/: {missing_files}")


def test_nav_walker_finds_nested_entries():
  nav = [{"Home": "index.md"},
         {"Guide": ["a.md", {"B": "sub/b.md"}, {"Ext": "https://example.com"}]}]
  assert _nav_pages(nav) == ["index.md", "a.md", "sub/b.md"]


def test_mkdocs_yml_is_strict_about_omitted_files():
  config = _load_mkdocs_yml()
  assert config["strict"] is True
  assert config["validation"]["omitted_files"] == "warn"  # a warning fails --strict
  assert config["validation"]["links"]["not_found"] == "warn"
  assert config["validation"]["links"]["anchors"] == "warn"


# -- API page -----------------------------------------------------------------


def _public_modules() -> dict[str, list[str]]:
  """``{module: __all__}`` for jaxprec and its public submodules (read, not imported)."""
  pkg = ROOT / "jaxprec"
  files = {"jaxprec": pkg / "__init__.py"}
  files.update({f"jaxprec.{p.stem}": p for p in sorted(pkg.glob("*.py"))
                if not p.stem.startswith("_")})
  out = {}
  for module, path in files.items():
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
      if (isinstance(node, ast.Assign)
          and any(getattr(t, "id", None) == "__all__" for t in node.targets)):
        out[module] = list(ast.literal_eval(node.value))
    assert module in out, f"{path.relative_to(ROOT)} has no literal __all__"
  return out


def _api_blocks() -> dict[str, list[str]]:
  """``{module: members}`` of the ``::: module`` blocks in docs/api.md, in
  page order; a module may have several blocks (the page groups
  ``jaxprec``'s names: entry points first, constants last)."""
  text = (DOCS / "api.md").read_text(encoding="utf-8")
  out: dict[str, list[str]] = {}
  for m in re.finditer(r"^::: (\S+)\n((?:[ \t]+\S.*\n?)*)", text, re.M):
    members = re.search(r"^(\s+)members:\n((?:\1\s+- \S+\n?)+)", m.group(2), re.M)
    assert members, f"docs/api.md's '::: {m.group(1)}' block lists no members"
    out.setdefault(m.group(1), []).extend(re.findall(r"- (\S+)", members.group(2)))
  return out


def _api_block(module: str, names: list[str]) -> str:
  members = "".join(f"        - {n}\n" for n in names)
  return (f"## `{module}`\n\n::: {module}\n    options:\n      show_root_heading: false\n"
          f"      heading_level: 3\n      members:\n{members}")


def test_api_page_documents_exactly_the_public_api():
  modules = _public_modules()
  assert modules["jaxprec"] == list(jaxprec.__all__)
  blocks = _api_blocks()
  missing = [m for m in modules if m not in blocks]
  assert not missing, (
      f"docs/api.md documents no {missing}; add a section such as\n\n"
      + "\n".join(_api_block(m, modules[m]) for m in missing))
  extra = sorted(set(blocks) - set(modules))
  assert not extra, f"docs/api.md documents {extra}, which are not public modules"
  for module, public in modules.items():
    members = blocks[module]
    twice = sorted({n for n in members if members.count(n) > 1})
    assert not twice, f"docs/api.md documents {module}'s {twice} twice"
    assert sorted(members) == sorted(public), (
        f"docs/api.md's members of {module} differ from its __all__ "
        f"(add {sorted(set(public) - set(members))}, "
        f"remove {sorted(set(members) - set(public))}); for a new module the "
        f"block reads\n\n{_api_block(module, public)}")


def test_api_page_opens_with_the_entry_points_and_ends_with_constants():
  members = _api_blocks()["jaxprec"]
  assert members[:7] == ["resolve", "precision", "current", "explain",
                         "emulate", "audit", "check"], members[:7]
  assert "search_policy" in members[:12]
  assert members[-2:] == ["CHIPS", "ENV_VAR"]


def _docs_extension():
  pytest.importorskip("griffe", reason=f"griffe is part of the docs extra: {DOCS_EXTRA}")
  spec = importlib.util.spec_from_file_location(
      "griffe_jaxprec", DOCS / "_ext" / "griffe_jaxprec.py")
  ext = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ext)
  return ext


def test_docs_extension_converts_sphinx_roles():
  ext = _docs_extension()
  text = ("See :func:`resolve`, :class:`~jaxprec.Numerics`, :meth:`Policy.parse`,\n"
          ":py:func:`jaxprec.audit`, :mod:`jaxprec._src.jaxpr.walker` and :attr:`AuditRow.tpu`.")
  assert ext.convert_roles(text, ["resolve", "Numerics", "audit", "Policy"]) == (
      "See [`resolve()`][jaxprec.resolve], [`Numerics`][jaxprec.Numerics], "
      "`Policy.parse()`,\n[`jaxprec.audit()`][jaxprec.audit], "
      "`jaxprec._src.jaxpr.walker` and `AuditRow.tpu`.")
  assert ext.convert_roles("no roles: `code`, ``more``", ["x"]) == "no roles: `code`, ``more``"


def test_docs_extension_splits_grouped_names():
  ext = _docs_extension()
  doc = ("Summary, a, b: not a section.\n\n"
         "Args:\n"
         "  lhs, rhs, window_strides,\n"
         "  padding: as ``lax.conv``.\n"
         "  atol, rtol (float): the tolerance,\n"
         "    two lines.\n"
         "  x: one name.\n\n"
         "Returns:\n"
         "  a, b: kept as it is.\n\n"
         "Attributes:\n"
         "    tpu, gpu: where.\n")
  assert ext.split_grouped_names(doc) == (
      "Summary, a, b: not a section.\n\n"
      "Args:\n"
      "  lhs: as ``lax.conv``.\n"
      "  rhs: as ``lax.conv``.\n"
      "  window_strides: as ``lax.conv``.\n"
      "  padding: as ``lax.conv``.\n"
      "  atol (float): the tolerance,\n    two lines.\n"
      "  rtol (float): the tolerance,\n    two lines.\n"
      "  x: one name.\n\n"
      "Returns:\n"
      "  a, b: kept as it is.\n\n"
      "Attributes:\n"
      "    tpu: where.\n"
      "    gpu: where.\n")


# -- home page ----------------------------------------------------------------


def _two_commands(markdown: str) -> list[str]:
  section = re.search(r"^## Two commands\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
  assert section, "no '## Two commands' section"
  return [c.strip() for c in re.findall(r"^```bash\n(.*?)^```", section.group(1), re.M | re.S)]


def test_home_page_repeats_the_readme_commands():
  readme = _two_commands((ROOT / "README.md").read_text(encoding="utf-8"))
  index = _two_commands((DOCS / "index.md").read_text(encoding="utf-8"))
  assert len(readme) == 2, readme
  assert index == readme, (
      "docs/index.md's 'Two commands' must be README.md's, verbatim:\n"
      f"README: {readme}\nindex:  {index}")


# -- links --------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_HTML_LINK = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)=["']([^"']+)["']""", re.I)


def _link_targets(markdown: str) -> list[str]:
  """Link targets in Markdown text, outside code blocks and code spans."""
  text = _FENCE.sub("", markdown)
  text = _INLINE_CODE.sub("", text)
  return (_INLINE_LINK.findall(text) + _REF_LINK.findall(text)
          + _HTML_LINK.findall(text))


def _broken_links(path: pathlib.Path) -> list[str]:
  broken = []
  for target in _link_targets(path.read_text(encoding="utf-8")):
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
      continue  # a URL (http:, mailto:, ...) or an anchor on the same page
    file_part = target.split("#", 1)[0].split("?", 1)[0]
    if file_part.startswith("/"):
      broken.append(f"{target} (absolute path; use a relative link)")
    elif not (path.parent / file_part).exists():
      broken.append(target)
  return broken


def _markdown_files() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(path):
  assert path.exists()
  broken = _broken_links(path)
  assert not broken, f"{path.relative_to(ROOT)}: broken relative links: {broken}"


def test_docs_link_inside_the_site():
  # mkdocs can only serve files under docs/: a link out of it breaks on the site.
  for path in sorted(DOCS.rglob("*.md")):
    for target in _link_targets(path.read_text(encoding="utf-8")):
      file_part = target.split("#", 1)[0]
      if file_part and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
        resolved = (path.parent / file_part).resolve()
        assert DOCS in resolved.parents, (
            f"{path.relative_to(ROOT)} links to {target}, outside docs/")


def test_link_checker_finds_broken_links(tmp_path):
  page = tmp_path / "page.md"
  (tmp_path / "there.md").write_text("# there\n")
  page.write_text(
      "[ok](there.md) [ok too](there.md#a-heading) [web](https://example.com)\n"
      "[anchor](#x) [gone](missing.md) ![img](img/missing.png)\n"
      "[ref]: also-missing.md\n"
      "`[in code](nope.md)`\n\n```\n[in a fence](nope.md)\n```\n"
      '<a href="html-missing.md">x</a> [abs](/etc/passwd)\n')
  assert sorted(_broken_links(page)) == sorted([
      "missing.md", "img/missing.png", "also-missing.md", "html-missing.md",
      "/etc/passwd (absolute path; use a relative link)"])


# -- the mkdocs build -----------------------------------------------------------


def _missing_docs_packages() -> list[str]:
  needed = {"mkdocs": "mkdocs", "material": "mkdocs-material",
            "mkdocstrings": "mkdocstrings",
            "mkdocstrings_handlers.python": "mkdocstrings[python]"}
  missing = []
  for module, package in needed.items():
    try:
      found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
      found = False
    if not found:
      missing.append(package)
  return missing


def test_mkdocs_build_strict(tmp_path):
  missing = _missing_docs_packages()
  if missing:
    pytest.skip(f"docs extra not installed ({', '.join(missing)} missing): {DOCS_EXTRA}")
  site = tmp_path / "site"
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONWARNINGS="ignore")
  proc = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
       str(MKDOCS_YML), "-d", str(site)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
  assert "WARNING -" not in log, log
  for page in _docs_pages():
    html = site / (page[:-3] + "/index.html" if page != "index.md" else "index.html")
    assert html.exists(), f"{page} was not built ({html})"
  api = (site / "api" / "index.html").read_text(encoding="utf-8")
  for module, names in _public_modules().items():
    for name in names:
      # mkdocstrings gives every documented object an anchor with its path.
      assert f'id="{module}.{name}"' in api, f"{module}.{name} is not on the API page"
  # Sphinx roles were turned into code and links (docs/_ext/griffe_jaxprec.py).
  assert not re.search(r":(func|class|meth|attr|mod|data):", api)


# -- examples -----------------------------------------------------------------


def _python_blocks(page: str) -> list[str]:
  text = (DOCS / page).read_text(encoding="utf-8")
  blocks = re.findall(r"^```python([^\n]*)\n(.*?)^```[ \t]*$", text, re.M | re.S)
  return [code for info, code in blocks if 'title="PyTorch"' not in info]


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_python_examples_run(page, tmp_path):
  blocks = _python_blocks(page)
  if page != "index.md":
    assert blocks, f"docs/{page} has no python examples to run"
  if not blocks:
    return
  script = tmp_path / "examples.py"
  script.write_text("\n\n".join(blocks), encoding="utf-8")
  env = {k: v for k, v in os.environ.items() if k != jaxprec.ENV_VAR}
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (
      f"docs/{page} examples failed:\n{proc.stdout}\n{proc.stderr}")


def test_pytorch_table_matches_resolve():
  """docs/pytorch.md's first table says what jaxprec.resolve says."""
  text = (DOCS / "pytorch.md").read_text(encoding="utf-8")
  rows = re.findall(
      r"^\| `'(highest|high|medium)'`[^|]*\|[^|]*\| `(\w+)`[^|]*\| `(\w+)` \| "
      r"`(\w+)`[^|]*\| `(\w+)` \| `(\w+)` \|$", text, re.M)
  assert [r[0] for r in rows] == ["highest", "high", "medium"], rows
  for torch_name, name, flag, tpu, gpu, cpu in rows:
    p = jaxprec.resolve(torch_name)
    assert (p.name, p.flag, p.tpu.algorithm, p.gpu.algorithm, p.cpu.algorithm) == (
        name, flag, tpu, gpu, cpu), torch_name


def _oldest_pins() -> dict[str, str]:
  lines = (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
  pins = dict(l.split("==") for l in lines if l.strip() and not l.startswith("#"))
  return {k.strip().lower().replace("_", "-"): v.strip() for k, v in pins.items()}


def test_supported_versions_are_the_ones_ci_tests_at_the_oldest_end():
  import tomllib
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  floors = {}
  for dep in project["dependencies"]:
    name, _, low = dep.partition(">=")
    floors[name.strip().lower().replace("_", "-")] = low.split(",")[0].strip()
  pins = _oldest_pins()
  for name in ("jax", "flax", "optax", "chex", "numpy", "ml-dtypes"):
    # The declared floor is the release CI installs (0.10 means 0.10.0).
    floor = tuple(int(x) for x in floors[name].split("."))
    pinned = tuple(int(x) for x in pins[name].split("."))
    assert pinned[:len(floor)] == floor and not any(pinned[len(floor):]) or (
        name == "numpy" and pinned[:2] == floor), (name, floors[name], pins[name])
  assert pins["jaxlib"] == pins["jax"]
  readme = (ROOT / "README.md").read_text()
  assert f"jax and jaxlib {pins['jax']} or newer" in readme
  assert f"flax {pins['flax']} or newer" in readme
  ci = (ROOT / ".ci" / "run").read_text()
  assert "-r .ci/oldest.txt" in ci
  for name in ("precision", "context", "rounding", "emulated_ops", "emulate",
               "audit", "policy"):
    assert f"tests/test_{name}.py" in ci
