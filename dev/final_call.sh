#!/usr/bin/env bash
# One device call for the merged branches (prebuilt binaries from build-pack/bins.txz): the
# skip_ignored capture tests and timing, the linear floor table as CSV, the torch extension
# with the Python capture test, the per-shard benchmark and the host-time probe.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out" build-gpu
tar -C build-gpu -xf build-pack/bins.txz || exit 1
( cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DPython_EXECUTABLE="$(command -v python3)" && nice -n 19 cmake --build build-gpu-torch -j 12 ) > "$out/torch_build.log" 2>&1 &
build=$!
echo "==== capture gtests"
timeout 150 build-gpu/tests/cpp/fusedce_tests --gtest_filter='Linear/LinearCapture.*:LinearCaptureErrors.*:*SizeLadder*' > "$out/capture_gtest.log" 2>&1
echo "rc $?"; grep -E "^\[  (PASSED|FAILED)|^\[  FAILED|tests ran" "$out/capture_gtest.log" | head -20
grep -B3 -A12 -m2 "Failure" "$out/capture_gtest.log" | head -60
echo "==== linear bench --graph"
timeout 100 build-gpu/bench/fusedce_linear_bench --graph 2>&1 | tail -25
wait $build || { tail -20 "$out/torch_build.log"; }
echo "==== pytest (graph capture, ce_loss)"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 90 python3 -m pytest tests/python/test_linear.py -k "graph and cuda" \
  tests/python/test_ops.py::test_ce_loss -q -p no:cacheprovider 2>&1 | tail -4
echo "==== host time"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 60 python3 dev/host_time/probe.py > "$out/probe.txt" 2>&1; grep "us/call" "$out/probe.txt"
echo "==== shard"
FUSEDCE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown) FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python \
  timeout ${SHARD_TIMEOUT:-150} python3 -m fusedce.bench --device cuda --only shard --no-progress --out "$out/shard" ${SHARD_ARGS:-} 2>&1 | tail -30
[ -f "$out/shard/results.csv" ] && cp "$out/shard/results.csv" "$out/linear_shard.csv"
echo "==== linear bench --csv"
timeout ${LINEAR_TIMEOUT:-150} build-gpu/bench/fusedce_linear_bench --csv "$out/linear_bench.csv" > "$out/linear_bench.md" 2>&1; echo "rc $?"; tail -12 "$out/linear_bench.md"
cd "$out" && tar czf logs.tgz capture_gtest.log torch_build.log shard 2>/dev/null; rm -rf capture_gtest.log torch_build.log shard
ls
