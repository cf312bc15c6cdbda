"""Helpers shared by the switched-program tests (test_switch*.py)."""

import jax
import numpy as np

import jaxprec
from jaxprec._src.inspect import cost as cost_lib
from jaxprec._src.search import search as search_lib
from jaxprec._src.search import search_algorithm
from jaxprec._src.search import switch


def same(a, b) -> bool:
  """Bit for bit (NaN payloads and the sign of zero included)."""
  a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
  return a.shape == b.shape and np.array_equal(a.view(np.uint32),
                                               b.view(np.uint32))


def units_and_cands(fn, args, target="tpu"):
  """The search's units and candidates for ``fn``, and a ``Search`` whose
  ``policy(levels)`` spells a level per unit as the search does."""
  weights = cost_lib.weights_for(target)
  cands = search_lib._candidates(None, target, weights)
  table = search_algorithm.CostTable.of(fn, args, {}, target, cands, weights)
  search = search_algorithm.Search(runner=None, table=table, cands=cands,
                                   metric="rel_rms", tolerance=1e-3, budget=9,
                                   verbose=False)
  return table.units, cands, search


def policies(n_units, n_cands, count, seed=0):
  """Every uniform assignment, then ``count`` random ones."""
  rng = np.random.default_rng(seed)
  out = [(c,) * n_units for c in range(n_cands)]
  out += [tuple(int(v) for v in rng.integers(0, n_cands, n_units))
          for _ in range(count)]
  return out


def assert_switched_is_fixed(fn, args, count, seed=0, target="tpu",
                             uniform=True):
  """The switched program against ``jax.jit(emulate(fn, policy))``, bit for
  bit, for the uniform (else only the most precise uniform) and ``count``
  random policies."""
  units, cands, search = units_and_cands(fn, args, target)
  g = jax.jit(switch.switched(fn, units, [c.precision for c in cands],
                              target=target))
  chosen = policies(len(units), len(cands), count, seed)
  if not uniform:
    chosen = chosen[len(cands) - 1:]
  for levels in chosen:
    fixed = jax.jit(jaxprec.emulate(fn, search.policy(levels), target=target))
    want = jax.tree.leaves(fixed(*args))
    got = jax.tree.leaves(g(switch.index_of(levels), *args))
    assert len(got) == len(want)
    assert all(same(a, b) for a, b in zip(got, want)), str(search.policy(levels))
  return units
