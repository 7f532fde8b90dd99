"""``PreTrainedModel.__call__`` while fused_linear or metrics is on: which calls are armed (a
training call with labels of a model whose forward calls its causal-LM loss function and whose
lm_head is a plain ``nn.Linear``), the armed run of a call (lm_head's forward swapped for the
fused one for that call alone), and the call that dynamo traces (planned, see _plans)."""

import inspect

import torch

from . import _settings
from ._head import _fused_head_forward
from ._loss import causal_lm_loss
from ._marker import _Decline
from ._metrics import _model_calls
from ._pending import _armed, _Pending
from ._plans import _PLAN, _CompiledCall, _compiled, _is_compiled_head_forward, _record_plan
from ._replay import _declined, _note_decline, _rng_state, _set_rng_state
from ._source import _calls_loss_function

_unset = object()
_original_call = None  # while wrapped: PreTrainedModel.__dict__'s own __call__, or _unset


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


def _model_call(self, *args, **kwargs):
    """PreTrainedModel.__call__ while fused_linear or metrics is on. With metrics, the model is
    pushed on this thread's stack of model calls for the call's duration, so that a loss knows
    the outermost model it belongs to. Traced by dynamo (a model compiled after apply()), it
    takes the compiled path (_compiled_model_call)."""
    if torch.compiler.is_compiling():
        return _compiled_model_call(self, args, kwargs)
    return _eager_call(self, args, kwargs)


def _eager_call(self, args, kwargs, plan=False):
    if not _settings.metrics:
        return _armed_call(self, args, kwargs, plan)
    stack = _model_calls()
    stack.append(self)
    try:
        return _armed_call(self, args, kwargs, plan)
    finally:
        stack.pop()


def _fusable_head(model):
    head = model.get_output_embeddings()
    return (isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
            and ("forward" not in head.__dict__
                 or _is_compiled_head_forward(head.__dict__["forward"])))


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
    if not _settings.fused_linear or not torch.is_grad_enabled():
        return None
    labels = _labels_of(model, args, kwargs)
    if labels is None:
        return None
    if getattr(model, "loss_function", None) is not causal_lm_loss or model in _declined \
            or not _calls_loss_function(type(model)) or not _fusable_head(model):
        return None
    return _Pending(model, model.get_output_embeddings(), labels, kwargs)


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
    out, reason, rerun = _run_armed(self, pending, args, kwargs)
    if reason is None:
        if plan:
            _record_plan(self, pending)
        return out
    if plan:
        _record_plan(self, None)
    _note_decline(self, reason)
    if rerun is None:
        return out
    _set_rng_state(rng)
    return torch.nn.Module.__call__(self, *args, **kwargs)


def _run_armed(model, pending, args, kwargs):
    """`model`'s call run once with its lm_head armed for `pending`: (output, the reason the
    call declined or None, that reason again when the decline escaped the call, which then
    has no output)."""
    head = pending.head
    previous = head.__dict__.get("forward")  # None, or the head's _compiled_head_forward
    head.forward = lambda hidden: _fused_head_forward(head, pending, hidden)
    # What lm_head's call returns after every hook of its own (ColwiseParallel's output hook
    # turns a DTensor marker into its output layout): registered last, so it runs last.
    seen = head.register_forward_hook(lambda module, inputs, output: pending.saw_output(output))
    outer, _armed.pending = getattr(_armed, "pending", None), pending
    out = reason = rerun = None
    try:
        out = torch.nn.Module.__call__(model, *args, **kwargs)
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
        _disarm(head, previous, pending)
    return out, reason, rerun


def _disarm(head, previous, pending):
    """lm_head's forward as it was before the armed call (`previous`), and `pending` closed."""
    if previous is None:
        del head.forward
    else:
        head.forward = previous
    pending.closed = True
    # The output's marker keeps its _Pending alive as long as the caller keeps the output:
    # it must not keep the hidden states, the weight or real logits alive with it.
    pending.hidden = pending.weight = pending.bias = None
    pending.ops, pending.real = [], {}


def _compiled_model_call(self, args, kwargs):
    """A model call that dynamo traces. Planned fused (see _plans) for a training call with
    labels; the first such call of a model plans it, eagerly; every other call is the model's
    own (its loss through causal_lm_loss over the logits)."""
    if not _settings.fused_linear or not torch.is_grad_enabled() \
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
