"""The built-in models by the names ``jaxprec check --model`` takes."""

from __future__ import annotations

from jaxprec._src.models.builders import bert, llama, wav2vec2

MODELS = {"bert": bert, "llama": llama, "wav2vec2": wav2vec2}
