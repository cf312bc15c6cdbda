"""What pyproject and CI promise about versions and extras."""

import pathlib
import re
import subprocess
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def _names(reqs):
  return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_the_torch_extra_is_torch_alone_with_no_exact_pin():
  assert _names(EXTRAS["torch"]) == {"torch"}
  assert not [r for r in EXTRAS["torch"] if "==" in r or "<" in r]


def test_what_needs_transformers_flax_models_has_its_own_extra():
  reqs = dict((n, r) for r in EXTRAS["hf-flax"] for n in _names([r]))
  assert set(reqs) == {"torch", "transformers"}
  assert "<5" in reqs["transformers"]  # transformers 5 has no Flax models


def test_the_torch_floor_is_the_version_ci_pins():
  floor = re.search(r"torch>=([\d.]+)", EXTRAS["torch"][0]).group(1)
  pins = dict(l.split("==") for l in (ROOT / ".ci" / "constraints.txt")
              .read_text().splitlines() if l and not l.startswith("#"))
  assert pins["torch"].startswith(floor)


def test_ci_runs_four_stages_and_the_newest_one_covers_the_named_areas():
  run = (ROOT / ".ci" / "run").read_text()
  for stage in ("main", "oldest", "newest", "torch-stack"):
    assert f"stage {stage} " in run
  newest = (ROOT / ".ci" / "newest").read_text()
  files = re.findall(r"tests/test_\w+\.py", newest)
  for area in ("precision", "emulate", "flax", "modules_nnx", "check", "search",
               "switch", "compat"):
    assert f"tests/test_{area}.py" in files, area
  for f in files:
    assert (ROOT / f).is_file(), f
  # /proc is unmounted on every exit, and before the root is removed.
  assert "trap unmount_root EXIT" in newest
  assert newest.index("unmount_root\n  if awk") < newest.index('rm -rf "$ROOT"')


def test_ci_scripts_parse():
  for script in ("run", "newest", "torch-stack"):
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / script)], check=True)


def test_the_torch_stack_stage_guards_the_users_packages():
  text = (ROOT / ".ci" / "torch-stack").read_text()
  assert 'PROTECTED="torch transformers huggingface-hub"' in text
  assert "--dry-run --report" in text and '"transformers>=5"' in text


def test_the_libraries_whose_primitives_are_tested_are_installed_by_ci():
  # tests/test_lineax.py skips without lineax: the test extra (the main
  # stage) and the newest stage install it, so that it runs.
  assert {"lineax", "equinox"} <= _names(EXTRAS["test"])
  newest = (ROOT / ".ci" / "newest").read_text()
  pip = newest[newest.index("pip install -q --upgrade"):
               newest.index('|| fail "pip install in the root"')]
  assert {"lineax", "equinox"} <= _names(re.findall(r'"([^"]+)"', pip))
  assert "tests/test_lineax.py" in re.findall(r"tests/test_\w+\.py", newest)
