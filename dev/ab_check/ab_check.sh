#!/usr/bin/env bash
# Same-run A/B on the GPU machine for a change that must keep the cross-entropy kernels' speed:
# builds a reference tree and this one (sm_90), runs this tree's CUDA gtests, then the logits
# cross-entropy benchmark (fusedce_bench) of the reference and of this tree in turn, ROUNDS times
# each (ref, this, ref, this, ...), and prints each shape and job's median over the rounds with
# the change; a job more than 2% slower is flagged and fails the run. STEPS=bits: the same calls
# through the public API built against both trees (dev/ab_check/ab_bits.cpp), every result compared bit
# for bit (a change that only moves code must leave them all).
#
# Here (no GPU), the reference's sources, e.g. main before the change:
#   rm -rf build-ref-src && mkdir build-ref-src && git archive REF | tar -x -C build-ref-src
# On the GPU machine (carry build-ref-src, and .deps where GoogleTest is not installed; the
# builds stay in build-ab/ between calls of a warm machine), in three calls of under 10 minutes:
#   STEPS=tests bash dev/ab_check/ab_check.sh      (builds this tree; its CUDA tests)
#   STEPS=bits bash dev/ab_check/ab_check.sh       (builds the reference; the same bits?)
#   STEPS=bench bash dev/ab_check/ab_check.sh      (the benchmarks)
# or, with everything built here (dev/ab_check/pack_ab.sh), in one call without compiling:
#   PREBUILT=build-pack/ab.txz bash dev/ab_check/ab_check.sh       (carry build-pack)
# Env: REF_DIR (build-ref-src), ROUNDS (2), BENCH_ARGS (to both benchmarks, e.g. --quick or
# --shapes ...), GTEST_FILTER ('*cuda*:*Cuda*'), TEST_TIMEOUT (seconds a test shard, 300),
# STEPS ("tests bits bench"), OUT (build-ab/out), AB_CUTLASS (OFF: the CUTLASS headers are fetched at
# configure time, which the GPU machine cannot; the logits kernels do not use them).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-build-ab/out}
ref=${REF_DIR:-build-ref-src}
rounds=${ROUNDS:-2}
mkdir -p "$out"
status=0
step() { echo "== $*  ($(date +%T))"; }
want() { [[ " ${STEPS:-tests bits bench} " == *" $1 "* ]]; }
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DFUSEDCE_GTEST_SOURCE_DIR="$PWD/.deps/googletest")

build() {  # build SRC DIR TARGETS...
  local src=$1 dir=$2
  shift 2
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TESTS=ON \
    -DFUSEDCE_BENCH=ON -DFUSEDCE_EXAMPLES=OFF -DCMAKE_CUDA_ARCHITECTURES=90 -DFUSEDCE_CUTLASS="${AB_CUTLASS:-OFF}" \
    "${gtest_arg[@]}" > "$out/configure_$(basename "$dir").log" 2>&1 &&
    cmake --build "$dir" -j "$(nproc)" --target "$@" > "$out/build_$(basename "$dir").log" 2>&1
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
if [ -n "${PREBUILT:-}" ]; then
  step "prebuilt binaries: $PREBUILT (dev/ab_check/pack_ab.sh)"
  mkdir -p build-ab && tar -C build-ab -xf "$PREBUILT" || exit 1
else
  step "build (sm_90): this tree, and the reference in $ref"
  build . build-ab/this fusedce_bench fusedce_tests fusedce_grid_tests fusedce_cuda_tests ||
    { grep -E "error" "$out/build_this.log" | head -20; exit 1; }
  if want bench || want bits; then
    [ -f "$ref/CMakeLists.txt" ] || { echo "ab_check: no reference sources in $ref (see the head of this script)"; exit 1; }
    build "$ref" build-ab/ref-build fusedce_bench || { grep -E "error" "$out/build_ref-build.log" | head -20; exit 1; }
  fi
fi

if want tests; then
  step "CUDA gtests of this tree (4 shards each, filter ${GTEST_FILTER:-*cuda*:*Cuda*})"
  pids=() names=()
  for t in build-ab/this/tests/cpp/fusedce_{tests,grid_tests,cuda_tests}; do
    for i in 0 1 2 3; do
      # Line-buffered, so that a shard stopped by the timeout still shows the test it was in.
      GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout -k 5 "${TEST_TIMEOUT:-300}" stdbuf -oL -eL "$t" \
        --gtest_filter="${GTEST_FILTER:-*cuda*:*Cuda*}" > "$out/gtest_$(basename "$t")_$i.log" 2>&1 &
      pids+=($!) names+=("$(basename "$t")_$i")
    done
  done
  for k in "${!pids[@]}"; do
    rc=0
    wait "${pids[$k]}" || rc=$?
    [ $rc -eq 0 ] && continue
    status=1
    log="$out/gtest_${names[$k]}.log"
    echo "shard ${names[$k]}: exit $rc$([ $rc -ge 124 ] && echo " (timed out after ${TEST_TIMEOUT:-300} s)");" \
      "last test started: $(grep -E '^\[ RUN' "$log" | tail -1 | sed 's/^\[ RUN *\] //')"
  done
  grep -hE "^\[ +OK \] .*\(([0-9]{5,}) ms\)" "$out"/gtest_*_[0-3].log | sort -t'(' -k2 -rn | head -8 |
    sed 's/^/slowest: /'
  cat "$out"/gtest_*_[0-3].log > "$out/gtest.log" && rm -f "$out"/gtest_*_[0-3].log
  grep -hE "^\[  (PASSED|FAILED)  \]|tests? ran" "$out/gtest.log" | sort | uniq -c
  grep -hE "^\[  FAILED  \].*\(" "$out/gtest.log" | head -30
fi

if want bits; then
  step "bit-for-bit A/B: dev/ab_check/ab_bits.cpp against the reference's library and this tree's"
  for side in ref this; do
    if [ -x "build-ab/bin/ab_bits_$side" ]; then  # prebuilt
      timeout -k 5 "${BITS_TIMEOUT:-400}" "build-ab/bin/ab_bits_$side" > "$out/bits_$side.txt" || status=1
      continue
    fi
    dir=build-ab/this inc=.
    [ $side = ref ] && dir=build-ab/ref-build inc=$ref
    # Linked as that tree links fusedce_bench (its CUDA runtime, cuBLASLt, and the CPU BLAS it found).
    link=$(ninja -C "$dir" -t commands bench/fusedce_bench | grep -E -- "-o bench/fusedce_bench( |$)" | tail -1 |
      sed -E 's/.*-o bench\/fusedce_bench //; s/ && :.*//; s# libfusedce\.a # '"$dir"'/libfusedce.a #')
    { nvcc -std=c++17 -O2 -I"$inc/include" -c dev/ab_check/ab_bits.cpp -o "$out/ab_bits_$side.o" &&
      c++ "$out/ab_bits_$side.o" -o "$out/ab_bits_$side" $link; } > "$out/ab_bits_build_$side.log" 2>&1 ||
      { tail -5 "$out/ab_bits_build_$side.log"; exit 1; }
    timeout -k 5 "${BITS_TIMEOUT:-400}" "$out/ab_bits_$side" > "$out/bits_$side.txt" || status=1
  done
  if diff "$out/bits_ref.txt" "$out/bits_this.txt" > "$out/bits.diff"; then
    echo "bits: $(grep -c . "$out/bits_this.txt") calls, every output the same bits as the reference"
  else
    status=1
    echo "bits: $(grep -c '^>' "$out/bits.diff") of $(grep -c . "$out/bits_this.txt") calls differ from the reference:"
    grep '^>' "$out/bits.diff" | head -20
  fi
fi

if want bench; then
  step "fusedce_bench: reference and this tree in turn, $rounds rounds"
  for r in $(seq 1 "$rounds"); do
    for side in ref this; do
      bin=build-ab/this/bench/fusedce_bench
      [ $side = ref ] && bin=build-ab/ref-build/bench/fusedce_bench
      timeout -k 5 "${BENCH_TIMEOUT:-240}" "$bin" ${BENCH_ARGS:-} --csv "$out/bench_${side}_$r.csv" > "$out/bench_${side}_$r.md" ||
        status=1
      echo "-- $side round $r: $(grep -c . "$out/bench_${side}_$r.csv") csv lines"
    done
  done
  python3 - "$out" "$rounds" <<'EOF' | tee "$out/ab.md" || status=1
import csv, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(side):
    t = {}
    for r in range(1, rounds + 1):
        for row in csv.DictReader(open(f"{out}/bench_{side}_{r}.csv")):
            t.setdefault((int(row["N"]), int(row["V"]), row["dtype"], row["job"]), []).append(float(row["median_ms"]))
    return {k: statistics.median(v) for k, v in t.items()}
ref, this = load("ref"), load("this")
worst = 0.0
print("| N x V | dtype | job | ref ms | this ms | change |")
print("|---|---|---|---|---|---|")
for k in sorted(ref):
    if k not in this:
        continue
    change = this[k] / ref[k] - 1.0
    worst = max(worst, change)
    flag = "  SLOWER" if change > 0.02 else ""
    print(f"| {k[0]} x {k[1]} | {k[2]} | {k[3]} | {ref[k]:.4f} | {this[k]:.4f} | {100 * change:+.1f}%{flag} |")
print(f"\nworst change {100 * worst:+.1f}% (limit +2%)")
sys.exit(1 if worst > 0.02 else 0)
EOF
fi
exit $status
