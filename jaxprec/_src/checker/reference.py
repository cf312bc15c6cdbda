"""External references: hidden states computed elsewhere, read into NumPy.

``check(..., reference=...)`` and ``search_policy(..., reference=...)`` take
either a precision (computed by :mod:`jaxprec._src.checker.harness`) or hidden states
computed elsewhere. The second kind is read here, by :func:`load`, into one
form: an insertion-ordered ``{name: np.ndarray}``. What it reads:

* a file: ``.npz`` (loaded with ``allow_pickle=False``), ``.npy`` (one array,
  the layer ``'output'``) or ``.safetensors``; a ``str`` or any
  ``os.PathLike``; suffixes in any case;
* a mapping ``{name: array}``;
* a pytree of arrays (named as :func:`jaxprec.named_layers` names them).

Objects of other frameworks are converted in one place,
:func:`jaxprec._src.torch.torch_ref.from_torch`, before anything else looks
at them.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxprec._src.checker import layers as layers_lib
from jaxprec._src.core import names as names_lib

FILE_TYPES = (".npz", ".npy", ".safetensors")
SUPPORTED = ("a precision name (e.g. 'float32', 'float64'), a .npz, .npy or "
              ".safetensors file (a str or os.PathLike), a {name: array} "
              "mapping, or a pytree of arrays")


class ReferenceMismatchError(ValueError):
  """A given reference does not have the output's layers or shapes."""


def _suffix(path: str) -> str:
  return os.path.splitext(path)[1].lower()


def is_file(obj: Any) -> bool:
  """Whether ``obj`` names a reference file (rather than a precision).

  Any ``os.PathLike``, and strings with a suffix of :data:`FILE_TYPES` in any
  case, or naming an existing file.
  """
  if isinstance(obj, os.PathLike):
    return True
  if not isinstance(obj, str):
    return False
  suffix = _suffix(obj)
  return suffix in FILE_TYPES or (bool(suffix) and os.path.isfile(obj))


def _safetensors(name: str):
  try:
    import safetensors.numpy as st  # noqa: PLC0415 -- optional dependency
  except ImportError as e:
    raise ImportError("reading or writing .safetensors needs the safetensors "
                      "package: pip install safetensors") from e
  return getattr(st, name)


def _load_file(obj: Any) -> dict[str, np.ndarray]:
  path = os.fsdecode(obj)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no reference file {path!r}")
  kind = _suffix(path)
  if kind not in FILE_TYPES:
    raise ValueError(f"Unknown reference file type {path!r}; supported: "
                     f"{', '.join(FILE_TYPES)}.")
  try:
    if kind == ".npz":
      if not zipfile.is_zipfile(path):
        raise ValueError("not a zip archive")
      with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
    if kind == ".npy":
      return {"output": np.load(path, allow_pickle=False)}
    load_file = _safetensors("load_file")
    return dict(load_file(path))
  except ImportError:
    raise
  except Exception as e:  # noqa: BLE001 -- every reader error is the file's
    raise ValueError(
        f"Cannot read the reference file {path!r} as {kind} ({e}); supported "
        f"files: {', '.join(FILE_TYPES)} (written by jaxprec.save_layers, "
        f"numpy.savez/numpy.save or safetensors).") from None


def load(obj: Any) -> dict[str, np.ndarray]:
  """An external reference as ``{name: np.ndarray}``, in its own order.

  Args:
    obj: a file, a mapping or a pytree of arrays (module docstring).

  Returns:
    An insertion-ordered dict of NumPy arrays (bfloat16 stays bfloat16).

  Raises:
    FileNotFoundError: a path that does not exist.
    ValueError: an unreadable or unsupported file, or an object that holds no
      floating arrays; the message names it and the supported types.
  """
  if is_file(obj):
    return _load_file(obj)
  from jaxprec._src.torch import torch_ref
  given = obj
  obj = torch_ref.from_torch(obj)  # PyTorch tensors and ModelOutputs
  obj = given if obj is None else obj
  if isinstance(obj, Mapping) and obj and all(isinstance(k, str) for k in obj) \
      and all(hasattr(v, "shape") and hasattr(v, "dtype")
              for v in obj.values()):
    found = dict(obj)
  else:
    found = layers_lib.named_layers(obj) if obj is not None else {}
  if not found:
    shown = repr(given)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    dtype = getattr(given, "dtype", None)
    of = f" of {dtype}" if dtype is not None else ""
    raise ValueError(f"reference={shown} ({type(given).__name__}{of}) holds "
                     f"no floating arrays; a reference is {SUPPORTED}.")
  return {k: np.asarray(v) for k, v in found.items()}


def describe(obj: Any) -> str:
  """The report's ``reference`` for an external reference."""
  return f"file:{os.fspath(obj)}" if is_file(obj) else "pytree"


def match(found: Mapping[str, np.ndarray],
          info: list[tuple[str, tuple[int, ...], str]],
          *, extra_ok: bool = False) -> list[np.ndarray]:
  """The arrays of ``found`` for the output layers ``info``, in its order.

  Names match after :func:`jaxprec._src.checker.layers.normalize`; a reference with
  the one layer ``'output'`` (a ``.npy`` file, a bare array) matches an
  output with one layer of any name.

  Args:
    found: the reference, from :func:`load`.
    info: ``(name, shape, dtype)`` of each output layer.
    extra_ok: allow reference layers the output does not have.

  Raises:
    ReferenceMismatchError: naming the first mismatching path and both shapes.
  """
  if list(found) == ["output"] and len(info) == 1:
    found = {info[0][0]: found["output"]}
  by_norm: dict[str, tuple[str, Any]] = {}
  for k, v in found.items():
    n = layers_lib.normalize(k)
    if n in by_norm:
      raise ReferenceMismatchError(
          f"reference names {by_norm[n][0]!r} and {k!r} denote the same "
          f"layer")
    by_norm[n] = (k, v)
  used, out = set(), []
  for name, shape, _ in info:
    n = layers_lib.normalize(name)
    if n not in by_norm:
      listed = ", ".join(map(repr, list(found)[:8]))
      more = "..." if len(found) > 8 else ""
      raise ReferenceMismatchError(
          f"reference does not match the output: first mismatch at {name!r}: "
          f"output shape {tuple(shape)}, reference shape: missing (the "
          f"reference has {listed}{more})")
    k, v = by_norm[n]
    v = np.asarray(v)
    if tuple(v.shape) != tuple(shape):
      raise ReferenceMismatchError(
          f"reference does not match the output: first mismatch at {name!r}: "
          f"output shape {tuple(shape)}, reference shape {tuple(v.shape)}")
    if v.dtype.type is np.void:  # ml_dtypes' types (bfloat16) are not void
      raise ReferenceMismatchError(
          f"reference {k!r} holds raw bytes ({v.dtype}), not numbers: NumPy's "
          f"savez writes bfloat16 arrays so; save the layers with "
          f"jaxprec.save_layers, which writes them as float32 (exactly)")
    if not np.issubdtype(v.dtype, np.floating) and v.dtype.name != "bfloat16":
      raise ReferenceMismatchError(
          f"reference {k!r} is not floating point ({v.dtype})")
    used.add(n)
    out.append(v)
  extra = [by_norm[n][0] for n in by_norm if n not in used]
  if extra and not extra_ok:
    raise ReferenceMismatchError(
        f"reference does not match the output: first mismatch at {extra[0]!r}: "
        f"output shape: missing, reference shape "
        f"{tuple(np.shape(found[extra[0]]))}")
  return out


def select(found: Mapping[str, Any], names: list[str]
           ) -> tuple[list[str], list[str]]:
  """``(checked, unchecked)``: the output layers ``names`` a partial
  reference ``found`` has values for, and those it has none for, in order.

  Names match after :func:`jaxprec._src.checker.layers.normalize`; a
  reference with the one layer ``'output'`` matches an output with one
  layer of any name (as :func:`match`).

  Raises:
    ReferenceMismatchError: a reference layer that names no output layer,
      naming it and the output's layers (with the closest one).
  """
  if list(found) == ["output"] and len(names) == 1:
    return list(names), []
  by_norm = {layers_lib.normalize(n): n for n in names}
  for k in found:
    if layers_lib.normalize(k) not in by_norm:
      raise names_lib.unknown(
          "reference layer", k, names, error=ReferenceMismatchError,
          hint=" (the module's output layers, any of which a reference may "
               "hold; '.', '/' and '[i]' match alike; capture(..., names=) "
               "renames or drops a layer)",
          near={**{layers_lib.normalize(n): n for n in names},
                **{n: n for n in names}})
  given = {layers_lib.normalize(k) for k in found}
  checked = [n for n in names if layers_lib.normalize(n) in given]
  return checked, [n for n in names if layers_lib.normalize(n) not in given]


def _storable(v: np.ndarray) -> np.ndarray:
  """``v``, or float32 where its dtype is one of ml_dtypes' (bfloat16, the
  float8 types), which NumPy's ``savez`` writes as raw bytes (``|V2``) and
  safetensors' NumPy API refuses. Every such value is a float32 value: the
  widening is exact."""
  if v.dtype.type.__module__.split(".")[0] == "ml_dtypes":
    # bfloat16 and most float8 types are kind 'V'; float8_e5m2 is kind 'f'.
    try:
      ml_dtypes.finfo(v.dtype)
    except (TypeError, ValueError):  # ml_dtypes' integer types
      return v
    return v.astype(np.float32)
  return v


def save_layers(path: str | os.PathLike, tree: Any) -> None:
  """Saves hidden states where ``check(..., reference=path)`` can read them.

  ``.npz`` (NumPy) or ``.safetensors`` (needs the ``safetensors`` package),
  in any case. Keys are the names of :func:`jaxprec.named_layers`. Layers in
  bfloat16 or a float8 type are written as float32, which holds each of
  their values exactly (NumPy would write their raw bytes).

  Args:
    path: the file to write; its extension picks the format.
    tree: the hidden states (a pytree of arrays).

  Raises:
    ValueError: another extension; a tree without floating arrays; two
      names a check would read as one layer (``'a.0'`` and ``'a/0'``:
      names match after :func:`jaxprec._src.checker.layers.normalize`).
      Nothing is written then.
  """
  path = os.fspath(path)
  arrays = {k: _storable(np.asarray(v))
            for k, v in layers_lib.named_layers(tree).items()}
  if not arrays:
    raise ValueError(f"save_layers: {type(tree).__name__} holds no floating "
                     f"arrays; nothing to save to {path!r}.")
  seen: dict[str, str] = {}
  for k in arrays:
    first = seen.setdefault(layers_lib.normalize(k), k)
    if first != k:
      raise ValueError(
          f"save_layers: the layers {first!r} and {k!r} would be read back "
          f"as one layer (a check matches names with '.', '/' and '[i]' "
          f"alike); rename one. Nothing was written to {path!r}.")
  kind = _suffix(path)
  if kind == ".npz":
    with open(path, "wb") as f:  # np.savez would append '.npz' to '.NPZ'
      np.savez(f, **arrays)
  elif kind == ".safetensors":
    save_file = _safetensors("save_file")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, path)
  else:
    raise ValueError(f"Unknown reference file type {path!r}: use .npz or "
                     f".safetensors.")
