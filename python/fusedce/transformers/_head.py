"""The fused head: lm_head's forward in an armed call, which computes the loss of the whole
batch from its input and its own weight (fused linear cross-entropy, the config's logit
transform applied) inside the head's call, and returns a marker in place of the logits."""

import torch

from .. import dtensor
from ..linear import linear_cross_entropy
from . import _settings
from ._marker import _PendingLogits


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


def _chunk_budget(weight):
    """The fused loss's chunk_budget_bytes under apply()'s setting: "head" is the bytes of the
    weight as the loss computes it (a tensor-parallel head's local shard), or the loss's own
    default with low_memory, whose bound a larger buffer would break."""
    budget = _settings.chunk_budget_bytes
    if budget != "head":
        return budget
    if _settings.low_memory:
        return None
    local = weight.to_local() if dtensor.is_dtensor(weight) else weight
    return local.numel() * local.element_size()


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
                                return_metrics=_settings.metrics, chunk_budget_bytes=_chunk_budget(weight),
                                low_memory=_settings.low_memory, skip_ignored=_settings.skip_ignored)
    metrics = None
    if _settings.metrics:
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

