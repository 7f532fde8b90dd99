#!/usr/bin/env bash
# The test command of README.md, C++ then Python:
#   1. configure (CUDA on where nvcc is found), build, run every C++ test with ctest;
#   2. build and install the Python package from this tree into the Python environment
#      ($FUSEDCE_PYTHON, else .venv when it exists, else python3; it must have torch,
#      transformers, accelerate, pytest, scikit-build-core, ninja and kernels: see README.md), then run
#      every Python test with pytest (no test collected counts as a failure; in parallel over the
#      cores with pytest-xdist where the environment has it).
# GPU tests skip themselves on a machine without a GPU. Both parts run; the exit status is
# non-zero if either failed.
# The Python package builds in the C++ part's build tree (FUSEDCE_PY_BUILD_DIR moves it): the
# core and its CUDA kernels compile once for both parts, and the package build adds the torch
# extension. For that both parts use one CMake generator (CMAKE_GENERATOR, set for both): an
# existing tree's own, else Ninja where the Python environment or the PATH has it (what
# scikit-build-core picks too). The wheel test (tests/python/test_wheel.py, scripts/build_wheel.sh)
# builds in the same tree.
# Usage: scripts/test.sh [build-dir]   (FUSEDCE_CMAKE_ARGS adds C++ configure arguments;
#        FUSEDCE_SKIP_CPP=1 or FUSEDCE_SKIP_PYTHON=1 runs one part only)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
jobs=$(nproc 2>/dev/null || echo 2)
status=0
python=${FUSEDCE_PYTHON:-python3}
[ -z "${FUSEDCE_PYTHON:-}" ] && [ -x .venv/bin/python ] && python=.venv/bin/python
# ninja, when it came with the environment's packages
py_bin=$(cd "$(dirname "$(command -v "$python" || echo "$python")")" && pwd)
export PATH="$py_bin:$PATH"
if [ -z "${CMAKE_GENERATOR:-}" ]; then
  if [ -f "$build/CMakeCache.txt" ]; then
    CMAKE_GENERATOR=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$build/CMakeCache.txt")
  elif command -v ninja > /dev/null; then
    CMAKE_GENERATOR=Ninja
  fi
  [ -n "${CMAKE_GENERATOR:-}" ] && export CMAKE_GENERATOR
fi

# With the Python part to follow, the C++ part configures as the package does (FUSEDCE_TORCH=ON,
# against the environment's interpreter: torch's ABI setting reaches every object), so that the
# package's build over this tree compiles nothing again.
torch_args=()
if [ "${FUSEDCE_SKIP_PYTHON:-0}" != 1 ] && py_exe=$("$python" -c "import sys, torch; print(sys.executable)" 2>/dev/null); then
  torch_args=(-DFUSEDCE_TORCH=ON "-DPython_EXECUTABLE=$py_exe")
fi

if [ "${FUSEDCE_SKIP_CPP:-0}" != 1 ]; then
  echo "== C++ tests"
  if cmake -S . -B "$build" -DFUSEDCE_TESTS=ON -DCMAKE_BUILD_TYPE=Release "${torch_args[@]}" ${FUSEDCE_CMAKE_ARGS:-} &&
     cmake --build "$build" -j "$jobs"; then
    ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 1200 || status=1
  else
    echo "C++ build failed"
    status=1
  fi
fi

if [ "${FUSEDCE_SKIP_PYTHON:-0}" != 1 ]; then
  echo "== Python tests"
  # Built against the torch of that environment (hence no build isolation), in the C++ part's
  # tree (kept: a rebuild compiles only what changed).
  FUSEDCE_PY_BUILD_DIR=$(realpath -m "${FUSEDCE_PY_BUILD_DIR:-$build}")
  export FUSEDCE_PY_BUILD_DIR
  if "$python" -m pip install --no-build-isolation --no-deps -q --config-settings=build-dir="$FUSEDCE_PY_BUILD_DIR" .; then
    # pytest-xdist (in the test command's set): one worker a core, each test file on one worker
    # (a file's module fixtures, such as the Kernels Hub build, run once)
    parallel=()
    [ "$jobs" -gt 1 ] && "$python" -c "import xdist" 2>/dev/null && parallel=(-n "$jobs" --dist loadfile)
    rc=0
    "$python" -m pytest tests/python -q -rs --durations=15 "${parallel[@]}" || rc=$?
    if [ $rc -eq 5 ]; then
      echo "pytest collected no tests: counted as a failure"
    fi
    [ $rc -eq 0 ] || status=1
  else
    echo "building the Python package failed"
    status=1
  fi
fi
exit $status
