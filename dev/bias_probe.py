"""Is fusedce's linear cross-entropy gradient biased on a real training run's inputs?

Trains the demo's model (the --device cuda preset unless told otherwise) with PyTorch's loss under
bfloat16 autocast, and at chosen steps takes that step's final hidden states, lm_head.weight and
targets, rounds them to bfloat16 as autocast does, and sends them through each path:
  torch          lm_head (bf16 logits) + .float() + F.cross_entropy: the baseline
  fusedce        fusedce.linear_cross_entropy at its default chunking
  fusedce_1chunk the same with one token chunk (a budget that holds all the logits)
  fusedce_logits fusedce.cross_entropy over the materialised bf16 logits
  torch_fp32     the baseline over float32 copies of the same bf16 values (TF32 off)
Each path's loss, grad hidden and grad weight are compared with float64 on the same bf16 values:
relative error, cosine, norm ratio, and the signed projection <g - r, r> / |r|^2 (a systematic
shrink or growth shows there; random rounding averages out). grad weight is also judged on the
vocabulary rows with the smallest reference gradients (the rare tokens, whose tiny gradients
Adam scales up to full-size updates).

  PYTHONPATH=python python dev/bias_probe.py --steps 300 --at 0 60 150 299 --out probe.json
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import fusedce
from fusedce.demo import cli
from fusedce.demo.corpus import load_text, tokenize
from fusedce.demo.model import TinyGPT
from fusedce.demo.train import batch_at, lr_at, make_optimizer, torch_loss


def stats(g, r):
    g, r = g.double().flatten(), r.double().flatten()
    rn = r.norm()
    return {"rel_err": ((g - r).norm() / rn).item(), "cos": (g @ r / (g.norm() * rn)).item(),
            "norm_ratio": (g.norm() / rn).item(), "proj": ((g - r) @ r / rn**2).item()}


def rare_rows(gw, rw, frac=0.5):
    """stats over the vocabulary rows whose reference gradient norm is in the lowest `frac`."""
    norms = rw.double().norm(dim=1)
    idx = norms.argsort()[: max(1, int(frac * norms.numel()))]
    return stats(gw[idx], rw[idx])


def grads(fn, h, w, t):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach().double().item(), h.grad, w.grad


def paths(n_rows, vocab):
    def torch_path(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    def torch_fp32(h, w, t):
        return F.cross_entropy(F.linear(h.float(), w.float()), t)

    def fused(h, w, t):
        return fusedce.linear_cross_entropy(h, w, t)

    def fused_1chunk(h, w, t):
        return fusedce.linear_cross_entropy(h, w, t, chunk_budget_bytes=n_rows * vocab * 2 + (64 << 20))

    def fused_logits(h, w, t):
        return fusedce.cross_entropy(F.linear(h, w), t)

    return {"torch": torch_path, "fusedce": fused, "fusedce_1chunk": fused_1chunk,
            "fusedce_logits": fused_logits, "torch_fp32": torch_fp32}


def probe(h, w, t):
    """Every path against float64 on the same bf16 values."""
    hb, wb = h.to(torch.bfloat16), w.to(torch.bfloat16)
    ref_loss, ref_h, ref_w = grads(lambda a, b, c: F.cross_entropy(F.linear(a, b), c), hb.double(), wb.double(), t)
    out = {"ref_loss": ref_loss}
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, fn in paths(t.numel(), w.shape[0]).items():
        loss, gh, gw = grads(fn, hb, wb, t)
        out[name] = {"loss_err": loss - ref_loss, "grad_hidden": stats(gh, ref_h),
                     "grad_weight": stats(gw, ref_w), "grad_weight_rare": rare_rows(gw, ref_w)}
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--at", type=int, nargs="+", default=[0, 60, 150, 299])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bias_probe.json")
    p.add_argument("--preset", default="cuda")
    a = p.parse_args(argv)
    cfg = cli.run_config(cli.parse_args(["--device", "cuda", "--steps", str(a.steps), "--seed", str(a.seed)]
                                        + (["--quick"] if a.preset == "quick" else [])))
    _, tokens = tokenize(load_text(), cfg.model.vocab)
    device = torch.device("cuda")
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg.model).to(device)
    opt = make_optimizer(model, cfg)
    data = torch.tensor(tokens, dtype=torch.long)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    results = {}
    for step in range(cfg.steps):
        x, y = batch_at(data, cfg.batch_size, cfg.model.seq_len, gen)
        x, y = x.to(device), y.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg.lr)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = model(x)
            loss = torch_loss(model, hidden, y)
        if step in a.at:
            h = hidden.detach().float().reshape(-1, hidden.shape[-1])
            results[step] = probe(h, model.lm_head.weight.detach(), y.reshape(-1))
            print(f"step {step} loss {loss.item():.4f}", json.dumps(results[step], indent=None)[:3000])
            sys.stdout.flush()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    for step, r in results.items():
        print(f"\nstep {step}: reference loss {r['ref_loss']:.6f}")
        print(f"{'path':<15} {'loss err':>10} | {'gh rel':>8} {'gh ratio-1':>11} {'gh proj':>10} | "
              f"{'gw rel':>8} {'gw ratio-1':>11} {'gw proj':>10} | {'rare rel':>8} {'rare proj':>10}")
        for name in paths(1, 1):
            s = r[name]
            gh, gw, gr = s["grad_hidden"], s["grad_weight"], s["grad_weight_rare"]
            print(f"{name:<15} {s['loss_err']:+10.2e} | {gh['rel_err']:8.2e} {gh['norm_ratio'] - 1:+11.2e} "
                  f"{gh['proj']:+10.2e} | {gw['rel_err']:8.2e} {gw['norm_ratio'] - 1:+11.2e} {gw['proj']:+10.2e} | "
                  f"{gr['rel_err']:8.2e} {gr['proj']:+10.2e}")


if __name__ == "__main__":
    main()
