// Experiment: can CUTLASS's sm90 products (TMA + WGMMA, warp-specialized, persistent) run the
// linear cross-entropy's three bf16 products faster than cuBLASLt at the linear issue's chunk
// shapes? For each product of a chunk (rows R, hidden H, vocabulary V):
//   logits  D (R x V) = hidden (R x H) . W^T        A row-major, B "column-major" (W is V x H)
//   grad_h  D (R x H) = dlogits (R x V) . W (V x H)  A row-major, B row-major
//   grad_w  D (V x H) = dlogits^T . hidden (R x H)   A column-major, B row-major
// it times cuBLASLt's first heuristic choice (what the library runs), its next seven, and three
// CUTLASS tile / cluster shapes under every raster order and swizzle of the persistent
// scheduler; then the best CUTLASS and best cuBLASLt candidates against cuBLASLt's first choice
// in interleaved rounds (medians of rounds). Each CUTLASS candidate is checked against
// cuBLASLt's output first (max |diff| / max |ref|, bf16 output).
//
// Build (no GPU needed; the CUTLASS include dir is the one CMake unpacks from the pinned wheel,
// e.g. build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include):
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -I<cutlass include dir> \
//     dev/gemm_sweep/probe.cu -o build-probe/gemm_sweep -lcublasLt
// Run (GPU): the binary.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;
using bf16 = cutlass::bfloat16_t;
using RM = cutlass::layout::RowMajor;
using CM = cutlass::layout::ColumnMajor;
using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;

#define CK(x)                                                 \
  do {                                                        \
    cudaError_t e_ = (x);                                     \
    if (e_ != cudaSuccess) {                                  \
      printf("%s: %s\n", #x, cudaGetErrorString(e_));         \
      exit(1);                                                \
    }                                                         \
  } while (0)

template <class Stride>
Stride with_ld(int64_t ld) {
  Stride s{};
  if constexpr (!is_static<remove_cvref_t<decltype(get<0>(s))>>::value) get<0>(s) = ld;
  if constexpr (!is_static<remove_cvref_t<decltype(get<1>(s))>>::value) get<1>(s) = ld;
  return s;
}

// Cooperative: both consumer warpgroups on one tile (each half of its M). Ping-pong: each
// consumer warpgroup a tile of its own, one's epilogue under the other's main loop.
struct Coop {
  using K = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using E = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct PingPong {
  using K = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using E = cutlass::epilogue::TmaWarpSpecialized;
};

template <class LA, class LB, class Tile, class Cluster, class Sched = Coop, class TileScheduler = void>
struct Kernel {
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, RM, 8, bf16, RM, 8, typename Sched::E>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, LA, 8, bf16, LB, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      typename Sched::K>::CollectiveOp;
  using GK = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GK>;

  // D (M x N row-major) = A . B; lda / ldb the operands' leading dimensions.
  static bool run(int M, int N, int K, const bf16* a, int64_t lda, const bf16* b, int64_t ldb, bf16* d, Raster raster,
                  int swizzle, void* ws, size_t wsb, cudaStream_t s) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {M, N, K, 1},
                                  {a, with_ld<typename GK::StrideA>(lda), b, with_ld<typename GK::StrideB>(ldb)},
                                  {{1.0f, 0.0f}, nullptr, with_ld<typename GK::StrideC>(N), d, with_ld<typename GK::StrideD>(N)},
                                  hw};
    args.scheduler.raster_order = raster;
    args.scheduler.max_swizzle_size = swizzle;
    Gemm g;
    if (g.can_implement(args) != cutlass::Status::kSuccess) return false;
    if (Gemm::get_workspace_size(args) > wsb) return false;
    if (g.initialize(args, ws, s) != cutlass::Status::kSuccess) return false;
    return g.run(s) == cutlass::Status::kSuccess;
  }
};

using T128x256 = Shape<_128, _256, _64>;
using T256x128 = Shape<_256, _128, _64>;
using C2x1 = Shape<_2, _1, _1>;
using C1x2 = Shape<_1, _2, _1>;

// One product's CUTLASS candidates: (name, runner) for each tile / cluster shape.
using Runner = std::function<bool(int, int, int, const bf16*, int64_t, const bf16*, int64_t, bf16*, Raster, int, void*,
                                  size_t, cudaStream_t)>;
using T128x192 = Shape<_128, _192, _64>;
using T256x192 = Shape<_256, _192, _64>;
template <class LA, class LB>
std::vector<std::pair<std::string, Runner>> candidates() {
  return {{"128x256 c2x1", Kernel<LA, LB, T128x256, C2x1>::run},
          {"256x128 c1x2", Kernel<LA, LB, T256x128, C1x2>::run},
          {"128x256 c1x2", Kernel<LA, LB, T128x256, C1x2>::run}};
}
// The logits product's extra shapes: V = 128256 is 668 tiles of 192, and 4096 or 8192 rows are
// whole tiles of 128. Ping-pong 128 x 192 (192 accumulator registers a consumer thread),
// cooperative 256 x 192.
template <class LA, class LB>
std::vector<std::pair<std::string, Runner>> logits_candidates() {
  auto v = candidates<LA, LB>();
  v.push_back({"pp 128x192 c2x1", Kernel<LA, LB, T128x192, C2x1, PingPong>::run});
  v.push_back({"pp 128x192 c1x2", Kernel<LA, LB, T128x192, C1x2, PingPong>::run});
  v.push_back({"coop 256x192 c2x1", Kernel<LA, LB, T256x192, C2x1>::run});
  return v;
}
// grad_hidden at 4096 rows: 512 tiles of 128 x 256 on 132 SMs (3.9 waves); stream-K splits the
// last wave's K.
template <class LA, class LB>
std::vector<std::pair<std::string, Runner>> grad_h_candidates() {
  auto v = candidates<LA, LB>();
  v.push_back({"128x256 c2x1 stream-K", Kernel<LA, LB, T128x256, C2x1, Coop, cutlass::gemm::StreamKScheduler>::run});
  return v;
}

template <class F>
float time_it(F f, cudaStream_t s, int reps = 10) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, s);
    f();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[t.size() / 2];
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// cuBLASLt's algorithms for row-major D (M x N) = A . B, A row-major (a_rm) or column-major,
/// B row-major (b_rm) or column-major; bf16 in and out, float32 compute. Column-major view:
/// D^T (N x M) = B^T A^T.
struct LtProduct {
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t lx, ly, ld;
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
  LtProduct(cublasLtHandle_t handle, int M, int N, int K, bool a_rm, bool b_rm, size_t wsb, const bf16* bias = nullptr,
            int want = 8, bool f32_out = false)
      : h(handle) {
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (bias) {  // a bias over D's columns (cuBLASLt's rows of the column-major D^T), bf16
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bt = CUDA_R_16BF;
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt));
    }
    // X stands for B^T (N x K): B row-major (K x N, N contiguous) is column-major N x K: op N;
    // B column-major (K contiguous) is column-major K x N: op T.
    const cublasOperation_t tx = b_rm ? CUBLAS_OP_N : CUBLAS_OP_T;
    // Y stands for A^T (K x M): A row-major is column-major K x M: op N; A column-major is M x K: op T.
    const cublasOperation_t ty = a_rm ? CUBLAS_OP_N : CUBLAS_OP_T;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tx, sizeof(tx));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &ty, sizeof(ty));
    if (b_rm) cublasLtMatrixLayoutCreate(&lx, CUDA_R_16BF, N, K, N);
    else cublasLtMatrixLayoutCreate(&lx, CUDA_R_16BF, K, N, K);
    if (a_rm) cublasLtMatrixLayoutCreate(&ly, CUDA_R_16BF, K, M, K);
    else cublasLtMatrixLayoutCreate(&ly, CUDA_R_16BF, M, K, M);
    cublasLtMatrixLayoutCreate(&ld, f32_out ? CUDA_R_32F : CUDA_R_16BF, N, M, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
    algos.resize(want);
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(h, op, lx, ly, ld, ld, pref, want, algos.data(), &found);
    algos.resize(found);
    cublasLtMatmulPreferenceDestroy(pref);
  }
  bool run(int i, const bf16* a, const bf16* b, bf16* d, void* ws, size_t wsb, cudaStream_t s) {
    const float alpha = 1, beta = 0;
    return cublasLtMatmul(h, op, &alpha, b, lx, a, ly, &beta, d, ld, d, ld, &algos[i].algo, ws, wsb, s) ==
           CUBLAS_STATUS_SUCCESS;
  }
};

/// An algorithm's configuration in cuBLASLt's own ids: algo, tile, stages, split-K, reduction
/// scheme, CTA swizzle, custom option, cluster shape.
std::string describe(const cublasLtMatmulAlgo_t& a) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;
    size_t n = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &n);
    return v;
  };
  char buf[160];
  snprintf(buf, sizeof buf, "id %u tile %u stages %u splitK %u red %u swz %u custom %u cluster %u",
           get(CUBLASLT_ALGO_CONFIG_ID), get(CUBLASLT_ALGO_CONFIG_TILE_ID), get(CUBLASLT_ALGO_CONFIG_STAGES_ID),
           get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM), get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
           get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
           get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
  return buf;
}

__global__ void fill_random(bf16* p, size_t n, float scale, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = bf16(((x & 0xffff) / 65536.0f + (x >> 16) / 65536.0f - 1.0f) * scale);
  }
}

__global__ void max_abs_diff(const bf16* a, const bf16* b, size_t n, float* out) {
  float w = 0, m = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    w = fmaxf(w, fabsf(float(a[i]) - float(b[i])));
    m = fmaxf(m, fabsf(float(b[i])));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(w));
  atomicMax(reinterpret_cast<int*>(out) + 1, __float_as_int(m));
}

/// max |d - ref| / max |ref| over n elements (0: the same bits).
float rel_diff(const bf16* d, const bf16* ref, size_t n, float* scratch, cudaStream_t s) {
  CK(cudaMemsetAsync(scratch, 0, 8, s));
  max_abs_diff<<<1024, 256, 0, s>>>(d, ref, n, scratch);
  float dm[2];
  CK(cudaMemcpy(dm, scratch, 8, cudaMemcpyDeviceToHost));
  return dm[0] / std::max(dm[1], 1e-30f);
}

const char* raster_name(Raster r) { return r == Raster::AlongM ? "M" : r == Raster::AlongN ? "N" : "H"; }

int main(int argc, char** argv) {
  const bool bias_only = argc > 1 && std::string(argv[1]) == "lt-bias";
  // lt-gradh: grad_hidden's candidates over hidden sizes 2048-5120 at 4096 rows (is a 256 x 96
  // preference a rule of the hidden size or of one shape?).
  const bool gradh_only = argc > 1 && std::string(argv[1]) == "lt-gradh";
  // lt-distill: the fused distillation's chunk shapes (H 4096, V 128256; 1664 rows is the default
  // budget's chunk of 8192, 2048 a quarter, 1536 the last of five), up to 24 candidates each,
  // grad_hidden into float32 as the library writes it.
  const bool distill = argc > 1 && std::string(argv[1]) == "lt-distill";
  const bool lt_only = bias_only || gradh_only || distill || (argc > 1 && std::string(argv[1]) == "lt");
  struct Shape3 {
    int R, H, V;
  };
  // Chunk shapes of the issue's five calls: 4096 x 4096 x 128256 and the one-chunk 8192 ones
  // as they are; 16384 x 2304 x 256000 in chunks of 4096 rows; 32768 x 4096 x 128256 in 8192.
  std::vector<Shape3> shapes = {{4096, 4096, 128256}, {8192, 4096, 128256}, {8192, 4096, 151936}, {4096, 2304, 256000}};
  if (gradh_only) {
    shapes.clear();
    for (int hs : {2048, 2304, 2560, 3072, 3584, 4096, 5120}) shapes.push_back({4096, hs, 128256});
    shapes.push_back({4096, 2304, 256000});
    shapes.push_back({8192, 2304, 256000});
  }
  if (distill) shapes = {{1664, 4096, 128256}, {2048, 4096, 128256}, {1536, 4096, 128256}};
  size_t big = 0, w_el = 0, h_el = 0;
  for (auto c : shapes) {
    big = std::max(big, size_t(c.R) * c.V);
    w_el = std::max(w_el, size_t(c.V) * c.H);
    h_el = std::max(h_el, size_t(c.R) * c.H);
  }
  bf16 *hid, *w, *lg, *d0, *d1;
  CK(cudaMalloc(&hid, h_el * 2));
  CK(cudaMalloc(&w, w_el * 2));
  CK(cudaMalloc(&lg, big * 2));
  const size_t out_el = std::max({big, w_el, h_el});
  CK(cudaMalloc(&d0, out_el * 2));
  CK(cudaMalloc(&d1, out_el * 2));
  float* diff;
  CK(cudaMalloc(&diff, 8));
  const size_t wsb = size_t(32) << 20;  // the library's cuBLASLt workspace
  void* ws;
  CK(cudaMalloc(&ws, wsb));
  // CUTLASS's own workspace (stream-K's partial tiles need more than cuBLASLt's 32 MiB).
  const size_t wsb_c = size_t(512) << 20;
  void* ws_c;
  CK(cudaMalloc(&ws_c, wsb_c));
  fill_random<<<1024, 256>>>(hid, h_el, 1.7f, 1);
  fill_random<<<1024, 256>>>(w, w_el, 0.04f, 2);
  fill_random<<<1024, 256>>>(lg, big, 1e-4f, 3);
  cudaStream_t s;
  cudaStreamCreate(&s);
  cublasLtHandle_t h;
  cublasLtCreate(&h);
  const std::vector<Raster> rasters = {Raster::Heuristic, Raster::AlongM, Raster::AlongN};
  const std::vector<int> swizzles = {1, 2, 4, 8};

  if (lt_only) {
    // Every heuristic candidate of every product: its configuration, its time in interleaved
    // rounds, and whether its output has the bits of candidate #0.
    printf("| chunk R x H x V | product | candidate | configuration | ms (median of 5 rounds) | / #0 | bits of #0 |\n|---|---|---|---|---|---|---|\n");
    for (auto c : shapes) {
      struct P {
        const char* name;
        int M, N, K;
        const bf16 *a, *b;
        bool a_rm, b_rm;
      };
      const P ps[4] = {{"logits", c.R, c.V, c.H, hid, w, true, false},
                       {"logits+bias", c.R, c.V, c.H, hid, w, true, false},
                       {"grad_h", c.R, c.H, c.V, lg, w, true, true},
                       {"grad_w", c.V, c.H, c.R, lg, hid, false, true}};
      for (const P& p : ps) {
        if (bias_only && std::string(p.name) != "logits+bias") continue;
        if (gradh_only && std::string(p.name) != "grad_h") continue;
        if (distill && std::string(p.name) == "logits+bias") continue;
        const bool f32 = distill && std::string(p.name) == "grad_h";
        LtProduct lt(h, p.M, p.N, p.K, p.a_rm, p.b_rm, wsb, std::string(p.name) == "logits+bias" ? w : nullptr,
                     distill ? 24 : 8, f32);
        const int n = int(lt.algos.size());
        std::vector<std::vector<float>> t(n);
        for (int round = 0; round < 5; ++round) {
          for (int i = 0; i < n; ++i) t[i].push_back(time_it([&] { lt.run(i, p.a, p.b, d1, ws, wsb, s); }, s, 6));
        }
        lt.run(0, p.a, p.b, d0, ws, wsb, s);
        const float m0 = median(t[0]);
        for (int i = 0; i < n; ++i) {
          lt.run(i, p.a, p.b, d1, ws, wsb, s);
          // (a float32 output compared as twice the bf16 halves: "the same bits" still holds)
          const float d = rel_diff(d1, d0, size_t(p.M) * p.N * (f32 ? 2 : 1), diff, s);
          printf("| %dx%dx%d | %s | #%d | %s | %.3f | %.3f | %s |\n", c.R, c.H, c.V, p.name, i,
                 describe(lt.algos[i].algo).c_str(), median(t[i]), median(t[i]) / m0, d == 0 ? "yes" : "no");
        }
        fflush(stdout);
      }
    }
    return 0;
  }
  printf("| chunk R x H x V | product | cuBLASLt #0 ms | best other cuBLASLt (ms, ratio) | best CUTLASS (config, ms, ratio) | check |\n|---|---|---|---|---|---|\n");
  for (auto c : shapes) {
    struct Prod {
      const char* name;
      int M, N, K;
      const bf16 *a, *b;
      int64_t lda, ldb;
      bool a_rm, b_rm;
      std::vector<std::pair<std::string, Runner>> cands;
    };
    std::vector<Prod> prods = {
        {"logits", c.R, c.V, c.H, hid, w, c.H, c.H, true, false, logits_candidates<RM, CM>()},
        {"grad_h", c.R, c.H, c.V, lg, w, c.V, c.H, true, true, grad_h_candidates<RM, RM>()},
        {"grad_w", c.V, c.H, c.R, lg, hid, c.V, c.H, false, true, candidates<CM, RM>()},
    };
    for (auto& p : prods) {
      LtProduct lt(h, p.M, p.N, p.K, p.a_rm, p.b_rm, wsb);
      if (lt.algos.empty()) {
        printf("| %dx%dx%d | %s | no cuBLASLt algorithm |\n", c.R, c.H, c.V, p.name);
        continue;
      }
      lt.run(0, p.a, p.b, d0, ws, wsb, s);  // the reference output
      // Screening: one timing each.
      const float t0 = time_it([&] { lt.run(0, p.a, p.b, d1, ws, wsb, s); }, s);
      int best_lt = -1;
      float best_lt_ms = 1e30f;
      for (int i = 1; i < int(lt.algos.size()); ++i) {
        const float t = time_it([&] { lt.run(i, p.a, p.b, d1, ws, wsb, s); }, s);
        if (t < best_lt_ms) best_lt_ms = t, best_lt = i;
      }
      int best_c = -1, best_sw = 1;
      Raster best_r = Raster::Heuristic;
      float best_c_ms = 1e30f, worst_check = 0;
      for (int k = 0; k < int(p.cands.size()); ++k) {
        auto& run = p.cands[k].second;
        if (!run(p.M, p.N, p.K, p.a, p.lda, p.b, p.ldb, d1, Raster::Heuristic, 1, ws_c, wsb_c, s)) {
          (void)cudaGetLastError();
          fprintf(stderr, "  %dx%dx%d %s %s: cannot run\n", c.R, c.H, c.V, p.name, p.cands[k].first.c_str());
          continue;
        }
        const float check = rel_diff(d1, d0, size_t(p.M) * p.N, diff, s);
        worst_check = std::max(worst_check, check);
        float mine = 1e30f;
        Raster my_r = Raster::Heuristic;
        int my_sw = 1;
        for (Raster r : rasters) {
          for (int sw : swizzles) {
            const float t = time_it([&] { run(p.M, p.N, p.K, p.a, p.lda, p.b, p.ldb, d1, r, sw, ws_c, wsb_c, s); }, s);
            if (t < mine) mine = t, my_r = r, my_sw = sw;
            if (t < best_c_ms) best_c_ms = t, best_c = k, best_r = r, best_sw = sw;
          }
        }
        // Each candidate's best screening time against cuBLASLt #0's (stderr: the table stays on stdout).
        fprintf(stderr, "  %dx%dx%d %s %-24s raster %s swizzle %d: %.3f ms (%.3f x #0 screen), check %.1e\n", c.R, c.H,
                c.V, p.name, p.cands[k].first.c_str(), raster_name(my_r), my_sw, mine, mine / t0, check);
      }
      CK(cudaGetLastError());
      // Interleaved rounds: cuBLASLt #0, the best other cuBLASLt, the best CUTLASS.
      std::vector<float> r0, r1, r2;
      for (int round = 0; round < 5; ++round) {
        r0.push_back(time_it([&] { lt.run(0, p.a, p.b, d1, ws, wsb, s); }, s));
        if (best_lt >= 0) r1.push_back(time_it([&] { lt.run(best_lt, p.a, p.b, d1, ws, wsb, s); }, s));
        if (best_c >= 0) {
          auto& run = p.cands[best_c].second;
          r2.push_back(time_it([&] { run(p.M, p.N, p.K, p.a, p.lda, p.b, p.ldb, d1, best_r, best_sw, ws_c, wsb_c, s); }, s));
        }
      }
      const float m0 = median(r0);
      char lt_s[64] = "-", c_s[128] = "-";
      if (best_lt >= 0) snprintf(lt_s, sizeof lt_s, "#%d %.3f, %.3f", best_lt, median(r1), median(r1) / m0);
      if (best_c >= 0)
        snprintf(c_s, sizeof c_s, "%s raster %s swizzle %d: %.3f, %.3f", p.cands[best_c].first.c_str(),
                 raster_name(best_r), best_sw, median(r2), median(r2) / m0);
      printf("| %dx%dx%d | %s | %.3f (screen %.3f) | %s | %s | %.1e |\n", c.R, c.H, c.V, p.name, m0, t0, lt_s, c_s,
             worst_check);
      fflush(stdout);
    }
  }
  return 0;
}
