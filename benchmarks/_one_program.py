"""A check row as one program computing its layers and their metrics.

``jaxprec.check`` runs a row as two programs: its layers, then their metrics
(one program per layout, shared by the rows). The benchmarks time this form
next to it (``bench_check.py --forms``, ``bench_search.py``); it has the
signature of ``harness.run_candidate``.
"""

from __future__ import annotations

from jaxprec._src.checker import harness
from jaxprec._src.checker import layers as layers_lib
from jaxprec._src.checker import metrics as metrics_lib


def one_program(fn, call, p, ref, atol, rtol, cache=None, *, seen=None):
  """A row as one program computing its layers and their metrics."""
  names, layout = tuple(ref.names), ref.layout

  def make(fn_ref):
    def program(hi, lo, stats, dynamic, atol, rtol):
      by_name = dict(layers_lib.ordered_layers(p.wrap, fn_ref(), call.static,
                                               dynamic))
      values = [by_name[n] for n in names]
      return metrics_lib.layer_stats(values, hi, lo, stats, layout,
                                     atol=atol, rtol=rtol,
                                     finite_only=True), values
    return harness.Jit(program)
  args = harness.candidate_args(call, ref, atol, rtol)
  prog = harness._program(  # noqa: SLF001
      fn, ("one", p.key, call.key, names, layout), make, cache)
  out, values = prog(*args)
  if seen is not None:
    seen(values)
  return harness._finish(out, values, ref, args)  # noqa: SLF001
