"""Training divergence: ``jaxprec.check_training``.

The same optax training loop runs at the reference precision and at each
precision under test, from the same parameters on the same batches. Every
step is one jitted program that advances all runs together and returns only
scalars: each run's loss and each candidate's parameter drift from the
reference run. Gradients are computed at the run's precision: when emulating,
``jax.value_and_grad`` of :func:`jaxprec.emulate`'d loss, whose backward
matmuls are emulated too, as a TPU would run them.

Memory: all runs' parameters and optimizer states are live at once (one copy
per precision plus the reference's).
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxprec._src.checker import harness
from jaxprec._src.checker import render
from jaxprec._src.checker import rows
from jaxprec._src.checker.report import TrainingReport
from jaxprec._src.core.precision import PrecisionLike
from jaxprec._src.jaxpr import compat
from jaxprec._src.policy import policy as policy_lib

DEFAULT_THRESHOLD = 0.1


def divergence_step(losses: Sequence[float], reference: Sequence[float],
                    threshold: float = DEFAULT_THRESHOLD) -> int | None:
  """The first step whose loss differs from the reference's by more than ``threshold``.

  Relative difference: ``|l - l_ref| > threshold * max(|l_ref|, 1e-12)``. A
  non-finite loss where the reference's is finite diverges too.

  Examples:
    >>> from jaxprec._src.checker.training import divergence_step
    >>> divergence_step([1.0, 0.9, 0.5], [1.0, 0.91, 0.8], threshold=0.1)
    2
    >>> print(divergence_step([1.0, float("nan")], [1.0, float("nan")]))
    None
  """
  for i, (l, r) in enumerate(zip(losses, reference)):
    if not math.isfinite(r):
      continue
    if not math.isfinite(l) or abs(l - r) > threshold * max(abs(r), 1e-12):
      return i
  return None


def _float_leaves(tree: Any) -> list[jax.Array]:
  return [x for x in jax.tree_util.tree_leaves(tree)
          if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]


def _sq_norm(leaves: Sequence[jax.Array]) -> jax.Array:
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves),
             jnp.float32(0))


def _batches(batches: Any, steps: int | None) -> list[Any]:
  if callable(batches) and not isinstance(batches, (list, tuple)):
    if steps is None:
      raise ValueError("batches is a function of the step: pass steps=")
    return [batches(i) for i in range(steps)]
  if isinstance(batches, Sequence):
    out = list(batches)
    if steps is not None:
      if steps > len(out):
        raise ValueError(f"steps={steps} but only {len(out)} batches given")
      out = out[:steps]
    return out
  if isinstance(batches, Iterable):
    if steps is None:
      raise ValueError("batches is an iterator: pass steps=")
    out = list(itertools.islice(iter(batches), steps))
    if len(out) < steps:
      raise ValueError(f"steps={steps} but the iterator gave {len(out)} batches")
    return out
  raise TypeError(f"batches must be a sequence, an iterable or a function of "
                  f"the step; got {type(batches).__name__}")


def check_training(loss_fn: Callable[[Any, Any], jax.Array], params: Any,
                   batches: Any, optimizer: Any, *,
                   precisions: Sequence[PrecisionLike] | PrecisionLike
                   | None = None,
                   steps: int | None = None, reference: str = "float32",
                   target: str = "tpu", mode: str = "auto",
                   threshold: float = DEFAULT_THRESHOLD,
                   progress: bool = False) -> TrainingReport:
  """Trains at each precision and reports loss curves, drift and divergence.

  Runs ``steps`` steps of ``params <- optimizer.update(grad(loss_fn)(params,
  batch))`` at the reference precision and at each precision in
  ``precisions``, from the same ``params`` on the same batches. Precision
  names mean what they mean in :func:`jaxprec.check`: what ``target``
  computes for them (when emulating, the gradients' matmuls are emulated
  too).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    params: the initial parameters (a pytree; not modified).
    batches: a sequence of batches, an iterable (with ``steps``), or a
      function ``step -> batch`` (with ``steps``).
    optimizer: an ``optax.GradientTransformation``.
    precisions: the precisions to train at; None (default): the target's
      default rows, as :func:`jaxprec.check`'s.
    steps: number of steps (default: ``len(batches)``).
    reference: the reference precision (default ``'float32'``, exact where the
      backend has it; float64 is not supported here). A model that computes
      in bfloat16 or float16 (Flax ``dtype=``, a policy's ``dtype:``) trains
      its float32 reference with every module at float32: the float32 model.
    target, mode: as in :func:`jaxprec.check`.
    threshold: the relative loss difference from the reference that counts
      as divergence (default 0.1, i.e. 10%; see :func:`divergence_step`).
    progress: show a progress bar over steps on stderr (if a terminal).

  Returns:
    A :class:`jaxprec.TrainingReport`.

  Raises:
    TypeError: ``loss_fn`` not callable; ``optimizer`` not an optax
      ``GradientTransformation`` (e.g. the string ``'sgd'``).
    ValueError: bad precision, target, mode, steps, reference or threshold
      (a finite number > 0).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxprec
    >>> def loss(w, batch):
    ...   x, y = batch
    ...   return jnp.mean((jnp.tanh(x @ w) - y) ** 2)
    >>> k1, k2 = jax.random.split(jax.random.key(0))
    >>> x = jax.random.normal(k1, (32, 16))
    >>> y = jnp.tanh(x @ jax.random.normal(k2, (16, 4)))
    >>> r = jaxprec.check_training(loss, jnp.zeros((16, 4)), [(x, y)] * 5,
    ...                            optax.sgd(0.5), precisions=["bfloat16"],
    ...                            mode="emulate")
    >>> r.steps, len(r.losses["bfloat16"]), r.divergence_step["bfloat16"] is None
    (5, 5, True)
  """
  import optax
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}")
  if not (callable(getattr(optimizer, "init", None))
          and callable(getattr(optimizer, "update", None))):
    raise TypeError(f"optimizer must be an optax.GradientTransformation (with "
                    f"init and update), e.g. optax.sgd(0.1); got {optimizer!r} "
                    f"of type {type(optimizer).__name__}.")
  setting = rows.setting(target, mode)
  target, mode = setting.target, setting.mode
  plans = rows.plans(precisions, setting)
  if not isinstance(reference, str) or reference.strip().lower() in \
      rows.FLOAT64_NAMES or "=" in reference:
    raise ValueError(f"check_training's reference must be a precision name "
                     f"such as 'float32'; got {reference!r}")
  ref_plan = harness.reference_plan(reference, target, mode)
  if isinstance(threshold, bool) or not isinstance(
      threshold, numbers.Real) or not 0 < threshold < math.inf:
    raise ValueError(f"threshold must be a finite number > 0, e.g. "
                     f"threshold=0.1; got {threshold!r}.")
  batch_list = _batches(batches, steps)
  if not batch_list:
    raise ValueError("no training steps: give at least one batch")
  n_steps = len(batch_list)
  if ref_plan.precision.name in ("float32", "F32_F32_F32") and \
      harness.narrow_compute(loss_fn, harness.Args(
          (params, batch_list[0]), {}, who="jaxprec.check_training"))[1]:
    # A bfloat16 model trains against the float32 model, as check compares.
    ref_plan = dataclasses.replace(
        ref_plan, dtypes=policy_lib.reference_policy("float32"))
  run_fns = [ref_plan.wrap(loss_fn)] + [p.wrap(loss_fn) for p in plans]

  def step(states, batch):
    new_states, losses = [], []
    for f, (p, o) in zip(run_fns, states):
      loss, grads = jax.value_and_grad(f)(p, batch)
      updates, o = optimizer.update(grads, o, p)
      new_states.append((optax.apply_updates(p, updates), o))
      losses.append(jnp.asarray(loss, jnp.float32))
    ref_leaves = _float_leaves(new_states[0][0])
    ref_norm = jnp.sqrt(_sq_norm(ref_leaves))
    drifts = []
    for p, _ in new_states[1:]:
      diff = _sq_norm([a - b for a, b in zip(_float_leaves(p), ref_leaves)])
      drifts.append(jnp.sqrt(diff) / jnp.maximum(ref_norm, np.float32(1e-30)))
    return new_states, jnp.stack(losses), jnp.stack(drifts)

  step = harness.Jit(step)
  opt_state = optimizer.init(params)
  states = [(params, opt_state)] * len(run_fns)
  all_losses, all_drifts = [], []
  t0 = time.perf_counter()
  with render.Progress(n_steps, "jaxprec check_training", progress) as bar:
    for i, batch in enumerate(batch_list):
      states, losses, drifts = step(states, batch)
      losses, drifts = jax.device_get((losses, drifts))
      all_losses.append([float(v) for v in losses])
      all_drifts.append([float(v) for v in drifts])
      bar.update(f"step {i + 1}", advance=1)
  seconds = time.perf_counter() - t0
  labels = tuple(p.label for p in plans)
  ref_losses, *run_losses = zip(*all_losses)  # per run, over the steps
  losses = dict(zip(labels, run_losses))
  drift = dict(zip(labels, zip(*all_drifts)))
  return TrainingReport(
      precisions=labels, reference=reference,
      target=target, mode=mode, backend=compat.backend_platform(),
      steps=n_steps, reference_losses=ref_losses, losses=losses, drift=drift,
      divergence_step={p: divergence_step(losses[p], ref_losses, threshold)
                       for p in losses},
      threshold=float(threshold),
      numerics={p.label: p.description for p in plans}, seconds=seconds)
