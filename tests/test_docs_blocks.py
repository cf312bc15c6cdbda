"""The README's Python blocks run as written, and the docs site's front door.

Every ```python block of README.md runs in a fresh interpreter, as a user
pasting it into a script would (one script per block, from a temporary
directory, with a timeout), so the README cannot drift from the code. A block
is skipped only when its first line is the marker comment

    # docs-test: skip (<why>)

for instance a block that needs a TPU. Nothing else skips a block.

The home page (docs/index.md) names every main job with its page and shows
the main job's picture; the site's CSS lets wide outputs scroll; the
getting-started page states the versions pyproject requires.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = ROOT / "docs"
SKIP_MARKER = "# docs-test: skip"
# Per block. The README's two blocks take about 15 s and 60 s on a busy 2-core
# machine (check_module of the tiny Wav2Vec2 is the longer).
TIMEOUT_S = 120


def python_blocks(markdown: str) -> list[str]:
  """The ```python blocks of ``markdown``, in order."""
  return re.findall(r"^```python[^\n]*\n(.*?)^```[ \t]*$", markdown, re.M | re.S)


def _run(code: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
  script = tmp_path / "block.py"
  script.write_text(code, encoding="utf-8")
  # The user's environment, but no matmul precision of the caller's.
  env = {k: v for k, v in os.environ.items() if k != "JAX_DEFAULT_MATMUL_PRECISION"}
  return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT_S)


README_BLOCKS = python_blocks(README)


def test_readme_has_python_blocks_and_only_marked_ones_are_skipped():
  assert len(README_BLOCKS) >= 2
  for code in README_BLOCKS:
    first = code.splitlines()[0] if code.strip() else ""
    assert SKIP_MARKER not in code or first.startswith(SKIP_MARKER), (
        f"the skip marker must be a block's first line:\n{code}")


@pytest.mark.parametrize("index", range(len(README_BLOCKS)),
                         ids=lambda i: f"block{i}")
def test_readme_python_block_runs_as_written(index, tmp_path):
  code = README_BLOCKS[index]
  if code.startswith(SKIP_MARKER):
    pytest.skip(code.splitlines()[0])
  start = time.monotonic()
  proc = _run(code, tmp_path)
  assert proc.returncode == 0, (
      f"README.md's python block {index} failed:\n{code}\n--- stdout\n"
      f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
  assert proc.stdout.strip(), "the block printed nothing"
  assert time.monotonic() - start < TIMEOUT_S
  if code == THIRTY_SECONDS:
    # What the block promises in its comments.
    out = proc.stdout
    assert ("Invalid precision 'bfloat61': unknown name. Did you mean "
            "'bfloat16'?") in out
    assert "jaxprec.Precision('bfloat16', source='context')" in out
    assert "bfloat16: first divergence output (#0)" in out
    assert "'bfloat16': Finding(precision='bfloat16', layer='output'" in out


THIRTY_SECONDS = re.search(r"^## 30 seconds\n\n```python\n(.*?)^```", README,
                           re.M | re.S).group(1)


def test_the_thirty_seconds_block_is_one_of_them():
  assert THIRTY_SECONDS in README_BLOCKS


# -- the docs site ----------------------------------------------------------------


def test_home_page_names_every_main_job_with_its_page_and_a_picture():
  index = (DOCS / "index.md").read_text(encoding="utf-8")
  for call, page in (("jaxprec.explain()", None), ("jaxprec.audit(", None),
                     ("jaxprec.emulate(", None), ("jaxprec.check(", "checker.md"),
                     ("jaxprec.search_policy(", "search.md"),
                     ("--reference pytorch", "pytorch.md"),
                     ("jaxprec.cost(", "cost.md")):
    assert call in index, call
    if page:
      assert f"]({page}" in index, page
  images = re.findall(r"!\[[^\]]+\]\((images/[^)]+)\)", index)
  assert images and all((DOCS / i).stat().st_size > 10_000 for i in images)


def _mkdocs_config() -> str:
  return (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_site_css_lets_wide_blocks_and_tables_scroll():
  sheets = re.findall(r"^extra_css:\n((?:\s+- \S+\n)+)", _mkdocs_config(), re.M)
  assert sheets, "mkdocs.yml has no extra_css"
  paths = re.findall(r"- (\S+)", sheets[0])
  css = "".join((DOCS / p).read_text(encoding="utf-8") for p in paths)
  rules = dict(re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.S)))
  rules = {k.strip(): v for k, v in rules.items()}
  assert "overflow-x: auto" in rules[".md-typeset pre > code"]
  assert "white-space: pre" in rules[".md-typeset pre > code"]
  assert "overflow-x: auto" in rules[".md-typeset table:not([class])"]
  width = re.search(r"max-width:\s*(\d+)rem", rules[".md-grid"])
  assert width and int(width.group(1)) > 61  # wider than the theme's column


def test_getting_started_states_the_required_versions_and_the_plots_extra():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  python = project["requires-python"].removeprefix(">=")
  jax = next(d for d in project["dependencies"] if d.startswith("jax>="))
  page = (DOCS / "getting-started.md").read_text(encoding="utf-8")
  assert f"Python {python} or newer" in page
  assert f"JAX {jax.removeprefix('jax>=')} or newer" in page
  install = re.search(r"```bash\n(.*?)```", page, re.S).group(1)
  assert 'pip install -e ".[plots]"' in install
