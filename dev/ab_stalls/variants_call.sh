#!/usr/bin/env bash
# Same-run A/B of gradient-sweep variants of the stream kernel: the --options table (ROUNDS
# rounds, each binary in turn) and the main table (MAIN_ROUNDS rounds) of the reference build,
# this tree's build and each variant benchmark packed in build-pack/var.txz. Writes $OUT.
set -uo pipefail
out=${OUT:-ab_out}
mkdir -p "$out" /tmp/ab /tmp/var
tar -xJf build-pack/ab.txz -C /tmp/ab
tar -xJf build-pack/var.txz -C /tmp/var
declare -A bin=([ref]=/tmp/ab/ref-build/bench/fusedce_bench [main]=/tmp/ab/this/bench/fusedce_bench)
for f in /tmp/var/*; do bin[$(basename "$f" | sed 's/^bench_//')]=$f; done
names="ref main ${!bin[*]}"
names=$(echo $names | tr ' ' '\n' | awk '!seen[$0]++' | tr '\n' ' ')
for r in $(seq 1 ${ROUNDS:-3}); do
  for n in $names; do echo "== $n round $r" >> "$out/options.txt"; "${bin[$n]}" --options >> "$out/options.txt" 2>&1; done
done
for r in $(seq 1 ${MAIN_ROUNDS:-2}); do
  for n in $names; do echo "== $n round $r" >> "$out/main.txt"; "${bin[$n]}" >> "$out/main.txt" 2>&1; done
done
python3 - "$out" <<'PY'
import re, sys, statistics as st, collections
out = sys.argv[1]
for fname, col in (("options.txt", 5), ("main.txt", None)):
    runs = collections.defaultdict(lambda: collections.defaultdict(list)); name = None
    for line in open(f"{out}/{fname}"):
        m = re.match(r"== (\S+) round", line)
        if m: name = m.group(1); continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.match(r"\d+ x \d+", cells[0]): continue
        if fname == "options.txt":
            runs[(cells[0], cells[1], "fwd")][name].append(float(cells[2])); runs[(cells[0], cells[1], "grad")][name].append(float(cells[4]))
        else:
            nums = [c for c in cells[1:] if re.match(r"^[\d.]+$", c)]
            if nums: runs[(cells[0], cells[1], cells[2] if len(cells) > 2 else "")][name].append(float(nums[0]))
    print("##", fname)
    for key, by in runs.items():
        ref = st.median(by["ref"]) if by.get("ref") else None
        if not ref: continue
        print(" | ".join(key), " ".join(f"{n}={st.median(v)/ref:.3f}" for n, v in by.items() if n != "ref"), f"(ref {ref:.4f})")
PY
