"""Fake (meta) kernels of the distillation ops of torch/distill_ops.h (schemas in
torch/registry.h): ``ld_fwd`` / ``ld_bwd`` / ``ld_fwd_bwd`` (a teacher head) and ``ldk_fwd`` /
``ldk_bwd`` / ``ldk_fwd_bwd`` (a teacher's top-k), and the vocabulary-parallel steps ``ld_shard_*`` / ``ldk_shard_*``. python/fusedce/distillation.py strings them together in its autograd.Function:
they have no autograd formula of their own.
"""

import torch

from . import _library

# Floats per row of the forward's statistics (fusedce::kDistillStatsWidth in fusedce/distill.h).
STATS_WIDTH = 4


def _forward_fake(hidden, labels, reduction):
    n = hidden.shape[0]
    torch._check(labels is None or labels.shape == (n,),
                 lambda: f"fusedce: labels must be 1-D with one entry per row of hidden ({n})")
    f32 = dict(dtype=torch.float32)
    loss = hidden.new_empty((n,) if reduction == "none" else (), **f32)
    return (loss, hidden.new_empty((n,), **f32), hidden.new_empty((n,), **f32), hidden.new_empty((n,), **f32),
            hidden.new_empty((n, STATS_WIDTH), **f32))


def _backward_fake(hidden, weight, bias, need_h, need_w, need_b):
    none = hidden.new_empty((0,))
    return (hidden.new_empty(hidden.shape, dtype=torch.float32) if need_h else none,
            weight.new_empty(weight.shape) if need_w else none,
            bias.new_empty(bias.shape) if need_b else none)


@torch.library.register_fake(_library.qualified("ld_fwd"))
def _ld_fwd_fake(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, labels, beta, temperature,
                 hard_weight, ignore_index, reduction, *rest):
    return _forward_fake(hidden, labels, reduction)


@torch.library.register_fake(_library.qualified("ldk_fwd"))
def _ldk_fwd_fake(hidden, weight, bias, teacher_ids, teacher_logprobs, labels, beta, temperature, hard_weight,
                  ignore_index, reduction, *rest):
    return _forward_fake(hidden, labels, reduction)


@torch.library.register_fake(_library.qualified("ld_bwd"))
def _ld_bwd_fake(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, labels, stats, grad_loss,
                 *rest):
    return _backward_fake(hidden, weight, bias, *rest[-3:])


@torch.library.register_fake(_library.qualified("ldk_bwd"))
def _ldk_bwd_fake(hidden, weight, bias, teacher_ids, teacher_logprobs, labels, stats, grad_loss, *rest):
    return _backward_fake(hidden, weight, bias, *rest[-3:])


@torch.library.register_fake(_library.qualified("ld_fwd_bwd"))
def _ld_fwd_bwd_fake(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, labels, beta, temperature,
                     hard_weight, ignore_index, reduction, *rest):
    return (*_forward_fake(hidden, labels, reduction), *_backward_fake(hidden, weight, bias, *rest[-3:]))


@torch.library.register_fake(_library.qualified("ldk_fwd_bwd"))
def _ldk_fwd_bwd_fake(hidden, weight, bias, teacher_ids, teacher_logprobs, labels, beta, temperature, hard_weight,
                      ignore_index, reduction, *rest):
    return (*_forward_fake(hidden, labels, reduction), *_backward_fake(hidden, weight, bias, *rest[-3:]))


# The vocabulary-parallel steps (ld_shard_*): floats per row of step 1's statistics and step 3's
# parts (fusedce::kDistillShardStatsWidth, kDistillPartsWidth).
SHARD_STATS_WIDTH = 9
PARTS_WIDTH = 6


@torch.library.register_fake(_library.qualified("ld_shard_stats"))
def _ld_shard_stats_fake(hidden, *rest):
    return hidden.new_empty((hidden.shape[0] + 1, SHARD_STATS_WIDTH), dtype=torch.float32)


@torch.library.register_fake(_library.qualified("ld_shard_parts"))
def _ld_shard_parts_fake(hidden, *rest):
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32)
    return (hidden.new_empty((n, STATS_WIDTH), **f32), hidden.new_empty((n,), **f32),
            hidden.new_empty((n, PARTS_WIDTH), **f32))


@torch.library.register_fake(_library.qualified("ld_shard_reduce"))
def _ld_shard_reduce_fake(gathered, row_stats, hard, labels, beta, temperature, hard_weight, ignore_index, reduction,
                          *rest):
    return _forward_fake(row_stats, labels, reduction)


@torch.library.register_fake(_library.qualified("ld_shard_bwd"))
def _ld_shard_bwd_fake(hidden, weight, bias, *rest):
    return _backward_fake(hidden, weight, bias, *rest[-3:])


# The top-k form's steps (ldk_shard_*): step 3's parts and step 4's stats carry K more columns.
@torch.library.register_fake(_library.qualified("ldk_shard_stats"))
def _ldk_shard_stats_fake(hidden, *rest):
    return hidden.new_empty((hidden.shape[0] + 1, SHARD_STATS_WIDTH), dtype=torch.float32)


@torch.library.register_fake(_library.qualified("ldk_shard_parts"))
def _ldk_shard_parts_fake(hidden, weight, bias, teacher_ids, *rest):
    n, k = hidden.shape[0], teacher_ids.shape[1]
    f32 = dict(dtype=torch.float32)
    return (hidden.new_empty((n, STATS_WIDTH), **f32), hidden.new_empty((n,), **f32),
            hidden.new_empty((n, PARTS_WIDTH + k), **f32))


@torch.library.register_fake(_library.qualified("ldk_shard_reduce"))
def _ldk_shard_reduce_fake(gathered, row_stats, hard, teacher_logprobs, labels, beta, temperature, hard_weight,
                           ignore_index, reduction, *rest):
    loss, divergence, hard_out, entropy, _ = _forward_fake(row_stats, labels, reduction)
    stats = row_stats.new_empty((row_stats.shape[0], STATS_WIDTH + teacher_logprobs.shape[1]))
    return loss, divergence, hard_out, entropy, stats


@torch.library.register_fake(_library.qualified("ldk_shard_bwd"))
def _ldk_shard_bwd_fake(hidden, weight, bias, *rest):
    return _backward_fake(hidden, weight, bias, *rest[-3:])
