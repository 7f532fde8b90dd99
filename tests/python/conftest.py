"""Shared helpers of the Python tests: devices, problem generation, the float64 reference, and
the error-budget comparison (fusedce's error against float64 judged by PyTorch's own error in
the same dtype).

FUSEDCE_BUILD_DIR=<CMake build dir> (configured with -DFUSEDCE_TORCH=ON) runs the tests on that
build instead of an installed package: its package folder (build_tree.py, in a temporary folder)
goes first on sys.path, and on PYTHONPATH for the processes the tests start."""

import atexit
import os
import shutil
import sys
import tempfile

# Processes the tests start inherit the folder through PYTHONPATH (FUSEDCE_TEST_TREE names it).
if os.environ.get("FUSEDCE_BUILD_DIR") and not os.environ.get("FUSEDCE_TEST_TREE"):
    import build_tree

    _tree = tempfile.mkdtemp(prefix="fusedce-build-tree-")
    atexit.register(shutil.rmtree, _tree, True)
    build_tree.package_folder(os.environ["FUSEDCE_BUILD_DIR"], _tree)
    sys.path.insert(0, _tree)
    os.environ["FUSEDCE_TEST_TREE"] = _tree
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_tree, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedce  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fusedce.with_cuda
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and a CUDA build")),
]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and a CUDA build")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_problem(shape, vocab, dtype=torch.float32, device="cpu", *, ignore_frac=0.2,
                 ignore_index=-100, seed=0, scale=2.0):
    """Logits (*shape, vocab) with a few outliers far above the rest (so the softmax is not
    flat), targets (*shape) with about `ignore_frac` of them ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, vocab, generator=g) * scale
    n_out = max(1, vocab // 50)
    idx = torch.randint(0, vocab, (*shape, n_out), generator=g)
    x.scatter_(-1, idx, torch.full((*shape, n_out), 12.0) + torch.randn(*shape, n_out, generator=g))
    t = torch.randint(0, vocab, shape, generator=g)
    # some targets on an outlier (a confident right answer), the rest anywhere
    hit = torch.rand(shape, generator=g) < 0.3
    t = torch.where(hit, idx[..., 0], t)
    t[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    return x.to(dtype).to(device), t.to(device)


def make_weight(vocab, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(vocab, generator=g) * 1.5 + 0.25).to(device)


def torch_cross_entropy(logits, target, weight=None, *, ignore_index=-100, reduction="mean",
                        label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0,
                        compute_dtype=None):
    """docs/contract.md written with PyTorch ops, in `compute_dtype` (default: the logits'
    dtype). In float64 this is the reference; in the logits' dtype it is what PyTorch itself
    gets, whose error sets the budget. Where PyTorch has the option, F.cross_entropy is the
    judge."""
    dt = compute_dtype or logits.dtype
    vocab = logits.shape[-1]
    z = logits.reshape(-1, vocab).to(dt) * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    t = target.reshape(-1)
    w = weight.to(dt) if weight is not None else None
    loss = F.cross_entropy(z, t, w, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        keep = t != ignore_index
        zl = z_loss * torch.logsumexp(z, dim=-1) ** 2 * keep
        if reduction == "none":
            loss = loss + zl
        else:
            total = zl.sum()
            if reduction == "mean":
                denom = w[t[keep]].sum() if w is not None else keep.sum()
                total = total / denom
            loss = loss + total
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return loss


def loss_and_grad(fn, logits, grad_out=None):
    """fn(x) and d(sum(fn(x) * grad_out))/dx for a fresh leaf x holding `logits`."""
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x)
    g = torch.ones_like(loss) if grad_out is None else grad_out
    (grad,) = torch.autograd.grad(loss, x, g)
    return loss.detach(), grad


def error(a, ref):
    """Largest absolute difference from the float64 reference, over entries where the reference
    is finite; non-finite entries must agree exactly (NaN where NaN, inf where inf)."""
    a = a.double()
    ref = ref.double()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isnan(a), torch.isnan(ref)), "NaN masks differ"
    assert torch.equal(a[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)]), "inf entries differ"
    if not finite.any():
        return 0.0
    return (a[finite] - ref[finite]).abs().max().item()


def error_scales(logits, target, weight=None, *, ignore_index=-100, reduction="mean",
                 logit_scale=1.0, softcap=None, z_loss=0.0, grad_out=None, **unused):
    """The magnitudes float32 rounding acts on, which a result's own value can hide (a confident
    right answer has loss lse - z_t and gradient p_t - 1 near 0, while lse and z_t are large
    and p_t is near 1). With cond_i = |lse_i| + 1 + max_j |z_ij|, the relative error of a row's
    float32 log-sum-exp, and so of its softmax probabilities, is about cond_i units of rounding:
      loss scale  per row w_max * cond_i * (1 + 2 z_loss |lse_i|), reduced as the loss;
      grad scale  the largest |g_i| * 2 w_max * cond_i * (1 + 2 z_loss |lse_i|) * |logit_scale|,
                  g_i the row's upstream gradient (the reduction's factor included).
    """
    vocab = logits.shape[-1]
    z = logits.detach().reshape(-1, vocab).double() * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    t = target.reshape(-1)
    keep = t != ignore_index
    if not keep.any():
        return 0.0, 0.0
    lse = torch.logsumexp(z, -1).nan_to_num(0.0, 0.0, 0.0).abs()
    zmax = z.nan_to_num(0.0, 0.0, 0.0).abs().max(-1).values
    row = (lse + 1 + zmax) * (1 + 2 * z_loss * lse) * keep
    if weight is not None:
        row = row * weight.max().item()
    g = torch.ones(()) if grad_out is None else grad_out.detach().double().abs().cpu()
    if reduction == "none":
        loss_scale = row.max().item()
        g_row = g.reshape(-1).to(row.device) if g.dim() else g.item()
    else:
        loss_scale = row.sum().item()
        g_row = g.item()
        if reduction == "mean":
            denom = weight.double()[t[keep]].sum().item() if weight is not None else keep.sum().item()
            loss_scale /= denom
            g_row /= denom
    grad_scale = (row * g_row).max().item() * 2 * abs(logit_scale)
    return loss_scale, grad_scale


def assert_within_budget(ours, theirs, ref, *, what, k=2.0, scale, out_dtype=torch.float32):
    """fusedce's error (ours vs the float64 reference) may be at most k times PyTorch's own error
    in the same dtype (theirs), plus a floor for when PyTorch is exact by luck: one unit of
    rounding of `out_dtype` (fusedce must round its result to the dtype it writes) at the
    reference's magnitude, and four units of float32 rounding at `scale` (see error_scales)."""
    err_ours = error(ours, ref)
    err_theirs = error(theirs, ref) if theirs is not None else 0.0
    finite = ref[torch.isfinite(ref)]
    magnitude = finite.abs().max().item() if finite.numel() else 0.0
    floor = torch.finfo(out_dtype).eps * magnitude + 4 * torch.finfo(torch.float32).eps * scale
    budget = k * err_theirs + floor
    assert err_ours <= budget, (f"{what}: fusedce error {err_ours:.3e} > budget {budget:.3e} "
                                f"(PyTorch's own error {err_theirs:.3e}, rounding floor {floor:.3e})")
