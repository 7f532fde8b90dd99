"""fusedce.linear_cross_entropy: the cross-entropy of ``hidden @ weight.T + bias`` without the
(N, V) logits.

This layer flattens hidden's leading dimensions (without a copy where the strides allow), turns
``shift=True`` into the core's sequence length, checks what it must to give clear errors, and
picks the op; every number comes from the core (linear_cross_entropy.h).
"""

import functools

import torch

from . import distributed, dtensor
from ._checks import check_cuda_build, check_same_device, check_target_values, check_tensor, unit_stride_vector
from ._options import Call, LinearOptions, Options, VocabParallel
from ._router import route
from .functional import _results, _rows
from .linear_ops import FusedLinearCrossEntropy, call_below_autograd, ops

_NAME = "fusedce.linear_cross_entropy"


def _fail(message):
    raise ValueError(f"{_NAME}: {message}")


def _check_arguments(hidden, weight, target, bias, class_weight):
    """Metadata checks only (shapes, dtypes, devices): nothing here reads tensor values."""
    if hidden.dim() < 1 or hidden.shape[-1] < 1:
        _fail(f"hidden must have shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    hidden_size = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        _fail(f"weight must have shape (V, H) with H = hidden's last dimension ({hidden_size}), "
              f"got {tuple(weight.shape)}")
    vocab = weight.shape[0]
    if target.shape != hidden.shape[:-1]:
        _fail(f"target must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
              f"got {tuple(target.shape)}")
    for value, name in ((weight, "weight"), (target, "target"), (bias, "bias"),
                        (class_weight, "class_weight")):
        check_same_device(value, name, hidden, "hidden", _NAME)
    if weight.dtype != hidden.dtype:
        _fail(f"weight must have hidden's dtype ({hidden.dtype}), got {weight.dtype}")
    if bias is not None:
        if bias.shape != (vocab,):
            _fail(f"bias must have shape ({vocab},) (V, from weight), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            _fail(f"bias must have hidden's dtype ({hidden.dtype}), got {bias.dtype}")
    if class_weight is not None and class_weight.shape != (vocab,):
        _fail(f"class_weight must have shape ({vocab},) (V, from weight), got {tuple(class_weight.shape)}")
    check_cuda_build(hidden, "hidden", _NAME)


def linear_cross_entropy(hidden, weight, target, bias=None, *, class_weight=None,
                         ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         logit_scale=1.0, softcap=None, z_loss=0.0, shift=False,
                         return_metrics=False, chunk_budget_bytes=None, low_memory=False,
                         skip_ignored=False, check_targets=False, process_group=None,
                         vocab_start=None, vocab_total=None):
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` against class indices ``target``,
    as ``fusedce.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` computes it, but
    without ever storing the (N, V) logits: the core forms them tile by tile, folds each tile
    into the loss and, when anything requires grad, into the gradients in the same pass.

    Args:
        hidden: float32, bfloat16 or float16, shape (..., H).
        weight: (V, H), hidden's dtype (a language model's ``lm_head.weight``).
        target: int64 or int32, shape hidden.shape[:-1]; values in [0, V) or ``ignore_index``.
        bias: (V,) in hidden's dtype, or None.
        class_weight: per-class weights (V,), as ``F.cross_entropy``'s ``weight`` (used in
            float32).
        ignore_index: rows with this target add nothing to the loss, gradients or the mean.
        reduction: 'none' (loss of target's shape), 'sum' or 'mean' (over non-ignored rows,
            weighted by ``class_weight[target]`` when given; NaN if every row is ignored).
        label_smoothing, logit_scale, softcap, z_loss: as in :func:`fusedce.cross_entropy`
            (z = logit_scale * logits, then ``softcap * tanh(z / softcap)``).
        shift: causal language modelling without copies: row i of each sequence predicts
            target i + 1, and the last row of each sequence predicts nothing. For hidden
            (..., S, H) a sequence is S rows; for 2-D hidden, all N rows are one sequence.
            target is given unshifted (the labels as they are).
        return_metrics: also return ``{"num_correct_tokens": int64 0-D tensor, "entropy_sum": float32
            0-D tensor, "lse": float32 (N,) tensor}`` (sums over non-ignored rows; lse is 0 at
            ignored rows), as :func:`fusedce.cross_entropy` does. The loss and gradients are
            bit-identical with and without.
        chunk_budget_bytes: scratch memory the core may use for logit tiles (None: its default).
        low_memory: keep all extra memory under 512 MiB, even at the cost of recomputation
            (on a GPU, grad_weight is formed slice by slice of the vocabulary from logits
            recomputed by a fourth matrix product: about 4/3 of the default path's flops,
            and no float32 (V, H) accumulator).
        skip_ignored: run the matrix products over the rows whose target is not ignored only
            (a prompt-masked batch then costs only its answer tokens). On a GPU this needs
            their count on the host: the call waits for the device once (a small copy), and
            cannot be captured in a CUDA graph. Off (default), nothing synchronises and ignored
            rows cost their share of the products (their gradient is zero). The CPU backend
            always skips them.
        check_targets: check the target values before any work and raise ValueError naming the
            first entry that is neither in [0, V) nor ignore_index (with ``shift``, the entries a
            row reads), as :func:`fusedce.cross_entropy` does: one device synchronisation on a
            GPU. The CPU always checks.
        process_group, vocab_start, vocab_total: with a process group, ``weight`` (and
            ``bias``, ``class_weight``) hold this rank's rows [vocab_start, vocab_start + V) of
            the head, out of vocab_total (layout rules: fusedce.distributed's docstring); the
            loss, metrics and gradients are those of the whole head. Each rank runs the same
            core per shard with the same options (chunk_budget_bytes, low_memory and
            skip_ignored mean what they mean here, for its V rows); the ranks exchange one
            all-gather of (N + 1, 9) float32 statistics in the forward and one all-reduce of
            the (N, H) float32 grad_hidden in the backward. hidden and target must be the same
            on every rank.

    A DTensor ``weight`` sharded on dim 0 (on one or more mesh dimensions; an ``lm_head`` under
    ``ColwiseParallel``) takes the vocabulary-parallel form by itself: the group,
    ``vocab_start`` and ``vocab_total`` are read from it (do not pass them); ``bias`` must be
    placed as ``weight``, ``class_weight`` may be placed so too, be a ``Replicate()`` DTensor or
    the full ``(V,)`` vector; ``hidden`` and ``target`` are plain tensors or ``Replicate()``
    DTensors. The loss and metrics are plain tensors, the same on every rank; the gradients of
    DTensor inputs are DTensors with their placements (``weight.grad``: the weight's). A
    replicated weight runs the single-device call. See :mod:`fusedce.dtensor`.

    Returns:
        The float32 loss, or ``(loss, metrics)`` with ``return_metrics=True``.

    Gradients are formed for hidden, weight and bias only where they require grad. With
    'sum' or 'mean' (and with 'none' when only hidden requires grad) they are formed in the
    forward pass for an upstream gradient of 1, and the backward only scales them (no work at
    all when the factor is 1); with 'none' and weight or bias requiring grad, the backward
    recomputes them with the per-row upstream gradient. No host synchronisation (unless
    ``skip_ignored`` or ``check_targets``): the core reads the targets where it runs; the Python
    side never looks at tensor values otherwise.
    """
    def call_of(hidden, parallel):  # the call object, built once, where the router runs the call
        return Call.of(_NAME, Options.checked(_NAME, ignore_index=ignore_index, reduction=reduction,
                                              label_smoothing=label_smoothing, logit_scale=logit_scale,
                                              softcap=softcap, z_loss=z_loss),
                       LinearOptions.checked(_NAME, hidden, shift=shift, chunk_budget_bytes=chunk_budget_bytes,
                                             low_memory=low_memory, skip_ignored=skip_ignored),
                       parallel, return_metrics=bool(return_metrics), check_targets=bool(check_targets))

    return route(_NAME, functools.partial(_linear_cross_entropy, call_of),
                 (hidden, weight, target, bias, class_weight),
                 VocabParallel.of(process_group, vocab_start, vocab_total), target=target,
                 device=getattr(hidden, "device", None), dtensor_form=dtensor.linear_cross_entropy)


def _linear_cross_entropy(call_of, hidden, weight, target, bias, class_weight, parallel):
    """The call on plain tensors (with a process group in `parallel`: this rank's rows of the
    head), its Call built by call_of(hidden, parallel) once the tensors are known to be tensors."""
    parallel.check_single(_NAME, " (vocabulary-parallel weight)")
    for value, name, optional in ((hidden, "hidden", False), (weight, "weight", False),
                                  (target, "target", False), (bias, "bias", True),
                                  (class_weight, "class_weight", True)):
        check_tensor(value, name, _NAME, optional)
    call = call_of(hidden, parallel)
    _check_arguments(hidden, weight, target, bias, class_weight)
    if class_weight is not None:
        class_weight = unit_stride_vector(class_weight.to(torch.float32))
    hidden_size = hidden.shape[-1]
    h = _rows(hidden, hidden_size)
    w = _rows(weight, hidden_size)
    b = unit_stride_vector(bias)
    t = unit_stride_vector(target.reshape(-1))
    if parallel.group is not None:
        # The same core, per shard: its linear shard statistics and gradients, with the merge
        # and the collectives of fusedce.distributed between them.
        out = distributed.linear_cross_entropy_rows(h, w, b, t, class_weight, call)
    else:
        if call.check_targets:
            check_target_values(t, w.shape[0], call.options.ignore_index, _NAME,
                                shift_seq_len=call.linear.shift_seq_len)
        grad_on = torch.is_grad_enabled()
        needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
                 grad_on and bias is not None and bias.requires_grad)
        if any(needs):
            out = FusedLinearCrossEntropy.apply(h, w, b, t, class_weight, call, needs)
        else:
            out = call_below_autograd(ops.lce_fwd.default, h, w, b, t, class_weight, *call.options.op_args(),
                                      *call.linear.op_args(), call.return_metrics)
    return _results(out, call, target.shape)


def vocab_parallel_linear_cross_entropy(hidden, weight, target, bias=None, *, process_group,
                                        vocab_start=None, vocab_total=None, **options):
    """``fusedce.linear_cross_entropy(hidden, weight, target, bias, process_group=...)`` with the
    process group required: this rank holds ``weight[v0:v1]`` (V_local, H) of the head (and
    ``bias[v0:v1]``, ``class_weight[v0:v1]``); ``hidden`` and ``target`` are the same on every
    rank. Every keyword of :func:`linear_cross_entropy` is accepted; the layout rules of
    ``vocab_start`` / ``vocab_total`` are in fusedce.distributed's docstring."""
    if process_group is None:
        raise ValueError("fusedce.vocab_parallel_linear_cross_entropy: process_group is required "
                         "(use fusedce.linear_cross_entropy for a head that is not split)")
    return linear_cross_entropy(hidden, weight, target, bias, process_group=process_group,
                                vocab_start=vocab_start, vocab_total=vocab_total, **options)
