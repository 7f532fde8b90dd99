"""Hardware counters of a probe's matrix products under Nsight Compute, a table row a launch.

Asks what holds each product below the chip's rate (issue 43's "ncu profiles of the products"):
our main loops (rs_loop's and rs_weight's variants), cuBLASLt's kernel and CUTLASS's plain kernel
on the same operands, side by side: the SM clock the kernel ran at (these products are power
bound), the tensor pipe's active share, issue-slot use, L2 and DRAM traffic against their peaks,
shared-memory wavefronts and bank conflicts, and the three largest warp stall reasons.

How: runs `ncu` on the probe's `profile` mode (each kernel's checked runs at one shape, no timing
rounds) with `--clock-control none` (the chip keeps its own clocks, as in every timing here),
writes the report to OUT/report.ncu-rep, re-reads it as CSV (OUT/raw.csv) and prints the table
(OUT/summary.md too). Metric names move between ncu versions and chips, so each is asked for only
if `ncu --query-metrics` lists its base name on this GPU; a missing one leaves its column empty.

Run (GPU machine, ncu on PATH or in /usr/local/cuda/bin or /opt/nvidia/nsight-compute/*/):
    python3 dev/scaled_gemm/ncu_summary.py --out DIR -- build-probe/rs_loop profile
    python3 dev/scaled_gemm/ncu_summary.py --out DIR -- build-probe/rs_weight profile
"""

import argparse
import csv
import glob
import io
import os
import re
import shutil
import subprocess
import sys

# column -> full metric names to try, first listed first
COLUMNS = [
    ("ms", ["gpu__time_duration.sum"]),
    ("SM GHz", ["sm__cycles_elapsed.avg.per_second"]),
    ("tensor pipe % active", ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                              "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                              "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"]),
    ("issue % active", ["sm__inst_issued.avg.pct_of_peak_sustained_active"]),
    ("L2 % peak", ["lts__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("L2 GB", ["lts__t_bytes.sum"]),
    ("DRAM % peak", ["dram__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("DRAM GB read", ["dram__bytes_read.sum"]),
    ("DRAM GB written", ["dram__bytes_write.sum"]),
    ("smem wavefronts (M)", ["l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"]),
    ("smem bank conflicts (M)", ["l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"]),
]
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active$")
SCALE = {"ms": 1e-6, "SM GHz": 1e-9, "L2 GB": 1e-9, "DRAM GB read": 1e-9, "DRAM GB written": 1e-9,
         "smem wavefronts (M)": 1e-6, "smem bank conflicts (M)": 1e-6}  # from ns, Hz, bytes, counts
# ncu's CSV prints each value in a unit of its own choosing (its second line: "ms", "Ghz", "Mbyte");
# each is brought back to the base unit (ns, Hz, bytes, counts) that SCALE starts from
UNIT_PREFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
UNIT_BASE = {"second": 1e9, "s": 1e9, "hz": 1.0, "Hz": 1.0, "byte": 1.0, "B": 1.0}  # time to ns
KERNELS = r"rs_loop|rs_weight|nvjet|gemm|xmma|device_kernel"


def find_ncu():
    for exe in [shutil.which("ncu"), "/usr/local/cuda/bin/ncu", *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))]:
        if exe and os.path.exists(exe):
            return exe
    sys.exit("ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute/*/)")


def available_bases(ncu):
    """The metric base names this GPU's ncu knows (the first word of each --query-metrics line)."""
    out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip() and re.match(r"^[a-z]\w*__\w+", line)}


def chosen_metrics(bases):
    """(column -> metric name or None, the stall metric names): the first candidate of each column
    whose base name ncu lists, and every per-issue stall ratio it lists."""
    cols = {name: next((m for m in tries if m.split(".")[0] in bases), None) for name, tries in COLUMNS}
    stalls = sorted(b + ".ratio" for b in bases if STALL.match(b))
    return cols, stalls


def short_name(kernel):
    """A kernel's name without its namespaces' noise: our kernels keep their template arguments."""
    m = re.search(r"(rs_loop_kernel|rs_weight_kernel)<([^>]*)>", kernel)
    if m:
        return f"{m.group(1)}<{m.group(2)}>"
    if "device_kernel" in kernel:
        return "CUTLASS " + ("GemmUniversal" if "GemmUniversal" in kernel else kernel[:60])
    return kernel.split("(")[0][:80]


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def to_base(value, unit):
    """value in `unit` (ncu's units row: "ms", "nsecond", "Ghz", "Mbyte", "" for a count) in the base
    unit; an unknown unit stops the program rather than print a wrong figure."""
    if not unit:
        return value
    for base, factor in UNIT_BASE.items():
        if unit.endswith(base) and unit[: -len(base)] in UNIT_PREFIX:
            return value * UNIT_PREFIX[unit[: -len(base)]] * factor
    if unit in ("%", "inst", "cycle", "warp", "sector", "request"):
        return value
    sys.exit(f"ncu_summary: unknown unit {unit!r}")


def table(rows, cols, stalls, units):
    """Markdown: a row a launch, in launch order (units: metric -> its unit in the CSV)."""
    head = ["#", "kernel", "grid", *[c for c, _ in COLUMNS], "top stalls (cycles per issued instruction)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        cells = [str(i), short_name(r.get("Kernel Name", "?")), r.get("Grid Size", "")]
        for name, _ in COLUMNS:
            v = number(r.get(cols[name] or "", ""))
            v = None if v is None else to_base(v, units.get(cols[name], ""))
            cells.append("" if v is None else f"{v * SCALE.get(name, 1):.4g}")
        ranked = sorted(((number(r.get(s, "")) or 0.0, STALL.match(s.split(".")[0]).group(1)) for s in stalls),
                        reverse=True)[:3]
        cells.append(", ".join(f"{why} {v:.2f}" for v, why in ranked if v > 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the report, the raw CSV and summary.md")
    ap.add_argument("--kernels", default=KERNELS, help=f"regex of the kernels to profile (default {KERNELS!r})")
    ap.add_argument("--from-csv", metavar="RAW", help="summarise a raw.csv this script wrote before (no GPU, no ncu)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the probe and its arguments")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.from_csv:
        with open(a.from_csv) as f:
            raw = f.read()
        header = next(csv.reader(io.StringIO(raw)))
        summarise(raw, *chosen_metrics({h.split(".")[0] for h in header}), a.out)
        return
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the probe to run after --")
    ncu = find_ncu()
    cols, stalls = chosen_metrics(available_bases(ncu))
    missing = [name for name, m in cols.items() if m is None]
    if missing:
        print("not on this GPU's ncu, left empty:", ", ".join(missing))
    metrics = [m for m in cols.values() if m] + stalls
    report = os.path.join(a.out, "report")
    run = [ncu, "--clock-control", "none", "--metrics", ",".join(metrics), "-k", f"regex:{a.kernels}",
           "-f", "-o", report, *cmd]
    print(" ".join(run), flush=True)
    probe = subprocess.run(run, capture_output=True, text=True)
    with open(os.path.join(a.out, "probe_output.txt"), "w") as f:
        f.write(probe.stdout + probe.stderr)
    if probe.returncode != 0:
        print(probe.stdout[-3000:] + probe.stderr[-3000:])
        sys.exit(f"ncu or the probe failed (exit {probe.returncode}); its output is in {a.out}/probe_output.txt")
    raw = subprocess.run([ncu, "--import", report + ".ncu-rep", "--csv", "--page", "raw"], capture_output=True,
                         text=True, check=True).stdout
    with open(os.path.join(a.out, "raw.csv"), "w") as f:
        f.write(raw)
    summarise(raw, cols, stalls, a.out)


def summarise(raw, cols, stalls, out):
    """summary.md (and stdout) from ncu's raw CSV: its first line the metric names, its second their
    units, then a line a launch."""
    records = list(csv.DictReader(io.StringIO(raw)))
    units = records[0] if records and number(records[0].get("ID", "")) is None else {}
    rows = [r for r in records if number(r.get("ID", "")) is not None]
    md = table(rows, cols, stalls, units)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
