"""A case's inputs on the device, ready to be timed by every implementation in turn: the calls
that are timed, the check against float64, and the rate a time amounts to.

Inputs smaller than three times the GPU's L2 are rotated among enough copies that each timed call
reads from device memory, as it would in a training step. Implementations that overwrite their
input with the gradient (Liger, Unsloth) are fine: every copy is restored from a pristine master
before each implementation's turn, and the check runs on a fresh clone.
"""

import math

import torch

from .problems import CrossEntropyReference, LinearReference, LogprobReference, make_linear, make_logits

MAX_COPIES = 64
JOBS = {"ce": ("forward", "fwd+bwd"), "linear": ("fwd+bwd",),
        "logprobs": ("forward", "fwd+bwd", "fwd+bwd+entropy")}
ENTROPY_COEF = 0.01


def _copies_for(nbytes, l2):
    if not l2:
        return 1
    return min(MAX_COPIES, max(1, math.ceil(3 * l2 / nbytes)))


class CrossEntropyWorkload:
    """Logits (N, V) and targets; jobs 'forward' (loss only, no gradient requested) and 'fwd+bwd'
    (loss.backward() into a fresh gradient)."""

    jobs = JOBS["ce"]
    unit = "GB/s"

    def __init__(self, case, dtype, device, l2):
        self.case = case
        self.master, self.target = make_logits(case, dtype, device)
        self.reference = CrossEntropyReference(self.master, self.target)
        k = _copies_for(self.master.nbytes, l2)
        self.copies = [self.master.clone() for _ in range(k)]

    def restore(self):
        for c in self.copies:
            c.copy_(self.master)

    def make_run(self, fn, job):
        """run(i) -> the outputs of call i (loss, and the gradient for 'fwd+bwd') on copy i mod k;
        and the input tensors (for telling a fresh output from one written in place)."""
        copies, target = self.copies, self.target
        if job == "forward":
            def run(i):
                with torch.no_grad():
                    return [fn(copies[i % len(copies)], target)]
            return run, copies
        leaves = [c.detach().requires_grad_(True) for c in copies]

        def run(i):
            leaf = leaves[i % len(leaves)]
            leaf.grad = None
            loss = fn(leaf, target)
            loss.backward()
            grad, leaf.grad = leaf.grad, None
            return [loss, grad]
        return run, leaves

    def check(self, fn, job):
        """(loss error, gradient error or None) of one call on a fresh clone of the inputs."""
        x = self.master.clone()
        if job == "forward":
            with torch.no_grad():
                loss = fn(x, self.target)
            return self.reference.loss_error(loss), None
        x.requires_grad_(True)
        loss = fn(x, self.target)
        loss.backward()
        return self.reference.loss_error(loss), self.reference.grad_error(x.grad)

    def rate(self, job, ms):
        """GB/s: forward N*V*elem bytes (each logit read once); fwd+bwd 2*N*V*elem (read once,
        gradient written once)."""
        passes = 1 if job == "forward" else 2
        return passes * self.master.numel() * self.master.element_size() / (ms * 1e-3) / 1e9


class LinearWorkload:
    """hidden (N, H), weight (V, H) and targets; job 'fwd+bwd' (loss.backward() into fresh
    gradients of hidden and weight)."""

    jobs = JOBS["linear"]
    unit = "TFLOP/s"

    def __init__(self, case, dtype, device, l2):
        self.case = case
        self.hidden, self.weight, self.target = make_linear(case, dtype, device)
        self.reference = LinearReference(self.hidden, self.weight, self.target)
        k = _copies_for(self.hidden.nbytes + self.weight.nbytes, l2)
        self.copies = [(self.hidden.clone(), self.weight.clone()) for _ in range(k)]

    def restore(self):
        for h, w in self.copies:
            h.copy_(self.hidden)
            w.copy_(self.weight)

    def make_run(self, fn, job):
        leaves = [(h.detach().requires_grad_(True), w.detach().requires_grad_(True)) for h, w in self.copies]
        target = self.target

        def run(i):
            h, w = leaves[i % len(leaves)]
            h.grad = w.grad = None
            loss = fn(h, w, target)
            loss.backward()
            out = [loss, h.grad, w.grad]
            h.grad = w.grad = None
            return out
        return run, [t for pair in leaves for t in pair]

    def check(self, fn, job):
        h = self.hidden.clone().requires_grad_(True)
        w = self.weight.clone().requires_grad_(True)
        loss = fn(h, w, self.target)
        loss.backward()
        if h.grad is None or w.grad is None:
            raise RuntimeError("no gradient for " + ("hidden" if h.grad is None else "weight"))
        return self.reference.loss_error(loss), self.reference.grad_error(h.grad, w.grad)

    def rate(self, job, ms):
        """TFLOP/s counting 6*N*H*V: the logits (2NHV), grad_hidden (2NHV) and grad_weight
        (2NHV), over every token (an implementation that skips ignored rows gains by it)."""
        n, h = self.hidden.shape
        v = self.weight.shape[0]
        return 6 * n * h * v / (ms * 1e-3) / 1e12


class LogprobWorkload:
    """hidden (N, H), weight (V, H), sampled tokens and a fixed advantage per token; an
    implementation is called fn(hidden, weight, tokens, entropy) -> (logprob, entropy or None).
    Jobs: 'forward' (logprob, no gradient: the old / reference policy's pass), 'fwd+bwd'
    (backward of sum(advantage * logprob)), 'fwd+bwd+entropy' (logprob and entropy, backward of
    sum(advantage * logprob) + ENTROPY_COEF * sum(entropy))."""

    jobs = JOBS["logprobs"]
    unit = "TFLOP/s"

    def __init__(self, case, dtype, device, l2):
        self.case = case
        self.hidden, self.weight, self.target = make_linear(case, dtype, device)
        g = torch.Generator(device=device).manual_seed(1)
        self.advantage = torch.randn(case.tokens, device=device, generator=g)
        self.reference = LogprobReference(self.hidden, self.weight, self.target, self.advantage, ENTROPY_COEF)
        k = _copies_for(self.hidden.nbytes + self.weight.nbytes, l2)
        self.copies = [(self.hidden.clone(), self.weight.clone()) for _ in range(k)]

    def restore(self):
        for h, w in self.copies:
            h.copy_(self.hidden)
            w.copy_(self.weight)

    def _objective(self, lp, ent):
        obj = (self.advantage * lp).sum()
        return obj if ent is None else obj + ENTROPY_COEF * ent.sum()

    def make_run(self, fn, job):
        target, with_entropy = self.target, job == "fwd+bwd+entropy"
        if job == "forward":
            def run(i):
                h, w = self.copies[i % len(self.copies)]
                with torch.no_grad():
                    return [fn(h, w, target, False)[0]]
            return run, [t for pair in self.copies for t in pair]
        leaves = [(h.detach().requires_grad_(True), w.detach().requires_grad_(True)) for h, w in self.copies]

        def run(i):
            h, w = leaves[i % len(leaves)]
            h.grad = w.grad = None
            lp, ent = fn(h, w, target, with_entropy)
            self._objective(lp, ent).backward()
            out = [lp, h.grad, w.grad]
            h.grad = w.grad = None
            return out
        return run, [t for pair in leaves for t in pair]

    def check(self, fn, job):
        """(value error, gradient error or None) against float64."""
        with_entropy = job == "fwd+bwd+entropy"
        h = self.hidden.clone().requires_grad_(job != "forward")
        w = self.weight.clone().requires_grad_(job != "forward")
        if job == "forward":
            with torch.no_grad():
                lp, ent = fn(h, w, self.target, False)
            return self.reference.value_error(lp, None), None
        lp, ent = fn(h, w, self.target, with_entropy)
        self._objective(lp, ent).backward()
        return (self.reference.value_error(lp, ent),
                self.reference.grad_error(h.grad, w.grad, with_entropy))

    def rate(self, job, ms):
        """TFLOP/s counting 2*N*H*V for the forward (the logits) and 6*N*H*V with the backward
        (the logits, grad_hidden and grad_weight), over every token."""
        n, h = self.hidden.shape
        v = self.weight.shape[0]
        return (2 if job == "forward" else 6) * n * h * v / (ms * 1e-3) / 1e12


def make_workload(case, dtype, device, l2):
    cls = {"ce": CrossEntropyWorkload, "linear": LinearWorkload, "logprobs": LogprobWorkload}[case.kind]
    return cls(case, dtype, device, l2)
