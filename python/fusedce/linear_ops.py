"""Fake (meta) kernels and autograd formulas for the fused linear cross-entropy ops of
torch/registry.h (``lce_fwd``, ``lce_fwd_bwd``), and the autograd Function behind
:func:`fusedce.linear_cross_entropy`.

As in ops.py, nothing here computes anything: the loss and every gradient come from the core.
When the inputs require grad, the core forms the gradients in the same pass as the loss (for an
upstream gradient of 1) and the backward only scales them with ``ce_rescale_``, which does no
work when the factor is 1. The one case that cannot work that way is reduction='none' with
weight or bias requiring grad: each row's upstream gradient weighs that row's contribution to
grad_weight differently, so the backward recomputes with the core's per-row ``grad_loss``.

Argument order shared by every lce op: hidden (N, H), weight (V, H), bias (V,) or None,
target (N,), class_weight (V,) or None, then the options (Options.op_args()) and the linear
options (LinearOptions.op_args(): shift_seq_len, chunk_budget_bytes, low_memory, skip_ignored);
the fake kernels and the autograd formulas take them as one Options and one LinearOptions.
"""

import torch

from . import _library
from ._options import linear_options_in, options_position, register_fake
from .ops import _graph_is_kept, _upstream, call_below_autograd, ops

# Where the options start (after hidden, weight, bias, target, class_weight), and the number of
# arguments of lce_fwd and lce_fwd_bwd (one gradient each in their autograd formulas).
_OPTIONS_AT = options_position(ops.lce_fwd.default._schema)
_NUM_ARGS_FWD = len(ops.lce_fwd.default._schema.arguments)
_NUM_ARGS_FWD_BWD = len(ops.lce_fwd_bwd.default._schema.arguments)


def _forward_outputs(hidden, reduction, return_metrics):
    """loss, lse, num_correct, entropy_sum as the functional lce ops allocate them."""
    n = hidden.shape[0]
    metrics_shape = () if return_metrics else (0,)
    return (
        hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32),
        hidden.new_empty((n,), dtype=torch.float32),
        hidden.new_empty(metrics_shape, dtype=torch.int64),
        hidden.new_empty(metrics_shape, dtype=torch.float32),
    )


def _check_fake_inputs(hidden, weight, target):
    torch._check(hidden.dim() == 2, lambda: f"fusedce: hidden must be 2-D (N, H), got {hidden.dim()}-D")
    torch._check(weight.dim() == 2, lambda: f"fusedce: weight must be 2-D (V, H), got {weight.dim()}-D")
    torch._check(
        target.dim() == 1 and target.shape[0] == hidden.shape[0],
        lambda: f"fusedce: target must be 1-D with one entry per row of hidden ({hidden.shape[0]})",
    )


# ---- fake kernels: shapes and dtypes only --------------------------------------------------


@register_fake("lce_fwd")
def _lce_fwd_fake(hidden, weight, bias, target, class_weight, options, linear, return_metrics):
    _check_fake_inputs(hidden, weight, target)
    return _forward_outputs(hidden, options.reduction, return_metrics)


@register_fake("lce_fwd_bwd")
def _lce_fwd_bwd_fake(hidden, weight, bias, target, class_weight, options, linear, grad_loss,
                      return_metrics, need_grad_hidden, need_grad_weight, need_grad_bias):
    _check_fake_inputs(hidden, weight, target)
    torch._check(not need_grad_bias or bias is not None,
                 lambda: "fusedce: need_grad_bias is set but bias is not given")
    grads = (
        hidden.new_empty(hidden.shape if need_grad_hidden else (0,)),
        weight.new_empty(weight.shape) if need_grad_weight else hidden.new_empty((0,)),
        bias.new_empty(bias.shape) if need_grad_bias else hidden.new_empty((0,)),
    )
    return (*_forward_outputs(hidden, options.reduction, return_metrics), *grads)


# ---- autograd of the functional ops --------------------------------------------------------
#
# Both recompute in the backward with the upstream gradient as the core's grad_loss: correct for
# every reduction and whatever gradients the op itself returned. fusedce.linear_cross_entropy
# does not go through here (FusedLinearCrossEntropy below saves the forward's gradients).


def _recomputed_grads(tensors, options, linear, grad_loss, needs):
    """Gradients for hidden, weight, bias of sum(grad_loss * loss), one forward_backward call;
    None where `needs` (one flag per gradient) is False."""
    if not any(needs):
        return None, None, None
    *_, grad_h, grad_w, grad_b = ops.lce_fwd_bwd(*tensors, *options.op_args(), *linear.op_args(), grad_loss,
                                                 False, *needs)
    return tuple(grad if need else None for need, grad in zip(needs, (grad_h, grad_w, grad_b)))


def _setup_lce(ctx, inputs, output):
    tensors, ctx.options, ctx.linear, _ = linear_options_in(_OPTIONS_AT, inputs)
    ctx.save_for_backward(*tensors)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward_lce(ctx, grad_loss, num_args):
    grads = (None, None, None)
    if grad_loss is not None:
        tensors = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        needs = (need_h, need_w, need_b and tensors[2] is not None)
        grads = _recomputed_grads(tensors, ctx.options, ctx.linear, _upstream(grad_loss), needs)
    return (*grads, *(None,) * (num_args - 3))  # nothing for the op's other arguments


torch.library.register_autograd(_library.qualified("lce_fwd"),
                                lambda ctx, grad_loss, *unused: _backward_lce(ctx, grad_loss, _NUM_ARGS_FWD),
                                setup_context=_setup_lce)
torch.library.register_autograd(_library.qualified("lce_fwd_bwd"),
                                lambda ctx, grad_loss, *unused: _backward_lce(ctx, grad_loss, _NUM_ARGS_FWD_BWD),
                                setup_context=_setup_lce)


# ---- the training path of fusedce.linear_cross_entropy -------------------------------------


def gradients_factor(reduction, need_grad_weight, need_grad_bias):
    """True when the gradients formed in the forward for an upstream gradient of 1 give the
    real ones by scaling: always for 'sum' / 'mean' (one scalar factor), and for 'none' only
    when grad_hidden alone is needed (row i of grad_hidden scales by the row's factor, while
    grad_weight and grad_bias mix the rows)."""
    return reduction != "none" or not (need_grad_weight or need_grad_bias)


def _scale_saved(grad, grad_loss, keep):
    """grad * grad_loss through ce_rescale_ (no work where the factor is 1), in place unless
    the graph is kept for another backward that will read `grad` again."""
    if keep:
        grad = grad.clone()
    as_rows = grad.view(1, -1) if grad.dim() == 1 else grad  # grad_bias (V,) as one row
    ops.ce_rescale_(grad_loss, as_rows)
    return grad


class FusedLinearCrossEntropy(torch.autograd.Function):
    """The loss of ``hidden @ weight.T + bias`` with the gradients the caller needs.

    When :func:`gradients_factor` holds, one ``lce_fwd_bwd`` call forms the loss and the needed
    gradients together; they never leave this function, so the backward scales them in place by
    the upstream gradient (``ce_rescale_``: nothing is touched when the factor is 1). Otherwise
    (reduction='none' with weight or bias requiring grad) the forward runs ``lce_fwd`` alone and
    the backward calls ``lce_fwd_bwd`` with the per-row upstream gradient.

    Arguments: hidden (N, H), weight, bias, target (N,), class_weight, the call (a Call: its
    options, linear options and return_metrics), needs (whether hidden, weight and bias each
    need their gradient). Returns loss, lse, num_correct, entropy_sum (only the loss is
    differentiable).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, call, needs):
        tensors = (hidden, weight, bias, target, class_weight)
        ctx.call, ctx.needs = call, needs
        ctx.fused = gradients_factor(call.options.reduction, needs[1], needs[2])
        if ctx.fused:
            loss, lse, num_correct, entropy_sum, grad_h, grad_w, grad_b = call_below_autograd(
                ops.lce_fwd_bwd.default, *tensors, *call.options.op_args(), *call.linear.op_args(), None,
                call.return_metrics, *needs)
            ctx.save_for_backward(grad_h, grad_w, grad_b)
        else:
            loss, lse, num_correct, entropy_sum = call_below_autograd(
                ops.lce_fwd.default, *tensors, *call.options.op_args(), *call.linear.op_args(),
                call.return_metrics)
            ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(lse, num_correct, entropy_sum)
        ctx.set_materialize_grads(False)
        return loss, lse, num_correct, entropy_sum

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grads = (None, None, None)
        if grad_loss is not None:
            g = _upstream(grad_loss)
            if ctx.fused:
                keep = _graph_is_kept()
                grads = tuple(_scale_saved(saved, g, keep) if need else None
                              for need, saved in zip(ctx.needs, ctx.saved_tensors))
            else:
                grads = _recomputed_grads(ctx.saved_tensors, ctx.call.options, ctx.call.linear, g, ctx.needs)
        return (*grads, None, None, None, None)  # nothing for target, class_weight, call, needs
