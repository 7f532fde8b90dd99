"""Can every option of docs/contract.md ride the third linear design's gradient form, and how
accurately? (docs/architecture.md, "The third linear design".)

The form: the forward epilogue stores E = bf16(2^(z log2 e - k_t)) per (row, 192-wide vocabulary
tile t), k_t = ceil(tile max * log2 e), and float32 partials S_t = sum E, U_t = sum E z; a merge
over the partials gives K = max_t k_t, lse, the entropy, the target's exact logit, a per-row
float32 factor r, and rewrites the target's entry of E (E') so that it carries the one-hot term:
    grad_hidden = diag(r) bf16(P) W,  grad_weight = bf16(P r)^T hidden,  grad_bias = colsum bf16(P r)
with P = E F, F = 2^(k_t - K) per (row, tile) (exact in bf16), or a cheap per-entry transform of
E in the operand's prologue, plus per-call rank-1 terms in the epilogues.

How it answers: per option it emulates the design (the epilogue and merge in float32 as the kernels
would run them, bf16 roundings exactly where the kernels round, products in float64 standing in for
float32 accumulation) and today's path (z = bf16 of the float32 logits, the gradient by float32
autograd, dlogits rounded to bf16 once, the same products), and compares both with float64 autograd
of the same loss on the same bf16 inputs: relative error |g - r| / |r| and the signed projection
<g - r, r> / |r|^2 (tests/python/test_gradient_accuracy.py's bias measure). Outputs are compared
before their final rounding to the parameter dtype (common to both paths). Inputs: that test's
trained-looking generator (peaked rows, Zipf targets) and plain randn, 10% of rows ignored, at
N x H x V = 1024 x 64 x 5003 (last tile partial); every option again at V = 193 and V = 1.

Pass: per output and input, design rel err <= max(2 x today's, 2^-8) and |projection| <= max(2 x
today's, 2^-8 / 10) (metrics: floors 1e-5; edge shapes: projection floor 2^-9, the share one bf16
rounding common to every row's g (p_t - 1) carries in either path; an exactly-zero reference: the
absolute error); ignored rows contribute exact zeros. Must be flagged: r x 1.005, no target-entry
rewrite, smoothing without its rank-1 terms, grad_weight's target entry rounded twice (bf16(E') F r).
KNOWN_LIMITS: reported, not counted. Exit status 1 on any failure. All -inf rows are out of scope.

Both forms of E run, the tile form's per-(row, tile) offsets and the window form's offset 0 within
+-64 powers of two (FORM); the entropy metric has a third partial, centred on each tile's own
offset, that cancels in neither form.

Run (CPU only, float64, about 30 s on 2 cores): .venv/bin/python dev/scaled_options.py
"""

import math
import sys
import time
from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.nn.functional as F

F32, F64 = torch.float32, torch.float64
TILE, IGNORE = 192, -100
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
REL_FLOOR, PROJ_FLOOR = 2.0**-8, 2.0**-8 / 10  # one bf16 unit; a tenth of one (the accuracy test's)
EDGE_PROJ_FLOOR, METRIC_FLOOR = 2.0**-9, 1e-5
RANGE_BITS = 100  # E' = ... S 2^(K - k_t) must stay a finite bf16 (docs: K - k_t <= 100)


@dataclass(frozen=True)
class Case:
    name: str
    fits: str
    terms: str
    kind: str = "ce"  # ce | lp (log-probabilities) | metrics
    reduction: str = "mean"
    eps: float = 0.0  # label smoothing
    zl: float = 0.0  # z-loss
    s: float = 1.0  # logit scale (1 / temperature for lp)
    cap: float = 0.0  # soft-cap
    cap_form: str = "prologue"  # prologue: z = ln E + k ln2 per entry; stored: epilogue stores E * chain
    smooth_form: str = "rank1"  # rank1: epilogue terms; prologue: P = E F - (eps/V)(S/a) w_j per entry
    weighted: bool = False
    bias: bool = False
    entropy: bool = False  # lp: gradient through the entropy too
    metric: str = ""  # metrics: lse | entropy | entropy_offset


CASES = [  # name, fits the form?, extra terms, settings
    Case("plain mean, ignore_index", "yes", "r = g/S; target entry E' (grad_w: the merge's float32 value, select)"),
    Case("reduction sum", "yes", "g = 1 in r", reduction="sum"),
    Case("reduction none", "yes", "per-row g in r", reduction="none"),
    Case("class weights (mean)", "yes", "r = g a/S, E' with b/a (a = b = w_t)", weighted=True),
    Case("z-loss 1e-2", "yes", "a = 1 + 2 zl lse in r", zl=1e-2),
    Case("label smoothing 0.1 (+ bias)", "yes + rank-1",
         "grad_h -= (g eps/V) x colsum(W); grad_w -= (eps/V) 1 x sum g h; grad_b -= (eps/V) sum g",
         eps=0.1, bias=True),
    Case("smoothing 0.1 + weights + z-loss", "yes + rank-1", "a = (1-eps)w_t + eps W/V + 2 zl lse; rank-1 "
         "with w: colsum(diag(w) W), w x sum g h", eps=0.1, zl=1e-2, weighted=True),
    Case("smoothing + weights + z-loss, in prologue", "prologue",
         "P = E F - (eps/V)(S/a) w_j: one FMA per entry, rounded to bf16 (no cancellation at V = 1)",
         eps=0.1, zl=1e-2, weighted=True, smooth_form="prologue"),
    Case("logit scale 0.6", "yes", "s into r", s=0.6),
    Case("bias", "yes", "grad_bias = column sums of grad_w's bf16 operand", bias=True),
    Case("soft-cap 10 (prologue ln E)", "prologue",
         "per entry: z = ln(bf16 E) + k ln2 (MUFU lg2), P = E F (1-(z/c)^2) rounded to bf16; "
         "target pre-transformed by the merge, index select", cap=10.0),
    Case("soft-cap 10 (epilogue stores E*chain)", "yes", "forward stores bf16(E (1-(z/c)^2)) instead of E "
         "(S, U from E); pure form", cap=10.0, cap_form="stored"),
    Case("soft-cap 10 + smoothing 0.1 + weights", "prologue",
         "uniform term times chain is not rank-1: P = chain (E F - (eps/V) (S/a) w_j), w_j per column",
         cap=10.0, eps=0.1, weighted=True),
    Case("logprobs T=0.7", "yes", "r = -g_lp/(S T); E' = E_t - S 2^(K-k_t)", kind="lp", s=1 / 0.7),
    Case("logprobs T=0.7 + entropy", "prologue",
         "per entry: P = E F (a0 + b ln(E F)) (MUFU lg2), rounded to bf16; r = 1/(S T); "
         "target pre-transformed, index select", kind="lp", s=1 / 0.7, entropy=True),
    Case("metrics: lse", "yes", "lse = ln2 (K + log2 sum S_t F_t)", kind="metrics", metric="lse"),
    Case("metrics: entropy, U_t = sum E z", "yes", "H = lse - sum U_t F_t / S", kind="metrics", metric="entropy"),
    Case("metrics: entropy, U_t = sum E (z - k_t ln2)", "yes",
         "H = ln S - sum F_t (U_t + (k_t-K) ln2 S_t) / S (no lse - U/S cancellation at the tile form's offsets)",
         kind="metrics", metric="entropy_offset"),
    Case("metrics: entropy, Uc_t = sum E (z - m_t ln2)", "yes",
         "centred on the tile's own offset m_t whatever E's: H = sum w_t (ln(S 2^(K-M)) + ln2 (M - m_t)) - "
         "sum F_t Uc_t / S, terms >= -ln 2", kind="metrics", metric="entropy_centred"),
]


# h (N, H), W (V, H), b (V,): float64 holding bf16 values; t (N,): targets, IGNORE where ignored;
# cw (V,): class weights; gup, glp, gH (N,): upstream of the per-row loss (none), logprob, entropy.
Inputs = namedtuple("Inputs", "h W b t cw gup glp gH")


def bf16(x):
    """Round-to-nearest-even to bf16 from float32 (as the kernels round), kept as float32."""
    return x.to(F32).to(torch.bfloat16).to(F32)


def trained_looking(n, hd, v, g):
    """tests/python/test_gradient_accuracy.py's generator: 80% of rows confident (target logit
    ~8-12 above the rest), 20% unsure; targets Zipf-distributed."""
    w = torch.randn(v, hd, generator=g) / hd**0.5
    target = torch.multinomial(1.0 / torch.arange(1, v + 1, dtype=F64), n, replacement=True, generator=g)
    direction = w[target] / w[target].norm(dim=1, keepdim=True)
    hidden = direction * (8.0 + 4.0 * torch.rand(n, 1, generator=g)) + 0.5 * torch.randn(n, hd, generator=g)
    unsure = torch.rand(n, generator=g) < 0.2
    hidden[unsure] = 1.5 * torch.randn(int(unsure.sum()), hd, generator=g)
    return hidden, w, target


def make_inputs(kind, n, hd, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "trained":
        h, w, t = trained_looking(n, hd, v, g)
    else:  # randn; randn_mean: the head's rows share a mean direction, as trained heads' do
        h, w, t = torch.randn(n, hd, generator=g), torch.randn(v, hd, generator=g) / hd**0.5, \
            torch.randint(0, v, (n,), generator=g)
        w += 0.5 * torch.randn(hd, generator=g) / hd**0.5 if kind == "randn_mean" else 0
    t[torch.rand(n, generator=g) < 0.1] = IGNORE
    return Inputs(h=bf16(h).double(), W=bf16(w).double(), b=bf16(torch.randn(v, generator=g)).double(), t=t,
                  cw=(0.25 + 1.5 * torch.rand(v, generator=g)).double(), gup=torch.randn(n, generator=g).double(),
                  glp=torch.randn(n, generator=g).double() / n, gH=torch.randn(n, generator=g).double() / n)


# The loss as the contract defines it (float64: the reference; float32 on bf16 logits: today)

def transform(x, c):
    """Logits x -> z: the scale (1 / temperature for lp), then the soft-cap."""
    z = x * c.s
    return c.cap * torch.tanh(z / c.cap) if c.cap else z


def objective(x, inp, c):
    """The scalar whose gradient both paths form: the reduced loss (upstream g folded in), or
    sum g_lp logprob + g_H entropy over non-ignored rows."""
    z, valid, dt = transform(x, c), inp.t != IGNORE, x.dtype
    tt = inp.t.clamp(min=0)
    lse = torch.logsumexp(z, 1)
    if c.kind == "lp":
        lp = z.gather(1, tt[:, None])[:, 0] - lse
        rows = inp.glp.to(dt) * lp
        if c.entropy:
            rows = rows + inp.gH.to(dt) * (lse - (torch.softmax(z, 1) * z).sum(1))
        return torch.where(valid, rows, 0).sum()
    cw = inp.cw.to(dt) if c.weighted else None
    rows = F.cross_entropy(z, inp.t, cw, ignore_index=IGNORE, label_smoothing=c.eps, reduction="none")
    if c.zl:
        rows = rows + torch.where(valid, c.zl * lse**2, 0)
    if c.reduction == "mean":
        return rows.sum() / (cw[tt][valid].sum() if c.weighted else valid.sum())
    return rows.sum() if c.reduction == "sum" else (rows * inp.gup.to(dt)).sum()


def logits64(inp, c):
    return inp.h @ inp.W.T + (inp.b if c.bias else 0)


def reference(inp, c):
    """float64 autograd on the float64 inputs: grad hidden, grad weight (, grad bias)."""
    h, W, b = (x.clone().requires_grad_(True) for x in (inp.h, inp.W, inp.b))
    objective(h @ W.T + (b if c.bias else 0), inp, c).backward()
    return [h.grad, W.grad] + ([b.grad] if c.bias else [])


def today(inp, c):
    """Today's path: bf16 logits (float32 product rounded), float32 gradient, bf16 dlogits, then
    grad hidden, grad weight (, grad bias) accumulated in float64."""
    x = bf16(logits64(inp, c).float()).requires_grad_(True)
    objective(x, inp, c).backward()
    dx = bf16(x.grad).double()
    return [dx @ inp.W, dx.T @ inp.h] + ([dx.sum(0)] if c.bias else [])


# The design: forward epilogue, merge, operand, products

def tiles(x, fill):
    """(N, V) -> (N, T, TILE); the last tile padded with `fill` (its padding holds no column)."""
    n, v = x.shape
    pad = -v % TILE
    return F.pad(x, (0, pad), value=fill).view(n, (v + pad) // TILE, TILE)


def chain(z, cap):
    """The soft-cap's chain factor d(c tanh(y / c)) / dy = 1 - (z / c)^2 (float32)."""
    return 1 - (z / cap) ** 2


# The form of E: "tile", every (row, tile) at its own offset k_t = ceil(max z log2 e) (E <= 1);
# "window", the offset 0 wherever that own offset lies within +-WINDOW_BITS (E = e^z <= 2^64) and
# its own elsewhere (docs/architecture.md, "The window form": the rows with another offset are
# rebased to one, E F, which is the same exact power-of-two multiply the tile form's operand does,
# so the emulated products are the same expressions). main() runs every check in both forms.
FORM = {"window": False}
WINDOW_BITS = 64


def epilogue(z):
    """The forward GEMM's epilogue from float32 logits z (N, V): per (row, tile) the offset k
    (FORM), E (float32, unrounded, 0 in the padding; ex2.approx.ftz flushes below 2^-126), S_t,
    U_t = sum E z, Uo_t = sum E (z - k_t ln2) = ln2 sum E y; and m_t, the tile's own offset, with
    Uc_t = ln2 sum E (z log2 e - m_t) <= 0, the entropy partial centred on it (merge's H_c)."""
    zt = tiles(z, -math.inf)
    pad = torch.isinf(zt)
    m = torch.ceil(zt.amax(-1) * LOG2E)  # E <= 1 at this offset: nothing overflows
    k = torch.where(m.abs() <= WINDOW_BITS, 0.0, m) if FORM["window"] else m
    y = zt * LOG2E - k[..., None]  # the exp2 argument, already in registers
    e = torch.exp2(y)
    e = torch.where(e < 2.0**-126, 0.0, e)
    yc = (zt * LOG2E - m[..., None]).masked_fill(pad, 0)
    return {"k": k, "m": m, "e": e, "S": e.sum(-1), "U": (e * zt.masked_fill(pad, 0)).sum(-1),
            "Uo": LN2 * (e * y.masked_fill(pad, 0)).sum(-1), "Uc": LN2 * (e * yc).sum(-1), "z": zt}


def merge(ep):
    """Over the (N, T) partials only, in float32: K, f = 2^(k_t - K), S, lse, three entropies.
    H_c sums terms that are all >= about -ln 2 (no cancellation whatever the offsets): with M the
    row's largest own offset, lse - z = ln(S 2^(K - M)) + ln2 (M - m_t) - ln2 (z log2 e - m_t), so
    H = sum_t w_t (ln(S 2^(K - M)) + ln2 (M - m_t)) - sum_t f_t Uc_t / S, w_t = f_t S_t / S."""
    K = ep["k"].amax(1)
    f = torch.exp2(ep["k"] - K[:, None])  # exact: integer powers of two
    S = (ep["S"] * f).sum(1)
    lse = LN2 * (K + torch.log2(S))
    ent = lse - (ep["U"] * f).sum(1) / S
    ent_off = torch.log(S) - ((ep["Uo"] + (ep["k"] - K[:, None]) * LN2 * ep["S"]) * f).sum(1) / S
    M = ep["m"].amax(1)
    w = ep["S"] * f / S[:, None]
    a = torch.log(torch.ldexp(S, (K - M).to(torch.int32)))  # S 2^(K - M) within [2^-1, V]: exact scaling
    ent_c = (w * (a[:, None] + LN2 * (M[:, None] - ep["m"]))).sum(1) - (ep["Uc"] * f).sum(1) / S
    return {"K": K, "f": f, "S": S, "lse": lse, "H": ent, "H_off": ent_off, "H_c": ent_c}


def row_factors(inp, c, mg, valid, w_t):
    """Per row: g (upstream incl. the reduction), a and b of dlogits / g = a p - b onehot (- the
    uniform term), all float32. lp: g = 1, a = b = -g_lp (dz = g_lp (onehot - p))."""
    v = inp.W.shape[0]
    if c.kind == "lp":
        a = -inp.glp.float() * valid
        return valid.float(), a, a
    if c.reduction == "mean":
        g = valid / (w_t[valid].sum() if c.weighted else valid.sum())
    else:
        g = valid * (inp.gup.float() if c.reduction == "none" else 1.0)
    wsum = inp.cw.float().sum() if c.weighted else float(v)
    b = (1 - c.eps) * w_t
    return g.float(), b + c.eps / v * wsum + 2 * c.zl * mg["lse"], b


def forward_merge(inp, c):
    """The forward epilogue and the merge, as the kernels would run them in float32, plus what the
    merge adds per row: the target's exact logit zt (a float32 dot product), its tile's k_t, its
    unrounded E (et) and d = 2^(K - k_t)."""
    valid, tt = inp.t != IGNORE, inp.t.clamp(min=0)
    ep = epilogue(transform(logits64(inp, c).float(), c))  # the product's float32 accumulators
    mg = merge(ep)
    kt = ep["k"].gather(1, (tt // TILE)[:, None])[:, 0]
    zt = transform((inp.h * inp.W[tt]).sum(1).float() + (inp.b[tt].float() if c.bias else 0), c)
    assert ((mg["K"] - kt)[valid] <= RANGE_BITS).all(), "target tile too far below the row's max for E'"
    return ep, dict(mg, valid=valid, tt=tt, kt=kt, zt=zt, et=torch.exp2(zt * LOG2E - kt),
                    d=torch.exp2(mg["K"] - kt), Fb=bf16(mg["f"]))  # Fb: bf16 powers of two, exact


def uniform_in_prologue(c):
    """Label smoothing's uniform term goes into the operand (not rank-1) where a per-entry factor
    multiplies it (the soft-cap's chain), or where asked (smooth_form)."""
    return c.eps > 0 and ((c.cap > 0 and c.cap_form == "prologue") or c.smooth_form == "prologue")


def operand(inp, c, ep, m, a, b, w):
    """P (N, T, TILE): the gradient products' A operand in float32 before its rounding, and xt: the
    target entry's float32 value divided by F_t (the merge's E', pre-transformed: the prologue
    passes it through). Per row, dlogits = r * P (r in the epilogue) with r = g a s / S."""
    E, Fb, S, K, d, et = bf16(ep["e"]), m["Fb"][..., None], m["S"], m["K"], m["d"], m["et"]
    ratio = torch.where(a != 0, b / torch.where(a != 0, a, 1), 0)  # a = 0 (and so b = 0): no gradient
    uni = c.eps / inp.W.shape[0] * S / torch.where(a != 0, a, 1) if uniform_in_prologue(c) else 0 * S
    wcol = tiles(w[None, :], 0)  # (1, T, TILE): per-column class weights, loaded by the prologue
    base = E * Fb - uni[:, None, None] * wcol
    xt = et - ratio * S * d - uni * w[m["tt"]] * d
    if c.kind == "lp" and c.entropy:  # dz = p (-(g_lp + g_H (H + log p))) + g_lp onehot; r = 1 / (S T)
        a0, b0 = -(inp.glp.float() + inp.gH.float() * (m["H"] - torch.log(S))), -inp.gH.float()
        ln_ef = LN2 * (torch.log2(E) + (ep["k"] - K[:, None])[..., None])  # ln(E F): MUFU lg2 per entry
        P = torch.where(E > 0, E * Fb * (a0[:, None, None] + b0[:, None, None] * ln_ef), 0)
        return P, et * (a0 + b0 * (m["zt"] - K * LN2)) + inp.glp.float() * S * d
    if c.cap and c.cap_form == "prologue":  # z = ln E + k ln2 from the bf16 E: MUFU lg2 per entry
        zp = LN2 * (torch.log2(E) + ep["k"][..., None])
        return torch.where(E > 0, chain(zp, c.cap), 0) * base, xt * chain(m["zt"], c.cap)
    if c.cap:  # the forward epilogue stores bf16(E * chain) instead of E; S and U sum the unrounded E
        assert not c.eps, "the uniform term times the chain is not rank-1: needs the prologue form"
        return bf16(ep["e"] * torch.where(ep["e"] > 0, chain(ep["z"], c.cap), 0)) * Fb, xt * chain(m["zt"], c.cap)
    return base, xt


def rank1_terms(inp, c, g, w, grads):
    """Label smoothing's uniform term -(eps/V) w_j g s, added in float32 in the epilogues:
    grad_h -= (g eps s/V) x colsum(diag(w) W); grad_w -= (eps s/V) w x sum_n g_n h_n; grad_b
    -= (eps s/V) w sum g (the two H-vectors formed once per call)."""
    u, coef = (g * c.eps / inp.W.shape[0] * c.s).double(), (c.eps / inp.W.shape[0] * c.s * w).double()
    grads[0] -= u[:, None] * (w.double() @ inp.W).float().double()[None, :]
    grads[1] -= coef[:, None] * (g.double() @ inp.h).float().double()[None, :]
    if c.bias:
        grads[2] -= coef * g.double().sum()


def design(inp, c, plant=1.0, rewrite=True, rank1=True, select_gw=True):
    """The design's gradients, and whether ignored rows contributed exact zeros. select_gw: grad_w's
    target entry is the merge's float32 value rounded once (index select), not bf16(E') F r."""
    v = inp.W.shape[0]
    ep, m = forward_merge(inp, c)
    valid, tt = m["valid"], m["tt"]
    w = inp.cw.float() if c.weighted else torch.ones(v)
    g, a, b = row_factors(inp, c, m, valid, w[tt])
    r = (valid / m["S"] * c.s if c.kind == "lp" and c.entropy else g * a * c.s / m["S"]) * plant
    P, xt = operand(inp, c, ep, m, a, b, w)
    P, Ft = P.reshape(P.shape[0], -1)[:, :v], m["Fb"].gather(1, (tt // TILE)[:, None])[:, 0]
    sel = torch.zeros_like(P, dtype=torch.bool)
    sel[valid, tt[valid]] = rewrite
    Pw = torch.where(sel, (xt * Ft)[:, None], P) if select_gw else None
    P = torch.where(sel, (bf16(xt) * Ft)[:, None], P)  # the target's entry: bf16(E') F_t
    Ah, Aw = bf16(P), bf16((P if Pw is None else Pw) * r[:, None])  # Ah exact unless a prologue transformed
    grads = [r.double()[:, None] * (Ah.double() @ inp.W), Aw.double().T @ inp.h]
    grads += [Aw.double().sum(0)] if c.bias else []
    if c.eps and not uniform_in_prologue(c) and rank1:
        rank1_terms(inp, c, g, w, grads)
    return grads, bool((grads[0][~valid] == 0).all() and (Aw[~valid] == 0).all())


def metrics(inp, c):
    """lse or entropy over non-ignored rows: float64, today's (bf16 logits, float32), design."""
    valid = inp.t != IGNORE
    x64 = logits64(inp, c)
    out = []
    for z in (x64, bf16(x64.float())):
        lse = torch.logsumexp(z, 1)
        out.append(lse if c.metric == "lse" else lse - (torch.softmax(z, 1) * z).sum(1))
    mg = merge(epilogue(x64.float()))
    ours = {"lse": mg["lse"], "entropy": mg["H"], "entropy_offset": mg["H_off"], "entropy_centred": mg["H_c"]}[c.metric]
    return [ours.double()[valid]], [out[1].double()[valid]], [out[0][valid]]


# Judging and the table

def stats(g, r):
    """Relative error and signed projection; an exactly-zero reference: the absolute error."""
    g, r = g.double().flatten(), r.double().flatten()
    rn2 = r @ r
    if rn2 == 0:
        return {"rel": (g - r).norm().item(), "proj": 0.0}
    return {"rel": ((g - r).norm() / rn2.sqrt()).item(), "proj": ((g - r) @ r / rn2).item()}


def within(ours, theirs, rel_floor, proj_floor):
    return (ours["rel"] <= max(2 * theirs["rel"], rel_floor)
            and abs(ours["proj"]) <= max(2 * abs(theirs["proj"]), proj_floor))


def grad_names(c):
    if c.kind == "metrics":
        return ["entropy" if c.metric.startswith("entropy") else "lse"]
    return ["grad_h", "grad_w"] + (["grad_b"] if c.bias else [])


def evaluate(inp, c, proj_floor=PROJ_FLOOR, **plant):
    """Per output: (design stats, today stats, within bounds); and whether ignored rows gave zeros."""
    floors = (METRIC_FLOOR, METRIC_FLOOR) if c.kind == "metrics" else (REL_FLOOR, proj_floor)
    if c.kind == "metrics":
        (ours, theirs, ref), zero_ok = metrics(inp, c), True
    else:
        (ours, zero_ok), ref, theirs = design(inp, c, **plant), reference(inp, c), today(inp, c)
    res = []
    for o, t, r in zip(ours, theirs, ref):
        so, st = stats(o, r), stats(t, r)
        res.append((so, st, within(so, st, *floors) and bool(torch.isfinite(o).all())))
    return res, zero_ok


def print_table(rows):
    head = ["option", "grad", "fits the form?", "extra terms", "rel err design / today: trained ; randn",
            "projection design / today: trained ; randn", "ok"]
    width = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, width)) + " |"  # noqa: E731
    print("\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in width) + "|"] + [line(r) for r in rows]))


def table(sets):
    """One row per option and output; the failures."""
    rows, failures = [], []
    for c in CASES:
        res = {k: evaluate(inp, c) for k, inp in sets.items()}
        for i, name in enumerate(grad_names(c)):
            (dt, tt, okt), (dr, tr, okr) = res["trained"][0][i], res["randn"][0][i]
            ok = okt and okr and res["trained"][1] and res["randn"][1]
            rows.append([c.name if i == 0 else "", name, c.fits if i == 0 else "", c.terms if i == 0 else "",
                         f"{dt['rel']:.1e} / {tt['rel']:.1e} ; {dr['rel']:.1e} / {tr['rel']:.1e}",
                         f"{dt['proj']:+.1e} / {tt['proj']:+.1e} ; {dr['proj']:+.1e} / {tr['proj']:+.1e}",
                         "ok" if ok else "FAIL"])
            failures += [] if ok else [f"{c.name} {name}"]
    print_table(rows)
    return failures


def entropy_worst_rows(inp):
    """The largest per-row relative entropy error (peaked rows: H ~ 1e-3 beside lse ~ 12)."""
    valid, x = inp.t != IGNORE, logits64(inp, CASES[0])
    ent = lambda z: (torch.logsumexp(z, 1) - (torch.softmax(z, 1) * z).sum(1))[valid].double()  # noqa: E731
    mg, ref = merge(epilogue(x.float())), ent(x)
    worst = lambda e: f"{((e.double() - ref).abs() / ref.abs()).max().item():.1e}"  # noqa: E731
    print(f"entropy, worst row's relative error (trained inputs): U_t = sum E z {worst(mg['H'][valid])}, "
          f"U_t = sum E (z - k_t ln2) {worst(mg['H_off'][valid])}, Uc_t centred {worst(mg['H_c'][valid])}, "
          f"today {worst(ent(bf16(x.float())))}")


KNOWN_LIMITS = {  # (V, option): why the design may exceed today's error there (reported, not counted)
    (1, "smoothing 0.1 + weights + z-loss"): "rank-1 split: a p - b - eps w/V cancels to 2 zl lse at V = 1; "
                                             "the operand's bf16 rounding is relative to a p, not to the result",
}


def edge_shapes():
    """Every option at V = 193 (a partial last tile of one column) and V = 1, randn."""
    failures, known = [], []
    for v in (193, 1):
        inp = make_inputs("randn", 512, 32, v, seed=3)
        for c in CASES:
            res, zero_ok = evaluate(inp, c, proj_floor=EDGE_PROJ_FLOOR)
            note = f"V={v}, {c.name}: " + ", ".join(f"rel {o['rel']:.1e} / {t['rel']:.1e} proj {o['proj']:+.1e} / "
                                                    f"{t['proj']:+.1e}" for o, t, _ in res)
            if (v, c.name) in KNOWN_LIMITS:
                known.append(f"{note}\n    ({'exceeds' if not all(ok for *_, ok in res) else 'within'}; "
                             f"{KNOWN_LIMITS[v, c.name]})")
            elif not (zero_ok and all(ok for _, _, ok in res)):
                failures.append(note)
    print(f"edge shapes: every option at 512 x 32 x 193 and 512 x 32 x 1 (randn), {len(failures)} failing")
    print("".join(f"  known limit, not counted: {k}\n" for k in known), end="")
    return failures


def must_flag(sets):
    """Errors the judge must catch: planted ones, and grad_w's target entry rounded twice (bf16(E')
    F r: the product of two roundings sits on a power of two where g (1 - p_t) does, as for sum or
    a mean over 2^n tokens, and shrinks it by ~2^-10 on average)."""
    plain, smooth, total = (next(c for c in CASES if c.name.startswith(n)) for n in ("plain", "label", "reduction sum"))
    checks = [("r x 1.005", "trained", plain, {"plant": 1.005}),
              ("no target-entry rewrite", "trained", plain, {"rewrite": False}),
              ("smoothing without its rank-1 terms", "randn_mean", smooth, {"rank1": False}),
              ("grad_w target entry rounded twice", "randn", total, {"select_gw": False})]
    failures = []
    sets = dict(sets, randn_mean=make_inputs("randn_mean", *SHAPE))
    base, _ = evaluate(sets["randn_mean"], smooth)  # the unplanted smoothing passes on these inputs
    failures += [] if all(ok for _, _, ok in base) else ["label smoothing on randn_mean inputs"]
    print("must be flagged:")
    for label, kind, c, kw in checks:
        res, _ = evaluate(sets[kind], c, **kw)
        flagged = [n for n, (_, _, ok) in zip(grad_names(c), res) if not ok]
        desc = ", ".join(f"{n} rel {o['rel']:.1e} / {t['rel']:.1e} proj {o['proj']:+.1e} / {t['proj']:+.1e}"
                         for n, (o, t, _) in zip(grad_names(c), res))
        verdict = f"flagged ({', '.join(flagged)})" if flagged else "NOT FLAGGED"
        print(f"  {label} ({c.name}, {kind}): {desc}: {verdict}")
        failures += [] if flagged else [f"'{label}' not flagged"]
    return failures


SHAPE = (1024, 64, 5003)  # N x H x V: V = 26 tiles of 192 and one of 11 columns


def main():
    start = time.time()
    sets = {k: make_inputs(k, *SHAPE) for k in ("trained", "randn")}
    failures = []
    for window in (False, True):
        FORM["window"] = window
        form = f"window form (offset 0 within +-{WINDOW_BITS} powers of two)" if window else "tile form"
        print(f"{'' if not window else chr(10)}== {form}: N x H x V = {SHAPE}; design / today against float64; "
              f"trained-looking ; randn inputs\n")
        found = table(sets)
        print()
        entropy_worst_rows(sets["trained"])
        found += edge_shapes()
        found += must_flag(sets)
        failures += [f"{form}: {f}" for f in found]
    print(f"\nbounds: design rel <= max(2 x today, {REL_FLOOR:.1e}), |proj| <= max(2 x today, {PROJ_FLOOR:.1e}); "
          f"ignored rows exact zeros. {time.time() - start:.1f} s")
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
