"""One GRPO-style policy-gradient step through fusedce.linear_logprobs, checked against the same
step computed from materialised logits in float64.

A tiny causal policy (token embedding, one MLP block, a language-model head) has sampled G
completions for one prompt; each completion has a scalar reward. GRPO turns the rewards into
group-normalised advantages, and the loss per completion token is the clipped policy-gradient
term of PPO, minus an entropy bonus:

    ratio   = exp(logprob - old_logprob)
    loss    = -mean over completion tokens of min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
              - entropy_coef * mean entropy

fusedce forms logprob and entropy from the hidden states and the head's weight at the sampling
temperature without the (tokens, vocabulary) logits, and its gradients flow into the whole
model; the check recomputes the loss and every parameter's gradient with the logits
materialised, in float64, and asserts that they agree.

Run: python examples/grpo_step.py [--device cuda] [--dtype bfloat16]
"""

import argparse
import copy

import torch
import torch.nn.functional as F

import fusedce

VOCAB, WIDTH, PROMPT, COMPLETION, GROUP = 1000, 64, 12, 20, 6
TEMPERATURE, CLIP_EPS, ENTROPY_COEF = 0.8, 0.2, 0.01


class TinyPolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, WIDTH))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=True)

    def hidden(self, tokens):
        """A causal stand-in for a transformer: each position sees the running mean of the
        embeddings up to it."""
        x = self.embed(tokens)
        x = x.cumsum(1) / torch.arange(1, tokens.shape[1] + 1, device=tokens.device)[:, None]
        return self.norm(x + self.mlp(x))


def rollout(policy, generator):
    """G sampled completions of one prompt (token ids), their rewards and the sampling policy's
    log-probabilities (old_logprob), and the completion mask."""
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=generator)
    seqs = prompt.repeat(GROUP, 1)
    with torch.no_grad():
        for _ in range(COMPLETION):
            h = policy.hidden(seqs)[:, -1].double()
            logits = F.linear(h, policy.head.weight.double(), policy.head.bias.double()) / TEMPERATURE
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            seqs = torch.cat([seqs, nxt], dim=1)
    rewards = (seqs[:, PROMPT:] % 7 == 0).float().mean(1)  # a toy reward: how often it says "7k"
    return seqs, rewards


def grpo_loss(logprob, entropy, old_logprob, advantages, mask):
    ratio = torch.exp(logprob - old_logprob)
    a = advantages[:, None]
    pg = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * a)
    n = mask.sum()
    return (pg * mask).sum() / n - ENTROPY_COEF * (entropy * mask).sum() / n


def targets_of(seqs):
    """Position i predicts token i + 1; only completion tokens count (the rest: ignore_index)."""
    t = torch.full_like(seqs, -100)
    t[:, PROMPT - 1:-1] = seqs[:, PROMPT:]
    return t


def step_fused(policy, seqs, old_logprob, advantages, device, dtype):
    p = copy.deepcopy(policy).to(device=device, dtype=dtype)
    t = targets_of(seqs).to(device)
    h = p.hidden(seqs.to(device))
    logprob, entropy = fusedce.linear_logprobs(h, p.head.weight, t, p.head.bias, temperature=TEMPERATURE,
                                               return_entropy=True)
    mask = (t != -100).float()
    loss = grpo_loss(logprob, entropy, old_logprob.to(device), advantages.to(device), mask)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in p.named_parameters()}, logprob.detach()


def step_torch(policy, seqs, old_logprob, advantages, device, dtype):
    """What a trainer does without fusedce: the logits materialised in the model's dtype, then
    log_softmax in float32. In bfloat16 its error against float64 is the budget fusedce meets."""
    p = copy.deepcopy(policy).to(device=device, dtype=dtype)
    t = targets_of(seqs).to(device)
    logp = torch.log_softmax((p.head(p.hidden(seqs.to(device))) / TEMPERATURE).float(), -1)
    keep = t != -100
    logprob = torch.where(keep, logp.gather(-1, t.clamp(min=0)[..., None])[..., 0], 0.0)
    entropy = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
    loss = grpo_loss(logprob, entropy, old_logprob.to(device), advantages.to(device), keep.float())
    loss.backward()
    return {k: v.grad for k, v in p.named_parameters()}


def step_materialised(policy, seqs, old_logprob, advantages):
    """The reference: the logits materialised in float64, log_softmax and gather."""
    p = copy.deepcopy(policy).double()
    t = targets_of(seqs)
    h = p.hidden(seqs)
    z = p.head(h) / TEMPERATURE
    logp = torch.log_softmax(z, -1)
    keep = t != -100
    logprob = torch.where(keep, logp.gather(-1, t.clamp(min=0)[..., None])[..., 0], 0.0)
    entropy = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
    loss = grpo_loss(logprob, entropy, old_logprob, advantages, keep.double())
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in p.named_parameters()}, logprob.detach()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    policy = TinyPolicy()
    seqs, rewards = rollout(policy, generator)
    advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).double()
    # The sampling policy's log-probabilities: the same weights one update earlier (perturbed
    # here), so that some ratios leave the clip range.
    stale = copy.deepcopy(policy)
    with torch.no_grad():
        for prm in stale.parameters():
            prm.add_(torch.randn(prm.shape, generator=generator) * 0.05)
    _, _, old = step_materialised(stale, seqs, torch.zeros(GROUP, seqs.shape[1], dtype=torch.float64), advantages)

    loss_ref, grads_ref, lp_ref = step_materialised(policy, seqs, old, advantages)
    loss, grads, lp = step_fused(policy, seqs, old.float(), advantages.float(), args.device, dtype)

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(lp.double().cpu(), lp_ref, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(loss.double().cpu(), loss_ref, rtol=tol, atol=tol)
    def error(g, g_ref):
        return ((g.double().cpu() - g_ref).abs().max() / g_ref.abs().max().clamp(min=1e-30)).item()

    # float32: float32 arithmetic's error. bfloat16: the whole model runs in bfloat16, so the
    # budget is three times the error of PyTorch's own bfloat16 step with materialised logits.
    grads_torch = None if dtype == torch.float32 else step_torch(policy, seqs, old.float(), advantages.float(),
                                                                 args.device, dtype)
    worst = 0.0
    for name, g_ref in grads_ref.items():
        err = error(grads[name], g_ref)
        worst = max(worst, err)
        budget = 2e-5 if grads_torch is None else max(3 * error(grads_torch[name], g_ref), 1e-2)
        assert err < budget, f"grad of {name}: relative error {err:.2e}, budget {budget:.2e}"
        if grads_torch is not None:
            print(f"  grad of {name}: relative error {err:.1e} (PyTorch's bfloat16 step: "
                  f"{error(grads_torch[name], g_ref):.1e})")
    print(f"GRPO step on {args.device} ({args.dtype}): loss {loss.item():.6f} (float64 materialised "
          f"{loss_ref.item():.6f}); {int((targets_of(seqs) != -100).sum())} completion tokens; worst "
          f"parameter-gradient error {worst:.1e} of its largest entry")
    return worst


if __name__ == "__main__":
    main()
