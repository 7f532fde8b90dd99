#!/usr/bin/env python3
"""Per-kernel resources of compiled CUDA objects (cuobjdump -res-usage and -sass): registers,
stack, shared and local memory, and the SASS size in instructions; with two object sets, the
difference per kernel. For checking that a refactoring of a kernel leaves its code as it was.

Usage: kernel_resources.py OBJ_OR_DIR... [--against OBJ_OR_DIR...] [--filter REGEX]
A directory stands for the .o files under it. cuobjdump: $CUOBJDUMP, else the one on PATH or in
the CUDA toolkit's bin/. Exits 1 when --against is given and any kernel has more registers,
stack, local memory or SASS instructions than in the reference.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys


def cuobjdump():
    exe = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not exe and os.path.exists("/usr/local/cuda/bin/cuobjdump"):
        exe = "/usr/local/cuda/bin/cuobjdump"
    if not exe:
        sys.exit("kernel_resources: no cuobjdump (set CUOBJDUMP)")
    return exe


def objects(paths):
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, _, files in os.walk(p):
                out += [os.path.join(root, f) for f in files if f.endswith(".o")]
        else:
            out.append(p)
    return sorted(out)


def resources(paths, pattern):
    """{kernel: {REG, STACK, SHARED, LOCAL, SASS}} over the objects."""
    exe = cuobjdump()
    table = {}
    for obj in objects(paths):
        res = subprocess.run([exe, "-res-usage", obj], capture_output=True, text=True).stdout
        name = None
        for line in res.splitlines():
            m = re.match(r"\s*Function (\S+):", line)
            if m:
                name = m.group(1)
                continue
            if name and "REG:" in line:
                fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line))
                table[name] = {k: int(fields.get(k, 0)) for k in ("REG", "STACK", "SHARED", "LOCAL")}
                table[name]["SASS"] = 0
                name = None
        sass = subprocess.run([exe, "-sass", obj], capture_output=True, text=True).stdout
        name = None
        for line in sass.splitlines():
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                name = m.group(1)
                continue
            if name in table and re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
                table[name]["SASS"] += 1
    return {k: v for k, v in table.items() if re.search(pattern, k)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--against", nargs="+")
    ap.add_argument("--filter", default="")
    a = ap.parse_args()
    now = resources(a.paths, a.filter)
    ref = resources(a.against, a.filter) if a.against else None
    cols = ("REG", "STACK", "LOCAL", "SHARED", "SASS")
    worse = 0
    print("| kernel | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for k in sorted(now):
        cells = []
        for c in cols:
            v = now[k][c]
            if ref is not None and k in ref and ref[k][c] != v:
                cells.append(f"{ref[k][c]} -> {v}")
                if c != "SHARED" and v > ref[k][c]:
                    worse += 1
            else:
                cells.append(str(v))
        if ref is not None and k not in ref:
            cells[0] += " (new)"
        print(f"| {k} | " + " | ".join(cells) + " |")
    if ref is not None:
        for k in sorted(set(ref) - set(now)):
            print(f"| {k} | (gone) |")
        print(f"\n{len(now)} kernels; {worse} values worse than the reference")
        return 1 if worse else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
