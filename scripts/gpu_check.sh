#!/usr/bin/env bash
# Everything the GPU must show, in one run on the GPU machine: build (sm_90 + sm_80), every C++
# test on the GPU, compute-sanitizer (memcheck, racecheck) on a small sweep, the benchmarks.
# Logs go to $OUT (or ./gpu_out). GoogleTest comes from .deps/googletest when it is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
build=build-gpu
status=0
step() { echo "== $*"; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
nvcc --version | tail -2

step "build"
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DFUSEDCE_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TESTS=ON \
  -DFUSEDCE_BENCH=ON "-DCMAKE_CUDA_ARCHITECTURES=80-real;90" "${gtest_arg[@]}" > "$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" -j 16 > "$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -30; exit 1; }
grep -E "spill" "$out/build.log" | sort | uniq -c | head -20

step "tests (ctest, GPU present)"
ctest --test-dir "$build" -j 4 --timeout 900 > "$out/ctest.log" 2>&1 || status=1
tail -25 "$out/ctest.log"

step "compute-sanitizer on a small sweep"
tests_bin=$(find "$build/tests/cpp" -maxdepth 1 -type f -name 'fusedce_tests*' -perm -u+x | head -1)
filter=${SANITIZER_FILTER:-'*Cuda*Small*:*Cuda*Odd*:*Cuda*Stride*'}
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 "$tests_bin" --gtest_filter="$filter" \
    > "$out/sanitizer_$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$out/sanitizer_$tool.log" | tail -3 | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
done

step "benchmark"
"$build/bench/fusedce_bench" ${BENCH_ARGS:-} --csv "$out/bench.csv" | tee "$out/bench.md" || status=1
exit $status
