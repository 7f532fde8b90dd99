"""Vocabulary-parallel cross-entropy over ``torch.distributed`` (docs/contract.md,
"Vocabulary-parallel form"): the model's head is split across the ranks of a process group by
vocabulary (tensor parallelism), each rank holds a contiguous block of classes, and the loss is
computed on the shards, exchanging only per-row scalars.

Two forms:

* :func:`vocab_parallel_cross_entropy` (also ``fusedce.cross_entropy(..., process_group=pg)``):
  each rank holds ``logits[..., v0:v1]`` of the full vocabulary.
* :func:`vocab_parallel_linear_cross_entropy`: each rank holds ``weight[v0:v1]`` (and
  ``bias[v0:v1]``) of the head; ``hidden`` is the same on every rank; the logits are formed in
  bounded chunks and never stored whole.

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
  ``hidden`` (each rank's part is ``dlogits_local @ weight_local``), only when ``hidden`` requires
  grad. ``grad_weight`` and ``grad_bias`` are the local slices and never leave the rank.

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

from . import _library
from ._checks import check_target_values, scalar_options
from .ops import _upstream, ops
from .vp_ops import STATS_WIDTH as _STATS_WIDTH

_REDUCTIONS = ("none", "sum", "mean")

# Default bound on one chunk of the linear form: its float32 logits and their gradient.
DEFAULT_CHUNK_BUDGET_BYTES = 256 << 20
# low_memory=True: bound on the float32 grad_weight accumulator of one vocabulary block.
LOW_MEMORY_ACCUMULATOR_BYTES = 256 << 20

# torch.mm(..., out_dtype=torch.float32) for half-precision inputs (CUDA, torch >= 2.8).
_MM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


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


def _layout_rule(vocab_start, vocab_total):
    """Which row of the layout table applies (index into _RULES); any values, checked or not."""
    if vocab_start is None:
        return 0 if vocab_total is None else 1
    return 2 if vocab_total is not None else 3


_RULES = ("equal shards (no vocab_start, no vocab_total)", "torch.chunk's layout (vocab_total only)",
          "vocab_start and vocab_total as given", "vocab_start given, vocab_total summed")


def shard_layout(local_vocab, process_group, vocab_start=None, vocab_total=None, *, device="cpu",
                 where="fusedce"):
    """(vocab_start, vocab_total) of this rank's shard of `local_vocab` columns, by the rules of
    the module's docstring. Raises ValueError naming the argument when the layout is impossible."""
    rank, world = _group_rank_and_size(process_group, where)
    if local_vocab < 1:
        raise ValueError(f"{where}: every rank must hold at least one column of the vocabulary, "
                         f"rank {rank} holds {local_vocab}")
    if vocab_total is not None:
        vocab_total = _as_int(vocab_total, "vocab_total", where)
    if vocab_start is None:
        if vocab_total is None:
            return rank * local_vocab, world * local_vocab
        block = -(-vocab_total // world)
        start = rank * block
        expected = max(0, min(block, vocab_total - start))
        if local_vocab != expected:
            raise ValueError(
                f"{where}: with vocab_total={vocab_total} and no vocab_start, rank {rank} of {world} "
                f"must hold torch.chunk's block of {expected} columns, but it holds {local_vocab}; "
                "pass vocab_start for another layout")
        return start, vocab_total
    vocab_start = _as_int(vocab_start, "vocab_start", where)
    if vocab_total is None:
        vocab_total = _summed_local_sizes(local_vocab, process_group, device, where)
    if vocab_start < 0 or vocab_start + local_vocab > vocab_total:
        raise ValueError(f"{where}: vocab_start ({vocab_start}) + the {local_vocab} local columns must "
                         f"lie within vocab_total ({vocab_total})")
    return vocab_start, vocab_total


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


def _with_layout_row(stats, layout):
    """stats with columns 1..8 of row N set to this rank's layout record (see above)."""
    vocab_start, local_vocab, vocab_total, rule = layout
    values = (0, *divmod(vocab_start, _LAYOUT_BASE), *divmod(local_vocab, _LAYOUT_BASE),
              *divmod(vocab_total, _LAYOUT_BASE), rule)
    for col, v in enumerate(values, start=1):
        stats[-1, col].fill_(float(v))  # a scalar fill, no host-to-device copy
    return stats


def _check_tiling(records, where):
    """Raise the same error on every rank unless the shards tile [0, V) in rank order. records:
    each rank's (error, vocab_start, V_local, vocab_total, rule), from the gathered block."""
    world = len(records)
    _raise_if_failed([r[0] for r in records], where, world)
    totals = {r[3] for r in records}
    end = 0
    ok = len(totals) == 1
    for _, start, count, _, _ in records:
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
    raise _AgreedError(
        f"{where}: the shards do not tile the vocabulary [0, V) in rank order: {claims} (layout "
        f"rule{'s' if len(rules) > 1 else ''}: {'; '.join(_RULES[k] for k in rules)}){hint}")


def _decode_layout(gathered, world, n):
    """Each rank's record from the gathered block: one small device-to-host read."""
    rows = gathered.view(world, n + 1, gathered.shape[1])[:, n, 1:].tolist()
    b = _LAYOUT_BASE
    return [(int(r[0]), int(r[1]) * b + int(r[2]), int(r[3]) * b + int(r[4]),
             int(r[5]) * b + int(r[6]), int(r[7])) for r in rows]


def _merge_shards(stats, target, weight, shard, options, compute_metrics, process_group,
                  where="fusedce", local_vocab=None, rule=0):
    """Step 2 of the core: the one all-gather of the shard statistics (with this rank's layout
    record in row N), the check that every rank accepted its arguments and that the shards tile
    [0, V) in rank order (the same error on every rank otherwise), then the rank-order merge
    (the same bits on every rank). Returns loss, lse, num_correct, entropy_sum, row_weight, batch.

    The check reads the gathered records on the host (one device synchronisation per call under
    NCCL); it is skipped under torch.compile, where the layout and arguments must be right."""
    if local_vocab is not None:
        stats = _with_layout_row(stats, (shard[0], local_vocab, shard[1], rule))
    _mark_collective("gathered")
    gathered = _all_gather_rows(stats, process_group)
    world = dist.get_world_size(process_group)
    if local_vocab is not None and world == 1:
        _check_tiling([(0, shard[0], local_vocab, shard[1], rule)], where)  # local, no read
    elif local_vocab is not None and not torch.compiler.is_compiling():
        _check_tiling(_decode_layout(gathered, world, target.shape[0]), where)
    return ops.ce_shard_merge(gathered, target, weight, *shard, *options, compute_metrics)


# ---- one agreed outcome per call ------------------------------------------------------------------

# The call in progress on this thread: whether it has entered its first collective. A rank whose
# checks fail before that point joins the collective the other ranks are in with an error code
# instead of raising alone (which would leave them waiting under NCCL, or let them run on into
# the collectives of the next call under gloo).
_CALL = threading.local()


def _mark_collective(kind):
    if getattr(_CALL, "state", None) is not None:
        _CALL.state[kind] = True


def in_agreed_call():
    return getattr(_CALL, "state", None) is not None


def agreed_call(where, process_group, target, device, vocab_start, vocab_total, body):
    """Run body() (the whole call, from its argument checks on) so that its outcome is agreed by
    the group: when body raises before its first collective, this rank joins that collective
    with the error's code (the gather of the statistics, or the all-reduce of the sizes when
    its layout rule needs one) and re-raises, and every other rank raises too.

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
            _rank, world = _group_rank_and_size(process_group, where)
        except Exception:
            raise exc from None
        if world == 1 or not isinstance(target, torch.Tensor):
            raise
        code = _error_code(exc)
        dev = device if isinstance(device, torch.device) else target.device
        try:
            # The all-reduce of the sizes, when this rank's rule needs one and it has not run
            # (when it has, every rank passed it and is now on its way to the gather).
            if _layout_rule(vocab_start, vocab_total) == 3 and not state["reduced"]:
                _summed_local_sizes(0, process_group, dev, where, error=code)
            else:
                block = torch.zeros((target.numel() + 1, _STATS_WIDTH), dtype=torch.float32,
                                    device=dev)
                block[-1, 1] = code
                _all_gather_rows(block, process_group)
        except _AgreedError:
            pass
        raise
    finally:
        _CALL.state = outer


# ---- cross-entropy over logit shards ----------------------------------------------------------


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: shard statistics, one all-gather, merge (loss, lse, metrics identical on every
    rank). Backward: this rank's dlogits from the merged lse; no communication.

    Arguments: logits (N, V_local), target (N,) global indices, weight (V_local,) or None, the
    process group, shard = (vocab_start, vocab_total), the six options of ops.py, compute_metrics.
    Returns loss, lse, num_correct, entropy_sum (only the loss is differentiable).
    """

    @staticmethod
    def forward(ctx, logits, target, weight, process_group, shard, options, compute_metrics, layout):
        stats = ops.ce_shard_stats(logits, target, weight, *shard, *options, compute_metrics)
        loss, lse, num_correct, entropy_sum, row_weight, batch = _merge_shards(
            stats, target, weight, shard, options, compute_metrics, process_group, *layout)
        ctx.save_for_backward(logits, target, weight, lse, row_weight, batch)
        ctx.shard, ctx.options = shard, options
        ctx.mark_non_differentiable(lse, num_correct, entropy_sum)
        ctx.set_materialize_grads(False)
        return loss, lse, num_correct, entropy_sum

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grads = [None] * 8
        if grad_loss is not None and ctx.needs_input_grad[0]:
            logits, target, weight, lse, row_weight, batch = ctx.saved_tensors
            grads[0] = ops.ce_shard_bwd(logits, target, weight, lse, row_weight, batch,
                                        _upstream(grad_loss), *ctx.shard, *ctx.options)
        return tuple(grads)


def cross_entropy_rows(x, target, weight, options, compute_metrics, *, process_group, vocab_start,
                       vocab_total, check_targets=False):
    """The vocabulary-parallel path of fusedce.cross_entropy, after its argument checks: x is
    (N, V_local) with unit stride along V, target (N,). Returns loss, lse, num_correct,
    entropy_sum as the single-device ops do. check_targets: targets are checked against the
    full vocabulary, [0, vocab_total)."""
    shard = shard_layout(x.shape[1], process_group, vocab_start, vocab_total, device=x.device,
                         where="fusedce.cross_entropy")
    if check_targets:
        check_target_values(target, shard[1], options[0], "fusedce.cross_entropy")
    layout = ("fusedce.cross_entropy", x.shape[1], _layout_rule(vocab_start, vocab_total))
    if torch.is_grad_enabled() and x.requires_grad:
        return VocabParallelCrossEntropy.apply(x, target, weight, process_group, shard, options,
                                               compute_metrics, layout)
    stats = ops.ce_shard_stats(x, target, weight, *shard, *options, compute_metrics)
    return _merge_shards(stats, target, weight, shard, options, compute_metrics, process_group,
                         *layout)[:4]


def vocab_parallel_cross_entropy(logits, target, weight=None, *, process_group, vocab_start=None,
                                 vocab_total=None, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0,
                                 return_metrics=False, check_targets=False):
    """Cross-entropy of logits split by vocabulary across the ranks of ``process_group``: this
    rank holds ``logits[..., v0:v1]`` of the full ``(..., V)`` logits, and the result is that of
    ``fusedce.cross_entropy`` on the full logits, up to float32 rounding.

    The same as ``fusedce.cross_entropy(logits, target, weight, process_group=..., ...)``; see the
    module's docstring for the shard layout (``vocab_start``, ``vocab_total``) and what crosses
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
    from .functional import cross_entropy

    if process_group is None:
        raise ValueError("fusedce.vocab_parallel_cross_entropy: process_group is required "
                         "(use fusedce.cross_entropy for logits that are not split)")
    return cross_entropy(logits, target, weight, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing, logit_scale=logit_scale, softcap=softcap,
                         z_loss=z_loss, return_metrics=return_metrics, check_targets=check_targets,
                         process_group=process_group, vocab_start=vocab_start,
                         vocab_total=vocab_total)


# ---- linear cross-entropy over weight shards ----------------------------------------------------


def _matmul_operand(weight):
    """The weight as the chunk products take it: as it is on a GPU or in float32 (products in
    float32 accumulation with a float32 result); widened to float32 once per call elsewhere,
    where half-precision products with a float32 result are not available."""
    if weight.dtype == torch.float32 or (weight.is_cuda and _MM_HAS_OUT_DTYPE):
        return weight
    return weight.float()


def _matmul_f32(a, b):
    """a @ b accumulated in float32 with a float32 result, without widening `b` when both are
    half precision on a GPU (tensor cores with out_dtype)."""
    if a.dtype == b.dtype == torch.float32:
        return a @ b
    if a.dtype == b.dtype and a.is_cuda and _MM_HAS_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _chunk_logits(hidden, weight_op, bias32, rows, cols):
    """float32 logits of hidden[rows] against weight rows `cols`: (len(rows), len(cols))."""
    z = _matmul_f32(hidden[rows], weight_op[cols].t())
    if bias32 is not None:
        z = z + bias32[cols]
    return z


def _spans(total, step):
    return [slice(i, min(i + step, total)) for i in range(0, total, step)]


class _LinearPlan:
    """How the linear form is chunked: rows per token chunk (its float32 logits and their
    gradient within chunk_budget_bytes) and rows of the weight per vocabulary block of the
    backward (the whole shard, or with low_memory a block whose float32 grad_weight accumulator
    is at most LOW_MEMORY_ACCUMULATOR_BYTES)."""

    def __init__(self, n, local_vocab, hidden_size, chunk_budget_bytes, low_memory):
        budget = DEFAULT_CHUNK_BUDGET_BYTES if chunk_budget_bytes is None else int(chunk_budget_bytes)
        self.token_chunks = _spans(n, max(1, budget // (8 * local_vocab)))
        block = local_vocab
        if low_memory:
            block = max(1, min(local_vocab, LOW_MEMORY_ACCUMULATOR_BYTES // (4 * max(1, hidden_size))))
        self.vocab_blocks = _spans(local_vocab, block)


def _linear_stats(hidden, weight, bias, target, class_weight, shard, options, compute_metrics, plan):
    """Pass 1: each token chunk's logits (float32) and their shard statistics; only the
    statistics are kept. Returns (N + 1, 9) float32 as ce_shard_stats does for the whole shard."""
    weight_op = _matmul_operand(weight)
    bias32 = bias.float() if bias is not None else None
    cols = slice(0, weight.shape[0])
    parts = []
    for rows in plan.token_chunks or [slice(0, 0)]:
        z = _chunk_logits(hidden, weight_op, bias32, rows, cols)
        s = ops.ce_shard_stats(z, target[rows], class_weight, *shard, *options, compute_metrics)
        parts.append(s[:-1])
    parts.append(s[-1:])  # the shard's class-weight sum, the same for every chunk
    return torch.cat(parts)


def _accumulator(grad, cols):
    """float32 zeros for grad[cols]: the slice itself when grad is float32, else a new buffer."""
    if grad.dtype == torch.float32:
        return grad[cols].zero_()
    return grad.new_zeros(grad[cols].shape, dtype=torch.float32)


def _linear_grads(hidden, weight, bias, target, class_weight, lse, row_weight, batch, grad_loss,
                  shard, options, plan, needs):
    """Pass 2: per vocabulary block and token chunk, the logits again, their gradient (the core's
    shard backward, float32), and its products into grad_hidden (float32, this rank's part),
    grad_weight (float32 accumulator per block, rounded once) and grad_bias."""
    need_h, need_w, need_b = needs
    n, hidden_size = hidden.shape
    weight_op = _matmul_operand(weight)
    bias32 = bias.float() if bias is not None else None
    per_row = grad_loss.dim() == 1 and options[1] == "none"
    # On a GPU the products take the gradient in the inputs' half precision (tensor cores), as
    # the unfused backward of a half-precision linear layer does; elsewhere it stays float32.
    low = hidden.dtype if hidden.dtype == weight_op.dtype else torch.float32
    grad_h = hidden.new_zeros((n, hidden_size), dtype=torch.float32) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.empty_like(bias) if need_b else None
    vocab_start, vocab_total = shard
    for cols in plan.vocab_blocks:
        acc_w = _accumulator(grad_w, cols) if need_w else None
        acc_b = _accumulator(grad_b, cols) if need_b else None
        cw = class_weight[cols] if class_weight is not None else None
        block_shard = (vocab_start + cols.start, vocab_total)
        for rows in plan.token_chunks:
            z = _chunk_logits(hidden, weight_op, bias32, rows, cols)
            g = grad_loss[rows] if per_row else grad_loss
            d = ops.ce_shard_bwd(z, target[rows], cw, lse[rows], row_weight[rows], batch, g,
                                 *block_shard, *options)
            if need_h:
                grad_h[rows] += _matmul_f32(d.to(low), weight_op[cols])
            if need_w:
                acc_w += _matmul_f32(d.t().to(low), hidden[rows])
            if need_b:
                acc_b += d.sum(0)
        for grad, acc in ((grad_w, acc_w), (grad_b, acc_b)):
            if acc is not None and acc.dtype != grad.dtype:
                grad[cols] = acc  # rounded once
    return grad_h, grad_w, grad_b


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Forward: pass 1 over token chunks (statistics only), one all-gather, merge. Backward:
    pass 2 (logits recomputed chunk by chunk), one all-reduce of grad_hidden.

    Arguments: hidden (N, H), weight (V_local, H), bias (V_local,) or None, target (N,) global
    indices (already shifted), class_weight (V_local,) or None, the process group, shard, the six
    options, compute_metrics, plan. Returns loss, lse, num_correct, entropy_sum.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, process_group, shard, options,
                compute_metrics, plan, layout):
        stats = _linear_stats(hidden, weight, bias, target, class_weight, shard, options,
                              compute_metrics, plan)
        loss, lse, num_correct, entropy_sum, row_weight, batch = _merge_shards(
            stats, target, class_weight, shard, options, compute_metrics, process_group, *layout)
        ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse, row_weight, batch)
        ctx.process_group, ctx.shard, ctx.options, ctx.plan = process_group, shard, options, plan
        ctx.mark_non_differentiable(lse, num_correct, entropy_sum)
        ctx.set_materialize_grads(False)
        return loss, lse, num_correct, entropy_sum

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grads = [None] * 11
        needs = tuple(ctx.needs_input_grad[:3])
        if grad_loss is None or not any(needs):
            return tuple(grads)
        hidden, weight, bias, target, class_weight, lse, row_weight, batch = ctx.saved_tensors
        grad_h, grad_w, grad_b = _linear_grads(hidden, weight, bias, target, class_weight, lse,
                                               row_weight, batch, _upstream(grad_loss), ctx.shard,
                                               ctx.options, ctx.plan, needs)
        if grad_h is not None:
            grad_h = _all_reduce_sum(grad_h, ctx.process_group).to(hidden.dtype)
        grads[0], grads[1], grads[2] = grad_h, grad_w, grad_b
        return tuple(grads)


def _shifted_target(target, ignore_index):
    """Causal shift within sequences along target's last dimension: position i takes target
    i + 1, the last position of each sequence is ignored. A cheap (N,) op; hidden is untouched."""
    if target.dim() == 0 or target.shape[-1] == 0:
        return target
    pad = torch.full_like(target[..., :1], ignore_index)
    return torch.cat([target[..., 1:], pad], dim=-1)


def _check_linear_args(hidden, weight, target, bias, class_weight, reduction, softcap, where):
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{where}: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if hidden.dim() < 1:
        raise ValueError(f"{where}: hidden must have shape (..., H), got {tuple(hidden.shape)}")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{where}: weight must be (V_local, H) with H = hidden.shape[-1] = "
                         f"{hidden.shape[-1]}, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{where}: weight has dtype {weight.dtype} but hidden has {hidden.dtype}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"{where}: target must have shape hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: target must be int64 or int32 class indices, got {target.dtype}")
    for name, t in (("weight", weight), ("target", target), ("bias", bias),
                    ("class_weight", class_weight)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{where}: {name} is on {t.device} but hidden is on {hidden.device}")
    local_vocab = weight.shape[0]
    if bias is not None and (bias.shape != (local_vocab,) or bias.dtype != hidden.dtype):
        raise ValueError(f"{where}: bias must be ({local_vocab},) {hidden.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    if class_weight is not None and class_weight.shape != (local_vocab,):
        raise ValueError(f"{where}: class_weight must be this rank's slice ({local_vocab},), got "
                         f"{tuple(class_weight.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{where}: softcap must be None (off) or > 0, got {softcap}")
    if hidden.device.type == "cuda" and not _library.with_cuda:
        raise RuntimeError(f"{where}: hidden is on a CUDA device but this build of fusedce has no "
                           "CUDA kernels")


def vocab_parallel_linear_cross_entropy(hidden, weight, target, bias=None, *, process_group,
                                        vocab_start=None, class_weight=None, ignore_index=-100,
                                        reduction="mean", label_smoothing=0.0, logit_scale=1.0,
                                        softcap=None, z_loss=0.0, shift=False,
                                        return_metrics=False, chunk_budget_bytes=None,
                                        low_memory=False, vocab_total=None, check_targets=False):
    """Cross-entropy of ``hidden @ weight.T + bias`` with the head split by vocabulary across the
    ranks of ``process_group``: this rank holds ``weight[v0:v1]`` (V_local, H) and
    ``bias[v0:v1]``; ``hidden`` (..., H) and ``target`` (...) are the same on every rank. The
    result is that of the unsplit head up to float32 rounding; the (N, V) logits are never
    stored, on any rank.

    How it runs (R ranks, N rows, H hidden size):

    1. pass 1, per chunk of rows: the chunk's logits against the local weight, float32
       (products accumulated in float32; half-precision inputs stay half on a GPU), reduced at
       once to the shard statistics of the chunk; the logits are dropped.
    2. ONE all-gather of the statistics ((N + 1, 9) float32 per rank) and the rank-order merge:
       loss, lse, metrics, the same bits on every rank.
    3. backward (only when a gradient is required), per chunk again: the logits recomputed,
       their gradient from the merged lse, accumulated into this rank's part of grad_hidden
       (float32), grad_weight (a float32 accumulator, rounded once to weight's dtype) and
       grad_bias; then ONE all-reduce (sum) of grad_hidden, (N, H) float32. grad_weight and
       grad_bias are this rank's slices and are not communicated.

    Ignored rows still enter the products (dropping them would need their count on the host);
    they contribute nothing.

    Memory beyond the inputs and the gradients: one chunk's float32 logits and their gradient,
    at most ``chunk_budget_bytes`` (default 256 MiB; rows per chunk = budget / (8 V_local)); the
    (N + 1, 9) statistics (R times that once gathered); in the backward the (N, H) float32
    grad_hidden and the float32 grad_weight accumulator: (V_local, H), or with
    ``low_memory=True`` a block of the vocabulary at a time, at most 256 MiB (the logits of each
    chunk are then computed once per block: no extra arithmetic, smaller products). On the CPU,
    half-precision weights are also widened to float32 once per pass.

    Args:
        hidden: (..., H) float32, bfloat16 or float16, identical on every rank.
        weight: this rank's rows (V_local, H) of the head, hidden's dtype.
        target: hidden.shape[:-1] global class indices in [0, V) or ``ignore_index``.
        bias: this rank's slice (V_local,) of the head's bias, or None.
        process_group, vocab_start, vocab_total: the group and the shard layout (module
            docstring); ``vocab_total`` (not in ``fusedce.linear_cross_entropy``'s keyword set)
            avoids the host-visible collective when ``vocab_start`` is given.
        class_weight: this rank's slice (V_local,) of the class weights (PyTorch's ``weight=``).
        ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss: as in
            ``fusedce.cross_entropy``, over the full vocabulary.
        shift: causal shift: position i of each sequence (the last dimension of ``target``)
            predicts target i + 1 and the last position is ignored, as a causal LM's loss; done
            on the target (an (N,) op), hidden is never copied.
        return_metrics: also return ``{"num_correct", "entropy_sum", "lse"}`` as
            ``fusedce.cross_entropy`` does.
        chunk_budget_bytes: bound on one chunk's float32 logits and their gradient.
        low_memory: bound the float32 grad_weight accumulator (see Memory).
        check_targets: check the target values against [0, V) first, as
            ``fusedce.cross_entropy`` does (one device synchronisation on a GPU); with ``shift``
            the entries no row reads (the first of each sequence) are not checked.

    Returns:
        The float32 loss (target's shape with ``reduction='none'``), the same on every rank, or
        ``(loss, metrics)``.
    """
    where = "fusedce.vocab_parallel_linear_cross_entropy"
    if process_group is not None and not torch.compiler.is_compiling() and not in_agreed_call():
        # Every check below may fail on one rank only: the outcome is agreed by the group.
        return agreed_call(
            where, process_group, target, getattr(hidden, "device", None), vocab_start, vocab_total,
            lambda: vocab_parallel_linear_cross_entropy(
                hidden, weight, target, bias, process_group=process_group, vocab_start=vocab_start,
                class_weight=class_weight, ignore_index=ignore_index, reduction=reduction,
                label_smoothing=label_smoothing, logit_scale=logit_scale, softcap=softcap,
                z_loss=z_loss, shift=shift, return_metrics=return_metrics,
                chunk_budget_bytes=chunk_budget_bytes, low_memory=low_memory,
                vocab_total=vocab_total, check_targets=check_targets))
    _check_linear_args(hidden, weight, target, bias, class_weight, reduction, softcap, where)
    if process_group is None:
        raise ValueError(f"{where}: process_group is required")
    if class_weight is not None:
        class_weight = class_weight.to(torch.float32)
    ignore_index, label_smoothing, logit_scale, softcap, z_loss = scalar_options(
        where, ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    local_vocab, hidden_size = weight.shape
    shard = shard_layout(local_vocab, process_group, vocab_start, vocab_total, device=hidden.device,
                         where=where)
    if check_targets:
        seq = target.shape[-1] if shift and target.dim() > 0 else 0
        check_target_values(target, shard[1], ignore_index, where, shift_seq_len=seq)
    t = _shifted_target(target, ignore_index) if shift else target
    h = hidden.reshape(-1, hidden_size)
    t = t.reshape(-1)
    options = (ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss)
    plan = _LinearPlan(h.shape[0], local_vocab, hidden_size, chunk_budget_bytes, low_memory)
    layout = (where, local_vocab, _layout_rule(vocab_start, vocab_total))
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (hidden, weight, bias))
    if needs_grad:
        loss, lse, num_correct, entropy_sum = VocabParallelLinearCrossEntropy.apply(
            h, weight, bias, t, class_weight, process_group, shard, options, bool(return_metrics), plan,
            layout)
    else:
        stats = _linear_stats(h, weight, bias, t, class_weight, shard, options,
                              bool(return_metrics), plan)
        loss, lse, num_correct, entropy_sum = _merge_shards(
            stats, t, class_weight, shard, options, bool(return_metrics), process_group, *layout)[:4]
    if reduction == "none":
        loss = loss.view(target.shape)
    if return_metrics:
        return loss, {"num_correct": num_correct, "entropy_sum": entropy_sum, "lse": lse}
    return loss
