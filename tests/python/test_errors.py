"""Bad input gives a ValueError / RuntimeError (TypeError for a non-tensor) whose message names
the argument, before any work; never a crash or a silently wrong number."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fusedce
from conftest import DEVICES, requires_cuda

ops = torch.ops.fusedce


def _ok(device="cpu", n=6, vocab=11):
    return torch.randn(n, vocab, device=device), torch.randint(0, vocab, (n,), device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,exc,match", [
    ("logits_float64_strict", ValueError, "float64 logits are not computed by the fused kernels"),
    ("probabilities_strict", ValueError, "class-probability targets are not computed"),
    ("logits_int", ValueError, "logits"),
    ("target_float", ValueError, "target must be int64 or int32"),
    ("target_shape", ValueError, "target must have shape"),
    ("target_trailing", ValueError, "target must have shape"),
    ("weight_shape", ValueError, "weight must be a tensor of shape"),
    ("weight_half", None, None),  # converted to float32: fine
    ("weight_not_tensor", ValueError, "weight"),
    ("reduction", ValueError, "reduction must be"),
    ("label_smoothing", ValueError, "label_smoothing must be in"),
    ("logit_scale", ValueError, "logit_scale must be finite"),
    ("softcap", ValueError, "softcap must be"),
    ("z_loss", ValueError, "z_loss must be"),
    ("scalar_logits", ValueError, "logits must have shape"),
    ("empty_vocab", ValueError, "logits must have shape"),
    ("logits_not_tensor", TypeError, "logits must be a tensor"),
])
def test_bad_arguments(device, case, exc, match):
    x, t = _ok(device)
    kw = {}
    if case == "logits_float64_strict":  # without strict=True: PyTorch computes it
        x = x.double()
        kw["strict"] = True
    elif case == "probabilities_strict":
        t = torch.softmax(torch.randn_like(x), -1)
        kw["strict"] = True
    elif case == "logits_int":
        x = x.long()
    elif case == "target_float":
        t = t.float()
    elif case == "target_shape":
        t = t[:-1]
    elif case == "target_trailing":
        t = t[:, None]
    elif case == "weight_shape":
        kw["weight"] = torch.ones(10, device=device)
    elif case == "weight_half":
        kw["weight"] = torch.ones(11, device=device, dtype=torch.half)
    elif case == "weight_not_tensor":
        kw["weight"] = [1.0] * 11
    elif case == "reduction":
        kw["reduction"] = "average"
    elif case == "label_smoothing":
        kw["label_smoothing"] = 1.5
    elif case == "logit_scale":
        kw["logit_scale"] = float("inf")
    elif case == "softcap":
        kw["softcap"] = -1.0
    elif case == "z_loss":
        kw["z_loss"] = -0.1
    elif case == "scalar_logits":
        x = x[0, 0]
        t = t[0]
    elif case == "empty_vocab":
        x = x[:, :0]
    elif case == "logits_not_tensor":
        x = x.tolist()
    if exc is None:
        fusedce.cross_entropy(x, t, **kw)
        return
    with pytest.raises(exc, match=match):
        fusedce.cross_entropy(x, t, **kw)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        with pytest.raises(exc, match=match):  # the training path checks the same way
            fusedce.cross_entropy(x.requires_grad_(True), t, **kw)


# Values the kernels' float32 cannot hold: 0 instead of a tiny number would turn an option off,
# a subnormal keeps a few digits, inf is refused by the core with a message about inf.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw,match", [
    ({"softcap": 1e-50}, r"softcap=1e-50 cannot be represented in float32.*become 0\.0"),
    ({"softcap": 1e-40}, r"softcap=1e-40 cannot be represented in float32"),  # subnormal
    ({"softcap": 1e39}, r"softcap=1e\+39 cannot be represented in float32.*become inf"),
    ({"softcap": float("inf")}, r"softcap must be None \(off\) or finite and > 0"),
    ({"logit_scale": 1e-50}, r"logit_scale=1e-50 cannot be represented"),
    ({"logit_scale": -1e39}, r"logit_scale=-1e\+39 cannot be represented"),
    ({"z_loss": 1e-50}, r"z_loss=1e-50 cannot be represented.*become 0\.0"),
    ({"z_loss": 1e-39}, r"z_loss=1e-39 cannot be represented"),
    ({"z_loss": 1e39}, r"z_loss=1e\+39 cannot be represented"),
    # the kernels take tanh(x * (logit_scale / softcap)) with the ratio in float32
    ({"softcap": 1e-30, "logit_scale": 1e10}, r"logit_scale / softcap=.* cannot be represented"),
    ({"softcap": 1e30, "logit_scale": 1e-20}, r"logit_scale / softcap=.* cannot be represented"),
], ids=lambda v: str(v))
def test_options_float32_cannot_hold(device, kw, match):
    x, t = _ok(device)
    for fn in (lambda: fusedce.cross_entropy(x, t, **kw),
               lambda: fusedce.cross_entropy(x.requires_grad_(True), t, **kw),
               lambda: fusedce.linear_cross_entropy(x, torch.randn(5, 11, device=device),
                                                    t.clamp(max=4), **kw)):
        with pytest.raises(ValueError, match=match):
            fn()


@pytest.mark.parametrize("device", DEVICES)
def test_options_at_float32s_edges_are_computed(device):
    # The smallest normal float32 values are taken and give the contract's numbers (float64
    # reference); label_smoothing is narrowed to float32 as PyTorch's own float32 kernels
    # narrow it, so a value float32 rounds to 0 is taken and gives PyTorch's result.
    x, t = _ok(device)
    x64 = x.double()
    for kw in ({"softcap": 2e-38}, {"z_loss": 2e-38}, {"logit_scale": 2e-38},
               {"softcap": 1e30, "logit_scale": 1e-7}):
        ours = fusedce.cross_entropy(x, t, **kw)
        z = x64 * kw.get("logit_scale", 1.0)
        if "softcap" in kw:
            z = kw["softcap"] * torch.tanh(z / kw["softcap"])
        ref = F.cross_entropy(z, t) + kw.get("z_loss", 0.0) * (torch.logsumexp(z, -1) ** 2).mean()
        torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6, msg=str(kw))
    torch.testing.assert_close(fusedce.cross_entropy(x, t, label_smoothing=1e-50),
                               F.cross_entropy(x, t, label_smoothing=1e-50), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value,exc,match", [
    (3.7, TypeError, r"ignore_index must be an integer, got 3.7 \(float\)"),  # int() truncated it
    (3.0, TypeError, "ignore_index must be an integer"),  # F.cross_entropy refuses floats too
    (True, TypeError, "ignore_index must be an integer, got the bool True"),
    ("3", TypeError, "ignore_index must be an integer"),
    (2 ** 70, ValueError, "ignore_index must fit in int64"),
], ids=str)
def test_ignore_index_must_be_an_integer(device, value, exc, match):
    x, t = _ok(device)
    for fn in (lambda: fusedce.cross_entropy(x, t, ignore_index=value),
               lambda: fusedce.cross_entropy(x.requires_grad_(True), t, ignore_index=value),
               lambda: fusedce.linear_cross_entropy(x, torch.randn(11, 11, device=device), t,
                                                    ignore_index=value)):
        with pytest.raises(exc, match=match):
            fn()


@pytest.mark.parametrize("device", DEVICES)
def test_ignore_index_takes_what_f_cross_entropy_takes(device):
    # Integers: int, a numpy integer, a one-element integer tensor; any int64 value.
    x, t = _ok(device)
    t[2] = t[4] = 3
    ref = F.cross_entropy(x, t, ignore_index=3)
    for value in (3, np.int64(3), np.int32(3), torch.tensor(3)):
        torch.testing.assert_close(fusedce.cross_entropy(x, t, ignore_index=value), ref)
    for value in (2 ** 40, -(2 ** 63)):
        torch.testing.assert_close(fusedce.cross_entropy(x, t, ignore_index=value),
                                   F.cross_entropy(x, t, ignore_index=value))


class _NoOps:
    """Stands for a module's op namespace: every op is `fail`."""

    def __init__(self, fail):
        self._fail = fail

    def __getattr__(self, name):
        return type("NoOp", (), {"default": staticmethod(self._fail), "__call__": staticmethod(self._fail)})()


@pytest.mark.parametrize("device", DEVICES)
def test_check_targets_names_the_first_bad_entry(device, monkeypatch):
    # check_targets=True runs in Python on the target's device before any op: the same check
    # the GPU gets (one synchronisation). The ops are made to fail here to show that it is
    # this check, not the CPU core's, that reports the entry.
    import fusedce.functional as functional
    import fusedce.linear as linear

    def no_op(*args, **kwargs):
        raise AssertionError("an op ran although the targets are bad")

    x = torch.randn(2, 5, 11, device=device)
    t = torch.randint(0, 11, (2, 5), device=device)
    t[0, 1] = -100  # ignore_index: fine
    t[1, 2], t[1, 4] = 11, -3
    h, w = torch.randn(2, 5, 8, device=device), torch.randn(11, 8, device=device)
    monkeypatch.setattr(functional, "ops", _NoOps(no_op))
    monkeypatch.setattr(functional.InplaceCrossEntropy, "apply", no_op)
    monkeypatch.setattr(linear, "call_below_autograd", no_op)
    monkeypatch.setattr(linear.FusedLinearCrossEntropy, "apply", no_op)
    message = r"target\[7\] = 11 is out of range \[0, 11\) and is not ignore_index \(-100\)"
    with pytest.raises(ValueError, match=message):
        fusedce.cross_entropy(x, t, check_targets=True)
    y = (x.clone().requires_grad_(True) * 1.0)
    y0 = y.detach().clone()
    with pytest.raises(ValueError, match=message):
        fusedce.cross_entropy(y, t, check_targets=True, inplace_backward=True)
    assert torch.equal(y.detach(), y0)
    with pytest.raises(ValueError, match=message):
        fusedce.cross_entropy(x.movedim(-1, 1), t, check_targets=True)  # (N, C, d) layout
    with pytest.raises(ValueError, match=message):
        fusedce.cross_entropy(x.double(), t, check_targets=True)  # the fallback to PyTorch
    with pytest.raises(ValueError, match=r"target\[1\] = -100 is out of range \[0, 11\) and is "
                                         r"not ignore_index \(5\)"):
        fusedce.cross_entropy(x, t, check_targets=True, ignore_index=5)
    with pytest.raises(ValueError, match=message):
        fusedce.CrossEntropyLoss(check_targets=True)(x, t)
    with pytest.raises(ValueError, match=message.replace("cross_entropy", "linear_cross_entropy")):
        fusedce.linear_cross_entropy(h, w, t, check_targets=True)
    # shift: the first entry of each sequence is no row's target and is not checked
    t2 = torch.randint(0, 11, (2, 5), device=device)
    t2[0, 0] = t2[1, 0] = 99
    t2[1, 3] = 12
    with pytest.raises(ValueError, match=r"target\[8\] = 12 is out of range"):
        fusedce.linear_cross_entropy(h, w, t2, shift=True, check_targets=True)
    with pytest.raises(ValueError, match=r"target\[8\] = 12 is out of range"):
        fusedce.LinearCrossEntropyLoss(shift=True, check_targets=True)(h, w, t2)


@pytest.mark.parametrize("device", DEVICES)
def test_check_targets_passes_good_targets(device):
    x, t = _ok(device)
    t[0] = -100
    ref = fusedce.cross_entropy(x, t)
    assert torch.equal(fusedce.cross_entropy(x, t, check_targets=True), ref)
    assert torch.equal(fusedce.cross_entropy(x, t.int(), check_targets=True), ref)
    empty = fusedce.cross_entropy(x[:0], t[:0], check_targets=True, reduction="sum")
    assert empty.item() == 0.0
    t2 = t.clone()
    t2[0] = 11
    with pytest.raises(ValueError, match=r"target\[0\] = 11"):  # the first entry
        fusedce.cross_entropy(x, t2, check_targets=True)
    t2[0] = 2 ** 40  # beyond int32: compared as int64
    with pytest.raises(ValueError, match=rf"target\[0\] = {2 ** 40}"):
        fusedce.cross_entropy(x, t2, check_targets=True)


@requires_cuda
def test_check_targets_cuda():
    # Off (default): no host synchronisation, the bad row is NaN. On: the row is named.
    x, t = _ok("cuda")
    t[4] = 1000
    torch.cuda.set_sync_debug_mode("error")  # a synchronising torch op raises
    try:
        loss = fusedce.cross_entropy(x, t, reduction="none")
        with pytest.raises(RuntimeError, match="synchroniz"):
            fusedce.cross_entropy(x, t, check_targets=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isnan(loss[4]) and torch.isfinite(loss[:4]).all()
    with pytest.raises(ValueError, match=r"target\[4\] = 1000 is out of range \[0, 11\)"):
        fusedce.cross_entropy(x, t, check_targets=True)
    with pytest.raises(ValueError, match=r"target\[4\] = 1000 is out of range \[0, 11\)"):
        fusedce.linear_cross_entropy(x, torch.randn(11, 11, device="cuda"), t, check_targets=True)


def test_target_out_of_range_names_row_and_value():
    x, t = _ok()
    t[3] = 11
    with pytest.raises(ValueError, match=r"target\[3\] = 11 is out of range \[0, 11\)"):
        fusedce.cross_entropy(x, t)
    t[3] = -1
    with pytest.raises(ValueError, match=r"target\[3\] = -1"):
        fusedce.cross_entropy(x.requires_grad_(True), t)
    t[3] = -100  # ignore_index is fine
    fusedce.cross_entropy(x, t)


def test_target_out_of_range_inplace_leaves_logits():
    x, t = _ok()
    t[2] = 50
    x0 = x.clone()
    y = x.requires_grad_(True) * 1.0
    with pytest.raises(ValueError, match=r"target\[2\] = 50"):
        fusedce.cross_entropy(y, t, inplace_backward=True)
    assert torch.equal(y.detach(), x0)


@pytest.mark.parametrize("device", DEVICES)
def test_device_mismatch(device):
    x, t = _ok(device)
    with pytest.raises(ValueError, match="target is on meta"):
        fusedce.cross_entropy(x, t.to("meta"))
    with pytest.raises(ValueError, match="weight is on meta"):
        fusedce.cross_entropy(x, t, torch.ones(11, device="meta"))


@requires_cuda
def test_device_mismatch_cuda():
    x, t = _ok("cpu")
    with pytest.raises(ValueError, match="target is on cuda"):
        fusedce.cross_entropy(x, t.cuda())
    with pytest.raises(ValueError, match="logits is on cpu but another argument is on a CUDA"):
        ops.ce_loss(x, t.cuda(), None, -100, "mean", 0.0, 1.0, 0.0, 0.0, False)
    with pytest.raises(ValueError, match="class_weight is on cpu but logits are on cuda"):
        ops.ce_loss(x.cuda(), t.cuda(), torch.ones(11), -100, "mean", 0.0, 1.0, 0.0, 0.0, False)


@requires_cuda
def test_target_out_of_range_cuda_gives_nan_row():
    # On the GPU targets are not checked (that would need a device sync): the row's loss is NaN
    # and nothing outside the tensors is touched (docs/contract.md, "Bad input").
    x, t = _ok("cuda")
    t[1] = 1000
    loss = fusedce.cross_entropy(x, t, reduction="none")
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3, 4, 5]]).all()


def test_ops_check_their_arguments():
    x, t = _ok()
    o = (-100, "mean", 0.0, 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        ops.ce_loss(x[None], t, None, *o, False)
    with pytest.raises(ValueError, match="reduction must be 'none', 'sum' or 'mean'"):
        ops.ce_loss(x, t, None, -100, "avg", 0.0, 1.0, 0.0, 0.0, False)
    with pytest.raises(ValueError, match="target must be 1-D with one entry per row"):
        ops.ce_loss(x, t[:3], None, *o, False)
    with pytest.raises(ValueError, match="class_weight must be float32"):
        ops.ce_loss(x, t, torch.ones(11, dtype=torch.float64), *o, False)
    with pytest.raises(ValueError, match="class_weight must be 1-D"):
        ops.ce_fwd_bwd(x, t, torch.ones(1, 11), *o, False)
    with pytest.raises(ValueError, match="unit stride along its last dimension"):
        ops.ce_loss(torch.randn(11, 6).t(), t, None, *o, False)
    with pytest.raises(ValueError, match="grad_loss must be float32"):
        ops.ce_rescale_(torch.ones((), dtype=torch.float64), x)
    with pytest.raises(ValueError, match="grad_loss must have 6 elements"):
        ops.ce_rescale_(torch.ones(5), x)


@pytest.mark.parametrize("device", DEVICES)
def test_slips_the_survey_found(device):
    """dev/bad_inputs.py's findings: a vocabulary range without a group, a bool as a number, a
    budget beyond int64 (which reached the dispatcher's own confusing message)."""
    x, t = _ok(device)
    with pytest.raises(ValueError, match="vocab_start and vocab_total are only used with a process_group"):
        fusedce.cross_entropy(x, t, vocab_start=3)
    with pytest.raises(ValueError, match="vocab_start and vocab_total are only used with a process_group"):
        fusedce.cross_entropy(x, t, vocab_total=11)
    with pytest.raises(TypeError, match="softcap must be a real number"):
        fusedce.cross_entropy(x, t, softcap=True)
    h = torch.randn(4, 8, device=device)
    w = torch.randn(11, 8, device=device)
    tt = torch.randint(0, 11, (4,), device=device)
    for bad in (True, 2**70):
        with pytest.raises(ValueError, match="chunk_budget_bytes must be None"):
            fusedce.linear_cross_entropy(h, w, tt, chunk_budget_bytes=bad)
