"""fusedce.CrossEntropyLoss: torch.nn.CrossEntropyLoss with fusedce's options;
fusedce.LinearCrossEntropyLoss: the same loss taken from hidden states and a head's weight."""

import torch
from torch.nn.modules.loss import _WeightedLoss

from .functional import cross_entropy
from .linear import linear_cross_entropy


class CrossEntropyLoss(_WeightedLoss):
    """Mirrors ``torch.nn.CrossEntropyLoss`` (same arguments, the class weights kept as the
    buffer ``weight``), computed by :func:`fusedce.cross_entropy`; input is (..., V) logits and
    target (...) class indices. The keyword-only arguments are fusedce's extra options, as in
    :func:`fusedce.cross_entropy`. With ``process_group`` the vocabulary is split across its
    ranks (input is this rank's (..., V_local) shard, ``weight`` its slice of the class weights;
    :mod:`fusedce.distributed`)."""

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "logit_scale", "softcap",
                     "z_loss", "inplace_backward", "return_metrics", "check_targets", "strict"]

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None,
                 reduction="mean", label_smoothing=0.0, *, logit_scale=1.0, softcap=None,
                 z_loss=0.0, inplace_backward=False, return_metrics=False, check_targets=False,
                 strict=False, process_group=None, vocab_start=None, vocab_total=None):
        super().__init__(weight, size_average, reduce, reduction)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.softcap = softcap
        self.z_loss = z_loss
        self.inplace_backward = inplace_backward
        self.return_metrics = return_metrics
        self.check_targets = check_targets
        self.strict = strict
        self.process_group = process_group
        self.vocab_start = vocab_start
        self.vocab_total = vocab_total

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             logit_scale=self.logit_scale, softcap=self.softcap,
                             z_loss=self.z_loss, inplace_backward=self.inplace_backward,
                             return_metrics=self.return_metrics,
                             check_targets=self.check_targets, strict=self.strict,
                             process_group=self.process_group, vocab_start=self.vocab_start,
                             vocab_total=self.vocab_total)

    def extra_repr(self):
        parts = [f"reduction={self.reduction!r}", f"ignore_index={self.ignore_index}"]
        for name, default in (("label_smoothing", 0.0), ("logit_scale", 1.0), ("softcap", None),
                              ("z_loss", 0.0), ("inplace_backward", False),
                              ("return_metrics", False), ("check_targets", False),
                              ("strict", False), ("vocab_start", None),
                              ("vocab_total", None)):
            value = getattr(self, name)
            if value != default:
                parts.append(f"{name}={value}")
        if self.process_group is not None:
            parts.append("process_group=<set>")
        return ", ".join(parts)


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of :func:`fusedce.linear_cross_entropy` as a module: the options are fixed at
    construction (the class weights kept as the buffer ``class_weight``), and
    ``forward(hidden, weight, target, bias=None)`` takes a language model's last hidden states
    (..., H) and its head's ``weight`` (V, H) (and ``bias``), never forming the logits."""

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "logit_scale", "softcap",
                     "z_loss", "shift", "return_metrics", "chunk_budget_bytes", "low_memory",
                     "check_targets"]

    def __init__(self, class_weight=None, *, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0, shift=False,
                 return_metrics=False, chunk_budget_bytes=None, low_memory=False,
                 check_targets=False):
        super().__init__()
        self.register_buffer("class_weight", class_weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.softcap = softcap
        self.z_loss = z_loss
        self.shift = shift
        self.return_metrics = return_metrics
        self.chunk_budget_bytes = chunk_budget_bytes
        self.low_memory = low_memory
        self.check_targets = check_targets

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor = None):
        return linear_cross_entropy(
            hidden, weight, target, bias, class_weight=self.class_weight,
            ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
            softcap=self.softcap, z_loss=self.z_loss, shift=self.shift,
            return_metrics=self.return_metrics, chunk_budget_bytes=self.chunk_budget_bytes,
            low_memory=self.low_memory, check_targets=self.check_targets)

    def extra_repr(self):
        parts = [f"reduction={self.reduction!r}", f"ignore_index={self.ignore_index}"]
        for name, default in (("label_smoothing", 0.0), ("logit_scale", 1.0), ("softcap", None),
                              ("z_loss", 0.0), ("shift", False), ("return_metrics", False),
                              ("chunk_budget_bytes", None), ("low_memory", False),
                              ("check_targets", False)):
            value = getattr(self, name)
            if value != default:
                parts.append(f"{name}={value}")
        return ", ".join(parts)
