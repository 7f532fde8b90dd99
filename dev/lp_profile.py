"""Where the time of one linear log-probabilities call (forward + backward, with the entropy)
goes, kernel by kernel: fusedce.linear_logprobs (keep_logits None / False) beside TRL's chunked
head, under torch.profiler; and, with --budgets, whether another plan of the recomputing form
beats TRL's head at this shape within the memory bound: the call timed (CUDA events, median of
--repeat after warm-up) and its peak memory over the inputs at each chunk_budget_bytes given
(each budget picks plan_of's path: one chunk, vocabulary chunks of all rows, or token chunks;
src/cuda/logprobs/logprobs_cuda.cpp), beside the default and TRL's head in the same run. A
probe, not a benchmark (bench/trl_post_training.py times the defaults).

    PYTHONPATH=$(python3 tests/python/build_tree.py <build>):/tmp/site python3 dev/lp_profile.py 8192 896 151936
    ... python3 dev/lp_profile.py 8192 896 151936 --budgets 256M,512M,1G,2G --repeat 20
    ... python3 dev/lp_profile.py 8192 896 151936 --gaps     (host time and the GPU's idle gaps)
    python3 dev/lp_profile.py 64 32 1000 --budgets 64K,1M --device cpu --repeat 2   (smoke run)
"""
import argparse
import statistics
import time

import torch

import fusedce


def _bytes(text):
    """'512M' -> 536870912 (K, M, G: powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _problem(n, h, v, device):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = (torch.randn(n, h, device=device) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device) / h ** 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device)
    g1, g2 = torch.randn(n, device=device), torch.randn(n, device=device)
    return x, w, t, g1, g2


def _runs(x, w, t, g1, g2, budgets):
    def fused(keep, budget=None):
        def run():
            lp, ent = fusedce.linear_logprobs(x, w, t, return_entropy=True, keep_logits=keep,
                                              chunk_budget_bytes=budget)
            torch.autograd.backward((lp, ent), (g1, g2))
        return run

    runs = {"fusedce default": fused(None), "fusedce keep_logits=True": fused(True),
            "fusedce keep_logits=False": fused(False)}
    for b in budgets:
        runs[f"fusedce keep_logits=False, budget {b / 2 ** 20:g} MiB"] = fused(False, b)
    try:
        from trl.kernels import ChunkedLogProbFunction

        def trl_run():
            out = ChunkedLogProbFunction.apply(x, w, None, t, 1.0, 32768, None, 1.0, ("log_probs", "entropy"))
            torch.autograd.backward((out[0], out[1]), (g1, g2))
        runs["trl"] = trl_run
    except ImportError as e:
        print("trl:", e)
    return runs


def _clear(*leaves):
    for x in leaves:
        x.grad = None


def timed(runs, leaves, repeat, device):
    """Median ms of each run after warm-up, and its peak memory over what was allocated before."""
    print(f"\n| run | median ms | p10 | p90 | peak over inputs GiB |\n|---|---|---|---|---|")
    for name, run in runs.items():
        for _ in range(2):
            run()
            _clear(*leaves)
        times = []
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(repeat):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
                _clear(*leaves)
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        else:
            for _ in range(repeat):
                start = time.perf_counter()
                run()
                times.append((time.perf_counter() - start) * 1e3)
                _clear(*leaves)
            peak = float("nan")
        q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
        print(f"| {name} | {statistics.median(times):.3f} | {q[0]:.3f} | {q[-1]:.3f} | {peak:.3f} |")


def profiled(runs, leaves):
    from torch.profiler import ProfilerActivity, profile

    for name, run in runs.items():
        for _ in range(3):
            run()
            _clear(*leaves)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
                _clear(*leaves)
            torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(e.device_time_total for e in events) / 5 / 1e3
        print(f"\n== {name}: {total:.2f} ms of kernels a call")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:12]:
            print(f"  {e.device_time_total / 5 / 1e3:8.3f} ms  x{e.count // 5:<4d} {e.key[:110]}")


def gaps(runs, leaves, repeat):
    """Where a call's wall time is not kernel time: per run, the host's time to issue one call
    (perf_counter from an idle device to the return of the backward, no synchronisation inside),
    the GPU's span of one call timed alone (CUDA events, synchronised before), and under
    torch.profiler the kernels' busy time in that span and the largest idle gaps between
    consecutive kernels, with the kernels either side."""
    from torch.profiler import ProfilerActivity, profile

    for name, run in runs.items():
        for _ in range(3):
            run()
            _clear(*leaves)
        host, span = [], []
        for _ in range(repeat):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            run()
            b.record()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            span.append(a.elapsed_time(b))
            _clear(*leaves)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            run()
            torch.cuda.synchronize()
        _clear(*leaves)
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        busy = sum(e - s for s, e, _ in kernels) / 1e3
        first, last = kernels[0][0], max(e for _, e, _ in kernels)
        holes = sorted(((kernels[i + 1][0] - kernels[i][1], kernels[i][2], kernels[i + 1][2])
                        for i in range(len(kernels) - 1)), reverse=True)
        print(f"\n== {name}: host {statistics.median(host):.3f} ms to issue, span {statistics.median(span):.3f} ms "
              f"(events), profiled: {len(kernels)} kernels, busy {busy:.3f} ms of {(last - first) / 1e3:.3f}")
        for gap, before, after in holes[:8]:
            print(f"  gap {gap / 1e3:7.3f} ms after {before[:70]} before {after[:70]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("n", type=int)
    p.add_argument("h", type=int)
    p.add_argument("v", type=int)
    p.add_argument("--budgets", default="", help="chunk_budget_bytes values to time, e.g. 256M,1G")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gaps", action="store_true", help="host time and the GPU's idle gaps of each run")
    a = p.parse_args(argv)
    x, w, t, g1, g2 = _problem(a.n, a.h, a.v, a.device)
    budgets = [_bytes(b) for b in a.budgets.split(",") if b.strip()]
    runs = _runs(x, w, t, g1, g2, budgets)
    if a.gaps:
        gaps(runs, (x, w), a.repeat)
    elif budgets:
        timed(runs, (x, w), a.repeat, a.device)
    elif a.device == "cuda":
        profiled(runs, (x, w))


if __name__ == "__main__":
    main()
