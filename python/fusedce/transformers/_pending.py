"""The record of one armed model call (_Pending): the labels and loss options it was given,
the loss lm_head computed, the operations applied to the marker since, checked against the logit
transform the model's config declares before the loss is handed to the loss function; and the
armed call in progress in this thread."""

import math
import threading

import torch

from .. import dtensor
from ._marker import _Decline
from ._metrics import _collect
from ._replay import _Replay


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


class _Pending(_Replay):
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
        super().__init__()

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


_SCALE_OPS = {"__mul__", "__rmul__", "mul", "__truediv__", "div", "true_divide"}
_DIVIDE_OPS = {"__truediv__", "div", "true_divide"}


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and value != 0


def _is_float_tensor(value):
    return isinstance(value, torch.Tensor) and value.is_floating_point()

