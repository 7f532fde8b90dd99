"""Host time of one small cross-entropy call through the public API against PyTorch eager.

Prints, per shape: the time per call when calls are queued back to back (the host's cost when
it is slower than the GPU), the GPU time alone (CUDA events around a CUDA graph replay is not
used: events around N queued calls with the host far ahead), and a torch.profiler table of the
host-side operators of one fused call. Usage: python dev/host_time/probe.py [--device cuda]
"""
import argparse
import time

import torch
import torch.nn.functional as F

import fusedce
from fusedce._options import Options
from fusedce.ops import call_below_autograd


class PythonFunctionLoss(torch.autograd.Function):
    """ce_loss's C++ autograd (torch/autograd.h) written as a Python autograd.Function: the
    same ops (ce_fwd_bwd, then ce_rescale_ on the private dlogits), two Python frames more."""

    @staticmethod
    def forward(ctx, x, t, args):
        loss, *_, dlogits = call_below_autograd(torch.ops.fusedce.ce_fwd_bwd.default, x, t, None, *args, False)
        ctx.save_for_backward(dlogits)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (dlogits,) = ctx.saved_tensors
        torch.ops.fusedce.ce_rescale_(grad.float().contiguous(), dlogits)
        return dlogits, None, None


def per_call_us(fn, n=300):
    for _ in range(30):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    return host, wall


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    dt = torch.bfloat16 if a.device == "cuda" else torch.float32
    for n, v in [(64, 262144), (1, 128256), (1, 128), (4096, 32000)]:
        x = (torch.randn(n, v, device=a.device) * 2).to(dt).requires_grad_()
        t = torch.randint(0, v, (n,), device=a.device)
        args = Options().op_args()
        jobs = {
            "eager fwd+bwd": lambda: F.cross_entropy(x, t).backward(),
            # The op level: ce_loss's C++ autograd against the same steps in a Python
            # autograd.Function, and against a formula registered with torch.library.register_autograd
            # (ce_fwd_bwd's, which scales a copy).
            "op: Python Function fwd+bwd": lambda: PythonFunctionLoss.apply(x, t, args).backward(),
            "op: register_autograd fwd+bwd": lambda: torch.ops.fusedce.ce_fwd_bwd.default(x, t, None, *args,
                                                                                      False)[0].backward(),
            "op: ce_loss fwd+bwd": lambda: torch.ops.fusedce.ce_loss.default(x, t, None, *args, False)[0].backward(),
            "fusedce fwd+bwd": lambda: fusedce.cross_entropy(x, t).backward(),
            "eager fwd (no grad)": lambda: F.cross_entropy(x.detach(), t),
            "fusedce fwd (no grad)": lambda: fusedce.cross_entropy(x.detach(), t),
        }
        for name, fn in jobs.items():
            host, wall = per_call_us(fn)
            print(f"{n} x {v} {name:30s} host {host:8.1f} us/call, wall {wall:8.1f} us/call")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                fusedce.cross_entropy(x, t).backward()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
