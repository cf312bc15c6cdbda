"""Check and search outputs that fit a terminal and say which tolerance they use.

The tables of a DivergenceReport are read in terminals of 80 and 100 columns,
in pipes and in CI logs: every layer name whole, every '!' mark, the '#'
column, no ellipsis, no line wider than the terminal; a policy row labelled
P1 with its string on a legend line; a container module whose output is its
child's drawn once. The table's gate line, the exit status, first_divergence
and the search's summary state one tolerance.
"""

import fcntl
import math
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap

import jax
import jax.numpy as jnp
import pytest
from rich.cells import cell_len
from rich.console import Console

from conftest import read_terminal

import jaxprec
from jaxprec._src.checker import render as render_lib
from jaxprec._src.checker.metrics import LayerMetrics
from jaxprec._src.checker.render import fmt as jaxprec_fmt
from jaxprec._src.checker.report import DivergenceReport, LayerResult

POLICY = ("default=bfloat16,encoder/layers/0/attention/output_dense="
          "bfloat16_3x,encoder/layers/1/feed_forward=float32")
PRECISIONS = ("float32", "bfloat16", "bfloat16_3x", "tensorfloat32", POLICY)


def lm(err: float) -> LayerMetrics:
  return LayerMetrics(
      max_abs=err, max_rel=err * 10, rel_rms=err / 3, cosine=1.0,
      sqnr_db=40.0, ulp_median=3.0, ulp_max=1e6, frac_outside=0.25, nan=0,
      inf=0, required_atol=err, size=12, ref_rms=0.5, ref_max_abs=1.0)


def wide_report(n_blocks: int = 4) -> DivergenceReport:
  """A check_module-like report: long module paths, a framework floor, four
  precisions and a policy row; ``encoder`` and ``output`` have the output of
  the layer before them (a container returning its child's)."""
  layers = []
  for b in range(n_blocks):
    for part in ("attention/output_dense", "attention",
                 "feed_forward/intermediate_dense", "feed_forward"):
      k = len(layers)
      layers.append(LayerResult(
          name=f"encoder/layers/{b}/{part}", shape=(2, 49, 768),
          dtype="float32",
          metrics={p: lm(10.0 ** -(1 + j) * (1 + k / 10))
                   for j, p in enumerate(PRECISIONS)}))
  last = layers[-1]
  for name in ("encoder", "output"):
    layers.append(LayerResult(name=name, shape=last.shape, dtype="float32",
                              metrics=dict(last.metrics)))
  return DivergenceReport(
      layers=tuple(layers), precisions=PRECISIONS, reference="pytree",
      target="tpu", mode="emulate", backend="cpu", atol=1e-3, rtol=1e-3,
      floor="float32", numerics={p: "bf16x1 (emulated)" for p in PRECISIONS})


def drawn(report):
  """(index, layer) of the rows a table draws: all but the folded ones."""
  folded = {len(report.layers) - 2, len(report.layers) - 1}
  return [(i, l) for i, l in enumerate(report.layers) if i not in folded]


def failing_cells(report) -> int:
  return sum(l.metrics[p].required_atol > report.atol
             for _, l in drawn(report) for p in report.precisions)


def render(report, width, full=False) -> str:
  console = Console(width=width, force_terminal=True, color_system=None,
                    record=True, file=open(os.devnull, "w"))
  console.print(report.rich(full))
  return console.export_text()


def table_part(text: str) -> str:
  """The lines before the gate line (heading and table)."""
  return text.split("\ngate:", 1)[0]


def drawn_names(table: str) -> dict[int, str]:
  """Layer number -> its name as a table draws it (folded lines joined): a
  rich table's cells between '│', a plain table's in the columns its rule
  line of dashes spans."""
  lines = table.splitlines()
  rule = next((l for l in lines if re.fullmatch(r"-+( +-+)+", l.strip())),
              None)
  spans = ([m.span() for m in re.finditer(r"-+", rule)] if rule else None)
  out, at = {}, None
  for line in lines:
    if "│" in line:
      cells = [c.strip() for c in line.strip().strip("│").split("│")]
    elif spans and line is not rule:
      cells = [line[a:b + 1].strip() for a, b in spans]
    else:
      continue
    if len(cells) < 2:
      continue
    if cells[0].isdigit():
      at = int(cells[0])
      out[at] = cells[1]
    elif at is not None and not cells[0] and cells[1]:
      out[at] += cells[1]
  return out


def assert_fits(text: str, report, width: int | None) -> None:
  lines = text.splitlines()
  assert "…" not in text and "..." not in text
  if width is not None:
    too_long = [l for l in lines if cell_len(l.rstrip()) > width]
    assert not too_long, too_long
  table = table_part(text)
  names = drawn_names(table)
  for i, l in drawn(report):
    # whole, on the line of its number, or folded whole in its column, or on
    # a line of its own (a table drawn a layer per line)
    assert names.get(i) == l.name or any(
        l.name in line and re.search(rf"(^|[\s│]){i}[\s│]", line)
        for line in table.splitlines()), (i, l.name, names.get(i))
  # Every '!' (a failing layer at a precision), and no other.
  assert len(re.findall(r"\d !|inf !", table)) == failing_cells(report)
  # The policy string is on its legend line only, never in the table.
  assert POLICY not in table
  assert "P1" in table


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize("full", [False, True])
def test_terminal_of_80_and_100_columns(width, full):
  r = wide_report()
  text = render(r, width, full)
  assert_fits(text, r, width)
  assert "[floor]" in table_part(text)
  if full:
    assert {"max_abs", "rel_rms", "req_atol"} <= set(re.findall(
        r"[a-z_]+", table_part(text)))
  else:
    assert "max_abs" not in table_part(text)


def test_the_default_check_of_wav2vec2_is_one_table_at_100_columns():
  # The layers and precisions of `jaxprec check --model wav2vec2`.
  names = [f"conv_features[{i}]" for i in range(7)] + [
      f"hidden_states[{i}]" for i in range(13)]
  r = DivergenceReport(
      layers=tuple(LayerResult(name=n, shape=(1, 3199, 32), dtype="float32",
                               metrics={p: lm(10.0 ** -(2 + j) * (1 + k / 10))
                                        for j, p in enumerate(PRECISIONS[1:4])})
                   for k, n in enumerate(names)),
      precisions=PRECISIONS[1:4], reference="float32", target="tpu",
      mode="emulate", atol=1e-3, rtol=1e-3)
  text = render(r, 100)
  assert "…" not in text
  assert max(cell_len(l) for l in text.splitlines()) <= 100
  header = " ".join(l for l in text.splitlines() if "┃" in l)
  for p in PRECISIONS[1:4]:
    assert p in header
  assert "┃  # ┃ layer" in header
  # One table row per layer, with its number, whole name and every '!'.
  rows = [l for l in text.splitlines() if l.startswith("│")]
  assert [row.split("│")[1:3] for row in rows] == [
      [f" {k:>2} ", f" {n:<17} "] for k, n in enumerate(names)]
  marks = sum(l.metrics[p].required_atol > 1e-3 for l in r.layers
              for p in r.precisions)
  assert marks > 0 and sum(row.count(" !") for row in rows) == marks


def test_piped_output_is_never_cut():
  r = wide_report()
  for text in (str(r), r.table(full=True), r.to_text(), r.to_text(full=True)):
    assert_fits(text, r, None)
    assert f"P1: {POLICY}" in text
  # A console that is not a terminal (80 columns by default) cuts nothing.
  console = Console(file=open(os.devnull, "w"), record=True,
                    force_terminal=False, width=80)
  console.print(r)
  assert_fits(console.export_text(), r, 80)
  # Plain text fitted to a width takes the narrow layout too.
  assert_fits(r.to_text(width=80), r, 80)


@pytest.mark.parametrize("how", ["table", "to_text"])
def test_a_narrow_table_folds_its_legend_at_spaces_never_inside_a_word(how):
  """report.table(width=40) broke 'attent|ion' and 'lay|ers' in the legend
  and summary lines: a word (or a policy entry) that fits a line is whole on
  one; a longer one is split after a ',' or '/' in it."""
  r = wide_report(1)
  text = getattr(r, how)(width=40)
  lines = text.splitlines()
  assert max(map(len, lines)) <= 40, text
  words = {w for line in (*render_lib._heading(r).splitlines(),
                          *render_lib._summary_lines(r))
           for word in line.split() for w in (word, *word.split(","))}
  room = 40 - 2  # a continuation line is indented by two spaces
  for w in sorted(w for w in words if w and len(w) <= room):
    assert any(w in line for line in lines), (w, text)
  assert "  encoder/layers/1/feed_forward=float32" in lines, text
  for long in ("encoder/layers/0/attention/output_dense",):
    split = [l for l in lines if l.rstrip().endswith("encoder/layers/0/")
             or l.rstrip().endswith("attention/")]
    assert split, (long, text)  # at a '/', not inside a segment


def test_policy_rows_are_labelled_P1_P2_with_a_legend():
  r = wide_report()
  pol2 = "default=bfloat16_3x"
  r = DivergenceReport(**{**r.__dict__, "precisions": (*PRECISIONS, pol2),
                          "layers": tuple(LayerResult(
                              name=l.name, shape=l.shape, dtype=l.dtype,
                              metrics={**l.metrics, pol2: lm(1e-5)})
                              for l in r.layers)})
  text = str(r)
  header = [l for l in text.splitlines() if "┃" in l]
  assert any("P1" in l and "P2" in l for l in header)
  assert not any("default=" in l for l in header)
  assert f"P1: {POLICY}" in text and f"P2: {pol2}" in text
  assert "P2: no divergence" in text
  md = r.to_markdown()
  assert "| P1 req_atol |" in md and f"- P2: {pol2}" in md


def test_a_container_with_its_childs_output_is_one_row():
  r = wide_report(1)
  text = str(r)
  names = [l.split("│")[2].strip() for l in text.splitlines()
           if l.startswith("│")]
  assert names == [l.name for l in r.layers[:4]]
  assert ("not in the table, the same output as a layer they contain: encoder "
          "(#4 = #3), output (#5 = #3)") in text
  # The report keeps both; a container with other figures is drawn.
  assert [l.name for l in r.layers][-2:] == ["encoder", "output"]
  changed = dict(r.layers[-1].metrics, bfloat16=lm(0.5))
  r2 = DivergenceReport(**{**r.__dict__, "layers": (*r.layers[:-1], LayerResult(
      name="output", shape=r.layers[-1].shape, dtype="float32",
      metrics=changed))})
  assert "│ 5 │ output" in str(r2) and "(#4 = #3)" in str(r2)


def test_check_module_draws_a_sequential_once():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.encoder = nnx.Sequential(nnx.Linear(8, 8, rngs=rngs))
      self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
      return self.head(jnp.tanh(self.encoder(x)))
  x = jax.random.normal(jax.random.key(1), (4, 8))
  r = jaxprec.check_module(Model(nnx.Rngs(0)), x, precisions=["bfloat16"],
                           mode="emulate")
  assert [l.name for l in r.layers] == [
      "encoder/layers/0", "encoder", "head", "output"]
  rows = [l.split("│")[2].strip() for l in str(r).splitlines()
          if l.startswith("│")]
  assert rows == ["encoder/layers/0", "head"]
  assert "encoder (#1 = #0), output (#3 = #2)" in str(r)


def test_one_layer_and_one_unchecked_layer_are_singular():
  r = wide_report(1)
  one = DivergenceReport(**{**r.__dict__, "layers": r.layers[:1],
                            "unchecked": ("decoder",)})
  text = str(one)
  assert "jaxprec.check: 1 layer vs" in text
  assert "unchecked: 1 layer has no reference and was not compared: decoder" in text
  assert "jaxprec.check: 6 layers vs" in str(r)


# -- One tolerance -----------------------------------------------------------


def net(w, x):
  h1 = jnp.tanh(x @ w[0])
  return {"h1": h1, "h2": jnp.tanh(h1 @ w[1]), "h3": jnp.tanh(h1 @ w[1]) * 1e-3}


W = jax.random.normal(jax.random.key(0), (2, 32, 32), jnp.float32) / 6
X = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)


@pytest.mark.parametrize("atol,rtol", [(1e-3, 1e-3), (1e-6, 1e-3), (3e-3, 0.0)])
def test_the_table_marks_what_first_divergence_and_passes_answer(atol, rtol):
  r = jaxprec.check(net, W, X, precisions=["bfloat16", "bfloat16_3x"],
                    mode="emulate", atol=atol, rtol=rtol)
  text = r.to_text()
  assert f"(atol={atol:g}, rtol={rtol:g})" in text
  rows = [re.split(r"\s{2,}", l.strip()) for l in text.splitlines()
          if re.match(r"\d\s", l)]
  assert [row[1] for row in rows] == ["h1", "h2", "h3"]
  for j, p in enumerate(r.precisions):
    cells = [row[3 + j] for row in rows]
    marked = [i for i, c in enumerate(cells) if c.endswith(" !")]
    f = r.first_divergence(precision=p)
    assert (f.index if f else None) == (marked[0] if marked else None), p
    assert r.passes(precision=p) == (not marked)
    # The cell is the figure the verdict reads: the smallest passing atol.
    for c, l in zip(cells, r.layers):
      need = l.metrics[p].required_atol
      assert c.split()[0] == jaxprec_fmt(need)
      assert c.endswith(" !") == (need > atol)
  assert any(c.endswith(" !") for row in rows for c in row[3:])


@pytest.fixture(scope="module")
def searched():
  from test_search import MODELS
  _, fn, args = MODELS[100.0]
  return fn, args, jaxprec.search_policy(fn, *args, tolerance=2e-2,
                                         verbose=False)


def test_search_states_its_tolerance_and_the_uniform_saving(searched):
  fn, args, r = searched
  text = str(r)
  assert ("tolerance rel_rms <= 0.02 in each of 6 layers (rel_rms per layer, "
          "not jaxprec.check's elementwise atol/rtol)") in text
  u = r.best_uniform()
  assert u is not None and u.counts == {"bfloat16_3x": 6}
  assert u.relative_cost == pytest.approx(0.5)
  assert (f"cost: {r.relative_cost:.3f} of float32 on tpu (meets the "
          f"tolerance), against 0.500 for uniform bfloat16_3x, the cheapest "
          f"uniform policy that meets it") in text
  assert r.relative_cost < u.relative_cost
  d = r.to_dict()
  assert d["best_uniform"] == {"candidate": "bfloat16_3x",
                               "relative_cost": 0.5}
  # What the policy passes in the check's terms holds in the check.
  atol = r.check_atol()
  # Printed rounded up: the figure a user pastes passes too.
  printed = re.search(r"this policy passes atol=(\S+), rtol=0", text).group(1)
  assert float(printed) >= atol and printed == render_lib.at_least(atol)
  c = jaxprec.check(fn, *args, precisions=[str(r.policy)], mode="emulate",
                    atol=atol, rtol=0.0)
  assert c.passes() and c.passes(float(printed), 0.0)
  assert not c.passes(atol * 0.99, 0.0)
  assert "1 layers" not in text


# -- The CLI in a pseudo-terminal and in a pipe --------------------------------

MODEL = textwrap.dedent("""\
    import jax, jax.numpy as jnp

    W = jax.random.normal(jax.random.key(0), (3, 32, 32), jnp.float32) / 6
    X = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)
    NAMES = ["encoder/layers/0/attention/output_dense",
             "encoder/layers/0/feed_forward/intermediate_dense",
             "encoder/layers/1/attention/output_dense"]

    def net(w, x):
      out, h = {}, x
      for i, name in enumerate(NAMES):
        h = jnp.tanh(h @ w[i])
        out[name] = h
      return out

    def make():
      return net, (W, X)
    """)
NAMES = ["encoder/layers/0/attention/output_dense",
         "encoder/layers/0/feed_forward/intermediate_dense",
         "encoder/layers/1/attention/output_dense"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
  path = tmp_path_factory.mktemp("fitproject")
  (path / "fitmodel.py").write_text(MODEL)
  return path


def cli_env(project, columns):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": os.pathsep.join(
      [str(project), root, os.environ.get("PYTHONPATH", "")]),
      "JAXPREC_CACHE_DIR": str(project / "cache"), "TERM": "xterm"}


ARGS = ["-m", "jaxprec", "check", "fitmodel:make", "--out", "out"]


def run_in_pty(project, columns, *extra):
  """The CLI's stdout as a terminal of ``columns`` columns shows it."""
  leader, follower = pty.openpty()
  fcntl.ioctl(follower, termios.TIOCSWINSZ,
              struct.pack("HHHH", 50, columns, 0, 0))
  child = subprocess.Popen([sys.executable, *ARGS, *extra], cwd=project,
                           stdout=follower, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL,
                           env=cli_env(project, columns))
  os.close(follower)
  try:
    text = read_terminal(leader).decode()
  except AssertionError:
    child.kill()
    raise
  err = child.stderr.read().decode()
  assert child.wait() == 0, err
  return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r\n", "\n")


@pytest.mark.parametrize("columns,full", [(100, False), (80, True)])
def test_cli_table_in_a_terminal(project, columns, full):
  text = run_in_pty(project, columns, *(["--full"] if full else []))
  table = text.split("\ngate:", 1)[0]
  assert "…" not in text
  assert max(cell_len(l.rstrip()) for l in text.splitlines()) <= columns
  for i, name in enumerate(NAMES):
    assert any(name in l and re.search(rf"(^|[\s│]){i}[\s│]", l)
               for l in table.splitlines()), name
  # bfloat16 fails every layer at the default tolerance, bfloat16_3x none.
  assert len(re.findall(r"\d !", table)) >= len(NAMES)
  assert "(atol=0.001, rtol=0.001)" in text
  assert ("max_abs" in table) == full


def test_cli_piped_output_is_not_cut(project):
  out = subprocess.run([sys.executable, *ARGS], cwd=project,
                       capture_output=True, text=True, timeout=600,
                       env=cli_env(project, 40))
  assert out.returncode == 0, out.stderr
  assert "…" not in out.stdout
  for name in NAMES:
    assert name in out.stdout
  assert len(re.findall(r"\d !", out.stdout.split("\ngate:")[0])) >= 3
