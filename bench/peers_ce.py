"""Peers' cross-entropy over logits, timed like bench/ce_bench.cu, for bench/RESULTS.md.

Runs on the GPU machine inside scripts/gpu_check.sh, right after fusedce_bench, so both tables come
from the same run on the same card. Ceilings are measured here again (torch copy and a streaming
sum). Jobs and byte formulas as in ce_bench.cu: forward N*V*elem; forward+gradient 2*N*V*elem.
Peers: PyTorch eager (`F.cross_entropy(logits.float(), ...)`, as transformers calls it), the same
under torch.compile, Liger-Kernel when importable, the fusedce Python front end, and
flash-attn's Triton cross-entropy loaded from the file named by $FUSEDCE_PEER_FLASH_ATTN_CE (its
module imports only torch and triton; the wheel's CUDA extension is not needed). A missing or
failing peer is reported as such. "median ms" waits for each call before the next (an isolated
call); "queued ms" enqueues every call with its events and waits once (GPU time per call with
the host ahead), as ce_bench.cu does. Usage: python3 bench/peers_ce.py [--quick]
[--shapes NxV[:f32|bf16|f16],...]
"""
import importlib.util
import os
import statistics
import sys

import torch
import torch.nn.functional as F

SHAPES = [(16384, 32000, torch.bfloat16), (8192, 128256, torch.bfloat16), (4096, 262144, torch.bfloat16),
          (64, 262144, torch.bfloat16), (8192, 151936, torch.bfloat16), (8192, 128256, torch.float32)]


def median_ms(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def queued_ms(fn, iters):
    """Events around each call, all enqueued before one wait: per-call GPU time, the host ahead."""
    for _ in range(3):
        fn(0)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def parse_shapes(arg):
    """"NxV[:dtype],..." (dtype f32, bf16 or f16; bf16 when left out)."""
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    shapes = []
    for item in arg.split(","):
        dims, _, dt = item.partition(":")
        n, v = (int(x) for x in dims.split("x"))
        shapes.append((n, v, dtypes[dt or "bf16"]))
    return shapes


def ceilings(iters):
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    b = torch.empty_like(a)
    copy = median_ms(lambda i: b.copy_(a), iters)
    x = a.view(torch.float32)
    read = median_ms(lambda i: x.sum(), iters)
    return 2 * n / copy / 1e6, n / read / 1e6


def eager_loss(x, t):
    return F.cross_entropy(x.float(), t)


def peers():
    out = {"torch eager": eager_loss, "torch.compile": torch.compile(eager_loss)}
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        out["liger"] = lambda x, t: liger_cross_entropy(x, t)
    except Exception as e:  # reported, never hides the row
        print(f"# liger: not available ({type(e).__name__}: {e})")
    path = os.environ.get("FUSEDCE_PEER_FLASH_ATTN_CE")
    try:
        spec = importlib.util.spec_from_file_location("flash_attn_ce", path)
        fa = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fa)
        out["flash-attn"] = lambda x, t: fa.cross_entropy_loss(x, t)[0].mean()
    except Exception as e:
        print(f"# flash-attn: not available ({type(e).__name__}: {e}; FUSEDCE_PEER_FLASH_ATTN_CE={path})")
    try:
        import fusedce

        out["fusedce (torch op)"] = lambda x, t: fusedce.cross_entropy(x, t)
    except Exception as e:
        print(f"# fusedce Python front end: not available ({type(e).__name__}: {e})")
    return out


def main():
    quick = "--quick" in sys.argv
    shapes = SHAPES
    if "--shapes" in sys.argv:
        shapes = parse_shapes(sys.argv[sys.argv.index("--shapes") + 1])
    iters = 10 if quick else 30
    copy_gbs, read_gbs = ceilings(iters)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"# ceilings: device-to-device copy {copy_gbs:.0f} GB/s (read + write), streaming read {read_gbs:.0f} GB/s\n")
    print("| N x V | dtype | peer | job | median ms | GB/s | of copy | of read | queued ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for n, v, dt in shapes:
        elem = torch.tensor([], dtype=dt).element_size()
        copies = max(1, -(-3 * l2 // (n * v * elem)))
        xs = [(torch.randn(n, v, device="cuda") * 2).to(dt) for _ in range(copies)]
        t = torch.randint(0, v, (n,), device="cuda")
        for name, fn in peers().items():
            for job in ("forward", "fwd+grad"):
                try:
                    if job == "forward":
                        def run(i, fn=fn):
                            with torch.no_grad():
                                fn(xs[i % copies], t)
                    else:
                        leaves = [x.detach().requires_grad_(True) for x in xs]

                        def run(i, fn=fn, leaves=leaves):
                            leaf = leaves[i % copies]
                            leaf.grad = None
                            fn(leaf, t).backward()
                    ms = median_ms(run, iters)
                    queued = queued_ms(run, iters)
                    gbs = (1 if job == "forward" else 2) * n * v * elem / ms / 1e6
                    print(f"| {n} x {v} | {str(dt)[6:]} | {name} | {job} | {ms:.4f} | {gbs:.0f} | "
                          f"{100 * gbs / copy_gbs:.1f}% | {100 * gbs / read_gbs:.1f}% | {queued:.4f} |", flush=True)
                except Exception as e:
                    print(f"| {n} x {v} | {str(dt)[6:]} | {name} | {job} | failed: {type(e).__name__} | | | | |", flush=True)
                torch.cuda.empty_cache()
        del xs


if __name__ == "__main__":
    main()
