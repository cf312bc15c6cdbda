"""`jaxprec check`: built-in models, MODULE:FUNCTION, outputs, exit codes."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import one_line_error, run_cli as run, run_cli_json as run_json, unfolded


MODEL = textwrap.dedent("""\
    import jax, jax.numpy as jnp

    W = jax.random.normal(jax.random.key(0), (2, 32, 32), jnp.float32) / 6
    X = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)

    def net(w, x, scale=1.0):
      h1 = jnp.tanh(x @ w[0]) * scale
      return {"h1": h1, "h2": jnp.tanh(h1 @ w[1])}

    def make():
      return net, (W, X), {"scale": 1.0}

    def two():
      return net, [W, X]

    def raises():
      raise RuntimeError("no data here")

    def fails_inside():
      return (lambda x: x.no_such_attribute), (X,)

    def not_fn():
      return 3, (X,)

    def overflows():  # the float32 reference itself is inf in "big"
      return (lambda x: {"h": x @ x.T, "big": jnp.exp((x @ x.T) * 100)}), (X,)

    def no_matmul():
      return (lambda x: {"h": jnp.tanh(x), "g": x * 2 + 1}), (X,)

    def conv():  # a chip's model covers dots only, and says so
      def f(x, k):
        return {"c": jax.lax.conv_general_dilated(
            x, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))}
      return f, (jnp.ones((1, 8, 3)), jnp.ones((3, 3, 4)) / 9)

    def warns():  # the user's own warning
      import warnings
      def f(x):
        warnings.warn("from the user's model")
        return {"h": x @ x.T}
      return f, (X,)
    """)


@pytest.fixture(autouse=True, scope="module")
def _compilation_cache_dir(tmp_path_factory):
  """The CLI's compilation cache goes to a temporary directory, not ~/.cache."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("JAXPREC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield


@pytest.fixture(scope="module")
def project_dir(tmp_path_factory):
  """One model file for the module: its functions (and so the compiled
  programs of jaxprec.check) are shared by the tests."""
  path = tmp_path_factory.mktemp("project")
  (path / "clicheck_model.py").write_text(MODEL)
  yield path
  sys.modules.pop("clicheck_model", None)


@pytest.fixture
def project(project_dir, tmp_path, monkeypatch):
  """The current directory is a fresh one that can import the model file."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [str(project_dir), *sys.path])
  (tmp_path / "clicheck_model.py").write_text(MODEL)  # for path:FUNCTION
  return tmp_path


def test_module_function_prints_table_and_writes_outputs(project, capsys):
  rc, out, err = run(capsys, "check", "clicheck_model:make", "--out", "rep")
  assert rc == 0, err
  assert "model: clicheck_model:make" in out
  for s in ("h1", "h2", "bfloat16_3x", "bf16x6 (tpu, emulated)",
            "first divergence"):
    assert s in out
  d = json.loads((project / "rep" / "report.json").read_text())
  assert d["schema"] == 2 and [l["name"] for l in d["layers"]] == ["h1", "h2"]
  assert (project / "rep" / "divergence.png").read_bytes()[:4] == b"\x89PNG"
  assert "\r" not in err  # no progress bar without a terminal


def test_a_failed_plot_leaves_no_picture_of_another_run(project, capsys,
                                                         monkeypatch):
  """The previous run's divergence.png stayed beside a new report.json when
  the plot failed; now it is removed and a warning says so (exit 0: the
  report is written)."""
  out = project / "rep-stale"
  out.mkdir()
  (out / "divergence.png").write_bytes(b"old run")
  from jaxprec._src.checker import report as report_lib

  def broken(self, path=None, **kwargs):
    raise ValueError("the plot broke")
  monkeypatch.setattr(report_lib.DivergenceReport, "plot", broken)
  rc, _, err = run(capsys, "check", "clicheck_model:make", "--out", str(out))
  assert rc == 0, err
  assert not (out / "divergence.png").exists()
  assert json.loads((out / "report.json").read_text())["kind"] == "check"
  warned = [l for l in err.splitlines() if "warning: divergence.png" in l]
  assert len(warned) == 1 and "ValueError: the plot broke" in warned[0]
  assert warned[0].endswith("report.json is written")


def test_json_and_options(project, capsys):
  d = run_json(capsys, "check", "clicheck_model.py:two", "--json",
               "--precisions", "bf16, float32", "--target", "gpu",
               "--reference", "float64", "--out", "r2")
  assert d["precisions"] == ["bf16", "float32"] and d["target"] == "gpu"
  assert d["reference"] == "float64" and d["mode"] == "emulate"
  assert d["numerics"]["float32"] == "f32 (gpu, emulated)"
  assert d["numerics"]["bf16"] == "tf32 (gpu, emulated)"


def test_tolerances_set_the_exit_status_for_ci(project, capsys):
  rc, out, err = run(capsys, "check", "clicheck_model:make", "--atol", "1",
                     "--out", "r3")
  assert rc == 0, err
  rc, out, err = run(capsys, "check", "clicheck_model:make", "--atol", "1e-6",
                     "--precisions", "bfloat16,bfloat16_3x", "--out", "r4")
  # A tolerance not given keeps its default (1e-3), as in jaxprec.check: the
  # exit status, the table's '!' and its gate line say the same.
  one_line_error(rc, err, 1, "outside atol=1e-06 rtol=0.001",
                 "bfloat16: h1 needs atol")
  assert "h2" in out  # the table is printed first
  assert "(atol=1e-06, rtol=0.001)" in out
  rc, out, err = run(capsys, "check", "clicheck_model:make", "--rtol", "1e-2",
                     "--atol", "1e-4", "--precisions", "bf16_3x", "--out", "r5")
  assert rc == 0, err
  # --atol 0 gates on --rtol alone: elements near zero must match exactly.
  rc, out, err = run(capsys, "check", "clicheck_model:make", "--rtol", "1e-2",
                     "--atol", "0", "--precisions", "bf16_3x", "--out", "r5")
  one_line_error(rc, err, 1, "outside atol=0 rtol=0.01")
  assert "(atol=0, rtol=0.01)" in out


def test_reference_file(project, capsys):
  import numpy as np
  rng = np.random.default_rng(0)
  np.savez(project / "ref.npz", h1=rng.standard_normal((4, 32)),
           h2=rng.standard_normal((4, 32)))
  d = run_json(capsys, "check", "clicheck_model:make", "--reference",
               "ref.npz", "--precisions", "bf16", "--json", "--out", "r6")
  assert d["reference"] == "file:ref.npz"
  np.savez(project / "bad.npz", h1=np.zeros((4, 3)))
  rc, out, err = run(capsys, "check", "clicheck_model:make", "--reference",
                     "bad.npz", "--out", "r7")
  one_line_error(rc, err, 2, "first mismatch at 'h1'", "(4, 32)", "(4, 3)")


@pytest.mark.parametrize("argv, fragments", [
    ([], ["--model", "MODULE:FUNCTION"]),
    (["clicheck_model:make", "--model", "bert"], ["not both"]),
    (["clicheck_model:make", "--size", "base"], ["--size applies to --model"]),
    (["--model", "gpt"], ["invalid choice"]),
    (["clicheck_model:make", "--precisions", "bf61"], ["bf61", "Did you mean"]),
    (["clicheck_model:make", "--precisions", ","], ["empty"]),
    (["clicheck_model:make", "--reference", "missing.npz"], ["no such reference"]),
    (["clicheck_model:make", "--reference", "float65"], ["float65"]),
    (["clicheck_model:make", "--atol", "-1"], ["--atol -1 is negative"]),
    (["clicheck_model:make", "--rtol", "inf"], ["--rtol inf is infinite"]),
    (["clicheck_model:make", "--rtol", "1e39"], ["--rtol 1e39", "float32's largest"]),
    (["clicheck_model:make", "--atol", "nan"], ["--atol nan is not a number"]),
    (["clicheck_model:make", "--mode", "fast"], ["invalid choice"]),
    (["clicheck_model:nope"], ["has no attribute"]),
    (["clicheck_model:not_fn"], ["not a callable"]),
])
def test_usage_errors_are_one_line_exit_2(project, capsys, argv, fragments):
  rc, out, err = run(capsys, "check", *argv)
  one_line_error(rc, err, 2, *fragments)


@pytest.mark.parametrize("argv, said", [
    # Python reads 1e400 as inf: the value is named as typed, not as "inf".
    (["--atol", "1e400"], "--atol 1e400 overflows to inf; a tolerance is a "
                          "finite number from 0 to 3.4e+38, e.g. --atol 1e-3"),
    (["--rtol", "-1e999"], "--rtol -1e999 is negative"),
    # argparse reads `--atol -inf` (and -1e-3) as two options: it is the value.
    (["--atol", "-inf"], "--atol -inf is negative (a tolerance bounds the "
                         "size of an error)"),
    (["--atol", "-1e-3"], "--atol -1e-3 is negative"),
    (["--atol=-inf"], "--atol -inf is negative"),
    (["--rtol", "x"], "--rtol 'x' is not a number"),
])
def test_a_tolerance_is_refused_naming_it_as_typed(project, capsys, argv,
                                                   said):
  rc, out, err = run(capsys, "check", "clicheck_model:make", *argv,
                     "--out", "never")
  one_line_error(rc, err, 2, said)
  assert "got inf" not in err and not os.path.exists("never")


def test_a_negative_number_after_dash_dash_is_left_alone():
  from jaxprec._src.cli import cli_inputs
  assert cli_inputs.join_negative_numbers(
      ["check", "m:f", "--atol", "-1", "--", "--rtol", "-2"]) == [
          "check", "m:f", "--atol=-1", "--", "--rtol", "-2"]
  run_cmd = ["run", "-p", "f32", "python", "t.py", "--atol", "-1"]
  assert cli_inputs.join_negative_numbers(run_cmd) == run_cmd
  assert cli_inputs.join_negative_numbers(
      ["search", "--tolerance", "-inf"]) == ["search", "--tolerance=-inf"]


def test_a_reference_that_overflows_is_said(project, capsys):
  rc, out, err = run(capsys, "check", "clicheck_model:overflows",
                     "--precisions", "bf16", "--out", "ov")
  assert rc == 0, err
  (note,) = [l for l in unfolded(out).splitlines() if "itself holds inf" in l]
  assert note.startswith("note: the reference (float32) itself holds inf or "
                         "NaN in 'big' (")
  assert "it overflowed" in note and "check against float64" in note
  assert not any("itself holds" in l for l in run(
      capsys, "check", "clicheck_model:make", "--precisions", "bf16",
      "--out", "fine")[1].splitlines())


@pytest.mark.parametrize("precisions", ["bf16", "bf16,tf32,float32"])
def test_a_model_without_a_matmul_is_said(project, capsys, precisions):
  """Every precision gives the same numbers: said, not a silent table of 0."""
  rc, out, err = run(capsys, "check", "clicheck_model:no_matmul",
                     "--precisions", precisions, "--out", "nm")
  assert rc == 0, err
  (note,) = [l for l in unfolded(out).splitlines() if "no matmul" in l]
  assert "has no matmul or convolution" in note
  assert "the precision changes nothing" in note
  assert ("every row is the same" in note) == ("," in precisions)
  rc, out, err = run(capsys, "check", "clicheck_model:make", "--precisions",
                     precisions, "--out", "mm")
  assert "no matmul" not in out


def test_failures_in_user_code_exit_1(project, capsys):
  rc, out, err = run(capsys, "check", "clicheck_model:raises")
  one_line_error(rc, err, 1, "raises() raised RuntimeError: no data here")
  rc, out, err = run(capsys, "check", "clicheck_model:fails_inside")
  one_line_error(rc, err, 1, "AttributeError", "no_such_attribute")
  # The line says where in the user's file, and how to see the traceback.
  one_line_error(rc, err, 1, "clicheck_model.py:", "in <lambda>)",
                 "JAXPREC_TRACEBACK=1 shows the traceback")
  line = MODEL.splitlines().index(
      "  return (lambda x: x.no_such_attribute), (X,)") + 1
  assert f"clicheck_model.py:{line} in <lambda>" in err


def test_jaxprec_traceback_prints_the_users_traceback(project, capsys,
                                                       monkeypatch):
  monkeypatch.setenv("JAXPREC_TRACEBACK", "1")
  rc, out, err = run(capsys, "check", "clicheck_model:fails_inside")
  assert rc == 1
  assert err.index("Traceback (most recent call last)") < err.index(
      "jaxprec: error: checking")
  assert "x.no_such_attribute" in err and "AttributeError" in err


def test_builtin_bert_in_process(tmp_path, capsys):
  rc, out, err = run(capsys, "check", "--model", "bert", "--precisions",
                     "bfloat16", "--out", str(tmp_path / "b"))
  assert rc == 0, err
  assert "model: bert (tiny, seed 0)" in out and "hidden_states[2]" in out


def test_wav2vec2_end_to_end(tmp_path):
  """The README's main command, in a fresh interpreter, JAX compile included.

  Its time is not asserted (machines differ and tests run in parallel):
  ``benchmarks/bench_cli_cache.py`` measures it, cold and warm side by side.
  """
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
       os.environ.get("PYTHONPATH", "")]),
      JAXPREC_CACHE_DIR=str(tmp_path / "cache"))  # cold: compile included
  proc = subprocess.run(
      [sys.executable, "-m", "jaxprec", "check", "--model", "wav2vec2", "--out",
       str(tmp_path / "out")], capture_output=True, text=True, env=env,
      timeout=600)
  assert proc.returncode == 0, proc.stderr
  assert "conv_features[0]" in proc.stdout and "hidden_states[2]" in proc.stdout
  assert "first divergence" in proc.stdout
  assert (tmp_path / "out" / "divergence.png").exists()
  # On the built-in model, one bfloat16 pass sits far above three, and three
  # far above six (a TPU's float32), at every layer.
  d = json.loads((tmp_path / "out" / "report.json").read_text())
  assert [l["name"] for l in d["layers"]] == (
      [f"conv_features[{i}]" for i in range(7)]
      + [f"hidden_states[{i}]" for i in range(3)])
  for layer in d["layers"]:
    m = {p: layer["metrics"][p]["rel_rms"] for p in d["precisions"]}
    assert m["bfloat16"] > 50 * m["bfloat16_3x"] > 50 * 10 * m["float32"] > 0
    assert 1e-3 < m["bfloat16"] < 3e-2
  assert d["summary"]["bfloat16"]["first_divergence"] == "conv_features[0]"
  assert d["summary"]["bfloat16_3x"]["first_divergence"] is None


def test_out_without_matplotlib_says_how_to_install_it_here(project, capsys,
                                                           monkeypatch):
  # The note names the install line that works for this copy of jaxprec (a
  # checkout: pip install -e), not an index name that a clone cannot install.
  from jaxprec._src.checker import report as report_lib
  from jaxprec._src.core.version import install_hint

  def no_matplotlib(self, path=None, **kwargs):
    raise ImportError("No module named 'matplotlib'")

  monkeypatch.setattr(report_lib.DivergenceReport, "plot", no_matplotlib)
  rc, _, err = run(capsys, "check", "clicheck_model:make", "--out", "rep")
  assert rc == 0, err
  err = unfolded(err)
  assert "divergence.png not written" in err
  assert install_hint("plots") in err
  assert json.loads((project / "rep" / "report.json").read_text())
  assert not (project / "rep" / "divergence.png").exists()


def test_warnings_are_one_line_each_and_name_only_the_users_file(project,
                                                                 capsys):
  rc, _, err = run(capsys, "check", "clicheck_model:conv", "--target", "gpu",
                   "--chip", "h100", "--precisions", "tensorfloat32")
  assert rc in (0, 1), err
  (line,) = [l for l in unfolded(err).splitlines() if "NotModelledWarning" in l]
  assert line.startswith("jaxprec: warning: NotModelledWarning: chip='h100'")
  assert ".py:" not in err and "warnings.warn" not in err, err
  rc, _, err = run(capsys, "check", "clicheck_model:warns", "--precisions",
                   "bfloat16")
  (line,) = [l for l in unfolded(err).splitlines() if "from the user's model" in l]
  assert line.startswith("jaxprec: warning: UserWarning: from the user's "
                         "model (")
  assert "clicheck_model.py:" in line


def test_target_and_mode_take_any_letter_case_as_the_api_does(project,
                                                               capsys):
  rc, out, err = run(capsys, "check", "clicheck_model:make", "--target",
                     "GPU", "--mode", "Emulate", "--precisions", "float32",
                     "--json")
  assert rc in (0, 1), err
  d = json.loads(out)
  assert (d["target"], d["mode"]) == ("gpu", "emulate")
  rc, _, err = run(capsys, "check", "clicheck_model:make", "--target", "cpu")
  assert rc == 2 and "invalid choice: 'cpu'" in err
