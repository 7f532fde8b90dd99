"""The distillation's options as one frozen object mirroring fusedce::DistillOptions
(include/fusedce/distill.h), built once per call from the public keywords, checked with messages
that name the argument, and handed to the ops whole (fields in the schema's order:
FUSEDCE_DISTILL_ARGS in torch/distill_ops.h; tests/python/test_distillation.py compares the two).
"""

import dataclasses

from ._checks import _INF, _real, _representable, ignore_index_of
from ._options import REDUCTIONS

DIVERGENCES = ("jsd", "forward_kl", "reverse_kl")
TOPK_NORMS = ("none", "renorm", "tail")


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """beta (0 forward KL, 1 reverse KL, between: TRL's generalized JSD), temperature,
    hard_weight, ignore_index, reduction, each head's logit_scale and softcap (0 = off), and the
    top-k form's normalisation, as the kernels take them. Build it with :meth:`checked`."""

    beta: float = 0.5
    temperature: float = 1.0
    hard_weight: float = 0.0
    ignore_index: int = -100
    reduction: str = "mean"
    student_logit_scale: float = 1.0
    student_softcap: float = 0.0
    teacher_logit_scale: float = 1.0
    teacher_softcap: float = 0.0
    topk_norm: str = "none"

    @classmethod
    def checked(cls, where, *, divergence="jsd", beta=None, temperature=1.0, hard_weight=0.0, ignore_index=-100,
                reduction="mean", has_labels=False, student_logit_scale=1.0, student_softcap=None,
                teacher_logit_scale=1.0, teacher_softcap=None, topk_norm="none"):
        """The options of a call of `where`: divergence 'jsd' takes beta (None: 0.5) in [0, 1]
        with TRL's ends (0 and 1 are the two KLs); 'forward_kl' and 'reverse_kl' are beta 0 and 1
        and take no beta. hard_weight in [0, 1], > 0 only with labels (has_labels)."""
        if divergence not in DIVERGENCES:
            raise ValueError(f"{where}: divergence must be 'jsd', 'forward_kl' or 'reverse_kl', got {divergence!r}")
        if divergence != "jsd":
            if beta is not None:
                raise ValueError(f"{where}: beta is for divergence='jsd'; divergence={divergence!r} is beta "
                                 f"{0.0 if divergence == 'forward_kl' else 1.0} already, got beta={beta!r}")
            beta = 0.0 if divergence == "forward_kl" else 1.0
        else:
            beta = 0.5 if beta is None else _real(beta, "beta", where)
            if not 0.0 <= beta <= 1.0:
                raise ValueError(f"{where}: beta must be in [0, 1], got {beta!r}")
            _representable(beta, "beta", where, "use 0, or a value in [1.2e-38, 1]")
            _representable(1.0 - beta, "1 - beta", where, "use 1, or a value in [0, 1 - 1.2e-38]")
        t = _real(temperature, "temperature", where)
        if not 0.0 < t < _INF:
            raise ValueError(f"{where}: temperature must be finite and > 0, got {temperature!r}")
        _representable(t, "temperature", where, "use a value in [1.2e-38, 3.4e38]")
        _representable(1.0 / t, "1 / temperature", where, "use a value in [3e-38, 8e37]")
        w = _real(hard_weight, "hard_weight", where)
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"{where}: hard_weight must be in [0, 1], got {hard_weight!r}")
        if w > 0.0 and not has_labels:
            raise ValueError(f"{where}: hard_weight={hard_weight!r} mixes in the cross-entropy on labels, "
                             "but labels is None")
        if reduction not in REDUCTIONS:
            raise ValueError(f"{where}: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
        if topk_norm not in TOPK_NORMS:
            raise ValueError(f"{where}: topk_norm must be 'none', 'renorm' or 'tail', got {topk_norm!r}")
        heads = [_head(where, "student", student_logit_scale, student_softcap),
                 _head(where, "teacher", teacher_logit_scale, teacher_softcap)]
        return cls(beta, t, w, ignore_index_of(ignore_index, where), reduction, *heads[0], *heads[1], topk_norm)

    def op_args(self):
        """The ten op arguments before chunk_budget_bytes, in schema order."""
        return dataclasses.astuple(self)


def _head(where, who, logit_scale, softcap):
    """(logit_scale, softcap) of one head, softcap None = off (0), each as float32 holds it."""
    s = _real(logit_scale, f"{who}_logit_scale", where)
    if not (-_INF < s < _INF and s != 0.0):
        raise ValueError(f"{where}: {who}_logit_scale must be finite and non-zero, got {logit_scale!r}")
    _representable(s, f"{who}_logit_scale", where, "use a magnitude in [1.2e-38, 3.4e38]")
    if softcap is None:
        return s, 0.0
    c = _real(softcap, f"{who}_softcap", where)
    if not 0.0 < c < _INF:
        raise ValueError(f"{where}: {who}_softcap must be None (off) or finite and > 0, got {softcap!r}")
    _representable(c, f"{who}_softcap", where, "use a value in [1.2e-38, 3.4e38], or None (off)")
    return s, c


NAMES = tuple(field.name for field in dataclasses.fields(DistillOptions))
