#!/usr/bin/env bash
# Downloads the kernels package and everything it pulls in, at the versions of constraints.txt,
# as wheels for another machine's Python (default 3.12, x86_64 Linux) into .whl/kernels/, for a
# GPU machine without internet access:
#   scripts/fetch_kernels_wheels.sh [PYTHON_VERSION]
#   there: python3 -m pip install --no-index --no-deps --target /tmp/site .whl/kernels/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
python=${FUSEDCE_PYTHON:-python3}
[ -z "${FUSEDCE_PYTHON:-}" ] && [ -x .venv/bin/python ] && python=.venv/bin/python
"$python" -m pip download -q -c constraints.txt --only-binary=:all: --python-version "${1:-3.12}" \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl/kernels kernels
ls .whl/kernels
