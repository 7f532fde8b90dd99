"""fusedce.integrations.trl's distillation seam: FusedceDivergence in place of TRL's
ChunkedDivergenceFunction (trl.trainer.distillation_trainer's name for it). The function alone
against TRL's own (its torch path on the CPU) on random heads, values and student gradients; the
calls it hands back to TRL; one step of the trainer's _chunked_divergence_loss on two tiny Llama
models, loss, entropy and every student gradient equal with and without apply(); a planted
relative error of 1e-5 on the divergence caught by both (the step's gradients, through the
model, by a planted 1e-3); apply/revert idempotent.

Tolerances: both sides compute in float32 from the same float32 inputs, each with its own order
of the sums (H-term products, V-term row sums), so they differ by float32 rounding: a few units of
2^-24 of the terms summed. VALUE_TOL and GRAD_TOL say how many; the planted error (1e-5 of the
value, about 170 units) is far outside them."""

import pytest
import torch

trl = pytest.importorskip("trl")
distillation_trainer = pytest.importorskip("trl.trainer.distillation_trainer")
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction  # noqa: E402

import fusedce.integrations.trl as fused_trl  # noqa: E402

U32 = 2.0 ** -24
VALUE_TOL = 32 * U32  # relative to max(1, the largest |value|)
GRAD_TOL = 64 * U32  # relative to the largest |gradient| of that tensor
PLANTED = 1e-5
STEP_GRAD_TOL = 1e-4  # the trainer step's gradients: see test_one_loss_step_equals_trls_own


@pytest.fixture(autouse=True)
def _reverted():
    fused_trl.revert()
    yield
    fused_trl.revert()


def heads(n, h_s, h_t, vocab, seed, bias):
    """Student and teacher heads whose distributions are peaked and correlated: the teacher's
    head leans towards the student's likely token of each row."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h_s, generator=g)
    ws = torch.randn(vocab, h_s, generator=g) * (2.0 / h_s ** 0.5)
    ht = torch.randn(n, h_t, generator=g)
    wt = torch.randn(vocab, h_t, generator=g) * (2.0 / h_t ** 0.5)
    likely = (hs @ ws.T).argmax(-1)
    wt[likely] += 2.0 * ht / ht.norm(dim=1, keepdim=True)
    bs = torch.randn(vocab, generator=g) * 0.3 if bias else None
    bt = torch.randn(vocab, generator=g) * 0.3 if bias else None
    return hs, ws, bs, ht, wt, bt


def run(fn, problem, *options):
    """fn.apply on fresh student leaves; a weighted sum of the divergence backward. Returns the
    divergence, the entropy and the student's gradients."""
    hs, ws, bs, ht, wt, bt = problem
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in (hs, ws, bs)]
    div, ent = fn.apply(leaves[0], leaves[1], leaves[2], ht, wt, bt, *options)
    weights = torch.linspace(0.5, 1.5, div.shape[0], device=div.device)
    (div * weights).sum().backward()
    return div, ent, [None if x is None else x.grad for x in leaves]


def planted(scale):
    """FusedceDivergence.apply with its divergence multiplied by `scale` (a planted error)."""
    original = fused_trl.FusedceDivergence.apply

    def wrong(*args, **kwargs):
        div, ent = original(*args, **kwargs)
        return div * scale, ent
    return original, staticmethod(wrong)


def assert_values_close(got, want, name):
    assert got.dtype == torch.float32 and got.shape == want.shape, name
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert err <= VALUE_TOL * max(1.0, want.abs().max().item() if want.numel() else 0.0), (name, err)


def assert_grads_close(got, want, name):
    assert (got is None) == (want is None), name
    if got is not None:
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if got.numel() == 0:
            return
        err = (got.double() - want.double()).abs().max().item()
        assert err <= GRAD_TOL * want.abs().max().item(), (name, err, want.abs().max().item())


OPTIONS = [  # beta, temperature, student scale, student softcap, teacher scale, teacher softcap
    (0.0, 1.0, 1.0, None, 1.0, None),
    (0.3, 1.3, 0.9, 4.0, 1.2, None),
    (1.0, 0.8, 1.0, None, 0.7, 6.0),
    (0.5, 1.0, 1.0, 30.0, 1.0, 30.0),
]


def compare(problem, options):
    ours = run(fused_trl.FusedceDivergence, problem, *options)
    theirs = run(ChunkedDivergenceFunction, problem, *options)
    assert_values_close(ours[0], theirs[0], "divergence")
    assert_values_close(ours[1], theirs[1], "entropy")
    assert not ours[1].requires_grad
    for name, x, y in zip(("hidden", "weight", "bias"), ours[2], theirs[2]):
        assert_grads_close(x, y, f"grad {name}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("options", OPTIONS, ids=["fkl", "jsd0.3_capped_student", "rkl_capped_teacher", "jsd_both_capped"])
def test_divergence_matches_trls(bias, options):
    problem = heads(29, 24, 40, 301, seed=4, bias=bias)
    assert fused_trl.can_serve_divergence(problem, *options)
    compare(problem, options)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("options", OPTIONS, ids=["fkl", "jsd0.3_capped_student", "rkl_capped_teacher", "jsd_both_capped"])
def test_divergence_matches_trls_on_cuda(dtype, options):
    """On a GPU fusedce's CUDA path serves the seam; TRL's side is its Triton kernel. float32:
    the CPU test's bounds. bfloat16 (the trainer's usual dtype, both heads' logits in it): each
    side rounds its logits to bfloat16 (2^-8) in its own order of the H-term products, so the two
    differ by bfloat16 rounding: 2^-6 of the largest value or gradient (a planted 1e-2 error
    would show)."""
    problem = tuple(None if x is None else x.to("cuda", dtype) for x in heads(29, 24, 40, 301, seed=4, bias=True))
    assert fused_trl.can_serve_divergence(problem, *options)
    if dtype == torch.float32:
        compare(problem, options)
        return
    ours = run(fused_trl.FusedceDivergence, problem, *options)
    theirs = run(ChunkedDivergenceFunction, problem, *options)
    for x, y, name in ((ours[0], theirs[0], "divergence"), (ours[1], theirs[1], "entropy")):
        assert x.dtype == torch.float32 and x.shape == y.shape, name
        assert (x - y).abs().max().item() <= 2.0 ** -6 * max(1.0, y.abs().max().item()), name
    for name, x, y in zip(("hidden", "weight", "bias"), ours[2], theirs[2]):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert (x.float() - y.float()).abs().max().item() <= 2.0 ** -6 * y.float().abs().max().item(), name


@needs_gpu
def test_cuda_step_matches_the_cpu_step():
    """The same problem through the seam on the GPU and on the CPU (float32): equal within the
    CPU comparison's bounds (both are fusedce's; only their orders of the sums differ)."""
    problem = heads(29, 24, 40, 301, seed=9, bias=True)
    options = OPTIONS[1]
    cpu = run(fused_trl.FusedceDivergence, problem, *options)
    gpu = run(fused_trl.FusedceDivergence, tuple(None if x is None else x.cuda() for x in problem), *options)
    assert_values_close(gpu[0].cpu(), cpu[0], "divergence")
    assert_values_close(gpu[1].cpu(), cpu[1], "entropy")
    for name, x, y in zip(("hidden", "weight", "bias"), gpu[2], cpu[2]):
        assert_grads_close(x.cpu(), y, f"grad {name}")


@pytest.mark.parametrize("n,vocab", [(0, 40), (5, 1), (9, 3)], ids=["no_tokens", "V1", "V3"])
def test_divergence_on_awkward_shapes(n, vocab):
    compare(heads(n, 8, 12, vocab, seed=2, bias=True), (0.5, 1.1, 1.0, None, 1.0, None))


def test_planted_error_fails_the_comparison():
    problem = heads(29, 24, 40, 301, seed=4, bias=True)
    original, wrong = planted(1 + PLANTED)
    fused_trl.FusedceDivergence.apply = wrong
    try:
        with pytest.raises(AssertionError):
            compare(problem, OPTIONS[1])
    finally:
        fused_trl.FusedceDivergence.apply = staticmethod(original)
    compare(problem, OPTIONS[1])


def test_calls_fusedce_cannot_serve_go_to_trl():
    """A logit scale of 0 (fusedce refuses it; TRL takes it), tensors on a meta device or on two
    devices: TRL's own function, bit for bit (the first), or not served."""
    problem = heads(11, 16, 20, 97, seed=5, bias=True)
    options = (0.5, 1.0, 0.0, None, 1.0, None)
    assert not fused_trl.can_serve_divergence(problem, *options)
    ours, theirs = run(fused_trl.FusedceDivergence, problem, *options), run(ChunkedDivergenceFunction, problem, *options)
    for x, y in zip(ours[:2] + tuple(ours[2]), theirs[:2] + tuple(theirs[2])):
        assert torch.equal(x, y)
    meta = tuple(None if x is None else x.to("meta") for x in problem)
    assert not fused_trl.can_serve_divergence(meta, 0.5, 1.0, 1.0, None, 1.0, None)
    mixed = problem[:3] + meta[3:]
    assert not fused_trl.can_serve_divergence(mixed, 0.5, 1.0, 1.0, None, 1.0, None)
    assert not fused_trl.can_serve_divergence(problem, 1.5, 1.0, 1.0, None, 1.0, None)


def test_apply_and_revert_swap_both_names():
    import trl.trainer.utils as trl_utils

    logprob, divergence = trl_utils._ChunkedLogProbFunction, distillation_trainer.ChunkedDivergenceFunction
    assert divergence is ChunkedDivergenceFunction
    fused_trl.apply()
    fused_trl.apply()
    assert fused_trl.is_applied()
    assert distillation_trainer.ChunkedDivergenceFunction is fused_trl.FusedceDivergence
    assert trl_utils._ChunkedLogProbFunction is fused_trl.FusedceLogProbHead
    fused_trl.revert()
    fused_trl.revert()
    assert not fused_trl.is_applied()
    assert distillation_trainer.ChunkedDivergenceFunction is divergence
    assert trl_utils._ChunkedLogProbFunction is logprob


# ---- one step of the trainer's loss on tiny models -----------------------------------------------

VOCAB = 151


def tiny_llama(seed, hidden, head_scale):
    """A random tiny Llama whose head is scaled so that its next-token distribution is peaked
    (a random init's is near uniform, and the divergence between two near 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def loss_step(use_fusedce, plant=None):
    """TRL's _chunked_divergence_loss on a student (H 32) and a teacher (H 48) over one batch of
    completions with padding: the loss, the entropy sum and every student gradient."""
    student, teacher = tiny_llama(3, 32, 40.0), tiny_llama(4, 48, 60.0)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, VOCAB, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = 0
    mask[2, :2] = 0
    if use_fusedce:
        fused_trl.apply()
    original = fused_trl.FusedceDivergence.apply
    if plant is not None:
        fused_trl.FusedceDivergence.apply = planted(1 + plant)[1]
    try:
        hs = student.model(input_ids=ids).last_hidden_state
        with torch.no_grad():
            ht = teacher.model(input_ids=ids).last_hidden_state
        loss, entropy_sum, n_valid = distillation_trainer._chunked_divergence_loss(
            hs, ht, student.lm_head.weight, teacher.lm_head.weight, mask, beta=0.4, temperature=0.9)
        loss.backward()
    finally:
        fused_trl.FusedceDivergence.apply = staticmethod(original)
        fused_trl.revert()
    assert int(n_valid) == int(mask.sum())
    return loss.detach(), entropy_sum.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}


def worst_grad(ours, theirs):
    return max((ours[n] - theirs[n]).abs().max().item() / max(theirs[n].abs().max().item(), 1e-30) for n in theirs)


def test_one_loss_step_equals_trls_own():
    theirs_loss, theirs_entropy, theirs = loss_step(use_fusedce=False)
    assert 0.1 < theirs_loss.item() < 10, theirs_loss  # a divergence the planted error moves
    ours_loss, ours_entropy, ours = loss_step(use_fusedce=True)
    assert set(ours) == set(theirs)
    assert abs(ours_loss.item() - theirs_loss.item()) <= VALUE_TOL * max(1.0, abs(theirs_loss.item()))
    assert abs(ours_entropy.item() - theirs_entropy.item()) <= VALUE_TOL * abs(theirs_entropy.item())
    # The gradients go back through the head's peaked softmaxes (p_s - p_t-like differences of
    # O(1) terms) and two layers: float32's differences reach a few hundred units of 2^-24 of a
    # tensor's largest entry, so STEP_GRAD_TOL is 1e-4 of it.
    assert worst_grad(ours, theirs) <= STEP_GRAD_TOL, worst_grad(ours, theirs)
    # The comparison can fail: a divergence 1e-5 too large moves the loss past VALUE_TOL, one
    # 1e-3 too large moves the gradients past STEP_GRAD_TOL.
    planted_loss, _, _ = loss_step(use_fusedce=True, plant=PLANTED)
    assert abs(planted_loss.item() - theirs_loss.item()) > VALUE_TOL * max(1.0, abs(theirs_loss.item()))
    _, _, wrong = loss_step(use_fusedce=True, plant=1e-3)
    assert worst_grad(wrong, theirs) > STEP_GRAD_TOL, worst_grad(wrong, theirs)
