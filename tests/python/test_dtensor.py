"""DTensor inputs (fusedce.dtensor): an lm_head weight sharded on dim 0 and logits sharded on their
class dimension, as PyTorch's tensor parallelism hands them over, on gloo groups of 2 and 3 ranks
with a 131-class vocabulary (torch's uneven Shard split: 66 + 65, 44 + 44 + 43).

Each rank runs every case against the unsharded problem in float64 (F.linear and F.cross_entropy)
and records what it found; the parametrized tests read one case each. Judged as the
vocabulary-parallel tests are: the loss within the budget set by PyTorch's own error in the
input dtype, bit-identical on every rank; each DTensor input's gradient is a DTensor with the
input's placements whose full tensor is the float64 gradient within that budget. Bad input: the
expected ValueError on every rank (none left waiting: a short collective timeout), then a
correct call."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedce
from conftest import assert_within_budget, error_scales, make_weight, torch_cross_entropy
from gloo_groups import failures_of, spawn_group

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

VOCAB = 131
HIDDEN = 24
N_ROWS = 29
WORLDS = (2, 3)

# Linear cases: options of fusedce.linear_cross_entropy plus test flags: bias (a DTensor placed
# as the weight); class_weight ("dtensor": Shard(0), "plain": the full (V,) vector, "replicate");
# hidden ("plain" or "replicate"); target ("replicate": a Replicate() DTensor); head
# ("replicate": a replicated weight); grad: upstream 'rows' or a factor; dtype; shape.
LINEAR_CASES = {
    "plain": {},
    "bias_smoothing_sum": {"bias": True, "label_smoothing": 0.1, "reduction": "sum", "grad": 0.7},
    "none_class_weight_ignore": {"class_weight": "dtensor", "ignore_index": 3, "reduction": "none",
                                 "grad": "rows"},
    "replicate_hidden_shift": {"hidden": "replicate", "target": "replicate",
                               "class_weight": "plain", "shift": True, "shape": (3, 9),
                               "softcap": 6.0, "logit_scale": 1.2, "z_loss": 1e-3},
    "bf16_bias_chunks": {"dtype": torch.bfloat16, "bias": True, "chunk_budget_bytes": 2 * 5 * 66,
                         "low_memory": True, "skip_ignored": True, "check_targets": True},
    "replicated_head": {"head": "replicate", "bias": True, "class_weight": "replicate",
                        "label_smoothing": 0.05},
}

# Logits cases: options of fusedce.cross_entropy plus flags: shape of the rows and where the
# classes are (layout "last" or "dim1": PyTorch's (N, C, d1)); weight as above; target.
CE_CASES = {
    "plain": {},
    "seq_none_ignore": {"shape": (3, 7), "reduction": "none", "grad": "rows", "ignore_index": 5},
    "weight_dtensor_smoothing_sum": {"weight": "dtensor", "label_smoothing": 0.1,
                                     "reduction": "sum", "grad": 1.3},
    "kdim_plain_weight": {"layout": "dim1", "shape": (5, 4), "weight": "plain", "z_loss": 1e-3},
    "replicate_target_softcap": {"target": "replicate", "softcap": 8.0, "logit_scale": 0.9},
    "fp16_mean": {"dtype": torch.float16, "label_smoothing": 0.2},
    "replicated_logits": {"logits": "replicate", "weight": "replicate"},
}

ERROR_CASES = ("process_group", "vocab_start", "plain_bias", "partial_weight", "sharded_hidden",
               "strided_weight", "inplace_backward", "probabilities", "weight_on_dim1",
               "one_rank_option/linear", "one_rank_option/ce", "one_rank_class_weight")


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _distribute(x, mesh, placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    p = Replicate() if placement == "replicate" else Shard(placement)
    return distribute_tensor(x, mesh, [p])


def _upstream(grad, shape, g):
    if grad == "rows":
        return torch.rand(shape, generator=g) + 0.5
    return None if grad is None else torch.tensor(float(grad))


def _full(x):
    """A gradient as a plain tensor: a DTensor's full tensor, a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _same_on_every_rank(values, what):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [v.detach() for v in values])
    for r, theirs in enumerate(gathered):
        for a, b in zip(values, theirs):
            assert torch.equal(a.detach(), b), f"{what}: rank {r} differs"


def _check_grad(name, ours, placements, ref, theirs, scale, dtype, what):
    """ours: the gradient of a DTensor (or plain) input; placements: the input's (None: plain)."""
    from torch.distributed.tensor import DTensor

    if placements is None:
        assert not isinstance(ours, DTensor), f"{what}: grad {name} should be a plain tensor"
    else:
        assert isinstance(ours, DTensor) and tuple(ours.placements) == tuple(placements), \
            f"{what}: grad {name} is {type(ours).__name__} {getattr(ours, 'placements', '')}, " \
            f"want a DTensor {tuple(placements)}"
    full = _full(ours)
    assert full.dtype == dtype and full.shape == ref.shape, f"{what}: grad {name}"
    assert_within_budget(full, theirs, ref, what=f"{what}: grad {name}", scale=scale, out_dtype=dtype)


# ---- linear cross-entropy, weight Shard(0) --------------------------------------------------------


def _run_linear_case(name, mesh, rank, world):
    case = LINEAR_CASES[name]
    g = torch.Generator().manual_seed(1000 + len(name))
    dtype = case.get("dtype", torch.float32)
    shape = case.get("shape", (N_ROWS,))
    h = (torch.randn(*shape, HIDDEN, generator=g) * 0.7).to(dtype)
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.7).to(dtype)
    b = torch.randn(VOCAB, generator=g).to(dtype) if case.get("bias") else None
    ignore = case.get("ignore_index", -100)
    t = torch.randint(0, VOCAB, shape, generator=g)
    t[torch.rand(shape, generator=g) < 0.2] = ignore
    cw = make_weight(VOCAB) if case.get("class_weight") else None
    grad = _upstream(case.get("grad"), shape, g)
    opts = {k: case[k] for k in ("label_smoothing", "softcap", "logit_scale", "z_loss", "reduction",
                                 "ignore_index") if k in case}
    extra = {k: case[k] for k in ("shift", "chunk_budget_bytes", "low_memory", "skip_ignored",
                                  "check_targets") if k in case}
    head = "replicate" if case.get("head") == "replicate" else 0

    # The DTensor inputs, leaves requiring grad.
    dw = _distribute(w, mesh, head).requires_grad_()
    db = _distribute(b, mesh, head).requires_grad_() if b is not None else None
    dh = (_distribute(h, mesh, "replicate") if case.get("hidden") == "replicate" else h.clone())
    dh.requires_grad_()
    dt = _distribute(t, mesh, "replicate") if case.get("target") == "replicate" else t
    dcw = {"dtensor": lambda: _distribute(cw, mesh, 0), "replicate": lambda: _distribute(cw, mesh, "replicate"),
           "plain": lambda: cw}.get(case.get("class_weight"), lambda: None)()
    loss, metrics = fusedce.linear_cross_entropy(dh, dw, dt, db, class_weight=dcw, return_metrics=True,
                                                 **opts, **extra)
    what = f"linear {name}, world {world}, rank {rank}"
    assert type(loss) is torch.Tensor, f"{what}: the loss is {type(loss).__name__}, want a plain tensor"
    loss.backward(torch.ones_like(loss) if grad is None else grad.to(loss.dtype))
    _same_on_every_rank([loss, metrics["num_correct_tokens"], metrics["entropy_sum"]], what)

    tt = torch.cat([t[..., 1:], torch.full_like(t[..., :1], ignore)], -1) if case.get("shift") else t

    def reference(dt_):
        hh, ww = h.to(dt_).requires_grad_(), w.to(dt_).requires_grad_()
        bb = b.to(dt_).requires_grad_() if b is not None else None
        out = torch_cross_entropy(F.linear(hh, ww, bb), tt, cw, compute_dtype=dt_, **opts)
        out.backward(torch.ones_like(out) if grad is None else grad.to(dt_))
        return out, hh.grad, ww.grad, None if bb is None else bb.grad

    ref, rh, rw, rb = reference(torch.float64)
    theirs, th, tw, tb = reference(dtype)
    z64 = F.linear(h.double(), w.double(), None if b is None else b.double())
    loss_scale, dz_scale = error_scales(z64, tt, cw, **opts, grad_out=grad)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape, what
    assert_within_budget(loss, theirs, ref, what=f"{what}: loss", scale=loss_scale)
    h2, w2 = h.double().reshape(-1, HIDDEN).abs(), w.double().abs()
    _check_grad("hidden", dh.grad, getattr(dh, "placements", None), rh, th,
                dz_scale * w2.sum(0).max().item(), dtype, what)
    _check_grad("weight", dw.grad, dw.placements, rw, tw, dz_scale * h2.sum(0).max().item(),
                dtype, what)
    if b is not None:
        _check_grad("bias", db.grad, db.placements, rb, tb, dz_scale * h2.shape[0], dtype, what)
    if head == 0:  # this rank's rows of the gradient are its local tensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        (rows, _), (v0, _) = compute_local_shape_and_global_offset(dw.shape, mesh, dw.placements)
        assert torch.equal(dw.grad.to_local(), _full(dw.grad)[v0:v0 + rows]), what


# ---- cross-entropy over logits sharded on the class dimension --------------------------------------


def _run_ce_case(name, mesh, rank, world):
    case = CE_CASES[name]
    g = torch.Generator().manual_seed(2000 + len(name))
    dtype = case.get("dtype", torch.float32)
    shape = case.get("shape", (N_ROWS,))
    ignore = case.get("ignore_index", -100)
    z = (torch.randn(*shape, VOCAB, generator=g) * 2).to(dtype)
    t = torch.randint(0, VOCAB, shape, generator=g)
    t[torch.rand(shape, generator=g) < 0.2] = ignore
    w = make_weight(VOCAB) if case.get("weight") else None
    grad = _upstream(case.get("grad"), shape, g)
    opts = {k: case[k] for k in ("label_smoothing", "softcap", "logit_scale", "z_loss", "reduction",
                                 "ignore_index") if k in case}
    dim1 = case.get("layout") == "dim1"
    x = z.movedim(-1, 1).contiguous() if dim1 else z  # (N, C, d1) for PyTorch's layout
    placement = "replicate" if case.get("logits") == "replicate" else (1 if dim1 else x.dim() - 1)
    dx = _distribute(x, mesh, placement).requires_grad_()
    dt = _distribute(t, mesh, "replicate") if case.get("target") == "replicate" else t
    dw = {"dtensor": lambda: _distribute(w, mesh, 0), "replicate": lambda: _distribute(w, mesh, "replicate"),
          "plain": lambda: w}.get(case.get("weight"), lambda: None)()
    loss, metrics = fusedce.cross_entropy(dx, dt, dw, return_metrics=True, **opts)
    what = f"ce {name}, world {world}, rank {rank}"
    assert type(loss) is torch.Tensor, f"{what}: the loss is {type(loss).__name__}, want a plain tensor"
    loss.backward(torch.ones_like(loss) if grad is None else grad.to(loss.dtype))
    _same_on_every_rank([loss, metrics["num_correct_tokens"], metrics["entropy_sum"], metrics["lse"]], what)

    def reference(dt_):
        a = z.to(dt_).requires_grad_()
        out = torch_cross_entropy(a, t, w, compute_dtype=dt_, **opts)
        if opts.get("reduction") == "none":
            out = out.view(t.shape)
        out.backward(torch.ones_like(out) if grad is None else grad.to(dt_))
        return out, a.grad

    ref, rz = reference(torch.float64)
    theirs, tz = reference(dtype)
    loss_scale, grad_scale = error_scales(z, t, w, **opts, grad_out=grad)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape, what
    assert_within_budget(loss, theirs, ref, what=f"{what}: loss", scale=loss_scale)
    if dim1:
        rz, tz = rz.movedim(-1, 1), tz.movedim(-1, 1)
    _check_grad("logits", dx.grad, dx.placements, rz, tz, grad_scale, dtype, what)


# ---- bad input: the same error on every rank, then a correct call ----------------------------------


def _run_error_case(key, mesh, rank, world):
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    g = torch.Generator().manual_seed(7)
    h = torch.randn(N_ROWS, HIDDEN, generator=g)
    w = torch.randn(VOCAB, HIDDEN, generator=g) / 4
    z = torch.randn(N_ROWS, VOCAB, generator=g)
    t = torch.randint(0, VOCAB, (N_ROWS,), generator=g)
    dw = _distribute(w, mesh, 0)
    dz = _distribute(z, mesh, 1)
    lin = fusedce.linear_cross_entropy
    agreed = r"rank 1 \(ValueError\) of %d rejected its arguments" % world
    if key == "process_group":
        with pytest.raises(ValueError, match="process_group is read from the DTensor weight"):
            lin(h, dw, t, process_group=dist.group.WORLD)
    elif key == "vocab_start":
        with pytest.raises(ValueError, match="vocab_start is read from the DTensor logits"):
            fusedce.cross_entropy(dz, t, vocab_start=0)
    elif key == "plain_bias":
        with pytest.raises(ValueError, match="bias must be a DTensor placed as weight"):
            lin(h, dw, t, torch.zeros(VOCAB))
    elif key == "partial_weight":
        with pytest.raises(ValueError, match=r"weight must be sharded on dim 0.*Partial"):
            lin(h, DTensor.from_local(w, mesh, [Partial()]), t)
    elif key == "sharded_hidden":
        with pytest.raises(ValueError, match=r"hidden must be a plain tensor or a Replicate\(\)"):
            lin(_distribute(h, mesh, 0), dw, t)
    elif key == "strided_weight":
        strided = DTensor.from_local(dw.to_local(), mesh, [_StridedShard(0, split_factor=2)],
                                     shape=dw.shape, stride=dw.stride())
        # alone, it holds no contiguous block of the vocabulary
        with pytest.raises(ValueError, match=r"weight .*_StridedShard.* must hold a contiguous "
                           r"block of at least one class on every rank"):
            lin(h, strided, t)
    elif key == "inplace_backward":
        with pytest.raises(ValueError, match="inplace_backward"):
            fusedce.cross_entropy(dz.detach().requires_grad_(), t, inplace_backward=True)
    elif key == "probabilities":
        with pytest.raises(ValueError, match="class-probability targets"):
            fusedce.cross_entropy(dz, torch.softmax(z, -1))
    elif key == "weight_on_dim1":
        with pytest.raises(ValueError, match=r"weight must be sharded on dim 0.*Shard\(dim=1\)"):
            lin(h, _distribute(w, mesh, 1), t)
    elif key == "one_rank_option/linear":  # an option only rank 1 gets wrong: every rank raises
        with pytest.raises(ValueError, match="reduction" if rank == 1 else agreed):
            lin(h, dw, t, reduction="avg" if rank == 1 else "mean")
    elif key == "one_rank_option/ce":
        with pytest.raises(ValueError, match="label_smoothing" if rank == 1 else agreed):
            fusedce.cross_entropy(dz, t, label_smoothing=1.5 if rank == 1 else 0.0)
    elif key == "one_rank_class_weight":
        bad = torch.ones(VOCAB + 1) if rank == 1 else torch.ones(VOCAB)
        with pytest.raises(ValueError, match="class_weight" if rank == 1 else agreed):
            lin(h, dw, t, class_weight=bad)
    # The group's next call is right on every rank.
    got = lin(h, dw, t)
    want = F.cross_entropy(h.double() @ w.double().t(), t).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- the spawned groups -------------------------------------------------------------------------


def _all_keys():
    return ([f"linear/{n}" for n in LINEAR_CASES] + [f"ce/{n}" for n in CE_CASES]
            + [f"error/{n}" for n in ERROR_CASES])


def _run_key(key, mesh, rank, world):
    form, name = key.split("/", 1)
    run = {"linear": _run_linear_case, "ce": _run_ce_case, "error": _run_error_case}[form]
    return run(name, mesh, rank, world)


@pytest.mark.parametrize("world,key", [(w, k) for w in WORLDS for k in _all_keys()],
                         ids=lambda v: str(v))
def test_dtensor_group(world, key, tmp_path_factory):
    if world not in _RESULTS:
        _RESULTS[world] = spawn_group(world, _all_keys(), _run_key, tmp_path_factory,
                                      timeout_s=30, deadline_s=240, context=_mesh)
    failures = failures_of(_RESULTS[world], key)
    assert not failures, failures


_RESULTS = {}


# ---- models: a tensor-parallel lm_head and FSDP2 under fusedce.transformers.apply() ---------------

MODEL_KEYS = ("tp/fused_linear", "tp/logits", "tp/direct_call", "tp/declined_scale",
              "fsdp/fused_linear", "fsdp/logits")


def _tiny_causal_lm(family="llama", seed=0):
    """A two-layer model of a 131-token vocabulary with an untied lm_head (Cohere: a logit scale
    of 0.5, applied to the DTensor logits by the model)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(seed)
    if family == "cohere":
        return tf.CohereForCausalLM(tf.CohereConfig(logit_scale=0.5, bos_token_id=1, eos_token_id=2,
                                                    pad_token_id=0, **common))
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common))


def _model_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, 6:] = -100
    return ids, labels


def _sgd_steps(model, steps, loss_of, lr=0.5):
    """`steps` steps of plain SGD; returns the losses."""
    losses = []
    for step in range(steps):
        loss = loss_of(model, *_model_batch(step))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
        losses.append(loss.detach().double())
    return losses


def _transformers_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def _compare_models(model, ref, losses, ref_losses, what, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: losses: {m}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.detach()).double(), q.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{what}: {name}: {m}")


def _run_model_case(key, mesh, rank, world):
    import copy
    import warnings

    import fusedce.transformers as fct

    kind, mode = key.split("/")
    family = "cohere" if mode == "declined_scale" else "llama"
    model = _tiny_causal_lm(family)
    ref = copy.deepcopy(model).double()
    steps = 2
    ref_losses = _sgd_steps(ref, steps, _transformers_loss)  # transformers' own loss, float64
    what = f"{key}, world {world}, rank {rank}"
    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
        assert tuple(model.lm_head.weight.placements)[0].is_shard(0), what
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert tuple(model.lm_head.weight.placements)[0].is_shard(0), what
    seen = []

    def loss_of(m, ids, labels):
        if mode == "direct_call":  # the head's DTensor weight passed by hand
            hidden = m.model(input_ids=ids).last_hidden_state
            return fusedce.linear_cross_entropy(hidden, m.lm_head.weight, labels, shift=True)
        out = m(input_ids=ids, labels=labels)
        seen.append((fct.serving(m), out.logits.shape[-1]))
        return out.loss

    fct.apply(fused_linear=mode not in ("logits",))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = _sgd_steps(model, steps, loss_of)
    finally:
        fct.revert()
    if mode in ("fused_linear",):
        assert seen == [("fused_linear", 0)] * steps, f"{what}: not the fused path: {seen}"
    elif mode == "logits":
        assert seen == [("logits", VOCAB)] * steps, f"{what}: not the logits path: {seen}"
    elif mode == "declined_scale":
        # The model scales the DTensor logits: the fused loss declines, the logits path serves.
        assert seen == [("logits", VOCAB)] * steps, f"{what}: {seen}"
        assert any("applies an operation to the DTensor logits" in str(w.message) for w in caught), \
            f"{what}: no warning of the decline"
    _compare_models(model, ref, losses, ref_losses, what)


_MODEL_RESULTS = {}


@pytest.mark.parametrize("world,key", [(w, k) for w in WORLDS for k in MODEL_KEYS],
                         ids=lambda v: str(v))
def test_models(world, key, tmp_path_factory):
    pytest.importorskip("transformers")
    if world not in _MODEL_RESULTS:
        _MODEL_RESULTS[world] = spawn_group(world, MODEL_KEYS, _run_model_case, tmp_path_factory,
                                            timeout_s=60, deadline_s=300, context=_mesh)
    failures = failures_of(_MODEL_RESULTS[world], key)
    assert not failures, failures


# ---- 2-D device meshes: FSDP2 over "dp" with tensor parallelism over "tp" -------------------------
#
# A (2, 2) mesh of four gloo ranks. The weight placed as FSDP2 + TP leave an lm_head: (Replicate,
# Shard(0)) while it is whole on "dp", (StridedShard(0, sf=2), Shard(0)) when FSDP2 shards it too
# (rank (d, t) holds block d of tp block t: the vocabulary's blocks run in another order than the
# group's ranks), plain Shard(0) on both dimensions and on "dp" alone. Each rank checks its case
# against the unsharded float64 problem, as the 1-D cases above.

MESH2D = (2, 2)

# placements: per mesh dimension, "r" Replicate, an int Shard(dim), "s<dim>" the strided shard
# FSDP2 puts on "dp" (split_factor 2: the "tp" shard it splits); dp_rows: the ranks of each "dp"
# coordinate hold other rows (data parallelism: only "tp" shares a problem).
MESH2D_LINEAR_CASES = {
    "replicate_shard": {"placements": ("r", 0), "bias": True, "class_weight": "dtensor"},
    "replicate_shard_dp_rows": {"placements": ("r", 0), "dp_rows": True, "reduction": "sum"},
    "strided_fsdp_tp": {"placements": ("s0", 0), "bias": True, "class_weight": "dtensor",
                        "label_smoothing": 0.1},
    "strided_none_hidden_replicate": {"placements": ("s0", 0), "hidden": "replicate",
                                      "reduction": "none", "grad": "rows", "z_loss": 1e-3},
    "shard_shard_bf16": {"placements": (0, 0), "dtype": torch.bfloat16, "class_weight": "plain",
                         "chunk_budget_bytes": 2 * 5 * 40},
    "shard_replicate": {"placements": (0, "r"), "bias": True, "softcap": 6.0},
    "replicated_head": {"placements": ("r", "r"), "class_weight": "replicate"},
}

MESH2D_CE_CASES = {
    "replicate_shard": {"placements": ("r", -1), "weight": "dtensor"},
    "strided_none": {"placements": ("s-1", -1), "reduction": "none", "grad": "rows",
                     "label_smoothing": 0.1},
    "shard_shard_dim1": {"placements": (1, 1), "layout": "dim1", "shape": (5, 4),
                         "weight": "dtensor"},
}

MESH2D_ERROR_CASES = ("partial_dp", "shard_dim1_on_dp", "rows_and_classes", "lone_strided",
                      "one_rank_option_strided", "class_weight_misplaced")


def _mesh2d():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", MESH2D, mesh_dim_names=("dp", "tp"))


def _placement(code):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if code == "r":
        return Replicate()
    if isinstance(code, str):  # "s<dim>": FSDP2's strided shard over the "tp" shard
        return _StridedShard(int(code[1:]), split_factor=MESH2D[1])
    return Shard(code)


def _distribute2d(x, mesh, codes):
    """x placed on `mesh` by `codes` (see MESH2D_LINEAR_CASES), built from this rank's block as
    torch computes it (torch's own split, strided shards included)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = [_placement(c) for c in codes]
    shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, placements)
    local = x[tuple(slice(o, o + s) for o, s in zip(offset, shape))].clone()
    d = DTensor.from_local(local, mesh, placements, shape=x.shape, stride=x.stride())
    assert torch.equal(d.full_tensor(), x), f"{codes}: not torch's layout of the full tensor"
    return d


def _run_mesh2d_linear_case(name, mesh, rank, world):
    case = MESH2D_LINEAR_CASES[name]
    dp = mesh.get_coordinate()[0]
    g = torch.Generator().manual_seed(3000 + len(name) + (dp if case.get("dp_rows") else 0))
    dtype = case.get("dtype", torch.float32)
    h = (torch.randn(N_ROWS, HIDDEN, generator=g) * 0.7).to(dtype)
    t = torch.randint(0, VOCAB, (N_ROWS,), generator=g)
    t[torch.rand(N_ROWS, generator=g) < 0.2] = -100
    g = torch.Generator().manual_seed(3100 + len(name))  # the head: the same on every rank
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.7).to(dtype)
    b = torch.randn(VOCAB, generator=g).to(dtype) if case.get("bias") else None
    cw = make_weight(VOCAB) if case.get("class_weight") else None
    grad = _upstream(case.get("grad"), (N_ROWS,), g)
    opts = {k: case[k] for k in ("label_smoothing", "softcap", "z_loss", "reduction") if k in case}
    extra = {k: case[k] for k in ("chunk_budget_bytes",) if k in case}
    codes = case["placements"]
    dw = _distribute2d(w, mesh, codes).requires_grad_()
    db = _distribute2d(b, mesh, codes).requires_grad_() if b is not None else None
    dh = _distribute2d(h, mesh, ("r", "r")) if case.get("hidden") == "replicate" else h.clone()
    dh.requires_grad_()
    dcw = {"dtensor": lambda: _distribute2d(cw, mesh, codes),
           "replicate": lambda: _distribute2d(cw, mesh, ("r", "r")),
           "plain": lambda: cw}.get(case.get("class_weight"), lambda: None)()
    loss, metrics = fusedce.linear_cross_entropy(dh, dw, t, db, class_weight=dcw,
                                                 return_metrics=True, **opts, **extra)
    what = f"2-D linear {name}, rank {rank}"
    assert type(loss) is torch.Tensor, f"{what}: the loss is {type(loss).__name__}"
    loss.backward(torch.ones_like(loss) if grad is None else grad.to(loss.dtype))
    if not case.get("dp_rows"):
        _same_on_every_rank([loss, metrics["num_correct_tokens"], metrics["entropy_sum"]], what)

    def reference(dt_):
        hh, ww = h.to(dt_).requires_grad_(), w.to(dt_).requires_grad_()
        bb = b.to(dt_).requires_grad_() if b is not None else None
        out = torch_cross_entropy(F.linear(hh, ww, bb), t, cw, compute_dtype=dt_, **opts)
        out.backward(torch.ones_like(out) if grad is None else grad.to(dt_))
        return out, hh.grad, ww.grad, None if bb is None else bb.grad

    ref, rh, rw, rb = reference(torch.float64)
    theirs, th, tw, tb = reference(dtype)
    z64 = F.linear(h.double(), w.double(), None if b is None else b.double())
    loss_scale, dz_scale = error_scales(z64, t, cw, **opts, grad_out=grad)
    assert_within_budget(loss, theirs, ref, what=f"{what}: loss", scale=loss_scale)
    h2, w2 = h.double().abs(), w.double().abs()
    _check_grad("hidden", dh.grad, getattr(dh, "placements", None), rh, th,
                dz_scale * w2.sum(0).max().item(), dtype, what)
    # This rank's rows of the gradient (its local tensor) against the float64 gradient's: with
    # dp_rows the ranks of another "dp" coordinate hold another problem's rows, so full_tensor()
    # would mix problems.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    (rows, _), (v0, _) = compute_local_shape_and_global_offset(dw.shape, mesh, dw.placements)
    assert isinstance(dw.grad, type(dw)) and dw.grad.placements == dw.placements, what
    assert_within_budget(dw.grad.to_local(), tw[v0:v0 + rows], rw[v0:v0 + rows],
                         what=f"{what}: grad weight", scale=dz_scale * h2.sum(0).max().item(),
                         out_dtype=dtype)
    if b is not None:
        assert db.grad.placements == db.placements, what
        assert_within_budget(db.grad.to_local(), tb[v0:v0 + rows], rb[v0:v0 + rows],
                             what=f"{what}: grad bias", scale=dz_scale * N_ROWS, out_dtype=dtype)


def _run_mesh2d_ce_case(name, mesh, rank, world):
    case = MESH2D_CE_CASES[name]
    g = torch.Generator().manual_seed(4000 + len(name))
    shape = case.get("shape", (N_ROWS,))
    z = torch.randn(*shape, VOCAB, generator=g) * 2
    t = torch.randint(0, VOCAB, shape, generator=g)
    t[torch.rand(shape, generator=g) < 0.2] = -100
    w = make_weight(VOCAB) if case.get("weight") else None
    grad = _upstream(case.get("grad"), shape, g)
    opts = {k: case[k] for k in ("label_smoothing", "reduction") if k in case}
    dim1 = case.get("layout") == "dim1"
    x = z.movedim(-1, 1).contiguous() if dim1 else z
    codes = case["placements"]
    dx = _distribute2d(x, mesh, codes).requires_grad_()
    wcodes = tuple(c if c == "r" else ("s0" if isinstance(c, str) else 0) for c in codes)
    dw = _distribute2d(w, mesh, wcodes) if w is not None else None
    loss, metrics = fusedce.cross_entropy(dx, t, dw, return_metrics=True, **opts)
    what = f"2-D ce {name}, rank {rank}"
    assert type(loss) is torch.Tensor, f"{what}: the loss is {type(loss).__name__}"
    loss.backward(torch.ones_like(loss) if grad is None else grad)
    _same_on_every_rank([loss, metrics["num_correct_tokens"], metrics["lse"]], what)
    a = z.double().requires_grad_()
    ref = torch_cross_entropy(a, t, w, compute_dtype=torch.float64, **opts)
    if opts.get("reduction") == "none":
        ref = ref.view(t.shape)
    ref.backward(torch.ones_like(ref) if grad is None else grad.double())
    b = z.float().requires_grad_()
    theirs = torch_cross_entropy(b, t, w, compute_dtype=torch.float32, **opts)
    theirs = theirs.view(t.shape) if opts.get("reduction") == "none" else theirs
    theirs.backward(torch.ones_like(theirs) if grad is None else grad)
    loss_scale, grad_scale = error_scales(z, t, w, **opts, grad_out=grad)
    assert_within_budget(loss, theirs, ref, what=f"{what}: loss", scale=loss_scale)
    rz, tz = (a.grad.movedim(-1, 1), b.grad.movedim(-1, 1)) if dim1 else (a.grad, b.grad)
    _check_grad("logits", dx.grad, dx.placements, rz, tz, grad_scale, torch.float32, what)


def _run_mesh2d_error_case(key, mesh, rank, world):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    g = torch.Generator().manual_seed(8)
    h = torch.randn(N_ROWS, HIDDEN, generator=g)
    w = torch.randn(VOCAB, HIDDEN, generator=g) / 4
    z = torch.randn(N_ROWS, VOCAB, generator=g)
    t = torch.randint(0, VOCAB, (N_ROWS,), generator=g)
    lin = fusedce.linear_cross_entropy
    strided = _distribute2d(w, mesh, ("s0", 0))
    if key == "partial_dp":
        local = _distribute2d(w, mesh, ("r", 0)).to_local() / 2
        bad = DTensor.from_local(local, mesh, [Partial(), Shard(0)], shape=w.shape,
                                 stride=w.stride())
        with pytest.raises(ValueError, match=r"weight must be sharded on dim 0.*replicated on "
                           r"every mesh dimension.*Partial.*mesh dimension 0 \('dp'\)"):
            lin(h, bad, t)
    elif key == "shard_dim1_on_dp":
        with pytest.raises(ValueError, match=r"weight must be sharded on dim 0.*Shard\(dim=1\) "
                           r"on mesh dimension 0 \('dp'\)"):
            lin(h, _distribute2d(w, mesh, (1, 0)), t)
    elif key == "rows_and_classes":
        with pytest.raises(ValueError, match="logits must be sharded on their class dimension "
                           "alone"):
            fusedce.cross_entropy(_distribute2d(z, mesh, (0, 1)), t)
    elif key == "lone_strided":  # a strided shard without the shard it splits: not contiguous
        placements = [_placement("s0"), Replicate()]
        # the rows this rank holds: its "dp" part of each of the two blocks
        local = torch.cat([c.chunk(MESH2D[0])[mesh.get_coordinate()[0]]
                           for c in w.chunk(MESH2D[1])])
        bad = DTensor.from_local(local, mesh, placements, shape=w.shape, stride=w.stride())
        with pytest.raises(ValueError, match="weight .* must hold a contiguous block of at least "
                           "one class on every rank"):
            lin(h, bad, t)
    elif key == "one_rank_option_strided":  # the group of both mesh dimensions agrees
        agreed = r"rank 1 \(ValueError\) of 4 rejected its arguments"
        with pytest.raises(ValueError, match="reduction" if rank == 1 else agreed):
            lin(h, strided, t, reduction="avg" if rank == 1 else "mean")
    elif key == "class_weight_misplaced":  # placed on "dp" only while the weight is on both
        with pytest.raises(ValueError, match=r"class_weight must be a DTensor placed as the "
                           r"weight on the classes \(\(_StridedShard"):
            lin(h, strided, t, class_weight=_distribute2d(torch.ones(VOCAB), mesh, (0, "r")))
    # The next call over the strided head is right on every rank.
    got = lin(h, strided, t)
    want = F.cross_entropy(h.double() @ w.double().t(), t).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _mesh2d_keys():
    return ([f"linear/{n}" for n in MESH2D_LINEAR_CASES] + [f"ce/{n}" for n in MESH2D_CE_CASES]
            + [f"error/{n}" for n in MESH2D_ERROR_CASES])


def _run_mesh2d_key(key, mesh, rank, world):
    form, name = key.split("/", 1)
    run = {"linear": _run_mesh2d_linear_case, "ce": _run_mesh2d_ce_case,
           "error": _run_mesh2d_error_case}[form]
    return run(name, mesh, rank, world)


_MESH2D_RESULTS = {}


@pytest.mark.parametrize("key", _mesh2d_keys())
def test_mesh2d(key, tmp_path_factory):
    if "cases" not in _MESH2D_RESULTS:
        _MESH2D_RESULTS["cases"] = spawn_group(4, _mesh2d_keys(), _run_mesh2d_key, tmp_path_factory,
                                               timeout_s=30, deadline_s=300, context=_mesh2d)
    failures = failures_of(_MESH2D_RESULTS["cases"], key)
    assert not failures, failures


# The model of the 1-D model cases on the (2, 2) mesh: lm_head under ColwiseParallel over "tp",
# every decoder layer, lm_head and the model under fully_shard over "dp" (FSDP2 + TP).
# direct_call: a module whose forward passes the head's weight to fusedce.linear_cross_entropy by
# hand; lm_head's own call never runs, so FSDP2 leaves its weight sharded on both dimensions
# (the strided layout) and the call runs over all four ranks.
MESH2D_MODEL_KEYS = ("fsdp_tp/fused_linear", "fsdp_tp/logits", "fsdp_tp/direct_call")


class _DirectLoss(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state
        return fusedce.linear_cross_entropy(hidden, self.lm.lm_head.weight, labels, shift=True)


def _run_mesh2d_model_case(key, mesh, rank, world):
    import copy

    import fusedce.transformers as fct
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    mode = key.split("/")[1]
    model = _tiny_causal_lm()
    ref = copy.deepcopy(model).double()
    steps = 2
    ref_losses = _sgd_steps(ref, steps, _transformers_loss)
    what = f"2-D {key}, rank {rank}"
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model.lm_head, mesh=mesh["dp"])
    root = _DirectLoss(model) if mode == "direct_call" else model
    fully_shard(root, mesh=mesh["dp"])
    placements = tuple(model.lm_head.weight.placements)
    assert placements == (_StridedShard(0, split_factor=2), Shard(0)), f"{what}: {placements}"
    seen = []

    def loss_of(m, ids, labels):
        if mode == "direct_call":
            return m(ids, labels)
        out = m(input_ids=ids, labels=labels)
        seen.append((fct.serving(m), out.logits.shape[-1]))
        return out.loss

    fct.apply(fused_linear=mode != "logits")
    try:
        losses = _sgd_steps(root, steps, loss_of)
    finally:
        fct.revert()
    if mode == "fused_linear":
        assert seen == [("fused_linear", 0)] * steps, f"{what}: not the fused path: {seen}"
    elif mode == "logits":
        assert seen == [("logits", VOCAB)] * steps, f"{what}: not the logits path: {seen}"
    _compare_models(model, ref, losses, ref_losses, what)


_MESH2D_MODEL_RESULTS = {}


@pytest.mark.parametrize("key", MESH2D_MODEL_KEYS)
def test_mesh2d_models(key, tmp_path_factory):
    pytest.importorskip("transformers")
    if "models" not in _MESH2D_MODEL_RESULTS:
        _MESH2D_MODEL_RESULTS["models"] = spawn_group(
            4, MESH2D_MODEL_KEYS, _run_mesh2d_model_case, tmp_path_factory, timeout_s=60,
            deadline_s=400, context=_mesh2d)
    failures = failures_of(_MESH2D_MODEL_RESULTS["models"], key)
    assert not failures, failures


# ---- torch.compile: DTensor inputs traced whole ---------------------------------------------------
#
# torch.compile(fullgraph=True, backend="aot_eager") of functions calling the DTensor forms: the
# layout (torch's split of the mesh) is taken as constants of the graph, the collectives are
# torch's functional ones; no graph break, and the loss and gradients of the eager call.

COMPILE_KEYS = ("linear", "ce")


def _compiled_and_eager(fn, make_inputs):
    """(loss, gradients) of fn eagerly and under torch.compile, from fresh leaves each time."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for run in (fn, compiled):
        leaves, args = make_inputs()
        loss = run(*args)
        loss.backward(torch.ones_like(loss) if loss.dim() == 0 else
                      torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape))
        results.append((loss.detach(), [_full(x.grad) for x in leaves]))
    return results


def _run_compile_case(key, mesh, rank, world):
    g = torch.Generator().manual_seed(5000)
    h = torch.randn(N_ROWS, HIDDEN, generator=g) * 0.7
    w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.7
    b = torch.randn(VOCAB, generator=g)
    z = torch.randn(3, VOCAB, 7, generator=g) * 2  # (N, C, d1): classes on dim 1
    t = torch.randint(0, VOCAB, (N_ROWS,), generator=g)
    t[::5] = -100
    tz = torch.randint(0, VOCAB, (3, 7), generator=g)
    cw = make_weight(VOCAB)
    if key == "linear":
        def fn(h, w, t, b):
            return fusedce.linear_cross_entropy(h, w, t, b, label_smoothing=0.1, z_loss=1e-3)

        def make_inputs():
            dh = h.clone().requires_grad_()
            dw = _distribute(w, mesh, 0).requires_grad_()
            db = _distribute(b, mesh, 0).requires_grad_()
            return (dh, dw, db), (dh, dw, t, db)
    else:
        def fn(z, t, cw):
            return fusedce.cross_entropy(z, t, cw, reduction="none", softcap=8.0)

        def make_inputs():
            dz = _distribute(z, mesh, 1).requires_grad_()
            return (dz,), (dz, tz, _distribute(cw, mesh, 0))
    (loss, grads), (closs, cgrads) = _compiled_and_eager(fn, make_inputs)
    what = f"compile {key}, world {world}, rank {rank}"
    assert type(closs) is torch.Tensor, f"{what}: {type(closs).__name__}"
    torch.testing.assert_close(closs, loss, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: loss: {m}")
    for i, (c, e) in enumerate(zip(cgrads, grads)):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7,
                                   msg=lambda m, i=i: f"{what}: grad {i}: {m}")
    # and the eager call is the float64 loss (the compiled one equals it above)
    if key == "linear":
        ref = torch_cross_entropy(F.linear(h.double(), w.double(), b.double()), t, None,
                                  compute_dtype=torch.float64, label_smoothing=0.1, z_loss=1e-3)
    else:
        ref = torch_cross_entropy(z.double().movedim(1, -1), tz, cw, compute_dtype=torch.float64,
                                  reduction="none", softcap=8.0).view(tz.shape)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


_COMPILE_RESULTS = {}


@pytest.mark.parametrize("key", COMPILE_KEYS)
def test_compile(key, tmp_path_factory):
    if "compile" not in _COMPILE_RESULTS:
        _COMPILE_RESULTS["compile"] = spawn_group(2, COMPILE_KEYS, _run_compile_case,
                                                  tmp_path_factory, timeout_s=120, deadline_s=400,
                                                  context=_mesh)
    failures = failures_of(_COMPILE_RESULTS["compile"], key)
    assert not failures, failures


