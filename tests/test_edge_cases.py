"""Probes of labels, refusals, metrics at the edge of float32's range, audit
sources inside a library's solve and the sampler's sides.

Each test failed before its fix: a float32 row of a GPU check with a chip was
labelled as computed on that chip's tensor cores (float32 runs on CUDA
cores); a native row of a precision the backend refuses ran the rows before
it and then failed with JAX's own error (exit 1 on the command line, where
``search`` said the same as bad usage, exit 2); the sampler named a side by
the name as typed alone (``bfloat16 on gpu``, which a GPU computes as TF32)
and took a precision its target does not run (``TF32_TF32_F32@tpu``);
the audit's rows inside a lineax solve named lineax's files as the source,
not the user's line that calls the solve; a layer whose candidate overflowed
where the reference is the layer's largest value reported its other
elements' rel_rms as 0, cosine as 1 and SQNR as inf (their squares, scaled
by that largest value, underflowed); the command line read a prefix of an
option as the option (``search --mode native`` was ``--model native``:
"argument --model: invalid choice"); with ``JAXPREC_TRACEBACK=1`` the error
line after the traceback still said that the variable shows it; the plot
showed nothing of a layer the table fails with inf or NaN (no value to draw,
or an exact 0 elsewhere in the layer), so the main job's picture passed it;
where the reader of stderr left, an error line ended the command with a
traceback and status 1 (and on Python 3.13 any command with status 120),
not as a shell says SIGPIPE ended it; ``DivergenceReport.from_json`` of JSON
that is not a check report's object raised ``AttributeError`` or
``KeyError``.
"""

import inspect
import os


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec
from jaxprec._src.checker import sampler_check
from jaxprec._src.core import numerics

from conftest import one_line_error, run_cli

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 16)).astype(np.float32)
W = RNG.standard_normal((16, 8)).astype(np.float32)


def _mlp(x, w):
  return {"y": x @ w}


# --------------------------------------------------------------------------
# A chip's label on the rows its tensor cores compute, and only those.


def test_a_chip_names_tensor_cores_only_on_rows_they_compute():
  r = jaxprec.check(_mlp, X, W, target="gpu", mode="emulate", chip="h100",
                    precisions=("float32", "F32_F32_F32", "tensorfloat32"))
  assert r.numerics["float32"] == "f32 (gpu, emulated)"
  assert r.numerics["F32_F32_F32"] == "f32 (gpu, emulated)"
  assert r.numerics["tensorfloat32"] == "tf32 (gpu, emulated, h100 tensor cores)"
  # The float32 rows compute exact float32, as their label says: no error.
  for row in ("float32", "F32_F32_F32"):
    assert r.layers[0].metrics[row].max_abs == 0.0
  assert r.layers[0].metrics["tensorfloat32"].max_abs > 0.0


# --------------------------------------------------------------------------
# A native row the backend refuses: refused before anything runs.


@pytest.mark.parametrize("name", ["TF32_TF32_F32", "BF16_BF16_F32_X9"])
def test_a_native_row_the_cpu_refuses_is_refused_before_anything_runs(name):
  calls = []

  def fn(x, w):
    calls.append(1)
    return _mlp(x, w)
  with pytest.raises(numerics.UnsupportedAlgorithmError,
                     match=rf"{name}.*natively.*cpu.*mode='emulate'"):
    jaxprec.check(fn, X, W, precisions=("bfloat16", name), mode="native")
  assert not calls


def test_the_command_line_refuses_a_row_the_target_does_not_run_as_usage(
    tmp_path, monkeypatch, capsys):
  (tmp_path / "m.py").write_text(
      "import numpy as np\n"
      "def make():\n"
      "  return (lambda x, w: x @ w), (np.ones((2, 4), np.float32),\n"
      "                                np.ones((4, 3), np.float32))\n")
  monkeypatch.chdir(tmp_path)
  rc, _, err = run_cli(capsys, "check", "m.py:make", "--precisions",
                       "TF32_TF32_F32", "--out", "o")
  one_line_error(rc, err, 2, "TF32_TF32_F32", "does not run on a TPU")
  rc, _, err = run_cli(capsys, "check", "m.py:make", "--target", "gpu",
                       "--mode", "native", "--out", "o")
  one_line_error(rc, err, 2, "TF32_TF32_F32_X3", "natively")
  assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------
# The sampler's sides: the name as typed, and what the target computes.


def test_a_sampler_side_says_what_its_target_computes_for_the_name(capsys):
  assert str(jaxprec.Compute(precision="bfloat16", target="gpu",
                             chip="h100")) == "bfloat16 (tf32) on gpu (h100)"
  assert str(jaxprec.Compute(precision="bfloat16", target="tpu",
                             head="float32")) == (
      "bfloat16 (bf16x1) on tpu, head float32 (bf16x6)")
  # No algorithm where the setting is a policy or the CPU's own float32.
  assert str(jaxprec.Compute(precision="default=dtype:bfloat16",
                             target="gpu")) == "default=dtype:bfloat16 on gpu"
  assert str(jaxprec.Compute(precision="float32")) == "float32 on cpu"
  # A side its target cannot compute is refused when it is made.
  for kw in (dict(precision="TF32_TF32_F32", target="tpu"),
             dict(precision="float32", target="tpu", head="F32_F32_F32")):
    with pytest.raises(numerics.UnsupportedAlgorithmError,
                       match=r"^Compute (precision|head)=: \S+ .*does not "
                             r"run on a TPU"):
      jaxprec.Compute(**kw)
  # The attribution's settings read the same (sampler_check._describe).
  assert sampler_check._describe(("BF16_BF16_F32", "gpu", "a100")) == (
      "BF16_BF16_F32 (bf16x1) on gpu (a100)")
  rc, _, err = run_cli(capsys, "sampler", "--sampler", "TF32_TF32_F32@tpu")
  one_line_error(rc, err, 2, "TF32_TF32_F32", "does not run on a TPU")


# --------------------------------------------------------------------------
# The audit's source inside a library's solve: the user's line.


def test_audit_rows_inside_a_lineax_solve_name_the_users_lines():
  lx = pytest.importorskip("lineax")
  a, b = 3 * jnp.eye(6), jnp.ones(6)

  def solve(a, b):
    op = lx.FunctionLinearOperator(lambda v: a @ v,  # the user's product
                                   jax.ShapeDtypeStruct(b.shape, b.dtype))
    solver = lx.GMRES(rtol=1e-6, atol=1e-6, max_steps=20, restart=4)
    return lx.linear_solve(op, b, solver, throw=False).value  # the call

  lines, first = inspect.getsourcelines(solve)
  at = {tag: f"{__file__}:{first + i}" for i, l in enumerate(lines)
        for tag in ("the user's product", "the call") if f"# {tag}" in l}
  rows = jaxprec.audit(solve, a, b).rows
  assert len(rows) > 2
  def tag(row):  # lineax's own products (inner products): the call's line
    return "the call" if f"lineax{os.sep}" in row.op else "the user's product"
  assert {tag(r) for r in rows} == {"the call", "the user's product"}
  for row in rows:
    assert row.source == at[tag(row)], (row.op, row.source)


# --------------------------------------------------------------------------
# The metrics over the elements finite in both, whatever the others hold.


def test_metrics_over_valid_elements_ignore_the_scale_of_an_overflowed_one():
  x, w = X.copy(), W.copy()
  x[0, 0], w[0] = 3.4e38, 0.01  # row 0 about 3.4e36; one bfloat16 pass: inf
  r = jaxprec.check(_mlp, x, w, precisions=("bfloat16",), mode="emulate")
  m = r.layers[0].metrics["bfloat16"]
  cand = np.asarray(jaxprec.emulate(_mlp, "bfloat16")(x, w)["y"], np.float64)
  ref = np.asarray(jax.jit(_mlp)(x, w)["y"], np.float64)
  assert np.isinf(cand[0]).all() and np.isfinite(cand[1:]).all()
  assert m.inf == 8 and m.required_atol == np.inf  # the gate still fails
  c, t = cand[1:].ravel(), ref[1:].ravel()  # the valid elements
  e = c - t
  np.testing.assert_allclose(m.rel_rms, np.sqrt((e @ e) / (t @ t)), rtol=1e-5)
  np.testing.assert_allclose(m.ref_rms, np.sqrt(np.mean(t * t)), rtol=1e-5)
  np.testing.assert_allclose(
      m.cosine, (c @ t) / np.sqrt((c @ c) * (t @ t)), rtol=1e-9)
  np.testing.assert_allclose(m.sqnr_db, 10 * np.log10((t @ t) / (e @ e)),
                             rtol=1e-5)
  assert m.max_abs == np.abs(e).max()
  floor = 1e-3 * np.sqrt(np.mean(t * t))  # max_rel's, of the valid elements
  np.testing.assert_allclose(
      m.max_rel, (np.abs(e) / np.maximum(np.abs(t), floor)).max(), rtol=1e-5)


# --------------------------------------------------------------------------
# The command line takes each option by its whole name.


@pytest.mark.parametrize("argv, bad", [
    (["search", "m:make", "--tolerance", "1e-2", "--mode", "native"],
     "--mode native"),
    (["check", "m:make", "--prec", "bfloat16"], "--prec bfloat16"),
    (["audit", "m:make", "--js"], "--js"),
])
def test_a_prefix_of_an_option_is_not_that_option(capsys, argv, bad):
  rc, out, err = run_cli(capsys, *argv)
  one_line_error(rc, err, 2, f"unrecognized arguments: {bad}")
  assert "--model" not in err and not out


def test_the_error_after_the_traceback_does_not_offer_it_again(
    tmp_path, monkeypatch, capsys):
  (tmp_path / "m.py").write_text("def make():\n  raise KeyError('k')\n")
  monkeypatch.chdir(tmp_path)
  rc, _, err = run_cli(capsys, "audit", "m.py:make")
  one_line_error(rc, err, 1, "KeyError", "JAXPREC_TRACEBACK=1 shows the")
  monkeypatch.setenv("JAXPREC_TRACEBACK", "1")
  rc, _, err = run_cli(capsys, "audit", "m.py:make")
  assert rc == 1 and "Traceback (most recent call last)" in err
  last = err.strip().splitlines()[-1]
  assert last.startswith("jaxprec: error: m.py:make() raised KeyError"), err
  assert "JAXPREC_TRACEBACK" not in err


# --------------------------------------------------------------------------
# The plot rings every layer the table fails, with or without a value to draw.


def test_the_plot_rings_a_layer_that_fails_with_inf_or_nan():
  pytest.importorskip("matplotlib")
  x, w = np.ones((2, 4), np.float32), np.ones((4, 2), np.float32)

  def fn(x, w):
    y = x @ w
    return {"exact": y, "overflows": (x * 3.4e38) @ (w * 0.25),
            "one_nan": y.at[0, 0].set(jnp.nan), "also_exact": 2 * y}

  def reference_fn(x, w):  # the same, NaN-free where the row has a NaN
    return dict(fn(x, w), one_nan=x @ w)
  ref = {k: np.asarray(v) for k, v in jax.jit(reference_fn)(x, w).items()}
  r = jaxprec.check(fn, x, w, precisions=("bfloat16",), mode="emulate",
                    reference=ref)
  fails = [i for i, l in enumerate(r.layers)
           if not l.metrics["bfloat16"].passes(r.atol)]
  assert fails == [1, 2]
  assert np.isnan(r.layers[1].metrics["bfloat16"].rel_rms)  # nothing to draw
  assert r.layers[2].metrics["bfloat16"].rel_rms == 0.0  # drawn as exact
  for metric in ("rel_rms", "max_abs", "required_atol"):
    fig = r.plot(metric=metric)
    rings = [l for l in fig.axes[0].get_lines()
             if l.get_markeredgecolor() == "tab:red" and l.get_marker() == "o"
             and len(l.get_xdata())]
    assert sorted(round(x) for l in rings for x in l.get_xdata()) == fails, (
        metric)


@pytest.mark.parametrize("args, stream", [
    (["info", "--json"], "stdout"),
    (["check", "--model", "nope"], "stderr"),  # argparse's usage line
    (["check", "--model", "mlp", "--precisions", "bogus"], "stderr"),
])
def test_a_reader_that_left_ends_the_command_as_sigpipe(args, stream):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  read, write = os.pipe()
  other = subprocess.PIPE
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxprec", *args],
      stdout=write if stream == "stdout" else subprocess.DEVNULL,
      stderr=write if stream == "stderr" else other)
  os.close(write)
  os.close(read)  # before the command writes: it imports JAX first
  said = proc.stderr.read() if stream == "stdout" else b""
  assert proc.wait(timeout=300) == 128 + 13 and said == b""


@pytest.mark.parametrize("text, words", [
    ("[]", ["a JSON object", "list"]),
    ('"report"', ["a JSON object", "str"]),
    ('{"schema": 2, "kind": "check"}', ["'layers'", "'precisions'"]),
    ('{"schema": 2}', ["kind None"]),
])
def test_reading_back_what_is_not_a_check_report_says_what_it_is(text, words):
  with pytest.raises(ValueError) as e:
    jaxprec.DivergenceReport.from_json(text)
  assert all(w in str(e.value) for w in words), str(e.value)
