"""Swap-in: run an existing Flax model's matmuls and convs at a policy's precisions.

:func:`swap` returns a new model that uses the same variables (the user's
model is never modified), with every module call run through the one
per-module hook (:mod:`jaxprec._src.flax.hook`): a linen module becomes an
instance of a subclass of its class that runs every method call under the
policy; a Hugging Face Flax model, a shallow copy whose ``module`` is such a
module; an NNX module, a clone with the policy applied and the hook
installed, whose call enters the policy (and, with ``emulate=True``,
:func:`jaxprec.emulate`, writing back the variables it writes).

This module imports Flax only when called.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import weakref
from typing import Any

from jaxprec._src.core import numerics
from jaxprec._src.core.version import install_hint
from jaxprec._src.flax import hook, nnx_policy
from jaxprec._src.flax import paths as flax_paths
from jaxprec._src.flax import scope as flax_scope
from jaxprec._src.flax import state as flax_state
from jaxprec._src.flax.scope import policy_scope
from jaxprec._src.policy import policy as policy_lib
from jaxprec._src.policy.policy import PolicyLike, PolicyReport

_NNX_RECORDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True, eq=False)
class _SwapConfig:
  """A swapped model's policy, and how a call made outside it enters it.

  A swapped linen class holds it (``_jaxprec_swap``); so do a swapped NNX
  model's hooked modules, as their ``entry``
  (:func:`jaxprec._src.flax.hook.run`): a call of one of them made outside the
  policy (the user's call) enters the policy in :meth:`enter`; with
  ``emulate``, it runs through :func:`jaxprec.emulate`'s interpreter, traced
  as ``emulate(model, policy)`` traces it, and the variables it writes are
  written back into the module.
  """

  policy: policy_lib.Policy
  emulate: bool
  target: str
  what: str
  recorder: flax_scope.Recorder
  classes: dict = dataclasses.field(default_factory=dict)  # hooked NNX classes
  emulated: dict = dataclasses.field(default_factory=dict)

  def in_force(self) -> bool:
    scope = flax_state.active()
    return scope is not None and scope.policy == self.policy

  def enter(self, module, path, call, args, kwargs):
    if not self.emulate:
      with policy_scope(self.policy, self.recorder, what=self.what):
        return hook.run(module, path, call, args, kwargs)
    from jaxprec._src.emulation.emulate import emulate_nnx_call

    key = (hook.base_class(type(module)), path)
    fn = self.emulated.get(key)
    if fn is None:
      fn = self.emulated[key] = emulate_nnx_call(
          call, self.target, self.policy, self.recorder, path)
    return fn(module, *args, **kwargs)


def _accepted(model: Any) -> TypeError:
  what = ("a class" if isinstance(model, type)
          else f"{model!r} of type {type(model).__name__}")
  owner = (getattr(model if isinstance(model, type) else type(model),
                   "__module__", "") or "").split(".")[0]
  why = ""
  if owner in ("transformers", "torch"):  # a PyTorch model: said what to do
    kind = model if isinstance(model, type) else type(model)
    what = f"{kind.__module__}.{kind.__qualname__}"  # (its repr: many lines)
    why = (f" It is a PyTorch model: Hugging Face's Flax models "
           f"(FlaxBertModel, ...) exist in transformers 4.x only "
           f"({install_hint('hf-flax')}; transformers 5 removed them). For a "
           f"PyTorch model, swap jaxprec's NNX port with its weights: "
           f"jaxprec.models.BertModel.from_pytorch(model) (or Wav2Vec2Model, "
           f"LlamaModel).")
  return TypeError(
      f"jaxprec.swap accepts a flax.linen.Module instance, a flax.nnx.Module, "
      f"or a Hugging Face Flax model (transformers.FlaxPreTrainedModel); got "
      f"{what}.{why}")


def _is_hf_model(model: Any, nn) -> bool:
  # FlaxPreTrainedModel: `module` and `params` are properties over `_module`
  # and `_params` (`params` raises when the model was made with _do_init=False).
  return (isinstance(getattr(model, "_module", None), nn.Module)
          and isinstance(getattr(type(model), "module", None), property)
          and isinstance(getattr(type(model), "params", None), property))


def swap(model: Any, policy: PolicyLike, *, emulate: bool = False,
         target: str = "tpu") -> Any:
  """Returns ``model`` running each matmul and conv at ``policy``'s precision.

  Every ``dot_general`` and ``conv_general_dilated`` that the model's code
  runs without an explicit ``precision=`` gets the precision that ``policy``
  gives its innermost module (path, type, op kind; see :class:`jaxprec.Policy`),
  including the attention score and weighting einsums of attention modules,
  which are not modules themselves. Ops with an explicit precision keep it.
  A policy with compute dtypes (``Rule(dtype=)``, ``default_dtype``) also
  runs each module it decides for in that dtype: modules with a ``dtype``
  field (attribute, in NNX) get it set on the swapped model's bound copies
  (linen, Hugging Face) or on the clone (NNX); linen modules without one have
  their floating inputs and outputs cast at their boundary
  (``docs/modules.md``, "Compute dtypes").
  The returned model uses the same variables; ``model`` is not modified. It
  works under ``jax.jit``, ``jax.grad`` and friends, and in native mode costs
  nothing at run time: the program is the one the model gives with those
  precisions written by hand.

  Args:
    model: a ``flax.linen.Module`` (use the returned module's ``apply`` and
      ``init`` as the original's), a Hugging Face Flax model (call it as the
      original, ``swapped(inputs, params=...)``, or use ``swapped.module``),
      or a ``flax.nnx.Module``.
    policy: a :class:`jaxprec.Policy`, a policy string (see
      :meth:`jaxprec.Policy.parse`), or one precision for everything.
    emulate: also compute every matmul and conv as ``target`` does, on any
      backend: the outputs then differ from the native ones where the policy
      asks for less than float32.
    target: ``'tpu'`` (default) or ``'gpu'`` for ``emulate=True``.

  Returns:
    The swapped model, of the same kind. :func:`jaxprec.policy_report` tells
    what the policy decided; rules that decide nothing raise a
    :class:`jaxprec.UnusedRuleWarning` once the model has run (linen, and
    NNX models holding linen modules through ``flax.nnx.bridge.ToNNX``) or
    at once (NNX).

  Raises:
    TypeError: ``model`` is not a Flax model.
    ValueError: bad policy or target; a dtype rule that matches an NNX module
      without a ``dtype`` attribute.

  Examples:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxprec
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(2, name="out")(nn.relu(nn.Dense(4, name="hidden")(x)))
    >>> model, x = MLP(), jnp.ones((1, 3))
    >>> params = model.init(jax.random.key(0), x)
    >>> fast = jaxprec.swap(model, "default=bf16,out=float32")
    >>> [r.precision_name for r in jaxprec.audit(fast.apply, params, x)]
    ['DEFAULT', 'HIGHEST']
    >>> bool(jnp.array_equal(fast.apply(params, x), model.apply(params, x)))  # CPU
    True
  """
  target = numerics.check_target(target, emulation=True)
  policy = policy_lib.as_policy(policy)
  if "flax" not in sys.modules or isinstance(model, type):
    raise _accepted(model)
  from flax import linen as nn
  from flax import nnx

  if isinstance(model, nn.Module):
    return _swap_linen(model, policy, emulate, target)
  if _is_hf_model(model, nn):
    new = copy.copy(model)
    new._module = _swap_linen(model._module, policy, emulate, target)  # noqa: SLF001
    return new
  if isinstance(model, nnx.Module):
    return _swap_nnx(model, policy, emulate, target)
  raise _accepted(model)


def policy_report(model: Any) -> PolicyReport:
  """What a policy decided for a swapped model or a policy-emulated function.

  Args:
    model: the result of :func:`jaxprec.swap`, or of
      ``jaxprec.emulate(fn, policy)``.

  Returns:
    A :class:`jaxprec.PolicyReport`: one entry per module (and op kind) the
    policy decided for, and ``.unused_rules``. For linen models and emulated
    functions it covers what has been traced so far.

  Raises:
    TypeError: ``model`` was not made by ``jaxprec.swap`` or with a policy.

  Examples:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxprec, warnings
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> params = model.init(jax.random.key(0), x)
    >>> swapped = jaxprec.swap(model, "conv=tf32,Dense=float32")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   _ = swapped.apply(params, x)
    >>> [str(r) for r in jaxprec.policy_report(swapped).unused_rules]
    ['conv=tensorfloat32']
    >>> caught[0].category.__name__
    'UnusedRuleWarning'
  """
  rec = _recorder(model)
  if rec is None:
    raise TypeError(
        f"jaxprec.policy_report expects a model returned by jaxprec.swap or a "
        f"function returned by jaxprec.emulate(fn, policy); got {model!r}.")
  return rec.report()


def _recorder(model: Any) -> flax_scope.Recorder | None:
  for owner in (model, getattr(model, "_module", None)):  # linen, HF
    cfg = getattr(type(owner), "_jaxprec_swap", None)
    if isinstance(cfg, _SwapConfig):
      return cfg.recorder
  rec = getattr(model, "_jaxprec_recorder", None)
  if isinstance(rec, flax_scope.Recorder):
    return rec
  try:
    return _NNX_RECORDERS.get(model)
  except TypeError:
    return None


def _swap_linen(module, policy, emulate: bool, target: str):
  base = getattr(type(module), "_jaxprec_base", type(module))
  cfg = _SwapConfig(policy, emulate, target, f"{base.__name__} (jaxprec.swap)",
                    flax_scope.Recorder(policy))
  cls = _swapped_class(base, cfg)
  fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.init and f.name != "parent"}
  return cls(**fields, parent=None)


def _swapped_class(base: type, cfg: _SwapConfig) -> type:
  """A subclass of ``base`` (same name and fields) that runs under the policy.

  ``apply`` and ``init_with_output`` (hence ``init``) enter the policy (and,
  with ``emulate=True``, :func:`jaxprec.emulate`). Flax's private
  ``Module._call_wrapped_method``, which runs every method call of a module,
  is overridden too where it exists (flax 0.12), so that ``bind`` and use as a
  submodule run under the policy as well.
  """
  from flax import linen as nn

  ns = {
      "__module__": base.__module__,
      "__qualname__": base.__qualname__,
      "__doc__": base.__doc__,
      "_jaxprec_swap": cfg,
      "_jaxprec_base": base,
      "apply": nn.nowrap(_policy_method(base.apply, cfg)),
      "init_with_output": nn.nowrap(_policy_method(base.init_with_output, cfg)),
  }
  if hasattr(base, "_call_wrapped_method"):
    @nn.nowrap
    def _call_wrapped_method(self, fun, args, kwargs):
      # Policy paths are relative to the swapped module (maybe a submodule).
      with policy_scope(cfg.policy, cfg.recorder, what=cfg.what,
                        root_path=tuple(self.path) if self.scope else ()):
        return base._call_wrapped_method(self, fun, args, kwargs)  # noqa: SLF001
    ns["_call_wrapped_method"] = _call_wrapped_method
  return type(base.__name__, (base,), ns)


def _policy_method(method, cfg: _SwapConfig):
  from jaxprec._src.emulation.emulate import emulate

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    with policy_scope(cfg.policy, cfg.recorder, what=cfg.what):
      if not cfg.emulate:
        return method(self, *args, **kwargs)
      fn = functools.partial(method, self)
      return emulate(fn, cfg.policy, target=cfg.target)(*args, **kwargs)
  return wrapper


def _swap_nnx(model, policy, emulate: bool, target: str):
  from flax import nnx

  new = nnx.clone(model)
  entry = _SwapConfig(policy, emulate, target,
                      f"{type(model).__name__} (jaxprec.swap)",
                      flax_scope.Recorder(policy))
  nnx_policy.apply(new, policy, entry.recorder, hooks=False)
  hook.install(new, entry)
  _NNX_RECORDERS[new] = entry.recorder
  # The linen modules inside an nnx.bridge.ToNNX are decided when it runs:
  # then, after the first call, its policy scope warns.
  if not any(isinstance(node, nnx.bridge.ToNNX)
             for _, node in flax_paths.nnx_modules(new)):
    entry.recorder.warn_unused(entry.what, stacklevel=3)
  return new
