"""Flax linen modules that take jaxprec precisions and emulate TPU/GPU numerics.

Drop-in replacements for ``flax.linen``'s modules of the same names (same
fields, same variables), whose ``precision=`` accepts any jaxprec name and
which compute as a TPU or GPU does with ``emulate=True``. Importing this module
imports Flax. See ``docs/modules.md``.
"""

from jaxprec._src.modules.linen import Conv
from jaxprec._src.modules.linen import ConvTranspose
from jaxprec._src.modules.linen import Dense
from jaxprec._src.modules.linen import DenseGeneral
from jaxprec._src.modules.linen import Einsum
from jaxprec._src.modules.linen import MultiHeadDotProductAttention

__all__ = (
    "Conv",
    "ConvTranspose",
    "Dense",
    "DenseGeneral",
    "Einsum",
    "MultiHeadDotProductAttention",
)
