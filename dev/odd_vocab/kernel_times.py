"""Where fusedce.linear_cross_entropy's time goes at a vocabulary that is not a multiple of 8:
the CUDA kernels of one forward+backward, by total time (torch.profiler).
    python dev/odd_vocab/kernel_times.py [N H V ...]   (default 8192 2048 50257 and 50264)"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fusedce

shapes = [tuple(int(x) for x in sys.argv[i:i + 3]) for i in range(1, len(sys.argv), 3)] or \
    [(8192, 2048, 50257), (8192, 2048, 50264)]
for n, h, v in shapes:
    hid = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda")

    def step():
        fusedce.linear_cross_entropy(hid, w, t).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"\n## {n} x {h} x {v}: 5 forward+backward calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))
