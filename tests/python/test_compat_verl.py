"""fusedce.compat.verl.linear_cross_entropy against a reference of verl's semantics written here
(verl's fused kernel: z = hidden @ weight.T / temperature; log_probs = log softmax(z)[label],
entropy of softmax(z), float32, per token; the reduction on log_probs alone; a tensor-parallel
group holding equal vocabulary blocks in rank order): values, gradients through both outputs,
leading dimensions, reductions, bad arguments named, and the vocabulary-parallel form on a
gloo group."""

import pytest
import torch
import torch.distributed as dist

from fusedce.compat.verl import linear_cross_entropy
from conftest import DEVICES
from gloo_groups import failures_of, spawn_group


def verl_reference(hidden, weight, labels, temperature, reduction="none"):
    """verl's semantics in float64 (inputs upcast), differentiable."""
    return verl_reference_over(hidden.double() @ weight.double().T, labels, temperature, reduction)


def verl_reference_over(logits, labels, temperature, reduction="none"):
    """The same from float64 logits."""
    z = logits / temperature
    logp = torch.log_softmax(z, dim=-1)
    log_probs = logp.gather(-1, labels[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    if reduction == "sum":
        log_probs = log_probs.sum()
    elif reduction == "mean":
        log_probs = log_probs.mean()
    return log_probs, entropy


def policy_problem(shape, hid, vocab, dtype, device, seed):
    """hidden (*shape, hid), weight (vocab, hid), labels (*shape): a peaked, trained-looking
    policy (each row's sampled token mostly its likely one, well above the rest)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    h = torch.randn(n, hid, generator=g)
    w = torch.randn(vocab, hid, generator=g) / hid ** 0.5
    likely = torch.randint(0, vocab, (n,), generator=g)
    w[likely] += 3.0 * h / h.norm(dim=1, keepdim=True)
    labels = torch.where(torch.rand(n, generator=g) < 0.7, likely, torch.randint(0, vocab, (n,), generator=g))
    return (h.reshape(*shape, hid).to(dtype).to(device), w.to(dtype).to(device), labels.reshape(shape).to(device))


def objective(log_probs, entropy, seed):
    """Weights of both outputs, so that the gradient goes through each."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(log_probs.shape, generator=g, dtype=torch.float64)
    b = torch.randn(entropy.shape, generator=g, dtype=torch.float64)
    return (log_probs.double() * a.to(log_probs.device)).sum() + (entropy.double() * b.to(entropy.device)).sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(37,), (2, 9)], ids=["2d", "3d"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_verl_semantics(device, dtype, shape, reduction, temperature):
    h, w, labels = policy_problem(shape, 24, 1031, dtype, device, seed=len(shape) * 11 + int(temperature * 10))
    hl, wl = (x.detach().clone().requires_grad_(True) for x in (h, w))
    log_probs, entropy = linear_cross_entropy(hl, wl, labels, temperature, reduction)
    assert log_probs.dtype == entropy.dtype == torch.float32
    assert entropy.shape == labels.shape
    assert log_probs.shape == (labels.shape if reduction == "none" else ())
    hr, wr = (x.detach().double().cpu().requires_grad_(True) for x in (h, w))
    lp_ref, ent_ref = verl_reference(hr, wr, labels.cpu(), temperature, reduction)
    if reduction == "none":
        assert (log_probs <= 0).all()
    # float32, and the CPU in any dtype (its logits stay float32): float32 arithmetic. A GPU keeps
    # a 16-bit input's logits in that dtype, as PyTorch's own head does: three times PyTorch's
    # error on the same inputs (F.linear in the dtype, then float64).
    tol = 2e-5
    if dtype != torch.float32 and device != "cpu":
        own_lp, own_ent = verl_reference_over(torch.nn.functional.linear(h, w).double().cpu(), labels.cpu(),
                                              temperature, reduction)
        tol = max(tol, 3 * max((own_lp - lp_ref).abs().max().item(), (own_ent - ent_ref).abs().max().item()))
    torch.testing.assert_close(log_probs.double().cpu(), lp_ref.detach(), rtol=tol, atol=tol * max(1, labels.numel() if reduction == "sum" else 1))
    torch.testing.assert_close(entropy.double().cpu(), ent_ref.detach(), rtol=tol, atol=tol)
    objective(log_probs, entropy, 5).backward()
    objective(lp_ref, ent_ref, 5).backward()
    for got, ref, name in ((hl.grad, hr.grad, "hidden"), (wl.grad, wr.grad, "weight")):
        assert got.dtype == dtype and got.shape == ref.shape, name
        scale = ref.abs().max().item()
        # the gradient rounded to its dtype (bf16: 2^-8), four units; on a GPU, bf16 dlogits too
        gtol = 1e-4 if dtype == torch.float32 else 1.6e-2 if device == "cpu" else 4e-2
        torch.testing.assert_close(got.double().cpu(), ref, rtol=gtol, atol=gtol * scale, msg=lambda m: f"grad_{name}: {m}")


def test_planted_errors_fail():
    """The comparison can fail: the cross-entropy (minus log_probs) in place of log_probs, and a
    temperature 0.5% off (in bfloat16 on the CPU too)."""
    h, w, labels = policy_problem((20,), 16, 211, torch.float32, "cpu", seed=3)
    log_probs, _ = linear_cross_entropy(h, w, labels)
    ref, ent_ref = verl_reference(h, w, labels, 1.0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(-log_probs.double(), ref, rtol=2e-5, atol=2e-5)
    hb, wb = h.bfloat16(), w.bfloat16()
    ref, ent_ref = verl_reference(hb, wb, labels, 1.0)
    log_probs, entropy = linear_cross_entropy(hb, wb, labels, 1.005)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(log_probs.double(), ref, rtol=2e-5, atol=2e-5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(entropy.double(), ent_ref, rtol=2e-5, atol=2e-5)


def test_bad_arguments_are_named():
    h, w, labels = policy_problem((6,), 8, 50, torch.float32, "cpu", seed=1)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, labels, 1.0, "avg")
    with pytest.raises(ValueError, match="temperature"):
        linear_cross_entropy(h, w, labels, 0.0)
    bad = labels.clone()
    bad[2] = 50
    with pytest.raises(ValueError, match=r"tokens\[2\]"):
        linear_cross_entropy(h, w, bad)


def _tp_case(key, group, rank, world):
    h, w, labels = policy_problem((3, 7), 16, 120 * world, torch.float32, "cpu", seed=9)
    block = w.shape[0] // world
    leaves = [x.detach().clone().requires_grad_(True) for x in (h, w[rank * block:(rank + 1) * block])]
    lp, ent = linear_cross_entropy(leaves[0], leaves[1], labels, 0.8, "none", dist_process_group=group)
    hr, wr = (x.detach().double().requires_grad_(True) for x in (h, w))
    lp_ref, ent_ref = verl_reference(hr, wr, labels, 0.8)
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), rtol=2e-5, atol=2e-5)
    objective(lp, ent, 2).backward()
    objective(lp_ref, ent_ref, 2).backward()
    torch.testing.assert_close(leaves[0].grad.double(), hr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(leaves[1].grad.double(), wr.grad[rank * block:(rank + 1) * block], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_tensor_parallel_group_matches_the_whole_head(tmp_path_factory):
    results = spawn_group(2, ["tp"], _tp_case, tmp_path_factory, timeout_s=120, deadline_s=400)
    failures = failures_of(results, "tp")
    assert not failures, failures


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,vocab", [(0, 50), (7, 1), (5, 3)], ids=["no_tokens", "V1", "V3"])
def test_awkward_shapes(device, n, vocab):
    """No tokens (empty outputs, zero gradients), a vocabulary of one (log-prob 0, entropy 0,
    zero gradients) and of three, against the float64 reference."""
    h, w, labels = policy_problem((n,), 8, vocab, torch.float32, device, seed=n + vocab)
    hl, wl = (x.detach().clone().requires_grad_(True) for x in (h, w))
    lp, ent = linear_cross_entropy(hl, wl, labels, 0.9)
    hr, wr = (x.detach().double().cpu().requires_grad_(True) for x in (h, w))
    lp_ref, ent_ref = verl_reference(hr, wr, labels.cpu(), 0.9)
    assert lp.shape == ent.shape == (n,)
    torch.testing.assert_close(lp.double().cpu(), lp_ref.detach(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent.double().cpu(), ent_ref.detach(), rtol=2e-5, atol=2e-5)
    objective(lp, ent, 3).backward()
    if n:
        objective(lp_ref, ent_ref, 3).backward()
        torch.testing.assert_close(hl.grad.double().cpu(), hr.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(wl.grad.double().cpu(), wr.grad, rtol=1e-4, atol=1e-6)
    else:
        assert hl.grad.shape == h.shape and not hl.grad.any()
        assert wl.grad.shape == w.shape and not wl.grad.any()
    if vocab == 1 and n:
        assert not lp.any() and not ent.any() and not wl.grad.any()
