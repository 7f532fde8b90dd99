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
``fusedce.linear_logprobs`` (log-probabilities and entropy, with their gradients to the hidden
states, the head and its bias) and, without gradients, the two statistics TRL's DPO and KTO ask
for: ``log_sum_sq_probs = log sum_v p_v^2``, from the identity ``2 log p_t(T) - log p_t(T / 2)``
(one more forward at half the temperature; its float32 error grows with those two terms, a few
1e-6 where the target's log-probability is near -20, against TRL's 5e-7), and ``mean_logits``, the mean over the vocabulary of
the scaled logits, exactly as ``scale / T * (h . mean_v w + mean_v b)`` (no logits formed).
A positive logit scale is folded into the temperature. What fusedce's log-probabilities do not
take yet, a soft-cap (``final_logit_softcapping``), a logit scale of 0 or below, or the argmax
test ``is_top1``, goes to TRL's own kernel for that call, so every TRL model and trainer keeps working; GRPO and RLOO ask for
neither (their outputs are log-probabilities and entropy).

The computation follows TRL's: under autocast the hidden states and the head are cast to
autocast's dtype (TRL's ``compute_dtype``), otherwise to the hidden states' dtype; the outputs
are float32.
"""

import torch

from .. import token_logprobs

__all__ = ["apply", "revert", "is_applied", "FusedceLogProbHead", "can_serve"]

_ORIGINAL = None  # TRL's own function while applied


def _utils():
    import trl.trainer.utils as utils  # TRL's module that holds the name the patched forward calls
    if not hasattr(utils, "_ChunkedLogProbFunction"):
        import trl
        raise RuntimeError(f"fusedce.integrations.trl: trl {trl.__version__} has no "
                           "trl.trainer.utils._ChunkedLogProbFunction (written against trl 1.16)")
    return utils


def can_serve(final_logit_softcapping, logit_scale, outputs):
    """Whether fusedce computes a call with these options (else TRL's own kernel does): no
    soft-cap, a positive logit scale (folded into the temperature), no ``is_top1``."""
    return final_logit_softcapping is None and float(logit_scale) > 0 and "is_top1" not in tuple(outputs)


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
        with torch.autocast(device.type, enabled=False):
            got = token_logprobs.linear_logprobs(h, w, targets, b, temperature=t_eff, return_entropy=want_entropy)
            log_probs, entropy = got if want_entropy else (got, None)
            log_sum_sq_probs = mean_logits = None
            if "log_sum_sq_probs" in outputs:
                with torch.no_grad():
                    half = token_logprobs.linear_logprobs(h.detach(), w.detach(), targets,
                                                          None if b is None else b.detach(), temperature=t_eff / 2)
                    log_sum_sq_probs = 2 * log_probs.detach() - half
            if "mean_logits" in outputs:
                with torch.no_grad():
                    mean_w = w.detach().mean(0, dtype=torch.float32)
                    mean_x = h.detach().float() @ mean_w
                    if b is not None:
                        mean_x = mean_x + b.detach().mean(dtype=torch.float32)
                    mean_logits = mean_x / t_eff
        return log_probs, entropy, log_sum_sq_probs, mean_logits, None


def apply():
    """TRL's fused head runs on fusedce from now on (every model patched by add_fused_lm_head,
    before or after this call). Idempotent."""
    global _ORIGINAL
    utils = _utils()
    if utils._ChunkedLogProbFunction is FusedceLogProbHead:
        return
    _ORIGINAL = utils._ChunkedLogProbFunction
    utils._ChunkedLogProbFunction = FusedceLogProbHead


def revert():
    """TRL's own kernel again. Idempotent."""
    global _ORIGINAL
    if _ORIGINAL is None:
        return
    utils = _utils()
    if utils._ChunkedLogProbFunction is FusedceLogProbHead:
        utils._ChunkedLogProbFunction = _ORIGINAL
    _ORIGINAL = None


def is_applied():
    return _ORIGINAL is not None
