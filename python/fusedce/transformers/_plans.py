"""fused_linear under torch.compile: compiled plans.

The marker cannot live in a graph (its bookkeeping is Python state that dynamo would freeze),
so a compiled model call works from a plan instead. The first training call with labels of a
model whose call dynamo traces runs eagerly (a graph break): the armed call with every check
of the eager path, declining as it would uncompiled. If it was served fused, the model gets a
plan (the logit transform its loss verified, and its lm_head), and its lm_head a forward that
computes the fused loss while a planned compiled call of its model is in progress
(_compiled_head_forward). From then on dynamo traces the planned call: plain tensors and plain
Python objects, so the fused op is in the graph and no (N, V) logits are. What the eager call
verified by recording the marker's operations (the transform between lm_head and the loss,
the arguments the loss function gets) the planned call relies on, checking what it can while
tracing (shapes, the identity of the labels). A model that declined, or is not served fused
for another reason, is compiled over its logits."""

import functools
import weakref

import torch

from .. import dtensor
from ._head import _head_loss, _head_target
from ._metrics import _collect

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

