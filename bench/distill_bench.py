#!/usr/bin/env python3
"""Fused linear distillation (fusedce.linear_distillation, issue 46) beside its peers: forward +
backward of the loss between a student head and a teacher head given their hidden states and
weights. Two parts, each its own CSV:

  full  (distill.csv) per shape NxHxV (student and teacher hidden H, vocabulary V) and variant
        (the generalized JSD at beta 0.5; beta 0 = forward KL(teacher || student); the JSD with
        labels, a fifth of them ignored, and hard_weight 0.5), one row per implementation:
          fusedce                  fusedce.linear_distillation, default options (TRL's
                                   convention: no temperature**2, mean over the counted rows)
          trl                      TRL 1.16's trl.kernels.chunked_divergence.
                                   ChunkedDivergenceFunction (per-token divergence, meaned here
                                   as its trainer does with every row counted)
          liger fused              Liger-Kernel's LigerFusedLinearJSD (liger_kernel.transformers)
          liger chunked            Liger-Kernel's LigerFusedLinearJSDLoss (liger_kernel.
                                   chunked_loss), weight_soft_loss 1 - hard_weight
          torch eager              the loss written here over materialised logits
          torch.compile            the same function through torch.compile
          cublas floor             the four products of 8 N H V FLOPs (the two heads' logits,
                                   grad_hidden, grad_weight), torch.matmul each, timed alone
        vs_floor: a row's time over the floor's (the issue's target: fusedce within 1.15x at
        BT = 8192); tflops_counted: 8 N H V FLOPs over a row's time.
  topk  (distill_topk.csv) fusedce.linear_distillation_topk against the teacher's top-K
        (default 64, taken from a teacher head) with topk_norm "none" (axolotl's KD loss) and
        "tail" (TRL's server distillation's default), beside the same loss in torch eager and
        torch.compile over the student's materialised logits. Neither TRL 1.16 nor Liger-Kernel
        0.8.5 has a top-k kernel: their rows say so. tflops_counted: 6 N H V (the student's
        logits, grad_hidden, grad_weight) over a row's time.

Every row: median, 10th and 90th percentile of CUDA-event times after warm-up; peak device
memory over the inputs (torch's allocator's peak plus the high-water mark of the stream-ordered
pool, where fusedce's distillation takes its workspace: a row's note says when that pool could
not be read) (and beyond the loss and gradients it returns); the loss and the largest
absolute difference of the loss, grad_hidden and grad_weight from a float64 reference computed
here in row chunks (from torch eager in the input dtype, with a note, if the float64 one does not
fit). An implementation that cannot run here gives a row with status "skipped" and the reason
(not installed; fusedce's CUDA path raising NotImplementedError; a variant the peer's API has no
form for); one that breaks gives "failed" and the error, and the script exits 1.

Run on a GPU from the repository root, the carried wheels installed to /tmp/site first (TRL and
what trl.kernels imports with it: datasets, dill, multiprocess, as for bench/trl_post_training.py;
liger-kernel 0.8.5):

    PYTHONPATH=$(python3 tests/python/build_tree.py <build>):/tmp/site \\
        python3 bench/distill_bench.py --out bench/h200

Each torch.compile row compiles in its checked call (not timed) and each variant computes its
float64 reference first (about 4 GiB per float64 head at V = 128256, H = 4096): where one
command's time is bounded, split the run by --only and --shapes.

Each row goes to its CSV as soon as it is measured, so a run cut short by a time limit keeps
the rows it finished. --variants picks variants by name (';'-separated).
--impls picks implementations by the names above (--impls "fusedce,cublas floor" once fusedce's
CUDA path lands, say); --only full or topk one part. --smoke runs both parts at tiny shapes on
the CPU, for tests/python/test_distill_bench.py.
"""

import argparse
import math
import os
import sys
import time
import traceback

import torch

import fusedce
from fusedce.bench.measure import device_name, spread, sync, time_runs
from fusedce.bench.rows import (common_columns, gib, max_abs, max_rel, peak_memory, print_rows, release,
                                 stream_ordered_pool, write_csv)

IGNORE = -100
SHAPES = [(1024, 4096, 128256), (8192, 4096, 128256)]
SMOKE_SHAPES = [(32, 16, 257), (64, 24, 1000)]
REFERENCE_ROWS = 1024  # rows of one float64 chunk: 1 GiB per (rows, V = 128256) tensor


class Skip(Exception):
    """This row cannot run here; the message says why."""


class Variant:
    """One loss: beta (0 forward KL, 0.5 the JSD), labels with a fifth ignored or none, and the
    weight of the hard cross-entropy; `name` labels the rows."""

    def __init__(self, name, beta, labels, hard_weight):
        self.name, self.beta, self.labels, self.hard_weight = name, beta, labels, hard_weight


VARIANTS = [Variant("jsd beta=0.5", 0.5, False, 0.0), Variant("forward_kl beta=0", 0.0, False, 0.0),
            Variant("jsd beta=0.5 + labels, hard_weight=0.5", 0.5, True, 0.5)]
TOPK_NORMS = ("none", "tail")


# ---- measurement and output -----------------------------------------------------------------------


def first_line(e):
    return f"{type(e).__name__}: {e}".splitlines()[0]


# ---- the problem --------------------------------------------------------------------------------


def head_pair(n, hid, vocab, dtype, device, seed=0):
    """Student hidden (n, hid) and head (vocab, hid), the teacher's the same sizes near them:
    logits of spread about 1 with one likely token per row, 4 above the rest in the student and
    6 in the teacher (peaked, trained-looking distributions that still differ)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=g, device=device)

    hs = randn(n, hid)
    ws = randn(vocab, hid) / math.sqrt(hid)
    ht = hs + 0.5 * randn(n, hid)
    wt = ws + 0.5 * randn(vocab, hid) / math.sqrt(hid)
    likely = torch.randint(0, vocab, (n,), generator=g, device=device)
    ws.index_add_(0, likely, 4.0 * hs / hs.square().sum(1, keepdim=True))
    wt.index_add_(0, likely, 6.0 * ht / ht.square().sum(1, keepdim=True))
    return hs.to(dtype), ws.to(dtype), ht.to(dtype), wt.to(dtype)


def labels_for(n, vocab, device, seed=1):
    """Random targets with a fifth of the rows ignored."""
    g = torch.Generator(device=device).manual_seed(seed)
    labels = torch.randint(0, vocab, (n,), generator=g, device=device)
    return labels.masked_fill(torch.rand(n, generator=g, device=device) < 0.2, IGNORE)


def teacher_topk(ht, wt, k, temperature, rows=REFERENCE_ROWS):
    """The teacher head's top-k ids and float32 log-probabilities at `temperature`, row chunk by
    row chunk (what a teacher server would send)."""
    ids, logprobs = [], []
    for start in range(0, ht.shape[0], rows):
        z = (ht[start:start + rows] @ wt.T).float() / temperature
        top = torch.log_softmax(z, dim=-1).topk(k, dim=-1)
        ids.append(top.indices)
        logprobs.append(top.values)
    return torch.cat(ids), torch.cat(logprobs)


# ---- the loss over materialised logits: torch eager, torch.compile and the float64 reference ----


def _compute_dtype(y):
    return torch.float64 if y.dtype == torch.float64 else torch.float32


def divergence_rows(zs, zt, beta):
    """Per row: beta 0 KL(p_t || p_s), 1 KL(p_s || p_t), else beta KL(p_t || m) + (1 - beta)
    KL(p_s || m) with m = (1 - beta) p_s + beta p_t; zs, zt the heads' tempered logits."""
    log_ps = torch.log_softmax(zs, dim=-1)
    log_pt = torch.log_softmax(zt, dim=-1)
    if beta == 0.0:
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
    return beta * (log_pt.exp() * (log_pt - log_m)).sum(-1) + (1 - beta) * (log_ps.exp() * (log_ps - log_m)).sum(-1)


def loss_rows(ys, yt, labels, beta, temperature, hard_weight):
    """Per row (N,): (1 - hard_weight) D + hard_weight CE(ys at temperature 1, labels), 0 at
    ignored rows; ys, yt the heads' logits (the products' dtype: float32 math for lower ones)."""
    dt = _compute_dtype(ys)
    ys, yt = ys.to(dt), yt.to(dt)
    rows = divergence_rows(ys / temperature, yt / temperature, beta)
    if hard_weight > 0:
        picked = ys.gather(-1, labels.clamp_min(0)[:, None])[:, 0]
        rows = (1 - hard_weight) * rows + hard_weight * (torch.logsumexp(ys, dim=-1) - picked)
    if labels is not None:
        rows = torch.where(labels != IGNORE, rows, torch.zeros_like(rows))
    return rows


def counted(labels, n):
    return n if labels is None else int((labels != IGNORE).sum().item())


def eager_loss(hs, ws, ht, wt, labels, beta, temperature, hard_weight):
    """The loss as one would write it in torch: both (N, V) logits materialised."""
    rows = loss_rows(hs @ ws.T, ht @ wt.T, labels, beta, temperature, hard_weight)
    count = rows.shape[0] if labels is None else (labels != IGNORE).sum()
    return rows.sum() / count


def _tail(x):
    """x's K entries and log(1 - sum e^x), the log-sum clamped to at most -1e-7 (TRL's tail)."""
    s = torch.logsumexp(x, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([x, torch.log(-torch.expm1(s))], dim=-1)


def topk_rows(ys, ids, t, temperature, topk_norm):
    """Per row: the forward KL between the teacher's top-k log-probabilities t and the student's
    full-vocabulary log-softmax at the same ids, compared as `topk_norm` says."""
    dt = _compute_dtype(ys)
    q = torch.log_softmax(ys.to(dt) / temperature, dim=-1).gather(-1, ids)
    t = t.to(dt)
    if topk_norm == "renorm":
        q, t = q - torch.logsumexp(q, -1, keepdim=True), t - torch.logsumexp(t, -1, keepdim=True)
    elif topk_norm == "tail":
        q, t = _tail(q), _tail(t)
    return (t.exp() * (t - q)).sum(-1)


def eager_topk_loss(hs, ws, ids, t, temperature, topk_norm):
    return topk_rows(hs @ ws.T, ids, t, temperature, topk_norm).mean()


def float64_reference(rows_of, hs, ws, n_counted, rows=REFERENCE_ROWS):
    """(loss, grad_hidden, grad_weight) in float64 of sum(rows_of(h, w, sl)) / n_counted, with
    rows_of(h, w, sl) the float64 per-row losses of the rows `sl` given the student's float64
    hidden chunk and head; a chunk of rows at a time, so only (rows, V) tensors exist."""
    w = ws.detach().double().requires_grad_(True)
    grad_h = torch.empty(hs.shape, dtype=torch.float64, device=hs.device)
    grad_w = torch.zeros(w.shape, dtype=torch.float64, device=hs.device)
    total = 0.0
    for start in range(0, hs.shape[0], rows):
        sl = slice(start, start + rows)
        h = hs[sl].detach().double().requires_grad_(True)
        part = rows_of(h, w, sl).sum() / max(n_counted, 1)
        gh, gw = torch.autograd.grad(part, (h, w))
        grad_h[sl] = gh
        grad_w += gw
        total += part.item()
        del h, part, gh, gw
    return total, grad_h, grad_w


# ---- the implementations: each a loader returning fn(...) -> the scalar loss, or raising Skip ----


def _fusedce_check(device):
    if device == "cuda" and not fusedce.with_cuda:
        raise Skip("this build of fusedce has no CUDA kernels")


def _fusedce_full(v, a):
    _fusedce_check(a.device)
    options = {"temperature": a.temperature}
    if v.beta == 0.0:
        options["divergence"] = "forward_kl"
    elif v.beta != 0.5:
        options["beta"] = v.beta
    if v.hard_weight:
        options["hard_weight"] = v.hard_weight

    def call(hs, ws, ht, wt, labels):
        return fusedce.linear_distillation(hs, ws, ht, wt, labels, **options)
    return call, "options: " + (", ".join(f"{k}={x!r}" for k, x in options.items()))


def _trl_full(v, a):
    if v.hard_weight:
        raise Skip("TRL's distillation loss has no hard-label term (its trainer masks rows, mixes in no "
                   "cross-entropy)")
    import trl
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    def call(hs, ws, ht, wt, labels):
        divergence, _entropy = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, v.beta, a.temperature)
        return divergence.mean()  # its trainer: sum over the counted rows / their number; all counted here
    return call, (f"trl {trl.__version__}; its per-token divergence meaned here as its trainer does (every row "
                  "counted); also computes the student's entropy (always on)")


def _liger_version():
    import liger_kernel
    from importlib.metadata import version
    return getattr(liger_kernel, "__version__", None) or version("liger-kernel")


def _liger_fused(v, a):
    if v.hard_weight:
        raise Skip("LigerFusedLinearJSD has no hard-label term (its shift_labels only leave rows out)")
    if a.device != "cuda":
        raise Skip("its kernels are Triton: CUDA only")
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
        version = _liger_version()
    except Exception as e:  # not installed, or a broken install: said, not raised
        raise Skip(f"liger-kernel does not import: {first_line(e)}") from None
    loss = LigerFusedLinearJSD(jsd_beta=v.beta, temperature=a.temperature)

    def call(hs, ws, ht, wt, labels):
        return loss(hs, ws, ht, wt, None)
    return call, f"liger-kernel {version}; grad_weight accumulated in the weight's dtype (accum_dtype None)"


def _liger_chunked(v, a):
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
        version = _liger_version()
    except Exception as e:
        raise Skip(f"liger-kernel does not import: {first_line(e)}") from None
    compiled = a.device == "cuda"
    loss = LigerFusedLinearJSDLoss(weight_hard_loss=v.hard_weight, weight_soft_loss=1.0 - v.hard_weight,
                                   beta=v.beta, temperature=a.temperature, compiled=compiled)

    def call(hs, ws, ht, wt, labels):
        if labels is None:  # it needs labels: every row counted, as fusedce's call without them
            labels = torch.zeros(hs.shape[0], dtype=torch.long, device=hs.device)
        return loss(hs, ws, ht, wt, labels)
    note = (f"liger-kernel {version}; its logits and log-softmax in the input dtype"
            f"{'' if compiled else '; compiled=False off CUDA'}")
    return call, note


def _eager_full(v, a):
    def call(hs, ws, ht, wt, labels):
        return eager_loss(hs, ws, ht, wt, labels, v.beta, a.temperature, v.hard_weight)
    return call, "logits rounded to the input dtype by the product, float32 after"


def _compiled_full(v, a):
    torch._dynamo.reset()  # a fresh compile per row: no recompile limit across shapes and variants
    compiled = torch.compile(eager_loss, dynamic=False)

    def call(hs, ws, ht, wt, labels):
        return compiled(hs, ws, ht, wt, labels, v.beta, a.temperature, v.hard_weight)
    return call, "torch eager's function; compile time not timed"


FULL_IMPLS = [("torch eager", _eager_full), ("torch.compile", _compiled_full), ("fusedce", _fusedce_full),
              ("trl", _trl_full), ("liger fused", _liger_fused), ("liger chunked", _liger_chunked)]


def _fusedce_topk(norm, a):
    _fusedce_check(a.device)

    def call(hs, ws, ids, t):
        return fusedce.linear_distillation_topk(hs, ws, ids, t, topk_norm=norm, temperature=a.temperature)
    return call, f"options: topk_norm={norm!r}, temperature={a.temperature!r} (divergence forward_kl, the default)"


def _eager_topk(norm, a):
    def call(hs, ws, ids, t):
        return eager_topk_loss(hs, ws, ids, t, a.temperature, norm)
    return call, "student logits rounded to the input dtype by the product, float32 after"


def _compiled_topk(norm, a):
    torch._dynamo.reset()
    compiled = torch.compile(eager_topk_loss, dynamic=False)

    def call(hs, ws, ids, t):
        return compiled(hs, ws, ids, t, a.temperature, norm)
    return call, "torch eager's function; compile time not timed"


def _trl_topk(norm, a):
    raise Skip("TRL 1.16 has no top-k kernel: its experimental ServerDistillationTrainer takes the sparse KL "
               "inside the trainer over the student's materialised log-softmax (what the torch eager row does)")


def _liger_topk(norm, a):
    raise Skip("Liger-Kernel 0.8.5 has no top-k distillation loss (its JSD losses take a teacher head)")


TOPK_IMPLS = [("torch eager", _eager_topk), ("torch.compile", _compiled_topk), ("fusedce", _fusedce_topk),
              ("trl", _trl_topk), ("liger", _liger_topk)]


def chosen(impls, a):
    """The (name, loader) pairs --impls keeps (all without it)."""
    return [(name, load) for name, load in impls if a.impls is None or name in a.impls]


def chosen_variants(a):
    """The full part's variants --variants keeps (all without it)."""
    return [v for v in VARIANTS if a.variants is None or v.name in a.variants]


# ---- running one row ------------------------------------------------------------------------------


def measure(fn, inputs, leaves, a):
    """fn(*inputs) -> loss, backward into the leaves (the student's hidden and head): the checked
    call's (loss, grad_hidden, grad_weight), then its timing and peak memory."""
    def run(_i):
        for x in leaves:
            x.grad = None
        loss = fn(*inputs)
        loss.backward()
        return loss.detach(), leaves[0].grad, leaves[1].grad

    checked = tuple(x.detach() for x in run(0))  # the checked call (and any compile)
    sync(a.device)
    return checked, run


def run_row(row, load, inputs, leaves, reference, a, counted_flops=None, floor_ms=None):
    """One implementation's row: loaded, its checked call compared with the reference, timed, its
    peak measured. Returns (row, the checked (loss, grad_hidden, grad_weight) where there is no
    reference yet, else None)."""
    try:
        fn, note = load()
    except Skip as e:
        return {**row, "status": "skipped", "note": str(e)}, None
    except ImportError as e:
        return {**row, "status": "skipped", "note": f"not installed: {first_line(e)}"}, None
    row = {**row, "note": note}
    kept = None
    try:
        checked, run = measure(fn, inputs, leaves, a)
        row.update(status="ok", **differences(checked, reference))
        kept = checked if reference is None else None
        del checked
        row.update(timing(run, leaves, a))
        if isinstance(a.pool, str):
            row["note"] = f"{note}; peak without the stream-ordered pool ({a.pool})"
    except NotImplementedError as e:  # fusedce's CUDA path before it is written
        return {**row, "status": "skipped", "note": first_line(e)}, None
    except Exception as e:
        traceback.print_exc()
        return {**row, "status": "failed", "note": first_line(e)}, None
    finally:
        for x in leaves:
            x.grad = None
    if counted_flops:
        row["tflops_counted"] = counted_flops / (row["median_ms"] * 1e-3) / 1e12
    if floor_ms:
        row["vs_floor"] = row["median_ms"] / floor_ms
    return row, kept


def differences(checked, reference):
    """The loss and, against reference = (loss, grad_hidden, grad_weight, its label) or None, the
    largest differences."""
    loss, gh, gw = checked
    out = {"loss": loss.item()}
    if reference is not None:
        ref_loss, ref_gh, ref_gw, label = reference
        out.update(loss_absdiff=abs(loss.item() - ref_loss), grad_hidden_maxabs=max_abs(gh, ref_gh),
                   grad_weight_maxabs=max_abs(gw, ref_gw), grad_hidden_maxrel=max_rel(gh, ref_gh),
                   grad_weight_maxrel=max_rel(gw, ref_gw), reference=label)
    return out


def timing(run, leaves, a):
    """The spread of run()'s times and its peak memory, no gradient held before each call."""
    for x in leaves:
        x.grad = None
    median, p10, p90 = spread(time_runs(run, a.repeat, a.warmup, a.device))
    for x in leaves:  # the last run's gradients are not the next run's inputs
        x.grad = None
    pool = a.pool if not isinstance(a.pool, str) else None
    over, beyond = peak_memory(run, a.device, pool)
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90, "runs": a.repeat, "peak_over_inputs_gib": gib(over),
            "peak_beyond_outputs_gib": gib(beyond)}


def eager_reference(outputs, a):
    """torch eager's checked (loss, grad_hidden, grad_weight) as the reference where the float64
    one did not fit, or None where eager did not run either."""
    if outputs is None:
        return None
    loss, gh, gw = outputs
    return loss.item(), gh, gw, f"torch eager {str(a.dtype).split('.')[-1]} (the float64 reference did not fit)"


def reference_of(compute):
    """compute()'s float64 (loss, grad_hidden, grad_weight) and the label "float64", or where it
    runs out of device memory, None: the caller then takes torch eager's outputs."""
    try:
        return (*compute(), "float64")
    except torch.cuda.OutOfMemoryError:
        release("cuda")
        return None


# ---- the floor: the four products alone --------------------------------------------------------


def floor_row(row, hs, ws, ht, wt, a):
    """torch.matmul of the two logits products, grad_hidden = G W_s and grad_weight = G^T H_s
    (G an (N, V) gradient of the logits in the input dtype): their time in one run, each
    product's alone in the note."""
    g = torch.randn(hs.shape[0], ws.shape[0], device=a.device).to(hs.dtype)
    hs, ws, ht, wt = (x.detach() for x in (hs, ws, ht, wt))
    products = {"student logits": lambda: torch.matmul(hs, ws.T), "teacher logits": lambda: torch.matmul(ht, wt.T),
                "grad_hidden": lambda: torch.matmul(g, ws), "grad_weight": lambda: torch.matmul(g.T, hs)}

    def run(_i):
        return tuple(p() for p in products.values())

    try:
        with torch.no_grad():
            run(0)
            sync(a.device)
            median, p10, p90 = spread(time_runs(run, a.repeat, a.warmup, a.device))
            alone = {k: spread(time_runs(lambda i, p=p: p(), a.repeat, a.warmup, a.device))[0]
                     for k, p in products.items()}
    except Exception as e:
        traceback.print_exc()
        return {**row, "status": "failed", "note": first_line(e)}
    finally:
        del g
        release(a.device)
    note = "torch.matmul alone: " + ", ".join(f"{k} {ms:.4g} ms" for k, ms in alone.items())
    return {**row, "status": "ok", "median_ms": median, "p10_ms": p10, "p90_ms": p90, "runs": a.repeat,
            "tflops_counted": full_flops(hs, ws, ht) / (median * 1e-3) / 1e12, "vs_floor": 1.0, "note": note}


def full_flops(hs, ws, ht):
    """The products counted: 2 N V (H_s + H_t) for the two logits, 4 N V H_s for the gradients
    (8 N H V with equal hidden sizes)."""
    n, vocab = hs.shape[0], ws.shape[0]
    return 2 * n * vocab * (hs.shape[1] + ht.shape[1]) + 4 * n * vocab * hs.shape[1]


# ---- the parts -------------------------------------------------------------------------------------


def shape_columns(n, hid, vocab, a):
    return {"shape": f"{n}x{hid}x{vocab}", "tokens": n, "hidden": hid, "vocab": vocab,
            "dtype": str(a.dtype).split(".")[-1], "temperature": a.temperature}


def full_reference(v, hs, ws, ht, wt, labels, a):
    """The float64 reference of variant v (the teacher's head taken to float64 once)."""
    wt64 = wt.double()

    def rows_of(h, w, sl):
        lab = None if labels is None else labels[sl]
        return loss_rows(h @ w.T, ht[sl].double() @ wt64.T, lab, v.beta, a.temperature, v.hard_weight)
    return float64_reference(rows_of, hs, ws, counted(labels, hs.shape[0]), a.reference_rows)


def full_part(a, emit):
    for n, hid, vocab in a.shapes:
        hs, ws, ht, wt = head_pair(n, hid, vocab, a.dtype, a.device)
        leaves = [hs.requires_grad_(True), ws.requires_grad_(True)]
        base = {"part": "full", **shape_columns(n, hid, vocab, a)}
        floor_ms = None
        if a.impls is None or "cublas floor" in a.impls:
            floor = floor_row({**base, "variant": "the four products", "impl": "cublas floor"}, hs, ws, ht, wt, a)
            emit({**floor, **common_columns(a.device)})
            floor_ms = floor.get("median_ms")
        for v in chosen_variants(a):
            labels = labels_for(n, vocab, a.device) if v.labels else None
            inputs = (hs, ws, ht, wt, labels)

            reference = reference_of(lambda: full_reference(v, hs, ws, ht, wt, labels, a))
            release(a.device)
            for impl, load in chosen(FULL_IMPLS, a):
                row = {**base, "variant": v.name, "impl": impl}
                out, outputs = run_row(row, lambda load=load: load(v, a), inputs, leaves, reference, a,
                                       full_flops(hs, ws, ht), floor_ms)
                if reference is None and impl == "torch eager":
                    reference = eager_reference(outputs, a)
                emit({**out, **common_columns(a.device)})
                del outputs
                release(a.device)
            del reference, labels
        del hs, ws, ht, wt, leaves
        release(a.device)


def topk_part(a, emit):
    for n, hid, vocab in a.shapes:
        hs, ws, ht, wt = head_pair(n, hid, vocab, a.dtype, a.device)
        k = min(a.topk, vocab)
        ids, t = teacher_topk(ht, wt, k, a.temperature, a.reference_rows)
        del ht, wt
        leaves = [hs.requires_grad_(True), ws.requires_grad_(True)]
        base = {"part": "topk", **shape_columns(n, hid, vocab, a), "k": k}
        for norm in [n for n in TOPK_NORMS if a.variants is None or f"forward_kl topk_norm={n}" in a.variants]:
            def rows_of(h, w, sl, norm=norm):
                return topk_rows(h @ w.T, ids[sl], t[sl], a.temperature, norm)

            reference = reference_of(lambda: float64_reference(rows_of, hs, ws, n, a.reference_rows))
            release(a.device)
            for impl, load in chosen(TOPK_IMPLS, a):
                row = {**base, "variant": f"forward_kl topk_norm={norm}", "impl": impl}
                out, outputs = run_row(row, lambda load=load: load(norm, a), (hs, ws, ids, t), leaves, reference,
                                       a, 6 * n * vocab * hid)
                if reference is None and impl == "torch eager":
                    reference = eager_reference(outputs, a)
                emit({**out, **common_columns(a.device)})
                del outputs
                release(a.device)
            del reference
        del hs, ws, ids, t, leaves
        release(a.device)


def targets(rows):
    """The issue's targets read off the full part's JSD rows: fusedce's speed-up over each peer
    (the peer's time over fusedce's), its time over the floor, its peak against Liger's fused."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ok = {r["impl"]: r for r in rows if r["shape"] == shape and r["variant"] == VARIANTS[0].name
              and r.get("status") == "ok"}
        mine = ok.get("fusedce")
        if mine is None:
            lines.append(f"{shape}: no fusedce row to compare")
            continue
        parts = [f"{impl} {ok[impl]['median_ms'] / mine['median_ms']:.2f}x" for impl in ok if impl != "fusedce"
                 and impl != "cublas floor"]
        line = f"{shape} {VARIANTS[0].name}: fusedce {mine['median_ms']:.4g} ms, speed-up over " + ", ".join(parts)
        if mine.get("vs_floor"):
            line += f"; {mine['vs_floor']:.3f}x the floor"
        liger = ok.get("liger fused")
        if liger and liger.get("peak_over_inputs_gib") is not None and mine.get("peak_over_inputs_gib") is not None:
            line += (f"; peak {mine['peak_over_inputs_gib']:.3g} GiB against liger fused's "
                     f"{liger['peak_over_inputs_gib']:.3g}")
        lines.append(line)
    return lines


COLUMNS = ["shape", "variant", "impl", "status", "median_ms", "p10_ms", "p90_ms", "vs_floor",
           "peak_over_inputs_gib", "loss", "loss_absdiff", "grad_hidden_maxabs", "grad_weight_maxabs", "note"]
PARTS = {"full": ("distill.csv", full_part), "topk": ("distill_topk.csv", topk_part)}
IMPL_NAMES = list(dict.fromkeys(["cublas floor"] + [name for name, _ in FULL_IMPLS + TOPK_IMPLS]))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_shapes(text, p):
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s.strip()]
    except ValueError:
        shapes = None
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        p.error(f"--shapes: want NxHxV[,NxHxV...] of positive sizes, got {text!r}")
    return shapes


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/h200", help="folder for the CSV files (default bench/h200)")
    p.add_argument("--only", default="full,topk", help="comma-separated from full,topk")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, two runs: checks that every row runs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--shapes", help="NxHxV, comma-separated (default 1024x4096x128256,8192x4096x128256)")
    p.add_argument("--variants", help="variants to run, by the names of the CSV's variant column, "
                   "separated by ';' (default all): " + "; ".join([v.name for v in VARIANTS]
                                                                   + [f"forward_kl topk_norm={n}" for n in TOPK_NORMS]))
    p.add_argument("--impls", help="comma-separated implementations to run (default all): " + ", ".join(IMPL_NAMES))
    p.add_argument("--temperature", type=float, default=1.0, help="every implementation's (default 1)")
    p.add_argument("--topk", type=int, default=64, help="K of the top-k part (default 64)")
    p.add_argument("--repeat", type=int, help="timed runs (default 10; --smoke 2)")
    p.add_argument("--warmup", type=int, help="untimed runs after the checked one (default 3; --smoke 0)")
    a = p.parse_args(argv)
    a.only = [x.strip() for x in a.only.split(",") if x.strip()]
    unknown = sorted(set(a.only) - set(PARTS))
    if unknown:
        p.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU")
    if not a.temperature > 0:
        p.error(f"--temperature must be > 0, got {a.temperature}")
    if a.topk < 1:
        p.error(f"--topk must be >= 1, got {a.topk}")
    if a.impls is not None:
        a.impls = {x.strip() for x in a.impls.split(",") if x.strip()}
        unknown = sorted(a.impls - set(IMPL_NAMES))
        if unknown:
            p.error(f"--impls: unknown {', '.join(unknown)}; choose from {', '.join(IMPL_NAMES)}")
    if a.variants is not None:
        a.variants = {x.strip() for x in a.variants.split(";") if x.strip()}
        names = [v.name for v in VARIANTS] + [f"forward_kl topk_norm={n}" for n in TOPK_NORMS]
        unknown = sorted(a.variants - set(names))
        if unknown:
            p.error(f"--variants: unknown {', '.join(unknown)}; choose from {'; '.join(names)}")
    a.dtype = DTYPES[a.dtype]
    a.shapes = parse_shapes(a.shapes, p) if a.shapes else (SMOKE_SHAPES if a.smoke else SHAPES)
    a.reference_rows = 24 if a.smoke else REFERENCE_ROWS  # --smoke: several chunks even at its sizes
    a.repeat = a.repeat or (2 if a.smoke else 10)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.smoke else 3)
    # The core's workspace where it takes one itself (cudaMallocAsync) counts in the peak too.
    a.pool = stream_ordered_pool() if a.device == "cuda" else None
    return a


def main(argv=None):
    a = parse_args(argv)
    print(f"fusedce {fusedce.__version__} (CUDA kernels: {fusedce.with_cuda}), torch {torch.__version__}, "
          f"{device_name(a.device)}")
    failed = False
    for name in a.only:
        file, part = PARTS[name]
        path = os.path.join(a.out, file)
        started = time.time()
        rows = []

        def emit(row, rows=rows, path=path):
            """Each row to the CSV as it comes, so a run cut short keeps what it measured."""
            rows.append(row)
            write_csv(path, rows)
        try:
            part(a, emit)
        except Exception:  # a part that breaks leaves the other to run
            print(f"\n== {name}: failed")
            traceback.print_exc()
            failed = True
            continue
        print_rows(f"{name} ({time.time() - started:.0f} s) -> {path}", rows, COLUMNS)
        if name == "full":
            print("\n".join(["\n== targets"] + targets(rows)))
        failed |= any(r.get("status") == "failed" for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
