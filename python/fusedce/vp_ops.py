"""Fake (meta) kernels of the vocabulary-parallel ops of torch/registry.h.

The ops (``ce_shard_stats``, ``ce_shard_merge``, ``ce_shard_bwd``, and the linear form's
``lce_shard_stats``, ``lce_shard_merge`` and ``lce_shard_bwd``) are the steps of fusedce/vocab_parallel.h;
python/fusedce/distributed.py strings them together with the collectives between them. They
have no autograd formula: the autograd.Functions of distributed.py call ``ce_shard_bwd`` in
their backward, because a gradient needs the merged statistics of every rank, which no single
op sees.

Arguments shared by the steps: target (N,) of global class indices (unshifted in the linear form), class_weight (V_local,) or
None, vocab_start, vocab_total, then the options (docs/contract.md, "Options") as in ops.py; the
fake kernels take them as objects (_options.register_fake): a ShardSpec, an Options and, for
the linear form, a LinearOptions.
"""

import torch

from ._options import register_fake

# Floats per row of shard statistics (fusedce::kShardStatsWidth in fusedce/vocab_parallel.h).
STATS_WIDTH = 9


def _check_rows(logits, target):
    torch._check(logits.dim() == 2, lambda: f"fusedce: logits must be 2-D (rows, V), got {logits.dim()}-D")
    torch._check(
        target.dim() == 1 and target.shape[0] == logits.shape[0],
        lambda: f"fusedce: target must be 1-D with one entry per row of logits ({logits.shape[0]})",
    )


@register_fake("ce_shard_stats")
def _ce_shard_stats_fake(logits, target, class_weight, shard, options, return_metrics):
    _check_rows(logits, target)
    return logits.new_empty((logits.shape[0] + 1, STATS_WIDTH), dtype=torch.float32)


@register_fake("ce_shard_merge")
def _ce_shard_merge_fake(gathered, target, class_weight, shard, options, return_metrics):
    return _merged(gathered, target, options, return_metrics)


@register_fake("lce_shard_merge")
def _lce_shard_merge_fake(gathered, target, class_weight, shard, options, linear, return_metrics):
    return _merged(gathered, target, options, return_metrics)


def _merged(gathered, target, options, return_metrics):
    n = target.shape[0]
    torch._check(gathered.dim() == 2 and gathered.shape[1] == STATS_WIDTH,
                 lambda: f"fusedce: gathered must be (world * (N + 1), {STATS_WIDTH})")
    torch._check(gathered.shape[0] % (n + 1) == 0,
                 lambda: "fusedce: gathered must have world * (N + 1) rows")
    metrics_shape = () if return_metrics else (0,)
    f32 = dict(dtype=torch.float32)
    return (
        gathered.new_empty((n,) if options.reduction == "none" else (), **f32),
        gathered.new_empty((n,), **f32),
        gathered.new_empty(metrics_shape, dtype=torch.int64),
        gathered.new_empty(metrics_shape, **f32),
        gathered.new_empty((n,), **f32),
        gathered.new_empty((2,), **f32),
    )


@register_fake("ce_shard_bwd")
def _ce_shard_bwd_fake(logits, target, class_weight, lse, row_weight, batch, grad_loss, shard, options):
    _check_rows(logits, target)
    return logits.new_empty(logits.shape)


def _check_linear_rows(hidden, weight, target):
    torch._check(hidden.dim() == 2, lambda: f"fusedce: hidden must be 2-D (N, H), got {hidden.dim()}-D")
    torch._check(weight.dim() == 2, lambda: f"fusedce: weight must be 2-D (V_local, H), got {weight.dim()}-D")
    torch._check(
        target.dim() == 1 and target.shape[0] == hidden.shape[0],
        lambda: f"fusedce: target must be 1-D with one entry per row of hidden ({hidden.shape[0]})",
    )


@register_fake("lce_shard_stats")
def _lce_shard_stats_fake(hidden, weight, bias, target, class_weight, shard, options, linear, return_metrics):
    _check_linear_rows(hidden, weight, target)
    return hidden.new_empty((hidden.shape[0] + 1, STATS_WIDTH), dtype=torch.float32)


@register_fake("lce_shard_bwd")
def _lce_shard_bwd_fake(hidden, weight, bias, target, class_weight, lse, row_weight, batch, grad_loss, shard, options,
                        linear, need_grad_hidden, need_grad_weight, need_grad_bias):
    _check_linear_rows(hidden, weight, target)
    none = hidden.new_empty((0,))
    return (
        hidden.new_empty(hidden.shape, dtype=torch.float32) if need_grad_hidden else none,
        weight.new_empty(weight.shape) if need_grad_weight else hidden.new_empty((0,)),
        bias.new_empty(bias.shape) if need_grad_bias else hidden.new_empty((0,)),
    )
