"""Bad input gives a ValueError / RuntimeError (TypeError for a non-tensor) whose message names
the argument, before any work; never a crash or a silently wrong number."""

import pytest
import torch

import fusedce
from conftest import DEVICES, requires_cuda

ops = torch.ops.fusedce


def _ok(device="cpu", n=6, vocab=11):
    return torch.randn(n, vocab, device=device), torch.randint(0, vocab, (n,), device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,exc,match", [
    ("logits_float64", ValueError, "logits must be float32, bfloat16 or float16"),
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
    if case == "logits_float64":
        x = x.double()
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
    with pytest.raises(ValueError, match=r"target\[2\] = 50"):
        fusedce.cross_entropy(x.requires_grad_(True), t, inplace_backward=True)
    assert torch.equal(x.detach(), x0)


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
        ops.ce_fwd(x, t.cuda(), None, -100, "mean", 0.0, 1.0, 0.0, 0.0, False)
    with pytest.raises(ValueError, match="weight is on cpu but logits are on cuda"):
        ops.ce_fwd(x.cuda(), t.cuda(), torch.ones(11), -100, "mean", 0.0, 1.0, 0.0, 0.0, False)


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
        ops.ce_fwd(x[None], t, None, *o, False)
    with pytest.raises(ValueError, match="reduction must be 'none', 'sum' or 'mean'"):
        ops.ce_fwd(x, t, None, -100, "avg", 0.0, 1.0, 0.0, 0.0, False)
    with pytest.raises(ValueError, match="target must be 1-D with one entry per row"):
        ops.ce_fwd(x, t[:3], None, *o, False)
    with pytest.raises(ValueError, match="weight must be float32"):
        ops.ce_fwd(x, t, torch.ones(11, dtype=torch.float64), *o, False)
    with pytest.raises(ValueError, match="unit stride along its last dimension"):
        ops.ce_fwd(torch.randn(11, 6).t(), t, None, *o, False)
    loss, lse = torch.empty(()), torch.empty(6)
    with pytest.raises(ValueError, match="dlogits must have the logits' shape"):
        ops.ce_fwd_bwd_out(x, t, None, *o, loss, lse, None, None, torch.empty(6, 10))
    with pytest.raises(ValueError, match="dlogits partly overlaps logits"):
        buf = torch.randn(7, 11)
        ops.ce_fwd_bwd_out(buf[:6], t, None, *o, loss, lse, None, None, buf[1:])
    with pytest.raises(ValueError, match="loss must have 6 elements"):
        ops.ce_fwd_out(x, t, None, -100, "none", 0.0, 1.0, 0.0, 0.0, loss, lse, None, None)
    with pytest.raises(ValueError, match="give both num_correct and entropy_sum"):
        ops.ce_fwd_out(x, t, None, *o, loss, lse, torch.empty((), dtype=torch.long), None)
    with pytest.raises(ValueError, match="grad_loss must be float32"):
        ops.ce_rescale_(torch.ones((), dtype=torch.float64), x)
    with pytest.raises(ValueError, match="grad_loss must have 6 elements"):
        ops.ce_rescale_(torch.ones(5), x)
