// The fused cross-entropy row pass (forward statistics, and the gradient in the same sweep).
//
// What it fuses: per row, one read of the logits into registers; the row's max, sum of exps,
// target logit, smoothing sum, argmax and entropy terms from those registers; the merge of the
// blocks' partial states across a thread-block cluster through distributed shared memory (sm_90),
// so every block of the row learns the row's lse; then dlogits written straight from the same
// registers. Nothing of size N x V is stored besides dlogits, and no logit is read twice when the
// row fits the cluster's registers (pieces == 1; else each piece is re-read for the gradient).
//
// Bytes: forward N*V*sizeof(T) read; with the gradient 2*N*V*sizeof(T). The limit is device memory
// bandwidth; the exps (one MUFU.EX2 per element per sweep) stay under the SFU rate at that bandwidth.
#pragma once

#include "cuda/port.h"  // first: the platform's runtime header (HIP defines __host__ there)

#include <cfloat>
#include <cstdint>

#include "common/numeric.h"
#include "cuda/ce/element_math.cuh"
#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {

constexpr int kMaxThreads = 1024;

/// Shared memory of the row pass.
struct RowShared {
  RowPartial warp[kMaxThreads / kWarpSize];
  RowPartial block;  // this block's partial, read by the cluster's other blocks
  RowPartial row;    // the merged row
};

/// The geometry of one block's share of a row: where its segments start and how many there are.
template <typename T>
struct RowSpan {
  const T* x;      // the row's logits
  T* dx;           // the row's dlogits (gradient kernels)
  int off, doff;   // the rows' misalignment in elements (row_offset)
  int V, nseg;     // the row's length and its segments at the logits' alignment
  int piece_segs;  // segments per piece: blockDim.x * kItems
  int block_seg0;  // this block's first segment
  int tid;
  /// First segment a thread holds of `piece`; its k-th is that + k * blockDim.x.
  __device__ __forceinline__ int seg0(int piece) const { return block_seg0 + piece * piece_segs + tid; }
};

/// An ignored row: zero results (forward, written once by the cluster's first thread) and a zero
/// gradient over this block's segments. The caller's branch is uniform over the cluster, so no
/// block waits at a cluster barrier the others skip.
template <typename T, bool kForward, bool kGrad, bool kExtras>
__device__ __forceinline__ void ignored_row(const RowParams& p, int64_t row, int rank, const RowSpan<T>& r) {
  constexpr int kVec = Segment<T>::kVec;
  if (kForward && rank == 0 && r.tid == 0) {
    p.row_loss[row * p.row_loss_stride] = 0.0f;
    if (p.lse_out) p.lse_out[row * p.lse_stride] = 0.0f;
    if (kExtras && p.metrics) {
      p.row_entropy[row] = 0.0f;
      p.row_correct[row] = 0;
    }
  }
  if (kGrad) {
    // dlogits may have one segment more than the logits: the last block covers the rest.
    const int dseg = static_cast<int>(row_segments(r.V, r.doff, kVec));
    const int end = rank == p.cluster - 1 ? dseg : min(dseg, r.block_seg0 + p.pieces * r.piece_segs);
    Segment<T> zero;
    zero.raw = u32x4_zero();
    for (int s = r.block_seg0 + r.tid; s < end; s += blockDim.x) store_segment(r.dx, s, r.doff, r.V, zero);
  }
}

/// Loads one piece of the row into registers; segments past the row's end hold `fill`. Each
/// segment is formed in a local and stored to reg[k] once: with reg[k] assigned in both branches
/// ptxas held the 16-bit fused forward + gradient kernel (kItems = 4) to 32 registers, with 344
/// bytes of stack (64 registers and 40 bytes this way).
template <typename T, int kItems>
__device__ __forceinline__ void load_piece(Segment<T> (&reg)[kItems], const RowSpan<T>& r, int piece, T fill) {
  constexpr int kVec = Segment<T>::kVec;
  const int s0 = r.seg0(piece);
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int s = s0 + k * static_cast<int>(blockDim.x);
    Segment<T> seg;
    if (s < r.nseg) {
      seg = load_segment(r.x, s, r.off, r.V, fill);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) seg.e[e] = fill;
    }
    reg[k] = seg;
  }
}

/// z of element e of a register segment whose first element is column j0; in the extras path,
/// -inf outside the row (the plain path's fill already has z = -inf).
template <typename T, bool kExtras>
__device__ __forceinline__ float z_at(const Segment<T>& seg, int e, int j0, int V, const detail::LossConstants& c,
                                      bool softcap) {
  const float z = transform(Elem<T>::to_float(seg.e[e]), c, softcap);
  if (kExtras) {
    const int j = j0 + e;
    return (j >= 0 && j < V) ? z : -INFINITY;
  }
  return z;
}

/// The statistics of the piece in registers, folded into this thread's running state: max,
/// then sum of exps (and the entropy term) against it; in the extras path the smoothing sum and
/// the argmax. Each segment is reduced as a tree first, so the dependent chain is kItems long,
/// not kItems * kVec.
template <typename T, int kItems, bool kExtras>
__device__ __forceinline__ void piece_stats(const Segment<T> (&reg)[kItems], const RowSpan<T>& r, int piece,
                                            const RowParams& p, const detail::LossConstants& c, bool softcap,
                                            bool weighted, bool metrics, RowPartial& mine, detail::LseAccum& run) {
  constexpr int kVec = Segment<T>::kVec;
  const int s0 = r.seg0(piece);
  float m = -INFINITY;
  int amax_i = INT32_MAX;
  float amax_v = -INFINITY;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int j0 = (s0 + k * static_cast<int>(blockDim.x)) * kVec - r.off;
    float zs[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) zs[e] = z_at<T, kExtras>(reg[k], e, j0, r.V, c, softcap);
    if (kExtras) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int j = j0 + e;
        const bool in_row = j >= 0 && j < r.V;
        const float z = zs[e];
        if (p.smoothing && in_row) mine.smooth += weighted ? p.class_weight[int64_t(j) * p.weight_stride] * z : z;
        // torch.argmax: the first NaN, else the first maximum (elements come in order of j).
        if (metrics && in_row && (amax_i == INT32_MAX || (!(z <= amax_v) && amax_v == amax_v))) {
          amax_v = z;
          amax_i = j;
        }
      }
    }
#pragma unroll
    for (int w = kVec / 2; w > 0; w /= 2) {
#pragma unroll
      for (int e = 0; e < w; ++e) zs[e] = fmaxf(zs[e], zs[e + w]);
    }
    m = fmaxf(m, zs[0]);
  }
  const float ref = detail::lse_ref(m);
  float s = 0.0f, ez = 0.0f;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int j0 = (s0 + k * static_cast<int>(blockDim.x)) * kVec - r.off;
    float es[kVec], ezs[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float z = z_at<T, kExtras>(reg[k], e, j0, r.V, c, softcap);
      es[e] = z == -INFINITY ? 0.0f : exp_rel(Elem<T>::to_float(reg[k].e[e]), z, ref, c, softcap);
      if (metrics) ezs[e] = es[e] > 0.0f ? es[e] * z : 0.0f;  // 0, not 0 * -inf, when masked
    }
#pragma unroll
    for (int w = kVec / 2; w > 0; w /= 2) {
#pragma unroll
      for (int e = 0; e < w; ++e) {
        es[e] += es[e + w];
        if (metrics) ezs[e] += ezs[e + w];
      }
    }
    s += es[0];
    if (metrics) ez += ezs[0];
  }
  detail::lse_accum_add(run, detail::LseState{m, s, ez});
  if (metrics && argmax_better(amax_v, amax_i, mine.amax_v, mine.amax_i)) {
    mine.amax_v = amax_v;
    mine.amax_i = amax_i;
  }
}

/// The row's merged partial into sh.row, visible to the whole block: warp shuffles, warp 0 over
/// the warps, then (sm_90, clusters) every block's partial through distributed shared memory,
/// merged in rank order. A fixed order throughout, so the bits do not depend on timing.
__device__ __forceinline__ void reduce_row(RowShared& sh, RowPartial mine, int cluster, bool metrics, int tid) {
#pragma unroll
  for (int d = kWarpSize / 2; d > 0; d >>= 1) mine = merge_partial(mine, shfl_down_partial(mine, d, metrics, true), metrics);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize, nwarps = blockDim.x / kWarpSize;
  if (lane == 0) sh.warp[warp] = mine;
  __syncthreads();  // warp partials visible to warp 0
  if (warp == 0) {  // sh.block is written only here, and read after the next barrier
    RowPartial b = sh.warp[lane < nwarps ? lane : 0];
#pragma unroll
    for (int d = 1; d < kWarpSize; d *= 2) {
      const RowPartial o = shfl_down_partial(b, d, metrics, true);
      if ((lane & (2 * d - 1)) == 0 && lane + d < nwarps) b = merge_partial(b, o, metrics);
    }
    if (lane == 0) sh.block = b;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) {
    namespace cg = cooperative_groups;
    cg::cluster_group group = cg::this_cluster();
    group.sync();  // every block's partial written before any is read
    if (warp == 0) {
      // Lane q fetches block q's partial (one DSMEM round trip for all), then the warp merges
      // them in rank order: the tree below always pairs lower ranks first.
      RowPartial r = *group.map_shared_rank(&sh.block, lane < cluster ? lane : 0);
#pragma unroll
      for (int d = 1; d < kWarpSize; d *= 2) {
        const RowPartial o = shfl_down_partial(r, d, metrics, true);
        if ((lane & (2 * d - 1)) == 0 && lane + d < cluster) r = merge_partial(r, o, metrics);
      }
      if (lane == 0) sh.row = r;
    }
    group.sync();  // no block leaves (freeing its shared memory) while others still read it
  } else
#endif
  {
    __syncthreads();  // sh.block written by warp 0
    if (tid == 0) sh.row = sh.block;
  }
  __syncthreads();  // sh.row visible to the whole block
}

/// The gradient sweep: dlogits of this block's segments from the row's lse, piece by piece
/// (re-read unless the forward left the only piece in registers).
template <typename T, int kItems, bool kForward, bool kExtras>
__device__ __forceinline__ void grad_sweep(Segment<T> (&reg)[kItems], const RowSpan<T>& r, const RowParams& p,
                                           int64_t row, float lse, bool valid_t, int t, float w_t,
                                           const detail::LossConstants& c, bool softcap, bool weighted, T fill) {
  using E = Elem<T>;
  constexpr int kVec = Segment<T>::kVec;
  const float g_chain = p.batch ? p.batch->g_chain : 1.0f;
  const float g = g_chain * (p.grad_loss ? p.grad_loss[p.grad_scalar ? 0 : row * p.grad_stride] : 1.0f);
  const detail::RowGrad rg = detail::row_grad(c, lse, w_t, g);
  // Plain path: dx = (g a scale) p - (g eps/V scale), the scale folded into the constants and
  // p's per-row factor into the first (plain_grad_exp).
  const PlainGradExp pe = plain_grad_exp(lse, c);
  const float ga_s = __fmul_rn(__fmul_rn(rg.g_a, c.logit_scale), pe.factor), gc_s = rg.g_c * c.logit_scale;
  const int seg_t = valid_t ? (t + r.off) / kVec : -1;
  const bool same_layout = r.doff == r.off;
  for (int piece = 0; piece < p.pieces; ++piece) {
    if (!kForward || p.pieces > 1) load_piece(reg, r, piece, fill);
    const int s0 = r.seg0(piece);
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int s = s0 + k * static_cast<int>(blockDim.x);
      const int j0 = s * kVec - r.off;
      Segment<T> out;
      if (kExtras && (softcap || (weighted && p.smoothing))) {
        // Per-element dz/dx (soft-cap) or per-class smoothing weight; class weights alone only
        // scale the row (through g_a, g_bt) and take the plain arithmetic below.
        out = options_grad_segment(reg[k], j0, p, lse, rg, c, softcap, weighted && p.smoothing);
      } else {
        // dx = g a scale p - g eps/V scale, p = exp(x scale - lse); pairs convert at once. The
        // same arithmetic as the streaming kernel's, so backward and forward-with-gradient agree
        // bit for bit.
#pragma unroll
        for (int i = 0; i < kVec / 2; ++i) {
          const float2 xx = seg_pair(reg[k], i);
          set_pair(out, i, fmaf(ga_s, ex2(fmaf(xx.x, pe.a, -pe.l)), -gc_s),
                   fmaf(ga_s, ex2(fmaf(xx.y, pe.a, -pe.l)), -gc_s));
        }
      }
      if (s == seg_t) {
        // The target's own term, once per row, by the thread that holds it.
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (j0 + e == t) out.e[e] = E::from_float(grad_elem(E::to_float(reg[k].e[e]), lse, rg, w_t, rg.g_bt, c, softcap));
        }
      }
      if (s < r.nseg) {
        if (same_layout) {
          store_segment(r.dx, s, r.off, r.V, out);
        } else {
          // Different alignment of dlogits rows: element by element (rare: strided views).
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const int j = j0 + e;
            if (j >= 0 && j < r.V) r.dx[j] = out.e[e];
          }
        }
      }
    }
  }
}

/// Fused row kernel. kItems: 16-byte segments per thread per piece (kept in registers);
/// kGrad: write dlogits; kForward: compute the statistics (else lse comes from lse_in);
/// kExtras: softcap / smoothing / class weights / metrics compiled in (runtime flags pick).
/// Indices inside a row are int (V < 2^31, checked by the launcher); row offsets are int64.
template <typename T, int kItems, bool kForward, bool kGrad, bool kExtras>
__global__ void __launch_bounds__(max_row_threads(kItems)) ce_row_kernel(const RowParams p) {
  using E = Elem<T>;
  constexpr int kVec = Segment<T>::kVec;
  __shared__ RowShared sh;

  const int rank = p.cluster > 1 ? static_cast<int>(blockIdx.x % p.cluster) : 0;
  const int64_t row = static_cast<int64_t>(blockIdx.x / p.cluster);
  if (row >= p.rows) return;  // uniform for the whole cluster
  RowSpan<T> r;
  r.V = static_cast<int>(p.vocab);
  r.x = static_cast<const T*>(p.logits) + row * p.logits_stride;
  r.dx = kGrad ? static_cast<T*>(p.dlogits) + row * p.dlogits_stride : nullptr;
  r.off = row_offset(r.x);
  // dlogits rows may sit at another alignment than the logits rows (different strides).
  r.doff = kGrad ? row_offset(r.dx) : 0;
  const int64_t t64 = load_target_dev(p, row);
  r.nseg = static_cast<int>(row_segments(r.V, r.off, kVec));
  r.piece_segs = static_cast<int>(blockDim.x) * kItems;
  r.block_seg0 = rank * p.pieces * r.piece_segs;
  r.tid = static_cast<int>(threadIdx.x);
  if (t64 == p.ignore_index) {
    ignored_row<T, kForward, kGrad, kExtras>(p, row, rank, r);
    return;
  }

  const bool valid_t = t64 >= 0 && t64 < r.V;
  const int t = valid_t ? static_cast<int>(t64) : -1;
  const bool weighted = kExtras && p.class_weight != nullptr;
  const bool softcap = kExtras && p.softcap;
  // A target outside [0, V) has no logit and no weight: NaN makes its loss and gradient NaN.
  const float w_t = !valid_t ? NAN : (weighted ? p.class_weight[t * p.weight_stride] : 1.0f);
  detail::LossConstants c = p.c;
  if (weighted && p.batch) c.weight_sum = p.batch->weight_sum;
  // Logits past the row's ends load as this value; in the plain path its z is -inf, which no
  // max, sum of exps or gradient store sees. The extras path masks them explicitly.
  const T fill = E::from_float(c.logit_scale > 0.0f ? -INFINITY : INFINITY);
  // Read before any barrier, hence before any gradient store (in place, x[t] is overwritten).
  const float z_t = (kForward && rank == 0 && r.tid == 0 && valid_t) ? transform(E::to_float(r.x[t]), c, softcap) : NAN;

  Segment<T> reg[kItems];  // the piece held in registers
  float lse;
  if (kForward) {
    const bool metrics = kExtras && p.metrics;
    RowPartial mine;
    // The pieces fold in double (detail::LseAccum): a long row has thousands of pieces.
    detail::LseAccum run = detail::lse_accum_empty();
    mine.smooth = 0.0f;
    mine.amax_v = -INFINITY;
    mine.amax_i = INT64_MAX;
    for (int piece = 0; piece < p.pieces; ++piece) {
      load_piece(reg, r, piece, fill);
      piece_stats<T, kItems, kExtras>(reg, r, piece, p, c, softcap, weighted, metrics, mine, run);
    }
    mine.st = detail::lse_accum_state(run);
    reduce_row(sh, mine, p.cluster, metrics, r.tid);
    lse = detail::lse_value(sh.row.st);
    if (rank == 0 && r.tid == 0) write_row_results(p, row, sh.row, lse, z_t, c, w_t, t, weighted, metrics);
  } else {
    lse = p.lse_in[row * p.lse_in_stride];
  }
  if (kGrad) {
    grad_sweep<T, kItems, kForward, kExtras>(reg, r, p, row, lse, valid_t, t, w_t, c, softcap, weighted, fill);
  }
}

}  // namespace cuda
}  // namespace fusedce
