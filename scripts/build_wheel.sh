#!/usr/bin/env bash
# A binary wheel of fusedce that installs and imports without a compiler: the extension built
# by scikit-build-core (the CUDA kernels where nvcc is found: sm_80 and sm_90 machine code and
# sm_90 PTX, the CUDA runtime linked statically, cuBLASLt the one torch already loads), against
# the torch of $FUSEDCE_PYTHON (else .venv/bin/python, else python3), then tagged for that torch
# (scripts/tag_wheel.py: version 0.1.0+torch<major.minor><cuXYZ|cpu>, Requires-Dist
# torch==<major.minor>.*).
#   scripts/build_wheel.sh [OUT]     (OUT: dist/; prints the wheel's path last)
# The build tree is FUSEDCE_PY_BUILD_DIR where set (scripts/test.sh sets it to the tree its
# `pip install .` used, so under the test command this compiles nothing), else pyproject.toml's
# build-py/<wheel tag>. FUSEDCE_CMAKE_DEFINES (e.g. "-DFUSEDCE_CUDA=OFF") passes CMake
# definitions.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
python=${FUSEDCE_PYTHON:-python3}
[ -z "${FUSEDCE_PYTHON:-}" ] && [ -x .venv/bin/python ] && python=.venv/bin/python
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
defines=()
[ -n "${FUSEDCE_CMAKE_DEFINES:-}" ] && defines=(--config-settings=cmake.args="$FUSEDCE_CMAKE_DEFINES")
build_dir=()
[ -n "${FUSEDCE_PY_BUILD_DIR:-}" ] && build_dir=(--config-settings=build-dir="$FUSEDCE_PY_BUILD_DIR")
"$python" -m pip wheel -q --no-build-isolation --no-deps "${defines[@]}" "${build_dir[@]}" -w "$tmp" .
wheel=$(ls "$tmp"/fusedce-*.whl)
tagged=$("$python" scripts/tag_wheel.py "$wheel")
mv "$tagged" "$out/"
echo "$out/$(basename "$tagged")"
