"""Built-in models to check: Wav2Vec2, BERT and Llama-style models.

Randomly initialised from a seed, nothing downloaded, or with the weights of
their PyTorch originals (``from_pytorch=``: transformers' ``Wav2Vec2Model``,
``BertModel``, ``LlamaModel``). The NNX models (:class:`Wav2Vec2Model`,
:class:`BertModel`, :class:`LlamaModel`, :class:`LlamaForCausalLM`) mirror
the PyTorch module trees; :class:`Wav2Vec2Encoder` and :class:`BertEncoder`
are their flax.linen counterparts, behind the random ``wav2vec2()`` and
``bert()``. Importing this module imports Flax (``import jaxprec`` alone does
not).

Examples:
  >>> import jaxprec, jaxprec.models
  >>> fn, args = jaxprec.models.bert("tiny")
  >>> report = jaxprec.check(fn, *args, precisions=["bfloat16"])
  >>> report.layers[0].name
  'hidden_states[0]'
"""

from jaxprec._src.models.encoders import BertConfig
from jaxprec._src.models.encoders import BertEncoder
from jaxprec._src.models.encoders import Wav2Vec2Config
from jaxprec._src.models.encoders import Wav2Vec2Encoder
from jaxprec._src.models.encoders import synthetic_audio
from jaxprec._src.models.encoders import synthetic_tokens
from jaxprec._src.models.builders import bert
from jaxprec._src.models.builders import llama
from jaxprec._src.models.builders import wav2vec2
from jaxprec._src.models.llama import LlamaConfig
from jaxprec._src.models.llama import LlamaForCausalLM
from jaxprec._src.models.llama import LlamaModel
from jaxprec._src.models.nnx_bert import BertModel
from jaxprec._src.models.nnx_wav2vec2 import Wav2Vec2Model

from jaxprec._src.models.builders import MODELS

__all__ = (
    "BertConfig",
    "BertEncoder",
    "BertModel",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "MODELS",
    "Wav2Vec2Config",
    "Wav2Vec2Encoder",
    "Wav2Vec2Model",
    "bert",
    "llama",
    "synthetic_audio",
    "synthetic_tokens",
    "wav2vec2",
)
