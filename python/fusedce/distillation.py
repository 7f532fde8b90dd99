"""fusedce.linear_distillation / fusedce.linear_distillation_topk: knowledge distillation from a
teacher's next-token distribution into a student head, without the (N, V) logits of either
(docs/contract.md, "Distillation"; the core's definitions in include/fusedce/distill.h).

Per counted row (label not ``ignore_index``; every row without labels), z = transform(logits) /
temperature for each head, p_s = softmax(z_student), p_t = softmax(z_teacher):

* ``divergence="forward_kl"``: KL(p_t || p_s); ``"reverse_kl"``: KL(p_s || p_t);
  ``"jsd"``: beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = (1 - beta) p_s + beta p_t, beta in
  [0, 1], whose ends are the two KLs (TRL's generalized JSD, ``ChunkedDivergenceFunction``);
* ``loss = (1 - hard_weight) * divergence + hard_weight * cross_entropy(student logits at
  temperature 1, labels)``, reduced by ``reduction`` (mean over the counted rows);
* no temperature**2 factor (TRL has none; multiply the loss for Hinton's convention).

The top-k form takes the teacher as its top-k ids and log-probabilities per position (entries of
-inf are absent). The student's side is its log-softmax over the whole vocabulary at those ids;
``topk_norm`` says which sparse distributions the divergence compares: ``"none"`` as they are
(axolotl's KD loss), ``"renorm"`` each renormalised over the K entries (TRL's server
distillation without a tail; axolotl's normalize_topk), ``"tail"`` K + 1 entries with the tail
log(1 - sum) (TRL's server distillation's default).

Gradients reach the student's hidden, weight and bias; the teacher gets none. On the CPU and on
CUDA devices (every tensor on the student_hidden's device). On CUDA nothing waits to check the
labels and top-k ids: one outside [0, V) (a label that is not ``ignore_index``) makes its row's
loss and gradients NaN, where the CPU raises.

Vocabulary parallel (``linear_distillation(..., process_group=pg)``, CPU and CUDA): each rank
holds the same rows ``[v0, v1)`` of both heads' weights (and biases), the full hidden states and
the labels (global indices); ``linear_distillation_topk(..., process_group=pg)`` the same for
the student's head, the teacher's top-k (global ids) whole on every rank. The core's five steps (include/fusedce/distill.h) with two
all-gathers of per-row scalars in the forward ((N + 1, 9) statistics, then (N, 6) partial sums,
each folded in rank order: the same bits on every rank) and one all-reduce of the float32
(N, H) grad_hidden in the backward. Layout rules and the agreement of the ranks on an error:
fusedce.distributed's docstring.
"""

import functools

import torch

from . import distributed, dtensor
from ._checks import check_cuda_build, check_same_device, check_tensor, unit_stride_vector
from ._distill_options import DistillOptions
from ._options import Call, LinearOptions, VocabParallel
from ._router import route
from .linear_ops import _scale_saved
from .ops import _graph_is_kept, call_below_autograd, ops

_FULL = "fusedce.linear_distillation"
_TOPK = "fusedce.linear_distillation_topk"


def _forward(h, w, bias, a, b, c, labels, call, shard):
    """ld_fwd's outputs (loss, divergence, hard, entropy, stats) over the student's head (h, w,
    bias) and the teacher (a, b, c): its head, or (ids, logprobs, None) its top-k. With a
    ShardSpec `shard`, the vocabulary-parallel steps: step 1 (this rank's statistics), the
    checked all-gather, steps 2 and 3 (the merge, this rank's partial sums; the top-k form: and
    its q at the ids it holds), the all-gather of the parts (none for N = 0: nothing to add),
    step 4; the same on every rank (the top-k form: stats with the K q after them)."""
    args = (*call.options.op_args(), call.linear.chunk_budget_bytes)
    topk = call.where == _TOPK
    head = (h, w, bias, a, b, labels) if topk else (h, w, bias, a, b, c, labels)
    if shard is None:
        return (ops.ldk_fwd if topk else ops.ld_fwd)(*head, *args)
    stats = (ops.ldk_shard_stats if topk else ops.ld_shard_stats)(*head, *shard.op_args(), *args)
    gathered = distributed.gather_checked(stats, h, shard, call.parallel, call.where)
    row_stats, hard, parts = (ops.ldk_shard_parts if topk else ops.ld_shard_parts)(
        *head, gathered, *shard.op_args(), *args)
    if h.shape[0] > 0:
        parts = distributed._all_gather_rows(parts, call.parallel.group)
    if topk:
        return ops.ldk_shard_reduce(parts, row_stats, hard, b, labels, *args)
    return ops.ld_shard_reduce(parts, row_stats, hard, labels, *args)


def _backward(h, w, bias, a, b, c, labels, stats, g, call, shard, need):
    """The student's gradients (grad_hidden float32, grad_weight, grad_bias; None where `need`
    says no) of sum_i g[i] loss[i]. With a ShardSpec: step 5 (this rank's part of grad_hidden,
    its rows of grad_weight and grad_bias), then one all-reduce (sum) of the float32
    grad_hidden over the ranks."""
    rest = (*call.options.op_args(), call.linear.chunk_budget_bytes, *need)
    topk = call.where == _TOPK
    head = (h, w, bias, a, b, labels) if topk else (h, w, bias, a, b, c, labels)
    if shard is None:
        part_h, part_w, part_b = (ops.ldk_bwd if topk else ops.ld_bwd)(*head, stats, g, *rest)
    else:
        part_h, part_w, part_b = (ops.ldk_shard_bwd if topk else ops.ld_shard_bwd)(
            *head, stats, g, *shard.op_args(), *rest)
        if need[0]:
            part_h = distributed._all_reduce_sum(part_h, call.parallel.group)
    return tuple(part if wanted else None for part, wanted in zip((part_h, part_w, part_b), need))


def _forward_backward(h, w, bias, a, b, c, labels, call, need):
    """One core call: ld_fwd's outputs, then the student's gradients of the reduced loss for an
    upstream gradient of 1 (reduction mean or sum; None where `need` says no)."""
    args = (*call.options.op_args(), call.linear.chunk_budget_bytes, *need)
    if call.where == _TOPK:
        out = ops.ldk_fwd_bwd(h, w, bias, a, b, labels, *args)
    else:
        out = ops.ld_fwd_bwd(h, w, bias, a, b, c, labels, *args)
    return out[:5], tuple(grad if wanted else None for grad, wanted in zip(out[5:], need))


class _LinearDistill(torch.autograd.Function):
    """Over the student's hidden (N, H), weight (V, H), bias (V,) or None and the teacher (a, b,
    c) = (hidden, weight, bias) of its head, or (ids, logprobs, None) of its top-k; labels (N,)
    or None; the Call; a ShardSpec for this rank's rows of a vocabulary-parallel head, or None.
    Returns loss, divergence, hard, entropy (the last three not differentiable).

    A single device with reduction mean or sum forms the gradients in the forward, over the same
    chunks of logits (ld_fwd_bwd: no second pass of products in the backward), and the backward
    scales them by the upstream gradient (ce_rescale_: nothing is touched when it is 1). With
    reduction none, or a vocabulary-parallel head, the backward forms them from the saved
    statistics."""

    @staticmethod
    def forward(ctx, h, w, bias, a, b, c, labels, call, shard):
        need = tuple(ctx.needs_input_grad[:3])
        ctx.fused = shard is None and call.options.reduction != "none"
        if ctx.fused:
            (loss, divergence, hard, entropy, _), grads = _forward_backward(h, w, bias, a, b, c, labels, call, need)
            ctx.save_for_backward(*grads)
        else:
            loss, divergence, hard, entropy, stats = _forward(h, w, bias, a, b, c, labels, call, shard)
            ctx.save_for_backward(h, w, bias, a, b, c, labels, stats)
        ctx.call, ctx.shard, ctx.dtype = call, shard, h.dtype
        ctx.mark_non_differentiable(divergence, hard, entropy)
        ctx.set_materialize_grads(False)
        return loss, divergence, hard, entropy

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        need = tuple(ctx.needs_input_grad[:3])
        grad_h = grad_w = grad_b = None
        if grad_loss is not None and any(need):
            g = grad_loss.reshape(-1).to(torch.float32).contiguous()
            if ctx.fused:
                keep = _graph_is_kept()
                grad_h, grad_w, grad_b = (None if saved is None or not wanted else _scale_saved(saved, g, keep)
                                          for saved, wanted in zip(ctx.saved_tensors, need))
            else:
                h, w, bias, a, b, c, labels, stats = ctx.saved_tensors
                grad_h, grad_w, grad_b = _backward(h, w, bias, a, b, c, labels, stats, g, ctx.call, ctx.shard, need)
            if grad_h is not None:
                grad_h = grad_h.to(ctx.dtype)  # the float32 sum (over ranks too), rounded once
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


# ---- checks ---------------------------------------------------------------------------------


def _check_float(x, name, where):
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: {name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_head(hidden, weight, bias, prefix, vocab, where):
    """hidden (..., H) float, weight (V, H) and bias (V,) in its dtype; vocab: V to match, or None."""
    hn, wn, bn = f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias"
    for value, name, optional in ((hidden, hn, False), (weight, wn, False), (bias, bn, True)):
        check_tensor(value, name, where, optional)
    _check_float(hidden, hn, where)
    if hidden.dim() < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"{where}: {hn} must have shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    size = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != size or weight.shape[0] < 1:
        raise ValueError(f"{where}: {wn} must have shape (V, H) with V >= 1 and H = {hn}'s last dimension "
                         f"({size}), got {tuple(weight.shape)}")
    if vocab is not None and weight.shape[0] != vocab:
        raise ValueError(f"{where}: {wn} must have the student's vocabulary of {vocab} rows, got {weight.shape[0]}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{where}: {wn} must have {hn}'s dtype ({hidden.dtype}), got {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != hidden.dtype):
        raise ValueError(f"{where}: {bn} must be ({weight.shape[0]},) in {hn}'s dtype ({hidden.dtype}), got "
                         f"{tuple(bias.shape)} {bias.dtype}")


def _check_labels(labels, shape, where):
    if labels is None:
        return
    check_tensor(labels, "labels", where)
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: labels must be int64 or int32 token indices, got {labels.dtype}")
    if labels.shape != shape:
        raise ValueError(f"{where}: labels must have shape {tuple(shape)} (student_hidden's leading "
                         f"dimensions), got {tuple(labels.shape)}")


def _check_device(tensors, hidden, where):
    for value, name in tensors:
        check_same_device(value, name, hidden, "student_hidden", where)
    check_cuda_build(hidden, "student_hidden", where)
    if hidden.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"{where}: student_hidden is on {hidden.device}, but the distillation runs on "
                                  "the CPU and on CUDA devices only")


def _rows(x):
    """x (..., D) as (N, D) with unit stride along D and rows that do not overlap."""
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] > 1 and ((x.shape[1] > 1 and x.stride(1) != 1) or x.stride(0) < x.shape[1]):
        x = x.contiguous()
    return x


def _call_of(where, options, chunk_budget_bytes, return_metrics, student_hidden, parallel=None):
    linear = LinearOptions.checked(where, student_hidden, chunk_budget_bytes=chunk_budget_bytes)
    return Call.of(where, options, linear, parallel, return_metrics=bool(return_metrics))


def _shard_of(student_weight, student_hidden, call):
    """This rank's ShardSpec for a vocabulary-parallel call (None for a single device)."""
    if call.parallel.group is None:
        return None
    return distributed.shard_of(student_weight.shape[0], call.parallel, student_hidden.device, call.where)


def _rows_like(hidden):
    """A tensor of hidden's leading rows, for the agreement of the ranks (its entry count is the
    rows of the gather), or None when hidden cannot give one."""
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        return torch.empty(hidden.shape[:-1], dtype=torch.int64, device=hidden.device)
    return None


def _run(call, hidden, weight, bias, teacher, labels, shape, shard=None):
    """The call on plain tensors: the autograd.Function when a gradient is wanted, else the op
    below autograd (with a ShardSpec `shard`: the vocabulary-parallel steps); the loss (of
    `shape` for none) and, with metrics, their dict."""
    h, w = _rows(hidden), weight.contiguous() if weight.stride(-1) != 1 else weight
    lab = None if labels is None else unit_stride_vector(labels.reshape(-1))
    b = unit_stride_vector(bias)
    grad_on = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    if grad_on:
        loss, divergence, hard, entropy = _LinearDistill.apply(h, w, b, *teacher, lab, call, shard)
    elif shard is not None:
        loss, divergence, hard, entropy, _ = _forward(h, w, b, *teacher, lab, call, shard)
    else:
        args = (*call.options.op_args(), call.linear.chunk_budget_bytes)
        if call.where == _TOPK:
            out = call_below_autograd(ops.ldk_fwd.default, h, w, b, teacher[0], teacher[1], lab, *args)
        else:
            out = call_below_autograd(ops.ld_fwd.default, h, w, b, *teacher, lab, *args)
        loss, divergence, hard, entropy, _ = out
    if call.options.reduction == "none":
        loss = loss.view(shape)
    if not call.return_metrics:
        return loss
    return loss, {"divergence": divergence.view(shape), "hard_loss": hard.view(shape), "entropy": entropy.view(shape)}


# ---- the functions ------------------------------------------------------------------------


def linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight, labels=None, *,
                        divergence="jsd", beta=None, temperature=1.0, ignore_index=-100, hard_weight=0.0,
                        reduction="mean", student_bias=None, teacher_bias=None, student_logit_scale=1.0,
                        student_softcap=None, teacher_logit_scale=1.0, teacher_softcap=None,
                        chunk_budget_bytes=None, return_metrics=False, process_group=None, vocab_start=None,
                        vocab_total=None):
    """The distillation loss between the student's head ``student_hidden @ student_weight.T +
    student_bias`` and the teacher's, never storing either's (N, V) logits.

    Args:
        student_hidden: float32, bfloat16 or float16, (..., H).
        student_weight: (V, H) in student_hidden's dtype; student_bias (V,) or None.
        teacher_hidden: (..., H_t) with student_hidden's leading dimensions, any H_t;
            teacher_weight (V, H_t) in its dtype (the same V); teacher_bias (V,) or None.
        labels: int64 / int32 of the leading shape, or None: rows whose label is
            ``ignore_index`` are left out; needed for ``hard_weight > 0``.
        divergence: "jsd" (with beta, None: 0.5), "forward_kl" (KL(teacher || student), beta 0)
            or "reverse_kl" (KL(student || teacher), beta 1).
        temperature: divides both heads' logits (after logit_scale and softcap).
        hard_weight: in [0, 1]: loss = (1 - hard_weight) divergence + hard_weight cross-entropy
            of the student's logits at temperature 1.
        reduction: "mean" (over the counted rows; NaN for none), "sum" or "none" (the leading
            shape, 0 at left-out rows).
        student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap: each head's
            transform of its logits, y = s x or c tanh(s x / c) (softcap None: off).
        chunk_budget_bytes: bytes of logits one chunk of rows may hold, both heads together:
            float32 logits on the CPU (None: 128 MiB), logits in the inputs' dtypes on CUDA (None:
            the larger of 448 MiB and one copy of the student's weight in its dtype).
        return_metrics: also return a dict of per-row float32 values of the leading shape:
            "divergence", "hard_loss" (0 with hard_weight 0) and "entropy" (the student's, of
            softmax(z)), not differentiable, 0 at left-out rows.
        process_group, vocab_start, vocab_total: a vocabulary-parallel pair of heads (the CPU
            only; NotImplementedError on CUDA): student_weight and teacher_weight (and their
            biases) hold this rank's rows [vocab_start, vocab_start + V_local) of each head,
            the same rows for both (layout rules: fusedce.distributed's docstring); the hidden
            states and labels (global indices) are the same on every rank. Two all-gathers of
            per-row float32 scalars in the forward, one all-reduce of the (N, H) float32
            grad_hidden in the backward; student_weight's and student_bias's gradients are this
            rank's rows. A DTensor student_weight (Shard(0) or replicated) gives the group and the
            layout itself; the teacher's head then is a DTensor placed alike or a plain tensor of
            the whole vocabulary (fusedce.dtensor).

    Returns:
        the loss (float32), or ``(loss, metrics)``; differentiable with respect to
        student_hidden, student_weight and student_bias.
    """
    args = (student_hidden, student_weight, teacher_hidden, teacher_weight, labels, student_bias, teacher_bias)
    run = functools.partial(_linear_distillation, dict(
        divergence=divergence, beta=beta, temperature=temperature, ignore_index=ignore_index,
        hard_weight=hard_weight, reduction=reduction, student_logit_scale=student_logit_scale,
        student_softcap=student_softcap, teacher_logit_scale=teacher_logit_scale, teacher_softcap=teacher_softcap,
        chunk_budget_bytes=chunk_budget_bytes, return_metrics=return_metrics))
    return route(_FULL, run, args, VocabParallel.of(process_group, vocab_start, vocab_total),
                 target=_rows_like(student_hidden), device=getattr(student_hidden, "device", None),
                 dtensor_form=dtensor.linear_distillation)


def _linear_distillation(kw, student_hidden, student_weight, teacher_hidden, teacher_weight, labels, student_bias,
                         teacher_bias, parallel):
    """linear_distillation on plain tensors, its keywords in `kw`, with `parallel` its
    VocabParallel (a process group: this rank's rows of both heads)."""
    where = _FULL
    parallel.check_single(where)
    _check_head(student_hidden, student_weight, student_bias, "student_", None, where)
    _check_head(teacher_hidden, teacher_weight, teacher_bias, "teacher_", student_weight.shape[0], where)
    shape = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != shape:
        raise ValueError(f"{where}: teacher_hidden must have student_hidden's leading dimensions {tuple(shape)}, "
                         f"got {tuple(teacher_hidden.shape)}")
    _check_labels(labels, shape, where)
    _check_device(((student_weight, "student_weight"), (student_bias, "student_bias"),
                   (teacher_hidden, "teacher_hidden"), (teacher_weight, "teacher_weight"),
                   (teacher_bias, "teacher_bias"), (labels, "labels")), student_hidden, where)
    options = DistillOptions.checked(
        where, divergence=kw["divergence"], beta=kw["beta"], temperature=kw["temperature"],
        hard_weight=kw["hard_weight"], ignore_index=kw["ignore_index"], reduction=kw["reduction"],
        has_labels=labels is not None, student_logit_scale=kw["student_logit_scale"],
        student_softcap=kw["student_softcap"], teacher_logit_scale=kw["teacher_logit_scale"],
        teacher_softcap=kw["teacher_softcap"])
    call = _call_of(where, options, kw["chunk_budget_bytes"], kw["return_metrics"], student_hidden, parallel)
    shard = _shard_of(student_weight, student_hidden, call)
    teacher = (_rows(teacher_hidden).detach(), teacher_weight.detach(), unit_stride_vector(
        None if teacher_bias is None else teacher_bias.detach()))
    return _run(call, student_hidden, student_weight, student_bias, teacher, labels, shape, shard)


def linear_distillation_topk(student_hidden, student_weight, teacher_ids, teacher_logprobs, labels=None, *,
                             divergence="forward_kl", beta=None, topk_norm="none", temperature=1.0,
                             ignore_index=-100, hard_weight=0.0, reduction="mean", student_bias=None,
                             student_logit_scale=1.0, student_softcap=None, chunk_budget_bytes=None,
                             return_metrics=False, process_group=None, vocab_start=None, vocab_total=None):
    """The distillation loss against a teacher given as its top-k per position.

    Args:
        teacher_ids: int64 / int32 (..., K), student_hidden's leading dimensions, ids in [0, V)
            (repeats allowed: each entry counts).
        teacher_logprobs: (..., K) floating point (taken as float32): the teacher's
            log-probabilities at those ids, at the temperature wanted (the temperature here
            divides the student's logits only); -inf marks an absent entry.
        topk_norm: "none", "renorm" or "tail" (see the module's docstring).
        divergence: default "forward_kl", the top-k teacher's usual objective (axolotl's default,
            TRL's server distillation's top-k path); the other arguments as in
            :func:`linear_distillation`.
        process_group, vocab_start, vocab_total: a vocabulary-parallel student head (the CPU
            only; NotImplementedError on CUDA): student_weight (and student_bias) hold this rank's
            rows [vocab_start, vocab_start + V_local); teacher_ids are global ids in
            [0, vocab_total), and they, the teacher's log-probabilities, the hidden states and the
            labels are the same on every rank. Two all-gathers of per-row float32 values in the
            forward (the (N + 1, 9) statistics, then (N, 6 + K) parts: each rank's student
            log-probabilities at the ids it holds), one all-reduce of the (N, H) float32
            grad_hidden in the backward. A DTensor student_weight (Shard(0) or replicated) gives
            the group and the layout itself.

    Returns:
        the loss, or ``(loss, metrics)``, as :func:`linear_distillation`.
    """
    args = (student_hidden, student_weight, teacher_ids, teacher_logprobs, labels, student_bias)
    run = functools.partial(_linear_distillation_topk, dict(
        divergence=divergence, beta=beta, topk_norm=topk_norm, temperature=temperature, ignore_index=ignore_index,
        hard_weight=hard_weight, reduction=reduction, student_logit_scale=student_logit_scale,
        student_softcap=student_softcap, chunk_budget_bytes=chunk_budget_bytes, return_metrics=return_metrics))
    return route(_TOPK, run, args, VocabParallel.of(process_group, vocab_start, vocab_total),
                 target=_rows_like(student_hidden), device=getattr(student_hidden, "device", None),
                 dtensor_form=dtensor.linear_distillation_topk)


def _linear_distillation_topk(kw, student_hidden, student_weight, teacher_ids, teacher_logprobs, labels,
                              student_bias, parallel):
    """linear_distillation_topk on plain tensors, its keywords in `kw`, with `parallel` its
    VocabParallel (a process group: this rank's rows of the student's head)."""
    where = _TOPK
    parallel.check_single(where)
    _check_head(student_hidden, student_weight, student_bias, "student_", None, where)
    shape = student_hidden.shape[:-1]
    check_tensor(teacher_ids, "teacher_ids", where)
    check_tensor(teacher_logprobs, "teacher_logprobs", where)
    if teacher_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: teacher_ids must be int64 or int32 token indices, got {teacher_ids.dtype}")
    if not teacher_logprobs.is_floating_point():
        raise ValueError(f"{where}: teacher_logprobs must be floating point, got {teacher_logprobs.dtype}")
    if teacher_ids.dim() != len(shape) + 1 or teacher_ids.shape[:-1] != shape or teacher_ids.shape[-1] < 1:
        raise ValueError(f"{where}: teacher_ids must have shape {(*shape, 'K')} with K >= 1 (student_hidden's "
                         f"leading dimensions), got {tuple(teacher_ids.shape)}")
    if teacher_logprobs.shape != teacher_ids.shape:
        raise ValueError(f"{where}: teacher_logprobs must have teacher_ids's shape {tuple(teacher_ids.shape)}, "
                         f"got {tuple(teacher_logprobs.shape)}")
    _check_labels(labels, shape, where)
    _check_device(((student_weight, "student_weight"), (student_bias, "student_bias"), (teacher_ids, "teacher_ids"),
                   (teacher_logprobs, "teacher_logprobs"), (labels, "labels")), student_hidden, where)
    options = DistillOptions.checked(
        where, divergence=kw["divergence"], beta=kw["beta"], temperature=kw["temperature"],
        hard_weight=kw["hard_weight"], ignore_index=kw["ignore_index"], reduction=kw["reduction"],
        has_labels=labels is not None, student_logit_scale=kw["student_logit_scale"],
        student_softcap=kw["student_softcap"], topk_norm=kw["topk_norm"])
    call = _call_of(where, options, kw["chunk_budget_bytes"], kw["return_metrics"], student_hidden, parallel)
    shard = _shard_of(student_weight, student_hidden, call)
    k = teacher_ids.shape[-1]
    teacher = (teacher_ids.reshape(-1, k).to(torch.int64).contiguous(),
               teacher_logprobs.detach().reshape(-1, k).to(torch.float32).contiguous(), None)
    return _run(call, student_hidden, student_weight, student_bias, teacher, labels, shape, shard)
