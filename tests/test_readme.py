"""The README's promises: CI runs its test command verbatim, its picture is
committed (its Python blocks run: tests/test_docs_blocks.py)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks():
  return re.findall(r"```bash\n(.*?)```", README, re.S)


def test_exactly_two_commands_and_ci_runs_the_test_command_verbatim():
  blocks = [b.strip() for b in _bash_blocks()[:2]]
  main_job, tests = blocks
  assert main_job.startswith("python3 -m venv") and "jaxprec check --model wav2vec2" in main_job
  assert tests.startswith("python3 -m venv") and "pytest" in tests
  assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


# The README's Python blocks run as written: tests/test_docs_blocks.py.


def test_readme_picture_is_committed():
  assert (ROOT / "docs" / "images" / "divergence.png").stat().st_size > 10_000
