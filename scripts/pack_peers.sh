#!/usr/bin/env bash
# Packs the Python packages the GPU machine lacks for the benchmarks' peers, for device calls that
# carry them (the machine has no internet; a call carries at most 64 MiB with the working tree):
#   build-peers/small/  TRL and what its trainers import beyond the machine's image, Liger-Kernel
#                       (about 3 MB of wheels)
#   build-peers/quack/  quack (Tri Dao's CuTe DSL kernels) and the three packages it imports that the
#                       image lacks (about 5 MB; with build-peers/dsl and build-peers/small over one
#                       call's 64 MiB: carry dsl in one call, small and quack in the next)
#   build-peers/dsl/    NVIDIA's CuTe DSL, which Liger-Kernel's SM90 path and quack need: its small
#                       wheels, and its CUDA 13 library wheel (92 MB, over one call) unpacked and
#                       repacked as dsl.txz with xz (about 54 MB: it fits one call)
#   bash scripts/pack_peers.sh            (about 5 minutes on 2 cores, most of it xz)
# On the GPU machine (Python 3.12), before the benchmark:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
#       build-peers/dsl/*.whl build-peers/small/*.whl build-peers/quack/*.whl
#   tar -C /tmp/site -xJf build-peers/dsl/dsl.txz
# in that order: pip --target skips a wheel whose top folder (nvidia_cutlass_dsl/) exists already,
# and the DSL's Python package (cutlass.cute) is in the small wheels.
#   export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:<fusedce's build tree>:/tmp/site
# (carry build-peers/small and build-peers/dsl in one call, or in two consecutive calls while the
# machine stays warm). Versions: TRL's and its needs' from constraints.txt; the rest pinned here.
# Every file's SHA-256 is written to build-peers/SHA256SUMS (pip checks none of them: --no-deps
# from a local folder).
set -euo pipefail
cd "$(dirname "$0")/.."
LIGER=0.8.5
QUACK=0.6.5
DSL=4.8.1
PY=3.12
pinned() { sed -n "s/^$1==//p" constraints.txt; }
out=build-peers
rm -rf "$out" && mkdir -p "$out/small" "$out/quack" "$out/dsl"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
get() {  # get DIR NAME==VERSION ...
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platforms[@]}" -d "$dir" "$@"
}
# TRL's trainers import datasets (and it dill and multiprocess); the image has the rest.
get "$out/small" "trl==$(pinned trl)" "datasets==$(pinned datasets)" "dill==$(pinned dill)" \
  "multiprocess==$(pinned multiprocess)" "liger-kernel==$LIGER"
get "$out/quack" "quack-kernels==$QUACK" "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5" "einops==0.8.2"
get "$out/dsl" "nvidia-cutlass-dsl==$DSL" "nvidia-cutlass-dsl-libs-base==$DSL" "nvidia-cutlass-dsl-libs-core==$DSL"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get "$tmp" "nvidia-cutlass-dsl-libs-cu13==$DSL"
mkdir "$tmp/unpacked"
unzip -q "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl -d "$tmp/unpacked"
# A dictionary larger than the largest library (193 MB) lets xz find what the libraries share.
tar -C "$tmp/unpacked" -cf - . | xz -9e -T2 --lzma2=dict=256MiB > "$out/dsl/dsl.txz"
(cd "$out" && sha256sum small/* quack/* dsl/* > SHA256SUMS)
du -b "$out/small" "$out/quack" "$out/dsl"
