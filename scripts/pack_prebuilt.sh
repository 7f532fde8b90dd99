#!/usr/bin/env bash
# Builds the CUDA tests and the benchmark here (no GPU needed; sm_90, with -lineinfo for ncu's
# source page) and packs them into build-pack/bins.txz for a device call that spends no time
# compiling:
#   bash scripts/pack_prebuilt.sh            (about 3-5 minutes on 2 cores from scratch, plus 2 to pack)
#   device: GPU_CHECK_COMMIT=<sha> PREBUILT=build-pack/bins.txz bash scripts/gpu_check.sh
#           (carry build-pack and .deps: every CUDA gtest, the sanitizer and the Python CUDA tests,
#           about 8 minutes, writing the record bench/h200/gpu_check.txt; STEPS="tests sanitizer
#           bench" for the benchmark too, STEPS=stalls for the stream kernel's stall samples)
# With DEVICE_TORCH=<version> (the GPU machine's torch, e.g. 2.11.0) it also builds the torch
# extension against that torch and packs it into build-pack/torch.txz, gpu_check.sh's
# TORCH_PREBUILT and the benchmarks' build (tar -C build-gpu-torch -xf build-pack/torch.txz, then
# PYTHONPATH=$(python3 tests/python/build_tree.py build-gpu-torch)): that torch's wheel comes from
# the package index without its dependencies into build-torch-venv/, imported with the CUDA
# libraries of .venv's torch (the extension is compiled against torch's headers and linked against
# its libraries; nothing of it runs here). The extension shares the build directory's objects.
# Both build-sm90/ and build-pack/ are ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-sm90}
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DFUSEDCE_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
torch_args=()
if [ -n "${DEVICE_TORCH:-}" ]; then
  venv=build-torch-venv
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$DEVICE_TORCH')" 2>/dev/null; then
    "$venv/bin/pip" install -q --no-deps "torch==$DEVICE_TORCH"
    "$venv/bin/pip" install -q typing_extensions sympy filelock networkx jinja2 fsspec numpy
  fi
  # torch's CUDA libraries for `import torch` (the configure step asks it for its paths)
  LD_LIBRARY_PATH=$(ls -d "$PWD"/.venv/lib/python3*/site-packages/nvidia/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH
  # -U: the torch libraries found by an earlier configure (another interpreter) are looked up again
  torch_args=(-U "FUSEDCE_TORCH_*" -DFUSEDCE_TORCH=ON "-DPython_EXECUTABLE=$PWD/$venv/bin/python")
fi
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TESTS=ON \
  -DFUSEDCE_BENCH=ON -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-lineinfo "${gtest_arg[@]}" "${torch_args[@]}" > /dev/null
cmake --build "$build" -j "$(nproc)" --target fusedce_cuda_tests fusedce_grid_tests fusedce_long_tests fusedce_tests fusedce_bench fusedce_linear_bench
mkdir -p build-pack
bins=(tests/cpp/fusedce_cuda_tests tests/cpp/fusedce_grid_tests tests/cpp/fusedce_long_tests tests/cpp/fusedce_tests bench/fusedce_bench bench/fusedce_linear_bench)
# Every binary links the whole static library (about 50 MB each), so gzip's 32 KiB window leaves
# 85 MB, over the 64 MiB a device call carries; xz with a dictionary larger than one binary
# stores the library once (about 9 MB).
tar -C "$build" -cf - "${bins[@]}" | xz -9 -T1 --lzma2=dict=192MiB > build-pack/bins.txz
ls -la build-pack/bins.txz
if [ -n "${DEVICE_TORCH:-}" ]; then
  cmake --build "$build" -j "$(nproc)" --target fusedce_torch
  tar -C "$build" -cf - torch/libfusedce_torch.so torch/_build_info.py | xz -6 -T2 > build-pack/torch.txz
  ls -la build-pack/torch.txz
fi
