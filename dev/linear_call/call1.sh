#!/usr/bin/env bash
# Device call: the linear path's gtests, its floor table (fusedce_linear_bench --csv) and an ncu
# per-kernel profile of one call at 16384 x 2304 x 256000 from prebuilt binaries
# (build-pack/bins.txz, scripts/pack_prebuilt.sh), while the torch extension builds (CUTLASS on:
# carry .deps); then the CUDA linear tests of the front end.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out" build-gpu
tar -C build-gpu -xJf build-pack/bins.txz || exit 1
( cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF -DFUSEDCE_CUTLASS=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFUSEDCE_CUTLASS_WHEEL="$PWD/.deps/nvidia_cutlass-4.2.0.0-py3-none-any.whl" \
    -DPython_EXECUTABLE="$(command -v python3)" && nice -n 19 cmake --build build-gpu-torch -j 12 ) > "$out/torch_build.log" 2>&1 &
build=$!
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
echo "==== linear gtests"
timeout 200 build-gpu/tests/cpp/fusedce_tests --gtest_filter='*Linear*:*Gemm*' 2>&1 | tail -4
echo "==== linear bench --csv"
timeout 200 build-gpu/bench/fusedce_linear_bench --csv "$out/linear_bench.csv" > "$out/linear_bench.md" 2>&1; echo "rc $?"; tail -12 "$out/linear_bench.md"
echo "==== profile ${PROFILE_SHAPE:=16384 2304 256000}"
timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  build-gpu/bench/fusedce_linear_bench --profile $PROFILE_SHAPE > "$out/linear_profile.csv" 2> "$out/ncu.err"; echo "rc $?"
python3 bench/ncu_summary.py "$out/linear_profile.csv" > "$out/linear_profile.md" 2>&1; head -80 "$out/linear_profile.md"
wait $build || { tail -20 "$out/torch_build.log"; }
echo "==== pytest linear (cuda)"
FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python:/tmp/site timeout 120 python3 -m pytest tests/python/test_linear.py -k cuda -q \
  -p no:cacheprovider -x 2>&1 | tail -4
rm -f "$out/linear_profile.csv"
tail -3 "$out/torch_build.log" > "$out/torch_build.tail"; rm -f "$out/torch_build.log"
ls "$out"
