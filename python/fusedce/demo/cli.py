"""python -m fusedce.demo: the command line, and the two runs side by side."""

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from . import report
from .corpus import CORPUS_PATH, load_text, tokenize
from .model import ModelConfig
from .train import LOSSES, RunConfig, train_run

# Model and batch per setting. cpu: trains in a few minutes on 2 cores. cuda: a vocabulary and
# a batch (16K tokens a step) where the (N, V) logits dominate the memory of the usual loss.
# quick: a few seconds, for CI.
PRESETS = {
    "cpu": dict(vocab=2048, seq_len=128, d_model=128, n_layer=4, n_head=4, batch_size=8,
                steps=200, lr=2e-3),
    "cuda": dict(vocab=32768, seq_len=512, d_model=768, n_layer=8, n_head=12, batch_size=32,
                 steps=300, lr=6e-4),
    "quick": dict(vocab=512, seq_len=32, d_model=32, n_layer=1, n_head=2, batch_size=4,
                  steps=8, lr=3e-3),
}


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m fusedce.demo",
        description="Trains a small GPT-style language model on a Shakespeare text twice with the "
        "same seed, once with lm_head + F.cross_entropy (float32 logits, as transformers does) and "
        "once with fusedce.linear_cross_entropy, and compares loss curves, tokens per second and "
        "peak memory. Exits with status 1 if the loss curves disagree.")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:index]")
    p.add_argument("--steps", type=int,
                   help="training steps (default: 200 on cpu, 300 on cuda, 8 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (seconds; for CI)")
    p.add_argument("--out", default="demo_out", help="output folder (default: demo_out)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: 2048 on cpu, 32768 on cuda)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: 8 on cpu, 32 on cuda)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 128 on cpu, 512 on cuda)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="float32, or bfloat16 autocast (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--sample-tokens", type=int, default=200, help="tokens of generated text to write")
    p.add_argument("--prompt", default="ROMEO:\n", help="start of the generated sample")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--seeds", type=int, default=1,
                   help="K >= 2: a seed study of K pairs of runs (seeds --seed .. --seed + K - 1); "
                   "reports each pair's final losses and the mean signed difference with its "
                   "standard error, and exits with status 1 when fusedce ends worse beyond noise")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at once in a seed study (default 1; on a large GPU several small "
                   "runs share it; their tokens/s then mean nothing)")
    a = p.parse_args(argv)
    for name in ("steps", "vocab", "batch_size", "seq_len"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if a.seeds < 1 or a.jobs < 1:
        p.error("--seeds and --jobs must be positive")
    for name in ("sample_tokens", "threads"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    if a.vocab is not None and a.vocab < 256:
        p.error("--vocab must be at least 256 (the byte values)")
    return a


def run_config(a):
    """RunConfig from the arguments: the preset for the device (or --quick), overridden by any
    option given."""
    on_cuda = a.device.startswith("cuda")
    preset = dict(PRESETS["quick" if a.quick else "cuda" if on_cuda else "cpu"])
    for name in ("steps", "vocab", "batch_size", "seq_len"):
        if getattr(a, name) is not None:
            preset[name] = getattr(a, name)
    model = ModelConfig(vocab=preset["vocab"], seq_len=preset["seq_len"], d_model=preset["d_model"],
                        n_layer=preset["n_layer"], n_head=preset["n_head"])
    return RunConfig(device=a.device, dtype=a.dtype or ("bfloat16" if on_cuda else "float32"), model=model,
                     batch_size=preset["batch_size"], steps=preset["steps"], lr=preset["lr"], seed=a.seed,
                     sample_tokens=a.sample_tokens, prompt=a.prompt, threads=a.threads)


def run_isolated(cfg, tokens, merges, loss_name):
    """train_run in a fresh Python process: bit-identical start for both runs, and a memory peak
    of its own (an allocator keeps pages from one run that would hide the next run's growth)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(train_run, cfg, tokens, merges, loss_name).result()


def run_pairs(cfg, tokens, merges, seeds, jobs):
    """Both losses' runs for each seed, `jobs` at a time, each in a fresh process; returns
    {seed: {loss_name: run}}."""
    configs = {s: dataclasses.replace(cfg, seed=s, sample_tokens=0) for s in seeds}
    if jobs == 1:
        return {s: {name: run_isolated(c, tokens, merges, name) for name in LOSSES}
                for s, c in configs.items()}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1) as ex:
        futures = {(s, name): ex.submit(train_run, c, tokens, merges, name)
                   for s, c in configs.items() for name in LOSSES}
        return {s: {name: futures[s, name].result() for name in LOSSES} for s in seeds}


def seed_study(a, cfg, tokens, merges):
    """--seeds K: K pairs of runs; prints the paired differences of the final losses and writes
    seeds.json into --out; returns the exit status (1: fusedce ends worse beyond noise)."""
    seeds = list(range(a.seed, a.seed + a.seeds))
    runs = run_pairs(cfg, tokens, merges, seeds, a.jobs)
    torch_finals = [report.final_loss(runs[s]["torch"]["losses"]) for s in seeds]
    fused_finals = [report.final_loss(runs[s]["fusedce"]["losses"]) for s in seeds]
    verdict = report.compare_seeds(torch_finals, fused_finals, cfg.dtype)
    first = runs[seeds[0]]["torch"]
    setup = describe(cfg, first["params"], where_it_ran(first))
    lines = report.seed_lines(setup, seeds, torch_finals, fused_finals, verdict)
    os.makedirs(a.out, exist_ok=True)
    curves = {s: {name: r["losses"] for name, r in pair.items()} for s, pair in runs.items()}
    with open(os.path.join(a.out, "seeds.json"), "w") as f:
        json.dump({"config": cfg.to_dict(), "versions": {"fusedce": fusedce_version(), "torch": torch.__version__},
                   "seeds": seeds, "torch_final": torch_finals, "fusedce_final": fused_finals,
                   "verdict": verdict, "losses": curves}, f, indent=1)
    lines.append(f"numbers: {os.path.join(a.out, 'seeds.json')}")
    print("\n".join(lines))
    return 1 if verdict["fusedce_worse"] else 0


def describe(cfg, params, where):
    m = cfg.model
    return (f"TinyGPT, {params / 1e6:.2f}M parameters "
            f"({m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads), "
            f"vocabulary {m.vocab}, {cfg.batch_size} x {m.seq_len} tokens a step, {cfg.steps} steps, "
            f"{cfg.dtype} on {where}")


def fusedce_version():
    import fusedce

    return fusedce.__version__


def where_it_ran(run):
    if run["device_name"] != "CPU":
        return run["device_name"]
    return f"CPU ({run['threads']} thread{'s' if run['threads'] != 1 else ''})"


def prepare_corpus(cfg):
    """The shipped text, a tokenizer learned on it with cfg.model.vocab ids at most, the text's
    ids, and a description of both (printed and kept in results.json)."""
    text = load_text()
    tok, tokens = tokenize(text, cfg.model.vocab)
    if len(tokens) <= cfg.model.seq_len + 1:
        raise ValueError(f"--seq-len {cfg.model.seq_len}: the corpus has only {len(tokens)} tokens")
    corpus = {"path": CORPUS_PATH.name, "characters": len(text), "tokens": len(tokens),
              "learned_vocab": tok.vocab_size, "unused_ids": cfg.model.vocab - tok.vocab_size}
    padding = ""
    if corpus["unused_ids"] > 0:
        padding = f"; ids {tok.vocab_size}..{cfg.model.vocab - 1} are padding the text cannot supply"
    print(f"corpus: {CORPUS_PATH.name}, {len(text):,} characters -> {len(tokens):,} tokens "
          f"(byte-pair encoding: 256 bytes + {len(tok.merges)} merges learned on the text{padding})")
    return tok, tokens, corpus


def write_report(out, cfg, corpus, runs):
    """Prints the summary and writes summary.txt, results.json, sample.txt and the plot into
    `out`; returns whether the loss curves agree."""
    os.makedirs(out, exist_ok=True)
    setup = describe(cfg, runs["torch"]["params"], where_it_ran(runs["torch"]))
    agreement = report.compare_curves(runs["torch"]["losses"], runs["fusedce"]["losses"], cfg.dtype)
    lines = report.summary_lines(setup, runs, agreement)
    png = os.path.join(out, "loss_curves.png")
    if report.plot_curves(png, runs, agreement, setup):
        lines.append(f"plot: {png}")
    else:
        lines.append("plot: skipped (matplotlib is not installed; `pip install matplotlib` for the PNG)")
    versions = {"fusedce": fusedce_version(), "torch": torch.__version__}
    report.write_json(os.path.join(out, "results.json"), cfg.to_dict(), versions, corpus, runs, agreement)
    report.write_samples(os.path.join(out, "sample.txt"), cfg.prompt, runs)
    lines.append(f"numbers: {os.path.join(out, 'results.json')}; "
                 f"generated text: {os.path.join(out, 'sample.txt')}")
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("\nsample (fusedce run):\n" + runs["fusedce"]["sample"][:400])
    return agreement["agree"]


def main(argv=None):
    """Runs the demo; returns the exit status (0: the curves agree, 1: they diverge or, in a
    seed study, fusedce ends worse beyond noise, 2: the demo cannot run as asked)."""
    a = parse_args(argv)
    cfg = run_config(a)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        print("fusedce.demo: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    try:
        tok, tokens, corpus = prepare_corpus(cfg)
    except ValueError as e:
        print(f"fusedce.demo: {e}", file=sys.stderr)
        return 2
    if a.seeds > 1:
        status = seed_study(a, cfg, tokens, tok.merges)
        if status:
            print("fusedce.demo: fusedce's final loss is higher than torch's beyond noise", file=sys.stderr)
        return status
    runs = {name: run_isolated(cfg, tokens, tok.merges, name) for name in LOSSES}
    if not write_report(a.out, cfg, corpus, runs):
        print("fusedce.demo: the loss curves diverge beyond the tolerance", file=sys.stderr)
        return 1
    return 0
