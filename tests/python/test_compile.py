"""torch.compile(fullgraph=True) of code calling fusedce.cross_entropy, forward and backward: no
graph break, the same numbers as eager, and the fused path in the compiled graphs (ce_fwd_bwd in
the forward, only ce_rescale_ in the backward: the gradient is not recomputed)."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import fusedce
from conftest import DEVICES, make_problem


def _head(device, dtype=torch.float32, n=24, hidden=32, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g) * 0.5).to(dtype).to(device).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).to(device).requires_grad_(True)
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    t[::5] = -100
    return h, w, t


def _grads(fn, h, w, t):
    h.grad = w.grad = None
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def step(h, w, t):
    # a language model's head and loss; the factor makes the upstream gradient differ from 1
    logits = h @ w.t()
    return fusedce.cross_entropy(logits, t, label_smoothing=0.1, z_loss=1e-4, softcap=30.0) * 3.0


@pytest.mark.parametrize("device", DEVICES)
def test_compile_matches_eager(device):
    torch._dynamo.reset()
    h, w, t = _head(device)
    eager = _grads(step, h, w, t)
    compiled = _grads(torch.compile(step, fullgraph=True), h, w, t)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_graphs_use_the_fused_path(device):
    torch._dynamo.reset()
    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm.code
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    h, w, t = _head(device)
    eager = _grads(step, h, w, t)
    compiled = _grads(torch.compile(step, fullgraph=True, backend=backend), h, w, t)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert "fusedce.ce_fwd_bwd" in graphs["forward"]
    assert "fusedce.ce_rescale_" in graphs["backward"]
    assert "fusedce.ce_bwd" not in graphs["backward"] and "fusedce.ce_fwd" not in graphs["backward"]


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_shapes_metrics_and_inplace_fallback(device):
    # Symbolic batch sizes through the fake kernels; metrics and 'none' out of a compiled graph;
    # inplace_backward=True falls back to the out-of-place path under compile (same numbers).
    torch._dynamo.reset()

    def fn(x, t):
        loss, m = fusedce.cross_entropy(x, t, reduction="none", return_metrics=True,
                                        inplace_backward=True)
        return loss.sum() * 0.5, m["num_correct_tokens"], m["entropy_sum"], m["lse"]

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for n in (7, 19):
        x, t = make_problem((n,), 50, device=device, seed=n)
        xc = x.clone().requires_grad_(True)
        xe = x.clone().requires_grad_(True)
        out_c = compiled(xc, t)
        out_e = fn(xe * 1.0, t)  # eager overwrites its logits: not a leaf, which autograd forbids
        out_c[0].backward()
        out_e[0].backward()
        for a, b in zip(out_c, out_e):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(xc.grad, xe.grad)
        assert torch.equal(xc.detach(), x)  # not overwritten under compile


@pytest.mark.parametrize("device", DEVICES)
def test_compile_forward_only(device):
    torch._dynamo.reset()
    x, t = make_problem((2, 9), 64, torch.bfloat16, device)
    fn = torch.compile(lambda a, b: fusedce.cross_entropy(a, b, reduction="sum"), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(fn(x, t), fusedce.cross_entropy(x, t, reduction="sum"))


# ---- fused linear cross-entropy ------------------------------------------------------------


def _linear_head(device, dtype=torch.float32, b=2, s=9, hidden=16, vocab=130, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(b, s, hidden, generator=g)).to(dtype).to(device).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).to(device).requires_grad_(True)
    bias = (torch.randn(vocab, generator=g) * 0.1).to(dtype).to(device).requires_grad_(True)
    t = torch.randint(0, vocab, (b, s), generator=g).to(device)
    t[:, ::4] = -100
    return h, w, bias, t


def _linear_grads(fn, h, w, bias, t):
    for x in (h, w, bias):
        x.grad = None
    loss = fn(h, w, bias, t)
    loss.backward()
    return loss.detach(), h.grad.clone(), w.grad.clone(), bias.grad.clone()


def linear_step(h, w, bias, t):
    # a language model's head and loss without logits; the factor makes the upstream gradient 3
    return fusedce.linear_cross_entropy(h, w, t, bias, label_smoothing=0.1, z_loss=1e-4,
                                        softcap=30.0, shift=True) * 3.0


def linear_step_none(h, w, bias, t):
    # 'none' with a per-row upstream gradient: the backward recomputes with it
    loss = fusedce.linear_cross_entropy(h, w, t, bias, reduction="none", logit_scale=0.5)
    return (loss * torch.linspace(0.5, 2.0, loss.shape[-1], device=loss.device)).sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step,forward_op,backward_op", [
    (linear_step, "fusedce.lce_fwd_bwd", "fusedce.ce_rescale_"),
    (linear_step_none, "fusedce.lce_fwd", "fusedce.lce_fwd_bwd"),
], ids=["mean", "none"])
def test_compile_linear(device, step, forward_op, backward_op):
    # fullgraph: no graph break; the same numbers as eager; with 'mean' the gradients come from
    # the forward's lce_fwd_bwd and the backward only scales them.
    torch._dynamo.reset()
    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm.code
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    inputs = _linear_head(device)
    eager = _linear_grads(step, *inputs)
    compiled = _linear_grads(torch.compile(step, fullgraph=True, backend=backend), *inputs)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert forward_op in graphs["forward"]
    assert backward_op in graphs["backward"]
    if step is linear_step:
        assert "fusedce.lce" not in graphs["backward"]
    inductor = _linear_grads(torch.compile(step, fullgraph=True), *inputs)
    for a, b in zip(inductor, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_linear_dynamic_shapes_and_metrics(device):
    torch._dynamo.reset()

    def fn(h, w, t):
        loss, m = fusedce.linear_cross_entropy(h, w, t, return_metrics=True, shift=True)
        return loss, m["num_correct_tokens"], m["entropy_sum"], m["lse"]

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for s in (7, 12):
        h, w, _, t = _linear_head(device, s=s, seed=s)
        out_c = compiled(h, w, t)
        out_e = fn(h, w, t)
        for a, b in zip(out_c, out_e):
            torch.testing.assert_close(a, b)
