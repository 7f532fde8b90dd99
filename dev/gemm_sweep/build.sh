#!/usr/bin/env bash
# Builds the GEMM sweep probe for sm_90a. Usage: dev/gemm_sweep/build.sh <cutlass include dir> [out]
# (the include dir is the one CMake unpacks from the pinned CUTLASS wheel, e.g.
# build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include)
set -euo pipefail
inc=$1
out=${2:-build-probe/gemm_sweep}
mkdir -p "$(dirname "$out")"
nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -I"$inc" \
  "$(dirname "$0")/probe.cu" -o "$out" -lcublasLt
