"""fusedce.transformers.apply() over every class of the installed transformers' causal-LM and
seq2seq-LM auto mappings (transformers_coverage.py): no class fails, and the fused linear loss
serves at least 90% of the causal LMs whose loss is transformers' causal-LM loss. The table is
printed (pytest -s) and kept in docs/transformers.md."""

import pytest
import torch

pytest.importorskip("transformers")
import fusedce.transformers as fct  # noqa: E402
import transformers_coverage as cov  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    try:
        return cov.run(out=None)
    finally:
        torch.set_num_threads(threads)


def test_no_class_fails(rows):
    print("\n" + cov.summary(rows))
    failing = [f"{name}: {detail}" for name, _, outcome, detail, _ in rows if outcome == "failing"]
    assert not failing, "\n\n".join(failing)


OWN = "its own CrossEntropyLoss"


def test_fused_serves_the_causal_lms(rows):
    causal = [r for r in rows if r[1] == "causal"]
    fused = sum(r[2] == "fused_linear" for r in causal)
    # the causal LMs whose loss is transformers' causal-LM loss (not their own cross-entropy)
    served = sum(r[2] in ("fused_linear", "logits") and not r[3].startswith(OWN) for r in causal)
    assert served >= 100, "the mapping is far smaller than transformers 5's, or few classes build"
    assert fused >= 0.9 * served, [r[0] for r in causal if r[2] == "logits"]
    # The models the issue named: the encoder-decoder models and the decoders with their own
    # cross-entropy are served over their logits by TokenCrossEntropyLoss.
    outcome = {r[0]: r[2:4] for r in rows}
    for name in ("T5ForConditionalGeneration", "BartForConditionalGeneration", "BartForCausalLM",
                 "TrOCRForCausalLM", "WhisperForCausalLM", "PLBartForCausalLM",
                 "EncoderDecoderModel", "MusicgenForCausalLM", "XLNetLMHeadModel"):
        assert outcome[name][0] == "logits" and outcome[name][1].startswith(OWN), name
    # Those whose own loss does not go through the name CrossEntropyLoss of their module
    # (F.nll_loss, nn.functional.cross_entropy, nn.CrossEntropyLoss) stay as they are.
    for name in ("ProphetNetForCausalLM", "XLMWithLMHeadModel",
                 "GraniteSpeechForConditionalGeneration", "Qwen2AudioForConditionalGeneration"):
        assert outcome[name][0] == "untouched", name
    outcome = {name: value[0] for name, value in outcome.items()}
    assert outcome["LlamaForCausalLM"] == "fused_linear"
    # Git calls lm_head on its image tokens too and slices them off before its loss: the fused
    # loss declines (its labels do not cover lm_head's positions) and the logits serve it.
    assert outcome["GitForCausalLM"] == "logits"
    # xLSTM's soft-cap is its config's output_logit_soft_cap.
    assert outcome["xLSTMForCausalLM"] == "fused_linear"
    # Every class builds but those that cannot take a step on their own (Gemma 4's draft
    # models) or need a package outside the pinned set (timm).
    unbuilt = sorted(r[0] for r in rows if r[2] == "not buildable")
    assert unbuilt == ["Gemma3nForConditionalGeneration", "Gemma4AssistantForCausalLM",
                       "Gemma4UnifiedAssistantForCausalLM"], unbuilt


def test_arming_a_model_with_its_own_loss_is_declined(monkeypatch):
    # T5 armed although it computes its own loss: it reads its logits' size, the fused loss is
    # declined, and the call run again unarmed is served by TokenCrossEntropyLoss, with T5's
    # loss and gradients.
    monkeypatch.setattr(fct, "_calls_loss_function", lambda cls: True)
    assert cov.check_class(cov.resolve("T5ForConditionalGeneration"))[0] == "logits"


def test_the_check_can_fail(monkeypatch):
    # Planted bugs are caught: a fused loss 0.1% too large, TokenCrossEntropyLoss summing where
    # the model asked for the mean, and TokenCrossEntropyLoss losing the model's ignore_index.
    real = fct.linear_cross_entropy
    monkeypatch.setattr(fct, "linear_cross_entropy", lambda *a, **k: real(*a, **k) * 1.001)
    outcome, detail = cov.check_class(cov.resolve("LlamaForCausalLM"))
    assert outcome == "failing" and detail.startswith("differs"), detail
    monkeypatch.undo()
    real_ce = fct.cross_entropy
    monkeypatch.setattr(fct, "cross_entropy", lambda *a, **k: real_ce(*a, **{**k, "reduction": "sum"}))
    outcome, detail = cov.check_class(cov.resolve("BartForCausalLM"))
    assert outcome == "failing" and detail.startswith("differs"), detail
    monkeypatch.undo()
    monkeypatch.setattr(fct, "cross_entropy", lambda *a, **k: real_ce(*a, **{**k, "ignore_index": -1}))
    outcome, detail = cov.check_class(cov.resolve("T5ForConditionalGeneration"))
    assert outcome == "failing" and "ValueError" in detail, detail
