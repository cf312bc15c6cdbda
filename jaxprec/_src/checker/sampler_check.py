"""``jaxprec.check_sampler``: an RL trainer's log-probs against its sampler's.

Two ways to compute one model on one token sequence:

* the trainer: a teacher-forced forward over the whole sequence, alone;
* the sampler: the prompt in one chunk, then one token at a time with a
  key/value cache (the model's ``decode``, or a PyTorch model's forward with
  ``past_key_values``: :mod:`jaxprec._src.torch.torch_sampler`), the
  sequence alone or left-padded among other sequences, as transformers'
  ``generate`` batches them.

Each side has its own numerics (:class:`Compute`: a precision or a policy,
a target, a chip, the LM head's own, the attention's own), emulated on any
backend (:func:`jaxprec.emulate`). The report holds the figures RL
frameworks log (:mod:`jaxprec._src.checker.sampler`), the gap split by
factor, and where the two first part: the first token position, then the
first module call there (in the order the calls return) whose output
differs by more than the float32 floor. Each side's module calls are those
``check_module`` sees (the hook's observers, their outputs taken out of the
jitted program), or a PyTorch sampler's forward hooks; a decode step's
output of a module covers the positions of its tokens, and is paired with
the forward's output of the same module (by path and call) at those
positions.

The attribution switches one factor at a time from the sampler's setting to
the trainer's (the LM head's numerics, the body's, the attention's, decoding
with a cache or teacher forcing, the batch) and reads the RMS of the gap
each time: a factor's share is how much the RMS falls, and the remainder
(what the factors do together) makes the shares sum to the total.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import textwrap
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxprec._src.checker import check
from jaxprec._src.checker import layers as layers_lib
from jaxprec._src.checker import progress as progress_lib
from jaxprec._src.checker import render
from jaxprec._src.checker import sampler as figures_lib
from jaxprec._src.core import numerics
from jaxprec._src.core.precision import PrecisionLike, resolve
from jaxprec._src.emulation import emulated_ops
from jaxprec._src.emulation.emulate import emulate
from jaxprec._src.flax import hook
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.policy import policy as policy_lib
from jaxprec._src.policy.policy import Policy
from jaxprec._src.torch import torch_sampler

FACTORS = ("lm_head", "body", "attention", "decode", "batch")

NOT_MODELLED = (
    "An inference engine's own kernels (paged or flash attention, fused "
    "norms, its sampler's logit processing) and sampler-side quantization "
    "are not modelled: the sampler here is this model's own decode, at the "
    "sampler's precision, dtypes and chip (attention= sets the precision "
    "of its attention's matmuls, not a kernel's order of sums).",
    "A device's shape-dependent choice of kernel (another algorithm or split "
    "for another batch size or cache length) is not modelled: the batch "
    "changes what emulation computes for the row itself (the padded slots "
    "in the attention sums, a chip's summation groups, the TPU's "
    "matrix-vector rule), not the kernels a device would pick.",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compute:
  """How one side (trainer or sampler) computes the model.

  Attributes:
    precision: a precision name, a :class:`jaxprec.Policy` or a policy
      string (compute dtypes per module: ``'default=dtype:bfloat16'`` is
      bfloat16 weights and activations); None: the precision in force.
    target: ``'tpu'`` or ``'gpu'`` (emulated on any backend), ``'cpu'``
      (native: float32 on a CPU).
    chip: with ``target='gpu'``, the NVIDIA chip whose tensor cores are
      emulated (``'a100'``, ``'h100'``, ``'b200'``); None: the algorithm's
      rounding alone.
    head: the LM head's precision or policy where it differs from the
      body's (None: ``precision``), e.g. ``'default=float32+dtype:float32'``
      for a float32 head on a bfloat16 body (a rule on the path
      ``lm_head`` in ``precision`` does the same).
    attention: the precision of the attention's own arithmetic where it
      differs from the body's (None: ``precision``'s): the score and value
      matmuls an attention module runs in its own code (a module whose
      class name has ``Attention`` in it: the op kind ``'attention'`` of a
      policy), not its query, key, value and output projections, which
      keep the body's. E.g. ``'bfloat16'`` for an inference engine's
      one-pass bfloat16 attention beside a float32 body. A policy's rules
      that can match those matmuls and its default do the same
      (``'layers/0/.*=bfloat16,default=float32'``); it sets no dtype.

  Raises:
    ValueError: an unknown precision, policy, target or chip, a chip
      without ``target='gpu'``, a precision the target does not run
      (:class:`jaxprec.UnsupportedAlgorithmError`: ``TF32_TF32_F32`` on a
      TPU), or an ``attention`` policy that sets a compute dtype.

  Examples:
    >>> import jaxprec
    >>> s = jaxprec.Compute(precision="default=dtype:bfloat16", target="gpu",
    ...                     chip="h100")
    >>> str(s)
    'default=dtype:bfloat16 on gpu (h100)'
    >>> str(jaxprec.Compute(precision="float32", target="tpu",
    ...                     attention="bfloat16"))
    'float32 (bf16x6) on tpu, attention bfloat16 (bf16x1)'
  """

  precision: PrecisionLike | Policy = None
  target: str = "cpu"
  chip: str | None = None
  head: PrecisionLike | Policy = None
  attention: PrecisionLike | Policy = None

  def __post_init__(self):
    object.__setattr__(self, "target", numerics.check_target(
        self.target, emulation=True))
    object.__setattr__(self, "chip", emulated_ops.check_chip(
        self.chip, self.target))
    for name in ("precision", "head", "attention"):
      object.__setattr__(self, name, _numerics(getattr(self, name), name))
      value = getattr(self, name)
      if name == "attention" and isinstance(value, Policy) and (
          value.has_dtypes):
        raise ValueError(
            f"Compute attention={str(value)!r}: sets a compute dtype; "
            f"attention= takes a precision or a policy of precisions (for "
            f"the attention's own matmuls); give dtypes in precision=")
      if (value is not None and not isinstance(value, Policy)
          and self.target in numerics.TARGETS):
        try:  # every entry point refuses what the target does not run
          numerics.algorithm_for(value, self.target, jnp.float32, jnp.float32)
        except ValueError as e:
          raise type(e)(f"Compute {name}=: {e}") from None

  def body(self) -> tuple[Any, str, str | None]:
    """The body's ``(precision or policy, target, chip)``, with the
    attention's own precision (:meth:`attending`)."""
    return self.attending(self.attention)

  def attends(self, target: str) -> Any:
    """The attention's precision (``attention``, else the body's) as
    ``target`` computes it (:func:`numerics.carried`); a policy as it is."""
    value = self.precision if self.attention is None else self.attention
    return value if isinstance(value, Policy) else numerics.carried(
        value, self.target, target)

  def attending(self, attention: Any) -> tuple[Any, str, str | None]:
    """The body's ``(precision or policy, target, chip)`` with the
    attention's own matmuls at ``attention``
    (:func:`jaxprec._src.policy.policy.attending`)."""
    return (policy_lib.attending(self.precision, attention), self.target,
            self.chip)

  def lm_head(self) -> tuple[Any, str, str | None]:
    """The LM head's ``(precision or policy, target, chip)``."""
    return (self.precision if self.head is None else self.head,
            self.target, self.chip)

  def __str__(self) -> str:
    text = _label(*self.attending(None))
    if self.head is not None:
      text += f", head {_label(self.head, self.target, None, where=False)}"
    if self.attention is not None:
      text += (f", attention "
               f"{_label(self.attention, self.target, None, where=False)}")
    return text


def _numerics(value: Any, name: str) -> Any:
  """A precision or a policy, checked: a policy string becomes a
  :class:`Policy`, a precision stays as typed (its name is what the target
  reads)."""
  if value is None:
    return None
  if isinstance(value, Policy) or (isinstance(value, str) and "=" in value):
    return Policy.parse(value)
  try:
    resolve(value)
  except ValueError as e:
    raise ValueError(f"Compute {name}=: {e}") from e
  return value


def _label(value: Any, target: str, chip: str | None, *,
           where: bool = True) -> str:
  """The name as typed, what ``target`` computes for it (a precision on a
  TPU or GPU: ``'bfloat16 (tf32)'``, :func:`numerics.algorithm_for`), and
  with ``where`` the target and chip."""
  text = ("the precision in force" if value is None
          else str(getattr(value, "name", value)))
  if (value is not None and not isinstance(value, Policy)
      and target in numerics.TARGETS):
    f32 = jnp.float32
    text += f" ({numerics.algorithm_for(value, target, f32, f32)})"
  if where:
    text += f" on {target}" + (f" ({chip})" if chip else "")
  return text


@dataclasses.dataclass(frozen=True)
class Share:
  """One factor of the attribution.

  Attributes:
    factor: one of :data:`FACTORS`: ``'lm_head'``, ``'body'`` (all but
      the attention's own matmuls), ``'attention'``, ``'decode'``,
      ``'batch'``.
    sampler, trainer: the factor's setting on each side (the trainer's
      attention as the sampler's target computes it, where the switch
      runs: ``'default'`` on a TPU is ``'BF16_BF16_F32'`` on a GPU).
    rms: the RMS gap with this factor alone switched to the trainer's.
    share: the total RMS gap minus ``rms``, in nats (0 where both sides
      agree on the factor).
  """

  factor: str
  sampler: str
  trainer: str
  rms: float
  share: float


@dataclasses.dataclass(frozen=True)
class Divergence:
  """Where the two paths first part: the first token position at which a
  module call's output differs by more than ``floor`` (relative RMS over
  the rest of its shape), and there the first such module in the order the
  calls return (a module before its parent), named by its path
  (``'model/layers/0/self_attn/o_proj'``; ``'lm_head'``: the logits at the
  head's numerics)."""

  position: int
  layer: str
  relative_rms: float
  floor: float


@dataclasses.dataclass(frozen=True)
class SamplerReport(render.Report):
  """What :func:`jaxprec.check_sampler` found.

  Attributes:
    trainer, sampler: each side's numerics, in words.
    sampling: the log-probabilities compared (raw or processed, with the
      options), in words.
    tokens: the sequence; ``prompt``: how many of its tokens the sampler
      prefilled in one chunk (the figures cover the tokens after them).
    batch: the lengths of the sequences decoded alongside (empty: alone).
    figures: :class:`GapFigures` of the whole gap.
    shares: one :class:`Share` per factor; ``remainder``: the total minus
      the shares (the factors' interaction); ``total``: ``figures.rms``.
    layers: for each module output compared, in the order the trainer's
      calls return (name, the largest relative RMS difference over
      positions); ``'lm_head'``, the logits, last.
    first_divergence: a :class:`Divergence`, or None where every module
      output stays within ``floor``.
    floor: the relative RMS difference counted as float32 rounding.
    notes: what the check does not see, among them the module outputs not
      compared position by position (one side's only, or not one value per
      position: a KV cache).
  """

  trainer: str
  sampler: str
  sampling: str
  tokens: tuple[int, ...]
  prompt: int
  batch: tuple[int, ...]
  figures: figures_lib.GapFigures
  shares: tuple[Share, ...]
  remainder: float
  total: float
  layers: tuple[tuple[str, float], ...]
  first_divergence: Divergence | None
  floor: float
  notes: tuple[str, ...]

  KIND = "sampler"

  def _fields(self) -> dict[str, Any]:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["figures"] = self.figures.to_dict()
    d["shares"] = [dataclasses.asdict(s) for s in self.shares]
    d["layers"] = [{"layer": n, "relative_rms_max": v} for n, v in self.layers]
    d["first_divergence"] = (None if self.first_divergence is None
                             else dataclasses.asdict(self.first_divergence))
    return d

  def _summary(self) -> list[tuple[str, str]]:
    g = self.figures
    rows = [("mean delta", f"{g.mean:+.4g}"), ("RMS delta", f"{g.rms:.4g}"),
            ("max |delta|", f"{g.max_abs:.4g}"),
            ("KL(train||sample) mean / max",
             f"{g.kl_train_sample_mean:.3g} / {g.kl_train_sample_max:.3g}"),
            ("KL(sample||train) mean / max",
             f"{g.kl_sample_train_mean:.3g} / {g.kl_sample_train_max:.3g}"),
            ("top-1 disagreement", f"{g.top1_disagreement:.3g}")]
    rows += [(f"ratio outside [{lo:g}, {hi:g}]", f"{f:.3g}")
             for lo, hi, f in g.outside]
    return rows

  def _where(self) -> str:
    d = self.first_divergence
    if d is None:
      return (f"no module output differs by more than the float32 floor "
              f"(relative RMS {self.floor:g})")
    return (f"token position {d.position}, module {d.layer} (relative RMS "
            f"{d.relative_rms:.3g} > floor {self.floor:g})")

  def _heading(self) -> list[str]:
    n = len(self.tokens) - self.prompt
    batch = ("alone" if not self.batch else
             f"left-padded among {len(self.batch)} other sequences (lengths "
             f"{', '.join(map(str, self.batch))})")
    return [f"trainer vs sampler: {n} sampled tokens of {len(self.tokens)}, "
            f"{self.sampling}",
            f"trainer: {self.trainer}; teacher-forced forward, alone",
            f"sampler: {self.sampler}; prompt of {self.prompt} in one chunk, "
            f"then decode with a KV cache, {batch}"]

  def _document(self, full: bool = False) -> render.Document:
    """The gap's figures, the attribution (a policy folded at 33
    characters), the first divergence and each module's largest
    difference."""
    def cell(text):
      return "\n".join(textwrap.wrap(text, 33)) or ""
    shares = [(s.factor, cell(s.sampler), cell(s.trainer), f"{s.rms:.3g}",
               f"{s.share:+.3g}") for s in self.shares]
    shares += [("remainder", "", "", "",
                f"{self.remainder:+.3g}"),
               ("total", "", "", f"{self.total:.3g}", f"{self.total:+.3g}")]
    return render.Document(heading=tuple(self._heading()), parts=(
        "gap: log pi_train - log pi_sample of each sampled token (nats)",
        render.Table(cols=("figure", "value"), rows=tuple(self._summary()),
                     left=frozenset({0, 1}), name=None),
        "attribution: each factor alone switched from the sampler's setting "
        "to the trainer's; the remainder is the factors together",
        render.Table(cols=("factor", "sampler", "trainer", "RMS delta",
                           "share (nats)"), rows=tuple(shares),
                     left=frozenset({0, 1, 2}), name=None),
        f"first divergence: {self._where()}",
        render.Table(cols=("module", "largest relative RMS over positions"),
                     rows=tuple((render.escaped(n), f"{v:.2g}")
                                for n, v in self.layers)),
        *[f"note: {n}" for n in self.notes]))

  def plot(self, path: str | os.PathLike | None = None
           ) -> "matplotlib.figure.Figure":
    """The gap along the sequence (left: ``figures.delta`` at each sampled
    token's position) and the attribution (right: each factor's share and
    the remainder as bars, the total as a line).

    Args:
      path: where to save the figure; None only returns it.

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ImportError: matplotlib is not installed (the ``plots`` extra).
    """
    Figure = render.figure_class("SamplerReport.plot")
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    gap, bars = fig.subplots(1, 2, width_ratios=(3, 2))
    delta = self.figures.delta
    gap.plot(range(self.prompt, len(self.tokens)), delta, marker="o")
    gap.axhline(0, color="grey", lw=1)
    infinite = sum(not math.isfinite(d) for d in delta)
    gap.set_title("log pi_train - log pi_sample of each sampled token"
                  + (f" ({infinite} infinite, not drawn)" if infinite
                     else ""), fontsize=9)
    gap.set_xlabel("token position")
    gap.set_ylabel("delta (nats)")
    names = [s.factor for s in self.shares] + ["remainder"]
    bars.bar(names, [s.share for s in self.shares] + [self.remainder],
             color=["tab:blue"] * len(self.shares) + ["tab:grey"])
    bars.axhline(self.total, color="tab:red", ls="--",
                 label=f"total RMS delta {self.total:.3g}")
    bars.set_title("attribution: each factor's share of the gap",
                   fontsize=9)
    bars.set_ylabel("share (nats)")
    bars.legend(fontsize=8)
    for ax in (gap, bars):
      ax.grid(True, alpha=0.3)
    fig.suptitle("\n".join(render.fold(
        f"trainer {self.trainer} vs sampler {self.sampler}", 110)),
                 fontsize=10)
    if path is not None:
      render.save(fig, path)
    return fig


@functools.lru_cache(maxsize=32)
def _program(fn: Any, setting: tuple[Any, str, str | None]):
  """``fn(state, ...)`` jitted, emulated at ``setting``. Keyed on the model's
  structure (``fn`` is one per graph definition and method) and the setting;
  holds no arrays: the state is an argument."""
  precision, target, chip = setting
  options = {} if chip is None else {"chip": chip}
  return jax.jit(emulate(fn, precision, target=target, **options))


class _Captured:
  """``fn(state, *inputs)``: a method of the model of ``graphdef`` with the
  output of every NNX module call in it, the capture of ``check_module``
  (:func:`jaxprec._src.checker.check.nnx_outputs`), as a tuple in the order
  the calls returned (a program's dict comes back sorted by name);
  ``names`` names them once a call has traced ``fn`` (as layers:
  :func:`layers_lib.rooted`), ``own`` the method's own output among them,
  ``lost`` the modules whose outputs it could not take out (inside a
  ``while_loop`` or ``cond``)."""

  def __init__(self, graphdef: Any, method: str):
    self.run = check.nnx_outputs(graphdef,
                                 None if method == "__call__" else method)
    self.after_root = "" if method == "__call__" else f".{method}"
    self.names: tuple[str, ...] = ()
    self.own = ""
    self.lost: list[str] = []

  def __call__(self, state, /, *inputs):
    out = self.run(state, *inputs, lost=self.lost)
    self.names = tuple(layers_lib.rooted(list(out)))
    self.own = layers_lib.root_name(out) + self.after_root
    return tuple(out.values())


@functools.lru_cache(maxsize=16)
def _captured(graphdef: Any, text: str, method: str) -> _Captured:
  # One per graph definition (and its text: 2 and 2.0 compare equal) and
  # method, so that its programs serve every model of that structure.
  del text  # part of the key only
  return _Captured(graphdef, method)


class _Runs:
  """The model's programs, one per side's numerics and call (shared by
  checks of models of one structure); the model's state is their
  argument. Each call gives the method's own output and its module calls'
  (``{name: output}``), a decode one such dict per step."""

  def __init__(self, model: Any):
    self.graphdef, state = _nnx().split(model)
    self.text = repr(self.graphdef)
    self.state = jax.tree.map(jnp.asarray, state)
    self.init_cache = model.init_cache
    self.lost: dict[str, None] = {}  # modules whose outputs are not seen

  def call(self, method: str, setting: tuple[Any, str, str | None],
           *inputs: Any) -> tuple[Any, dict[str, Any]]:
    try:
      fn = _captured(self.graphdef, self.text, method)
    except TypeError:  # a graph definition that is not hashable: not shared
      fn = _Captured(self.graphdef, method)
    out = _program(fn, setting)(self.state, *inputs)  # traced: names
    calls = dict(zip(fn.names, out))
    self.lost.update(dict.fromkeys(fn.lost))
    return calls.pop(fn.own), calls

  def forward(self, setting, ids, mask, positions):
    """``(hidden states, [(width, module calls)])`` of teacher forcing."""
    if isinstance(setting, torch_sampler.TorchSampler):
      return setting.hidden(ids, mask, positions, None)
    out, calls = self.call("__call__", setting, ids, mask, positions)
    return out["hidden_states"], [(ids.shape[1], calls)]

  def decode(self, setting, ids, mask, positions, chunk):
    """``(hidden states, [(n, module calls)] per step)`` of a decode:
    ``ids[:, :chunk]`` in one chunk, then one token at a time (a chunk of 1
    token or less: every token alone, padding included, one program for
    every step)."""
    if isinstance(setting, torch_sampler.TorchSampler):
      return setting.hidden(ids, mask, positions, chunk)
    cache = self.init_cache(*ids.shape)
    states, steps, at = [], [], 0
    for n in [chunk] + [1] * (ids.shape[1] - chunk):
      out, calls = self.call("decode", setting, ids[:, at:at + n], cache,
                             jnp.int32(at), mask, positions[:, at:at + n])
      cache = out["cache"]
      states.append(out["hidden_states"])
      steps.append((n, calls))
      at += n
    return tuple(jnp.concatenate(s, axis=1) for s in zip(*states)), steps

  def head(self, setting, hidden):
    """``(logits, module calls)`` of the LM head."""
    if isinstance(setting, torch_sampler.TorchSampler):
      return setting.head(hidden), {}
    return self.call("head", setting, hidden)


def _nnx():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx


def _by_position(steps: Sequence[tuple[int, dict[str, Any]]]
                 ) -> dict[tuple[str, int], tuple[str, np.ndarray | None]]:
  """Each module output's leaves over every position, by ``(name, leaf
  index)``: ``(label, array)``, the array ``(batch, positions, ...)`` joined
  from the steps' (each covers the ``n`` positions after the last), None
  where a step lacks the leaf or its second axis is not the step's ``n``
  positions (a cache, a table). The label is the name, with the leaf's
  place where the output has several (``'model/layers/0[1][0]'``)."""
  found: dict[tuple[str, int], tuple[str, list | None]] = {}
  for k, (n, calls) in enumerate(steps):
    for name, out in calls.items():
      flat = jax.tree_util.tree_flatten_with_path(out)[0]
      for i, (where, x) in enumerate(flat):
        label, parts = found.get((name, i), (
            name + (layers_lib.path_name(where) if len(flat) > 1 else ""),
            []))
        x = np.asarray(x)
        fits = parts is not None and len(parts) == k and x.ndim >= 2 and (
            x.shape[1] == n) and all(p.shape[:1] + p.shape[2:] == x.shape[:1]
                                     + x.shape[2:] for p in parts[:1])
        found[name, i] = label, [*parts, x] if fits else None
  return {key: (label, None if parts is None or len(parts) < len(steps)
                else np.concatenate(parts, axis=1))
          for key, (label, parts) in found.items()}


def _module_outputs(run: tuple[Any, list], head: tuple[Any, dict]
                    ) -> dict[tuple[str, int], tuple[str, Any]]:
  """A side's module outputs by position (:func:`_by_position`): its body's
  calls, those of its head (computed at the head's numerics, in place of the
  body's calls of the same modules), and its logits as ``'lm_head'``."""
  logits, calls = head
  width = np.shape(logits)[1]
  heads = _by_position([(width, calls)])
  replaced = {name for name, _ in heads} | {"lm_head"}
  found = {k: v for k, v in _by_position(run[1]).items()
           if k[0] not in replaced}
  found.update(heads)
  found["lm_head", 0] = "lm_head", np.asarray(logits)
  return found


def _paired(trainer: dict, sampler: dict, t_skip: int, s_skip: int
            ) -> tuple[dict[str, np.ndarray], list[str]]:
  """``({label: relative RMS per position}, unpaired labels)``: each module
  output of row 0 that both sides have at every position of the sequence,
  the sampler's against the trainer's (:func:`_relative`), in the order the
  trainer's calls returned; the rest (one side's only, or shapes that do not
  pair) by label."""
  rel, unpaired = {}, []
  for key in dict.fromkeys([*trainer, *sampler]):
    label, a = trainer.get(key, sampler.get(key))
    b = sampler.get(key, (None, None))[1]
    if key in trainer and a is not None and b is not None:
      a = np.asarray(a[0, t_skip:], np.float64)
      b = np.asarray(b[0, s_skip:], np.float64)
      if a.shape == b.shape:
        rel[label] = _relative(b, a)
        continue
    unpaired.append(label)
  return rel, unpaired


def _unpaired_note(unpaired: Sequence[str]) -> str:
  shown = ", ".join(unpaired[:8]) + (f" and {len(unpaired) - 8} more"
                                     if len(unpaired) > 8 else "")
  return (f"{len(unpaired)} module outputs are not compared position by "
          f"position (one side alone has them, or they are not one value "
          f"per position, such as a KV cache): {shown}.")


def _batch(tokens: np.ndarray, lengths: tuple[int, ...], vocab: int,
           seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
  """``(ids, mask, positions, pad)``: the sequence as row 0, the others
  (random tokens of ``lengths``) after it, all left-padded to the longest;
  ``pad`` is row 0's padding."""
  rng = np.random.default_rng(seed)
  rows = [tokens] + [rng.integers(0, vocab, n) for n in lengths]
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return ids, mask, positions, width - len(tokens)


def _shares(trainer, sampler, batch, gap, bar, hidden, logits, s_run,
            t_logits, sampled, sampling) -> list[Share]:
  """Each factor of :data:`FACTORS` switched alone from the sampler's
  setting to the trainer's, a phase of ``bar`` each (a factor on which both
  agree runs as the sampler: its share is 0)."""

  def rms_with(body, head, decode, batched):
    if (body, decode, batched) == (sampler.body(), True, bool(batch)):
      run, skip = s_run
    else:
      run, skip = hidden(body, decode, batched)
    z, _ = logits(run, skip, head)
    return figures_lib.gap_figures(t_logits, z, sampled, sampling).rms

  s_body, s_head = sampler.body(), sampler.lm_head()
  t_bare = trainer.attending(None)
  if isinstance(sampler, torch_sampler.TorchSampler):
    # its attention runs inside its decoder, which the body factor switches
    s_bare, t_body = sampler, trainer.body()
    attention = (f"{sampler}, its own", _describe(
        (trainer.attends(trainer.target), *t_bare[1:])), s_body)
  else:  # each side's attention as the other's target computes it
    s_bare = sampler.attending(None)
    t_body = trainer.attending(sampler.attends(trainer.target))
    t_attends = trainer.attends(sampler.target)
    attention = (_describe((sampler.attends(sampler.target), *s_bare[1:])),
                 _describe((t_attends, *s_bare[1:])),
                 sampler.attending(t_attends))
  switched = {
      "lm_head": (_describe(s_head), _describe(trainer.lm_head()), s_body,
                  trainer.lm_head(), True, bool(batch)),
      "body": (_describe(s_bare), _describe(t_bare), t_body, s_head, True,
               bool(batch)),
      "attention": (*attention, s_head, True, bool(batch)),
      "decode": ("decode with a KV cache", "teacher forcing", s_body, s_head,
                 False, bool(batch)),
      "batch": (f"among {len(batch)} others" if batch else "alone", "alone",
                s_body, s_head, True, False),
  }
  shares = []
  for i, factor in enumerate(FACTORS, 1):
    s_text, t_text, *args = switched[factor]
    bar.update(f"factor {factor} ({i}/{len(FACTORS)})", advance=1)
    r = rms_with(*args)
    shares.append(Share(factor, s_text, t_text, r, gap.rms - r))
  return shares


def check_sampler(model: Any, tokens: Any, *, trainer: Compute = Compute(),
                  sampler: Compute | Any = Compute(),
                  sampling: figures_lib.Sampling = figures_lib.Sampling(),
                  prompt: int = 1, batch: Sequence[int] = (),
                  floor: float = 1e-5, seed: int = 0,
                  progress: bool = False) -> SamplerReport:
  """How far a sampler's log-probabilities are from the trainer's, and why.

  The trainer computes ``model(tokens)`` (teacher forcing) with its
  numerics; the sampler prefills ``tokens[:prompt]`` and decodes the rest
  one token at a time with ``model.decode`` and a KV cache, with its own
  numerics, the sequence alone or among ``batch``. Both are emulated on any
  backend (:func:`jaxprec.emulate`); the user's model is not changed. The
  sampler may instead be a transformers PyTorch ``LlamaForCausalLM`` with
  the model's weights: its forward with ``past_key_values``, in its own
  dtype on its own device.

  Args:
    model: a causal language model with ``__call__(ids, attention_mask,
      position_ids)``, ``decode(ids, cache, position, attention_mask,
      position_ids)``, ``init_cache(batch, length)``, ``head(hidden)`` and
      ``config.vocab_size``, returning ``"hidden_states"``: the built-in NNX
      Llama
      (:class:`jaxprec.models.LlamaForCausalLM`, ``from_pytorch`` for a
      transformers checkpoint).
    tokens: the sequence ``(length,)``: prompt and sampled tokens.
    trainer, sampler: each side's numerics (:class:`jaxprec.Compute`); the
      sampler may be a transformers PyTorch ``LlamaForCausalLM`` (or
      ``Qwen2ForCausalLM``) whose config is ``model``'s and whose weights
      are ``model``'s rounded to its dtype (e.g. ``model =
      LlamaForCausalLM.from_pytorch(pt)`` and ``sampler=pt`` or a
      ``bfloat16`` copy); it is run in eval mode and left as it was.
    sampling: the log-probabilities compared (:class:`jaxprec.Sampling`:
      raw, or processed with a temperature, top-k, top-p).
    prompt: tokens the sampler prefills in one chunk (at least 1); the
      figures cover the tokens after them.
    batch: lengths of other sequences (random tokens from ``seed``) the
      sampler decodes alongside, every row left-padded to the longest.
    floor: the relative RMS difference of a module's output counted as
      float32 rounding, not a divergence.
    seed: the other sequences' tokens.
    progress: show each phase on stderr (the trainer, the sampler, then each
      factor switched): a bar on a terminal, a line per phase elsewhere.

  Returns:
    A :class:`jaxprec.SamplerReport`.

  Raises:
    TypeError: ``trainer`` not a :class:`Compute`, ``sampler`` neither a
      :class:`Compute` nor a PyTorch causal LM, ``sampling`` not a
      :class:`Sampling`, or a model without ``decode``.
    ValueError: a PyTorch sampler of another architecture, config or
      weights than ``model``, tokens that are not a sequence of at least 2
      token ids in
      the vocabulary, a ``prompt`` outside ``1..length-1``, a batch length
      below 1, or a ``floor`` that is not a positive number.
  """
  for name, value, kind in (("trainer", trainer, Compute),
                            ("sampler", sampler, Compute),
                            ("sampling", sampling, figures_lib.Sampling)):
    if name == "sampler" and torch_sampler.is_torch_module(value):
      continue
    if not isinstance(value, kind):
      also = (" or a transformers PyTorch LlamaForCausalLM"
              if name == "sampler" else "")
      raise TypeError(f"check_sampler: {name}= takes a jaxprec."
                      f"{kind.__name__}{also}; got {_short(value)}")
  missing = [m for m in ("decode", "init_cache", "head")
             if not callable(getattr(model, m, None))]
  if missing:
    raise TypeError(f"check_sampler: the model has no {', '.join(missing)} "
                    f"method; it takes a causal LM with a KV-cache decode, "
                    f"such as jaxprec.models.LlamaForCausalLM")
  ids = np.asarray(tokens)
  vocab = model.config.vocab_size
  if ids.ndim != 1 or len(ids) < 2 or not np.issubdtype(
      ids.dtype, np.integer) or ((ids < 0) | (ids >= vocab)).any():
    raise ValueError(f"check_sampler: tokens must be one sequence of at "
                     f"least 2 token ids in 0..{vocab - 1}; got shape "
                     f"{ids.shape}, dtype {ids.dtype}")
  if isinstance(prompt, bool) or not isinstance(prompt, (int, np.integer)) \
      or not 1 <= prompt < len(ids):
    raise ValueError(f"check_sampler: prompt={prompt!r}: an integer in "
                     f"1..{len(ids) - 1} (tokens the sampler prefills)")
  batch = tuple(batch)
  if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1
         for n in batch):
    raise ValueError(f"check_sampler: batch={batch!r}: lengths >= 1 of the "
                     f"other sequences")
  if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not (
      floor > 0):
    raise ValueError(f"check_sampler: floor={floor!r}: a number > 0")

  notes = NOT_MODELLED
  if not isinstance(sampler, Compute):
    sampler = torch_sampler.TorchSampler(sampler, model)
    notes = sampler.notes
  runs = _Runs(model)
  b_ids, b_mask, b_pos, pad = _batch(ids, batch, vocab, seed)
  alone = _batch(ids, (), vocab, seed)

  def hidden(body, decode, batched):
    i, m, p, skip = (b_ids, b_mask, b_pos, pad) if batched else alone
    i, m, p = map(jnp.asarray, (i, m, p))
    if decode:  # a one-token prompt: no chunk, padding one step at a time
      run = runs.decode(body, i, m, p, skip + prompt if prompt > 1 else 1)
    else:  # teacher forcing: the trainer's plain call when alone
      run = (runs.forward(body, i, None, None) if not batched
             else runs.forward(body, i, m, p))
    return run, skip

  def logits(run, skip, head):
    z, calls = runs.head(head, run[0][-1])
    sl = slice(skip + prompt - 1, skip + len(ids) - 1)
    return np.asarray(z[0, sl], np.float64), (z, calls)

  sampled = ids[prompt:]
  bar = progress_lib.Phases(2 + len(FACTORS), "jaxprec sampler", progress)
  with bar:
    bar.update(f"trainer: teacher forcing, {trainer}")
    t_run, t_skip = hidden(trainer.body(), False, False)
    t_logits, t_head = logits(t_run, t_skip, trainer.lm_head())
    bar.update(f"sampler: decode with a KV cache, {sampler}", advance=1)
    s_run, s_skip = hidden(sampler.body(), True, bool(batch))
    s_logits, s_head = logits(s_run, s_skip, sampler.lm_head())
    gap = figures_lib.gap_figures(t_logits, s_logits, sampled, sampling)
    shares = _shares(trainer, sampler, batch, gap, bar, hidden, logits,
                     (s_run, s_skip), t_logits, sampled, sampling)
    bar.finish()
  remainder = gap.rms - sum(s.share for s in shares)

  rel, unpaired = _paired(_module_outputs(t_run, t_head),
                          _module_outputs(s_run, s_head), t_skip, s_skip)
  if unpaired:
    notes = (*notes, _unpaired_note(unpaired))
  if not _attends(model):
    notes = (*notes, "No module of the model is an attention module (a "
             "class whose name has 'Attention' in it, or Flax's "
             "MultiHeadAttention): attention= reaches no matmul, and the "
             "attention factor's 0 share says nothing of its attention; "
             "its matmuls are the body's.")
  if runs.lost:
    notes = (*notes, f"The outputs of {', '.join(runs.lost)} are not "
             f"compared: they run inside a while_loop or cond, out of which "
             f"they cannot be taken.")
  names = list(rel)
  rel = np.stack(list(rel.values()))
  first = None
  over = np.argwhere(rel.T > floor)  # (position, module), in that order
  if len(over):
    p, layer = over[0]
    first = Divergence(int(p), names[layer], float(rel[layer, p]),
                       float(floor))
  return SamplerReport(
      trainer=str(trainer), sampler=str(sampler), sampling=str(sampling),
      tokens=tuple(map(int, ids)), prompt=int(prompt),
      batch=tuple(map(int, batch)), figures=gap, shares=tuple(shares),
      remainder=float(remainder), total=gap.rms,
      layers=tuple((n, float(r)) for n, r in zip(names, rel.max(axis=1))),
      first_divergence=first, floor=float(floor), notes=notes)


def _attends(model: Any) -> bool:
  """Whether a module of the NNX ``model`` is one the op kind
  ``'attention'`` reaches (:func:`jaxprec._src.flax.hook.classify`)."""
  return any(hook.classify_nnx(m)[1] == "attention"
             for _, m in flax_paths.nnx_modules(model))


def _describe(setting: Any) -> str:
  return (str(setting) if isinstance(setting, torch_sampler.TorchSampler)
          else _label(*setting))


def _short(value: Any) -> str:
  """``repr`` on one line of at most 80 characters (a PyTorch model's
  runs to pages)."""
  text = " ".join(repr(value).split())
  return text if len(text) <= 80 else text[:77] + "..."


def _relative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Per position (the first axis): RMS of ``a - b`` over the rest, over
  the RMS of ``b``."""
  a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
  with np.errstate(invalid="ignore", divide="ignore"):
    d = np.sqrt(((a - b) ** 2).mean(1))
    r = d / np.sqrt((b * b).mean(1))
  return np.where(d == 0, 0.0, np.where(np.isnan(r), np.inf, r))
