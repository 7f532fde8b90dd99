"""python -m fusedce.bench on a tiny configuration (seconds on a CPU): the files it writes hold
sane numbers, a failing or missing implementation gets a row saying why, a wrong one is marked
and never counted in a speed-up, and bad arguments are refused naming the flag."""

import csv
import importlib.util
import math

import pytest
import torch

from fusedce.bench import __main__ as bench_main
from fusedce.bench import cases, peers, report
from fusedce.bench.measure import spread, time_blocks, time_rounds
from fusedce.bench.problems import CrossEntropyReference, LinearReference, make_linear, make_logits
from fusedce.bench.runner import Progress, run_benchmark

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One --quick CPU run of fusedce and torch eager, two timed runs a row."""
    out = tmp_path_factory.mktemp("bench")
    bench_main.main(["--device", "cpu", "--quick", "--peers", "fusedce,torch", "--repeat", "2",
                     "--warmup", "0", "--no-progress", "--out", str(out)])
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return out, rows


def test_quick_run_writes_csv_table_and_plots(quick_run):
    out, rows = quick_run
    assert (out / "results.md").read_text().count("| fusedce |") >= 4
    kinds = {(r["kind"], r["job"]) for r in rows}
    assert kinds == {("ce", "forward"), ("ce", "fwd+bwd"), ("linear", "fwd+bwd"), ("logprobs", "forward"),
                     ("logprobs", "fwd+bwd"), ("logprobs", "fwd+bwd+entropy")}
    assert {r["peer"] for r in rows} == {"fusedce", "torch eager"}
    for r in rows:
        assert r["device"] == "cpu" and r["device_name"] and r["torch_version"] == torch.__version__
        assert float(r["copy_gbs"]) > 0
    if HAS_MPL:
        assert (out / "ce_bandwidth_float32.png").stat().st_size > 10_000
        assert (out / "linear_tokens_float32.png").stat().st_size > 10_000


def test_quick_run_numbers_are_sane(quick_run):
    """Every measured row: positive ordered times, a rate that matches its byte or FLOP formula,
    and errors against float64 at float32's scale."""
    _, rows = quick_run
    measured = [r for r in rows if r["status"] == "ok"]
    assert any(r["peer"] == "fusedce" for r in measured)
    assert all(r["status"] == "ok" for r in rows if r["kind"] == "ce")
    for r in measured:
        median, p10, p90 = float(r["median_ms"]), float(r["p10_ms"]), float(r["p90_ms"])
        assert 0 < p10 <= median <= p90
        n, h, v = int(r["tokens"]), int(r["hidden"]), int(r["vocab"])
        if r["kind"] == "ce":
            bytes_ = (1 if r["job"] == "forward" else 2) * n * v * 4
            assert math.isclose(float(r["rate"]), bytes_ / (median * 1e-3) / 1e9, rel_tol=1e-6)
            assert math.isclose(float(r["of_ceiling"]), float(r["rate"]) / float(r["copy_gbs"]), rel_tol=1e-6)
        else:
            flops = (2 if r["kind"] == "logprobs" and r["job"] == "forward" else 6) * n * h * v
            assert math.isclose(float(r["rate"]), flops / (median * 1e-3) / 1e12, rel_tol=1e-6)
            assert float(r["gemm_tflops"]) > 0
        assert float(r["loss_err"]) < 1e-5
        assert r["job"] == "forward" or float(r["grad_err"]) < 1e-4
        assert r["correct"] == "True"
    # fusedce's linear rows: numbers where fusedce.linear_cross_entropy exists, the reason if not
    import fusedce

    for r in rows:
        if r["peer"] == "fusedce" and r["kind"] == "linear":
            if hasattr(fusedce, "linear_cross_entropy"):
                assert r["status"] == "ok"
            else:
                assert r["status"] == "unavailable" and "linear_cross_entropy" in r["note"]


def _peer(name, ce=None, reason=None):
    return peers.Peer(name, name, {"ce": ce} if ce else {}, {"ce": reason} if reason else {})


def test_failing_missing_and_wrong_peers_get_rows():
    """A peer that raises gets a 'failed' row with the message, a missing one an 'unavailable'
    row with its reason; one whose loss is 1% off is marked incorrect and left out of the
    geometric-mean speed-ups, however fast it is."""
    import fusedce

    def broken(x, t):
        raise RuntimeError("kernel exploded")

    def wrong(x, t):
        return torch.nn.functional.cross_entropy(x, t) * 1.01

    lineup = [_peer("fusedce", ce=lambda x, t: fusedce.cross_entropy(x, t)), _peer("broken", ce=broken),
              _peer("missing", reason="No module named 'missing'"), _peer("wrong", ce=wrong)]
    rows = run_benchmark([cases.Case("ce", 37, 1001, masked=True)], [torch.float32], lineup, "cpu",
                         repeat=1, warmup=0, ceilings={"copy": 10.0}, l2=0,
                         progress=Progress(8, enabled=False))
    by = {(r.peer, r.job): r for r in rows}
    assert len(rows) == 8
    assert by[("broken", "fwd+bwd")].status == "failed"
    assert "kernel exploded" in by[("broken", "fwd+bwd")].note
    assert by[("missing", "forward")].status == "unavailable"
    assert "No module named" in by[("missing", "forward")].note
    assert by[("wrong", "forward")].status == "ok" and not by[("wrong", "forward")].correct
    assert by[("fusedce", "fwd+bwd")].correct
    assert not any(peer == "wrong" for (_, _, peer) in report.speedups(rows))
    assert "WRONG" in report.summary(rows)
    # The compact same-run table: ms of the implementations that ran, fusedce's speed-up over
    # the others (the failed one has neither).
    compact = report.versus(rows).splitlines()
    assert compact[1] == "| case | dtype | fusedce | wrong | vs wrong |"
    cells = [c.strip() for c in compact[3].split("|")[1:-1]]
    assert cells[:2] == ["37 x 1001 masked", "float32"]
    speedup = by[("wrong", "fwd+bwd")].median_ms / by[("fusedce", "fwd+bwd")].median_ms
    assert cells[4] == f"{speedup:.2f}x"
    meta = {"device_name": "cpu", "torch_version": "x", "fusedce_version": "y", "fusedce_commit": "z",
            "ceiling_text": ["copy 10 GB/s"]}
    text = report.table(rows, meta)
    assert "failed: RuntimeError: kernel exploded" in text
    assert "- missing (ce): No module named 'missing'" in text


def test_references_match_pytorch_in_float64():
    """The chunked float64 references agree with autograd through F.cross_entropy in float64."""
    case = cases.Case("ce", 40, 3000, masked=True)
    x, t = make_logits(case, torch.float32, "cpu")
    ref = CrossEntropyReference(x, t)
    x64 = x.double().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(x64, t)
    loss.backward()
    assert ref.loss_error(loss) < 1e-12
    assert ref.grad_error(x64.grad) < 1e-12

    case = cases.Case("linear", 24, 700, hidden=48, masked=True)
    h, w, t = make_linear(case, torch.float32, "cpu")
    ref = LinearReference(h, w, t)
    h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(h64 @ w64.T, t)
    loss.backward()
    assert ref.loss_error(loss) < 1e-12
    assert ref.grad_error(h64.grad, w64.grad) < 1e-12


def test_masked_cases_ignore_the_prompt_half():
    mask = cases.ignored_mask(4096 + 100, "cpu")
    assert mask[:1024].all() and not mask[1024:2048].any() and mask[2048:3072].all()
    assert cases.ignored_mask(10, "cpu").tolist() == [True] * 5 + [False] * 5


def test_spread_is_median_and_percentiles():
    assert spread([5.0]) == (5.0, 5.0, 5.0)
    median, p10, p90 = spread([float(i) for i in range(11)])
    assert (median, p10, p90) == (5.0, 1.0, 9.0)


def test_time_rounds_interleaves_rotated_rounds_and_activates_each_call():
    calls = []
    runs = {name: (lambda i, name=name: calls.append((name, i))) for name in "abc"}
    activated = []
    times = time_rounds(runs, repeat=3, warmup=1, device="cpu", activate=activated.append)
    # round r calls every run once with i = r, its order rotated by r
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2),
                     ("a", 3), ("b", 3), ("c", 3)]
    assert activated == [name for name, _ in calls]  # before every call, warm-up rounds too
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}  # warm-up not timed
    assert all(ms >= 0.0 for t in times.values() for ms in t)
    assert time_rounds({}, repeat=2, warmup=1, device="cpu") == {}


def test_time_blocks_interleaves_rotated_blocks_of_back_to_back_calls():
    calls, restored = [], []
    runs = {name: (lambda i, name=name: calls.append((name, i))) for name in "ab"}
    times = time_blocks(runs, repeat=5, warmup=2, device="cpu", blocks=2, before=lambda: restored.append(len(calls)))
    # blocks of 3 and 2 timed calls; a run's first block has its 2 warm-ups, a later block 1;
    # round b starts with run b mod 2; each run's call index counts on across its blocks
    assert calls == [("a", i) for i in range(5)] + [("b", i) for i in range(5)] \
        + [("b", i) for i in range(5, 8)] + [("a", i) for i in range(5, 8)]
    assert restored == [0, 5, 10, 13]  # before every block, outside it
    assert {name: len(t) for name, t in times.items()} == {"a": 5, "b": 5}
    assert all(ms >= 0.0 for t in times.values() for ms in t)
    # more blocks than timed calls: one block a call
    calls.clear()
    assert len(time_blocks({"a": runs["a"]}, repeat=2, warmup=0, device="cpu", blocks=5)["a"]) == 2
    assert calls == [("a", 0), ("a", 1), ("a", 2)]
    assert time_blocks({}, repeat=2, warmup=1, device="cpu") == {}


def test_a_peer_failing_mid_timing_leaves_the_others_their_rows():
    """A peer that passes its check but raises while the job's implementations are timed
    together gets a 'failed' row; the others are timed again alone and keep theirs, with a note
    saying so (their times did not share the chip's drift with the rest)."""
    import fusedce

    calls = {"n": 0}

    def flaky(x, t):
        calls["n"] += 1
        if calls["n"] > 2:  # its checked call (and one more) pass, the timing's do not
            raise RuntimeError("out of memory, say")
        return torch.nn.functional.cross_entropy(x, t)

    lineup = [_peer("fusedce", ce=lambda x, t: fusedce.cross_entropy(x, t)), _peer("flaky", ce=flaky)]
    rows = run_benchmark([cases.Case("ce", 37, 1001)], [torch.float32], lineup, "cpu",
                         repeat=3, warmup=1, ceilings={"copy": 10.0}, l2=0,
                         progress=Progress(4, enabled=False))
    by = {(r.peer, r.job): r for r in rows}
    assert by[("flaky", "forward")].status == "failed" and "out of memory" in by[("flaky", "forward")].note
    for job in ("forward", "fwd+bwd"):
        assert by[("fusedce", job)].status == "ok" and by[("fusedce", job)].runs == 3
        assert by[("fusedce", job)].correct
    assert by[("fusedce", "forward")].note.startswith("timed alone: RuntimeError: out of memory")
    assert by[("fusedce", "fwd+bwd")].note == ""  # flaky failed its fwd+bwd check: timed together


@pytest.mark.parametrize("shapes, message", [
    ("4096", "not NxV or NxHxV"),
    ("4096x0", "not NxV or NxHxV"),
    ("axb", "not NxV or NxHxV"),
    ("64x100:prompt", "the suffixes are ':masked' and ':logprobs'"),
])
def test_bad_shapes_name_the_flag(shapes, message):
    with pytest.raises(ValueError, match="--shapes") as e:
        cases.parse_shapes(shapes)
    assert message in str(e.value)


def test_shapes_syntax():
    parsed = cases.parse_shapes("4096x32000, 8x64x1000:masked, 8x4096x151936:logprobs:masked")
    assert parsed == [cases.Case("ce", 4096, 32000), cases.Case("linear", 8, 1000, hidden=64, masked=True),
                      cases.Case("logprobs", 8, 151936, hidden=4096, masked=True)]
    assert parsed[0].model == "Llama 2 / Mistral 7B" and parsed[1].label == "8 x 64 x 1000 masked"
    assert parsed[2].model == "Qwen 3 8B" and parsed[2].label == "8 x 4096 x 151936 logprobs masked"
    with pytest.raises(ValueError, match="':logprobs' takes NxHxV"):
        cases.parse_shapes("8x1000:logprobs")


@pytest.mark.parametrize("argv, flag", [
    (["--dtypes", "float8"], "--dtypes"),
    (["--peers", "fusedce,nosuch"], "--peers"),
    (["--shapes", "12"], "--shapes"),
    (["--repeat", "0"], "--repeat"),
])
def test_bad_arguments_exit_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--device", "cpu"] + argv)
    assert flag in capsys.readouterr().err


def test_unknown_peer_is_refused_and_gpu_only_peers_are_explained_on_the_cpu():
    with pytest.raises(ValueError, match="--peers"):
        peers.load(["nosuch"], "cpu")
    loaded = {p.id: p for p in peers.load(["liger", "liger-sm90", "unsloth", "flash-attn"], "cpu")}
    for p in loaded.values():
        assert not p.fns and all(reason for reason in p.reasons.values())


def test_floor_and_all_options_are_timed_not_checked(tmp_path, capsys):
    """The floor (three bare products) and fusedce with every option compute something other
    than the reference on purpose: their rows carry times and no error, are never marked wrong,
    never count in a speed-up, and the compact table gives each fusedce variant over the floor."""
    bench_main.main(["--device", "cpu", "--only", "linear", "--shapes", "8x32x100",
                     "--peers", "fusedce,fusedce-all,torch,floor", "--repeat", "2", "--warmup", "0",
                     "--no-progress", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    with open(tmp_path / "results.csv", newline="") as f:
        rows = {r["peer"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"fusedce", "fusedce all options", "torch eager", "floor (3 bare products)"}
    for name in ("fusedce all options", "floor (3 bare products)"):
        r = rows[name]
        assert r["status"] == "ok" and float(r["median_ms"]) > 0
        assert r["loss_err"] == "" and r["correct"] == ""
    assert rows["fusedce"]["correct"] == "True" and float(rows["fusedce"]["loss_err"]) < 1e-5
    assert "WRONG:" not in text and not any(line.endswith("WRONG |") for line in text.splitlines())
    assert "| fusedce x floor | fusedce all options x floor |" in text
    assert "vs floor" not in text and "vs fusedce all options" not in text
    assert "fusedce vs torch eager" in text and "fusedce vs floor" not in text


def test_the_compile_peer_compiles_every_shape_of_a_run():
    """One compiled function serves every case and job of a run: past dynamo's recompile limit
    (8 by default) torch.compile runs the function eagerly, and the torch.compile column would
    time eager. The peer raises the limit; here, twelve shapes of one function each get a graph."""
    import torch._dynamo

    torch._dynamo.reset()
    peers._torch_compile("cpu")
    f = torch.compile(lambda x: (x * 2).sum(-1), backend="eager", dynamic=False)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in range(1, 13):
        f(torch.ones(n, 3))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 12


def test_the_wide_peer_is_checked_against_the_reference(tmp_path):
    """fusedce-wide is the same loss with another chunk budget: its rows are checked like
    fusedce's, and its loss and gradients agree with the reference."""
    bench_main.main(["--device", "cpu", "--only", "linear", "--shapes", "8x32x100",
                     "--peers", "fusedce,fusedce-wide", "--repeat", "1", "--warmup", "0",
                     "--no-progress", "--out", str(tmp_path)])
    with open(tmp_path / "results.csv", newline="") as f:
        rows = {r["peer"]: r for r in csv.DictReader(f)}
    wide = rows["fusedce 4096-row chunks"]
    assert wide["status"] == "ok" and wide["correct"] == "True"
    assert float(wide["loss_err"]) < 1e-5 and float(wide["grad_err"]) < 1e-4
