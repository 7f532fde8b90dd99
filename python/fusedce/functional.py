"""fusedce.cross_entropy: a drop-in for torch.nn.functional.cross_entropy.

This layer finds the class dimension (fusedce's (..., V), or PyTorch's (N, C, d1, ...)), flattens
to (N, V) rows (without a copy where the strides allow), checks what it must to give clear
errors, and picks the op; every number comes from the core. What the core does not compute
(class-probability targets, float64 logits) goes to PyTorch's own implementation instead.
"""

import functools

import torch
import torch.nn.functional as F

from . import distributed, dtensor
from ._checks import check_cuda_build, check_same_device, check_target_values, check_tensor, unit_stride_vector
from ._options import Call, Options, VocabParallel
from ._router import route
from .ops import InplaceCrossEntropy, InplaceWrite, Overwritten, ops

_NAME = "fusedce.cross_entropy"


def _rows(logits, vocab):
    """logits as (N, V) with unit stride along V and rows that do not overlap, as the core takes
    them: a view of `logits` whenever the leading dimensions collapse to one row stride of at
    least V, a copy otherwise (a last dimension that is not contiguous; rows that share memory,
    such as an expanded (1, V) row of stride 0, which F.cross_entropy takes and whose gradient
    rows must be distinct)."""
    x = logits if logits.dim() == 2 else logits.reshape(-1, vocab)  # (a reshape costs ~3 us of host time)
    if x.shape[0] > 1 and ((vocab > 1 and x.stride(1) != 1) or x.stride(0) < vocab):
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def _results(out, call, shape):
    """What a front end returns of the ops' (loss, lse, num_correct, entropy_sum): the loss (of
    the target's `shape` for reduction='none'), with the metrics when the call computes them."""
    loss, lse, num_correct, entropy_sum = out
    if call.options.reduction == "none":
        loss = loss.view(shape)
    if call.return_metrics:
        return loss, {"num_correct_tokens": num_correct, "entropy_sum": entropy_sum, "lse": lse}
    return loss


def _class_dim(logits, target):
    """Where the classes are, from the target's shape and dtype, as F.cross_entropy reads them:
    -1 for class indices of shape logits.shape[:-1] ((..., V), and PyTorch's (C,) and (N, C)); 1
    for class indices of shape (N, d1, ...) against (N, C, d1, ...) logits; None for class
    probabilities of logits' own shape (PyTorch's layout throughout). Raises ValueError when the
    shapes fit neither, or fit both ways (C == d1 == ... == dk), where only the caller knows."""
    if logits.dim() == 2 and target.dim() == 1 and not target.is_floating_point():
        # (N, C) with (N,) class indices, the usual call: only classes last can fit.
        if target.shape[0] == logits.shape[0]:
            return -1
    if target.is_floating_point():
        if target.shape == logits.shape:
            return None
        raise ValueError(f"{_NAME}: target must be int64 or int32 class indices, or class "
                         f"probabilities of logits' shape {tuple(logits.shape)}; got {target.dtype} "
                         f"of shape {tuple(target.shape)}")
    last = target.shape == logits.shape[:-1]
    dim1 = logits.dim() >= 3 and target.shape == (logits.shape[0], *logits.shape[2:])
    if last and dim1:
        raise ValueError(
            f"{_NAME}: logits {tuple(logits.shape)} with target {tuple(target.shape)} fit both "
            "layouts, classes last (..., V) and F.cross_entropy's (N, C, d1, ...); flatten them to "
            "(rows, classes) and (rows,) to say which")
    if last:
        return -1
    if dim1:
        return 1
    expected = f"logits.shape[:-1] = {tuple(logits.shape[:-1])}"
    if logits.dim() >= 3:
        expected += f" or (N, d1, ...) = {(logits.shape[0], *logits.shape[2:])}"
    raise ValueError(f"{_NAME}: target must have shape {expected}, got {tuple(target.shape)}")


def cross_entropy(logits, target, weight=None, *, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0,
                  inplace_backward=False, return_metrics=False, check_targets=False, strict=False,
                  process_group=None, vocab_start=None, vocab_total=None):
    """Cross-entropy of ``logits`` against ``target``, as ``F.cross_entropy`` computes it, fused:
    the loss and its gradient come from one read of the logits, and the logits are never upcast.

    Layouts (the target's shape and dtype say which, as for ``F.cross_entropy``):

    * ``(..., V)`` logits with class indices of shape ``(...)``: the fused path, without a copy
      where the rows can be viewed as ``(N, V)``. This covers PyTorch's ``(C,)`` and ``(N, C)``.
    * ``(N, C, d1, ..., dk)`` logits with class indices ``(N, d1, ..., dk)`` (PyTorch's
      K-dimensional layout): the fused path with the classes moved last (a copy).
      Where the shapes fit both layouts (``C == d1 == ... == dk``) the call raises ValueError:
      flatten to ``(rows, C)`` and ``(rows,)`` to say which is meant.
    * What the kernels do not compute goes to PyTorch (``F.cross_entropy``, with logit_scale,
      softcap and z_loss applied around it by the same formulas): class-probability targets
      (a float target of logits' shape, PyTorch's layout) and float64 logits. That result is
      PyTorch's, in its dtype, with PyTorch's gradients; ``inplace_backward`` has no effect there,
      ``return_metrics`` needs class indices, and ``process_group`` is not available. Pass
      ``strict=True`` to get a ValueError instead of this fallback.

    Args:
        logits: float32, bfloat16 or float16 for the fused path (float64 through PyTorch).
            Rows may be strided (a slice of a larger buffer) and are read in place; rows that
            overlap (an expanded tensor) and a last dimension that is not contiguous are copied.
        target: int64 or int32 class indices, values in [0, V) or ``ignore_index``; or class
            probabilities (see Layouts).
        weight: per-class weights (V,), as ``F.cross_entropy``'s ``weight`` (used in float32).
        ignore_index: an integer (not bool); rows with this target add nothing to the loss,
            gradients or the mean.
        reduction: 'none' (loss of target's shape), 'sum' or 'mean' (over non-ignored rows,
            weighted by ``weight[target]`` when weights are given; NaN if every row is ignored).
        label_smoothing: in [0, 1], as in PyTorch (and, as there, used in float32 by a float32
            computation).
        logit_scale: the logits are multiplied by this before anything else.
        softcap: if given (> 0), logits become ``softcap * tanh(logits / softcap)`` (after
            scaling), as in Gemma 2.
        z_loss: adds ``z_loss * logsumexp(logits)**2`` per non-ignored row (PaLM's z-loss).
            logit_scale, softcap and z_loss are held in float32 by the kernels: a non-zero value
            outside float32's normal range (or a ratio logit_scale / softcap outside it) raises
            ValueError rather than becoming 0 or inf.
        inplace_backward: overwrite ``logits`` with their gradient during the forward (no
            second (N, V) buffer). Autograd is told (as for any in-place op): a gradient that
            later flows through the overwritten logits raises, and so does a backward that needs
            their old values; logits that are a leaf requiring grad, or a view of one, are
            refused before any work, as PyTorch refuses in-place ops on them. Logits the call
            copies (see ``logits``) leave the caller's tensor untouched. In eager mode only:
            under torch.compile the call takes the out-of-place path, because an op that mutates
            its differentiable input cannot be differentiated in a compiled graph.
        return_metrics: also return ``{"num_correct_tokens": int64 0-D tensor, "entropy_sum": float32
            0-D tensor, "lse": float32 (N,) tensor}`` (counts and sums over non-ignored rows, not
            means; lse is 0 at ignored rows). These are not differentiable.
        check_targets: check the target values before any work and raise ValueError naming the
            first entry that is neither in [0, V) nor ignore_index. On a GPU this costs one
            device synchronisation (and a graph break under torch.compile); off (default), the
            GPU path never synchronises and such a row's loss and gradient are NaN. The CPU
            always checks.
        strict: raise ValueError instead of falling back to PyTorch (see Layouts).
        process_group: a ``torch.distributed`` group whose ranks split the vocabulary: this rank's
            ``logits`` are columns ``[vocab_start, vocab_start + V_local)`` of the full logits,
            ``weight`` is its slice of the class weights, ``target`` holds global indices; the
            loss and metrics are those of the full logits on every rank, the gradient this
            rank's slice. See :mod:`fusedce.distributed` for the layout rules of
            ``vocab_start`` / ``vocab_total`` and what crosses ranks (one all-gather of per-row
            scalars). ``inplace_backward`` is not available there.

    DTensor logits sharded on their class dimension (the last, or dim 1 of ``(N, C, d1, ...)``;
    the ``loss_parallel`` convention, a ``ColwiseParallel(use_local_output=False)`` head's
    output; on one or more mesh dimensions) take the vocabulary-parallel form by themselves:
    the group, ``vocab_start`` and ``vocab_total`` are read from the DTensor (do not pass
    them), ``weight`` may be a DTensor placed as the logits, a ``Replicate()`` one or the full ``(V,)`` vector,
    ``target`` a plain tensor or a ``Replicate()`` DTensor. The loss and metrics are plain
    tensors, the same on every rank; the logits' gradient is a DTensor with their placements.
    Replicated logits run the single-device call. See :mod:`fusedce.dtensor`.

    Returns:
        The float32 loss (the fallback: PyTorch's), or ``(loss, metrics)`` with
        ``return_metrics=True``.

    The gradient is formed in the forward sweep (for an upstream gradient of 1) whenever the
    logits require grad, and the backward only scales it by the upstream gradient (no work at
    all when that is 1). When the logits do not require grad, only the forward runs.
    """
    def call_of(parallel):  # the call object, built once, where the router runs the call
        return Call.of(_NAME, Options.checked(_NAME, ignore_index=ignore_index, reduction=reduction,
                                              label_smoothing=label_smoothing, logit_scale=logit_scale,
                                              softcap=softcap, z_loss=z_loss),
                       parallel=parallel, return_metrics=bool(return_metrics), check_targets=bool(check_targets),
                       inplace_backward=bool(inplace_backward), strict=bool(strict))

    return route(_NAME, functools.partial(_cross_entropy, call_of), (logits, target, weight),
                 VocabParallel.of(process_group, vocab_start, vocab_total), target=target,
                 device=getattr(logits, "device", None), dtensor_form=dtensor.cross_entropy)


def _cross_entropy(call_of, logits, target, weight, parallel):
    """The call on plain tensors (with a process group in `parallel`: this rank's columns of the
    logits), its Call built by call_of(parallel) once logits and target are known to be tensors."""
    check_tensor(logits, "logits", _NAME)
    check_tensor(target, "target", _NAME)
    call = call_of(parallel)
    parallel.check_single(_NAME, " (vocabulary-parallel logits)")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{_NAME}: logits must have shape (..., V) with V >= 1, "
                         f"got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{_NAME}: logits must be float32, bfloat16 or float16 (float64 through "
                         f"PyTorch), got {logits.dtype}")
    check_same_device(target, "target", logits, "logits", _NAME, verb="are")
    check_cuda_build(logits, "logits", _NAME, verb="are")
    class_dim = _class_dim(logits, target)
    vocab = logits.shape[1 if class_dim == 1 or (class_dim is None and logits.dim() > 1) else -1]
    if vocab < 1:
        raise ValueError(f"{_NAME}: logits must have shape (..., V) with V >= 1, "
                         f"got {tuple(logits.shape)}")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or weight.shape != (vocab,):
            raise ValueError(f"{_NAME}: weight must be a tensor of shape ({vocab},), "
                             f"got {getattr(weight, 'shape', type(weight).__name__)}")
        check_same_device(weight, "weight", logits, "logits", _NAME, verb="are")

    fallback = ("class-probability targets" if class_dim is None
                else "float64 logits" if logits.dtype == torch.float64 else None)
    if fallback is not None:
        if call.strict:
            raise ValueError(f"{_NAME}: {fallback} are not computed by the fused kernels (they take "
                             "float32, bfloat16 or float16 logits and class indices), and "
                             "strict=True forbids the fallback to PyTorch")
        if parallel.group is not None:
            raise ValueError(f"{_NAME}: process_group is not available for {fallback}")
        if call.check_targets and class_dim is not None:
            check_target_values(target, vocab, call.options.ignore_index, _NAME)
        return _pytorch_cross_entropy(logits, target, weight, class_dim, call)

    if weight is not None:
        weight = unit_stride_vector(weight.to(torch.float32))
    x = _rows(logits if class_dim == -1 else logits.movedim(1, -1), vocab)
    t = unit_stride_vector(target if target.dim() == 1 else target.reshape(-1))
    if parallel.group is not None:
        if call.inplace_backward:
            raise ValueError(f"{_NAME}: inplace_backward is not available with {parallel.source}")
        out = distributed.cross_entropy_rows(x, t, weight, call)
    else:
        if call.check_targets:
            check_target_values(t, vocab, call.options.ignore_index, _NAME)
        if (call.inplace_backward and torch.is_grad_enabled() and logits.requires_grad
                and not torch.compiler.is_compiling()):
            Overwritten.check(x, _NAME)
            write = InplaceWrite()
            out = InplaceCrossEntropy.apply(x, t, weight, call, write)
            Overwritten.apply(x)
            write.version = x._version
        else:
            # With or without grad: the loss's autograd is ce_loss's own, in C++ (torch/autograd.h).
            out = ops.ce_loss.default(x, t, weight, *call.options.op_args(), call.return_metrics)
    return _results(out, call, target.shape)


def _pytorch_cross_entropy(logits, target, weight, class_dim, call):
    """The fallback: F.cross_entropy itself on what the kernels do not take (class_dim None:
    class probabilities; else float64 logits with class indices), with fusedce's own options
    applied around it by the contract's formulas (docs/contract.md, "Per-row loss") in the
    logits' dtype. With only PyTorch's options the result is F.cross_entropy's, bit for bit."""
    ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss = call.options.op_args()
    return_metrics = call.return_metrics
    probabilities = class_dim is None
    if return_metrics and probabilities:
        raise ValueError(f"{_NAME}: return_metrics needs class-index targets")
    z = logits * logit_scale if logit_scale != 1.0 else logits
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    vocab = logits.shape[-1] if class_dim == -1 else logits.shape[1 if logits.dim() > 1 else 0]
    # F.cross_entropy's classes are at dim 1 (dim 0 for 1-D logits): rows of classes-last logits
    # of 3 or more dimensions are flattened for it.
    flat = class_dim == -1 and z.dim() > 2
    zf = z.reshape(-1, vocab) if flat else z
    tf = target.reshape(-1) if flat else target
    w = None if weight is None else weight.to(logits.dtype)
    loss = F.cross_entropy(zf, tf, w, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(zf, dim=1 if zf.dim() > 1 else 0)
        if probabilities:
            terms, denom = z_loss * lse ** 2, lse.numel()
        else:
            keep = tf != ignore_index
            terms = torch.where(keep, z_loss * lse ** 2, 0.0)
            denom = w[tf[keep]].sum() if w is not None else keep.sum()
        if reduction == "none":
            loss = loss + terms
        elif reduction == "sum":
            loss = loss + terms.sum()
        else:
            loss = loss + terms.sum() / denom
    if reduction == "none" and flat:
        loss = loss.view(target.shape)
    if not return_metrics:
        return loss
    with torch.no_grad():
        rows = (z if class_dim == -1 else z.movedim(1, -1)).reshape(-1, vocab)
        t = target.reshape(-1)
        keep = t != ignore_index
        lse = torch.logsumexp(rows, -1)
        entropy = lse - (torch.softmax(rows, -1) * rows).sum(-1)
        metrics = {
            "num_correct_tokens": ((rows.argmax(-1) == t) & keep).sum(),
            "entropy_sum": torch.where(keep, entropy, 0.0).sum().to(torch.float32),
            "lse": torch.where(keep, lse, 0.0).to(torch.float32),
        }
    return loss, metrics


def vocab_parallel_cross_entropy(logits, target, weight=None, *, process_group, vocab_start=None,
                                 vocab_total=None, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0,
                                 return_metrics=False, check_targets=False):
    """Cross-entropy of logits split by vocabulary across the ranks of ``process_group``: this
    rank holds ``logits[..., v0:v1]`` of the full ``(..., V)`` logits, and the result is that of
    ``fusedce.cross_entropy`` on the full logits, up to float32 rounding (the machinery is
    fusedce.distributed's).

    The same as ``fusedce.cross_entropy(logits, target, weight, process_group=..., ...)``; see the
    docstring of fusedce.distributed for the shard layout (``vocab_start``, ``vocab_total``) and what crosses
    ranks (one all-gather of ``(N + 1, 9)`` float32 statistics per rank in the forward, nothing
    in the backward).

    Args:
        logits: this rank's shard (..., V_local): float32, bfloat16 or float16.
        target: (...) global class indices in [0, V) or ``ignore_index``, the same on every rank.
        weight: this rank's slice (V_local,) of the class weights, or None.
        process_group: the ranks that share the vocabulary (``torch.distributed.group.WORLD``
            for all of them).
        vocab_start, vocab_total: where the shard sits in the full vocabulary (module docstring).
        ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss, return_metrics:
            as in ``fusedce.cross_entropy``, over the full vocabulary (label smoothing spreads
            ``eps / V`` over all V classes, as PyTorch defines it).
        check_targets: check the target values against [0, V) first (one device
            synchronisation on a GPU), as ``fusedce.cross_entropy`` does.

    Returns:
        The float32 loss, the same on every rank, or ``(loss, metrics)`` with
        ``return_metrics=True`` (``num_correct``: argmax over the full vocabulary, ties to the
        lowest global index; ``entropy_sum``; ``lse`` (N,)). The gradient of this rank's logits
        is its slice of the full gradient.

    Memory: the (N + 1, 9) statistics per rank (gathered: R times that) and a few (N,) vectors;
    the gradient, (N, V_local) in the logits' dtype, is formed in the backward (one more read of
    the logits, which are kept for it).
    """
    if process_group is None:
        raise ValueError("fusedce.vocab_parallel_cross_entropy: process_group is required "
                         "(use fusedce.cross_entropy for logits that are not split)")
    return cross_entropy(logits, target, weight, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing, logit_scale=logit_scale, softcap=softcap,
                         z_loss=z_loss, return_metrics=return_metrics, check_targets=check_targets,
                         process_group=process_group, vocab_start=vocab_start,
                         vocab_total=vocab_total)
