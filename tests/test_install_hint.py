"""Install hints say what works for how jaxprec was installed: from a clone,
``pip install 'jaxprec[plots]'`` fails (jaxprec is not on PyPI)."""

from __future__ import annotations

import pathlib
import shlex
import subprocess
import sys

import pytest

from jaxprec._src.core import version

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_checkout_gets_the_editable_install_of_its_own_folder():
  cmd = version.install_command("plots", direct_url=None,
                                package_dir=ROOT / "jaxprec")
  assert cmd == f"pip install -e {shlex.quote(f'{ROOT}[plots]')}"


def test_an_editable_install_names_its_folder(tmp_path):
  # PEP 610: pip writes direct_url.json with dir_info.editable for `pip install -e`.
  src = tmp_path / "my clone"
  info = {"url": src.as_uri(), "dir_info": {"editable": True}}
  cmd = version.install_command("torch", "transformers", direct_url=info,
                                package_dir=tmp_path / "site" / "jaxprec")
  assert cmd == f"pip install -e '{src}[torch]' transformers"
  # The quoting survives the shell: the folder with its space is one word.
  assert shlex.split(cmd) == ["pip", "install", "-e", f"{src}[torch]", "transformers"]


def test_a_local_folder_install_and_a_git_install(tmp_path):
  site = tmp_path / "site-packages" / "jaxprec"
  src = tmp_path / "src"
  src.mkdir()
  local = {"url": src.as_uri(), "dir_info": {}}
  assert version.install_command("plots", direct_url=local, package_dir=site) == (
      f"pip install '{src}[plots]'")
  gone = {"url": (tmp_path / "deleted").as_uri(), "dir_info": {}}
  assert version.install_command("plots", direct_url=gone, package_dir=site) == (
      "pip install 'jaxprec[plots]'")
  git = {"url": "https://github.com/example/jaxprec.git",
         "vcs_info": {"vcs": "git", "commit_id": "0" * 40}}
  assert version.install_command("hf-flax", direct_url=git, package_dir=site) == (
      "pip install 'jaxprec[hf-flax] @ git+https://github.com/example/jaxprec.git'")


def test_an_index_install_gets_the_index_form(tmp_path):
  site = tmp_path / "site-packages" / "jaxprec"
  for info in (None, {}, {"url": "https://files.example/jaxprec.whl",
                          "archive_info": {}}):
    assert version.install_command("plots", direct_url=info, package_dir=site) == (
        "pip install 'jaxprec[plots]'")


def test_a_folder_named_like_a_checkout_but_not_jaxprecs(tmp_path):
  (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
  assert version.install_command("plots", package_dir=tmp_path / "jaxprec") == (
      "pip install 'jaxprec[plots]'")


def test_this_install_gets_a_command_that_names_this_checkout():
  # The test suite runs from a clone (editable or not): the hint installs it.
  assert version.install_hint("plots") == (
      f"pip install -e {shlex.quote(f'{ROOT}[plots]')}")


@pytest.mark.parametrize("code, extra", [
    ("sys.modules['matplotlib'] = None; import jaxprec; "
     "from jaxprec._src.checker import render; render.figure_class('plot')",
     "plots"),
    ("sys.modules['torch'] = None; import jaxprec.torch as t; "
     "t.capture(None, None)", "torch"),
    ("sys.modules['transformers'] = None; import jaxprec.torch as t; "
     "t.twin('hf-bert')", "hf-flax"),
])
def test_every_missing_extra_message_gives_the_hint(code, extra):
  proc = subprocess.run([sys.executable, "-c", f"import sys; {code}"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 1
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("ImportError: ") and version.install_hint(extra) in last


# -- PyTorch and transformers, named at once ------------------------------------

TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("missing", [("torch",), ("transformers",),
                                     ("torch", "transformers")])
def test_a_port_check_names_everything_missing_at_once(monkeypatch, missing):
  from jaxprec._src.torch import torch_ports  # pylint: disable=import-outside-toplevel
  for name in missing:  # `import name` raises ImportError
    monkeypatch.setitem(sys.modules, name, None)
  with pytest.raises(ImportError) as e:
    torch_ports.require()
  message = str(e.value)
  assert "\n" not in message
  said = message.split("; ", 1)[1].split(" not installed")[0]
  assert said == " and ".join(missing) + (" is" if len(missing) == 1 else " are")
  assert (TORCH_CPU in message) == ("torch" in missing), message
  assert version.install_hint("torch", "transformers") in message


def test_the_command_line_says_it_in_one_error(monkeypatch, capsys):
  from jaxprec._src.cli.cli import main  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(sys.modules, "torch", None)
  monkeypatch.setitem(sys.modules, "transformers", None)
  assert main(["check", "--model", "hf-wav2vec2", "--reference", "pytorch"]) == 2
  err = " ".join(capsys.readouterr().err.split())  # unfolded
  assert err.count("jaxprec: error:") == 1
  assert "torch and transformers are not installed" in err and TORCH_CPU in err


def test_the_docs_give_the_cpu_only_line_before_the_extra():
  for page in (ROOT / "README.md", ROOT / "docs" / "port-check.md"):
    text = page.read_text(encoding="utf-8")
    assert TORCH_CPU in text, page
    assert text.index(TORCH_CPU) < text.index('pip install -e ".[torch]" transformers'), page
