// Which of the linear cross-entropy's three cuBLASLt products slows down when the vocabulary V is
// not a multiple of 8 (GPT-2's 50257), and whether splitting V into an aligned part and a tail
// of fewer than 8 restores the aligned speed. The logits buffer's row stride is V rounded up to
// 16 bytes, as the library allocates it; only the extent V varies.
//   nvcc -std=c++17 -O2 -arch=sm_90 dev/odd_vocab/probe.cu -o build-probe/odd_vocab -lcublasLt
//   ./build-probe/odd_vocab [N H V]   (default 8192 2048 50257)
// Found (an H200, cuBLAS of CUDA 13.0): at 8192 x 2048 x 50257 the whole products took 15.7 /
// 12.7 / 3.6 ms (logits, grad_hidden, grad_weight) against 2.3 / 2.3 / 2.3 split, and 2.6 / 2.2 /
// 2.6 at V = 50264; 8192 x 4096 x 32001 likewise (21.7 / 16.2 / 4.8 against 2.8 / 3.0 / 2.9).
// src/cuda/gemm.cpp splits such products.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::printf("%s: %s\n", #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)
#define LT(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { std::printf("%s: %d\n", #x, int(s_)); std::exit(1); } } while (0)

cublasLtHandle_t lt;
void* ws;
const size_t kWs = 32 << 20;

// D (m x n, col-major, ld ldd) = op(A) op(B) + beta D; A, B bf16; D bf16 or float32.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
          int64_t ldb, void* D, int64_t ldd, cudaDataType_t dt, float beta) {
  cublasLtMatmulDesc_t op;
  LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof(oa)));
  LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof(ob)));
  cublasLtMatrixLayout_t la, lb, ld;
  LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ta ? k : m, ta ? m : k, lda));
  LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, tb ? n : k, tb ? k : n, ldb));
  LT(cublasLtMatrixLayoutCreate(&ld, dt, m, n, ldd));
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWs, sizeof(kWs)));
  cublasLtMatmulHeuristicResult_t h = {};
  int found = 0;
  LT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &h, &found));
  if (!found) { std::printf("no algorithm\n"); std::exit(1); }
  const float alpha = 1.f;
  LT(cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &h.algo, ws, kWs, 0));
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(op);
}

double median_ms(const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < 15; ++i) {
    CK(cudaEventRecord(a)); f(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

__global__ void fill(__nv_bfloat16* p, size_t n, float s) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(s * (float((i * 2654435761u) % 1000) / 500.f - 1.f));
}

int main(int argc, char** argv) {
  std::vector<int64_t> a = {8192, 2048, 50257};
  if (argc >= 4) a = {std::atoll(argv[1]), std::atoll(argv[2]), std::atoll(argv[3])};
  const int64_t N = a[0], H = a[1];
  LT(cublasLtCreate(&lt));
  CK(cudaMalloc(&ws, kWs));
  std::printf("| N x H x V | variant | logits ms | grad_hidden ms | grad_weight ms | sum ms | TFLOP/s |\n|---|---|---|---|---|---|---|\n");
  for (int64_t V : {a[2], (a[2] + 7) / 8 * 8, a[2] / 8 * 8}) {
    const int64_t ldl = (V + 7) / 8 * 8, lo = V / 8 * 8, r = V - lo;
    __nv_bfloat16 *hid, *w, *lg, *gh;
    float* gw;
    CK(cudaMalloc(&hid, N * H * 2)); CK(cudaMalloc(&w, V * H * 2)); CK(cudaMalloc(&lg, N * ldl * 2));
    CK(cudaMalloc(&gh, N * H * 2)); CK(cudaMalloc(&gw, V * H * 4));
    fill<<<1024, 256>>>(hid, N * H, 1.f); fill<<<1024, 256>>>(w, V * H, 0.02f); fill<<<1024, 256>>>(lg, N * ldl, 1e-4f);
    for (int split = 0; split < (r ? 2 : 1); ++split) {
      auto logits = [&] {
        if (!split) { gemm(true, false, V, N, H, w, H, hid, H, lg, ldl, CUDA_R_16BF, 0.f); return; }
        gemm(true, false, lo, N, H, w, H, hid, H, lg, ldl, CUDA_R_16BF, 0.f);
        gemm(true, false, r, N, H, w + lo * H, H, hid, H, lg + lo, ldl, CUDA_R_16BF, 0.f);
      };
      auto grad_hidden = [&] {
        if (!split) { gemm(false, false, H, N, V, w, H, lg, ldl, gh, H, CUDA_R_16BF, 0.f); return; }
        gemm(false, false, H, N, r, w + lo * H, H, lg + lo, ldl, gh, H, CUDA_R_16BF, 0.f);
        gemm(false, false, H, N, lo, w, H, lg, ldl, gh, H, CUDA_R_16BF, 1.f);
      };
      auto grad_weight = [&] {
        if (!split) { gemm(false, true, H, V, N, hid, H, lg, ldl, gw, H, CUDA_R_32F, 0.f); return; }
        gemm(false, true, H, lo, N, hid, H, lg, ldl, gw, H, CUDA_R_32F, 0.f);
        gemm(false, true, H, r, N, hid, H, lg + lo, ldl, gw + lo * H, H, CUDA_R_32F, 0.f);
      };
      const double t1 = median_ms(logits), t2 = median_ms(grad_hidden), t3 = median_ms(grad_weight);
      const double s = t1 + t2 + t3;
      std::printf("| %lld x %lld x %lld | %s | %.3f | %.3f | %.3f | %.3f | %.0f |\n", (long long)N, (long long)H,
                  (long long)V, split ? "split 8k + tail" : "whole", t1, t2, t3, s, 6.0 * N * H * V / s / 1e9);
    }
    CK(cudaFree(hid)); CK(cudaFree(w)); CK(cudaFree(lg)); CK(cudaFree(gh)); CK(cudaFree(gw));
  }
  return 0;
}
