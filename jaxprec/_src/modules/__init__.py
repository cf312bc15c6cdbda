"""What users put in their Flax models: the precision-aware linen and NNX
layers (``linen``, ``nnx``) and :func:`jaxprec.swap` (``swap``), all on the
one per-module hook of :mod:`jaxprec._src.flax`.
"""
