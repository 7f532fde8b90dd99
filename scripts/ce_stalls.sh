#!/usr/bin/env bash
# Where the stream kernel's warps wait: ncu's warp-state statistics and the per-SASS-instruction
# stall samples (source page) for the stream kernel launches of `fusedce_bench --profile`
# (64 x 262144, 16384 x 32000 and 8192 x 128256 forward, 8192 x 128256 fwd+grad, the soft-cap;
# each twice). Takes a prebuilt benchmark (build it with -lineinfo, e.g. locally with
# -DCMAKE_CUDA_FLAGS=-lineinfo -DCMAKE_CUDA_ARCHITECTURES=90, and carry it), so a call spends its
# device time on the profile alone. Output in $OUT: stalls_details.txt (sections per launch),
# stalls_sass.csv.gz (the source page, SASS, every profiled launch); bench/sass_stalls.py reads it.
set -uo pipefail
bin=${1:-build-sm90/bench/fusedce_bench}
out=${OUT:-gpu_out}
mkdir -p "$out"
# Launches 0-9 of the stream kernel: per case a warm-up, then the one to read (odd indices).
ncu --clock-control none -k regex:ce_stream_kernel --launch-skip ${SKIP:-1} --launch-count ${COUNT:-7} \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
  --import-source yes -f -o "$out/stalls" "$bin" --profile > "$out/stalls_run.log" 2>&1 || { tail -20 "$out/stalls_run.log"; exit 1; }
ncu -i "$out/stalls.ncu-rep" --page details > "$out/stalls_details.txt" 2>&1
ncu -i "$out/stalls.ncu-rep" --page source --csv --print-source sass 2> "$out/stalls_src.err" | gzip > "$out/stalls_sass.csv.gz"
ls -la "$out"
grep -E "ce_stream_kernel|Duration|DRAM Throughput|Warp Cycles Per Issued|Issued Warp|Stall|L2 Hit" "$out/stalls_details.txt" | head -80
rm -f "$out/stalls.ncu-rep"
