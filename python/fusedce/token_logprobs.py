"""fusedce.logprobs / fusedce.linear_logprobs: per-token log-probabilities and entropy, with
gradients, for reinforcement-learning post-training (docs/contract.md, "Log-probabilities").

For each position with token t, z = (logits [+ bias]) / temperature:
``logprob = z_t - logsumexp(z)`` and ``entropy = logsumexp(z) - sum_j softmax(z)_j z_j``, both
float32, both differentiable. The target's log-probability is formed from the sum of the exps of
the *other* entries, so it stays exact when the distribution collapses (where ``z_t - lse`` in
float32 rounds to 0 once the margin passes ~16.6 nats), and so does its gradient.

One implementation for a single device and a vocabulary-parallel head (the core's three steps,
fusedce/logprobs.h): statistics of this rank's columns, a merge of every rank's (a single device
is a world of 1, with no collective), and the gradients from the merged values. With
``keep_logits=False`` the linear form never stores the (N, V) logits: the forward folds them chunk
by chunk, the backward forms each chunk again (four matrix products for forward and backward).
The default (``keep_logits=None``) keeps them, for a call that forms a gradient, where they fit the
memory bound of that form (logit_room.py) and recomputes past it; a call that forms none never
keeps them. With ``keep_logits=True`` it forms the logits once in hidden's dtype, runs the logits
form's steps over them and keeps them for the backward, which writes dlogits over them and takes the two gradient products from there (three
products, for (N, V_local) logits held between forward and backward).
"""

import functools

import torch

from . import distributed, dtensor, logit_room
from ._checks import check_cuda_build, check_same_device, check_target_values, check_tensor, unit_stride_vector
from ._options import Call, LinearOptions, LogprobOptions, ShardSpec, VocabParallel
from ._router import route
from .functional import _rows
from .ops import _graph_is_kept, call_below_autograd, ops

_LINEAR = "fusedce.linear_logprobs"
_LOGITS = "fusedce.logprobs"


# ---- checks -------------------------------------------------------------------------------


def _check_tokens(tokens, shape, where):
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: tokens must be int64 or int32 token indices, got {tokens.dtype}")
    if tokens.shape != shape:
        raise ValueError(f"{where}: tokens must have shape {tuple(shape)}, got {tuple(tokens.shape)}")


def _check_float(x, name, where):
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: {name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_keep_logits(keep_logits, chunk_budget_bytes, where):
    if keep_logits is not None and not isinstance(keep_logits, bool):
        raise TypeError(f"{where}: keep_logits must be None (the default) or a bool, got "
                        f"{type(keep_logits).__name__}")
    if keep_logits and chunk_budget_bytes is not None:
        raise ValueError(f"{where}: chunk_budget_bytes bounds the logit chunks of keep_logits=False; "
                         "keep_logits=True forms all the (N, V) logits at once: give one or the other")


def _check_token_values(t, vocab, call, device):
    """Token values against [0, vocab): always on the CPU (no synchronisation there), on a GPU
    when asked (one synchronisation). Skipped while torch.compile traces (a host read)."""
    if torch.compiler.is_compiling():
        return
    where = call.where
    if call.check_targets or device.type == "cpu":
        try:
            check_target_values(t, vocab, call.options.ignore_index, where)
        except ValueError as exc:
            raise ValueError(str(exc).replace(f"{where}: target[", f"{where}: tokens[", 1)) from None


# ---- the steps, and their autograd --------------------------------------------------------


def _merged(stats, target, call, shard):
    """Step 2 over this rank's statistics alone (single device), or every rank's, gathered:
    logprob, entropy, lse, and with the options' distribution_stats the three (N,) statistics of
    lp_distribution_stats (else None)."""
    if call.parallel.group is not None:
        stats = distributed.gather_checked(stats, target, shard, call.parallel, call.where)
    args = (*shard.op_args(), *call.options.op_args())
    logprob, entropy, lse = ops.lp_merge(stats, target, *args)
    dist = ops.lp_distribution_stats(stats, target, *args) if call.options.distribution_stats else None
    return logprob, entropy, lse, dist


def _returned(ctx, logprob, entropy, dist):
    """An autograd.Function's outputs: logprob, entropy, then the distribution statistics (not
    differentiable) when asked for."""
    if dist is None:
        return logprob, entropy
    ctx.mark_non_differentiable(*dist)
    return (logprob, entropy, *dist)


def _upstream(g, like):
    """An upstream gradient as the backward ops take it: float32 (N,) with unit stride (the
    gradient of a .sum() arrives expanded, with stride 0)."""
    if g is None:
        return None
    return g.reshape(-1).to(torch.float32).contiguous()


def _upstreams(grad_logprob, grad_entropy, logprob, entropy):
    """The two upstream gradients as the backward ops take them (a missing logprob's as zeros)."""
    g_lp = torch.zeros_like(logprob) if grad_logprob is None else _upstream(grad_logprob, logprob)
    return g_lp, _upstream(grad_entropy, entropy)


class _Logprobs(torch.autograd.Function):
    """Over logits (N, V_local), with the call (a Call) and this rank's ShardSpec. Returns
    logprob, entropy (float32 (N,)), both differentiable."""

    @staticmethod
    def forward(ctx, x, target, call, shard):
        stats = ops.lp_stats(x, target, *shard.op_args(), *call.options.op_args())
        logprob, entropy, lse, dist = _merged(stats, target, call, shard)
        ctx.save_for_backward(x, target, lse, logprob, entropy)
        ctx.call, ctx.shard = call, shard
        ctx.set_materialize_grads(False)
        return _returned(ctx, logprob, entropy, dist)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, *unused):
        grad = None
        if (grad_logprob is not None or grad_entropy is not None) and ctx.needs_input_grad[0]:
            x, target, lse, logprob, entropy = ctx.saved_tensors
            grad = ops.lp_bwd(x, target, lse, logprob, entropy,
                              *_upstreams(grad_logprob, grad_entropy, logprob, entropy),
                              *ctx.shard.op_args(), *ctx.call.options.op_args())
        return grad, None, None, None  # nothing for target, call, shard


class _LinearLogprobs(torch.autograd.Function):
    """Over hidden (N, H) and this rank's rows weight (V_local, H), bias (V_local,) or None, with
    the call (a Call: its LogprobOptions, LinearOptions for the chunk budget, VocabParallel) and
    this rank's ShardSpec. Backward: the core's gradients (the logits formed again, chunk by
    chunk), then, for a vocabulary-parallel head, one all-reduce (sum) of the float32
    grad_hidden."""

    @staticmethod
    def forward(ctx, h, w, bias, target, call, shard):
        stats = ops.llp_stats(h, w, bias, target, *shard.op_args(), *call.options.op_args(),
                              call.linear.chunk_budget_bytes)
        logprob, entropy, lse, dist = _merged(stats, target, call, shard)
        ctx.save_for_backward(h, w, bias, target, lse, logprob, entropy)
        ctx.call, ctx.shard = call, shard
        ctx.set_materialize_grads(False)
        return _returned(ctx, logprob, entropy, dist)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, *unused):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = grad_w = grad_b = None
        if (grad_logprob is not None or grad_entropy is not None) and (need_h or need_w or need_b):
            h, w, bias, target, lse, logprob, entropy = ctx.saved_tensors
            call = ctx.call
            part_h, part_w, part_b = ops.llp_bwd(
                h, w, bias, target, lse, logprob, entropy,
                *_upstreams(grad_logprob, grad_entropy, logprob, entropy), *ctx.shard.op_args(),
                *call.options.op_args(), call.linear.chunk_budget_bytes, need_h, need_w, need_b)
            if need_h:
                if call.parallel.group is not None:
                    # The sum over ranks of every rank's part, in float32, rounded once.
                    part_h = distributed._all_reduce_sum(part_h, call.parallel.group)
                grad_h = part_h.to(h.dtype)
            grad_w = part_w if need_w else None
            grad_b = part_b if need_b else None
        return grad_h, grad_w, grad_b, None, None, None  # nothing for target, call, shard


# Bytes of float32 per block of the CPU's float32 product of 16-bit matrices (_float32_product):
# what the block upcasts, whatever the shapes.
_FLOAT32_PRODUCT_BLOCK_BYTES = 64 << 20


def _has_float32_mm(a):
    """torch.mm(a, b, out_dtype=torch.float32) for 16-bit a, b: CUDA, torch >= 2.8 (aten::mm.dtype)."""
    return a.device.type == "cuda" and "dtype" in torch.ops.aten.mm.overloads()


def _float32_product(a, b):
    """a @ b in float32, for a grad_hidden that the ranks sum before rounding it once, without a
    float32 copy of a (N, V_local) or b (V_local, H). 16-bit on CUDA: cuBLAS's float32 accumulator
    written out as float32 (torch.mm's out_dtype). Elsewhere (the CPU has no such kernel): by
    blocks of the shared dimension, each block of a and b upcast and its product added in float32,
    a block at most _FLOAT32_PRODUCT_BLOCK_BYTES of float32."""
    if a.dtype == torch.float32:
        return a @ b
    if _has_float32_mm(a):
        return torch.mm(a, b, out_dtype=torch.float32)
    k = a.shape[1]
    step = max(1, _FLOAT32_PRODUCT_BLOCK_BYTES // (4 * max(1, a.shape[0] + b.shape[1])))
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.float32)
    for k0 in range(0, k, step):
        out.addmm_(a[:, k0:k0 + step].float(), b[k0:k0 + step].float())
    return out


def _kept_forward(h, w, bias, target, call, shard):
    """keep_logits=True's forward: the logits (N, V_local) formed once in hidden's dtype, then the
    logits form's steps over them. Returns logprob, entropy, lse, the distribution statistics
    (or None) and the logits."""
    logits = torch.nn.functional.linear(h, w, bias)
    stats = call_below_autograd(ops.lp_stats.default, logits, target, *shard.op_args(), *call.options.op_args())
    return (*_merged(stats, target, call, shard), logits)


class _KeptLinearLogprobs(torch.autograd.Function):
    """The linear form with its logits kept (keep_logits=True), over hidden (N, H), this rank's
    rows weight (V_local, H) and bias (V_local,) or None, with the call and this rank's
    ShardSpec. Backward: dlogits written over the saved logits (lp_bwd_; into a new buffer when
    the graph is kept for another backward), then grad_hidden = dlogits @ weight, grad_weight =
    dlogits.T @ hidden, grad_bias = the column sums of dlogits, each with float32 accumulation
    and returned in the parameter dtype; for a vocabulary-parallel head, grad_hidden is this
    rank's float32 part, all-reduced (sum) and rounded once."""

    @staticmethod
    def forward(ctx, h, w, bias, target, call, shard):
        logprob, entropy, lse, dist, logits = _kept_forward(h, w, bias, target, call, shard)
        ctx.save_for_backward(h, w, logits, target, lse, logprob, entropy)
        ctx.call, ctx.shard = call, shard
        ctx.set_materialize_grads(False)
        return _returned(ctx, logprob, entropy, dist)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, *unused):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = grad_w = grad_b = None
        if (grad_logprob is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return grad_h, grad_w, grad_b, None, None, None
        h, w, logits, target, lse, logprob, entropy = ctx.saved_tensors
        group = ctx.call.parallel.group
        args = (target, lse, logprob, entropy, *_upstreams(grad_logprob, grad_entropy, logprob, entropy),
                *ctx.shard.op_args(), *ctx.call.options.op_args())
        if _graph_is_kept():  # a later backward reads the logits again
            dlogits = ops.lp_bwd(logits, *args)
        else:
            ops.lp_bwd_(logits, *args)
            dlogits = logits
        if need_h:
            if group is not None:
                # The sum over ranks of every rank's float32 part, rounded once.
                grad_h = distributed._all_reduce_sum(_float32_product(dlogits, w), group).to(h.dtype)
            else:
                grad_h = dlogits @ w
        if need_w:
            grad_w = dlogits.T @ h
        if need_b:
            grad_b = dlogits.sum(0)  # a 16-bit sum accumulates in float32, rounded once
        return grad_h, grad_w, grad_b, None, None, None  # nothing for target, call, shard


def _shard(local_vocab, call, device):
    """This rank's ShardSpec: the whole vocabulary for a single device."""
    if call.parallel.group is None:
        return ShardSpec.whole(local_vocab)
    return distributed.shard_of(local_vocab, call.parallel, device, call.where)


def _results(out, shape, call):
    """What a function returns from (logprob, entropy[, the three distribution statistics])."""
    logprob = out[0].view(shape)
    if not call.return_entropy and not call.options.distribution_stats:
        return logprob
    got = (logprob, out[1].view(shape)) if call.return_entropy else (logprob,)
    if call.options.distribution_stats:
        log_sum_sq, mean, top1 = out[2:5]
        got += ({"log_sum_sq_probs": log_sum_sq.view(shape), "mean_logits": mean.view(shape),
                 "is_top1": (top1 != 0).view(shape)},)
    return got


# ---- the functions ------------------------------------------------------------------------


def linear_logprobs(hidden, weight, tokens, bias=None, *, temperature=1.0, return_entropy=False,
                    ignore_index=-100, chunk_budget_bytes=None, check_tokens=False, process_group=None,
                    vocab_start=None, vocab_total=None, keep_logits=None, return_stats=False):
    """Per-token log-probabilities (and entropy) of the logits ``hidden @ weight.T + bias`` at a
    sampling temperature, storing the (N, V) logits only where they fit the memory budget.

    Args:
        hidden: float32, bfloat16 or float16, shape (..., H).
        weight: (V, H) in hidden's dtype (the head: ``lm_head.weight``).
        tokens: int64 or int32, shape hidden.shape[:-1]: the sampled tokens, in [0, V), or
            ``ignore_index``.
        bias: (V,) in hidden's dtype, or None.
        temperature: z = logits / temperature; finite and > 0.
        return_entropy: also return the per-token entropy of softmax(z).
        ignore_index: positions with this token get logprob 0 and entropy 0, and no gradient.
        chunk_budget_bytes: memory for logits (None: the core's default): the most the
            recomputing form's chunks hold, and with ``keep_logits=None`` the room the kept
            logits must fit; not with ``keep_logits=True`` (ValueError).
        check_tokens: on a GPU, check the token values first (one synchronisation) and raise
            ValueError naming the first bad one; the CPU always checks.
        process_group, vocab_start, vocab_total: a vocabulary-parallel head: ``weight`` (and
            ``bias``) hold this rank's rows of the head (layout rules: fusedce.distributed's
            docstring); ``hidden`` and ``tokens`` are the same on every rank. The ranks exchange
            one all-gather of (N + 1, 9) float32 statistics in the forward and one all-reduce of
            the (N, H) float32 grad_hidden in the backward. A DTensor weight (Shard(0), as
            ColwiseParallel shards an lm_head, or replicated) gives the group and the layout
            itself (fusedce.dtensor).
        keep_logits: trade memory for one matrix product. None (the default): for a call that
            forms a gradient, True where the kept logits fit the recomputing form's memory
            bound, else False (fusedce.logit_room: the linear cross-entropy's rule for its
            chunks, or ``chunk_budget_bytes``), so the default is the faster form within that
            bound; for a call that forms none (``torch.no_grad()``, or no input requiring a
            gradient) False, whose forward writes no logits.
            False: the logits are formed chunk by chunk in the forward and again in the
            backward, four products in all. True: they are formed once, ``F.linear`` in
            hidden's dtype (this rank's columns for a vocabulary-parallel head), kept from
            forward to backward ((N, V_local) elements of hidden's dtype) and overwritten
            there by dlogits, from which the two gradient products come: three products. The
            backward adds the gradients' own
            outputs (and a float32 (N, H) part of grad_hidden for a vocabulary-parallel head);
            when the graph is kept for another backward (``retain_graph=True``), a second
            (N, V_local) buffer for dlogits. Without a gradient the logits are formed and freed
            on return (the same values as with one).
        return_stats: also return a dict of per-token statistics of softmax(z), from the same
            pass over the logits, not differentiable, of tokens' shape (0 / False at ignored
            positions): "log_sum_sq_probs" (float32, log sum_v p_v^2), "mean_logits" (float32,
            the mean of z over the vocabulary) and "is_top1" (bool, whether the token is z's
            argmax, the first one on ties: torch.argmax's rule). TRL's fused head's optional
            outputs, with its definitions.

    Returns:
        logprob, float32 of tokens' shape; or ``(logprob, entropy)`` with ``return_entropy``;
        the stats dict after them with ``return_stats``. logprob and entropy are differentiable
        with respect to hidden, weight and bias.
    """
    def call_of(hidden, parallel):  # the call object, built once, where the router runs the call
        linear = LinearOptions.checked(_LINEAR, hidden, chunk_budget_bytes=chunk_budget_bytes)
        _check_keep_logits(keep_logits, chunk_budget_bytes, _LINEAR)
        options = LogprobOptions.checked(_LINEAR, temperature=temperature, ignore_index=ignore_index,
                                         distribution_stats=return_stats)
        return Call.of(_LINEAR, options, linear, parallel, check_targets=bool(check_tokens), keep_logits=keep_logits,
                       return_entropy=bool(return_entropy))

    return route(_LINEAR, functools.partial(_linear_logprobs, call_of), (hidden, weight, tokens, bias),
                 VocabParallel.of(process_group, vocab_start, vocab_total), target=tokens,
                 device=getattr(hidden, "device", None), dtensor_form=dtensor.linear_logprobs)


def _linear_logprobs(call_of, hidden, weight, tokens, bias, parallel):
    """linear_logprobs on plain tensors (with a process group in `parallel`: this rank's rows of
    the head), its Call built by call_of(hidden, parallel) after the tensors' checks."""
    where = _LINEAR
    parallel.check_single(where)
    for value, name, optional in ((hidden, "hidden", False), (weight, "weight", False),
                                  (tokens, "tokens", False), (bias, "bias", True)):
        check_tensor(value, name, where, optional)
    _check_float(hidden, "hidden", where)
    if hidden.dim() < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"{where}: hidden must have shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    hidden_size = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != hidden_size or weight.shape[0] < 1:
        raise ValueError(f"{where}: weight must have shape (V, H) with V >= 1 and H = hidden's last "
                         f"dimension ({hidden_size}), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{where}: weight must have hidden's dtype ({hidden.dtype}), got {weight.dtype}")
    _check_tokens(tokens, hidden.shape[:-1], where)
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{where}: bias must have shape ({weight.shape[0]},) (V, from weight), got "
                             f"{tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise ValueError(f"{where}: bias must have hidden's dtype ({hidden.dtype}), got {bias.dtype}")
    for value, name in ((weight, "weight"), (tokens, "tokens"), (bias, "bias")):
        check_same_device(value, name, hidden, "hidden", where)
    check_cuda_build(hidden, "hidden", where)
    call = call_of(hidden, parallel)

    h = _rows(hidden, hidden_size)
    w = _rows(weight, hidden_size)
    t = unit_stride_vector(tokens.reshape(-1))
    b = unit_stride_vector(bias)
    shard = _shard(w.shape[0], call, h.device)
    _check_token_values(t, shard.vocab_total, call, h.device)
    grad_on = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    keep = call.keep_logits
    if keep is None:
        # Without a gradient nothing reuses kept logits, and the statistics form, which writes
        # none, is the faster forward: the default keeps only for a backward.
        keep = grad_on and logit_room.keeps_logits(h.shape[0], hidden_size, w.shape[0], h.dtype,
                                       torch.is_grad_enabled() and weight.requires_grad, h.device.type,
                                       call.linear.chunk_budget_bytes or None)
    if keep and grad_on:
        out = _KeptLinearLogprobs.apply(h, w, b, t, call, shard)
    elif keep:
        logprob, entropy, _, dist, _ = _kept_forward(h, w, b, t, call, shard)
        out = (logprob, entropy, *(dist or ()))
    elif grad_on:
        out = _LinearLogprobs.apply(h, w, b, t, call, shard)
    else:
        stats = call_below_autograd(ops.llp_stats.default, h, w, b, t, *shard.op_args(), *call.options.op_args(),
                                    call.linear.chunk_budget_bytes)
        logprob, entropy, _, dist = _merged(stats, t, call, shard)
        out = (logprob, entropy, *(dist or ()))
    return _results(out, tokens.shape, call)


def logprobs(logits, tokens, *, temperature=1.0, return_entropy=False, ignore_index=-100, check_tokens=False,
             process_group=None, vocab_start=None, vocab_total=None, return_stats=False):
    """Per-token log-probabilities (and entropy) of ``logits`` (..., V) at a sampling
    temperature: ``log_softmax(logits / temperature).gather(-1, tokens)``, exact in collapse.

    Args:
        logits: float32, bfloat16 or float16, shape (..., V).
        tokens: int64 or int32, shape logits.shape[:-1], in [0, V) or ``ignore_index``.
        temperature, return_entropy, ignore_index, check_tokens, return_stats: as in
            :func:`linear_logprobs`.
        process_group, vocab_start, vocab_total: a vocabulary-parallel head: ``logits`` hold this
            rank's columns (layout rules: fusedce.distributed's docstring); one all-gather of
            (N + 1, 9) float32 statistics per forward, nothing in the backward. DTensor logits
            sharded on their last dimension give the group and the layout themselves.

    Returns:
        logprob (float32, tokens' shape), or ``(logprob, entropy)``, then the stats dict with
        ``return_stats``; logprob and entropy are differentiable with respect to logits (the
        gradient has the logits' dtype).
    """
    def call_of(parallel):  # the call object, built once, where the router runs the call
        options = LogprobOptions.checked(_LOGITS, temperature=temperature, ignore_index=ignore_index,
                                         distribution_stats=return_stats)
        return Call.of(_LOGITS, options, parallel=parallel, check_targets=bool(check_tokens), return_entropy=bool(return_entropy))

    return route(_LOGITS, functools.partial(_logprobs, call_of), (logits, tokens),
                 VocabParallel.of(process_group, vocab_start, vocab_total), target=tokens,
                 device=getattr(logits, "device", None), dtensor_form=dtensor.logprobs)


def _logprobs(call_of, logits, tokens, parallel):
    """logprobs on plain tensors (with a process group in `parallel`: this rank's columns of the
    logits), its Call built by call_of(parallel) after the tensors' checks."""
    where = _LOGITS
    parallel.check_single(where)
    check_tensor(logits, "logits", where)
    check_tensor(tokens, "tokens", where)
    _check_float(logits, "logits", where)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{where}: logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    _check_tokens(tokens, logits.shape[:-1], where)
    check_same_device(tokens, "tokens", logits, "logits", where)
    check_cuda_build(logits, "logits", where)
    call = call_of(parallel)

    vocab = logits.shape[-1]
    x = _rows(logits, vocab)
    t = unit_stride_vector(tokens.reshape(-1))
    shard = _shard(vocab, call, x.device)
    _check_token_values(t, shard.vocab_total, call, x.device)
    if torch.is_grad_enabled() and logits.requires_grad:
        out = _Logprobs.apply(x, t, call, shard)
    else:
        stats = call_below_autograd(ops.lp_stats.default, x, t, *shard.op_args(), *call.options.op_args())
        logprob, entropy, _, dist = _merged(stats, t, call, shard)
        out = (logprob, entropy, *(dist or ()))
    return _results(out, tokens.shape, call)
