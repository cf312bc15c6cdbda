"""The built-in port checks (jaxprec.torch.port) through port_check: the
tiny transformers BERT and jaxprec's NNX port of it, with its weights."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jaxprec.torch as jt  # noqa: E402


def test_the_builtin_bert_port_has_no_suspect():
  port = jt.port("hf-bert", seed=0)
  jax_inputs = tuple(port.inputs.values())
  torch_inputs = tuple(v.astype(np.int64) if np.issubdtype(v.dtype, np.integer)
                       else v for v in jax_inputs)
  r = jt.port_check(port.model, port.torch_model, *jax_inputs,
                    torch_inputs=torch_inputs)
  assert r.suspects() == []
  layer = r.layer("encoder/layer/1/attention")
  assert r.alignment[layer.name] == "encoder.layer.1.attention"
  assert layer.floor < 1e-5 and layer.local["bfloat16"] > 1e-4
  assert len(r.alignment) > 20
