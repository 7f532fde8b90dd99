// The CUDA kernels of the per-token log-probabilities (fusedce/logprobs.h): a row's statistics
// (max, the exps of every entry but one instance of the max, the entropy sum), the rank-order
// merge, and the gradient of g_lp * logprob + g_H * entropy. Same formulas as the CPU backend
// (common/logprob_math.h); every reduction in a fixed order, so results are the same bits run to
// run and on every rank; no host synchronisation.
//
// One block per row. The statistics read a row twice (a thread's columns: the max and its
// first position, then the sums against it, the second read from cache) and write 9 floats; the
// backward reads the row once and writes it once: memory-bound, 2 (or 4) bytes per logit each
// way. In the linear form the row is a chunk of logits the product just wrote, in L2 when the
// chunk fits.
#include "cuda/port.h"  // first: the platform's runtime header

#include <cstdint>

#include "common/logprob_math.h"
#include "cuda/host_util.h"
#include "cuda/logprobs/logprobs_kernels.h"
#include "cuda/vec.cuh"
#include "fusedce/logprobs.h"

namespace fusedce {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMergeThreads = 256;

__device__ int64_t lp_target(const LpRows& r, int64_t i) {
  return r.target_i64 ? static_cast<const int64_t*>(r.target)[i * r.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(r.target)[i * r.target_stride]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) lp_stats_kernel(const LpRows r, const T* logits, int64_t stride,
                                                            int64_t V, float* stats) {
  __shared__ detail::LpState<float> part[kThreads];
  const int64_t i = blockIdx.x;
  const int tid = threadIdx.x;
  float* out = stats + i * kLogprobStatsWidth;
  const int64_t t = i < r.rows ? lp_target(r, i) : r.ignore_index;
  if (t == r.ignore_index) {  // ignored rows and the spare row: zeros
    if (tid < kLogprobStatsWidth) out[tid] = 0.0f;
    return;
  }
  const T* x = logits + i * stride;
  // This thread's columns tid, tid + kThreads, ...: the max and its first position, then the
  // sums against it (in double: their rounding does not grow with V).
  float m = -INFINITY;
  int64_t at = -1;
  bool nan = false;
  for (int64_t j = tid; j < V; j += kThreads) {
    const float z = Elem<T>::to_float(x[j]) * r.inv_t;
    nan |= z != z;
    if (z > m) {
      m = z;
      at = j;
    }
  }
  double rest = 0.0, u = 0.0;
  if (at >= 0) {
    for (int64_t j = tid; j < V; j += kThreads) {
      if (j == at) continue;
      const float d = Elem<T>::to_float(x[j]) * r.inv_t - m;
      const float e = expf(d);
      rest += e;
      if (e > 0.0f) u += static_cast<double>(e) * d;  // 0, not 0 * -inf
    }
  }
  detail::LpState<float> s = at < 0 ? detail::lp_empty<float>()
                                     : detail::LpState<float>{m, static_cast<float>(rest), static_cast<float>(u)};
  if (nan) s.r = s.u = NAN;
  part[tid] = s;
  __syncthreads();
  for (int k = kThreads / 2; k > 0; k >>= 1) {
    if (tid < k) part[tid] = detail::lp_merge(part[tid], part[tid + k]);
    __syncthreads();
  }
  if (tid == 0) {
    const int64_t tl = t - r.vocab_start;
    const bool holds = tl >= 0 && tl < V;
    out[0] = part[0].m;
    out[1] = part[0].r;
    out[2] = part[0].u;
    out[3] = holds ? Elem<T>::to_float(x[tl]) * r.inv_t : 0.0f;
    out[4] = holds ? 1.0f : 0.0f;
  }
  if (tid >= 5 && tid < kLogprobStatsWidth) out[tid] = 0.0f;
}

__global__ void __launch_bounds__(kMergeThreads) lp_merge_kernel(const LpRows r, const float* gathered, int64_t world,
                                                                 float* logprob, int64_t lp_stride, float* entropy,
                                                                 int64_t ent_stride, float* lse, int64_t lse_stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kMergeThreads + threadIdx.x;
  if (i >= r.rows) return;
  detail::LpResult res{0.0f, 0.0f, 0.0f};
  if (lp_target(r, i) != r.ignore_index) {
    detail::LpState<double> st = detail::lp_empty<double>();
    float z_t = NAN;
    for (int64_t k = 0; k < world; ++k) {
      const float* row = gathered + (k * (r.rows + 1) + i) * kLogprobStatsWidth;
      st = detail::lp_merge(st, detail::LpState<float>{row[0], row[1], row[2]});
      if (row[4] != 0.0f) z_t = row[3];
    }
    res = detail::lp_finish(st, z_t);
  }
  logprob[i * lp_stride] = res.logprob;
  lse[i * lse_stride] = res.lse;
  if (entropy) entropy[i * ent_stride] = res.entropy;
}

struct LpBackwardParams {
  LpRows r;
  const void* logits;
  int64_t logits_stride;
  void* dlogits;
  int64_t dlogits_stride;
  int64_t V;
  const float *lse, *logprob, *entropy, *g_lp, *g_h;
  int64_t lse_stride, logprob_stride, entropy_stride, g_lp_stride, g_h_stride;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) lp_backward_kernel(const LpBackwardParams p) {
  const int64_t i = blockIdx.x;
  const T* x = static_cast<const T*>(p.logits) + i * p.logits_stride;
  T* dx = static_cast<T*>(p.dlogits) + i * p.dlogits_stride;
  const int64_t t = lp_target(p.r, i);
  if (t == p.r.ignore_index) {
    for (int64_t j = threadIdx.x; j < p.V; j += kThreads) dx[j] = Elem<T>::from_float(0.0f);
    return;
  }
  const bool with_h = p.g_h != nullptr;
  const detail::LpRowGrad g{p.lse[i * p.lse_stride], p.logprob[i * p.logprob_stride],
                            with_h ? p.entropy[i * p.entropy_stride] : 0.0f, p.g_lp[i * p.g_lp_stride],
                            with_h ? p.g_h[i * p.g_h_stride] : 0.0f};
  const int64_t tl = t - p.r.vocab_start;
  for (int64_t j = threadIdx.x; j < p.V; j += kThreads) {
    const float z = Elem<T>::to_float(x[j]) * p.r.inv_t;
    dx[j] = Elem<T>::from_float(detail::lp_grad(g, z, j == tl) * p.r.inv_t);
  }
}

template <typename F>
void by_dtype(DType d, F&& f) {
  if (d == DType::kFloat32) f(float{});
  else if (d == DType::kBFloat16) f(BFloat16{});
  else f(Half{});
}

}  // namespace

void launch_lp_stats(const LpRows& r, const MatrixView& logits, float* stats, cudaStream_t stream) {
  by_dtype(logits.dtype, [&](auto tag) {
    using T = decltype(tag);
    lp_stats_kernel<T><<<static_cast<unsigned>(r.rows + 1), kThreads, 0, stream>>>(
        r, static_cast<const T*>(logits.data), logits.row_stride, logits.cols, stats);
  });
}

void launch_lp_merge(const LpRows& r, const float* gathered, int64_t world, const VectorView& logprob,
                     const VectorView& entropy, const VectorView& lse, cudaStream_t stream) {
  if (r.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((r.rows + kMergeThreads - 1) / kMergeThreads);
  lp_merge_kernel<<<blocks, kMergeThreads, 0, stream>>>(
      r, gathered, world, static_cast<float*>(logprob.data), logprob.stride, static_cast<float*>(entropy.data),
      entropy.stride, static_cast<float*>(lse.data), lse.stride);
}

void launch_lp_backward(const LpRows& r, const MatrixView& logits, const MatrixView& dlogits,
                        const VectorView& lse, const VectorView& logprob, const VectorView& entropy,
                        const VectorView& grad_logprob, const VectorView& grad_entropy, cudaStream_t stream) {
  if (r.rows == 0) return;
  LpBackwardParams p{};
  p.r = r;
  p.logits = logits.data;
  p.logits_stride = logits.row_stride;
  p.dlogits = dlogits.data;
  p.dlogits_stride = dlogits.row_stride;
  p.V = logits.cols;
  p.lse = static_cast<const float*>(lse.data);
  p.lse_stride = lse.stride;
  p.logprob = static_cast<const float*>(logprob.data);
  p.logprob_stride = logprob.stride;
  p.entropy = static_cast<const float*>(entropy.data);
  p.entropy_stride = entropy.stride;
  p.g_lp = static_cast<const float*>(grad_logprob.data);
  p.g_lp_stride = grad_logprob.stride;
  p.g_h = static_cast<const float*>(grad_entropy.data);
  p.g_h_stride = grad_entropy.stride;
  by_dtype(logits.dtype, [&](auto tag) {
    using T = decltype(tag);
    lp_backward_kernel<T><<<static_cast<unsigned>(r.rows), kThreads, 0, stream>>>(p);
  });
}

}  // namespace cuda
}  // namespace fusedce
