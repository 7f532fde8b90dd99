"""Hugging Face transformers integration: ``fusedce.transformers.apply()`` makes every causal
language model of the installed transformers compute its training loss with fusedce;
``revert()`` undoes it.

With ``apply(fused_linear=True)`` (the default), a model laid out as a base model plus an
``nn.Linear`` ``lm_head`` never produces its logits when it is called with labels and with
gradients enabled (a training step): the loss is fused linear cross-entropy of the last hidden
states and ``lm_head.weight``, computed inside ``lm_head``'s own call, so that the hooks which
gather a sharded weight around that call (FSDP, DeepSpeed ZeRO-3) fire as usual. How it works,
generically (no model's forward is copied):

- ``PreTrainedModel.__call__`` is wrapped. A call with ``labels`` of a model whose forward calls
  ``self.loss_function`` and whose loss function is the causal-LM loss below arms the model's
  ``lm_head`` for that one call: its forward (an instance attribute set for the call and
  removed after it) computes the loss and returns a marker, an empty ``(..., 0)`` tensor, in
  place of the logits. Models that compute their own cross-entropy (T5, Bart, TrOCR, Whisper's
  decoder, ...) are never armed (see below for how their loss is served).
- The model's forward carries the marker on to its loss function, which returns the loss. Any
  logit transform a model applies between ``lm_head`` and the loss must be the one the config
  declares (``final_logit_softcapping``: Gemma 2 and 3; ``logit_scale``: Cohere;
  ``logits_scaling``: Granite; ``output_logit_soft_cap``: xLSTM), and the fused loss applies it;
  the marker records every
  operation on it and the loss function checks them against that transform on sample values.
- A model that does anything else with the marker (another operation, reading its shape,
  passing it elsewhere than to its loss), or whose ``lm_head`` sees other positions than its
  labels name (Git's image tokens), declines the fused loss within the same call, with a
  warning: from that point the logits are real (lm_head's product of the hidden states it was
  given, with the operations the model applied since replayed on it), the model's forward goes
  on over them, and its loss is the logits' loss; that model stays on the logits path. The
  model's forward runs once (a forward that changes buffers, a cache or counters changes them
  once). Only when lm_head's weight is no longer whole by then (FSDP freed its gathered copy)
  or the head is tensor-parallel is the call run again unarmed from the same random state.
  Never a different loss, never an error that the model would not raise without fusedce.
- A tensor-parallel ``lm_head`` (``ColwiseParallel(use_local_output=False)``: its weight a
  DTensor sharded on dim 0 during the call) computes the loss through the DTensor form of
  ``linear_cross_entropy`` (vocabulary-parallel over the mesh) and returns an empty DTensor
  sharded on its last dimension for its output hook; that output must reach the loss function
  unchanged, else the call declines (operations on a DTensor are not recorded); with gradients
  on, that marker is a function of the loss and the loss function adds its empty sum back, so
  the backward passes through the head's output (where FSDP2 + TP gathers the head again). An
  FSDP2 head is whole during its call (FSDP2 gathers it first) and takes the plain fused loss.
- The returned output's ``logits`` is that empty tensor. Calls without labels, or without
  gradients (evaluation, generation), produce the logits as usual.
- Under ``torch.compile`` (a model compiled after apply(), whose call dynamo traces through the
  wrapped ``__call__``) the marker is not used: it is Python state that a graph would freeze.
  The model's first training call with labels runs eagerly (a graph break), with every check
  above; if it is served fused, the model is planned: its ``lm_head`` gets a forward that
  computes the fused loss while a planned compiled call of its model is in progress, and the
  loss function returns that loss. The compiled graphs then hold the fused linear op and no
  (N, V) logits. A model that declined stays on the logits path compiled. A model compiled
  before apply(), or through ``model.compile()`` (which compiles the forward, not the wrapped
  call), takes the logits path.

Models that compute their own cross-entropy build ``CrossEntropyLoss()`` in their forward, from
the name their transformers module imported from ``torch.nn``. apply() rebinds that name, in
every transformers module, to :class:`TokenCrossEntropyLoss`: a subclass of torch's whose
standard calls ((N, V) float32 / bfloat16 / float16 logits, (N,) int64 targets, no class
weights) fusedce.cross_entropy computes, and whose every other call is torch's own forward.
Modules that transformers imports after apply() get it when a model of theirs is built (the
wrapped ``PreTrainedModel.__init__``). Models that call ``nn.CrossEntropyLoss`` or
``F.cross_entropy`` through ``torch.nn`` itself stay untouched.

:func:`serving` tells how a model is served: ``"fused_linear"``, ``"logits"`` or
``"untouched"``. ``docs/transformers.md`` has the table over every causal-LM and seq2seq-LM
class of transformers.

transformers looks a model's loss up by its ``loss_type`` in
``transformers.loss.loss_utils.LOSS_MAPPING`` every time the model computes a loss; causal LMs
(``ForCausalLM``, ``ForConditionalGeneration`` and every other entry that maps to
``ForCausalLMLoss``) get :func:`causal_lm_loss` instead. ``Trainer`` recognises a causal-LM loss
by identity (``LOSS_MAPPING[loss_type] is ForCausalLMLoss``, to count ``num_items_in_batch`` over
shifted labels), so the name ``ForCausalLMLoss`` is replaced too, in ``loss_utils`` and in every
transformers module already imported; modules imported later pick the replacement up from
``loss_utils``. Works with models created before or after ``apply()``, with ``Trainer`` and with
a hand-written loop.

``apply(metrics=True)`` also has every loss fusedce computes return its token metrics (the fused
call makes them in the same sweep: argmax hits and softmax entropy over the non-ignored targets)
and adds them, with the count of those targets, to device-side sums (those of losses computed
with gradients enabled, training's, apart from those computed without, evaluation's):
per model (the outermost ``PreTrainedModel`` whose call computed the loss), or unowned for a loss
computed outside any model call (or in a compiled call, or in a DataParallel replica).
:func:`token_metrics` reads them; :class:`MetricsCallback` (or
:func:`add_metrics_callback`) puts ``token_accuracy`` and ``entropy`` into ``Trainer``'s training
logs, summed over every micro-batch since the previous log, and ``eval_token_accuracy`` and
``eval_entropy`` into its evaluation logs. The loss and gradients are bit-identical with and
without metrics.

The package's modules, one job each: ``_apply`` (apply, revert, serving: the swaps),
``_loss`` (causal_lm_loss, TokenCrossEntropyLoss), ``_source`` (what a model's forward calls,
from its source), ``_call`` (the wrapped ``__call__`` and the armed call), ``_head`` (the fused
head's forward and loss), ``_marker`` (the marker tensor), ``_pending`` (the record of an armed
call and its checks), ``_replay`` (a decline: the real logits replayed, the rerun's random
state), ``_plans`` (compiled plans), ``_metrics`` (token metrics and the Trainer callback),
``_settings`` (what apply() chose).
"""

import sys
import types

from . import (_apply, _call, _head, _loss, _marker, _metrics, _pending, _plans, _replay,
               _settings, _source)
# The package's names: its API, the kernels' entry points its losses call (tests count the
# calls through them), and the private names the tests read or replace.
from ..functional import cross_entropy
from ..linear import linear_cross_entropy
from ._apply import apply, is_applied, revert, serving
from ._call import _fusable_head, _model_call
from ._loss import TokenCrossEntropyLoss, causal_lm_loss
from ._metrics import (TokenSums, _metrics_callback_class, _unowned, add_metrics_callback,
                       reset_token_metrics, token_metrics)
from ._plans import _CompiledCall, _Plan
from ._replay import _declined, _warned
from ._source import _calls_loss_function, _computes_own_cross_entropy

_ABSENT = object()
_MODULES = (_apply, _call, _head, _loss, _marker, _metrics, _pending, _plans, _replay, _settings,
            _source)


def __getattr__(name):
    if name == "MetricsCallback":
        return _metrics_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """This package's module object. A name set on it (``monkeypatch.setattr(
    fusedce.transformers, "cross_entropy", spy)``) is set in every module of the package that
    holds the same object under that name, so that the code calling it sees the new one, as
    the code of a single module would."""

    def __setattr__(self, name, value):
        old = self.__dict__.get(name, _ABSENT)
        if old is not _ABSENT:
            for module in _MODULES:
                if module.__dict__.get(name, _ABSENT) is old:
                    setattr(module, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
