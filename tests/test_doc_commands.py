"""Every ``jaxprec`` command of README.md and docs/*.md runs as written.

A command is a ``jaxprec ...`` or ``python -m jaxprec ...`` in a fenced
block that is not Python: every line of a ```bash block (the piece of a
``a && b`` line that is the command, comments dropped), and every ``$ ``
line of a ```console block or of a block without a language (``time`` in
front dropped). Each runs in this process through the CLI's ``main``, from
a directory holding the page's files (its ```python blocks headed
``# NAME.py``), and must exit with the status the page shows on the
``$ echo $?`` line after it, else 0. A program the page runs without giving
it (``python train.py``: the reader's own script) is a script that prints
its arguments and the environment ``jaxprec run`` sets.

docs/cli.md's ```console blocks are not run here: tests/test_cli_docs.py
runs them, output included. Nothing else is left out.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SHELLS = ("bash", "sh", "shell")
# The reader's own program, where a page runs one it does not give.
SCRIPT = ("import os, sys\n"
          "print(sys.argv[1:], os.environ.get('JAX_DEFAULT_MATMUL_PRECISION'),"
          " os.environ.get('JAXPREC_POLICY'))\n")
# Run by tests/test_cli_docs.py, with the output the page shows.
SESSIONS_RUN_ELSEWHERE = {"cli.md": "console"}


def _jaxprec_part(line: str) -> str | None:
  """The ``jaxprec`` command of one shell line (comments dropped, ``time``
  in front dropped, quoting normalized), or None."""
  words = shlex.split(line, comments=True)
  pieces, piece = [], []
  for w in [*words, "&&"]:
    if w in ("&&", "||", ";"):
      pieces.append(piece)
      piece = []
    else:
      piece.append(w)
  for piece in pieces:
    if piece[:1] == ["time"]:
      piece = piece[1:]
    i = 0
    while i < len(piece) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", piece[i]):
      i += 1
    if piece[i:i + 1] == ["jaxprec"] or piece[i:i + 3] == ["python", "-m", "jaxprec"]:
      return shlex.join(piece)
  return None


def commands(page: pathlib.Path) -> list[tuple[str, int]]:
  """``[(command, exit status), ...]`` of ``page``, in its order."""
  text = page.read_text(encoding="utf-8")
  out: list[tuple[str, int]] = []
  for lang, body in FENCE.findall(text):
    if lang == "python" or SESSIONS_RUN_ELSEWHERE.get(page.name) == lang:
      continue
    lines = body.splitlines()
    for i, line in enumerate(lines):
      if lang in SHELLS:
        command = line
      elif lang in ("console", "") and line.startswith("$ "):
        command = line[2:]
      else:
        continue
      found = _jaxprec_part(command.strip())
      if found is None:
        continue
      status = 0
      later = [l for l in lines[i + 1:] if l.startswith("$ ")]
      if later and later[0] == "$ echo $?":
        status = int(lines[lines.index(later[0], i + 1) + 1])
      out.append((found, status))
  return out


def files(page: pathlib.Path) -> dict[str, str]:
  """The page's files: ``{name: text}`` of each ```python block headed
  ``# NAME.py``."""
  out = {}
  for lang, body in FENCE.findall(page.read_text(encoding="utf-8")):
    m = re.match(r"# (\w+\.py)\b", body)
    if lang == "python" and m:
      out[m.group(1)] = body
  return out


def _cases():
  seen, cases = set(), []
  for page in PAGES:
    for command, status in commands(page):
      # A command that reads a file of its page runs with that page's files.
      key = (command, page.name if re.search(r"\w+\.py\b", command) else "")
      if key not in seen:
        seen.add(key)
        cases.append(pytest.param(page, command, status,
                                  id=f"{page.name}: {command}"[:90]))
  return cases


CASES = _cases()


def test_the_commands_are_found():
  found = {c.values[1] for c in CASES}
  assert "jaxprec check --model wav2vec2" in found  # README's first command
  assert "jaxprec run -p fp32 -- python train.py" in found
  assert "jaxprec check --model hf-wav2vec2 --reference pytorch" in found
  assert any(c.startswith("jaxprec search --model wav2vec2") for c in found)
  assert any(c.values[2] == 2 for c in CASES)  # a documented exit status
  assert commands(ROOT / "docs" / "getting-started.md") == [("jaxprec info", 0)]


def test_the_extraction_reads_chains_prefixes_and_statuses(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
      "```bash\npython3 -m venv .venv && pip install x && jaxprec info  # hi\n"
      "X=1 jaxprec run -p fp32 -- python a.py\n```\n\n"
      "```\n$ time python -m jaxprec check --model bert\nout\n"
      "$ jaxprec run -p bogus -- python a.py\njaxprec: error: ...\n"
      "$ echo $?\n2\n```\n\n```python\n# a.py\njaxprec check x\n```\n",
      encoding="utf-8")
  assert commands(page) == [
      ("jaxprec info", 0), ("X=1 jaxprec run -p fp32 -- python a.py", 0),
      ("python -m jaxprec check --model bert", 0),
      ("jaxprec run -p bogus -- python a.py", 2)]
  assert files(page) == {"a.py": "# a.py\njaxprec check x\n"}


@pytest.mark.parametrize("page, command, status", CASES)
def test_documented_command_runs(page, command, status, tmp_path, monkeypatch,
                                 capsys):
  from jaxprec._src.cli.cli import main  # pylint: disable=import-outside-toplevel
  words = shlex.split(command)
  if "pytorch" in command:
    pytest.importorskip("torch", reason="--reference pytorch needs torch")
    pytest.importorskip("transformers", reason="the ports need transformers")
  for name, text in files(page).items():
    (tmp_path / name).write_text(text, encoding="utf-8")
  for name in re.findall(r"\b(\w+\.py)\b", command):
    if not (tmp_path / name).exists():
      (tmp_path / name).write_text(SCRIPT, encoding="utf-8")
  for var in ("JAX_DEFAULT_MATMUL_PRECISION", "JAXPREC_POLICY",
              "JAXPREC_KERNEL", "COLUMNS"):  # the page assumes none is set
    monkeypatch.delenv(var, raising=False)
  while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
    name, _, value = words.pop(0).partition("=")
    monkeypatch.setenv(name, value)
  # `python` in a command is this interpreter, as in the reader's venv.
  monkeypatch.setenv("PATH", os.pathsep.join(
      [os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  argv = words[1:] if words[0] == "jaxprec" else words[3:]
  rc = main(argv)
  out, err = capsys.readouterr()
  assert rc == status, (
      f"{page.name}: `{command}` exited {rc}, the page says {status}:\n"
      f"{out[-3000:]}\n{err[-3000:]}")


def test_the_search_figures_a_page_prints_are_in_the_search_s_format():
  """A figure of a progress line or a summary, as the search prints it
  (``search_result.shown``: three significant digits, as ``:g`` writes
  them), so that a reader's output matches the page's."""
  from jaxprec._src.search.search_result import shown  # pylint: disable=import-outside-toplevel
  found = 0
  for page in PAGES:
    for lang, body in FENCE.findall(page.read_text(encoding="utf-8")):
      if lang == "python" or "jaxprec search [" not in body:
        continue
      for value in re.findall(
          r"(?:worst rel_rms|worst layer: \S+ \(rel_rms)\s+(\S+?)[ );]", body):
        found += 1
        assert shown("rel_rms", float(value)) == value, (page.name, value)
  assert found > 20
