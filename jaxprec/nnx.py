"""Flax NNX modules that take jaxprec precisions and emulate TPU/GPU numerics.

Drop-in replacements for ``flax.nnx``'s modules of the same names (same
arguments, same state), whose ``precision=`` accepts any jaxprec name and which
compute as a TPU or GPU does with ``emulate=True``. Importing this module
imports Flax. See ``docs/modules.md``.
"""

from jaxprec._src.modules.nnx import Conv
from jaxprec._src.modules.nnx import ConvTranspose
from jaxprec._src.modules.nnx import Einsum
from jaxprec._src.modules.nnx import Linear
from jaxprec._src.modules.nnx import LinearGeneral
from jaxprec._src.modules.nnx import MultiHeadAttention

__all__ = (
    "Conv",
    "ConvTranspose",
    "Einsum",
    "Linear",
    "LinearGeneral",
    "MultiHeadAttention",
)
