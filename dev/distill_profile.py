"""Where the time of one fused linear distillation call (forward + backward, bf16) goes, kernel
by kernel under torch.profiler: fusedce.linear_distillation (JSD beta 0.5, and forward KL) and the
top-k form, beside the bare products of the same shape; and, with --budgets, the call timed
(CUDA events, median of --repeat after warm-up) with its peak memory at each chunk_budget_bytes
given. A probe, not a benchmark (bench/distill_bench.py times the defaults against the peers).

    PYTHONPATH=$(python3 tests/python/build_tree.py <build>):/tmp/site python3 dev/distill_profile.py 8192 4096 128256
    ... python3 dev/distill_profile.py 1024 4096 128256 --budgets 256M,1G,4G --repeat 10
"""
import argparse
import statistics

import torch

import fusedce


def _bytes(text):
    """'512M' -> 536870912 (K, M, G: powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _runs(n, h, v, budgets, k=64):
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    hs = (torch.randn(n, h, device=dev) * 0.5).to(dt).requires_grad_()
    ws = (torch.randn(v, h, device=dev) / h ** 0.5).to(dt).requires_grad_()
    ht = (torch.randn(n, h, device=dev) * 0.5).to(dt)
    wt = (torch.randn(v, h, device=dev) / h ** 0.5).to(dt)
    with torch.no_grad():
        top = torch.log_softmax((ht @ wt.T).float(), -1).topk(k, -1)
    ids, lps = top.indices, top.values.contiguous()

    def full(divergence, budget=None):
        def run():
            fusedce.linear_distillation(hs, ws, ht, wt, divergence=divergence, chunk_budget_bytes=budget).backward()
        return run

    def topk():
        fusedce.linear_distillation_topk(hs, ws, ids, lps).backward()

    def products():
        z = hs.detach() @ ws.detach().T
        zt = ht @ wt.T
        dz = z + zt
        _ = dz @ ws.detach()
        _ = dz.T @ hs.detach()

    runs = {"four products": products, "jsd": full("jsd"), "forward_kl": full("forward_kl"), "top-k": topk}
    for b in budgets:
        runs[f"jsd, budget {b / 2 ** 20:g} MiB"] = full("jsd", b)
    return runs, (hs, ws)


def _clear(leaves):
    for x in leaves:
        x.grad = None


def timed(runs, leaves, repeat):
    print("\n| run | median ms | p10 | p90 | peak over inputs GiB |\n|---|---|---|---|---|")
    for name, run in runs.items():
        for _ in range(2):
            run()
            _clear(leaves)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
            _clear(leaves)
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
        print(f"| {name} | {statistics.median(times):.3f} | {q[0]:.3f} | {q[-1]:.3f} | {peak:.3f} |")


def profiled(runs, leaves):
    from torch.profiler import ProfilerActivity, profile

    for name, run in runs.items():
        for _ in range(3):
            run()
            _clear(leaves)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
                _clear(leaves)
            torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(e.device_time_total for e in events) / 5 / 1e3
        print(f"\n== {name}: {total:.2f} ms of kernels a call")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:14]:
            print(f"  {e.device_time_total / 5 / 1e3:8.3f} ms  x{e.count // 5:<4d} {e.key[:120]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("n", type=int)
    p.add_argument("h", type=int)
    p.add_argument("v", type=int)
    p.add_argument("--budgets", default="", help="chunk_budget_bytes values to time, e.g. 256M,1G")
    p.add_argument("--repeat", type=int, default=10)
    a = p.parse_args(argv)
    budgets = [_bytes(b) for b in a.budgets.split(",") if b.strip()]
    runs, leaves = _runs(a.n, a.h, a.v, budgets)
    if budgets:
        timed(runs, leaves, a.repeat)
    else:
        profiled(runs, leaves)


if __name__ == "__main__":
    main()
