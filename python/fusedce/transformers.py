"""Hugging Face transformers integration: ``fusedce.transformers.apply()`` makes every causal
language model of the installed transformers compute its training loss with fusedce;
``revert()`` undoes it.

transformers looks a model's loss up by its ``loss_type`` in
``transformers.loss.loss_utils.LOSS_MAPPING`` every time the model computes a loss; causal LMs
(``ForCausalLM``, ``ForConditionalGeneration`` and every other entry that maps to
``ForCausalLMLoss``) get :func:`causal_lm_loss` instead. ``Trainer`` recognises a causal-LM loss
by identity (``LOSS_MAPPING[loss_type] is ForCausalLMLoss``, to count ``num_items_in_batch`` over
shifted labels), so the name ``ForCausalLMLoss`` is replaced too, in ``loss_utils`` and in every
transformers module already imported; modules imported later pick the replacement up from
``loss_utils``. Works with models created before or after ``apply()``, with ``Trainer`` and with
a hand-written loop.
"""

import sys

import torch
import torch.nn.functional as F

from .functional import cross_entropy

_original = None  # transformers' ForCausalLMLoss while applied


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, **kwargs):
    """transformers' ``ForCausalLMLoss`` (label shift, ``ignore_index``, ``num_items_in_batch``
    normalisation), with fusedce computing the cross-entropy straight from the logits in their
    own dtype: no float32 copy, no (N, V) buffer besides the gradient."""
    if shift_labels is None:
        # Shift so that tokens < n predict n; the last position predicts nothing.
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _swap(old, new):
    """Replace `old` by `new` in LOSS_MAPPING and wherever a transformers module holds it under
    the name ForCausalLMLoss."""
    from transformers.loss import loss_utils

    for key, fn in list(loss_utils.LOSS_MAPPING.items()):
        if fn is old:
            loss_utils.LOSS_MAPPING[key] = new
    for name, module in list(sys.modules.items()):
        if (name == "transformers" or name.startswith("transformers.")) and module is not None:
            if module.__dict__.get("ForCausalLMLoss") is old:
                setattr(module, "ForCausalLMLoss", new)


def apply():
    """Route every causal-LM training loss of transformers through fusedce (idempotent)."""
    global _original
    if _original is not None:
        return
    from transformers.loss import loss_utils

    _original = loss_utils.ForCausalLMLoss
    _swap(_original, causal_lm_loss)


def revert():
    """Restore transformers' own loss, also in modules imported since apply()."""
    global _original
    if _original is None:
        return
    _swap(causal_lm_loss, _original)
    _original = None


def is_applied():
    return _original is not None
