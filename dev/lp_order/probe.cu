// The fused log-probability products (src/cuda/logprobs/lp_fused_products.cu) against cuBLASLt's
// plain logits product of the same shape, at every tile order of CUTLASS's persistent scheduler:
// raster order (heuristic, along M, along N) x swizzle size (1, 2, 4, 8). The library runs them
// at one fixed order (kLpTileOrder); this says which order that should be, and how far the fused
// kernels are from the plain product at each. A probe, not a benchmark, and no check of values
// (the library's tests check the kernels; the order changes which CTA computes a tile, never
// what a tile computes).
//
// Shapes: the GRPO head's (8192 x 896 x 151936: the statistics product over all rows, over the
// 1365-row token chunks the forward's default plan runs, and the gradient product over the 50688-
// column vocabulary chunks of the backward's plan and over all columns), and 8192 x 4096 x 151936
// for contrast. Timing: CUDA events over 10 calls after 2, median of 3 such; the inputs (the
// weight: 272 MB at V = 151936, H = 896) are larger than L2. Each line: ms and the ratio to
// cuBLASLt's product of the same rows and columns (bf16 output, its first heuristic choice).
//
// Build from the repository root (sm_90a; the kernels are compiled into the probe from the
// library's source file, nothing else of the library is linked):
//   I=build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -Iinclude -Isrc -I$I \
//        dev/lp_order/probe.cu -o build-probe/lp_order -lcublasLt
// Run: build-probe/lp_order            every order of every case
//      build-probe/lp_order --library  each case at the library's own order only, with the
//                                      distribution statistics (TRL's all-outputs head) as well
//      build-probe/lp_order --library <text>  only the cases whose name holds <text> (for ncu)
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../src/cuda/logprobs/lp_fused_products.cu"

namespace {

using fusedce::cuda::LpEpiParams;
using fusedce::cuda::LpFusedGrad;
using fusedce::cuda::LpFusedProduct;
using fusedce::cuda::LpRows;
using fusedce::cuda::LpTileOrder;
using fusedce::cuda::RasterOrder;

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)
#define LT(x)                                                                   \
  do {                                                                          \
    cublasStatus_t s_ = (x);                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                          \
      std::fprintf(stderr, "%s:%d: %s: cuBLASLt %d\n", __FILE__, __LINE__, #x, int(s_)); \
      std::exit(2);                                                             \
    }                                                                           \
  } while (0)

__global__ void fill_bf16(__nv_bfloat16* x, size_t n, float scale, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2bfloat16(scale * (float(h & 0xffffff) / 16777216.0f - 0.5f));
  }
}

__global__ void fill_targets(int64_t* t, int64_t n, int64_t vocab) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    t[i] = (i * 7919) % vocab;
}

__global__ void fill_f32(float* x, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = v;
}

template <class F>
float median_ms(F f, cudaStream_t s) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) f();
  std::vector<float> t;
  for (int r = 0; r < 3; ++r) {
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < 10; ++i) f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / 10);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[1];
}

/// cuBLASLt's bf16 logits product, logits^T (cols x rows) = weight (H x cols)^T . hidden (H x
/// rows), as the library runs it: its first heuristic choice.
struct LtProduct {
  cublasLtMatmulDesc_t op{};
  cublasLtMatrixLayout_t a{}, b{}, d{};
  cublasLtMatmulHeuristicResult_t heur{};
  void* ws = nullptr;
  size_t wsb = size_t(32) << 20;
  LtProduct(cublasLtHandle_t lt, int64_t rows, int64_t cols, int64_t H) {
    LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    LT(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, H, cols, H));
    LT(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, H, rows, H));
    LT(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, cols, rows, cols));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, d, d, pref, 1, &heur, &found));
    if (found == 0) std::exit(3);
    LT(cublasLtMatmulPreferenceDestroy(pref));
    CK(cudaMalloc(&ws, wsb));
  }
  void run(cublasLtHandle_t lt, const void* weight, const void* hidden, void* out, cudaStream_t s) {
    const float one = 1.0f, zero = 0.0f;
    LT(cublasLtMatmul(lt, op, &one, weight, a, hidden, b, &zero, out, d, out, d, &heur.algo, ws, wsb, s));
  }
};

const char* raster_name(RasterOrder r) {
  return r == RasterOrder::AlongM ? "along M" : r == RasterOrder::AlongN ? "along N" : "heuristic";
}

}  // namespace

int main(int argc, char** argv) {
  const bool library = argc > 1 && std::string(argv[1]) == "--library";
  const std::string only = library && argc > 2 ? argv[2] : "";
  struct Case {
    const char* what;
    int64_t rows, H, cols;
    bool grad, dist = false;
  };
  const Case cases[] = {
      {"statistics, all rows (GRPO head)", 8192, 896, 151936, false},
      {"statistics, a 1365-row chunk (the forward's default plan)", 1365, 896, 151936, false},
      {"gradient, a 50688-column chunk (the backward's plan)", 8192, 896, 50688, true},
      {"gradient, all columns", 8192, 896, 151936, true},
      {"statistics, H = 4096", 8192, 4096, 151936, false},
      {"distribution statistics, all rows", 8192, 896, 151936, false, true},
  };
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasLtHandle_t lt;
  LT(cublasLtCreate(&lt));
  const int64_t maxN = 8192, maxV = 151936, maxH = 4096;
  __nv_bfloat16 *hidden, *weight, *out;
  int64_t* target;
  float* rowf;
  float4* partials;
  CK(cudaMalloc(&hidden, size_t(maxN) * maxH * 2));
  CK(cudaMalloc(&weight, size_t(maxV) * maxH * 2));
  CK(cudaMalloc(&out, size_t(maxN) * maxV * 2));
  CK(cudaMalloc(&target, size_t(maxN) * 8));
  CK(cudaMalloc(&rowf, size_t(maxN) * 4));
  CK(cudaMalloc(&partials, 2 * size_t(maxN) * fusedce::cuda::lp_fused_tiles(maxV) * sizeof(float4)));
  fill_bf16<<<1024, 256, 0, s>>>(hidden, size_t(maxN) * maxH, 2.0f, 1u);
  fill_bf16<<<1024, 256, 0, s>>>(weight, size_t(maxV) * maxH, 0.2f, 2u);
  fill_targets<<<64, 256, 0, s>>>(target, maxN, maxV);
  fill_f32<<<64, 256, 0, s>>>(rowf, maxN, 0.5f);
  CK(cudaStreamSynchronize(s));
  int dev = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s\n\n| case | rows x H x cols | cuBLASLt ms | tile order | fused ms | / cuBLASLt |\n"
              "|---|---|---|---|---|---|\n", prop.name);
  for (const Case& c : cases) {
    if ((c.dist && !library) || std::string(c.what).find(only) == std::string::npos) continue;
    LtProduct ref(lt, c.rows, c.cols, c.H);
    const float lt_ms = median_ms([&] { ref.run(lt, weight, hidden, out, s); }, s);
    LpFusedProduct p{};
    p.rows = c.rows;
    p.cols = c.cols;
    p.H = c.H;
    p.hidden = hidden;
    p.ld_hidden = c.H;
    p.weight = weight;
    p.ld_weight = c.H;
    p.r = LpRows{target, 1, true, -100, c.rows, 0, maxV, 1.0f, c.dist};
    p.stream = s;
    p.device = dev;
    LpEpiParams epi{};
    epi.r = p.r;
    if (c.grad) {
      LpFusedGrad g{};
      g.lse = g.logprob = g.entropy = g.g_lp = g.g_h = rowf;
      g.lse_stride = g.logprob_stride = g.entropy_stride = g.g_lp_stride = g.g_h_stride = 1;
      g.dlogits = out;
      g.ld_dlogits = c.cols;
      epi.g = g;
    } else {
      epi.partials = partials;
      epi.tiles = fusedce::cuda::lp_fused_tiles(c.cols);
    }
    for (RasterOrder r : {RasterOrder::Heuristic, RasterOrder::AlongM, RasterOrder::AlongN}) {
      for (int sw : {1, 2, 4, 8}) {
        const LpTileOrder order{r, sw};
        const LpTileOrder own = c.grad ? fusedce::cuda::kLpGradOrder : fusedce::cuda::kLpTileOrder;
        if (library && (order.raster != own.raster || order.swizzle != own.swizzle)) continue;
        auto launch = [&] {
          const fusedce::Status st = c.grad ? fusedce::cuda::run_dlogits(p, epi.g, &order)
                                     : c.dist ? fusedce::cuda::run_lp_stats_product(p, partials)
                                              : fusedce::cuda::FusedKernel<false>::run(p, epi, order);
          if (!st.ok()) {
            std::fprintf(stderr, "%s: %s\n", c.what, st.message().c_str());
            std::exit(4);
          }
        };
        const float ms = median_ms(launch, s);
        CK(cudaGetLastError());
        std::printf("| %s | %ld x %ld x %ld | %.3f | %s, swizzle %d | %.3f | %.3f |\n", c.what, long(c.rows),
                    long(c.H), long(c.cols), lt_ms, raster_name(r), sw, ms, ms / lt_ms);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
