#!/usr/bin/env bash
# The log-probabilities on the GPU machine, in one call: the torch extension built for sm_90, the
# CUDA cases of tests/python/test_logprobs.py and of the GRPO example's test, then the benchmark
# rows of fusedce.linear_logprobs beside torch's materialised path (eager and torch.compile).
# STEPS picks steps (default "build python bench"; "cpp" adds the C++ suite's CUDA cases, which
# needs a second build of the core with tests). Logs and the benchmark table go to $OUT (or
# ./gpu_out). BENCH_ARGS goes to `python -m fusedce.bench` (default: its logprobs rows).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
status=0
step() { echo "== $*  ($(date +%T))"; }
want() { [[ " ${STEPS:-build python bench} " == *" $1 "* ]]; }
py=$(command -v python3)

if want build; then
  step "torch extension (build-gpu-torch)"
  cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DCMAKE_CUDA_ARCHITECTURES=90 -DPython_EXECUTABLE="$py" \
    > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
  cmake --build build-gpu-torch -j 16 > "$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -30; exit 1; }
fi

if want python; then
  step "pytest -k cuda: test_logprobs.py, test_grpo_example.py"
  FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python "$py" -m pytest tests/python/test_logprobs.py \
    tests/python/test_grpo_example.py -k cuda -q -rs 2>&1 | tee "$out/pytest.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want cpp; then
  step "C++ tests, CUDA log-probabilities (build-gpu-lp)"
  gtest_arg=()
  [ -d .deps/googletest ] && gtest_arg=(-DFUSEDCE_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
  cmake -S . -B build-gpu-lp -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TESTS=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 "${gtest_arg[@]}" > "$out/configure_cpp.log" 2>&1 \
    && cmake --build build-gpu-lp -j 16 --target fusedce_tests > "$out/build_cpp.log" 2>&1 \
    && ./build-gpu-lp/tests/cpp/fusedce_tests --gtest_filter='*Logprobs*' 2>&1 | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want bench; then
  step "benchmark: log-probabilities"
  FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python "$py" -m fusedce.bench --device cuda --no-progress \
    ${BENCH_ARGS:---only logprobs --peers fusedce,fusedce-keep,torch,torch-compile} --out "$out/bench_logprobs" 2>&1 | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
