"""Forward + backward time of fusedce.cross_entropy against torch.nn.functional.cross_entropy on
the same logits, on the CPU (default) or a GPU:

    python -m fusedce.bench [--device cpu|cuda] [--shapes 2048x32000,512x128256]
                            [--dtypes float32,bfloat16] [--repeat 5] [--warmup 2]
                            [--threads N]

Each row times loss + loss.backward() on a fresh leaf holding the logits (median of --repeat
runs after --warmup runs; the first runs at a new size pay for fresh pages of memory). "torch" is F.cross_entropy in the logits' dtype; "torch fp32" upcasts
first, as transformers' ForCausalLMLoss does for a bfloat16 model. Bytes: fusedce reads the
logits once and writes the gradient once (2 N V element sizes); GB/s is that over the time.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fusedce


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(fn, x, t, repeat, warmup, device):
    times = []
    for i in range(warmup + repeat):
        leaf = x.detach().requires_grad_(True)
        _sync(device)
        start = time.perf_counter()
        loss = fn(leaf, t)
        loss.backward()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        del loss, leaf
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="2048x32000,512x128256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave it)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    peers = {
        "fusedce": lambda x, t: fusedce.cross_entropy(x, t),
        "torch": lambda x, t: F.cross_entropy(x, t),
        "torch fp32": lambda x, t: F.cross_entropy(x.float(), t),
    }
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# fusedce {fusedce.__version__}, torch {torch.__version__}, {where}")
    print(f"| N x V | dtype | {' | '.join(f'{k} ms' for k in peers)} | fusedce GB/s | speed-up vs torch |")
    print("|---|---|" + "---|" * (len(peers) + 2))
    speedups = []
    for shape in a.shapes.split(","):
        n, v = (int(s) for s in shape.split("x"))
        for dtype_name in a.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            g = torch.Generator().manual_seed(0)
            x = (torch.randn(n, v, generator=g) * 2).to(dtype).to(a.device)
            t = torch.randint(0, v, (n,), generator=g).to(a.device)
            t[::7] = -100
            ms = {}
            for name, fn in peers.items():
                if name == "torch fp32" and dtype == torch.float32:
                    continue
                ms[name] = time_fwd_bwd(fn, x, t, a.repeat, a.warmup, a.device) * 1e3
            gbs = 2 * n * v * x.element_size() / (ms["fusedce"] * 1e-3) / 1e9
            speedup = ms["torch"] / ms["fusedce"]
            speedups.append(speedup)
            cells = " | ".join(f"{ms[k]:.1f}" if k in ms else "-" for k in peers)
            print(f"| {n} x {v} | {dtype_name} | {cells} | {gbs:.1f} | {speedup:.2f}x |")
    print(f"\ngeometric-mean speed-up over torch: {statistics.geometric_mean(speedups):.2f}x")


if __name__ == "__main__":
    main()
