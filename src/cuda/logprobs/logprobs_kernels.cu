// The CUDA kernels of the per-token log-probabilities (fusedce/logprobs.h): a row's statistics
// (max, the exps of every entry but one instance of the max, the entropy sum), the rank-order
// merge, and the gradient of g_lp * logprob + g_H * entropy. Same formulas as the CPU backend
// (common/logprob_math.h); every reduction in a fixed order, so results are the same bits run to
// run and on every rank; no host synchronisation.
//
// One block per row, 16-byte segments of it per thread (cuda/vec.cuh), several loads in flight.
// The statistics read a row once (a running max with its sums moved along, LaneState) and write
// 9 floats; the backward reads the row once and writes it once: memory-bound, 2 (or 4) bytes
// per logit each way. Both take their exps in base 2 (one FFMA and one ex2 an entry, the
// temperature folded into the FFMA's factor) so that the arithmetic stays under the memory time.
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

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exps are taken as 2^(x log2(e) / T)
constexpr double kLn2 = 0.6931471805599453;

/// The base-2 form of a row state (logprob_math.h's LpState<double> with m the raw logit x,
/// positions (x - m) c with c = log2(e) / T, and u in base 2), merged like lp_merge.
__device__ __forceinline__ detail::LpState<double> merge2(const detail::LpState<double>& a,
                                                          const detail::LpState<double>& b, double c) {
  if (b.m == -INFINITY) return detail::LpState<double>{a.m, a.r + b.r, a.u + b.u, a.q + b.q};
  if (a.m == -INFINITY) return detail::LpState<double>{b.m, b.r + a.r, b.u + a.u, b.q + a.q};
  const bool a_top = a.m >= b.m;
  const detail::LpState<double> hi = a_top ? a : b, lo = a_top ? b : a;
  const double d = (double(lo.m) - double(hi.m)) * c;
  const double f = exp2(d);
  return detail::LpState<double>{hi.m, hi.r + (1.0 + lo.r) * f, hi.u + (lo.u + (1.0 + lo.r) * d) * f,
                                 hi.q + (1.0 + lo.q) * f * f};
}

/// One row's running state over a thread's segments, in one read of them, in base 2. The raw
/// logits x are scaled by c = log2(e) / T inside the exponent's one FFMA: an entry's position is
/// d = fl(x c - fl(M c)) against the lane's raw max M, its term 2^d one ex2. A segment's max is
/// taken first, so a segment without a new max is kVec independent exps with no compare per
/// entry; one whose max passes M moves the state to it (the rare branch) and leaves that max's
/// first instance out of r (logprob_math.h: r counts every entry but one instance of the max,
/// which keeps log1p(r) exact in collapse). fl(M c) is off M c by delta (exact: fmaf's
/// residual); state() folds delta out, so the state is relative to M c itself, and the row's
/// m = fl(M / T) has the bits of the max of fl(x / T) (a positive scale and the max commute).
/// Segment sums in float, lane sums in double (their rounding does not grow with V).
/// -inf entries add 2^-inf = 0 (times a clamped position); a NaN entry makes r, u, q NaN through
/// its term (flagged where the lane has no finite max yet); a +inf max makes them NaN, as
/// torch's log_softmax gives (inf - inf).
/// kDist: also q (the squares' sum, as r), the sum of x over the row's columns and the max of x
/// over the columns before the local target index tl (raw: scaled by 1 / T at the end).
struct LaneState {
  float M = -INFINITY;
  float nym = INFINITY;  // -fl(M c)
  float delta = 0.0f;    // M c - fl(M c)
  double r = 0.0, u = 0.0, q = 0.0, x_sum = 0.0;
  float max_before = -INFINITY;
  bool nan = false;

  /// Segment `seg` holds columns [j0, j0 + kVec) (those outside [0, V) are -inf fill).
  template <bool kDist, typename T>
  __device__ __forceinline__ void push(const Segment<T>& seg, float c, int64_t j0, int64_t V, int64_t tl) {
    constexpr int kVec = Segment<T>::kVec;
    float v[kVec];
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 p = seg_pair(seg, k);
      v[2 * k] = p.x;
      v[2 * k + 1] = p.y;
    }
    const float top = seg_max(seg);
    if (kDist) {
      float xs = 0.0f;
      if (j0 >= 0 && j0 + kVec <= V) {  // whole: no fill to leave out
#pragma unroll
        for (int k = 0; k < kVec; ++k) xs += v[k];
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) xs += (j0 + k >= 0 && j0 + k < V) ? v[k] : 0.0f;
      }
      x_sum += xs;
      if (j0 + kVec <= tl) {
        max_before = fmaxf(max_before, top);
      } else if (j0 < tl) {  // the segment holding the target: the columns before it
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (j0 + k < tl) max_before = fmaxf(max_before, v[k]);
        }
      }
    }
    if (top > M) {
      new_max<kDist>(v, top, c);
      return;
    }
    if (M == -INFINITY) {  // every entry so far -inf (or NaN): nothing to add, NaN to note
#pragma unroll
      for (int k = 0; k < kVec; ++k) nan |= v[k] != v[k];
      return;
    }
    float d[kVec], e[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      d[k] = fmaf(v[k], c, nym);
      e[k] = ex2_subnormal(d[k]);
    }
    float rs = 0.0f, us = 0.0f, qs = 0.0f;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      rs += e[k];
      us = fmaf(e[k], fmaxf(d[k], -256.0f), us);  // 0 * clamp, not 0 * -inf
      if (kDist) qs = fmaf(e[k], e[k], qs);
    }
    r += rs;
    u += us;
    if (kDist) q += qs;
  }

  /// A segment whose max `top` passes M: the state moves to it, then the segment's entries but
  /// top's first instance join.
  template <bool kDist, int kVec>
  __device__ __forceinline__ void new_max(const float (&v)[kVec], float top, float c) {
    if (top == INFINITY) {
      M = top;
      nan = true;
      return;
    }
    const float ym = top * c;
    const float nd = fmaf(top, c, -ym);
    // The segment first (its entries are dead before the state's double arithmetic).
    bool skip = true;
    float rs = 0.0f, us = 0.0f, qs = 0.0f;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (skip && v[k] == top) {
        skip = false;
        continue;
      }
      const float d = fmaf(v[k], c, -ym);
      const float e = ex2_subnormal(d);
      rs += e;
      us = fmaf(e, fmaxf(d, -256.0f), us);
      if (kDist) qs = fmaf(e, e, qs);
    }
    if (M != -INFINITY) {
      // The old reference fl(M c) lies D below the new one (both floats: D is exact in double);
      // the old max instance joins at its position delta + D.
      const double D = double(-nym) - double(ym);
      const double g = exp2(D);
      const double pos = double(delta) + D;
      const double e0 = exp2(pos);
      u = (u + D * r) * g + e0 * pos;
      r = r * g + e0;
      if (kDist) q = q * g * g + e0 * e0;
    }
    M = top;
    nym = -ym;
    delta = nd;
    r += rs;
    u += us;
    if (kDist) q += qs;
  }

  /// The lane's state relative to M c exactly (base 2, m the raw max).
  __device__ __forceinline__ detail::LpState<double> state() const {
    detail::LpState<double> s = detail::lp_empty<double>();
    if (M != -INFINITY) {
      const double dl = delta, g = exp2(-dl);
      s = detail::LpState<double>{M, r * g, (u - dl * r) * g, q * g * g};
    }
    if (nan) s.r = s.u = s.q = NAN;
    return s;
  }
};

/// What a row's lanes carry into the block's merge.
struct LaneOut {
  detail::LpState<double> st;
  double x_sum;
  float max_before;
};

/// The lanes' states merged in a fixed order (down each warp by shuffles, then the warps in
/// order), the result in thread 0: the same bits on every run.
template <bool kDist>
__device__ __forceinline__ LaneOut block_merge(LaneOut s, double c) {
  __shared__ LaneOut warp_part[kThreads / kWarpSize];
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    detail::LpState<double> o;
    o.m = shfl_down(s.st.m, off);
    o.r = shfl_down(s.st.r, off);
    o.u = shfl_down(s.st.u, off);
    o.q = kDist ? shfl_down(s.st.q, off) : 0.0;
    s.st = merge2(s.st, o, c);
    if (kDist) {
      s.x_sum += shfl_down(s.x_sum, off);
      s.max_before = fmaxf(s.max_before, shfl_down(s.max_before, off));
    }
  }
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) warp_part[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / kWarpSize; ++w) {
      s.st = merge2(s.st, warp_part[w].st, c);
      if (kDist) {
        s.x_sum += warp_part[w].x_sum;
        s.max_before = fmaxf(s.max_before, warp_part[w].max_before);
      }
    }
  }
  return s;
}

template <typename T, bool kDist>
__global__ void __launch_bounds__(kThreads) lp_stats_kernel(const LpRows r, const T* logits, int64_t stride,
                                                            int64_t V, float* stats) {
  constexpr int kVec = Segment<T>::kVec;
  const int64_t i = blockIdx.x;
  const int tid = threadIdx.x;
  float* out = stats + i * kLogprobStatsWidth;
  const int64_t t = i < r.rows ? lp_target(r, i) : r.ignore_index;
  if (t == r.ignore_index) {  // ignored rows and the spare row: zeros (the whole block leaves)
    if (tid < kLogprobStatsWidth) out[tid] = 0.0f;
    return;
  }
  if (tid >= (kDist ? 8 : 5) && tid < kLogprobStatsWidth) out[tid] = 0.0f;
  const int64_t tl = t - r.vocab_start;
  const T* x = logits + i * stride;
  // What the row's result needs besides its sums, read before the loop so that no pointer
  // stays live across it.
  const bool holds = tl >= 0 && tl < V;
  const float z_t = holds ? Elem<T>::to_float(x[tl]) * r.inv_t : 0.0f;
  const int off = row_offset(x);
  const int64_t segs = (V + off + kVec - 1) / kVec;
  const T fill = Elem<T>::from_float(-INFINITY);
  const float c = r.inv_t * kLog2e;
  LaneState lane;
  int64_t s0 = tid;
  for (; s0 + (kUnroll - 1) * kThreads < segs; s0 += kUnroll * kThreads) {
    Segment<T> seg[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) seg[k] = load_segment(x, s0 + k * kThreads, off, V, fill);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) lane.push<kDist>(seg[k], c, (s0 + k * kThreads) * kVec - off, V, tl);
  }
  for (; s0 < segs; s0 += kThreads) lane.push<kDist>(load_segment(x, s0, off, V, fill), c, s0 * kVec - off, V, tl);
  const LaneOut row = block_merge<kDist>(LaneOut{lane.state(), lane.x_sum, lane.max_before}, double(c));
  if (tid == 0) {
    float* o = stats + static_cast<int64_t>(blockIdx.x) * kLogprobStatsWidth;
    o[0] = row.st.m * r.inv_t;
    o[1] = static_cast<float>(row.st.r);
    o[2] = static_cast<float>(row.st.u * kLn2);
    o[3] = z_t;
    o[4] = holds ? 1.0f : 0.0f;
    if (kDist) {
      o[5] = static_cast<float>(row.st.q);
      o[6] = static_cast<float>(row.x_sum * r.inv_t);
      o[7] = row.max_before * r.inv_t;
    }
  }
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

/// Step 1 from the fused statistics product's (tile, row) partials (lp_fused_products.h): a warp
/// a row; lane l folds tiles l, l + 32, ... in order (each a state relative to its own max,
/// exactly as shards merge), then the lanes merge down the warp in a fixed order: the same bits
/// every run. Writes the statistics row launch_lp_stats writes; with r.dist the distribution
/// columns from the second plane of partials (else 0).
__global__ void __launch_bounds__(kMergeThreads)
    lp_fold_tiles_kernel(const LpRows r, const float4* partials, int64_t tiles, int64_t tile_cols, int64_t cols,
                         float* stats) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kMergeThreads + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (i > r.rows) return;  // whole warps: a row's lanes leave together
  float* o = stats + i * kLogprobStatsWidth;
  const int64_t t = i < r.rows ? lp_target(r, i) : r.ignore_index;
  if (t == r.ignore_index) {  // ignored rows and row `rows`: zeros (no partial was written)
    if (lane < kLogprobStatsWidth) o[lane] = 0.0f;
    return;
  }
  const float4* dist = partials + tiles * r.rows;  // read only with r.dist
  detail::LpState<double> st = detail::lp_empty<double>();
  double x_sum = 0.0;
  float max_before = -INFINITY;
  for (int64_t k = lane; k < tiles; k += kWarpSize) {
    const float4 p = partials[k * r.rows + i];
    const float4 d = r.dist ? dist[k * r.rows + i] : make_float4(0.0f, 0.0f, -INFINITY, 0.0f);
    st = detail::lp_merge(st, detail::LpState<float>{p.x, p.y, p.z, d.x});
    x_sum += d.y;
    max_before = fmaxf(max_before, d.z);
  }
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    detail::LpState<double> other;
    other.m = shfl_down(st.m, off);
    other.r = shfl_down(st.r, off);
    other.u = shfl_down(st.u, off);
    other.q = shfl_down(st.q, off);
    st = detail::lp_merge(st, other);
    x_sum += shfl_down(x_sum, off);
    max_before = fmaxf(max_before, shfl_down(max_before, off));
  }
  if (lane == 0) {
    const int64_t tl = t - r.vocab_start;
    const bool holds = tl >= 0 && tl < cols;
    o[0] = st.m;
    o[1] = static_cast<float>(st.r);
    o[2] = static_cast<float>(st.u);
    o[3] = holds ? partials[(tl / tile_cols) * r.rows + i].w : 0.0f;
    o[4] = holds ? 1.0f : 0.0f;
    o[5] = r.dist ? static_cast<float>(st.q) : 0.0f;
    o[6] = r.dist ? static_cast<float>(x_sum) : 0.0f;
    o[7] = r.dist ? max_before : 0.0f;
  } else if (lane >= 8 && lane < kLogprobStatsWidth) {
    o[lane] = 0.0f;
  }
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
  // lp_grad's non-target form in base 2: with d2 = x c - lse log2(e) (one FFMA; c = log2(e) / T),
  // p = 2^d2 (subnormals kept, as expf gives them) and z - lse = d2 ln 2, so dx = p (A + B d2)
  // with 1 / T folded into A and B; the position is clamped so that a -inf logit gives 0, not
  // 0 * -inf. The target's entry is lp_grad's own (1 - p_t as -expm1 of the logprob: exact in
  // collapse), set once a segment.
  const float inv_t = p.r.inv_t;
  const float c = inv_t * kLog2e;
  const float nl2 = -(g.lse * kLog2e);
  const float A = -(g.g_lp + g.g_h * g.entropy) * inv_t;
  const float B = -g.g_h * inv_t * static_cast<float>(kLn2);
  const float at_target = detail::lp_grad(g, 0.0f, true) * inv_t;
  const int64_t tl = t - p.r.vocab_start;
  const T fill = Elem<T>::from_float(0.0f);
  // Each segment is read before it is written, by the same thread (dx may be x).
  auto grad = [&](Segment<T>& seg, int64_t s) {
    const int64_t j0 = s * kVec - off;
    float d[kVec];
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 v = seg_pair(seg, k);
      const float d0 = fmaf(v.x, c, nl2), d1 = fmaf(v.y, c, nl2);
      d[2 * k] = ex2_subnormal(d0) * fmaf(B, fmaxf(d0, -256.0f), A);
      d[2 * k + 1] = ex2_subnormal(d1) * fmaf(B, fmaxf(d1, -256.0f), A);
    }
    const uint64_t at = static_cast<uint64_t>(tl - j0);
    if (at < static_cast<uint64_t>(kVec)) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) d[k] = static_cast<uint64_t>(k) == at ? at_target : d[k];
    }
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) set_pair(seg, k, d[2 * k], d[2 * k + 1]);
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

void launch_lp_fold_tiles(const LpRows& r, const float4* partials, int64_t tiles, int64_t tile_cols, int64_t cols,
                          float* stats, cudaStream_t stream) {
  constexpr int64_t kRowsPerBlock = kMergeThreads / kWarpSize;
  const unsigned blocks = static_cast<unsigned>((r.rows + 1 + kRowsPerBlock - 1) / kRowsPerBlock);
  lp_fold_tiles_kernel<<<blocks, kMergeThreads, 0, stream>>>(r, partials, tiles, tile_cols, cols, stats);
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
