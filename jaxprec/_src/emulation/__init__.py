"""Emulation on any backend: rounding, passes, kernels, emulated ops,
``emulate``. Never imports Flax.
"""
