"""Layers: the floating leaves of an output, named by their pytree path.

The checker and the search compare outputs layer by layer, by the names of
:func:`named_layers`; names from other frameworks match after
:func:`normalize`.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxprec._src.flax import nnx_policy
from jaxprec._src.jaxpr import trees


def _key_name(k: Any) -> str:
  tu = jax.tree_util
  if isinstance(k, tu.DictKey):
    return f".{k.key}" if isinstance(k.key, str) else f"[{k.key!r}]"
  if isinstance(k, tu.GetAttrKey):
    return f".{k.name}"
  if isinstance(k, tu.SequenceKey):
    return f"[{k.idx}]"
  if isinstance(k, tu.FlattenedIndexKey):
    return f"[{k.key}]"
  return f"[{k}]"


def path_name(path: Sequence[Any]) -> str:
  """A leaf's place in its tree as layer names write it
  (``'.hidden_states[0]'``)."""
  return "".join(map(_key_name, path))


def _leaves_with_paths(tree: Any) -> list[tuple[tuple, Any]]:
  """Like ``tree_flatten_with_path``, but plain dicts keep insertion order.

  JAX sorts dict keys; a dict of layers written in depth order
  (``layer_2`` before ``layer_10``) keeps that order here.
  """
  out: list[tuple[tuple, Any]] = []

  def rec(node, path):
    if type(node) in (dict, collections.OrderedDict):
      for k, v in node.items():
        rec(v, path + (jax.tree_util.DictKey(k),))
      return
    kids = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x, node=node: x is not node)[0]
    if len(kids) == 1 and kids[0][0] == () and kids[0][1] is node:
      out.append((path, node))
      return
    for p, v in kids:
      rec(v, path + tuple(p))
  rec(tree, ())
  return out


def is_float(x: Any) -> bool:
  """Whether ``x`` is a floating array (or a stand-in with shape and dtype)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or not hasattr(x, "shape"):
    return False
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:  # a dtype NumPy does not know (e.g. torch.float32)
    return False


def layers(tree: Any) -> list[tuple[str, Any]]:
  """``(name, leaf)`` for every floating leaf; ValueError on duplicate names."""
  out = [(path_name(p).lstrip(".") or "output", v)
         for p, v in _leaves_with_paths(tree) if is_float(v)]
  dup = [n for n, c in collections.Counter(n for n, _ in out).items() if c > 1]
  if dup:
    raise ValueError(f"Two layers of the output have the same name {dup[0]!r}; "
                     f"rename the keys of the returned pytree (in "
                     f"check_module: a value a module sows (Module.sow) is "
                     f"named as a key of its output, 'block.name': rename "
                     f"one of them).")
  return out


def not_compared(tree: Any) -> list[tuple[str, str]]:
  """``(name, what)`` of every leaf :func:`layers` leaves out: Python numbers
  and arrays that are not floating (token ids, masks, counts), named as the
  layers are, ``what`` their type or dtype (``'int'``, ``'int32'``)."""
  out = []
  for p, v in _leaves_with_paths(tree):
    if v is None or is_float(v):
      continue
    dtype = getattr(v, "dtype", None)
    what = str(dtype) if dtype is not None else type(v).__name__
    out.append((path_name(p).lstrip(".") or "output", what))
  return out


def ordered_layers(wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
                   fn: Callable[..., Any], call: Any,
                   dynamic: Sequence[Any],
                   skipped: list | None = None) -> list[tuple[str, Any]]:
  """The layers of ``wrap(fn)`` called by ``call`` in the order ``fn`` returned them.

  Transformations (emulation, ``eval_shape``) rebuild the output from its
  treedef, which sorts dict keys; the names are read from ``fn``'s own
  output while it is traced, and the result is put back in that order.

  Args:
    wrap: the transformation, e.g. ``Plan.wrap``.
    fn: the user's function (an NNX model comes as
      :func:`jaxprec._src.flax.nnx_policy.stateful` makes it).
    call: an object whose ``call(f, dynamic)`` calls ``f`` with the arguments
      (:class:`jaxprec._src.checker.harness.Args`).
    dynamic: the array arguments.
    skipped: where to put :func:`not_compared` of ``fn``'s own output.
  """
  order: list[list[str]] = []

  def note(out):
    order.append([n for n, _ in layers(out)])
    if skipped is not None:
      skipped[:] = not_compared(out)
    return out
  if isinstance(fn, nnx_policy.Stateful):
    # Stays a Stateful, so that a policy's path rules still find the module
    # (jaxprec._src.flax.nnx_policy.bind).
    observed = fn.observing(note)
  else:
    @functools.wraps(fn)
    def observed(*a, **k):
      return note(fn(*a, **k))
  # A leaf jit cannot return names the user's function (jit would name ours).
  found = layers(trees.jax_outputs(fn, call.call(wrap(observed), dynamic)))
  if not order:
    return found
  by_name = dict(found)
  if sorted(by_name) != sorted(order[-1]):
    return found
  return [(n, by_name[n]) for n in order[-1]]


def named_layers(tree: Any) -> dict[str, Any]:
  """The floating leaves of a pytree by the names ``jaxprec.check`` gives them.

  Names are pytree paths: ``'hidden_states[3]'``, ``'encoder.layer_0'``,
  ``'output'`` for a bare array. Plain dicts keep their insertion order.

  Args:
    tree: hidden states, e.g. the output of ``fn`` given to ``check``.

  Returns:
    An insertion-ordered dict, name -> array.

  Examples:
    >>> import numpy as np, jaxprec
    >>> tree = {"hidden_states": (np.zeros(2), np.ones(2)), "mask": np.ones(2, int)}
    >>> list(jaxprec.named_layers(tree))
    ['hidden_states[0]', 'hidden_states[1]']
  """
  return dict(layers(tree))


def normalize(name: str) -> str:
  """The form in which layer names from different frameworks are compared.

  Examples:
    >>> from jaxprec._src.checker.layers import normalize
    >>> normalize("hidden_states[3]") == normalize("hidden_states/3")
    True
  """
  return re.sub(r"[\[\]./'\"]+", ".", name).strip(".")


def root_name(names: Iterable[str]) -> str:
  """The prefix of the root's layers among module outputs by path
  (``names``): ``'output'`` (``'output.encode'``), unless a submodule is
  named ``'output'``: then ``'(root)'`` (``'((root))'`` where one is named
  ``'(root)'`` too, and so on)."""
  taken = {n.split("/")[0].split(".")[0].split("#")[0] for n in names}
  root = "output" if "output" not in taken else "(root)"
  while root in taken:
    root = f"({root})"
  return root


def is_rooted(name: str) -> bool:
  """Whether the module output ``name`` (by path: the root's ``''``, its
  method's ``'.encode'``, its calls' ``'#0'``) is one of the root's."""
  return not name or name[0] in ".#"


def rooted(names: Sequence[str]) -> list[str]:
  """Module outputs by path as layers name them: the root's prefixed by
  :func:`root_name` (``''`` -> ``'output'``; beside a submodule named
  ``output``, ``'(root)'``)."""
  root = root_name(names)
  return [root + n if is_rooted(n) else n for n in names]


def unlisted(kind: str, module: Any, kwargs: dict) -> bool:
  """Whether a module call the hook shows
  (:func:`jaxprec._src.flax.hook.observing`) is no layer of a ``kind`` model
  (``'linen'`` or ``'nnx'``): an NNX module inside a linen model (a
  ``ToLinen``'s), or an ``nnx.bridge.ToNNX``'s own call of ``__call__``,
  whose linen module's call is the layer at its path."""
  from flax import nnx  # noqa: PLC0415 -- Flax only when in use
  return ((kind == "linen" and isinstance(module, nnx.Module))
          or (isinstance(module, nnx.bridge.ToNNX)
              and kwargs.get("method") in (None, "__call__")))
