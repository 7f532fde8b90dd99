#!/usr/bin/env bash
# Device call: the one benchmark run issue-style of the linear path at its five shapes: the floor
# (three bare cuBLAS products), fusedce (default, skip_ignored, low_memory, every option),
# torch.compile and Liger-Kernel (carried as a wheel in .whl), one process, bf16. The torch
# extension is built first, incrementally over what build-gpu-torch holds (CUTLASS on: carry .deps).
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
{
  cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFUSEDCE_CUTLASS_WHEEL="$PWD/.deps/nvidia_cutlass-4.2.0.0-py3-none-any.whl" \
    -DPython_EXECUTABLE="$(command -v python3)" > "$out/torch_build.log" 2>&1 && cmake --build build-gpu-torch -j 16 >> "$out/torch_build.log" 2>&1 \
    || { tail -20 "$out/torch_build.log"; exit 1; }
}
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python:/tmp/site \
  timeout ${BENCH_TIMEOUT:-560} python3 -m fusedce.bench --device cuda --only linear --no-progress \
  --shapes ${SHAPES:-4096x4096x128256,8192x4096x128256,8192x4096x151936,16384x2304x256000,32768x4096x128256} \
  --peers fusedce,fusedce-skip,fusedce-lowmem,fusedce-all,torch-compile,liger,floor \
  --repeat ${REPEAT:-10} --warmup 2 --out "$out/linear_peers" 2>&1 | tail -40
rm -f "$out/torch_build.log"
