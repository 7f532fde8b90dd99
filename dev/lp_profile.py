"""Where the time of one linear log-probabilities call (forward + backward, with the entropy)
goes, kernel by kernel: fusedce.linear_logprobs (keep_logits None / False) beside TRL's chunked
head, under torch.profiler. A probe, not a benchmark (bench/trl_post_training.py times them).

    PYTHONPATH=$(python3 tests/python/build_tree.py <build>):/tmp/site python3 dev/lp_profile.py 8192 896 151936
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fusedce


def main(n, h, v):
    torch.manual_seed(0)
    x = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda") / h ** 0.5).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    g1, g2 = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")

    def fused(keep):
        def run():
            lp, ent = fusedce.linear_logprobs(x, w, t, return_entropy=True, keep_logits=keep)
            torch.autograd.backward((lp, ent), (g1, g2))
        return run

    runs = {"fusedce default": fused(None), "fusedce keep_logits=False": fused(False)}
    try:
        from trl.kernels import ChunkedLogProbFunction

        def trl_run():
            out = ChunkedLogProbFunction.apply(x, w, None, t, 1.0, 32768, None, 1.0, ("log_probs", "entropy"))
            torch.autograd.backward((out[0], out[1]), (g1, g2))
        runs["trl"] = trl_run
    except ImportError as e:
        print("trl:", e)
    for name, run in runs.items():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(e.device_time_total for e in events) / 5 / 1e3
        print(f"\n== {name}: {total:.2f} ms of kernels a call")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:12]:
            print(f"  {e.device_time_total / 5 / 1e3:8.3f} ms  x{e.count // 5:<4d} {e.key[:110]}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
