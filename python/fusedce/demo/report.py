"""What the demo shows: the two loss curves and their agreement, tokens per second, peak memory,
and a sample of generated text; printed, written to JSON and text files, and plotted (PNG) when
matplotlib is installed."""

import json
import math
import statistics
import textwrap

# How far the two loss curves may drift apart (nats), by compute dtype. The runs start from the
# same weights and see the same batches, so the curves differ only by rounding, which training
# carries forward: little while the learning rate is low, a lot near its peak. Measured:
# - float32, the CPU default run: within 3e-6 over 200 steps. On the H200 (300 steps; attention's
#   backward adds atomics' non-determinism to both runs): 1.8e-5 over the warm-up, 4.1e-3 at
#   worst later, 4.7e-4 on average.
# - bfloat16 (the baseline rounds its logits to bfloat16 before the upcast, fusedce does not, so
#   the runs differ from the first step on): 5.2e-3 over the 200 steps of the CPU default; on the
#   H200 (2026-11-30) 8.2e-4 over the first 20 steps, then, from step 21 as the warm-up reached
#   its peak learning rate, 0.09 at step 30 and 0.029 on average over 300 steps (seed 0; seed 1:
#   1.1e-2 at worst; 150 steps: 1.0e-3). A rounding difference near the peak sends the runs down
#   visibly different (equally good) paths; a pointwise bound over the whole run cannot tell that
#   from a bug.
# A wrong loss shows at the first step; a wrong gradient changes what the model learns at once
# (Adam ignores a uniform scale of a gradient, not a wrong direction): lm_head.weight's gradient
# taken from half the rows, or the hidden states' gradient missing for 1/16 of the rows, moved
# the float32 curves apart by more than 1e-3 within two steps and by 0.037 to 0.13 within 100
# (tests/python/test_demo.py plants the first). So the sharp check is the early steps' largest
# difference (EARLY_TOLERANCE over the first early_steps(n)), and the whole run's mean difference
# gets a loose bound (RUN_TOLERANCE) that only a run going wrong later would break.
EARLY_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-2}
RUN_TOLERANCE = {"float32": 1e-2, "bfloat16": 1e-1}
TOLERANCE = EARLY_TOLERANCE  # the bound plotted beside the differences

LABELS = {
    "torch": "torch: lm_head + F.cross_entropy (float32 logits)",
    "fusedce": "fusedce.linear_cross_entropy",
}


def early_steps(n):
    """The steps the sharp check covers: the first 5% of the run (half the learning-rate
    warm-up), at least 5 (or all of a shorter run)."""
    return min(n, max(5, n // 20))


def compare_curves(a, b, dtype):
    """Where and how far the curves differ: the early steps' largest |a - b| (against
    EARLY_TOLERANCE[dtype]), the whole run's mean and largest |a - b| (the mean against
    RUN_TOLERANCE[dtype]), the first step's; and whether they agree (any non-finite loss or a
    length mismatch: they do not)."""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    finite = all(math.isfinite(x) for x in a + b) and len(a) == len(b) and len(a) > 0
    nan = float("nan")
    worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else 0
    k = early_steps(len(diffs))
    early = max(diffs[:k]) if finite else nan
    mean = sum(diffs) / len(diffs) if finite else nan
    return {
        "max_abs_diff": diffs[worst] if finite else nan,
        "at_step": worst,
        "first_step_abs_diff": diffs[0] if diffs else nan,
        "early_steps": k,
        "early_max_abs_diff": early,
        "mean_abs_diff": mean,
        "tolerance": EARLY_TOLERANCE[dtype],
        "run_tolerance": RUN_TOLERANCE[dtype],
        "agree": finite and early <= EARLY_TOLERANCE[dtype] and mean <= RUN_TOLERANCE[dtype],
    }


# The seed study (--seeds K): K pairs of runs, each pair from its own seed. Two bfloat16 runs that
# differ only by rounding drift apart with either sign; a biased gradient makes one loss end
# higher in every pair. Each run's final loss is the mean over its last FINAL_FRACTION of steps
# (less batch noise than the last step alone; both runs of a pair see the same batches). fusedce
# is worse beyond noise when the mean signed difference (fusedce - torch) exceeds both twice its
# standard error and BIAS_FLOOR: in float32 the pairs agree to ~1e-6, so a standard error alone
# would flag differences far below anything training notices.
FINAL_FRACTION = 0.1
BIAS_FLOOR = {"float32": 1e-4, "bfloat16": 2e-3}


def final_loss(losses):
    """The mean loss over the last FINAL_FRACTION of the steps (at least one step)."""
    k = max(1, int(len(losses) * FINAL_FRACTION))
    return sum(losses[-k:]) / k


def compare_seeds(torch_finals, fused_finals, dtype):
    """The paired differences of K runs' final losses (fusedce - torch): their mean, standard
    error and sign count, and whether fusedce ends worse beyond noise (K >= 2)."""
    if len(torch_finals) != len(fused_finals) or len(torch_finals) < 2:
        raise ValueError("compare_seeds needs two or more pairs of final losses")
    diffs = [f - t for t, f in zip(torch_finals, fused_finals)]
    k = len(diffs)
    mean = sum(diffs) / k
    finite = all(math.isfinite(d) for d in diffs)
    se = statistics.stdev(diffs) / math.sqrt(k) if finite else float("nan")
    return {
        "diffs": diffs,
        "mean_diff": mean,
        "stderr": se,
        "positive": sum(d > 0 for d in diffs),
        "pairs": k,
        "floor": BIAS_FLOOR[dtype],
        "fusedce_worse": (not finite) or (mean > 2 * se and mean > BIAS_FLOOR[dtype]),
    }


def seed_lines(setup, seeds, torch_finals, fused_finals, verdict):
    """The seed study's printed report, as lines of text."""
    lines = [setup, "",
             f"final loss = mean over the last {FINAL_FRACTION:.0%} of the steps",
             "seed | torch    | fusedce  | fusedce - torch",
             "-----|----------|----------|----------------"]
    for s, t, f, d in zip(seeds, torch_finals, fused_finals, verdict["diffs"]):
        lines.append(f"{s:4d} | {t:8.4f} | {f:8.4f} | {d:+.4e}")
    worse = "fusedce WORSE beyond noise" if verdict["fusedce_worse"] else "no systematic gap"
    lines.append(f"mean difference {verdict['mean_diff']:+.4e} +- {verdict['stderr']:.2e} (standard "
                 f"error, {verdict['pairs']} pairs; {verdict['positive']} of {verdict['pairs']} "
                 f"positive; floor {verdict['floor']:.0e}): {worse}")
    return lines


def _mib(n):
    return f"{n / 2**20:,.1f} MiB"


def summary_lines(setup, runs, agreement):
    """The printed report, as lines of text."""
    t, f = runs["torch"], runs["fusedce"]
    lines = [setup, ""]
    width = max(len(v) for v in LABELS.values())
    lines.append(f"{'run':<{width}} | final loss | tokens/s | peak memory")
    lines.append(f"{'-' * width}-|------------|----------|------------")
    for name in ("torch", "fusedce"):
        r = runs[name]
        lines.append(f"{LABELS[name]:<{width}} | {r['losses'][-1]:10.4f} | {r['tokens_per_s']:8,.0f} | "
                     f"{_mib(r['peak_memory_bytes']):>11}")
    lines.append(f"peak memory: {t['memory_measure']}")
    saved = t["peak_memory_bytes"] - f["peak_memory_bytes"]
    if t["peak_memory_bytes"] > 0:
        lines.append(f"fusedce vs torch: peak memory {_mib(abs(saved))} {'less' if saved >= 0 else 'more'} "
                     f"({100 * abs(saved) / t['peak_memory_bytes']:.0f}%), "
                     f"{f['tokens_per_s'] / t['tokens_per_s']:.2f}x the tokens/s")
    verdict = "agree" if agreement["agree"] else "DIVERGE"
    lines.append(f"loss curves: max |diff| {agreement['early_max_abs_diff']:.2e} over the first "
                 f"{agreement['early_steps']} steps (tolerance {agreement['tolerance']:.0e}), mean |diff| "
                 f"{agreement['mean_abs_diff']:.2e} over all {len(t['losses'])} (tolerance "
                 f"{agreement['run_tolerance']:.0e}): {verdict}")
    lines.append(f"             largest |diff| {agreement['max_abs_diff']:.2e} at step {agreement['at_step']}, "
                 f"first step {agreement['first_step_abs_diff']:.2e}")
    return lines


def plot_curves(path, runs, agreement, title):
    """Writes the two loss curves and their difference to a PNG; False when matplotlib is not
    installed (nothing written)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    styles = {"torch": dict(color="tab:blue", lw=2.2, alpha=0.6),
              "fusedce": dict(color="tab:red", lw=1, ls="--")}
    for name in ("torch", "fusedce"):
        r = runs[name]
        label = (f"{LABELS[name]}: {r['tokens_per_s']:,.0f} tok/s, peak {_mib(r['peak_memory_bytes'])}")
        top.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, **styles[name])
    top.set_ylabel("training loss (nats)")
    top.set_title(textwrap.fill(title, 100), fontsize=9)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    pairs = zip(runs["torch"]["losses"], runs["fusedce"]["losses"])
    # steps with bit-identical losses have no point on a log scale
    diff = [(step, abs(a - b)) for step, (a, b) in enumerate(pairs, 1) if a != b]
    bottom.semilogy([s for s, _ in diff], [d for _, d in diff], ".", color="black", ms=3,
                    label="|difference| (steps with identical losses not shown)")
    bottom.axhline(agreement["tolerance"], color="tab:red", lw=0.8, ls=":", label=f"tolerance (first {agreement['early_steps']} steps)")
    bottom.set_xlabel("step")
    bottom.set_ylabel("|torch - fusedce|")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_json(path, config, versions, corpus, runs, agreement):
    with open(path, "w") as f:
        json.dump({"config": config, "versions": versions, "corpus": corpus, "runs": runs,
                   "agreement": agreement}, f, indent=1)


def write_samples(path, prompt, runs):
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# Text sampled from each trained model after the prompt {prompt!r} "
                "(temperature 0.8, same seed)\n")
        for name in ("fusedce", "torch"):
            f.write(f"\n## {LABELS[name]}\n\n{runs[name]['sample']}\n")
