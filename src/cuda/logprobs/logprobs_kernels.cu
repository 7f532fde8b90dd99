// The CUDA kernels of the per-token log-probabilities (fusedce/logprobs.h): a row's statistics
// (max, the exps of every entry but one instance of the max, the entropy sum), the rank-order
// merge, and the gradient of g_lp * logprob + g_H * entropy. Same formulas as the CPU backend
// (common/logprob_math.h); every reduction in a fixed order, so results are the same bits run to
// run and on every rank; no host synchronisation.
//
// One block per row, 16-byte segments of it per thread (cuda/vec.cuh), several loads in flight.
// The statistics read a row once (a running max with its sums moved along, LaneState) and write
// 9 floats; the backward reads the row once and writes it once: memory-bound, 2 (or 4) bytes
// per logit each way.
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

// Segments in flight per thread: loads issued together, before their values are used.
constexpr int kUnroll = 4;

/// One row's running state over a thread's segments, in one read of them: the max so far and
/// the sums against it (each segment's in float, the running ones in double: their rounding
/// does not grow with V). A segment whose max passes the running one moves the state to it
/// first (one exp), and its first element equal to the new max is the instance r leaves out.
/// kDist: also q (the squares' sum, as r), the sum of z over the row's columns and the max of z
/// over the columns before the local target index tl.
struct LaneState {
  float m = -INFINITY;
  double r = 0.0, u = 0.0, q = 0.0, z_sum = 0.0;
  float max_before = -INFINITY;
  bool nan = false;

  /// Segment `seg` holds columns [j0, j0 + kVec) (those outside [0, V) are -inf fill).
  template <bool kDist, typename T>
  __device__ __forceinline__ void push(const Segment<T>& seg, float inv_t, int64_t j0, int64_t V, int64_t tl) {
    constexpr int kVec = Segment<T>::kVec;
    const float top = seg_max(seg) * inv_t;
    if (kDist) {
      const bool whole = j0 >= 0 && j0 + kVec <= V;
      float zs = 0.0f;
#pragma unroll
      for (int k = 0; k < kVec / 2; ++k) {
        const float2 p = seg_pair(seg, k);
        const int64_t j = j0 + 2 * k;
        if (whole || (j >= 0 && j < V)) zs += p.x * inv_t;
        if (whole || (j + 1 >= 0 && j + 1 < V)) zs += p.y * inv_t;
        if (j0 + kVec > tl && j0 < tl) {  // the segment holding the target: the columns before it
          if (j < tl) max_before = fmaxf(max_before, p.x * inv_t);
          if (j + 1 < tl) max_before = fmaxf(max_before, p.y * inv_t);
        }
      }
      z_sum += zs;
      if (j0 + kVec <= tl) max_before = fmaxf(max_before, top);
    }
    bool skip = false;
    if (top > m) {
      if (m != -INFINITY) {
        const double d = double(m) - double(top);
        const double f = exp(d);
        u = (u + (1.0 + r) * d) * f;
        r = (r + 1.0) * f;
        if (kDist) q = (q + 1.0) * f * f;
      }
      m = top;
      skip = true;
    }
    if (m == -INFINITY) {  // every entry so far -inf (or NaN): nothing to add, NaN to note
#pragma unroll
      for (int k = 0; k < kVec / 2; ++k) {
        const float2 p = seg_pair(seg, k);
        nan |= p.x != p.x || p.y != p.y;
      }
      return;
    }
    float rs = 0.0f, us = 0.0f, qs = 0.0f;
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 p = seg_pair(seg, k);
      const float z[2] = {p.x * inv_t, p.y * inv_t};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        nan |= z[e] != z[e];
        if (skip && z[e] == m) {
          skip = false;
          continue;
        }
        const float d = z[e] - m;
        const float x = expf(d);
        rs += x;
        if (x > 0.0f) us += x * d;  // 0, not 0 * -inf
        if (kDist) qs += x * x;
      }
    }
    r += rs;
    u += us;
    if (kDist) q += qs;
  }
};

template <typename T, bool kDist>
__global__ void __launch_bounds__(kThreads) lp_stats_kernel(const LpRows r, const T* logits, int64_t stride,
                                                            int64_t V, float* stats) {
  constexpr int kVec = Segment<T>::kVec;
  // The lanes merge in double: lanes that share a max far below the row's move by the same
  // exp(d), which float32 holds only as a subnormal (a few bits) past d = -87, so its rounding
  // would not average out over them.
  __shared__ detail::LpState<double> part[kThreads];
  __shared__ double z_part[kDist ? kThreads : 1];
  __shared__ float before_part[kDist ? kThreads : 1];
  const int64_t i = blockIdx.x;
  const int tid = threadIdx.x;
  float* out = stats + i * kLogprobStatsWidth;
  const int64_t t = i < r.rows ? lp_target(r, i) : r.ignore_index;
  if (t == r.ignore_index) {  // ignored rows and the spare row: zeros
    if (tid < kLogprobStatsWidth) out[tid] = 0.0f;
    return;
  }
  const int64_t tl = t - r.vocab_start;
  const T* x = logits + i * stride;
  const int off = row_offset(x);
  const int64_t segs = (V + off + kVec - 1) / kVec;
  const T fill = Elem<T>::from_float(-INFINITY);
  LaneState lane;
  int64_t s0 = tid;
  for (; s0 + (kUnroll - 1) * kThreads < segs; s0 += kUnroll * kThreads) {
    Segment<T> seg[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) seg[k] = load_segment(x, s0 + k * kThreads, off, V, fill);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) lane.push<kDist>(seg[k], r.inv_t, (s0 + k * kThreads) * kVec - off, V, tl);
  }
  for (; s0 < segs; s0 += kThreads) lane.push<kDist>(load_segment(x, s0, off, V, fill), r.inv_t, s0 * kVec - off, V, tl);
  detail::LpState<double> s = lane.m == -INFINITY ? detail::lp_empty<double>()
                                                  : detail::LpState<double>{lane.m, lane.r, lane.u, lane.q};
  if (lane.nan) s.r = s.u = s.q = NAN;
  part[tid] = s;
  if (kDist) {
    z_part[tid] = lane.z_sum;
    before_part[tid] = lane.max_before;
  }
  __syncthreads();
  for (int k = kThreads / 2; k > 0; k >>= 1) {
    if (tid < k) {
      part[tid] = detail::lp_merge(part[tid], part[tid + k]);
      if (kDist) {
        z_part[tid] += z_part[tid + k];
        before_part[tid] = fmaxf(before_part[tid], before_part[tid + k]);
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    const bool holds = tl >= 0 && tl < V;
    out[0] = part[0].m;
    out[1] = static_cast<float>(part[0].r);
    out[2] = static_cast<float>(part[0].u);
    out[3] = holds ? Elem<T>::to_float(x[tl]) * r.inv_t : 0.0f;
    out[4] = holds ? 1.0f : 0.0f;
    if (kDist) {
      out[5] = static_cast<float>(part[0].q);
      out[6] = static_cast<float>(z_part[0]);
      out[7] = before_part[0];
    }
  }
  if (tid >= (kDist ? 8 : 5) && tid < kLogprobStatsWidth) out[tid] = 0.0f;
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
      st = detail::lp_merge(st, detail::LpState<float>{row[0], row[1], row[2], 0.0f});
      if (row[4] != 0.0f) z_t = row[3];
    }
    res = detail::lp_finish(st, z_t);
  }
  logprob[i * lp_stride] = res.logprob;
  lse[i * lse_stride] = res.lse;
  if (entropy) entropy[i * ent_stride] = res.entropy;
}

__global__ void __launch_bounds__(kMergeThreads)
    lp_dist_kernel(const LpRows r, const float* gathered, int64_t world, float* lss, int64_t lss_stride, float* mean,
                   int64_t mean_stride, float* top1, int64_t top1_stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kMergeThreads + threadIdx.x;
  if (i >= r.rows) return;
  detail::LpDist d{0.0f, 0.0f, 0.0f};
  if (lp_target(r, i) != r.ignore_index) {
    detail::LpState<double> st = detail::lp_empty<double>();
    double z_sum = 0.0;
    float max_before = -INFINITY, z_t = NAN;
    for (int64_t k = 0; k < world; ++k) {
      const float* row = gathered + (k * (r.rows + 1) + i) * kLogprobStatsWidth;
      st = detail::lp_merge(st, detail::LpState<float>{row[0], row[1], row[2], row[5]});
      z_sum += row[6];
      max_before = fmaxf(max_before, row[7]);
      if (row[4] != 0.0f) z_t = row[3];
    }
    d = detail::lp_dist_finish(st, z_sum, max_before, z_t, r.vocab_total);
  }
  if (lss) lss[i * lss_stride] = d.log_sum_sq_probs;
  if (mean) mean[i * mean_stride] = d.mean_logit;
  if (top1) top1[i * top1_stride] = d.is_top1;
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
  constexpr int kVec = Segment<T>::kVec;
  const int64_t i = blockIdx.x;
  const T* x = static_cast<const T*>(p.logits) + i * p.logits_stride;
  T* dx = static_cast<T*>(p.dlogits) + i * p.dlogits_stride;
  const int64_t t = lp_target(p.r, i);
  // Segments of dx: x and dx may sit at different offsets from a 16-byte boundary (then the
  // logits are read element by element).
  const int off = row_offset(dx);
  const bool aligned = row_offset(x) == off;
  const int64_t segs = (p.V + off + kVec - 1) / kVec;
  if (t == p.r.ignore_index) {
    Segment<T> zero;
    zero.raw = U32x4{0u, 0u, 0u, 0u};
    for (int64_t s = threadIdx.x; s < segs; s += kThreads) store_segment(dx, s, off, p.V, zero);
    return;
  }
  const bool with_h = p.g_h != nullptr;
  const detail::LpRowGrad g{p.lse[i * p.lse_stride], p.logprob[i * p.logprob_stride],
                            with_h ? p.entropy[i * p.entropy_stride] : 0.0f, p.g_lp[i * p.g_lp_stride],
                            with_h ? p.g_h[i * p.g_h_stride] : 0.0f};
  const int64_t tl = t - p.r.vocab_start;
  const T fill = Elem<T>::from_float(0.0f);
  // Each segment is read before it is written, by the same thread (dx may be x).
  auto grad = [&](Segment<T>& seg, int64_t s) {
    const int64_t j0 = s * kVec - off;
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 v = seg_pair(seg, k);
      const int64_t j = j0 + 2 * k;
      set_pair(seg, k, detail::lp_grad(g, v.x * p.r.inv_t, j == tl) * p.r.inv_t,
               detail::lp_grad(g, v.y * p.r.inv_t, j + 1 == tl) * p.r.inv_t);
    }
  };
  int64_t s0 = threadIdx.x;
  if (aligned) {
    for (; s0 + (kUnroll - 1) * kThreads < segs; s0 += kUnroll * kThreads) {
      Segment<T> seg[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) seg[k] = load_segment(x, s0 + k * kThreads, off, p.V, fill);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        grad(seg[k], s0 + k * kThreads);
        store_segment(dx, s0 + k * kThreads, off, p.V, seg[k]);
      }
    }
  }
  for (; s0 < segs; s0 += kThreads) {
    Segment<T> seg;
    if (aligned) {
      seg = load_segment(x, s0, off, p.V, fill);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int64_t j = s0 * kVec - off + e;
        seg.e[e] = j >= 0 && j < p.V ? x[j] : fill;
      }
    }
    grad(seg, s0);
    store_segment(dx, s0, off, p.V, seg);
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
    const unsigned blocks = static_cast<unsigned>(r.rows + 1);
    const T* x = static_cast<const T*>(logits.data);
    if (r.dist) {
      lp_stats_kernel<T, true><<<blocks, kThreads, 0, stream>>>(r, x, logits.row_stride, logits.cols, stats);
    } else {
      lp_stats_kernel<T, false><<<blocks, kThreads, 0, stream>>>(r, x, logits.row_stride, logits.cols, stats);
    }
  });
}

void launch_lp_distribution_stats(const LpRows& r, const float* gathered, int64_t world,
                                  const VectorView& log_sum_sq_probs, const VectorView& mean_logit,
                                  const VectorView& is_top1, cudaStream_t stream) {
  if (r.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((r.rows + kMergeThreads - 1) / kMergeThreads);
  lp_dist_kernel<<<blocks, kMergeThreads, 0, stream>>>(
      r, gathered, world, static_cast<float*>(log_sum_sq_probs.data), log_sum_sq_probs.stride,
      static_cast<float*>(mean_logit.data), mean_logit.stride, static_cast<float*>(is_top1.data), is_top1.stride);
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
