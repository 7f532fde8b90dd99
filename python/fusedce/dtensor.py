"""DTensor inputs of fusedce.cross_entropy and fusedce.linear_cross_entropy: tensors sharded as
PyTorch's tensor parallelism hands them over, run through the vocabulary-parallel form of
:mod:`fusedce.distributed` with the group, the column start and the vocabulary size read from
the DTensors themselves.

* ``linear_cross_entropy(hidden, weight, target, bias)`` with ``weight`` a DTensor sharded on
  dim 0 (``Shard(0)``) over a 1-D device mesh: an ``lm_head`` under ``ColwiseParallel``.
  ``bias`` (if given) must be placed as ``weight``; ``hidden`` and ``target`` are plain tensors
  (the same on every rank) or ``Replicate()`` DTensors on the same mesh.
* ``cross_entropy(logits, target, weight)`` with ``logits`` a DTensor sharded on its class
  dimension (the last, or dim 1 of PyTorch's ``(N, C, d1, ...)`` layout): the ``loss_parallel``
  convention (``ColwiseParallel(use_local_output=False)`` logits).
* Class weights (``weight=`` / ``class_weight=``): a DTensor placed as the sharded input on the
  class dimension, a ``Replicate()`` DTensor, or a plain full ``(V,)`` tensor; each rank uses its
  slice.

A replicated head (``Replicate()`` weight or logits) runs the single-device call on every rank
(nothing crosses ranks).

Layout: ``vocab_total`` is the DTensor's global size on the class dimension and ``vocab_start``
this rank's offset in it (torch's own computation of the shard's offset, so torch's uneven
``Shard`` split, ``ceil(V / R)`` rows on the first ranks, is followed as it is). Every rank must
hold at least one class: a vocabulary that torch's split leaves a rank without any is refused.
``process_group``, ``vocab_start`` and ``vocab_total`` come from the DTensor and are refused when
passed.

Results: the loss (and metrics) are plain tensors, the same bits on every rank, those of the
whole vocabulary; a plain tensor rather than a ``Replicate()`` DTensor because it is what the
rest of a training step mixes it with (a division by a token count, an auxiliary loss, logging),
which a DTensor would refuse. Gradients reach the DTensor inputs through ``to_local()``, so each
input's gradient is a DTensor with that input's placements (``weight.grad``: ``Shard(0)``, this
rank's rows of the full gradient; ``hidden.grad`` of a ``Replicate()`` hidden: the full gradient
on every rank).

What a DTensor call refuses (ValueError naming the argument): a mesh of more than one dimension,
placements other than those above (``Partial``, a shard on another dimension, the strided
shards of FSDP2 + TP before FSDP's unshard), inputs on different meshes, a plain ``bias`` or
``logits`` with a sharded head, class-probability targets, ``inplace_backward``. The sharded
calls run inside :func:`fusedce.distributed.agreed_call`, so an argument error found on one rank
is raised on every rank.
"""

import sys

import torch

from . import distributed

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


def _shard_dim(placement):
    """The dimension of a plain Shard placement (not a strided one), or None."""
    from torch.distributed.tensor import Shard

    return placement.dim if type(placement) is Shard else None


def _describe(value):
    if is_dtensor(value):
        return f"a DTensor with placements {tuple(value.placements)}"
    return type(value).__name__ if not isinstance(value, torch.Tensor) else "a plain tensor"


def _mesh_of(value, name, where):
    """The 1-D device mesh of the DTensor `value` (ValueError naming `name` otherwise)."""
    mesh = value.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"{where}: {name} is a DTensor on a {mesh.ndim}-D device mesh; the "
                         "vocabulary-parallel form takes a 1-D mesh (the tensor-parallel one, "
                         "e.g. mesh['tp'])")
    return mesh


def _same_mesh(value, name, mesh, where):
    if value.device_mesh != mesh:
        raise ValueError(f"{where}: {name} is a DTensor on another device mesh than the sharded "
                         f"input ({value.device_mesh} vs {mesh})")


def _replicated_local(value, name, mesh, where, optional=False):
    """A plain tensor as it is; a Replicate() DTensor on `mesh` as its local tensor (autograd
    follows to_local, so its gradient is a Replicate() DTensor); anything else refused."""
    if value is None and optional:
        return None
    if not is_dtensor(value):
        return value
    _same_mesh(value, name, mesh, where)
    if not value.placements[0].is_replicate():
        raise ValueError(f"{where}: {name} must be a plain tensor or a Replicate() DTensor (the "
                         f"same on every rank), got {_describe(value)}")
    return value.to_local()


def _class_weight_local(value, name, sharded, dim, v0, v_local, vocab, mesh, where):
    """This rank's slice (v_local,) of the class weights: from a DTensor placed as the sharded
    input, or sliced from a Replicate() DTensor or a plain full (V,) tensor. With `sharded`
    False (a replicated head), the whole vector."""
    if value is None:
        return None
    if is_dtensor(value):
        _same_mesh(value, name, mesh, where)
        placement = value.placements[0]
        if value.dim() != 1 or value.shape[0] != vocab:
            raise ValueError(f"{where}: {name} must have shape ({vocab},) (the vocabulary), got "
                             f"{tuple(value.shape)}")
        if sharded and _shard_dim(placement) == 0:
            return value.to_local()
        if not placement.is_replicate():
            raise ValueError(f"{where}: {name} must be a DTensor sharded as the "
                             f"{'weight' if dim is None else 'logits'} are (Shard(0)), a "
                             f"Replicate() DTensor or a plain ({vocab},) tensor, got "
                             f"{_describe(value)}")
        value = value.to_local()
    elif not isinstance(value, torch.Tensor) or value.shape != (vocab,):
        raise ValueError(f"{where}: {name} must be the full ({vocab},) vector of class weights "
                         f"(each rank uses its slice) or a DTensor, got "
                         f"{getattr(value, 'shape', type(value).__name__)}")
    return value[v0:v0 + v_local] if sharded else value


def _refuse_layout_keywords(options, where, what):
    for key in ("process_group", "vocab_start", "vocab_total"):
        if options.get(key) is not None:
            raise ValueError(f"{where}: {key} is read from the DTensor {what} (its device mesh and "
                             "sharding); it cannot be passed with it")


def _offset(value, dim):
    """This rank's offset along `dim` of the DTensor `value`: torch's own computation."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                      value.placements)
    return int(offset[dim])


def _agreed(where, mesh, target, device, body):
    """body() with its outcome agreed by the mesh's group (distributed.agreed_call): an error
    raised by one rank before the call's first collective is raised on every rank. The layout
    is passed explicitly by the bodies (vocab_start and vocab_total), so the agreement joins the
    one gather of the statistics."""
    group = mesh.get_group()
    return distributed.agreed_call(where, group, target, device, 0, 1, body)


def _agreement_target(target):
    """What agreed_call needs of the target: a tensor with every rank's number of entries (a
    DTensor's global numel is the same on every rank)."""
    return target if isinstance(target, torch.Tensor) else None


# ---- linear cross-entropy: weight sharded on dim 0 -------------------------------------------


def linear_cross_entropy(call, hidden, weight, target, bias, options):
    """``call`` (fusedce.linear_cross_entropy) on the local tensors of a DTensor head: the
    vocabulary-parallel form for a Shard(0) weight, the single-device call for a Replicate()
    one. options: every keyword of the call but bias."""
    where = "fusedce.linear_cross_entropy"
    if not is_dtensor(weight):
        which = next(n for n, v in (("hidden", hidden), ("target", target), ("bias", bias),
                                    ("class_weight", options.get("class_weight")))
                     if is_dtensor(v))
        raise ValueError(f"{where}: {which} is a DTensor but weight is {_describe(weight)}; "
                         "a DTensor head is a weight sharded on dim 0 (Shard(0), as "
                         "ColwiseParallel shards an lm_head) or replicated")
    mesh = _mesh_of(weight, "weight", where)
    placement = weight.placements[0]
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight must have shape (V, H), got {tuple(weight.shape)}")
    if _shard_dim(placement) == 0:
        body = lambda: _linear_sharded(call, hidden, weight, target, bias, options, mesh, where)  # noqa: E731
        return _agreed(where, mesh, _agreement_target(target), weight.to_local().device, body)
    if placement.is_replicate():
        return _linear_replicated(call, hidden, weight, target, bias, options, mesh, where)
    raise ValueError(f"{where}: weight must be sharded on dim 0 (Shard(0): the vocabulary, as "
                     "ColwiseParallel shards an lm_head) or replicated, got "
                     f"{_describe(weight)}")


def _linear_locals(hidden, target, bias, weight, mesh, where):
    h = _replicated_local(hidden, "hidden", mesh, where)
    t = _replicated_local(target, "target", mesh, where)
    if bias is not None:
        if not is_dtensor(bias) or tuple(bias.placements) != tuple(weight.placements):
            raise ValueError(f"{where}: bias must be a DTensor placed as weight's rows "
                             f"({tuple(weight.placements)}), got {_describe(bias)}")
        _same_mesh(bias, "bias", mesh, where)
        bias = bias.to_local()
    return h, t, bias


def _linear_sharded(call, hidden, weight, target, bias, options, mesh, where):
    _refuse_layout_keywords(options, where, "weight")
    h, t, b = _linear_locals(hidden, target, bias, weight, mesh, where)
    w = weight.to_local()
    vocab, v_local = weight.shape[0], w.shape[0]
    v0 = _offset(weight, 0)
    cw = _class_weight_local(options.get("class_weight"), "class_weight", True, None, v0, v_local,
                             vocab, mesh, where)
    kwargs = dict(options, class_weight=cw, process_group=mesh.get_group(), vocab_start=v0,
                  vocab_total=vocab)
    return call(h, w, t, b, **kwargs)


def _linear_replicated(call, hidden, weight, target, bias, options, mesh, where):
    _refuse_layout_keywords(options, where, "weight")
    h, t, b = _linear_locals(hidden, target, bias, weight, mesh, where)
    cw = _class_weight_local(options.get("class_weight"), "class_weight", False, None, 0,
                             weight.shape[0], weight.shape[0], mesh, where)
    return call(h, weight.to_local(), t, b, **dict(options, class_weight=cw))


# ---- cross-entropy over logits sharded on the class dimension ----------------------------------


def cross_entropy(call, logits, target, weight, options):
    """``call`` (fusedce.cross_entropy) on the local tensors of DTensor logits: the
    vocabulary-parallel form for logits sharded on their class dimension, the single-device
    call for Replicate() logits. options: every keyword of the call."""
    where = "fusedce.cross_entropy"
    if not is_dtensor(logits):
        which = "target" if is_dtensor(target) else "weight"
        raise ValueError(f"{where}: {which} is a DTensor but logits are {_describe(logits)}; "
                         "DTensor logits are sharded on their class dimension (the loss_parallel "
                         "convention) or replicated")
    mesh = _mesh_of(logits, "logits", where)
    placement = logits.placements[0]
    class_dim = _class_dim(logits, target, _shard_dim(placement), where)
    if class_dim is not None:
        body = lambda: _ce_sharded(call, logits, target, weight, options, mesh, class_dim, where)  # noqa: E731
        return _agreed(where, mesh, _agreement_target(target), logits.to_local().device, body)
    if placement.is_replicate():
        _refuse_layout_keywords(options, where, "logits")
        w = _class_weight_local(weight, "weight", False, -1, 0, 0, logits.shape[_classes(logits, target)],
                                mesh, where)
        return call(logits.to_local(), _replicated_local(target, "target", mesh, where), w,
                    **options)
    raise ValueError(f"{where}: logits must be sharded on their class dimension (the last, or dim 1 "
                     f"of (N, C, d1, ...)) or replicated, got {_describe(logits)} of shape "
                     f"{tuple(logits.shape)}")


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


def _ce_sharded(call, logits, target, weight, options, mesh, class_dim, where):
    _refuse_layout_keywords(options, where, "logits")
    if options.get("inplace_backward"):
        raise ValueError(f"{where}: inplace_backward is not available with DTensor logits "
                         "(the vocabulary-parallel form)")
    t = _replicated_local(target, "target", mesh, where)
    x = logits.to_local()
    vocab, v_local = logits.shape[class_dim], x.shape[class_dim]
    v0 = _offset(logits, class_dim)
    w = _class_weight_local(weight, "weight", True, class_dim, v0, v_local, vocab, mesh, where)
    # Rows of classes: (rows, V_local) with (rows,) targets, a layout no local shape makes
    # ambiguous (fusedce.cross_entropy reads the class dimension from the shapes).
    if class_dim != x.dim() - 1:
        x = x.movedim(class_dim, -1)
    rows = x.reshape(-1, v_local)
    out = call(rows, t.reshape(-1), w, **dict(options, process_group=mesh.get_group(),
                                                 vocab_start=v0, vocab_total=vocab))
    if options.get("reduction", "mean") != "none":
        return out
    if isinstance(out, tuple):
        return out[0].view(target.shape), out[1]
    return out.view(target.shape)
