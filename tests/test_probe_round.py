"""Probes of search_policy's tensor_cores=, port_check's layouts= and
check's tpu_matvec_f32=.

Each test failed before its fix: search_policy's errors for a bad
``tensor_cores`` named ``chip=`` (the search's roofline chip, another
argument); ``layouts`` took a permutation of strings with a bare
``'<' not supported`` TypeError, took booleans and floats as axes, refused
a NumPy integer array and silently permuted nothing where the permutation's
length matched no array of the layers its pattern names; ``jaxprec.check``
refused a NumPy bool for ``tpu_matvec_f32`` that ``jaxprec.emulate`` takes.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxprec


def _fn(x, w):
  return jnp.tanh(x @ w)


X, W = np.ones((2, 8), np.float32), np.ones((8, 4), np.float32)


def test_search_errors_for_tensor_cores_name_tensor_cores():
  with pytest.raises(ValueError, match=r"tensor_cores.*'tpu-v5e'.*'h100'"):
    jaxprec.search_policy(_fn, X, W, tolerance=1e-2, target="gpu",
                          tensor_cores="tpu-v5e", verbose=False)
  with pytest.raises(ValueError,
                     match=r"^tensor_cores='h100' names an NVIDIA GPU.*"
                           r"target='gpu'"):
    jaxprec.search_policy(_fn, X, W, tolerance=1e-2, target="tpu",
                          tensor_cores="h100", verbose=False)
  # jaxprec.emulate and jaxprec.check keep naming chip=.
  with pytest.raises(ValueError, match=r"^chip='h100' names an NVIDIA GPU"):
    jaxprec.check(_fn, X, W, target="tpu", chip="h100")


@pytest.fixture(scope="module")
def conv():
  pytest.importorskip("torch")
  import torch  # noqa: PLC0415
  from test_port_check import JConv, TConv  # noqa: PLC0415
  torch.manual_seed(0)
  t = TConv().eval()
  x = np.random.default_rng(0).normal(size=(2, 10, 3)).astype(np.float32)
  return JConv, t, x, (x.transpose(0, 2, 1),)


@pytest.mark.parametrize("perm", [(0, 2, "1"), (0, 2, None), (True, False),
                                  (0.0, 2.0, 1.0), ()])
def test_layouts_refuse_axes_that_are_not_integers(conv, perm):
  import jaxprec.torch as jt  # noqa: PLC0415
  jconv, t, x, ncw = conv
  with pytest.raises(ValueError, match=r"layouts\['conv'\] = .* is no axes "
                                       r"permutation"):
    jt.port_check(jconv(t), t, x, torch_inputs=ncw, layouts={"conv": perm},
                  precisions="float32")


@pytest.mark.parametrize("perm", [(1, 0), (0, 3, 2, 1)])
def test_layouts_refuse_a_permutation_that_fits_no_array(conv, perm):
  import jaxprec.torch as jt  # noqa: PLC0415
  jconv, t, x, ncw = conv
  with pytest.raises(ValueError, match=rf"layouts\['conv'\] = .* permutes "
                                       rf"arrays of {len(perm)} axes.*3"):
    jt.port_check(jconv(t), t, x, torch_inputs=ncw, layouts={"conv": perm},
                  precisions="float32")


def test_layouts_take_an_integer_array(conv):
  import jaxprec.torch as jt  # noqa: PLC0415
  jconv, t, x, ncw = conv
  r = jt.port_check(jconv(t), t, x, torch_inputs=ncw,
                    layouts={"conv": np.array([0, 2, 1])},
                    precisions="float32")
  assert r.alignment["conv"] == "conv"


def test_check_takes_a_numpy_bool_for_tpu_matvec_f32_as_emulate_does():
  w, v = np.full((4, 8), 1 + 2.0**-10, np.float32), np.ones(8, np.float32)
  matvec = lambda w, v: w @ v  # noqa: E731
  dot = jaxprec.emulate(matvec, "bfloat16", target="tpu",
                        tpu_matvec_f32=np.False_)(w, v)
  r = jaxprec.check(matvec, w, v, precisions="bfloat16",
                    tpu_matvec_f32=np.False_)
  plain = jaxprec.check(matvec, w, v, precisions="bfloat16",
                        tpu_matvec_f32=False)
  assert np.asarray(dot)[0] == 8.0  # one bfloat16 pass: 1 + 2**-10 -> 1
  got, want = json.loads(r.to_json()), json.loads(plain.to_json())
  assert got["layers"] == want["layers"] and got["notes"] == want["notes"]
  assert any("tpu_matvec_f32=False" in n for n in got["notes"])
  with pytest.raises(TypeError, match="tpu_matvec_f32 must be True or False"):
    jaxprec.check(matvec, w, v, tpu_matvec_f32=0)
