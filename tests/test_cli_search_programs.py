"""`jaxprec search --program-per-policy`: which programs the search runs, and
the same answers either way."""

import json
import sys

import pytest

from jaxprec._src.cli.cli import main
from conftest import unfolded
from test_cli_search import MODEL


@pytest.fixture
def project(tmp_path, monkeypatch):
  (tmp_path / "clisearch_programs.py").write_text(MODEL)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  monkeypatch.setenv("JAXPREC_CACHE_DIR", str(tmp_path / "cache"))
  yield tmp_path
  sys.modules.pop("clisearch_programs", None)


def _search(capsys, *flags):
  rc = main(["search", "clisearch_programs:make", "--tolerance", "0.02",
             "--json", *flags])
  out, err = capsys.readouterr()
  assert rc == 0, err
  return json.loads(out)


def test_program_flags_choose_the_programs_and_keep_the_answers(project,
                                                                capsys):
  default = _search(capsys)
  per_policy = _search(capsys, "--program-per-policy")
  programs = lambda r: [s["program"] for s in r["history"]]  # noqa: E731
  assert programs(default)[0] == "fixed"
  assert set(programs(default)[1:]) == {"switched"}
  assert set(programs(per_policy)) == {"fixed"}
  assert per_policy["policy"] == default["policy"] == (
      "default=bfloat16,dense_2=bfloat16_3x")
  assert [s["worst_value"] for s in per_policy["history"]] == [
      s["worst_value"] for s in default["history"]]


def test_removed_prepare_weights_is_refused(project, capsys):
  """The removed ``--prepare-weights`` / ``prepare_weights=`` are refused
  with a clear error, not passed on to the model."""
  assert main(["search", "clisearch_programs:make", "--tolerance", "0.02",
               "--prepare-weights"]) == 2
  err = unfolded(capsys.readouterr().err)
  assert err.count("\n") == 1 and "--prepare-weights was removed" in err
  import jax.numpy as jnp
  import jaxprec
  with pytest.raises(TypeError, match="prepare_weights was removed"):
    jaxprec.search_policy(lambda x: x @ x, jnp.ones((2, 2)), tolerance=0.1,
                          prepare_weights=True)


def test_program_flags_are_in_the_help(capsys):
  assert main(["search", "--help"]) == 0
  out = capsys.readouterr().out
  assert "--program-per-policy" in out and "--prepare-weights" not in out
