"""TRL's fused LM head on fusedce.

TRL (1.16) computes its trainers' per-token log-probabilities through ``add_fused_lm_head``: with
``model(..., fused_lm_head=True)`` the patched forward runs the backbone and hands the hidden
states of the scored positions to ``trl.kernels.ChunkedLogProbFunction`` (a chunked Triton
kernel), which ``trl.trainer.utils`` calls as ``_ChunkedLogProbFunction.apply(hidden, weight,
bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)`` and
which returns ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, the ones not in
``outputs`` as None.

    import fusedce.integrations.trl
    fusedce.integrations.trl.apply()      # before or after the trainer is built
    trainer.train()
    fusedce.integrations.trl.revert()     # TRL's own kernel again

``apply()`` replaces that one name with :data:`FusedceLogProbHead`, which serves the call with
one ``fusedce.linear_logprobs`` call: log-probabilities and entropy, with their gradients to the
hidden states, the head and its bias, and (``return_stats``, from the same pass over the logits,
without gradients) the statistics TRL's other trainers ask for: ``log_sum_sq_probs = log sum_v
p_v^2``, ``mean_logits`` (the mean over the vocabulary of the scaled logits) and ``is_top1``
(whether the label is the first argmax), with TRL's definitions. A positive logit scale is
folded into the temperature. What fusedce's log-probabilities do not take yet, a soft-cap
(``final_logit_softcapping``) or a logit scale of 0 or below, goes to TRL's own kernel for that
call, so every TRL model and trainer keeps working; GRPO and RLOO ask for neither.

The computation follows TRL's: under autocast the hidden states and the head are cast to
autocast's dtype (TRL's ``compute_dtype``), otherwise to the hidden states' dtype; the outputs
are float32.

``apply()`` also replaces the name ``ChunkedDivergenceFunction`` in
``trl.trainer.distillation_trainer`` (the one its ``_chunked_divergence_loss`` calls) with
:data:`FusedceDivergence`: the same arguments (student's and teacher's hidden states, head and
bias, beta, temperature, each head's logit scale and soft-cap) and the same returns (per-token
divergence with gradients to the student, per-token entropy of the student without), computed
by ``fusedce.linear_distillation`` (beta 0 forward KL, 1 reverse KL, between the generalized
JSD: TRL's definitions). Calls it cannot serve go to TRL's own function: tensors on another
device than the CPU or CUDA (or on several), and options ``linear_distillation`` refuses.
"""

import torch

from .. import _library, token_logprobs
from .._distill_options import DistillOptions
from ..distillation import linear_distillation

__all__ = ["apply", "revert", "is_applied", "FusedceLogProbHead", "can_serve", "FusedceDivergence",
           "can_serve_divergence"]

_ORIGINAL = None  # TRL's own function while applied
_ORIGINAL_DIVERGENCE = None  # TRL's own ChunkedDivergenceFunction while applied


def _utils():
    import trl.trainer.utils as utils  # TRL's module that holds the name the patched forward calls
    if not hasattr(utils, "_ChunkedLogProbFunction"):
        import trl
        raise RuntimeError(f"fusedce.integrations.trl: trl {trl.__version__} has no "
                           "trl.trainer.utils._ChunkedLogProbFunction (written against trl 1.16)")
    return utils


_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")


def can_serve(final_logit_softcapping, logit_scale, outputs):
    """Whether fusedce computes a call with these options (else TRL's own kernel does): no
    soft-cap and a positive logit scale (folded into the temperature); any of TRL's outputs."""
    return final_logit_softcapping is None and float(logit_scale) > 0


class FusedceLogProbHead:
    """Stands where TRL calls ``_ChunkedLogProbFunction.apply`` (same arguments, same returns)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        outputs = tuple(outputs)
        if not can_serve(final_logit_softcapping, logit_scale, outputs):
            fallback = _ORIGINAL
            if fallback is None:
                from trl.kernels import ChunkedLogProbFunction as fallback
            return fallback.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                  final_logit_softcapping, logit_scale, outputs)
        device = hidden.device
        compute_dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                         else hidden.dtype)
        # z = logit_scale * x / temperature: one temperature (linear_logprobs checks it).
        t_eff = float(temperature) / float(logit_scale)
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        want_entropy = "entropy" in outputs
        want_stats = any(name in outputs for name in _STATS)
        with torch.autocast(device.type, enabled=False):
            got = token_logprobs.linear_logprobs(h, w, targets, b, temperature=t_eff, return_entropy=want_entropy,
                                                 return_stats=want_stats)
        got = got if isinstance(got, tuple) else (got,)
        log_probs = got[0]
        entropy = got[1] if want_entropy else None
        stats = got[-1] if want_stats else {}
        return (log_probs, entropy, *(stats.get(name) if name in outputs else None for name in _STATS))


# ---- the distillation trainer's divergence ---------------------------------------------------


def _distillation():
    import trl.trainer.distillation_trainer as module  # holds the name _chunked_divergence_loss calls
    if not hasattr(module, "ChunkedDivergenceFunction"):
        import trl
        raise RuntimeError(f"fusedce.integrations.trl: trl {trl.__version__} has no "
                           "trl.trainer.distillation_trainer.ChunkedDivergenceFunction (written against trl 1.16)")
    return module


def _trls_divergence():
    if _ORIGINAL_DIVERGENCE is not None:
        return _ORIGINAL_DIVERGENCE
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    return ChunkedDivergenceFunction


def can_serve_divergence(tensors, beta, temperature, student_logit_scale, student_final_logit_softcapping,
                         teacher_logit_scale, teacher_final_logit_softcapping):
    """Whether fusedce computes a ChunkedDivergenceFunction call (else TRL's own function does):
    every tensor given on one device, the CPU or a CUDA device this build has kernels for,
    hidden states of two dimensions, and options that linear_distillation takes (beta in [0, 1],
    a temperature > 0, finite non-zero logit scales, positive soft-caps or None)."""
    device = tensors[0].device
    if any(x is not None and x.device != device for x in tensors) or tensors[0].dim() != 2:
        return False
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not _library.with_cuda):
        return False
    try:
        DistillOptions.checked("fusedce.integrations.trl", divergence="jsd", beta=beta, temperature=temperature,
                               student_logit_scale=student_logit_scale,
                               student_softcap=student_final_logit_softcapping,
                               teacher_logit_scale=teacher_logit_scale,
                               teacher_softcap=teacher_final_logit_softcapping)
    except (TypeError, ValueError):
        return False
    return True


def _compute_dtype(hidden):
    """TRL's: autocast's dtype under autocast, else the hidden states' own."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _head_in(hidden, weight, bias):
    dtype = _compute_dtype(hidden)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


class FusedceDivergence:
    """Stands where TRL's distillation trainer calls ``ChunkedDivergenceFunction.apply`` (same
    arguments, same returns: per-token divergence and the student's per-token entropy, float32)."""

    @staticmethod
    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
              temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None,
              teacher_logit_scale=1.0, teacher_final_logit_softcapping=None):
        args = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
                temperature, student_logit_scale, student_final_logit_softcapping, teacher_logit_scale,
                teacher_final_logit_softcapping)
        if not can_serve_divergence(args[:6], *args[6:]):
            return _trls_divergence().apply(*args)
        hs, ws, bs = _head_in(student_hidden, student_weight, student_bias)
        ht, wt, bt = _head_in(teacher_hidden, teacher_weight, teacher_bias)
        with torch.autocast(student_hidden.device.type, enabled=False):
            divergence, metrics = linear_distillation(
                hs, ws, ht, wt, divergence="jsd", beta=beta, temperature=temperature, reduction="none",
                student_bias=bs, teacher_bias=bt, student_logit_scale=student_logit_scale,
                student_softcap=student_final_logit_softcapping, teacher_logit_scale=teacher_logit_scale,
                teacher_softcap=teacher_final_logit_softcapping, return_metrics=True)
        return divergence, metrics["entropy"]


# ---- apply / revert -------------------------------------------------------------------------


def apply():
    """TRL's fused head (every model patched by add_fused_lm_head, before or after this call)
    and its distillation trainer's divergence run on fusedce from now on. Idempotent."""
    global _ORIGINAL, _ORIGINAL_DIVERGENCE
    utils = _utils()
    if utils._ChunkedLogProbFunction is not FusedceLogProbHead:
        _ORIGINAL = utils._ChunkedLogProbFunction
        utils._ChunkedLogProbFunction = FusedceLogProbHead
    distillation = _distillation()
    if distillation.ChunkedDivergenceFunction is not FusedceDivergence:
        _ORIGINAL_DIVERGENCE = distillation.ChunkedDivergenceFunction
        distillation.ChunkedDivergenceFunction = FusedceDivergence


def revert():
    """TRL's own kernels again. Idempotent."""
    global _ORIGINAL, _ORIGINAL_DIVERGENCE
    if _ORIGINAL is not None:
        utils = _utils()
        if utils._ChunkedLogProbFunction is FusedceLogProbHead:
            utils._ChunkedLogProbFunction = _ORIGINAL
        _ORIGINAL = None
    if _ORIGINAL_DIVERGENCE is not None:
        distillation = _distillation()
        if distillation.ChunkedDivergenceFunction is FusedceDivergence:
            distillation.ChunkedDivergenceFunction = _ORIGINAL_DIVERGENCE
        _ORIGINAL_DIVERGENCE = None


def is_applied():
    return _ORIGINAL is not None and _ORIGINAL_DIVERGENCE is not None
