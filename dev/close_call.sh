#!/usr/bin/env bash
# One device call for the kernel change of the options gradient sweep (prebuilt binaries:
# build-pack/bins.txz from scripts/pack_prebuilt.sh, build-pack/ab.txz from scripts/pack_ab.sh):
# every output bit for bit against the reference build, the kernels' table and the linear floor
# table as CSV, then (the torch extension built meanwhile) the host-time probe and the CUDA tests
# of the loss op and the functional front end.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out" build-gpu
tar -C build-gpu -xJf build-pack/bins.txz || exit 1
( cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DPython_EXECUTABLE="$(command -v python3)" && nice -n 19 cmake --build build-gpu-torch -j 12 ) > "$out/torch_build.log" 2>&1 &
build=$!
echo "==== bits against the reference"
OUT=$out/ab PREBUILT=build-pack/ab.txz STEPS=bits bash scripts/ab_check.sh 2>&1 | tail -6
echo "==== kernels csv"
timeout 200 build-gpu/bench/fusedce_bench --csv "$out/ce_kernels.csv" > "$out/ce_kernels.md" 2>&1; echo "rc $?"
grep -E "all options" "$out/ce_kernels.md" | head -8
echo "==== linear bench --csv"
timeout 200 build-gpu/bench/fusedce_linear_bench --csv "$out/linear_bench.csv" > "$out/linear_bench.md" 2>&1; echo "rc $?"; tail -12 "$out/linear_bench.md"
wait $build || { tail -20 "$out/torch_build.log"; }
echo "==== host time"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 90 python3 dev/host_time/probe.py > "$out/probe.txt" 2>&1; grep "us/call" "$out/probe.txt"
echo "==== pytest"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python timeout 150 python3 -m pytest tests/python/test_ops.py tests/python/test_functional.py \
  tests/python/test_options.py -k cuda -q -p no:cacheprovider -x 2>&1 | tail -4
cd "$out" && tar czf logs.tgz torch_build.log ab 2>/dev/null; rm -rf torch_build.log ab
ls
