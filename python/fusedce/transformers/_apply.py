"""apply() and revert(): transformers' causal-LM loss swapped for causal_lm_loss (in
``LOSS_MAPPING`` and wherever a transformers module holds ``ForCausalLMLoss``), torch's
``CrossEntropyLoss`` for TokenCrossEntropyLoss in transformers' modules, and
``PreTrainedModel.__call__`` wrapped; serving() tells how a model is served."""

import functools
import sys

import torch

from .._options import LinearOptions
from . import _settings
from ._call import _fusable_head, _unwrap_call, _wrap_call
from ._loss import TokenCrossEntropyLoss, causal_lm_loss
from ._plans import _forget_plans
from ._replay import _declined
from ._source import _calls_loss_function, _computes_own_cross_entropy

_original_init = None  # while applied: PreTrainedModel.__dict__'s own __init__


def _swap(old, new):
    """Replace `old` by `new` in LOSS_MAPPING and wherever a transformers module holds it under
    the name ForCausalLMLoss."""
    from transformers.loss import loss_utils

    for key, fn in list(loss_utils.LOSS_MAPPING.items()):
        if fn is old:
            loss_utils.LOSS_MAPPING[key] = new
    for name, module in list(sys.modules.items()):
        if (name == "transformers" or name.startswith("transformers.")) and module is not None:
            if module.__dict__.get("ForCausalLMLoss") is old:
                setattr(module, "ForCausalLMLoss", new)


def apply(fused_linear=True, metrics=False, *, chunk_budget_bytes="head", low_memory=False, skip_ignored=False):
    """Route every causal-LM training loss of transformers through fusedce (idempotent; calling
    it again with other arguments switches). With ``fused_linear`` the loss of a call with
    labels and gradients comes from fused linear cross-entropy and the logits are never made
    (the package's docstring); without it, from fusedce.cross_entropy over the logits. Models that
    compute their own cross-entropy get TokenCrossEntropyLoss in either case. With
    ``metrics``, every such loss computed with gradients enabled also adds its token metrics to
    the sums that :func:`token_metrics` and :class:`MetricsCallback` read.

    ``chunk_budget_bytes``, ``low_memory`` and ``skip_ignored`` go to every fused linear loss
    (fusedce.linear_cross_entropy's options of the same names: the scratch memory of its logit
    chunks, the bound of 512 MiB of extra memory at the cost of recomputation, and the products
    over the positions whose label is not ignored only); they change memory and time, not the
    loss beyond float rounding.

    ``chunk_budget_bytes="head"`` (the default) bounds each call's logit chunk by the bytes of
    the head's weight (as the loss computes it). A training step's loss runs where the
    activations peak, and with a 16-bit head such a chunk lives in the weight's gradient until
    that gradient is formed: the loss's extra memory is then a float32 copy of the head (the
    gradient's accumulator) and small per-token vectors, less than TRL's chunked loss takes, for
    more token chunks than the fastest plan. ``None`` takes linear_cross_entropy's own default
    (the fastest plan within its bound, up to one more head-sized buffer), an int that many
    bytes; with ``low_memory`` "head" means None (its own bound)."""
    from transformers import PreTrainedModel
    from transformers.loss import loss_utils

    # checked here, so that a bad value fails at apply() rather than inside a training step
    if isinstance(chunk_budget_bytes, str):
        if chunk_budget_bytes != "head":
            raise ValueError(f'fusedce.transformers.apply: chunk_budget_bytes must be "head", None or a number of '
                             f"bytes, got {chunk_budget_bytes!r}")
    else:
        LinearOptions.checked("fusedce.transformers.apply", torch.empty(0), chunk_budget_bytes=chunk_budget_bytes)
    if _settings.original is None:
        _settings.original = loss_utils.ForCausalLMLoss
        _swap(_settings.original, causal_lm_loss)
        _serve_own_cross_entropy(PreTrainedModel)
    _settings.fused_linear = bool(fused_linear)
    _settings.metrics = bool(metrics)
    _settings.chunk_budget_bytes = chunk_budget_bytes
    _settings.low_memory = bool(low_memory)
    _settings.skip_ignored = bool(skip_ignored)
    # The wrapped call arms lm_head (fused_linear) and tells whose call a loss belongs to
    # (metrics); with neither, PreTrainedModel stays as transformers defines it.
    if _settings.fused_linear or _settings.metrics:
        _wrap_call(PreTrainedModel)
    else:
        _unwrap_call(PreTrainedModel)


def revert():
    """Restore transformers' own loss, also in modules imported since apply(), torch's
    CrossEntropyLoss in transformers' modules, and PreTrainedModel.__call__ and __init__.
    Metrics stop being collected; the sums collected so far stay readable (token_metrics)."""
    if _settings.original is None:
        return
    from transformers import PreTrainedModel

    _unwrap_call(PreTrainedModel)
    _forget_plans()
    _leave_own_cross_entropy(PreTrainedModel)
    _settings.fused_linear = False
    _settings.metrics = False
    _settings.chunk_budget_bytes = "head"
    _settings.low_memory = False
    _settings.skip_ignored = False
    _swap(causal_lm_loss, _settings.original)
    _settings.original = None


def is_applied():
    return _settings.original is not None


def serving(model):
    """How fusedce serves `model`'s training loss under the current apply(): "fused_linear"
    (the loss from lm_head's input and weight, no logits), "logits" (fusedce.cross_entropy over
    the logits the model makes: through the causal-LM loss function, or through the
    TokenCrossEntropyLoss that a model computing its own cross-entropy builds), or "untouched"
    (the model computes its loss itself, exactly as without fusedce). Under torch.compile a
    "fused_linear" model is served fused when it was compiled after apply() (from its second
    training call on), else through the logits. Read from the model's class and state; a
    model whose forward reaches the loss function or its CrossEntropyLoss only through a helper
    is reported "untouched" although the logits path serves it, and a call that is not standard
    (TokenCrossEntropyLoss) runs torch's own loss although the model is reported "logits"."""
    if not is_applied():
        return "untouched"
    if getattr(model, "loss_function", None) is not causal_lm_loss \
            or not _calls_loss_function(type(model)):
        return "logits" if _computes_own_cross_entropy(type(model)) else "untouched"
    if _settings.fused_linear and model not in _declined and _fusable_head(model):
        return "fused_linear"
    return "logits"


# ---- models that compute their own cross-entropy: TokenCrossEntropyLoss for their class ----


def _swap_cross_entropy_loss(module, old, new):
    if module is not None and module.__dict__.get("CrossEntropyLoss") is old:
        setattr(module, "CrossEntropyLoss", new)


def _is_transformers_module(name):
    return name == "transformers" or name.startswith("transformers.")


def _serve_classes(cls):
    """TokenCrossEntropyLoss in the modules of `cls` and its bases (those of transformers)."""
    for c in cls.__mro__:
        if _is_transformers_module(c.__module__):
            _swap_cross_entropy_loss(sys.modules.get(c.__module__), torch.nn.CrossEntropyLoss,
                                     TokenCrossEntropyLoss)


def _serve_own_cross_entropy(cls):
    """Put TokenCrossEntropyLoss in place of torch's CrossEntropyLoss in every transformers
    module imported so far, and wrap `cls.__init__` (PreTrainedModel's) so that a model's own
    modules get it when the model is built: transformers imports its modeling modules lazily,
    and a module imported after apply() binds torch's class, but every model of it is built
    after apply() too."""
    global _original_init
    for name, module in list(sys.modules.items()):
        if _is_transformers_module(name):
            _swap_cross_entropy_loss(module, torch.nn.CrossEntropyLoss, TokenCrossEntropyLoss)
    if _original_init is None:
        _original_init = cls.__dict__["__init__"]
        original = _original_init

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            _serve_classes(type(self))
            original(self, *args, **kwargs)

        cls.__init__ = __init__


def _leave_own_cross_entropy(cls):
    global _original_init
    if _original_init is not None:
        cls.__init__ = _original_init
        _original_init = None
    for name, module in list(sys.modules.items()):
        if _is_transformers_module(name):
            _swap_cross_entropy_loss(module, TokenCrossEntropyLoss, torch.nn.CrossEntropyLoss)

