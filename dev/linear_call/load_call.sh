#!/usr/bin/env bash
# Device call: dev/linear_call/under_load.py at the given shapes (the torch extension built first
# when the machine is fresh; CUTLASS on: carry .deps).
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
if ! ls build-gpu-torch/torch/*.so > /dev/null 2>&1; then
  cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFUSEDCE_CUTLASS_WHEEL="$PWD/.deps/nvidia_cutlass-4.2.0.0-py3-none-any.whl" \
    -DPython_EXECUTABLE="$(command -v python3)" > "$out/torch_build.log" 2>&1 && cmake --build build-gpu-torch -j 16 >> "$out/torch_build.log" 2>&1 \
    || { tail -20 "$out/torch_build.log"; exit 1; }
fi
for shape in ${SHAPES:-"16384 2304 256000"}; do
  FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 200 python3 dev/linear_call/under_load.py $shape ${ITERS:-30} 2>&1
done
rm -f "$out/torch_build.log"
