#!/usr/bin/env bash
# Device call: the linear products on cuBLASLt's preferred candidates (src/cuda/linear/algo_choice.h):
# the CUDA linear gtests and the CPU-vs-CUDA agreement (prebuilt: build-pack/bins.txz), the
# C++ floor table (fusedce_linear_bench --csv), then the five-shape one-process run of peers.sh.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out" build-gpu
tar -C build-gpu -xJf build-pack/bins.txz || exit 1
echo "==== linear gtests"
timeout 240 build-gpu/tests/cpp/fusedce_tests --gtest_filter='*Linear*cuda*:*linear*cuda*:*Logprob*cuda*:*cuda*Linear*' --gtest_brief=1 > "$out/gtests.txt" 2>&1
echo "rc $?"; tail -4 "$out/gtests.txt"
timeout 120 build-gpu/tests/cpp/fusedce_cuda_tests --gtest_brief=1 > "$out/cuda_tests.txt" 2>&1
echo "rc $?"; tail -3 "$out/cuda_tests.txt"
echo "==== linear bench --csv"
timeout 200 build-gpu/bench/fusedce_linear_bench --csv "$out/linear_bench.csv" > "$out/linear_bench.md" 2>&1; echo "rc $?"
grep -E "^\| [0-9]" "$out/linear_bench.md"
[ "${SKIP_PEERS:-0}" = 1 ] && exit 0
echo "==== peers"
REPEAT=${REPEAT:-30} BENCH_TIMEOUT=${BENCH_TIMEOUT:-330} OUT=$out bash dev/linear_call/peers.sh | tail -14
