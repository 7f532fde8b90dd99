"""torch.library.opcheck on every op of the fusedce library: schemas and mutation annotations
match what the kernels do, fake kernels match real ones, autograd is registered where it must be,
and the ops work under AOTAutograd with dynamic shapes."""

import pytest
import torch

import fusedce  # noqa: F401  (loads the ops)
from conftest import DEVICES, make_problem, make_weight

ops = torch.ops.fusedce

# (name, options): the plain call and one with every option (class_weight passed separately).
CASES = [
    ("plain", dict(ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0,
                   softcap=0.0, z_loss=0.0)),
    ("options_none", dict(ignore_index=2, reduction="none", label_smoothing=0.1, logit_scale=0.7,
                          softcap=10.0, z_loss=1e-3)),
    ("options_sum", dict(ignore_index=-100, reduction="sum", label_smoothing=0.2, logit_scale=1.3,
                         softcap=0.0, z_loss=1e-2)),
]


def _inputs(device, dtype, opts, weighted, n=13, vocab=97):
    x, t = make_problem((n,), vocab, dtype, device, ignore_index=opts["ignore_index"], seed=4)
    w = make_weight(vocab, device) if weighted else None
    return x, t, w, tuple(opts.values())


parametrize = pytest.mark.parametrize
cases = parametrize("name,opts", CASES, ids=[c[0] for c in CASES])
dtypes = parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)


@parametrize("device", DEVICES)
@dtypes
@cases
@parametrize("metrics", [False, True])
@parametrize("requires_grad", [False, True])
def test_ce_fwd_bwd(device, dtype, name, opts, metrics, requires_grad):
    x, t, w, o = _inputs(device, dtype, opts, weighted=name != "plain")
    torch.library.opcheck(ops.ce_fwd_bwd.default, (x.requires_grad_(requires_grad), t, w, *o, metrics))


@parametrize("device", DEVICES)
@dtypes
@cases
@parametrize("metrics", [False, True])
@parametrize("requires_grad", [False, True])
def test_ce_loss(device, dtype, name, opts, metrics, requires_grad):
    """ce_loss, the op whose autograd is C++ (torch/autograd.h): its schema, fake kernel,
    autograd registration (opcheck's test_autograd_registration) and its gradient: the bits of
    ce_fwd_bwd's dlogits scaled by the upstream gradient with ce_rescale_."""
    x, t, w, o = _inputs(device, dtype, opts, weighted=name != "plain")
    torch.library.opcheck(ops.ce_loss.default, (x.requires_grad_(requires_grad), t, w, *o, metrics))
    if requires_grad:
        loss = ops.ce_loss.default(x, t, w, *o, metrics)[0]
        upstream = torch.rand_like(loss) + 0.5
        (grad,) = torch.autograd.grad(loss, x, upstream)
        expected = ops.ce_fwd_bwd(x.detach(), t, w, *o, metrics)[4]
        ops.ce_rescale_(upstream.float().contiguous(), expected)
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)
        # The saved dlogits is scaled in place once; a kept graph scales a copy each time.
        loss = ops.ce_loss.default(x, t, w, *o, metrics)[0]
        first = torch.autograd.grad(loss, x, upstream, retain_graph=True)[0]
        second = torch.autograd.grad(loss, x, upstream)[0]
        torch.testing.assert_close(first, expected, rtol=0, atol=0)
        torch.testing.assert_close(second, expected, rtol=0, atol=0)


@parametrize("device", DEVICES)
@dtypes
@cases
@parametrize("metrics", [False, True])
def test_ce_fwd_bwd_(device, dtype, name, opts, metrics):
    x, t, w, o = _inputs(device, dtype, opts, weighted=name != "plain")
    torch.library.opcheck(ops.ce_fwd_bwd_.default, (x, t, w, *o, metrics))
    # The gradient written over the logits is ce_fwd_bwd's dlogits, and the rest its outputs.
    expected = ops.ce_fwd_bwd(x, t, w, *o, metrics)
    got = ops.ce_fwd_bwd_(x, t, w, *o, metrics)
    for a, b in zip(got, expected[:4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(x, expected[4], rtol=0, atol=0)


@parametrize("device", DEVICES)
@dtypes
@parametrize("per_row", [False, True])
def test_ce_rescale_(device, dtype, per_row):
    x, _ = make_problem((9,), 40, dtype, device)
    g = torch.rand(9 if per_row else (), device=device) * 3
    torch.library.opcheck(ops.ce_rescale_.default, (g, x))


# ---- fused linear cross-entropy --------------------------------------------------------------

# (name, options, bias, class weights): the options after class_weight, as the lce ops take them
# (ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss, shift_seq_len,
# chunk_budget_bytes, low_memory, skip_ignored).
LCE_CASES = [
    ("plain", (-100, "mean", 0.0, 1.0, 0.0, 0.0, 0, 0, False, False), False, False),
    ("options_none_shift_skip", (2, "none", 0.1, 0.7, 10.0, 1e-3, 7, 0, False, True), True, True),
    ("options_sum_low_memory", (-100, "sum", 0.2, 1.3, 0.0, 1e-2, 0, 4096, True, False), True, False),
]
lce_cases = parametrize("name,opts,with_bias,weighted", LCE_CASES, ids=[c[0] for c in LCE_CASES])


def _lce_inputs(device, dtype, opts, with_bias, weighted, n=14, hidden=9, vocab=53):
    g = torch.Generator().manual_seed(8)
    h = torch.randn(n, hidden, generator=g).to(dtype).to(device)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).to(device)
    b = torch.randn(vocab, generator=g).to(dtype).to(device) if with_bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::4] = opts[0]
    cw = make_weight(vocab, device) if weighted else None
    return h, w, b, t.to(device), cw


def _lce_loss_buffer(h, opts):
    return torch.empty((h.shape[0],) if opts[1] == "none" else (), device=h.device)


@parametrize("device", DEVICES)
@dtypes
@lce_cases
@parametrize("metrics", [False, True])
@parametrize("requires_grad", [False, True])
def test_lce_fwd(device, dtype, name, opts, with_bias, weighted, metrics, requires_grad):
    h, w, b, t, cw = _lce_inputs(device, dtype, opts, with_bias, weighted)
    h.requires_grad_(requires_grad)
    w.requires_grad_(requires_grad)
    torch.library.opcheck(ops.lce_fwd.default, (h, w, b, t, cw, *opts, metrics))


@parametrize("device", DEVICES)
@dtypes
@lce_cases
@parametrize("needs", [(True, True, True), (False, True, False)], ids=["hwb", "w"])
@parametrize("grad_loss", [False, True])
def test_lce_fwd_bwd(device, dtype, name, opts, with_bias, weighted, needs, grad_loss):
    h, w, b, t, cw = _lce_inputs(device, dtype, opts, with_bias, weighted)
    metrics = name != "plain"
    needs = (needs[0], needs[1], needs[2] and b is not None)
    g = torch.rand(_lce_loss_buffer(h, opts).shape, device=device) if grad_loss else None
    h.requires_grad_(True)
    torch.library.opcheck(ops.lce_fwd_bwd.default, (h, w, b, t, cw, *opts, g, metrics, *needs))


def test_every_op_is_checked():
    # The vocabulary-parallel ops get theirs in test_distributed.py: ce_shard_* in test_opcheck,
    # lce_shard_* in test_lce_opcheck; the log-probability ops (lp_*, llp_*) in
    # test_logprobs.py's test_opcheck; the distillation ops (ld_*, ldk_*) in test_distillation.py's.
    names = {name for name in dir(ops)
             if not name.startswith("_")
             and not name.startswith(("ce_shard_", "lce_shard_", "lp_", "llp_", "ld_", "ldk_"))} - {"name"}
    tested = {name[len("test_"):] for name in globals()
              if name.startswith("test_ce_") or name.startswith("test_lce_")}
    assert names <= tested, f"ops without an opcheck test: {sorted(names - tested)}"
