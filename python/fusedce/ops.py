"""Fake (meta) kernels and autograd formulas for the ce_* ops of torch/registry.h.

The ops themselves (schemas, CPU and CUDA kernels) live in the C++ extension; this module only
tells torch.compile the shapes of their outputs and tells autograd how to differentiate them.
Nothing here computes anything: gradients come from the core, formed during the forward sweep
(``ce_fwd_bwd``, ``ce_fwd_bwd_``), and are scaled by the upstream gradient with ``ce_rescale_``.

Argument order shared by every op (see torch/registry.h): logits (N, V), target (N,),
class_weight (V,) or None, the options (Options.op_args(): ignore_index, reduction,
label_smoothing, logit_scale, softcap (0 = off), z_loss), return_metrics. The fake kernels take
the options as one Options.

Where each op's autograd lives (docs/architecture.md, "Autograd"): ``ce_fwd_bwd``'s formula is
registered here, beside its fake kernel; ``ce_loss``'s is C++ (torch/autograd.h), for host time;
``ce_fwd_bwd_`` writes over its input, which torch.library.register_autograd does not take, so
fusedce.cross_entropy's in-place path is the autograd.Function ``InplaceCrossEntropy`` below.
"""

import torch

from . import _library
from ._options import register_fake

ops = _library.ops()

# Arguments of ce_fwd_bwd: logits, target, class_weight, the options, return_metrics.
_NUM_ARGS_FWD_BWD = len(ops.ce_fwd_bwd.default._schema.arguments)

_below_autograd = getattr(torch._C, "_AutoDispatchBelowAutograd", None)


def call_below_autograd(overload, *args):
    """``overload(*args)`` past the autograd dispatch key, for a call that builds no graph: no
    input requires grad, or it runs inside an autograd.Function's forward. The ops' autograd
    kernels (register_autograd below) are Python and cost host time on every call, graph or
    not, which is what a small GPU problem waits for (docs/performance.md, "Host time").
    Traced under torch.compile, the plain call (a context manager there is a graph break, and
    the trace has no autograd cost)."""
    if _below_autograd is None or torch.compiler.is_compiling():
        return overload(*args)
    with _below_autograd():
        return overload(*args)


def _loss_shape(logits, reduction):
    return (logits.shape[0],) if reduction == "none" else ()


def _empty_outputs(logits, reduction, return_metrics):
    """loss, lse, num_correct, entropy_sum as the functional ops allocate them (torch/ops.h)."""
    n = logits.shape[0]
    metrics_shape = () if return_metrics else (0,)
    return (
        logits.new_empty(_loss_shape(logits, reduction), dtype=torch.float32),
        logits.new_empty((n,), dtype=torch.float32),
        logits.new_empty(metrics_shape, dtype=torch.int64),
        logits.new_empty(metrics_shape, dtype=torch.float32),
    )


def _check_fake_inputs(logits, target):
    torch._check(logits.dim() == 2, lambda: f"fusedce: logits must be 2-D (rows, V), got {logits.dim()}-D")
    torch._check(
        target.dim() == 1 and target.shape[0] == logits.shape[0],
        lambda: f"fusedce: target must be 1-D with one entry per row of logits ({logits.shape[0]})",
    )


# ---- fake kernels: shapes and dtypes only --------------------------------------------------


@register_fake("ce_loss")
def _ce_loss_fake(logits, target, class_weight, options, return_metrics):
    _check_fake_inputs(logits, target)
    return _empty_outputs(logits, options.reduction, return_metrics)


@register_fake("ce_fwd_bwd")
def _ce_fwd_bwd_fake(logits, target, class_weight, options, return_metrics):
    _check_fake_inputs(logits, target)
    return (*_empty_outputs(logits, options.reduction, return_metrics), logits.new_empty(logits.shape))


@register_fake("ce_fwd_bwd_")
def _ce_fwd_bwd_inplace_fake(logits, target, class_weight, options, return_metrics):
    _check_fake_inputs(logits, target)
    return _empty_outputs(logits, options.reduction, return_metrics)


@torch.library.register_fake(_library.qualified("ce_rescale_"))
def _ce_rescale_fake(grad_loss, dlogits):
    torch._check(dlogits.dim() == 2, lambda: "fusedce: dlogits must be 2-D (rows, V)")


# ---- autograd ------------------------------------------------------------------------------


def _graph_is_kept():
    """True when the running backward keeps its graph (retain_graph=True), so a saved tensor may
    be read again by a later backward and must not be overwritten."""
    if torch.compiler.is_compiling():
        return False  # traced: the graph is functionalised, in-place ops are rewritten
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)  # torch >= 2.5
    return bool(keep()) if keep is not None else True  # unknown: assume kept, copy to be safe


def _upstream(grad_loss):
    # float32 and with a real stride: `loss.sum().backward()` hands 'none' an expanded (stride 0)
    # gradient, which the core does not take.
    return grad_loss.to(torch.float32).contiguous()


def _setup_ce_fwd_bwd(ctx, inputs, output):
    loss, lse, num_correct, entropy_sum, dlogits = output
    ctx.save_for_backward(dlogits)
    # Only the loss is differentiable; no zero gradients are materialised for the other outputs
    # (dlogits is as large as the logits).
    ctx.mark_non_differentiable(lse, num_correct, entropy_sum, dlogits)
    ctx.set_materialize_grads(False)


def _backward_ce_fwd_bwd(ctx, grad_loss, *unused):
    # The op returned dlogits to its caller, so its formula scales a copy. fusedce.cross_entropy
    # does not go through here: ce_loss keeps dlogits private and scales it in place.
    grad = None
    if grad_loss is not None and ctx.needs_input_grad[0]:
        (dlogits,) = ctx.saved_tensors
        grad = dlogits.clone()
        ops.ce_rescale_(_upstream(grad_loss), grad)
    return (grad, *(None,) * (_NUM_ARGS_FWD_BWD - 1))  # nothing for the op's other arguments


torch.library.register_autograd(_library.qualified("ce_fwd_bwd"), _backward_ce_fwd_bwd,
                                setup_context=_setup_ce_fwd_bwd)


class InplaceWrite:
    """What ``InplaceCrossEntropy`` and ``Overwritten`` share about logits overwritten
    with their gradient: their version counter once autograd has been told of the write
    (``mark_dirty`` bumps it), which the loss's backward expects to find unchanged."""

    __slots__ = ("version",)

    def __init__(self):
        self.version = None


class InplaceCrossEntropy(torch.autograd.Function):
    """fusedce.cross_entropy(inplace_backward=True): one sweep forms the loss and writes the
    gradient for an upstream gradient of 1 over the logits (``ce_fwd_bwd_``); the backward scales
    it in place by the upstream gradient (``ce_rescale_``: rows whose factor is 1 are not
    touched) and hands it on. Only when the graph is kept for another backward is a copy scaled
    instead.

    An autograd.Function rather than a formula registered with the op: the op mutates a
    differentiable input, which torch.library.register_autograd does not take and a compiled
    graph cannot differentiate; fusedce.cross_entropy uses it in eager mode only.

    The caller follows this function with ``Overwritten.apply(logits)`` so that autograd knows of
    the mutation: this function cannot mark the logits dirty itself, because a function that
    mutates a view (the usual case: (B, S, V) logits viewed as (N, V)) may return only one
    tensor. Marking them dirty bumps their version, so the logits are kept on ctx rather than
    through save_for_backward, and the backward checks their version against the one recorded in
    ``write`` (an InplaceWrite) after the marking: any later in-place change of the gradient they
    hold is refused as autograd refuses it for saved tensors.

    Arguments: logits, target, class_weight, the call (a Call: its options and return_metrics),
    write (an InplaceWrite). Returns loss, lse, num_correct, entropy_sum (only the loss is
    differentiable).
    """

    @staticmethod
    def forward(ctx, logits, target, class_weight, call, write):
        ctx.write = write
        loss, lse, num_correct, entropy_sum = call_below_autograd(
            ops.ce_fwd_bwd_.default, logits, target, class_weight, *call.options.op_args(), call.return_metrics)
        ctx.dlogits = logits  # now holds the gradient
        ctx.mark_non_differentiable(lse, num_correct, entropy_sum)
        ctx.set_materialize_grads(False)
        return loss, lse, num_correct, entropy_sum

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad = None
        if grad_loss is not None and ctx.needs_input_grad[0]:
            kept = _graph_is_kept()
            dlogits = ctx.dlogits
            if dlogits is None:
                raise RuntimeError("fusedce.cross_entropy: trying to backward through the graph "
                                   "a second time; specify retain_graph=True the first time")
            if dlogits._version != ctx.write.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: the {list(dlogits.shape)} logits that "
                    "fusedce.cross_entropy(inplace_backward=True) overwrote with their "
                    f"gradient are at version {dlogits._version}; expected version "
                    f"{ctx.write.version} instead")
            if kept:
                dlogits = dlogits.clone()
            else:
                ctx.dlogits = None  # as save_for_backward frees a saved tensor
            ops.ce_rescale_(_upstream(grad_loss), dlogits)
            grad = dlogits
        return grad, None, None, None, None  # nothing for target, class_weight, call, write


class Overwritten(torch.autograd.Function):
    """Marks logits that ``InplaceCrossEntropy`` has just overwritten with their
    gradient as modified in place (``ctx.mark_dirty``), so that autograd treats them as any
    in-place op's output: their history becomes this function, whose backward raises, because
    the values they now hold (the gradient of the loss) are not differentiable here; a view's
    base is rebased as for any in-place op on a view. Nothing is computed. The caller records
    the version the logits have after this (``InplaceWrite.version``) for the loss's backward."""

    @staticmethod
    def check(logits, where):
        """Refuse, before any work, what autograd would refuse after the overwrite: an in-place
        change of a leaf that requires grad, or of a view of one."""
        base = logits._base if logits._is_view() else None
        if (logits.is_leaf and logits.requires_grad) or (
                base is not None and base.is_leaf and base.requires_grad):
            raise ValueError(
                f"{where}: inplace_backward=True would overwrite a leaf tensor that requires grad"
                f"{' (through a view of it)' if base is not None else ''}, which autograd forbids "
                "for in-place operations; pass inplace_backward=False, or logits computed from "
                "the leaf")

    @staticmethod
    def forward(ctx, logits):
        ctx.mark_dirty(logits)
        return logits

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "fusedce.cross_entropy: a gradient reached logits that inplace_backward=True "
            "overwrote with the loss's gradient; what they hold now cannot be differentiated. "
            "Pass inplace_backward=False when the logits are used after the loss")
