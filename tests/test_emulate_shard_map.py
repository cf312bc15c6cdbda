"""jaxprec.emulate inside shard_map: sharded and partially replicated specs, collectives.

Several host devices are needed, and the suite's process has one: the checks run
in a subprocess started with ``--xla_force_host_platform_device_count=4``.
"""

import os
import subprocess
import sys
import textwrap

_CHECKS = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxprec
    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal((6, 4)).astype(np.float32)
    emulate = lambda f: jaxprec.emulate(f, "bfloat16", target="tpu")
    mm = emulate(lambda u, v: u @ v)  # the same math, emulated on one shard
    line = Mesh(np.array(jax.devices()), ("x",))
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))

    def checks(check):
      def smap(f, mesh, in_specs, out_specs):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs,
                             out_specs=out_specs, check_vma=check)

      # Rows sharded over x, the rhs replicated: each shard's emulated matmul.
      f = smap(lambda u, v: u @ v, line, (P("x"), P()), P("x"))
      want = np.concatenate([mm(a[2 * i:2 * i + 2], b) for i in range(4)])
      for g in (emulate(f), jax.jit(emulate(f))):
        np.testing.assert_array_equal(g(a, b), want)
      assert not np.array_equal(want, a @ b)
      # ... and its gradient: the shards' emulated transposed matmuls.
      loss = lambda h: lambda u, v: jnp.sin(h(u, v)).sum()
      ga, gb = jax.jit(jax.grad(loss(emulate(f)), (0, 1)))(a, b)
      wa, wb = jax.jit(jax.grad(loss(mm), (0, 1)))(a, b)
      np.testing.assert_array_equal(ga, wa)
      np.testing.assert_allclose(gb, wb, rtol=1e-6, atol=1e-6)

      # Partially replicated: the lhs over x (replicated over y), the rhs over y.
      f = smap(lambda u, v: u @ v, grid, (P("x", None), P(None, "y")),
               P("x", "y"))
      want = np.block([[mm(a[4 * i:4 * i + 4], b[:, 2 * j:2 * j + 2])
                        for j in range(2)] for i in range(2)])
      np.testing.assert_array_equal(emulate(f)(a, b), want)

      # The contraction sharded, partial products summed by psum.
      f = smap(lambda u, v: jax.lax.psum(u @ v, "x"), line,
               (P(None, "x"), P("x")), P())
      got = np.asarray(emulate(f)(a[:, :4], b[:4]), np.float64)
      parts = sum(np.asarray(mm(a[:, i:i + 1], b[i:i + 1]), np.float64)
                  for i in range(4))
      np.testing.assert_allclose(got, parts, rtol=1e-6, atol=1e-6)

      # all_gather of the lhs rows, then the whole matmul on every device (under
      # check_vma the gathered value varies over x: one output block each).
      f = smap(lambda u, v: jax.lax.all_gather(u, "x", tiled=True) @ v, line,
               (P("x"), P()), P("x") if check else P())
      np.testing.assert_array_equal(emulate(f)(a, b),
                                    np.tile(mm(a, b), (4 if check else 1, 1)))

      # The emulated op called inside the body itself (not through emulate):
      # a sharded and a replicated operand, forward, reverse and forward mode.
      dn = (((1,), (0,)), ((), ()))
      op = lambda u, v: jaxprec.emulated_dot_general(u, v, dn, "bfloat16")
      f = smap(op, line, (P("x"), P()), P("x"))
      want = np.concatenate([op(a[2 * i:2 * i + 2], b) for i in range(4)])
      np.testing.assert_array_equal(jax.jit(f)(a, b), want)
      ga, gb = jax.jit(jax.grad(loss(f), (0, 1)))(a, b)
      wa, wb = jax.jit(jax.grad(loss(op), (0, 1)))(a, b)
      np.testing.assert_array_equal(ga, wa)
      np.testing.assert_allclose(gb, wb, rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(jax.jvp(f, (a, b), (a, b))[1],
                                 jax.jvp(op, (a, b), (a, b))[1],
                                 rtol=1e-6, atol=1e-6)

    for check in (True, False):  # check_vma both ways
      checks(check)
    print("ok")
""")


def test_emulate_inside_sharded_shard_map():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  r = subprocess.run([sys.executable, "-c", _CHECKS], env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().endswith("ok")
