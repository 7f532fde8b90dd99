"""fusedce.linear_logprobs and fusedce.logprobs: per-token log-probabilities and entropy with
gradients, against a float64 reference that materialises the logits (F.linear + log_softmax +
gather, entropy from the softmax), on random and peaked ("trained-looking") inputs.

The inputs are rounded to their dtype first and the reference is computed in float64 from those
rounded values, so fusedce's error is float32 arithmetic's whatever the input dtype: the
tolerances are float32 ones for the values, and the dtype's rounding for gradients returned in
a 16-bit dtype. Collapse: margins of 20-100 nats, where torch's float32 log_softmax gives 0 for
the target (asserted), and fusedce must give the float64 value to float32 precision, and so must
the target's gradient (1 - p_t). Vocabulary parallel: gloo groups of 2 and 3 ranks, equal to the
single-device call. The linear form's tests run with keep_logits False and True (the logits formed
once, in the input dtype, and kept for the backward). Parametrised over DEVICES (run with -k cuda
on a GPU)."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fusedce
from fusedce import token_logprobs
from conftest import DEVICES, DTYPES
from gloo_groups import failures_of, spawn_group

ops = torch.ops.fusedce
IGNORE = -100
KEEP = pytest.mark.parametrize("keep_logits", [False, True], ids=["stream", "keep"])


# ---- problems and the float64 reference -----------------------------------------------------


def _peaked_logits(n, vocab, seed, peak=12.0):
    """Logits with a few outliers far above the rest (the softmax is not flat) and, for some
    rows, a dominant entry: what a trained policy gives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 2.0
    k = max(1, vocab // 40)
    idx = torch.randint(0, vocab, (n, k), generator=g)
    x.scatter_(1, idx, peak + torch.randn(n, k, generator=g))
    return x, idx[:, 0]


def _tokens(n, vocab, seed, likely=None, ignore_frac=0.2):
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.randint(0, vocab, (n,), generator=g)
    if likely is not None:  # sampled tokens are mostly the likely ones
        hit = torch.rand(n, generator=g) < 0.6
        t = torch.where(hit, likely, t)
    t[torch.rand(n, generator=g) < ignore_frac] = IGNORE
    return t


def _linear_problem(n, hidden, vocab, dtype, device, seed, bias=False, peaked=True):
    """hidden, weight (and bias) whose logits are peaked: a few rows of weight aligned with
    each hidden row."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
    likely = torch.randint(0, vocab, (n,), generator=g)
    if peaked:
        w[likely] += 2.5 * h / h.norm(dim=1, keepdim=True)
    b = torch.randn(vocab, generator=g) * 0.5 if bias else None
    t = _tokens(n, vocab, seed, likely)
    cast = lambda x: None if x is None else x.to(dtype).to(device)  # noqa: E731
    return cast(h), cast(w), cast(b), t.to(device)


def reference(z64, tokens, ignore_index=IGNORE):
    """logprob, entropy in float64 from float64 z (N, V); 0 at ignored rows. log_softmax in
    float64 collapses too (past ~37 nats): log p is anchored at each row's max a instead,
    log p_a = -log1p(sum_{j != a} exp(z_j - z_a)), log p_j = z_j - z_a + log p_a."""
    if z64.shape[0] == 0:
        logp = z64
    else:
        a = z64.argmax(-1, keepdim=True)
        d = z64 - z64.gather(-1, a)
        others = torch.ones_like(d).scatter(-1, a, 0.0)
        logp = d - torch.log1p((d.exp() * others).sum(-1, keepdim=True))
    keep = tokens != ignore_index
    lp = logp.gather(-1, torch.where(keep, tokens, 0)[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


def _collapse_dz(z64, tokens):
    """d sum(logprob) / dz in float64, analytically: -p_j, and 1 - p_t as the sum of the others'
    p_j (autograd through the reference would form 1 - p_t by cancellation)."""
    a = z64.argmax(-1, keepdim=True)
    d = z64 - z64.gather(-1, a)
    logp = d - torch.log1p((d.exp() * torch.ones_like(d).scatter(-1, a, 0.0)).sum(-1, keepdim=True))
    p = logp.exp()
    dz = -p
    rest = (p * torch.ones_like(p).scatter(-1, tokens[:, None], 0.0)).sum(-1)
    return dz.scatter(-1, tokens[:, None], rest[:, None])


def _objective(lp, ent, old_lp, adv, coef=0.01, eps=0.2):
    """A GRPO-style objective: clipped ratio times advantage, minus an entropy bonus."""
    ratio = torch.exp(lp - old_lp)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    return pg.sum() - coef * ent.sum()


def _weights(n, seed):
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randn(n, generator=g, dtype=torch.float64) * 0.3, torch.randn(n, generator=g, dtype=torch.float64)


def _close(got, want, atol, rtol, what):
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _grad_tol(dtype, ref, terms):
    """(atol, rtol) of a gradient formed in float32 and rounded once to `dtype`. rtol: that one
    rounding, the dtype's unit roundoff u (rounding to nearest moves x by at most u |x|). atol:
    float32 arithmetic, whose rounding errors over the `terms` terms of the sums behind an element
    (the row's sums over the vocabulary, and for the linear form the products over the hidden
    size and the rows) add like a random walk: 2 sqrt(terms) float32 roundoffs of the largest
    |ref|, twice that for margin; float16 adds half its subnormal step (2^-25). A 0.5% bfloat16
    scale error or a 1e-5 float32 one exceeds it (planted in the gradients' output path, each
    fails test_logits_values_and_gradients and test_linear_values_and_gradients)."""
    scale = max(ref.abs().max().item(), 1e-30)
    atol = 2 * terms ** 0.5 * UNIT_ROUNDOFF[torch.float32] * scale
    return atol + (2.0 ** -25 if dtype == torch.float16 else 0.0), UNIT_ROUNDOFF[dtype]


# ---- over logits ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,vocab", [(13, 301), (7, 1), (0, 50), (33, 2053), (4, 37000)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_values_and_gradients(device, dtype, n, vocab, temperature):
    x, likely = _peaked_logits(n, vocab, seed=n + vocab)
    t = _tokens(n, vocab, seed=vocab, likely=likely).to(device)
    x = x.to(dtype).to(device)
    z64 = x.double().cpu() / temperature
    lp_ref, ent_ref = reference(z64, t.cpu())
    leaf = x.detach().clone().requires_grad_(True)
    lp, ent = fusedce.logprobs(leaf, t, temperature=temperature, return_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (n,)
    _close(lp, lp_ref, 2e-5, 2e-6, "logprob")
    _close(ent, ent_ref, 2e-5, 2e-6, "entropy")
    old, adv = _weights(n, n)
    obj = _objective(lp, ent, old.float().to(device), adv.float().to(device))
    if n:
        obj.backward()
        x64 = x.detach().double().cpu().requires_grad_(True)
        l64, e64 = reference(x64 / temperature, t.cpu())
        _objective(l64, e64, old, adv).backward()
        assert leaf.grad.dtype == dtype
        atol, rtol = _grad_tol(dtype, x64.grad, vocab)
        _close(leaf.grad, x64.grad, atol, rtol, "dlogits")
        assert (leaf.grad[t == IGNORE] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_logits_leading_dims_and_return_forms(device):
    x, likely = _peaked_logits(12, 97, seed=3)
    t = _tokens(12, 97, seed=3, likely=likely)
    x3, t3 = x.view(3, 4, 97).to(device), t.view(3, 4).to(device)
    lp = fusedce.logprobs(x3, t3)
    assert isinstance(lp, torch.Tensor) and lp.shape == (3, 4)
    lp2, ent = fusedce.logprobs(x3, t3, return_entropy=True)
    assert torch.equal(lp, lp2) and ent.shape == (3, 4)
    lp_ref, ent_ref = reference(x.double(), t)
    _close(lp.reshape(-1), lp_ref, 2e-5, 2e-6, "logprob")
    _close(ent.reshape(-1), ent_ref, 2e-5, 2e-6, "entropy")
    # ignored positions: logprob 0 and entropy 0 (documented)
    assert (lp[t3 == IGNORE] == 0).all() and (ent[t3 == IGNORE] == 0).all()


# ---- collapse -----------------------------------------------------------------------------------


def _collapsed_rows(margins, vocab, dtype):
    """Row i: token 0 at 0, the others at -margins[i] and a little below (exact in bf16), so
    that p_t = 1 / (1 + sum exp(-margin...)) is 1 in float32 but not in float64."""
    n = len(margins)
    x = torch.zeros(n, vocab)
    for i, m in enumerate(margins):
        x[i, 1:] = -float(m) - torch.arange(vocab - 1) % 4 * 0.5
    return x.to(dtype), torch.zeros(n, dtype=torch.int64)


MARGINS = [20, 25, 40, 60, 80, 100]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_collapse_logits(device, dtype):
    x, t = _collapsed_rows(MARGINS, 333, dtype)
    # the case: PyTorch's own float32 log_softmax has lost the target's log-probability
    naive = torch.log_softmax(x.float(), -1)[:, 0]
    assert (naive[1:] == 0).all()  # (at a margin of 20, 332 others still add up to 7e-7)
    x64 = x.double().requires_grad_(True)
    lp_ref, ent_ref = reference(x64, t)
    assert (lp_ref < 0).all()
    leaf = x.to(device).requires_grad_(True)
    lp, ent = fusedce.logprobs(leaf, t.to(device), return_entropy=True)
    # below 1.2e-38 (a margin past ~87 nats) float32 holds subnormals: sums of them are exact to
    # some ulps of 1.4e-45 only
    _close(lp, lp_ref.detach(), 1e-41, 1e-5, "collapsed logprob")
    _close(ent, ent_ref.detach(), 1e-41, 1e-4, "collapsed entropy")
    lp.sum().backward()
    # d logprob_t / dz_t = 1 - p_t, exact; the others -p_j
    g, g_ref = leaf.grad.float().cpu(), _collapse_dz(x.double(), t)
    if dtype == torch.float32:
        _close(g, g_ref, 1e-41, 1e-5, "collapsed gradient")
    else:  # bf16 gradient: its rounding only
        _close(g, g_ref, 1e-40, 8e-3, "collapsed gradient")
    assert (g[:-1, 0] > 0).all()  # (at 100 nats 1 - p_t = 7e-42 is below bf16's smallest subnormal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
@KEEP
def test_collapse_linear(device, dtype, temperature, keep_logits):
    """Integer-valued logits from one-hot hidden rows (exact in every dtype and in the product's
    float32 accumulation, even when a GPU stores the chunk in bf16)."""
    vocab, hid = 203, 8
    margins = [m * temperature for m in MARGINS]
    n = len(margins)
    h = torch.zeros(n, hid)
    h[torch.arange(n), torch.arange(n) % hid] = 1.0
    w = torch.zeros(vocab, hid)
    w[1:] = -torch.tensor(margins).round()[torch.arange(hid) % n][None, :] - (torch.arange(vocab - 1) % 3)[:, None]
    t = torch.zeros(n, dtype=torch.int64)
    h, w = h.to(dtype), w.to(dtype)
    z64 = (h.double() @ w.double().T) / temperature
    lp_ref, _ = reference(z64, t)
    assert (torch.log_softmax(z64.float(), -1)[1:, 0] == 0).all()
    hl, wl = h.to(device).requires_grad_(True), w.to(device).requires_grad_(True)
    lp = fusedce.linear_logprobs(hl, wl, t.to(device), temperature=temperature, keep_logits=keep_logits)
    _close(lp, lp_ref, 1e-41, 1e-5, "collapsed logprob (linear)")
    lp.sum().backward()
    dz = _collapse_dz(z64, t) / temperature
    assert hl.grad.abs().max() > 0
    for got, want, name in ((hl.grad, dz @ w.double(), "hidden"), (wl.grad, dz.T @ h.double(), "weight")):
        rtol = 1e-5 if dtype == torch.float32 else 8e-3
        _close(got.float(), want, 1e-30, rtol, f"collapsed grad_{name}")


# ---- the linear form ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,hid,vocab", [(19, 24, 301), (5, 8, 1), (0, 16, 40), (40, 32, 1031)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
@KEEP
def test_linear_values_and_gradients(device, dtype, n, hid, vocab, bias, temperature, keep_logits):
    h, w, b, t = _linear_problem(n, hid, vocab, dtype, device, seed=n * 7 + vocab, bias=bias)
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    lp, ent = fusedce.linear_logprobs(leaves[0], leaves[1], t, leaves[2], temperature=temperature,
                                      return_entropy=True, keep_logits=keep_logits)
    ref64 = [x.detach().double().cpu().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    z64 = torch.nn.functional.linear(ref64[0], ref64[1], ref64[2]) / temperature
    lp_ref, ent_ref = reference(z64, t.cpu())
    old, adv = _weights(n, n)
    # PyTorch's own error in this dtype (F.linear in the dtype, then float32), which sets the
    # budget where the dtype's rounding of the logits dominates: kept logits are in the input
    # dtype, and so is a GPU's logit chunk (the CPU streams float32 chunks); float32
    # arithmetic's error is the floor.
    logits_rounded = dtype != torch.float32 and (keep_logits or device != "cpu")
    own = [x.detach().clone().cpu().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    lp_own, ent_own = reference(torch.nn.functional.linear(*own).float() / temperature, t.cpu())
    budget = max((lp_own.double() - lp_ref).abs().max().item() if n else 0.0,
                 (ent_own.double() - ent_ref).abs().max().item() if n else 0.0)
    tol = max(2e-5, 3 * budget)
    _close(lp, lp_ref.detach(), tol, 2e-6, "logprob")
    _close(ent, ent_ref.detach(), tol, 2e-6, "entropy")
    if not n:
        return
    _objective(lp, ent, old.float().to(device), adv.float().to(device)).backward()
    _objective(lp_ref, ent_ref, old, adv).backward()
    _objective(lp_own, ent_own, old.float(), adv.float()).backward()
    for leaf, ref, mine, name in zip(leaves, ref64, own, ("hidden", "weight", "bias")):
        if leaf is None:
            continue
        assert leaf.grad.dtype == dtype, name
        atol, rtol = _grad_tol(dtype, ref.grad, n + hid + vocab)
        if logits_rounded:
            atol = max(atol, 3 * (mine.grad.double() - ref.grad).abs().max().item())
        _close(leaf.grad, ref.grad, atol, rtol, f"grad_{name}")
    assert (leaves[0].grad[t == IGNORE] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_linear_chunked_and_leading_dims(device):
    h, w, b, t = _linear_problem(24, 16, 257, torch.float32, device, seed=5, bias=True)
    full = fusedce.linear_logprobs(h, w, t, b, return_entropy=True, keep_logits=False)
    # a budget of a few rows of logits: several chunks (5 rows each on the CPU)
    chunked = fusedce.linear_logprobs(h.view(2, 12, 16), w, t.view(2, 12), b, return_entropy=True,
                                      chunk_budget_bytes=5 * 264 * 4, keep_logits=False)
    for a, c in zip(full, chunked):
        assert c.shape == (2, 12)
        torch.testing.assert_close(c.reshape(-1), a, rtol=1e-6, atol=1e-6)

    # the gradients summed over chunks equal the one-chunk call's
    def grads(**kw):
        hh, ww, bb = (x.detach().clone().requires_grad_(True) for x in (h, w, b))
        lp, ent = fusedce.linear_logprobs(hh, ww, t, bb, return_entropy=True, keep_logits=False, **kw)
        (lp * torch.linspace(-1, 1, lp.numel(), device=lp.device) + 0.1 * ent).sum().backward()
        return hh.grad, ww.grad, bb.grad

    for a, c, name in zip(grads(), grads(chunk_budget_bytes=5 * 264 * 4), ("hidden", "weight", "bias")):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_targets_past_a_vocabulary_chunk_inside_its_last_tile(device):
    """The recomputing backward's vocabulary chunks need not end on a tile of the fused product
    (192 columns on Hopper): at 256 x 64 x 1000 a 32 KiB budget over the float32 grad_weight
    accumulator (256 KB) gives chunks of 512 and 488 columns (the plan's arithmetic:
    logprobs_cuda.cpp, plan_of), and the first ends inside the tile [384, 576). Every counted
    target lies in [512, 576): past the first chunk, inside that tile, so each row's tile holds
    its target's column without the chunk holding it. A chunk's dlogits must not take that
    target (stored past the chunk's end it lands in the next row's first columns, unless that
    row's own tile stores later: the race makes this end-to-end check likely, not certain, to see
    it; CudaFusedLogprobs checks the stores deterministically). bf16 (the fused products' dtype)
    against float64, values and gradients, with test_linear_values_and_gradients' tolerances."""
    n, hid, vocab, dtype = 256, 64, 1000, torch.bfloat16
    h, w, _, t = _linear_problem(n, hid, vocab, dtype, device, seed=11)
    g = torch.Generator().manual_seed(12)
    t = torch.where(t.cpu() == IGNORE, IGNORE, 512 + torch.randint(0, 64, (n,), generator=g)).to(device)
    leaves = [x.detach().clone().requires_grad_(True) for x in (h, w)]
    lp, ent = fusedce.linear_logprobs(*leaves, t, return_entropy=True, chunk_budget_bytes=32 << 10,
                                      keep_logits=False)
    ref64 = [x.detach().double().cpu().requires_grad_(True) for x in (h, w)]
    own = [x.detach().clone().cpu().requires_grad_(True) for x in (h, w)]
    lp_ref, ent_ref = reference(ref64[0] @ ref64[1].T, t.cpu())
    lp_own, ent_own = reference(torch.nn.functional.linear(*own).float(), t.cpu())
    budget = max((lp_own.double() - lp_ref).abs().max().item(), (ent_own.double() - ent_ref).abs().max().item())
    _close(lp, lp_ref.detach(), max(2e-5, 3 * budget), 2e-6, "logprob")
    _close(ent, ent_ref.detach(), max(2e-5, 3 * budget), 2e-6, "entropy")
    # A policy-gradient objective whose targets carry their full weight (dlogit ~ adv (1 - p_t),
    # about 1: a stray one in another row moves a gradient entry by about 1, far past the bound)
    _, adv = _weights(n, 3)
    for x, e, a in ((lp, ent, adv.float().to(device)), (lp_ref, ent_ref, adv), (lp_own, ent_own, adv.float())):
        ((x * a).sum() + 0.01 * e.sum()).backward()
    for leaf, ref, mine, name in zip(leaves, ref64, own, ("hidden", "weight")):
        atol, rtol = _grad_tol(dtype, ref.grad, n + hid + vocab)
        atol = max(atol, 3 * (mine.grad.double() - ref.grad).abs().max().item())
        _close(leaf.grad, ref.grad, atol, rtol, f"grad_{name}")


# ---- keep_logits=True: the logits formed once and kept -----------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vp", [False, True], ids=["whole", "shard"])
def test_kept_logits_are_the_logits_form_over_f_linear(device, dtype, bias, vp):
    """keep_logits=True is, bit for bit, the logits form over F.linear's logits in the input
    dtype, followed by the three products: grad_hidden = dlogits @ weight, grad_weight =
    dlogits.T @ hidden, grad_bias = dlogits' column sums (float32, rounded once). "shard": the
    step arguments of one rank's columns (vocab_start, vocab_total) without a process group,
    whose float32 grad_hidden part comes from _float32_product."""
    n, hid, vocab = 21, 24, 517
    h, w, b, t = _linear_problem(n, hid, vocab, dtype, device, seed=17, bias=bias)
    old, adv = (x.float().to(device) for x in _weights(n, 6))
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    lp, ent = fusedce.linear_logprobs(leaves[0], leaves[1], t, leaves[2], temperature=0.9, return_entropy=True,
                                      keep_logits=True)
    x = torch.nn.functional.linear(h, w, b).detach().requires_grad_(True)
    lp_x, ent_x = fusedce.logprobs(x, t, temperature=0.9, return_entropy=True)
    assert torch.equal(lp, lp_x) and torch.equal(ent, ent_x)
    _objective(lp, ent, old, adv).backward()
    _objective(lp_x, ent_x, old, adv).backward()
    dl = x.grad
    assert torch.equal(leaves[0].grad, dl @ w)
    assert torch.equal(leaves[1].grad, dl.T @ h)
    if bias:  # float32 accumulation, rounded once to the dtype
        one_ulp = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
        _close(leaves[2].grad, dl.double().sum(0), 1e-6, one_ulp, "grad_bias")
        if device == "cpu":
            assert torch.equal(leaves[2].grad, dl.sum(0, dtype=torch.float32).to(dtype))
    if vp:  # one rank's part of grad_hidden, in float32, as the vocabulary-parallel backward takes it
        part = token_logprobs._float32_product(dl, w)
        assert part.dtype == torch.float32
        _close(part, dl.double() @ w.double(), 1e-6, 1e-5, "float32 grad_hidden part")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kept_logits_against_streamed(device, dtype):
    """keep_logits True and False: the same values to float32 arithmetic plus the input dtype's
    rounding of the logits (the kept logits are in the input dtype; the streamed chunks are
    float32 on the CPU, the input dtype on a GPU), so not the same bits in general."""
    n, hid, vocab = 33, 40, 2053
    h, w, b, t = _linear_problem(n, hid, vocab, dtype, device, seed=23, bias=True)
    runs = {}
    for keep in (False, True):
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
        lp, ent = fusedce.linear_logprobs(*leaves[:2], t, leaves[2], temperature=1.1, return_entropy=True,
                                          keep_logits=keep)
        (lp * torch.linspace(-1, 1, n, device=device) + 0.05 * ent).sum().backward()
        runs[keep] = [lp.detach(), ent.detach()] + [x.grad for x in leaves]
    # a logit rounded to the dtype moves by up to half its ulp: logprob (z_t - lse) and entropy by
    # up to about eps * max |z|
    eps = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    zmax = torch.nn.functional.linear(h.double(), w.double(), b.double()).abs().max().item() / 1.1
    vtol = max(2e-5, eps * zmax)
    for a, c, name in zip(runs[False], runs[True], ("logprob", "entropy", "hidden", "weight", "bias")):
        assert a.dtype == c.dtype, name
        if name in ("logprob", "entropy"):
            _close(c, a, vtol, 1e-5, name)
        else:
            # each path rounds its gradient once (2 u apart at most), and the kept logits'
            # rounding moves each p_j by at most eps zmax p_j (eps = 2 u): summed over a row's
            # probabilities, eps zmax of the largest gradient, twice that for the entropy's terms
            atol, rtol = _grad_tol(dtype, a.double(), n + hid + vocab)
            atol += 2 * eps * zmax * a.abs().max().item()
            _close(c, a, 2 * atol, 2 * rtol, f"grad_{name}")


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_kept_logits_overwritten_unless_the_graph_is_kept(device):
    """One backward writes dlogits over the kept logits (lp_bwd_, no second (N, V) buffer); a
    backward that keeps the graph (retain_graph=True) writes a new buffer (lp_bwd), so a second
    backward reads the logits again and gets the same gradients."""
    h, w, b, t = _linear_problem(12, 16, 301, torch.bfloat16, device, seed=29, bias=True)

    def grads(backwards):
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
        lp, ent = fusedce.linear_logprobs(*leaves[:2], t, leaves[2], return_entropy=True, keep_logits=True)
        obj = (lp * torch.linspace(-1, 1, 12, device=device) + 0.1 * ent).sum()
        out = []
        for k in range(backwards):
            log = _OpLog()
            with log:
                obj.backward(retain_graph=k + 1 < backwards)
            out.append(([x.grad.clone() for x in leaves], [n for n in log.names if n.startswith("fusedce.")]))
            for x in leaves:
                x.grad = None
        return out

    (once, ops_once), = grads(1)
    assert ops_once == ["fusedce.lp_bwd_"]
    (first, ops_first), (second, ops_second) = grads(2)
    assert ops_first == ["fusedce.lp_bwd"] and ops_second == ["fusedce.lp_bwd_"]
    for a, c, d in zip(once, first, second):
        assert torch.equal(a, c) and torch.equal(a, d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [0, 5], ids=["empty", "all_ignored"])
@KEEP
def test_empty_batch_gradients(device, keep_logits, dtype, rows):
    h, w, b, t = _linear_problem(rows, 8, 40, dtype, device, seed=3, bias=True)
    t = torch.full_like(t, IGNORE)
    leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
    lp, ent = fusedce.linear_logprobs(*leaves[:2], t, leaves[2], return_entropy=True, keep_logits=keep_logits)
    assert lp.shape == ent.shape == (rows,)
    (lp.sum() + ent.sum()).backward()
    for leaf in leaves:
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype and (leaf.grad == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_product(device, dtype, monkeypatch):
    """a @ b in float32 from 16-bit a, b (a vocabulary-parallel rank's part of grad_hidden),
    against float64: float32's error, well below a 16-bit rounding of the result. On the CPU by
    blocks of the shared dimension (a small block here: 14 blocks, the last one short)."""
    n, k, m = 7, 1000, 5
    monkeypatch.setattr(token_logprobs, "_FLOAT32_PRODUCT_BLOCK_BYTES", 4 * (n + m) * 73)
    g = torch.Generator().manual_seed(37)
    a = torch.randn(n, k, generator=g).to(dtype).to(device)
    b = torch.randn(k, m, generator=g).to(dtype).to(device)
    got = token_logprobs._float32_product(a, b)
    want = a.double() @ b.double()
    assert got.dtype == torch.float32 and got.shape == (n, m)
    _close(got, want, 1e-4, 1e-5, "float32 product")
    assert (got.double() - want).abs().max() < (want.to(dtype).double() - want).abs().max() / 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kept_logits_backward_holds_one_logits_buffer():
    """The backward of keep_logits=True adds no (N, V) buffer to the kept logits: its peak above
    the start of the backward is the gradients' outputs (and cuBLAS's workspace), well under the
    logits' size."""
    n, hid, vocab = 4096, 256, 32768
    h, w, _, t = _linear_problem(n, hid, vocab, torch.bfloat16, "cuda", seed=41, peaked=False)
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fusedce.linear_logprobs(hl, wl, t, return_entropy=True, keep_logits=True)
    obj = (lp + 0.1 * ent).sum()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    obj.backward()
    torch.cuda.synchronize()
    added = torch.cuda.max_memory_allocated() - start
    logits_bytes = n * vocab * 2
    grads_bytes = (n + vocab) * hid * 2
    assert added < grads_bytes + logits_bytes // 4, (added, logits_bytes, grads_bytes)


# ---- beyond 2^31 elements (GPU: the logits alone are 4.3 GB) --------------------------------

_BIG_N, _BIG_V = 16500, 131072  # N * V > 2^31; row 16384 starts at element 2^31


def _chunks(n, size=2048):
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_logits_beyond_2_31_elements():
    g = torch.Generator(device="cuda").manual_seed(31)
    x = torch.randn(_BIG_N, _BIG_V, device="cuda", generator=g) * 2.0
    x.scatter_(1, torch.randint(0, _BIG_V, (_BIG_N, 8), device="cuda", generator=g), 14.0)
    x = x.to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, _BIG_V, (_BIG_N,), device="cuda", generator=g)
    t[::7] = IGNORE
    c = torch.randn(_BIG_N, device="cuda", generator=g)
    lp, ent = fusedce.logprobs(x, t, return_entropy=True)
    (lp * c + 0.1 * ent).sum().backward()
    for rows in _chunks(_BIG_N):  # every row against float64, on the GPU
        x64 = x[rows].detach().double().requires_grad_(True)
        l64, e64 = reference(x64, t[rows])
        _close(lp[rows], l64.detach(), 2e-5, 2e-6, f"logprob rows {rows}")
        _close(ent[rows], e64.detach(), 2e-5, 2e-6, f"entropy rows {rows}")
        (l64 * c[rows].double() + 0.1 * e64).sum().backward()
        atol, rtol = _grad_tol(torch.bfloat16, x64.grad, _BIG_V)
        _close(x.grad[rows], x64.grad, atol, rtol, f"dlogits rows {rows}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_linear_beyond_2_31_logits():
    hid = 32
    g = torch.Generator(device="cuda").manual_seed(32)
    h = torch.randn(_BIG_N, hid, device="cuda", generator=g)
    w = torch.randn(_BIG_V, hid, device="cuda", generator=g) / hid ** 0.5
    likely = torch.randint(0, _BIG_V, (_BIG_N,), device="cuda", generator=g)
    w.index_add_(0, likely, 2.5 * h / h.norm(dim=1, keepdim=True))
    t = torch.where(torch.rand(_BIG_N, device="cuda", generator=g) < 0.6, likely,
                    torch.randint(0, _BIG_V, (_BIG_N,), device="cuda", generator=g))
    t[::7] = IGNORE
    c = torch.randn(_BIG_N, device="cuda", generator=g)
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fusedce.linear_logprobs(hl, wl, t, temperature=0.8, return_entropy=True)
    (lp * c + 0.1 * ent).sum().backward()
    w64 = w.double().requires_grad_(True)
    for rows in _chunks(_BIG_N):
        h64 = h[rows].double().requires_grad_(True)
        l64, e64 = reference(h64 @ w64.T / 0.8, t[rows])
        _close(lp[rows], l64.detach(), 2e-5, 2e-6, f"logprob rows {rows}")
        _close(ent[rows], e64.detach(), 2e-5, 2e-6, f"entropy rows {rows}")
        (l64 * c[rows].double() + 0.1 * e64).sum().backward()
        atol, rtol = _grad_tol(torch.float32, h64.grad, hid + _BIG_V)
        _close(hl.grad[rows], h64.grad, atol, rtol, f"grad_hidden rows {rows}")
    # grad_weight sums N float32 terms per entry
    atol, rtol = _grad_tol(torch.float32, w64.grad, hid + _BIG_N)
    _close(wl.grad, w64.grad, atol, rtol, "grad_weight")


@pytest.mark.parametrize("device", DEVICES)
@KEEP
def test_only_entropy_or_only_logprob_has_a_gradient(device, keep_logits):
    h, w, b, t = _linear_problem(10, 8, 50, torch.float32, device, seed=9, bias=True)
    for pick in (0, 1):
        hl = h.detach().clone().requires_grad_(True)
        out = fusedce.linear_logprobs(hl, w, t, b, return_entropy=True, temperature=0.9, keep_logits=keep_logits)
        out[pick].sum().backward()
        h64 = h.double().cpu().requires_grad_(True)
        ref = reference(torch.nn.functional.linear(h64, w.double().cpu(), b.double().cpu()) / 0.9, t.cpu())
        ref[pick].sum().backward()
        _close(hl.grad, h64.grad, 1e-5, 1e-5, f"output {pick}")


@pytest.mark.parametrize("device", DEVICES)
@KEEP
def test_no_grad_and_frozen_head(device, keep_logits):
    h, w, b, t = _linear_problem(9, 8, 60, torch.float32, device, seed=2)
    with torch.no_grad():
        a = fusedce.linear_logprobs(h.requires_grad_(True), w, t, keep_logits=keep_logits)
    assert not a.requires_grad
    hl = h.detach().clone().requires_grad_(True)
    lp = fusedce.linear_logprobs(hl, w, t, keep_logits=keep_logits)
    if keep_logits:  # the same computation with and without a gradient: the same bits
        assert torch.equal(lp.detach(), a)
    torch.testing.assert_close(lp.detach(), a)
    lp.sum().backward()
    assert hl.grad is not None and w.grad is None


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_input_is_named():
    h, w, b, t = _linear_problem(6, 8, 30, torch.float32, "cpu", seed=1, bias=True)
    cases = [
        (dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=name):
            fusedce.linear_logprobs(h, w, t, **kwargs)
        with pytest.raises(ValueError, match=name):
            fusedce.logprobs(h @ w.T, t, **kwargs)
    with pytest.raises(TypeError, match="temperature"):
        fusedce.logprobs(h @ w.T, t, temperature=True)
    bad = t.clone()
    bad[3] = 30
    with pytest.raises(ValueError, match=r"tokens\[3\] = 30"):
        fusedce.linear_logprobs(h, w, bad)
    with pytest.raises(ValueError, match=r"tokens\[3\] = 30"):
        fusedce.logprobs(h @ w.T, bad)
    with pytest.raises(ValueError, match="weight must have hidden's dtype"):
        fusedce.linear_logprobs(h, w.double(), t)
    with pytest.raises(ValueError, match="bias"):
        fusedce.linear_logprobs(h, w, t, b[:-1])
    with pytest.raises(ValueError, match="tokens must be int64 or int32"):
        fusedce.linear_logprobs(h, w, t.float())
    with pytest.raises(ValueError, match="tokens must have shape"):
        fusedce.linear_logprobs(h, w, t[:-1])
    with pytest.raises(ValueError, match="logits must be float32"):
        fusedce.logprobs((h @ w.T).double(), t)
    with pytest.raises(ValueError, match="chunk_budget_bytes"):
        fusedce.linear_logprobs(h, w, t, chunk_budget_bytes=0)
    with pytest.raises(ValueError, match="process_group"):
        fusedce.linear_logprobs(h, w, t, vocab_total=30)
    with pytest.raises(ValueError, match="chunk_budget_bytes.*keep_logits"):
        fusedce.linear_logprobs(h, w, t, chunk_budget_bytes=1 << 20, keep_logits=True)
    with pytest.raises(TypeError, match="keep_logits must be None \\(the default\\) or a bool"):
        fusedce.linear_logprobs(h, w, t, keep_logits=1)


# ---- distribution statistics (return_stats) ------------------------------------------------


def _dist_reference(z64, tokens, ignore_index=IGNORE):
    """log sum p^2, the mean of z and whether the token is z's first argmax, in float64 (0 /
    False at ignored rows)."""
    keep = tokens != ignore_index
    if z64.shape[0] == 0:
        zero = z64.new_zeros((0,))
        return zero, zero, keep
    logp = z64 - torch.logsumexp(z64, -1, keepdim=True)
    lss = torch.logsumexp(2 * logp, -1)
    top1 = z64.argmax(-1) == torch.where(keep, tokens, -1)
    return torch.where(keep, lss, 0.0), torch.where(keep, z64.mean(-1), 0.0), top1 & keep


def _tied_logits(n, vocab, seed):
    """Peaked logits with exact ties at each row's max: rows 0 mod 3 a copy of the max before the
    token (is_top1 False though the token's logit is the max), rows 1 mod 3 a copy after it
    (True), rows 2 mod 3 none; the token at the max in most rows."""
    x, likely = _peaked_logits(n, vocab, seed)
    t = _tokens(n, vocab, seed, likely, ignore_frac=0.1)
    for i in range(n):
        j = int(x[i].argmax())
        if vocab < 3 or t[i] == IGNORE:
            continue
        t[i] = j if i % 4 else t[i]
        if i % 3 == 0 and j > 0:
            x[i, j - 1] = x[i, j]
        elif i % 3 == 1 and j < vocab - 1:
            x[i, j + 1] = x[i, j]
    return x, t


def _check_dist(got, z64, t, what):
    """log sum p^2 within 2e-6 + 1e-6 of its size (float32 sums of p and p^2 stored as float32;
    a 1e-5 relative bias fails), the mean within float32 roundoff of the largest |z|, is_top1
    exactly (ties by torch.argmax's first-index rule)."""
    lss, mean, top1 = _dist_reference(z64, t.cpu())
    assert set(got) == {"log_sum_sq_probs", "mean_logits", "is_top1"}
    _close(got["log_sum_sq_probs"].reshape(-1), lss, 2e-6, 1e-6, f"{what} log_sum_sq_probs")
    zmax = z64.abs().max().item() if z64.numel() else 0.0
    _close(got["mean_logits"].reshape(-1), mean, 4e-7 * zmax + 1e-30, 0.0, f"{what} mean_logits")
    assert got["is_top1"].dtype == torch.bool
    assert torch.equal(got["is_top1"].reshape(-1).cpu(), top1), f"{what} is_top1"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,vocab", [(13, 301), (7, 1), (0, 50), (33, 2053), (6, 5000)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_distribution_stats_over_logits(device, dtype, n, vocab, temperature):
    x, t = _tied_logits(n, vocab, seed=n + 3 * vocab)
    x = x.to(dtype)
    z64 = x.double() / temperature
    lp, ent, got = fusedce.logprobs(x.to(device), t.to(device), temperature=temperature, return_entropy=True,
                                    return_stats=True)
    lp_ref, ent_ref = reference(z64, t)
    _close(lp, lp_ref, 2e-5, 2e-6, "logprob")  # the other outputs are unchanged by return_stats
    _check_dist(got, z64, t, "logits form")
    only = fusedce.logprobs(x.to(device), t.to(device), temperature=temperature, return_stats=True)
    assert len(only) == 2 and torch.equal(only[0], lp)
    # with a gradient: the statistics are not differentiable, logprob and entropy are
    xg = x.to(device).requires_grad_(True)
    lp_g, ent_g, got_g = fusedce.logprobs(xg, t.to(device), temperature=temperature, return_entropy=True,
                                          return_stats=True)
    assert not any(v.requires_grad for v in got_g.values())
    for k in got:
        assert torch.equal(got_g[k], got[k]), k
    (lp_g.sum() + ent_g.sum()).backward()
    assert xg.grad is not None and xg.grad.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("keep_logits", [False, True], ids=["stream", "keep"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_distribution_stats_linear(device, dtype, keep_logits, grad):
    n, hid, vocab = 29, 24, 1031
    h, w, b, t = _linear_problem(n, hid, vocab, dtype, device, seed=21, bias=True)
    z64 = torch.nn.functional.linear(h.double(), w.double(), b.double()) / 0.9
    leaves = [x.detach().clone().requires_grad_(grad) for x in (h, w, b)]
    lp, got = fusedce.linear_logprobs(*leaves[:2], t, leaves[2], temperature=0.9, keep_logits=keep_logits,
                                      return_stats=True)
    # The head's logits are formed in float32 (the CPU's streamed form) or in the input dtype
    # (kept logits; CUDA's chunks), so the statistics carry that rounding: each is held to the
    # float64 value within twice what logits formed in the input dtype (F.linear) move it, plus
    # float32's 2e-5. A token whose logit is within that rounding of the max may compare either
    # way, so is_top1 is judged against the float64 argmax where the top two logits are 1e-2
    # apart (relative; bf16's step is 2^-8).
    top2 = z64.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-2 * top2[:, 0].abs().clamp(min=1)
    lss, mean, top1 = _dist_reference(z64.cpu(), t.cpu())
    own64 = torch.nn.functional.linear(*(x.detach() for x in (h, w, b))).double().cpu() / 0.9
    lss_own, mean_own, _ = _dist_reference(own64, t.cpu())
    for key, want, moved in (("log_sum_sq_probs", lss, lss_own), ("mean_logits", mean, mean_own)):
        budget = 2 * (moved - want).abs().max().item() + 2e-5
        _close(got[key], want, budget, 0.0, f"linear {key}")
    assert torch.equal(got["is_top1"].cpu()[clear.cpu()], top1[clear.cpu()])
    assert got["is_top1"].any() and not got["is_top1"].all()
    if grad:
        lp.sum().backward()
        assert all(x.grad is not None for x in leaves)


# ---- the ops --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    h, w, b, t = _linear_problem(7, 8, 45, torch.float32, device, seed=4, bias=True)
    logits = (h @ w.T).contiguous()
    opts = (0, 45, 0.8, IGNORE, False)  # vocab_start, vocab_total, temperature, ignore_index, distribution_stats
    dist_opts = opts[:-1] + (True,)
    stats = ops.lp_stats(logits, t, *opts)
    dist_stats = ops.lp_stats(logits, t, *dist_opts)
    lp, ent, lse = ops.lp_merge(stats, t, *opts)
    g = torch.randn(7, device=device)
    checks = [
        (ops.lp_stats.default, (logits, t, *opts)),
        (ops.lp_stats.default, (logits, t, *dist_opts)),
        (ops.llp_stats.default, (h, w, b, t, *opts, 0)),
        (ops.llp_stats.default, (h, w, b, t, *dist_opts, 0)),
        (ops.lp_merge.default, (stats, t, *opts)),
        (ops.lp_distribution_stats.default, (dist_stats, t, *dist_opts)),
        (ops.lp_bwd.default, (logits, t, lse, lp, ent, g, g, *opts)),
        (ops.lp_bwd_.default, (logits.clone(), t, lse, lp, ent, g, None, *opts)),
        (ops.llp_bwd.default, (h, w, b, t, lse, lp, ent, g, None, *opts, 0, True, True, True)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args)
    # lp_bwd_ writes lp_bwd's dlogits over its logits, and tells autograd (the version counter)
    x = logits.clone()
    version = x._version
    ops.lp_bwd_(x, t, lse, lp, ent, g, g, *opts)
    assert torch.equal(x, ops.lp_bwd(logits, t, lse, lp, ent, g, g, *opts)) and x._version > version
    # the statistics' columns 0-4 are the same with distribution_stats (it only adds columns)
    assert torch.equal(dist_stats[:, :5], stats[:, :5])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep_logits", [False, True, None], ids=["stream", "keep", "default"])
def test_compile_matches_eager(device, keep_logits):
    torch._dynamo.reset()
    h, w, b, t = _linear_problem(16, 16, 131, torch.float32, device, seed=8, bias=True)
    old, adv = (x.float().to(device) for x in _weights(16, 3))

    def step(h, w, b):
        lp, ent = fusedce.linear_logprobs(h, w, t, b, temperature=0.9, return_entropy=True, keep_logits=keep_logits)
        return _objective(lp, ent, old, adv)

    def run(fn):
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach()] + [x.grad for x in leaves]

    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True))
    for a, c in zip(eager, compiled):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


# ---- vocabulary parallel ----------------------------------------------------------------------


def _vp_cases(world, rank, group):
    """Every rank: its shard of a problem, the vocabulary-parallel call, and the single-device
    call on the whole problem: values equal (bit for bit on every rank), gradients equal to the
    slices (grad_hidden up to the all-reduce's float32 rounding)."""
    vocab, hid, n = 127, 12, 15
    sizes = [vocab // world + (1 if r < vocab % world else 0) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    v0, v1 = starts[rank], starts[rank] + sizes[rank]
    for dtype, with_bias, temperature, keep in ((torch.float32, True, 0.8, False), (torch.bfloat16, False, 1.0, False),
                                                (torch.float32, True, 0.8, True), (torch.bfloat16, True, 1.0, True),
                                                (torch.float16, False, 1.2, True), (torch.bfloat16, True, 0.9, None)):
        h, w, b, t = _linear_problem(n, hid, vocab, dtype, "cpu", seed=11, bias=with_bias)
        old, adv = (x.float() for x in _weights(n, 5))

        def run(w_part, b_part, **kw):
            leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (h, w_part, b_part)]
            lp, ent = fusedce.linear_logprobs(leaves[0], leaves[1], t, leaves[2], temperature=temperature,
                                              return_entropy=True, keep_logits=keep, **kw)
            _objective(lp, ent, old, adv).backward()
            return lp.detach(), ent.detach(), [x.grad if x is not None else None for x in leaves]

        full = run(w, b)
        part = run(w[v0:v1], None if b is None else b[v0:v1], process_group=group, vocab_start=v0,
                   vocab_total=vocab)
        torch.testing.assert_close(part[0], full[0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(part[1], full[1], rtol=2e-6, atol=2e-6)
        gtol = dict(rtol=2e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(part[2][0], full[2][0], **gtol)
        torch.testing.assert_close(part[2][1], full[2][1][v0:v1], **gtol)
        if b is not None:
            torch.testing.assert_close(part[2][2], full[2][2][v0:v1], **gtol)
        # the same bits on every rank
        both = torch.stack([part[0], part[1]])
        gathered = [torch.empty_like(both) for _ in range(world)]
        dist.all_gather(gathered, both, group=group)
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        # over logit shards: torch.chunk's layout (vocab_total only)
        x = torch.nn.functional.linear(h.float(), w.float(), None if b is None else b.float()).to(dtype)
        chunk = torch.chunk(x, world, dim=1)[rank]
        c0 = sum(c.shape[1] for c in torch.chunk(x, world, dim=1)[:rank])
        xl = chunk.detach().clone().requires_grad_(True)
        lp, ent, dist_part = fusedce.logprobs(xl, t, temperature=temperature, return_entropy=True,
                                              process_group=group, vocab_total=vocab, return_stats=True)
        xf = x.detach().clone().requires_grad_(True)
        lpf, entf, dist_full = fusedce.logprobs(xf, t, temperature=temperature, return_entropy=True,
                                                return_stats=True)
        # the distribution statistics folded over the ranks: the single device's (the sums in
        # another order), the same bits on every rank
        assert torch.equal(dist_part["is_top1"], dist_full["is_top1"])
        for key in ("log_sum_sq_probs", "mean_logits"):
            torch.testing.assert_close(dist_part[key], dist_full[key], rtol=2e-6, atol=2e-6)
            mine = dist_part[key].clone()
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine, group=group)
            assert all(torch.equal(e, every[0]) for e in every), key
        torch.testing.assert_close(lp, lpf, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(ent, entf, rtol=2e-6, atol=2e-6)
        _objective(lp, ent, old, adv).backward()
        _objective(lpf, entf, old, adv).backward()
        torch.testing.assert_close(xl.grad, xf.grad[:, c0:c0 + chunk.shape[1]], **gtol)
    # a bad argument on one rank only: every rank raises
    bad = t.clone()
    if rank == world - 1:
        bad[2] = vocab + 5
    try:
        fusedce.linear_logprobs(h, w[v0:v1], bad, process_group=group, vocab_start=v0, vocab_total=vocab)
    except ValueError as e:
        assert ("tokens[2]" in str(e)) == (rank == world - 1), str(e)
    else:
        raise AssertionError("no rank may go on with a bad call")


def _vp_case(key, group, rank, world):
    _vp_cases(world, rank, group)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_parallel_equals_single_device(world, tmp_path_factory):
    results = spawn_group(world, ["vp"], _vp_case, tmp_path_factory, timeout_s=120, deadline_s=400)
    failures = failures_of(results, "vp")
    assert not failures, failures
