"""Per-kernel time of one `fusedce_linear_bench --profile N H V` run, from ncu's CSV.

Usage: ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
           build/bench/fusedce_linear_bench --profile 8192 4096 128256 > prof.csv
       python3 bench/ncu_summary.py prof.csv

The profile mode runs the three bare products of the floor once, then one fused call per mode
(default, low_memory); each fused call starts with linear_prepare_kernel. Prints, per part, the
kernels grouped by name (cuBLAS kernels as "gemm: <name>") with count and total microseconds.
"""
import csv
import sys
from collections import OrderedDict


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own log lines first
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            unit = r.get("Metric Unit", "nsecond")
            v = float(r["Metric Value"].replace(",", ""))
            scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
            yield r["Kernel Name"], v * scale


def short(name):
    name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    if name.startswith("void "):
        name = name[5:]
    base = name.split("(")[0].split("<")[0].strip()
    if "gemm" in name.lower() or "cutlass" in name.lower() or "sm90" in name.lower():
        return "gemm: " + base[:60]
    return base.split("::")[-1][:70]


def main(path):
    parts, current = [], None
    for name, us in rows(path):
        if "linear_prepare_kernel" in name or current is None:
            current = ("floor (bare products)" if current is None else f"fused call {len(parts)}", OrderedDict())
            parts.append(current)
        k = short(name)
        n, t = current[1].get(k, (0, 0.0))
        current[1][k] = (n + 1, t + us)
    for title, kernels in parts:
        total = sum(t for _, t in kernels.values())
        print(f"\n## {title}: {total / 1000:.2f} ms of kernel time\n")
        print("| kernel | launches | total us | share |")
        print("|---|---|---|---|")
        for k, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
            print(f"| {k} | {n} | {t:.0f} | {100 * t / total:.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
