"""Per-kernel times of the linear path under sustained load: the floor (three bare products),
fusedce's default call and its all-options call, each run back to back for a few seconds with
torch.profiler (CUPTI) recording every kernel, and nvidia-smi sampling clocks and power beside.

ncu times each kernel alone, at the clocks of an idle chip; a training step runs them back to
back on a hot one. This says which kernels take the difference.

    PYTHONPATH=$(python3 tests/python/build_tree.py build-gpu-torch) python3 dev/under_load/probe.py 16384 2304 256000
"""
import collections
import re
import subprocess
import sys
import time

import torch

import fusedce


def short(name):
    m = re.search(r"(nvjet_\w+|cutlass\w*|ce_\w+_kernel|\w+_kernel|gemv\w*|splitK\w*)", name)
    return (m.group(1) if m else name)[:60]


def phase(label, step, iters):
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ev[0].record()
        for _ in range(iters):
            step()
        ev[1].record()
        torch.cuda.synchronize()
    wall = ev[0].elapsed_time(ev[1]) / iters
    per = collections.OrderedDict()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name.startswith("Memcpy") or e.name.startswith("Memset"):
            continue
        k = short(e.name)
        n, t = per.get(k, (0, 0.0))
        per[k] = (n + 1, t + e.time_range.elapsed_us())
    busy = sum(t for _, t in per.values()) / iters / 1e3
    print(f"\n## {label}: {wall:.2f} ms a call (wall, {iters} back to back), kernels {busy:.2f} ms a call")
    print("| kernel | launches a call | ms a call |\n|---|---|---|")
    for k, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n / iters:g} | {t / iters / 1e3:.3f} |")
    return time.time()


def main():
    N, H, V = (int(a) for a in sys.argv[1:4]) if len(sys.argv) >= 4 else (16384, 2304, 256000)
    iters = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    torch.manual_seed(0)
    dev = "cuda"
    h = torch.randn(N, H, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    w = (torch.randn(V, H, device=dev, dtype=torch.bfloat16) / H ** 0.5).requires_grad_(True)
    b = (0.5 * torch.randn(V, device=dev, dtype=torch.bfloat16)).requires_grad_(True)
    t = torch.randint(0, V, (N,), device=dev)

    def floor():
        logits = h.detach() @ w.detach().t()
        logits @ w.detach()
        logits.t() @ h.detach()

    def fused():
        h.grad = w.grad = None
        fusedce.linear_cross_entropy(h, w, t).backward()

    def fused_all():
        h.grad = w.grad = b.grad = None
        loss, _ = fusedce.linear_cross_entropy(h, w, t, b, label_smoothing=0.1, z_loss=1e-4, logit_scale=0.9,
                                               softcap=30.0, return_metrics=True)
        loss.backward()

    smi = subprocess.Popen(["nvidia-smi", "dmon", "-s", "pc", "-d", "1", "-o", "T"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    marks = [("start", time.time())]
    for label, fn in (("floor", floor), ("fusedce default", fused), ("fusedce all options", fused_all), ("floor again", floor)):
        for _ in range(5):
            fn()
        marks.append((label, phase(label, fn, iters)))
    smi.terminate()
    out = smi.communicate(timeout=5)[0]
    print("\n## nvidia-smi dmon (phase ends:", ", ".join(f"{l} {time.strftime('%H:%M:%S', time.localtime(s))}" for l, s in marks), ")")
    print(out)


if __name__ == "__main__":
    main()
