"""`jaxprec search --program-per-policy` and `--prepare-weights`: which programs
the search runs, and the same answers either way."""

import json
import sys

import pytest

from jaxprec._src.cli.cli import main
from jaxprec._src.emulation import prepared
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


def test_program_flags_choose_the_programs_and_keep_the_answers(
    project, capsys, monkeypatch):
  calls = []
  real = prepared.prepare
  monkeypatch.setattr(prepared, "prepare",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  default = _search(capsys)
  assert calls == []  # weights are split at every evaluation by default
  per_policy = _search(capsys, "--program-per-policy")
  weights = _search(capsys, "--prepare-weights")
  assert calls == [1]  # once per search
  programs = lambda r: [s["program"] for s in r["history"]]  # noqa: E731
  assert programs(default)[0] == "fixed"
  assert set(programs(default)[1:]) == {"switched"}
  assert set(programs(per_policy)) == {"fixed"}
  assert programs(weights) == programs(default)
  for other in (per_policy, weights):
    assert other["policy"] == default["policy"] == (
        "default=bfloat16,dense_2=bfloat16_3x")
    assert [s["worst_value"] for s in other["history"]] == [
        s["worst_value"] for s in default["history"]]


def test_program_flags_are_in_the_help(capsys):
  assert main(["search", "--help"]) == 0
  out = capsys.readouterr().out
  assert "--program-per-policy" in out and "--prepare-weights" in out
