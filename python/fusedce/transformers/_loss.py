"""The losses over logits: transformers' causal-LM loss (``causal_lm_loss``, which also takes
the loss an armed lm_head computed from its marker, or a planned compiled call's), and
``TokenCrossEntropyLoss`` for the models that build their own ``CrossEntropyLoss``."""

import torch
import torch.nn.functional as F

from .. import _library
from ..functional import cross_entropy
from . import _settings
from ._marker import _PendingLogits
from ._metrics import _collect
from ._pending import _armed_with_dtensor_marker
from ._plans import _compiled


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
                         return_metrics=_settings.metrics)
    if _settings.metrics:
        loss, metrics = loss
        _collect(metrics, (shift_labels != ignore_index).sum(), torch.is_grad_enabled())
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


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
                             return_metrics=_settings.metrics)
        if _settings.metrics:
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

