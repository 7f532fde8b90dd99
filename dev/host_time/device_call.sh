#!/usr/bin/env bash
# One device call: the torch extension built in the background while the A/B benchmark runs,
# then the CUDA Python tests of the ops and the host-time probe. $OUT gets the logs.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
( cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DPython_EXECUTABLE="$(command -v python3)" && nice -n 19 cmake --build build-gpu-torch -j 12 ) > "$out/torch_build.log" 2>&1 &
build=$!
PREBUILT=build-pack/ab.txz STEPS=bench ROUNDS=${ROUNDS:-2} OUT=$out/ab1 bash scripts/ab_check.sh 2>&1 | tail -40
echo "==== row kernel forced (reference: FUSEDCE_NO_STREAM=1; this tree: --variant rowkernel)"
FUSEDCE_NO_STREAM=1 BENCH_ARGS="--variant rowkernel --shapes 16384x32000,8192x128256,64x262144,8192x128256:f32" \
  PREBUILT=build-pack/ab.txz STEPS=bench ROUNDS=2 OUT=$out/ab2 bash scripts/ab_check.sh 2>&1 | tail -30
wait $build || { tail -20 "$out/torch_build.log"; exit 1; }
echo "==== pytest -k cuda (ops, options, functional, compile, errors)"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 240 python3 -m pytest tests/python/test_ops.py \
  tests/python/test_options.py tests/python/test_functional.py tests/python/test_compile.py tests/python/test_errors.py \
  -k cuda -q -p no:cacheprovider -x 2>&1 | tail -8
echo "==== host time"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 120 python3 dev/host_time/probe.py > "$out/probe.txt" 2>&1; grep "us/call" "$out/probe.txt"
cd "$out" && tar czf logs.tgz ab1 ab2 torch_build.log && rm -rf ab1 ab2 torch_build.log
