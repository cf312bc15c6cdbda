"""A user's own model from the command line: ``check --modules``, the warning
when Flax modules run without module paths, ``search --model llama``, the
no-model message, the phase lines on stderr (piped and on a terminal),
``jaxprec.policy_from_env`` and the audit header of a decorated function."""

import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import pytest

import jaxprec
from conftest import one_line_error, read_terminal, run_cli as run, unfolded

MODEL = textwrap.dedent("""\
    import jax, jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx

    class Block(nnx.Module):
      def __init__(self, d, rngs):
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

      def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.blocks = nnx.List([Block(16, rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 4, rngs=rngs)

      def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
          h = block(h)
        return self.head(h)

      def encode(self, x):
        return self.embed(x)

      def own_matmul(self, x):  # calls no submodule
        return jnp.tanh(x @ self.embed.kernel[...])

      def nothing(self, x):
        return None

    class Mlp(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Dense(4, name="dense2")(jnp.tanh(nn.Dense(16, name="dense1")(x)))

      def squashed(self, x):
        return jnp.tanh(self(x) * 3)

    X = jax.random.normal(jax.random.key(1), (4, 8))

    def model():
      return Net(nnx.Rngs(0)), (X,)

    def encode():
      return Net(nnx.Rngs(0)).encode, (X,)

    def merged():
      graphdef, state = nnx.split(Net(nnx.Rngs(0)))
      def fn(state, x):
        return nnx.merge(graphdef, state)(x)
      return fn, (state, X)

    def plain():
      w = jax.random.normal(jax.random.key(2), (8, 8))
      return (lambda w, x: {"h": jnp.tanh(x @ w)}), (w, X)

    def linen_apply():
      m = Mlp()
      return jax.jit(m.apply), (m.init(jax.random.key(0), X), X)

    def linen_module():
      m = Mlp()
      return m, (m.init(jax.random.key(0), X), X)

    def linen_frozen():
      from flax.core import freeze
      m = Mlp()
      return m, (freeze(m.init(jax.random.key(0), X)), X)

    def linen_no_variables():
      return Mlp(), (X,)

    def linen_bound():
      return Mlp().bind(Mlp().init(jax.random.key(0), X)), (X,)

    def linen_bound_method():
      return Mlp().bind(Mlp().init(jax.random.key(0), X)).squashed, (X,)

    def own_matmul():
      return Net(nnx.Rngs(0)).own_matmul, (X,)

    def nothing():
      return Net(nnx.Rngs(0)).nothing, (X,)
    """)

# Imported by the model file when it should be slow to import (the terminal test).
SLOW = "import time\ntime.sleep(4)\nfrom ownmodel import *\n"


@pytest.fixture(autouse=True, scope="module")
def _compilation_cache_dir(tmp_path_factory):
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("JAXPREC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield


@pytest.fixture(scope="module")
def project_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("own")
  (path / "ownmodel.py").write_text(MODEL)
  (path / "slowmodel.py").write_text(SLOW)
  yield path
  sys.modules.pop("ownmodel", None)


@pytest.fixture
def project(project_dir, monkeypatch):
  monkeypatch.chdir(project_dir)
  monkeypatch.setattr(sys, "path", [str(project_dir), *sys.path])
  return project_dir


def cli(*argv, cwd, env=None, **kw):
  """``python -m jaxprec ARGV`` in a subprocess: (exit status, stdout, stderr)."""
  full = {k: v for k, v in os.environ.items()
          if k not in ("JAX_DEFAULT_MATMUL_PRECISION", "JAXPREC_POLICY")}
  full.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **(env or {}))
  r = subprocess.run([sys.executable, "-m", "jaxprec", *argv], cwd=cwd,
                     env=full, capture_output=True, text=True, timeout=600, **kw)
  return r.returncode, r.stdout, r.stderr


# -- check --modules -----------------------------------------------------------


def test_check_modules_nnx_checks_every_submodule_in_order(project):
  rc, out, err = cli("check", "ownmodel.py:model", "--modules", "--precisions",
                     "bfloat16,bfloat16_3x", "--json", "--out", "r1", cwd=project)
  assert rc == 0, err
  d = json.loads(out)
  names = [l["name"] for l in d["layers"]]
  assert names[:4] == ["embed", "blocks/0/up", "blocks/0/down", "blocks/0"]
  assert {"blocks/1", "head", "output"} <= set(names)
  # Every submodule diverges at bfloat16 and far less at bfloat16_3x.
  for layer in d["layers"]:
    m = layer["metrics"]
    assert m["bfloat16"]["rel_rms"] > 100 * m["bfloat16_3x"]["rel_rms"], layer
  assert json.loads((project / "r1" / "report.json").read_text())["layers"]


def test_check_modules_method_and_linen_forms(project, capsys):
  """A bound NNX method, a jitted linen apply and a linen module work."""
  rc, out, err = run(capsys, "check", "ownmodel:encode", "--modules",
                     "--precisions", "bf16", "--json", "--out", "r2")
  assert rc == 0, err
  names = [l["name"] for l in json.loads(out)["layers"]]
  assert names[0] == "embed" and not {"head", "blocks/0"} & set(names), names
  for target in ("ownmodel:linen_apply", "ownmodel:linen_module"):
    rc, out, err = run(capsys, "check", target, "--modules", "--precisions",
                       "bf16", "--json", "--out", "r3")
    assert rc == 0, err
    names = [l["name"] for l in json.loads(out)["layers"]]
    assert names[:2] == ["dense1", "dense2"], (target, names)


def test_check_modules_takes_a_bound_linen_module(project, capsys):
  """model.bind(variables) was refused: its variables are used."""
  for target, last in (("ownmodel:linen_bound", "output"),
                       ("ownmodel:linen_bound_method", "output.squashed")):
    for modules in ((), ("--modules",)):
      rc, out, err = run(capsys, "check", target, *modules, "--precisions",
                         "bf16", "--json", "--out", "r6")
      assert rc == 0, (target, modules, err)
      names = [l["name"] for l in json.loads(out)["layers"]]
      if modules:
        assert names[:2] == ["dense1", "dense2"] and names[-1] == last, names
  import ownmodel  # noqa: PLC0415
  bound, (x,) = ownmodel.linen_bound()
  r = jaxprec.check_module(bound, x, precisions="bf16")
  _, variables = bound.unbind()
  same = jaxprec.check_module(bound.clone(parent=None), variables, x,
                              precisions="bf16")
  assert r.metric("rel_rms") == same.metric("rel_rms")
  assert [l.name for l in r.layers] == [l.name for l in same.layers]


def test_check_modules_takes_frozen_linen_variables(project, capsys):
  """Variables in a FrozenDict (flax.core.freeze) were refused."""
  rows = []
  for target in ("ownmodel:linen_module", "ownmodel:linen_frozen"):
    rc, out, err = run(capsys, "check", target, "--modules", "--precisions",
                       "bf16", "--json", "--out", "r8")
    assert rc == 0, (target, err)
    rows.append([(l["name"], l["metrics"]) for l in json.loads(out)["layers"]])
  assert rows[0] == rows[1] and rows[0][0][0] == "dense1"


def test_check_modules_of_a_method_checks_its_own_output(project, capsys):
  """A method that calls no submodule gave no row (and an unclear error):
  its own output is a row; a method with no output at all is named."""
  rc, out, err = run(capsys, "check", "ownmodel:own_matmul", "--modules",
                     "--precisions", "bf16", "--json", "--out", "r7")
  assert rc == 0, err
  assert [l["name"] for l in json.loads(out)["layers"]] == ["output.own_matmul"]
  rc, out, err = run(capsys, "check", "ownmodel:nothing", "--modules",
                     "--precisions", "bf16", "--out", "r8")
  one_line_error(rc, err, 1, "Net.nothing gave no output to check",
                 "calls no submodule and returns no array")


def test_check_modules_exit_1_past_the_tolerance(project, capsys):
  rc, out, err = run(capsys, "check", "ownmodel:model", "--modules",
                     "--precisions", "bfloat16", "--atol", "1e-6", "--out", "r4")
  one_line_error(rc, err, 1, "outside atol=1e-06", "bfloat16: embed needs atol")
  assert "model: ownmodel:model (every submodule)" in out


@pytest.mark.parametrize("target, fragments", [
    ("ownmodel:merged", ["'merged.<locals>.fn' as fn, not a Flax module",
                         "nnx.merge(graphdef, state)", "(model, (x,)) for NNX"]),
    ("ownmodel:plain", ["not a Flax module", "return the model itself"]),
    ("ownmodel:linen_no_variables", ["returned a linen Mlp",
                                     "return model, (variables, x)"]),
])
def test_check_modules_refuses_what_is_not_a_module(project, capsys, target,
                                                    fragments):
  rc, out, err = run(capsys, "check", target, "--modules", "--out", "r5")
  one_line_error(rc, err, 2, "--modules: ", *fragments)
  assert out == "" and not (project / "r5").exists()


def test_check_modules_is_for_your_own_model(project, capsys):
  rc, _, err = run(capsys, "check", "--model", "bert", "--modules")
  one_line_error(rc, err, 2, "--modules applies to MODULE:FUNCTION",
                 "--model bert")


# -- no model, two models ------------------------------------------------------


def test_check_without_a_model_names_every_choice(project, capsys):
  rc, _, err = run(capsys, "check")
  one_line_error(rc, err, 2, "check needs a model: --model NAME (one of "
                 "wav2vec2, bert, llama, hf-wav2vec2, hf-bert, hf-llama)",
                 "MODULE:FUNCTION for your own model", "(fn, args)")
  rc, _, err = run(capsys, "check", "ownmodel:model", "--model", "llama")
  one_line_error(rc, err, 2, "check takes one model: --model llama or "
                 "ownmodel:model, not both")


def test_search_takes_llama(project, capsys):
  rc, _, err = run(capsys, "search", "--model", "llama", "--tolerance", "-1")
  one_line_error(rc, err, 2, "tolerance must be a finite number >= 0")
  rc, out, err = run(capsys, "search", "--model", "llama", "--tolerance", "1",
                     "--budget", "1")
  assert rc == 0, err
  assert "model: llama (tiny, seed 0)" in out
  assert "policy: default=bfloat16" in out


# -- Flax modules without module paths ----------------------------------------


def test_audit_warns_when_flax_modules_have_no_paths(project, capsys):
  rc, out, err = run(capsys, "audit", "ownmodel:merged")
  assert rc == 0, err
  warned = [l for l in unfolded(err).splitlines()
            if l.startswith("jaxprec: warning:")]
  assert len(warned) == 1, err
  for fragment in ("6 of the 6 matmuls", "Flax modules (Linear)",
                   "nnx.merge(graphdef, state)(x)",
                   "return the module itself as the function"):
    assert fragment in warned[0]
  for target in ("ownmodel:model", "ownmodel:plain", "ownmodel:linen_apply"):
    rc, out, err = run(capsys, "audit", target)
    assert rc == 0 and "warning" not in err, (target, err)


def test_search_warns_when_it_sees_one_unit_of_many_modules(project, capsys):
  rc, out, err = run(capsys, "search", "ownmodel:merged", "--tolerance", "1")
  assert rc == 0, err
  assert "module paths: 1 at" in out
  warned = [l for l in unfolded(err).splitlines()
            if l.startswith("jaxprec: warning:")]
  assert len(warned) == 1 and "jaxprec.search_policy: 6 of the 6" in warned[0]
  assert "return the module itself as the function" in warned[0]
  rc, out, err = run(capsys, "search", "ownmodel:model", "--tolerance", "1")
  assert rc == 0, err
  assert "module paths: 6 at" in out and "warning" not in err


def test_search_policy_warns_in_python_too(project):
  import ownmodel  # pylint: disable=import-outside-toplevel
  fn, args = ownmodel.merged()
  with pytest.warns(UserWarning, match="hides its submodules"):
    jaxprec.search_policy(fn, *args, tolerance=1.0, verbose=False)


# -- progress ------------------------------------------------------------------


def test_piped_check_prints_a_line_per_phase_as_it_starts(project):
  """stderr is a pipe: one line per phase, each flushed when it begins."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_DEFAULT_MATMUL_PRECISION", "JAXPREC_POLICY")}
  env.update(JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxprec", "check", "ownmodel.py:model",
       "--precisions", "bfloat16,bfloat16_3x", "--out", "r6"],
      cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  arrived = []
  for line in proc.stderr:
    arrived.append((time.monotonic(), line.rstrip("\n")))
  proc.wait(timeout=600)
  end = time.monotonic()
  assert proc.returncode == 0, arrived
  lines = [l for _, l in arrived]
  assert lines[:4] == [
      "jaxprec check: importing ownmodel.py:model",
      "jaxprec check: reference at float32",
      "jaxprec check: compiling+running bfloat16 (1/2)",
      "jaxprec check: compiling+running bfloat16_3x (2/2)"], lines
  assert lines[4].startswith("jaxprec check: done in ") and lines[4].endswith(" s")
  assert lines[5].startswith("wrote r6")
  assert "\r" not in "".join(lines)
  # Each line came when its phase began, not all at the end.
  assert arrived[0][0] < arrived[4][0] - 0.5 and arrived[0][0] < end - 0.5


def test_terminal_shows_a_status_line_before_the_model_is_imported(project):
  """stderr is a terminal of 100 columns: the status line is on screen while
  the model's module is still importing (it sleeps 4 s), then cleared."""
  pty = pytest.importorskip("pty")
  import fcntl  # pylint: disable=import-outside-toplevel
  import struct  # pylint: disable=import-outside-toplevel
  import termios  # pylint: disable=import-outside-toplevel
  leader, follower = pty.openpty()
  fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_DEFAULT_MATMUL_PRECISION", "JAXPREC_POLICY")}
  env.update(JAX_PLATFORMS="cpu", COLUMNS="100")
  start = time.monotonic()
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxprec", "check", "slowmodel.py:model",
       "--precisions", "bfloat16", "--out", "r7"],
      cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=follower)
  os.close(follower)
  seen = []

  def on_chunk(screen):
    if not seen and b"importing slowmodel.py:model" in screen:
      seen.append(time.monotonic())
  screen = read_terminal(leader, on_chunk=on_chunk)
  first = seen[0] if seen else None
  proc.wait(timeout=600)
  end = time.monotonic()
  text = screen.decode(errors="replace")
  assert proc.returncode == 0, text
  # The launcher's line, before JAX imports (python -m jaxprec too), then
  # the command's own.
  assert text.startswith("\rjaxprec check: starting...\x1b[K\r\x1b[K\r"
                         "jaxprec check: checking the arguments..."), text[:200]
  assert first is not None, text[:300]
  assert end - first > 4  # shown while the import sleeps, not after it
  print(f"status line after {first - start:.2f} s; command ran {end - start:.1f} s")
  # Cleared before the check's own progress: no status text left on a line.
  assert "\r\x1b[K" in text


# -- run --policy and policy_from_env ------------------------------------------


def test_policy_from_env_reads_what_run_policy_passes(project):
  code = "import jaxprec; print(repr(jaxprec.policy_from_env()))"
  rc, out, err = cli("run", "--policy", "default=bf16,head=fp32", "--",
                     sys.executable, "-c", code, cwd=project)
  assert rc == 0, err
  assert out.strip() == "jaxprec.Policy.parse('default=bfloat16,head=float32')"
  assert jaxprec.policy_from_env({}) is None
  assert jaxprec.policy_from_env({"JAXPREC_POLICY": " "}) is None
  p = jaxprec.policy_from_env({"JAXPREC_POLICY": "default=bfloat16,head=float32"})
  assert p == jaxprec.Policy.parse("default=bf16,head=float32")


def test_policy_from_env_names_a_bad_value(monkeypatch):
  monkeypatch.setenv("JAXPREC_POLICY", "default=bfloat61")
  with pytest.raises(ValueError) as e:
    jaxprec.policy_from_env()
  message = str(e.value)
  assert message.startswith("JAXPREC_POLICY='default=bfloat61' is not a "
                            "jaxprec policy")
  assert "Did you mean 'bfloat16'?" in message


# -- the audit header of a decorated function ----------------------------------


X = jax.ShapeDtypeStruct((8, 16), jnp.float32)
W = jax.ShapeDtypeStruct((16, 4), jnp.float32)


@jaxprec.precision("float32")
def f(x, w):
  return x @ w


@jaxprec.precision("bfloat16")  # the inner scope is entered last: it wins
@jaxprec.precision("BF16_BF16_F32_X3")
def g(x, w):
  return x @ w


def test_audit_header_names_the_decorators_precision():
  for fn in (f, jax.jit(f)):
    report = jaxprec.audit(fn, X, W)
    assert report.precision_in_force == "float32 (@jaxprec.precision on f)"
    assert str(report).splitlines()[0] == (
        "jaxprec audit of f, traced at precision float32 "
        "(@jaxprec.precision on f)")
    assert report.rows[0].precision_name == "HIGHEST"

  report = jaxprec.audit(g, X, W)
  assert report.precision_in_force.startswith("BF16_BF16_F32_X3 (")
  assert report.rows[0].precision_name == "BF16_BF16_F32_X3"

  def h(x, w):
    return x @ w
  with jaxprec.precision("bf16"):
    assert jaxprec.audit(h, X, W).precision_in_force == "bfloat16 (context)"


def test_cli_audit_header_of_a_decorated_function(tmp_path):
  (tmp_path / "deco.py").write_text(textwrap.dedent("""\
      import jax, jax.numpy as jnp, jaxprec

      @jaxprec.precision("float32")
      def f(x, w):
        return x @ w

      def target():
        x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
        w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
        return jax.jit(f), (x, w)
      """))
  rc, out, err = cli("audit", "deco.py:target", cwd=tmp_path)
  assert rc == 0, err
  assert out.splitlines()[0] == ("jaxprec audit of f, traced at precision "
                                 "float32 (@jaxprec.precision on f)")


# -- search --modules -----------------------------------------------------------


@pytest.mark.parametrize("target, plain", [
    ("ownmodel:model", "ownmodel:model"),
    ("ownmodel:linen_module", "ownmodel:linen_apply")])
def test_search_modules_keeps_every_submodule_within_the_tolerance(
    project, capsys, target, plain):
  """As check --modules: every submodule's output is a layer the policy must
  keep within --tolerance, named by its module path."""
  rc, out, err = run(capsys, "search", target, "--modules", "--tolerance",
                     "2e-3", "--json")
  assert rc == 0, err
  d = json.loads(out)
  layers = set(d["values"])
  want = ({"embed", "blocks/0/up", "blocks/0/down", "blocks/0", "blocks/1",
           "head", "output"} if "linen" not in target
          else {"dense1", "dense2", "output"})
  assert want <= layers, layers
  assert all(v <= 2e-3 for v in d["values"].values()), d["values"]
  # Without it: the final output alone ("1 layer").
  rc, out, err = run(capsys, "search", plain, "--tolerance", "2e-3", "--json")
  assert rc == 0, err
  assert set(json.loads(out)["values"]) == {"output"}
  # The policy it prints is the model's own paths: check agrees with it.
  policy = d["policy"]
  rc, out, err = run(capsys, "check", target, "--modules", "--precisions",
                     "float32", "--policy", policy, "--json", "--out", "rep")
  assert rc == 0, err
  report = json.loads(out)
  assert set(l["name"] for l in report["layers"]) == layers


def test_search_modules_is_refused_with_a_built_in_model(capsys):
  rc, _, err = run(capsys, "search", "--model", "bert", "--modules",
                   "--tolerance", "1e-3")
  one_line_error(rc, err, 2, "--modules applies to MODULE:FUNCTION")
