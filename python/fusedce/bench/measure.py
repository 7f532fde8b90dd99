"""How a run is measured: wall time (CUDA events on a GPU, perf_counter on the CPU), the ceilings
of the machine measured in the same process, and the peak of extra device memory.

Byte and FLOP formulas (written once here, used by every row):
  cross-entropy forward          N * V * elem bytes      (each logit read once)
  cross-entropy forward+backward 2 * N * V * elem bytes  (each logit read once, each gradient
                                                          element written once)
  linear cross-entropy fwd+bwd   6 * N * H * V FLOPs     (logits 2NHV, grad_hidden 2NHV,
                                                          grad_weight 2NHV; every token counted,
                                                          ignored ones too)
  copy ceiling                   2 * bytes / time        (a device-to-device copy reads and
                                                          writes every byte)
  GEMM ceiling                   2 * M * K * N / time    (torch.matmul (M, K) x (K, N))
"""

import gc
import statistics
import time

import torch


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_runs(run, repeat, warmup, device):
    """Milliseconds of each of `repeat` calls run(i) after `warmup` calls. On a GPU, CUDA events
    around each call, recorded back to back (the host runs ahead, so a call's time is the GPU's
    unless launching it takes longer than running it); on the CPU, perf_counter."""
    for i in range(warmup):
        run(i)
    sync(device)
    if device == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        for i in range(repeat):
            starts[i].record()
            run(warmup + i)
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = []
    for i in range(repeat):
        start = time.perf_counter()
        run(warmup + i)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_blocks(runs, repeat, warmup, device, blocks=5, before=None):
    """Milliseconds of `repeat` calls of each run in `runs` (a dict name -> run(i)), timed as
    time_runs times one run (back to back, the host running ahead) but in `blocks` blocks per run,
    interleaved: a round times one block of every run, in an order rotated by one from the last
    round's, so that the chip's clock and temperature drift over the rounds reach every run alike
    (run one after the other, identical code measured 1-3% apart on an H100). Before its first
    block a run has its `warmup` calls; every later block starts with one untimed call, so no run
    is timed straight after another run's memory traffic. before(), when given, is called ahead of
    each block, untimed (inputs that a run overwrites in place are restored there). Returns
    name -> list of times."""
    names = list(runs)
    blocks = max(1, min(blocks, repeat))
    sizes = [repeat // blocks + (1 if b < repeat % blocks else 0) for b in range(blocks)]
    times = {name: [] for name in names}
    done = {name: 0 for name in names}
    for b, size in enumerate(sizes):
        shift = b % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            start = done[name]
            run = runs[name]
            if before is not None:
                before()
            times[name] += time_runs(lambda i, run=run, start=start: run(start + i), size,
                                     warmup if b == 0 else 1, device)
            done[name] += size + (warmup if b == 0 else 1)
    return times


def time_rounds(runs, repeat, warmup, device, activate=None):
    """Milliseconds of `repeat` calls of each run in `runs` (a dict name -> run(i)), interleaved
    in rounds so that the chip's clock and temperature drift reach every run alike: a round calls
    every run once, in an order rotated by one from the last round's (no run always follows the
    same one), after `warmup` rounds that are not timed. activate(name), when given, is called
    before each call and outside its timing: a run whose setting is global (a patched trainer)
    gets it back. Each call starts on an idle device and is timed alone (CUDA events around it,
    synchronised before and after; on the CPU perf_counter), so a step that synchronises inside
    itself is timed the same way whatever ran before it. Returns name -> list of times."""
    names = list(runs)
    times = {name: [] for name in names}
    for r in range(warmup + repeat):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if activate is not None:
                activate(name)
            sync(device)
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                runs[name](r)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                runs[name](r)
                ms = (time.perf_counter() - t0) * 1e3
            if r >= warmup:
                times[name].append(ms)
    return times


def spread(times):
    """(median, 10th percentile, 90th percentile) of a list of times, interpolated between the
    nearest runs (with few runs p10 and p90 are the fastest and the slowest)."""
    ordered = sorted(times)

    def pct(q):
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return statistics.median(ordered), pct(0.1), pct(0.9)


def copy_ceiling_gbs(device, quick):
    """Device-to-device copy bandwidth, bytes read + written per second (GB/s): the ceiling of a
    job that reads its input once and writes an output of the same size once. 2 GiB on a GPU
    (far past any L2), 256 MiB on the CPU."""
    n = (256 << 20) if device == "cpu" or quick else (2 << 30)
    a = torch.ones(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = time_runs(lambda i: b.copy_(a), 5 if quick else 20, 2, device)
    del a, b
    return 2 * n / (statistics.median(times) * 1e-3) / 1e9


def gemm_ceiling_tflops(device, dtype, quick):
    """A large GEMM's rate through torch.matmul (M, K) x (K, N) in `dtype` (TFLOP/s), the (K, N)
    operand the transpose of an (N, K) matrix as F.linear uses a weight: the ceiling of linear
    cross-entropy, which is three such products."""
    if device == "cuda":
        m, k, n = (8192, 4096, 8192) if quick else (16384, 4096, 16384)
    else:
        m, k, n = (256, 1024, 2048) if quick else (512, 2048, 4096)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=g).to(dtype)
    b = torch.randn(n, k, device=device, generator=g).to(dtype).T  # stored as a weight (V, H) is
    times = time_runs(lambda i: torch.matmul(a, b), 3 if quick else 10, 2, device)
    return 2 * m * k * n / (statistics.median(times) * 1e-3) / 1e12


def peak_extra_bytes(run, inputs, device):
    """Peak device memory one call run(0) allocates beyond what is live before it, less the
    outputs it returns (the loss and the gradients, which any implementation must produce); an
    output that shares storage with an input (a gradient written in place over the logits) is
    not subtracted, since it took no new memory. None on the CPU (no allocator statistics)."""
    if device != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    outputs = run(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    input_storages = {t.untyped_storage().data_ptr() for t in inputs}
    fresh = 0
    for out in outputs:
        if out is not None and out.untyped_storage().data_ptr() not in input_storages:
            fresh += out.untyped_storage().nbytes()
    return max(0, peak - base - fresh)


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {torch.get_num_threads()} threads"
    except OSError:
        pass
    import platform

    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def l2_bytes(device):
    """The GPU's L2 size (inputs smaller than a few times this are rotated among copies so each
    timed call reads from device memory, as a training step does); 0 on the CPU."""
    if device != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
