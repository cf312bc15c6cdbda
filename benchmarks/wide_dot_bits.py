"""Whether XLA's dot library gives the blocks of a stacked bfloat16 dot the
bits of the dots of its parts, on this jaxlib and CPU.

The bf16 kernel runs the passes of a small X6 or X9 dot as one dot per rhs
part, of the lhs parts it pairs with stacked along M, each pass a block of
the product (``emulated_ops._grouped_passes``). That keeps the bits only
where the library sums every block as it sums the part's dot run alone. This
script measures it over a grid of shapes (M, K, N from 8 up, K up to 3072, 2
and 3 parts, random bfloat16 values), stacked along M (what runs) and, for
comparison, the rhs parts side by side along N too (one wider dot), and
prints each shape whose blocks differ. Measured on an AMD EPYC with
AVX512-BF16 (jaxlib 0.10.2): none differ stacked along M; side by side along
N, K over 2048 with a narrow N does (XLA:CPU blocks K by N). On jaxlib 0.12.1
both differ in some shapes: its sums depend on the whole shape.

Usage: python benchmarks/wide_dot_bits.py [--seed N] [--quick]
Exit status 0 where every block stacked along M kept its bits, 1 otherwise.
"""

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np
from jax import lax

DN = (((1,), (0,)), ((), ()))
DIMS = (8, 9, 12, 15, 16, 17, 24, 31, 32, 64, 128)
KS = (8, 16, 17, 24, 32, 64, 256, 768, 3072)


def differing(dot, rng, m: int, k: int, n: int, parts: int,
              wide: bool) -> int:
  """Elements of the stacked dot's blocks that differ from the parts' dots:
  the lhs parts stacked along M, and with ``wide`` the rhs parts side by
  side along N as well."""
  a = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
       for _ in range(parts)]
  b = [jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
       for _ in range(parts)]
  rhs = range(parts) if wide else range(1)
  out = np.asarray(dot(jnp.concatenate(a, 0),
                       jnp.concatenate([b[j] for j in rhs], 1)))
  bad = 0
  for i, j in itertools.product(range(parts), rhs):
    alone = np.asarray(dot(a[i], b[j])).view(np.uint32)
    block = out[i * m:(i + 1) * m, j * n:(j + 1) * n].view(np.uint32)
    bad += int((alone != block).sum())
  return bad


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true",
                      help="three shapes: a smoke test, not a measurement")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(args.seed)
  dot = jax.jit(lambda l, r: lax.dot_general(
      l, r, DN, preferred_element_type=jnp.float32))
  shapes = [s for s in itertools.product(DIMS, KS, DIMS)
            if s[0] * s[1] * s[2] * 9 <= 2**25]
  if args.quick:
    shapes = [(8, 24, 12), (16, 24, 20), (16, 17, 17)]
  print(f"jax {jax.__version__}, jaxlib {jaxlib.version.__version__}, "
        f"{jax.devices()[0].device_kind}: {len(shapes)} shapes x 2 and 3 parts")
  counts = {}
  for wide in (False, True):
    where = "side by side along N too" if wide else "stacked along M"
    bad = 0
    for (m, k, n), parts in itertools.product(shapes, (2, 3)):
      d = differing(dot, rng, m, k, n, parts, wide)
      if d:
        bad += 1
        print(f"  {where}: M={m} K={k} N={n}, {parts} parts: {d} of "
              f"{parts * (parts if wide else 1) * m * n} elements differ")
    counts[where] = bad
    print(f"{where}: {bad} of {2 * len(shapes)} cases differ")
  return 1 if counts["stacked along M"] else 0


if __name__ == "__main__":
  sys.exit(main())
