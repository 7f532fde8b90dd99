"""fusedce as a Kernels Hub package: fused linear cross-entropy and cross-entropy, computed by the
fusedce core (the package ``_fusedce`` beside this file is fusedce's own Python front end, with
its library compiled under an op namespace of this build's own, so that this package and an
installed fusedce can be loaded in one process).

    kernel = kernels.get_kernel(...)   # or kernels.get_local_kernel(path)
    loss = kernel.fused_linear_cross_entropy(hidden, lm_head.weight, targets)
    loss, metrics = kernel.fused_linear_cross_entropy(hidden, w, targets, return_metrics=True)
"""

from . import _fusedce
from ._ops import add_op_namespace_prefix, ops


def _hub_metrics(metrics):
    """fusedce's metrics under the Hub API's names: sums over the non-ignored positions."""
    return {"num_correct_tokens": metrics["num_correct_tokens"], "entropy_sum": metrics["entropy_sum"]}


def fused_linear_cross_entropy(hidden, weight, targets, bias=None, ignore_index=-100,
                               logit_scale=1.0, softcap=None, reduction="mean",
                               return_metrics=False):
    """Cross-entropy of the logits ``logit_scale * (hidden @ weight.T + bias)`` (then
    ``softcap * tanh(z / softcap)`` when ``softcap`` is given) against ``targets``, without ever
    storing the (N, V) logits.

    Args:
        hidden: (..., H) float32, bfloat16 or float16.
        weight: (V, H) in hidden's dtype.
        targets: hidden.shape[:-1], int64 or int32 class indices or ``ignore_index``.
        bias: (V,) in hidden's dtype, or None.
        reduction: "mean" (over the non-ignored positions), "sum" or "none".
        return_metrics: also return ``{"num_correct_tokens": int64 0-D tensor, "entropy_sum":
            float32 0-D tensor}``: the number of non-ignored positions whose argmax is the
            target, and the sum of the softmax entropies (nats) over them. The loss and
            gradients are bit-identical with and without.

    Returns:
        The float32 loss, or ``(loss, metrics)``. Gradients flow to hidden, weight and bias.
    """
    out = _fusedce.linear_cross_entropy(hidden, weight, targets, bias, ignore_index=ignore_index,
                                        logit_scale=logit_scale, softcap=softcap,
                                        reduction=reduction, return_metrics=return_metrics)
    if return_metrics:
        return out[0], _hub_metrics(out[1])
    return out


def cross_entropy(logits, targets, ignore_index=-100, logit_scale=1.0, softcap=None,
                  reduction="mean", return_metrics=False):
    """Cross-entropy of ``logits`` (..., V) against ``targets`` (...), with the options and the
    return of :func:`fused_linear_cross_entropy`; the gradient is formed in the forward sweep.
    """
    out = _fusedce.cross_entropy(logits, targets, ignore_index=ignore_index,
                                 logit_scale=logit_scale, softcap=softcap, reduction=reduction,
                                 return_metrics=return_metrics, strict=True)
    if return_metrics:
        return out[0], _hub_metrics(out[1])
    return out


with_cuda = _fusedce.with_cuda
"""True when this build has the CUDA kernels."""

__all__ = ["fused_linear_cross_entropy", "cross_entropy", "ops", "add_op_namespace_prefix",
           "with_cuda"]
