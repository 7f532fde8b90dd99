"""fusedce.cross_entropy as a drop-in for F.cross_entropy on PyTorch's own sample inputs: the
OpInfo entry of nn.functional.cross_entropy (torch.testing._internal.common_methods_invocations),
float32, float64 and bfloat16 on the CPU, loss and gradients (of the logits, and of
class-probability targets). Fused samples (class indices, float32 / bfloat16) must give
PyTorch's numbers to float32's precision (the loss) and to PyTorch's own rounding (the gradient);
the samples fusedce hands to PyTorch (probabilities, float64) must be PyTorch's, bit for bit."""

import sys
import types
import unittest

import pytest
import torch
import torch.nn.functional as F

import fusedce
from conftest import assert_within_budget, error_scales


@pytest.fixture(scope="module")
def op_info():
    # torch's test helpers import expecttest for their own TestCase, which the sample generators
    # never use; where it is not installed a stand-in lets them import. Importing them also
    # freezes torch.backends' flags for torch's suite; they are unfrozen again for this one.
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase
            sys.modules["expecttest"] = stub
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db

    if not frozen:
        vars(torch.backends)["__allow_nonbracketed_mutation_flag"] = True
    return next(op for op in op_db if op.name == "nn.functional.cross_entropy")


def _run(fn, sample, grad_out):
    """fn's loss on fresh leaves of the sample's differentiable tensors, and their gradients."""
    x = sample.input.detach().clone().requires_grad_(True)
    target = sample.args[0]
    leaves = [x]
    if target.requires_grad:
        target = target.detach().clone().requires_grad_(True)
        leaves.append(target)
    loss = fn(x, target, **sample.kwargs)
    grads = torch.autograd.grad(loss, leaves, grad_out.to(loss.dtype))
    return loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_pytorch_sample_inputs(op_info, dtype):
    torch.manual_seed(0)
    samples = list(op_info.sample_inputs("cpu", dtype, requires_grad=True))
    assert len(samples) >= 20
    kinds = set()
    for i, sample in enumerate(samples):
        target = sample.args[0]
        what = (f"sample {i}: logits {tuple(sample.input.shape)}, target {target.dtype} "
                f"{tuple(target.shape)}, {sorted(sample.kwargs)}")
        with torch.no_grad():
            shape = F.cross_entropy(sample.input, target, **sample.kwargs).shape
        grad_out = torch.rand(shape, dtype=torch.float64) + 0.5
        theirs = _run(F.cross_entropy, sample, grad_out)
        ours = _run(fusedce.cross_entropy, sample, grad_out)
        fused = dtype != torch.float64 and not target.is_floating_point()
        kinds.add(fused)
        if not fused:  # PyTorch's own implementation
            assert ours[0].dtype == theirs[0].dtype and torch.equal(ours[0], theirs[0]), what
            assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1])), what
            continue
        assert ours[0].dtype == torch.float32 and ours[0].shape == theirs[0].shape, what
        assert len(ours[1]) == 1 and ours[1][0].dtype == dtype, what
        # float64 of the same (rounded) inputs: fusedce's float32 loss to float32's precision,
        # its gradient within PyTorch's own error in `dtype` (conftest's judge)
        kw64 = dict(sample.kwargs)
        if "weight" in kw64:
            kw64["weight"] = kw64["weight"].double()
        ref = _run(lambda x, t, **kw: F.cross_entropy(x.double(), t, **kw64), sample, grad_out)
        rows = sample.input.movedim(1, -1) if sample.input.dim() > 2 else sample.input
        loss_scale, grad_scale = error_scales(rows, target, grad_out=grad_out, **sample.kwargs)
        assert_within_budget(ours[0], None, ref[0], what=f"loss {what}", scale=loss_scale)
        assert_within_budget(ours[1][0], theirs[1][0], ref[1][0], what=f"grad {what}",
                             scale=grad_scale, out_dtype=dtype)
        # and PyTorch's own result in `dtype`, to that dtype's default tolerance
        torch.testing.assert_close(ours[0], theirs[0].float(), msg=what,
                                   **({} if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)))
        torch.testing.assert_close(ours[1][0], theirs[1][0], msg=what)
    assert kinds == ({False} if dtype == torch.float64 else {True, False})
