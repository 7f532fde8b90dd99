"""fusedce.linear_distillation and fusedce.linear_distillation_topk against a float64 reference
that materialises both heads' logits (F.linear, the transforms, log_softmax) and writes each
definition of include/fusedce/distill.h out with torch ops; gradients against the reference's
autograd, and gradcheck in float64 on tiny shapes through the ops. Parametrised over DEVICES
(run with -k cuda on a GPU).

The inputs are rounded to their dtype first and the reference runs in float64 on those rounded
values, so fusedce's error is float32 arithmetic's: the logits' products over H terms, the row
sums over V terms. Tolerances (_value_tol, _grad_tol) say so. Planted bugs: a 1e-5 relative
error on the float32 loss, and a 0.5% one on the bfloat16 gradients, each fail
test_full_values_and_gradients and test_topk_values_and_gradients.

On CUDA with 16-bit inputs each logits chunk (and its dlogits) is held in the input dtype, one
rounding of every logit and dlogit (two of a biased head with unaligned H: Rounding), as the
linear cross-entropy does: there the tolerance grows to 3 times the change those roundings make in
the reference itself (the reference run again on rounded logits, whose autograd rounds the dlogits
too): the rule of test_logprobs.py."""

import math
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import fusedce
from conftest import DEVICES, requires_cuda
from fusedce._distill_options import NAMES

IGNORE = -100
U32 = 2.0 ** -24
UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
BETAS = [0.0, 0.5, 1.0]
# V = 1, an odd V, N = 0, a V past a vocabulary block (256) and a chunk of rows
SHAPES = [(13, 24, 301), (7, 16, 1), (0, 8, 50), (37, 40, 2053)]


# ---- problems and the float64 reference -------------------------------------------------------


def _problem(n, h, vocab, dtype, seed, *, h_t=None, bias=False, ignore_frac=0.25):
    """Student (hidden, weight, bias) and teacher (hidden, weight, bias) whose logits are peaked
    and correlated (the teacher's head leans towards the student's likely token), labels with
    about ignore_frac ignored."""
    g = torch.Generator().manual_seed(seed)
    h_t = h_t or h + 5
    hs = torch.randn(n, h, generator=g)
    ws = torch.randn(vocab, h, generator=g) * (2.0 / h ** 0.5)
    ht = torch.randn(n, h_t, generator=g)
    wt = torch.randn(vocab, h_t, generator=g) * (2.5 / h_t ** 0.5)
    bs = torch.randn(vocab, generator=g) * 0.5 if bias else None
    bt = torch.randn(vocab, generator=g) * 0.5 if bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = IGNORE
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(hs), cast(ws), cast(bs), cast(ht), cast(wt), cast(bt), labels


def _transform(x, scale, softcap):
    y = scale * x
    return softcap * torch.tanh(y / softcap) if softcap else y


def _term(s, t, beta):
    """f(s, t) of include/fusedce/distill.h per entry, 0 where its weight is 0."""
    ps, pt = s.exp(), t.exp()
    if beta == 0.0:
        return torch.where(pt == 0, 0.0, pt * (t - s))
    if beta == 1.0:
        return torch.where(ps == 0, 0.0, ps * (s - t))
    lm = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
    return torch.where(pt == 0, 0.0, beta * pt * (t - lm)) + torch.where(ps == 0, 0.0, (1 - beta) * ps * (s - lm))


class Rounding(NamedTuple):
    """How a CUDA chunk holds a head's logits: in `dtype`, rounded once (product + bias), or,
    with `bias_after_rounding`, a biased head whose rows of H are not whole 16-byte segments
    rounded twice (the product, then product + bias): the order of some of cuBLASLt's kernels
    for such operands (the tests' teachers, H + 5; a model's H is a multiple of 8), chosen by
    its heuristics per shape, so the tolerance takes the larger change of the two."""
    dtype: torch.dtype
    bias_after_rounding: bool = False


def _logits(h, w, b, rounding):
    """float64 logits; rounded as `rounding` (a Rounding, or None) says and back, as a CUDA
    chunk holds them (autograd then rounds their gradient to the dtype as well, as the CUDA
    dlogits are)."""
    x = F.linear(h.double(), w.double())
    if rounding is None:
        return x if b is None else x + b.double()
    unaligned = h.shape[-1] * torch.empty((), dtype=rounding.dtype).element_size() % 16 != 0
    if b is not None and unaligned and rounding.bias_after_rounding:
        x = x.to(rounding.dtype).double()
    if b is not None:
        x = x + b.double()
    return x.to(rounding.dtype).double()


def _student(hs, ws, bs, scale=1.0, softcap=None, rounding=None):
    return _transform(_logits(hs, ws, bs, rounding), scale, softcap)


def _finish(ys, div, labels, temperature, hard_weight, reduction):
    """loss and the per-row metrics from the student's transformed logits and the divergence."""
    n = ys.shape[0]
    keep = labels != IGNORE if labels is not None else torch.ones(n, dtype=torch.bool)
    zs = ys / temperature
    ls = zs.log_softmax(-1)
    ent = -(ls.exp() * ls).sum(-1)
    hard = torch.zeros(n, dtype=torch.float64)
    if hard_weight > 0:
        hard = F.cross_entropy(ys, torch.where(keep, labels, 0), reduction="none")
    row = (1 - hard_weight) * div + hard_weight * hard if hard_weight < 1 else hard
    row = torch.where(keep, row, 0.0)
    if reduction == "none":
        loss = row
    elif reduction == "sum":
        loss = row.sum()
    else:
        loss = row.sum() / keep.sum()
    zero = lambda v: torch.where(keep, v, 0.0)  # noqa: E731
    return loss, {"divergence": zero(div), "hard_loss": zero(hard), "entropy": zero(ent)}


def reference_full(hs, ws, bs, ht, wt, bt, labels, *, beta, temperature=1.0, hard_weight=0.0, reduction="mean",
                   s_scale=1.0, s_cap=None, t_scale=1.0, t_cap=None, rounding=None):
    ys = _student(hs, ws, bs, s_scale, s_cap, rounding)
    yt = _transform(_logits(ht, wt, bt, rounding), t_scale, t_cap)
    ls, lt = (ys / temperature).log_softmax(-1), (yt / temperature).log_softmax(-1)
    return _finish(ys, _term(ls, lt, beta).sum(-1), labels, temperature, hard_weight, reduction)


def _sparse_lse(x, valid):
    return torch.where(valid, x, -math.inf).logsumexp(-1, keepdim=True)


def reference_topk(hs, ws, bs, ids, tlp, labels, *, beta, norm, temperature=1.0, hard_weight=0.0, reduction="mean",
                   rounding=None):
    """TRL's and axolotl's top-k definitions: the student's full-vocabulary log-softmax at the
    ids, then none / renorm / tail (TRL's tail bucket with its clamp at -1e-7)."""
    ys = _student(hs, ws, bs, rounding=rounding)
    q = (ys / temperature).log_softmax(-1).gather(-1, ids)
    t = tlp.double()
    valid = t != -math.inf
    if norm == "renorm":
        q, t = q - _sparse_lse(q, valid), t - _sparse_lse(t, valid)
    terms = torch.where(valid, _term(q, torch.where(valid, t, 0.0), beta), 0.0)
    div = terms.sum(-1)
    if norm == "tail":
        tails = [torch.log(-torch.expm1(_sparse_lse(x, valid).clamp(max=-1e-7)))[:, 0] for x in (q, t)]
        div = div + _term(tails[0], tails[1], beta)
    return _finish(ys, div, labels, temperature, hard_weight, reduction)


def _topk_teacher(n, vocab, k, seed, *, repeats=False, absent=False):
    """Top-k ids and the teacher's log-probabilities there (of a random peaked distribution,
    so they sum to less than 1 unless k = vocab); repeated ids and -inf entries when asked."""
    g = torch.Generator().manual_seed(seed + 11)
    logits = torch.randn(n, vocab, generator=g) * 2.5
    lp = logits.log_softmax(-1)
    tlp, ids = lp.topk(k, dim=-1)
    if repeats and k > 1:
        ids[:, -1] = ids[:, 0]
        tlp[:, -1] = tlp[:, 0]
    if absent and k > 1:
        tlp[::2, -1] = -math.inf
    return ids, tlp


# ---- tolerances -------------------------------------------------------------------------------


def _value_tol(h, h_t, vocab, ref_scale):
    """atol of a float32 value (loss, divergence, entropy): each logit of the float32 products
    carries about sqrt(H) roundoffs of its terms, each row sum over V adds sqrt(V) more; these
    move a divergence (weights summing to 1) by a few times their size. Against the largest
    value: 4 (sqrt(H + H_t) + sqrt(V)) u * scale; a 1e-5 relative error on an O(1) loss exceeds
    it (planted: fails)."""
    return 4 * ((h + h_t) ** 0.5 + vocab ** 0.5) * U32 * max(ref_scale, 1.0)


def _grad_tol(dtype, ref, terms, amplification=1.0, floor=0.0):
    """(atol, rtol) of a gradient formed in float32 and rounded once to `dtype` (the rule of
    test_logprobs.py): rtol the dtype's unit roundoff, atol 4 sqrt(terms) float32 roundoffs of
    the largest |ref|, times `amplification`: the top-k form's entry gradients e^s (s - t + 1)
    carry the rounding of e^s times |s - t|, up to the largest |t| of the teacher's entries,
    before the pull-back through the softmax cancels most of them. `floor` (see _grad_floor)
    bounds the scale from below where the exact gradient cancels to 0 (V = 1: p_s = p_t = 1)
    but its float32 terms do not."""
    scale = max(ref.abs().max().item(), floor, 1e-30)
    atol = 4 * terms ** 0.5 * U32 * scale * amplification
    return atol + (2.0 ** -25 if dtype == torch.float16 else 0.0), UNIT_ROUNDOFF[dtype]


def _close(got, want, atol, rtol, what):
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def _leaf(x, device="cpu"):
    return None if x is None else x.detach().to(device).clone().requires_grad_(True)


def _on(device, *xs):
    return [None if x is None else x.to(device) for x in xs]


def _own(device, dtype, inputs, run_reference):
    """On CUDA with 16-bit inputs, [(loss, metrics, leaves)] of the reference run again with its
    logits and dlogits rounded to the dtype, as the GPU's chunks hold them, once per Rounding
    order: what sets the tolerance there. [] elsewhere (the CPU forms float32 logits)."""
    if device == "cpu" or dtype == torch.float32:
        return []
    runs = []
    for twice in (False, True):
        leaves = [_leaf64(x) for x in inputs]
        loss, metrics = run_reference(leaves, Rounding(dtype, twice))
        runs.append((loss, metrics, leaves))
    return runs


def _leaf64(x):
    return None if x is None else x.detach().double().requires_grad_(True)


def _rounding_budget(owns, ref):
    """3 times the largest change that the 16-bit chunks make in the reference, over the
    rounding orders `owns` (0 without)."""
    if not ref.numel():
        return 0.0
    return max([3 * (own.detach() - ref.detach()).abs().max().item() for own in owns if own is not None], default=0.0)


def _grad_floor(name, leaves64, n):
    """The size of a leaf's gradient where every row's dlogits are of size 1, whatever they
    cancel to: the largest |weight| (grad_hidden), |hidden| (grad_weight) or 1 (grad_bias),
    times the largest loss weight (1.5) over the n rows of the mean."""
    partner = {"hidden": leaves64[1], "weight": leaves64[0], "bias": None}[name]
    size = 1.0 if partner is None or partner.numel() == 0 else partner.detach().abs().max().item()
    return size * 1.5 / max(n, 1)


def _check_against(loss, metrics, ref_loss, ref_metrics, leaves, leaves64, dtype, h, h_t, vocab, n,
                   amplification=1.0, own=()):
    """Values, then the gradients of loss.sum() (weighted for 'none') against the reference's;
    `own` (see _own) widens each tolerance by its rounding budget."""
    own_losses = [o[0] for o in own]
    scale = max(ref_loss.abs().max().item() if ref_loss.numel() else 0.0, 1.0)
    tol = max(_value_tol(h, h_t, vocab, scale), _rounding_budget(own_losses, ref_loss))
    _close(loss, ref_loss, tol, 0.0, "loss")
    for key, value in ref_metrics.items():
        tol = max(_value_tol(h, h_t, vocab, value.abs().max().item() if n else 1.0),
                  _rounding_budget([o[1].get(key) for o in own], value))
        _close(metrics[key], value, tol, 0.0, key)
    if n == 0 or not torch.isfinite(ref_loss).all():
        return
    w = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64).view(loss.shape)
    (loss.double() * w.to(loss.device)).sum().backward()
    (ref_loss * w).sum().backward()
    for own_loss in own_losses:
        (own_loss * w).sum().backward()
    for i, (got, want, name) in enumerate(zip(leaves, leaves64, ("hidden", "weight", "bias"))):
        if got is None:
            continue
        assert got.grad.dtype == dtype
        atol, rtol = _grad_tol(dtype, want.grad, vocab + h + n, amplification, _grad_floor(name, leaves64, n))
        atol = max(atol, _rounding_budget([o[2][i].grad for o in own], want.grad))
        _close(got.grad, want.grad, atol, rtol, f"grad_{name}")


# ---- the full teacher -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,h,vocab", SHAPES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature,hard_weight", [(1.0, 0.0), (0.7, 0.3)])
def test_full_values_and_gradients(device, dtype, n, h, vocab, beta, temperature, hard_weight):
    hs, ws, bs, ht, wt, bt, labels = _problem(n, h, vocab, dtype, seed=n + vocab + int(10 * beta), bias=True)
    leaves, leaves64 = [_leaf(x, device) for x in (hs, ws, bs)], [_leaf64(x) for x in (hs, ws, bs)]
    loss, metrics = fusedce.linear_distillation(
        leaves[0], leaves[1], *_on(device, ht, wt, labels), beta=beta, temperature=temperature,
        hard_weight=hard_weight, student_bias=leaves[2], teacher_bias=_on(device, bt)[0], return_metrics=True)
    assert loss.dtype == torch.float32 and loss.shape == () and loss.device.type == device
    kw = dict(beta=beta, temperature=temperature, hard_weight=hard_weight)
    ref, ref_m = reference_full(*leaves64, ht, wt, bt, labels, **kw)
    if n == 0 or (labels == IGNORE).all():
        assert torch.isnan(loss)  # mean over no rows
        return
    own = _own(device, dtype, (hs, ws, bs), lambda l64, r: reference_full(*l64, ht, wt, bt, labels, rounding=r, **kw))
    _check_against(loss, metrics, ref, ref_m, leaves, leaves64, dtype, h, h + 5, vocab, n, own=own)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("beta", BETAS)
def test_full_reductions_transforms_and_shapes(device, reduction, beta):
    """(B, S, H) hidden, no labels (every row counts), each head with its own logit scale and
    softcap, a chunk budget of a few rows (several chunks)."""
    n, h, vocab = 12, 20, 97
    hs, ws, _, ht, wt, _, _ = _problem(n, h, vocab, torch.float32, seed=5)
    opts = dict(student_logit_scale=0.8, student_softcap=6.0, teacher_logit_scale=1.3, teacher_softcap=9.0)
    leaves, leaves64 = [_leaf(hs, device), _leaf(ws, device), None], [_leaf64(hs), _leaf64(ws), None]
    loss, metrics = fusedce.linear_distillation(
        leaves[0].view(3, 4, h), leaves[1], ht.to(device).view(3, 4, h + 5), wt.to(device), beta=beta, reduction=reduction,
        temperature=1.5, chunk_budget_bytes=2 * 3 * vocab * 4, return_metrics=True, **opts)
    assert loss.shape == ((3, 4) if reduction == "none" else ())
    ref, ref_m = reference_full(leaves64[0], leaves64[1], None, ht, wt, None, None, beta=beta, temperature=1.5,
                                reduction=reduction, s_scale=0.8, s_cap=6.0, t_scale=1.3, t_cap=9.0)
    _check_against(loss.reshape(ref.shape), {k: v.reshape(-1) for k, v in metrics.items()}, ref, ref_m, leaves,
                   leaves64, torch.float32, h, h + 5, vocab, n)


@pytest.mark.parametrize("device", DEVICES)
def test_ignored_rows_and_no_teacher_gradient(device):
    hs, ws, bs, ht, wt, bt, labels = _problem(10, 8, 33, torch.float32, seed=2, bias=True, ignore_frac=0.0)
    labels[:4] = IGNORE
    ws, labels = _on(device, ws, labels)
    hs_, ht_, wt_ = _leaf(hs, device), _leaf(ht, device), _leaf(wt, device)
    loss = fusedce.linear_distillation(hs_, ws, ht_, wt_, labels, reduction="none", beta=0.3)
    assert (loss[:4] == 0).all() and (loss[4:] > 0).all()
    loss.sum().backward()
    assert (hs_.grad[:4] == 0).all() and hs_.grad[4:].abs().sum() > 0
    assert ht_.grad is None and wt_.grad is None
    all_ignored = torch.full_like(labels, IGNORE)
    hs2 = _leaf(hs, device)
    for reduction, want in (("sum", 0.0), ("mean", math.nan)):
        loss = fusedce.linear_distillation(hs2, ws, ht_.detach(), wt_.detach(), all_ignored, reduction=reduction)
        assert math.isnan(want) and math.isnan(loss.item()) or loss.item() == want
        loss.backward()
        assert (hs2.grad == 0).all()


def test_gradcheck_full():
    """float64 student through the ops is not taken (float32 is the widest the core reads):
    gradcheck of the float32 call in float64 arithmetic would be rounding-limited, so it runs
    the finite differences on a float32 problem with a loose eps, at every beta and a hard mix."""
    torch.manual_seed(0)
    n, h, vocab = 3, 4, 5
    hs, ws, bs, ht, wt, bt, labels = _problem(n, h, vocab, torch.float32, seed=9, bias=True, ignore_frac=0.0)
    for beta in BETAS:
        fn = lambda a, b, c: fusedce.linear_distillation(  # noqa: E731
            a, b, ht, wt, labels, beta=beta, student_bias=c, teacher_bias=bt, hard_weight=0.25, temperature=0.9,
            student_softcap=3.0, reduction="sum")
        assert torch.autograd.gradcheck(fn, (_leaf(hs), _leaf(ws), _leaf(bs)), eps=1e-2, atol=2e-3, rtol=2e-2)


# ---- the top-k teacher ------------------------------------------------------------------------


TOPK_CASES = [  # (n, h, vocab, k, repeats, absent)
    (13, 24, 301, 8, False, False),
    (9, 16, 40, 40, False, False),     # K = V: the whole distribution
    (11, 16, 77, 6, True, True),       # a repeated id, absent (-inf) entries
    (7, 8, 1, 1, False, False),        # V = 1
    (0, 8, 50, 4, False, False),       # N = 0
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: "n{}_v{}_k{}{}{}".format(c[0], c[2], c[3],
                                                                                    "_rep" if c[4] else "",
                                                                                    "_abs" if c[5] else ""))
@pytest.mark.parametrize("norm", ["none", "renorm", "tail"])
@pytest.mark.parametrize("beta", BETAS)
def test_topk_values_and_gradients(device, dtype, case, norm, beta):
    n, h, vocab, k, repeats, absent = case
    hs, ws, bs, _, _, _, labels = _problem(n, h, vocab, dtype, seed=n + vocab + k, bias=True)
    ids, tlp = _topk_teacher(n, vocab, k, seed=n + k, repeats=repeats, absent=absent)
    leaves, leaves64 = [_leaf(x, device) for x in (hs, ws, bs)], [_leaf64(x) for x in (hs, ws, bs)]
    mix = dict(temperature=0.8, hard_weight=0.2) if beta == 0.5 else {}
    loss, metrics = fusedce.linear_distillation_topk(
        leaves[0], leaves[1], *_on(device, ids, tlp, labels), divergence="jsd", beta=beta, topk_norm=norm,
        student_bias=leaves[2], return_metrics=True, **mix)
    kw = dict(beta=beta, norm=norm, **mix)
    ref, ref_m = reference_topk(*leaves64, ids, tlp, labels, **kw)
    if n == 0 or (labels == IGNORE).all():
        assert torch.isnan(loss)
        return
    finite = tlp[tlp != -math.inf]
    amplification = 1.0 + (finite.abs().max().item() if finite.numel() else 0.0)
    own = _own(device, dtype, (hs, ws, bs), lambda l64, r: reference_topk(*l64, ids, tlp, labels, rounding=r, **kw))
    _check_against(loss, metrics, ref, ref_m, leaves, leaves64, dtype, h, 0, vocab, n, amplification, own=own)


@pytest.mark.parametrize("device", DEVICES)
def test_topk_normalisations_differ_and_agree_where_they_should(device):
    """renorm of a teacher whose K probabilities sum to 1 (K = V) with the student's K = V
    log-probabilities is the full forward KL; none and tail differ from renorm for K < V."""
    n, h, vocab = 6, 8, 23
    hs, ws, _, _, _, _, _ = _problem(n, h, vocab, torch.float32, seed=4)
    hs, ws = _on(device, hs, ws)
    ids, tlp = _on(device, *_topk_teacher(n, vocab, vocab, seed=1))
    full = [fusedce.linear_distillation_topk(hs, ws, ids, tlp, topk_norm=m) for m in ("none", "renorm")]
    torch.testing.assert_close(full[0], full[1], atol=1e-5, rtol=1e-5)
    ids, tlp = _on(device, *_topk_teacher(n, vocab, 4, seed=1))
    vals = [fusedce.linear_distillation_topk(hs, ws, ids, tlp, topk_norm=m).item() for m in ("none", "renorm", "tail")]
    assert len({round(v, 4) for v in vals}) == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_opcheck(device, reduction):
    """Every distillation op against its schema and fake kernel (torch.library.opcheck)."""
    ops = torch.ops.fusedce
    hs, ws, bs, ht, wt, bt, labels = _on(device, *_problem(6, 8, 13, torch.float32, seed=3, bias=True))
    ids, tlp = _on(device, *_topk_teacher(6, 13, 4, seed=3))
    args = (0.5, 0.9, 0.25, IGNORE, reduction, 1.0, 0.0, 1.0, 5.0, "tail", 0)
    g = torch.ones(6 if reduction == "none" else 1, device=device)
    for fwd, bwd, both, teacher in ((ops.ld_fwd, ops.ld_bwd, ops.ld_fwd_bwd, (ht, wt, bt)),
                                    (ops.ldk_fwd, ops.ldk_bwd, ops.ldk_fwd_bwd, (ids, tlp))):
        torch.library.opcheck(fwd.default, (hs, ws, bs, *teacher, labels, *args))
        stats = fwd(hs, ws, bs, *teacher, labels, *args)[4]
        torch.library.opcheck(bwd.default, (hs, ws, bs, *teacher, labels, stats, g, *args, True, True, True))
        if reduction != "none":
            torch.library.opcheck(both.default, (hs, ws, bs, *teacher, labels, *args, True, False, True))
            # the same bits as the two ops with an upstream gradient of 1
            got = both(hs, ws, bs, *teacher, labels, *args, True, True, True)
            want = (*fwd(hs, ws, bs, *teacher, labels, *args), *bwd(hs, ws, bs, *teacher, labels, stats, g, *args,
                                                                     True, True, True))
            for x, y in zip(got, want):
                assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_upstream_gradient_scales_the_forwards_gradients(device, reduction):
    """Mean and sum form the gradients in the forward (one pass over the logits) and scale them
    by the upstream gradient in the backward: a factor of 0.37 (and 1, untouched) gives the
    gradients of reduction none's rows each weighted so, within float32 rounding; a kept graph
    (retain_graph) gives the same gradients twice."""
    n, h, vocab = 14, 12, 61
    hs, ws, bs, ht, wt, bt, labels = _problem(n, h, vocab, torch.float32, seed=8, bias=True)
    ht, wt, bt, labels = _on(device, ht, wt, bt, labels)
    kw = dict(beta=0.4, temperature=1.1, hard_weight=0.3)
    for factor in (0.37, 1.0):
        leaves = [_leaf(x, device) for x in (hs, ws, bs)]
        loss = fusedce.linear_distillation(leaves[0], leaves[1], ht, wt, labels, student_bias=leaves[2],
                                           teacher_bias=bt, reduction=reduction, **kw)
        (loss * factor).backward(retain_graph=True)
        first = [x.grad.clone() for x in leaves]
        for x in leaves:
            x.grad = None
        (loss * factor).backward()
        ref = [_leaf(x, device) for x in (hs, ws, bs)]
        rows = fusedce.linear_distillation(ref[0], ref[1], ht, wt, labels, student_bias=ref[2], teacher_bias=bt,
                                           reduction="none", **kw)
        count = (labels != IGNORE).sum() if reduction == "mean" else 1
        (rows.sum() * factor / count).backward()
        for got, again, want in zip(first, (x.grad for x in leaves), (x.grad for x in ref)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            assert torch.equal(got, again)


# ---- arguments ---------------------------------------------------------------------------------


def test_options_match_the_schema():
    schema = torch.ops.fusedce.ld_fwd.default._schema
    names = [a.name for a in schema.arguments]
    at = names.index("beta")
    assert tuple(names[at:at + len(NAMES)]) == NAMES
    assert names[at + len(NAMES)] == "chunk_budget_bytes"


def _args():
    hs, ws, bs, ht, wt, bt, labels = _problem(4, 6, 9, torch.float32, seed=1, bias=True)
    return hs, ws, ht, wt, labels


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(beta=1.5), ValueError, "beta must be in"),
    (dict(divergence="kl"), ValueError, "divergence must be"),
    (dict(divergence="forward_kl", beta=0.3), ValueError, "beta is for divergence='jsd'"),
    (dict(temperature=0.0), ValueError, "temperature must be"),
    (dict(hard_weight=2.0), ValueError, "hard_weight must be in"),
    (dict(reduction="avg"), ValueError, "reduction must be"),
    (dict(teacher_softcap=-1.0), ValueError, "teacher_softcap"),
    (dict(student_logit_scale=0.0), ValueError, "student_logit_scale"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(beta="a"), TypeError, "beta must be a real number"),
])
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        fusedce.linear_distillation(*_args(), **kwargs)


def test_bad_tensors():
    hs, ws, ht, wt, labels = _args()
    where = "fusedce.linear_distillation"
    cases = [
        ((hs, ws, ht, wt[:-1], labels), {}, "teacher_weight must have the student's vocabulary of 9"),
        ((hs, ws.double(), ht, wt, labels), {}, "student_weight must have student_hidden's dtype"),
        ((hs, ws, ht[:-1], wt, labels), {}, "teacher_hidden must have student_hidden's leading"),
        ((hs, ws, ht, wt, labels[:-1]), {}, "labels must have shape"),
        ((hs, ws, ht, wt, labels.float()), {}, "labels must be int64 or int32"),
        ((hs, ws, ht, wt, None), dict(hard_weight=0.5), "but labels is None"),
        ((hs, ws, ht, wt, torch.tensor([0, 1, 9, 2])), {}, r"labels\[2\] = 9 is out of range"),
        ((hs, ws, ht, wt, labels), dict(student_bias=torch.zeros(8)), "student_bias must be"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            fusedce.linear_distillation(*args, **kwargs)
    with pytest.raises(TypeError, match=f"{where}: teacher_hidden must be a tensor"):
        fusedce.linear_distillation(hs, ws, None, wt)


def test_bad_topk_tensors():
    hs, ws, _, _, labels = _args()
    ids, tlp = _topk_teacher(4, 9, 3, seed=0)
    cases = [
        ((hs, ws, ids[:, :2], tlp, labels), "teacher_logprobs must have teacher_ids's shape"),
        ((hs, ws, ids.float(), tlp, labels), "teacher_ids must be int64 or int32"),
        ((hs, ws, ids[:3], tlp[:3], labels), "teacher_ids must have shape"),
        ((hs, ws, ids + 9, tlp, labels.clamp(min=0)), r"teacher_ids\[0, 0\] = \d+ is out of range"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            fusedce.linear_distillation_topk(*args)
    with pytest.raises(ValueError, match="topk_norm must be"):
        fusedce.linear_distillation_topk(hs, ws, ids, tlp, topk_norm="sum")


def test_core_names_bad_arguments_through_the_ops():
    """What the front end checks first, the core checks again for its other callers: its
    message names the argument."""
    hs, ws, ht, wt, labels = _args()
    args = (0.5, 1.0, 0.0, IGNORE, "mean", 1.0, 0.0, 1.0, 0.0, "none", 0)
    with pytest.raises(ValueError, match="teacher_weight must have teacher_hidden's 11 columns"):
        torch.ops.fusedce.ld_fwd(hs, ws, None, ht, wt[:, :-1].contiguous(), None, labels, *args)
    with pytest.raises(ValueError, match="beta must be in"):
        torch.ops.fusedce.ld_fwd(hs, ws, None, ht, wt, None, labels, 2.0, *args[1:])
    with pytest.raises(ValueError, match="hard_weight > 0 needs labels"):
        torch.ops.fusedce.ld_fwd(hs, ws, None, ht, wt, None, None, 0.5, 1.0, 0.5, *args[3:])


def test_other_devices_are_refused():
    hs, ws, ht, wt, labels = _args()
    meta = [x.to("meta") for x in (hs, ws, ht, wt)]
    with pytest.raises((NotImplementedError, RuntimeError), match="student_hidden is on"):
        fusedce.linear_distillation(*meta)


@requires_cuda
def test_cuda_bad_ids_and_labels_give_nan_rows():
    """On CUDA nothing waits to check the labels and top-k ids: a row with one outside [0, V)
    gets NaN (its loss and gradients), the others are unchanged."""
    hs, ws, ht, wt, labels = _on("cuda", *_args())
    ids, tlp = _on("cuda", *_topk_teacher(4, 9, 3, seed=0))
    good = fusedce.linear_distillation(hs, ws, ht, wt, labels.clamp(min=0), reduction="none")
    bad_labels = labels.clamp(min=0).clone()
    bad_labels[2] = 9
    got = fusedce.linear_distillation(hs, ws, ht, wt, bad_labels, reduction="none")
    assert torch.isnan(got[2]) and torch.equal(got[[0, 1, 3]], good[[0, 1, 3]])
    bad_ids = ids.clone()
    bad_ids[1, 0] = -1
    leaf = _leaf(hs, "cuda")
    got = fusedce.linear_distillation_topk(leaf, ws, bad_ids, tlp, reduction="none")
    assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2, 3]]).all()
    got.sum().backward()
    assert torch.isnan(leaf.grad[1]).all() and torch.isfinite(leaf.grad[[0, 2, 3]]).all()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_matches_trls_chunked_divergence(beta):
    """TRL's own ChunkedDivergenceFunction (its torch path on the CPU) gives the same per-token
    divergence and entropy and the same student gradients, with its per-head scale and softcap."""
    chunked = pytest.importorskip("trl.kernels.chunked_divergence")
    hs, ws, bs, ht, wt, bt, _ = _problem(10, 12, 67, torch.float32, seed=8, bias=True)
    scales = (0.9, 4.0, 1.2, None)  # student scale, softcap; teacher scale, softcap
    leaves, trl_leaves = [_leaf(x) for x in (hs, ws, bs)], [_leaf(x) for x in (hs, ws, bs)]
    div, ent = chunked.ChunkedDivergenceFunction.apply(trl_leaves[0], trl_leaves[1], trl_leaves[2], ht, wt, bt, beta,
                                                       1.3, *scales)
    loss, metrics = fusedce.linear_distillation(
        leaves[0], leaves[1], ht, wt, divergence="jsd", beta=beta, temperature=1.3, reduction="none",
        student_bias=leaves[2], teacher_bias=bt, student_logit_scale=0.9, student_softcap=4.0,
        teacher_logit_scale=1.2, return_metrics=True)
    torch.testing.assert_close(loss, div, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(metrics["entropy"], ent, atol=2e-5, rtol=1e-5)
    w = torch.linspace(0.5, 1.5, 10)
    (div * w).sum().backward()
    (loss * w).sum().backward()
    for got, want in zip(leaves, trl_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-4)
