"""SFT's head (issue 44): one fused linear cross-entropy call, forward + backward, shifted labels
with each sequence's prompt ignored, at each plan the options pick (the default, low_memory,
and chunk_budget_bytes values), timed (CUDA events, median of --repeat after warm-up) with its
peak memory over the inputs, beside TRL's chunked head computing the same mean NLL; and,
without --budgets, each plan kernel by kernel under torch.profiler. Does a plan of the linear
loss beat TRL's head in both time and memory at SFT's shape? A probe, not a benchmark
(bench/trl_post_training.py times the whole SFT step).

    PYTHONPATH=$(python3 tests/python/build_tree.py <build>):/tmp/site python3 dev/lce_budgets.py 8 1152 896 151936 --budgets 128M,256M,512M --repeat 20
    python3 dev/lce_budgets.py 2 40 32 1000 --budgets 64K --device cpu --repeat 2   (smoke run)
"""
import argparse
import os
import sys

import torch

import fusedce

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lp_profile import _bytes, profiled, timed  # noqa: E402  (the same timing and profile)


def _problem(b, s, h, v, prompt, device):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = (torch.randn(b, s, h, device=device) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device) / h ** 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (b, s), device=device)
    labels[:, :prompt] = -100
    return x, w, labels


def _runs(x, w, labels, budgets):
    def fused(**kw):
        def run():
            fusedce.linear_cross_entropy(x, w, labels, shift=True, **kw).backward()
        return run

    runs = {"fusedce default": fused(), "fusedce low_memory": fused(low_memory=True),
            "fusedce skip_ignored": fused(skip_ignored=True)}
    for b in budgets:
        runs[f"fusedce budget {b / 2 ** 20:g} MiB"] = fused(chunk_budget_bytes=b)
    try:
        from trl.kernels import ChunkedLogProbFunction

        def trl_run():
            h = x[:, :-1].reshape(-1, x.shape[-1])
            t = labels[:, 1:].reshape(-1)
            keep = t != -100
            lp = ChunkedLogProbFunction.apply(h, w, None, t.clamp(min=0), 1.0, 32768, None, 1.0, ("log_probs",))[0]
            (-(lp * keep).sum() / keep.sum()).backward()
        runs["trl"] = trl_run
    except ImportError as e:
        print("trl:", e)
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("batch", type=int)
    p.add_argument("seq", type=int)
    p.add_argument("h", type=int)
    p.add_argument("v", type=int)
    p.add_argument("--prompt", type=int, default=128, help="ignored positions at each sequence's start")
    p.add_argument("--budgets", default="", help="chunk_budget_bytes values to time, e.g. 256M,1G")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = p.parse_args(argv)
    x, w, labels = _problem(a.batch, a.seq, a.h, a.v, a.prompt, a.device)
    budgets = [_bytes(b) for b in a.budgets.split(",") if b.strip()]
    runs = _runs(x, w, labels, budgets)
    if budgets:
        timed(runs, (x, w), a.repeat, a.device)
    elif a.device == "cuda":
        profiled(runs, (x, w))


if __name__ == "__main__":
    main()
