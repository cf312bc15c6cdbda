"""Shared fixtures: every test leaves JAX's global precision state as it found it.

The suite runs in parallel (pytest-xdist, ``-n auto --dist loadfile`` in the
README's command): every worker has its own temporary directories (tmp_path,
``JAXPREC_CACHE_DIR``), and no test writes into the repository.
"""

import os
import shutil
import tempfile

import jax
import pytest

# Workers ``-n auto`` starts at most: each imports JAX, Flax, PyTorch and
# transformers (a few hundred MB), and the slowest test file bounds the run.
MAX_AUTO_WORKERS = 8


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, if installed
def pytest_xdist_auto_num_workers(config):
  """``-n auto``: one worker per CPU this process may run on (logical CPUs,
  cgroup affinity respected; psutil's default counts physical cores, which is
  1 on a 2-vCPU cloud machine), at most ``MAX_AUTO_WORKERS``;
  ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it."""
  del config
  env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
  if env:
    return int(env)
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # macOS, Windows
    cpus = os.cpu_count() or 1
  return max(1, min(cpus, MAX_AUTO_WORKERS))


_CACHE_DIR = pytest.StashKey[tuple]()


def pytest_configure(config):
  """jaxprec's caches (kernel benchmark, compiled programs) go to a temporary
  directory of this process (each xdist worker has its own), never to the
  user's ~/.cache: for the tests and for ``jaxprec``'s doctests (which this
  conftest's fixtures do not reach); subprocesses inherit it."""
  path = tempfile.mkdtemp(prefix="jaxprec-cache-")
  config.stash[_CACHE_DIR] = (path, os.environ.get("JAXPREC_CACHE_DIR"))
  os.environ["JAXPREC_CACHE_DIR"] = path
  _share_compiled_programs(config)


_XLA_CACHE_ENV = "JAXPREC_TESTS_XLA_CACHE"
_XLA_CACHE = pytest.StashKey[str]()


def _share_compiled_programs(config):
  """JAX's persistent compilation cache, in one temporary directory for this
  run (shared by the xdist workers, removed at the end): tests that compile
  the same program (a tiny BERT checked at the same rows, say) compile it
  once. In this process only, never through the environment JAX reads, so
  the command-line tests' subprocesses still compile cold. jaxprec's own
  cache (``cache=``, the CLI) switches directory and restores this one."""
  path = os.environ.get(_XLA_CACHE_ENV)
  if path is None:  # the controller (or a run without xdist) owns it
    path = tempfile.mkdtemp(prefix="jaxprec-tests-xla-")
    os.environ[_XLA_CACHE_ENV] = path
    config.stash[_XLA_CACHE] = path
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_unconfigure(config):
  if _XLA_CACHE in config.stash:
    os.environ.pop(_XLA_CACHE_ENV, None)
    shutil.rmtree(config.stash[_XLA_CACHE], ignore_errors=True)
  if _CACHE_DIR not in config.stash:
    return
  path, before = config.stash[_CACHE_DIR]
  if before is None:
    os.environ.pop("JAXPREC_CACHE_DIR", None)
  else:
    os.environ["JAXPREC_CACHE_DIR"] = before
  shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_matmul_precision():
  before = jax.config.jax_default_matmul_precision
  yield
  jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(autouse=True)
def _restore_emulation_kernel():
  import jaxprec  # pylint: disable=import-outside-toplevel
  from jaxprec._src.jaxpr import compat
  from jaxprec._src.emulation import kernels
  before = compat.KERNEL_STATE.get_global()
  kernels._forget_environment()  # each test reads JAXPREC_KERNEL afresh
  yield
  jaxprec.set_kernel(before)
  kernels._forget_environment()


def lowered(fn, *args) -> str:
  """StableHLO text of ``jax.jit(fn)`` on ``args``."""
  return jax.jit(fn).lower(*args).as_text()


def read_terminal(leader: int, timeout: float = 600, on_chunk=None) -> bytes:
  """Everything a command wrote to the pseudo-terminal whose leader end is
  ``leader``, until it closes the terminal; ``on_chunk(screen)`` sees the
  screen so far after each read. Raises AssertionError after ``timeout``
  seconds without output. Closes ``leader``."""
  import select  # pylint: disable=import-outside-toplevel
  screen = b""
  try:
    while True:
      if not select.select([leader], [], [], timeout)[0]:
        raise AssertionError(f"the command printed nothing for {timeout} s")
      try:
        chunk = os.read(leader, 65536)
      except OSError:  # the command closed the terminal
        break
      if not chunk:
        break
      screen += chunk
      if on_chunk is not None:
        on_chunk(screen)
  finally:
    os.close(leader)
  return screen


def run_cli(capsys, *argv) -> tuple[int, str, str]:
  """``(exit status, stdout, stderr)`` of ``jaxprec ARGV`` run in this process."""
  from jaxprec._src.cli.cli import main  # pylint: disable=import-outside-toplevel
  rc = main(list(argv))
  out, err = capsys.readouterr()
  return rc, out, err


def run_cli_json(capsys, *argv):
  """The JSON ``jaxprec ARGV`` prints, once it exited 0."""
  import json  # pylint: disable=import-outside-toplevel
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 0, err
  return json.loads(out)


def unfolded(text: str) -> str:
  """``text`` with each line the CLI folded to the terminal's width (its
  later parts indented two more than the line) joined back into one."""
  out: list[str] = []
  for line in text.splitlines():
    indent = len(line) - len(line.lstrip(" "))
    if out and line.strip() and indent >= 2 and (
        indent == len(out[-1]) - len(out[-1].lstrip(" ")) + 2
        or out[-1].startswith("jaxprec: ")):
      out[-1] += " " + line.strip()
    else:
      out.append(line)
  return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def one_line_error(rc, err, code, *fragments):
  """The command exited ``code`` with one ``jaxprec: error:`` message (one
  line, folded to the terminal's width) holding every fragment, and no
  traceback."""
  assert rc == code, err
  lines = [l for l in unfolded(err).splitlines()
           if l.startswith("jaxprec: error:")]
  assert len(lines) == 1 and "Traceback" not in err, err
  for f in fragments:
    assert f in lines[0], (f, lines[0])


def policies(pieces, dtypes=None):
  """A hypothesis strategy of random ``jaxprec.Policy`` values: up to four
  rules, each with a path regex joined from ``pieces`` (a strategy), a module
  type, an op kind, or some of them, and a precision; with ``dtypes`` (a
  strategy) a rule sets a precision, a dtype or both, and the policy has a
  default dtype too."""
  import hypothesis  # pylint: disable=import-outside-toplevel
  import hypothesis.strategies as st  # pylint: disable=import-outside-toplevel
  from jaxprec import Policy, Rule  # pylint: disable=import-outside-toplevel
  from jaxprec._src.policy.policy_text import MODULE_TYPES, OP_KINDS  # pylint: disable=import-outside-toplevel
  precisions = st.sampled_from(["bfloat16", "tensorfloat32", "float32", "bfloat16_3x",
                                "BF16_BF16_F32_X3", "F32_F32_F32", "backend-default"])

  @st.composite
  def policy(draw):
    rules = []
    for _ in range(draw(st.integers(0, 4))):
      path = draw(st.none() | st.lists(pieces, min_size=1, max_size=4).map("".join))
      mtype = draw(st.none() | st.sampled_from(MODULE_TYPES))
      op = draw(st.none() | st.sampled_from(OP_KINDS))
      if path is None and mtype is None and op is None:
        op = "dot"
      if dtypes is None:
        values = {"precision": draw(precisions)}
      else:
        values = {"precision": draw(st.none() | precisions),
                  "dtype": draw(st.none() | dtypes)}
        if values["precision"] is None and values["dtype"] is None:
          values["dtype"] = "bfloat16"
      try:
        rules.append(Rule(path=path, module_type=mtype, op=op, **values))
      except ValueError:  # an invalid regex from the pieces
        hypothesis.assume(False)
    default = draw(st.none() | precisions)
    if dtypes is None:
      return Policy(rules=tuple(rules), default=default)
    return Policy(rules=tuple(rules), default=default,
                  default_dtype=draw(st.none() | dtypes))

  return policy()


def assert_same_figures(report, result):
  """``report`` (a check with the row ``str(result.policy)``) measures what
  the search's final step measured, layer by layer and metric by metric."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  label = str(result.policy)
  assert report.precisions == (label,)
  assert [l.name for l in report.layers] == list(result.values)
  for got, want in zip(report.layers, result.report.layers):
    g, w = got.metrics[label], want.metrics["policy"]
    for k in ("rel_rms", "max_abs", "max_rel", "cosine", "sqnr_db"):
      np.testing.assert_allclose(getattr(g, k), getattr(w, k), rtol=1e-5,
                                 atol=1e-12, err_msg=f"{got.name} {k}")
  np.testing.assert_allclose(report.metric(result.metric, label),
                             list(result.values.values()), rtol=1e-5)
