// dev experiment: fused linear cross-entropy on CUDA, first design (DESIGN.md).
//
// Token chunks of `chunk` rows. Per chunk: a cuBLASLt bf16 GEMM writes the (chunk, V) logit chunk
// with the bias added in its epilogue; fusedce's cross-entropy kernel turns the chunk into the
// loss and dlogits in place (reduction sum, upstream gradient = the mean's 1/denominator read
// from device memory, so no host sync); two GEMMs then write grad_hidden for the chunk and
// accumulate grad_weight into a float32 accumulator (beta = 1); a GEMM against a ones vector
// accumulates grad_bias. Extra memory: the logit chunk, the float32 grad_weight accumulator, a
// few vectors. FLOPs 6 N H V; the floor is the three bare GEMMs, measured in the same run.
//
// Not built by default and not yet run on a GPU (written in a session whose GPU time was spent).
// On the GPU machine:
//   cmake -S . -B build-gpu -DFUSEDCE_CUDA=ON -DFUSEDCE_TESTS=OFF && cmake --build build-gpu -j16
//   nvcc -std=c++17 -O3 -arch=sm_90 -Iinclude dev/linear_ce_cublas.cu build-gpu/libfusedce.a \
//        -lcublasLt -o /tmp/lce && /tmp/lce
// It first checks itself against fusedce's CPU linear cross-entropy, then times.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "fusedce/fusedce.h"

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define CKB(x)                                                                         \
  do {                                                                                 \
    cublasStatus_t s_ = (x);                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

namespace {

using bf16 = __nv_bfloat16;

void ok(const fusedce::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "fusedce: %s\n", s.message().c_str());
    std::exit(1);
  }
}

/// D (m x n, col-major, ldd) = alpha op(A) op(B) + beta C, A/B bf16, D bf16 or fp32, fp32 compute.
struct Gemm {
  cublasLtHandle_t lt;
  void* ws;
  size_t ws_bytes = size_t(64) << 20;

  Gemm() {
    CKB(cublasLtCreate(&lt));
    CK(cudaMalloc(&ws, ws_bytes));
  }
  void run(cublasOperation_t opa, cublasOperation_t opb, int64_t m, int64_t n, int64_t k, const void* A,
           int64_t lda, const void* B, int64_t ldb, void* D, int64_t ldd, cudaDataType_t dtype, float beta,
           const void* bias, cudaStream_t stream) {
    cublasLtMatmulDesc_t desc;
    CKB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    if (bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;  // bias over the m dimension (V)
      CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
      CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
      const cudaDataType_t bt = CUDA_R_16BF;
      CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    }
    cublasLtMatrixLayout_t la, lb, ld;
    CKB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, opa == CUBLAS_OP_N ? m : k, opa == CUBLAS_OP_N ? k : m, lda));
    CKB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, opb == CUBLAS_OP_N ? k : n, opb == CUBLAS_OP_N ? n : k, ldb));
    CKB(cublasLtMatrixLayoutCreate(&ld, dtype, m, n, ldd));
    cublasLtMatmulPreference_t pref;
    CKB(cublasLtMatmulPreferenceCreate(&pref));
    CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    CKB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &heur, &found));
    if (found == 0) {
      std::fprintf(stderr, "no cuBLASLt algorithm for %lld x %lld x %lld\n", (long long)m, (long long)n, (long long)k);
      std::exit(1);
    }
    const float alpha = 1.0f;
    CKB(cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heur.algo, ws, ws_bytes, stream));
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
  }
};

// 1 / (number of non-ignored targets), the mean's chain factor, into *g (device), no host sync.
__global__ void mean_factor_kernel(const int64_t* t, int64_t n, int64_t ignore, float* g) {
  __shared__ unsigned long long count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  unsigned long long local = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) local += t[i] != ignore;
  atomicAdd(&count, local);  // integer: exact, order-free
  __syncthreads();
  if (threadIdx.x == 0) *g = 1.0f / static_cast<float>(count);
}

__global__ void finish_kernel(const float* chunk_loss, int chunks, const float* g, float* loss, const float* dw32,
                              bf16* dw, int64_t n_dw, const float* db32, bf16* db, int64_t n_db) {
  const int64_t i0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = i0; i < n_dw; i += step) dw[i] = __float2bfloat16_rn(dw32[i]);
  for (int64_t i = i0; i < n_db; i += step) db[i] = __float2bfloat16_rn(db32[i]);
  if (i0 == 0) {
    double s = 0.0;
    for (int c = 0; c < chunks; ++c) s += chunk_loss[c];  // chunk order: deterministic
    *loss = static_cast<float>(s * *g);
  }
}

__global__ void fill_ones(bf16* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(1.0f);
}

struct LinearCe {
  int64_t N, H, V, chunk;
  Gemm gemm;
  bf16 *logits, *ones;
  float *dw32, *db32, *chunk_loss, *g;
  void* ce_ws;
  size_t ce_ws_bytes;

  LinearCe(int64_t n, int64_t h, int64_t v, int64_t chunk_rows, const fusedce::Options& o) : N(n), H(h), V(v) {
    chunk = std::min(chunk_rows, N);
    CK(cudaMalloc(&logits, size_t(chunk) * V * sizeof(bf16)));
    CK(cudaMalloc(&ones, chunk * sizeof(bf16)));
    CK(cudaMalloc(&dw32, size_t(V) * H * sizeof(float)));
    CK(cudaMalloc(&db32, V * sizeof(float)));
    CK(cudaMalloc(&chunk_loss, ((N + chunk - 1) / chunk) * sizeof(float)));
    CK(cudaMalloc(&g, sizeof(float)));
    fill_ones<<<64, 256>>>(ones, chunk);
    ce_ws_bytes = fusedce::cross_entropy_workspace_size(fusedce::Job::kForwardBackward, fusedce::Device::cuda(), chunk, V, o);
    CK(cudaMalloc(&ce_ws, std::max<size_t>(ce_ws_bytes, 1)));
  }
  size_t extra_bytes() const {
    return size_t(chunk) * V * sizeof(bf16) + size_t(V) * H * sizeof(float) + V * sizeof(float) + ce_ws_bytes;
  }

  // Mean reduction over all rows; outputs bf16 grads, float loss and lse (N,).
  void run(const bf16* hid, const bf16* w, const bf16* bias, const int64_t* target, fusedce::Options o, float* loss,
           float* lse, bf16* gh, bf16* gw, bf16* gb, cudaStream_t s) {
    mean_factor_kernel<<<1, 1024, 0, s>>>(target, N, o.ignore_index, g);
    CK(cudaMemsetAsync(dw32, 0, size_t(V) * H * sizeof(float), s));
    CK(cudaMemsetAsync(db32, 0, V * sizeof(float), s));
    o.reduction = fusedce::Reduction::kSum;
    o.inplace_grad = true;
    int c = 0;
    for (int64_t r0 = 0; r0 < N; r0 += chunk, ++c) {
      const int64_t nc = std::min(chunk, N - r0);
      const bf16* hc = hid + r0 * H;
      // logits^T (V x nc, col-major) = W (op T of H x V) . hidden_c^T (H x nc), + bias
      gemm.run(CUBLAS_OP_T, CUBLAS_OP_N, V, nc, H, w, H, hc, H, logits, V, CUDA_R_16BF, 0.0f, bias, s);
      fusedce::ForwardOutputs out;
      out.loss = fusedce::vector(chunk_loss + c, fusedce::DType::kFloat32, 1);
      out.lse = fusedce::vector(lse + r0, fusedce::DType::kFloat32, nc);
      const auto L = fusedce::matrix(logits, fusedce::DType::kBFloat16, nc, V);
      ok(fusedce::cross_entropy_forward_backward(fusedce::Device::cuda(0, s), L,
                                                 fusedce::vector(const_cast<int64_t*>(target + r0), fusedce::DType::kInt64, nc),
                                                 o, out, fusedce::vector(g, fusedce::DType::kFloat32, 1), L,
                                                 fusedce::Workspace{ce_ws, ce_ws_bytes}));
      // grad_hidden_c^T (H x nc) = W^T (H x V, op N) . dX^T (V x nc, op N)
      gemm.run(CUBLAS_OP_N, CUBLAS_OP_N, H, nc, V, w, H, logits, V, gh + r0 * H, H, CUDA_R_16BF, 0.0f, nullptr, s);
      // grad_weight^T (H x V) += hidden_c^T (H x nc, op N) . dX (nc x V: op T of V x nc)
      gemm.run(CUBLAS_OP_N, CUBLAS_OP_T, H, V, nc, hc, H, logits, V, dw32, H, CUDA_R_32F, 1.0f, nullptr, s);
      // grad_bias (V x 1) += dX^T (V x nc, op N) . ones (nc x 1)
      if (gb) gemm.run(CUBLAS_OP_N, CUBLAS_OP_N, V, 1, nc, logits, V, ones, nc, db32, V, CUDA_R_32F, 1.0f, nullptr, s);
    }
    finish_kernel<<<1024, 256, 0, s>>>(chunk_loss, c, g, loss, dw32, gw, V * H, db32, gb, gb ? V : 0);
    CK(cudaGetLastError());
  }
};

std::vector<bf16> random_bf16(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) x = __float2bfloat16_rn(nd(rng));
  return v;
}

template <typename T>
T* to_device(const std::vector<T>& v) {
  T* p;
  CK(cudaMalloc(&p, v.size() * sizeof(T)));
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

float max_rel(const std::vector<bf16>& got, const std::vector<bf16>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double a = __bfloat162float(got[i]), b = __bfloat162float(ref[i]);
    num = std::max(num, std::fabs(a - b));
    den = std::max(den, std::fabs(b));
  }
  return static_cast<float>(num / den);
}

bool check(int64_t N, int64_t H, int64_t V, const fusedce::Options& o) {
  std::mt19937 rng(7);
  const auto hid = random_bf16(N * H, 1.0f, rng), w = random_bf16(V * H, 2.0f / std::sqrt(float(H)), rng),
             b = random_bf16(V, 1.0f, rng);
  std::vector<int64_t> t(N);
  for (auto& x : t) x = rng() % 10 < 3 ? -100 : int64_t(rng() % V);
  bf16 *dh = to_device(hid), *dwt = to_device(w), *db = to_device(b), *gh, *gw, *gb;
  int64_t* dt = to_device(t);
  float *loss, *lse;
  CK(cudaMalloc(&gh, N * H * sizeof(bf16)));
  CK(cudaMalloc(&gw, V * H * sizeof(bf16)));
  CK(cudaMalloc(&gb, V * sizeof(bf16)));
  CK(cudaMalloc(&loss, 4));
  CK(cudaMalloc(&lse, N * 4));
  LinearCe lce(N, H, V, 97, o);  // an odd chunk: several chunks, a ragged last one
  lce.run(dh, dwt, db, dt, o, loss, lse, gh, gw, gb, nullptr);
  CK(cudaDeviceSynchronize());
  float gl;
  std::vector<bf16> g_gh(N * H), g_gw(V * H), g_gb(V), c_gh(N * H), c_gw(V * H), c_gb(V);
  CK(cudaMemcpy(&gl, loss, 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(g_gh.data(), gh, g_gh.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(g_gw.data(), gw, g_gw.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(g_gb.data(), gb, g_gb.size() * 2, cudaMemcpyDeviceToHost));
  float cl;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(&cl, fusedce::DType::kFloat32, 1);
  fusedce::LinearGrads grads;
  grads.grad_hidden = fusedce::matrix(c_gh.data(), fusedce::DType::kBFloat16, N, H);
  grads.grad_weight = fusedce::matrix(c_gw.data(), fusedce::DType::kBFloat16, V, H);
  grads.grad_bias = fusedce::vector(c_gb.data(), fusedce::DType::kBFloat16, V);
  ok(fusedce::linear_cross_entropy_forward_backward(
      fusedce::Device::cpu(), fusedce::matrix(const_cast<bf16*>(hid.data()), fusedce::DType::kBFloat16, N, H),
      fusedce::matrix(const_cast<bf16*>(w.data()), fusedce::DType::kBFloat16, V, H),
      fusedce::vector(const_cast<bf16*>(b.data()), fusedce::DType::kBFloat16, V),
      fusedce::vector(t.data(), fusedce::DType::kInt64, N), o, {}, out, {}, grads));
  // bf16 logits (as PyTorch's bf16 matmul makes them) against the CPU path's float32 logits:
  // about 1e-2 relative is the expected difference, far above a wrong-formula error.
  const float e_loss = std::fabs(gl - cl) / std::fabs(cl), e_h = max_rel(g_gh, c_gh), e_w = max_rel(g_gw, c_gw),
              e_b = max_rel(g_gb, c_gb);
  const bool good = e_loss < 1e-2f && e_h < 3e-2f && e_w < 3e-2f && e_b < 3e-2f;
  std::printf("# check N=%lld H=%lld V=%lld: loss gpu %.6f cpu %.6f (rel %.1e), grad_hidden %.1e, grad_weight %.1e, grad_bias %.1e: %s\n",
              (long long)N, (long long)H, (long long)V, gl, cl, e_loss, e_h, e_w, e_b, good ? "ok" : "MISMATCH");
  return good;
}

template <typename F>
double median_ms(F&& fn, int iters) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  fn();
  fn();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a));
    fn();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void bench(int64_t N, int64_t H, int64_t V, bool half_ignored) {
  std::mt19937 rng(11);
  const auto hid = random_bf16(N * H, 1.0f, rng), w = random_bf16(V * H, 2.0f / std::sqrt(float(H)), rng);
  std::vector<int64_t> t(N);
  for (int64_t i = 0; i < N; ++i) t[i] = half_ignored && i % 2 ? -100 : int64_t(rng() % V);
  bf16 *dh = to_device(hid), *dw = to_device(w), *gh, *gw, *full;
  int64_t* dt = to_device(t);
  float *loss, *lse;
  CK(cudaMalloc(&gh, N * H * 2));
  CK(cudaMalloc(&gw, V * H * 2));
  CK(cudaMalloc(&loss, 4));
  CK(cudaMalloc(&lse, N * 4));
  const fusedce::Options o;
  // Chunk of at most 512 MiB of bf16 logits.
  const int64_t chunk = std::max<int64_t>(1, (int64_t(512) << 20) / (V * 2));
  LinearCe lce(N, H, V, chunk, o);
  const double t_fused = median_ms([&] { lce.run(dh, dw, nullptr, dt, o, loss, lse, gh, gw, nullptr, nullptr); }, 10);
  // The floor: the three bare GEMMs of forward + backward at full size.
  CK(cudaMalloc(&full, size_t(N) * V * 2));
  float* dw32 = lce.dw32;
  const double t_floor = median_ms([&] {
    lce.gemm.run(CUBLAS_OP_T, CUBLAS_OP_N, V, N, H, dw, H, dh, H, full, V, CUDA_R_16BF, 0.0f, nullptr, nullptr);
    lce.gemm.run(CUBLAS_OP_N, CUBLAS_OP_N, H, N, V, dw, H, full, V, gh, H, CUDA_R_16BF, 0.0f, nullptr, nullptr);
    lce.gemm.run(CUBLAS_OP_N, CUBLAS_OP_T, H, V, N, dh, H, full, V, dw32, H, CUDA_R_32F, 0.0f, nullptr, nullptr);
  }, 10);
  const double flops = 6.0 * N * H * V;
  std::printf("| %lld x %lld x %lld%s | %.2f ms | %.0f TFLOP/s | floor %.2f ms (%.0f TFLOP/s) | %.3f x floor | extra %.0f MiB |\n",
              (long long)N, (long long)H, (long long)V, half_ignored ? " (half ignored)" : "", t_fused,
              flops / t_fused / 1e9, t_floor, flops / t_floor / 1e9, t_fused / t_floor, lce.extra_bytes() / 1048576.0);
  CK(cudaFree(full));
}

}  // namespace

int main() {
  fusedce::Options all;
  all.label_smoothing = 0.1f;
  all.softcap = 20.0f;
  all.z_loss = 1e-4f;
  bool good = check(300, 128, 5003, fusedce::Options{}) && check(257, 67, 1001, all);
  if (!good) return 2;
  std::printf("| N x H x V | fused fwd+bwd | TFLOP/s (6NHV) | bare GEMMs | ratio | extra memory |\n|---|---|---|---|---|---|\n");
  bench(4096, 4096, 128256, false);
  bench(8192, 4096, 128256, false);
  bench(16384, 2304, 256000, false);
  bench(8192, 4096, 151936, false);
  bench(8192, 4096, 128256, true);
  return 0;
}
