"""Named chips for :func:`jaxprec.cost`: peak FLOP/s per pass type and HBM bandwidth.

Every figure is the vendor's spec-sheet figure for one chip, dense (no 2:4
sparsity), with its source next to it. The cost model is a roofline per op
(:func:`op_seconds`); ``docs/cost.md`` repeats the table and says what the
model leaves out. A pass type is the dtype a matrix unit multiplies in
(``'float32'``: CUDA cores, no tensor cores): float32 on a TPU is six
bfloat16 passes (XLA's dot_algorithm_rewriter.cc, openxla/xla).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxprec._src.core import algorithms
from jaxprec._src.core import names


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  """One accelerator's spec-sheet figures.

  Attributes:
    name: the key in :data:`CHIPS`, e.g. ``'tpu-v5e'``.
    target: what it computes, ``'tpu'`` or ``'gpu'`` (a key of
      :data:`jaxprec._src.core.numerics.TARGETS`).
    description: the exact part, e.g. ``'NVIDIA A100 SXM4 80GB'``.
    peak: dense peak FLOP/s (OP/s for int8) per pass type.
    hbm_bytes_per_s: HBM bandwidth in bytes per second.
    source: where the figures come from (URL of the spec sheet).
  """

  name: str
  target: str
  description: str
  peak: Mapping[str, float]
  hbm_bytes_per_s: float
  source: str


_T, _G = 1e12, 1e9

CHIPS: Mapping[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: "Peak compute per chip 275 teraflops
    # (bf16 or int8)"; "HBM2 capacity and bandwidth 32 GiB, 1200 GBps".
    "tpu-v4": Chip(
        name="tpu-v4", target="tpu", description="Google Cloud TPU v4",
        peak={"bfloat16": 275 * _T, "int8": 275 * _T},
        hbm_bytes_per_s=1200 * _G,
        source="https://cloud.google.com/tpu/docs/v4"),
    # cloud.google.com/tpu/docs/v5e: "Peak compute per chip (bf16) 197
    # TFLOPs", "(Int8) 393 TOPs"; "HBM2 capacity and bandwidth 16 GB, 819 GBps".
    "tpu-v5e": Chip(
        name="tpu-v5e", target="tpu", description="Google Cloud TPU v5e",
        peak={"bfloat16": 197 * _T, "int8": 393 * _T},
        hbm_bytes_per_s=819 * _G,
        source="https://cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: "Peak compute per chip (bf16) 459
    # TFLOPs"; "HBM2e capacity and bandwidth 95GB, 2765 GBps".
    "tpu-v5p": Chip(
        name="tpu-v5p", target="tpu", description="Google Cloud TPU v5p",
        peak={"bfloat16": 459 * _T},
        hbm_bytes_per_s=2765 * _G,
        source="https://cloud.google.com/tpu/docs/v5p"),
    # docs.cloud.google.com/tpu/docs/v6e (Trillium): "Peak compute per chip
    # (bf16) 918 TFLOPs", "Peak compute per chip (Int8) 1836 TOPs", "HBM
    # bandwidth per chip 1638 GBps".
    "tpu-v6e": Chip(
        name="tpu-v6e", target="tpu", description="Google Cloud TPU v6e (Trillium)",
        peak={"bfloat16": 918 * _T, "int8": 1836 * _T},
        hbm_bytes_per_s=1638 * _G,
        source="https://docs.cloud.google.com/tpu/docs/v6e"),
    # docs.cloud.google.com/tpu/docs/tpu7x (Ironwood): "Peak compute per chip
    # (BF16) (TFLOPs) 2307", "Peak compute per chip (FP8) (TFLOPs) 4614",
    # "HBM bandwidth per chip (GBps) 7380".
    "tpu7x": Chip(
        name="tpu7x", target="tpu", description="Google Cloud TPU7x (Ironwood)",
        peak={"bfloat16": 2307 * _T, "float8": 4614 * _T},
        hbm_bytes_per_s=7380 * _G,
        source="https://docs.cloud.google.com/tpu/docs/tpu7x"),
    # NVIDIA A100 datasheet: FP32 19.5 TFLOPS; Tensor Float 32 156 TFLOPS;
    # BFLOAT16 and FP16 Tensor Core 312 TFLOPS; INT8 624 TOPS (dense; the
    # sheet's starred figures are with sparsity, twice these); GPU memory
    # bandwidth 2,039 GB/s (A100 80GB SXM; the 40GB part has 1,555 GB/s).
    "a100": Chip(
        name="a100", target="gpu", description="NVIDIA A100 SXM4 80GB",
        peak={"float32": 19.5 * _T, "tensorfloat32": 156 * _T,
              "bfloat16": 312 * _T, "float16": 312 * _T, "int8": 624 * _T},
        hbm_bytes_per_s=2039 * _G,
        source=("https://www.nvidia.com/content/dam/en-zz/Solutions/"
                "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-"
                "1758950-r4-web.pdf")),
    # NVIDIA H100 datasheet, H100 SXM: FP32 67 TFLOPS; TF32 Tensor Core 989
    # TFLOPS, BFLOAT16 and FP16 Tensor Core 1,979 TFLOPS, INT8 3,958 TOPS,
    # all "with sparsity" (dense is half: 494.5, 989.5, 1,979); GPU memory
    # bandwidth 3.35 TB/s.
    "h100": Chip(
        name="h100", target="gpu", description="NVIDIA H100 SXM5 80GB",
        peak={"float32": 67 * _T, "tensorfloat32": 494.5 * _T,
              "bfloat16": 989.5 * _T, "float16": 989.5 * _T,
              "int8": 1979 * _T},
        hbm_bytes_per_s=3350 * _G,
        source="https://www.nvidia.com/en-us/data-center/h100/"),
    # NVIDIA HGX B200, "Individual Blackwell GPU Specifications": FP8/FP6
    # Tensor Core 9 PFLOPS, INT8 9 POPS, FP16/BF16 4.5 PFLOPS, TF32 2.2 PFLOPS,
    # all with sparsity (dense is half: 4,500, 4,500, 2,250, 1,100 TFLOPS);
    # FP32 75 TFLOPS; GPU memory bandwidth 7.7 TB/s (180 GB HBM3E).
    "b200": Chip(
        name="b200", target="gpu", description="NVIDIA B200 (HGX B200)",
        peak={"float32": 75 * _T, "tensorfloat32": 1100 * _T,
              "bfloat16": 2250 * _T, "float16": 2250 * _T,
              "int8": 4500 * _T, "float8": 4500 * _T},
        hbm_bytes_per_s=7700 * _G,
        source="https://www.nvidia.com/en-us/data-center/hgx/"),
}
"""Chips for ``jaxprec.cost(..., chip=...)``: ``'tpu-v4'``, ``'tpu-v5e'``,
``'tpu-v5p'``, ``'tpu-v6e'``, ``'tpu7x'``, ``'a100'``, ``'h100'``, ``'b200'``, each a
``Chip`` with ``target``, ``description``, ``peak`` (dense FLOP/s per pass
type: ``'bfloat16'``, ``'float16'``, ``'tensorfloat32'``, ``'float32'``,
``'int8'``, ``'float8'``),
``hbm_bytes_per_s`` and ``source`` (the spec sheet). ``docs/cost.md`` has
the table."""


def check_chip(chip: object) -> Chip:
  """The :class:`Chip` named ``chip`` (case-insensitive, ``_`` read as ``-``).

  Raises:
    ValueError: an unknown name; the message lists the choices and the
      closest one.

  Examples:
    >>> from jaxprec._src.inspect.chips import check_chip
    >>> check_chip("TPU-v5e").hbm_bytes_per_s
    819000000000.0
    >>> check_chip("tpu_v5p").name
    'tpu-v5p'
    >>> check_chip("tpu-v5ee")
    Traceback (most recent call last):
    ...
    ValueError: Unknown chip 'tpu-v5ee'; valid choices: 'tpu-v4', 'tpu-v5e', 'tpu-v5p', 'tpu-v6e', 'tpu7x', 'a100', 'h100', 'b200'. Did you mean 'tpu-v5e'?
  """
  name = chip.strip().lower().replace("_", "-") if isinstance(chip, str) else None
  if name in CHIPS:
    return CHIPS[name]
  raise names.unknown("chip", chip, CHIPS)


def op_seconds(chip: Chip, algorithm: str, flops: float, nbytes: float
               ) -> float | None:
  """The roofline time of one op: ``max(passes * flops / peak, nbytes /
  bandwidth)``; None when ``chip`` has no peak for the algorithm's pass type
  (float16 on a TPU, TF32 on a TPU, ...).

  Examples:
    >>> from jaxprec._src.inspect.chips import CHIPS, op_seconds
    >>> v5e = CHIPS["tpu-v5e"]
    >>> op_seconds(v5e, "bf16x3", 197e12, 0)   # three bfloat16 passes
    3.0
    >>> op_seconds(v5e, "bf16x1", 0, 819e9)    # bandwidth-bound: 1 s
    1.0
    >>> op_seconds(v5e, "tf32", 1e9, 1e6) is None
    True
  """
  kind = algorithms.pass_type(algorithm, chip.target)
  if kind is None or kind[0] not in chip.peak:
    return None
  dtype, passes = kind
  return max(passes * flops / chip.peak[dtype], nbytes / chip.hbm_bytes_per_s)
