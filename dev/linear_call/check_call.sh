#!/usr/bin/env bash
# Device call: the C++ floor table (fusedce_linear_bench --csv, prebuilt: build-pack/bins.txz) and
# the front end's linear tests on the GPU (the torch extension built as peers.sh builds it,
# incrementally over build-gpu-torch; carry .deps and .whl).
set -u
out=${OUT:-gpu_out}
mkdir -p "$out" build-gpu
tar -C build-gpu -xJf build-pack/bins.txz || exit 1
echo "==== linear bench --csv"
timeout 200 build-gpu/bench/fusedce_linear_bench --csv "$out/linear_bench.csv" > "$out/linear_bench.md" 2>&1; echo "rc $?"
grep -E "^\| [0-9]" "$out/linear_bench.md"
echo "==== pytest test_linear.py (CUDA)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
  -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DFUSEDCE_CUTLASS_WHEEL="$PWD/.deps/nvidia_cutlass-4.2.0.0-py3-none-any.whl" \
  -DPython_EXECUTABLE="$(command -v python3)" > "$out/torch_build.log" 2>&1 && cmake --build build-gpu-torch -j 16 >> "$out/torch_build.log" 2>&1 \
  || { tail -20 "$out/torch_build.log"; exit 1; }
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python:/tmp/site timeout ${PYTEST_TIMEOUT:-200} \
  python3 -m pytest tests/python/test_linear.py -q -x -k cuda 2>&1 | tail -5
