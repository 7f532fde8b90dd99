"""Vocabulary-parallel cross-entropy (fusedce.distributed) over torch.distributed.

Multi-process groups of 2 and 3 ranks on gloo, spawned once per world size: every rank runs every
case (each option of docs/contract.md, even and uneven shards, every shard-layout rule) against
the full, unsharded problem built from the same seed, and writes what it found to a file; the
parametrized tests below read one case each. Judged as the single-device tests are: the float64
reference (F.cross_entropy in float64, and F.linear for the linear form), with an error budget
set by PyTorch's own error in the same dtype; metrics exactly (num_correct) or within rounding;
loss and metrics bit-identical on every rank; each rank's gradient against its slice.

A group of one runs in this process (gloo on the CPU, NCCL for CUDA tensors), parametrized over
DEVICES: it must equal the plain op. The ops themselves get opcheck."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedce
import fusedce.distributed as fdist
from conftest import (DEVICES, HAS_CUDA, assert_within_budget, error_scales, make_problem,
                      make_weight, torch_cross_entropy)
from gloo_groups import failures_of, spawn_group

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

ops = torch.ops.fusedce

# Shards per world size: name -> (columns per rank, how the layout is told). Sizes that no vector
# width divides; "chunked" is torch.chunk's layout of V = sum (last rank smaller); "start_only"
# is the rule that derives V with a host-visible collective.
LAYOUTS = {
    2: {"even": [65, 65], "chunked": [66, 65], "explicit": [90, 41]},
    3: {"even": [43, 43, 43], "chunked": [43, 43, 42], "start_only": [60, 50, 17]},
}

# Cross-entropy cases: options of fusedce.cross_entropy, plus test flags (weight: class weights;
# dtype; shape of the rows; grad: upstream gradient 'rows' (random per row) or a factor;
# special: a problem built for one behaviour).
CE_CASES = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "zloss": {"z_loss": 1e-3},
    "softcap_scale": {"softcap": 5.0, "logit_scale": 1.3},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.2},
    "sum_upstream": {"reduction": "sum", "grad": 0.7},
    "none_upstream": {"reduction": "none", "grad": "rows"},
    "everything": {"weight": True, "label_smoothing": 0.1, "logit_scale": 0.8, "softcap": 8.0,
                   "z_loss": 1e-2, "ignore_index": 3, "reduction": "none", "grad": "rows"},
    "bf16_everything": {"dtype": torch.bfloat16, "weight": True, "label_smoothing": 0.1,
                        "softcap": 8.0, "z_loss": 1e-3, "grad": 1.5},
    "fp16_sum": {"dtype": torch.float16, "reduction": "sum", "label_smoothing": 0.05},
    "batch_seq_rows": {"shape": (3, 7), "weight": True},
    "argmax_ties_int32": {"special": "ties"},
    "every_row_ignored": {"special": "all_ignored", "reduction": "sum"},
    "forward_only": {"special": "no_grad", "label_smoothing": 0.1},
}

# Linear cases: options of fusedce.linear_cross_entropy plus test flags (bias; weight: class
# weights; dtype; shape; needs: which inputs require grad; chunk_rows: a chunk budget of about
# that many rows of this rank's logits, for the backends that chunk).
LINEAR_CASES = {
    "plain": {},
    "everything_shift": {"bias": True, "weight": True, "label_smoothing": 0.1, "softcap": 6.0,
                         "logit_scale": 1.2, "z_loss": 1e-3, "shift": True, "shape": (3, 9),
                         "reduction": "none", "grad": "rows"},
    "bf16_bias": {"dtype": torch.bfloat16, "bias": True, "label_smoothing": 0.1},
    "chunks_low_memory": {"bias": True, "reduction": "sum", "chunk_rows": 5, "low_memory": True,
                          "grad": 0.6},
    "fp16_skip_ignored": {"dtype": torch.float16, "weight": True, "z_loss": 1e-3, "skip_ignored": True,
                          "reduction": "sum", "needs": ("hidden", "weight")},
    "frozen_head": {"needs": ("hidden",)},
    "forward_only": {"needs": ()},
}

N_ROWS = 37
HIDDEN = 24


# ---- problems and references ---------------------------------------------------------------


def _split(sizes):
    """(start, stop) of each rank's columns."""
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def _layout_kwargs(layout, sizes, rank):
    """The keywords that tell fusedce this layout, as a user would pass them."""
    start = _split(sizes)[rank][0]
    if layout == "even":
        return {}
    if layout == "chunked":
        return {"vocab_total": sum(sizes)}
    if layout == "explicit":
        return {"vocab_start": start, "vocab_total": sum(sizes)}
    return {"vocab_start": start}


def _ce_problem(case, vocab, seed):
    """Full logits, target, class weights (or None), upstream gradient (or None), options."""
    opts = {k: v for k, v in case.items() if k not in ("weight", "dtype", "shape", "grad", "special")}
    dtype = case.get("dtype", torch.float32)
    shape = case.get("shape", (N_ROWS,))
    x, t = make_problem(shape, vocab, dtype, ignore_index=opts.get("ignore_index", -100), seed=seed)
    special = case.get("special")
    if special == "ties":
        # The row maximum twice, in the first and the last shard: argmax takes the lowest index.
        x = x.float()
        x[:, 1] = 30.0
        x[:, vocab - 2] = 30.0
        t[::2] = 1
        t[1::2] = vocab - 2
        t[::5] = -100
        x, t = x.to(dtype), t.to(torch.int32)
    elif special == "all_ignored":
        t = torch.full_like(t, opts.get("ignore_index", -100))
    w = make_weight(vocab) if case.get("weight") else None
    grad = case.get("grad")
    if grad == "rows":
        grad = torch.rand(t.shape, generator=torch.Generator().manual_seed(seed + 1)) + 0.5
    elif grad is not None:
        grad = torch.tensor(float(grad))
    return x, t, w, grad, opts


def _loss_and_grad(fn, x, grad, requires_grad=True):
    x = x.detach().clone().requires_grad_(requires_grad)
    out = fn(x)
    loss = out[0] if isinstance(out, tuple) else out
    if not requires_grad:
        return out, None
    g = torch.ones_like(loss) if grad is None else grad.to(loss.dtype)
    (dx,) = torch.autograd.grad(loss, x, g)
    return out, dx


def _z64(x, opts):
    z = x.double().reshape(-1, x.shape[-1]) * opts.get("logit_scale", 1.0)
    if opts.get("softcap"):
        z = opts["softcap"] * torch.tanh(z / opts["softcap"])
    return z


def _reference_metrics(z, t, ignore_index):
    """num_correct (argmax of float64 z, lowest index on ties), entropy_sum, lse (0 at ignored)."""
    t = t.reshape(-1).long()
    keep = t != ignore_index
    lse = torch.logsumexp(z, -1)
    entropy = (lse - (torch.softmax(z, -1) * z).sum(-1))[keep].sum()
    correct = (z.argmax(-1) == t)[keep].sum()
    return correct, entropy, torch.where(keep, lse, 0.0)


def _check_metrics(m, z, t, opts, what):
    correct, entropy, lse = _reference_metrics(z, t, opts.get("ignore_index", -100))
    assert m["num_correct_tokens"].item() == correct.item(), f"{what}: num_correct"
    keep = t.reshape(-1) != opts.get("ignore_index", -100)
    rows = (z.abs().max(-1).values + lse.abs() + 1)[keep]
    scale = rows.sum().item()
    assert_within_budget(m["entropy_sum"], None, entropy, what=f"{what}: entropy_sum", scale=scale)
    row_scale = rows.max().item() if keep.any() else 0.0
    assert_within_budget(m["lse"], None, lse, what=f"{what}: lse", scale=row_scale)


def _same_on_every_rank(values, what):
    """values (tensors) bit-identical on every rank of the default group."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [v.detach().cpu() for v in values])
    for r, theirs in enumerate(gathered):
        for a, b in zip(values, theirs):
            a = a.detach().cpu()
            bits = torch.int32 if a.dtype == torch.float32 else a.dtype
            assert torch.equal(a.view(bits), b.view(bits)), f"{what}: rank {r} differs"


def _run_ce_case(name, layout, sizes, rank, group):
    case = CE_CASES[name]
    vocab = sum(sizes)
    x, t, w, grad, opts = _ce_problem(case, vocab, seed=len(sizes) * 100 + len(name))
    v0, v1 = _split(sizes)[rank]
    w_local = w[v0:v1] if w is not None else None
    requires_grad = case.get("special") != "no_grad"

    def ours_fn(a):
        return fusedce.cross_entropy(a[..., v0:v1],
                                     t, w_local, process_group=group, return_metrics=True,
                                     **_layout_kwargs(layout, sizes, rank), **opts)

    (loss, metrics), dx = _loss_and_grad(ours_fn, x, grad, requires_grad)
    what = f"{name} on {layout} shards {sizes}, rank {rank}"
    _same_on_every_rank([loss, metrics["num_correct_tokens"], metrics["entropy_sum"], metrics["lse"]], what)

    ref_grad = None if grad is None else grad.double()
    ref, ref_dx = _loss_and_grad(
        lambda a: torch_cross_entropy(a, t.long(), w, compute_dtype=torch.float64, **opts), x, ref_grad)
    theirs, their_dx = _loss_and_grad(lambda a: torch_cross_entropy(a, t.long(), w, **opts), x, grad)
    loss_scale, grad_scale = error_scales(x, t.long(), w, **opts, grad_out=grad)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape, what
    assert_within_budget(loss, theirs, ref, what=f"{what}: loss", scale=loss_scale)
    _check_metrics(metrics, _z64(x, opts), t, opts, what)
    if requires_grad:
        assert dx.dtype == x.dtype and dx.shape == x.shape, what
        assert_within_budget(dx[..., v0:v1], their_dx[..., v0:v1], ref_dx[..., v0:v1],
                             what=f"{what}: grad", scale=grad_scale, out_dtype=x.dtype)
        outside = torch.cat([dx[..., :v0], dx[..., v1:]], -1)
        assert not outside.any(), f"{what}: gradient outside this rank's columns"


def _linear_problem(case, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = case.get("dtype", torch.float32)
    shape = case.get("shape", (N_ROWS,))
    h = (torch.randn(*shape, HIDDEN, generator=g) * 0.7).to(dtype)
    wt = (torch.randn(vocab, HIDDEN, generator=g) * 0.7).to(dtype)
    b = (torch.randn(vocab, generator=g)).to(dtype) if case.get("bias") else None
    t = torch.randint(0, vocab, shape, generator=g)
    t[torch.rand(shape, generator=g) < 0.2] = -100
    cw = make_weight(vocab) if case.get("weight") else None
    grad = case.get("grad")
    if grad == "rows":
        grad = torch.rand(shape, generator=g) + 0.5
    elif grad is not None:
        grad = torch.tensor(float(grad))
    opts = {k: case[k] for k in ("label_smoothing", "softcap", "logit_scale", "z_loss", "reduction")
            if k in case}
    return h, wt, b, t, cw, grad, opts


def _linear_loss_and_grads(fn, inputs, needs, grad):
    """fn(*leaves) and the gradients of the inputs named in `needs` (None for the others)."""
    names = ("hidden", "weight", "bias")
    leaves = [None if x is None else x.detach().clone().requires_grad_(n in needs)
              for n, x in zip(names, inputs)]
    out = fn(*leaves)
    loss = out[0] if isinstance(out, tuple) else out
    wanted = [x for n, x in zip(names, leaves) if x is not None and n in needs]
    if not wanted:
        return out, [None] * 3
    g = torch.ones_like(loss) if grad is None else grad.to(loss.dtype)
    got = iter(torch.autograd.grad(loss, wanted, g))
    return out, [next(got) if x is not None and n in needs else None for n, x in zip(names, leaves)]


def _shift(t):
    return torch.cat([t[..., 1:], torch.full_like(t[..., :1], -100)], -1)


def _run_linear_case(name, layout, sizes, rank, group):
    case = LINEAR_CASES[name]
    vocab = sum(sizes)
    h, wt, b, t, cw, grad, opts = _linear_problem(case, vocab, seed=len(sizes) * 1000 + len(name))
    v0, v1 = _split(sizes)[rank]
    needs = case.get("needs", ("hidden", "weight", "bias"))
    local = sizes[rank]
    kw = dict(opts, shift=case.get("shift", False), low_memory=case.get("low_memory", False),
              skip_ignored=case.get("skip_ignored", False),
              class_weight=cw[v0:v1] if cw is not None else None,
              **_layout_kwargs(layout, sizes, rank))
    if "chunk_rows" in case:
        kw["chunk_budget_bytes"] = h.element_size() * local * case["chunk_rows"]
    (loss, metrics), (gh, gw, gb) = _linear_loss_and_grads(
        lambda hh, ww, bb: fusedce.linear_cross_entropy(
            hh, ww[v0:v1], t, None if bb is None else bb[v0:v1], process_group=group,
            return_metrics=True, **kw),
        (h, wt, b), needs, grad)
    what = f"linear {name} on {layout} shards {sizes}, rank {rank}"
    _same_on_every_rank([loss, metrics["num_correct_tokens"], metrics["entropy_sum"]] +
                        ([gh] if gh is not None else []), what)

    tt = _shift(t) if case.get("shift") else t

    def reference(dtype):
        def fn(hh, ww, bb):
            z = F.linear(hh.to(dtype), ww.to(dtype), None if bb is None else bb.to(dtype))
            return torch_cross_entropy(z, tt, cw, compute_dtype=dtype, **opts)
        return fn

    ref_grad = None if grad is None else grad.double()
    ref, ref_g = _linear_loss_and_grads(reference(torch.float64), (h, wt, b), needs, ref_grad)
    theirs, their_g = _linear_loss_and_grads(reference(h.dtype), (h, wt, b), needs, grad)
    z64 = F.linear(h.double(), wt.double(), None if b is None else b.double())
    loss_scale, dz_scale = error_scales(z64, tt, cw, **opts, grad_out=grad)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape, what
    assert_within_budget(loss, theirs, ref, what=f"{what}: loss", scale=loss_scale)
    _check_metrics(metrics, _z64(z64, opts), tt, opts, what)
    h2, w2 = h.double().reshape(-1, HIDDEN).abs(), wt.double().abs()
    # A gradient entry sums N or V entries of dz, each within about dz_scale's rounding.
    scales = {"hidden": dz_scale * w2.sum(0).max().item(), "weight": dz_scale * h2.sum(0).max().item(),
              "bias": dz_scale * h2.shape[0]}
    cols = {"hidden": (...,), "weight": (slice(v0, v1),), "bias": (slice(v0, v1),)}
    for n, ours, r, th in zip(("hidden", "weight", "bias"), (gh, gw, gb), ref_g, their_g):
        if r is None:
            assert ours is None, f"{what}: grad {n} formed but not asked for"
            continue
        assert ours.dtype == h.dtype and ours.shape == r.shape, f"{what}: grad {n}"
        assert_within_budget(ours[cols[n]], th[cols[n]], r[cols[n]], what=f"{what}: grad {n}",
                             scale=scales[n], out_dtype=h.dtype)


def _run_compile_case(group):
    """torch.compile(fullgraph=True) of a step that calls the vocabulary-parallel loss, forward
    and backward: no graph break, the same numbers as eager."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = LAYOUTS[world]["even"]
    v0, v1 = _split(sizes)[rank]
    x, t = make_problem((N_ROWS,), sum(sizes), seed=11)

    def step(logits, target):
        return fusedce.cross_entropy(logits, target, process_group=group, label_smoothing=0.1,
                                     z_loss=1e-4, softcap=30.0) * 3.0

    torch._dynamo.reset()
    eager = _loss_and_grad(lambda a: step(a, t), x[:, v0:v1], None)
    compiled_step = torch.compile(step, fullgraph=True)
    compiled = _loss_and_grad(lambda a: compiled_step(a, t), x[:, v0:v1], None)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _run_compile_linear_case(group):
    """The linear form under torch.compile(fullgraph=True): chunk loops and collectives traced
    without a graph break (aot_eager: the tracing is what can break; inductor's code generation
    for these graphs is the logits form's case above)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = LAYOUTS[world]["chunked"]
    v0, v1 = _split(sizes)[rank]
    h, wt, b, t, cw, _, _ = _linear_problem({"bias": True, "shape": (2, 9)}, sum(sizes), seed=12)

    def step(hh, ww, bb):
        return fusedce.vocab_parallel_linear_cross_entropy(
            hh, ww[v0:v1], t, bb[v0:v1], process_group=group, vocab_total=sum(sizes), shift=True,
            z_loss=1e-3, chunk_budget_bytes=8 * sizes[rank] * 5)

    torch._dynamo.reset()
    needs = ("hidden", "weight", "bias")
    eager = _linear_loss_and_grads(step, (h, wt, b), needs, None)
    compiled = _linear_loss_and_grads(torch.compile(step, fullgraph=True, backend="aot_eager"),
                                      (h, wt, b), needs, None)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


# ---- the spawned groups ---------------------------------------------------------------------


def _all_case_keys(world):
    keys = [f"ce/{layout}/{name}" for layout in LAYOUTS[world] for name in CE_CASES]
    keys += [f"linear/{layout}/{name}" for layout in LAYOUTS[world] for name in LINEAR_CASES]
    if world == 2:
        keys += ["compile", "compile_linear"]
    return keys


def _run_key(key, group, rank, world):
    if key == "compile":
        return _run_compile_case(group)
    if key == "compile_linear":
        return _run_compile_linear_case(group)
    form, layout, name = key.split("/")
    run = _run_ce_case if form == "ce" else _run_linear_case
    return run(name, layout, LAYOUTS[world][layout], rank, group)


_GROUP_RESULTS = {}


def _group_results(world, tmp_path_factory):
    """Every rank's findings for every case of a world size: one spawned group per world size
    (a spawn costs seconds), run on first use."""
    if world not in _GROUP_RESULTS:
        _GROUP_RESULTS[world] = spawn_group(world, _all_case_keys(world), _run_key,
                                            tmp_path_factory, timeout_s=120, deadline_s=600)
    return _GROUP_RESULTS[world]


@pytest.mark.parametrize("world,key", [(w, k) for w in LAYOUTS for k in _all_case_keys(w)],
                         ids=lambda v: str(v))
def test_group(world, key, tmp_path_factory):
    failures = failures_of(_group_results(world, tmp_path_factory), key)
    assert not failures, failures


# ---- a group of one, in this process ----------------------------------------------------------


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    """The default group, of one rank: gloo for CPU tensors, NCCL for CUDA ones."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    backend = "cpu:gloo,cuda:nccl" if HAS_CUDA and dist.is_nccl_available() else "gloo"
    store = tmp_path_factory.mktemp("group_of_one") / "store"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _needs_vp_kernels(device):
    """The CUDA kernels of the vocabulary-parallel ops come with the core's CUDA backend for
    them; until then a CUDA case has nothing to run."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    if device == "cuda" and not has_kernel("fusedce::ce_shard_stats", "CUDA"):
        pytest.skip("the vocabulary-parallel ops have no CUDA kernels in this build yet")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["plain", "everything"])
def test_group_of_one_equals_plain_op(device, dtype, name, group_of_one):
    _needs_vp_kernels(device)
    case = CE_CASES[name]
    x, t, w, grad, opts = _ce_problem(case, 301, seed=3)
    x, t = x.to(dtype).to(device), t.to(device)
    w = w.to(device) if w is not None else None
    grad = grad.to(device) if grad is not None else None
    (loss, m), dx = _loss_and_grad(
        lambda a: fusedce.cross_entropy(a, t, w, process_group=group_of_one, return_metrics=True,
                                        **opts), x, grad)
    (ref, ref_m), ref_dx = _loss_and_grad(
        lambda a: fusedce.cross_entropy(a, t, w, return_metrics=True, **opts), x, grad)
    torch.testing.assert_close(loss, ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=2e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert m["num_correct_tokens"].item() == ref_m["num_correct_tokens"].item()
    torch.testing.assert_close(m["entropy_sum"], ref_m["entropy_sum"], rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(m["lse"], ref_m["lse"], rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_group_of_one_linear(device, group_of_one):
    _needs_vp_kernels(device)
    g = torch.Generator().manual_seed(8)
    h = torch.randn(2, 11, HIDDEN, generator=g).to(device)
    wt = torch.randn(97, HIDDEN, generator=g).to(device)
    b = torch.randn(97, generator=g).to(device)
    t = torch.randint(0, 97, (2, 11), generator=g).to(device)
    opts = dict(label_smoothing=0.1, z_loss=1e-3)
    (loss, m), (gh, gw, gb) = _linear_loss_and_grads(
        lambda hh, ww, bb: fusedce.vocab_parallel_linear_cross_entropy(
            hh, ww, t, bb, process_group=group_of_one, shift=True, return_metrics=True, **opts),
        (h, wt, b), ("hidden", "weight", "bias"), None)
    ref, ref_g = _linear_loss_and_grads(
        lambda hh, ww, bb: fusedce.cross_entropy(F.linear(hh, ww, bb), _shift(t), **opts),
        (h, wt, b), ("hidden", "weight", "bias"), None)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip((gh, gw, gb), ref_g):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_group_of_one_linear_skip_ignored(device, reduction, group_of_one):
    """skip_ignored in the vocabulary-parallel form (the rows gathered by the front end, on
    CUDA too): the loss, lse and gradients of the call over every row, 0 at ignored rows."""
    _needs_vp_kernels(device)
    g = torch.Generator().manual_seed(9)
    h = torch.randn(3, 13, HIDDEN, generator=g).to(device)
    wt = torch.randn(97, HIDDEN, generator=g).to(device)
    b = torch.randn(97, generator=g).to(device)
    t = torch.randint(0, 97, (3, 13), generator=g)
    t[0, :9] = -100  # a prompt-masked sequence
    t[2, 4] = -100
    t = t.to(device)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, reduction=reduction)
    grad = torch.rand(3, 13, generator=g).to(device) if reduction == "none" else None

    def call(skip):
        return _linear_loss_and_grads(
            lambda hh, ww, bb: fusedce.vocab_parallel_linear_cross_entropy(
                hh, ww, t, bb, process_group=group_of_one, shift=True, return_metrics=True,
                skip_ignored=skip, **opts),
            (h, wt, b), ("hidden", "weight", "bias"), grad)

    (loss, m), grads = call(True)
    (ref, ref_m), ref_grads = call(False)
    assert loss.shape == ref.shape
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["lse"], ref_m["lse"], rtol=1e-5, atol=1e-6)
    assert m["num_correct_tokens"] == ref_m["num_correct_tokens"]
    torch.testing.assert_close(m["entropy_sum"], ref_m["entropy_sum"], rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    ignored = _shift(t) == -100
    assert (grads[0][ignored] == 0).all() and (m["lse"].view(3, 13)[ignored] == 0).all()


def test_the_core_applies_shift_and_skip_ignored(monkeypatch, group_of_one):
    """The front end hands every shard step the targets as the user gave them and the call's
    linear options, shift and skip_ignored included: the core applies both (one implementation
    for one device and for shards). Planting a copy of the shift or a gathering of the rows in
    the front end fails this test."""
    from fusedce import distributed as dist_mod
    seen = []

    class Spy:
        def __getattr__(self, name):
            op = getattr(ops, name)
            if not name.startswith("lce_shard_"):
                return op

            def call(*args):
                seen.append((name, args[0].shape[0], args[3 if name != "lce_shard_merge" else 1].tolist(),
                             args[-5:-1] if name != "lce_shard_bwd" else args[-7:-3]))
                return op(*args)
            return call

    monkeypatch.setattr(dist_mod, "ops", Spy())
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, HIDDEN, generator=g, requires_grad=True)
    t = torch.tensor([1, -100, 2, -100, 3, 4])
    loss = fusedce.vocab_parallel_linear_cross_entropy(h, torch.randn(11, HIDDEN, generator=g), t,
                                                       process_group=group_of_one, shift=True,
                                                       skip_ignored=True, chunk_budget_bytes=4096)
    loss.backward()
    linear = (6, 4096, False, True)
    assert seen == [("lce_shard_stats", 6, t.tolist(), linear), ("lce_shard_merge", seen[1][1], t.tolist(), linear),
                    ("lce_shard_bwd", 6, t.tolist(), linear)]


def test_group_of_one_module(group_of_one):
    x, t = make_problem((4, 5), 50, ignore_index=7)
    loss_fn = fusedce.CrossEntropyLoss(ignore_index=7, label_smoothing=0.05, process_group=group_of_one)
    assert "process_group" in repr(loss_fn)
    theirs = F.cross_entropy(x.reshape(-1, 50), t.reshape(-1), ignore_index=7, label_smoothing=0.05)
    torch.testing.assert_close(loss_fn(x, t), theirs)


def test_empty_batch(group_of_one):
    x = torch.randn(0, 17, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long)
    assert fusedce.cross_entropy(x, t, reduction="sum", process_group=group_of_one).item() == 0.0
    loss = fusedce.cross_entropy(x, t, process_group=group_of_one)
    assert torch.isnan(loss)
    loss.backward()
    assert x.grad.shape == (0, 17)
    h = torch.randn(0, 5, requires_grad=True)
    out = fusedce.vocab_parallel_linear_cross_entropy(h, torch.randn(17, 5), t, reduction="sum",
                                                      process_group=group_of_one)
    out.backward()
    assert out.item() == 0.0 and h.grad.shape == (0, 5)


def _count_collectives(monkeypatch):
    """Record every collective fusedce.distributed issues: (kind, shape)."""
    calls = []
    gather, reduce, host_reduce = fdist._all_gather_rows, fdist._all_reduce_sum, dist.all_reduce

    def counted(kind, fn):
        def wrapper(t, *args, **kwargs):
            calls.append((kind, tuple(t.shape)))
            return fn(t, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(fdist, "_all_gather_rows", counted("all_gather", gather))
    monkeypatch.setattr(fdist, "_all_reduce_sum", counted("all_reduce", reduce))
    monkeypatch.setattr(dist, "all_reduce", counted("host_all_reduce", host_reduce))
    return calls


def test_communication_pattern(group_of_one, monkeypatch):
    # Per call: one all-gather of (N + 1, 9) statistics in the forward; nothing in the backward of
    # the logits form; one all-reduce of the (N, H) grad_hidden in the backward of the linear
    # form; one more, of (2, R) integers (sizes and error codes), only for vocab_start without
    # vocab_total.
    calls = _count_collectives(monkeypatch)
    x, t = make_problem((4, 5), 50)
    x.requires_grad_()
    loss = fusedce.cross_entropy(x, t, process_group=group_of_one, label_smoothing=0.1)
    assert calls == [("all_gather", (21, 9))]
    loss.backward()
    assert calls == [("all_gather", (21, 9))]
    calls.clear()
    fusedce.cross_entropy(x, t, process_group=group_of_one, vocab_start=0)
    assert calls == [("host_all_reduce", (2, 1)), ("all_gather", (21, 9))]
    calls.clear()
    h, wt = torch.randn(20, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    loss = fusedce.vocab_parallel_linear_cross_entropy(h, wt, t.reshape(-1), process_group=group_of_one,
                                                       chunk_budget_bytes=8 * 50 * 3)  # 7 chunks
    loss.backward()
    assert calls == [("all_gather", (21, 9)), ("all_reduce", (20, 8))]
    calls.clear()
    h.grad = None
    h.requires_grad_(False)
    loss = fusedce.vocab_parallel_linear_cross_entropy(h, wt, t.reshape(-1), process_group=group_of_one)
    loss.backward()
    assert calls == [("all_gather", (21, 9))], "no all-reduce when hidden needs no gradient"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and a CUDA build")
def test_no_host_sync_on_cuda(group_of_one):
    _needs_vp_kernels("cuda")
    x, t = make_problem((64,), 1000, torch.bfloat16, "cuda")
    w = make_weight(1000, "cuda")
    h = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(1000, 32, device="cuda", dtype=torch.bfloat16)

    def step():
        a = x.detach().requires_grad_()
        fusedce.cross_entropy(a, t, w, process_group=group_of_one, label_smoothing=0.1,
                              vocab_total=1000, return_metrics=True)[0].backward()
        hh, ww = h.detach().requires_grad_(), wt.detach().requires_grad_()
        fusedce.vocab_parallel_linear_cross_entropy(hh, ww, t, process_group=group_of_one,
                                                    class_weight=w).backward()

    step()  # communicators and allocator warm
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- bad input ------------------------------------------------------------------------------


def test_bad_layout_and_arguments_are_named(group_of_one):
    x, t = make_problem((6,), 20)
    pg = group_of_one
    with pytest.raises(TypeError, match="process_group"):
        fusedce.cross_entropy(x, t, process_group="world")
    with pytest.raises(ValueError, match="vocab_start"):
        fusedce.cross_entropy(x, t, process_group=pg, vocab_start=5, vocab_total=20)
    with pytest.raises(ValueError, match="vocab_total=30"):
        fusedce.cross_entropy(x, t, process_group=pg, vocab_total=30)
    with pytest.raises(TypeError, match="vocab_start"):
        fusedce.cross_entropy(x, t, process_group=pg, vocab_start=0.0)
    with pytest.raises(ValueError, match="inplace_backward"):
        fusedce.cross_entropy(x.requires_grad_(), t, process_group=pg, inplace_backward=True)
    with pytest.raises(ValueError, match="weight"):
        fusedce.cross_entropy(x, t, torch.ones(21), process_group=pg)
    bad = t.clone()
    bad[2] = 25  # a global index beyond the full vocabulary
    with pytest.raises(ValueError, match=r"target\[2\] = 25"):
        fusedce.cross_entropy(x, bad, process_group=pg, vocab_start=0, vocab_total=24)
    with pytest.raises(ValueError, match="process_group is required"):
        fusedce.vocab_parallel_cross_entropy(x, t, process_group=None)
    h, wt = torch.randn(6, 4), torch.randn(20, 4)
    linear = fusedce.vocab_parallel_linear_cross_entropy
    with pytest.raises(ValueError, match="weight must have shape"):
        linear(h, torch.randn(20, 5), t, process_group=pg)
    with pytest.raises(ValueError, match="bias"):
        linear(h, wt, t, torch.randn(19), process_group=pg)
    with pytest.raises(ValueError, match="class_weight"):
        linear(h, wt, t, class_weight=torch.ones(21), process_group=pg)
    with pytest.raises(ValueError, match="target"):
        linear(h, wt, t[:5], process_group=pg)
    with pytest.raises(ValueError, match="reduction"):
        linear(h, wt, t, process_group=pg, reduction="avg")
    with pytest.raises(ValueError, match="weight must have hidden's dtype"):
        linear(h, wt.double(), t, process_group=pg)


def test_check_targets_and_option_checks_with_process_group(group_of_one, monkeypatch):
    # check_targets=True checks against the full vocabulary before the shard ops run (the ops
    # are made to fail here: it is the Python check, the one a GPU gets, that names the entry);
    # the options are checked as on one device.
    x, t = make_problem((6,), 20)
    pg = group_of_one
    bad = t.clone()
    bad[1], bad[4] = 24, 30  # 24 < vocab_total
    monkeypatch.setattr(fdist.ops, "ce_shard_stats", None, raising=False)
    with pytest.raises(ValueError, match=r"target\[4\] = 30 is out of range \[0, 25\)"):
        fusedce.cross_entropy(x, bad, process_group=pg, vocab_start=0, vocab_total=25,
                              check_targets=True)
    h, wt = torch.randn(2, 3, 4), torch.randn(20, 4)
    bad = torch.randint(0, 20, (2, 3))
    bad[0, 0], bad[1, 1] = 99, 21
    with pytest.raises(ValueError, match=r"target\[4\] = 21 is out of range \[0, 20\)"):
        fusedce.linear_cross_entropy(h, wt, bad, shift=True, check_targets=True, process_group=pg)
    monkeypatch.undo()
    bad[1, 1] = 3  # only the entry no row reads (the first of a sequence) is out of range
    fusedce.linear_cross_entropy(h, wt, bad, shift=True, check_targets=True, process_group=pg)
    for kw, exc in (({"softcap": 1e-50}, ValueError), ({"ignore_index": 3.7}, TypeError),
                    ({"z_loss": 1e-45}, ValueError)):
        with pytest.raises(exc, match=next(iter(kw))):
            fusedce.cross_entropy(x, t, process_group=pg, **kw)
        with pytest.raises(exc, match=next(iter(kw))):
            fusedce.vocab_parallel_linear_cross_entropy(h, wt, bad, process_group=pg, **kw)


# ---- the ops ----------------------------------------------------------------------------------


def _shard_op_args(device, weighted, reduction, n=13, sizes=(40, 27)):
    """Two shards of one problem on one process: their stats, gathered in rank order."""
    vocab = sum(sizes)
    x, t = make_problem((n,), vocab, device=device, seed=6)
    w = make_weight(vocab, device) if weighted else None
    opts = (-100, reduction, 0.1, 1.1, 9.0, 1e-3)
    shards = []
    for v0, v1 in _split(list(sizes)):
        wl = w[v0:v1] if w is not None else None
        shards.append((x[:, v0:v1].contiguous(), wl, (v0, vocab)))
    return shards, t, opts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("metrics", [False, True])
def test_opcheck(device, weighted, reduction, metrics):
    _needs_vp_kernels(device)
    shards, t, opts = _shard_op_args(device, weighted, reduction)
    stats = []
    for x, w, shard in shards:
        args = (x, t, w, *shard, *opts, metrics)
        torch.library.opcheck(ops.ce_shard_stats.default, args)
        stats.append(ops.ce_shard_stats(*args))
    gathered = torch.cat(stats)
    x, w, shard = shards[1]
    merge_args = (gathered, t, w, *shard, *opts, metrics)
    torch.library.opcheck(ops.ce_shard_merge.default, merge_args)
    loss, lse, _, _, row_weight, batch = ops.ce_shard_merge(*merge_args)
    grad = torch.rand(loss.shape, device=device) + 0.5
    torch.library.opcheck(ops.ce_shard_bwd.default,
                          (x, t, w, lse, row_weight, batch, grad, *shard, *opts))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("metrics", [False, True])
# shift_seq_len, chunk_budget_bytes (0: the default), low_memory, skip_ignored
@pytest.mark.parametrize("linear", [(0, 0, False, False), (13, 0, False, True)], ids=["plain", "shift_skip"])
def test_lce_opcheck(device, with_bias, metrics, linear):
    """The linear form's ops: lce_shard_stats on each of two shards of a head, their merge
    (lce_shard_merge), then lce_shard_bwd, each through torch.library.opcheck (schema, fake
    kernel, autograd registration)."""
    _needs_vp_kernels(device)
    g = torch.Generator().manual_seed(9)
    n, h, sizes = 13, 16, (40, 27)
    vocab = sum(sizes)
    hidden = torch.randn(n, h, generator=g).to(device)
    weight = (torch.randn(vocab, h, generator=g) * 0.3).to(device)
    bias = torch.randn(vocab, generator=g).to(device) if with_bias else None
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    t[3] = -100
    opts = (-100, "mean", 0.1, 1.1, 9.0, 1e-3)
    stats, parts = [], []
    for v0, v1 in _split(list(sizes)):
        args = (hidden, weight[v0:v1].contiguous(), bias[v0:v1].contiguous() if with_bias else None, t, None,
                v0, vocab, *opts, *linear, metrics)
        torch.library.opcheck(ops.lce_shard_stats.default, args)
        stats.append(ops.lce_shard_stats(*args))
        parts.append(args)
    merge_args = (torch.cat(stats), t, None, 0, vocab, *opts, *linear, metrics)
    torch.library.opcheck(ops.lce_shard_merge.default, merge_args)
    merged = ops.lce_shard_merge(*merge_args)
    lse, row_weight, batch = merged[1], merged[4], merged[5]
    grad = torch.tensor(1.5, device=device)
    hid, w, b, *_ = parts[1]
    torch.library.opcheck(ops.lce_shard_bwd.default,
                          (hid, w, b, t, None, lse, row_weight, batch, grad, sizes[0], vocab, *opts, *linear,
                           True, True, with_bias))


def test_merge_names_a_bad_gathered_block():
    shards, t, opts = _shard_op_args("cpu", False, "mean")
    x, w, shard = shards[0]
    stats = ops.ce_shard_stats(x, t, w, *shard, *opts, False)
    with pytest.raises(ValueError, match="gathered"):
        ops.ce_shard_merge(stats[:-1], t, w, *shard, *opts, False)
    with pytest.raises(ValueError, match="gathered"):
        ops.ce_shard_merge(stats.double(), t, w, *shard, *opts, False)


# ---- agreement: the shards tile the vocabulary, and one rank's error is every rank's --------------

# 131 columns split unevenly; "overlap" / "missing" move the last rank's start by -5 / +4.
_AGREE_SIZES = {2: (66, 65), 3: (45, 44, 42)}
_AGREE_KEYS = ("uneven_default/ce", "uneven_default/linear", "overlap/ce", "missing/linear",
               "error_one_rank/ce", "error_one_rank/linear", "error_summed_rule/ce",
               "error_after_summed/linear")


def _agree_problem(world, rank, seed=11):
    sizes = _AGREE_SIZES[world]
    vocab = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N_ROWS, vocab, generator=g)
    t = torch.randint(0, vocab, (N_ROWS,), generator=g)
    h = torch.randn(N_ROWS, HIDDEN, generator=g)
    w = torch.randn(vocab, HIDDEN, generator=g) / 4
    lo, hi = _split(sizes)[rank]
    return sizes, vocab, z, t, h, w, lo, hi


def _run_agree_case(key, group, rank, world):
    """Every rank must raise (the expected error on each), then a correct call must give the
    true loss: no rank went on with another call's statistics."""
    sizes, vocab, z, t, h, w, lo, hi = _agree_problem(world, rank)
    name, form = key.split("/")
    last = rank == world - 1
    ce = lambda **kw: fusedce.cross_entropy(z[:, lo:hi], t, process_group=group, **kw)  # noqa: E731
    lin = lambda **kw: fusedce.vocab_parallel_linear_cross_entropy(  # noqa: E731
        h, w[lo:hi], t, process_group=group, **kw)
    run = ce if form == "ce" else lin
    agreed = r"rank 1 \((ValueError|TypeError)\) of %d rejected its arguments" % world
    if name == "uneven_default":
        # Either the tiling error, or (a rank's targets beyond its assumed V) the agreed one.
        with pytest.raises(ValueError, match=r"do not tile.*rank 0 holds \[0, %d\).*same number|"
                           r"rejected its arguments|out of range" % sizes[0]):
            run()
    elif name in ("overlap", "missing"):
        shift = -5 if name == "overlap" else 4
        last_start = _split(sizes)[-1][0] + shift
        with pytest.raises(ValueError, match=r"do not tile.*rank %d holds \[%d, "
                           % (world - 1, last_start)):
            run(vocab_start=lo + shift * last, vocab_total=vocab + max(shift, 0))
    elif name == "error_one_rank":
        bad = {"weight": torch.ones(hi - lo + 1)} if form == "ce" else {
            "class_weight": torch.ones(hi - lo + 1)}
        with pytest.raises(ValueError, match="weight" if rank == 1 else agreed):
            if form == "ce":
                fusedce.cross_entropy(z[:, lo:hi], t, process_group=group, vocab_start=lo,
                                      vocab_total=vocab, **(bad if rank == 1 else {}))
            else:
                lin(vocab_start=lo, vocab_total=vocab, **(bad if rank == 1 else {}))
    elif name == "error_summed_rule":  # vocab_total summed by an all-reduce before the gather
        with pytest.raises(TypeError if rank == 1 else ValueError,
                           match="ignore_index" if rank == 1 else agreed):
            run(vocab_start=lo, ignore_index=3.5 if rank == 1 else -100)
    elif name == "error_after_summed":  # rank 1's start is only found wrong once V is known
        with pytest.raises(ValueError, match="vocab_start" if rank == 1 else agreed):
            run(vocab_start=vocab if rank == 1 else lo)
    # The next call of the group is right on every rank.
    got = run(vocab_start=lo, vocab_total=vocab)
    logits = z if form == "ce" else h @ w.t()
    want = torch.nn.functional.cross_entropy(logits.double(), t).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


_AGREE_RESULTS = {}


def _agree_results(world, tmp_path_factory):
    if world not in _AGREE_RESULTS:
        # A short collective timeout: a rank left waiting fails the case instead of hanging.
        _AGREE_RESULTS[world] = spawn_group(world, _AGREE_KEYS, _run_agree_case, tmp_path_factory,
                                            timeout_s=20, deadline_s=150)
    return _AGREE_RESULTS[world]


@pytest.mark.parametrize("world,key", [(w, k) for w in _AGREE_SIZES for k in _AGREE_KEYS],
                         ids=lambda v: str(v))
def test_group_agrees(world, key, tmp_path_factory):
    failures = failures_of(_agree_results(world, tmp_path_factory), key)
    assert not failures, failures
