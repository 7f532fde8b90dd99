"""Survey of bad and awkward inputs through the public Python API (issue 29's closing note).

Tries each input on fusedce.cross_entropy, fusedce.linear_cross_entropy and the
vocabulary-parallel forms (in-process, a 1-rank gloo group) and prints a markdown table, one row
per input, with what happened: the exception type and the start of its message, or the value
returned and whether it equals the float64 reference (PyTorch's F.cross_entropy on float64
copies of the same inputs, with fusedce's own options applied by the contract's formulas).

A row is flagged (last column "BUG?") when the result is neither an error whose message names
one of the arguments the input is about, nor a value equal to the reference; and noted ("stricter
than reference") where fusedce raises on an input the float64 reference computes (PyTorch
itself, or the formula it would follow).

Each case runs in a worker process; a crash or a hang (60 s) of one case is recorded as such
and the survey goes on with a fresh worker from the next case.

Run (CPU, a build tree of the extension):
    PYTHONPATH=$(python tests/python/build_tree.py <build dir>) python dev/bad_inputs.py > bad_inputs.md
"""

import json
import os
import selectors
import subprocess
import sys
import tempfile

HANG_SECONDS = 60
MESSAGE_CHARS = 120


# ---------------------------------------------------------------------------------------------
# The cases (built in the worker only: they need torch and fusedce)
# ---------------------------------------------------------------------------------------------

def build_cases():
    import torch
    import torch.nn.functional as F

    import fusedce

    ce = fusedce.cross_entropy
    lce = fusedce.linear_cross_entropy
    g = torch.Generator().manual_seed(29)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    def randint(high, shape):
        return torch.randint(0, high, shape, generator=g)

    def ref_ce(x, t, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
               logit_scale=1.0, softcap=None, z_loss=0.0):
        """float64 reference of the contract's loss for classes-last or PyTorch-layout logits."""
        z = x.double() * logit_scale
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        t = t.double() if t.is_floating_point() else t
        w = None if weight is None else weight.double()
        loss = F.cross_entropy(z, t, w, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        if z_loss:
            lse = torch.logsumexp(z, dim=-1)
            keep = t != ignore_index
            terms = torch.where(keep, z_loss * lse ** 2, 0.0)
            denom = w[t[keep]].sum() if w is not None else keep.sum()
            loss = loss + (terms if reduction == "none" else terms.sum()
                           if reduction == "sum" else terms.sum() / denom)
        return loss

    def ref_lce(h, w, t, bias=None, **kw):
        logits = h.double() @ w.double().T
        if bias is not None:
            logits = logits + bias.double()
        return ref_ce(logits.reshape(-1, w.shape[0]), t.reshape(-1), **kw)

    def grad_of(fn, x):
        """(loss, x.grad) of fn applied to a fresh leaf copy of x."""
        leaf = x.detach().clone().requires_grad_(True)
        loss = fn(leaf)
        loss.backward()
        return loss.detach(), leaf.grad

    cases = []

    def case(call, what, fn, ref=None, names=()):
        cases.append(dict(call=call, input=what, fn=fn, ref=ref, names=tuple(names)))

    x = randn(8, 11)
    t = randint(11, (8,))
    CE = "cross_entropy"

    # --- baselines --------------------------------------------------------------------------
    case(CE, "baseline (8, 11) float32, int64 targets", lambda: ce(x, t), lambda: ref_ce(x, t))
    case(CE, "baseline with grad (label_smoothing=0.1, z_loss=1e-3)",
         lambda: grad_of(lambda a: ce(a, t, label_smoothing=0.1, z_loss=1e-3), x),
         lambda: grad_of(lambda a: ref_ce(a, t, label_smoothing=0.1, z_loss=1e-3), x.double()))

    # --- issue 29's rows --------------------------------------------------------------------
    case(CE, "softcap=1e-50", lambda: ce(x, t, softcap=1e-50), names=["softcap"])
    case(CE, "ignore_index=3.7", lambda: ce(x, t, ignore_index=3.7), names=["ignore_index"])
    xe = x[:1].expand(8, 11)
    case(CE, "stride-0 logits x[:1].expand(8, 11)", lambda: ce(xe, t), lambda: ref_ce(xe, t))
    case(CE, "stride-0 logits, grad", lambda: grad_of(lambda a: ce(a.expand(8, 11), t), x[:1]),
         lambda: grad_of(lambda a: ref_ce(a.expand(8, 11), t), x[:1].double()))
    buf = randn(8 * 5 + 6)
    xo = buf.as_strided((8, 11), (5, 1))
    case(CE, "overlapping rows as_strided((8, 11), (5, 1))", lambda: ce(xo, t),
         lambda: ref_ce(xo, t))
    tb = t.clone()
    tb[3] = 11
    case(CE, "target[3] = 11 = V (out of range), check_targets off", lambda: ce(x, tb),
         lambda: ref_ce(x, tb), names=["target"])
    case(CE, "target[3] = 11 = V, check_targets=True", lambda: ce(x, tb, check_targets=True),
         lambda: ref_ce(x, tb), names=["target"])
    tn = t.clone()
    tn[5] = -1
    case(CE, "target[5] = -1 (negative, not ignore_index)", lambda: ce(x, tn),
         lambda: ref_ce(x, tn), names=["target"])
    tig = t.clone()
    tig[2] = 11
    case(CE, "target[2] = 11 with ignore_index=11", lambda: ce(x, tig, ignore_index=11),
         lambda: ref_ce(x, tig, ignore_index=11))
    case(CE, "inplace_backward=True on a leaf requiring grad",
         lambda: ce(x.clone().requires_grad_(True), t, inplace_backward=True),
         names=["inplace_backward", "leaf"])

    def inplace_nonleaf_backward():
        leaf = x.clone().requires_grad_(True)
        y = leaf * 1.0
        loss = ce(y, t, inplace_backward=True)
        loss.backward()
        return loss.detach(), leaf.grad

    case(CE, "inplace_backward=True on non-leaf y = leaf * 1; loss.backward()",
         inplace_nonleaf_backward,
         lambda: grad_of(lambda a: ref_ce(a, t), x.double()))

    def inplace_then_read():
        leaf = x.clone().requires_grad_(True)
        y = leaf * 1.0
        loss = ce(y, t, inplace_backward=True)
        (loss + y.sum()).backward()  # y now holds the gradient: autograd must refuse this
        return loss

    case(CE, "inplace_backward on non-leaf y, then (loss + y.sum()).backward()",
         inplace_then_read, names=["inplace_backward", "modified by an inplace"])

    def inplace_then_read_values():
        leaf = x.clone().requires_grad_(True)
        y = leaf * 1.0
        ce(y, t, inplace_backward=True)
        xd = x.double().requires_grad_(True)
        (gd,) = torch.autograd.grad(ref_ce(xd, t), [xd])
        same = torch.allclose(y.detach().double(), gd, rtol=1e-5, atol=1e-7)
        return Note(f"y now holds d loss / d y (equals float64 gradient: {same}); "
                    f"y._version = {y._version}", same)

    case(CE, "inplace_backward on non-leaf y, read y.detach() afterwards",
         inplace_then_read_values)
    case(CE, "inplace_backward=True, logits not requiring grad",
         lambda: (lambda y: (ce(y, t, inplace_backward=True), y)[0])(x.clone()),
         lambda: ref_ce(x, t))

    x3 = randn(2, 11, 5)
    t3 = randint(11, (2, 5))
    case(CE, "(N, C, d) = (2, 11, 5) logits, (2, 5) target", lambda: ce(x3, t3),
         lambda: ref_ce(x3, t3))
    x4 = randn(2, 7, 3, 4)
    t4 = randint(7, (2, 3, 4))
    case(CE, "(N, C, d1, d2) = (2, 7, 3, 4), reduction='none', grad",
         lambda: grad_of(lambda a: ce(a, t4, reduction="none").sum(), x4),
         lambda: grad_of(lambda a: ref_ce(a, t4, reduction="none").sum(), x4.double()))
    xa = randn(2, 3, 3)
    case(CE, "ambiguous (2, 3, 3) logits, (2, 3) target (fits both layouts)",
         lambda: ce(xa, randint(3, (2, 3))), lambda: ref_ce(xa, randint(3, (2, 3))),
         names=["layout", "target"])
    p = torch.softmax(randn(8, 11), -1)
    case(CE, "class-probability targets (8, 11)", lambda: ce(x, p), lambda: ref_ce(x, p))
    case(CE, "class-probability targets, label_smoothing=0.2, grad",
         lambda: grad_of(lambda a: ce(a, p, label_smoothing=0.2), x),
         lambda: grad_of(lambda a: ref_ce(a, p, label_smoothing=0.2), x.double()))
    case(CE, "class-probability targets, strict=True", lambda: ce(x, p, strict=True),
         names=["strict", "probabilit"])
    case(CE, "int64 target .requires_grad_() (PyTorch refuses to build it)",
         lambda: ce(x, t.clone().requires_grad_(True)), names=["floating point"])
    case(CE, "class-probability targets requiring grad (grad to target)",
         lambda: grad_of(lambda q: ce(x, q), p),
         lambda: grad_of(lambda q: ref_ce(x, q), p.double()))
    case(CE, "class-probability targets, return_metrics=True", lambda: ce(x, p, return_metrics=True),
         names=["return_metrics"])
    xd = x.double()
    case(CE, "float64 logits", lambda: ce(xd, t), lambda: ref_ce(xd, t))
    case(CE, "float64 logits, z_loss=1e-2, softcap=5, grad",
         lambda: grad_of(lambda a: ce(a, t, z_loss=1e-2, softcap=5.0), xd),
         lambda: grad_of(lambda a: ref_ce(a, t, z_loss=1e-2, softcap=5.0), xd))
    case(CE, "float64 logits, strict=True", lambda: ce(xd, t, strict=True),
         names=["strict", "float64"])

    # --- dtypes -----------------------------------------------------------------------------
    xb = randn(8, 11, dtype=torch.bfloat16)
    case(CE, "bfloat16 logits (reference: float64 of the rounded values)", lambda: ce(xb, t),
         lambda: ref_ce(xb, t))
    xh = randn(8, 11, dtype=torch.float16)
    case(CE, "float16 logits", lambda: ce(xh, t), lambda: ref_ce(xh, t))
    xi = torch.randint(-3, 3, (8, 11), generator=g)
    case(CE, "int64 logits", lambda: ce(xi, t), names=["logits"])
    case(CE, "bool logits", lambda: ce(xi > 0, t), names=["logits"])
    case(CE, "int32 targets", lambda: ce(x, t.int()), lambda: ref_ce(x, t))
    case(CE, "int16 targets", lambda: ce(x, t.short()), lambda: ref_ce(x, t.short()),
         names=["target"])
    case(CE, "uint8 targets", lambda: ce(x, t.to(torch.uint8)),
         lambda: ref_ce(x, t.to(torch.uint8)), names=["target"])
    case(CE, "bool targets", lambda: ce(x, t > 5), lambda: ref_ce(x, t > 5), names=["target"])
    case(CE, "float targets of shape (8,) (class indices as floats)", lambda: ce(x, t.float()),
         lambda: ref_ce(x, t.float()), names=["target"])
    case(CE, "complex logits", lambda: ce(x.to(torch.complex64), t), names=["logits"])
    wgt = torch.rand(11, generator=g) + 0.5
    case(CE, "weight (11,) float32", lambda: ce(x, t, wgt), lambda: ref_ce(x, t, wgt))
    case(CE, "weight float64 with float32 logits", lambda: ce(x, t, wgt.double()),
         lambda: ref_ce(x, t, wgt))
    case(CE, "weight int64", lambda: ce(x, t, torch.ones(11, dtype=torch.long)),
         lambda: ref_ce(x, t, torch.ones(11)), names=["weight"])
    case(CE, "weight bfloat16 with float32 logits", lambda: ce(x, t, wgt.bfloat16()),
         lambda: ref_ce(x, t, wgt.bfloat16()))
    case(CE, "weight with a negative entry", lambda: ce(x, t, wgt - 1.0),
         lambda: ref_ce(x, t, wgt - 1.0))
    case(CE, "weight stride-0 (expanded scalar)", lambda: ce(x, t, wgt[:1].expand(11)),
         lambda: ref_ce(x, t, wgt[:1].expand(11)))

    # --- shapes -----------------------------------------------------------------------------
    case(CE, "target (7,) against logits (8, 11)", lambda: ce(x, t[:7]),
         lambda: ref_ce(x, t[:7]), names=["target"])
    case(CE, "target (8, 1) against logits (8, 11)", lambda: ce(x, t[:, None]),
         lambda: ref_ce(x, t[:, None]), names=["target"])
    case(CE, "weight (10,) against V = 11", lambda: ce(x, t, wgt[:10]),
         lambda: ref_ce(x, t, wgt[:10]), names=["weight"])
    case(CE, "weight (1, 11)", lambda: ce(x, t, wgt[None]), lambda: ref_ce(x, t, wgt[None]),
         names=["weight"])
    case(CE, "0-d logits, 0-d target", lambda: ce(torch.tensor(1.0), torch.tensor(0)),
         lambda: ref_ce(torch.tensor(1.0), torch.tensor(0)), names=["logits"])
    x1 = randn(11)
    case(CE, "1-D logits (C,), 0-d target", lambda: ce(x1, t[0]), lambda: ref_ce(x1, t[0]))
    xbs = randn(2, 4, 11)
    tbs = randint(11, (2, 4))
    case(CE, "3-D (B, S, V) = (2, 4, 11) logits, (2, 4) target, reduction='none'",
         lambda: ce(xbs, tbs, reduction="none"),
         lambda: ref_ce(xbs.reshape(8, 11), tbs.reshape(8), reduction="none").view(2, 4))
    e0 = torch.empty(0, 11)
    e0t = torch.empty(0, dtype=torch.long)
    case(CE, "N = 0 (0, 11), reduction='mean'", lambda: ce(e0, e0t), lambda: ref_ce(e0, e0t))
    case(CE, "N = 0, reduction='sum', grad", lambda: grad_of(lambda a: ce(a, e0t, reduction="sum"), e0),
         lambda: grad_of(lambda a: ref_ce(a, e0t, reduction="sum"), e0.double()))
    case(CE, "N = 0, reduction='none'", lambda: ce(e0, e0t, reduction="none"),
         lambda: ref_ce(e0, e0t, reduction="none"))
    case(CE, "V = 0: logits (4, 0)", lambda: ce(torch.empty(4, 0), torch.zeros(4, dtype=torch.long)),
         lambda: ref_ce(torch.empty(4, 0), torch.zeros(4, dtype=torch.long)), names=["logits", "V"])
    xv1 = randn(5, 1)
    tv1 = torch.zeros(5, dtype=torch.long)
    case(CE, "V = 1: logits (5, 1), grad", lambda: grad_of(lambda a: ce(a, tv1), xv1),
         lambda: grad_of(lambda a: ref_ce(a, tv1), xv1.double()))
    case(CE, "V = 1 with label_smoothing=0.5", lambda: ce(xv1, tv1, label_smoothing=0.5),
         lambda: ref_ce(xv1, tv1, label_smoothing=0.5))

    # --- NaN / inf --------------------------------------------------------------------------
    def with_entry(value, row=2, col=4):
        y = x.clone()
        y[row, col] = value
        return y

    xnan = with_entry(float("nan"))
    case(CE, "NaN in row 2, reduction='none'", lambda: ce(xnan, t, reduction="none"),
         lambda: ref_ce(xnan, t, reduction="none"))
    xinf = with_entry(float("inf"))
    case(CE, "+inf in row 2, reduction='none'", lambda: ce(xinf, t, reduction="none"),
         lambda: ref_ce(xinf, t, reduction="none"))
    tni = t.clone()
    tni[2] = 5
    xninf = with_entry(float("-inf"))
    case(CE, "-inf at a non-target entry of row 2, grad",
         lambda: grad_of(lambda a: ce(a, tni), xninf),
         lambda: grad_of(lambda a: ref_ce(a, tni), xninf.double()))
    xrow = x.clone()
    xrow[2] = float("-inf")
    case(CE, "row 2 all -inf, reduction='none'", lambda: ce(xrow, t, reduction="none"),
         lambda: ref_ce(xrow, t, reduction="none"))
    xbig = x * 1e38
    case(CE, "logits ~1e38 (near float32 max)", lambda: ce(xbig, t), lambda: ref_ce(xbig, t))
    tall = torch.full((8,), -100)
    case(CE, "every target ignored, reduction='mean'", lambda: ce(x, tall), lambda: ref_ce(x, tall))

    # --- scalar options ---------------------------------------------------------------------
    case(CE, "softcap=0", lambda: ce(x, t, softcap=0), names=["softcap"])
    case(CE, "softcap=-1", lambda: ce(x, t, softcap=-1.0), names=["softcap"])
    case(CE, "softcap=inf", lambda: ce(x, t, softcap=float("inf")), names=["softcap"])
    case(CE, "softcap=nan", lambda: ce(x, t, softcap=float("nan")), names=["softcap"])
    case(CE, "softcap=1e300", lambda: ce(x, t, softcap=1e300), names=["softcap"])
    case(CE, "softcap='30'", lambda: ce(x, t, softcap="30"), names=["softcap"])
    case(CE, "softcap=True (a bool)", lambda: ce(x, t, softcap=True),
         lambda: ref_ce(x, t, softcap=1.0), names=["softcap"])
    case(CE, "softcap=1e-3 (tiny but representable)", lambda: ce(x, t, softcap=1e-3),
         lambda: ref_ce(x, t, softcap=1e-3))
    case(CE, "ignore_index=True", lambda: ce(x, t, ignore_index=True), names=["ignore_index"])
    case(CE, "ignore_index=2**70", lambda: ce(x, t, ignore_index=2 ** 70), names=["ignore_index"])
    case(CE, "ignore_index=torch.tensor(3)", lambda: ce(x, t, ignore_index=torch.tensor(3)),
         lambda: ref_ce(x, t, ignore_index=3))
    case(CE, "ignore_index='-100'", lambda: ce(x, t, ignore_index="-100"), names=["ignore_index"])
    case(CE, "label_smoothing=-0.1", lambda: ce(x, t, label_smoothing=-0.1),
         lambda: ref_ce(x, t, label_smoothing=-0.1), names=["label_smoothing"])
    case(CE, "label_smoothing=1.5", lambda: ce(x, t, label_smoothing=1.5),
         lambda: ref_ce(x, t, label_smoothing=1.5), names=["label_smoothing"])
    case(CE, "label_smoothing=nan", lambda: ce(x, t, label_smoothing=float("nan")),
         names=["label_smoothing"])
    case(CE, "label_smoothing=1.0 (edge)", lambda: ce(x, t, label_smoothing=1.0),
         lambda: ref_ce(x, t, label_smoothing=1.0))
    case(CE, "label_smoothing=1e300", lambda: ce(x, t, label_smoothing=1e300),
         names=["label_smoothing"])
    case(CE, "z_loss=-1", lambda: ce(x, t, z_loss=-1.0), names=["z_loss"])
    case(CE, "z_loss=1e300", lambda: ce(x, t, z_loss=1e300), names=["z_loss"])
    case(CE, "z_loss=1e-50", lambda: ce(x, t, z_loss=1e-50), names=["z_loss"])
    case(CE, "z_loss=nan", lambda: ce(x, t, z_loss=float("nan")), names=["z_loss"])
    case(CE, "z_loss=None", lambda: ce(x, t, z_loss=None), names=["z_loss"])
    case(CE, "logit_scale=0", lambda: ce(x, t, logit_scale=0.0), names=["logit_scale"])
    case(CE, "logit_scale=-2", lambda: ce(x, t, logit_scale=-2.0),
         lambda: ref_ce(x, t, logit_scale=-2.0))
    case(CE, "logit_scale=inf", lambda: ce(x, t, logit_scale=float("inf")), names=["logit_scale"])
    case(CE, "logit_scale=1e-45", lambda: ce(x, t, logit_scale=1e-45), names=["logit_scale"])
    case(CE, "logit_scale=1e30, softcap=1e-30 (ratio 1e60)",
         lambda: ce(x, t, logit_scale=1e30, softcap=1e-30), names=["logit_scale", "softcap"])
    case(CE, "logit_scale=torch.ones(2)", lambda: ce(x, t, logit_scale=torch.ones(2)),
         names=["logit_scale"])
    case(CE, "reduction='bogus'", lambda: ce(x, t, reduction="bogus"),
         lambda: ref_ce(x, t, reduction="bogus"), names=["reduction"])
    case(CE, "reduction=None", lambda: ce(x, t, reduction=None), names=["reduction"])
    case(CE, "reduction='MEAN'", lambda: ce(x, t, reduction="MEAN"), names=["reduction"])

    # --- layouts ----------------------------------------------------------------------------
    xt = randn(11, 8).t()
    case(CE, "transposed logits randn(11, 8).t() (column-major)", lambda: ce(xt, t),
         lambda: ref_ce(xt, t))
    xs = randn(8, 22)[:, ::2]
    src22 = randn(8, 22)
    case(CE, "logits x[:, ::2] (last-dim stride 2), grad",
         lambda: grad_of(lambda a: ce(a[:, ::2], t), src22),
         lambda: grad_of(lambda a: ref_ce(a[:, ::2], t), src22.double()))
    case(CE, "logits x[:, ::2] forward only", lambda: ce(xs, t), lambda: ref_ce(xs, t))
    xu = randn(8 * 11 + 1)[1:].view(8, 11)
    case(CE, "logits at an odd storage offset (unaligned)", lambda: ce(xu, t), lambda: ref_ce(xu, t))
    case(CE, "target stride-0 t[:1].expand(8)", lambda: ce(x, t[:1].expand(8)),
         lambda: ref_ce(x, t[:1].expand(8)))
    case(CE, "target t[::2] of a (16,) tensor (stride 2)",
         lambda: ce(x, torch.cat([t, t])[::2]), lambda: ref_ce(x, torch.cat([t, t])[::2]))

    # --- types and devices ------------------------------------------------------------------
    case(CE, "logits a Python list", lambda: ce(x.tolist(), t), names=["logits"])
    case(CE, "target a Python list", lambda: ce(x, t.tolist()), names=["target"])
    case(CE, "weight a Python list", lambda: ce(x, t, wgt.tolist()), names=["weight"])
    xm = torch.empty(8, 11, device="meta")
    case(CE, "logits on meta, target on CPU", lambda: ce(xm, t), names=["device", "meta"])
    case(CE, "logits and target on meta", lambda: ce(xm, torch.empty(8, dtype=torch.long, device="meta")),
         names=["meta"])
    case(CE, "weight on meta, logits on CPU", lambda: ce(x, t, wgt.to("meta")),
         names=["weight"])
    case(CE, "process_group given with float64 logits (fallback)",
         lambda: ce(xd, t, process_group=object()), names=["process_group"])
    case(CE, "vocab_start=3 without process_group", lambda: ce(x, t, vocab_start=3),
         names=["vocab_start"])
    case(CE, "return_metrics=True (float32)", lambda: ce(x, t, return_metrics=True)[0],
         lambda: ref_ce(x, t))

    # --- linear_cross_entropy ---------------------------------------------------------------
    LCE = "linear_cross_entropy"
    h = randn(6, 16)
    w = randn(13, 16) * 0.3
    b = randn(13)
    ht = randint(13, (6,))
    case(LCE, "baseline h (6, 16), w (13, 16), bias (13,)", lambda: lce(h, w, ht, b),
         lambda: ref_lce(h, w, ht, b))
    case(LCE, "baseline grads of hidden, weight", lambda: grad_of(lambda a: lce(a, w, ht), h),
         lambda: grad_of(lambda a: ref_lce(a, w, ht), h.double()))
    case(LCE, "weight (13, 15): H mismatch", lambda: lce(h, w[:, :15], ht),
         names=["weight"])
    case(LCE, "weight 1-D (16,)", lambda: lce(h, w[0], ht), names=["weight"])
    case(LCE, "target (5,) against hidden (6, 16)", lambda: lce(h, w, ht[:5]), names=["target"])
    case(LCE, "weight bfloat16, hidden float32", lambda: lce(h, w.bfloat16(), ht), names=["weight"])
    case(LCE, "hidden and weight int64", lambda: lce(h.long(), w.long(), ht),
         names=["hidden", "weight"])
    case(LCE, "hidden and weight float64", lambda: lce(h.double(), w.double(), ht),
         lambda: ref_lce(h, w, ht), names=["hidden", "float64"])
    case(LCE, "bias (12,) against V = 13", lambda: lce(h, w, ht, b[:12]), names=["bias"])
    case(LCE, "bias float64 with float32 hidden", lambda: lce(h, w, ht, b.double()),
         names=["bias"])
    case(LCE, "bias (1, 13)", lambda: lce(h, w, ht, b[None]), names=["bias"])
    cw = torch.rand(13, generator=g) + 0.5
    case(LCE, "class_weight (12,) against V = 13", lambda: lce(h, w, ht, class_weight=cw[:12]),
         names=["class_weight"])
    case(LCE, "class_weight int64", lambda: lce(h, w, ht, class_weight=torch.ones(13, dtype=torch.long)),
         lambda: ref_lce(h, w, ht, weight=torch.ones(13)), names=["class_weight"])
    case(LCE, "class_weight float32", lambda: lce(h, w, ht, class_weight=cw),
         lambda: ref_lce(h, w, ht, weight=cw))
    case(LCE, "bool targets", lambda: lce(h, w, ht > 5), names=["target"])
    case(LCE, "float targets (6,)", lambda: lce(h, w, ht.float()), names=["target"])
    case(LCE, "int32 targets", lambda: lce(h, w, ht.int()), lambda: ref_lce(h, w, ht))
    case(LCE, "int16 targets", lambda: lce(h, w, ht.short()), names=["target"])
    case(LCE, "chunk_budget_bytes=-1", lambda: lce(h, w, ht, chunk_budget_bytes=-1),
         names=["chunk_budget_bytes"])
    case(LCE, "chunk_budget_bytes=0", lambda: lce(h, w, ht, chunk_budget_bytes=0),
         names=["chunk_budget_bytes"])
    case(LCE, "chunk_budget_bytes=1 (smaller than one row)", lambda: lce(h, w, ht, chunk_budget_bytes=1),
         lambda: ref_lce(h, w, ht), names=["chunk_budget_bytes"])
    case(LCE, "chunk_budget_bytes=1.5", lambda: lce(h, w, ht, chunk_budget_bytes=1.5),
         names=["chunk_budget_bytes"])
    case(LCE, "chunk_budget_bytes=True", lambda: lce(h, w, ht, chunk_budget_bytes=True),
         names=["chunk_budget_bytes"])
    case(LCE, "chunk_budget_bytes=2**70", lambda: lce(h, w, ht, chunk_budget_bytes=2 ** 70),
         lambda: ref_lce(h, w, ht), names=["linear_cross_entropy: chunk_budget_bytes"])
    case(LCE, "softcap=1e-50", lambda: lce(h, w, ht, softcap=1e-50), names=["softcap"])
    case(LCE, "softcap=nan", lambda: lce(h, w, ht, softcap=float("nan")), names=["softcap"])
    case(LCE, "ignore_index=3.7", lambda: lce(h, w, ht, ignore_index=3.7), names=["ignore_index"])
    htb = ht.clone()
    htb[4] = 13
    case(LCE, "target[4] = 13 = V, check_targets off", lambda: lce(h, w, htb), names=["target"])
    case(LCE, "target[4] = 13 = V, check_targets=True", lambda: lce(h, w, htb, check_targets=True),
         names=["target"])
    case(LCE, "label_smoothing=2", lambda: lce(h, w, ht, label_smoothing=2.0),
         names=["label_smoothing"])
    case(LCE, "z_loss=-1", lambda: lce(h, w, ht, z_loss=-1.0), names=["z_loss"])
    case(LCE, "logit_scale=0", lambda: lce(h, w, ht, logit_scale=0.0), names=["logit_scale"])
    case(LCE, "reduction='bogus'", lambda: lce(h, w, ht, reduction="bogus"), names=["reduction"])
    hT = randn(16, 6).t()
    case(LCE, "hidden transposed randn(16, 6).t()", lambda: lce(hT, w, ht), lambda: ref_lce(hT, w, ht))
    wT = (randn(16, 13) * 0.3).t()
    case(LCE, "weight transposed randn(16, 13).t(), grad of weight",
         lambda: grad_of(lambda a: lce(h, a, ht), wT),
         lambda: grad_of(lambda a: ref_lce(h, a, ht), wT.double()))
    hE = h[:1].expand(6, 16)
    case(LCE, "hidden stride-0 h[:1].expand(6, 16)", lambda: lce(hE, w, ht), lambda: ref_lce(hE, w, ht))
    case(LCE, "N = 0: hidden (0, 16)", lambda: lce(torch.empty(0, 16), w, e0t),
         lambda: ref_lce(torch.empty(0, 16), w, e0t))
    case(LCE, "V = 0: weight (0, 16)", lambda: lce(h, torch.empty(0, 16), torch.zeros(6, dtype=torch.long)),
         names=["weight", "V"])
    case(LCE, "V = 1: weight (1, 16)", lambda: lce(h, w[:1], torch.zeros(6, dtype=torch.long)),
         lambda: ref_lce(h, w[:1], torch.zeros(6, dtype=torch.long)))
    case(LCE, "H = 0: hidden (6, 0), weight (13, 0)",
         lambda: lce(torch.empty(6, 0), torch.empty(13, 0), ht), names=["hidden"])
    case(LCE, "0-d hidden", lambda: lce(torch.tensor(1.0), w, ht), names=["hidden"])
    hB = randn(2, 3, 16)
    tB = randint(13, (2, 3))
    case(LCE, "3-D hidden (2, 3, 16), shift=True",
         lambda: lce(hB, w, tB, shift=True),
         lambda: ref_lce(hB[:, :-1], w, tB[:, 1:]))
    hN = h.clone()
    hN[1, 3] = float("nan")
    case(LCE, "NaN in hidden row 1, reduction='none'", lambda: lce(hN, w, ht, reduction="none"),
         lambda: ref_lce(hN, w, ht, reduction="none"))
    case(LCE, "hidden a Python list", lambda: lce(h.tolist(), w, ht), names=["hidden"])
    case(LCE, "hidden on meta, weight on CPU", lambda: lce(h.to("meta"), w, ht),
         names=["weight", "device", "meta"])
    case(LCE, "vocab_start=0 without process_group", lambda: lce(h, w, ht, vocab_start=0),
         names=["vocab_start"])
    case(LCE, "hidden bfloat16 (reference: float64 of the rounded values)",
         lambda: lce(h.bfloat16(), w.bfloat16(), ht),
         lambda: ref_lce(h.bfloat16(), w.bfloat16(), ht))

    # --- vocabulary-parallel forms (1-rank gloo group) --------------------------------------
    VP = "vocab_parallel (1-rank gloo)"

    def group():
        import torch.distributed as dist
        if not dist.is_initialized():
            path = os.path.join(tempfile.mkdtemp(prefix="fusedce_bad_inputs_"), "store")
            dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        return dist.group.WORLD

    vpce = fusedce.vocab_parallel_cross_entropy
    vplce = fusedce.vocab_parallel_linear_cross_entropy
    case(VP, "vocab_parallel_cross_entropy, valid, grad",
         lambda: grad_of(lambda a: vpce(a, t, process_group=group()), x),
         lambda: grad_of(lambda a: ref_ce(a, t), x.double()))
    case(VP, "vocab_parallel_cross_entropy, process_group=None",
         lambda: vpce(x, t, process_group=None), names=["process_group"])
    case(VP, "vocab_parallel_cross_entropy, vocab_total=12 (V_local = 11)",
         lambda: vpce(x, t, process_group=group(), vocab_total=12), names=["vocab_total", "vocab"])
    case(VP, "vocab_parallel_cross_entropy, vocab_start=1",
         lambda: vpce(x, t, process_group=group(), vocab_start=1), names=["vocab_start", "vocab"])
    case(VP, "vocab_parallel_cross_entropy, target[3] = 11 = V",
         lambda: vpce(x, tb, process_group=group()), names=["target"])
    case(VP, "cross_entropy(process_group=, inplace_backward=True)",
         lambda: ce(x.clone().requires_grad_(True) * 1, t, process_group=group(), inplace_backward=True),
         names=["inplace_backward"])
    case(VP, "cross_entropy(process_group=) with float64 logits",
         lambda: ce(xd, t, process_group=group()), names=["process_group"])
    case(VP, "vocab_parallel_cross_entropy, softcap=1e-50",
         lambda: vpce(x, t, process_group=group(), softcap=1e-50), names=["softcap"])
    case(VP, "vocab_parallel_cross_entropy, process_group='world' (a string)",
         lambda: vpce(x, t, process_group="world"), names=["process_group"])
    case(VP, "vocab_parallel_linear_cross_entropy, valid, grad of hidden",
         lambda: grad_of(lambda a: vplce(a, w, ht, b, process_group=group()), h),
         lambda: grad_of(lambda a: ref_lce(a, w, ht, b), h.double()))
    case(VP, "vocab_parallel_linear_cross_entropy, weight H mismatch",
         lambda: vplce(h, w[:, :15], ht, process_group=group()), names=["weight"])
    case(VP, "vocab_parallel_linear_cross_entropy, vocab_total=14",
         lambda: vplce(h, w, ht, process_group=group(), vocab_total=14),
         names=["vocab_total", "vocab"])
    return cases


class Note:
    """A result the case itself judged (text for the table and whether it is correct)."""

    def __init__(self, text, good):
        self.text, self.good = text, good


# ---------------------------------------------------------------------------------------------
# Running one case and describing its result
# ---------------------------------------------------------------------------------------------

def _flat(value):
    import torch
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _flat(item)]
    return [value]


def _show(value):
    import torch
    parts = []
    for v in _flat(value):
        if not isinstance(v, torch.Tensor):
            parts.append(repr(v))
        elif v.device.type == "meta":
            parts.append(f"meta tensor {tuple(v.shape)} {v.dtype}")
        elif v.numel() == 1:
            parts.append(f"{v.item():.6g}" + ("" if v.dtype == torch.float32 else f" ({v.dtype})"))
        elif v.numel() == 0:
            parts.append(f"empty {tuple(v.shape)}")
        else:
            parts.append(f"tensor {tuple(v.shape)}")
    return ", ".join(parts)


def _matches(value, reference):
    """Every tensor of `value` equals the float64 reference's to float32 precision (NaN where
    the reference has NaN, +-inf where it has them)."""
    import torch
    got, want = _flat(value), _flat(reference)
    if len(got) != len(want):
        return False, "a different number of results"
    worst = 0.0
    for a, b in zip(got, want):
        if a is None or b is None:
            if a is not b:
                return False, "a gradient is missing"
            continue
        if a.shape != b.shape:
            return False, f"shape {tuple(a.shape)} vs reference {tuple(b.shape)}"
        a64, b64 = a.detach().double(), b.detach().double()
        if not torch.equal(torch.isnan(a64), torch.isnan(b64)):
            return False, "NaN where the reference has none (or the reverse)"
        if not torch.allclose(a64, b64, rtol=2e-5, atol=1e-6, equal_nan=True):
            err = ((a64 - b64).abs().nan_to_num(0.0)).max().item()
            return False, f"max abs difference {err:.3g} from the reference"
        finite = torch.isfinite(b64)
        if finite.any():
            worst = max(worst, (a64[finite] - b64[finite]).abs().max().item())
    return True, f"max abs diff {worst:.1e}"


def _error_text(exc):
    message = " ".join(str(exc).split())
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + "..."
    return f"{type(exc).__name__}: {message}"


def run_case(c):
    """{'result': text, 'flag': '' | 'BUG?' | 'torch differs'} for one case."""
    reference, ref_error = None, None
    if c["ref"] is not None:
        try:
            reference = c["ref"]()
        except Exception as exc:  # noqa: BLE001 (what PyTorch raises is part of the survey)
            ref_error = exc
    try:
        value = c["fn"]()
    except Exception as exc:  # noqa: BLE001
        text = _error_text(exc)
        named = any(n.lower() in str(exc).lower() for n in c["names"])
        if not named:
            return {"result": text, "flag": "BUG? (error does not name "
                    + (" / ".join(c["names"]) if c["names"] else "anything expected") + ")"}
        if c["ref"] is not None and ref_error is None:
            return {"result": text + f" [reference computes {_show(reference)}]",
                    "flag": "stricter than reference"}
        return {"result": text, "flag": ""}
    if isinstance(value, Note):
        return {"result": f"ok: {value.text}", "flag": "" if value.good else "BUG?"}
    shown = _show(value)
    if c["ref"] is None:
        good = bool(_flat(value)) and all(
            getattr(v, "device", None) is not None and v.device.type == "meta" for v in _flat(value))
        return {"result": f"ok: {shown} (accepted; no reference to judge it by)",
                "flag": "" if good and not c["names"] or good and "meta" in c["names"] else "BUG?"}
    if ref_error is not None:
        return {"result": f"ok: {shown}; PyTorch raises {_error_text(ref_error)[:80]}",
                "flag": "BUG? (accepted)"}
    same, how = _matches(value, reference)
    if same:
        return {"result": f"ok: {shown} (= float64 reference, {how})", "flag": ""}
    return {"result": f"ok: {shown} but reference is {_show(reference)} ({how})", "flag": "BUG?"}


# ---------------------------------------------------------------------------------------------
# Worker and driver
# ---------------------------------------------------------------------------------------------

def worker(start):
    import warnings
    warnings.simplefilter("ignore")
    cases = build_cases()
    for i in range(start, len(cases)):
        c = cases[i]
        print(json.dumps({"i": i, "call": c["call"], "input": c["input"], "start": True}), flush=True)
        out = run_case(c)
        out.update(i=i, call=c["call"], input=c["input"])
        print(json.dumps(out), flush=True)
    print(json.dumps({"done": len(cases)}), flush=True)


def _cell(text):
    return text.replace("|", "\\|").replace("\n", " ")


def main():
    rows, start, current = [], 0, None
    while True:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        finished = False
        while True:
            if not sel.select(timeout=HANG_SECONDS):
                proc.kill()
                proc.wait()
                rows.append(dict(current, result=f"HANG: no result in {HANG_SECONDS} s", flag="BUG?"))
                break
            line = proc.stdout.readline()
            if not line:
                proc.wait()
                if current is None:
                    sys.exit("worker failed before the first case:\n" + proc.stderr.read())
                rows.append(dict(current, result=f"CRASH: worker exited with {proc.returncode}",
                                 flag="BUG?"))
                break
            msg = json.loads(line)
            if "done" in msg:
                finished = True
                proc.wait()
                break
            if msg.get("start"):
                current = msg
            else:
                rows.append(msg)
                current = None
        if finished:
            break
        start = rows[-1]["i"] + 1
        current = None

    flagged = [r for r in rows if r["flag"].startswith("BUG")]
    print(f"# Bad inputs through fusedce's Python API (CPU): {len(rows)} inputs, "
          f"{len(flagged)} flagged\n")
    print("Reference: float64 F.cross_entropy of the same inputs (fusedce's logit_scale / softcap / "
          "z_loss applied by the contract's formulas). \"names\" checks: an error must name the "
          "argument the input is about. Generated by dev/bad_inputs.py.\n")
    print("| # | call | input | result | flag |")
    print("|---|---|---|---|---|")
    for n, r in enumerate(rows, 1):
        print(f"| {n} | {_cell(r['call'])} | {_cell(r['input'])} | {_cell(r['result'])} | "
              f"{_cell(r['flag'])} |")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
    else:
        main()
