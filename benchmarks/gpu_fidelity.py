"""How closely jaxprec's GPU emulation matches a real NVIDIA GPU, per algorithm.

For every precision level and ``DotAlgorithmPreset`` that the GPU accepts, runs
the native dot (and, for levels, the native convolution) on the GPU and
``jaxprec.emulated_dot_general`` / ``emulated_conv_general_dilated`` with
``target="gpu"`` on the CPU, on each emulation kernel (``bf16``, ``f32``),
on the same float32 inputs, and reports per algorithm:

* the bit-equality rate of the results;
* ULP differences (median, 99th percentile, max);
* the largest difference between emulated and native results relative to
  ``max|exact result|`` (float64), next to XLA's own GPU test tolerance for
  that algorithm (relative: BF16_BF16_F32 6e-5, X3 7e-6, X6 and X9 2e-6, TF32
  1e-3, TF32_X3 3e-6), and whether it stays within it;
* for context, the native and the emulated errors against the exact result.

Shapes: a contraction of length 1 (one product per element: where the
emulation should be bit-exact), and a few matmuls and convolutions of longer
contractions. Runs in a few minutes on one GPU; the shapes are small.

    python benchmarks/gpu_fidelity.py [--markdown docs/fidelity.md]
    python benchmarks/gpu_fidelity.py --quick   # dry run: builds every case and
                                                # runs the CPU side only; no GPU

A second table compares the real GPU with the two GPU models side by side
(``docs/gpu.md``): for each dot case that runs on tensor cores, float8
operands under ``ANY_F8_ANY_F8_F32_FAST_ACCUM`` and ``ANY_F8_ANY_F8_F32``, and
batched vector·vector dots and matrix·vector dots below and above XLA:GPU's
strength-reduction bound (float32 below it), the ULP
distance of the GPU's result to the default model (``chip=None``) and to the
chip model of the GPU at hand (``--chip``; by default read from the device
name: A100 -> ``a100``, H100/H200 -> ``h100``, B200 -> ``b200``), so that one
run says which model is closer.

    python benchmarks/gpu_fidelity.py --chip h100

Without a GPU (and without ``--quick``) it says so and exits with status 2.
It exits with status 1 when a row is outside XLA's tolerance (``NO`` in the
table; the count is printed last), else 0, so that CI can run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import warnings

import jax
import numpy as np
from jax import lax

import jaxprec

F32 = np.float32
MATMUL = (((1,), (0,)), ((), ()))
KERNELS = ("bf16", "f32")

# What each request computes on an Ampere+ GPU (the jax.lax.Precision docs and JAX's tests/lax_test.py) and
# XLA's GPU test tolerance for it (relative; None: no XLA figure).
TOLERANCE = {
    "bf16x1": 6e-5, "bf16x3": 7e-6, "bf16x6": 2e-6, "bf16x9": 2e-6,
    "tf32": 1e-3, "tf32x3": 3e-6, "f32": 1e-6, "f16": None,
}
DOT_PRECISIONS = ("default", "high", "highest", "BF16_BF16_F32",
                  "BF16_BF16_F32_X3", "BF16_BF16_F32_X6", "BF16_BF16_F32_X9",
                  "TF32_TF32_F32", "TF32_TF32_F32_X3", "F32_F32_F32",
                  "F16_F16_F32")
CONV_PRECISIONS = ("default", "high", "highest")  # convolutions take levels only


@dataclasses.dataclass(frozen=True)
class Case:
  op: str  # 'dot' or 'conv'
  precision: str
  shape: str  # a label
  lhs: np.ndarray
  rhs: np.ndarray

  @property
  def algorithm(self) -> str:
    op = "dot_general" if self.op == "dot" else "conv_general_dilated"
    return jaxprec._src.core.numerics.algorithm_for(  # pylint: disable=protected-access
        self.precision, "gpu", F32, F32, op=op)


def _operands(rng, shape):
  # random significands and exponents: the low bits of every split matter
  return (rng.standard_normal(shape) * np.exp2(rng.integers(-4, 5, shape))).astype(F32)


def build_cases(quick: bool) -> list[Case]:
  rng = np.random.default_rng(0)
  small = quick
  dot_shapes = {"k=1 (bit-exact)": ((64, 1), (1, 64)),
                "256x512 @ 512x128": ((256, 512), (512, 128)),
                "64x4096 @ 4096x64": ((64, 4096), (4096, 64))}
  conv_shapes = {"1x1 kernel (bit-exact)": ((2, 1, 16, 16), (8, 1, 1, 1)),
                 "3x3, 32 channels": ((4, 32, 32, 32), (32, 32, 3, 3))}
  if small:
    dot_shapes = {"k=1 (bit-exact)": ((8, 1), (1, 8)),
                  "16x32 @ 32x8": ((16, 32), (32, 8))}
    conv_shapes = {"3x3, 4 channels": ((1, 4, 8, 8), (4, 4, 3, 3))}
  cases = []
  for label, (ls, rs) in dot_shapes.items():
    lhs, rhs = _operands(rng, ls), _operands(rng, rs)
    cases += [Case("dot", p, label, lhs, rhs) for p in DOT_PRECISIONS]
  for label, (ls, rs) in conv_shapes.items():
    lhs, rhs = _operands(rng, ls), _operands(rng, rs)
    cases += [Case("conv", p, label, lhs, rhs) for p in CONV_PRECISIONS]
  return cases


def _native(case: Case, device):
  lhs, rhs = (jax.device_put(x, device) for x in (case.lhs, case.rhs))
  if case.op == "dot":
    fn = jax.jit(functools.partial(lax.dot_general, dimension_numbers=MATMUL,
                                   precision=case.precision))
  else:
    fn = jax.jit(functools.partial(lax.conv_general_dilated,
                                   window_strides=(1, 1), padding="SAME",
                                   precision=case.precision))
  return np.asarray(fn(lhs, rhs))


def _emulated(case: Case, kernel: str, device):
  lhs, rhs = (jax.device_put(x, device) for x in (case.lhs, case.rhs))
  with jaxprec.use_kernel(kernel):
    if case.op == "dot":
      fn = jax.jit(functools.partial(jaxprec.emulated_dot_general,
                                     dimension_numbers=MATMUL,
                                     precision=case.precision, target="gpu"))
    else:
      fn = jax.jit(functools.partial(jaxprec.emulated_conv_general_dilated,
                                     window_strides=(1, 1), padding="SAME",
                                     precision=case.precision, target="gpu"))
    return np.asarray(fn(lhs, rhs))


def _exact(case: Case) -> np.ndarray:
  l, r = case.lhs.astype(np.float64), case.rhs.astype(np.float64)
  if case.op == "dot":
    return l @ r
  # NCHW x OIHW, stride 1, SAME padding (odd kernels), in float64.
  kh, kw = r.shape[2:]
  ph, pw = kh // 2, kw // 2
  padded = np.pad(l, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
  h, w = l.shape[2:]
  out = np.zeros((l.shape[0], r.shape[0], h, w))
  for i in range(kh):
    for j in range(kw):
      out += np.einsum("nchw,oc->nohw", padded[:, :, i:i + h, j:j + w], r[:, :, i, j])
  return out


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """ULP distance between float32 arrays (ordered bit patterns)."""
  def ordered(x):
    i = np.asarray(x, F32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)
  return np.abs(ordered(a) - ordered(b))


def stats(got: np.ndarray, want: np.ndarray, exact: np.ndarray) -> dict:
  u = ulps(got, want)
  scale = max(float(np.abs(exact).max()), np.finfo(F32).tiny)
  return {"equal": float(np.mean(got.view(np.int32) == want.view(np.int32))),
          "ulp_median": float(np.median(u)), "ulp_p99": float(np.percentile(u, 99)),
          "ulp_max": int(u.max()),
          "rel_err": float(np.abs(got.astype(np.float64) - exact).max() / scale),
          "rel_diff": float(np.abs(got.astype(np.float64) - want).max() / scale)}


CHIPS = ("a100", "h100", "b200")
# The chip model of a GPU, by a word of its device name (jax's device_kind).
_CHIP_OF = {"A100": "a100", "H100": "h100", "H200": "h100", "H800": "h100",
            "B200": "b200", "B100": "b200", "GB200": "b200"}
# The algorithms a chip model computes (tensor-core passes).
CHIP_ALGORITHMS = ("tf32", "tf32x3", "bf16x1", "bf16x3", "bf16x6", "bf16x9",
                   "f16")
FP8_PRESETS = ("ANY_F8_ANY_F8_F32_FAST_ACCUM", "ANY_F8_ANY_F8_F32")


def chip_of(kind: str) -> str | None:
  """The chip model of a device name, None where jaxprec has none."""
  for word, chip in _CHIP_OF.items():
    if word in kind.upper().replace("-", " ").split():
      return chip
  return None


@dataclasses.dataclass(frozen=True)
class ChipCase:
  """One dot of the chip table: float32 or float8 operands, any dims."""
  precision: str
  shape: str
  lhs: np.ndarray
  rhs: np.ndarray
  dims: tuple = MATMUL


def build_chip_cases(cases: list[Case], quick: bool) -> list[ChipCase]:
  out = [ChipCase(c.precision, c.shape, c.lhs, c.rhs) for c in cases
         if c.op == "dot" and c.algorithm in CHIP_ALGORITHMS and not (
             quick and (c.precision not in ("default", "BF16_BF16_F32_X3")
                        or "bit-exact" in c.shape))]
  rng = np.random.default_rng(1)
  e4m3 = getattr(jax.numpy, "float8_e4m3fn")
  k = 256 if quick else 4096
  l8 = np.asarray(rng.standard_normal((16, k)), F32).astype(e4m3)
  r8 = np.asarray(rng.standard_normal((k, 16)), F32).astype(e4m3)
  out += [ChipCase(p, f"16x{k} @ {k}x16 e4m3", l8, r8) for p in FP8_PRESETS]
  v = _operands(rng, (64, 96))
  out.append(ChipCase("default", "64 vector·vector (strength-reduced)", v,
                      _operands(rng, (64, 96)), (((1,), (1,)), ((0,), (0,)))))
  # Matrix·vector: strength-reduced below XLA:GPU's size bound ((m + n) * k <
  # 1e7, float32), on tensor cores above it (numerics.strength_reduced).
  matvec = (((1,), (0,)), ((), ()))
  sizes = [(64, 96)] + ([] if quick else [(4096, 4096)])
  for m, k in sizes:
    side = "below" if (m + 1) * k < 10_000_000 else "above"
    out.append(ChipCase("default", f"{m}x{k} matrix·vector ({side} the bound)",
                        _operands(rng, (m, k)), _operands(rng, (k,)), matvec))
  return out


def _chip_dot(case: ChipCase, device, chip: str | None, native: bool):
  lhs, rhs = (jax.device_put(x, device) for x in (case.lhs, case.rhs))
  pref = np.float32
  if native:
    fn = functools.partial(lax.dot_general, dimension_numbers=case.dims,
                           precision=case.precision,
                           preferred_element_type=pref)
  else:
    fn = functools.partial(jaxprec.emulated_dot_general,
                           dimension_numbers=case.dims,
                           precision=case.precision,
                           preferred_element_type=pref, target="gpu",
                           chip=chip)
  # The default model on the bf16 kernel: its bits (the f32 kernel merges
  # passes, within the same bound but not bit for bit).
  with warnings.catch_warnings(), jaxprec.use_kernel("bf16"):
    warnings.simplefilter("ignore")  # the default model's float8 warning
    return np.asarray(jax.jit(fn)(lhs, rhs), F32)


def chip_table(gpu, chip: str, quick: bool, cases: list[Case]) -> list[str]:
  """The chip table's lines: the GPU's result against both models."""
  cpu = jax.devices("cpu")[0]
  lines = ["", f"Chip model: {chip} (docs/gpu.md). ULP distance of the "
           f"{'GPU' if gpu else 'default model (dry run: no GPU)'} to each "
           "model: bit-equal share, median / p99 / max.", "",
           "| precision | shape | default model | chip model | closer |",
           "|---|---|---|---|---|"]
  for case in build_chip_cases(cases, quick):
    try:
      default = _chip_dot(case, cpu, None, native=False)
      model = _chip_dot(case, cpu, chip, native=False)
    except NotImplementedError as e:
      lines.append(f"| {case.precision} | {case.shape} | - | {e} | |")
      continue
    if gpu is not None:
      try:
        real = _chip_dot(case, gpu, None, native=True)
      except Exception as e:  # pylint: disable=broad-except
        lines.append(f"| {case.precision} | {case.shape} | not accepted by "
                     f"the GPU: {type(e).__name__} | | |")
        continue
    else:
      real = default
    cells = []
    for want in (default, model):
      u = ulps(real, want)
      cells.append(f"{np.mean(u == 0):.3f}, {np.median(u):g} / "
                   f"{np.percentile(u, 99):g} / {int(u.max())}")
    d, m = (float(np.mean(ulps(real, w))) for w in (default, model))
    closer = "chip" if m < d else ("default" if d < m else "same")
    lines.append(f"| {case.precision} | {case.shape} | {cells[0]} | "
                 f"{cells[1]} | {closer} |")
  return lines


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true",
                  help="dry run without a GPU: build every case, run the CPU side")
  ap.add_argument("--markdown", help="also write the table to this file")
  ap.add_argument("--chip", choices=CHIPS,
                  help="the chip model to compare with (default: from the "
                       "GPU's name; a dry run: h100)")
  args = ap.parse_args(argv)
  if args.markdown is not None and (
      os.path.isdir(args.markdown) or not os.path.isdir(
          os.path.dirname(os.path.abspath(args.markdown)))):
    ap.error(f"--markdown {args.markdown!r}: not a file in an existing "
             f"directory (checked before the run, not after it)")

  gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
  if not gpus and not args.quick:
    print("gpu_fidelity: no GPU here (JAX backend: "
          f"{jax.default_backend()}); run it on a machine with an NVIDIA GPU "
          "and jax[cuda], or pass --quick for a dry run on CPU.", file=sys.stderr)
    return 2
  cpu = jax.devices("cpu")[0]
  cases = build_cases(args.quick)
  t0 = time.perf_counter()
  rows = []
  kind = (gpus[0].device_kind if gpus
          else "none, dry run: 'native' is the bf16 kernel on the CPU")
  for case in cases:
    exact = _exact(case)
    if gpus:
      try:
        native = _native(case, gpus[0])
      except Exception as e:  # pylint: disable=broad-except
        rows.append((case, None, f"not accepted by the GPU: {type(e).__name__}"))
        continue
    else:  # dry run: the "native" column is the bf16 kernel on the CPU
      native = _emulated(case, "bf16", cpu)
    for kernel in KERNELS:
      # Dry run: the bf16 kernel's result is 'native', already computed (one
      # program, the same numbers): compiled once, not twice.
      emu = (native if not gpus and kernel == "bf16"
             else _emulated(case, kernel, cpu))
      s = stats(emu, native, exact)
      s["native_rel_err"] = stats(native, native, exact)["rel_err"]
      rows.append((case, kernel, s))

  lines = [f"jax {jax.__version__}, jaxprec {jaxprec.__version__}, GPU: {kind}, "
           f"{len(cases)} cases in {time.perf_counter() - t0:.1f} s", "",
           "| op | precision | algorithm | shape | kernel | bit-equal | ULP median / p99 / max "
           "| rel. error native | rel. error emulated | rel. difference | XLA tolerance | within |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for case, kernel, s in rows:
    if isinstance(s, str):
      lines.append(f"| {case.op} | {case.precision} | {case.algorithm} | {case.shape} "
                   f"| - | {s} | | | | | | |")
      continue
    tol = TOLERANCE.get(case.algorithm)
    nat = s["native_rel_err"]
    within = "" if tol is None else ("yes" if s["rel_diff"] <= tol else "NO")
    lines.append(
        f"| {case.op} | {case.precision} | {case.algorithm} | {case.shape} | {kernel} "
        f"| {s['equal']:.4f} | {s['ulp_median']:g} / {s['ulp_p99']:g} / {s['ulp_max']} "
        f"| {nat:.2e} | {s['rel_err']:.2e} | {s['rel_diff']:.2e} "
        f"| {'-' if tol is None else f'{tol:g}'} | {within} |")
  outside = sum(line.endswith("| NO |") for line in lines)
  lines += ["", f"{outside} of {sum(not isinstance(r[2], str) for r in rows)} rows "
            "outside XLA's tolerance" if outside else
            "every row with a tolerance is within it"]
  chip = args.chip or (chip_of(kind) if gpus else "h100")
  if chip is None:
    lines += ["", f"No chip model for {kind}: pass --chip."]
  else:
    lines += chip_table(gpus[0] if gpus else None, chip, args.quick, cases)
  text = "\n".join(lines)
  print(text)
  if args.markdown:
    with open(args.markdown, "w", encoding="utf-8") as f:
      f.write("# GPU fidelity of jaxprec's emulation\n\n"
              "Written by `benchmarks/gpu_fidelity.py`.\n\n" + text + "\n")
  return 1 if outside else 0


if __name__ == "__main__":
  sys.exit(main())
