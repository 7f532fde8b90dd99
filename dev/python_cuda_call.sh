#!/usr/bin/env bash
# One device call: the torch extension (sm_90, no CUTLASS) and the CUDA cases of the Python suite,
# bounded by PYTEST_TIMEOUT; the slowest and failing tests printed.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
  -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DPython_EXECUTABLE="$(command -v python3)" > "$out/torch_build.log" 2>&1 &&
  cmake --build build-gpu-torch -j 16 >> "$out/torch_build.log" 2>&1 || { tail -20 "$out/torch_build.log"; exit 1; }
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest ${PYTEST_PATHS:-tests/python} \
  -k "${PYTEST_K:-cuda}" -q -p no:cacheprovider --durations=5 --maxfail=5 ${PYTEST_ARGS:-} > "$out/pytest.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|error" "$out/pytest.log" | tail -3; grep -E "^FAILED|^ERROR|Error" "$out/pytest.log" | head -20
sed -n '/slowest/,/^$/p' "$out/pytest.log" | head -8
