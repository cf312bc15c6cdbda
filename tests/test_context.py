"""jaxprec.precision as decorator and context manager; jaxprec.current."""

import re
import threading
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxprec
from conftest import lowered

P = lax.Precision


def dot_precisions(fn, *args):
  """The precision param of every dot_general/conv in fn's jaxpr, at any depth."""
  from jaxprec._src.jaxpr import walker
  return [w.eqn.params["precision"] for w in walker.iter_eqns(jax.make_jaxpr(fn)(*args))
          if w.eqn.primitive.name in ("dot_general", "conv_general_dilated")]


def mm(a, b):
  return a @ b


A = jnp.ones((4, 4), jnp.float32)


def conv_net(x, k, w):
  y = lax.conv_general_dilated(x, k, (1, 1), "SAME")
  return jnp.tanh(y.reshape(y.shape[0], -1) @ w)


X, K, W = jnp.ones((2, 3, 8, 8)), jnp.ones((4, 3, 3, 3)) / 9, jnp.ones((256, 5)) / 256


@pytest.mark.parametrize("spelling", ["float32", "fp32", "HIGHEST", P.HIGHEST])
def test_decorator_sets_level_for_plain_and_jitted(spelling):
  f = jaxprec.precision(spelling)(mm)
  assert dot_precisions(f, A, A) == [(P.HIGHEST, P.HIGHEST)]
  assert dot_precisions(jax.jit(f), A, A) == [(P.HIGHEST, P.HIGHEST)]  # jit outside
  g = jaxprec.precision(spelling)(jax.jit(mm))                          # jit inside
  assert dot_precisions(g, A, A) == [(P.HIGHEST, P.HIGHEST)]
  assert "precision = [HIGHEST, HIGHEST]" in lowered(f, A, A)
  assert jax.config.jax_default_matmul_precision is None


def test_undecorated_function_is_unaffected():
  assert dot_precisions(mm, A, A) == [None]
  assert "precision_config" not in lowered(mm, A, A) or "DEFAULT" in lowered(mm, A, A)


def test_context_manager_nested_and_restored():
  with jaxprec.precision("bf16") as p:
    assert p.name == "bfloat16" and p.source == "context"
    assert dot_precisions(mm, A, A) == [(P.DEFAULT, P.DEFAULT)]
    with jaxprec.precision("highest"):
      assert dot_precisions(mm, A, A) == [(P.HIGHEST, P.HIGHEST)]
      assert jaxprec.current().name == "float32"
    assert jaxprec.current().name == "bfloat16"
  assert jaxprec.current().source in ("backend-default", "env", "config")
  assert jax.config.jax_default_matmul_precision is None


def test_same_object_reentrant():
  ctx = jaxprec.precision("float32")
  with ctx:
    with ctx:
      assert jaxprec.current().name == "float32"
    assert jaxprec.current().name == "float32"
  assert jax.config.jax_default_matmul_precision is None


def test_exception_restores_state():
  @jaxprec.precision("float32")
  def boom(a):
    raise RuntimeError("inside")
  with pytest.raises(RuntimeError, match="inside"):
    boom(A)
  with pytest.raises(KeyError):
    with jaxprec.precision("bf16"):
      raise KeyError("x")
  assert jax.config.jax_default_matmul_precision is None
  assert jaxprec.current().source == "backend-default"


def test_threads_are_independent():
  barrier = threading.Barrier(2)
  seen = {}

  def worker(name, p):
    with jaxprec.precision(p):
      barrier.wait()
      seen[name] = (jaxprec.current().name, dot_precisions(mm, A, A))
      barrier.wait()

  ts = [threading.Thread(target=worker, args=("a", "bf16")),
        threading.Thread(target=worker, args=("b", "fp32"))]
  for t in ts:
    t.start()
  for t in ts:
    t.join()
  assert seen["a"] == ("bfloat16", [(P.DEFAULT, P.DEFAULT)])
  assert seen["b"] == ("float32", [(P.HIGHEST, P.HIGHEST)])
  assert jaxprec.current().source == "backend-default"


def test_under_grad_vmap_scan():
  f = jaxprec.precision("float32")(lambda a: jnp.sum(mm(a, a)))
  # grad: forward and the transposed dots all carry HIGHEST.
  ps = dot_precisions(jax.grad(f), A)
  assert ps and all(p == (P.HIGHEST, P.HIGHEST) for p in ps)
  ps = dot_precisions(jax.vmap(jaxprec.precision("float32")(mm)), A[None], A[None])
  assert ps == [(P.HIGHEST, P.HIGHEST)]

  def body(c, _):
    return jaxprec.precision("float32")(mm)(c, c), None
  ps = dot_precisions(lambda a: lax.scan(body, a, None, length=3)[0], A)
  assert ps == [(P.HIGHEST, P.HIGHEST)]


def test_preset_decorator_lowers_dots_with_preset_and_convs_at_highest():
  f = jaxprec.precision("F32_F32_F32")(conv_net)
  text = lowered(f, X, K, W)
  convs = re.findall(r"stablehlo.convolution.*", text)
  assert convs and all("precision HIGHEST" in c for c in convs)
  assert "precision DEFAULT" not in text
  dots = re.findall(r"stablehlo.dot_general.*", text)
  assert dots and all("lhs_precision_type = f32" in d for d in dots)
  # Plain JAX under the same preset shows the pitfall the decorator fixes.
  with jax.default_matmul_precision("F32_F32_F32"):
    plain = lowered(conv_net, X, K, W)
  assert "precision DEFAULT" in re.findall(r"stablehlo.convolution.*", plain)[0]
  # Same values (CPU ignores precision) and gradients flow.
  assert jnp.allclose(f(X, K, W), conv_net(X, K, W))
  g = jax.grad(lambda k: f(X, k, W).sum())(K)
  g_ref = jax.grad(lambda k: conv_net(X, k, W).sum())(K)
  assert jnp.allclose(g, g_ref)


def test_preset_decorator_with_jit_inside_and_outside_and_x3_level():
  for f in (jax.jit(jaxprec.precision("BF16_BF16_F32_X3")(conv_net)),
            jaxprec.precision("BF16_BF16_F32_X3")(jax.jit(conv_net))):
    text = lowered(f, X, K, W)
    conv = re.findall(r"stablehlo.convolution.*", text)[0]
    assert "precision HIGH>" in conv
    assert "num_primitive_operations = 3" in re.findall(r"stablehlo.dot_general.*", text)[0]


def test_preset_decorator_traces_once_per_signature_and_handles_static_args():
  calls = []

  @jaxprec.precision("F32_F32_F32")
  def f(x, k, w, *, scale=1.0):
    calls.append(1)
    return conv_net(x, k, w) * scale
  a = f(X, K, W, scale=2.0)
  b = f(X, K, W, scale=2.0)
  assert len(calls) == 1 and jnp.array_equal(a, b)
  c = f(X, K, W, scale=3.0)  # a new static value traces again
  assert len(calls) == 2 and jnp.allclose(c, a * 1.5)


def test_context_manager_warns_once_about_preset_convs():
  from jaxprec._src.core import context
  context._warned_presets.discard("F32_F32_F32")
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    with jaxprec.precision("F32_F32_F32"):
      pass
    with jaxprec.precision("F32_F32_F32"):
      pass
    with jaxprec.precision("BF16_BF16_F32"):  # conv at DEFAULT is what it means
      pass
  msgs = [str(w.message) for w in rec if issubclass(w.category, jaxprec.PresetConvWarning)]
  assert len(msgs) == 1
  assert "DEFAULT" in msgs[0] and "@jaxprec.precision('F32_F32_F32')" in msgs[0]


def test_decorating_a_non_callable_is_a_type_error():
  with pytest.raises(TypeError, match="decorates a callable; got 3"):
    jaxprec.precision("fp32")(3)


def test_bad_name_fails_at_construction():
  with pytest.raises(ValueError, match="Did you mean 'float32'"):
    jaxprec.precision("flaot32")


def test_backend_default_scope_clears_outer_setting():
  with jaxprec.precision("fp32"):
    with jaxprec.precision(None):
      assert dot_precisions(mm, A, A) == [None]
      assert jaxprec.current().name == "backend-default"
      assert jaxprec.current().source == "context"


# ---------------------------------------------------------------------------
# Preset decorator trace cache and outputs (item 11).


def test_preset_decorator_does_not_reuse_a_float32_trace_under_x64():
  f = jaxprec.precision("F32_F32_F32")(lambda x: x @ x + jnp.zeros(()))
  x = jnp.ones((2, 2), jnp.float32)
  assert f(x).dtype == jnp.float32
  with jax.enable_x64(True):
    y = f(x)
    fresh = jaxprec.precision("F32_F32_F32")(lambda x: x @ x + jnp.zeros(()))(x)
  assert y.dtype == fresh.dtype == jnp.float64
  assert f(x).dtype == jnp.float32


def test_preset_decorator_non_array_output_raises_as_jit_does():
  f = jaxprec.precision("F32_F32_F32")(lambda x: {"y": x @ x, "tag": "done"})
  with pytest.raises(TypeError, match=r"returned a value of type <class 'str'> "
                     r"at output\['tag'\], which is not a valid JAX type"):
    f(A)


# ---------------------------------------------------------------------------
# Generators and coroutines: each resumption in the scope.


def test_decorated_generator_runs_each_step_in_the_scope():
  @jaxprec.precision("float32")
  def gen(n):
    got = []
    for _ in range(n):
      sent = yield jaxprec.current().name, dot_precisions(mm, A, A)
      got.append(sent)
    return got

  g = gen(2)
  assert jaxprec.current().name == "backend-default"  # not entered at the call
  name, precs = next(g)
  assert name == "float32" and precs == [(P.HIGHEST, P.HIGHEST)]
  assert jaxprec.current().name == "backend-default"  # restored between steps
  with jaxprec.precision("bfloat16"):
    assert g.send("a")[0] == "float32"
    assert jaxprec.current().name == "bfloat16"
  with pytest.raises(StopIteration) as stop:
    g.send("b")
  assert stop.value.value == ["a", "b"]


def test_decorated_generator_throw_and_close_reach_the_body():
  seen = []

  @jaxprec.precision("tensorfloat32")
  def gen():
    try:
      yield 1
    except KeyError:
      seen.append(("caught", jaxprec.current().name))
      yield 2
    finally:
      seen.append(("closed", jaxprec.current().name))

  g = gen()
  next(g)
  assert g.throw(KeyError("k")) == 2
  g.close()
  assert seen == [("caught", "tensorfloat32"), ("closed", "tensorfloat32")]
  assert jax.config.jax_default_matmul_precision is None


def test_decorated_coroutine_awaits_in_the_scope_and_restores_between():
  import asyncio  # noqa: PLC0415

  @jaxprec.precision("float32")
  async def work():
    before = jaxprec.current().name
    await asyncio.sleep(0)
    return before, jaxprec.current().name, dot_precisions(mm, A, A)

  async def main():
    task = asyncio.ensure_future(work())
    await asyncio.sleep(0)  # work() is suspended: the scope is not ours
    between = jaxprec.current().name
    return between, await task

  between, (before, after, precs) = asyncio.run(main())
  assert (before, after, between) == ("float32", "float32", "backend-default")
  assert precs == [(P.HIGHEST, P.HIGHEST)]


def test_decorated_async_generator_runs_each_step_in_the_scope():
  import asyncio  # noqa: PLC0415

  @jaxprec.precision("bfloat16_3x")
  async def agen():
    for _ in range(2):
      await asyncio.sleep(0)
      yield jaxprec.current().name

  async def main():
    out = []
    async for name in agen():
      out.append((name, jaxprec.current().name))
    return out

  # bfloat16_3x is the HIGH level, named tensorfloat32.
  assert asyncio.run(main()) == [("tensorfloat32", "backend-default")] * 2


def test_preset_decorator_on_a_generator_applies_the_flag_and_warns():
  from jaxprec._src.core import context
  context._warned_presets.discard("BF16_BF16_F32_X3")

  with pytest.warns(jaxprec.PresetConvWarning):
    @jaxprec.precision("BF16_BF16_F32_X3")
    def gen():
      yield dot_precisions(mm, A, A)

  assert next(gen()) == [lax.DotAlgorithmPreset.BF16_BF16_F32_X3]


# ---------------------------------------------------------------------------
# asyncio: scopes follow JAX's thread-local config, so
# tasks interleaved on one thread see each other's `with` scopes (as with
# jax.default_matmul_precision itself). docs/precision.md says so.


@pytest.mark.parametrize("scope", [jaxprec.precision, jax.default_matmul_precision])
def test_interleaved_asyncio_tasks_share_the_threads_scope(scope):
  import asyncio  # noqa: PLC0415
  seen = {}

  async def a():
    with scope("float32"):
      await asyncio.sleep(0)  # b runs here, inside a's scope
      await asyncio.sleep(0)

  async def b():
    seen["b"] = jaxprec.current().name

  async def main():
    await asyncio.gather(a(), b())
    seen["after"] = jaxprec.current().name

  asyncio.run(main())
  assert seen == {"b": "float32", "after": "backend-default"}
