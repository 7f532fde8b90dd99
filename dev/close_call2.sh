#!/usr/bin/env bash
# One device call after a launcher and front-end change (prebuilt binaries in
# build-pack/bins.txz from scripts/pack_prebuilt.sh): every CUDA gtest of the four binaries
# (scripts/gpu_check.sh step tests) while the torch extension builds, then the host-time probe and
# the CUDA cases of the front end's Python tests.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
( cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DPython_EXECUTABLE="$(command -v python3)" && nice -n 19 cmake --build build-gpu-torch -j 8 ) > "$out/torch_build.log" 2>&1 &
build=$!
OUT=$out/check PREBUILT=build-pack/bins.txz STEPS=tests bash scripts/gpu_check.sh 2>&1 | tail -12
wait $build || { tail -20 "$out/torch_build.log"; }
echo "==== host time"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 90 python3 dev/host_time/probe.py > "$out/probe.txt" 2>&1; grep "us/call" "$out/probe.txt"
echo "==== pytest"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 200 python3 -m pytest tests/python/test_ops.py tests/python/test_functional.py \
  tests/python/test_options.py tests/python/test_errors.py -k cuda -q -p no:cacheprovider 2>&1 | tail -4
cd "$out" && tar czf logs.tgz torch_build.log check 2>/dev/null; rm -rf torch_build.log check
ls
