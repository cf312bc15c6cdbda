"""A policy on Flax models: the one per-module hook for linen and NNX.

Rooms, lowest first (each may import only the rooms above it in this list,
plus :mod:`jaxprec._src.policy.policy`, :mod:`jaxprec._src.core.numerics` and the other
core modules; nothing below imports these back, not even lazily):

* :mod:`.paths`: the one source of Flax module paths (for the interceptor and
  for :func:`jaxprec.audit`). Imports Flax only when called.
* :mod:`.state`: the typed runtime state of a policy scope (thread-local).
* :mod:`.identity`: what a module is to a policy: its type, op kind and own
  precision (both APIs).
* :mod:`.hook`: the one per-module hook: the policy's decision for a module
  call, and the NNX call wrapper installed on a copy of the model (which also
  gives the audit NNX module paths). Imports Flax only when called.
* :mod:`.nnx_policy`: a policy applied to an NNX copy (dtypes, records, the
  hook), for :func:`jaxprec.swap`, :func:`jaxprec.emulate`,
  :func:`jaxprec.cost` and :func:`jaxprec.audit`. Imports Flax only when
  called.
* :mod:`.interception`: linen method interception through the hook (imports
  Flax).
* :mod:`.scope`: :func:`policy_scope`, the one way a policy comes in force
  (imports :mod:`.interception` only once Flax linen is imported).

The precision-aware modules and :func:`jaxprec.swap`, which emulate through
:func:`jaxprec.emulate`, are in :mod:`jaxprec._src.modules`, above the
emulation; this package sits below it and never imports it.

``import jaxprec`` imports none of the rooms that import Flax.
"""
