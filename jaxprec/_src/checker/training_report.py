"""The report of :func:`jaxprec.check_training`: losses and drift per step."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from jaxprec._src.checker import render

SCHEMA = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingReport:
  """The same training loop run at several precisions, against a reference.

  Returned by :func:`jaxprec.check_training`.

  Attributes:
    precisions: the precision labels.
    reference: the reference precision name.
    target, mode, backend: as in :class:`DivergenceReport`.
    steps: number of training steps.
    reference_losses: the reference run's loss at each step (before the
      update of that step).
    losses: label -> losses at each step.
    drift: label -> relative L2 distance of the parameters from the
      reference run's after each step: ``||p - p_ref|| / ||p_ref||`` over all
      floating parameter leaves together.
    divergence_step: label -> the first step whose loss differs from the
      reference's by more than ``threshold`` relatively
      (``|l - l_ref| > threshold * max(|l_ref|, 1e-12)``) or is not finite;
      None if none.
    threshold: the relative loss difference that counts as divergence.
    numerics: label -> what ran.
    notes: remarks.
    seconds: wall time of the whole loop, compilation included.
  """

  precisions: tuple[str, ...]
  reference: str
  target: str
  mode: str
  backend: str
  steps: int
  reference_losses: tuple[float, ...]
  losses: Mapping[str, tuple[float, ...]]
  drift: Mapping[str, tuple[float, ...]]
  divergence_step: Mapping[str, int | None]
  threshold: float
  numerics: Mapping[str, str] = dataclasses.field(default_factory=dict)
  notes: tuple[str, ...] = ()
  seconds: float = 0.0

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe values: ``{"schema": 1, "kind": "training", ...}``, the
    attributes by name; non-finite numbers as strings, as in check reports."""
    return render.encode({
        "schema": SCHEMA, "kind": "training", "reference": self.reference,
        "target": self.target, "mode": self.mode, "backend": self.backend,
        "precisions": list(self.precisions), "steps": self.steps,
        "threshold": self.threshold, "numerics": dict(self.numerics),
        "reference_losses": list(self.reference_losses),
        "losses": {p: list(v) for p, v in self.losses.items()},
        "drift": {p: list(v) for p, v in self.drift.items()},
        "divergence_step": dict(self.divergence_step),
        "notes": list(self.notes), "seconds": self.seconds,
    })

  to_json = render.to_json

  def __str__(self) -> str:
    head = (f"jaxprec.check_training: {self.steps} steps vs reference "
            f"{self.reference}; target {self.target}, mode {self.mode} "
            f"(backend {self.backend}); divergence: relative loss difference "
            f"> {self.threshold:g}")
    cols = ["precision", "numerics", "final loss", "max rel loss diff",
            "final drift", "diverged at step"]
    rows = [["(reference) " + self.reference, "",
             render.fmt(self.reference_losses[-1], 4) if self.reference_losses else "-",
             "", "", ""]]
    for p in self.precisions:
      losses, ref = self.losses[p], self.reference_losses
      diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref)]
      step = self.divergence_step[p]
      rows.append([p, self.numerics.get(p, ""),
                   render.fmt(losses[-1], 4) if losses else "-",
                   render.fmt(max(diffs, default=0.0)),
                   render.fmt(self.drift[p][-1]) if self.drift[p] else "-",
                   "-" if step is None else str(step)])
    return "\n".join([head, *render.table(cols, rows, {0, 1}),
                      *[f"note: {n}" for n in self.notes]])

  def plot(self, path: str | os.PathLike | None = None
           ) -> "matplotlib.figure.Figure":
    """Loss curves (left) and parameter drift (right, log scale) per step.

    Args:
      path: where to save the figure; None only returns it. In a
        multi-process run (``jax.distributed``) process 0 alone saves it.

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ImportError: matplotlib is not installed (the ``plots`` extra).
    """
    Figure = render.figure_class("TrainingReport.plot")
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_loss, ax_drift = fig.subplots(1, 2)
    steps = list(range(self.steps))
    ax_loss.plot(steps, self.reference_losses, color="black", lw=2,
                 label=f"reference {self.reference}")
    for p in self.precisions:
      ax_loss.plot(steps, self.losses[p], label=p)
      ys = [v if math.isfinite(v) and v > 0 else float("nan") for v in self.drift[p]]
      ax_drift.plot(steps, ys, label=p)
      if self.divergence_step[p] is not None:
        ax_loss.axvline(self.divergence_step[p], ls=":", alpha=0.5)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=8)
    ax_drift.set_yscale("log")
    ax_drift.set_xlabel("step")
    ax_drift.set_ylabel("||p - p_ref|| / ||p_ref||")
    ax_drift.legend(fontsize=8)
    for ax in (ax_loss, ax_drift):
      ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"training at each precision vs {self.reference} "
                 f"(target {self.target}, {self.mode})", fontsize=10)
    if path is not None:
      render.save(fig, path)
    return fig
