"""Where a check's packed layers lie when its arguments span several devices.

A check reduces every layer to a few numbers next to the computation that
produced it. On a batch sharded over several devices (one process, or many
under ``jax.distributed``) the layers are stacked in one group per device
(:class:`jaxprec._src.checker.metric_stats.Layout`), so that each device's share of a
batch-sharded layer is stacked and reduced where it lies and only the
per-layer numbers cross between devices. This module names those devices and
places arrays the host packs (a reference read from a file or a mapping) on
them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def group_devices(dynamic: Sequence[Any]) -> tuple[Any, ...]:
  """The devices of the array of ``dynamic`` that lies on the most of them.

  In its mesh's order (a ``NamedSharding``), else by device id; ``()`` when
  no argument is a JAX array on devices (NumPy arrays, tracers). A program
  over several devices stacks its layers in that many groups.
  """
  best: tuple[Any, ...] = ()
  for x in dynamic:
    if not isinstance(x, jax.Array):
      continue
    try:
      sharding = x.sharding
      if isinstance(sharding, jax.sharding.NamedSharding):
        devices = tuple(sharding.mesh.devices.flat)
      else:
        devices = tuple(sorted(sharding.device_set, key=lambda d: d.id))
    except (AttributeError, TypeError, ValueError):  # a tracer: no devices
      continue
    if len(devices) > len(best):
      best = devices
  return best


def on_devices(packed: np.ndarray, devices: Sequence[Any]) -> jax.Array:
  """A packed host array split over ``devices``: group ``k`` on the ``k``-th.

  With one device or none, the array as ``jnp.asarray`` places it. A
  reference read from the host and checked against a batch sharded over
  several devices is split over them as the layers it is compared with are,
  never held whole by one. Under ``jax.distributed`` every process passes
  the same array and keeps its own devices' rows.
  """
  if len(devices) <= 1:
    return jnp.asarray(packed)
  mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("groups",))
  return jax.device_put(packed, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("groups")))
