"""Checks of a loaded Kernels Hub build of fusedce (kernels.get_local_kernel), shared by
test_kernels_hub.py (the CPU variant, in CI) and the GPU machine (the CUDA variant):

    python tests/python/hub_checks.py KERNEL_REPO --backend cuda

The exact signature of fused_linear_cross_entropy; its loss and the gradients of hidden, weight
and bias against a float64 reference (F.linear + F.cross_entropy, scale and soft-cap by the
contract's formulas) in float32, bfloat16 and float16, within the project's budget: twice
PyTorch's own error in the same dtype plus rounding floors; the metrics' names, dtypes and values;
loss and gradients bit-identical with and without metrics; cross_entropy likewise. Self-contained
(no installed fusedce needed)."""

import argparse
import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SIGNATURE = ("(hidden, weight, targets, bias=None, ignore_index=-100, logit_scale=1.0, "
             "softcap=None, reduction='mean', return_metrics=False)")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_problem(n, hidden_size, vocab, dtype, device, *, bias, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden_size, generator=g)
    w = torch.randn(vocab, hidden_size, generator=g) / hidden_size ** 0.5 * 2
    b = torch.randn(vocab, generator=g) * 0.5 if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.3] = -100
    cast = lambda x: None if x is None else x.to(dtype).to(device)  # noqa: E731
    return cast(h), cast(w), cast(b), t.to(device)


def transform(logits, logit_scale, softcap):
    z = logits * logit_scale
    return softcap * torch.tanh(z / softcap) if softcap else z


def reference(h, w, t, b, *, logit_scale=1.0, softcap=None, reduction="mean", dtype=torch.float64):
    z = transform(F.linear(h.to(dtype), w.to(dtype), None if b is None else b.to(dtype)),
                  logit_scale, softcap)
    return F.cross_entropy(z, t, ignore_index=-100, reduction=reduction)


def loss_and_grads(fn, tensors):
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in tensors]
    out = fn(*leaves)
    loss = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(loss.sum(), [x for x in leaves if x is not None])
    return out, loss.detach(), grads


def error(a, ref):
    return (a.double() - ref.double()).abs().max().item()


def budget_ok(ours, theirs, ref, scale, out_dtype):
    """ours' error may be twice PyTorch's own (theirs) plus one rounding of out_dtype at the
    reference's magnitude and four float32 roundings at `scale` (the magnitudes rounding acts
    on, which a small result can hide)."""
    floor = torch.finfo(out_dtype).eps * ref.abs().max().item() + 4 * torch.finfo(torch.float32).eps * scale
    return error(ours, ref) <= 2 * error(theirs, ref) + floor, error(ours, ref), 2 * error(theirs, ref) + floor


def scales(h, w, t, b, logit_scale, softcap, reduction):
    """Per row cond_i = |lse_i| + 1 + max_j |z_ij| + |scale| max_j sum_h |h_ih w_jh| units of
    rounding; the gradients carry A = g cond (p + onehot) |scale| through the products."""
    h64, w64 = h.double(), w.double()
    z = transform(F.linear(h64, w64, None if b is None else b.double()), logit_scale, softcap)
    keep = t != -100
    lse = torch.logsumexp(z, -1)
    dots = (h64.abs() @ w64.abs().t()).max(-1).values * abs(logit_scale)
    cond = torch.where(keep, lse.abs() + 1 + z.abs().max(-1).values + dots, 0.0)
    g = 1.0 / max(int(keep.sum()), 1) if reduction == "mean" else 1.0
    onehot = F.one_hot(torch.where(keep, t, 0), w.shape[0]).double()
    a = (g * cond)[:, None] * (torch.softmax(z, -1) + onehot) * abs(logit_scale)
    grads = [(a @ w64.abs()).max().item(), (a.t() @ h64.abs()).max().item(), a.sum(0).max().item()]
    return cond.sum().item() * g, grads


def check_linear(kernel, device, dtype, bias, options, reduction, failures):
    seed = DTYPES.index(dtype) * 4 + 2 * bias + (reduction == "sum")
    h, w, b, t = make_problem(53, 64, 515, dtype, device, bias=bias, seed=seed)
    label = f"fused_linear_cross_entropy {dtype} bias={bias} {options} {reduction}"
    tensors = (h, w, b)
    _, ours, ours_g = loss_and_grads(
        lambda h_, w_, b_: kernel.fused_linear_cross_entropy(h_, w_, t, b_, reduction=reduction, **options), tensors)
    _, ref, ref_g = loss_and_grads(
        lambda h_, w_, b_: reference(h_, w_, t, b_, reduction=reduction, **options),
        [None if x is None else x.double() for x in tensors])
    _, theirs, theirs_g = loss_and_grads(
        lambda h_, w_, b_: reference(h_, w_, t, b_, reduction=reduction, dtype=dtype, **options), tensors)
    loss_scale, grad_scales = scales(h, w, t, b, options.get("logit_scale", 1.0), options.get("softcap"), reduction)
    if ours.dtype != torch.float32:
        failures.append(f"{label}: loss dtype {ours.dtype}")
    ok, err, bud = budget_ok(ours, theirs, ref, loss_scale, torch.float32)
    if not ok:
        failures.append(f"{label}: loss error {err:.3e} > budget {bud:.3e}")
    for name, a, th, r, s in zip(("hidden", "weight", "bias"), ours_g, theirs_g, ref_g, grad_scales):
        ok, err, bud = budget_ok(a, th, r, s, dtype)
        if a.dtype != dtype or not ok:
            failures.append(f"{label}: grad_{name} ({a.dtype}) error {err:.3e} > budget {bud:.3e}")

    # Metrics: names, dtypes, values; the loss and gradients bit-identical with and without.
    out, loss_m, grads_m = loss_and_grads(
        lambda h_, w_, b_: kernel.fused_linear_cross_entropy(h_, w_, t, b_, reduction=reduction,
                                                             return_metrics=True, **options), tensors)
    metrics = out[1]
    if set(metrics) != {"num_correct_tokens", "entropy_sum"}:
        failures.append(f"{label}: metrics keys {sorted(metrics)}")
        return
    nc, ent = metrics["num_correct_tokens"], metrics["entropy_sum"]
    if nc.dtype != torch.int64 or nc.dim() != 0 or ent.dtype != torch.float32 or ent.dim() != 0:
        failures.append(f"{label}: metrics {nc.dtype} {tuple(nc.shape)}, {ent.dtype} {tuple(ent.shape)}")
    if not torch.equal(loss_m, ours) or not all(torch.equal(x, y) for x, y in zip(grads_m, ours_g)):
        failures.append(f"{label}: loss or gradients differ with return_metrics=True")
    z = transform(F.linear(h.double(), w.double(), None if b is None else b.double()),
                  options.get("logit_scale", 1.0), options.get("softcap"))
    keep = t != -100
    correct = int(((z.argmax(-1) == t) & keep).sum())
    p = torch.softmax(z, -1)
    entropy = float(torch.where(keep, torch.logsumexp(z, -1) - (p * z).sum(-1), 0.0).sum())
    slack = 0 if dtype == torch.float32 else 2  # near-ties of the rounded products may flip
    if abs(int(nc) - correct) > slack:
        failures.append(f"{label}: num_correct_tokens {int(nc)}, float64 says {correct}")
    rtol = 1e-4 if dtype == torch.float32 else 3e-2
    if abs(float(ent) - entropy) > rtol * abs(entropy) + 1e-3:
        failures.append(f"{label}: entropy_sum {float(ent)}, float64 says {entropy}")


def check_cross_entropy(kernel, device, dtype, failures):
    h, w, _, t = make_problem(41, 32, 300, dtype, device, bias=False, seed=7)
    logits = F.linear(h, w).detach()
    label = f"cross_entropy {dtype}"
    _, ours, (ours_g,) = loss_and_grads(lambda x: kernel.cross_entropy(x, t, softcap=10.0), (logits,))
    _, ref, (ref_g,) = loss_and_grads(lambda x: F.cross_entropy(transform(x, 1.0, 10.0), t), (logits.double(),))
    _, theirs, (theirs_g,) = loss_and_grads(lambda x: F.cross_entropy(transform(x, 1.0, 10.0), t), (logits,))
    z = transform(logits.double(), 1.0, 10.0)
    cond = (torch.logsumexp(z, -1).abs() + 1 + z.abs().max(-1).values)[t != -100]
    n = max(int((t != -100).sum()), 1)
    for what, a, th, r, s, dt in (("loss", ours, theirs, ref, cond.sum().item() / n, torch.float32),
                                  ("grad", ours_g, theirs_g, ref_g, 2 * cond.max().item() / n, dtype)):
        ok, err, bud = budget_ok(a, th, r, s, dt)
        if not ok:
            failures.append(f"{label}: {what} error {err:.3e} > budget {bud:.3e}")
    loss, metrics = kernel.cross_entropy(logits, t, return_metrics=True)
    if set(metrics) != {"num_correct_tokens", "entropy_sum"}:
        failures.append(f"{label}: metrics keys {sorted(metrics)}")


def run(kernel, device):
    """Every check on `device`; returns (number of checks, number failed, what failed)."""
    failures = []
    signature = str(inspect.signature(kernel.fused_linear_cross_entropy))
    if signature != SIGNATURE:
        failures.append(f"fused_linear_cross_entropy{signature}, expected {SIGNATURE}")
    checks = [lambda: None]  # the signature, checked above
    for dtype in DTYPES:
        for bias in (False, True):
            for options in ({}, {"logit_scale": 0.7, "softcap": 15.0}):
                for reduction in ("mean", "sum"):
                    checks.append(lambda a=(dtype, bias, options, reduction):
                                  check_linear(kernel, device, *a, failures))
        checks.append(lambda dtype=dtype: check_cross_entropy(kernel, device, dtype, failures))
    failed = 1 if failures else 0
    for check in checks[1:]:
        before = len(failures)
        check()
        failed += len(failures) > before
    return len(checks), failed, failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo", type=Path, help="the kernel repository (build.toml, build/<variant>/)")
    parser.add_argument("--backend", default=None, help="cpu or cuda (default: kernels' choice)")
    args = parser.parse_args()
    import kernels

    kernel = kernels.get_local_kernel(args.repo.resolve(), backend=args.backend)
    device = "cuda" if kernel.with_cuda and torch.cuda.is_available() and args.backend != "cpu" else "cpu"
    print(f"loaded {kernel.__name__} from {Path(kernel.__file__).parent}; checks on {device}")
    count, failed, failures = run(kernel, device)
    for failure in failures:
        print("FAILED", failure)
    print(f"hub checks: {count - failed} passed, {failed} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
