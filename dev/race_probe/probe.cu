// racecheck probe: does compute-sanitizer's racecheck accept the stream kernel's ring protocol?
//
// The stream kernel reports write-after-read hazards between a bulk copy into a ring stage and
// the consumers' earlier reads of that stage, once the ring wraps (docs/performance.md). This probe
// runs the same protocol, stripped down, in two forms:
//   bulk:    a producer thread waits on the stage's `empty` mbarrier, then cp.async.bulk fills
//            the stage and completes on its `full` mbarrier (the stream kernel's protocol);
//   generic: the same barriers, but the producer warp fills the stage with ordinary shared
//            stores before arriving on `full` (no async proxy).
// Consumers (4 warps) read a stage, __syncwarp, and one lane per warp arrives on `empty`.
// Both forms check their sums against the host. Build, then run each under racecheck:
//   nvcc -std=c++17 -O2 -arch=sm_90 -Isrc dev/race_probe/probe.cu -o build-probe/race_probe
//   compute-sanitizer --tool racecheck build-probe/race_probe bulk   (and: ... generic)
// If racecheck flags `bulk` but not `generic`, it does not model the mbarrier ordering of
// async-proxy writes, and the stream kernel's report is the same false positive.
// What it shows on an H200: racecheck flags both forms (bulk 8 hazards, generic 4) with correct
// sums, so it cannot judge a ring. A hazard in a ring can still be real: a consumer must not
// arrive on `empty` before its shared-memory reads have returned (the stream kernel's
// release_stage in src/cuda/ce/stream_producer.cuh makes the arrive depend on the loaded words). The consumer loop below arrives the same
// way (its sums are only checked, not timed under load); do not copy it into a kernel.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/tma.cuh"

namespace {

constexpr int kStages = 4;
constexpr int kStageBytes = 4096;
constexpr int kChunks = 64;  // 16 passes over the ring
constexpr int kConsumerWarps = 4;
constexpr int kWords = kStageBytes / 4;

template <bool kBulk>
__global__ void ring_kernel(const uint32_t* src, unsigned long long* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace fusedce::cuda;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kStages], empty[kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&full[i], kBulk ? 1 : 32);
      mbar_init(&empty[i], kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (warp == kConsumerWarps) {  // producer
    for (int n = 0; n < kChunks; ++n) {
      const int stage = n % kStages;
      mbar_wait(&empty[stage], ((n / kStages) & 1) ^ 1);
      uint32_t* dst = reinterpret_cast<uint32_t*>(smem + stage * kStageBytes);
      const uint32_t* from = src + size_t(n) * kWords;
      if (kBulk) {
        if (lane == 0) {
          mbar_arrive_expect_tx(&full[stage], kStageBytes);
          bulk_load(dst, from, kStageBytes, &full[stage]);
        }
      } else {
        for (int i = lane; i < kWords; i += 32) dst[i] = from[i];
        mbar_arrive(&full[stage]);
      }
    }
    return;
  }
  unsigned long long sum = 0;
  for (int n = 0; n < kChunks; ++n) {
    const int stage = n % kStages;
    mbar_wait(&full[stage], (n / kStages) & 1);
    const uint32_t* buf = reinterpret_cast<const uint32_t*>(smem + stage * kStageBytes);
    for (int i = threadIdx.x; i < kWords; i += kConsumerWarps * 32) sum += buf[i];
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[stage]);
  }
  atomicAdd(out, sum);
#endif
}

template <bool kBulk>
bool run(const uint32_t* d_src, unsigned long long expect, const char* name) {
  unsigned long long* d_out;
  cudaMalloc(&d_out, sizeof(*d_out));
  cudaMemset(d_out, 0, sizeof(*d_out));
  ring_kernel<kBulk><<<1, (kConsumerWarps + 1) * 32, kStages * kStageBytes>>>(d_src, d_out);
  unsigned long long got = 0;
  cudaError_t e = cudaMemcpy(&got, d_out, sizeof(got), cudaMemcpyDeviceToHost);
  cudaFree(d_out);
  std::printf("%-8s sum %llu, expected %llu: %s (%s)\n", name, got, expect, got == expect ? "ok" : "WRONG",
              cudaGetErrorString(e));
  return e == cudaSuccess && got == expect;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string form = argc > 1 ? argv[1] : "both";
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major < 9) {
    std::printf("race_probe: needs an sm_90 GPU\n");
    return 0;
  }
  std::vector<uint32_t> h(size_t(kChunks) * kWords);
  unsigned long long expect = 0;
  for (size_t i = 0; i < h.size(); ++i) expect += h[i] = static_cast<uint32_t>((i * 2654435761u) >> 7);
  uint32_t* d_src;
  cudaMalloc(&d_src, h.size() * 4);
  cudaMemcpy(d_src, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  bool ok = true;
  if (form != "generic") ok &= run<true>(d_src, expect, "bulk");
  if (form != "bulk") ok &= run<false>(d_src, expect, "generic");
  cudaFree(d_src);
  return ok ? 0 : 1;
}
