"""The precision-aware linen and NNX layers and ``swap``, on the hook of
:mod:`jaxprec._src.flax`.
"""
