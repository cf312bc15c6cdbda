"""``jaxprec sampler``: an RL trainer's log-probs against its sampler's
(:func:`jaxprec.check_sampler`) on the built-in Llama with random weights or
on the model and tokens ``MODULE:FUNCTION`` returns."""

from __future__ import annotations

import argparse
import functools

from jaxprec._src.cli import cli_inputs as inputs
from jaxprec._src.cli.cli_inputs import Failure, UsageError


# What --out receives.
OUT_FILES = ("report.json", "sampler.png")


def add(sub: argparse._SubParsersAction, write_outputs, print_report) -> None:
  """The ``sampler`` command's parser; ``write_outputs(report, out,
  png_name)`` writes ``--out``, ``print_report(report)`` prints the text."""
  p = sub.add_parser(
      "sampler", help="an RL trainer's log-probs against its sampler's",
      description="Computes one token sequence's log-probs as an RL trainer "
                  "does (teacher forcing) and as its sampler does (decode "
                  "with a KV cache), each side with its own numerics "
                  "emulated on this machine, and prints the gap RL "
                  "frameworks log, its split by factor (LM head, body, "
                  "attention, decode, batch) and where the two first part "
                  "(jaxprec.check_sampler). A side is PRECISION@TARGET or "
                  "POLICY@TARGET, with :CHIP after a gpu target, or "
                  "pytorch. The model is --model llama (the default) or "
                  "MODULE:FUNCTION, where " + FORM + ".",
      epilog="examples: jaxprec sampler --model llama --trainer float32@cpu "
             "--sampler 'default=dtype:bfloat16@gpu:h100' --sampler-head "
             "'default=float32+dtype:float32'; jaxprec sampler "
             "mymodel.py:make --sampler pytorch")
  p.add_argument("function", nargs="?", metavar="MODULE:FUNCTION",
                 help="your model: e.g. mymodel.py:make")
  p.add_argument("--model", choices=("llama",), default=None,
                 help="the built-in Llama (random weights; the default)")
  p.add_argument("--size", choices=("tiny", "small"), default=None,
                 help="the built-in Llama's size (default tiny)")
  p.add_argument("--seed", type=int, default=0,
                 help="seeds the weights, the sequence and the batch")
  p.add_argument("--length", type=int, default=None,
                 help="tokens in the built-in Llama's sequence (default 12)")
  p.add_argument("--prompt", type=int, default=1,
                 help="tokens the sampler prefills in one chunk")
  p.add_argument("--trainer", default="float32@cpu",
                 help="the trainer's numerics (default float32@cpu)")
  p.add_argument("--sampler", default="float32@cpu",
                 help="the sampler's numerics, e.g. "
                      "'default=dtype:bfloat16@gpu:h100', or pytorch: the "
                      "PyTorch model FUNCTION returns third")
  p.add_argument("--trainer-head", help="the trainer's LM head, if other")
  p.add_argument("--sampler-head", help="the sampler's LM head, if other")
  p.add_argument("--trainer-attention",
                 help="the trainer's attention matmuls (scores and values, "
                      "not the projections), if other")
  p.add_argument("--sampler-attention",
                 help="the sampler's attention matmuls, if other, e.g. "
                      "bfloat16")
  p.add_argument("--batch", default="",
                 help="lengths of other sequences decoded alongside, e.g. "
                      "5,14")
  p.add_argument("--logprobs", choices=("raw", "processed"), default="raw")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--fail-above", type=float, metavar="NATS",
                 help="exit 1 when the RMS gap exceeds NATS")
  p.add_argument("--no-cache", action="store_true",
                 help="do not use JAX's persistent compilation cache")
  p.add_argument("--out", metavar="DIR",
                 help="also write report.json and sampler.png (the gap "
                      "along the sequence, the attribution) to DIR")
  out = p.add_mutually_exclusive_group()
  out.add_argument("--json", action="store_true", help="print JSON")
  out.add_argument("--markdown", action="store_true", help="print markdown")
  p.set_defaults(handler=functools.partial(run, write_outputs=write_outputs,
                                           print_report=print_report))


# What MODULE:FUNCTION's FUNCTION() returns.
FORM = ("FUNCTION() must return (model, tokens) or (model, tokens, "
        "pytorch_model): model a causal LM with decode, init_cache and head "
        "(jaxprec.models.LlamaForCausalLM), tokens one sequence of token "
        "ids, pytorch_model its transformers PyTorch LlamaForCausalLM, the "
        "sampler of --sampler pytorch")


def compute(text: str, head: str | None, attention: str | None, flag: str):
  """``PRECISION@TARGET[:CHIP]`` as a :class:`jaxprec.Compute`."""
  from jaxprec._src.checker.sampler_check import Compute  # noqa: PLC0415
  numerics, at, where = text.rpartition("@")
  if not at or not numerics:
    raise UsageError(f"{flag} {text!r}: write PRECISION@TARGET or "
                     f"POLICY@TARGET, e.g. float32@cpu, default@tpu, "
                     f"'default=dtype:bfloat16@gpu:h100'")
  target, _, chip = where.partition(":")
  try:
    return Compute(precision=numerics, target=target, chip=chip or None,
                   head=head, attention=attention)
  except ValueError as e:
    raise UsageError(f"{flag}: {inputs.one_line(e)}") from None


def model_and_tokens(ns: argparse.Namespace):
  """``(model, tokens, pytorch_model or None)`` from MODULE:FUNCTION or the
  built-in Llama."""
  if ns.function is None:
    from jaxprec._src.models.encoders import synthetic_tokens  # noqa
    from jaxprec._src.models.llama import LlamaConfig, LlamaForCausalLM  # noqa
    from flax import nnx  # noqa: PLC0415
    length = 12 if ns.length is None else ns.length
    if length < 2:
      raise UsageError(f"--length {length}: at least 2 tokens")
    config = LlamaConfig.of_size(ns.size or "tiny")
    ns.status.say(f"building the {ns.size or 'tiny'} Llama")
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(ns.seed))
    return model, synthetic_tokens(1, length, vocab_size=config.vocab_size,
                                   seed=ns.seed)[0], None
  for flag, value in (("--model", ns.model), ("--size", ns.size),
                      ("--length", ns.length)):
    if value is not None:
      raise UsageError(f"sampler takes one model: {flag} applies to the "
                       f"built-in Llama, not to {ns.function}, whose "
                       f"FUNCTION returns the tokens")
  ns.status.say(f"importing {ns.function}")
  made = inputs.call(ns.function)
  if not (isinstance(made, tuple) and len(made) in (2, 3) and all(
      callable(getattr(made[0], m, None))
      for m in ("decode", "init_cache", "head"))):
    raise UsageError(f"{ns.function}() returned {inputs.kinds(made)}; "
                     f"{FORM}")
  if ns.sampler == "pytorch" and len(made) == 2:
    raise UsageError(f"--sampler pytorch: {ns.function}() returned 2 "
                     f"items, no PyTorch model; {FORM}")
  return made[0], made[1], made[2] if len(made) == 3 else None


def run(ns: argparse.Namespace, write_outputs, print_report) -> int:
  trainer = compute(ns.trainer, ns.trainer_head, ns.trainer_attention,
                    "--trainer")
  if ns.sampler == "pytorch" and ns.function is None:
    raise UsageError(f"--sampler pytorch checks the PyTorch model that "
                     f"MODULE:FUNCTION returns; {FORM}")
  if ns.sampler != "pytorch":
    sampler = compute(ns.sampler, ns.sampler_head, ns.sampler_attention,
                      "--sampler")
  else:
    for flag, value in (("--sampler-head", ns.sampler_head),
                        ("--sampler-attention", ns.sampler_attention)):
      if value is not None:
        raise UsageError(f"{flag}: a PyTorch sampler computes it as its "
                         f"model does")
  try:
    batch = tuple(int(n) for n in ns.batch.split(",") if n.strip())
  except ValueError:
    raise UsageError(f"--batch {ns.batch!r}: comma-separated lengths, e.g. "
                     f"5,14") from None
  from jaxprec._src.checker import sampler as figures  # noqa: PLC0415
  from jaxprec._src.checker.sampler_check import check_sampler  # noqa
  try:
    sampling = figures.Sampling(logprobs=ns.logprobs,
                                temperature=ns.temperature, top_k=ns.top_k,
                                top_p=ns.top_p)
  except ValueError as e:
    raise UsageError(inputs.one_line(e)) from None
  if ns.model is not None and ns.function is not None:
    raise UsageError(f"sampler takes one model: --model {ns.model} or "
                     f"{ns.function}, not both")
  if ns.out is not None:
    inputs.check_out(ns.out, OUT_FILES)
  model, tokens, pt_model = model_and_tokens(ns)
  if ns.sampler == "pytorch":
    sampler = pt_model
  ns.cache_on()
  ns.status.clear()  # the check's own progress follows
  try:
    report = check_sampler(model, tokens, trainer=trainer, sampler=sampler,
                           sampling=sampling, prompt=ns.prompt, batch=batch,
                           seed=ns.seed, progress=True)
  except (TypeError, ValueError) as e:
    raise UsageError(inputs.one_line(e)) from None
  if ns.json or ns.markdown:
    print(report.to_json() if ns.json else report.to_markdown())
  else:
    print_report(report)
  if ns.out is not None:
    write_outputs(report, ns.out, OUT_FILES[1])
  if ns.fail_above is not None and report.total > ns.fail_above:
    raise Failure(f"the RMS gap {report.total:.4g} nats exceeds "
                  f"--fail-above {ns.fail_above:g}")
  return 0
