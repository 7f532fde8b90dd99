// Experiment: CUTLASS sm90 GEMM configurations against cuBLASLt on the three products of the
// linear cross-entropy (logits, grad_hidden, grad_weight), bf16 in, float32 accumulation.
// Prints the median of CUDA-event timings per config. The inputs are random: on a constant bit
// pattern the products run at other speeds than on real data (docs/performance.md).
// Build (no GPU needed; the CUTLASS include dir is the one CMake unpacks from the pinned wheel,
// e.g. build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include):
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -I<cutlass include dir> \
//     dev/cutlass_probe/probe.cu -o build-probe/cutlass_probe -lcublasLt
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;
using bf16 = cutlass::bfloat16_t;

// A stride of one operand with leading dimension `ld`: the dynamic one of the first two modes.
template <class Stride>
Stride with_ld(int64_t ld) {
  Stride s{};
  if constexpr (!cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) cute::get<0>(s) = ld;
  if constexpr (!cute::is_static<cute::remove_cvref_t<decltype(cute::get<1>(s))>>::value) cute::get<1>(s) = ld;
  return s;
}

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1);} } while (0)

template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Tile, class Cluster, class KSched, class ESched>
struct Cfg {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementC, cutlass::layout::RowMajor, 16 / sizeof(ElementC),
      ElementD, cutlass::layout::RowMajor, 16 / sizeof(ElementD), ESched>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, LayoutA, 8, bf16, LayoutB, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // D (M x N, row-major, ldd) = A (M x K) B (K x N) + beta C
  static bool run(int M, int N, int K, const bf16* A, const bf16* B, const ElementC* C, ElementD* D, float beta,
                  void* ws, size_t ws_bytes, cudaStream_t s, int swizzle) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SC = typename Kernel::StrideC;
    using SD = typename Kernel::StrideD;
    // Packed operands: a row-major A has ld K, a column-major one M; B likewise with N.
    SA sa = with_ld<SA>(std::is_same_v<LayoutA, cutlass::layout::RowMajor> ? K : M);
    SB sb = with_ld<SB>(std::is_same_v<LayoutB, cutlass::layout::RowMajor> ? N : K);
    SC sc = with_ld<SC>(N);
    SD sd = with_ld<SD>(N);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1}, {A, sa, B, sb},
                                  {{1.0f, beta}, C, sc, D, sd}, hw};
    args.scheduler.max_swizzle_size = swizzle;
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    if (Gemm::get_workspace_size(args) > ws_bytes) return false;
    if (gemm.initialize(args, ws, s) != cutlass::Status::kSuccess) return false;
    return gemm.run(s) == cutlass::Status::kSuccess;
  }
};

using RM = cutlass::layout::RowMajor;
using CM = cutlass::layout::ColumnMajor;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using ECoop = cutlass::epilogue::TmaWarpSpecializedCooperative;
using EPing = cutlass::epilogue::TmaWarpSpecialized;

// Product kinds: logits = hidden (n x H, RM) . W^T (B = K x N with W (N x K) RM -> CM);
// grad_hidden = dlogits (n x V, RM) . W (V x H, RM); grad_weight = dlogits^T (CM) . hidden (RM).
#define CONFIGS(LA, LB, EC, ED)                                                                        \
  X(LA, LB, EC, ED, Shape<_128 COMMA _256 COMMA _64>, Shape<_2 COMMA _1 COMMA _1>, Coop, ECoop, "coop128x256c2x1") \
  X(LA, LB, EC, ED, Shape<_128 COMMA _256 COMMA _64>, Shape<_1 COMMA _2 COMMA _1>, Coop, ECoop, "coop128x256c1x2") \
  X(LA, LB, EC, ED, Shape<_256 COMMA _128 COMMA _64>, Shape<_1 COMMA _2 COMMA _1>, Coop, ECoop, "coop256x128c1x2")
#define COMMA ,

struct Bufs {
  bf16 *x, *y, *z;
  float* acc;
  void* ws;
};

// Bell-shaped random bf16 (a sum of two uniforms): the matrix units draw more power on random
// bits than on a constant pattern, and the clocks follow, so timings need realistic data.
__global__ void fill_random(bf16* p, size_t n, float scale, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    const float u = (x & 0xffff) / 65536.0f + (x >> 16) / 65536.0f - 1.0f;
    p[i] = bf16(u * scale);
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
static float time_it(F f, cudaStream_t s, int reps = 20) {
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
  return median(t);
}

// cuBLASLt reference: row-major D (M x N) = A (M x K) B (K x N): column-major D^T = B^T A^T.
static float cublas_time(cublasLtHandle_t h, int M, int N, int K, bool a_rm, bool b_rm, const bf16* A, const bf16* B,
                         void* D, bool d_f32, float beta, void* ws, size_t wsb, cudaStream_t s) {
  cublasLtMatmulDesc_t op;
  cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  // column-major view: D^T (N x M) = op(B^T) (N x K) . op(A^T) (K x M)
  cublasOperation_t tb = b_rm ? CUBLAS_OP_N : CUBLAS_OP_T;  // B row-major (K x N) = col-major N x K
  cublasOperation_t ta = a_rm ? CUBLAS_OP_N : CUBLAS_OP_T;
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tb, sizeof(tb));
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &ta, sizeof(ta));
  cublasLtMatrixLayout_t la, lb, ld;
  if (b_rm) cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, N, K, N); else cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K);
  if (a_rm) cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K); else cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, M, K, M);
  cublasLtMatrixLayoutCreate(&ld, d_f32 ? CUDA_R_32F : CUDA_R_16BF, N, M, N);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
  cublasLtMatmulHeuristicResult_t r;
  int n = 0;
  cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &r, &n);
  if (n == 0) return -1;
  float alpha = 1.0f;
  return time_it([&] { cublasLtMatmul(h, op, &alpha, b_rm ? (const void*)B : (const void*)B, la, A, lb, &beta, D, ld, D, ld, &r.algo, ws, wsb, s); }, s);
}

int main(int argc, char** argv) {
  struct Case { int n, H, V; };
  std::vector<Case> cases = {{4096, 4096, 128256}, {8192, 4096, 128256}, {8192, 2304, 256000}, {6656, 4096, 128256}};
  size_t maxe = 0;
  for (auto c : cases) maxe = std::max({maxe, size_t(c.n) * c.V, size_t(c.V) * c.H, size_t(c.n) * c.H});
  Bufs b;
  CK(cudaMalloc(&b.x, maxe * 2));
  CK(cudaMalloc(&b.y, maxe * 2));
  CK(cudaMalloc(&b.z, maxe * 2));
  CK(cudaMalloc(&b.acc, maxe * 4));
  size_t wsb = size_t(64) << 20;
  CK(cudaMalloc(&b.ws, wsb));
  fill_random<<<1024, 256>>>(b.x, maxe, 2.0f, 1);
  fill_random<<<1024, 256>>>(b.y, maxe, 0.05f, 2);
  CK(cudaMemset(b.acc, 0, maxe * 4));
  cudaStream_t s;
  cudaStreamCreate(&s);
  cublasLtHandle_t h;
  cublasLtCreate(&h);
  int swz = argc > 1 ? atoi(argv[1]) : 1;
  for (auto c : cases) {
    const int n = c.n, H = c.H, V = c.V;
    printf("== n %d H %d V %d (swizzle %d)\n", n, H, V, swz);
    // logits: M=n N=V K=H, A=hidden RM, B: W (V x H RM) as K x N col-major
    float tl = cublas_time(h, n, V, H, true, false, b.x, b.y, b.z, false, 0.f, b.ws, wsb, s);
    float tg = cublas_time(h, n, H, V, true, true, b.x, b.y, b.z, false, 0.f, b.ws, wsb, s);
    float tw = cublas_time(h, V, H, n, false, true, b.x, b.y, b.acc, true, 1.f, b.ws, wsb, s);
    double fl = 2.0 * n * H * V;
    printf("cublas       logits %7.3f ms (%5.0f TF)  gh %7.3f (%5.0f)  gw_f32acc %7.3f (%5.0f)  sum %7.3f\n", tl,
           fl / tl / 1e9, tg, fl / tg / 1e9, tw, fl / tw / 1e9, tl + tg + tw);
#define X(LA, LB, EC, ED, T, C, K, E, NAME) \
    { float t = time_it([&] { Cfg<LA, LB, EC, ED, T, C, K, E>::run(M_, N_, K_, A_, B_, CC_, DD_, BETA_, b.ws, wsb, s, swz); }, s); \
      bool ok = Cfg<LA, LB, EC, ED, T, C, K, E>::run(M_, N_, K_, A_, B_, CC_, DD_, BETA_, b.ws, wsb, s, swz); \
      printf("  %-18s %-8s %7.3f ms (%5.0f TF)%s\n", NAME, KIND_, t, fl / t / 1e9, ok ? "" : " FAILED"); }
    {
      int M_ = n, N_ = V, K_ = H; const bf16 *A_ = b.x, *B_ = b.y; bf16* CC_ = b.z; bf16* DD_ = b.z; float BETA_ = 0.f;
      const char* KIND_ = "logits";
      CONFIGS(RM, CM, bf16, bf16)
    }
    {
      int M_ = n, N_ = H, K_ = V; const bf16 *A_ = b.x, *B_ = b.y; bf16* CC_ = b.z; bf16* DD_ = b.z; float BETA_ = 0.f;
      const char* KIND_ = "gh";
      CONFIGS(RM, RM, bf16, bf16)
    }
    {
      int M_ = V, N_ = H, K_ = n; const bf16 *A_ = b.x, *B_ = b.y; float* CC_ = b.acc; float* DD_ = b.acc; float BETA_ = 1.f;
      const char* KIND_ = "gw_f32";
      CONFIGS(CM, RM, float, float)
    }
    {
      int M_ = V, N_ = H, K_ = n; const bf16 *A_ = b.x, *B_ = b.y; float* CC_ = b.acc; bf16* DD_ = b.z; float BETA_ = 1.f;
      const char* KIND_ = "gw_f32c_bf16d";
      CONFIGS(CM, RM, float, bf16)
    }
#undef X
    CK(cudaStreamSynchronize(s));
  }
  CK(cudaGetLastError());
  return 0;
}
