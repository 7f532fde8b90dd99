#!/usr/bin/env bash
# On the GPU machine (no internet): builds the CUDA variant of the Kernels Hub package against
# the machine's torch, loads it with kernels.get_local_kernel and runs tests/python/hub_checks.py
# on the GPU (loss and gradients against float64 in float32 / bfloat16 / float16, the metrics,
# the exact signature). kernels comes from .whl/kernels/ (scripts/fetch_kernels_wheels.sh, run
# where there is a package index; carry .whl). Logs in $OUT (or ./gpu_out).
#   bash scripts/gpu_hub_check.sh        (about 3-5 minutes with 16 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kernels-site .whl/kernels/*.whl || exit 1
export PYTHONPATH=/tmp/kernels-site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 FUSEDCE_PYTHON=$(command -v python3)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, kernels; print('torch', torch.__version__, '| kernels', kernels.__version__)"
bash scripts/build_kernels_hub.sh --cuda /tmp/fusedce-hub > "$out/hub_build.log" 2>&1 \
  || { tail -30 "$out/hub_build.log"; exit 1; }
tail -2 "$out/hub_build.log"
python3 tests/python/hub_checks.py /tmp/fusedce-hub 2>&1 | tee "$out/hub_checks.log"
