"""fusedce.linear_distillation over a vocabulary-parallel pair of heads (``process_group=``):
gloo groups of 1, 2 and 3 ranks with uneven shards of V = 37 (19 / 18, 13 / 12 / 12),
each rank holding the same rows of both heads' weights and biases.

Every case runs on every rank and checks, for each of divergence beta 0 / 0.5 / 1, temperatures,
the hard-loss mix (labels falling on every rank), ignored rows, each head's transform, the three
reductions and several chunks:
  * against the single-device call on the whole heads: values within twice the float32 budget
    of test_distillation.py (_value_tol, per entry, of max(1, |value|)): both calls are float32
    computations of the same value, but not the same bits (the global log-sum-exps are folded
    from the ranks' partial states, each rounded to float32, where the single device sums in
    double: each entry's log-probability s_j = z_j - lse then rounds differently, and a
    divergence of a few nats moves by a few of its own roundoffs); gradients within 1e-5
    relative (1e-6 absolute) in float32, the dtype's unit roundoff in bfloat16 (grad_hidden's
    float32 parts are summed over ranks before its one rounding);
  * against test_distillation.py's float64 reference, with its written tolerances (_value_tol,
    _grad_tol), each rank's gradients against its rows of the reference's;
  * the loss, the metrics and grad_hidden bit for bit the same on every rank.
N = 0, every row ignored, and the agreement of the ranks on a bad argument (one rank's, or every
rank's) are cases of their own.

fusedce.linear_distillation_topk over a vocabulary-parallel student head (its ids global, whole on
every rank) is checked the same way (TOPK_CONFIGS: each topk_norm, beta 0 / 0.5 / 1, repeated ids,
absent entries, K = V, several chunks), its float64 reference test_distillation.py's
reference_topk, its gradient tolerances times test_distillation.py's top-k amplification
1 + max |t| (the entries' gradients carry e^s's rounding times |s - t|). The single-device file's tolerance helpers are imported, not
copied.

Planted bugs (each seen to fail, then reverted): a label kept as its global index on its shard
(build_problem in src/cpu/distill_cpu.cpp not subtracting vocab_start) fails every hard-mix case
of 2 and 3 ranks; a 1e-5 relative error on step 4's divergence fails every case's float64
comparison on 1, 2 and 3 ranks; step 5 of the top-k form summing dD/dq over the shard's own ids
only fails every top-k case of 2 and 3 ranks (C++ test_distill_vp.cpp's plant, seen there)."""

import math

import pytest
import torch
import torch.distributed as dist

import fusedce
from fusedce._distill_options import NAMES
from conftest import requires_cuda
from gloo_groups import failures_of, spawn_group
from test_distillation import IGNORE, _grad_tol, _problem, _topk_teacher, _value_tol, reference_full, reference_topk

VOCAB, HID, HID_T, ROWS = 37, 12, 9, 13
# Against the single-device call (see the module's docstring).
SAME_GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2.0 ** -8, atol=1e-3)}

# (dtype, beta, temperature, hard_weight, bias, reduction, labels, transforms, chunk_budget_bytes)
CONFIGS = [
    (torch.float32, 0.0, 1.0, 0.0, True, "mean", True, False, None),
    (torch.float32, 0.5, 0.7, 0.3, True, "mean", True, False, None),
    (torch.float32, 1.0, 1.5, 0.3, False, "none", True, True, None),
    (torch.bfloat16, 0.5, 1.0, 0.5, True, "sum", True, False, None),
    (torch.float32, 0.3, 1.2, 0.0, False, "sum", False, True, 2 * 3 * 19 * 4),  # several chunks, no labels
    (torch.float32, 1.0, 0.9, 1.0, True, "mean", True, False, None),  # the hard term alone
    (torch.float32, 0.0, 2.0, 0.6, True, "none", True, True, None),
]
TRANSFORMS = dict(student_logit_scale=0.8, student_softcap=6.0, teacher_logit_scale=1.3, teacher_softcap=9.0)
REF_TRANSFORMS = dict(s_scale=0.8, s_cap=6.0, t_scale=1.3, t_cap=9.0)


def _shards(vocab, world):
    """Each rank's [v0, v1): uneven blocks, the first ranks one row larger."""
    sizes = [vocab // world + (1 if r < vocab % world else 0) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    return [(s, s + z) for s, z in zip(starts, sizes)]


def _leaf(x):
    return None if x is None else x.detach().clone().requires_grad_(True)


def _same_on_every_rank(group, world, *tensors):
    """Every tensor bit for bit equal to rank 0's."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=group)
    for r, g in enumerate(gathered):
        assert torch.equal(g.nan_to_num(123.0), gathered[0].nan_to_num(123.0)), f"rank {r} differs from rank 0"


def _same_values(got, want, what):
    """got within twice the float32 budget of test_distillation.py's _value_tol of want, entry by
    entry (each is within one budget of the exact value)."""
    atol = 2 * _value_tol(HID, HID_T, VOCAB, 1.0) * want.abs().clamp(min=1.0)
    bad = ~((got - want).abs() <= atol) & ~(got.isnan() & want.isnan())
    assert not bad.any(), f"{what}: {got[bad].tolist()} against {want[bad].tolist()} (atol {atol[bad].tolist()})"


def _run(hs, ws, bs, ht, wt, bt, labels, kw, **parallel):
    """loss, metrics and the (hidden, weight, bias) leaves after backward of a weighted sum."""
    leaves = [_leaf(x) for x in (hs, ws, bs)]
    loss, metrics = fusedce.linear_distillation(leaves[0], leaves[1], ht, wt, labels, student_bias=leaves[2],
                                                teacher_bias=bt, return_metrics=True, **kw, **parallel)
    if loss.numel() and torch.isfinite(loss).all():
        w = torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)
        (loss * w).sum().backward()
    return loss.detach(), metrics, leaves


def _config_case(config, group, rank, world):
    dtype, beta, temperature, hard_weight, bias, reduction, with_labels, transforms, budget = config
    v0, v1 = _shards(VOCAB, world)[rank]
    hs, ws, bs, ht, wt, bt, labels = _problem(ROWS, HID, VOCAB, dtype, seed=7 + int(10 * beta), h_t=HID_T, bias=bias)
    if not with_labels:
        labels = None
    kw = dict(beta=beta, temperature=temperature, hard_weight=hard_weight, reduction=reduction,
              chunk_budget_bytes=budget, **(TRANSFORMS if transforms else {}))
    sl = lambda x: None if x is None else x[v0:v1]  # noqa: E731
    loss, metrics, leaves = _run(hs, sl(ws), sl(bs), ht, sl(wt), sl(bt), labels, kw, process_group=group,
                                 vocab_start=v0, vocab_total=VOCAB)
    # the same bits on every rank
    _same_on_every_rank(group, world, loss, *metrics.values(), leaves[0].grad)
    # against the single-device call
    one_loss, one_metrics, one_leaves = _run(hs, ws, bs, ht, wt, bt, labels, kw)
    _same_values(loss, one_loss, "loss")
    for key, value in one_metrics.items():
        _same_values(metrics[key], value, key)
    for got, want, rows, name in zip(leaves, one_leaves, (slice(None), slice(v0, v1), slice(v0, v1)),
                                     ("hidden", "weight", "bias")):
        if got is None:
            continue
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad, want.grad[rows], **SAME_GRAD_TOL[dtype], msg=lambda m: f"grad_{name}: {m}")
    # against the float64 reference
    leaves64 = [None if x is None else x.detach().double().requires_grad_(True) for x in (hs, ws, bs)]
    ref, ref_m = reference_full(*leaves64, ht, wt, bt, labels, beta=beta, temperature=temperature,
                                hard_weight=hard_weight, reduction=reduction, **(REF_TRANSFORMS if transforms else {}))
    scale = max(ref.abs().max().item(), 1.0)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=_value_tol(HID, HID_T, VOCAB, scale), rtol=0.0)
    for key, value in ref_m.items():
        tol = _value_tol(HID, HID_T, VOCAB, value.abs().max().item())
        torch.testing.assert_close(metrics[key].double(), value.detach(), atol=tol, rtol=0.0,
                                   msg=lambda m: f"{key}: {m}")
    (ref * torch.linspace(0.5, 1.5, ref.numel(), dtype=torch.float64).view(ref.shape)).sum().backward()
    for got, want, rows, name in zip(leaves, leaves64, (slice(None), slice(v0, v1), slice(v0, v1)),
                                     ("hidden", "weight", "bias")):
        if got is None:
            continue
        atol, rtol = _grad_tol(dtype, want.grad, VOCAB + HID + ROWS)
        torch.testing.assert_close(got.grad.double(), want.grad[rows], atol=atol, rtol=rtol,
                                   msg=lambda m: f"grad_{name} against float64: {m}")


# (dtype, beta, temperature, hard_weight, bias, reduction, labels, topk_norm, K, repeats, absent,
#  chunk_budget_bytes)
TOPK_CONFIGS = [
    (torch.float32, 0.0, 1.0, 0.0, True, "mean", True, "none", 8, False, False, None),
    (torch.float32, 0.5, 0.8, 0.2, True, "mean", True, "renorm", 6, True, True, None),
    (torch.float32, 1.0, 1.0, 0.0, False, "none", True, "tail", 5, False, True, None),
    (torch.bfloat16, 0.5, 1.2, 0.3, True, "sum", True, "tail", 8, True, False, None),
    (torch.float32, 0.0, 1.0, 0.0, False, "sum", False, "renorm", VOCAB, False, False, 2 * 19 * 4),  # K = V, chunks
    (torch.float32, 0.5, 1.0, 0.5, True, "none", True, "none", 4, False, False, None),
]


def _run_topk(hs, ws, bs, ids, tlp, labels, kw, **parallel):
    """_run for the top-k form."""
    leaves = [_leaf(x) for x in (hs, ws, bs)]
    loss, metrics = fusedce.linear_distillation_topk(leaves[0], leaves[1], ids, tlp, labels, student_bias=leaves[2],
                                                     return_metrics=True, **kw, **parallel)
    if loss.numel() and torch.isfinite(loss).all():
        w = torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)
        (loss * w).sum().backward()
    return loss.detach(), metrics, leaves


def _topk_config_case(config, group, rank, world):
    dtype, beta, temperature, hard_weight, bias, reduction, with_labels, norm, k, repeats, absent, budget = config
    v0, v1 = _shards(VOCAB, world)[rank]
    hs, ws, bs, _, _, _, labels = _problem(ROWS, HID, VOCAB, dtype, seed=17 + k, bias=bias)
    ids, tlp = _topk_teacher(ROWS, VOCAB, k, seed=5 + k, repeats=repeats, absent=absent)
    if not with_labels:
        labels = None
    kw = dict(divergence="jsd", beta=beta, temperature=temperature, hard_weight=hard_weight, reduction=reduction,
              topk_norm=norm, chunk_budget_bytes=budget)
    sl = lambda x: None if x is None else x[v0:v1]  # noqa: E731
    loss, metrics, leaves = _run_topk(hs, sl(ws), sl(bs), ids, tlp, labels, kw, process_group=group,
                                      vocab_start=v0, vocab_total=VOCAB)
    _same_on_every_rank(group, world, loss, *metrics.values(), leaves[0].grad)
    finite = tlp[tlp != -math.inf]
    amplification = 1.0 + finite.abs().max().item()
    one_loss, one_metrics, one_leaves = _run_topk(hs, ws, bs, ids, tlp, labels, kw)
    _same_values(loss, one_loss, "loss")
    for key, value in one_metrics.items():
        _same_values(metrics[key], value, key)
    rows_of = (slice(None), slice(v0, v1), slice(v0, v1))
    for got, want, rows, name in zip(leaves, one_leaves, rows_of, ("hidden", "weight", "bias")):
        if got is None:
            continue
        assert got.grad.dtype == dtype
        tol = dict(SAME_GRAD_TOL[dtype])
        tol["atol"] *= amplification
        torch.testing.assert_close(got.grad, want.grad[rows], **tol, msg=lambda m: f"grad_{name}: {m}")
    leaves64 = [None if x is None else x.detach().double().requires_grad_(True) for x in (hs, ws, bs)]
    ref, ref_m = reference_topk(*leaves64, ids, tlp, labels, beta=beta, norm=norm, temperature=temperature,
                                hard_weight=hard_weight, reduction=reduction)
    scale = max(ref.abs().max().item(), 1.0)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=_value_tol(HID, 0, VOCAB, scale), rtol=0.0)
    for key, value in ref_m.items():
        tol = _value_tol(HID, 0, VOCAB, value.abs().max().item())
        torch.testing.assert_close(metrics[key].double(), value.detach(), atol=tol, rtol=0.0,
                                   msg=lambda m: f"{key}: {m}")
    (ref * torch.linspace(0.5, 1.5, ref.numel(), dtype=torch.float64).view(ref.shape)).sum().backward()
    for got, want, rows, name in zip(leaves, leaves64, rows_of, ("hidden", "weight", "bias")):
        if got is None:
            continue
        atol, rtol = _grad_tol(dtype, want.grad, VOCAB + HID + ROWS, amplification)
        torch.testing.assert_close(got.grad.double(), want.grad[rows], atol=atol, rtol=rtol,
                                   msg=lambda m: f"grad_{name} against float64: {m}")


def _topk_empty_and_agreement_case(group, rank, world):
    """The top-k form: N = 0 (mean NaN), every row ignored (gradients 0), an id past the
    vocabulary named on every rank, then a right call."""
    v0, v1 = _shards(VOCAB, world)[rank]
    hs, ws, bs, _, _, _, labels = _problem(0, HID, VOCAB, torch.float32, seed=3, bias=True)
    ids, tlp = _topk_teacher(0, VOCAB, 4, seed=3)
    loss, _, _ = _run_topk(hs, ws[v0:v1], bs[v0:v1], ids, tlp, labels, dict(hard_weight=0.4), process_group=group,
                           vocab_start=v0, vocab_total=VOCAB)
    assert math.isnan(loss.item())
    hs, ws, bs, _, _, _, labels = _problem(6, HID, VOCAB, torch.float32, seed=4, bias=True)
    ids, tlp = _topk_teacher(6, VOCAB, 4, seed=4)
    ignored = torch.full_like(labels, IGNORE)
    leaves = [_leaf(x) for x in (hs, ws[v0:v1], bs[v0:v1])]
    loss = fusedce.linear_distillation_topk(leaves[0], leaves[1], ids, tlp, ignored, student_bias=leaves[2],
                                            reduction="sum", process_group=group, vocab_start=v0, vocab_total=VOCAB)
    assert loss.item() == 0.0
    loss.backward()
    assert all((x.grad == 0).all() for x in leaves)
    bad = ids.clone()
    bad[2, 1] = VOCAB
    with pytest.raises(ValueError, match=r"teacher_ids\[2, 1\] = 37 is out of range \[0, 37\)"):
        fusedce.linear_distillation_topk(hs, ws[v0:v1], bad, tlp, labels, process_group=group, vocab_start=v0,
                                         vocab_total=VOCAB)
    loss = fusedce.linear_distillation_topk(hs, ws[v0:v1], ids, tlp, labels, process_group=group, vocab_start=v0,
                                            vocab_total=VOCAB)
    _same_values(loss, fusedce.linear_distillation_topk(hs, ws, ids, tlp, labels), "loss")


def _empty_and_ignored_case(group, rank, world):
    """N = 0 (mean: NaN; sum: 0; no gradient rows) and every row ignored (mean NaN, gradients 0)."""
    v0, v1 = _shards(VOCAB, world)[rank]
    hs, ws, bs, ht, wt, bt, labels = _problem(0, HID, VOCAB, torch.float32, seed=3, h_t=HID_T, bias=True)
    for reduction in ("mean", "sum", "none"):
        loss, metrics, leaves = _run(hs, ws[v0:v1], bs[v0:v1], ht, wt[v0:v1], bt[v0:v1], labels,
                                     dict(reduction=reduction, hard_weight=0.4), process_group=group,
                                     vocab_start=v0, vocab_total=VOCAB)
        if reduction == "mean":
            assert math.isnan(loss.item())
        elif reduction == "sum":
            assert loss.item() == 0.0
            assert leaves[0].grad.shape == (0, HID) and (leaves[1].grad == 0).all() and (leaves[2].grad == 0).all()
        else:
            assert loss.shape == (0,)
        assert all(v.shape == (0,) for v in metrics.values())
    hs, ws, bs, ht, wt, bt, labels = _problem(6, HID, VOCAB, torch.float32, seed=4, h_t=HID_T, bias=True)
    labels[:] = IGNORE
    for reduction, want in (("sum", 0.0), ("mean", math.nan)):
        leaves = [_leaf(x) for x in (hs, ws[v0:v1], bs[v0:v1])]
        loss = fusedce.linear_distillation(leaves[0], leaves[1], ht, wt[v0:v1], labels, student_bias=leaves[2],
                                           teacher_bias=bt[v0:v1], reduction=reduction, hard_weight=0.5,
                                           process_group=group, vocab_start=v0, vocab_total=VOCAB)
        assert (math.isnan(want) and math.isnan(loss.item())) or loss.item() == want
        loss.backward()
        assert all((x.grad == 0).all() for x in leaves)


def _agreement_case(group, rank, world):
    """A bad argument on one rank: that rank raises its own error naming the argument, every
    other rank the agreed one; a bad label on every rank: every rank names it; the group's next
    call is right on every rank."""
    v0, v1 = _shards(VOCAB, world)[rank]
    hs, ws, bs, ht, wt, bt, labels = _problem(ROWS, HID, VOCAB, torch.float32, seed=9, h_t=HID_T, bias=True)
    if world > 1:
        bad_tw = wt[v0:v1 - 1] if rank == 1 else wt[v0:v1]  # a row short of the student's
        agreed = r"rank 1 \(ValueError\) of %d rejected its arguments" % world
        with pytest.raises(ValueError, match="teacher_weight" if rank == 1 else agreed):
            fusedce.linear_distillation(hs, ws[v0:v1], ht, bad_tw, labels, process_group=group, vocab_start=v0,
                                        vocab_total=VOCAB)
        # shards that do not tile the vocabulary: the same error on every rank
        with pytest.raises(ValueError, match="do not tile the vocabulary"):
            fusedce.linear_distillation(hs, ws[v0:v1], ht, wt[v0:v1], labels, process_group=group,
                                        vocab_start=v0 + (1 if rank == 0 else 0), vocab_total=VOCAB)
    bad = labels.clone()
    bad[2] = VOCAB + 3
    with pytest.raises(ValueError, match=r"labels\[2\] = 40 is out of range \[0, 37\)"):
        fusedce.linear_distillation(hs, ws[v0:v1], ht, wt[v0:v1], bad, hard_weight=0.2, process_group=group,
                                    vocab_start=v0, vocab_total=VOCAB)
    with pytest.raises(ValueError, match="beta must be in"):
        fusedce.linear_distillation(hs, ws[v0:v1], ht, wt[v0:v1], labels, beta=1.5, process_group=group,
                                    vocab_start=v0, vocab_total=VOCAB)
    loss = fusedce.linear_distillation(hs, ws[v0:v1], ht, wt[v0:v1], labels, process_group=group, vocab_start=v0,
                                       vocab_total=VOCAB)
    want = fusedce.linear_distillation(hs, ws, ht, wt, labels)
    _same_values(loss, want, "loss")


def _run_key(key, group, rank, world):
    if key.startswith("config"):
        _config_case(CONFIGS[int(key[len("config"):])], group, rank, world)
    elif key == "empty":
        _empty_and_ignored_case(group, rank, world)
    elif key == "agreement":
        _agreement_case(group, rank, world)
    elif key == "topk_empty_agreement":
        _topk_empty_and_agreement_case(group, rank, world)
    elif key.startswith("topk"):
        _topk_config_case(TOPK_CONFIGS[int(key[len("topk"):])], group, rank, world)
    else:
        raise KeyError(key)


KEYS = ([f"config{i}" for i in range(len(CONFIGS))] + ["empty", "agreement"] +
        [f"topk{i}" for i in range(len(TOPK_CONFIGS))] + ["topk_empty_agreement"])
_RESULTS = {}


def _results(world, tmp_path_factory):
    """Every rank's findings for every key, the group spawned once per world size."""
    if world not in _RESULTS:
        _RESULTS[world] = spawn_group(world, KEYS, _run_key, tmp_path_factory, timeout_s=120, deadline_s=500)
    return _RESULTS[world]


needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@needs_gloo
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_vocabulary_parallel_distillation(world, key, tmp_path_factory):
    failures = failures_of(_results(world, tmp_path_factory), key)
    assert not failures, failures


# ---- without a group -----------------------------------------------------------------------------


def _five_steps(device, topk, problem, args):
    """The five shard ops at world 1 (each gathered block the rank's own), on `device`: the
    forward's outputs and the student's gradients (upstream gradient 1), on the CPU."""
    ops = torch.ops.fusedce
    hs, ws, bs, ht, wt, bt, labels, ids, tlp = (None if x is None else x.to(device) for x in problem)
    teacher = (ids, tlp) if topk else (ht, wt, bt)
    pre = "ldk" if topk else "ld"
    stats = getattr(ops, pre + "_shard_stats")(hs, ws, bs, *teacher, labels, 0, VOCAB, *args)
    row_stats, hard, parts = getattr(ops, pre + "_shard_parts")(hs, ws, bs, *teacher, labels, stats, 0, VOCAB, *args)
    out = (ops.ldk_shard_reduce(parts, row_stats, hard, tlp, labels, *args) if topk
           else ops.ld_shard_reduce(parts, row_stats, hard, labels, *args))
    grads = getattr(ops, pre + "_shard_bwd")(hs, ws, bs, *teacher, labels, out[-1], torch.ones(1, device=device),
                                              0, VOCAB, *args, True, True, True)
    return [x.cpu() for x in (*out, *grads)]


@requires_cuda
@pytest.mark.parametrize("topk", [False, True], ids=["head", "topk"])
def test_cuda_shard_steps_match_the_cpu(topk):
    """The core's five steps on a CUDA device (world 1: the gathered blocks are the rank's own;
    several ranks on one GPU are tests/cpp/test_distill_vp.cpp's) against the CPU's, float32:
    the same float32 computation in other orders, within _value_tol's budget of each output's
    largest entry (a planted 1e-5 relative error exceeds it)."""
    hs, ws, bs, ht, wt, bt, labels = _problem(9, HID, VOCAB, torch.float32, seed=3, h_t=HID_T, bias=True)
    ids, tlp = _topk_teacher(9, VOCAB, 5, seed=3)
    problem = (hs, ws, bs, ht, wt, bt, labels, ids, tlp)
    args = (0.5, 1.3, 0.2, IGNORE, "mean", 1.0, 0.0, 1.0, 0.0, "tail" if topk else "none", 0)
    cpu, gpu = _five_steps("cpu", topk, problem, args), _five_steps("cuda", topk, problem, args)
    names = ["loss", "divergence", "hard", "entropy", "stats", "grad_hidden", "grad_weight", "grad_bias"]
    for name, want, got in zip(names, cpu, gpu):
        tol = 2 * _value_tol(HID, 0 if topk else HID_T, VOCAB, max(want.abs().max().item(), 1.0))
        torch.testing.assert_close(got, want, atol=tol, rtol=0.0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("op", ["ld_shard_stats", "ld_shard_parts", "ld_shard_reduce", "ld_shard_bwd",
                                "ldk_shard_stats", "ldk_shard_parts", "ldk_shard_reduce", "ldk_shard_bwd"])
def test_shard_ops_take_the_options_in_the_python_order(op):
    names = [a.name for a in getattr(torch.ops.fusedce, op).default._schema.arguments]
    at = names.index("beta")
    assert tuple(names[at:at + len(NAMES)]) == NAMES
    assert names[at + len(NAMES)] == "chunk_budget_bytes"


def test_vocab_start_needs_a_group():
    hs, ws, _, ht, wt, _, labels = _problem(4, HID, VOCAB, torch.float32, seed=1, h_t=HID_T)
    with pytest.raises(ValueError, match="only used with a process_group"):
        fusedce.linear_distillation(hs, ws, ht, wt, labels, vocab_start=0)


def test_core_steps_name_bad_blocks():
    """The shard ops name their bad arguments (what the front end never passes)."""
    ops = torch.ops.fusedce
    hs, ws, _, ht, wt, _, labels = _problem(4, HID, VOCAB, torch.float32, seed=1, h_t=HID_T)
    args = (0.5, 1.0, 0.0, IGNORE, "mean", 1.0, 0.0, 1.0, 0.0, "none", 0)
    with pytest.raises(ValueError, match="vocab_start"):
        ops.ld_shard_stats(hs, ws[:10], None, ht, wt[:10], None, labels, 30, VOCAB, *args)
    with pytest.raises(ValueError, match="teacher_weight"):
        ops.ld_shard_stats(hs, ws[:10], None, ht, wt[:11], None, labels, 0, VOCAB, *args)
    stats = ops.ld_shard_stats(hs, ws, None, ht, wt, None, labels, 0, VOCAB, *args)
    with pytest.raises(ValueError, match="gathered"):
        ops.ld_shard_parts(hs, ws, None, ht, wt, None, labels, stats[:-1], 0, VOCAB, *args)
    # the top-k steps: parts without the K columns, logprobs of another K
    ids, tlp = _topk_teacher(4, VOCAB, 3, seed=1)
    kstats = ops.ldk_shard_stats(hs, ws, None, ids, tlp, labels, 0, VOCAB, *args)
    row_stats, hard, parts = ops.ldk_shard_parts(hs, ws, None, ids, tlp, labels, kstats, 0, VOCAB, *args)
    assert parts.shape == (4, 6 + 3)
    with pytest.raises(ValueError, match="gathered"):
        ops.ldk_shard_reduce(parts[:, :-1].contiguous(), row_stats, hard, tlp, labels, *args)
    with pytest.raises(ValueError, match="teacher_ids"):
        ops.ldk_shard_stats(hs, ws[:10], None, ids + 30, tlp, labels, 0, VOCAB, *args)
    out = ops.ldk_shard_reduce(parts, row_stats, hard, tlp, labels, *args)
    assert out[4].shape == (4, 4 + 3)
