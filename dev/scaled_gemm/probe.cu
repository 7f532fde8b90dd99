// Experiment: the third linear design's grad_hidden product with its operand transform in the
// main loop. grad_hidden = diag(r) (E * F) W, where E (rows x V, bf16, vocabulary-contiguous) is
// what the logits product's scaled-exp epilogue stores and F holds one power of two per (row,
// 192-wide vocabulary tile) (docs/architecture.md, "The third linear design"). CUTLASS's sm90
// mixed-input main loop (MainloopSm90TmaGmmaRmemAWarpSpecializedMixedInput) loads A through
// registers and multiplies each (row, K-group) slice by a scale from an (M, K / group) tensor
// before the register-sourced WGMMA. Its collective builder sends only operands of different
// widths there, so the collective is put together here directly: A = (bf16, bf16 scale), K-major;
// B = the head W (V x H, row-major: MN-major, which the register-sourced WGMMA takes for 16-bit
// B); group 192 (three 64-wide K tiles); cooperative, 128 x 256 tiles, float32 out.
//
// Does that product cost what the plain product costs? Timed (interleaved rounds, medians)
// against cuBLASLt's product of the prescaled E * F (what the library runs today on its dlogits)
// and against CUTLASS's own plain cooperative kernel of the same tile on the same prescaled
// operand. Checked first: the scaled product against cuBLASLt's (max |diff| / max |ref|; F is a
// power of two, so E * F is exact in bf16 and the two differ by float32 summation order only),
// and 16 sampled outputs against float64 dot products.
//
// Ran once on an H200 (docs/performance.md, "The scaled grad_hidden on CUTLASS's mixed-input main
// loop"): exact, 1.66-2.04x cuBLASLt.
// Build (the include dir is the one CMake unpacks from the pinned CUTLASS wheel,
// e.g. build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include):
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -I<cutlass include dir> \
//     dev/scaled_gemm/probe.cu -o build-probe/scaled_gemm -lcublasLt
// Run (GPU): the binary; a table row a shape.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
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
using RM = cutlass::layout::RowMajor;
namespace cg = cutlass::gemm;
namespace gd = cutlass::gemm::collective::detail;

#define CK(x)                                                 \
  do {                                                        \
    cudaError_t e_ = (x);                                     \
    if (e_ != cudaSuccess) {                                  \
      printf("%s: %s\n", #x, cudaGetErrorString(e_));         \
      exit(1);                                                \
    }                                                         \
  } while (0)

/// A row- or column-major (rows, cols, batch) stride whose dynamic leading mode is ld (the
/// batch mode's: batch).
template <class Stride>
Stride with_ld(int64_t ld, int64_t batch) {
  Stride s{};
  if constexpr (!is_static<remove_cvref_t<decltype(get<0>(s))>>::value) get<0>(s) = ld;
  if constexpr (!is_static<remove_cvref_t<decltype(get<1>(s))>>::value) get<1>(s) = ld;
  get<2>(s) = batch;
  return s;
}

constexpr int kGroup = 192;  // the logits product's vocabulary tile
using TileMNK = Shape<_128, _256, _64>;
using ClusterMNK = Shape<_1, _1, _1>;
using KSched = cg::KernelTmaWarpSpecializedCooperative;
using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileMNK, ClusterMNK,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RM, 4, float, RM, 4,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

cutlass::KernelHardwareInfo hw_info() {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  return hw;
}

/// The float32 row-major D (M x N) of either kernel's epilogue, no C.
template <class GK>
typename GK::EpilogueArguments epilogue_args(int M, int N, float* d) {
  return {{1.0f, 0.0f}, nullptr, with_ld<typename GK::StrideC>(N, int64_t(M) * N), d,
          with_ld<typename GK::StrideD>(N, int64_t(M) * N)};
}

/// Checks the arguments and the workspace and initializes `gemm` for them.
template <class Gemm>
bool prepare(Gemm& gemm, const typename Gemm::Arguments& args, void* ws, size_t wsb, cudaStream_t s) {
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) > wsb) return false;
  return gemm.initialize(args, ws, s) == cutlass::Status::kSuccess;
}

// The scaled product: A = (E, F) K-major, B = W MN-major.
struct Scaled {
  using StrideA = cutlass::detail::TagToStrideA_t<RM>;
  using StrideB = cutlass::detail::TagToStrideB_t<RM>;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<bf16, bf16, float, TileMNK, GMMA::Major::K, GMMA::Major::MN>(), Layout<Shape<_2, _1, _1>>{}));
  using AtomA = decltype(gd::rs_smem_selector<GMMA::Major::K, bf16, decltype(get<0>(TileMNK{})),
                                              decltype(get<2>(TileMNK{})), false>());
  using AtomB = decltype(gd::rs_smem_selector<GMMA::Major::MN, bf16, decltype(get<1>(TileMNK{})),
                                              decltype(get<2>(TileMNK{})), false>());
  using Carveout = cg::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>;
  static constexpr int kStages = gd::compute_stage_count_or_override_single_affine_transformed_input<
      gd::sm90_smem_capacity_bytes, bf16, bf16, bf16, void, TileMNK, Carveout::bytes, 128>(Carveout{});
  using Policy = cg::MainloopSm90TmaGmmaRmemAWarpSpecializedMixedInput<kStages, ClusterMNK, KSched>;
  using Main = cg::collective::CollectiveMma<Policy, TileMNK, cute::tuple<bf16, bf16>, StrideA, bf16, StrideB, TiledMma,
                                             SM90_TMA_LOAD, AtomA, Copy_Atom<AutoVectorizingCopy, bf16>, cute::identity,
                                             SM90_TMA_LOAD, AtomB, void, cute::identity>;
  using GK = cg::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GK>;
  Gemm gemm;

  // D (M x N, float32, row-major) = (E * F) W; E (M x K) row-major, F (M, K / kGroup) with
  // row index fastest, W (K x N) row-major.
  bool init(int M, int N, int K, const bf16* e, const bf16* f, const bf16* w, float* d, void* ws, size_t wsb,
            cudaStream_t s) {
    const int groups = (K + kGroup - 1) / kGroup;
    typename Main::StrideScale ds = make_stride(_1{}, int64_t(M), int64_t(M) * groups);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {M, N, K, 1},
                                  {e, with_ld<StrideA>(K, int64_t(M) * K), w, with_ld<StrideB>(N, int64_t(K) * N), f,
                                   ds, kGroup},
                                  epilogue_args<GK>(M, N, d),
                                  hw_info()};
    return prepare(gemm, args, ws, wsb, s);
  }
  bool run(cudaStream_t s) { return gemm.run(s) == cutlass::Status::kSuccess; }
};

// CUTLASS's plain product of the same tile and schedule (A K-major, B MN-major, both in shared
// memory), on the prescaled operand.
struct Plain {
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, RM, 8, bf16, RM, 8, float, TileMNK, ClusterMNK,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KSched>::CollectiveOp;
  using GK = cg::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GK>;
  Gemm gemm;
  bool init(int M, int N, int K, const bf16* a, const bf16* w, float* d, void* ws, size_t wsb, cudaStream_t s) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {M, N, K, 1},
                                  {a, with_ld<typename GK::StrideA>(K, int64_t(M) * K), w,
                                   with_ld<typename GK::StrideB>(N, int64_t(K) * N)},
                                  epilogue_args<GK>(M, N, d),
                                  hw_info()};
    return prepare(gemm, args, ws, wsb, s);
  }
  bool run(cudaStream_t s) { return gemm.run(s) == cutlass::Status::kSuccess; }
};

/// cuBLASLt's first heuristic candidate for D (M x N, float32, row-major) = A (M x K, row-major)
/// . B (K x N, row-major), bf16 in, float32 compute: the library's grad_hidden product.
struct Lt {
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulHeuristicResult_t algo{};
  bool ok = false;
  Lt(cublasLtHandle_t handle, int M, int N, int K, size_t wsb) : h(handle) {
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    // column-major view: D^T (N x M) = B^T (N x K) . A^T (K x M), both op N
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, N, K, N);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, M, K);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, N, M, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(h, op, lb, la, ld, ld, pref, 1, &algo, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    ok = found > 0;
  }
  bool run(const bf16* a, const bf16* b, float* d, void* ws, size_t wsb, cudaStream_t s) {
    const float alpha = 1, beta = 0;
    return cublasLtMatmul(h, op, &alpha, b, lb, a, la, &beta, d, ld, d, ld, &algo.algo, ws, wsb, s) ==
           CUBLAS_STATUS_SUCCESS;
  }
};

__device__ uint32_t mix(size_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return x;
}

// E: what the epilogue stores, 2^(z log2 e - k) in (2^-12, 1]; F: 2^-j, j in [0, 20); W: small
// random.
__global__ void fill(bf16* e, bf16* f, bf16* w, int M, int K, int N, int groups) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t t = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (size_t i = t; i < size_t(M) * groups; i += stride) f[i] = bf16(exp2f(-float(mix(i, 7u) % 20u)));
  for (size_t i = t; i < size_t(K) * N; i += stride) w[i] = bf16(((mix(i, 3u) & 0xffff) / 32768.0f - 1.0f) * 0.02f);
  for (size_t i = t; i < size_t(M) * K; i += stride) e[i] = bf16(exp2f(-12.0f * (mix(i, 5u) & 0xffff) / 65536.0f));
}

/// The prescaled operand E * F (exact in bf16: F is a power of two).
__global__ void prescale(const bf16* e, const bf16* f, bf16* pre, int M, int K) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(M) * K; i += stride) {
    const size_t m = i / K, g = (i % K) / kGroup;
    pre[i] = bf16(float(e[i]) * float(f[m + size_t(M) * g]));
  }
}

__global__ void max_abs_diff(const float* a, const float* b, size_t n, float* out) {
  float w = 0, m = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    w = fmaxf(w, fabsf(a[i] - b[i]));
    m = fmaxf(m, fabsf(b[i]));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(w));
  atomicMax(reinterpret_cast<int*>(out) + 1, __float_as_int(m));
}

float rel_diff(const float* d, const float* ref, size_t n, float* scratch) {
  CK(cudaMemset(scratch, 0, 8));
  max_abs_diff<<<1024, 256>>>(d, ref, n, scratch);
  float dm[2];
  CK(cudaMemcpy(dm, scratch, 8, cudaMemcpyDeviceToHost));
  return dm[0] / std::max(dm[1], 1e-30f);
}

template <class F>
float time_it(F f, cudaStream_t s, int reps = 10) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 2; ++i) f();
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

int main() {
  struct Shape3 {
    int M, N, K;  // rows (tokens), hidden, vocabulary
  };
  const std::vector<Shape3> shapes = {{4096, 4096, 128256}, {8192, 4096, 128256}, {2048, 4096, 128256}};
  size_t e_el = 0, w_el = 0, d_el = 0, f_el = 0;
  for (auto c : shapes) {
    e_el = std::max(e_el, size_t(c.M) * c.K);
    w_el = std::max(w_el, size_t(c.K) * c.N);
    d_el = std::max(d_el, size_t(c.M) * c.N);
    f_el = std::max(f_el, size_t(c.M) * ((c.K + kGroup - 1) / kGroup));
  }
  bf16 *e, *f, *w, *pre;
  float *d0, *d1, *scratch;
  CK(cudaMalloc(&e, e_el * 2));
  CK(cudaMalloc(&pre, e_el * 2));
  CK(cudaMalloc(&w, w_el * 2));
  CK(cudaMalloc(&f, f_el * 2));
  CK(cudaMalloc(&d0, d_el * 4));
  CK(cudaMalloc(&d1, d_el * 4));
  CK(cudaMalloc(&scratch, 8));
  // a workspace each: a CUTLASS kernel's tile-scheduler state must not be overwritten by another
  // product between its initialize and its runs
  const size_t wsb = size_t(64) << 20;
  void *ws, *ws_plain, *ws_scaled;
  CK(cudaMalloc(&ws, wsb));
  CK(cudaMalloc(&ws_plain, wsb));
  CK(cudaMalloc(&ws_scaled, wsb));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasLtHandle_t h;
  cublasLtCreate(&h);
  printf("| rows x H x V | cuBLASLt on E*F (ms) | CUTLASS plain on E*F (ms, x cuBLASLt) | scaled main loop (ms, x cuBLASLt) "
         "| scaled vs cuBLASLt max rel diff | vs float64 (16 outputs) |\n|---|---|---|---|---|---|\n");
  for (auto c : shapes) {
    const int groups = (c.K + kGroup - 1) / kGroup;
    fill<<<2048, 256>>>(e, f, w, c.M, c.K, c.N, groups);
    prescale<<<2048, 256>>>(e, f, pre, c.M, c.K);
    CK(cudaDeviceSynchronize());
    Lt lt(h, c.M, c.N, c.K, wsb);
    Scaled scaled;
    Plain plain;
    const bool lt_ok = lt.ok && lt.run(pre, w, d0, ws, wsb, s);
    const bool sc_ok = scaled.init(c.M, c.N, c.K, e, f, w, d1, ws_scaled, wsb, s) && scaled.run(s);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    if (!lt_ok || !sc_ok) {
      printf("| %dx%dx%d | %s | | %s | | |\n", c.M, c.N, c.K, lt_ok ? "ok" : "cuBLASLt failed",
             sc_ok ? "ok" : "scaled kernel refused the arguments");
      continue;
    }
    const float diff = rel_diff(d1, d0, size_t(c.M) * c.N, scratch);
    // float64 dot products at 16 sampled outputs, relative to the largest |reference| among them
    std::vector<bf16> hrow(c.K), hcol(c.K);
    std::vector<float> got(1);
    double worst = 0, big = 0;
    std::vector<std::pair<double, double>> pairs;
    for (int q = 0; q < 16; ++q) {
      const int m = (q * 2654435761u) % c.M, n = (q * 40503u + 11) % c.N;
      CK(cudaMemcpy(hrow.data(), pre + size_t(m) * c.K, size_t(c.K) * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy2D(hcol.data(), 2, w + n, size_t(c.N) * 2, 2, c.K, cudaMemcpyDeviceToHost));
      double ref = 0;
      for (int k = 0; k < c.K; ++k) ref += double(float(hrow[k])) * double(float(hcol[k]));
      CK(cudaMemcpy(got.data(), d1 + size_t(m) * c.N + n, 4, cudaMemcpyDeviceToHost));
      pairs.push_back({got[0], ref});
      big = std::max(big, std::abs(ref));
    }
    for (auto& pr : pairs) worst = std::max(worst, std::abs(pr.first - pr.second));
    std::vector<float> r0, r1, r2;
    const bool plain_ok = plain.init(c.M, c.N, c.K, pre, w, d1, ws_plain, wsb, s);
    for (int round = 0; round < 5; ++round) {
      r0.push_back(time_it([&] { lt.run(pre, w, d1, ws, wsb, s); }, s));
      if (plain_ok) r1.push_back(time_it([&] { plain.run(s); }, s));
      r2.push_back(time_it([&] { scaled.run(s); }, s));
    }
    CK(cudaGetLastError());
    const float m0 = median(r0), m2 = median(r2);
    char plain_s[64] = "refused";
    if (plain_ok) snprintf(plain_s, sizeof plain_s, "%.3f, %.3f", median(r1), median(r1) / m0);
    printf("| %dx%dx%d | %.3f | %s | %.3f, %.3f | %.1e | %.1e |\n", c.M, c.N, c.K, m0, plain_s, m2, m2 / m0, diff,
           worst / std::max(big, 1e-300));
    fflush(stdout);
  }
  return 0;
}
