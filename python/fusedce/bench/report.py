"""What the user reads: a terminal table (Markdown), a CSV whose rows carry the machine, torch
and fusedce, and PNG plots (matplotlib, when installed)."""

import csv
import dataclasses
import os
import statistics

from .peers import REGISTRY
from .runner import Row

FUSEDCE = "fusedce"
BASELINE = "torch eager"
FLOOR = "floor (3 bare products)"


def _ms(row):
    if row.status != "ok":
        return f"{row.status}: {row.note}"
    text = f"{row.median_ms:.3f} ({row.p10_ms:.3f}-{row.p90_ms:.3f})"
    return f"{text}; {row.note}" if row.note else text


def _num(value, fmt):
    return "" if value is None else format(value, fmt)


def _sig(x):
    """Three significant digits, no exponent for the usual range of rates."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _err(row):
    if row.loss_err is None:
        return ""
    text = f"{row.loss_err:.1e}" + ("" if row.grad_err is None else f" / {row.grad_err:.1e}")
    return text if row.correct else text + " WRONG"


def table(rows, meta):
    """The Markdown table of every row that has numbers or a failure, fusedce's unavailable rows
    too; other unavailable implementations are listed once below it with the reason."""
    lines = [f"# {meta['device_name']} | torch {meta['torch_version']} | fusedce {meta['fusedce_version']} "
             f"({meta['fusedce_commit']})",
             "# ceilings measured in this run: " + ", ".join(meta["ceiling_text"]),
             "# rate: cross-entropy GB/s (forward N*V*elem, fwd+bwd 2*N*V*elem bytes) of the copy "
             "bandwidth; linear TFLOP/s (6*N*H*V) of the GEMM rate; logprobs TFLOP/s (forward "
             "2*N*H*V, with backward 6*N*H*V)",
             "# error: the loss's relative error / the gradient's relative max-norm error against "
             "float64; WRONG past the dtype's tolerance",
             "# peak extra MB: device memory beyond the inputs and the gradients returned"
             + ("" if meta.get("device") != "cpu" else " (GPU only: empty here)"),
             "",
             "| case | model | dtype | job | implementation | median ms (p10-p90) | rate | of ceiling "
             "| peak extra MB | error loss / grad |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    unavailable = {}
    for r in rows:
        if r.status == "unavailable" and r.peer != FUSEDCE:  # listed once below the table
            unavailable.setdefault((r.peer, r.note), set()).add(r.kind)
            continue
        rate = "" if r.rate is None else f"{_sig(r.rate)} {r.unit}"
        share = "" if r.of_ceiling is None else f"{100 * r.of_ceiling:.1f}%"
        lines.append(f"| {r.case} | {r.model} | {r.dtype} | {r.job} | {r.peer} | {_ms(r)} | {rate} | {share} "
                     f"| {_num(r.peak_extra_mb, '.0f')} | {_err(r)} |")
    if unavailable:
        lines.append("")
        lines.append("Not run here:")
        for (peer, note), kinds in sorted(unavailable.items()):
            lines.append(f"- {peer} ({', '.join(sorted(kinds))}): {note}")
    return "\n".join(lines)


def speedups(rows):
    """fusedce's geometric-mean speed-up over each other implementation (not over its own
    variants), per kind and job, over the rows where both ran and both were within tolerance:
    {(kind, job, peer): (x, count)}."""
    ours = {(r.kind, r.job, r.case, r.dtype): r for r in rows
            if r.peer == FUSEDCE and r.status == "ok" and r.correct}
    ratios = {}
    for r in rows:
        mine = ours.get((r.kind, r.job, r.case, r.dtype))
        if r.peer.startswith(FUSEDCE) or mine is None or r.status != "ok" or not r.correct:
            continue
        ratios.setdefault((r.kind, r.job, r.peer), []).append(r.median_ms / mine.median_ms)
    return {k: (statistics.geometric_mean(v), len(v)) for k, v in ratios.items()}


def versus(rows, job="fwd+bwd"):
    """A compact table of one job: per case, each implementation's median ms, then fusedce's
    speed-up over each implementation that is not one of its own variants (their median over
    fusedce's: above 1, fusedce is faster), from the same run; with the floor measured, each
    fusedce variant's time over the floor's."""
    done = [r for r in rows if r.job == job and r.status == "ok"]
    peers = list(dict.fromkeys(r.peer for r in done))
    others = [p for p in peers if not p.startswith(FUSEDCE) and p != FLOOR]
    ours_all = [p for p in peers if p.startswith(FUSEDCE)] if FLOOR in peers else []
    if FUSEDCE not in peers or not (others or ours_all):
        return ""
    lines = [f"{job}, median ms (fusedce's speed-up" + ("; x floor: time over the floor's" if ours_all else "") + "):",
             "| case | dtype | " + " | ".join(peers) + " | " + " | ".join(f"vs {p}" for p in others)
             + "".join(f" | {p} x floor" for p in ours_all) + " |",
             "|---|---|" + "---|" * (len(peers) + len(others) + len(ours_all))]
    for key in dict.fromkeys((r.kind, r.case, r.dtype) for r in done):
        at = {r.peer: r for r in done if (r.kind, r.case, r.dtype) == key}
        ours = at.get(FUSEDCE)
        floor = at.get(FLOOR)
        ms = [_num(at[p].median_ms, ".1f") if p in at else "" for p in peers]
        xs = [f"{at[p].median_ms / ours.median_ms:.2f}x" if ours is not None and p in at else "" for p in others]
        xs += [f"{at[p].median_ms / floor.median_ms:.3f}" if floor is not None and p in at else "" for p in ours_all]
        lines.append(f"| {key[1]} | {key[2]} | " + " | ".join(ms) + " | " + " | ".join(xs) + " |")
    return "\n".join(lines)


def summary(rows):
    lines = []
    for (kind, job, peer), (x, n) in sorted(speedups(rows).items()):
        what = {"ce": "cross-entropy", "linear": "linear cross-entropy"}.get(kind, "log-probabilities")
        lines.append(f"fusedce vs {peer}, {what} {job}: geometric-mean speed-up {x:.2f}x over "
                     f"{n} row{'' if n == 1 else 's'}")
    wrong = [r for r in rows if r.status == "ok" and r.correct is False]
    for r in wrong:
        lines.append(f"WRONG: {r.peer} on {r.case} {r.dtype} {r.job}: loss error {r.loss_err:.2e}"
                     + ("" if r.grad_err is None else f", gradient error {r.grad_err:.2e}"))
    return "\n".join(lines)


def write_csv(rows, meta, path):
    """One line per row, every field of Row plus the machine, torch, fusedce and the ceilings."""
    extra = ["device", "device_name", "torch_version", "fusedce_version", "fusedce_commit", "date",
             "copy_gbs", "gemm_tflops"]
    fields = [f.name for f in dataclasses.fields(Row)] + extra
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            line = dataclasses.asdict(r)
            line.update({k: meta[k] for k in extra if k != "gemm_tflops"})
            line["gemm_tflops"] = meta["gemm_tflops"].get(r.dtype, "")
            writer.writerow(line)


def _series(rows, kind, job, dtype, key):
    """{implementation: [(x, row)]} of the ok rows of one kind, job and dtype, x = key(row)."""
    out = {}
    for r in rows:
        if r.kind == kind and r.job == job and r.dtype == dtype and r.status == "ok" and not r.masked:
            x = key(r)
            if x is not None:
                out.setdefault(r.peer, []).append((x, r))
    return {peer: sorted(points, key=lambda p: p[0]) for peer, points in out.items()}


def _most_common(values):
    values = list(values)
    return max(set(values), key=values.count) if values else None


def _style(peer):
    """fusedce bold; every implementation keeps its colour across plots (registry order)."""
    names = [entry[1] for entry in REGISTRY]
    color = f"C{names.index(peer) % 10}" if peer in names else None
    if peer == FUSEDCE:
        return dict(color=color, linewidth=2.5, marker="o", zorder=3)
    return dict(color=color, linewidth=1.2, marker=".")


def _plot_ce(plt, rows, meta, dtype, path):
    """Bandwidth vs vocabulary at the token count that has the most vocabularies, forward and
    forward+backward side by side, the copy ceiling drawn. False if there is nothing to draw."""
    ce_rows = [r for r in rows if r.kind == "ce" and r.dtype == dtype and r.status == "ok" and not r.masked]
    tokens = (_most_common(r.tokens for r in ce_rows if r.peer == FUSEDCE)
              or _most_common(r.tokens for r in ce_rows))
    if tokens is None:
        return False
    vocabs = sorted({r.vocab for r in ce_rows if r.tokens == tokens})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, job in zip(axes, ("forward", "fwd+bwd")):
        series = _series(rows, "ce", job, dtype, lambda r: r.vocab if r.tokens == tokens else None)
        for peer, points in sorted(series.items()):
            ax.plot([p[0] for p in points], [p[1].rate for p in points], label=peer, **_style(peer))
        ax.axhline(meta["copy_gbs"], color="black", linestyle="--", linewidth=1,
                   label=f"copy bandwidth (read + write), {_sig(meta['copy_gbs'])} GB/s")
        ax.set_xscale("log")
        ax.set_xticks(vocabs, [str(v) for v in vocabs], rotation=30)
        ax.minorticks_off()
        ax.set_xlabel("vocabulary")
        ax.set_title(f"cross-entropy {job}, {tokens} tokens, {dtype}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s (forward N·V·elem, fwd+bwd 2·N·V·elem)")
    axes[1].legend(fontsize=8, loc="best")
    _save(plt, fig, meta, path)
    return True


def _plot_linear(plt, rows, meta, dtype, path):
    """Time (and, on a GPU, peak extra memory) vs tokens for the hidden x vocab that has the most
    token counts, with the time 6·N·H·V takes at the measured GEMM rate. False if nothing."""
    lin_rows = [r for r in rows
                if r.kind == "linear" and r.dtype == dtype and r.status == "ok" and not r.masked]
    head = _most_common((r.hidden, r.vocab) for r in lin_rows)
    if head is None:
        return False
    series = _series(rows, "linear", "fwd+bwd", dtype,
                     lambda r: r.tokens if (r.hidden, r.vocab) == head else None)
    has_memory = any(r.peak_extra_mb is not None for points in series.values() for _, r in points)
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(13 if has_memory else 7, 5), squeeze=False)
    axes = axes[0]
    xs = sorted({r.tokens for r in lin_rows if (r.hidden, r.vocab) == head})
    for peer, points in sorted(series.items()):
        axes[0].plot([x for x, _ in points], [r.median_ms for _, r in points], label=peer, **_style(peer))
        if has_memory:
            mem = [(x, r.peak_extra_mb) for x, r in points if r.peak_extra_mb is not None]
            # a log axis cannot show 0: nothing extra is drawn at 0.01 MB
            axes[1].plot([x for x, _ in mem], [max(m, 0.01) for _, m in mem], label=peer, **_style(peer))
    gemm = meta["gemm_tflops"].get(dtype)
    if gemm:
        floor = [6 * n * head[0] * head[1] / (gemm * 1e12) * 1e3 for n in xs]
        axes[0].plot(xs, floor, color="black", linestyle="--", linewidth=1,
                     label=f"6·N·H·V at the GEMM rate, {_sig(gemm)} TFLOP/s")
    labels = ("median ms, forward + backward", "peak extra memory, MB (beyond inputs and gradients)")
    for ax, what in zip(axes, labels):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(n) for n in xs])
        ax.minorticks_off()
        ax.set_xlabel("tokens")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_title(f"linear cross-entropy, hidden {head[0]}, vocab {head[1]}, {dtype}")
    axes[0].legend(fontsize=8, loc="best")
    _save(plt, fig, meta, path)
    return True


def _save(plt, fig, meta, path):
    fig.suptitle(f"{meta['device_name']}, torch {meta['torch_version']}, fusedce {meta['fusedce_commit']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows, meta, out_dir):
    """PNG plots in out_dir, per dtype: ce_bandwidth_<dtype>.png (cross-entropy GB/s vs
    vocabulary, one line per implementation, the copy ceiling drawn) and
    linear_tokens_<dtype>.png (linear cross-entropy time and peak memory vs tokens). Returns the
    files written, or a sentence saying why none were."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plots (pip install matplotlib)"
    written = []
    for dtype in sorted({r.dtype for r in rows}):
        for name, draw in (("ce_bandwidth", _plot_ce), ("linear_tokens", _plot_linear)):
            path = os.path.join(out_dir, f"{name}_{dtype}.png")
            if draw(plt, rows, meta, dtype, path):
                written.append(path)
    return written


def ceiling_text(meta):
    parts = [f"copy {meta['copy_gbs']:.0f} GB/s (read + write)"]
    for dtype, tflops in sorted(meta["gemm_tflops"].items()):
        parts.append(f"{dtype} GEMM {_sig(tflops)} TFLOP/s")
    return parts

