"""Emulation on any backend: rounding to bfloat16/TF32/float16 (``rounding``),
the passes of each algorithm (``passes``) on the kernel the CPU's features
choose (``kernels``), the emulated ``dot_general`` and
``conv_general_dilated`` with their derivatives (``emulated_ops``),
bfloat16/float16 compute (``dtype_emulation``), :func:`jaxprec.emulate`
(``emulate``) and JAX's persistent
compilation cache (``compile_cache``).

Never imports Flax: Flax models reach it through :mod:`jaxprec._src.flax`,
which imports Flax only when given a Flax object.
"""
