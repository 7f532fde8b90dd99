// The stream kernel's statistics sweep: each consumer thread folds its segments of every staged
// chunk of an item into an online (max, sum of exps) state, with the smoothing sum, the entropy
// term and the argmax riding along when the options ask for them; then the argmax is resolved
// to an element once per item. Two arithmetics: the plain one (logit_scale > 0, the max over raw
// logits, one FFMA + one EX2 + one add per element; the options variant adds its terms in
// raw-logit units, the same exps, so options that leave the math alone leave the loss bits),
// and the general one (soft-cap or logit_scale < 0: z formed once per element and kept).
// Also the item's set-up the sweeps and reductions share (StreamItem).
#pragma once

#include <cfloat>
#include <cstdint>

#include "common/argmax_track.h"
#include "common/numeric.h"
#include "cuda/ce/element_math.cuh"
#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/ce/stream_schedule.cuh"
#include "cuda/port.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {

/// One item's target and constants, set up before its sweep.
template <typename T>
struct StreamItem {
  bool valid_t;
  int t;           // the target, or -1
  float w_t;       // the target's class weight (1 unweighted, NaN for a bad target)
  float g_up;      // the upstream gradient of the row (gradient)
  detail::LossConstants c;
  T fill;          // the value past the row's ends (the identity of the max)
  float a_log2;    // logit_scale log2(e): exponents in base 2 (plain arithmetic)
  bool holds_t;    // this thread loaded the target logit
  T x_t;           // ... here
};

/// Class weights (options variants) and the soft-cap (general variant). The kernel forms both
/// once per item and hands them to the parts as plain flags, not as StreamItem fields: a flag
/// carried through the item's copies reached the sweeps' branches on it in another form, and the
/// 16-bit gradient kernels spilled more.
template <typename S>
__device__ __forceinline__ bool weighted_of(const RowParams& p) {
  return S::kExtras && p.class_weight != nullptr;
}
template <typename S>
__device__ __forceinline__ bool softcap_of(const RowParams& p) {
  return S::kGeneral && p.softcap;  // the planner picks the general variant for it
}

/// The item's set-up. The target logit is loaded by the one thread whose item holds it and only
/// used at the end, so its latency hides behind the sweep; it is read before this row's
/// barriers, hence before any of its gradient stores (in place). So is the upstream gradient.
template <typename S, typename T>
__device__ __forceinline__ StreamItem<T> item_setup(const StreamWalk& walk, const ItemGeometry<T>& g, int64_t row,
                                                    int64_t t64, int gtid, bool weighted) {
  using E = Elem<T>;
  const RowParams& p = walk.sp.row;
  const int V = static_cast<int>(p.vocab);
  StreamItem<T> it;
  it.valid_t = t64 >= 0 && t64 < V;
  it.t = it.valid_t ? static_cast<int>(t64) : -1;
  it.w_t = !it.valid_t ? NAN : (weighted ? p.class_weight[it.t * p.weight_stride] : 1.0f);
  // The upstream gradient, loaded now so its latency hides behind the statistics sweep.
  it.g_up = grad_here<S>(walk.sp) && p.grad_loss ? p.grad_loss[p.grad_scalar ? 0 : row * p.grad_stride] : 1.0f;
  it.c = p.c;
  if (weighted && p.batch) it.c.weight_sum = p.batch->weight_sum;
  it.fill = E::from_float(it.c.logit_scale > 0.0f ? -INFINITY : INFINITY);
  it.a_log2 = __fmul_rn(it.c.logit_scale, kLog2e);
  const int item_lo = g.c0 * kChunkSegs * S::kVec - g.off, item_hi = g.c1 * kChunkSegs * S::kVec - g.off;
  const bool whole = walk.sp.splits == 1 && !walk.halves;
  it.holds_t = gtid == 0 && it.valid_t && (whole || (it.t >= item_lo && it.t < item_hi));
  it.x_t = it.holds_t ? g.x[it.t] : it.fill;
  return it;
}

/// A partial of nothing: the identity of every merge.
__device__ __forceinline__ RowPartial empty_partial() {
  RowPartial r;
  r.st = detail::lse_empty();
  r.smooth = 0.0f;
  r.amax_v = -INFINITY;
  r.amax_i = INT64_MAX;
  r.z_target = 0.0f;
  r.has_target = 0;
  return r;
}

/// The factor that moves a running sum from the running max `old_m` to the new reference `ref`
/// (exponents in base 2, scaled by `a`): 1 where the max did not move (no exp: the common
/// case), else 2^((old_m - ref) a) in double. A float factor rounded at every move of the max
/// compounds over a row whose max keeps growing (one rounding per chunk, thousands of chunks).
__device__ __forceinline__ double rescale_factor(float old_m, float ref, float a) {
  if (old_m == -INFINITY || old_m == ref) return 1.0;
  return exp2((double(old_m) - double(ref)) * double(a));
}

/// A thread's running statistics over an item. run_m: the general variant's running max in z;
/// run_xm: the others' in raw logits. The running sums fold the item's chunks in double
/// (rescale_factor): a split of 2^30 logits folds 2048 chunks per thread. The argmax along this thread is tracked per segment and
/// resolved once per item (common/argmax_track.h): the options variant in raw-logit units (scale
/// > 0 keeps the order), the general one in z.
struct SweepState {
  float run_m = -INFINITY, run_xm = -INFINITY, smooth = 0.0f;
  double run_s = 0.0, run_ez = 0.0;
  detail::SegmentArgmax amax;
};

/// Segment sg's smoothing term: sum_j v_j or sum_j w_j v_j over the row's elements. Bitwise
/// conditions (no short-circuit): selects, not a branch per element.
template <typename T, typename ValueAt>
__device__ __forceinline__ float smooth_term(int sg, const ItemGeometry<T>& g, const RowParams& p, int V,
                                             bool weighted, ValueAt value_at) {
  constexpr int kVec = Segment<T>::kVec;
  const int j0 = sg * kVec - g.off;
  const bool interior = sg >= g.first_full && sg <= g.last_full;
  float sm[kVec];
  if (weighted) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int j = j0 + e;
      const bool in_row = interior | ((j >= 0) & (j < V));
      const float w = in_row ? p.class_weight[int64_t(in_row ? j : 0) * p.weight_stride] : 0.0f;
      sm[e] = in_row ? w * value_at(e) : 0.0f;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int j = j0 + e;
      sm[e] = (interior | ((j >= 0) & (j < V))) ? value_at(e) : 0.0f;
    }
  }
#pragma unroll
  for (int wdt = kVec / 2; wdt > 0; wdt /= 2) {
#pragma unroll
    for (int e = 0; e < wdt; ++e) sm[e] += sm[e + wdt];
  }
  return sm[0];
}

/// One pass over a chunk (segments ch * kChunkSegs + sb + k * gthreads), plain arithmetic
/// (logit_scale > 0): the max over raw logits (packed pairs for 16-bit types), then one FFMA +
/// one EX2 + one add per element. The exponent is x a - r in one FFMA (a = scale log2(e), r = ref
/// a rounded), taken from the raw running max `ref`: the FFMA's exact product makes it
/// (x - ref) a + cc, where cc = ref a - r is the product's rounding residual, exact by one more
/// FFMA and the same for the whole chunk; the chunk's sums are multiplied by 2^-cc once. So the
/// sum is of 2^((x - ref) a) with one rounding per exponent, as precise as forming x scale - ref
/// first, at one FMUL per element less.
template <typename S, typename T>
__device__ __forceinline__ void fold_plain_pass(SweepState& st, const Segment<T> (&seg)[kSegsPerThread],
                                                const ItemGeometry<T>& g, const StreamItem<T> it,
                                                const RowParams& p, int V, int ch, int sb, bool weighted,
                                                bool metrics) {
  using E = Elem<T>;
  constexpr int kVec = S::kVec;
  constexpr bool kExtras = S::kExtras;
  const float a_log2 = it.a_log2;
  float xmax[kSegsPerThread];
  float xm = -INFINITY;
#pragma unroll
  for (int k = 0; k < kSegsPerThread; ++k) {
    xmax[k] = seg_max(seg[k]);
    xm = fmaxf(xm, xmax[k]);
  }
  const float new_xm = fmaxf(st.run_xm, xm);
  const float ref = new_xm == -INFINITY ? 0.0f : new_xm;
  const float r = __fmul_rn(ref, a_log2);
  const float unshift = ex2(-fmaf(ref, a_log2, -r));
  const double scale = rescale_factor(st.run_xm, ref, a_log2);
  float acc[kSegsPerThread];
  float ez = 0.0f;
  const bool smooth_in_pairs = kExtras && p.smoothing && !weighted;
#pragma unroll
  for (int k = 0; k < kSegsPerThread; ++k) {
    const int sg = ch * kChunkSegs + sb + k * S::gthreads;
    float es[kVec / 2];
    float ss = 0.0f;  // the segment's raw sum (smoothing, unweighted, inside the row)
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      const float2 xx = seg_pair(seg[k], i);
      const float e0 = ex2(fmaf(xx.x, a_log2, -r)), e1 = ex2(fmaf(xx.y, a_log2, -r));
      es[i] = e0 + e1;
      // p x, 0 (not 0 * -inf) where x = -inf (masked or not): -FLT_MAX keeps the product 0.
      if (kExtras && metrics) ez = fmaf(e1, fmaxf(xx.y, -FLT_MAX), fmaf(e0, fmaxf(xx.x, -FLT_MAX), ez));
      if (kExtras && smooth_in_pairs) ss += xx.x + xx.y;
    }
#pragma unroll
    for (int wdt = kVec / 4; wdt > 0; wdt /= 2) {
#pragma unroll
      for (int i = 0; i < wdt; ++i) es[i] += es[i + wdt];
    }
    acc[k] = es[0];
    if constexpr (kExtras) {
      if (p.smoothing) {
        const bool interior = sg >= g.first_full && sg <= g.last_full;
        st.smooth += !weighted && interior
                         ? ss
                         : smooth_term(sg, g, p, V, weighted, [&](int e) { return E::to_float(seg[k].e[e]); });
      }
      if (metrics) st.amax.add(sg, sg < g.nseg, xmax[k], acc[k]);
    }
  }
  static_assert(kSegsPerThread == 4, "the sum below pairs four segments");
  st.run_s = fma(double((acc[0] + acc[1]) + (acc[2] + acc[3])), double(unshift), st.run_s * scale);
  if (kExtras && metrics) st.run_ez = fma(double(ez), double(unshift), st.run_ez * scale);
  st.run_xm = new_xm;
}

/// One pass over a chunk, general arithmetic (soft-cap, or logit_scale < 0): z formed once per
/// element and kept (the soft-cap's tanh costs two MUFU ops), -inf outside the row; only the
/// row's ragged end segments check indices per element. Branches are uniform and outside the
/// element loops: per-element conditions around the tanh made the compiler branch per element
/// (SASS: BSSY/BSYNC pairs, ~20 instructions per element). 16-bit logits: the thread's segments
/// in two halves, an online update each, so that only half of z is live at once (the bf16
/// gradient kernel spilled 136 bytes with all of it).
template <typename S, typename T>
__device__ __forceinline__ void fold_general_pass(SweepState& st, const Segment<T> (&seg)[kSegsPerThread],
                                                  const ItemGeometry<T>& g, const StreamItem<T> it,
                                                  const RowParams& p, int V, int ch, int sb, bool weighted,
                                                  bool softcap, bool metrics) {
  using E = Elem<T>;
  constexpr int kVec = S::kVec;
  const detail::LossConstants& c = it.c;
  constexpr int kHalves = sizeof(T) == 2 ? 2 : 1;
  constexpr int kPer = kSegsPerThread / kHalves;
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    float zc[kPer][kVec];
    float segmax[kPer];
    float cm = -INFINITY;
    if (softcap) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) zc[k][e] = transform(E::to_float(seg[h * kPer + k].e[e]), c, true);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) zc[k][e] = transform(E::to_float(seg[h * kPer + k].e[e]), c, false);
      }
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int sg = ch * kChunkSegs + sb + (h * kPer + k) * S::gthreads;
      const int j0 = sg * kVec - g.off;
      if (sg < g.first_full || sg > g.last_full) {  // a ragged end (or past the row): mask
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (j0 + e < 0 || j0 + e >= V) zc[k][e] = -INFINITY;
        }
      }
      if (p.smoothing) st.smooth += smooth_term(sg, g, p, V, weighted, [&](int e) { return zc[k][e]; });
      float mx[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) mx[e] = zc[k][e];
#pragma unroll
      for (int wdt = kVec / 2; wdt > 0; wdt /= 2) {
#pragma unroll
        for (int e = 0; e < wdt; ++e) mx[e] = fmaxf(mx[e], mx[e + wdt]);
      }
      segmax[k] = mx[0];
      cm = fmaxf(cm, mx[0]);
    }
    const float new_m = fmaxf(st.run_m, cm);
    const float ref = detail::lse_ref(new_m);
    const double scale = rescale_factor(st.run_m, ref, kLog2e);
    float acc[kPer], acc_ez[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      float es[kVec], ezs[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        es[e] = exp_rel(0.0f, zc[k][e], ref, c, true);  // exp(z - ref), 0 outside the row
        ezs[e] = metrics && es[e] > 0.0f ? es[e] * zc[k][e] : 0.0f;  // 0, not 0 * -inf
      }
#pragma unroll
      for (int i = 0; i < kVec / 2; ++i) {
        es[i] = es[2 * i] + es[2 * i + 1];
        ezs[i] = ezs[2 * i] + ezs[2 * i + 1];
      }
#pragma unroll
      for (int wdt = kVec / 4; wdt > 0; wdt /= 2) {
#pragma unroll
        for (int i = 0; i < wdt; ++i) {
          es[i] += es[i + wdt];
          ezs[i] += ezs[i + wdt];
        }
      }
      acc[k] = es[0];
      acc_ez[k] = ezs[0];
      if (metrics) {
        const int sg = ch * kChunkSegs + sb + (h * kPer + k) * S::gthreads;
        st.amax.add(sg, sg < g.nseg, segmax[k], acc[k]);
      }
    }
    static_assert(kPer == 4 || kPer == 2, "the sums below pair two or four segments");
    if constexpr (kPer == 4) {
      st.run_s = st.run_s * scale + double((acc[0] + acc[1]) + (acc[2] + acc[3]));
      if (metrics) st.run_ez = st.run_ez * scale + double((acc_ez[0] + acc_ez[1]) + (acc_ez[2] + acc_ez[3]));
    } else {
      st.run_s = st.run_s * scale + double(acc[0] + acc[1]);
      if (metrics) st.run_ez = st.run_ez * scale + double(acc_ez[0] + acc_ez[1]);
    }
    st.run_m = new_m;
  }
}

/// The argmax's element (metrics): the first NaN at or after nan_seg (its sum can be NaN from a
/// +inf logit alone, then the search goes on), else the first element equal to the max in its
/// segment. The segments are read again from memory (L2): once per item and thread. Returns
/// (value, index); index INT32_MAX where this thread has no element of the row.
struct ArgmaxElem {
  float v;
  int i;
};
template <typename S, typename T>
__device__ __forceinline__ ArgmaxElem resolve_argmax(const detail::SegmentArgmax amax, const ItemGeometry<T> g,
                                                     const StreamItem<T> it, int V, int gtid, bool softcap) {
  using E = Elem<T>;
  constexpr int kVec = S::kVec;
  const T fill = it.fill;
  const detail::LossConstants c = it.c;
  auto values_of = [&](int sg) {
    const Segment<T> sgm = load_segment(g.x, sg, g.off, V, fill);
    return [=](int e) {
      const float x = E::to_float(sgm.e[e]);
      return S::kGeneral ? transform(x, c, softcap) : x;
    };
  };
  int best_i = -1;
  float best_v = -INFINITY;
  if (amax.nan_seg >= 0) {
    for (int ch = g.c0; ch < g.c1 && best_i < 0; ++ch) {
      for (int q = 0; q < S::groups && best_i < 0; ++q) {
        for (int k = 0; k < kSegsPerThread && best_i < 0; ++k) {
          const int sg = ch * kChunkSegs + q * S::pass_segs + gtid + k * S::gthreads;
          if (sg < amax.nan_seg || sg >= g.nseg) continue;
          best_i = detail::first_nan_in_segment<kVec>(sg * kVec - g.off, V, values_of(sg));
        }
      }
    }
    best_v = NAN;
  }
  if (best_i < 0 && amax.seg >= 0) {
    best_i = detail::first_equal_in_segment<kVec>(amax.seg * kVec - g.off, V, amax.max, values_of(amax.seg));
    best_v = amax.max;
  }
  if (best_i < 0) {  // no element (no row segment along this thread)
    best_i = INT32_MAX;
    best_v = -INFINITY;
  }
  return ArgmaxElem{best_v, best_i};
}

/// One chunk's pass of the statistics sweep (segments ch * kChunkSegs + sb + k * gthreads),
/// folded into `st` by the variant's arithmetic.
template <typename S, typename T>
__device__ __forceinline__ void fold_pass(SweepState& st, const Segment<T> (&seg)[kSegsPerThread],
                                          const ItemGeometry<T>& g, const StreamItem<T> it, const RowParams& p, int V,
                                          int ch, int sb, bool weighted, bool softcap, bool metrics) {
  if constexpr (!S::kGeneral) {
    fold_plain_pass<S>(st, seg, g, it, p, V, ch, sb, weighted, metrics);
  } else {
    fold_general_pass<S>(st, seg, g, it, p, V, ch, sb, weighted, softcap, metrics);
  }
}

/// The thread's partial from its sweep (statistics in z units; the options variant's sums are in
/// raw-logit units, z = x * scale), with the argmax's element resolved (metrics).
template <typename S, typename T>
__device__ __forceinline__ RowPartial sweep_partial(const SweepState& st, const ItemGeometry<T>& g,
                                                    const StreamItem<T> it, int V, int gtid, bool softcap,
                                                    bool metrics) {
  const detail::LossConstants& c = it.c;
  RowPartial mine = empty_partial();
  const float unit = S::kGeneral ? 1.0f : c.logit_scale;
  mine.st = detail::LseState{S::kGeneral ? st.run_m : st.run_xm * c.logit_scale, float(st.run_s),
                             float(st.run_ez * unit)};
  mine.smooth = st.smooth * unit;
  if (metrics) {
    const ArgmaxElem best = resolve_argmax<S>(st.amax, g, it, V, gtid, softcap);
    mine.amax_v = best.v;
    mine.amax_i = best.i;
  }
  return mine;
}

}  // namespace cuda
}  // namespace fusedce
