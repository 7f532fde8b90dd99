"""bench/distill_bench.py at tiny shapes on the CPU (--smoke): both parts run and write their CSV
with a row per shape, variant and implementation, each ok or skipped with its reason, and in
float32 fusedce's loss and gradients agree with the float64 reference (as do torch eager's and,
where TRL is installed, TRL's). A second run stands in for fusedce's CUDA path before it is
written (the function raising NotImplementedError): its rows say "skipped" and why, and the run
still succeeds; a third, a float64 reference that does not fit: torch eager stands in, said so.
The script's H200 run is the lead's; this keeps it from rotting."""

import csv
import importlib.util
import pathlib

import pytest
import torch

import fusedce

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "distill_bench.py"
FULL_IMPLS = {"cublas floor", "torch eager", "torch.compile", "fusedce", "trl", "liger fused", "liger chunked"}
TOPK_IMPLS = {"torch eager", "torch.compile", "fusedce", "trl", "liger"}
# float32 against float64 over V <= 1000: a few float32 roundings of terms of size ~1
LOSS_TOL = 1e-5
GRAD_REL_TOL = 1e-4


def _script():
    spec = importlib.util.spec_from_file_location("distill_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _check_rows(rows, impls, variants):
    """A row per shape x variant x implementation, each ok or skipped with a reason."""
    for shape in {r["shape"] for r in rows}:
        for variant in variants:
            got = {r["impl"] for r in rows if r["shape"] == shape and r["variant"] == variant}
            assert got == impls - {"cublas floor"}, (shape, variant, got)
    for r in rows:
        assert r["status"] in ("ok", "skipped"), r
        if r["status"] == "skipped":
            assert r["note"], r
        else:
            assert float(r["median_ms"]) > 0, r


def _check_agrees(r):
    loss = float(r["loss"])
    assert r["reference"] == "float64", r
    assert float(r["loss_absdiff"]) <= LOSS_TOL * max(1.0, abs(loss)), r
    assert float(r["grad_hidden_maxrel"]) <= GRAD_REL_TOL, r
    assert float(r["grad_weight_maxrel"]) <= GRAD_REL_TOL, r


def test_smoke_run_on_the_cpu(tmp_path):
    module = _script()
    rc = module.main(["--smoke", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path)])
    assert rc == 0

    full = _rows(tmp_path / "distill.csv")
    assert len({r["shape"] for r in full}) == len(module.SMOKE_SHAPES)
    variants = [v.name for v in module.VARIANTS]
    _check_rows(full, FULL_IMPLS, variants)
    assert {r["impl"] for r in full if r["variant"] == "the four products"} == {"cublas floor"}
    for r in full:
        if r["impl"] in ("fusedce", "torch eager", "torch.compile"):
            assert r["status"] == "ok", r  # fusedce, eager and compile run everywhere on the CPU
            _check_agrees(r)
        elif r["impl"] == "trl" and r["status"] == "ok":
            _check_agrees(r)
        elif r["impl"] == "liger fused":
            assert r["status"] == "skipped", r  # Triton kernels: CUDA only
        if r["impl"] == "trl" and "hard_weight" in r["variant"]:
            assert r["status"] == "skipped" and "hard-label" in r["note"], r

    topk = _rows(tmp_path / "distill_topk.csv")
    _check_rows(topk, TOPK_IMPLS, [f"forward_kl topk_norm={n}" for n in module.TOPK_NORMS])
    for r in topk:
        if r["impl"] in ("fusedce", "torch eager", "torch.compile"):
            assert r["status"] == "ok", r
            _check_agrees(r)
        else:
            assert r["status"] == "skipped" and "no top-k" in r["note"], r


def test_fusedce_raising_not_implemented_is_a_skipped_row(tmp_path, monkeypatch):
    """What fusedce's CUDA path does before it is written: the rows say skipped and why."""
    module = _script()

    def not_yet(*args, **kwargs):
        raise NotImplementedError("fusedce.linear_distillation: no CUDA path yet")

    monkeypatch.setattr(fusedce, "linear_distillation", not_yet)
    monkeypatch.setattr(fusedce, "linear_distillation_topk", not_yet)
    rc = module.main(["--smoke", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path),
                      "--shapes", "16x8x50", "--impls", "fusedce,torch eager"])
    assert rc == 0
    for name in ("distill.csv", "distill_topk.csv"):
        rows = _rows(tmp_path / name)
        assert {r["impl"] for r in rows} == {"fusedce", "torch eager"}, rows
        for r in rows:
            if r["impl"] == "fusedce":
                assert r["status"] == "skipped" and "no CUDA path yet" in r["note"], r
            else:
                assert r["status"] == "ok", r


def test_eager_stands_in_where_the_float64_reference_does_not_fit(tmp_path, monkeypatch):
    module = _script()

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("stand-in")

    monkeypatch.setattr(module, "float64_reference", out_of_memory)
    rc = module.main(["--smoke", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path),
                      "--shapes", "16x8x50", "--impls", "torch eager,fusedce"])
    assert rc == 0
    for name in ("distill.csv", "distill_topk.csv"):
        for r in _rows(tmp_path / name):
            assert r["status"] == "ok", r
            if r["impl"] == "fusedce":
                assert r.get("reference", "").startswith("torch eager float32"), r
                assert float(r["loss_absdiff"]) <= LOSS_TOL * max(1.0, abs(float(r["loss"]))), r
            else:
                assert not r.get("reference"), r  # eager is the reference itself


def test_bad_arguments_name_the_option(capsys):
    module = _script()
    for argv, option in ((["--shapes", "8x4"], "--shapes"), (["--impls", "fusedce,nope"], "--impls"),
                         (["--only", "topk,nope"], "--only"), (["--variants", "jsd beta=0.5;nope"], "--variants")):
        with pytest.raises(SystemExit):
            module.main(["--device", "cpu", *argv])
        assert option in capsys.readouterr().err


def test_variants_pick_rows_and_a_run_cut_short_keeps_its_rows(tmp_path, monkeypatch):
    """--variants keeps the named variants of either part; each row is in the CSV as soon as it
    is measured: a part that breaks after its first rows leaves them in the file."""
    module = _script()
    argv = ["--smoke", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path), "--impls", "fusedce",
            "--variants", "forward_kl beta=0;forward_kl topk_norm=tail"]
    assert module.main(argv) == 0
    assert {r["variant"] for r in _rows(tmp_path / "distill.csv")} == {"forward_kl beta=0"}
    assert {r["variant"] for r in _rows(tmp_path / "distill_topk.csv")} == {"forward_kl topk_norm=tail"}

    calls = []
    real = module.run_row

    def breaks_on_the_second_shape(row, *args, **kwargs):
        calls.append(row["shape"])
        if len(set(calls)) > 1:
            raise RuntimeError("cut short")
        return real(row, *args, **kwargs)
    monkeypatch.setattr(module, "run_row", breaks_on_the_second_shape)
    out = tmp_path / "cut"
    assert module.main(argv[:-4] + ["--out", str(out), "--only", "full", "--impls", "fusedce",
                                     "--variants", "forward_kl beta=0"]) == 1
    rows = _rows(out / "distill.csv")
    assert [r["shape"] for r in rows] == [calls[0]] and rows[0]["status"] == "ok", rows


# ---- the peak of a call whose workspace torch does not allocate --------------------------------


def test_without_a_gpu_the_stream_ordered_pool_is_a_reason():
    from fusedce.bench.rows import stream_ordered_pool

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: test_cuda_peak_counts_the_stream_ordered_pool covers it")
    assert isinstance(stream_ordered_pool(), str)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_counts_the_stream_ordered_pool():
    """64 MiB taken with cudaMallocAsync inside the call (as fusedce's distillation takes its
    workspace) is in the peak with the pool, and not without it."""
    from cuda.bindings import runtime as rt

    from fusedce.bench.rows import peak_memory, stream_ordered_pool

    pool = stream_ordered_pool()
    assert not isinstance(pool, str), pool
    size = 64 << 20
    stream = torch.cuda.current_stream().cuda_stream

    def run(_i):
        err, ptr = rt.cudaMallocAsync(size, stream)
        assert err == rt.cudaError_t.cudaSuccess
        (err,) = rt.cudaFreeAsync(ptr, stream)
        assert err == rt.cudaError_t.cudaSuccess
        return ()

    with_pool, _ = peak_memory(run, "cuda", pool)
    without, _ = peak_memory(run, "cuda")
    assert with_pool >= size and without < size
