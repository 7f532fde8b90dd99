"""verl's fused linear log-probabilities under verl's own name and signature, computed by
fusedce: ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``, which verl's actors call
as ``log_probs, entropy = linear_cross_entropy(hidden_states, lm_head.weight, labels,
temperature, "none")`` when ``use_fused_kernels`` is on.

    from fusedce.compat.verl import linear_cross_entropy

Semantics (verl's): ``z = hidden @ weight.T / temperature`` with ``weight`` the (V, H) head (on a
tensor-parallel group, this rank's block of V / world rows, in rank order); ``log_probs`` is
``log softmax(z)[label]`` (at most 0; the negative cross-entropy), ``entropy`` is the entropy of
``softmax(z)``, both float32 per token, and both carry gradients to ``hidden`` and ``weight``.
Every position counts: verl passes rolled labels, all in [0, V). The reduction applies to
``log_probs`` alone (``"sum"`` and ``"mean"`` over the tokens give a scalar); ``entropy`` stays
per token, as verl's kernel returns it.
"""

import torch

from .. import token_logprobs

__all__ = ["linear_cross_entropy"]

_REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """(log_probs, entropy) of ``labels`` under ``hidden @ weight.T / temperature``, verl's
    semantics (module docstring).

    Args:
        hidden: (..., H) float32, bfloat16 or float16.
        weight: (V, H) in hidden's dtype; with ``dist_process_group``, this rank's (V / world, H)
            block of the head, the blocks in rank order.
        labels: hidden.shape[:-1] integer token ids in [0, V).
        temperature: the logits are divided by it; finite and > 0.
        reduction: "none" (per token), "sum" or "mean" over the tokens, for ``log_probs``.
        dist_process_group: the tensor-parallel group over which the vocabulary is split, or None.

    Returns:
        log_probs (labels' shape, or a scalar), entropy (labels' shape), both float32.
    """
    where = "fusedce.compat.verl.linear_cross_entropy"
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(f"{where}: reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, "
                         f"got {reduction!r}")
    if isinstance(temperature, torch.Tensor):
        temperature = float(temperature)
    log_probs, entropy = token_logprobs.linear_logprobs(
        hidden, weight, labels, temperature=temperature, return_entropy=True,
        process_group=dist_process_group)
    reduction = reduction.lower()
    if reduction == "sum":
        log_probs = log_probs.sum()
    elif reduction == "mean":
        log_probs = log_probs.mean()
    return log_probs, entropy
