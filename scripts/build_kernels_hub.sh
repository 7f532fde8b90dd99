#!/usr/bin/env bash
# Builds fusedce as a Kernels Hub kernel repository with the project's CMake build: build.toml
# and build/<variant>/ (metadata.json, the Hub API of torch-ext/fusedce, the front end and the
# extension library), loadable with kernels.get_local_kernel(OUT) and ready to upload.
#   scripts/build_kernels_hub.sh [--cuda] [OUT]     (OUT: build-hub/kernel)
# The variant is compiled against the torch of $FUSEDCE_PYTHON (else .venv/bin/python, else
# python3) and named for it (torch version, C++ ABI, CPU, or CUDA version of that torch); the
# CPU variant by default, with --cuda the CUDA variant (nvcc; CUDA_ARCHS, default "80-real;90":
# sm_80 and sm_90 machine code and sm_90 PTX). Variants built into one OUT sit side by side.
# Build trees: build-hub-cpu/ and build-hub-cuda/ (kept: a rebuild compiles what changed).
set -euo pipefail
cd "$(dirname "$0")/.."
backend=cpu
if [ "${1:-}" = "--cuda" ]; then backend=cuda; shift; fi
out=$(realpath -m "${1:-build-hub/kernel}")
python=${FUSEDCE_PYTHON:-python3}
[ -z "${FUSEDCE_PYTHON:-}" ] && [ -x .venv/bin/python ] && python=.venv/bin/python
python=$(command -v "$python")
export PATH="$(dirname "$python"):$PATH"  # ninja, when it came with the environment's packages
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
build=build-hub-$backend
cuda_args=(-DFUSEDCE_CUDA=OFF)
if [ "$backend" = cuda ]; then
  command -v nvcc > /dev/null || [ ! -x /usr/local/cuda/bin/nvcc ] || export PATH=/usr/local/cuda/bin:$PATH
  cuda_args=(-DFUSEDCE_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-80-real;90}")
fi
mkdir -p "$build"
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_TORCH=ON \
  -DFUSEDCE_KERNELS_HUB=ON -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF "${cuda_args[@]}" \
  -DPython_EXECUTABLE="$python" -DCMAKE_INSTALL_PREFIX="$out" > "$build/configure.log" 2>&1 \
  || { tail -30 "$build/configure.log"; exit 1; }
grep -E "Kernels Hub variant" "$build/configure.log" | sed 's/^-- //'
cmake --build "$build" -j "$jobs" --target fusedce_torch
cmake --install "$build" --component kernels_hub > /dev/null
echo "kernel repository: $out"
find "$out" -name metadata.json | sed "s|^$out/||"
