#!/usr/bin/env bash
# Where the one-group options fwd+grad stream kernel (ce_stream_kernel<bf16, grad, options, 1>)
# loses time against the reference build: ncu's warp-state and per-SASS stall samples of one
# launch of it (fusedce_bench --options, 8192 x 128256, label smoothing 0.1) in each build, then
# the --options table of both builds, alternating. Takes build-pack/ab.txz (scripts/pack_ab.sh,
# both benchmarks built with -lineinfo); writes to $OUT.
set -uo pipefail
out=${OUT:-ab_out}
mkdir -p "$out" /tmp/ab
tar -xJf build-pack/ab.txz -C /tmp/ab
kernel='regex:ce_stream_kernelI13__nv_bfloat16Lb1ELi1ELi1E'
for side in ref this; do
  bin=/tmp/ab/$([ $side = ref ] && echo ref-build || echo this)/bench/fusedce_bench
  # Launches of that instance: label smoothing's 3 warm-ups, then timed ones; the 4th is read.
  ncu --clock-control none --kernel-name-base mangled -k "$kernel" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats \
    --section Occupancy --import-source yes -f -o /tmp/ab/$side "$bin" --options > /tmp/ab/${side}_ncu.log 2>&1 ||
    tail -5 /tmp/ab/${side}_ncu.log
  ncu -i /tmp/ab/$side.ncu-rep --page details > "$out/${side}_details.txt" 2>&1
  ncu -i /tmp/ab/$side.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > "$out/${side}_sass.csv.gz"
done
for r in 1 2; do
  for side in ref this; do
    bin=/tmp/ab/$([ $side = ref ] && echo ref-build || echo this)/bench/fusedce_bench
    echo "== $side round $r" >> "$out/options.txt"
    "$bin" --options >> "$out/options.txt" 2>&1
  done
done
grep -E "Duration|Warp Cycles Per Issued|Issued Ipc|Registers|Executed Ipc" "$out"/{ref,this}_details.txt
grep -E "^==|8192 x 128256 \| (plain|label|metrics|class|softcap)" "$out/options.txt"
