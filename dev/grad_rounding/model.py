"""A CPU model of the linear CUDA path's gradient rounding, to tell luck from bias in
tests/python/test_gradient_accuracy.py's judge: the upstream gradient g = 1/N of a mean folded
into the 16-bit dlogits (main: bf16(g (p - y)), entry for entry what PyTorch's own 16-bit path
forms) against g applied as the gradient products' float32 alpha (dev/pending/alpha-scale.patch:
bf16(p - y), then g times the float32 product, rounded once). Each form is modelled as the GPU
computes it: the logits product rounded once to the dtype with the bias added before rounding
(cuBLASLt's bias epilogue), the softmax in float32, the products accumulated in float32 and
rounded once. On the judge's inputs (trained_looking, SHAPE, with a bias) the model reproduces
what an H100 gave for the alpha form at seed 0 (grad_bias relative error 2.255e-3 against
PyTorch's 2.036e-3 in bf16; grad_weight's share +5.5e-5 against +2.4e-5 in fp16).

Prints, per dtype and gradient, over SEEDS seeds: the alpha form's relative error over PyTorch's
(the folded form's, which equals PyTorch's), both forms' signed shares (mean and spread over
seeds), and how many seeds the judge fails; then the same with a planted 0.5% bf16 shrink of
alpha (0.1%, two units, in fp16), which every gradient must fail, or the model says nothing. Where
the test module has judge_over_seeds, also that judge over each group of len(SEEDS) seeds.

Run from the repository root (a CMake build tree of the torch extension made importable, as for
the tests, since the test module imports fusedce):
  PYTHONPATH=$(python tests/python/build_tree.py <build dir>) python dev/grad_rounding/model.py [SEEDS]
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))
import test_gradient_accuracy as tga  # noqa: E402
from test_gradient_accuracy import SHAPE, error_stats, judge, trained_looking  # noqa: E402


def modelled(h, w, b, t, dtype, alpha_form, shrink=1.0):
    """grad_hidden, grad_weight, grad_bias of the mean cross-entropy, as the GPU forms them."""
    g = 1.0 / h.shape[0]
    z = (h.float() @ w.float().T + b.float()).to(dtype).float()
    d = torch.softmax(z, 1) - F.one_hot(t, w.shape[0]).float()
    dl, alpha = ((d.to(dtype).float(), g * shrink) if alpha_form else ((d * g).to(dtype).float(), 1.0))
    return tuple((alpha * x).to(dtype).double() for x in (dl @ w.float(), dl.T @ h.float(), dl.sum(0)))


def one_seed(seed, dtype, shrink):
    h, w, t = trained_looking(*SHAPE, seed, "cpu")
    h, w = h.to(dtype), w.to(dtype)
    b = torch.randn(SHAPE[2], generator=torch.Generator().manual_seed(seed + 1000)).to(dtype)
    dz = (torch.softmax(h.double() @ w.double().T + b.double(), 1) - F.one_hot(t, SHAPE[2]).double()) / SHAPE[0]
    exact = (dz @ w.double(), dz.T @ h.double(), dz.sum(0))
    ours, theirs = modelled(h, w, b, t, dtype, True, shrink), modelled(h, w, b, t, dtype, False)
    return [(error_stats(o, r), error_stats(p, r), error_stats(r.to(dtype).double(), r))
            for o, p, r in zip(ours, theirs, exact)]


def main(seeds):
    torch.set_num_threads(2)
    for dtype, planted in ((torch.bfloat16, 0.995), (torch.float16, 0.999)):
        for shrink in (1.0, planted):
            runs = [one_seed(s, dtype, shrink) for s in range(seeds)]
            for i, name in enumerate(("grad_hidden", "grad_weight", "grad_bias")):
                ours = torch.tensor([r[i][0]["proj"] for r in runs], dtype=torch.float64)
                theirs = torch.tensor([r[i][1]["proj"] for r in runs], dtype=torch.float64)
                ratio = torch.tensor([r[i][0]["rel"] / r[i][1]["rel"] for r in runs])
                fails = sum(bool(judge(r[i][0], r[i][1], dtype, r[i][2])) for r in runs)
                if hasattr(tga, "judge_over_seeds"):  # the judge on the mean of each group of its seeds
                    k = len(tga.SEEDS)
                    groups = [runs[j:j + k] for j in range(0, seeds - k + 1, k)]
                    grouped = sum(bool(tga.judge_over_seeds([r[i] for r in g], dtype)) for g in groups)
                    fails = f"{fails} of {seeds} seeds, over-seeds judge {grouped} of {len(groups)} groups of {k}"
                print(f"{str(dtype)[6:]:8} shrink {shrink:<8} {name:11}  error / PyTorch's: mean {ratio.mean():.3f} "
                      f"(min {ratio.min():.3f}, max {ratio.max():.3f});  share: alpha {ours.mean():+.2e} "
                      f"(sd {ours.std():.1e}), folded = PyTorch's {theirs.mean():+.2e} (sd {theirs.std():.1e});  "
                      f"judge fails {fails}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
