#!/usr/bin/env python3
"""Summarise ncu's per-SASS-instruction stall samples (stalls_sass.csv.gz of scripts/gpu_check.sh's step
`stalls`).

For one profiled launch (--block K: the K-th "Kernel Name" block of the CSV): stall reasons summed
over the kernel, and the instructions holding the most samples with their reasons and, around
them, the SASS they sit in (so a stall can be read against the loop it belongs to).
"""
import argparse
import csv
import gzip
import io


def blocks(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    parts = text.split('"Kernel Name",')[1:]
    for part in parts:
        name, _, body = part.partition("\n")
        rows = list(csv.DictReader(io.StringIO(body)))
        yield name.strip().strip(","), rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--context", type=int, default=0)
    a = ap.parse_args()
    allb = list(blocks(a.csv))
    name, rows = allb[a.block]
    print(f"{len(allb)} blocks; block {a.block}: {name} ({len(rows)} instructions)")
    stall_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    num = lambda r, c: float(r[c]) if r[c] not in ("", "-") else 0.0
    total = {c: sum(num(r, c) for r in rows) for c in stall_cols}
    samples = sum(num(r, "Warp Stall Sampling (All Samples)") for r in rows)
    print(f"samples {samples:.0f}")
    for c, v in sorted(total.items(), key=lambda kv: -kv[1]):
        if v:
            print(f"  {c:24s} {v:10.0f} {100 * v / samples:5.1f}%")
    order = sorted(range(len(rows)), key=lambda i: -num(rows[i], "Warp Stall Sampling (All Samples)"))
    print(f"\ntop {a.top} instructions (index, samples, executed, reasons >10%):")
    for i in sorted(order[: a.top]):
        r = rows[i]
        s = num(r, "Warp Stall Sampling (All Samples)")
        why = ", ".join(f"{c[6:]} {num(r, c):.0f}" for c in stall_cols if num(r, c) > 0.1 * s)
        print(f"{i:5d} {s:7.0f} {num(r, 'Instructions Executed'):10.0f}  {r['Source'].strip():60s} {why}")


if __name__ == "__main__":
    main()
