"""Every command's output fits the terminal without a word split across lines.

Each command of the parser (and its ``--help``) runs in this process with
``$COLUMNS`` set as a terminal sets it (100 is also the width of a pipe or a
log): every line of stdout and stderr fits, and every word of the output is
a word of the same command's output at a width that folds nothing, or a
piece of a word longer than a line cut after a ``,`` or ``/`` in it.
"""

import argparse
import json
import re
import textwrap

import pytest

from conftest import run_cli

from jaxprec._src.cli import cli

# A model with long module paths, so that the audit's table is wider than 100.
MODEL = textwrap.dedent('''
    import jax, jax.numpy as jnp
    from flax import nnx

    class FeedForwardBlockWithALongName(nnx.Module):
      def __init__(self, rngs):
        self.intermediate_dense_projection = nnx.Linear(16, 32, rngs=rngs)
        self.output_dense_projection = nnx.Linear(32, 16, rngs=rngs)

      def __call__(self, x):
        return self.output_dense_projection(
            jax.nn.gelu(self.intermediate_dense_projection(x)))

    class Model(nnx.Module):
      def __init__(self, rngs):
        self.encoder_feed_forward = FeedForwardBlockWithALongName(rngs)

      def __call__(self, x):
        return self.encoder_feed_forward(x)

    def make():
      return Model(nnx.Rngs(0)), (jnp.ones((4, 16)),)
''')

# One run of each command: what a newcomer types first.
COMMANDS = {
    "info": [["info"]],
    "audit": [["audit", "model.py:make"]],
    "run": [["run", "-p", "bogus", "--", "python", "x.py"]],
    "check": [["check", "model.py:make", "--out", "out"],
              ["check", "model.py:make", "--modules", "--out", "out",
               "--precisions", "bfloat16,bfloat16_3x"]],
    "sampler": [["sampler", "--length", "6", "--trainer", "float32@cpu",
                 "--sampler", "bfloat16@tpu", "--batch", "4"]],
    "search": [["search", "model.py:make", "--tolerance", "1e-2"],
               ["search", "model.py:make", "--tolerance", "1e-9",
                "--budget", "2"]],
}


def test_every_command_of_the_parser_is_run_here():
  sub = next(a for a in cli._parser()._actions  # pylint: disable=protected-access
             if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  assert set(sub.choices) == set(COMMANDS)


def _words(text: str) -> list[str]:
  # Timings and counts differ from run to run: digits are read as one digit.
  # A table drawn one row a line numbers its rows '#1' and ends its cells
  # with ';'.
  return [re.sub(r"\d+", "0", w).lstrip("#").rstrip(";") for w in text.split()]


def _a_piece_of(word: str, words: set[str]) -> bool:
  """``word`` is a run of a longer word's pieces, cut after ``,`` or ``/``."""
  for w in words:
    at = w.find(word)
    while at >= 0:
      if ((at == 0 or w[at - 1] in ",/")
          and (at + len(word) == len(w) or word[-1] in ",/")):
        return True
      at = w.find(word, at + 1)
  return False


def _run(capsys, monkeypatch, width, argv):
  # As a terminal of that width shows it (a pipe or a file is not folded).
  monkeypatch.setattr(cli, "_on_terminal", lambda stream: True)
  monkeypatch.setenv("COLUMNS", str(width))
  rc, out, err = run_cli(capsys, *argv)
  return rc, out + err, out


@pytest.fixture
def project(tmp_path, monkeypatch):
  (tmp_path / "model.py").write_text(MODEL, encoding="utf-8")
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv("JAX_DEFAULT_MATMUL_PRECISION", raising=False)
  return tmp_path


@pytest.mark.parametrize("width", [100, 72])
@pytest.mark.parametrize("argv", [a for runs in COMMANDS.values() for a in runs]
                         + [[c, "--help"] for c in COMMANDS] + [["--help"]],
                         ids=" ".join)
def test_output_fits_without_splitting_a_word(project, capsys, monkeypatch,
                                              argv, width):
  if width != 100 and argv[0] not in ("audit", "info", "search"):
    pytest.skip("one width is enough for the others")
  rc, text, _ = _run(capsys, monkeypatch, width, argv)
  wide_rc, wide, _ = _run(capsys, monkeypatch, 100_000, argv)
  assert rc == wide_rc
  long = [l for l in text.splitlines() if len(l) > width]
  assert not long, f"lines wider than {width}:\n" + "\n".join(long)
  words = set(_words(wide))
  split = [w for w in _words(text) if w not in words and not _a_piece_of(w, words)]
  assert not split, f"words not in the unfolded output: {split}\n{text}"


def test_the_audit_table_is_one_op_a_line_where_it_is_too_wide(project, capsys,
                                                                monkeypatch):
  _, text, _ = _run(capsys, monkeypatch, 100, ["audit", "model.py:make"])
  _, wide, _ = _run(capsys, monkeypatch, 100_000, ["audit", "model.py:make"])
  assert any(len(l) > 100 for l in wide.splitlines())  # the table is wider
  lines = text.splitlines()
  first = next(i for i, l in enumerate(lines) if l.startswith("#1 "))
  assert "encoder_feed_forward/intermediate_dense_projection" in lines[first]
  assert lines[first + 1].lstrip().startswith("operands f32[4,16] x f32[16,32]")


def test_json_is_never_folded(project, capsys, monkeypatch):
  rc, _, out = _run(capsys, monkeypatch, 40, ["audit", "model.py:make", "--json"])
  assert rc == 0
  assert json.loads(out)["rows"]
