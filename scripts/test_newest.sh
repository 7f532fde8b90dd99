#!/usr/bin/env bash
# The test suite against the newest releases of everything the tests install (no pins), in a
# virtual environment of its own (.venv-newest) and build directories of their own, so that a
# new torch or transformers that breaks something is found on purpose rather than by surprise.
# When it passes, constraints.txt can move to this set: its freeze is written to
# build-newest/freeze.txt.
# Usage: scripts/test_newest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-newest
.venv-newest/bin/pip install -q --upgrade torch transformers accelerate pytest pytest-xdist scikit-build-core ninja matplotlib tqdm kernels trl
mkdir -p build-newest
.venv-newest/bin/pip freeze > build-newest/freeze.txt
.venv-newest/bin/python -c "import torch, transformers; print('newest: torch', torch.__version__, '| transformers', transformers.__version__)"
FUSEDCE_PYTHON=.venv-newest/bin/python bash scripts/test.sh build-newest/cpp
