"""The README's promises: its example runs, and CI runs its test command verbatim."""

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


def test_thirty_second_example_runs(capsys):
  code = re.search(r"## 30 seconds\n\n```python\n(.*?)```", README, re.S).group(1)
  # As written: a user pastes the block into a script, and it runs to its end.
  exec(compile(code, "README.md", "exec"), {})
  out = capsys.readouterr().out
  assert "'bfloat61'" in out and "Did you mean 'bfloat16'?" in out
  assert "jaxprec.Precision('bfloat16', source='context')" in out
  assert "first divergence output" in out


def test_readme_picture_is_committed():
  assert (ROOT / "docs" / "images" / "divergence.png").stat().st_size > 10_000
