"""Unsloth's cross-entropy entry points, computed by fusedce.

``fast_cross_entropy_loss(logits, labels, logit_softcapping=0, logit_scaling=0, n_items=None)``
takes ``(batch, seq, vocab)`` logits and ``(batch, seq)`` labels that are already aligned with
them (no shift here: position i's label is the target of position i), ignores the label -100,
and returns the summed token losses divided by the number of non-ignored labels, or by
``n_items`` when given (gradient accumulation over micro-batches). As in Unsloth, 0 switches
soft-capping and scaling off; otherwise ``z = logit_scaling * logits`` and then
``z = logit_softcapping * tanh(z / logit_softcapping)``.

``patch_loss_functions()`` makes transformers' causal-LM loss (``ForCausalLMLoss``: the label
shift, -100, ``num_items_in_batch``) compute its cross-entropy with fusedce over the logits, which
is what Unsloth's patch does with its own kernel; it is
``fusedce.transformers.apply(fused_linear=False)``. ``unpatch_loss_functions()`` restores
transformers' loss. ``fusedce.transformers.apply()`` goes further (the logits are never made).
"""

import numbers

import torch

from .. import transformers as _transformers
from ..functional import cross_entropy

_NAME = "fusedce.compat.unsloth.fast_cross_entropy_loss"
IGNORE_INDEX = -100


def _option(value, name):
    """Unsloth's convention for logit_softcapping and logit_scaling: 0 (or None) is off. Returns
    the value as a float, or None when off."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{_NAME}: {name} must be a number, got a tensor of shape "
                             f"{tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_NAME}: {name} must be a number, got {type(value).__name__}")
    return None if value == 0 else float(value)


def fast_cross_entropy_loss(logits, labels, logit_softcapping=0, logit_scaling=0, n_items=None):
    """Mean cross-entropy of ``logits`` (batch, seq, vocab) against ``labels`` (batch, seq) over
    the labels that are not -100, or the sum divided by ``n_items`` when it is given (an int or
    a 0-D tensor: the number of labelled tokens of the whole accumulated batch).

    The logits are read in their own dtype (float32, bfloat16 or float16), never upcast; the
    loss is float32. With every label -100 and no ``n_items`` the result is NaN (0 / 0), as in
    Unsloth. Gradients flow to ``logits``.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{_NAME}: logits must be a tensor, got {type(logits).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{_NAME}: labels must be a tensor, got {type(labels).__name__}")
    if logits.dim() != 3:
        raise ValueError(f"{_NAME}: logits must have shape (batch, seq, vocab), got "
                         f"{tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"{_NAME}: labels must have shape (batch, seq) = "
                         f"{tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
    softcap = _option(logit_softcapping, "logit_softcapping")
    scale = _option(logit_scaling, "logit_scaling")
    if softcap is not None and softcap < 0:
        raise ValueError(f"{_NAME}: logit_softcapping must be 0 (off) or > 0, got {softcap}")
    if n_items is None:
        n_items = torch.count_nonzero(labels != IGNORE_INDEX)
    elif isinstance(n_items, torch.Tensor):
        if n_items.numel() != 1:
            raise ValueError(f"{_NAME}: n_items must be a number or a 0-D tensor, got shape "
                             f"{tuple(n_items.shape)}")
    elif isinstance(n_items, bool) or not isinstance(n_items, numbers.Real):
        raise TypeError(f"{_NAME}: n_items must be None, a number or a tensor, got "
                        f"{type(n_items).__name__}")
    total = cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum",
                          logit_scale=1.0 if scale is None else scale, softcap=softcap)
    if isinstance(n_items, torch.Tensor):
        n_items = n_items.to(total.device).reshape(())
    return total / n_items


def patch_loss_functions():
    """Route transformers' causal-LM loss through fusedce over the logits (module docstring).
    Idempotent; undone by :func:`unpatch_loss_functions`."""
    _transformers.apply(fused_linear=False)


def unpatch_loss_functions():
    """Restore transformers' own causal-LM loss."""
    _transformers.revert()


__all__ = ["fast_cross_entropy_loss", "patch_loss_functions", "unpatch_loss_functions"]
