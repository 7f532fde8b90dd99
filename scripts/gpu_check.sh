#!/usr/bin/env bash
# Everything the GPU must show, in one run on the GPU machine: build (sm_90 + sm_80), every C++
# test on the GPU, compute-sanitizer (memcheck, racecheck) on a small sweep, the benchmarks.
# Logs go to $OUT (or ./gpu_out). GoogleTest comes from .deps/googletest when it is not installed
# (copy /usr/src/googletest there and carry it). CTEST_ARGS narrows ctest (e.g. -R "cuda|Cuda"),
# BENCH_ARGS goes to the benchmark (e.g. --quick). TORCH_CUDA_ARCHS: the torch extension's
# architectures (default 80-real;90). STEPS picks steps (default: all of
# "tests sanitizer bench python peers linear report demo"); the C++ build runs for the first four.
# BUILD_ARCHS / BUILD_TARGETS narrow the C++ build (e.g. 90 and fusedce_linear_bench for a
# benchmark-only call). PYTEST_PATHS (default tests/python) and PYTEST_ARGS (e.g. -k cuda) narrow
# the Python tests; REPORT_ARGS / DEMO_ARGS go to
# `python -m fusedce.bench` / `python -m fusedce.demo`; PYTEST_TIMEOUT, REPORT_TIMEOUT and
# DEMO_TIMEOUT (seconds) bound those steps. The opt-in step "profile" runs ncu over one fused
# linear call (PROFILE_SHAPE="N H V") and prints the per-kernel times (bench/ncu_summary.py);
# "ce_profile" runs ncu's speed-of-light, occupancy, warp-state and memory sections over the
# cross-entropy kernels of `fusedce_bench --profile`, and "stalls" its per-SASS-instruction stall
# samples of the stream kernel (stalls_sass.csv.gz, read by bench/sass_stalls.py; a benchmark built
# with -lineinfo, as scripts/pack_prebuilt.sh builds it); "hub" builds the Kernels Hub package's
# CUDA variant and runs tests/python/hub_checks.py on it (kernels and what it pulls in carried
# as wheels in .whl/, docs/distribution.md); "splits" times few-rows forwards over the
# stream kernel's chunks per split (PlanChoices::split_chunks), per call and per call inside a CUDA graph
# (`fusedce_bench --sweep-splits`); "ab" runs the benchmark as is and with each variant
# of the launcher's plan named in AB_VARIANTS (fusedce_bench --variant, see the step); "options"
# times each option alone (`fusedce_bench --options`).
# All steps take about 20 minutes on an H200, more than one 10-minute device call, so the work is
# split in two calls: STEPS="tests sanitizer bench linear" with CTEST_ARGS='-R (cuda|Cuda)'
# (~7 min), then STEPS="python peers report demo" TORCH_CUDA_ARCHS=90 PYTEST_ARGS="-k cuda"
# REPORT_ARGS=--quick (~5 min). Carry .deps (GoogleTest) and .whl (peers) with them. The bench,
# linear and peers steps write the CSV files bench/RESULTS.md is made from (bench.csv,
# linear_bench.csv, ce_peers.csv: copy them into bench/h200 and run bench/make_results.py).
# PEERS_ARGS goes to the peers step's `python -m fusedce.bench --only ce` (e.g. --quick).
# With PREBUILT (binaries from scripts/pack_prebuilt.sh) the default steps are "tests sanitizer
# python" with PYTEST_ARGS="-k cuda" and TORCH_CUDA_ARCHS=90: every CUDA check of a commit in one
# device call of just under 10 minutes on a fast host (595 s); the torch extension builds in the
# background meanwhile, or comes built with TORCH_PREBUILT (a tarball of a build directory made
# against the machine's torch). The CUDA tests' heaviest shard (the cross-entropy stream tests,
# bound by their CPU references) takes 160 to 250 s depending on the host, so each gtest shard
# gets TEST_TIMEOUT seconds (default 420), and that binary runs in 8 shards (GTEST_SHARDS); where
# one call cannot hold all three steps, split it: STEPS="tests sanitizer", then copy that call's
# gpu_check.txt to bench/h200/ and run STEPS=python with GPU_CHECK_APPEND=1 (one record of both).
# The record: every run writes gpu_check.txt (to $OUT and to bench/h200/gpu_check.txt): its first
# line `commit <full sha>` ($GPU_CHECK_COMMIT, else git's HEAD: the device machine's copy of the
# tree may carry a .git of another commit), then the date, the GPU, the steps and each one's pass / fail
# counts. Commit it with the change it checked.
# The opt-in step "shard" times one rank of the vocabulary-parallel linear cross-entropy at
# W = 2, 4, 8 beside the one-device call (`python -m fusedce.bench --only shard`, SHARD_ARGS
# added, e.g. --repeat 50) and writes linear_shard.csv; alone (STEPS=shard TORCH_CUDA_ARCHS=90)
# it builds the torch extension first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
build=build-gpu
status=0
step() { echo "== $*  ($(date +%T))"; }
# The device tool returns at most 8 files from $OUT: on exit, more than that are packed into
# logs.tgz (everything), and only it, the record (gpu_check.txt), the benchmark tables (bench*.md)
# and the CSV files stay beside it.
pack_logs() {
  [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -le 8 ] && return
  tar -C "$out" -czf /tmp/gpu_check_logs.tgz . && mv /tmp/gpu_check_logs.tgz "$out/logs.tgz"
  find "$out" -mindepth 1 -maxdepth 1 ! -name logs.tgz ! -name gpu_check.txt ! -name 'bench*.md' ! -name '*.csv' -exec rm -rf {} +
  [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -le 8 ] || find "$out" -maxdepth 1 -name 'bench*.md' -delete
}
if [ -n "${PREBUILT:-}" ]; then
  default_steps="tests sanitizer python"
  : "${PYTEST_ARGS=-k cuda}" "${TORCH_CUDA_ARCHS:=90}"
else
  default_steps="tests sanitizer bench python peers linear report demo"
fi
steps=${STEPS:-$default_steps}
want() { [[ " $steps " == *" $1 "* ]]; }

# The record of the run: gpu_check.txt, one line a fact, each step's counts added as it ends.
record=$out/gpu_check.txt
# GPU_CHECK_COMMIT first: a device machine's copy of the tree can carry a .git of another commit.
if [ -n "${GPU_CHECK_COMMIT:-}" ]; then
  commit=$GPU_CHECK_COMMIT
  tree="as given by GPU_CHECK_COMMIT (the caller's clean checkout of that commit)"
else
  commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  tree="as committed"
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && tree="changed from the commit"
fi
# GPU_CHECK_APPEND=1 continues the record of an earlier call for the same commit (a check split
# over two device calls): when bench/h200/gpu_check.txt, as carried, begins with this commit's
# line, its lines (with that part's status) come first and this run's follow, so that one file
# holds every step. Otherwise the record starts anew.
prior=
if [ -n "${GPU_CHECK_APPEND:-}" ] && [ -f bench/h200/gpu_check.txt ] \
  && [ "$(head -1 bench/h200/gpu_check.txt)" = "commit $commit" ]; then
  prior=$(cat bench/h200/gpu_check.txt)
fi
{
  if [ -n "$prior" ]; then
    echo "$prior"
    echo "continued $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  else
    echo "commit $commit"
    echo "tree $tree"
    echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  fi
  echo "gpu $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "nvcc $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' | head -1)"
  echo "binaries $([ -n "${PREBUILT:-}" ] && echo "prebuilt ($PREBUILT)" || echo "built here")"
  echo "steps $steps"
} > "$record"
note() { echo "$*" >> "$record"; }
finish() {
  local rc=$?
  note "status $([ "$status" -eq 0 ] && [ "$rc" -eq 0 ] && echo passed || echo FAILED)"
  mkdir -p bench/h200 && cp "$record" bench/h200/gpu_check.txt
  pack_logs
}
trap finish EXIT
# Sums "[  PASSED  ] N tests" and "[  FAILED  ] N tests" over gtest logs.
gtest_counts() {
  local passed failed
  passed=$(cat "$@" 2>/dev/null | grep -hoE "^\[  PASSED  \] [0-9]+ tests?" | awk '{s += $4} END {print s + 0}')
  failed=$(cat "$@" 2>/dev/null | grep -hoE "^\[  FAILED  \] [0-9]+ tests?," | awk '{s += $4} END {print s + 0}')
  echo "passed $passed failed $failed"
}

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
nvcc --version | tail -2

if [ -n "${PREBUILT:-}" ]; then
  # Binaries built elsewhere (scripts/pack_prebuilt.sh, on the machine without a GPU), so the
  # call spends no device time compiling. ctest's files name the build machine's paths, so
  # the tests step runs the binaries themselves (gtest shards in parallel) instead.
  step "prebuilt binaries: $PREBUILT"
  mkdir -p "$build" && tar -C "$build" -xf "$PREBUILT" || { status=1; exit 1; }
elif want tests || want sanitizer || want bench || want linear || want profile || want ce_profile || want stalls || want splits || want ab || want options; then
step "build"
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DFUSEDCE_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TESTS=ON \
  -DFUSEDCE_BENCH=ON "-DCMAKE_CUDA_ARCHITECTURES=${BUILD_ARCHS:-80-real;90}" "${gtest_arg[@]}" > "$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" -j 16 ${BUILD_TARGETS:+--target $BUILD_TARGETS} > "$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -30; exit 1; }
grep -E "spill" "$out/build.log" | sort | uniq -c | head -20
fi

# The torch extension (for the Python steps) builds in the background while the C++ tests and
# the sanitizer run; the Python steps wait for it.
torch_build_pid=""
build_torch_extension() {
  cmake -S . -B build-gpu-torch -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEDCE_CUDA=ON -DFUSEDCE_TORCH=ON \
    -DFUSEDCE_TESTS=OFF -DFUSEDCE_EXAMPLES=OFF "-DCMAKE_CUDA_ARCHITECTURES=${TORCH_CUDA_ARCHS:-80-real;90}" \
    -DPython_EXECUTABLE="$(command -v python3)" > "$out/torch_build.log" 2>&1 &&
    cmake --build build-gpu-torch -j "${TORCH_BUILD_JOBS:-12}" >> "$out/torch_build.log" 2>&1
}
if (want python || want peers || want report || want demo || want shard) && python3 -c "import torch, pytest" 2>/dev/null; then
  if [ -n "${TORCH_PREBUILT:-}" ]; then
    # An extension built elsewhere against the machine's torch version (a tarball of its build
    # directory): the Python steps start without waiting for a compile.
    step "torch extension: prebuilt ($TORCH_PREBUILT)"
    mkdir -p build-gpu-torch && tar -C build-gpu-torch -xf "$TORCH_PREBUILT" || { status=1; exit 1; }
    note "torch extension prebuilt ($TORCH_PREBUILT)"
    true & torch_build_pid=$!
  else
    step "torch extension: building in the background"
    build_torch_extension &
    torch_build_pid=$!
  fi
fi

if want tests && [ -n "${PREBUILT:-}" ]; then
# Shards per binary: fusedce_cuda_tests holds the CPU-reference-bound cross-entropy stream tests
# (the call's longest shard at 4), so it gets 8; 20 processes on the 16 cores in all.
# GTEST_SHARDS ("binary=count ...") overrides a binary's count.
shards_of() {
  local name=$1 n=4 kv
  [ "$name" = fusedce_cuda_tests ] && n=8
  for kv in ${GTEST_SHARDS:-}; do [ "${kv%%=*}" = "$name" ] && n=${kv#*=}; done
  echo "$n"
}
step "tests (prebuilt gtest binaries in shards, filter ${GTEST_FILTER:-*cuda*:*Cuda*})"
pids=()
for t in "$build"/tests/cpp/fusedce_*tests; do
  n=$(shards_of "$(basename "$t")")
  for ((i = 0; i < n; ++i)); do
    # A hung kernel must not eat the whole call: each shard gets TEST_TIMEOUT seconds.
    GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout -k 5 "${TEST_TIMEOUT:-420}" "$t" --gtest_filter="${GTEST_FILTER:-*cuda*:*Cuda*}" \
      > "$out/gtest_$(basename "$t")_shard$i.log" 2>&1 &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
note "gtest (${GTEST_FILTER:-*cuda*:*Cuda*}): $(gtest_counts "$out"/gtest_*_shard*.log)"
cat "$out"/gtest_*_shard*.log > "$out/gtest.log" && rm -f "$out"/gtest_*_shard*.log
grep -hE "^\[  (PASSED|FAILED)  \]|tests? ran" "$out/gtest.log" | sort | uniq -c
grep -hE "^\[  FAILED  \].*\(" "$out/gtest.log" | head -30
grep -hE "^\[  FAILED  \].*\(" "$out/gtest.log" | sed 's/, where GetParam().*//; s/ ([0-9]* ms)$//' | sort -u | head -20 \
  | sed 's/^/  /' >> "$record"
elif want tests; then
step "tests (ctest, GPU present)"
ctest --test-dir "$build" -j 12 --timeout 900 --output-on-failure ${CTEST_ARGS:-} > "$out/ctest.log" 2>&1 || status=1
tail -25 "$out/ctest.log"
note "ctest ${CTEST_ARGS:-}: $(grep -hE "tests passed, [0-9]+ tests? failed out of" "$out/ctest.log" | tail -1)"
fi

if want sanitizer; then
step "compute-sanitizer on a small sweep (every run at once: 16 cores, one GPU)"
# Small CUDA cases of the grid (odd, tiny and mid-size V, every option) and the layout, special
# value, equivalence and batch tests on CUDA.
bin="$build/tests/cpp"
# racecheck runs on the tests whose plan takes the stream kernel's synchronous row reduction
# (CudaSanitize.*Sync*, explicit PlanChoices) and the paths without the stream kernel: the
# asynchronous one (the default) reuses its warp-partial slots after kReduceSlots items, an
# order racecheck cannot see (it runs through the mbarrier ring: a warp can only reach item i + 8
# after the finalizer of item i released a stage it reads after its fold; stream_reduce.cuh), so
# it reports those reuses as hazards. The async path's results are checked bit for bit against
# the synchronous one (CudaStream.AsyncReductionGivesTheSameBits); its racecheck count is printed
# below for information.
# The runs are independent processes, so they run together (the larger ones as gtest shards);
# each writes its own log, read below once all have ended.
san_pids=()
sanitize() {  # log name, shards, tool, binary, filter, extra options of compute-sanitizer
  local name=$1 shards=$2 tool=$3 binary=$4 filter=$5
  shift 5
  local i
  for ((i = 0; i < shards; ++i)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i compute-sanitizer --tool "$tool" "$@" "$bin/$binary" \
      --gtest_filter="$filter" > "$out/sanitizer_${name}_$i.log" 2>&1 &
    san_pids+=("$!:$name")
  done
}
sanitize memcheck_grid 2 memcheck fusedce_grid_tests \
  "${GRID_FILTER:-*cuda_*_V7_N3_*:*cuda_*_V127_N257_*:*cuda_bfloat16_V1024_N257_*:*cuda_*_V1_N1_*}" --error-exitcode 9
sanitize memcheck_tests 6 memcheck fusedce_tests "${TESTS_FILTER:-*cuda*:*Cuda*}" --error-exitcode 9
# Rows of several chunks, several rows a block: every stage of the stream kernel's ring turns
# over, with the gradient's second sweep (the grid's sizes above fit one chunk a row: the ring
# never wraps there). memcheck only: racecheck flags every wrap of an mbarrier ring, even the
# probe's ring of plain shared stores (dev/race_probe/probe.cu `generic`), so its
# count says nothing here; the ring's order is checked by results (CudaStream.MetricsLeave*).
# With it the stream kernel's own finish over split rows (stale workspace, counters).
sanitize memcheck_stages 1 memcheck fusedce_cuda_tests \
  'CudaStream.MetricsLeaveBitsWhileStagesTurnOver:CudaStream.OneLaunchFinishMatchesSeparatePasses' --error-exitcode 9
# The grid's sizes under the synchronous reduction, one and two consumer groups, and the row
# kernel's forward. racecheck serialises every cuBLAS product: the linear grid (memcheck covers
# it) would take the whole call.
sanitize racecheck_grid 1 racecheck fusedce_cuda_tests 'CudaSanitize.*Sync*:CudaSanitize.RowKernelForward' \
  --error-exitcode 9
# Two consumer groups forced (with the gradient too): the grid's sizes under memcheck (racecheck
# runs CudaSanitize.TwoGroupsSyncReduction above).
sanitize groups 1 memcheck fusedce_cuda_tests 'CudaSanitize.TwoGroups' --error-exitcode 9
# Informational: racecheck over the layout, value and equivalence tests of fusedce_tests. They
# run the public API, hence the default plans, whose asynchronous reduction racecheck reports as
# above; its count is printed, not judged.
sanitize public 4 racecheck fusedce_tests "${RACECHECK_FILTER:-*cuda*:*Cuda*:-*LinearGrid*:*LinearContract*}" \
  --print-limit 2
# Informational: racecheck over the default (asynchronous) reduction on one small sweep.
sanitize async 1 racecheck fusedce_grid_tests '*cuda_bfloat16_V1024_N257_*' --print-limit 2
declare -A san_rc=()
for entry in "${san_pids[@]}"; do
  rc=0
  wait "${entry%%:*}" || rc=$?
  name=${entry#*:}
  [ "${san_rc[$name]:-0}" -ne 0 ] || san_rc[$name]=$rc
done
summary() { grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$@" | sort | uniq -c | sed 's/^ *//' | tr '\n' ' '; }
judged() {  # the record's line for the runs `names` (judged: their exit codes count)
  local what=$1 rc=0 name logs=()
  shift
  for name in "$@"; do
    [ "${san_rc[$name]}" -eq 0 ] || rc=${san_rc[$name]}
    logs+=("$out"/sanitizer_${name}_*.log)
  done
  echo "$what: exit $rc; $(summary "${logs[@]}")$(grep -hE 'tests? ran|FAILED  \]' "${logs[@]}" | sort | uniq -c | tr '\n' ' ')"
  note "$what (judged): exit $rc; $(summary "${logs[@]}")gtest $(gtest_counts "${logs[@]}")"
  [ $rc -eq 0 ] || status=1
}
judged memcheck memcheck_grid memcheck_tests memcheck_stages
judged racecheck racecheck_grid
judged "memcheck, two groups forced" groups
echo "racecheck, public API with the default plans (informational): $(summary "$out"/sanitizer_public_*.log)"
note "racecheck, public API, default plans (informational): $(summary "$out"/sanitizer_public_*.log)gtest $(gtest_counts "$out"/sanitizer_public_*.log)"
echo "racecheck, asynchronous reduction (informational): $(summary "$out"/sanitizer_async_*.log)"
fi

if want bench; then
step "benchmark"
rc=0
"$build/bench/fusedce_bench" ${BENCH_ARGS:-} --csv "$out/bench.csv" | tee "$out/bench.md" || rc=1
note "bench: exit $rc"
[ $rc -eq 0 ] || status=1
fi

# Carried wheels (peers, and whatever the Python tests need) go to /tmp/site.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi

if want python || want peers || want report || want demo || want shard; then
step "Python front end on the GPU (the machine's torch)"
if [ -n "$torch_build_pid" ]; then
  wait "$torch_build_pid" || { tail -20 "$out/torch_build.log"; status=1; note "torch extension build: FAILED"; }
  if want python; then
    rc=0
    FUSEDCE_BUILD_DIR=build-gpu-torch PYTHONPATH=python:${PYTHONPATH:-} timeout ${PYTEST_TIMEOUT:-3000} python3 -m pytest ${PYTEST_PATHS:-tests/python} -q -rsfE \
      -p no:cacheprovider ${PYTEST_ARGS:-} > "$out/pytest.log" 2>&1 || rc=$?
    tail -5 "$out/pytest.log"
    grep -hE "^FAILED|^ERROR" "$out/pytest.log" | head -20
    note "pytest ${PYTEST_PATHS:-tests/python} ${PYTEST_ARGS:-}: exit $rc; $(grep -hE "[0-9]+ (passed|failed)" "$out/pytest.log" | tail -1 | tr -d '=')"
    grep -hE "^FAILED|^ERROR" "$out/pytest.log" | head -20 | sed 's/^/  /' >> "$record"
    [ $rc -eq 0 ] || status=1
  fi
else
  echo "python3 has no torch or pytest here: Python tests not run (carry pytest in .whl/)"
  note "pytest: not run (python3 has no torch or pytest)"
  want python && status=1
fi
fi

if want peers; then
step "peers: cross-entropy over logits against every importable peer (python -m fusedce.bench --only ce)"
# Liger-Kernel travels as a wheel in .whl/, flash-attn's Triton cross-entropy as a file in
# .whl/peers/ (carry .whl); torch and triton are on the machine. The CSV is bench/h200/ce_peers.csv's
# successor; the folder (table and plots) is archived.
FUSEDCE_PEER_FLASH_ATTN_CE=${FUSEDCE_PEER_FLASH_ATTN_CE:-$PWD/.whl/peers/flash_attn_ce.py} \
  FUSEDCE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown) \
  PYTHONPATH=$(python3 tests/python/build_tree.py build-gpu-torch):${PYTHONPATH:-} PYTHONUNBUFFERED=1 \
  timeout ${REPORT_TIMEOUT:-3000} python3 -m fusedce.bench --device cuda --only ce --no-progress --out "$out/peers" \
  ${PEERS_ARGS:-} 2>&1 | tee "$out/peers.log" || status=1
[ -f "$out/peers/results.csv" ] && cp "$out/peers/results.csv" "$out/ce_peers.csv"
tar -C "$out" -czf "$out/peers.tgz" peers && rm -rf "$out/peers"
fi

if want report; then
step "benchmark report: python -m fusedce.bench against every importable peer"
FUSEDCE_PEER_FLASH_ATTN_CE=${FUSEDCE_PEER_FLASH_ATTN_CE:-$PWD/.whl/peers/flash_attn_ce.py} \
  FUSEDCE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown) \
  PYTHONPATH=$(python3 tests/python/build_tree.py build-gpu-torch):${PYTHONPATH:-} PYTHONUNBUFFERED=1 \
  timeout ${REPORT_TIMEOUT:-3000} python3 -m fusedce.bench --no-progress --out "$out/report" ${REPORT_ARGS:-} 2>&1 | tee "$out/report.log" || status=1
# One archive: the device tool brings back only a few files per call.
tar -C "$out" -czf "$out/report.tgz" report && rm -rf "$out/report"
fi

if want shard; then
step "per shard: the vocabulary-parallel linear cross-entropy, one rank (python -m fusedce.bench --only shard)"
FUSEDCE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown) \
  PYTHONPATH=$(python3 tests/python/build_tree.py build-gpu-torch):${PYTHONPATH:-} PYTHONUNBUFFERED=1 \
  timeout ${REPORT_TIMEOUT:-3000} python3 -m fusedce.bench --device cuda --only shard --no-progress \
  --out "$out/shard" ${SHARD_ARGS:-} 2>&1 | tee "$out/shard.log" || status=1
[ -f "$out/shard/results.csv" ] && cp "$out/shard/results.csv" "$out/linear_shard.csv"
rm -rf "$out/shard"
fi

if want demo; then
step "demo: python -m fusedce.demo --device cuda"
PYTHONPATH=$(python3 tests/python/build_tree.py build-gpu-torch):${PYTHONPATH:-} PYTHONUNBUFFERED=1 \
  timeout ${DEMO_TIMEOUT:-3000} python3 -m fusedce.demo --device cuda --out "$out/demo" ${DEMO_ARGS:-} 2>&1 | tail -40 | tee "$out/demo.log" || status=1
tar -C "$out" -czf "$out/demo.tgz" demo && rm -rf "$out/demo"
fi

if want linear; then
step "linear cross-entropy benchmark (fused vs the bare GEMM floor of the same run)"
"$build/bench/fusedce_linear_bench" ${BENCH_ARGS:-} --csv "$out/linear_bench.csv" 2>&1 | tee "$out/linear_bench.md" || status=1
fi

if want profile; then
step "ncu: per-kernel times of one fused linear call (PROFILE_SHAPE, default 8192 4096 128256)"
ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  "$build/bench/fusedce_linear_bench" --profile ${PROFILE_SHAPE:-8192 4096 128256} > "$out/linear_profile.csv" 2> "$out/ncu.err" || status=1
python3 bench/ncu_summary.py "$out/linear_profile.csv" | tee "$out/linear_profile.md" || { tail -5 "$out/ncu.err"; status=1; }
fi

if want splits; then
step "few-rows sweep: the stream kernel's work split (PlanChoices::split_chunks)"
"$build/bench/fusedce_bench" --sweep-splits ${BENCH_ARGS:-} 2>&1 | tee "$out/sweep_splits.md" || status=1
fi

if want options; then
step "what each option costs (fusedce_bench --options)"
"$build/bench/fusedce_bench" --options ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_options.md" || status=1
fi

if want ab; then
step "A/B: the stream kernel's variants against the default (fusedce_bench, same binary)"
# AB_VARIANTS picks them (fusedce_bench --variant, explicit plan choices): sync (the synchronous
# row reduction), halves (every long row on 2-block clusters), groups1 / groups2 (one or two
# consumer groups over whole rows, forced; groups2 also with the gradient), separate (the
# prepare / split-merge / finalize passes instead of the stream kernel's own finish), rowkernel
# (the row kernel for forward jobs), persist0 (the L2's persisting set-aside set to 0 before
# timing). BENCH_ARGS="--shapes 16384x32000,16384x50257,8192x128256" narrows each run to a few
# shapes (a fraction of the device time).
for f in ${AB_VARIANTS:-default groups1 groups2}; do
  args=()
  case $f in
    persist0) args=(--l2-persist-kb 0) ;;
    *) args=(--variant "$f") ;;
  esac
  timeout -k 5 "${BENCH_TIMEOUT:-150}" "$build/bench/fusedce_bench" ${BENCH_ARGS:-} "${args[@]}" --csv "$out/bench_$f.csv" > "$out/bench_$f.md" || status=1
  echo "-- $f"; grep -E "persisting|ceilings|\| (forward|fwd\+grad) \|" "$out/bench_$f.md"
done
fi

if want ce_profile; then
step "ncu: the cross-entropy kernels at the shapes whose gaps docs/performance.md explains"
# DRAM bytes against the formula (forward N V elem read; with the gradient as much again written):
# more read than that with the gradient means its second sweep missed L2.
ncu --clock-control none -k regex:ce_ --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
  "$build/bench/fusedce_bench" --profile > "$out/ce_profile.txt" 2> "$out/ncu_ce.err" || status=1
grep -E "profiled|ce_.*kernel|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Warp Cycles Per Issued|Stall|Grid Size|L2 Hit|dram__bytes|lts__t_sector_hit" "$out/ce_profile.txt" | head -200
fi

if want stalls; then
step "ncu: where the stream kernel's warps wait (fusedce_bench --profile, per-SASS stall samples)"
# Launches 0-9 of the stream kernel: per case a warm-up, then the one to read (odd indices).
rc=0
ncu --clock-control none -k regex:ce_stream_kernel --launch-skip 1 --launch-count 7 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
  --import-source yes -f -o "$out/stalls" "$build/bench/fusedce_bench" --profile > "$out/stalls_run.log" 2>&1 || rc=1
if [ $rc -eq 0 ]; then
  ncu -i "$out/stalls.ncu-rep" --page details > "$out/stalls_details.txt" 2>&1
  ncu -i "$out/stalls.ncu-rep" --page source --csv --print-source sass 2> "$out/stalls_src.err" | gzip > "$out/stalls_sass.csv.gz"
  grep -E "ce_stream_kernel|Duration|DRAM Throughput|Warp Cycles Per Issued|Issued Warp|Stall|L2 Hit" "$out/stalls_details.txt" | head -80
else
  tail -20 "$out/stalls_run.log"; status=1
fi
rm -f "$out/stalls.ncu-rep"
fi

if want hub; then
step "Kernels Hub package: the CUDA variant built against this machine's torch, checked on the GPU"
rc=0
HF_HUB_OFFLINE=1 FUSEDCE_PYTHON=$(command -v python3) bash scripts/build_kernels_hub.sh --cuda /tmp/fusedce-hub \
  > "$out/hub_build.log" 2>&1 || { tail -30 "$out/hub_build.log"; rc=1; }
if [ $rc -eq 0 ]; then
  HF_HUB_OFFLINE=1 python3 tests/python/hub_checks.py /tmp/fusedce-hub --backend cuda > "$out/hub_checks.log" 2>&1 || rc=1
  tail -20 "$out/hub_checks.log"
fi
note "hub: exit $rc"
[ $rc -eq 0 ] || status=1
fi
exit $status
