"""DTensor heads of fusedce.linear_logprobs, fusedce.logprobs, fusedce.linear_distillation and
fusedce.linear_distillation_topk (fusedce.dtensor): a head sharded on dim 0 (Shard(0), as
ColwiseParallel shards an lm_head; logits sharded on their last dimension) runs the
vocabulary-parallel form over the mesh's group, a replicated one the single-device call. Each is
compared on gloo groups of 2 and 3 ranks (131 classes: uneven shards) with the single-device call
on the full tensors: the outputs within float32 rounding of the sums' other order and the same
bits on every rank; each gradient a DTensor with its input's placements, whose full tensor
matches the single-device gradient; bad placements named on every rank."""

import re

import pytest
import torch
import torch.distributed as dist

import fusedce
from gloo_groups import failures_of, spawn_group

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

VOCAB, HIDDEN, TEACHER_HIDDEN, ROWS, K = 131, 16, 12, 23, 5
WORLDS = (2, 3)
# float32 throughout: the sharded call sums the same terms in another order (per shard, then
# over the ranks), so values agree within a few float32 roundoffs of their size and gradients
# within a few of their largest entry.
VALUE_TOL = dict(rtol=2e-6, atol=2e-6)
GRAD_TOL = dict(rtol=2e-5, atol=2e-6)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _place(x, mesh, how):
    """x as a DTensor: "shard0", "shard_last", "replicate"; "plain": x itself."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if how == "plain" or x is None:
        return x
    placement = {"shard0": Shard(0), "shard_last": Shard(x.dim() - 1), "replicate": Replicate()}[how]
    return distribute_tensor(x, mesh, [placement])


def _leaf(x):
    return None if x is None else x.detach().clone().requires_grad_(True)


def _full(x):
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _same_on_every_rank(values, what):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [v.detach() for v in values])
    for r, theirs in enumerate(gathered):
        for a, b in zip(values, theirs):
            assert torch.equal(a.detach(), b), f"{what}: rank {r} differs"


def _check_grads(ours, placed, theirs, what):
    """ours: gradients of the placed inputs; each a DTensor with the input's placements (a plain
    input: a plain gradient), its full tensor close to the single-device gradient."""
    from torch.distributed.tensor import DTensor

    for i, (g, x, want) in enumerate(zip(ours, placed, theirs)):
        if x is None or want is None:
            continue
        if isinstance(x, DTensor):
            assert isinstance(g, DTensor) and tuple(g.placements) == tuple(x.placements), f"{what}: grad {i}"
        else:
            assert not isinstance(g, DTensor), f"{what}: grad {i} should be plain"
        torch.testing.assert_close(_full(g), want, **GRAD_TOL, msg=lambda m: f"{what}: grad {i}: {m}")


def _problem(seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(ROWS, HIDDEN, generator=g)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    b = torch.randn(VOCAB, generator=g) * 0.3
    t = torch.randint(0, VOCAB, (ROWS,), generator=g)
    t[::7] = -100
    return h, w, b, t


# ---- cases: (name, run(mesh, rank, world)) ---------------------------------------------------


def _linear_logprobs(mesh, head, hidden, with_bias):
    h, w, b, t = _problem(1)
    placed = [_place(_leaf(h), mesh, hidden), _place(_leaf(w), mesh, head),
              _place(_leaf(b), mesh, head) if with_bias else None]
    for x in placed:
        if x is not None and not x.is_leaf:
            x.retain_grad()
    lp, ent = fusedce.linear_logprobs(placed[0], placed[1], t, placed[2], temperature=0.9, return_entropy=True)
    assert type(lp) is torch.Tensor and type(ent) is torch.Tensor
    (lp * torch.linspace(0.5, 1.5, ROWS)).sum().add(ent.sum() * 0.1).backward()
    ref_leaves = [_leaf(x) for x in (h, w, b if with_bias else None)]
    lp_r, ent_r = fusedce.linear_logprobs(*ref_leaves[:2], t, ref_leaves[2], temperature=0.9, return_entropy=True)
    (lp_r * torch.linspace(0.5, 1.5, ROWS)).sum().add(ent_r.sum() * 0.1).backward()
    what = f"linear_logprobs head={head} hidden={hidden} bias={with_bias}"
    torch.testing.assert_close(lp, lp_r, **VALUE_TOL)
    torch.testing.assert_close(ent, ent_r, **VALUE_TOL)
    _same_on_every_rank([lp, ent], what)
    _check_grads([None if x is None else x.grad for x in placed], placed,
                 [None if x is None else x.grad for x in ref_leaves], what)


def _logprobs(mesh, how):
    h, w, b, t = _problem(2)
    x = (h @ w.T + b).detach()
    placed = _place(_leaf(x), mesh, how)
    lp, ent = fusedce.logprobs(placed, t, return_entropy=True, temperature=1.1)
    (lp.sum() + 0.2 * ent.sum()).backward()
    ref = _leaf(x)
    lp_r, ent_r = fusedce.logprobs(ref, t, return_entropy=True, temperature=1.1)
    (lp_r.sum() + 0.2 * ent_r.sum()).backward()
    torch.testing.assert_close(lp, lp_r, **VALUE_TOL)
    torch.testing.assert_close(ent, ent_r, **VALUE_TOL)
    _same_on_every_rank([lp, ent], f"logprobs {how}")
    _check_grads([placed.grad], [placed], [ref.grad], f"logprobs {how}")


def _teacher(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, TEACHER_HIDDEN, generator=g), torch.randn(VOCAB, TEACHER_HIDDEN, generator=g) * 0.5,
            torch.randn(VOCAB, generator=g) * 0.3)


def _distillation(mesh, teacher_how):
    h, w, b, t = _problem(3)
    th, tw, tb = _teacher(4)
    placed = [_leaf(h), _place(_leaf(w), mesh, "shard0"), _place(_leaf(b), mesh, "shard0")]
    teacher = (th, _place(tw, mesh, teacher_how), _place(tb, mesh, teacher_how))
    kw = dict(divergence="jsd", beta=0.3, temperature=1.2, hard_weight=0.25, reduction="none", return_metrics=True)
    loss, metrics = fusedce.linear_distillation(placed[0], placed[1], teacher[0], teacher[1], t,
                                                student_bias=placed[2], teacher_bias=teacher[2], **kw)
    (loss * torch.linspace(0.5, 1.5, ROWS)).sum().backward()
    ref = [_leaf(x) for x in (h, w, b)]
    loss_r, metrics_r = fusedce.linear_distillation(ref[0], ref[1], th, tw, t, student_bias=ref[2],
                                                    teacher_bias=tb, **kw)
    (loss_r * torch.linspace(0.5, 1.5, ROWS)).sum().backward()
    what = f"linear_distillation teacher={teacher_how}"
    torch.testing.assert_close(loss, loss_r, **VALUE_TOL)
    for key in metrics_r:
        torch.testing.assert_close(metrics[key], metrics_r[key], **VALUE_TOL)
    _same_on_every_rank([loss, *metrics.values()], what)
    _check_grads([x.grad for x in placed], placed, [x.grad for x in ref], what)


def _distillation_topk(mesh):
    h, w, b, t = _problem(5)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (ROWS, K), generator=g)
    lps = torch.log_softmax(torch.randn(ROWS, K, generator=g), -1)
    placed = [_place(_leaf(h), mesh, "replicate"), _place(_leaf(w), mesh, "shard0")]
    placed[0].retain_grad()
    kw = dict(topk_norm="renorm", temperature=0.9, reduction="mean")
    loss = fusedce.linear_distillation_topk(placed[0], placed[1], _place(ids, mesh, "replicate"), lps, t, **kw)
    loss.backward()
    ref = [_leaf(x) for x in (h, w)]
    loss_r = fusedce.linear_distillation_topk(ref[0], ref[1], ids, lps, t, **kw)
    loss_r.backward()
    torch.testing.assert_close(loss, loss_r, **VALUE_TOL)
    _same_on_every_rank([loss], "linear_distillation_topk")
    _check_grads([x.grad for x in placed], placed, [x.grad for x in ref], "linear_distillation_topk")


def _errors(mesh, rank, world):
    """Bad placements: ValueError naming the argument, on every rank alike (found before any
    collective, from the placements alone)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    h, w, b, t = _problem(7)
    th, tw, tb = _teacher(8)
    sharded_w = distribute_tensor(w, mesh, [Shard(0)])
    cases = [
        ("hidden must be a plain tensor or a Replicate() DTensor",
         lambda: fusedce.linear_logprobs(distribute_tensor(h, mesh, [Shard(0)]), sharded_w, t)),
        ("tokens is a DTensor but weight is",
         lambda: fusedce.linear_logprobs(h, w, distribute_tensor(t, mesh, [Replicate()]))),
        ("weight must be sharded on dim 0",
         lambda: fusedce.linear_logprobs(h, distribute_tensor(w, mesh, [Shard(1)]), t)),
        ("bias must be a DTensor placed as weight",
         lambda: fusedce.linear_logprobs(h, sharded_w, t, distribute_tensor(b, mesh, [Replicate()]))),
        ("bias must be a DTensor placed as weight", lambda: fusedce.linear_logprobs(h, sharded_w, t, b)),
        ("student_bias must be a DTensor placed as student_weight",
         lambda: fusedce.linear_distillation(h, sharded_w, th, tw, student_bias=b)),
        ("process_group is read from the DTensor",
         lambda: fusedce.linear_logprobs(h, sharded_w, t, process_group=dist.group.WORLD)),
        ("teacher_weight must be a DTensor placed as student_weight",
         lambda: fusedce.linear_distillation(h, sharded_w, th, distribute_tensor(tw, mesh, [Replicate()]))),
        ("teacher_weight must have student_weight's 131 rows",
         lambda: fusedce.linear_distillation(h, sharded_w, th, tw[:-1])),
        ("logits must be sharded on its last dimension",
         lambda: fusedce.logprobs(distribute_tensor(h @ w.T, mesh, [Shard(0)]), t)),
    ]
    for expected, call in cases:
        with pytest.raises(ValueError, match=re.escape(expected)):
            call()


CASES = {
    "linear_logprobs/shard_bias": lambda m, r, w: _linear_logprobs(m, "shard0", "plain", True),
    "linear_logprobs/shard_replicated_hidden": lambda m, r, w: _linear_logprobs(m, "shard0", "replicate", False),
    "linear_logprobs/replicated_head": lambda m, r, w: _linear_logprobs(m, "replicate", "plain", True),
    "logprobs/shard_last": lambda m, r, w: _logprobs(m, "shard_last"),
    "logprobs/replicate": lambda m, r, w: _logprobs(m, "replicate"),
    "distillation/teacher_sharded": lambda m, r, w: _distillation(m, "shard0"),
    "distillation/teacher_plain": lambda m, r, w: _distillation(m, "plain"),
    "distillation_topk": lambda m, r, w: _distillation_topk(m),
    "errors": _errors,
}


def _run_key(key, mesh, rank, world):
    return CASES[key](mesh, rank, world)


_RESULTS = {}


@pytest.mark.parametrize("world,key", [(w, k) for w in WORLDS for k in CASES], ids=lambda v: str(v))
def test_dtensor_heads(world, key, tmp_path_factory):
    if world not in _RESULTS:
        _RESULTS[world] = spawn_group(world, list(CASES), _run_key, tmp_path_factory, timeout_s=30,
                                      deadline_s=240, context=_mesh)
    failures = failures_of(_RESULTS[world], key)
    assert not failures, failures
