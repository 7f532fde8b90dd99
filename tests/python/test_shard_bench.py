"""python -m fusedce.bench --only shard on the CPU at tiny heads (seconds): its rows hold the
numbers their formulas say, and the gather it stands in for hands each rank what the other
ranks of a real group would send (the rank's merged loss is the loss of the whole vocabulary)."""

import csv
import math

import pytest
import torch
import torch.nn.functional as F

import fusedce
from fusedce.bench import __main__ as bench_main
from fusedce.bench import shard
from fusedce.bench.cases import Case
from fusedce.bench.problems import IGNORE_INDEX, make_linear

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

# float32 throughout: the merged loss and the one-device loss are float32 sums over the same
# float32 logits, so they agree to a few ulps of the loss.
LOSS_TOL = 1e-5
GRAD_TOL = 1e-6  # absolute, on gradients of about 1 / N


@pytest.fixture(scope="module")
def shard_run(tmp_path_factory):
    """One CPU run of the group at its default tiny heads, two timed runs a row."""
    out = tmp_path_factory.mktemp("shard")
    bench_main.main(["--device", "cpu", "--only", "shard", "--repeat", "2", "--warmup", "0",
                     "--no-progress", "--out", str(out)])
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return out, rows


def test_every_head_variant_and_world_has_a_row(shard_run):
    out, rows = shard_run
    heads = [c.label for c in shard.default_cases("cpu", quick=False)]
    expected = {(h, v, str(w)) for h in heads for v in shard.VARIANTS for w in shard.WORLDS}
    assert {(r["case"], r["variant"], r["world"]) for r in rows} == expected
    assert len(rows) == len(expected)
    text = (out / "results.md").read_text()
    assert text.count("| float32 |") == len(expected)
    assert "per-shard time x W / one-device time, geometric mean" in text


def test_rows_hold_what_their_formulas_say(shard_run):
    _, rows = shard_run
    for r in rows:
        assert r["status"] == "ok", r["note"]
        n, h, v, w = int(r["tokens"]), int(r["hidden"]), int(r["vocab"]), int(r["world"])
        assert r["kind"] == "shard" and r["dtype"] == "float32" and r["device"] == "cpu"
        assert int(r["rank"]) == 0 and int(r["vocab_local"]) == math.ceil(v / w)
        one, sh = float(r["one_device_ms"]), float(r["shard_ms"])
        assert 0 < float(r["shard_p10_ms"]) <= sh <= float(r["shard_p90_ms"])
        assert 0 < float(r["one_device_p10_ms"]) <= one <= float(r["one_device_p90_ms"])
        assert math.isclose(float(r["ideal_ms"]), one / w, rel_tol=1e-9)
        assert math.isclose(float(r["ratio"]), sh * w / one, rel_tol=1e-9)
        flops = 6 * n * h * math.ceil(v / w)
        assert math.isclose(float(r["shard_tflops"]), flops / (sh * 1e-3) / 1e12, rel_tol=1e-9)
        assert int(r["gather_bytes"]) == w * (n + 1) * 9 * 4
        assert int(r["allreduce_bytes"]) == n * h * 4
        assert float(r["gemm_tflops"]) > 0
        # the rank's loss after the stood-in gather is the one-device loss
        assert float(r["loss_rel_diff"]) <= LOSS_TOL


def _float64_problem(hidden, weight, target):
    """The float64 loss of the unsplit head and its gradients (hidden, weight)."""
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    loss = F.cross_entropy(h @ w.T, target, ignore_index=IGNORE_INDEX)
    loss.backward()
    return float(loss.detach()), h.grad, w.grad


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("masked", [False, True], ids=["all-targets", "masked"])
def test_every_rank_merges_the_loss_of_the_whole_vocabulary(world, masked):
    """Each rank's call with the block the benchmark hands it gives the float64 loss of the
    unsplit head: the other ranks' statistics are theirs, in their slots, and exactly one rank
    holds each target (the merge takes the target term from it, as in a real group). Its
    backward gives its slice of grad_weight, and the ranks' parts of grad_hidden (what the
    stood-in all-reduce hands back) add up to the whole."""
    case = Case("shard", 40 if not masked else 64, 203, 16, masked)
    hidden, weight, target = make_linear(case, torch.float32, "cpu", seed=world)
    if masked:
        target[1::3] = IGNORE_INDEX  # ignored rows spread over the batch as well
    want, want_gh, want_gw = _float64_problem(hidden, weight, target)
    layout = shard.chunk_layout(case.vocab, world)
    rows = case.tokens + 1
    with shard.fake_group(world) as group:
        block = shard.received_block(hidden, weight, target, group, layout, {})
        holds = block.view(world, rows, 9)[:, :-1, 4].sum(0)
        kept = target != IGNORE_INDEX
        assert torch.equal(holds[kept], torch.ones_like(holds[kept]))
        assert torch.equal(holds[~kept], torch.zeros_like(holds[~kept]))
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float64)
        for rank, (v0, count) in enumerate(layout):
            h = hidden.clone().requires_grad_(True)
            w = weight[v0:v0 + count].clone().requires_grad_(True)
            with shard.collectives_stood_in(block, rank, rows):
                loss = fusedce.linear_cross_entropy(h, w, target, process_group=group, vocab_start=v0,
                                                    vocab_total=case.vocab)
                loss.backward()
            assert abs(float(loss.detach()) - want) <= LOSS_TOL * abs(want), (rank, float(loss.detach()), want)
            torch.testing.assert_close(w.grad.double(), want_gw[v0:v0 + count], rtol=0, atol=GRAD_TOL)
            grad_hidden += h.grad.double()
        torch.testing.assert_close(grad_hidden, want_gh, rtol=0, atol=GRAD_TOL)


def test_the_stood_in_gather_carries_each_ranks_layout():
    """The layout records travel with the statistics: a block assembled for another layout is
    refused by the front end's tiling check, as a real group's would be."""
    case = Case("shard", 8, 40, 4)
    hidden, weight, target = make_linear(case, torch.float32, "cpu")
    with shard.fake_group(2) as group:
        block = shard.received_block(hidden, weight, target, group, shard.chunk_layout(40, 2), {})
        swapped = torch.cat([block[9:], block[:9]])
        with shard.collectives_stood_in(swapped, 0, 9), pytest.raises(ValueError, match="do not tile"):
            fusedce.linear_cross_entropy(hidden, weight[:20], target, process_group=group, vocab_start=0,
                                         vocab_total=40)


def test_a_layout_with_an_empty_rank_is_skipped_with_the_reason():
    assert shard.chunk_layout(10, 8) is None  # blocks of 2: five ranks hold all ten columns
    assert shard.chunk_layout(203, 8) == [(r * 26, 26) for r in range(7)] + [(182, 21)]
    rows = shard.run_case(Case("shard", 4, 10, 4), torch.float32, "cpu", 1, 0, 0, worlds=(2, 8),
                          variants={"default": {}})
    assert [r.status for r in rows] == ["ok", "skipped"]
    assert "leaves a rank empty" in rows[1].note and rows[1].one_device_ms > 0


def test_a_second_default_group_is_refused():
    with shard.fake_group(2):
        with pytest.raises(RuntimeError, match="without a default process group"):
            with shard.fake_group(2):
                pass
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("shapes", ["64x1000", "64x32x1000:logprobs"])
def test_shapes_other_than_a_head_are_refused_naming_the_flag(shapes, capsys):
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--device", "cpu", "--only", "shard", "--shapes", shapes])
    assert "--shapes" in capsys.readouterr().err
