"""fusedce.cross_entropy against PyTorch: every option, every reduction, the three dtypes, loss
and gradient, judged against a float64 reference with PyTorch's own error in the same dtype as
the budget."""

import pytest
import torch
import torch.nn.functional as F

import fusedce
from conftest import (DEVICES, DTYPES, assert_within_budget, error_scales, loss_and_grad,
                      make_problem, make_weight, torch_cross_entropy)

# Option sets: each PyTorch option alone, fusedce's own options alone, and all together.
OPTIONS = {
    "plain": {},
    "weight": {"weight": True},
    "smoothing": {"label_smoothing": 0.1},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.2},
    "scale": {"logit_scale": 0.5},
    "softcap": {"softcap": 5.0},
    "zloss": {"z_loss": 1e-3},
    "everything": {"weight": True, "label_smoothing": 0.1, "logit_scale": 1.7, "softcap": 8.0,
                   "z_loss": 1e-2, "ignore_index": 3},
}

# Shapes: a single row; odd V that no vector width divides; (B, S, V) as a language model has it;
# a vocabulary large enough for several chunks per row.
SHAPES = [((1,), 7), ((37,), 129), ((2, 9), 1000), ((4,), 5003)]


def _kwargs(opts, vocab, device):
    kw = dict(opts)
    if kw.pop("weight", False):
        kw["weight"] = make_weight(vocab, device)
    return kw


def _check(device, dtype, shape, vocab, opts, reduction, grad_scale=1.0):
    kw = _kwargs(opts, vocab, device)
    kw["reduction"] = reduction
    x, t = make_problem(shape, vocab, dtype, device, ignore_index=kw.get("ignore_index", -100))
    fkw = {k: v for k, v in kw.items() if k != "weight"}
    w = kw.get("weight")
    grad_out = None
    if grad_scale != 1.0 or reduction == "none":
        g = torch.Generator().manual_seed(5)
        shape_out = t.shape if reduction == "none" else ()
        grad_out = (torch.rand(shape_out, generator=g) * grad_scale).to(device)

    ours = loss_and_grad(lambda a: fusedce.cross_entropy(a, t, w, **fkw), x, grad_out)
    ref = loss_and_grad(lambda a: torch_cross_entropy(a, t, w, compute_dtype=torch.float64, **fkw), x,
                        None if grad_out is None else grad_out.double())
    theirs = loss_and_grad(lambda a: torch_cross_entropy(a, t, w, **fkw), x,
                           None if grad_out is None else grad_out.to(dtype))

    assert ours[0].dtype == torch.float32
    assert ours[0].shape == ref[0].shape
    assert ours[1].dtype == dtype
    label = f"{dtype} {shape}x{vocab} {opts} {reduction}"
    loss_scale, grad_scale = error_scales(x, t, **kw, grad_out=grad_out)
    # The loss is float32, computed in float32 whatever the logits' dtype: it is judged against
    # float64 of the same (rounded) logits with float32's tolerance alone, not by PyTorch's own
    # error in a 16-bit dtype, which is hundreds of times larger. The gradient is rounded to the
    # logits' dtype, so PyTorch's error in that dtype is its budget.
    assert_within_budget(ours[0], None, ref[0], what=f"loss {label}", scale=loss_scale)
    assert_within_budget(ours[1], theirs[1], ref[1], what=f"grad {label}", scale=grad_scale,
                         out_dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,vocab", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_options_mean(device, dtype, shape, vocab, opts):
    _check(device, dtype, shape, vocab, opts, "mean")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_options_reductions(device, dtype, reduction, opts):
    _check(device, dtype, (3, 11), 517, opts, reduction)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_upstream_gradient_not_one(device, dtype, reduction):
    # The backward scales the gradient formed in the forward by the upstream gradient.
    _check(device, dtype, (64,), 300, OPTIONS["everything"], reduction, grad_scale=3.0)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_f_cross_entropy_directly(device):
    # The plain call is F.cross_entropy's drop-in: same arguments, same numbers (float32).
    w = make_weight(321, device)
    for kw in ({}, {"weight": w}, {"label_smoothing": 0.3}, {"weight": w, "reduction": "sum"},
               {"reduction": "none", "ignore_index": 7}):
        x, t = make_problem((50,), 321, device=device, ignore_index=kw.get("ignore_index", -100))
        ours = fusedce.cross_entropy(x, t, **kw)
        theirs = F.cross_entropy(x, t, **kw)
        torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_unbatched_logits(device):
    # (V,) logits with a 0-D target, as F.cross_entropy takes them.
    x = torch.randn(10, device=device)
    t = torch.tensor(4, device=device)
    for reduction in ("none", "mean", "sum"):
        ours = fusedce.cross_entropy(x, t, reduction=reduction)
        theirs = F.cross_entropy(x, t, reduction=reduction)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_every_row_ignored(device, reduction):
    x = torch.randn(5, 13, device=device, requires_grad=True)
    t = torch.full((5,), -100, device=device)
    ours = fusedce.cross_entropy(x, t, reduction=reduction)
    theirs = F.cross_entropy(x.detach(), t, reduction=reduction)
    torch.testing.assert_close(ours, theirs, equal_nan=True)  # mean: NaN, as PyTorch
    ours.sum().backward()
    if reduction != "mean":
        assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = torch.randn(0, 17, device=device, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=device)
    assert fusedce.cross_entropy(x, t, reduction="sum").item() == 0.0
    assert fusedce.cross_entropy(x, t, reduction="none").shape == (0,)
    loss = fusedce.cross_entropy(x, t)
    assert torch.isnan(loss)
    loss.backward()
    assert x.grad.shape == (0, 17)


@pytest.mark.parametrize("device", DEVICES)
def test_special_values(device):
    # NaN / +inf propagate to that row as in PyTorch; -inf entries are a masked vocabulary.
    x = torch.randn(4, 9, device=device)
    x[0, 3] = float("nan")
    x[1, 2] = float("inf")
    x[2, :5] = float("-inf")
    t = torch.tensor([1, 2, 6, 0], device=device)
    ours = fusedce.cross_entropy(x, t, reduction="none")
    theirs = F.cross_entropy(x, t, reduction="none")
    torch.testing.assert_close(ours, theirs, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_metrics(device, dtype):
    x, t = make_problem((3, 40), 700, dtype, device)
    loss, m = fusedce.cross_entropy(x, t, reduction="sum", return_metrics=True)
    assert set(m) == {"num_correct_tokens", "entropy_sum", "lse"}
    x64 = x.double().reshape(-1, 700)
    t1 = t.reshape(-1)
    keep = t1 != -100
    assert m["num_correct_tokens"].dtype == torch.int64 and m["num_correct_tokens"].shape == ()
    assert m["num_correct_tokens"].item() == (x64.argmax(-1) == t1)[keep].sum().item()
    lse = torch.logsumexp(x64, -1)
    p = torch.softmax(x64, -1)
    entropy = (lse - (p * x64).sum(-1))[keep].sum()
    assert m["entropy_sum"].dtype == torch.float32 and m["entropy_sum"].shape == ()
    torch.testing.assert_close(m["entropy_sum"].double(), entropy, rtol=1e-5, atol=1e-4)
    assert m["lse"].dtype == torch.float32 and m["lse"].shape == (120,)
    torch.testing.assert_close(m["lse"].double(), torch.where(keep, lse, 0.0), rtol=1e-6, atol=1e-5)
    # metrics leave the loss and the gradient bit-identical
    assert torch.equal(loss, fusedce.cross_entropy(x, t, reduction="sum"))
    g1 = loss_and_grad(lambda a: fusedce.cross_entropy(a, t, return_metrics=True)[0], x)[1]
    g2 = loss_and_grad(lambda a: fusedce.cross_entropy(a, t), x)[1]
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bsv_and_strided_rows_without_copy(device, dtype):
    # (B, S, V) logits that are a slice of a wider buffer: the rows are strided, the call reads
    # them in place (the gradient formed in place over the logits shows it is the same memory).
    big, t = make_problem((3, 5), 260, dtype, device)
    x = big[..., :250]
    t = t.clamp(max=249)
    assert not x.is_contiguous()
    ours = loss_and_grad(lambda a: fusedce.cross_entropy(a[..., :250], t), big)
    ref = loss_and_grad(lambda a: torch_cross_entropy(a[..., :250], t, compute_dtype=torch.float64), big)
    theirs = loss_and_grad(lambda a: torch_cross_entropy(a[..., :250], t), big)
    loss_scale, grad_scale = error_scales(x[..., :250], t)
    assert_within_budget(ours[0], None, ref[0], what="loss", scale=loss_scale)
    assert_within_budget(ours[1], theirs[1], ref[1], what="grad", out_dtype=dtype, scale=grad_scale)

    leaf = big.detach().clone().requires_grad_(True)
    buf = leaf * 1.0  # in place over a leaf (or a view of one) is refused, as autograd refuses it
    loss = fusedce.cross_entropy(buf[..., :250], t, inplace_backward=True)
    loss.backward()
    # the first 250 columns of the buffer now hold the gradient; the rest is untouched
    assert torch.equal(buf.detach()[..., :250], leaf.grad[..., :250])
    assert torch.equal(buf.detach()[..., 250:], big[..., 250:])
    assert torch.equal(leaf.grad[..., 250:], torch.zeros_like(leaf.grad[..., 250:]))


@pytest.mark.parametrize("device", DEVICES)
def test_non_unit_last_stride(device):
    # A last dimension that is not contiguous (a transpose) is copied, then computed right.
    x = torch.randn(300, 8, device=device).t()  # (8, 300) with stride (1, 8)
    t = torch.randint(0, 300, (8,), device=device)
    ours = loss_and_grad(lambda a: fusedce.cross_entropy(a, t), x)
    theirs = loss_and_grad(lambda a: F.cross_entropy(a, t), x)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])


@pytest.mark.parametrize("device", DEVICES)
def test_int32_target_and_strided_target(device):
    x, t = make_problem((6, 7), 100, device=device)
    t_strided = torch.stack([t, t], -1)[..., 0]  # stride 2
    assert t_strided.stride(-1) == 2
    ref = fusedce.cross_entropy(x, t)
    assert torch.equal(fusedce.cross_entropy(x, t.int()), ref)
    assert torch.equal(fusedce.cross_entropy(x, t_strided), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_backward(device, dtype):
    # The logits are overwritten by their gradient; the gradient is the out-of-place one, also
    # through a matmul (logits as an intermediate, as a language model's head makes them).
    g = torch.Generator().manual_seed(3)
    h = torch.randn(24, 32, generator=g).to(dtype).to(device).requires_grad_(True)
    w = torch.randn(500, 32, generator=g).to(dtype).to(device).requires_grad_(True)
    t = torch.randint(0, 500, (24,), generator=g).to(device)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=20.0)

    def grads(inplace):
        h.grad = w.grad = None
        logits = h @ w.t()
        loss = fusedce.cross_entropy(logits, t, inplace_backward=inplace, **kw) * 2.5
        loss.backward()
        return loss.detach(), h.grad.clone(), w.grad.clone(), logits.detach()

    loss0, gh0, gw0, logits0 = grads(False)
    loss1, gh1, gw1, logits1 = grads(True)
    assert torch.equal(loss0, loss1)
    assert torch.equal(gh0, gh1) and torch.equal(gw0, gw1)
    assert not torch.equal(logits0, logits1)  # overwritten


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_refuses_when_logits_are_needed(device):
    # tanh saves its output for its own backward; overwriting it must not go unnoticed.
    x = torch.randn(4, 50, device=device, requires_grad=True)
    t = torch.randint(0, 50, (4,), device=device)
    logits = torch.tanh(x)
    loss = fusedce.cross_entropy(logits, t, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_retain_graph_backward_twice(device, inplace):
    # The saved gradient is scaled in place, except when the graph is kept for another backward.
    x0, t = make_problem((20,), 90, device=device)
    x = x0.clone().requires_grad_(True)
    loss = fusedce.cross_entropy(x * 1.0, t, inplace_backward=inplace)
    (g1,) = torch.autograd.grad(loss * 3.0, x, retain_graph=True)
    (g2,) = torch.autograd.grad(loss * 3.0, x, retain_graph=True)
    (g3,) = torch.autograd.grad(loss * 0.5, x)
    ref = loss_and_grad(lambda a: F.cross_entropy(a, t), x0)[1]
    torch.testing.assert_close(g1, 3.0 * ref)
    assert torch.equal(g1, g2)
    torch.testing.assert_close(g3, 0.5 * ref)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_only_without_grad(device):
    # Without a gradient to form, only the forward runs (and no (N, V) buffer is made).
    x, t = make_problem((8,), 64, device=device)
    with torch.no_grad():
        a = fusedce.cross_entropy(x.requires_grad_(True), t)
    assert a.grad_fn is None
    b = fusedce.cross_entropy(x.detach(), t)
    assert b.grad_fn is None
    torch.testing.assert_close(a, F.cross_entropy(x.detach(), t))


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_of_the_raw_fwd_bwd_op(device):
    # ce_fwd_bwd's own autograd formula (a copy of its dlogits, scaled), for callers of the raw op.
    x, t = make_problem((10,), 77, device=device)
    args = (t, None, -100, "mean", 0.1, 1.0, 0.0, 0.0, False)
    ours = loss_and_grad(lambda a: torch.ops.fusedce.ce_fwd_bwd(a, *args)[0] * 2.0, x)
    ref = loss_and_grad(lambda a: F.cross_entropy(a, t, label_smoothing=0.1) * 2.0, x)
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1])


@pytest.mark.parametrize("device", DEVICES)
def test_module(device):
    w = make_weight(200, device)
    x, t = make_problem((4, 6), 200, device=device, ignore_index=5)
    ours = fusedce.CrossEntropyLoss(w, ignore_index=5, label_smoothing=0.05).to(device)
    theirs = torch.nn.CrossEntropyLoss(w, ignore_index=5, label_smoothing=0.05)
    torch.testing.assert_close(ours(x, t), theirs(x.reshape(-1, 200), t.reshape(-1)))
    assert "weight" in dict(ours.named_buffers())
    with pytest.warns(UserWarning, match="deprecated"):  # the deprecated arguments, as torch
        legacy = fusedce.CrossEntropyLoss(size_average=False)
    assert legacy.reduction == "sum"
    loss, m = fusedce.CrossEntropyLoss(reduction="none", return_metrics=True, z_loss=1e-4)(x, t)
    assert loss.shape == t.shape and "num_correct_tokens" in m
    assert "z_loss=0.0001" in repr(fusedce.CrossEntropyLoss(z_loss=1e-4))


@pytest.mark.parametrize("device", DEVICES)
def test_calls_without_a_graph_skip_autograd_and_match_the_op(device):
    """Where no graph is built (nothing requires grad, or under no_grad) fusedce.cross_entropy
    calls the op past autograd's Python kernel (host time per call) and returns what the op
    returns; with grad on, the loss has a grad_fn and the same value."""
    from fusedce.ops import ops
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 37, generator=gen) * 2).to(device)
    t = torch.randint(0, 37, (6,), generator=gen).to(device)
    ref = ops.ce_loss(x, t, None, -100, "mean", 0.0, 1.0, 0.0, 0.0, False)[0]
    loss = fusedce.cross_entropy(x, t)
    assert loss.grad_fn is None and torch.equal(loss, ref)
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        assert not fusedce.cross_entropy(xg, t).requires_grad
    loss_g = fusedce.cross_entropy(xg, t)
    assert loss_g.grad_fn is not None  # (the gradient kernel may sum in another order)
    torch.testing.assert_close(loss_g.detach(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_overlapping_and_expanded_rows_as_f_cross_entropy(device):
    # F.cross_entropy takes logits whose rows share memory: an expanded row (stride 0) and rows
    # one element apart; fusedce copies them (its kernels write one gradient row per row) and
    # gives the same loss and gradient. Expanded targets and class weights are taken too.
    V = 37
    t = torch.randint(0, V, (6,), device=device)
    w = make_weight(V, device)
    cases = {  # base tensor, the logits made from it, their vocabulary
        "expanded": (torch.randn(1, V, device=device), lambda a: a.expand(6, V), V),
        "expanded_bsv": (torch.randn(1, V, device=device), lambda a: a.expand(2, 3, V), V),
        "overlapping": (torch.randn(V + 5, device=device), lambda a: a.as_strided((6, V), (1, 1)), V),
        "expanded_v1": (torch.randn(1, 1, device=device), lambda a: a.expand(6, 1), 1),
    }
    for name, (base, view, vocab) in cases.items():
        tt = (t if vocab == V else torch.zeros_like(t)).reshape(view(base).shape[:-1])
        for kw in ({}, {"weight": make_weight(vocab, device), "reduction": "none"}):
            ours = loss_and_grad(lambda a: fusedce.cross_entropy(view(a), tt, **kw), base)
            theirs = loss_and_grad(lambda a: F.cross_entropy(
                view(a).reshape(-1, vocab), tt.reshape(-1), **kw).reshape(ours[0].shape), base)
            torch.testing.assert_close(ours[0], theirs[0], msg=name)
            torch.testing.assert_close(ours[1], theirs[1], msg=name)
    x = torch.randn(6, V, device=device)
    torch.testing.assert_close(fusedce.cross_entropy(x, torch.tensor([4], device=device).expand(6)),
                               F.cross_entropy(x, torch.full((6,), 4, device=device)))
    torch.testing.assert_close(fusedce.cross_entropy(x, t, torch.tensor(2.0, device=device).expand(V)),
                               F.cross_entropy(x, t, torch.full((V,), 2.0, device=device)))
    # in place over expanded rows: the copy is overwritten, not the shared row
    row = torch.randn(1, V, device=device, requires_grad=True)
    y = row * 1.0
    fusedce.cross_entropy(y.expand(6, V), t, w, inplace_backward=True).backward()
    assert torch.equal(y.detach(), row.detach())
    torch.testing.assert_close(row.grad, loss_and_grad(lambda a: F.cross_entropy(a.expand(6, V), t, w),
                                                       row.detach())[1])


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_tells_autograd(device):
    # The overwritten logits are an in-place op's output to autograd: they hold the gradient
    # now, and a gradient flowing through them (which would silently treat them as the old
    # logits) raises; the loss alone still differentiates.
    x = torch.randn(6, 40, device=device, requires_grad=True)
    t = torch.randint(0, 40, (6,), device=device)
    y = x * 2.0
    version = y._version
    loss = fusedce.cross_entropy(y, t, inplace_backward=True)
    assert y._version > version
    assert type(y.grad_fn).__name__ == "OverwrittenBackward"
    with pytest.raises(RuntimeError, match="inplace_backward=True overwrote"):
        (loss + y.sum()).backward()
    # (B, S, V) logits are a (N, V) view to the op: the view's base is rebased, as for any
    # in-place op on a view
    y3 = x.view(2, 3, 40) * 2.0
    loss = fusedce.cross_entropy(y3, t.view(2, 3), inplace_backward=True)
    assert type(y3.grad_fn).__name__ == "CopySlices"
    with pytest.raises(RuntimeError, match="inplace_backward=True overwrote"):
        (loss + y3[0].sum()).backward()
    loss = fusedce.cross_entropy(x.view(2, 3, 40) * 2.0, t.view(2, 3), inplace_backward=True)
    (g,) = torch.autograd.grad(loss * 3.0, x)
    torch.testing.assert_close(g, loss_and_grad(lambda a: F.cross_entropy(a * 2.0, t) * 3.0, x)[1])
    # a later in-place change of the gradient the logits hold is refused at the backward
    y = x * 2.0
    loss = fusedce.cross_entropy(y, t, inplace_backward=True)
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_refuses_a_leaf(device):
    # As PyTorch refuses an in-place op on a leaf that requires grad (or a view of one), before
    # anything is written; logits the call copies anyway leave the leaf alone.
    x = torch.randn(6, 40, device=device, requires_grad=True)
    t = torch.randint(0, 40, (6,), device=device)
    x0 = x.detach().clone()
    with pytest.raises(ValueError, match="would overwrite a leaf tensor that requires grad"):
        fusedce.cross_entropy(x, t, inplace_backward=True)
    with pytest.raises(ValueError, match=r"through a view of it"):
        fusedce.cross_entropy(x.view(2, 3, 40), t.view(2, 3), inplace_backward=True)
    assert torch.equal(x.detach(), x0)
    xt = torch.randn(40, 6, device=device, requires_grad=True)  # transposed: copied
    xt0 = xt.detach().clone()
    fusedce.cross_entropy(xt.t(), t, inplace_backward=True).backward()
    assert torch.equal(xt.detach(), xt0)
    torch.testing.assert_close(xt.grad, loss_and_grad(lambda a: F.cross_entropy(a.t(), t), xt0)[1])


def _layout_check(ours, theirs, ref, dtype, what):
    """A fused result against PyTorch's float64 (ref) and its own in `dtype` (theirs): the loss
    to float32's precision, the gradient to PyTorch's error in `dtype`."""
    assert ours[0].dtype == torch.float32 and ours[0].shape == ref[0].shape, what
    assert ours[1].dtype == dtype and ours[1].shape == ref[1].shape, what
    scale = ref[0].abs().max().item() + 1.0
    assert_within_budget(ours[0], None, ref[0], what=f"loss {what}", scale=scale)
    assert_within_budget(ours[1], theirs[1], ref[1], what=f"grad {what}", scale=scale,
                         out_dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 7, 5), (2, 7, 3, 4), (3, 7, 1), (2, 7, 1, 2, 3)], ids=str)
def test_k_dimensional_layout(device, dtype, shape):
    # PyTorch's (N, C, d1, ..., dk) logits with (N, d1, ..., dk) targets: the fused path on a
    # copy with the classes last, PyTorch's numbers.
    n, c, rest = shape[0], shape[1], shape[2:]
    x, t = make_problem((n, *rest), c, dtype, device)
    logits = x.movedim(-1, 1).contiguous()
    assert logits.shape == shape
    w = make_weight(c, device)
    t2 = t.clamp(min=0)
    for kw, tt in (({}, t), ({"weight": w, "label_smoothing": 0.1, "reduction": "none"}, t),
                   ({"reduction": "sum", "ignore_index": 2}, t2)):
        g = torch.rand(tt.shape, device=device) if kw.get("reduction") == "none" else None
        ours = loss_and_grad(lambda a: fusedce.cross_entropy(a, tt, **kw), logits, g)
        kw64 = dict(kw, weight=w.double()) if "weight" in kw else kw
        ref = loss_and_grad(lambda a: F.cross_entropy(a.double(), tt, **kw64), logits,
                            None if g is None else g.double())
        kwd = dict(kw, weight=w.to(dtype)) if "weight" in kw else kw
        theirs = loss_and_grad(lambda a: F.cross_entropy(a, tt, **kwd), logits,
                               None if g is None else g.to(dtype))
        _layout_check(ours, theirs, ref, dtype, f"{shape} {kw}")
    # fusedce's own options: the same rows as the classes-last call, the same bits
    kw = dict(softcap=3.0, z_loss=1e-3, logit_scale=0.7, reduction="none")
    ours = loss_and_grad(lambda a: fusedce.cross_entropy(a, t, **kw), logits, torch.rand(t.shape, device=device))
    last = loss_and_grad(lambda a: fusedce.cross_entropy(a.movedim(1, -1), t, **kw), logits,
                         torch.rand(t.shape, device=device))
    assert torch.equal(ours[0], last[0])
    loss, m = fusedce.cross_entropy(logits, t, return_metrics=True)
    loss_last, m_last = fusedce.cross_entropy(logits.movedim(1, -1), t, return_metrics=True)
    assert torch.equal(loss, loss_last) and all(torch.equal(m[k], m_last[k]) for k in m)


@pytest.mark.parametrize("device", DEVICES)
def test_layout_that_fits_both_ways_raises(device):
    # (N, C, C) logits with (N, C) targets: classes last or PyTorch's dim 1, only the caller
    # knows; flattened, either is computed.
    x = torch.randn(2, 4, 4, device=device)
    t = torch.randint(0, 4, (2, 4), device=device)
    with pytest.raises(ValueError, match=r"fit both layouts.*flatten them"):
        fusedce.cross_entropy(x, t)
    torch.testing.assert_close(fusedce.cross_entropy(x.reshape(-1, 4), t.reshape(-1)),
                               F.cross_entropy(x.reshape(-1, 4), t.reshape(-1)))
    with pytest.raises(ValueError, match=r"target must have shape logits.shape\[:-1\] = \(2, 4\) or "
                                         r"\(N, d1, ...\) = \(2, 4\), got \(3,\)"):
        fusedce.cross_entropy(x, t[0, :3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_probability_targets_are_pytorchs(device, dtype):
    # Class probabilities (a float target of logits' shape) go to F.cross_entropy itself: its
    # result in its dtype, bit for bit, and its gradients for logits and target.
    w = make_weight(9, device).to(dtype)
    for shape in ((5, 9), (9,), (2, 9, 3)):
        x = torch.randn(shape, device=device).to(dtype)
        p = torch.softmax(torch.randn(shape, device=device), 1 if len(shape) > 1 else 0).to(dtype)
        for kw in ({}, {"weight": w, "label_smoothing": 0.2, "reduction": "none"},
                   {"reduction": "sum"}):
            xs = [x.clone().requires_grad_(True) for _ in range(2)]
            ps = [p.clone().requires_grad_(True) for _ in range(2)]
            ours = fusedce.cross_entropy(xs[0], ps[0], **kw)
            theirs = F.cross_entropy(xs[1], ps[1], **kw)
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (shape, kw)
            g = torch.rand_like(theirs)
            assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(ours, (xs[0], ps[0]), g),
                                                         torch.autograd.grad(theirs, (xs[1], ps[1]), g)))
    # fusedce's own options, by the contract's formulas around F.cross_entropy
    x = torch.randn(5, 9, device=device).to(dtype)
    p = torch.softmax(torch.randn(5, 9, device=device), 1).to(dtype)
    z = 4.0 * torch.tanh(x * 0.5 / 4.0)
    ref = F.cross_entropy(z, p) + 1e-2 * (torch.logsumexp(z, 1) ** 2).mean()
    torch.testing.assert_close(fusedce.cross_entropy(x, p, logit_scale=0.5, softcap=4.0, z_loss=1e-2), ref)
    with pytest.raises(ValueError, match="class-probability targets are not computed by the fused "
                                         "kernels.*strict=True"):
        fusedce.cross_entropy(x, p, strict=True)
    with pytest.raises(ValueError, match="return_metrics needs class-index targets"):
        fusedce.cross_entropy(x, p, return_metrics=True)
    with pytest.raises(ValueError, match="process_group is not available for class-probability"):
        fusedce.cross_entropy(x, p, process_group=object())


@pytest.mark.parametrize("device", DEVICES)
def test_float64_metrics_count_what_the_contract_counts(device):
    """The float64 fallback's metrics against counts written here, on a problem that can tell:
    about half the counted rows on their argmax (so num_correct_tokens is far from 0), and
    ignored rows whose argmax is ignore_index itself (a count that forgot to drop them, or that
    counted them, is off). Classes last and classes at dim 1 (PyTorch's layout)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 30, generator=g, dtype=torch.float64) * 2
    argmax = x.argmax(-1)
    t = torch.randint(0, 30, (40,), generator=g)
    t[::2] = argmax[::2]
    ignored = torch.zeros(40, dtype=torch.bool)
    ignored[1::5] = True
    x[ignored, 7] = x[ignored].max(-1).values + 3.0  # their argmax is the ignore_index
    t[ignored] = 7
    keep = t != 7  # a row is ignored by its target alone (an argmax-7 row set above is too)
    want_correct = int(((x.argmax(-1) == t) & keep).sum())
    logp = torch.log_softmax(x, -1)
    want_entropy = float((-(logp.exp() * logp).sum(-1))[keep].sum())
    want_lse = torch.where(keep, torch.logsumexp(x, -1), 0.0)
    assert 10 <= want_correct < int(keep.sum())
    for layout in ("last", "dim1"):
        xl = (x.view(8, 5, 30) if layout == "last" else x.view(8, 5, 30).movedim(-1, 1)).to(device)
        tl = t.view(8, 5).to(device)
        _, m = fusedce.cross_entropy(xl, tl, ignore_index=7, return_metrics=True)
        assert m["num_correct_tokens"].item() == want_correct, layout
        assert abs(m["entropy_sum"].item() - want_entropy) <= 1e-5 * abs(want_entropy), layout
        torch.testing.assert_close(m["lse"].cpu().reshape(-1).double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_logits_are_pytorchs(device):
    # float64 logits go to F.cross_entropy itself (classes last flattened for it): its float64
    # result and gradient, bit for bit; fusedce's own options by the contract's formulas.
    x, t = make_problem((3, 4), 50, torch.float64, device, ignore_index=7)
    w = make_weight(50, device)
    for kw in ({}, {"weight": w, "ignore_index": 7, "label_smoothing": 0.1},
               {"reduction": "none", "ignore_index": 7}):
        g = torch.rand(t.shape, dtype=torch.float64, device=device) if kw.get("reduction") else None
        ours = loss_and_grad(lambda a: fusedce.cross_entropy(a, t, **kw), x, g)
        kwd = dict(kw, weight=w.double()) if "weight" in kw else kw
        theirs = loss_and_grad(lambda a: F.cross_entropy(a.reshape(-1, 50), t.reshape(-1), **kwd).reshape(
            t.shape if kw.get("reduction") else ()), x, g)
        assert ours[0].dtype == torch.float64
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), kw
    kw = dict(weight=w, ignore_index=7, label_smoothing=0.1, logit_scale=1.7, softcap=8.0, z_loss=1e-2)
    for reduction in ("none", "sum", "mean"):
        ours = loss_and_grad(lambda a: fusedce.cross_entropy(a, t, reduction=reduction, **kw), x)
        ref = loss_and_grad(lambda a: torch_cross_entropy(a, t, reduction=reduction, **kw), x)
        torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-12)
    loss, m = fusedce.cross_entropy(x, t, ignore_index=7, return_metrics=True)
    _, m32 = fusedce.cross_entropy(x.float(), t, ignore_index=7, return_metrics=True)
    assert m["num_correct_tokens"].item() == m32["num_correct_tokens"].item()
    torch.testing.assert_close(m["entropy_sum"], m32["entropy_sum"])
    torch.testing.assert_close(m["lse"], m32["lse"])
    with pytest.raises(ValueError, match="float64 logits are not computed by the fused kernels"):
        fusedce.cross_entropy(x, t, strict=True)
    with pytest.raises(ValueError, match="process_group is not available for float64 logits"):
        fusedce.cross_entropy(x, t, process_group=object())
