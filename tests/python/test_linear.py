"""fusedce.linear_cross_entropy against a float64 reference built from F.linear and
F.cross_entropy (with the contract's formulas for scale, softcap and z-loss, conftest's
torch_cross_entropy): every option alone and together, the three dtypes, odd shapes, 30 %
ignored targets, bias, the causal shift, every reduction, metrics, gradients only where they are
required, and bad input. The error budget is PyTorch's own error in the same dtype (F.linear and
F.cross_entropy in that dtype) times a small factor."""


import pytest
import torch
import torch.nn.functional as F

import fusedce
import fusedce.linear_ops
from conftest import (DEVICES, DTYPES, assert_within_budget, make_weight, requires_cuda,
                      torch_cross_entropy)

OPTIONS = {
    "plain": {},
    "class_weight": {"class_weight": True},
    "smoothing": {"label_smoothing": 0.1},
    "scale": {"logit_scale": 0.6},
    "softcap": {"softcap": 4.0},
    "zloss": {"z_loss": 1e-3},
    "everything": {"class_weight": True, "label_smoothing": 0.1, "logit_scale": 1.3, "softcap": 6.0,
                   "z_loss": 1e-2, "ignore_index": 3},
}

# (rows, H, V): an odd shape (no vector width divides H or V); a language model's
# (B, S) rows over more than one vocabulary tile; enough rows for several row chunks.
SHAPES = [((3,), 67, 1001), ((2, 9), 32, 300), ((70,), 24, 129)]


def make_linear_problem(shape, hidden_size, vocab, dtype=torch.float32, device="cpu", *,
                        bias=False, ignore_frac=0.3, ignore_index=-100, seed=0):
    """hidden (*shape, H), weight (V, H), bias (V,) or None, target (*shape) with about
    `ignore_frac` of it ignored. Logits have unit spread, and a few vocabulary rows of weight
    are six times larger, so that some logits stand far above the rest (the softmax is not
    flat) and about a third of the targets are those confident answers."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden_size, generator=g)
    w = torch.randn(vocab, hidden_size, generator=g) / hidden_size ** 0.5
    hot = torch.randperm(vocab, generator=g)[: max(1, vocab // 100)]
    w[hot] *= 6.0
    b = torch.randn(vocab, generator=g) * 0.5 if bias else None
    t = torch.randint(0, vocab, shape, generator=g)
    t = torch.where(torch.rand(shape, generator=g) < 0.3, hot[0], t)
    t[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    move = lambda x: None if x is None else x.to(dtype).to(device)  # noqa: E731
    return move(h), move(w), move(b), t.to(device)


def shifted(target, ignore_index=-100):
    """The targets a causal shift reads: row i gets target i + 1, the last row of each sequence
    (the last dimension) is ignored."""
    pad = torch.full_like(target[..., :1], ignore_index)
    return torch.cat([target[..., 1:], pad], dim=-1)


def reference(hidden, weight, target, bias=None, *, class_weight=None, shift=False,
              compute_dtype=None, ignore_index=-100, **opts):
    """Linear CE as docs/contract.md defines it, written with PyTorch ops, in `compute_dtype`
    (float64: the reference; the inputs' dtype: PyTorch's own result, whose error sets the
    budget)."""
    dt = compute_dtype or hidden.dtype
    logits = F.linear(hidden.to(dt), weight.to(dt), None if bias is None else bias.to(dt))
    if shift:
        target = shifted(target, ignore_index)
    return torch_cross_entropy(logits, target, class_weight, ignore_index=ignore_index,
                               compute_dtype=dt, **opts)


def loss_and_grads(fn, tensors, grad_out=None):
    """fn(*leaves) and the gradient of sum(fn * grad_out) for fresh leaves holding `tensors`
    (None entries stay None and get no gradient)."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in tensors]
    loss = fn(*leaves)
    inputs = [x for x in leaves if x is not None]
    g = torch.ones_like(loss) if grad_out is None else grad_out.to(loss.dtype)
    return loss.detach(), torch.autograd.grad(loss, inputs, g)


def linear_error_scales(hidden, weight, target, bias, *, shift, grad_out, reduction,
                        class_weight=None, ignore_index=-100, logit_scale=1.0, softcap=None,
                        z_loss=0.0, **unused):
    """The magnitudes float32 rounding acts on, in units of rounding, as conftest.error_scales
    reasons for logits, plus what the products add. A row's conditioning is
    cond_i = |lse_i| + 1 + max_j |z_ij| + |logit_scale| max_j sum_h |hidden_ih weight_jh| (the
    last term: rounding of the logits' own dot products), times w_max (1 + 2 z_loss |lse_i|).
    dlogits[i, j] is then off by about A_ij = |g_i| cond_i (p_ij + [j == t_i]) |logit_scale|,
    and the products carry A: grad_hidden by A @ |weight|, grad_weight by A.T @ |hidden|,
    grad_bias by A's column sums. Returns the loss scale and those three (largest entries)."""
    vocab, hidden_size = weight.shape
    h = hidden.detach().double().reshape(-1, hidden_size)
    w = weight.detach().double()
    x = F.linear(h, w, None if bias is None else bias.detach().double())
    t = (shifted(target, ignore_index) if shift else target).reshape(-1)
    keep = t != ignore_index
    z = x * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, -1)
    p = torch.softmax(z, -1)
    dots = (h.abs() @ w.abs().t()).max(-1).values * abs(logit_scale)
    w_max = class_weight.max().item() if class_weight is not None else 1.0
    cond = (lse.abs() + 1 + z.abs().max(-1).values + dots) * (1 + 2 * z_loss * lse.abs()) * w_max
    cond = torch.where(keep, cond, 0.0)
    g = torch.ones(()) if grad_out is None else grad_out.detach().double().abs().cpu()
    g = g.reshape(-1).to(cond.device) if reduction == "none" else g.to(cond.device)
    if reduction == "mean":
        denom = class_weight.double()[t[keep]].sum() if class_weight is not None else keep.sum()
        g = g / denom
    loss_scale = cond.max() if reduction == "none" else cond.sum() * (g if reduction == "mean" else 1.0)
    onehot = F.one_hot(torch.where(keep, t, 0), vocab).double()
    a = (g * cond)[:, None] * (p + onehot) * abs(logit_scale)
    scales = [(a @ w.abs()).max(), (a.t() @ h.abs()).max(), a.sum(0).max()]
    return loss_scale.item(), [s.item() for s in scales]


def check_linear(device, dtype, shape, hidden_size, vocab, opts, reduction, *, bias=False,
                 shift=False, grad_scale=1.0, seed=0, error_factor=1.0):
    kw = dict(opts)
    if kw.pop("class_weight", False):
        kw["class_weight"] = make_weight(vocab, device)
    ignore_index = kw.get("ignore_index", -100)
    h, w, b, t = make_linear_problem(shape, hidden_size, vocab, dtype, device, bias=bias,
                                     ignore_index=ignore_index, seed=seed)
    grad_out = None
    if grad_scale != 1.0 or reduction == "none":
        g = torch.Generator().manual_seed(5)
        grad_out = (torch.rand(t.shape if reduction == "none" else (), generator=g) * grad_scale).to(device)

    def ours_fn(h_, w_, b_):
        return fusedce.linear_cross_entropy(h_, w_, t, b_, reduction=reduction, shift=shift, **kw)

    ours = loss_and_grads(ours_fn, (h, w, b), grad_out)
    ours = ours[0], [g * error_factor for g in ours[1]]  # error_factor: only to test this check
    as64 = [None if x is None else x.double() for x in (h, w, b)]
    ref = loss_and_grads(lambda h_, w_, b_: reference(h_, w_, t, b_, reduction=reduction, shift=shift,
                                                      compute_dtype=torch.float64, **kw),
                         as64, None if grad_out is None else grad_out.double())
    theirs = loss_and_grads(lambda h_, w_, b_: reference(h_, w_, t, b_, reduction=reduction,
                                                         shift=shift, **kw), (h, w, b), grad_out)

    assert ours[0].dtype == torch.float32 and ours[0].shape == ref[0].shape
    label = f"{dtype} {shape}x{hidden_size}x{vocab} {opts} {reduction} bias={bias} shift={shift}"
    loss_scale, grad_scales = linear_error_scales(h, w, t, b, shift=shift, grad_out=grad_out,
                                                  reduction=reduction, **kw)
    assert_within_budget(ours[0], theirs[0], ref[0], what=f"loss {label}", scale=loss_scale)
    for name, a, th, r, scale, x in zip(("hidden", "weight", "bias"), ours[1], theirs[1], ref[1],
                                        grad_scales, (h, w, b)):
        assert a.dtype == x.dtype and a.shape == x.shape
        assert_within_budget(a, th, r, what=f"grad_{name} {label}", scale=scale, out_dtype=dtype)


# ---- against the reference ------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,hidden_size,vocab", SHAPES, ids=str)
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_options_mean(device, dtype, shape, hidden_size, vocab, opts):
    check_linear(device, dtype, shape, hidden_size, vocab, opts, "mean")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("opts", [OPTIONS["plain"], OPTIONS["everything"]], ids=["plain", "everything"])
def test_bias_and_reductions(device, dtype, reduction, opts):
    # 'none' with a per-row upstream gradient: the gradients are recomputed with it.
    check_linear(device, dtype, (5, 7), 40, 263, opts, reduction, bias=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_upstream_gradient_not_one(device, dtype, reduction):
    # The gradients formed in the forward are scaled by the upstream gradient in the backward.
    check_linear(device, dtype, (33,), 19, 211, OPTIONS["everything"], reduction, bias=True,
                 grad_scale=3.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 11), (23,)], ids=["BSH", "NH"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_shift(device, dtype, shape, reduction):
    # Row i predicts target i + 1 within each sequence: S rows of (B, S, H), all rows of (N, H).
    check_linear(device, dtype, shape, 29, 170, OPTIONS["everything"], reduction, bias=True,
                 shift=True)


@pytest.mark.parametrize("device", DEVICES)
def test_shift_reads_hidden_in_place(device):
    # shift=True equals an explicit shift of the targets, and hidden is not copied: a strided
    # slice of a wider buffer gives the same numbers as its contiguous copy.
    h, w, b, t = make_linear_problem((3, 8), 20, 90, device=device, bias=True)
    wide = torch.cat([h, torch.randn(3, 8, 5, device=device)], -1)
    strided = wide[..., :20]
    assert not strided.is_contiguous()
    a = fusedce.linear_cross_entropy(strided, w, t, b, shift=True, reduction="none")
    c = fusedce.linear_cross_entropy(h, w, shifted(t), b, reduction="none")
    assert torch.equal(a, c)
    assert torch.equal(a[:, -1], torch.zeros(3, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_metrics(device, dtype):
    h, w, b, t = make_linear_problem((4, 9), 30, 257, dtype, device, bias=True)
    kw = dict(label_smoothing=0.1, softcap=5.0, z_loss=1e-3, reduction="sum", shift=True)
    loss, m = fusedce.linear_cross_entropy(h, w, t, b, return_metrics=True, **kw)
    assert set(m) == {"num_correct_tokens", "entropy_sum", "lse"}
    z = F.linear(h.double(), w.double(), b.double()).reshape(-1, 257)
    z = 5.0 * torch.tanh(z / 5.0)
    t1 = shifted(t).reshape(-1)
    keep = t1 != -100
    assert m["num_correct_tokens"].dtype == torch.int64 and m["num_correct_tokens"].shape == ()
    assert m["num_correct_tokens"].item() == (z.argmax(-1) == t1)[keep].sum().item()
    lse = torch.logsumexp(z, -1)
    entropy = (lse - (torch.softmax(z, -1) * z).sum(-1))[keep].sum()
    # On a GPU 16-bit logits are held in their dtype (as PyTorch's matmul makes them): lse and
    # entropy then carry that rounding, about 2^-8 relative in bfloat16.
    rounded = device != "cpu" and dtype != torch.float32
    rtol = (4e-3 if dtype == torch.bfloat16 else 5e-4) if rounded else 1e-5
    assert m["entropy_sum"].dtype == torch.float32 and m["entropy_sum"].shape == ()
    torch.testing.assert_close(m["entropy_sum"].double(), entropy, rtol=rtol, atol=1e-4 if not rounded else 0.05)
    assert m["lse"].dtype == torch.float32 and m["lse"].shape == (36,)
    torch.testing.assert_close(m["lse"].double(), torch.where(keep, lse, 0.0), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_metrics_leave_loss_and_gradients_bit_identical(device, dtype, reduction):
    h, w, b, t = make_linear_problem((40,), 24, 300, dtype, device, bias=True)
    kw = dict(reduction=reduction, label_smoothing=0.05, z_loss=1e-4, logit_scale=0.9)

    def run(metrics):
        out = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(
            *a[:2], t, a[2], return_metrics=metrics, **kw)[0] if metrics else
            fusedce.linear_cross_entropy(*a[:2], t, a[2], **kw), (h, w, b))
        return out[0], *out[1]

    for a, c in zip(run(True), run(False)):
        assert torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True),
                                   (True, True, False), (False, True, True), (True, True, True)],
                         ids=lambda n: "".join("hwb"[i] for i in range(3) if n[i]))
def test_gradients_only_where_required(device, reduction, needs, monkeypatch):
    # Only the required gradients are formed (the core gets no buffer for the others), each
    # equal to the one of a call where everything requires grad. With 'sum' / 'mean', and with
    # 'none' when only hidden requires grad, the core runs once (forward with gradients);
    # otherwise a forward, and a forward with gradients in the backward.
    h, w, b, t = make_linear_problem((12,), 16, 70, device=device, bias=True)
    calls = []
    real = fusedce.linear_ops.ops

    class Spy:
        def __getattr__(self, name):
            op = getattr(real, name)

            def call(*args):
                if name == "lce_fwd_bwd":
                    calls.append((name, tuple(args[-3:])))
                elif name.startswith("lce"):
                    calls.append((name, None))
                return op(*args)
            call.default = call  # the overload that call_below_autograd is handed
            return call

    monkeypatch.setattr(fusedce.linear_ops, "ops", Spy())
    leaves = [x.clone().requires_grad_(need) for x, need in zip((h, w, b), needs)]
    loss = fusedce.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction=reduction)
    loss.sum().backward()
    if reduction == "mean" or not (needs[1] or needs[2]):
        assert calls == [("lce_fwd_bwd", needs)]
    else:
        assert calls == [("lce_fwd", None), ("lce_fwd_bwd", needs)]
    full = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(a[0], a[1], t, a[2], reduction=reduction),
                          (h, w, b), torch.ones_like(loss))[1]
    for leaf, need, ref in zip(leaves, needs, full):
        if need:
            torch.testing.assert_close(leaf.grad, ref, rtol=1e-6, atol=1e-7)
        else:
            assert leaf.grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_forward_only_without_grad(device):
    h, w, b, t = make_linear_problem((6,), 10, 40, device=device, bias=True)
    with torch.no_grad():
        a = fusedce.linear_cross_entropy(h.requires_grad_(True), w, t, b)
    assert a.grad_fn is None
    ref = reference(h.detach(), w, t, b, compute_dtype=torch.float64)
    torch.testing.assert_close(a.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_retain_graph_backward_twice(device):
    # The saved gradients are scaled in place, except when the graph is kept for another
    # backward (then copies are scaled and the saved ones stay for the next).
    h, w, b, t = make_linear_problem((10,), 12, 50, device=device, bias=True)
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    loss = fusedce.linear_cross_entropy(*leaves[:2], t, leaves[2])
    g1 = torch.autograd.grad(loss * 3.0, leaves, retain_graph=True)
    g2 = torch.autograd.grad(loss * 3.0, leaves, retain_graph=True)
    g3 = torch.autograd.grad(loss * 0.5, leaves)
    ref = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(a[0], a[1], t, a[2]), (h, w, b))[1]
    for a, c, d, r in zip(g1, g2, g3, ref):
        torch.testing.assert_close(a, 3.0 * r)
        assert torch.equal(a, c)
        torch.testing.assert_close(d, 0.5 * r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_every_row_ignored_and_empty_batch(device, reduction):
    h, w, b, _ = make_linear_problem((5,), 8, 20, device=device, bias=True)
    t = torch.full((5,), -100, device=device)
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    loss = fusedce.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction=reduction)
    theirs = F.cross_entropy(F.linear(h, w, b), t, reduction=reduction)
    torch.testing.assert_close(loss, theirs, equal_nan=True)  # mean: NaN, as PyTorch
    if reduction != "mean":
        loss.sum().backward()
        for leaf in leaves:
            assert torch.equal(leaf.grad, torch.zeros_like(leaf))
    empty = torch.zeros(0, 8, device=device, requires_grad=True)
    t0 = torch.zeros(0, dtype=torch.long, device=device)
    out = fusedce.linear_cross_entropy(empty, w, t0, b, reduction=reduction)
    assert out.shape == ((0,) if reduction == "none" else ())
    out.sum().backward()
    assert empty.grad.shape == (0, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_int32_and_strided_target_and_weight_copy(device):
    # int32 targets, a strided target, and a weight whose rows are not unit-stride (copied).
    h, w, b, t = make_linear_problem((4, 5), 12, 60, device=device)
    ref = fusedce.linear_cross_entropy(h, w, t)
    assert torch.equal(fusedce.linear_cross_entropy(h, w, t.int()), ref)
    t_strided = torch.stack([t, t], -1)[..., 0]
    assert torch.equal(fusedce.linear_cross_entropy(h, w, t_strided), ref)
    w_t = w.t().contiguous().t()
    assert w_t.stride(1) != 1
    assert torch.equal(fusedce.linear_cross_entropy(h, w_t, t), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_module(device):
    cw = make_weight(90, device)
    h, w, b, t = make_linear_problem((3, 7), 14, 90, device=device, bias=True, ignore_index=5)
    module = fusedce.LinearCrossEntropyLoss(cw, ignore_index=5, label_smoothing=0.05, shift=True,
                                            z_loss=1e-4).to(device)
    assert "class_weight" in dict(module.named_buffers())
    fn = fusedce.linear_cross_entropy(h, w, t, b, class_weight=cw, ignore_index=5,
                                      label_smoothing=0.05, shift=True, z_loss=1e-4)
    assert torch.equal(module(h, w, t, b), fn)
    assert "shift=True" in repr(module) and "z_loss=0.0001" in repr(module)
    loss, m = fusedce.LinearCrossEntropyLoss(reduction="none", return_metrics=True)(h, w, t)
    assert loss.shape == t.shape and set(m) == {"num_correct_tokens", "entropy_sum", "lse"}


_MEMORY_VARIANTS = [{"chunk_budget_bytes": 4096}, {"skip_ignored": True}, {"low_memory": True},
                    {"low_memory": True, "chunk_budget_bytes": 2048, "skip_ignored": True}]


@requires_cuda
def test_memory_options_leave_results_unchanged_cuda():
    # chunk_budget_bytes, low_memory and skip_ignored change how the CUDA backend does the work
    # (here: 4096 bytes hold 2 of the 30 rows' logits, so the call runs 15 chunks; low_memory
    # forms grad_weight in a second pass from recomputed logits; skip_ignored compacts the ~30 %
    # ignored rows), not the result (the CPU's own chunks: test_memory_options_leave_results_unchanged_cpu).
    h, w, b, t = make_linear_problem((30,), 16, 400, device="cuda", bias=True)
    ref = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(a[0], a[1], t, a[2]), (h, w, b))
    for kw in _MEMORY_VARIANTS:
        out = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(a[0], a[1], t, a[2], **kw), (h, w, b))
        # low_memory forms grad_weight from probabilities recomputed in its second pass (expf
        # there, the logits kernel's hardware exp2 in the first): float32 rounding apart, seen
        # at 7e-6 relative on an entry of 1.7e-2.
        tol = dict(rtol=1e-5, atol=1e-6) if kw.get("low_memory") else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-7)
        for a, r in zip(out[1], ref[1]):
            torch.testing.assert_close(a, r, **tol)


def test_memory_options_leave_results_unchanged_cpu():
    # The CPU backend takes the rows in chunks whose float32 logits fit chunk_budget_bytes (4096
    # bytes: 2 of the 30 rows, 15 chunks adding into grad_weight), and always drops ignored rows:
    # the budget changes the rounding, not the result; skip_ignored, and low_memory with a
    # float32 weight (the same chunks under its cap), leave every bit unchanged.
    h, w, b, t = make_linear_problem((30,), 16, 400, bias=True)
    ref = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(a[0], a[1], t, a[2]), (h, w, b))
    for kw in _MEMORY_VARIANTS:
        out = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(a[0], a[1], t, a[2], **kw), (h, w, b))
        if "chunk_budget_bytes" in kw:
            torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-7)
            for a, r in zip(out[1], ref[1]):
                torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(out[0], ref[0]), kw
            assert all(torch.equal(a, r) for a, r in zip(out[1], ref[1])), kw


@requires_cuda
def test_cuda_matches_cpu():
    # The CUDA path calls the same core entry points; it agrees with the CPU backend.
    h, w, b, t = make_linear_problem((4, 33), 64, 1000, torch.bfloat16, bias=True)
    kw = dict(label_smoothing=0.1, softcap=10.0, z_loss=1e-4, shift=True)
    cpu = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(a[0], a[1], t, a[2], **kw), (h, w, b))
    gpu = loss_and_grads(lambda *a: fusedce.linear_cross_entropy(a[0], a[1], t.cuda(), a[2], **kw),
                         (h.cuda(), w.cuda(), b.cuda()))
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-4, atol=1e-4)
    for a, c in zip(gpu[1], cpu[1]):
        torch.testing.assert_close(a.float().cpu(), c.float(), rtol=2e-2, atol=1e-3)


@requires_cuda
@pytest.mark.parametrize("kw", [{}, {"low_memory": True, "chunk_budget_bytes": 1 << 16}], ids=["default", "low_memory"])
def test_cuda_graph_captures_forward_and_backward(kw):
    # torch.cuda.graph over loss and its gradients: nothing in the call syncs with the host or
    # allocates outside the graph's pool, and each replay on new hidden states gives the bits of
    # an eager call on them.
    h0, w0, b0, t = make_linear_problem((96,), 40, 1500, torch.bfloat16, "cuda", bias=True)
    h = h0.clone().requires_grad_(True)
    w = w0.clone().requires_grad_(True)
    b = b0.clone().requires_grad_(True)

    def step():
        loss = fusedce.linear_cross_entropy(h, w, t, b, label_smoothing=0.1, **kw)
        return (loss, *torch.autograd.grad(loss, (h, w, b)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's docs do
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        with torch.no_grad():
            h.copy_(torch.randn(h.shape, generator=g, device="cuda", dtype=h.dtype))
        graph.replay()
        torch.cuda.synchronize()
        from_graph = [x.clone() for x in captured]
        for a, e in zip(from_graph, step()):
            assert torch.equal(a, e)


@requires_cuda
def test_cuda_graph_skip_ignored_follows_the_targets():
    # skip_ignored under torch.cuda.graph: the products are sized on the device from the count of
    # valid rows (no host sync), so one captured graph serves targets with any count. Each replay
    # with new targets in the captured buffer matches an eager skip_ignored call on them: bit for
    # bit where the eager chunks have the size ladder's sizes (300 rows in one chunk: rungs 128,
    # 256, 300; and no valid row), else within a reordered float32 sum; and matches the call
    # without skip_ignored within the bf16 tolerance.
    n, vocab = 300, 1001
    h0, w0, b0, t0 = make_linear_problem((n,), 40, vocab, torch.bfloat16, "cuda", bias=True)
    h = h0.clone().requires_grad_(True)
    w = w0.clone().requires_grad_(True)
    b = b0.clone().requires_grad_(True)
    t = t0.clone()
    kw = dict(label_smoothing=0.1, z_loss=1e-4, softcap=20.0)

    def step(skip=True):
        loss = fusedce.linear_cross_entropy(h, w, t, b, skip_ignored=skip, **kw)
        return (loss, *torch.autograd.grad(loss, (h, w, b)))

    gen = torch.Generator(device="cuda").manual_seed(7)

    def targets(valid):
        new = torch.full((n,), -100, dtype=t.dtype, device="cuda")
        rows = torch.randperm(n, generator=gen, device="cuda")[:valid]
        new[rows] = torch.randint(0, vocab, (valid,), generator=gen, device="cuda", dtype=t.dtype)
        return new

    t.copy_(targets(200))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for valid, same_bits in [(128, True), (129, False), (300, True), (1, False), (0, True), (256, True)]:
        with torch.no_grad():
            t.copy_(targets(valid))
        graph.replay()
        torch.cuda.synchronize()
        got = [x.clone() for x in captured]
        eager = step()
        names = ("loss", "grad_hidden", "grad_weight", "grad_bias")
        for name, a, e in zip(names, got, eager):
            if same_bits:
                assert torch.equal(a, e) or (valid == 0 and name == "loss" and a.isnan() and e.isnan()), (valid, name)
            else:
                torch.testing.assert_close(a.float(), e.float(), rtol=1e-2, atol=1e-3, msg=f"{valid} valid rows: {name}")
        if valid > 0:
            for name, a, e in zip(names, got, step(skip=False)):
                torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-3, msg=f"{valid} valid rows: {name}")


@pytest.mark.parametrize("dtype,factor", [(torch.float32, 1.001), (torch.bfloat16, 1.05)], ids=str)
def test_budget_catches_a_wrong_gradient(dtype, factor):
    # The tolerances above can fail: gradients off by 0.1 % in float32 (5 % in bfloat16, whose
    # own rounding is 0.4 %) are outside the budget.
    with pytest.raises(AssertionError, match="grad_hidden"):
        check_linear("cpu", dtype, (33,), 19, 211, OPTIONS["everything"], "sum", bias=True,
                     error_factor=factor)


# ---- vocabulary-parallel hand-off -----------------------------------------------------------


def test_process_group_hands_every_option_to_distributed(monkeypatch):
    # With a process group the call runs fusedce.distributed's linear rows with one Call holding
    # every option: the six loss options, the linear ones as the single-device op takes them,
    # the layout as passed, the flags.
    import fusedce.distributed as fdist
    from fusedce._options import LinearOptions, VocabParallel

    seen = {}

    def fake(h, w, bias, target, class_weight, call):
        seen.update(h=h, w=w, bias=bias, target=target, class_weight=class_weight, call=call)
        n = h.shape[0]
        return torch.zeros(()), torch.zeros(n), torch.zeros((), dtype=torch.int64), torch.zeros(())

    monkeypatch.setattr(fdist, "linear_cross_entropy_rows", fake)
    h, w, b, t = make_linear_problem((2, 4), 8, 16, bias=True)
    cw = make_weight(16)
    group = object()
    kw = dict(class_weight=cw, ignore_index=2, reduction="sum", label_smoothing=0.1,
              logit_scale=0.5, softcap=3.0, z_loss=1e-3, shift=True, return_metrics=True,
              chunk_budget_bytes=1 << 20, low_memory=True, skip_ignored=True, check_targets=True)
    fusedce.linear_cross_entropy(h, w, t, b, process_group=group, vocab_start=16, vocab_total=48, **kw)
    call = seen["call"]
    assert call.parallel == VocabParallel(group, 16, 48)
    assert seen["h"].shape == (8, 8) and seen["w"] is w and seen["bias"] is b
    assert torch.equal(seen["target"], t.reshape(-1))
    assert torch.equal(seen["class_weight"], cw)
    assert call.options.op_args() == (2, "sum", 0.1, 0.5, 3.0, 1e-3)
    assert call.return_metrics is True and call.check_targets is True
    assert call.linear == LinearOptions(4, 1 << 20, True, True)
    assert call.where == "fusedce.linear_cross_entropy"


# ---- bad input ------------------------------------------------------------------------------


def _bad(case, device):
    """The arguments of a call that is wrong in one way."""
    h, w, b, t = make_linear_problem((6,), 10, 30, device=device, bias=True)
    kw = {}
    if case == "weight_dtype":
        w = w.half()
    elif case == "bias_dtype":
        b = b.half()
    elif case == "hidden_float64":
        h, w, b = h.double(), w.double(), b.double()
    elif case == "hidden_size":
        w = w[:, :9]
    elif case == "weight_1d":
        w = w[0]
    elif case == "bias_shape":
        b = b[:-1]
    elif case == "target_shape":
        t = t[:-1]
    elif case == "target_float":
        t = t.float()
    elif case == "target_range":
        t = t.clone()
        t[3] = 30
    elif case == "target_negative":
        t = t.clone()
        t[2] = -7
    elif case == "class_weight_shape":
        kw["class_weight"] = torch.ones(29, device=device)
    elif case == "weight_device":
        w = w.to("meta")
    elif case == "target_device":
        t = t.to("meta")
    elif case == "reduction":
        kw["reduction"] = "average"
    elif case == "softcap":
        kw["softcap"] = 0.0
    elif case == "label_smoothing":
        kw["label_smoothing"] = 2.0
    elif case == "vocab_start":
        kw["vocab_start"] = 0
    elif case == "chunk_budget":
        kw["chunk_budget_bytes"] = -1
    elif case == "hidden_not_tensor":
        h = h.tolist()
    return (h, w, t, b), kw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,exc,match", [
    ("weight_dtype", ValueError, "weight must have hidden's dtype"),
    ("bias_dtype", ValueError, "bias must have hidden's dtype"),
    ("hidden_float64", ValueError, "hidden must be float32, bfloat16 or float16"),
    ("hidden_size", ValueError, r"weight must have shape \(V, H\) with H = hidden's last dimension \(10\)"),
    ("weight_1d", ValueError, r"weight must have shape \(V, H\)"),
    ("bias_shape", ValueError, r"bias must have shape \(30,\)"),
    ("target_shape", ValueError, "target must have shape"),
    ("target_float", ValueError, "target must be int64 or int32"),
    ("target_range", ValueError, r"target\[3\] = 30 is out of range \[0, 30\)"),
    ("target_negative", ValueError, r"target\[2\] = -7 is out of range"),
    ("class_weight_shape", ValueError, r"class_weight must have shape \(30,\)"),
    ("weight_device", ValueError, "weight is on meta but hidden is on"),
    ("target_device", ValueError, "target is on meta but hidden is on"),
    ("reduction", ValueError, "reduction must be"),
    ("softcap", ValueError, "softcap must be None"),
    ("label_smoothing", ValueError, "label_smoothing must be in"),
    ("vocab_start", ValueError, "vocab_start and vocab_total are only used with a process_group"),
    ("chunk_budget", ValueError, "chunk_budget_bytes must be"),
    ("hidden_not_tensor", TypeError, "hidden must be a tensor"),
])
def test_bad_arguments(device, case, exc, match):
    if device == "cuda" and case in ("target_range", "target_negative"):
        pytest.skip("on a GPU targets are not checked (a device sync): test_target_out_of_range_cuda_gives_nan_row")
    args, kw = _bad(case, device)
    with pytest.raises(exc, match=match):
        fusedce.linear_cross_entropy(*args, **kw)
    if case.startswith("target_r") or case.startswith("target_n"):
        # also on the training path, and from the op directly
        args[0].requires_grad_(True)
        with pytest.raises(exc, match=match):
            fusedce.linear_cross_entropy(*args, **kw)


@requires_cuda
def test_target_out_of_range_cuda_gives_nan_row():
    # docs/contract.md, "Bad input": unchecked on the GPU, the row's loss is NaN and nothing
    # outside the tensors is touched; the other rows are unaffected.
    h, w, b, t = make_linear_problem((6,), 10, 30, device="cuda", bias=True)
    t[:] = torch.arange(6, device="cuda")
    t[3] = 30
    loss = fusedce.linear_cross_entropy(h, w, t, b, reduction="none")
    assert torch.isnan(loss[3]) and torch.isfinite(loss[[0, 1, 2, 4, 5]]).all()


@requires_cuda
def test_device_mismatch_cuda():
    h, w, b, t = make_linear_problem((6,), 10, 30, bias=True)
    for args, name in (((h, w.cuda(), t, b), "weight"), ((h.cuda(), w.cuda(), t, b.cuda()), "target"),
                       ((h.cuda(), w.cuda(), t.cuda(), b), "bias")):
        with pytest.raises(ValueError, match=f"{name} is on"):
            fusedce.linear_cross_entropy(*args)
    # the op itself names the argument too (no Python checks in front of it)
    with pytest.raises(ValueError, match="weight is on"):
        torch.ops.fusedce.lce_fwd(h.cuda(), w, None, t.cuda(), None, -100, "mean", 0.0, 1.0, 0.0, 0.0,
                                  0, 0, False, False, False)


def test_op_errors_name_the_argument():
    # The ops check what the Python front end also checks, for callers of the raw ops.
    h, w, b, t = make_linear_problem((6,), 10, 30, bias=True)
    opts = (-100, "mean", 0.0, 1.0, 0.0, 0.0, 0, 0, False, False)
    lce_fwd = torch.ops.fusedce.lce_fwd
    with pytest.raises(ValueError, match="weight must have hidden's dtype"):
        lce_fwd(h, w.half(), None, t, None, *opts, False)
    with pytest.raises(ValueError, match="weight must be .V, H. with H = hidden's 10 columns"):
        lce_fwd(h, w[:, :9], None, t, None, *opts, False)
    with pytest.raises(ValueError, match="target must be 1-D with one entry per row of hidden"):
        lce_fwd(h, w, None, t[:-1], None, *opts, False)
    with pytest.raises(ValueError, match="bias must"):
        lce_fwd(h, w, b[:-1], t, None, *opts, False)
    with pytest.raises(ValueError, match="shift_seq_len must be 0"):
        lce_fwd(h, w, None, t, None, *opts[:6], 4, 0, False, False, False)
    with pytest.raises(ValueError, match="need_grad_bias"):
        torch.ops.fusedce.lce_fwd_bwd(h, w, None, t, None, *opts, None, False, True, True, True)


# ---- the CPU products' library ---------------------------------------------------------------

_BLAS_SYMBOLS = ("sgemm_", "sgemm", "cblas_sgemm", "openblas_set_num_threads", "openblas_get_corename")


def test_cpu_blas_is_private_to_the_extension():
    """fusedce.cpu_blas names the CPU linear path's products, and the extension takes no BLAS
    symbol from the process: torch's libtorch_cpu exports MKL's sgemm_, and an extension that
    left its products undefined would run those instead of the library its build names."""
    import os
    import shutil
    import subprocess

    from fusedce import _library

    assert fusedce.cpu_blas in ("OpenBLAS", "none")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to read the extension's symbol table")
    out = subprocess.run([nm, "-D", "--undefined-only", _library._path], capture_output=True, text=True,
                         check=True).stdout
    undefined = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    assert os.path.exists(_library._path)
    assert not undefined & set(_BLAS_SYMBOLS), f"undefined BLAS symbols: {sorted(undefined & set(_BLAS_SYMBOLS))}"
