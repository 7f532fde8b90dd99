"""Vocabulary-parallel cross-entropy over ``torch.distributed`` (docs/contract.md,
"Vocabulary-parallel form"): the model's head is split across the ranks of a process group by
vocabulary (tensor parallelism), each rank holds a contiguous block of classes, and the loss is
computed on the shards, exchanging only per-row scalars.

Two forms, each the single-device call with ``process_group=``; this module is the machinery
below them (the shard layout, the collectives, the agreement of the ranks), and it imports
neither front end:

* ``fusedce.cross_entropy(..., process_group=pg)`` (also ``fusedce.vocab_parallel_cross_entropy``):
  each rank holds ``logits[..., v0:v1]`` of the full vocabulary.
* ``fusedce.linear_cross_entropy(..., process_group=pg)`` (also
  ``fusedce.vocab_parallel_linear_cross_entropy``): each rank holds ``weight[v0:v1]`` (and
  ``bias[v0:v1]``) of the head; ``hidden`` is the same on every rank. Each rank runs the core's
  linear cross-entropy over its rows of the head (``lce_shard_stats``, ``lce_shard_merge``,
  ``lce_shard_bwd``: the logits formed chunk by chunk, never stored whole), with the options of
  the single-device call and their meaning there (``shift``, ``chunk_budget_bytes``,
  ``low_memory``, ``skip_ignored``: the core applies each of them, as on one device).

What crosses ranks
------------------
Per call, a constant number of collectives, none of them of size ``(N, V)``:

* forward: ONE all-gather of every rank's shard statistics, ``(N + 1, 9)`` float32 per rank
  (per row: max, sum of exponentials, entropy term, target logit and weight when the rank holds
  the target, smoothing sum, argmax value and global index; plus one row with the shard's
  class-weight sum). Every rank then merges the gathered block in rank order with the core's
  ``cross_entropy_shard_merge`` (the same partial log-sum-exp merge as the single-GPU split-row
  path), so the loss, ``lse`` and metrics are bit-identical on every rank.
* backward of the logits form: nothing; each rank forms its own ``(N, V_local)`` gradient slice
  from the merged ``lse`` (``cross_entropy_shard_backward``).
* backward of the linear form: ONE all-reduce (sum) of the ``(N, H)`` float32 gradient of
  ``hidden`` (each rank's part, formed by the core from its shard), only when ``hidden``
  requires grad. ``grad_weight`` and ``grad_bias`` are the local slices and never leave the
  rank.

The collectives are torch's functional collectives (``torch.distributed._functional_collectives``),
which torch.compile traces into the graph.

Agreement: the gathered block carries, in the spare floats of each rank's last row, that rank's
error code, column start, column count, ``vocab_total`` and layout rule. After the gather every
rank checks that the shards tile ``[0, V)`` in rank order and otherwise raises the same
``ValueError`` naming every rank's range; a rank whose own arguments fail its checks still joins
the call's first collective with its error code, and then every rank raises. So no rank waits
for a collective another rank never reaches, and none goes on with another call's data. The
check reads the gathered layout rows on the host: with more than one rank that is one small
device-to-host read per forward (a synchronisation under NCCL). Under torch.compile the check
is left out. A rank whose ``target`` is not a tensor or whose row count differs cannot join the
collective and raises alone.

Every rank must call the function with the same ``target``, options and rows, and run the
backward (the all-reduce of the linear form is a collective).

DTensor inputs (a head's weight sharded on dim 0, as ``ColwiseParallel`` leaves an ``lm_head``;
logits sharded on their class dimension, the ``loss_parallel`` convention) take these forms
without ``process_group``: :mod:`fusedce.dtensor` reads the group and the layout from the
DTensor and calls the front ends on the local tensors.

Shard layout
------------
Each rank passes its local block; where that block sits in the full vocabulary comes from two
keywords, with these rules (``r`` = this rank, ``R`` = the group's size, ``V_local`` = this
rank's number of columns, at least 1):

==================  ==================  ============================================  ==============
``vocab_start``     ``vocab_total``     layout                                        communication
==================  ==================  ============================================  ==============
None                None                equal shards: ``v0 = r * V_local``,           none
                                        ``V = R * V_local``
None                ``V``               ``torch.chunk(weight, R)``'s layout: blocks   none
                                        of ``ceil(V / R)``, the last one smaller;
                                        ``V_local`` is checked against it
``v0``              ``V``               as given                                      none
``v0``              None                ``V`` = the sum of every rank's ``V_local``   one all-reduce
                                                                                      of each rank's
                                                                                      size and error
                                                                                      code, read on
                                                                                      the host
==================  ==================  ============================================  ==============

The last rule costs a host-visible collective on every call (a device synchronisation under
NCCL) and cannot run inside torch.compile: pass ``vocab_total`` in a training loop.

Targets are global class indices in ``[0, V)`` (or ``ignore_index``) on every rank; class weights
(``weight=`` / ``class_weight=``) are each rank's slice ``(V_local,)`` of the full ``(V,)`` vector.
"""


import threading

import torch
import torch.distributed as dist

from ._checks import check_target_values
from ._options import ShardSpec
from .ops import _upstream, ops
from .vp_ops import STATS_WIDTH as _STATS_WIDTH



# ---- the process group and the shard layout -----------------------------------------------


def _functional_collectives():
    import torch.distributed._functional_collectives as funcol

    return funcol


def _group_rank_and_size(process_group, where):
    """(rank, world) of this process in `process_group`; errors name the argument."""
    if not dist.is_available():
        raise RuntimeError(f"{where}: this build of torch has no torch.distributed")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{where}: process_group must be a torch.distributed.ProcessGroup, got "
                        f"{type(process_group).__name__}")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(f"{where}: this process is not a member of process_group")
    return rank, dist.get_world_size(process_group)


def _as_int(value, name, where):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int or None, got {type(value).__name__}")
    return value


def _summed_local_sizes(local_vocab, process_group, device, where, error=0):
    """V as the sum of every rank's V_local: one all-reduce of a (2, R) int64 block (row 0: each
    rank's V_local in its own column, row 1: its error code), read on the host. A rank whose
    argument check failed takes part with error != 0, and then every rank raises: the ranks that
    reach this all-reduce do exactly this one collective of the call before raising, so none is
    left waiting and none goes on to a gather the others never join."""
    if torch.compiler.is_compiling():
        raise ValueError("fusedce: vocab_total is required under torch.compile when vocab_start "
                         "is given (deriving it needs a host-visible collective)")
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    block = torch.zeros((2, world), dtype=torch.int64, device=device)
    block[0, rank], block[1, rank] = local_vocab, error
    _mark_collective("reduced")
    dist.all_reduce(block, group=process_group)
    sizes, errors = block.tolist()
    _raise_if_failed(errors, where, world)
    return sum(sizes)


_RULES = ("equal shards (no vocab_start, no vocab_total)", "torch.chunk's layout (vocab_total only)",
          "vocab_start and vocab_total as given", "vocab_start given, vocab_total summed")


def shard_of(local_vocab, parallel, device, where):
    """The ShardSpec of this rank's `local_vocab` columns in the call `parallel` (a VocabParallel
    with a group), by the rules of the module's docstring. Raises ValueError naming the argument
    when the layout is impossible."""
    rank, world = _group_rank_and_size(parallel.group, where)
    if local_vocab < 1:
        raise ValueError(f"{where}: every rank must hold at least one column of the vocabulary, "
                         f"rank {rank} holds {local_vocab}")
    vocab_start, vocab_total, rule = parallel.vocab_start, parallel.vocab_total, parallel.rule
    if vocab_total is not None:
        vocab_total = _as_int(vocab_total, "vocab_total", where)
    if vocab_start is None:
        if vocab_total is None:
            return ShardSpec(rank * local_vocab, world * local_vocab, local_vocab, rule)
        block = -(-vocab_total // world)
        start = rank * block
        expected = max(0, min(block, vocab_total - start))
        if local_vocab != expected:
            raise ValueError(
                f"{where}: with vocab_total={vocab_total} and no vocab_start, rank {rank} of {world} "
                f"must hold torch.chunk's block of {expected} columns, but it holds {local_vocab}; "
                "pass vocab_start for another layout")
        return ShardSpec(start, vocab_total, local_vocab, rule)
    vocab_start = _as_int(vocab_start, "vocab_start", where)
    if vocab_total is None:
        vocab_total = _summed_local_sizes(local_vocab, parallel.group, device, where)
    if vocab_start < 0 or vocab_start + local_vocab > vocab_total:
        raise ValueError(f"{where}: vocab_start ({vocab_start}) + the {local_vocab} local columns must "
                         f"lie within vocab_total ({vocab_total})")
    return ShardSpec(vocab_start, vocab_total, local_vocab, rule)


# ---- collectives ----------------------------------------------------------------------------


def _waited(tensor):
    """The value of a functional collective's result (eager mode hands back an
    AsyncCollectiveTensor that waits on first use; traced code has a plain tensor)."""
    funcol = _functional_collectives()
    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


def _all_gather_rows(tensor, process_group):
    """Every rank's `tensor` concatenated along dim 0 in rank order."""
    funcol = _functional_collectives()
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return _waited(gather(tensor.contiguous(), 0, process_group))


def _all_reduce_sum(tensor, process_group):
    funcol = _functional_collectives()
    return _waited(funcol.all_reduce(tensor.contiguous(), "sum", process_group))


# Row N of a rank's statistics carries the class-weight sum in column 0 and nothing else for the
# core's merge (fusedce/vocab_parallel.h); columns 1..8 carry this rank's part of the call's
# agreement, so it travels in the one all-gather that already happens:
#   1: error code (0: arguments accepted; else _ERROR_KINDS' index, the rest of the block is 0)
#   2, 3 / 4, 5 / 6, 7: vocab_start / V_local / vocab_total, each as (hi, lo) = divmod(v, 2**20),
#      exact in float32 (both parts < 2**24) for any value below 2**44
#   8: the layout rule (_RULES' index)
_LAYOUT_BASE = 1 << 20
_ERROR_KINDS = (None, ValueError, TypeError, RuntimeError)


def _error_code(exc):
    for code, kind in enumerate(_ERROR_KINDS):
        if code and type(exc) is kind:
            return code
    return len(_ERROR_KINDS) - 1


def _raise_if_failed(errors, where, world):
    """The error every rank raises when some rank rejected its arguments (errors: each rank's
    code, in rank order). The rejecting rank raises its own, more specific error instead."""
    bad = [(r, int(c)) for r, c in enumerate(errors) if c]
    if not bad:
        return
    kinds = ", ".join(f"rank {r} ({_ERROR_KINDS[c].__name__ if c < len(_ERROR_KINDS) else 'error'})"
                      for r, c in bad)
    raise _AgreedError(
        f"{where}: {kinds} of {world} rejected its arguments (see that rank's error); every rank "
        "raises, and no rank uses statistics of this call")


class _AgreedError(ValueError):
    """An error every rank of the group raises for the same call, agreed through its collective."""


def _with_layout_row(stats, shard):
    """stats with columns 1..8 of row N set to this rank's layout record (see above)."""
    values = (0, *divmod(shard.vocab_start, _LAYOUT_BASE), *divmod(shard.local_vocab, _LAYOUT_BASE),
              *divmod(shard.vocab_total, _LAYOUT_BASE), shard.rule)
    for col, v in enumerate(values, start=1):
        stats[-1, col].fill_(float(v))  # a scalar fill, no host-to-device copy
    return stats


def _check_tiling(records, where, order=None):
    """Raise the same error on every rank unless the shards tile [0, V) in rank order (or, with
    `order`, in that order of the group's ranks: a DTensor sharded over several mesh dimensions
    by FSDP2 + TP holds its blocks in another order than its group's ranks). records: each
    rank's (error, vocab_start, V_local, vocab_total, rule), from the gathered block."""
    world = len(records)
    _raise_if_failed([r[0] for r in records], where, world)
    totals = {r[3] for r in records}
    end = 0
    ok = len(totals) == 1 and (order is None or sorted(order) == list(range(world)))
    for r in (range(world) if order is None or not ok else order):
        _, start, count, _, _ = records[r]
        ok = ok and start == end
        end = start + count
    ok = ok and end == records[0][3]
    if ok:
        return
    claims = ", ".join(f"rank {r} holds [{start}, {start + count}) of V={total}"
                       for r, (_, start, count, total, _) in enumerate(records))
    rules = sorted({rec[4] for rec in records})
    hint = ""
    if 0 in rules:
        hint = ("; without vocab_start and vocab_total every rank must hold the same number of "
                "columns: for uneven shards pass vocab_start and vocab_total (or vocab_total alone "
                "for torch.chunk's layout)")
    in_order = "in rank order" if order is None else f"in the order of ranks {tuple(order)}"
    raise _AgreedError(
        f"{where}: the shards do not tile the vocabulary [0, V) {in_order}: {claims} (layout "
        f"rule{'s' if len(rules) > 1 else ''}: {'; '.join(_RULES[k] for k in rules)}){hint}")


def _decode_layout(gathered, world, n):
    """Each rank's record from the gathered block: one small device-to-host read."""
    rows = gathered.view(world, n + 1, gathered.shape[1])[:, n, 1:].tolist()
    b = _LAYOUT_BASE
    return [(int(r[0]), int(r[1]) * b + int(r[2]), int(r[3]) * b + int(r[4]),
             int(r[5]) * b + int(r[6]), int(r[7])) for r in rows]


def _merge_shards(stats, target, class_weight, shard, call, linear=None):
    """Step 2 of the core: the one all-gather of the shard statistics (gather_checked), then
    the rank-order merge (the same bits on every rank), of the linear form when `linear` (its
    LinearOptions) is given. Returns loss, lse, num_correct, entropy_sum, row_weight, batch."""
    gathered = gather_checked(stats, target, shard, call.parallel, call.where)
    if linear is not None:
        return ops.lce_shard_merge(gathered, target, class_weight, *shard.op_args(), *call.options.op_args(),
                                   *linear.op_args(), call.return_metrics)
    return ops.ce_shard_merge(gathered, target, class_weight, *shard.op_args(), *call.options.op_args(),
                              call.return_metrics)


def gather_checked(stats, target, shard, parallel, where):
    """The one all-gather of a rank's (N + 1, 9) statistics (with this rank's layout record, from
    its ShardSpec, in row N) and the check that every rank accepted its arguments and that the
    shards tile [0, V) in rank order, or in the order `parallel` gives (the same error on every
    rank otherwise). Returns the gathered block, every rank's statistics in rank order, for a
    merge step of the core.

    The check reads the gathered records on the host (one device synchronisation per call under
    NCCL); it is skipped under torch.compile, where the layout and arguments must be right."""
    stats = _with_layout_row(stats, shard)
    _mark_collective("gathered")
    gathered = _all_gather_rows(stats, parallel.group)
    world = dist.get_world_size(parallel.group)
    record = (0, shard.vocab_start, shard.local_vocab, shard.vocab_total, shard.rule)
    if world == 1:
        _check_tiling([record], where)  # local, no read
    elif not torch.compiler.is_compiling():
        _check_tiling(_decode_layout(gathered, world, target.shape[0]), where, parallel.order)
    return gathered


# ---- one agreed outcome per call ------------------------------------------------------------------

# The call in progress on this thread: whether it has entered its first collective. A rank whose
# checks fail before that point joins the collective the other ranks are in with an error code
# instead of raising alone (which would leave them waiting under NCCL, or let them run on into
# the collectives of the next call under gloo).
_CALL = threading.local()


def _mark_collective(kind):
    if getattr(_CALL, "state", None) is not None:
        _CALL.state[kind] = True


def agreed_call(where, parallel, target, device, body):
    """Run body() (the whole call, from its argument checks on) so that its outcome is agreed by
    the group of `parallel` (a VocabParallel): when body raises before its first collective,
    this rank joins that collective with the error's code (the gather of the statistics, or the
    all-reduce of the sizes when its layout rule needs one) and re-raises, and every other rank
    raises too.

    Needs what every rank must agree on anyway: the process group and the target's number of
    entries (the rows of the gather); a rank that cannot even name those raises alone."""
    if torch.compiler.is_compiling():
        return body()
    outer = getattr(_CALL, "state", None)
    _CALL.state = {"reduced": False, "gathered": False}
    try:
        return body()
    except Exception as exc:
        state = _CALL.state
        if state["gathered"] or isinstance(exc, _AgreedError):
            raise
        try:
            _rank, world = _group_rank_and_size(parallel.group, where)
        except Exception:
            raise exc from None
        if world == 1 or not isinstance(target, torch.Tensor):
            raise
        code = _error_code(exc)
        dev = device if isinstance(device, torch.device) else target.device
        try:
            # The all-reduce of the sizes, when this rank's rule needs one and it has not run
            # (when it has, every rank passed it and is now on its way to the gather).
            if parallel.rule == 3 and not state["reduced"]:
                _summed_local_sizes(0, parallel.group, dev, where, error=code)
            else:
                block = torch.zeros((target.numel() + 1, _STATS_WIDTH), dtype=torch.float32,
                                    device=dev)
                block[-1, 1] = code
                _all_gather_rows(block, parallel.group)
        except _AgreedError:
            pass
        raise
    finally:
        _CALL.state = outer


# ---- cross-entropy over logit shards ----------------------------------------------------------


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: shard statistics, one all-gather, merge (loss, lse, metrics identical on every
    rank). Backward: this rank's dlogits from the merged lse; no communication.

    Arguments: logits (N, V_local), target (N,) global indices, class_weight (V_local,) or None, the
    call (a Call with its VocabParallel), this rank's ShardSpec. Returns loss, lse, num_correct,
    entropy_sum (only the loss is differentiable).
    """

    @staticmethod
    def forward(ctx, logits, target, class_weight, call, shard):
        stats = ops.ce_shard_stats(logits, target, class_weight, *shard.op_args(), *call.options.op_args(),
                                   call.return_metrics)
        loss, lse, num_correct, entropy_sum, row_weight, batch = _merge_shards(stats, target, class_weight, shard, call)
        ctx.save_for_backward(logits, target, class_weight, lse, row_weight, batch)
        ctx.call, ctx.shard = call, shard
        ctx.mark_non_differentiable(lse, num_correct, entropy_sum)
        ctx.set_materialize_grads(False)
        return loss, lse, num_correct, entropy_sum

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad = None
        if grad_loss is not None and ctx.needs_input_grad[0]:
            logits, target, class_weight, lse, row_weight, batch = ctx.saved_tensors
            grad = ops.ce_shard_bwd(logits, target, class_weight, lse, row_weight, batch, _upstream(grad_loss),
                                    *ctx.shard.op_args(), *ctx.call.options.op_args())
        return grad, None, None, None, None  # nothing for target, class_weight, call, shard


def cross_entropy_rows(x, target, class_weight, call):
    """The vocabulary-parallel path of fusedce.cross_entropy, after its argument checks: x is
    (N, V_local) with unit stride along V, target (N,), `call` a Call with its VocabParallel.
    Returns loss, lse, num_correct, entropy_sum as the single-device ops do. With
    call.check_targets, targets are checked against the full vocabulary, [0, vocab_total)."""
    shard = shard_of(x.shape[1], call.parallel, x.device, call.where)
    if call.check_targets:
        check_target_values(target, shard.vocab_total, call.options.ignore_index, call.where)
    if torch.is_grad_enabled() and x.requires_grad:
        return VocabParallelCrossEntropy.apply(x, target, class_weight, call, shard)
    stats = ops.ce_shard_stats(x, target, class_weight, *shard.op_args(), *call.options.op_args(), call.return_metrics)
    loss, lse, num_correct, entropy_sum, _, _ = _merge_shards(stats, target, class_weight, shard, call)
    return loss, lse, num_correct, entropy_sum


# ---- linear cross-entropy over weight shards ----------------------------------------------------


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Forward: the core's linear shard statistics (lce_shard_stats: the logits of this rank's
    rows of the head formed chunk by chunk and folded at once), one all-gather, merge
    (lce_shard_merge). Backward: the core's linear shard gradients (lce_shard_bwd: the logits
    formed again, their gradient from the merged lse, its products into grad_hidden,
    grad_weight, grad_bias), then one all-reduce (sum) of the float32 grad_hidden.

    Arguments: hidden (N, H), weight (V_local, H), bias (V_local,) or None, target (N,) global
    indices (unshifted: the core applies the call's shift), class_weight (V_local,) or None, the
    call (a Call: options, linear options, VocabParallel), this rank's ShardSpec. Returns loss,
    lse, num_correct, entropy_sum.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, call, shard):
        stats = ops.lce_shard_stats(hidden, weight, bias, target, class_weight, *shard.op_args(),
                                    *call.options.op_args(), *call.linear.op_args(), call.return_metrics)
        loss, lse, num_correct, entropy_sum, row_weight, batch = _merge_shards(
            stats, target, class_weight, shard, call, call.linear)
        ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse, row_weight, batch)
        ctx.call, ctx.shard = call, shard
        ctx.mark_non_differentiable(lse, num_correct, entropy_sum)
        ctx.set_materialize_grads(False)
        return loss, lse, num_correct, entropy_sum

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = grad_w = grad_b = None
        if grad_loss is not None and (need_h or need_w or need_b):
            hidden, weight, bias, target, class_weight, lse, row_weight, batch = ctx.saved_tensors
            call = ctx.call
            part_h, part_w, part_b = ops.lce_shard_bwd(
                hidden, weight, bias, target, class_weight, lse, row_weight, batch, _upstream(grad_loss),
                *ctx.shard.op_args(), *call.options.op_args(), *call.linear.op_args(),
                need_h, need_w, need_b)
            if need_h:
                # The sum over ranks of every rank's part, in float32, rounded once.
                grad_h = _all_reduce_sum(part_h, call.parallel.group).to(hidden.dtype)
            grad_w = part_w if need_w else None
            grad_b = part_b if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None  # nothing for target, class_weight, call, shard


def linear_cross_entropy_rows(h, w, bias, target, class_weight, call):
    """The vocabulary-parallel path of fusedce.linear_cross_entropy, after its argument checks:
    h (N, H), w this rank's rows (V_local, H) of the head, bias (V_local,) or None, target (N,)
    unshifted, class_weight (V_local,) float32 or None, `call` a Call with its linear options and
    VocabParallel. Returns loss, lse, num_correct, entropy_sum over the full vocabulary. The
    shift and skip_ignored are the core's, as on one device: every rank holds the same targets,
    so every rank keeps the same rows and the collectives keep their sizes."""
    shard = shard_of(w.shape[0], call.parallel, h.device, call.where)
    if call.check_targets:
        check_target_values(target, shard.vocab_total, call.options.ignore_index, call.where,
                            shift_seq_len=call.linear.shift_seq_len)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (h, w, bias)):
        return VocabParallelLinearCrossEntropy.apply(h, w, bias, target, class_weight, call, shard)
    stats = ops.lce_shard_stats(h, w, bias, target, class_weight, *shard.op_args(), *call.options.op_args(),
                                *call.linear.op_args(), call.return_metrics)
    loss, lse, num_correct, entropy_sum, _, _ = _merge_shards(stats, target, class_weight, shard, call, call.linear)
    return loss, lse, num_correct, entropy_sum
