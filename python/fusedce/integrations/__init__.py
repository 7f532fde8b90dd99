"""One call that moves a training library's own fused head onto fusedce:
:mod:`fusedce.integrations.trl` (TRL's chunked log-probability head, used by its GRPO, RLOO,
DPO, KTO and SFT trainers through ``add_fused_lm_head``)."""
