"""Fake (meta) kernels of the log-probability ops of torch/registry.h.

The ops (``lp_stats``, ``llp_stats``, ``lp_merge``, ``lp_distribution_stats``, ``lp_bwd``,
``llp_bwd``, and ``lp_bwd_``, which writes ``lp_bwd``'s dlogits over its logits argument) are the
steps of
fusedce/logprobs.h; python/fusedce/token_logprobs.py strings them together (with the collectives of
fusedce.distributed between them for a vocabulary-parallel head). They have no autograd formula:
the autograd.Functions of logprobs.py call the backward ops, because a gradient needs the merged
statistics, which no single op sees.
"""

import torch

from ._options import register_fake

# Floats per row of the statistics (fusedce::kLogprobStatsWidth in fusedce/logprobs.h): the
# shape of the loss's shard statistics, so that fusedce.distributed gathers either alike.
STATS_WIDTH = 9


def _check_rows(x, target, name):
    torch._check(x.dim() == 2, lambda: f"fusedce: {name} must be 2-D, got {x.dim()}-D")
    torch._check(target.dim() == 1 and target.shape[0] == x.shape[0],
                 lambda: f"fusedce: target must be 1-D with one entry per row of {name} ({x.shape[0]})")


@register_fake("lp_stats")
def _lp_stats_fake(logits, target, shard, options):
    _check_rows(logits, target, "logits")
    return logits.new_empty((logits.shape[0] + 1, STATS_WIDTH), dtype=torch.float32)


@register_fake("llp_stats")
def _llp_stats_fake(hidden, weight, bias, target, shard, options, chunk_budget_bytes):
    _check_rows(hidden, target, "hidden")
    return hidden.new_empty((hidden.shape[0] + 1, STATS_WIDTH), dtype=torch.float32)


def _check_gathered(gathered, target):
    n = target.shape[0]
    torch._check(gathered.dim() == 2 and gathered.shape[1] == STATS_WIDTH,
                 lambda: f"fusedce: gathered must be (world * (N + 1), {STATS_WIDTH})")
    torch._check(gathered.shape[0] % (n + 1) == 0, lambda: "fusedce: gathered must have world * (N + 1) rows")
    return n


@register_fake("lp_merge")
def _lp_merge_fake(gathered, target, shard, options):
    n = _check_gathered(gathered, target)
    return tuple(gathered.new_empty((n,), dtype=torch.float32) for _ in range(3))


@register_fake("lp_distribution_stats")
def _lp_distribution_stats_fake(gathered, target, shard, options):
    n = _check_gathered(gathered, target)
    return tuple(gathered.new_empty((n,), dtype=torch.float32) for _ in range(3))


@register_fake("lp_bwd")
def _lp_bwd_fake(logits, target, lse, logprob, entropy, grad_logprob, grad_entropy, shard, options):
    _check_rows(logits, target, "logits")
    return logits.new_empty(logits.shape)


@register_fake("llp_bwd")
def _llp_bwd_fake(hidden, weight, bias, target, lse, logprob, entropy, grad_logprob, grad_entropy, shard, options,
                  chunk_budget_bytes, need_grad_hidden, need_grad_weight, need_grad_bias):
    _check_rows(hidden, target, "hidden")
    none = hidden.new_empty((0,))
    return (
        hidden.new_empty(hidden.shape, dtype=torch.float32) if need_grad_hidden else none,
        weight.new_empty(weight.shape) if need_grad_weight else hidden.new_empty((0,)),
        bias.new_empty(bias.shape) if need_grad_bias else hidden.new_empty((0,)),
    )


@register_fake("lp_bwd_")
def _lp_bwd_inplace_fake(logits, target, lse, logprob, entropy, grad_logprob, grad_entropy, shard, options):
    _check_rows(logits, target, "logits")
