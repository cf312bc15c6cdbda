"""jaxprec's version, in one place (``jaxprec.__version__`` re-exports it),
and how this copy was installed: :func:`install_hint`, the one ``pip install``
line every missing-extra message gives."""

from __future__ import annotations

import json
import pathlib
import shlex
from collections.abc import Mapping
from typing import Any

__version__ = "0.1.0.dev0"

# The folder of the `jaxprec` package (in a checkout, the one below its root).
_PACKAGE = pathlib.Path(__file__).resolve().parents[2]


def _direct_url() -> Mapping[str, Any] | None:
  """The installed distribution's ``direct_url.json`` (PEP 610), or None
  (installed from an index, or not installed: run from a checkout)."""
  from importlib import metadata  # noqa: PLC0415 -- only for a message
  try:
    text = metadata.distribution("jaxprec").read_text("direct_url.json")
    return json.loads(text) if text else None
  except (metadata.PackageNotFoundError, ValueError, OSError):
    return None


def _checkout(package_dir: pathlib.Path) -> pathlib.Path | None:
  """The source checkout ``package_dir`` (the ``jaxprec`` package folder)
  lives in: its parent, when that holds jaxprec's ``pyproject.toml``."""
  root = package_dir.parent
  try:
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
  except OSError:
    return None
  return root if 'name = "jaxprec"' in text else None


def _local_path(url: str) -> str | None:
  """The local folder a ``file://`` URL names, or None."""
  from urllib.parse import unquote, urlparse  # noqa: PLC0415
  parsed = urlparse(url)
  return unquote(parsed.path) if parsed.scheme == "file" else None


def install_command(extras: str, *more: str,
                    direct_url: Mapping[str, Any] | None = None,
                    package_dir: pathlib.Path | None = None) -> str:
  """The ``pip install`` line for jaxprec's ``extras`` that works for how
  jaxprec was installed (:func:`install_hint` with the facts given).

  The package in a source checkout (the one running, whatever is installed),
  or an editable install: ``pip install -e '<checkout>[extras]'``; installed from a local folder: ``pip install
  '<folder>[extras]'``; from a Git URL: ``pip install 'jaxprec[extras] @
  git+<url>'``; otherwise from the package index: ``pip install
  'jaxprec[extras]'``. ``more`` names other packages to install with it.

  Args:
    extras: the extra(s), e.g. ``'plots'`` or ``'torch,plots'``.
    *more: further requirements, e.g. ``'transformers'``.
    direct_url: the distribution's ``direct_url.json`` (PEP 610) as a dict,
      or None when there is none.
    package_dir: the folder of the ``jaxprec`` package.

  Examples:
    >>> import pathlib
    >>> from jaxprec._src.core.version import install_command
    >>> install_command("plots", direct_url=None,
    ...                 package_dir=pathlib.Path("/nowhere/jaxprec"))
    "pip install 'jaxprec[plots]'"
    >>> install_command("torch", "transformers", direct_url={
    ...     "url": "file:///home/me/jaxprec", "dir_info": {"editable": True}},
    ...     package_dir=pathlib.Path("/home/me/jaxprec/jaxprec"))
    "pip install -e '/home/me/jaxprec[torch]' transformers"
  """
  tail = "".join(f" {shlex.quote(m)}" for m in more)
  info = direct_url or {}
  url = str(info.get("url", ""))
  local = _local_path(url) if url else None
  dir_info = info.get("dir_info")
  # The checkout the running code is in first: another copy may be the one
  # installed.
  checkout = _checkout(package_dir) if package_dir is not None else None
  if checkout is not None:
    return f"pip install -e {shlex.quote(f'{checkout}[{extras}]')}{tail}"
  if isinstance(dir_info, Mapping) and local and dir_info.get("editable"):
    return f"pip install -e {shlex.quote(f'{local}[{extras}]')}{tail}"
  if isinstance(dir_info, Mapping) and local and pathlib.Path(local).is_dir():
    return f"pip install {shlex.quote(f'{local}[{extras}]')}{tail}"
  vcs = info.get("vcs_info")
  if isinstance(vcs, Mapping) and url and vcs.get("vcs"):
    spec = f"jaxprec[{extras}] @ {vcs['vcs']}+{url}"
    return f"pip install {shlex.quote(spec)}{tail}"
  return f"pip install {shlex.quote(f'jaxprec[{extras}]')}{tail}"


# PyTorch's CPU build: `pip install torch` on Linux pulls its CUDA wheels (a few
# GB), which jaxprec never uses (https://pytorch.org/get-started/locally/).
TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def torch_hint(*more: str) -> str:
  """The install lines for jaxprec's ``torch`` extra (and ``more``
  packages), PyTorch's CPU build first."""
  return f"{TORCH_CPU}, then {install_hint('torch', *more)}"


def install_hint(extras: str, *more: str) -> str:
  """The ``pip install`` line for jaxprec's ``extras`` (and ``more``
  packages) that works for this copy of jaxprec: from a clone
  (``pip install -e '/path/to/jaxprec[plots]'``), a local folder, a Git URL,
  or the package index (``pip install 'jaxprec[plots]'``). Every message
  about a missing extra gives this line."""
  return install_command(extras, *more, direct_url=_direct_url(),
                         package_dir=_PACKAGE)
