"""Ops that run natively under emulation are said in the report, by name.

A Pallas kernel (here in interpret mode, so that it runs on any backend) is
opaque to jaxprec: under emulation its matmul computes as this machine
computes it. ``check``, ``check_module`` and ``port_check`` say so in the
report's notes (text and JSON), not only in a Python warning, which logging
set-ups and notebooks drop.
"""

import json
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.experimental import pallas as pl

import jaxprec

KERNEL = "pallas_call 'matmul_kernel'"


def matmul_kernel(x_ref, w_ref, o_ref):
  o_ref[...] = jnp.dot(x_ref[...], w_ref[...],
                       preferred_element_type=jnp.float32)


def pallas_matmul(x, w):
  return pl.pallas_call(
      matmul_kernel, interpret=True,
      out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))(
          x, w)


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 16)).astype(np.float32) + 2.0**-9
  w = rng.standard_normal((16, 8)).astype(np.float32)
  return x, w


def _quiet(fn, *args, **kwargs):
  """``fn(...)`` with every warning dropped, as a logging set-up may."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return fn(*args, **kwargs)


def _said(report) -> str:
  note = next((n for n in report.notes if KERNEL in n), None)
  assert note is not None, report.notes
  assert KERNEL in str(report)
  assert any(KERNEL in n for n in json.loads(report.to_json())["notes"])
  return note


def test_check_says_a_pallas_kernel_ran_natively_and_the_emulated_rows_miss_it():
  x, w = _data()

  def kernel_fn(x, w):
    return {"h": pallas_matmul(x, w)}

  report = _quiet(jaxprec.check, kernel_fn, x, w, precisions=["bfloat16"])
  note = _said(report)
  assert "natively" in note and "bfloat16" in note
  # What the report measured: nothing, where one bfloat16 pass (NumPy,
  # ml_dtypes) differs from float32.
  bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
  assert not np.array_equal(bf(x) @ bf(w), x.astype(np.float64) @ w)
  assert report.layer("h").metrics["bfloat16"].rel_rms == 0.0
  # The same function with jnp.dot instead: emulated, no such note.
  plain = _quiet(jaxprec.check, lambda x, w: {"h": x @ w}, x, w,
                 precisions=["bfloat16"])
  assert not any("natively" in n for n in plain.notes)
  assert plain.layer("h").metrics["bfloat16"].rel_rms > 0


def test_native_rows_emulate_nothing_and_get_no_such_note():
  x, w = _data()
  report = _quiet(jaxprec.check, lambda x, w: {"h": pallas_matmul(x, w)}, x,
                  w, precisions=["bfloat16"], mode="native")
  assert not any(KERNEL in n for n in report.notes)


class KernelNet(nnx.Module):
  def __init__(self, w):
    self.w = nnx.Param(jnp.asarray(w))
    self.out = nnx.Linear(8, 4, rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.out(jnp.tanh(pallas_matmul(x, self.w[...])))


@pytest.mark.parametrize("shadow", [False, True])
def test_check_module_says_it_too(shadow):
  x, w = _data()
  report = _quiet(jaxprec.check_module, KernelNet(w), x,
                  precisions=["bfloat16"], shadow=shadow)
  _said(report)


def test_port_check_says_it_too():
  torch = pytest.importorskip("torch")
  import jaxprec.torch as jt  # noqa: PLC0415
  x, w = _data()
  model = KernelNet(w)

  class TNet(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.out = torch.nn.Linear(8, 4)
      with torch.no_grad():
        self.out.weight.copy_(torch.tensor(np.asarray(model.out.kernel[...]).T))
        self.out.bias.copy_(torch.tensor(np.asarray(model.out.bias[...])))

    def forward(self, x):
      return self.out(torch.tanh(x @ torch.tensor(w)))

  report = _quiet(jt.port_check, model, TNet(), x,
                  precisions=("float32", "bfloat16"))
  note = next((n for n in report.notes if KERNEL in n), None)
  assert note is not None, report.notes
  assert KERNEL in report.table()
  assert any(KERNEL in n for n in json.loads(report.to_json())["notes"])
