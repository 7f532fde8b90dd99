#!/usr/bin/env bash
# The test command of README.md, C++ then Python:
#   1. configure (CUDA on where nvcc is found), build, run every C++ test with ctest;
#   2. build and install the Python package from this tree into the Python environment
#      ($FUSEDCE_PYTHON, else .venv when it exists, else python3; it must have torch,
#      transformers, accelerate, pytest, scikit-build-core, ninja and kernels: see README.md), then run
#      every Python test with pytest (no test collected counts as a failure).
# GPU tests skip themselves on a machine without a GPU. Both parts run; the exit status is
# non-zero if either failed.
# Usage: scripts/test.sh [build-dir]   (FUSEDCE_CMAKE_ARGS adds C++ configure arguments;
#        FUSEDCE_PY_BUILD_DIR moves the Python package's build tree from build-py/;
#        FUSEDCE_SKIP_CPP=1 or FUSEDCE_SKIP_PYTHON=1 runs one part only)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
jobs=$(nproc 2>/dev/null || echo 2)
status=0

if [ "${FUSEDCE_SKIP_CPP:-0}" != 1 ]; then
  echo "== C++ tests"
  if cmake -S . -B "$build" -DFUSEDCE_TESTS=ON -DCMAKE_BUILD_TYPE=Release ${FUSEDCE_CMAKE_ARGS:-} &&
     cmake --build "$build" -j "$jobs"; then
    ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 1200 || status=1
  else
    echo "C++ build failed"
    status=1
  fi
fi

if [ "${FUSEDCE_SKIP_PYTHON:-0}" != 1 ]; then
  echo "== Python tests"
  python=${FUSEDCE_PYTHON:-python3}
  [ -z "${FUSEDCE_PYTHON:-}" ] && [ -x .venv/bin/python ] && python=.venv/bin/python
  # Built against the torch of that environment (hence no build isolation); the build tree
  # build-py/ is kept, so a rebuild compiles only what changed.
  py_build=()
  [ -n "${FUSEDCE_PY_BUILD_DIR:-}" ] && py_build=(--config-settings=build-dir="$FUSEDCE_PY_BUILD_DIR")
  if "$python" -m pip install --no-build-isolation --no-deps -q "${py_build[@]}" .; then
    rc=0
    "$python" -m pytest tests/python -q -rs || rc=$?
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
