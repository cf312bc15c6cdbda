"""``jaxprec sampler``: an RL trainer's log-probs against its sampler's
(:func:`jaxprec.check_sampler`) on the built-in Llama with random weights."""

from __future__ import annotations

import argparse

from jaxprec._src.cli import cli_inputs as inputs
from jaxprec._src.cli.cli_inputs import Failure, UsageError


def add(sub: argparse._SubParsersAction) -> None:
  """The ``sampler`` command's parser."""
  p = sub.add_parser(
      "sampler", help="an RL trainer's log-probs against its sampler's",
      description="Computes one token sequence's log-probs as an RL trainer "
                  "does (teacher forcing) and as its sampler does (decode "
                  "with a KV cache), each side with its own numerics "
                  "emulated on this machine, and prints the gap RL "
                  "frameworks log, its split by factor (LM head, body, "
                  "decode, batch) and where the two first part "
                  "(jaxprec.check_sampler). A side is PRECISION@TARGET or "
                  "POLICY@TARGET, with :CHIP after a gpu target.",
      epilog="example: jaxprec sampler --model llama --trainer float32@cpu "
             "--sampler 'default=dtype:bfloat16@gpu:h100' --sampler-head "
             "'default=float32+dtype:float32'")
  p.add_argument("--model", choices=("llama",), default="llama",
                 help="the built-in Llama (random weights)")
  p.add_argument("--size", choices=("tiny", "small"), default="tiny")
  p.add_argument("--seed", type=int, default=0,
                 help="seeds the weights, the sequence and the batch")
  p.add_argument("--length", type=int, default=12,
                 help="tokens in the sequence (default 12)")
  p.add_argument("--prompt", type=int, default=1,
                 help="tokens the sampler prefills in one chunk")
  p.add_argument("--trainer", default="float32@cpu",
                 help="the trainer's numerics (default float32@cpu)")
  p.add_argument("--sampler", default="float32@cpu",
                 help="the sampler's numerics, e.g. "
                      "'default=dtype:bfloat16@gpu:h100'")
  p.add_argument("--trainer-head", help="the trainer's LM head, if other")
  p.add_argument("--sampler-head", help="the sampler's LM head, if other")
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
  out = p.add_mutually_exclusive_group()
  out.add_argument("--json", action="store_true", help="print JSON")
  out.add_argument("--markdown", action="store_true", help="print markdown")
  p.set_defaults(handler=run)


def compute(text: str, head: str | None, flag: str):
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
                   head=head)
  except ValueError as e:
    raise UsageError(f"{flag}: {inputs.one_line(e)}") from None


def run(ns: argparse.Namespace) -> int:
  trainer = compute(ns.trainer, ns.trainer_head, "--trainer")
  sampler = compute(ns.sampler, ns.sampler_head, "--sampler")
  try:
    batch = tuple(int(n) for n in ns.batch.split(",") if n.strip())
  except ValueError:
    raise UsageError(f"--batch {ns.batch!r}: comma-separated lengths, e.g. "
                     f"5,14") from None
  from jaxprec._src.checker import sampler as figures  # noqa: PLC0415
  from jaxprec._src.checker.sampler_check import check_sampler  # noqa
  from jaxprec._src.models.encoders import synthetic_tokens  # noqa
  from jaxprec._src.models.llama import LlamaConfig, LlamaForCausalLM  # noqa
  from flax import nnx  # noqa: PLC0415
  try:
    sampling = figures.Sampling(logprobs=ns.logprobs,
                                temperature=ns.temperature, top_k=ns.top_k,
                                top_p=ns.top_p)
  except ValueError as e:
    raise UsageError(inputs.one_line(e)) from None
  if ns.length < 2:
    raise UsageError(f"--length {ns.length}: at least 2 tokens")
  config = LlamaConfig.of_size(ns.size)
  ns.status.say(f"building the {ns.size} Llama")
  model = LlamaForCausalLM(config, rngs=nnx.Rngs(ns.seed))
  tokens = synthetic_tokens(1, ns.length, vocab_size=config.vocab_size,
                            seed=ns.seed)[0]
  ns.cache_on()
  ns.status.say("running the trainer and the sampler")
  try:
    report = check_sampler(model, tokens, trainer=trainer, sampler=sampler,
                           sampling=sampling, prompt=ns.prompt, batch=batch,
                           seed=ns.seed)
  except ValueError as e:
    raise UsageError(inputs.one_line(e)) from None
  ns.status.clear()
  print(report.to_json() if ns.json else
        report.to_markdown() if ns.markdown else str(report))
  if ns.fail_above is not None and report.total > ns.fail_above:
    raise Failure(f"the RMS gap {report.total:.4g} nats exceeds "
                  f"--fail-above {ns.fail_above:g}")
  return 0
