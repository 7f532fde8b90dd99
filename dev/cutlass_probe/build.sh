#!/usr/bin/env bash
# Builds the CUTLASS-vs-cuBLASLt probe for sm_90a. Usage: dev/cutlass_probe/build.sh <cutlass include dir> [out]
set -euo pipefail
inc=$1
out=${2:-build-probe/cutlass_probe}
mkdir -p "$(dirname "$out")"
nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -I"$inc" \
  "$(dirname "$0")/probe.cu" -o "$out" -lcublasLt
