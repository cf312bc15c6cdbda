"""Built-in models to check: Wav2Vec2-style and BERT-style encoders.

Randomly initialised from a seed, nothing downloaded. Importing this module
imports Flax (``import jaxprec`` alone does not).

Examples:
  >>> import jaxprec, jaxprec.models
  >>> fn, args = jaxprec.models.bert("tiny")
  >>> report = jaxprec.check(fn, *args, precisions=["bfloat16"])
  >>> report.layers[0].name
  'hidden_states[0]'
"""

from jaxprec._src.models.bert import BertConfig
from jaxprec._src.models.bert import BertEncoder
from jaxprec._src.models.bert import bert
from jaxprec._src.models.bert import synthetic_tokens
from jaxprec._src.models.wav2vec2 import Wav2Vec2Config
from jaxprec._src.models.wav2vec2 import Wav2Vec2Encoder
from jaxprec._src.models.wav2vec2 import synthetic_audio
from jaxprec._src.models.wav2vec2 import wav2vec2

MODELS = {"bert": bert, "wav2vec2": wav2vec2}

__all__ = (
    "BertConfig",
    "BertEncoder",
    "MODELS",
    "Wav2Vec2Config",
    "Wav2Vec2Encoder",
    "bert",
    "synthetic_audio",
    "synthetic_tokens",
    "wav2vec2",
)
