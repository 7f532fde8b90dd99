#!/usr/bin/env bash
# Builds the scaled-exp epilogue probe for sm_90a. Usage: dev/scaled_exp/build.sh <cutlass include dir> [out]
# (the include dir is the one CMake unpacks from the pinned CUTLASS wheel, e.g.
# build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include)
set -euo pipefail
inc=$1
out=${2:-build-probe/scaled_exp}
mkdir -p "$(dirname "$out")"
nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -Xptxas -v -lineinfo -I"$inc" \
  "$(dirname "$0")/probe.cu" -o "$out" -lcublasLt 2>&1 | grep -E "error|spill|Used [0-9]+ registers|warning" | grep -v "^$" | head -40
