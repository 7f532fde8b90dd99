"""A model that declines the fused loss within its armed call: the real logits each marker
stands for, replayed from lm_head's inputs and the operations recorded on the marker (_Replay,
the base of _Pending), the models that declined (they stay on the logits path), and the random
state a rerun starts from when the decline escapes the call."""

import warnings
import weakref

import torch
import torch.nn.functional as F

from .. import dtensor
from ._marker import _Decline, _PendingLogits


# Models whose armed call was declined once: they stay on the logits path (model -> reason).
_declined = weakref.WeakKeyDictionary()
_warned = set()


class _Replay:
    """What a decline within an armed call needs, and the real logits made from it."""

    def __init__(self):
        # What a decline within the call needs: lm_head's inputs as its forward saw them, every
        # followed operation on the marker (func, args, kwargs) in order, the real tensor of
        # each marker depth once made, and the reason once declined.
        self.hidden = self.weight = self.bias = None
        self.ops = []
        self.real = {}
        self.declined = None

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


def _note_decline(model, reason):
    """`model` stays on the logits path; the first decline of its class warns."""
    _declined[model] = reason
    name = type(model).__name__
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"fusedce.transformers: {name} {reason}; its loss is computed from the "
                      "logits instead of the fused linear loss",
                      stacklevel=4)  # _model_call's frame, past _armed_call and _eager_call


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)

