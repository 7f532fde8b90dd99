"""bench/trl_post_training.py at tiny shapes on the CPU (--smoke): every part runs and writes its
CSV, and in float32 every implementation agrees with TRL's own head (the kernel part), the GRPO
step on fusedce gives TRL's gradients, and the SFT step through fusedce.transformers gives
SFTTrainer's loss, served by the fused linear loss. The script's H200 run is the lead's; this
keeps it from rotting. Peers that are not installed are skipped: TRL for the whole file,
Liger-Kernel's row says why it did not run."""

import csv
import importlib.util
import pathlib

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "trl_post_training.py"


def _script():
    spec = importlib.util.spec_from_file_location("trl_post_training", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_smoke_run_on_the_cpu(tmp_path):
    rc = _script().main(["--smoke", "--device", "cpu", "--dtype", "float32", "--model-dtype", "float32",
                         "--out", str(tmp_path)])
    assert rc == 0

    kernel = _rows(tmp_path / "logprobs_trl.csv")
    assert {r["impl"] for r in kernel} >= {"trl", "fusedce", "fusedce keep_logits=True", "fusedce keep_logits=False",
                                           "trl all shared outputs", "fusedce TRL head, all shared outputs",
                                           "liger-kernel sm90"}
    for r in kernel:
        if r["impl"].startswith("liger"):
            assert r["status"] == "skipped" and r["note"], r
            continue
        assert r["status"] == "ok", r
        assert float(r["median_ms"]) > 0
        # float32: TRL's and fusedce's heads agree to float32 arithmetic
        assert float(r["logprob_maxabs_vs_trl"]) < 1e-4, r
        assert float(r["entropy_maxabs_vs_trl"]) < 1e-4, r
        assert float(r["grad_weight_maxrel_vs_trl"]) < 1e-4, r

    grpo = _rows(tmp_path / "grpo_step_trl.csv")
    assert [r["variant"] for r in grpo] == ["trl", "trl + fusedce.integrations.trl"]
    assert all(r["status"] == "ok" for r in grpo), grpo
    assert float(grpo[1]["grad_maxrel_vs_first"]) < 1e-4, grpo[1]

    sft = _rows(tmp_path / "sft_step_trl.csv")
    assert [r["variant"] for r in sft] == ["trl", "fusedce.transformers.apply()",
                                           "fusedce.transformers.apply(metrics=True)",
                                           "fusedce.transformers.apply(low_memory=True)",
                                           "fusedce.transformers.apply(skip_ignored=True)", "transformers (logits)"]
    assert all(r["status"] == "ok" for r in sft), sft
    for r in sft[1:]:
        assert float(r["loss_absdiff_vs_first"]) < 1e-5 * max(1.0, float(sft[0]["loss"])), r
        assert float(r["grad_maxrel_vs_first"]) < 1e-4, r
    assert all(r["note"] == "fused linear loss" for r in sft if r["variant"].startswith("fusedce")), sft
