"""torch.autograd.gradcheck of fusedce.cross_entropy and of the differentiable ops.

The core computes in float32 and takes float32 / bfloat16 / float16 logits only, so the check
runs on float32 inputs, not float64: central differences with eps = 1e-2 on logits of order 1,
whose float32 error (truncation about eps^2 times a third derivative, rounding about 1e-7 / eps
of a loss of order 1) was at most 6e-5 over these cases. The tolerances (atol 3e-4, rtol 3e-3)
leave a margin of five over that and stay far below a real mistake:
test_gradcheck_catches_a_wrong_gradient shows the same check failing for a gradient off by 1 %.
"""

import warnings

import pytest
import torch

import fusedce
from torch.autograd.gradcheck import GradcheckError
from conftest import DEVICES, make_weight

TOL = dict(eps=1e-2, atol=3e-4, rtol=3e-3)

OPTIONS = {
    "plain": {},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.2},
    "scale_softcap_zloss": {"logit_scale": 1.5, "softcap": 2.0, "z_loss": 0.05},
    "everything": {"weight": True, "label_smoothing": 0.1, "logit_scale": 0.8, "softcap": 3.0,
                   "z_loss": 0.02, "ignore_index": 1},
}


def _gradcheck(fn, x):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not of double precision.*")
        warnings.filterwarnings("ignore", message=".*not a double precision.*")
        return torch.autograd.gradcheck(fn, (x,), **TOL)


def _problem(device, ignore_index=-100):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 6, generator=g).to(device).requires_grad_(True)
    t = torch.tensor([0, 5, ignore_index, 2]).to(device)
    return x, t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("inplace", [False, True])
def test_gradcheck(device, reduction, opts, inplace):
    kw = dict(opts)
    if kw.pop("weight", False):
        kw["weight"] = make_weight(6, device)
    x, t = _problem(device, kw.get("ignore_index", -100))
    # x * 1.0: inplace_backward overwrites its input, and gradcheck reuses x.
    assert _gradcheck(lambda a: fusedce.cross_entropy(a * 1.0, t, reduction=reduction,
                                                      inplace_backward=inplace, **kw), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["ce_loss", "ce_fwd_bwd"])
def test_gradcheck_ops(device, op):
    x, t = _problem(device)
    args = (t, make_weight(6, device), -100, "sum", 0.1, 1.2, 4.0, 0.01, False)
    fn = getattr(torch.ops.fusedce, op)
    assert _gradcheck(lambda a: fn(a, *args)[0], x)


class _WrongGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t):
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            loss = fusedce.cross_entropy(x_, t)
            (g,) = torch.autograd.grad(loss, x_)
        ctx.save_for_backward(g)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        return grad * g * 1.01, None


def test_gradcheck_catches_a_wrong_gradient():
    x, t = _problem("cpu")
    with pytest.raises(GradcheckError):
        _gradcheck(lambda a: _WrongGradient.apply(a, t), x)


# ---- fused linear cross-entropy ------------------------------------------------------------
# The core takes no float64 either, so the same float32 check: hidden, weight and bias of order
# 1 (logits of order 1), the same step and tolerances.


def _linear_problem(device, ignore_index=-100):
    g = torch.Generator().manual_seed(12)
    h = torch.randn(2, 3, 5, generator=g).to(device).requires_grad_(True)
    w = (torch.randn(7, 5, generator=g) * 0.5).to(device).requires_grad_(True)
    b = (torch.randn(7, generator=g) * 0.5).to(device).requires_grad_(True)
    t = torch.tensor([[0, 6, ignore_index], [2, 4, 1]]).to(device)
    return h, w, b, t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("shift", [False, True])
def test_gradcheck_linear(device, reduction, opts, shift):
    kw = dict(opts)
    if kw.pop("weight", False):
        kw["class_weight"] = make_weight(7, device)
    h, w, b, t = _linear_problem(device, kw.get("ignore_index", -100))
    fn = lambda h_, w_, b_: fusedce.linear_cross_entropy(h_, w_, t, b_, reduction=reduction,  # noqa: E731
                                                         shift=shift, **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not of double precision.*")
        warnings.filterwarnings("ignore", message=".*not a double precision.*")
        assert torch.autograd.gradcheck(fn, (h, w, b), **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["lce_fwd", "lce_fwd_bwd"])
def test_gradcheck_linear_ops(device, op):
    # The raw ops' own autograd formulas (a recompute with the upstream gradient).
    h, w, b, t = _linear_problem(device)
    opts = (t.reshape(-1), make_weight(7, device), -100, "none", 0.1, 1.2, 4.0, 0.01, 3, 0, False, False)
    extra = (False,) if op == "lce_fwd" else (None, False, False, False, False)
    fn = getattr(torch.ops.fusedce, op)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not of double precision.*")
        warnings.filterwarnings("ignore", message=".*not a double precision.*")
        assert torch.autograd.gradcheck(
            lambda h_, w_, b_: fn(h_.reshape(-1, 5), w_, b_, *opts, *extra)[0], (h, w, b), **TOL)
