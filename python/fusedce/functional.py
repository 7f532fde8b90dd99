"""fusedce.cross_entropy: a drop-in for torch.nn.functional.cross_entropy over (..., V) logits.

This layer flattens leading dimensions (without a copy where the strides allow), checks what it
must to give clear errors, and picks the op; every number comes from the core.
"""

import torch

from . import _library, distributed
from .ops import FusedCrossEntropy, call_below_autograd, ops

_REDUCTIONS = ("none", "sum", "mean")


def _rows(logits, vocab):
    """logits as (N, V) with unit stride along V; a view of `logits` whenever the leading
    dimensions collapse to one row stride (a copy only otherwise)."""
    x = logits if logits.dim() == 2 else logits.reshape(-1, vocab)  # (a reshape costs ~3 us of host time)
    if x.shape[0] > 1 and vocab > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x


def cross_entropy(logits, target, weight=None, *, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0,
                  inplace_backward=False, return_metrics=False, process_group=None,
                  vocab_start=None, vocab_total=None):
    """Cross-entropy of ``logits`` (..., V) against class indices ``target`` (...), as
    ``F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ...)`` computes it, fused: the
    loss and its gradient come from one read of the logits, and the logits are never copied or
    upcast.

    Args:
        logits: float32, bfloat16 or float16, shape (..., V); the last dimension must be
            contiguous for a copy-free call (rows may be strided, e.g. a slice of a larger buffer).
        target: int64 or int32, shape logits.shape[:-1]; values in [0, V) or ``ignore_index``.
        weight: per-class weights (V,), as ``F.cross_entropy``'s ``weight`` (used in float32).
        ignore_index: rows with this target add nothing to the loss, gradients or the mean.
        reduction: 'none' (loss of target's shape), 'sum' or 'mean' (over non-ignored rows,
            weighted by ``weight[target]`` when weights are given; NaN if every row is ignored).
        label_smoothing: in [0, 1], as in PyTorch.
        logit_scale: the logits are multiplied by this before anything else.
        softcap: if given (> 0), logits become ``softcap * tanh(logits / softcap)`` (after
            scaling), as in Gemma 2.
        z_loss: adds ``z_loss * logsumexp(logits)**2`` per non-ignored row (PaLM's z-loss).
        inplace_backward: overwrite ``logits`` with their gradient during the forward (no
            second (N, V) buffer). The logits' values are gone after the call, so nothing else
            may need them; autograd's version check reports it if something does. (Logits whose
            rows cannot be viewed as (N, V) without a copy are copied, and the copy is
            overwritten.) In eager mode
            only: under torch.compile the call falls back to the out-of-place path, because an op
            that mutates its differentiable input cannot be differentiated in a compiled graph.
        return_metrics: also return ``{"num_correct": int64 0-D tensor, "entropy_sum": float32
            0-D tensor, "lse": float32 (N,) tensor}`` (counts and sums over non-ignored rows, not
            means; lse is 0 at ignored rows). These are not differentiable.
        process_group: a ``torch.distributed`` group whose ranks split the vocabulary: this rank's
            ``logits`` are columns ``[vocab_start, vocab_start + V_local)`` of the full logits,
            ``weight`` is its slice of the class weights, ``target`` holds global indices; the
            loss and metrics are those of the full logits on every rank, the gradient this
            rank's slice. See :mod:`fusedce.distributed` for the layout rules of
            ``vocab_start`` / ``vocab_total`` and what crosses ranks (one all-gather of per-row
            scalars). ``inplace_backward`` is not available there.

    Returns:
        The float32 loss, or ``(loss, metrics)`` with ``return_metrics=True``.

    The gradient is formed in the forward sweep (for an upstream gradient of 1) whenever the
    logits require grad, and the backward only scales it by the upstream gradient (no work at
    all when that is 1). When the logits do not require grad, only the forward runs.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"fusedce.cross_entropy: logits must be a tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"fusedce.cross_entropy: target must be a tensor, got {type(target).__name__}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"fusedce.cross_entropy: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"fusedce.cross_entropy: logits must have shape (..., V) with V >= 1, "
                         f"got {tuple(logits.shape)}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"fusedce.cross_entropy: target must have shape logits.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}")
    if target.device != logits.device:
        raise ValueError(f"fusedce.cross_entropy: target is on {target.device} but logits are on "
                         f"{logits.device}")
    if logits.is_cuda and not _library.with_cuda:
        raise RuntimeError("fusedce.cross_entropy: logits are on a CUDA device but this build of "
                           "fusedce has no CUDA kernels (it was built without nvcc or with a "
                           "CPU-only torch)")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fusedce.cross_entropy: softcap must be None (off) or > 0, got {softcap}")
    vocab = logits.shape[-1]
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or weight.shape != (vocab,):
            raise ValueError(f"fusedce.cross_entropy: weight must be a tensor of shape ({vocab},), "
                             f"got {getattr(weight, 'shape', type(weight).__name__)}")
        if weight.device != logits.device:
            raise ValueError(f"fusedce.cross_entropy: weight is on {weight.device} but logits are on "
                             f"{logits.device}")
        weight = weight.to(torch.float32)

    x = _rows(logits, vocab)
    t = target if target.dim() == 1 else target.reshape(-1)
    args = (x, t, weight, int(ignore_index), reduction, float(label_smoothing),
            float(logit_scale), float(softcap or 0.0), float(z_loss), bool(return_metrics))

    if process_group is not None:
        if inplace_backward:
            raise ValueError("fusedce.cross_entropy: inplace_backward is not available with "
                             "process_group")
        loss, lse, num_correct, entropy_sum = distributed.cross_entropy_rows(
            x, t, weight, args[3:9], args[9], process_group=process_group, vocab_start=vocab_start,
            vocab_total=vocab_total)
    elif torch.is_grad_enabled() and logits.requires_grad:
        inplace = bool(inplace_backward) and not torch.compiler.is_compiling()
        loss, lse, num_correct, entropy_sum = FusedCrossEntropy.apply(*args, inplace)
    else:
        loss, lse, num_correct, entropy_sum = call_below_autograd(ops.ce_fwd.default, *args)

    if reduction == "none":
        loss = loss.view(target.shape)
    if return_metrics:
        return loss, {"num_correct": num_correct, "entropy_sum": entropy_sum, "lse": lse}
    return loss
