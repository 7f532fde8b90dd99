#!/usr/bin/env bash
# Device call: the linear tables of bench/RESULTS.md from one machine: fusedce_linear_bench --csv
# (prebuilt: build-pack/bins.txz), the five-shape run of peers.sh, the cross-entropy options table
# (fusedce_bench --options, the per-option cost of the pass the all-options linear call pays) and
# under_load.py at 4096 x 4096 x 128256.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out" build-gpu
tar -C build-gpu -xJf build-pack/bins.txz || exit 1
echo "==== linear bench --csv"
timeout 200 build-gpu/bench/fusedce_linear_bench --csv "$out/linear_bench.csv" > "$out/linear_bench.md" 2>&1; echo "rc $?"
grep -E "^\| [0-9]" "$out/linear_bench.md"
echo "==== ce options"
timeout 90 build-gpu/bench/fusedce_bench --options > "$out/ce_options.md" 2>&1; echo "rc $?"; grep -E "128256|options|\| " "$out/ce_options.md" | head -40
echo "==== peers"
REPEAT=30 BENCH_TIMEOUT=330 OUT=$out bash dev/linear_call/peers.sh | tail -12
echo "==== under load 4096 x 4096 x 128256"
SHAPES=4096x4096x128256 OUT=$out bash dev/linear_call/load_call.sh | grep -v "^ [0-9][0-9]:" | head -70
