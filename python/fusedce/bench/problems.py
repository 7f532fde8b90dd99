"""The inputs of a case and their float64 reference, so every timed row also carries its error
(a fast wrong answer must not win).

Logits ~ N(0, 2) with one entry in 1024 lifted to +12 (a confident prediction, so the softmax is
not flat), 30% of the targets on such an entry; linear cases draw hidden ~ N(0, 1) and a weight
scaled so the logits again have a spread of about 2. Masked cases ignore the prompt half of every
sequence (cases.ignored_mask). The reference works in float64 over chunks of rows, so a case of
gigabytes needs only a few more.

Errors reported: the loss's relative error |loss - ref| / |ref|; a gradient's relative max-norm
error max|g - ref| / max|ref| (the worse of grad_hidden and grad_weight for linear cases).
"""

import torch

from .cases import ignored_mask

IGNORE_INDEX = -100
OUTLIER_EVERY = 1024
OUTLIER_VALUE = 12.0
LOGIT_SPREAD = 2.0


def _chunk_rows(cols, device, elem=8):
    """Rows per chunk so one float64 chunk of `cols` columns stays near 1 GiB on a GPU and
    256 MiB on the CPU."""
    budget = (1 << 30) if device == "cuda" else (256 << 20)
    return max(1, budget // (cols * elem))


def _masked_targets(target, case):
    if case.masked:
        target[ignored_mask(case.tokens, target.device)] = IGNORE_INDEX
    return target


def make_logits(case, dtype, device, seed=0):
    """(N, V) logits in `dtype` and (N,) int64 targets on `device`, generated there in chunks of
    rows (no float32 copy of the whole matrix)."""
    g = torch.Generator(device=device).manual_seed(seed)
    n, v = case.tokens, case.vocab
    logits = torch.empty(n, v, dtype=dtype, device=device)
    target = torch.randint(0, v, (n,), device=device, generator=g)
    n_out = max(1, v // OUTLIER_EVERY)
    step = _chunk_rows(v, device, elem=4)
    for r in range(0, n, step):
        rows = slice(r, min(n, r + step))
        z = torch.randn(rows.stop - r, v, device=device, generator=g) * LOGIT_SPREAD
        idx = torch.randint(0, v, (rows.stop - r, n_out), device=device, generator=g)
        z.scatter_(1, idx, OUTLIER_VALUE)
        hit = torch.rand(rows.stop - r, device=device, generator=g) < 0.3
        target[rows] = torch.where(hit, idx[:, 0], target[rows])
        logits[rows] = z.to(dtype)
    return logits, _masked_targets(target, case)


def make_linear(case, dtype, device, seed=0):
    """hidden (N, H), weight (V, H) in `dtype` and (N,) int64 targets on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    n, h, v = case.tokens, case.hidden, case.vocab
    hidden = torch.randn(n, h, device=device, generator=g).to(dtype)
    weight = (torch.randn(v, h, device=device, generator=g) * (LOGIT_SPREAD / h ** 0.5)).to(dtype)
    target = torch.randint(0, v, (n,), device=device, generator=g)
    return hidden, weight, _masked_targets(target, case)


def relative_error(value, ref):
    value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    return abs(value - ref) / abs(ref) if ref else abs(value)


class CrossEntropyReference:
    """F.cross_entropy(logits, target) (mean over non-ignored rows) in float64, and the error of
    another implementation's loss and gradient against it. Keeps only the per-row log-sum-exp;
    the reference gradient softmax - onehot is formed again chunk by chunk when compared."""

    def __init__(self, logits, target):
        self.logits = logits
        self.target = target
        self.valid = target != IGNORE_INDEX
        self.count = int(self.valid.sum())
        n, v = logits.shape
        self.lse = torch.empty(n, dtype=torch.float64, device=logits.device)
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        for rows in self._chunks():
            z = logits[rows].double()
            self.lse[rows] = torch.logsumexp(z, dim=1)
            t = target[rows]
            keep = self.valid[rows]
            picked = z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((self.lse[rows] - picked) * keep).sum()
        self.loss = float(total) / self.count if self.count else float("nan")

    def _chunks(self):
        n, v = self.logits.shape
        step = _chunk_rows(v, self.logits.device)
        return [slice(r, min(n, r + step)) for r in range(0, n, step)]

    def loss_error(self, loss):
        return relative_error(loss, self.loss)

    def grad_error(self, grad):
        """max|grad - ref| / max|ref| with ref = (softmax(z) - onehot(t)) / count on kept rows."""
        worst = torch.zeros((), dtype=torch.float64, device=grad.device)
        scale = torch.zeros((), dtype=torch.float64, device=grad.device)
        for rows in self._chunks():
            ref = torch.exp(self.logits[rows].double() - self.lse[rows, None])
            keep = self.valid[rows]
            ref.scatter_add_(1, self.target[rows].clamp(min=0).unsqueeze(1),
                             -torch.ones(ref.shape[0], 1, dtype=ref.dtype, device=ref.device))
            ref *= keep.unsqueeze(1).to(ref.dtype) / self.count
            worst = torch.maximum(worst, (grad[rows].double() - ref).abs().max())
            scale = torch.maximum(scale, ref.abs().max())
        return float(worst / scale)


class LinearReference:
    """F.cross_entropy(hidden @ weight.T, target) in float64 with both gradients, formed over
    chunks of rows (grad_weight accumulates); the errors of another implementation against it."""

    def __init__(self, hidden, weight, target):
        valid = target != IGNORE_INDEX
        count = int(valid.sum())
        w64 = weight.double()
        h64 = hidden.double()
        self.grad_hidden = torch.zeros_like(h64)
        self.grad_weight = torch.zeros_like(w64)
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        n = hidden.shape[0]
        step = _chunk_rows(weight.shape[0], hidden.device)
        for r in range(0, n, step):
            rows = slice(r, min(n, r + step))
            z = h64[rows] @ w64.T
            lse = torch.logsumexp(z, dim=1)
            t = target[rows].clamp(min=0).unsqueeze(1)
            keep = valid[rows]
            total += ((lse - z.gather(1, t).squeeze(1)) * keep).sum()
            p = torch.exp(z.sub_(lse[:, None]))
            p.scatter_add_(1, t, -torch.ones(p.shape[0], 1, dtype=p.dtype, device=p.device))
            p *= keep.unsqueeze(1).to(p.dtype) / count
            self.grad_hidden[rows] = p @ w64
            self.grad_weight.addmm_(p.T, h64[rows])
        self.loss = float(total) / count if count else float("nan")

    def loss_error(self, loss):
        return relative_error(loss, self.loss)

    def grad_error(self, grad_hidden, grad_weight):
        """The worse relative max-norm error of the two gradients."""
        errs = []
        for g, ref in ((grad_hidden, self.grad_hidden), (grad_weight, self.grad_weight)):
            errs.append(float((g.double() - ref).abs().max() / ref.abs().max()))
        return max(errs)


class LogprobReference:
    """Per-token log-probabilities and entropy of hidden @ weight.T in float64, and the gradients
    of the benchmark's objective sum(advantage * logprob) [+ coef * sum(entropy)], formed over
    chunks of rows (grad_weight accumulates), for both objectives."""

    def __init__(self, hidden, weight, target, advantage, coef):
        valid = target != IGNORE_INDEX
        w64, h64 = weight.double(), hidden.double()
        n = hidden.shape[0]
        self.logprob = torch.zeros(n, dtype=torch.float64, device=hidden.device)
        self.entropy = torch.zeros_like(self.logprob)
        self.grads = {False: (torch.zeros_like(h64), torch.zeros_like(w64)),
                      True: (torch.zeros_like(h64), torch.zeros_like(w64))}
        step = _chunk_rows(weight.shape[0], hidden.device)
        for r in range(0, n, step):
            rows = slice(r, min(n, r + step))
            logp = torch.log_softmax(h64[rows] @ w64.T, dim=1)
            t = target[rows].clamp(min=0).unsqueeze(1)
            keep = valid[rows].to(torch.float64)
            p = logp.exp()
            ent = -(p * logp).sum(1)
            self.logprob[rows] = logp.gather(1, t).squeeze(1) * keep
            self.entropy[rows] = ent * keep
            a = (advantage[rows].double() * keep)[:, None]
            dz = -p * a
            dz.scatter_add_(1, t, a)
            for with_entropy in (False, True):
                d = dz - (coef * keep)[:, None] * p * (logp + ent[:, None]) if with_entropy else dz
                gh, gw = self.grads[with_entropy]
                gh[rows] = d @ w64
                gw.addmm_(d.T, h64[rows])

    def value_error(self, logprob, entropy):
        """The worse relative max-norm error of logprob and (when given) entropy."""
        errs = [float((logprob.double() - self.logprob).abs().max() / self.logprob.abs().max())]
        if entropy is not None:
            errs.append(float((entropy.double() - self.entropy).abs().max() / self.entropy.abs().max()))
        return max(errs)

    def grad_error(self, grad_hidden, grad_weight, with_entropy):
        ref_h, ref_w = self.grads[with_entropy]
        return max(float((g.double() - ref).abs().max() / ref.abs().max())
                   for g, ref in ((grad_hidden, ref_h), (grad_weight, ref_w)))


def tolerance(dtype):
    """(loss, gradient) errors above which a row is marked wrong: several units of rounding of
    results in `dtype` (a bfloat16 gradient alone carries 2^-9 of relative rounding; a bfloat16
    GEMM's logits carry more), far below what a wrong formula gives."""
    if dtype == torch.float32:
        return 1e-4, 1e-3
    return 1e-2, 5e-2
