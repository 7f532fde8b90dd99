#!/usr/bin/env bash
# The test command of README.md: configure (CUDA on where nvcc is found), build, run every C++
# test with ctest. GPU tests skip themselves on a machine without a GPU.
# Usage: scripts/test.sh [build-dir]   (FUSEDCE_CMAKE_ARGS adds configure arguments)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B "$build" -DFUSEDCE_TESTS=ON -DCMAKE_BUILD_TYPE=Release ${FUSEDCE_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 1200
