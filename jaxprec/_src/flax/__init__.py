"""A policy on Flax models: the one per-module hook for linen and NNX.

Rooms, lowest first; each may import only the rooms above it in this list,
plus :mod:`jaxprec._src.policy.policy` and the core modules, and nothing
below imports these back, not even lazily: :mod:`.paths` (module paths),
:mod:`.state` (the typed runtime state of a policy scope), :mod:`.hook` (what
a module is to a policy, and the one per-module hook),
:mod:`.nnx_policy` (a policy applied to an NNX copy), :mod:`.interception`
(linen method interception; imports Flax) and :mod:`.scope`
(:func:`policy_scope`, the one way a policy comes in force).

The precision-aware modules and :func:`jaxprec.swap` are in
:mod:`jaxprec._src.modules`, above the emulation; this package sits below it
and never imports it. ``import jaxprec`` imports none of the rooms that
import Flax.
"""
