"""jaxprec.cost with bytes and named chips: bytes moved at each op's
dtypes, the roofline time on a chip's spec-sheet figures, and ratios to the
all-float32 program."""

import json
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxprec
from jaxprec._src.core import numerics
from jaxprec._src.inspect import chips as chips_lib

F32, BF16 = jnp.float32, jnp.bfloat16
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "cost.md"


def sds(*shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def matmul(a, b):
  return a @ b


# -- the table ------------------------------------------------------------------


def _docs_table() -> dict[str, list[str]]:
  """The chip table of docs/cost.md: chip name -> its cells."""
  rows = {}
  for line in DOCS.read_text(encoding="utf-8").splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) > 1 and cells[0].strip("`") in chips_lib.CHIPS:
      rows[cells[0].strip("`")] = cells
  return rows


def _number(cell: str) -> float | None:
  m = re.match(r"^([\d.,]+)", cell)
  return None if m is None or cell.startswith("-") else float(
      m.group(1).replace(",", ""))


def test_every_chip_has_its_figures_and_a_source():
  assert tuple(chips_lib.CHIPS) == ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e",
                                    "tpu7x", "a100", "h100", "b200")
  for name, chip in chips_lib.CHIPS.items():
    assert chip.name == name and chip.target in numerics.TARGETS
    assert chip.peak["bfloat16"] > 0 and chip.hbm_bytes_per_s > 0
    assert chip.source.startswith("https://")
    assert set(chip.peak) <= {"bfloat16", "float16", "tensorfloat32",
                              "float32", "int8", "float8"}
  for name in ("a100", "h100", "b200"):  # float32 cores, TF32 tensor cores
    peak = chips_lib.CHIPS[name].peak
    # Half the 16-bit rate (the sheets round: the H100's 989 and 1,979
    # TFLOPS, the B200's 2.2 and 4.5 PFLOPS).
    assert peak["tensorfloat32"] == pytest.approx(peak["bfloat16"] / 2, rel=0.03)
    assert peak["float32"] < peak["tensorfloat32"]


def test_docs_table_repeats_the_figures_and_sources():
  table = _docs_table()
  assert set(table) == set(chips_lib.CHIPS)
  for name, chip in chips_lib.CHIPS.items():
    _, _, bf16, f16, tf32, f32, int8, f8, hbm, source = table[name]
    for cell, key in ((bf16, "bfloat16"), (f16, "float16"),
                      (tf32, "tensorfloat32"), (f32, "float32"),
                      (int8, "int8"), (f8, "float8")):
      want = chip.peak.get(key)
      assert _number(cell) == (None if want is None else want / 1e12), (
          name, key, cell)
    assert _number(hbm) == chip.hbm_bytes_per_s / 1e9
    assert chip.source in source


@pytest.mark.parametrize("bad, close", [("tpu-v5ee", "tpu-v5e"),
                                        ("h10", "h100"), ("A1000", "a100")])
def test_unknown_chip_names_choices_and_the_closest(bad, close):
  with pytest.raises(ValueError) as e:
    jaxprec.cost(matmul, sds(8, 16), sds(16, 4), chip=bad)
  assert str(e.value) == (
      f"Unknown chip {bad!r}; valid choices: 'tpu-v4', 'tpu-v5e', 'tpu-v5p', "
      f"'tpu-v6e', 'tpu7x', 'a100', 'h100', 'b200'. Did you mean {close!r}?")


def test_chip_spellings_and_a_chip_of_another_target():
  assert jaxprec.cost(matmul, sds(8, 16), sds(16, 4), chip="TPU_v5e").chip == (
      "tpu-v5e")
  r = jaxprec.cost(matmul, sds(8, 16), sds(16, 4), chip="a100")
  assert (r.target, r.chip) == ("gpu", "a100")
  with pytest.raises(ValueError, match="chip 'h100' is a GPU but target='tpu'"):
    jaxprec.cost(matmul, sds(8, 16), sds(16, 4), chip="h100", target="tpu")
  with pytest.raises(ValueError, match="Unknown chip 3"):
    jaxprec.cost(matmul, sds(8, 16), sds(16, 4), chip=3)


# -- bytes ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, size", [(F32, 4), (BF16, 2), (jnp.float16, 2)])
def test_bytes_are_operands_and_result_at_their_dtypes(dtype, size):
  r = jaxprec.cost(matmul, sds(8, 16, dtype=dtype), sds(16, 4, dtype=dtype))
  elements = 8 * 16 + 16 * 4 + 8 * 4
  assert (r.bytes, r.float32_bytes) == (size * elements, 4 * elements)
  assert r.bytes_relative == size / 4
  assert r.rows[0].bytes == r.bytes and r.seconds is None
  assert r.time_relative is None and r.rows[0].time_relative is None


def test_bytes_count_compute_dtypes_and_trip_counts():
  def f(x, w):  # float32 stored, cast to bfloat16: bytes at bfloat16
    def body(c, _):
      return jnp.tanh(c @ w.astype(BF16)), None
    return lax.scan(body, x.astype(BF16), None, length=5)[0]
  r = jaxprec.cost(f, sds(8, 16), sds(16, 16))
  elements = 8 * 16 + 16 * 16 + 8 * 16
  assert (r.bytes, r.float32_bytes) == (5 * 2 * elements, 5 * 4 * elements)
  # int32 accumulation of int8 operands: integers keep their size.
  g = lambda a, b: lax.dot(a, b, preferred_element_type=jnp.int32)
  r = jaxprec.cost(g, sds(8, 16, dtype=jnp.int8), sds(16, 4, dtype=jnp.int8))
  assert r.bytes == r.float32_bytes == 8 * 16 + 16 * 4 + 4 * 8 * 4


# -- time: the roofline ---------------------------------------------------------


def test_compute_bound_time_is_passes_over_peak():
  n = 4096
  x, w = sds(n, n), sds(n, n)
  flops = 2 * n ** 3
  peak, hbm = 197e12, 819e9  # tpu-v5e
  assert 3 * n * n * 4 / hbm < flops / peak  # compute-bound even at float32
  for policy, passes in (("bfloat16", 1), ("bfloat16_3x", 3), ("float32", 6)):
    r = jaxprec.cost(matmul, x, w, policy=policy, chip="tpu-v5e")
    assert r.seconds == pytest.approx(passes * flops / peak, rel=1e-12)
    assert r.float32_seconds == pytest.approx(6 * flops / peak, rel=1e-12)
    assert r.time_relative == pytest.approx(passes / 6)
  # A GPU: TF32 tensor cores against float32 CUDA cores.
  for chip, tf32, bf16, f32 in (("a100", 156e12, 312e12, 19.5e12),
                                ("h100", 494.5e12, 989.5e12, 67e12)):
    r = jaxprec.cost(matmul, x, w, policy="tf32", chip=chip)
    assert r.seconds == pytest.approx(flops / tf32, rel=1e-12)
    assert r.time_relative == pytest.approx(f32 / tf32)
    r = jaxprec.cost(matmul, sds(n, n, dtype=BF16), sds(n, n, dtype=BF16),
                     chip=chip)
    assert r.time_relative == pytest.approx(f32 / bf16)


def test_bandwidth_bound_time_is_bytes_over_bandwidth():
  x, w = sds(1, 4096, dtype=BF16), sds(4096, 4096, dtype=BF16)
  r = jaxprec.cost(matmul, x, w, chip="tpu-v5p")
  nbytes = 2 * (4096 + 4096 * 4096 + 4096)
  assert r.bytes == nbytes
  assert r.seconds == pytest.approx(nbytes / 2765e9, rel=1e-12)
  assert r.float32_seconds == pytest.approx(2 * nbytes / 2765e9, rel=1e-12)
  assert r.time_relative == pytest.approx(0.5)


class MLP(nn.Module):
  dtype: object = F32

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(512, dtype=self.dtype, name="dense_0")(x))
    x = nn.relu(nn.Dense(512, dtype=self.dtype, name="dense_1")(x))
    return nn.Dense(16, dtype=self.dtype, name="dense_2")(x)


def _mlp_cost(dtype, batch, **kw):
  model = MLP(dtype=dtype)
  x = sds(batch, 512)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  return jaxprec.cost(model.apply, params, x, **kw)


@pytest.mark.parametrize("chip", list(chips_lib.CHIPS))
def test_a_bfloat16_model_costs_less_than_its_float32_twin(chip):
  f32 = _mlp_cost(F32, 1, chip=chip)
  bf16 = _mlp_cost(BF16, 1, chip=chip)
  assert f32.bytes_relative == 1.0 and f32.time_relative == 1.0
  # Batch 1 is bandwidth-bound: half the bytes, half the time.
  assert bf16.bytes < f32.bytes and bf16.seconds < f32.seconds
  assert bf16.bytes_relative == pytest.approx(0.5, abs=0.01)
  assert bf16.time_relative == pytest.approx(0.5, abs=0.01)
  assert bf16.float32_seconds == f32.float32_seconds
  for row in bf16.rows:
    assert row.bytes * 2 == row.float32_bytes
    assert row.seconds < f32.row(row.path).seconds


def test_untimed_ops_are_left_out_of_both_times():
  # One float16 pass (a preset) has no peak on a TPU, nor a weight.
  def f(x, w1, w2):
    return jnp.dot(jnp.tanh(x @ w1), w2, precision="F16_F16_F32")
  x, w1, w2 = sds(8, 16), sds(16, 32), sds(32, 4)
  r = jaxprec.cost(f, x, w1, w2, policy="bfloat16", chip="tpu-v4")
  assert r.untimed_flops == 2 * 8 * 32 * 4 and r.unknown_flops == r.untimed_flops
  first = 4 * (8 * 16 + 16 * 32 + 8 * 32)
  assert r.seconds == pytest.approx(first / 1200e9, rel=1e-12)
  assert "not timed: 2.05k FLOPs whose pass type tpu-v4 has no peak for" in str(r)
  # The same on an A100, whose tensor cores run float16.
  r = jaxprec.cost(f, x, w1, w2, policy="tf32", chip="a100")
  assert r.untimed_flops == 0 and r.seconds > 0


def test_every_op_untimed_is_no_figure_not_the_cost_of_float32():
  """A float16 matmul on tpu-v5e: no peak and no weight for its pass type, so
  both times and both costs are 0. The ratio was 0/0 shown as 1.0, "the same
  cost as float32"; it is None, shown as "-"."""
  f = lambda x, w: jnp.dot(x, w, precision="F16_F16_F32")  # noqa: E731
  r = jaxprec.cost(f, sds(8, 16), sds(16, 4), chip="tpu-v5e")
  assert r.flops == r.untimed_flops == r.unknown_flops == 2 * 8 * 16 * 4
  assert r.seconds == r.float32_seconds == 0 and r.cost == r.float32_cost == 0
  assert r.time_relative is None and r.relative is None
  assert all(row.relative is None and row.time_relative is None
             for row in r.rows)
  d = json.loads(r.to_json())
  assert d["relative"] is None and d["time_relative"] is None
  text = str(r)
  assert "= - of float32" in text and "= - of all-float32" in text
  assert "= 1.000 of float32" not in text
  # No op at all stays "the same cost as float32".
  none = jaxprec.cost(lambda x: jnp.tanh(x), sds(8, 16), chip="tpu-v5e")
  assert none.flops == 0 and none.relative == 1.0 and none.time_relative == 1.0


def test_str_and_to_dict_with_and_without_a_chip():
  r = _mlp_cost(BF16, 1, chip="tpu-v5e")
  lines = str(r).splitlines()
  assert lines[0].startswith("jaxprec cost of Module.apply on tpu")
  assert lines[1].startswith("bytes moved: ") and " of all-float32 (" in lines[1]
  assert lines[2].startswith("time on tpu-v5e (Google Cloud TPU v5e), roofline ")
  assert lines[3].split() == ["module", "path", "ops", "FLOPs", "runs", "as",
                              "cost", "vs", "float32", "bytes", "bytes/f32",
                              "time", "time/f32"]
  d = json.loads(r.to_json())
  assert d["chip"] == "tpu-v5e" and d["bytes"] == r.bytes
  assert d["time_relative"] == pytest.approx(r.time_relative)
  assert d["rows"][0]["seconds"] == pytest.approx(r.rows[0].seconds)
  r = _mlp_cost(BF16, 1)
  text = str(r)
  assert "time on" not in text and "time/f32" not in text
  assert json.loads(r.to_json())["seconds"] is None


def test_op_seconds_is_the_roofline():
  v4 = chips_lib.CHIPS["tpu-v4"]
  assert chips_lib.op_seconds(v4, "bf16x6", 275e12, 0) == 6.0
  assert chips_lib.op_seconds(v4, "native float32", 275e12, 0) == 6.0
  assert chips_lib.op_seconds(v4, "bf16x1", 275e12, 2400e9) == 2.0
  assert chips_lib.op_seconds(v4, "native int8", 275e12, 0) == 1.0
  assert chips_lib.op_seconds(v4, "f16", 1, 1) is None
  a100 = chips_lib.CHIPS["a100"]
  assert chips_lib.op_seconds(a100, "native float32", 19.5e12, 0) == 1.0
  assert chips_lib.op_seconds(a100, "tf32x3", 156e12, 0) == 3.0
  assert chips_lib.op_seconds(a100, "unknown", 1, 1) is None


# -- dtype policies ---------------------------------------------------------------


def test_a_dtype_policy_moves_bfloat16_bytes_for_the_matched_layer():
  f32 = _mlp_cost(F32, 1, chip="tpu-v5e")
  r = _mlp_cost(F32, 1, chip="tpu-v5e", policy="dense_1=dtype:bfloat16")
  assert r.row("dense_1").algorithms == ("native bfloat16",)
  assert r.row("dense_1").bytes_relative == 0.5
  assert r.row("dense_1").time_relative == pytest.approx(0.5)
  for path in ("dense_0", "dense_2"):  # not matched: float32 as before
    assert r.row(path).bytes == f32.row(path).bytes
    assert r.row(path).bytes_relative == 1.0
  assert r.bytes == f32.bytes - f32.row("dense_1").bytes // 2
  # The undo switch on a bfloat16 model: every layer back to float32 bytes.
  undo = _mlp_cost(BF16, 1, chip="tpu-v5e",
                   policy=jaxprec.Policy(default_dtype="float32"))
  assert undo.bytes == f32.bytes and undo.bytes_relative == 1.0


def test_hugging_face_bert_in_bfloat16_moves_fewer_bytes_than_float32():
  import models  # noqa: PLC0415 -- tests/models.py, skips without transformers
  costs = {}
  for dtype in (F32, BF16):
    model, params, ids = models.tiny_bert(dtype=dtype)
    costs[dtype] = jaxprec.cost(
        lambda p, i, m=model: m(i, params=p).last_hidden_state, params, ids,
        chip="tpu-v5e")
  f32, bf16 = costs[F32], costs[BF16]
  assert f32.flops == bf16.flops and f32.bytes == f32.float32_bytes
  assert bf16.float32_bytes == f32.float32_bytes
  # Every operand and result is bfloat16 but the int32 head mask of the
  # attention einsums: just over half the bytes; tiny shapes: bandwidth-bound.
  assert 0.5 < bf16.bytes_relative < 0.52
  assert bf16.seconds < f32.seconds
  assert bf16.time_relative == pytest.approx(bf16.bytes_relative, rel=0.05)
