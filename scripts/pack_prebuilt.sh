#!/usr/bin/env bash
# Builds the CUDA tests and the benchmark here (no GPU needed; sm_90, with -lineinfo for ncu's
# source page) and packs them into build-pack/bins.txz for a device call that spends no time
# compiling:
#   bash scripts/pack_prebuilt.sh            (about 3-5 minutes on 2 cores from scratch, plus 2 to pack)
#   device: GPU_CHECK_COMMIT=<sha> PREBUILT=build-pack/bins.txz bash scripts/gpu_check.sh
#           (carry build-pack and .deps: every CUDA gtest, the sanitizer and the Python CUDA tests,
#           about 8 minutes, writing the record bench/h200/gpu_check.txt; STEPS="tests sanitizer
#           bench" for the benchmark too, STEPS=stalls for the stream kernel's stall samples)
# Both build-sm90/ and build-pack/ are ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-sm90}
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DFUSEDCE_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TESTS=ON \
  -DFUSEDCE_BENCH=ON -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-lineinfo "${gtest_arg[@]}" > /dev/null
cmake --build "$build" -j "$(nproc)" --target fusedce_cuda_tests fusedce_grid_tests fusedce_long_tests fusedce_tests fusedce_bench fusedce_linear_bench
mkdir -p build-pack
bins=(tests/cpp/fusedce_cuda_tests tests/cpp/fusedce_grid_tests tests/cpp/fusedce_long_tests tests/cpp/fusedce_tests bench/fusedce_bench bench/fusedce_linear_bench)
# Every binary links the whole static library (about 50 MB each), so gzip's 32 KiB window leaves
# 85 MB, over the 64 MiB a device call carries; xz with a dictionary larger than one binary
# stores the library once (about 9 MB).
tar -C "$build" -cf - "${bins[@]}" | xz -9 -T1 --lzma2=dict=192MiB > build-pack/bins.txz
ls -la build-pack/bins.txz
