"""DTensor inputs of fusedce.cross_entropy and fusedce.linear_cross_entropy (and of the heads of
fusedce.linear_logprobs, fusedce.logprobs, fusedce.linear_distillation and
fusedce.linear_distillation_topk: the end of this module): tensors sharded as PyTorch's tensor
parallelism hands them over, run through the vocabulary-parallel form of
:mod:`fusedce.distributed` with the group, the column start and the vocabulary size read from
the DTensors themselves.

* ``linear_cross_entropy(hidden, weight, target, bias)`` with ``weight`` a DTensor sharded on
  dim 0 (``Shard(0)``): an ``lm_head`` under ``ColwiseParallel``. ``bias`` (if given) must be
  placed as ``weight``; ``hidden`` and ``target`` are plain tensors (the same on every rank of
  the vocabulary's group) or replicated DTensors on the same mesh.
* ``cross_entropy(logits, target, weight)`` with ``logits`` a DTensor sharded on its class
  dimension (the last, or dim 1 of PyTorch's ``(N, C, d1, ...)`` layout): the ``loss_parallel``
  convention (``ColwiseParallel(use_local_output=False)`` logits).
* Class weights (``weight=`` / ``class_weight=``): a DTensor placed as the sharded input on the
  class dimension, a ``Replicate()`` DTensor, or a plain full ``(V,)`` tensor; each rank uses its
  slice.

Device meshes of any number of dimensions: on each, the input is replicated or sharded on its
class dimension (``Shard``, or the strided shard FSDP2 puts on its dimension over a
tensor-parallel shard: FSDP2 + TP). The vocabulary's group is that of the mesh dimensions that
shard the classes (one dimension's group, or the group of their flattened submesh); on the
others each rank runs its own problem (data parallelism: plain ``hidden`` may differ there). A
head replicated on every mesh dimension runs the single-device call on every rank (nothing
crosses ranks).

Layout: ``vocab_total`` is the DTensor's global size on the class dimension and ``vocab_start``
this rank's offset in it (torch's own computation of the shard's offset, so torch's uneven
``Shard`` split, ``ceil(V / R)`` rows on the first ranks, is followed as it is). Every block of
the group is computed on every rank from the mesh and the placements (no communication): each
must be a contiguous run of at least one class, and the runs must tile the vocabulary. Their
order among the group's ranks (another than rank order under FSDP2 + TP's strided shard) is
what the gather's layout check follows. Under torch.compile the layout is a constant of the
graph and the calls trace without a graph break.
``process_group``, ``vocab_start`` and ``vocab_total`` come from the DTensor and are refused when
passed.

Results: the loss (and metrics) are plain tensors, the same bits on every rank, those of the
whole vocabulary; a plain tensor rather than a ``Replicate()`` DTensor because it is what the
rest of a training step mixes it with (a division by a token count, an auxiliary loss, logging),
which a DTensor would refuse. Gradients reach the DTensor inputs through ``to_local()``, so each
input's gradient is a DTensor with that input's placements (``weight.grad``: this rank's rows
of the full gradient; ``hidden.grad`` of a ``Replicate()`` hidden: the full gradient
on every rank).

What a DTensor call refuses (ValueError naming the argument): placements other than those
above on any mesh dimension (``Partial``, a shard on another dimension, logits sharded on rows
and classes, a strided shard without the shard it splits), class weights placed otherwise than
the input, several sharded mesh dimensions without names, inputs on different meshes, a plain ``bias`` or
``logits`` with a sharded head, class-probability targets, ``inplace_backward``. The sharded
calls run inside :func:`fusedce.distributed.agreed_call`, so an argument error found on one rank
is raised on every rank.
"""

import functools
import sys
from typing import NamedTuple, Optional, Tuple

import torch

from . import distributed
from ._options import VocabParallel

def _dtensor_class():
    """torch's DTensor class, or () (isinstance(x, ()) is False) while torch.distributed.tensor
    is not imported: no DTensor can exist before it is, and importing it takes seconds, which a
    program that never makes one must not pay."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", ()) if module is not None else ()


def is_dtensor(value):
    return any_dtensor(value)


def any_dtensor(*values):
    """Whether any of `values` is a DTensor. Plain tensors and parameters (every call of the
    single-device forms) are told apart by their type alone."""
    for value in values:
        if isinstance(value, torch.Tensor) and type(value) not in _PLAIN:
            if isinstance(value, _dtensor_class()):
                return True
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain(*values):
    """Whether every one of `values` is None or a plain tensor or parameter (by type alone): the
    usual call, told apart without any_dtensor's look-ups."""
    for value in values:
        if value is not None and type(value) not in _PLAIN:
            return False
    return True


def _describe(value):
    if is_dtensor(value):
        return f"a DTensor with placements {tuple(value.placements)}"
    return type(value).__name__ if not isinstance(value, torch.Tensor) else "a plain tensor"


def _same_mesh(value, name, mesh, where):
    if value.device_mesh != mesh:
        raise ValueError(f"{where}: {name} is a DTensor on another device mesh than the sharded "
                         f"input ({value.device_mesh} vs {mesh})")


def _replicated(value):
    return all(p.is_replicate() for p in value.placements)


def _replicated_local(value, name, mesh, where, optional=False):
    """A plain tensor as it is; a DTensor on `mesh` replicated on every mesh dimension as its
    local tensor (autograd follows to_local, so its gradient is a DTensor so placed); anything
    else refused."""
    if value is None and optional:
        return None
    if not is_dtensor(value):
        return value
    _same_mesh(value, name, mesh, where)
    if not _replicated(value):
        raise ValueError(f"{where}: {name} must be a plain tensor or a Replicate() DTensor (the "
                         f"same on every rank), got {_describe(value)}")
    return value.to_local()


def _on_dim0(placement):
    """`placement` (a shard of the class dimension, or Replicate) moved to dim 0: how a (V,)
    vector of class weights is placed as the sharded input."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if _is_strided(placement):
        return _StridedShard(0, split_factor=placement.split_factor)
    return Shard(0) if type(placement) is Shard else placement


def _class_weight_local(value, name, layout, source, what, vocab, mesh, where):
    """This rank's slice of the class weights: from a DTensor placed as the sharded input
    (`source`, with its class dimension on dim 0), or sliced from a replicated DTensor or a plain
    full (V,) tensor. With `layout` None (a replicated head), the whole vector."""
    if value is None:
        return None
    if is_dtensor(value):
        _same_mesh(value, name, mesh, where)
        if value.dim() != 1 or value.shape[0] != vocab:
            raise ValueError(f"{where}: {name} must have shape ({vocab},) (the vocabulary), got "
                             f"{tuple(value.shape)}")
        placed_as_source = tuple(_on_dim0(p) for p in source.placements)
        if layout is not None and tuple(value.placements) == placed_as_source:
            return value.to_local()
        if not _replicated(value):
            raise ValueError(f"{where}: {name} must be a DTensor placed as the "
                             f"{what} on the classes "
                             f"({placed_as_source}), a Replicate() DTensor or a plain ({vocab},) "
                             f"tensor, got {_describe(value)}")
        value = value.to_local()
    elif not isinstance(value, torch.Tensor) or value.shape != (vocab,):
        raise ValueError(f"{where}: {name} must be the full ({vocab},) vector of class weights "
                         f"(each rank uses its slice) or a DTensor, got "
                         f"{getattr(value, 'shape', type(value).__name__)}")
    return value if layout is None else value[layout.start:layout.start + layout.count]


def _refuse_layout_keywords(parallel, where, what):
    given = parallel.given()
    if given is not None:
        raise ValueError(f"{where}: {given} is read from the DTensor {what} (its device mesh and "
                         "sharding); it cannot be passed with it")


def _agreed(where, layout, source, target, device, body):
    """body(parallel) with the VocabParallel of `layout` (vocab_start and vocab_total given, the
    order of its blocks among the group's ranks; `source` names the sharded input in errors) and
    its outcome agreed by the group of the vocabulary (distributed.agreed_call): an error raised
    by one rank before the call's first collective is raised on every rank."""
    parallel = VocabParallel(layout.group, layout.start, layout.total, layout.order, source)
    return distributed.agreed_call(where, parallel, _agreement_target(target), device,
                                   functools.partial(body, parallel))


def _agreement_target(target):
    """What agreed_call needs of the target: a tensor with every rank's number of entries (a
    DTensor's global numel is the same on every rank)."""
    return target if isinstance(target, torch.Tensor) else None


# ---- the vocabulary layout of a sharded DTensor ------------------------------------------------


class _Layout(NamedTuple):
    """Where this rank's classes sit and which ranks share the vocabulary: the process group over
    the mesh dimensions that shard the class dimension, this rank's first class and count, the
    vocabulary size, and the group's ranks in vocabulary order (None when that is rank order)."""

    group: object
    start: int
    count: int
    total: int
    order: Optional[Tuple[int, ...]]


def _is_strided(placement):
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def _shards_dim(placement, dim, ndim):
    """Whether `placement` shards tensor dimension `dim` (plain or strided shards)."""
    from torch.distributed.tensor import Shard

    if type(placement) is not Shard and not _is_strided(placement):
        return False
    return placement.dim % ndim == dim % ndim


def _sharded_mesh_dims(value, dim, name, where, what):
    """The mesh dimensions over which the DTensor `value` shards tensor dimension `dim`; every
    other mesh dimension must replicate it (ValueError naming `name` otherwise)."""
    dims = []
    for i, placement in enumerate(value.placements):
        if _shards_dim(placement, dim, value.dim()):
            dims.append(i)
        elif not placement.is_replicate():
            at = f" on mesh dimension {_mesh_dim_name(value.device_mesh, i)}" \
                if value.device_mesh.ndim > 1 else ""
            raise ValueError(f"{where}: {name} must be {what} or replicated on every mesh "
                             f"dimension, got {_describe(value)}: {placement!r}{at}")
    return dims


def _mesh_dim_name(mesh, i):
    names = mesh.mesh_dim_names
    return f"{i} ({names[i]!r})" if names else str(i)


def _vocab_group(mesh, dims, name, where):
    """The process group of this rank over mesh dimensions `dims`: the mesh's own group for one
    dimension, a flattened submesh's for several (created once per mesh, on every rank)."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"{where}: {name} is sharded over mesh dimensions {tuple(dims)} of a "
                         "device mesh without dimension names; name them (init_device_mesh("
                         "..., mesh_dim_names=...)) so that their ranks can form one group")
    sub = mesh[tuple(names[i] for i in dims)] if len(dims) < mesh.ndim else mesh
    return sub._flatten().get_group()


@torch.compiler.assume_constant_result
def _blocks(mesh, placements, shape, dim, dims):
    """The mesh coordinates of this rank's group (over mesh dimensions `dims`, row-major), the
    (first class, count) block along `dim` held at each, and this rank's block: Python integers
    from the mesh and the placements alone, which torch.compile takes as constants of the graph
    (they are this process's, and a process keeps its place in the mesh)."""
    import itertools

    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    me = tuple(mesh.get_coordinate())
    coordinates, blocks = [], []
    for sub in itertools.product(*(range(mesh.size(i)) for i in dims)):
        coordinate = list(me)
        for i, c in zip(dims, sub):
            coordinate[i] = c
        local, offset = _compute_local_shape_and_global_offset(shape, tuple(mesh.shape),
                                                               coordinate, placements)
        coordinates.append(tuple(coordinate))
        blocks.append((int(offset[dim]), int(local[dim])))
    start, count = blocks[coordinates.index(me)]
    return tuple(coordinates), tuple(blocks), start, count


def _tiles(blocks, total):
    """Whether the (first class, count) blocks, each of at least one class, tile [0, total):
    followed from 0, each block starting where the previous one ends (plain loops: torch.compile
    runs them while tracing)."""
    end, left = 0, list(blocks)
    while left:
        i = 0
        while i < len(left) and not (left[i][0] == end and left[i][1] >= 1):
            i += 1
        if i == len(left):
            return False
        end += left.pop(i)[1]
    return end == total


def _vocab_layout(value, dim, name, where, what):
    """The _Layout of the DTensor `value` sharded on class dimension `dim`, or None when every
    mesh dimension replicates it. Every block of this rank's group is computed here from the
    mesh and the placements alone (no communication): each must be a contiguous run of at least
    one class and the runs must tile [0, V), else ValueError naming `name` (the same on every
    rank, before any collective)."""
    dims = _sharded_mesh_dims(value, dim, name, where, what)
    if not dims:
        return None
    mesh, total = value.device_mesh, value.shape[dim]
    coordinates, blocks, start, count = _blocks(mesh, tuple(value.placements), tuple(value.shape),
                                                dim, tuple(dims))
    if not _tiles(blocks, total):
        raise ValueError(
            f"{where}: {name} ({_describe(value)}, {total} classes) must hold a contiguous block "
            "of at least one class on every rank, and torch's split gives "
            f"{list(blocks)} (first class, count) at mesh coordinates {list(coordinates)}; shard "
            "a vocabulary of at least one class per rank on plain Shard placements (FSDP2's "
            "strided shard only together with the shard it splits)")
    group = _vocab_group(mesh, dims, name, where)
    # The order of the blocks among the group's ranks, for the gather's check of the layout (an
    # eager check: torch.compile leaves it out, and the merge does not depend on the order).
    order = None if torch.compiler.is_compiling() else _block_order(mesh, group, coordinates, blocks)
    return _Layout(group, start, count, total, order)


def _block_order(mesh, group, coordinates, blocks):
    """The group's ranks (their indices in the group) in the order their blocks run through the
    vocabulary; None when that is rank order."""
    import torch.distributed as dist

    ranks = mesh.mesh.tolist()
    at = {functools.reduce(lambda row, c: row[c], coordinate, ranks): block
          for coordinate, block in zip(coordinates, blocks)}
    members = dist.get_process_group_ranks(group)
    order = tuple(sorted(range(len(members)), key=lambda r: at[members[r]][0]))
    return None if order == tuple(range(len(order))) else order


# ---- linear cross-entropy: weight sharded on dim 0 -------------------------------------------


def linear_cross_entropy(run, hidden, weight, target, bias, class_weight, parallel):
    """``run`` (fusedce.linear_cross_entropy's call on plain tensors) on the local tensors of a
    DTensor head: the vocabulary-parallel form for a weight sharded on dim 0 over one or more
    mesh dimensions (over the group of those dimensions), the single-device call for a
    replicated one. parallel: the VocabParallel the caller passed (refused unless empty)."""
    where = "fusedce.linear_cross_entropy"
    if not is_dtensor(weight):
        which = next(n for n, v in (("hidden", hidden), ("target", target), ("bias", bias),
                                    ("class_weight", class_weight))
                     if is_dtensor(v))
        raise ValueError(f"{where}: {which} is a DTensor but weight is {_describe(weight)}; "
                         "a DTensor head is a weight sharded on dim 0 (Shard(0), as "
                         "ColwiseParallel shards an lm_head) or replicated")
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight must have shape (V, H), got {tuple(weight.shape)}")
    layout = _vocab_layout(weight, 0, "weight", where,
                           "sharded on dim 0 (Shard(0): the vocabulary, as ColwiseParallel "
                           "shards an lm_head)")
    local = functools.partial(_linear_local, run, hidden, weight, target, bias, class_weight, parallel,
                              layout, where)
    if layout is None:
        return local(parallel)
    return _agreed(where, layout, "DTensor weight", target, weight.to_local().device, local)


def _linear_local(run, hidden, weight, target, bias, class_weight, given, layout, where, parallel):
    """run on the local tensors: vocabulary-parallel over `layout` (with `parallel`, its spec), or
    (layout None: a replicated head) the single-device call."""
    _refuse_layout_keywords(given, where, "weight")
    mesh = weight.device_mesh
    h = _replicated_local(hidden, "hidden", mesh, where)
    t = _replicated_local(target, "target", mesh, where)
    if bias is not None:
        if not is_dtensor(bias) or tuple(bias.placements) != tuple(weight.placements):
            raise ValueError(f"{where}: bias must be a DTensor placed as weight's rows "
                             f"({tuple(weight.placements)}), got {_describe(bias)}")
        _same_mesh(bias, "bias", mesh, where)
        bias = bias.to_local()
    cw = _class_weight_local(class_weight, "class_weight", layout, weight, "weight", weight.shape[0], mesh,
                             where)
    return run(h, weight.to_local(), t, bias, cw, parallel)


# ---- cross-entropy over logits sharded on the class dimension ----------------------------------


def cross_entropy(run, logits, target, weight, parallel):
    """``run`` (fusedce.cross_entropy's call on plain tensors) on the local tensors of DTensor
    logits: the vocabulary-parallel form for logits sharded on their class dimension over one
    or more mesh dimensions, the single-device call for replicated logits. parallel: the
    VocabParallel the caller passed (refused unless empty)."""
    where = "fusedce.cross_entropy"
    if not is_dtensor(logits):
        which = "target" if is_dtensor(target) else "weight"
        raise ValueError(f"{where}: {which} is a DTensor but logits are {_describe(logits)}; "
                         "DTensor logits are sharded on their class dimension (the loss_parallel "
                         "convention) or replicated")
    mesh = logits.device_mesh
    class_dim = _class_dim(logits, target, _sharded_tensor_dim(logits, where), where)
    if class_dim is not None:
        layout = _vocab_layout(logits, class_dim, "logits", where, "sharded on their class "
                               "dimension (the last, or dim 1 of (N, C, d1, ...))")
        body = functools.partial(_ce_sharded, run, logits, target, weight, parallel, mesh, class_dim, layout,
                                 where)
        return _agreed(where, layout, "DTensor logits (the vocabulary-parallel form)", target,
                       logits.to_local().device, body)
    if _replicated(logits):
        _refuse_layout_keywords(parallel, where, "logits")
        w = _class_weight_local(weight, "weight", None, logits, "logits",
                                logits.shape[_classes(logits, target)], mesh, where)
        return run(logits.to_local(), _replicated_local(target, "target", mesh, where), w, parallel)
    raise ValueError(f"{where}: logits must be sharded on their class dimension (the last, or dim 1 "
                     f"of (N, C, d1, ...)) or replicated, got {_describe(logits)} of shape "
                     f"{tuple(logits.shape)}")


def _sharded_tensor_dim(logits, where):
    """The one tensor dimension the placements of `logits` shard (None when none does); logits
    sharded on two dimensions (rows over one mesh dimension, classes over another) are refused:
    the loss of the whole batch would need a reduction over the rows' mesh dimension."""
    from torch.distributed.tensor import Shard

    dims = {p.dim % logits.dim() for p in logits.placements
            if type(p) is Shard or _is_strided(p)}
    if len(dims) > 1:
        raise ValueError(f"{where}: logits must be sharded on their class dimension alone (the "
                         "vocabulary-parallel form needs every row on every rank of the "
                         f"vocabulary's group), got {_describe(logits)} of shape "
                         f"{tuple(logits.shape)}")
    return dims.pop() if dims else None


def _classes(logits, target):
    """The class dimension of replicated logits, as fusedce.cross_entropy reads it (its own
    checks name any mismatch)."""
    if isinstance(target, torch.Tensor) and logits.dim() >= 3 \
            and tuple(target.shape) == (logits.shape[0], *logits.shape[2:]) \
            and tuple(target.shape) != tuple(logits.shape[:-1]):
        return 1
    return -1


def _class_dim(logits, target, shard_dim, where):
    """The class dimension of logits sharded on `shard_dim` (None when not sharded): the
    sharding says which layout is meant, the target's shape must fit it."""
    if shard_dim is None:
        return None
    ndim = logits.dim()
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{where}: target must be a tensor, got {type(target).__name__}")
    if target.is_floating_point():
        raise ValueError(f"{where}: class-probability targets are not available with DTensor "
                         "logits (the vocabulary-parallel form takes class indices)")
    if shard_dim == ndim - 1 and tuple(target.shape) == tuple(logits.shape[:-1]):
        return shard_dim
    if shard_dim == 1 and ndim >= 3 and tuple(target.shape) == (logits.shape[0], *logits.shape[2:]):
        return 1
    if shard_dim not in (ndim - 1, 1):
        return None
    raise ValueError(f"{where}: target must have shape logits.shape[:-1] = "
                     f"{tuple(logits.shape[:-1])} for logits sharded on their last dimension "
                     "(or (N, d1, ...) for logits sharded on dim 1 of (N, C, d1, ...)), got "
                     f"{tuple(target.shape)}")


def _ce_sharded(run, logits, target, weight, given, mesh, class_dim, layout, where, parallel):
    _refuse_layout_keywords(given, where, "logits")
    t = _replicated_local(target, "target", mesh, where)
    x = logits.to_local()
    v_local = x.shape[class_dim]
    w = _class_weight_local(weight, "weight", layout, logits, "logits", layout.total, mesh, where)
    # Rows of classes: (rows, V_local) with (rows,) targets, a layout no local shape makes
    # ambiguous (fusedce.cross_entropy reads the class dimension from the shapes).
    if class_dim != x.dim() - 1:
        x = x.movedim(class_dim, -1)
    out = run(x.reshape(-1, v_local), t.reshape(-1), w, parallel)
    loss = out[0] if isinstance(out, tuple) else out
    if loss.dim() == 1:  # reduction='none': the loss of each of target's entries
        loss = loss.view(target.shape)
    return (loss, out[1]) if isinstance(out, tuple) else loss


# ---- the other linear heads: log-probabilities and distillation, weight sharded on dim 0 -------
#
# The same rules as linear_cross_entropy's: a head (the student's, for distillation) sharded on
# dim 0 runs the function's vocabulary-parallel form over the group of the mesh dimensions that
# shard it, a replicated head the single-device call; the other inputs are plain tensors or
# Replicate() DTensors (the same on every rank). A bias that gets a gradient is a DTensor placed
# as its head; the distillation teacher's head and bias (no gradient) may also be plain tensors
# of the whole vocabulary, of which each rank reads its rows. Logits (fusedce.logprobs) are
# sharded on their last dimension. Results are plain tensors, the same bits on every rank.

_HEAD_PLACEMENT = "sharded on dim 0 (Shard(0): the vocabulary, as ColwiseParallel shards an lm_head)"


def _head_layout(weight, name, where, others):
    """The _Layout of the DTensor head `weight` (None: replicated). ValueError when one of
    `others` ((name, value) pairs) is a DTensor but the head is not, or the head is not (V, H)."""
    if not is_dtensor(weight):
        which = next(n for n, v in others if is_dtensor(v))
        raise ValueError(f"{where}: {which} is a DTensor but {name} is {_describe(weight)}; a DTensor head "
                         f"is a {name} {_HEAD_PLACEMENT} or replicated")
    if weight.dim() != 2:
        raise ValueError(f"{where}: {name} must have shape (V, H), got {tuple(weight.shape)}")
    return _vocab_layout(weight, 0, name, where, _HEAD_PLACEMENT)


def _rows_of_head(value, name, head, head_name, layout, mesh, where, plain_ok):
    """This rank's rows of a tensor that goes with the head `head` (its bias, or a second head
    over the same vocabulary): a DTensor placed as the head (its local tensor), or, where
    `plain_ok` (a tensor that gets no gradient: the teacher's), a plain tensor of the full
    vocabulary on dim 0 (sliced to this rank's rows; whole for a replicated head). A plain
    tensor that gets a gradient is refused with a sharded head: each rank would see the gradient
    of its own rows only."""
    if value is None:
        return None
    alternative = " or a plain tensor of the full vocabulary" if plain_ok else ""
    if is_dtensor(value):
        if tuple(value.placements) != tuple(head.placements) or value.shape[0] != head.shape[0]:
            raise ValueError(f"{where}: {name} must be a DTensor placed as {head_name} "
                             f"({tuple(head.placements)}, {head.shape[0]} rows){alternative}, got "
                             f"{_describe(value)} of shape {tuple(value.shape)}")
        _same_mesh(value, name, mesh, where)
        return value.to_local()
    if not plain_ok:
        raise ValueError(f"{where}: {name} must be a DTensor placed as {head_name} ({tuple(head.placements)}), "
                         f"got {_describe(value)}")
    if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] != head.shape[0]:
        raise ValueError(f"{where}: {name} must have {head_name}'s {head.shape[0]} rows (the full vocabulary) "
                         f"or be a DTensor placed as {head_name}, got {getattr(value, 'shape', type(value).__name__)}")
    return value if layout is None else value[layout.start:layout.start + layout.count]


def _head_call(where, head, head_name, given, target, layout, body):
    """body(parallel) on the local tensors: under the agreement of the vocabulary's group with
    the VocabParallel of `layout`, or at once with the caller's (empty) one for a replicated
    head; `given` (the keywords' VocabParallel) is refused unless empty."""
    def local(parallel):
        _refuse_layout_keywords(given, where, head_name)
        return body(parallel)

    if layout is None:
        return local(given)
    return _agreed(where, layout, f"DTensor {head_name}", target, head.to_local().device, local)


def linear_logprobs(run, hidden, weight, tokens, bias, parallel):
    """``run`` (fusedce.linear_logprobs on plain tensors) on the local tensors of a DTensor head:
    the vocabulary-parallel form for a weight sharded on dim 0, the single-device call for a
    replicated one. hidden and tokens: plain tensors or Replicate() DTensors on the mesh; bias a
    DTensor placed as the weight."""
    where = "fusedce.linear_logprobs"
    layout = _head_layout(weight, "weight", where, (("hidden", hidden), ("tokens", tokens), ("bias", bias)))
    mesh = weight.device_mesh

    def body(p):
        return run(_replicated_local(hidden, "hidden", mesh, where), weight.to_local(),
                   _replicated_local(tokens, "tokens", mesh, where),
                   _rows_of_head(bias, "bias", weight, "weight", layout, mesh, where, plain_ok=False), p)

    return _head_call(where, weight, "weight", parallel, tokens, layout, body)


def logprobs(run, logits, tokens, parallel):
    """``run`` (fusedce.logprobs on plain tensors) on the local tensors of DTensor logits sharded
    on their last dimension (the vocabulary; the loss_parallel convention), or replicated.
    tokens: a plain tensor or a Replicate() DTensor."""
    where = "fusedce.logprobs"
    if not is_dtensor(logits):
        raise ValueError(f"{where}: tokens is a DTensor but logits is {_describe(logits)}; DTensor logits "
                         "are sharded on their last dimension (the vocabulary) or replicated")
    if logits.dim() < 1:
        raise ValueError(f"{where}: logits must have shape (..., V), got {tuple(logits.shape)}")
    layout = _vocab_layout(logits, logits.dim() - 1, "logits", where,
                           "sharded on its last dimension (the vocabulary)")
    mesh = logits.device_mesh

    def body(p):
        return run(logits.to_local(), _replicated_local(tokens, "tokens", mesh, where), p)

    return _head_call(where, logits, "logits", parallel, tokens, layout, body)


def linear_distillation(run, student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                        student_bias, teacher_bias, parallel):
    """``run`` (fusedce.linear_distillation on plain tensors) on the local tensors of a DTensor
    student head sharded on dim 0 (or replicated). The teacher's head: a DTensor placed as the
    student's, or a plain (V, H_t) tensor of the whole vocabulary (each rank uses its rows), its
    bias placed likewise; the student's bias a DTensor placed as its head; the hidden states and
    labels plain or Replicate()."""
    where = "fusedce.linear_distillation"
    layout = _head_layout(student_weight, "student_weight", where,
                          (("student_hidden", student_hidden), ("teacher_hidden", teacher_hidden),
                           ("teacher_weight", teacher_weight), ("labels", labels),
                           ("student_bias", student_bias), ("teacher_bias", teacher_bias)))
    mesh = student_weight.device_mesh

    def body(p):
        tw = _rows_of_head(teacher_weight, "teacher_weight", student_weight, "student_weight", layout, mesh, where,
                           plain_ok=True)
        tb_head = teacher_weight if is_dtensor(teacher_weight) else student_weight
        tb = _rows_of_head(teacher_bias, "teacher_bias", tb_head, "teacher_weight" if is_dtensor(teacher_weight)
                           else "student_weight", layout, mesh, where, plain_ok=True)
        return run(_replicated_local(student_hidden, "student_hidden", mesh, where), student_weight.to_local(),
                   _replicated_local(teacher_hidden, "teacher_hidden", mesh, where), tw,
                   _replicated_local(labels, "labels", mesh, where, optional=True),
                   _rows_of_head(student_bias, "student_bias", student_weight, "student_weight", layout, mesh, where,
                                 plain_ok=False),
                   tb, p)

    return _head_call(where, student_weight, "student_weight", parallel, _rows_target(student_hidden), layout, body)


def linear_distillation_topk(run, student_hidden, student_weight, teacher_ids, teacher_logprobs, labels,
                             student_bias, parallel):
    """``run`` (fusedce.linear_distillation_topk on plain tensors) on the local tensors of a
    DTensor student head sharded on dim 0 (or replicated); its bias a DTensor placed as the head;
    the hidden states, the teacher's top-k (global ids) and the labels plain or Replicate()."""
    where = "fusedce.linear_distillation_topk"
    layout = _head_layout(student_weight, "student_weight", where,
                          (("student_hidden", student_hidden), ("teacher_ids", teacher_ids),
                           ("teacher_logprobs", teacher_logprobs), ("labels", labels),
                           ("student_bias", student_bias)))
    mesh = student_weight.device_mesh

    def body(p):
        return run(_replicated_local(student_hidden, "student_hidden", mesh, where), student_weight.to_local(),
                   _replicated_local(teacher_ids, "teacher_ids", mesh, where),
                   _replicated_local(teacher_logprobs, "teacher_logprobs", mesh, where),
                   _replicated_local(labels, "labels", mesh, where, optional=True),
                   _rows_of_head(student_bias, "student_bias", student_weight, "student_weight", layout, mesh, where,
                                 plain_ok=False),
                   p)

    return _head_call(where, student_weight, "student_weight", parallel, _rows_target(student_hidden), layout, body)


def _rows_target(hidden):
    """What the agreement needs of a distillation call (a tensor with every rank's row count):
    hidden's leading entries (a DTensor's global shape, the same on every rank)."""
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        return torch.empty(hidden.shape[:-1], dtype=torch.int64, device="meta")
    return None
