"""Probes of search_policy's tensor_cores= and port_check's layouts=.

Each test failed before its fix: search_policy's errors for a bad
``tensor_cores`` named ``chip=`` (the search's roofline chip, another
argument), and ``layouts`` took a permutation of strings with a bare
``'<' not supported`` TypeError, took booleans and floats as axes, and
silently permuted nothing where the permutation's length matched no array
of the layers its pattern names.
"""

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
