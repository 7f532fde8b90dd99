"""fusedce.logit_room: when linear_logprobs keeps its logits by default (keep_logits=None).

The rule alone (shapes, dtype, budget -> decision) at the shapes around its boundary: the three
shapes of the log-probabilities benchmark sit on it (bf16 with a weight gradient keeps up to
N = 4 H rows once a float32 copy of the weight passes 512 MiB); a 16-bit input on the CPU is
never kept by default (the CPU recomputes float32 logits); its constants are the core's, read
from the C++ sources. Then the default call: it takes the path the rule names (seen by
which autograd Function runs), its results are that forced path's bit for bit, and the other
forced path's and float64's within float32 arithmetic plus the input dtype's rounding of the
logits; a chunk_budget_bytes given with the default moves the decision at exactly the kept
logits' bytes."""

import pathlib
import re

import pytest
import torch

import fusedce
from fusedce import logit_room, token_logprobs
from conftest import DEVICES
from test_logprobs import _linear_problem, _objective, _weights, reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
MIB = 1 << 20
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


# ---- the rule ----------------------------------------------------------------------------------


def _constant(path, name):
    """`constexpr size_t name = size_t(a) << b;` in a core source file, as an int."""
    text = (ROOT / path).read_text()
    m = re.search(rf"constexpr size_t {name} = size_t\((\d+)\) << (\d+);", text)
    assert m, f"{name} not found in {path}"
    return int(m.group(1)) << int(m.group(2))


def test_constants_are_the_cores():
    assert logit_room.CUDA_LEAST_CHUNK_BUDGET == _constant("src/cuda/linear/linear_cuda.cpp", "kDefaultChunkBudget")
    assert logit_room.CUDA_CHUNK_OVERHEAD == _constant("src/cuda/linear/linear_cuda.cpp", "kChunkOverheadBytes")
    assert logit_room.CPU_CHUNK_BUDGET == _constant("src/cpu/logprobs_cpu.cpp", "kDefaultBudget")


def _last_kept(hid, vocab, dtype, grad_weight, device_type, budget=None):
    """The most rows the rule keeps, by walking the boundary: keeps at n, not at n + 1."""
    room = logit_room.room_bytes(vocab, hid, dtype, grad_weight, device_type, budget)
    n = room // logit_room.kept_bytes(1, vocab, dtype)
    assert logit_room.keeps_logits(n, hid, vocab, dtype, grad_weight, device_type, budget)
    assert not logit_room.keeps_logits(n + 1, hid, vocab, dtype, grad_weight, device_type, budget)
    return n


# The benchmark's shapes (N x H x V) and beside them: bf16 with a weight gradient keeps while
# N * V * 2 <= 4 V H (the float32 weight copy's room) + 4 V H (the accumulator): N <= 4 H.
@pytest.mark.parametrize("n,hid,vocab", [(8192, 4096, 151936), (16384, 4096, 151936), (8192, 2048, 262144)])
def test_benchmark_shapes_keep_and_one_row_more_does_not(n, hid, vocab):
    assert logit_room.keeps_logits(n, hid, vocab, BF16, True, "cuda")
    assert _last_kept(hid, vocab, BF16, True, "cuda") == 4 * hid
    assert logit_room.keeps_logits(4 * hid, hid, vocab, BF16, True, "cuda")
    assert not logit_room.keeps_logits(4 * hid + 1, hid, vocab, BF16, True, "cuda")


def test_room_by_dtype_gradient_and_size():
    hid, vocab = 4096, 151936
    weight_f32 = 4 * hid * vocab
    # bf16 / fp16 with a weight gradient: the weight copy's room plus the accumulator.
    for dtype in (BF16, F16):
        assert logit_room.room_bytes(vocab, hid, dtype, True, "cuda") == 2 * weight_f32
    # No weight gradient (a frozen head, a reference model, no grad): no accumulator, N <= 2 H.
    assert _last_kept(hid, vocab, BF16, False, "cuda") == 2 * hid
    # float32 has no accumulator (its grad_weight sums in place): N * V * 4 <= 4 V H, N <= H.
    assert _last_kept(hid, vocab, F32, True, "cuda") == hid
    # A small head: the 512 MiB floor of the logit room, plus the bf16 accumulator.
    hid, vocab = 1024, 32000
    room = 512 * MIB + 4 * hid * vocab
    assert logit_room.room_bytes(vocab, hid, BF16, True, "cuda") == room
    assert _last_kept(hid, vocab, BF16, True, "cuda") == room // (2 * vocab)
    assert logit_room.room_bytes(vocab, hid, BF16, False, "cuda") == 512 * MIB


def test_a_vocabulary_parallel_rank_decides_from_its_shard():
    hid, vocab = 4096, 151936
    # 4 ranks: each rank's float32 weight copy still passes 512 MiB, so N <= 4 H as on one device.
    assert _last_kept(hid, vocab // 4, BF16, True, "cuda") == 4 * hid
    # 8 ranks: the 512 MiB floor holds more rows of the narrower shard.
    local = vocab // 8
    assert 4 * hid * local < 512 * MIB
    assert _last_kept(hid, local, BF16, True, "cuda") == (512 * MIB + 4 * hid * local) // (2 * local)


def test_cpu_room_and_a_given_budget():
    # The CPU: its default chunk of float32 logits, whatever the dtype or gradient.
    for dtype in (F32, BF16):
        for grad_weight in (False, True):
            assert logit_room.room_bytes(50000, 1024, dtype, grad_weight, "cpu") == 128 * MIB
    assert _last_kept(1024, 50000, F32, True, "cpu") == 128 * MIB // (4 * 50000)
    # A 16-bit input on the CPU: never kept by default (its recomputed logits are float32).
    for dtype in (BF16, F16):
        assert not logit_room.keeps_logits(1, 8, 16, dtype, True, "cpu")
        assert not logit_room.keeps_logits(1, 8, 16, dtype, True, "cpu", 1 << 30)
        assert logit_room.keeps_logits(1, 8, 16, dtype, True, "cuda")
    # A budget given is the room, on any device: keeps exactly up to the kept logits' bytes.
    n, hid, vocab = 300, 64, 1000
    for dtype, device_type in ((BF16, "cuda"), (F32, "cuda"), (F32, "cpu")):
        kept = logit_room.kept_bytes(n, vocab, dtype)
        assert kept == n * vocab * dtype.itemsize
        assert logit_room.keeps_logits(n, hid, vocab, dtype, True, device_type, kept)
        assert not logit_room.keeps_logits(n, hid, vocab, dtype, True, device_type, kept - 1)
    # No rows: nothing to keep, always within the room.
    assert logit_room.keeps_logits(0, hid, vocab, F32, True, "cuda", 1)


# ---- the default call --------------------------------------------------------------------------


class PathSpy:
    """Counts the calls of the two autograd Functions of the linear form (kept, recomputed)."""

    def __init__(self, monkeypatch):
        self.kept = self.recomputed = 0
        kept_apply = token_logprobs._KeptLinearLogprobs.apply
        recomputed_apply = token_logprobs._LinearLogprobs.apply

        def kept(*args):
            self.kept += 1
            return kept_apply(*args)

        def recomputed(*args):
            self.recomputed += 1
            return recomputed_apply(*args)

        monkeypatch.setattr(token_logprobs._KeptLinearLogprobs, "apply", kept)
        monkeypatch.setattr(token_logprobs._LinearLogprobs, "apply", recomputed)

    def took(self):
        assert self.kept + self.recomputed == 1, (self.kept, self.recomputed)
        kept = self.kept == 1
        self.kept = self.recomputed = 0
        return kept


def _run(h, w, b, t, **kw):
    """Values and every gradient of a GRPO-style objective over the call's outputs."""
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    lp, ent = fusedce.linear_logprobs(leaves[0], leaves[1], t, leaves[2], temperature=0.9, return_entropy=True, **kw)
    old, adv = (x.float().to(h.device) for x in _weights(t.numel(), 3))
    _objective(lp, ent, old, adv).backward()
    return [lp.detach(), ent.detach()] + [x.grad for x in leaves if x is not None]


def _reference(h, w, b, t):
    ref = [x.detach().double().cpu().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    lp, ent = reference(torch.nn.functional.linear(*ref) / 0.9, t.cpu())
    old, adv = _weights(t.numel(), 3)
    _objective(lp, ent, old, adv).backward()
    return [lp.detach(), ent.detach()] + [x.grad for x in ref if x is not None]


def _tolerances(dtype, ref, i):
    """Values (i < 2): float32 arithmetic, plus the rounding of 16-bit logits (a GPU's chunks and
    the kept logits are in the input dtype); gradients: their dtype's rounding."""
    if i < 2:
        return ({F32: 2e-5, BF16: 6e-2, F16: 8e-3}[dtype], 2e-6)
    eps = {F32: 2e-6, BF16: 1.6e-2, F16: 2e-3}[dtype]
    return (8 * eps * ref.abs().max().item(), 8 * eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("room", ["fits", "past"])
def test_default_is_the_forced_path_the_rule_names(device, dtype, room, monkeypatch):
    """Kept where the logits fit (the CPU's 128 MiB holds these; a 16-bit input on the CPU
    is never kept by default), recomputed past the room (made smaller than the logits here):
    bit for bit that forced path, and within tolerance of the other forced path and of
    float64."""
    n, hid, vocab = 29, 24, 517
    h, w, b, t = _linear_problem(n, hid, vocab, dtype, device, seed=23, bias=True)
    if room == "past":
        monkeypatch.setattr(logit_room, "room_bytes", lambda *a, **k: logit_room.kept_bytes(n, vocab, dtype) - 1)
    spy = PathSpy(monkeypatch)
    default = _run(h, w, b, t)
    keeps = room == "fits" and (device == "cuda" or dtype == F32)
    assert spy.took() == keeps
    kept = _run(h, w, b, t, keep_logits=True)
    assert spy.took()
    recomputed = _run(h, w, b, t, keep_logits=False)
    assert not spy.took()
    same, other = (kept, recomputed) if keeps else (recomputed, kept)
    ref = _reference(h, w, b, t)
    names = ("logprob", "entropy", "grad_hidden", "grad_weight", "grad_bias")
    for i, name in enumerate(names):
        assert torch.equal(default[i], same[i]), name
        atol, rtol = _tolerances(dtype, ref[i], i)
        torch.testing.assert_close(default[i].double().cpu(), other[i].double().cpu(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name} against the other path: {m}")
        torch.testing.assert_close(default[i].double().cpu(), ref[i], atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name} against float64: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_budget_given_with_the_default_picks_by_it(device, monkeypatch):
    """chunk_budget_bytes with keep_logits=None: kept when the logits' bytes fit it exactly,
    recomputed in chunks of that budget one byte below; the results are the forced paths'."""
    n, hid, vocab = 37, 16, 263
    h, w, b, t = _linear_problem(n, hid, vocab, F32, device, seed=31, bias=False)
    kept_bytes = n * vocab * 4
    spy = PathSpy(monkeypatch)
    at = _run(h, w, b, t, chunk_budget_bytes=kept_bytes)
    assert spy.took()
    below = _run(h, w, b, t, chunk_budget_bytes=kept_bytes - 1)
    assert not spy.took()
    for x, y in zip(at, _run(h, w, b, t, keep_logits=True)):
        assert torch.equal(x, y)
    for x, y in zip(below, _run(h, w, b, t, keep_logits=False, chunk_budget_bytes=kept_bytes - 1)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_default_without_a_gradient_never_keeps(device, monkeypatch):
    """No gradient to form (a reference model's log-probabilities under no_grad, or inputs that
    need none): nothing would reuse kept logits, so the default takes the statistics form without
    asking the rule, even a rule that says keep; its values are keep_logits=False's bit for bit.
    With a gradient the same rule is asked and taken."""
    h, w, b, t = _linear_problem(11, 8, 97, F32, device, seed=3, bias=True)
    asked, kept = [], []

    def keep_always(*args):
        asked.append(args)
        return True

    monkeypatch.setattr(logit_room, "keeps_logits", keep_always)
    kept_forward = token_logprobs._kept_forward
    monkeypatch.setattr(token_logprobs, "_kept_forward", lambda *a: kept.append(a) or kept_forward(*a))
    with torch.no_grad():
        under_no_grad = fusedce.linear_logprobs(h, w.detach().requires_grad_(True), t, b)
    needing_none = fusedce.linear_logprobs(h.detach(), w.detach(), t, b)
    assert not asked and not kept
    forced = fusedce.linear_logprobs(h.detach(), w.detach(), t, b, keep_logits=False)
    assert torch.equal(under_no_grad, forced) and torch.equal(needing_none, forced)
    spy = PathSpy(monkeypatch)
    fusedce.linear_logprobs(h.detach(), w.detach().requires_grad_(True), t, b)
    assert len(asked) == 1 and asked[0][4] is True and spy.took()
