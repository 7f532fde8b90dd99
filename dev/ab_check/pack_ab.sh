#!/usr/bin/env bash
# Packs what dev/ab_check/ab_check.sh runs on the GPU machine, built here (no GPU needed), so that the
# device call spends no time compiling: this tree's CUDA gtests and benchmark, the reference's
# benchmark, and dev/ab_check/ab_bits.cpp linked against each tree's library. Into build-pack/ab.txz:
#   bash scripts/pack_prebuilt.sh                     (this tree, in build-sm90)
#   REF_BUILD=<the reference's sm_90 build directory, Ninja, fusedce_bench built> bash dev/ab_check/pack_ab.sh
#   device: PREBUILT=build-pack/ab.txz STEPS="tests bits bench" bash dev/ab_check/ab_check.sh  (carry build-pack)
# REF_SRC (build-ref-src): the reference's sources, for its public headers.
set -euo pipefail
cd "$(dirname "$0")/../.."
this=${THIS_BUILD:-build-sm90}
ref=${REF_BUILD:?the reference tree\'s build directory}
ref_src=${REF_SRC:-build-ref-src}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/this/bench" "$stage/this/tests/cpp" "$stage/ref-build/bench" "$stage/bin"
cp "$this"/tests/cpp/fusedce_{tests,grid_tests,cuda_tests} "$stage/this/tests/cpp/"
cp "$this/bench/fusedce_bench" "$stage/this/bench/"
cp "$ref/bench/fusedce_bench" "$stage/ref-build/bench/"
for side in ref this; do
  dir=$this inc=.
  [ $side = ref ] && dir=$ref inc=$ref_src
  # Linked as that tree links fusedce_bench (its CUDA runtime, cuBLASLt, the CPU BLAS it found),
  # from its build directory, where that command's relative paths hold.
  link=$(ninja -C "$dir" -t commands bench/fusedce_bench | grep -E -- "-o bench/fusedce_bench( |$)" | tail -1 |
    sed -E 's/.*-o bench\/fusedce_bench //; s/ && :.*//')
  (cd "$dir" && nvcc -std=c++17 -O2 -I"$OLDPWD/$inc/include" -c "$OLDPWD/dev/ab_check/ab_bits.cpp" -o "$stage/ab_bits_$side.o" &&
    c++ "$stage/ab_bits_$side.o" -o "$stage/bin/ab_bits_$side" $link)
done
mkdir -p build-pack
tar -C "$stage" -cf - this ref-build bin | xz -9 -T1 --lzma2=dict=192MiB > build-pack/ab.txz
ls -la build-pack/ab.txz
