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
"""

import ast
import functools
import inspect
import math
import sys
import textwrap
import threading
import warnings
import weakref

import torch
import torch.nn.functional as F

from . import _library, dtensor
from .functional import cross_entropy
from .linear import linear_cross_entropy

_original = None  # transformers' ForCausalLMLoss while applied
_fused_linear = False  # apply(fused_linear=...)
_metrics = False  # apply(metrics=...)
_unset = object()
_original_call = None  # while wrapped: PreTrainedModel.__dict__'s own __call__, or _unset
_original_init = None  # while applied: PreTrainedModel.__dict__'s own __init__


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, **kwargs):
    """transformers' ``ForCausalLMLoss`` (label shift, ``ignore_index``, ``num_items_in_batch``
    normalisation), with fusedce computing the cross-entropy straight from the logits in their
    own dtype: no float32 copy, no (N, V) buffer besides the gradient. Given the marker of an
    armed ``lm_head`` (``fused_linear``), it returns the loss the head computed."""
    if isinstance(logits, _PendingLogits):
        loss, real = logits.consume(labels, vocab_size, shift_labels, num_items_in_batch)
        if real is None:
            return loss
        logits = real  # declined within the call: the loss of the real logits, below
    call = _compiled.current
    if call is not None and call.loss is not None and not call.consumed:
        return call.consume(logits, labels, vocab_size, shift_labels, num_items_in_batch)
    pending = _armed_with_dtensor_marker(logits)
    if pending is not None:
        return pending.consume_dtensor_marker(logits, labels, vocab_size, shift_labels,
                                              num_items_in_batch)
    if shift_labels is None:
        # Shift so that tokens < n predict n; the last position predicts nothing.
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction,
                         return_metrics=_metrics)
    if _metrics:
        loss, metrics = loss
        _collect(metrics, (shift_labels != ignore_index).sum(), torch.is_grad_enabled())
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


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


def apply(fused_linear=True, metrics=False):
    """Route every causal-LM training loss of transformers through fusedce (idempotent; calling
    it again with other arguments switches). With ``fused_linear`` the loss of a call with
    labels and gradients comes from fused linear cross-entropy and the logits are never made
    (module docstring); without it, from fusedce.cross_entropy over the logits. Models that
    compute their own cross-entropy get TokenCrossEntropyLoss in either case. With
    ``metrics``, every such loss computed with gradients enabled also adds its token metrics to
    the sums that :func:`token_metrics` and :class:`MetricsCallback` read."""
    global _original, _fused_linear, _metrics
    from transformers import PreTrainedModel
    from transformers.loss import loss_utils

    if _original is None:
        _original = loss_utils.ForCausalLMLoss
        _swap(_original, causal_lm_loss)
        _serve_own_cross_entropy(PreTrainedModel)
    _fused_linear = bool(fused_linear)
    _metrics = bool(metrics)
    # The wrapped call arms lm_head (fused_linear) and tells whose call a loss belongs to
    # (metrics); with neither, PreTrainedModel stays as transformers defines it.
    if _fused_linear or _metrics:
        _wrap_call(PreTrainedModel)
    else:
        _unwrap_call(PreTrainedModel)


def revert():
    """Restore transformers' own loss, also in modules imported since apply(), torch's
    CrossEntropyLoss in transformers' modules, and PreTrainedModel.__call__ and __init__.
    Metrics stop being collected; the sums collected so far stay readable (token_metrics)."""
    global _original, _fused_linear, _metrics
    if _original is None:
        return
    from transformers import PreTrainedModel

    _unwrap_call(PreTrainedModel)
    _forget_plans()
    _leave_own_cross_entropy(PreTrainedModel)
    _fused_linear = False
    _metrics = False
    _swap(causal_lm_loss, _original)
    _original = None


def is_applied():
    return _original is not None


# ---- models that compute their own cross-entropy: their CrossEntropyLoss over the logits -------


_SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SERVED_REDUCTIONS = ("mean", "sum", "none")


class TokenCrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` whose standard calls are computed by fusedce.cross_entropy.

    While apply() is in effect it stands in for the name ``CrossEntropyLoss`` in transformers'
    modules (the models that compute their own loss: T5, Bart, TrOCR, Whisper's decoder, ...,
    and their classification heads, which are the same call). A call is standard when the
    logits are a plain (N, V) float32, bfloat16 or float16 tensor on a device fusedce computes
    on, the target an (N,) int64 tensor of class indices on the same device, with no class
    weights, a reduction of 'mean', 'sum' or 'none', an integer ignore_index and a label
    smoothing in [0, 1]: fusedce computes exactly that function (the contract of
    fusedce.cross_entropy), and the loss is returned in the logits' dtype as torch returns it.
    Every other call (class weights, K-dimensional or class-probability targets, float64, an
    empty batch, tensor subclasses, ...) is torch's own forward, unchanged."""

    def forward(self, input, target):
        if not _is_standard_call(self, input, target):
            return super().forward(input, target)
        loss = cross_entropy(input, target, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             return_metrics=_metrics)
        if _metrics:
            loss, metrics = loss
            _collect(metrics, (target != self.ignore_index).sum(), torch.is_grad_enabled())
        return loss.to(input.dtype)


def _is_standard_call(loss, input, target):
    """Whether fusedce.cross_entropy computes `loss`(input, target) as torch does (see
    TokenCrossEntropyLoss)."""
    if type(input) is not torch.Tensor or type(target) is not torch.Tensor:
        return False  # parameters, DTensor and other subclasses: torch's own dispatch
    if input.dim() != 2 or target.dim() != 1 or target.shape[0] != input.shape[0] \
            or input.shape[0] == 0 or input.shape[1] == 0:
        return False
    if input.dtype not in _SERVED_DTYPES or target.dtype != torch.int64:
        return False
    if target.device != input.device or not (
            input.device.type == "cpu" or (input.is_cuda and _library.with_cuda)):
        return False
    smoothing = loss.label_smoothing
    return (loss.weight is None and loss.reduction in _SERVED_REDUCTIONS
            and type(loss.ignore_index) is int
            and type(smoothing) in (int, float) and 0.0 <= smoothing <= 1.0)


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


_own_loss_calls = {}  # forward function -> whether it calls CrossEntropyLoss(...)


def _computes_own_cross_entropy(cls):
    """Whether `cls.forward`'s own source builds a ``CrossEntropyLoss(...)`` that its module now
    names TokenCrossEntropyLoss (the model's standard calls of it are served over the logits)."""
    forward = cls.forward
    module = sys.modules.get(getattr(forward, "__module__", None) or "")
    if module is None or module.__dict__.get("CrossEntropyLoss") is not TokenCrossEntropyLoss:
        return False
    if forward not in _own_loss_calls:
        found = False
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
            found = any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "CrossEntropyLoss" for node in ast.walk(tree))
        except (OSError, TypeError, SyntaxError):
            pass
        _own_loss_calls[forward] = found
    return _own_loss_calls[forward]


# ---- fused_linear: the loss from lm_head's call ---------------------------------------------


def _wrap_call(cls):
    global _original_call
    if _original_call is None:
        _original_call = cls.__dict__.get("__call__", _unset)
        cls.__call__ = _model_call


def _unwrap_call(cls):
    global _original_call
    if _original_call is None:
        return
    if _original_call is _unset:
        del cls.__call__
    else:  # transformers defines none today
        cls.__call__ = _original_call
    _original_call = None


class _Decline(Exception):
    """Raised inside an armed model call when the model does something with lm_head's output
    that the fused loss does not follow; _model_call then runs the call again unarmed."""


# Models whose armed call was declined once: they stay on the logits path (model -> reason).
_declined = weakref.WeakKeyDictionary()
_warned = set()


def _model_call(self, *args, **kwargs):
    """PreTrainedModel.__call__ while fused_linear or metrics is on. With metrics, the model is
    pushed on this thread's stack of model calls for the call's duration, so that a loss knows
    the outermost model it belongs to. Traced by dynamo (a model compiled after apply()), it
    takes the compiled path (_compiled_model_call)."""
    if torch.compiler.is_compiling():
        return _compiled_model_call(self, args, kwargs)
    return _eager_call(self, args, kwargs)


def _eager_call(self, args, kwargs, plan=False):
    if not _metrics:
        return _armed_call(self, args, kwargs, plan)
    stack = _model_calls()
    stack.append(self)
    try:
        return _armed_call(self, args, kwargs, plan)
    finally:
        stack.pop()


def _armed_call(self, args, kwargs, plan=False):
    """Arm lm_head for a training call with labels (fused_linear), run the model, disarm. If
    the model declines the fused loss, it does so within the call (_Pending.decline: the
    logits become real where the model uses them), so the caller gets exactly what the model
    computes without the fused loss, from one run of its forward. Only a _Decline that escapes
    (a head whose gathered weight is gone, a tensor-parallel head) runs the call again unarmed
    from the same random state. With `plan`, the outcome is recorded for the model's compiled
    calls (_record_plan)."""
    pending = _arm(self, args, kwargs)
    if pending is None:
        if plan:
            _record_plan(self, None)
        return torch.nn.Module.__call__(self, *args, **kwargs)
    rng = _rng_state()
    head = pending.head
    previous = head.__dict__.get("forward")  # None, or the head's _compiled_head_forward
    head.forward = lambda hidden: _fused_head_forward(head, pending, hidden)
    # What lm_head's call returns after every hook of its own (ColwiseParallel's output hook
    # turns a DTensor marker into its output layout): registered last, so it runs last.
    seen = head.register_forward_hook(lambda module, inputs, output: pending.saw_output(output))
    outer, _armed.pending = getattr(_armed, "pending", None), pending
    reason = rerun = None
    try:
        out = torch.nn.Module.__call__(self, *args, **kwargs)
        if pending.head_called and not pending.consumed and pending.declined is None:
            pending.declined = "never passes lm_head's output to its loss function"
        if pending.declined is not None:
            out = pending.real_output(out)
            reason = pending.declined
    except _Decline as e:
        reason = rerun = str(e)
    finally:
        _armed.pending = outer
        seen.remove()
        if previous is None:
            del head.forward
        else:
            head.forward = previous
        pending.closed = True
        # The output's marker keeps its _Pending alive as long as the caller keeps the output:
        # it must not keep the hidden states, the weight or real logits alive with it.
        pending.hidden = pending.weight = pending.bias = None
        pending.ops, pending.real = [], {}
    if reason is None:
        if plan:
            _record_plan(self, pending)
        return out
    if plan:
        _record_plan(self, None)
    _declined[self] = reason
    name = type(self).__name__
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"fusedce.transformers: {name} {reason}; its loss is computed from the "
                      "logits instead of the fused linear loss", stacklevel=3)
    if rerun is None:
        return out
    _set_rng_state(rng)
    return torch.nn.Module.__call__(self, *args, **kwargs)


# ---- fused_linear under torch.compile ---------------------------------------------------------
#
# The marker cannot live in a graph (its bookkeeping is Python state that dynamo would freeze),
# so a compiled model call works from a plan instead. The first training call with labels of a
# model whose call dynamo traces runs eagerly (a graph break): the fused path with every check
# above, declining as it would uncompiled. If it was served fused, the model gets a plan (the
# logit transform its loss verified, and its lm_head), and its lm_head a forward that computes
# the fused loss while a planned compiled call of its model is in progress
# (_compiled_head_forward). From then on dynamo traces the planned call: plain tensors and plain
# Python objects, so the fused op is in the graph and no (N, V) logits are. What the eager call
# verified by recording the marker's operations (the transform between lm_head and the loss,
# the arguments the loss function gets) the planned call relies on, checking what it can while
# tracing (shapes, the identity of the labels). A model that declined, or is not served fused
# for another reason, is compiled over its logits.

_PLAN = "_fusedce_compile_plan"  # the model attribute that holds its _Plan, or False
_planned = weakref.WeakSet()  # models with a plan
_dispatching_heads = weakref.WeakSet()  # heads whose forward is _compiled_head_forward


class _Plan:
    """What a model's first (eager) fused call established for its compiled calls."""

    def __init__(self, head, logit_scale, softcap):
        self.head = head
        self.logit_scale = logit_scale
        self.softcap = softcap


def _record_plan(model, pending):
    """After the eager planning call: a _Plan when `pending` was served fused with a plain
    weight, else False (the model's compiled calls take the logits path)."""
    plan = False
    if pending is not None and pending.consumed and pending.dtensor_marker is None:
        head = pending.head
        if "forward" not in head.__dict__:
            head.forward = functools.partial(_compiled_head_forward, head)
            _dispatching_heads.add(head)
        plan = _Plan(head, pending.logit_scale, pending.softcap)
    setattr(model, _PLAN, plan)
    _planned.add(model)


def _forget_plans():
    for model in list(_planned):
        model.__dict__.pop(_PLAN, None)
    _planned.clear()
    for head in list(_dispatching_heads):
        if _is_compiled_head_forward(head.__dict__.get("forward")):
            del head.forward
    _dispatching_heads.clear()


def _is_compiled_head_forward(forward):
    return isinstance(forward, functools.partial) and forward.func is _compiled_head_forward


class _CompiledCalls:
    """The planned compiled model call in progress (`current`): a plain object, whose
    attribute dynamo follows as a side effect of the traced call. An instance attribute from
    the start, so that the traced call's assignment does not change what dynamo guards on."""

    def __init__(self):
        self.current = None


_compiled = _CompiledCalls()


class _CompiledCall:
    """One planned model call under torch.compile: its loss arguments, and the loss lm_head
    computed."""

    def __init__(self, plan, model_name, labels, kwargs):
        self.plan = plan
        self.model_name = model_name
        self.labels = labels
        self.shift_labels = kwargs.get("shift_labels")
        self.num_items_in_batch = kwargs.get("num_items_in_batch")
        self.ignore_index = kwargs.get("ignore_index", -100)
        self.head_called = self.consumed = False
        self.loss = self.metrics = self.rows = None

    def consume(self, logits, labels, vocab_size, shift_labels, num_items_in_batch):
        """The loss computed in lm_head. The loss function must get what lm_head's output became
        (an empty (..., 0) tensor over the head's rows) and the call's own labels, as the
        planning call verified."""
        if not (_same(labels, self.labels) and _same(shift_labels, self.shift_labels)
                and _same(num_items_in_batch, self.num_items_in_batch)
                and vocab_size == self.plan.head.weight.shape[0]
                and tuple(logits.shape) == (*self.rows, 0)):
            raise RuntimeError(
                f"fusedce.transformers: under torch.compile, {self.model_name} passes its loss "
                "function other arguments than in its first training call, which verified the "
                "fused linear loss; use fusedce.transformers.apply(fused_linear=False) for it")
        self.consumed = True
        if self.metrics is not None:
            _collect(*self.metrics, True)
        return self.loss


def _same(a, b):
    if a is None or b is None or torch.is_tensor(a) or torch.is_tensor(b):
        return a is b
    return a == b  # num_items_in_batch as a number


def _compiled_model_call(self, args, kwargs):
    """A model call that dynamo traces. Planned fused (see above) for a training call with
    labels; the first such call of a model plans it, eagerly; every other call is the model's
    own (its loss through causal_lm_loss over the logits)."""
    if not _fused_linear or not torch.is_grad_enabled() \
            or _labels_of(self, args, kwargs) is None:
        return torch.nn.Module.__call__(self, *args, **kwargs)
    plan = getattr(self, _PLAN, None)
    if plan is None:
        return _planning_call(self, args, kwargs)
    if plan is False:
        return torch.nn.Module.__call__(self, *args, **kwargs)
    call = _CompiledCall(plan, type(self).__name__, _labels_of(self, args, kwargs), kwargs)
    outer = _compiled.current
    _compiled.current = call
    try:
        out = torch.nn.Module.__call__(self, *args, **kwargs)
    finally:
        _compiled.current = outer
    if call.loss is not None and not call.consumed:
        raise RuntimeError(f"fusedce.transformers: under torch.compile, {type(self).__name__} "
                           "does not pass lm_head's output to its loss function as in its first "
                           "training call; use fusedce.transformers.apply(fused_linear=False) "
                           "for it")
    return out


@torch.compiler.disable
def _planning_call(self, args, kwargs):
    """The first training call with labels of a compiled model: eager, and it plans the
    model's compiled calls."""
    return _eager_call(self, args, kwargs, plan=True)


def _compiled_head_forward(head, hidden):
    """lm_head's forward once its model is planned: nn.Linear's, except in the planned compiled
    call of its model, where it computes the fused loss from `hidden` and returns an empty
    (..., 0) tensor for the logits. A second call of the head in the same model call, a head
    that sees other positions than the labels name, or a sharded weight gets ordinary logits
    (the loss function then computes over them)."""
    call = _compiled.current
    if call is None or call.plan.head is not head or call.head_called:
        return torch.nn.Linear.forward(head, hidden)
    call.head_called = True
    target, shift = _head_target(call.labels, call.shift_labels, hidden)
    if target.shape != hidden.shape[:-1] or dtensor.is_dtensor(head.weight) \
            or dtensor.is_dtensor(hidden):
        return torch.nn.Linear.forward(head, hidden)
    call.loss, call.metrics = _head_loss(head, hidden, target, shift, call.ignore_index,
                                         call.num_items_in_batch, call.plan.logit_scale,
                                         call.plan.softcap)
    call.rows = tuple(hidden.shape[:-1])
    return hidden.new_empty((*hidden.shape[:-1], 0))


_armed = threading.local()  # .pending: the armed model call in progress in this thread


def _armed_with_dtensor_marker(logits):
    """The armed call in progress whose lm_head (a tensor-parallel head) returned a DTensor
    marker, when `logits` may be that marker or something made from it (empty classes)."""
    pending = getattr(_armed, "pending", None)
    if pending is None or pending.dtensor_marker is None or pending.consumed or pending.closed:
        return None
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or logits.shape[-1] != 0:
        return None
    return pending


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


_loss_calls = {}  # model class -> whether its forward calls self.loss_function


def _calls_loss_function(cls):
    """Whether `cls.forward`'s own source calls ``self.loss_function(...)``. A model that computes
    its loss otherwise (its own CrossEntropyLoss: T5, Bart, TrOCR, ...) must never be armed: it
    would receive the empty marker as its logits."""
    if cls not in _loss_calls:
        found = False
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
            found = any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "loss_function"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                        for node in ast.walk(tree))
        except (OSError, TypeError, SyntaxError):
            pass
        _loss_calls[cls] = found
    return _loss_calls[cls]


def _fusable_head(model):
    head = model.get_output_embeddings()
    return (isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
            and ("forward" not in head.__dict__
                 or _is_compiled_head_forward(head.__dict__["forward"])))


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
    if _fused_linear and model not in _declined and _fusable_head(model):
        return "fused_linear"
    return "logits"


_label_positions = {}  # model class -> position of `labels` among forward's positional args


def _labels_of(model, args, kwargs):
    if "labels" in kwargs:
        return kwargs["labels"]
    cls = type(model)
    if cls not in _label_positions:
        names = list(inspect.signature(cls.forward).parameters)[1:]  # without self
        _label_positions[cls] = names.index("labels") if "labels" in names else None
    i = _label_positions[cls]
    return args[i] if i is not None and i < len(args) else None


def _arm(model, args, kwargs):
    """The loss context of a call that fused_linear takes over, or None: a training call
    (gradients enabled) with labels, of a model whose loss is the causal-LM loss and whose
    output embedding is a plain nn.Linear not already wrapped by someone else's forward."""
    if not _fused_linear or not torch.is_grad_enabled():
        return None
    labels = _labels_of(model, args, kwargs)
    if labels is None:
        return None
    if getattr(model, "loss_function", None) is not causal_lm_loss or model in _declined \
            or not _calls_loss_function(type(model)) or not _fusable_head(model):
        return None
    return _Pending(model, model.get_output_embeddings(), labels, kwargs)


def _logit_transform(config):
    """(logit_scale, softcap) that the model applies to lm_head's output before its loss, as
    its config declares them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    scale = 1.0 if scale is None else float(scale)
    scaling = getattr(text, "logits_scaling", None)  # Granite divides by it
    if scaling is not None:
        scale /= float(scaling)
    softcap = getattr(text, "final_logit_softcapping", None) or getattr(text, "logits_soft_cap", None) \
        or getattr(text, "output_logit_soft_cap", None)  # xLSTM
    return scale, (float(softcap) if softcap else None)


class _Pending:
    """One armed model call: the labels and loss options it was given, the loss lm_head
    computed, and the operations applied to the marker since."""

    def __init__(self, model, head, labels, kwargs):
        self.model_name = type(model).__name__
        self.head = head
        self.labels = labels
        self.shift_labels = kwargs.get("shift_labels")
        self.num_items_in_batch = kwargs.get("num_items_in_batch")
        self.ignore_index = kwargs.get("ignore_index", -100)
        self.logit_scale, self.softcap = _logit_transform(model.config)
        self.steps = []  # ("scale", c) or ("tanh",) in order
        self.latest = None  # the newest marker
        self.loss = None
        self.metrics = None  # (metrics, token count) of the loss, with apply(metrics=True)
        self.head_called = self.consumed = self.closed = False
        self.dtensor_marker = None  # the DTensor marker of a tensor-parallel head
        self.head_output = None  # what lm_head's call returned (after its hooks)
        # What a decline within the call needs: lm_head's inputs as its forward saw them, every
        # followed operation on the marker (func, args, kwargs) in order, the real tensor of
        # each marker depth once made, and the reason once declined.
        self.hidden = self.weight = self.bias = None
        self.ops = []
        self.real = {}
        self.declined = None

    def saw_output(self, output):
        if self.head_output is None and self.head_called:
            self.head_output = output

    def finish(self, labels, vocab_size, shift_labels, num_items_in_batch):
        """The loss computed in lm_head, once the loss function's arguments and the operations
        applied to the marker are checked to be those the fused loss assumed."""
        if labels is not self.labels or shift_labels is not self.shift_labels \
                or num_items_in_batch is not self.num_items_in_batch:
            self.fail("passes its loss function other labels than it was given")
        if vocab_size != self.head.weight.shape[0]:
            self.fail(f"computes its loss over {vocab_size} classes, not lm_head's "
                      f"{self.head.weight.shape[0]}")
        self.check_steps()
        self.consumed = True
        # Collected only now: a call that declines before this point computes its loss over the
        # real logits, which collects its own metrics, so each loss counts once.
        if self.metrics is not None:
            _collect(*self.metrics, True)  # armed only with gradients enabled
        return self.loss

    def consume_dtensor_marker(self, logits, labels, vocab_size, shift_labels, num_items_in_batch):
        """The loss of a tensor-parallel head's call: its output (the DTensor marker in the
        head's output layout) must reach the loss function unchanged. Operations on a DTensor
        are not followed (they run below __torch_function__), so any one of them declines, and
        so does a head that hands its local shard on (use_local_output=True: without fusedce the
        loss would see V_local classes)."""
        if logits is not self.head_output:
            self.fail("applies an operation to the DTensor logits of its tensor-parallel lm_head")
        if not dtensor.is_dtensor(logits):
            self.fail("receives its tensor-parallel lm_head's local logits (the head returns a "
                      "local shard: ColwiseParallel(use_local_output=True))")
        loss = self.finish(labels, vocab_size, shift_labels, num_items_in_batch)
        # The empty marker's sum (exactly 0) joins the loss: the backward reaches the head's
        # output, so the hooks a wrapper put there run (see _dtensor_marker).
        return loss + logits.to_local().sum().to(loss.dtype)

    def fail(self, what):
        raise _Decline(what)

    def decline(self, reason):
        """Decline within the call: from now on every marker of this call stands for its real
        logits (materialize)."""
        if self.declined is None:
            self.declined = reason

    def materialize(self, marker):
        """The real tensor a marker stands for: lm_head's forward of the hidden states it was
        given (its weight as it was in that call, under the call's autocast), then the
        operations recorded up to the marker, replayed in order. Raises _Decline when the
        weight's storage is gone (FSDP frees a gathered weight after the head's call)."""
        depth = marker._depth
        if depth in self.real:
            return self.real[depth]
        if 0 not in self.real:
            for t in (self.weight, self.bias):
                if t is not None and (dtensor.is_dtensor(t) or t.untyped_storage().size() == 0):
                    raise _Decline("uses its logits in a way the fused loss does not follow, after "
                                   "lm_head's gathered weight was released")
            with torch._C.DisableTorchFunctionSubclass():
                self.real[0] = F.linear(self.hidden, self.weight, self.bias)
        start = max(d for d in self.real if d <= depth)
        x = self.real[start]
        for d in range(start + 1, depth + 1):
            func, args, kwargs = self.ops[d - 1]
            args = [x if isinstance(a, _PendingLogits) else a for a in args]
            with torch._C.DisableTorchFunctionSubclass():
                x = func(*args, **kwargs)
            self.real[d] = x
        return x

    def realize(self, value):
        """`value` with every marker of this call replaced by its real tensor (one level of
        tuples, lists and dict values: the arguments of an operation)."""
        if isinstance(value, _PendingLogits) and getattr(value, "_pending", None) is self:
            return self.materialize(value)
        if isinstance(value, (tuple, list)):
            return type(value)(self.realize(v) for v in value)
        if isinstance(value, dict):
            return {k: self.realize(v) for k, v in value.items()}
        return value

    def real_output(self, out):
        """The model's output with the markers it holds (its logits) made real."""
        if isinstance(out, dict):  # a ModelOutput (an OrderedDict)
            for key, value in list(out.items()):
                if isinstance(value, _PendingLogits) and getattr(value, "_pending", None) is self:
                    out[key] = self.materialize(value)
            return out
        if isinstance(out, tuple):
            return tuple(self.realize(v) for v in out)
        return self.realize(out)

    def record(self, func, args, kwargs, source):
        """Note an operation on the marker `source`; only a chain of scalings, tanh and dtype
        casts is followed (what Gemma's softcap and Cohere's or Granite's scale are made of)."""
        name = getattr(func, "__name__", repr(func))
        if source is not self.latest:
            self.fail(f"uses its logits more than once (in {name})")
        if kwargs or not args or args[0] is not source:
            self.fail(f"applies {name} to its logits")
        rest = args[1:]
        if name in _SCALE_OPS and len(rest) == 1 and _is_number(rest[0]):
            factor = float(rest[0])
            self.steps.append(("scale", 1.0 / factor if name in _DIVIDE_OPS else factor))
        elif name == "tanh" and not rest:
            self.steps.append(("tanh",))
        elif name in ("float", "to", "type_as") and all(isinstance(r, torch.dtype) or _is_float_tensor(r)
                                                        for r in rest):
            pass  # a cast: the fused loss computes in float32 whatever the logits' dtype
        elif name == "contiguous" and not rest:
            pass  # the same values
        else:
            self.fail(f"applies {name} to its logits")
        self.ops.append((func, tuple(args), dict(kwargs)))

    def check_steps(self):
        """The recorded operations equal the config's transform on sample logits."""
        x = torch.linspace(-60.0, 60.0, 241, dtype=torch.float64)
        y = x.clone()
        for step in self.steps:
            y = y * step[1] if step[0] == "scale" else torch.tanh(y)
        z = x * self.logit_scale
        if self.softcap:
            z = self.softcap * torch.tanh(z / self.softcap)
        if not torch.allclose(y, z, rtol=1e-9, atol=1e-12):
            ops = ", ".join(s[0] if len(s) == 1 else f"{s[0]} {s[1]:g}" for s in self.steps) or "nothing"
            self.fail(f"transforms its logits by [{ops}] while its config declares "
                      f"logit_scale={self.logit_scale:g}, softcap={self.softcap}")


_HARMLESS_ATTRIBUTES = {"device", "dtype", "requires_grad", "is_cuda", "layout"}
_SCALE_OPS = {"__mul__", "__rmul__", "mul", "__truediv__", "div", "true_divide"}
_DIVIDE_OPS = {"__truediv__", "div", "true_divide"}


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and value != 0


def _is_float_tensor(value):
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _fused_head_forward(head, pending, hidden):
    """lm_head's forward for an armed call: the loss of the whole batch from `hidden` and the
    head's own weight (inside the head's call), and a marker in place of the logits. A second
    call of the head in the same model call gets ordinary logits, and so does a head whose
    call dynamo traces (a model whose forward is compiled while its call is not, as
    ``model.compile()`` makes it): the marker cannot live in a graph, and that call's loss
    comes from the logits."""
    if pending.head_called or torch.compiler.is_compiling():
        return torch.nn.Linear.forward(head, hidden)
    pending.head_called = True
    target, shift = _head_target(pending.labels, pending.shift_labels, hidden)
    if target.shape != hidden.shape[:-1]:
        # lm_head sees other positions than the labels name (Git prepends its image tokens
        # and slices them off the logits before its loss): the real logits, declined here.
        pending.decline(f"calls lm_head on {tuple(hidden.shape[:-1])} positions while its labels "
                        f"are {tuple(target.shape)}")
        return torch.nn.Linear.forward(head, hidden)
    pending.hidden, pending.weight, pending.bias = hidden, head.weight, head.bias
    loss, pending.metrics = _head_loss(head, hidden, target, shift, pending.ignore_index,
                                       pending.num_items_in_batch, pending.logit_scale,
                                       pending.softcap)
    pending.loss = loss
    weight = head.weight
    if dtensor.is_dtensor(weight):
        # A tensor-parallel head (ColwiseParallel): its output hook takes a DTensor sharded on
        # the classes; an empty one, whose identity the loss function checks.
        pending.dtensor_marker = _dtensor_marker(hidden, weight, loss)
        return pending.dtensor_marker
    marker = hidden.new_empty((*hidden.shape[:-1], 0)).as_subclass(_PendingLogits)
    marker._pending = pending
    marker._depth = 0
    pending.latest = marker
    return marker


def _head_target(labels, shift_labels, hidden):
    """(target, shift) of the fused loss: precomputed shift_labels as they are, else the labels
    shifted inside the loss (the first label predicts nothing)."""
    if shift_labels is not None:
        return shift_labels.to(hidden.device), False
    return labels.to(hidden.device), True


def _head_loss(head, hidden, target, shift, ignore_index, num_items, logit_scale, softcap):
    """(loss, metrics) of lm_head's call: fused linear cross-entropy of `hidden` and the head's
    weight and bias in the dtype nn.Linear would compute in, normalised by `num_items`
    (num_items_in_batch) or a mean; metrics (metrics, number of scored targets) with
    apply(metrics=True), else None."""
    weight, bias = head.weight, head.bias
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # nn.Linear would run in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    loss = linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                reduction="mean" if num_items is None else "sum",
                                logit_scale=logit_scale, softcap=softcap, shift=shift,
                                return_metrics=_metrics)
    metrics = None
    if _metrics:
        loss, values = loss
        scored = target[..., 1:] if shift else target  # shift: the first label predicts nothing
        metrics = (values, (scored != ignore_index).sum())
    if num_items is not None:
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        loss = loss / num_items
    return loss, metrics


def _dtensor_marker(hidden, weight, loss):
    """An empty (..., 0) DTensor over weight's mesh, sharded on its last dimension where the
    weight is sharded and replicated elsewhere: the marker of a tensor-parallel head, as
    ColwiseParallel's output hook expects its output. With gradients on, it is a function of
    the loss (and the loss function adds its empty sum back), so the backward reaches the head's
    output before the loss's own backward: FSDP2 gathers a head's weight for the backward in a
    hook on that output (with TP, the gathered weight is rebuilt only there)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = hidden.to_local() if dtensor.is_dtensor(hidden) else hidden
    shape = (*local.shape[:-1], 0)
    if loss.requires_grad:
        empty = loss.sum().to(local.dtype).reshape([1] * len(shape)).expand(shape).clone()
    else:
        empty = local.new_empty(shape)
    placements = [Replicate() if p.is_replicate() else Shard(-1) for p in weight.placements]
    return DTensor.from_local(empty, weight.device_mesh, placements, run_check=False)


class _PendingLogits(torch.Tensor):
    """The empty stand-in for the logits that an armed lm_head returns. While its model call
    runs, every operation on it is recorded (_Pending.record) and yields a new marker; the
    causal-LM loss function takes the loss from it. Afterwards it behaves as a plain empty
    tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = next((a for a in args if isinstance(a, _PendingLogits)), None)
        if source is None:
            source = next((a for a in kwargs.values() if isinstance(a, _PendingLogits)), None)
        pending = getattr(source, "_pending", None)
        if pending is None or pending.closed or pending.consumed:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = getattr(func, "__name__", repr(func))
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
            if name in _HARMLESS_ATTRIBUTES:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        if pending.declined is None:
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                if not isinstance(out, torch.Tensor):
                    # shape, size, numel, item, ...: the marker's answer is not the logits'
                    pending.fail(f"reads {name} of its logits")
                pending.record(func, args, kwargs, source)
            except _Decline as e:
                pending.decline(str(e))
            except Exception:
                pending.decline(f"applies {name} to its logits")
            else:
                marker = out.as_subclass(cls)
                marker._pending = pending
                marker._depth = len(pending.ops)
                pending.latest = marker
                return marker
        # Declined within the call: the operation on the real logits.
        args, kwargs = pending.realize(args), pending.realize(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def consume(self, labels, vocab_size, shift_labels, num_items_in_batch):
        """(loss, None): the loss computed in lm_head, once the loss function's arguments and
        the operations since lm_head are checked to be those the fused loss assumed; or
        (None, logits): the call declined (now or earlier), and the loss function computes
        the loss of these real logits."""
        pending = getattr(self, "_pending", None)
        if pending is None or pending.closed or pending.consumed:
            raise RuntimeError("fusedce.transformers: logits from an earlier fused_linear call "
                               "were passed to a loss function")  # no call to fall back to
        if pending.declined is None:
            try:
                if self is not pending.latest:
                    pending.fail("passes an earlier version of its logits to its loss")
                return pending.finish(labels, vocab_size, shift_labels, num_items_in_batch), None
            except _Decline as e:
                pending.decline(str(e))
        return None, pending.materialize(self)


# ---- metrics: token accuracy and entropy from the fused call ------------------------------------


class TokenSums:
    """Sums over the scored (non-ignored) targets of the losses of one owner: argmax hits
    (int64), softmax entropy in nats (float64, so that sums over many steps do not drift), and
    the number of targets (int64). 0-D tensors on the device of the first loss added, so that
    adding a micro-batch is three device-side additions and never waits for the device."""

    __slots__ = ("num_correct", "entropy_sum", "tokens")

    def __init__(self):
        self.num_correct = self.entropy_sum = self.tokens = None

    def add(self, num_correct, entropy_sum, tokens):
        if self.tokens is None:
            device = tokens.device
            self.num_correct = torch.zeros((), dtype=torch.int64, device=device)
            self.entropy_sum = torch.zeros((), dtype=torch.float64, device=device)
            self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        device = self.tokens.device  # a model split over devices sends its sums to the first one
        self.num_correct += num_correct.detach().to(device)
        self.entropy_sum += entropy_sum.detach().to(device, torch.float64)
        self.tokens += tokens.detach().to(device)

    def reset(self):
        self.num_correct = self.entropy_sum = self.tokens = None

    def values(self, device=None):
        """(num_correct, entropy_sum, tokens) as one float64 (3,) tensor on `device` (the sums'
        own by default); zeros when nothing was added. float64 holds the counts exactly below
        2**53."""
        if self.tokens is None:
            return torch.zeros(3, dtype=torch.float64, device=device)
        out = torch.stack([self.num_correct.double(), self.entropy_sum, self.tokens.double()])
        return out if device is None else out.to(device)


_sums = weakref.WeakKeyDictionary()  # model -> TokenSums of the losses computed in its calls
_unowned = TokenSums()  # losses computed outside any model call, in a compiled call, or in a
                        # DataParallel replica (a new module object every step)
# The same for the losses computed without gradients (evaluation), kept apart from training's.
_eval_sums = weakref.WeakKeyDictionary()
_eval_unowned = TokenSums()
_calls = threading.local()  # .stack: the PreTrainedModel calls in progress in this thread
_adding = threading.Lock()  # DataParallel's replicas run their losses in concurrent threads


def _model_calls():
    stack = getattr(_calls, "stack", None)
    if stack is None:
        stack = _calls.stack = []
    return stack


def _store(evaluation):
    """(per-model sums, unowned sums) of training's losses or, `evaluation`, of those computed
    without gradients."""
    return (_eval_sums, _eval_unowned) if evaluation else (_sums, _unowned)


@torch.compiler.disable
def _collect(metrics, tokens, training):
    """Add one loss's metrics to the sums of the outermost model whose call is in progress:
    training's sums for a loss computed with gradients enabled (`training`), evaluation's
    otherwise. Outside dynamo's graph (a compiled model's loss breaks the graph here), so that
    the sums are ordinary tensors updated in place."""
    stack = getattr(_calls, "stack", None)
    owner = stack[0] if stack and not getattr(stack[0], "_is_replica", False) else None
    per_model, unowned = _store(not training)
    with _adding:
        if owner is None:
            sums = unowned
        else:
            sums = per_model.get(owner)
            if sums is None:
                sums = per_model[owner] = TokenSums()
        sums.add(metrics["num_correct_tokens"], metrics["entropy_sum"], tokens)


def _owned_by(model, evaluation=False):
    """The TokenSums that `model`'s metrics are made of: those of `model` and of every module
    inside it (a wrapper such as a PEFT model, DDP or an OptimizedModule holds the
    PreTrainedModel whose calls collected them), and the unowned ones; every one for None."""
    per_model, unowned = _store(evaluation)
    if model is None:
        return [*per_model.values(), unowned]
    modules = model.modules() if isinstance(model, torch.nn.Module) else (model,)
    return [s for s in (per_model.get(m) for m in modules) if s is not None] + [unowned]


def _summed(model, device=None, evaluation=False):
    """(num_correct, entropy_sum, tokens) summed over _owned_by(model, evaluation), float64
    (3,) on `device` (by default the device of the first sums that hold any)."""
    owned = _owned_by(model, evaluation)
    if device is None:
        device = next((s.tokens.device for s in owned if s.tokens is not None), "cpu")
    return torch.stack([s.values(device) for s in owned]).sum(0)


def _as_metrics(values):
    """{"token_accuracy", "entropy", "tokens"} from summed (num_correct, entropy_sum, tokens);
    the means are NaN when no token was scored."""
    correct, entropy, tokens = values.tolist()  # the one host synchronisation
    mean = (lambda x: x / tokens) if tokens else (lambda x: math.nan)
    return {"token_accuracy": mean(correct), "entropy": mean(entropy), "tokens": int(tokens)}


def token_metrics(model=None, reset=False, evaluation=False):
    """The token metrics collected under ``apply(metrics=True)`` since the last reset:
    ``{"token_accuracy": hits / tokens, "entropy": mean softmax entropy in nats, "tokens": the
    number of scored (non-ignored) targets}``, summed over every loss computed with gradients
    enabled (with `evaluation`: without gradients, as Trainer.evaluate computes them; the two
    are kept apart) in calls of `model` (or of a PreTrainedModel inside it), plus the unowned
    ones (computed outside any model call, in a compiled call or in a DataParallel replica);
    `model=None`: every loss. The means are NaN when no token was scored. Reads the device
    once; ``reset`` then zeroes those sums."""
    values = _summed(model, evaluation=evaluation)
    if reset:
        reset_token_metrics(model, evaluation)
    return _as_metrics(values)


def reset_token_metrics(model=None, evaluation=False):
    """Zero the sums that token_metrics(model, evaluation=evaluation) reads."""
    for sums in _owned_by(model, evaluation):
        sums.reset()


def _make_metrics_callback():
    from transformers import TrainerCallback
    from transformers.training_args import ParallelMode

    class MetricsCallback(TrainerCallback):
        """Adds ``token_accuracy`` and ``entropy`` (mean per-token softmax entropy, nats) to
        every training log of a ``Trainer`` (a log with ``loss``), from the sums that
        ``apply(metrics=True)`` collects: over every micro-batch of every step since the
        previous log, and over every rank under DDP (summed there, as the counts are, before
        dividing). The sums are reset at every training log and when training begins.
        Likewise ``eval_token_accuracy`` and ``eval_entropy`` (``<prefix>_...`` for
        Trainer.evaluate's metric_key_prefix) in every evaluation log, from the sums of the
        losses computed without gradients since the previous evaluation log (or prediction).

        Trainer calls callbacks in order, and the report_to integrations (wandb, TensorBoard,
        ...) come before callbacks passed to Trainer; :func:`add_metrics_callback` puts this one
        first so that they see the metrics. Wherever it is, it also writes them into the entry
        of ``trainer.state.log_history`` that Trainer made for the log (Trainer appends a copy
        of the logs there before calling on_log)."""

        def __init__(self):
            self._warned = False

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            reset_token_metrics(model)
            reset_token_metrics(model, evaluation=True)

        def on_predict(self, args, state, control, model=None, **kwargs):
            # Trainer.predict logs nothing: its losses must not count in the next evaluation.
            reset_token_metrics(model, evaluation=True)

        def _read(self, args, model, evaluation):
            values = _summed(model, args.device, evaluation)
            reset_token_metrics(model, evaluation)
            if args.parallel_mode == ParallelMode.DISTRIBUTED and torch.distributed.is_initialized():
                torch.distributed.all_reduce(values)
            return _as_metrics(values)

        @staticmethod
        def _write(state, logs, key, new):
            logs.update(new)
            # Trainer.log appends a copy of `logs` to the history just before on_log.
            last = state.log_history[-1] if state.log_history else None
            if last is not None and last.get("step") == state.global_step \
                    and last.get(key) == logs[key]:
                last.update(new)

        def _on_evaluation_log(self, args, state, logs, model):
            """``<prefix>_token_accuracy`` and ``<prefix>_entropy`` next to an evaluation's
            ``<prefix>_loss`` (Trainer.evaluate's metric_key_prefix, "eval" by default)."""
            prefix = next((k[:-len("_runtime")] for k in logs
                           if k.endswith("_runtime") and k[:-len("_runtime")] + "_loss" in logs),
                          None)
            if prefix is None:
                return  # the end-of-training summary, or a log of the user's
            metrics = self._read(args, model, evaluation=True)
            if metrics["tokens"]:
                self._write(state, logs, prefix + "_loss",
                            {prefix + "_token_accuracy": metrics["token_accuracy"],
                             prefix + "_entropy": metrics["entropy"]})

        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if logs is None:
                return
            if "loss" not in logs:
                return self._on_evaluation_log(args, state, logs, model)
            metrics = self._read(args, model, evaluation=False)
            if metrics["tokens"] == 0:
                if not self._warned:
                    self._warned = True
                    warnings.warn("fusedce.transformers.MetricsCallback: no token metrics were "
                                  "collected since the previous log (call "
                                  "fusedce.transformers.apply(metrics=True) before training; "
                                  "models that compute their own loss have none)", stacklevel=2)
                return
            self._write(state, logs, "loss", {"token_accuracy": metrics["token_accuracy"],
                                              "entropy": metrics["entropy"]})

    return MetricsCallback


def add_metrics_callback(trainer):
    """Insert a MetricsCallback ahead of `trainer`'s other callbacks (so that the report_to
    integrations log the metrics too) and return it."""
    callback = _metrics_callback_class()()
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


def _metrics_callback_class():
    # MetricsCallback subclasses transformers' TrainerCallback: made on first use (one class
    # for the process), so that importing fusedce does not import transformers.
    cls = globals().get("MetricsCallback")
    if cls is None:
        cls = globals()["MetricsCallback"] = _make_metrics_callback()
    return cls


def __getattr__(name):
    if name == "MetricsCallback":
        return _metrics_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
