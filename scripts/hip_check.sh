#!/usr/bin/env bash
# CI step for AMD GPUs: the GPU backend (src/cuda, compiled as HIP through src/cuda/port.h) builds
# for gfx90a with Debian's ROCm packages, and a program links against the library. Compile and
# link only: no AMD GPU is here, so nothing runs. Exits non-zero on any failure.
# Usage: scripts/hip_check.sh [build-dir]   (default build-hip; FUSEDCE_HIP_CMAKE_ARGS adds
# configure arguments, e.g. -DCMAKE_HIP_ARCHITECTURES="gfx90a;gfx942")
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-hip}
jobs=$(nproc 2>/dev/null || echo 2)
start=$(date +%s)

# Debian bookworm's ROCm 5.2.3: hipcc (pulls clang-15, lld-15), the HIP runtime and its CMake
# packages (libamdhip64-dev, with amd_comgr and hsa-runtime), the device bitcode libraries.
need=()
for pkg in cmake g++ hipcc libamdhip64-dev rocm-device-libs; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "hip_check: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

cmake -S . -B "$build" -DFUSEDCE_HIP=ON -DFUSEDCE_CUDA=OFF -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=ON \
  -DCMAKE_BUILD_TYPE=Release ${FUSEDCE_HIP_CMAKE_ARGS:-}
# The library (CPU backend + the GPU kernels for cross-entropy over logits) and the example
# program, which links it: unresolved HIP runtime symbols fail here.
cmake --build "$build" -j "$jobs" --target fusedce fusedce_example

# The kernels really are in it, as AMD GPU code objects (gfx90a by default), not a host-only build.
lib="$build/libfusedce.a"
targets=$(grep -ao "amdgcn-amd-amdhsa--gfx[0-9a-z]*" "$lib" | sort -u | sed 's/.*--//' | tr '\n' ' ')
[ -n "$targets" ] || { echo "hip_check: no AMD GPU code object in $lib" >&2; exit 1; }
[ -n "${FUSEDCE_HIP_CMAKE_ARGS:-}" ] || [[ " $targets" == *" gfx90a "* ]] ||
  { echo "hip_check: no gfx90a code object in $lib (found: $targets)" >&2; exit 1; }
symbols=$(nm -C "$lib")
for kernel in ce_row_kernel ce_rescale_kernel ce_prepare_kernel ce_finalize_kernel; do
  grep -q "$kernel" <<<"$symbols" || { echo "hip_check: $kernel missing from $lib" >&2; exit 1; }
done
echo "hip_check: OK, HIP build for ${targets}compiled and linked ($(( $(date +%s) - start )) s, installs included)"
