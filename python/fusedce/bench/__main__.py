"""fusedce against every cross-entropy implementation importable here, on shapes from real
models: time, achieved bandwidth or FLOP rate against ceilings measured in the same run, peak
extra memory and the error against float64.

    python -m fusedce.bench [--out DIR] [--quick] [--only ce|linear|logprobs|shard] [--peers LIST]
                            [--shapes 8192x128256,8192x4096x128256:masked] [--dtypes bfloat16]
                            [--repeat N] [--warmup N] [--device cuda|cpu] [--threads N]

Jobs: cross-entropy over (N, V) logits, forward and forward+backward; linear cross-entropy
(hidden (N, H) @ weight (V, H).T, never materialised by the fused implementations),
forward+backward; per-token log-probabilities of hidden @ weight.T (fusedce.linear_logprobs
against the materialised path: F.linear, log_softmax, gather, entropy), forward, forward+backward
and forward+backward with the entropy. Implementations: fusedce; PyTorch eager (F.cross_entropy on float32 logits, as
transformers calls it) and torch.compile of it; PyTorch's F.linear_cross_entropy (chunked) where
torch has it; liger-kernel (its Triton kernels, and its SM90 CuTe DSL path where that imports on
an SM90 GPU), cut-cross-entropy, quack (its scaled-exp SM90 pipeline where eligible), unsloth and
flash-attn's Triton kernel
(file named by $FUSEDCE_PEER_FLASH_ATTN_CE) when importable. A missing or failing one is
reported with the reason.

Rates: cross-entropy GB/s by forward N*V*elem and forward+backward 2*N*V*elem bytes, against the
device-to-device copy bandwidth (read + write); linear cross-entropy TFLOP/s by 6*N*H*V against a
large torch.matmul in the same dtype; log-probabilities TFLOP/s by 2*N*H*V (forward) and 6*N*H*V. On a GPU: CUDA events after warm-up, inputs smaller than 3x
the L2 rotated among copies; the implementations of one job are checked first, then timed
together in interleaved blocks (measure.time_blocks), so that the chip's drift reaches them alike. Without a GPU the CPU path runs against PyTorch's CPU path, at
smaller sizes. --out DIR writes results.csv, results.md and PNG plots (matplotlib) there.

--only shard is a group of its own (fusedce only, its own CSV columns, no plots): one rank of the
vocabulary-parallel linear cross-entropy at W = 2, 4, 8 ranks, forward + backward, beside the
one-device call in the same run, the collectives stood in for (fusedce/bench/shard.py says how);
--shapes takes NxHxV there.
"""

import argparse
import datetime
import os
import subprocess
import sys
import time

import torch

import fusedce

from . import cases as cases_mod
from . import peers as peers_mod
from . import report
from . import shard as shard_mod
from .measure import copy_ceiling_gbs, device_name, gemm_ceiling_tflops, l2_bytes
from .runner import Progress, count_units, dtype_name, run_benchmark

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m fusedce.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", metavar="DIR", help="folder for results.csv, results.md and the plots")
    p.add_argument("--quick", action="store_true", help="a few small cases and fewer runs")
    p.add_argument("--only", choices=("ce", "linear", "logprobs", "shard"),
                   help="only cross-entropy over logits, only linear, only the log-probabilities, or "
                        "the vocabulary-parallel linear form per shard (a group of its own)")
    p.add_argument("--peers", default=",".join(peers_mod.PEER_IDS),
                   help=f"comma-separated, from {','.join(peers_mod.PEER_IDS)} (default: all)")
    p.add_argument("--shapes", help="NxV (cross-entropy) and NxHxV (linear), comma-separated, each "
                                    "optionally ':masked' (half the targets ignored); default: "
                                    "shapes of real models")
    p.add_argument("--dtypes", help="comma-separated from float32,bfloat16,float16 (default bfloat16 on a "
                                    "GPU, float32 on the CPU, where bfloat16 products are slow)")
    p.add_argument("--repeat", type=int,
                   help="timed runs per row (default 20 on a GPU, 3 on the CPU; with --quick 5 / 2)")
    p.add_argument("--warmup", type=int, help="untimed runs after the checked one (default 3 on a GPU, "
                                              "0 on the CPU)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU")
    a.dtypes = a.dtypes or ("bfloat16" if a.device == "cuda" else "float32")
    try:
        a.dtypes = [DTYPES[d.strip()] for d in a.dtypes.split(",") if d.strip()]
    except KeyError as e:
        p.error(f"--dtypes: unknown {e.args[0]!r}; choose from {','.join(DTYPES)}")
    if not a.dtypes:
        p.error("--dtypes: none given")
    a.peers = [s.strip() for s in a.peers.split(",") if s.strip()]
    try:
        if a.only == "shard":
            a.cases = (shard_mod.as_shard_cases(cases_mod.parse_shapes(a.shapes)) if a.shapes
                       else shard_mod.default_cases(a.device, a.quick))
        else:
            a.cases = cases_mod.parse_shapes(a.shapes) if a.shapes else cases_mod.default_cases(a.device, a.quick)
    except ValueError as e:
        p.error(str(e))
    unknown = sorted(set(a.peers) - set(peers_mod.PEER_IDS))
    if unknown:
        p.error(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(peers_mod.PEER_IDS)}")
    if a.only:
        a.cases = [c for c in a.cases if c.kind == a.only]
    gpu = a.device == "cuda"
    if a.repeat is None:
        a.repeat = (5 if a.quick else 20) if gpu else (2 if a.quick else 3)
    a.warmup = a.warmup if a.warmup is not None else (3 if gpu else 0)
    if a.repeat < 1 or a.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")
    return a


def fusedce_commit():
    """$FUSEDCE_COMMIT, else the git commit of the checkout fusedce was imported from (with
    '-dirty' when it has changes), else 'unknown' (an installed wheel)."""
    if os.environ.get("FUSEDCE_COMMIT"):
        return os.environ["FUSEDCE_COMMIT"]
    here = os.path.dirname(os.path.abspath(fusedce.__file__))
    try:
        out = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def measure_ceilings(device, dtypes, cases, quick):
    """The copy bandwidth always; a GEMM rate for each dtype of a linear case."""
    gemm = {}
    if any(c.kind != "ce" for c in cases):
        for dtype in dtypes:
            gemm[dtype_name(dtype)] = gemm_ceiling_tflops(device, dtype, quick)
    return copy_ceiling_gbs(device, quick), gemm


def run_meta(a):
    """The machine, torch, fusedce and the ceilings measured now: every CSV row carries them."""
    copy_gbs, gemm = measure_ceilings(a.device, a.dtypes, a.cases, a.quick)
    meta = {
        "device": a.device,
        "device_name": device_name(a.device),
        "torch_version": torch.__version__,
        "fusedce_version": fusedce.__version__,
        "fusedce_commit": fusedce_commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "copy_gbs": copy_gbs,
        "gemm_tflops": gemm,
    }
    meta["ceiling_text"] = report.ceiling_text(meta)
    return meta


def write_outputs(out_dir, text, write_csv):
    os.makedirs(out_dir, exist_ok=True)
    write_csv(os.path.join(out_dir, "results.csv"))
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text + "\n")


def main_shard(a, started):
    """--only shard: its own rows, table and CSV."""
    meta = run_meta(a)
    progress = Progress(shard_mod.count_units(a.cases, a.dtypes), enabled=not a.no_progress)
    try:
        rows = shard_mod.run_shard_benchmark(a.cases, a.dtypes, a.device, a.repeat, a.warmup,
                                             l2_bytes(a.device), progress)
    finally:
        progress.close()
    text = shard_mod.table(rows, meta) + "\n\n" + shard_mod.summary(rows)
    print(text)
    if a.out:
        write_outputs(a.out, text, lambda path: shard_mod.write_csv(rows, meta, path))
        print(f"\nwrote results.csv, results.md to {a.out}")
    print(f"({time.time() - started:.0f} s)")


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    started = time.time()
    if a.only == "shard":
        return main_shard(a, started)
    peers = peers_mod.load(a.peers, a.device)
    meta = run_meta(a)
    copy_gbs, gemm = meta["copy_gbs"], meta["gemm_tflops"]
    ceilings = {"copy": copy_gbs, **{dt: gemm[dtype_name(dt)] for dt in a.dtypes if dtype_name(dt) in gemm}}
    progress = Progress(count_units(a.cases, a.dtypes, peers), enabled=not a.no_progress)
    try:
        rows = run_benchmark(a.cases, a.dtypes, peers, a.device, a.repeat, a.warmup, ceilings,
                             l2_bytes(a.device), progress)
    finally:
        progress.close()

    compact = report.versus(rows)
    text = report.table(rows, meta) + "\n\n" + (compact + "\n\n" if compact else "") + report.summary(rows)
    print(text)
    if a.out:
        write_outputs(a.out, text, lambda path: report.write_csv(rows, meta, path))
        plots = report.plot(rows, meta, a.out)
        written = ["results.csv", "results.md"] + ([os.path.basename(p) for p in plots]
                                                   if isinstance(plots, list) else [])
        print(f"\nwrote {', '.join(written)} to {a.out}")
        if not isinstance(plots, list):
            print(plots)
    print(f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
