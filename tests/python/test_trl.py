"""fusedce.integrations.trl: TRL's fused LM head (trl.kernels.ChunkedLogProbFunction, as
trl.trainer.utils calls it) served by fusedce. The head alone against TRL's own kernel (every
output, every option TRL passes, gradients through log-probabilities and entropy), the calls it
hands back to TRL, and one GRPO step and one RLOO step of TRL's trainers on a tiny model on the
CPU: the loss and every parameter's gradient equal to TRL's own within float32 rounding, and a
planted 1e-3 error in the log-probabilities caught."""

import pytest
import torch

trl = pytest.importorskip("trl")
import trl.trainer.utils as trl_utils  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402

import fusedce.integrations.trl as fused_trl  # noqa: E402

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture(autouse=True)
def _reverted():
    fused_trl.revert()
    yield
    fused_trl.revert()


def head_problem(n, hid, vocab, seed, bias):
    """A peaked policy head: each row's target mostly its likely token."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=g)
    w = torch.randn(vocab, hid, generator=g) / hid ** 0.5
    likely = torch.randint(0, vocab, (n,), generator=g)
    w[likely] += 2.5 * h / h.norm(dim=1, keepdim=True)
    t = torch.where(torch.rand(n, generator=g) < 0.7, likely, torch.randint(0, vocab, (n,), generator=g))
    b = torch.randn(vocab, generator=g) * 0.3 if bias else None
    return h, w, b, t


def run_head(fn, h, w, b, t, temperature, logit_scale, outputs, softcap=None):
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in (h, w, b)]
    out = fn.apply(leaves[0], leaves[1], leaves[2], t, temperature, 64, softcap, logit_scale, outputs)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(t.shape, generator=g)
    c = torch.randn(t.shape, generator=g)
    loss = (out[0] * a).sum() + (0.0 if out[1] is None else (out[1] * c).sum())
    loss.backward()
    return out, [None if x is None else x.grad for x in leaves]


class Float64Head:
    """The head's definition in float64 (autograd through the full logits): the reference."""

    @staticmethod
    def apply(h, w, b, t, temperature, chunk_size, softcap, logit_scale, outputs):
        x = h.double() @ w.double().T + (0 if b is None else b.double())
        z = logit_scale * x / temperature
        logp = torch.log_softmax(z, -1)
        lp = logp.gather(-1, t[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        lsq = torch.logsumexp(2 * logp, -1).detach() if "log_sum_sq_probs" in outputs else None
        mean = z.mean(-1).detach() if "mean_logits" in outputs else None
        top1 = z.argmax(-1) == t if "is_top1" in outputs else None  # the first maximum on ties
        return lp, ent, lsq, mean, top1


def error(x, ref):
    return (x.double() - ref.double()).abs().max().item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature,logit_scale", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.25), (1.3, 2.0)])
@pytest.mark.parametrize("outputs", [("log_probs",), ("log_probs", "entropy"), ("log_probs", "is_top1"), OUTPUTS])
def test_head_matches_trls_kernel(bias, temperature, logit_scale, outputs):
    h, w, b, t = head_problem(37, 24, 301, seed=3, bias=bias)
    ours, our_grads = run_head(fused_trl.FusedceLogProbHead, h, w, b, t, temperature, logit_scale, outputs)
    theirs, their_grads = run_head(ChunkedLogProbFunction, h, w, b, t, temperature, logit_scale, outputs)
    ref, ref_grads = run_head(Float64Head, h.double(), w.double(), None if b is None else b.double(), t,
                              temperature, logit_scale, outputs)
    # Against float64: fusedce's error within twice TRL's own float32 error, or float32's
    # rounding of the values (a few units of 2^-24 of the largest).
    for name, x, y, r in zip(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), ours, theirs, ref):
        assert (x is None) == (y is None), name
        if x is not None and name == "is_top1":
            assert x.dtype == y.dtype == torch.bool and torch.equal(x, y) and torch.equal(x, r), name
        elif x is not None:
            assert x.dtype == torch.float32, name
            floor = 8 * 2.0**-24 * max(1.0, r.abs().max().item())
            assert error(x, r) <= max(2 * error(y, r), floor), (name, error(x, r), error(y, r))
    for name, x, y, r in zip(("hidden", "weight", "bias"), our_grads, their_grads, ref_grads):
        assert (x is None) == (y is None), name
        if x is not None:
            floor = 64 * 2.0**-24 * r.abs().max().item()
            assert error(x, r) <= max(2 * error(y, r), floor), (f"grad {name}", error(x, r), error(y, r))


@pytest.mark.parametrize("n,vocab", [(0, 40), (6, 1), (9, 3)], ids=["no_tokens", "V1", "V3"])
def test_head_on_awkward_shapes(n, vocab):
    """No tokens, a vocabulary of one and of three: every output and gradient against float64."""
    h, w, b, t = head_problem(n, 8, vocab, seed=2, bias=True)
    ours, our_grads = run_head(fused_trl.FusedceLogProbHead, h, w, b, t, 0.8, 1.5, OUTPUTS)
    ref, ref_grads = run_head(Float64Head, h.double(), w.double(), b.double(), t, 0.8, 1.5, OUTPUTS)
    for name, x, r in zip(OUTPUTS, ours, ref):
        assert x.shape == (n,), name
        torch.testing.assert_close(x.double(), r.double(), rtol=1e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
    for name, x, r in zip(("hidden", "weight", "bias"), our_grads, ref_grads):
        torch.testing.assert_close(x.double(), r, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {name}: {m}")


def test_calls_fusedce_cannot_serve_go_to_trl():
    """A soft-cap or a logit scale of 0: TRL's own kernel, bit for bit."""
    h, w, b, t = head_problem(11, 16, 97, seed=5, bias=True)
    for softcap, scale, outputs in ((30.0, 1.0, OUTPUTS), (None, 0.0, ("log_probs",))):
        assert not fused_trl.can_serve(softcap, scale, outputs)
        ours, og = run_head(fused_trl.FusedceLogProbHead, h, w, b, t, 1.0, scale, outputs, softcap)
        theirs, tg = run_head(ChunkedLogProbFunction, h, w, b, t, 1.0, scale, outputs, softcap)
        for x, y in zip(ours + tuple(og), theirs + tuple(tg)):
            assert (x is None and y is None) or torch.equal(x, y)
    assert fused_trl.can_serve(None, 1.0, OUTPUTS)


def test_apply_and_revert_swap_one_name():
    original = trl_utils._ChunkedLogProbFunction
    fused_trl.apply()
    fused_trl.apply()
    assert trl_utils._ChunkedLogProbFunction is fused_trl.FusedceLogProbHead and fused_trl.is_applied()
    fused_trl.revert()
    assert trl_utils._ChunkedLogProbFunction is original and not fused_trl.is_applied()


# ---- one step of TRL's GRPO and RLOO trainers ---------------------------------------------------

VOCAB = ["<pad>", "<eos>"] + [f"w{i}" for i in range(150)]


def tiny_tokenizer():
    """A word-level tokenizer over VOCAB, built here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


def tiny_model(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def reward_even_words(completions, **kwargs):
    """A fixed reward: the share of even-numbered words in the completion."""
    out = []
    for c in completions:
        words = [w for w in c.split() if w.startswith("w")]
        out.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(1, len(words)))
    return out


class GradientSnapshot:
    """A trainer callback that keeps every parameter's gradient just before the optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        snap = self

        class _Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                snap.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

        self.callback = _Callback()
        self.grads = None


def one_step(trainer_name, tmp_path, use_fusedce, planted=None, **config):
    """The loss and every gradient of one step of TRL's `trainer_name` ("grpo" or "rloo"), its
    config's defaults here overridden by `config`."""
    from datasets import Dataset

    if use_fusedce:
        fused_trl.apply()
    else:
        fused_trl.revert()
    original_apply = fused_trl.FusedceLogProbHead.apply
    if planted is not None:  # a planted error in the log-probabilities fusedce returns
        def planted_apply(*args, **kwargs):
            out = original_apply(*args, **kwargs)
            return (out[0] * (1 + planted),) + tuple(out[1:])
        fused_trl.FusedceLogProbHead.apply = staticmethod(planted_apply)
    try:
        prompts = Dataset.from_dict({"prompt": [" ".join(f"w{(7 * i + k) % 150}" for k in range(5)) for i in range(4)]})
        snapshot = GradientSnapshot()
        common = dict(output_dir=str(tmp_path / f"{trainer_name}_{use_fusedce}"), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=1, learning_rate=1e-3,
                      report_to=[], use_cpu=True, seed=11, logging_steps=1, save_strategy="no", bf16=False,
                      beta=0.04, max_grad_norm=0.0)  # no clipping: it would hide a uniform scale error
        common.update(config)
        if trainer_name == "grpo":
            from trl import GRPOConfig as Config, GRPOTrainer as Trainer
        else:
            from trl import RLOOConfig as Config, RLOOTrainer as Trainer
        # The model from a local folder, so that TRL builds the reference model (beta > 0) from it too.
        model_dir = tmp_path / "tiny_model"  # shared by the runs of one test
        if not model_dir.exists():
            tiny_model(seed=2).save_pretrained(model_dir)
        common["output_dir"] += "_" + "_".join(f"{k}{v}" for k, v in sorted(config.items()))
        trainer = Trainer(model=str(model_dir), reward_funcs=reward_even_words, args=Config(**common),
                          train_dataset=prompts, processing_class=tiny_tokenizer(), callbacks=[snapshot.callback])
        trainer.train()
        loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
        return loss, snapshot.grads
    finally:
        fused_trl.FusedceLogProbHead.apply = staticmethod(original_apply)
        fused_trl.revert()


@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
def test_one_trainer_step_equals_trls_own(trainer_name, tmp_path):
    theirs_loss, theirs = one_step(trainer_name, tmp_path, use_fusedce=False)
    ours_loss, ours = one_step(trainer_name, tmp_path, use_fusedce=True)
    assert theirs and set(ours) == set(theirs)
    assert abs(ours_loss - theirs_loss) <= 1e-5 * max(1.0, abs(theirs_loss)), (ours_loss, theirs_loss)
    worst = max((ours[n] - theirs[n]).abs().max().item() / max(theirs[n].abs().max().item(), 1e-12) for n in theirs)
    assert worst < 1e-4, worst
    # The comparison can fail: log-probabilities 0.1% too large move the gradients past it.
    _, planted = one_step(trainer_name, tmp_path, use_fusedce=True, planted=1e-3)
    worst = max((planted[n] - theirs[n]).abs().max().item() / max(theirs[n].abs().max().item(), 1e-12) for n in theirs)
    assert worst >= 1e-4, worst


def _worst(ours, theirs):
    return max((ours[n] - theirs[n]).abs().max().item() / max(theirs[n].abs().max().item(), 1e-12) for n in theirs)


@pytest.mark.parametrize("config", [
    dict(loss_type="grpo"), dict(loss_type="bnpo"), dict(loss_type="dr_grpo"), dict(loss_type="cispo"),
    dict(loss_type="sapo"), dict(loss_type="luspo"), dict(loss_type="vespo"),
    dict(loss_type="dapo", top_entropy_quantile=0.3),  # the high-entropy token mask
    dict(loss_type="dapo", entropy_coef=0.05),  # the entropy bonus: a gradient through the entropy
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grpo_loss_variants_equal_trls_own(config, tmp_path):
    """Every GRPO loss type, top-entropy masking and the entropy bonus: the loss and every
    gradient of one step equal TRL's own run (the head sits below the loss, so each variant
    only changes what reaches it: the entropy's mask and its own gradient). Seen: within 5e-7
    of each parameter's largest entry; the bound is 1e-5, which an entropy 1% too large exceeds
    in the entropy-bonus case (4.2e-5, tried once)."""
    theirs_loss, theirs = one_step("grpo", tmp_path, use_fusedce=False, **config)
    ours_loss, ours = one_step("grpo", tmp_path, use_fusedce=True, **config)
    assert theirs and set(ours) == set(theirs)
    assert abs(ours_loss - theirs_loss) <= 1e-5 * max(1.0, abs(theirs_loss)), (ours_loss, theirs_loss)
    assert _worst(ours, theirs) < 1e-5
