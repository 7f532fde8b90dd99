// The stream kernel's gradient sweep (forward + gradient over whole rows): with the row's lse
// known, the row's chunks are read once more (re-staged by the producer from L2, or still in
// the ring for rows of at most StreamShape::keep_max chunks) and dlogits is written from them:
// dx = g (a p - eps/V - [j == t] b_t) dz/dx, on the plain arithmetic one FMA and one EX2 per
// element. Also an ignored row's zero gradient.
#pragma once

#include <cstdint>

#include "common/numeric.h"
#include "cuda/ce/element_math.cuh"
#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/ce/stream_producer.cuh"
#include "cuda/ce/stream_schedule.cuh"
#include "cuda/ce/stream_stats.cuh"
#include "cuda/port.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {

/// An ignored row's gradient: zeros (the group's threads over the row's segments).
template <typename S, typename T>
__device__ __forceinline__ void zero_row_grad(const RowParams& p, int64_t row, int gtid) {
  const int V = static_cast<int>(p.vocab);
  T* dx = static_cast<T*>(p.dlogits) + row * p.dlogits_stride;
  const int doff = row_offset(dx);
  const int dseg = static_cast<int>(row_segments(V, doff, S::kVec));
  Segment<T> zero;
  zero.raw = u32x4_zero();
  for (int s = gtid; s < dseg; s += S::gthreads) store_segment(dx, s, doff, V, zero);
}

/// Per-class smoothing weights in the gradient (class weights with label smoothing), formed from
/// the parameters where the sweep uses it: a flag carried in from the item's set-up made the
/// compiler merge the weights' loads with the unweighted path (register copies per element) and
/// the 16-bit options gradient kernels spill 16 bytes more.
__device__ __forceinline__ bool class_smoothing(const RowParams& p) {
  return p.class_weight != nullptr && p.smoothing;
}

/// Whether the gradient needs the per-element form (options_grad_segment): a per-element dz/dx
/// (soft-cap) or per-class smoothing weights. Decided once per row, outside the sweep: tested
/// per segment, the compiler reloaded the two parameters before every segment's branch (to save
/// registers), and the branch cut the segment's exponentials off from the loads and conversions
/// they were interleaved with; the one-group options kernels lost 3-5% to the stalls.
template <typename S>
__device__ __forceinline__ bool per_element_grad(const RowParams& p, bool softcap) {
  return S::kExtras && (softcap || class_smoothing(p));
}

/// The gradient sweep over the item's chunks, in the producer's order (backwards when
/// StreamParams::grad_backwards, except for a row kept in the ring, whose stages are read again
/// from row_at, already waited for and not released since). `at` moves past the row's second
/// copy when there is one.
/// `g` and `it` are taken by value: the sweep stores to global memory, which a reference could
/// alias, and a copy lets every field stay in a register across the stores.
/// kPerElement: per_element_grad's answer for the row; the sweep is compiled once for each, so
/// that the common form has no option branch inside it.
template <typename S, typename T, bool kPerElement>
__device__ __forceinline__ void gradient_sweep(const StreamParams& sp, int64_t row, const ItemGeometry<T> g,
                                               const StreamItem<T> it, bool softcap, float lse,
                                               float g_chain,
                                               const StreamRing& ring, RingPos& at, RingPos row_at, int ring0,
                                               int ring1, int gtid, int lane, bool in_ring) {
  using E = Elem<T>;
  constexpr int kVec = S::kVec;
  const RowParams& p = sp.row;
  const int V = static_cast<int>(p.vocab);
  const detail::LossConstants& c = it.c;
  const int t = it.t;
  T* dx = static_cast<T*>(p.dlogits) + row * p.dlogits_stride;
  const bool same_layout = row_offset(dx) == g.off;
  const float gr = g_chain * it.g_up;
  const detail::RowGrad rg = detail::row_grad(c, lse, it.w_t, gr);
  // p's exponent in one FMA, its per-row factor folded into g a scale (the row kernel's
  // backward forms the same constants: same bits).
  const PlainGradExp pe = plain_grad_exp(lse, c);
  const float ga_s = __fmul_rn(__fmul_rn(rg.g_a, c.logit_scale), pe.factor), gc_s = rg.g_c * c.logit_scale;
  const int seg_t = it.valid_t ? (t + g.off) / kVec : -1;
  RingPos gat = in_ring ? row_at : at;
  for (int i = 0; i < g.c1 - g.c0; ++i, gat.next(ring0, ring1)) {
    const int ch = in_ring || !sp.grad_backwards ? g.c0 + i : g.c1 - 1 - i;  // in the producer's order
    const unsigned char* buf = ring.stage(gat.stage);
    if (!in_ring) mbar_wait(&ring.full[gat.stage], gat.phase);
    const bool inner = g.interior(ch);
    uint32_t token = 0;
    for (int q = 0; q < S::groups; ++q) {  // the chunk's passes (one without groups)
      const int sb = q * S::pass_segs + gtid;
      Segment<T> seg[kSegsPerThread];
      g.fetch_chunk(seg, buf, ch, sb, S::gthreads, V, it.fill);
      token ^= stage_token(seg);
      if (q == S::groups - 1) release_stage(&ring.empty[gat.stage], token, lane, V);
#pragma unroll
      for (int k = 0; k < kSegsPerThread; ++k) {
        const int s = ch * kChunkSegs + sb + k * S::gthreads;
        if (!inner && s >= g.nseg) continue;
        const int j0 = s * kVec - g.off;
        Segment<T> out;
        if (kPerElement) {
          // Per-element dz/dx (soft-cap) or per-class smoothing weight; class weights alone only
          // scale the row (through g_a, g_bt) and take the plain arithmetic below.
          out = options_grad_segment(seg[k], j0, p, lse, rg, c, softcap, class_smoothing(p));
        } else {
          // dx = g a scale p - g eps/V scale, p = exp(x scale - lse): the same arithmetic on the
          // plain path and with options that leave dz/dx = scale (smoothing, z-loss, metrics).
#pragma unroll
          for (int i = 0; i < kVec / 2; ++i) {
            const float2 xx = seg_pair(seg[k], i);
            set_pair(out, i, fmaf(ga_s, ex2(fmaf(xx.x, pe.a, -pe.l)), -gc_s),
                     fmaf(ga_s, ex2(fmaf(xx.y, pe.a, -pe.l)), -gc_s));
          }
        }
        if (s == seg_t) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if (j0 + e == t) {
              out.e[e] = E::from_float(grad_elem(E::to_float(seg[k].e[e]), lse, rg, it.w_t, rg.g_bt, c, softcap));
            }
          }
        }
        if (inner && same_layout) {
          store_streaming(reinterpret_cast<U32x4*>(dx + j0), out.raw);  // wholly inside the row
        } else if (same_layout) {
          store_segment(dx, s, g.off, V, out);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const int j = j0 + e;
            if (j >= 0 && j < V) dx[j] = out.e[e];
          }
        }
      }
    }
  }
  if (!in_ring) at = gat;  // past the second copy of the row
}

}  // namespace cuda
}  // namespace fusedce
