"""Why is one GRPO policy step with fusedce.integrations.trl.apply() ~2.5 ms slower than TRL's own
step (34.5 against 32.0 ms on an H200) when the LM head alone (fusedce.linear_logprobs against
trl.kernels.ChunkedLogProbFunction, the same shape) differs by 0.2 ms? The step of
bench/trl_post_training.py's grpo part (its model, inputs, trainer config and `run` body), for
TRL and fusedce: the steps timed in interleaved rounds (CUDA events around each step, synchronised
before and after; median of --repeat after --warmup rounds), then one
step under torch.profiler: its span, the kernels' sum and the GPU's idle time inside it with the
longest gaps (the kernels either side, the CPU ops at the gap's start), the CUDA runtime calls
(synchronisations, copies, allocations, launches), kernel time under the head's CPU ops against
the rest, the head's CPU ops, and the caching allocator's device allocations during the step.
A probe, not a benchmark (the bench times the step).

    PYTHONPATH=$(python3 tests/python/build_tree.py build-gpu-torch):/tmp/site \\
        python3 dev/grpo_profile.py --trace $OUT/grpo
    ... python3 dev/grpo_profile.py --repeat 20 --completion-tokens 2048
    python3 dev/grpo_profile.py --smoke --device cpu --repeat 2 --warmup 1   (smoke run)
"""
import argparse
import bisect
import os
import re
import sys
from collections import defaultdict

import torch

import fusedce
from fusedce.bench.measure import spread, time_rounds, time_runs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import trl_post_training as bench  # noqa: E402  (the grpo part's model, inputs, config and timing)

STEP_MARK = "grpo_profile::step"
HEAD_MARK = "grpo_profile::head"
# CPU ops that belong to the head: fusedce's torch ops and autograd Functions (with their backward
# nodes), TRL's autograd Function, and the span this script puts around whichever head TRL calls.
HEAD_NAMES = ("fusedce", "linearlogprobs", "chunkedlogprob", HEAD_MARK)
RUNTIME_NAMED = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                 "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaGetDeviceProperties",
                 "cudaFuncSetAttribute", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
MEMORY_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def parse_args(argv):
    """The bench's grpo options with its defaults (its parse_args also takes the other parts'
    options and parses in the same call, so the grpo ones are repeated here)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the bench's tiny model and step (for the CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, help="the step's vocabulary (default 151936; --smoke 1000)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--completion-tokens", type=int, default=1024)
    p.add_argument("--model-dtype", choices=tuple(bench.DTYPES), default="bfloat16")
    p.add_argument("--repeat", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--trace", metavar="DIR", help="write each variant's chrome trace to DIR/<variant>.json")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU")
    a.model_dtype = bench.DTYPES[a.model_dtype]
    a.vocab = a.vocab or (1000 if a.smoke else 151936)
    return a


class _MarkedHead:
    """Whichever head trl.trainer.utils calls, inside one record_function: fusedce's stand-in is
    no autograd.Function, so without it its forward (the casts, the router) has no span of its own."""

    def __init__(self, inner):
        self.inner = inner

    def apply(self, *args, **kw):
        with torch.profiler.record_function(HEAD_MARK):
            return self.inner.apply(*args, **kw)


def profiled_step(run, device, trace_path):
    """One step under torch.profiler: (its events, the allocator's counter deltas)."""
    import trl.trainer.utils as trl_utils
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    bench.sync(device)
    before = torch.cuda.memory_stats() if device == "cuda" else {}
    head = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = _MarkedHead(head)
    try:
        with profile(activities=activities, record_shapes=False) as prof:
            with torch.profiler.record_function(STEP_MARK):
                run()
            bench.sync(device)  # the step's kernels finish inside the profile (outside the step's span)
    finally:
        trl_utils._ChunkedLogProbFunction = head
    after = torch.cuda.memory_stats() if device == "cuda" else {}
    if trace_path:
        os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
        prof.export_chrome_trace(trace_path)
    return prof.events(), {k: after[k] - before.get(k, 0) for k in MEMORY_KEYS if k in after}


def _table(title, header, rows):
    print(f"\n  {title}")
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(re.fullmatch(r"[-+]?[\d.]+|-", r[i]) for r in cells[1:]) for i in range(len(header))]
    for r in cells:  # numbers right-aligned, text left
        print("    " + "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip())


def _is_runtime(name):
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


def _chain(e, depth=3):
    """'innermost < parent < ...': a CPU event and its enclosing ops."""
    names = []
    while e is not None and len(names) < depth:
        names.append(e.name)
        e = e.cpu_parent
    return " < ".join(names)


def _in_head(e):
    while e is not None:
        if any(m in e.name.lower() for m in HEAD_NAMES):
            return True
        e = e.cpu_parent
    return False


def analyse(events):
    """Prints one variant's tables; returns its numbers for the summary (ms)."""
    dev = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    step = max((e for e in cpu if e.name == STEP_MARK), key=lambda e: e.time_range.elapsed_us())
    t0, t1 = step.time_range.start, step.time_range.end
    in_step = [e for e in cpu if t0 <= e.time_range.start < t1]
    out = {"host step ms": (t1 - t0) / 1e3}

    # the head's CPU ops (inclusive time: nested ones are counted in each)
    head_ops = defaultdict(lambda: [0, 0.0])
    for e in in_step:
        if any(m in e.name.lower() for m in HEAD_NAMES):
            head_ops[e.name][0] += 1
            head_ops[e.name][1] += e.time_range.elapsed_us()
    _table("head CPU ops (inclusive CPU time)", ["op", "count", "total ms"],
           [[n[:90], c, f"{t / 1e3:.3f}"] for n, (c, t) in sorted(head_ops.items(), key=lambda kv: -kv[1][1])])
    self_ops = defaultdict(lambda: [0, 0.0])
    for e in in_step:
        self_ops[e.name][0] += 1
        self_ops[e.name][1] += e.self_cpu_time_total
    _table("CPU ops by self time (top 12)", ["op", "count", "self ms"],
           [[n[:90], c, f"{t / 1e3:.3f}"] for n, (c, t) in sorted(self_ops.items(), key=lambda kv: -kv[1][1])[:12]])

    if not dev:
        print("\n  no GPU kernels (CPU run): no kernel times, idle gaps, runtime calls or allocator counters")
        return out

    # the step's span, the kernels' sum and the GPU's idle time between its first and last kernel
    dev.sort(key=lambda e: e.time_range.start)
    busy, gaps, end, last = 0.0, [], dev[0].time_range.start, dev[0]
    for e in dev:
        s, f = e.time_range.start, e.time_range.end
        if s > end:
            gaps.append((s - end, end, last.name, e.name))
        busy += max(0.0, f - max(s, end))
        if f > end:
            end, last = f, e
    kernel_sum = sum(e.time_range.elapsed_us() for e in dev)
    gpu_span = end - dev[0].time_range.start
    out.update({"wall span ms": (max(t1, end) - min(t0, dev[0].time_range.start)) / 1e3,
                "kernel sum ms": kernel_sum / 1e3, "GPU idle ms": (gpu_span - busy) / 1e3})
    print(f"\n  span {out['wall span ms']:.3f} ms (host step {out['host step ms']:.3f}, first kernel "
          f"{(dev[0].time_range.start - t0) / 1e3:.3f} ms after its start, last kernel "
          f"{(end - t1) / 1e3:+.3f} ms from its end); kernels {len(dev)}, sum {kernel_sum / 1e3:.3f} ms; "
          f"GPU idle {out['GPU idle ms']:.3f} ms of {gpu_span / 1e3:.3f} ms in {len(gaps)} gaps")

    # the CPU ops at each long gap's start: the innermost event covering it, on each thread
    by_start = sorted(cpu, key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in by_start]
    rows = []
    for gap, at, before, after in sorted(gaps, reverse=True)[:10]:
        inner = {}
        for e in by_start[:bisect.bisect_right(starts, at)]:
            if e.time_range.end >= at:
                inner[e.thread] = e  # later starts are nested deeper
        cpu_at = " | ".join(_chain(e) for e in inner.values()) or "-"
        rows.append([f"{gap / 1e3:.3f}", f"{(at - t0) / 1e3:.3f}", before[:45], after[:45], cpu_at[:160]])
    _table("longest GPU idle gaps", ["ms", "at ms", "kernel before", "kernel after", "CPU at the gap's start"],
           rows)

    # the CUDA runtime and driver calls of the step
    calls = defaultdict(lambda: [0, 0.0], {n: [0, 0.0] for n in RUNTIME_NAMED})
    for e in in_step:
        if _is_runtime(e.name):
            calls[e.name][0] += 1
            calls[e.name][1] += e.time_range.elapsed_us()
    ranked = sorted(calls.items(), key=lambda kv: -kv[1][1])
    _table("CUDA runtime / driver calls (CPU time; the named ones and the top 15)", ["call", "count", "total ms"],
           [[n, c, f"{t / 1e3:.3f}"] for i, (n, (c, t)) in enumerate(ranked) if i < 15 or n in RUNTIME_NAMED])
    out["syncs (stream/device/event)"] = "/".join(str(calls[n][0]) for n in SYNCS)
    out["cudaMalloc"] = calls["cudaMalloc"][0]

    # kernel time by the CPU op that launched it: under the head, or the rest; and who copies to the host
    head_us, other_us, d2h = 0.0, 0.0, defaultdict(int)
    for e in cpu:
        for k in e.kernels:
            if _in_head(e):
                head_us += k.duration
            else:
                other_us += k.duration
            if "DtoH" in k.name:
                d2h[("head: " if _in_head(e) else "") + _chain(e)] += 1
    out.update({"head kernels ms": head_us / 1e3, "other kernels ms": other_us / 1e3,
                "D2H copies": sum(d2h.values())})
    print(f"\n  kernel time: under the head's ops {head_us / 1e3:.3f} ms, the rest {other_us / 1e3:.3f} ms, "
          f"no CPU op found {(kernel_sum - head_us - other_us) / 1e3:.3f} ms")
    _table("device-to-host copies by the CPU op that launched them", ["count", "op < parents"],
           [[c, n[:150]] for n, c in sorted(d2h.items(), key=lambda kv: -kv[1])] or [["0", "-"]])
    per_kernel = defaultdict(lambda: [0, 0.0])
    for e in dev:
        per_kernel[e.name][0] += 1
        per_kernel[e.name][1] += e.time_range.elapsed_us()
    _table("kernels by total time (top 15)", ["kernel", "count", "total ms"],
           [[n[:90], c, f"{t / 1e3:.3f}"] for n, (c, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:15]])
    return out


def profile_variant(name, run, a, times):
    """Profiles one variant's step (its setting in place), beside its step times; returns its
    summary numbers."""
    median, p10, p90 = spread(times)
    # the bench's former timing: steps queued back to back, the host running ahead across them
    queued = spread(time_runs(run, a.repeat, a.warmup, a.device))[0]
    print(f"\n== {name}: step {median:.3f} ms median of {a.repeat} interleaved (p10 {p10:.3f}, p90 {p90:.3f}) "
          f"after {a.warmup} warm-up rounds; queued back to back {queued:.3f} ms")
    trace = os.path.join(a.trace, f"{name}.json") if a.trace else None
    events, memory = profiled_step(run, a.device, trace)
    out = {"step median ms": median, "queued step ms": queued, **analyse(events)}
    if memory:
        print("\n  allocator during the profiled step: " + ", ".join(f"{k} {v:+d}" for k, v in memory.items())
              + " (a device allocation inside a step synchronises)")
        out.update({f"{k} delta": v for k, v in memory.items()})
    if trace:
        print(f"\n  trace: {trace}")
    return out


def main(argv=None):
    a = parse_args(argv)
    import fusedce.integrations.trl as fused_trl

    seqs, prompt, completion = bench.step_sizes(a)
    print(f"fusedce {fusedce.__version__} (CUDA kernels: {fusedce.with_cuda}), torch {torch.__version__}, "
          f"{bench.device_name(a.device)}; {seqs} x ({prompt} + {completion}) tokens, vocabulary {a.vocab}, "
          f"{'smoke model' if a.smoke else f'{a.layers} layers'}, {str(a.model_dtype).split('.')[-1]}")
    run = bench.grpo_step(a)[0]
    results = {}

    def activate(name):
        if name == "trl":
            fused_trl.revert()
        else:
            fused_trl.apply()

    try:
        # both variants' steps in interleaved rounds (the chip's drift reaches both alike)
        times = time_rounds({"trl": run, "fusedce": run}, a.repeat, a.warmup, a.device, activate)
        for name in ("trl", "fusedce"):
            activate(name)
            results[name] = profile_variant(name, run, a, times[name])
    finally:
        fused_trl.revert()

    keys = list(dict.fromkeys(k for r in results.values() for k in r))

    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v)

    rows = []
    for k in keys:
        t, f = results["trl"].get(k), results.get("fusedce", {}).get(k)
        diff = f"{f - t:+.3f}" if isinstance(t, (int, float)) and isinstance(f, (int, float)) else ""
        rows.append([k, cell(t), cell(f), diff])
    print("\n== summary")
    _table("trl against fusedce.integrations.trl.apply()", ["", "trl", "fusedce", "fusedce - trl"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
