// The stream kernel's reductions of an item's statistics: each warp folds its lanes' partials
// (warp_fold), then the group's warp partials are folded into the row's (or split's) statistics
// by one of four routes:
// - asynchronous (forward over whole rows; the default): each warp posts its partial and counts
//   itself in, and the warp that arrives last folds them and writes the row's results; no warp
//   waits for another;
// - synchronous: a named barrier, then one warp (or, with the gradient on whole rows, every
//   warp, so the gradient sweep starts without a second barrier) folds them;
// - halves: the two blocks of a cluster swap their halves' statistics through distributed
//   shared memory and merge them in rank order (both hold the same bits);
// - splits: each split publishes its partial, and the row's last split to finish folds them
//   (or the split-merge pass after the kernel).
#pragma once

#include <cstdint>

#include "common/numeric.h"
#include "cuda/ce/element_math.cuh"
#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/ce/stream_finish.cuh"
#include "cuda/ce/stream_schedule.cuh"
#include "cuda/ce/stream_stats.cuh"
#include "cuda/port.h"
#include "cuda/tma.cuh"

namespace fusedce {
namespace cuda {

/// A warp's partial statistics folded in two passes: the warp's max, then each lane's sums scaled
/// to it once and added. Five online merges (two exps and a compare each, on one dependent
/// chain) cost several times more, and this runs once per row in every warp. Butterflies: every
/// lane ends with the same bits (each level adds the same two values, and addition commutes;
/// the argmax is a selection under a total order), the association of a tree onto lane 0.
/// The argmax (metrics) folds in a butterfly of its own. Lanes past the partials to fold hold
/// empty ones (m = -inf, sums 0, no argmax).
__device__ __forceinline__ RowPartial warp_fold(RowPartial p, bool metrics) {
  float m = p.st.m;
#pragma unroll
  for (int d = kWarpSize / 2; d > 0; d >>= 1) m = fmaxf(m, shfl_xor(m, d));
  // As lse_merge: an empty state scales by 0 (a NaN sum stays NaN), all-empty keeps its sums.
  const float f = m == -INFINITY ? 1.0f : ex2((p.st.m - m) * kLog2e);
  float s = p.st.s * f, ez = p.st.ez * f, sm = p.smooth;
#pragma unroll
  for (int d = kWarpSize / 2; d > 0; d >>= 1) {
    s += shfl_xor(s, d);
    sm += shfl_xor(sm, d);
    if (metrics) ez += shfl_xor(ez, d);
  }
  if (metrics) {
#pragma unroll
    for (int d = kWarpSize / 2; d > 0; d >>= 1) {
      const float ov = shfl_xor(p.amax_v, d);
      const int64_t oi = shfl_xor(p.amax_i, d);
      if (argmax_better(ov, oi, p.amax_v, p.amax_i)) {
        p.amax_v = ov;
        p.amax_i = oi;
      }
    }
  }
  p.st = detail::LseState{m, s, ez};
  p.smooth = sm;
  return p;
}

/// The reductions' shared memory (arrays the kernel declares apart, so that a variant drops the
/// ones it never touches). Warp partials: synchronous reduction, double-buffered by row parity (a
/// warp may start writing the next row's partial while warp 0 still reads this row's; one
/// barrier between them); asynchronous reduction, kReduceSlots slots with an arrival count each
/// (per group). Halves: the other block's partial, written here through distributed shared
/// memory, and the mbarrier it arrives on; double-buffered by row parity.
struct ReduceShared {
  RowPartial (*warp_part)[kStreamConsumerWarps];  // [kReduceSlots]
  RowPartial* row_part;
  RowPartial* half_part;  // [2]
  uint64_t* half_full;    // [2]
  int (*arrivals)[kMaxStreamGroups];  // [kReduceSlots]
};

/// A consumer thread's place in its group and the reductions' running counts (the kernel
/// advances them after each item; the reductions take them by value).
struct Consumer {
  int warp, lane;
  int gi;      // this thread's group
  int gtid;    // and its index there
  int gwarp0;  // the group's first warp (folds, synchronous reduction)
  int parity = 0;     // which warp_part buffer this row uses (synchronous reduction)
  uint32_t seq = 0;   // items reduced asynchronously so far (the slot; ignored rows are not)
};

/// The target's z, carried in the partial of the one thread that loaded the target logit.
template <typename T>
__device__ __forceinline__ void attach_target(RowPartial& b, const StreamItem<T> it, bool softcap) {
  if (it.holds_t) {
    b.z_target = transform(Elem<T>::to_float(it.x_t), it.c, softcap);
    b.has_target = 1;
  }
}

template <typename T>
__device__ __forceinline__ void write_item_results(const RowParams& p, int64_t row, const RowPartial& b,
                                                   const StreamItem<T> it, bool weighted, bool metrics) {
  write_row_results(p, row, b, detail::lse_value(b.st), b.has_target ? b.z_target : NAN, it.c, it.w_t, it.t,
                    weighted, metrics);
}

/// Asynchronous reduction (forward over whole rows): each warp posts its partial and counts
/// itself in (a shared-memory atomic); the warp of the group that arrives last folds the group's
/// partials and writes the row's results. Short rows paid for a finalizing warp waiting at a
/// per-item barrier (13% of all warp samples at 16384 x 32000 under ncu), and the last to arrive
/// is the slowest warp anyway. Slots (partials and counters, one set per group) are safe to
/// reuse: every item has at least one chunk, and no warp can run more than kStages chunks ahead
/// of the slowest (the ring's empty barriers), so at most kStages + 1 < kReduceSlots items are in
/// flight; the folding warp is among the slowest.
template <typename S, typename T>
__device__ __forceinline__ void reduce_async(const ReduceShared sh, const Consumer cs, RowPartial mine,
                                             const RowParams& p, int64_t row, const StreamItem<T> it, bool weighted,
                                             bool softcap, bool metrics) {
  const int slot = static_cast<int>(cs.seq % kReduceSlots);
  int last = 0;
  if (cs.lane == 0) {
    attach_target(mine, it, softcap);  // the target rides in warp 0's partial (lane 0 keeps it through the fold)
    sh.warp_part[slot][cs.warp] = mine;
    __threadfence_block();  // the partial is visible before the count that announces it
    last = atomicAdd(&sh.arrivals[slot][cs.gi], 1) == S::gwarps - 1;
  }
  if (!shfl_idx(last, 0)) return;
  __threadfence_block();  // every other warp's partial, announced by its count...
  __syncwarp();           // ...and lane 0's observation of it ordered before every lane's reads
  RowPartial b = cs.lane < S::gwarps ? sh.warp_part[slot][cs.gwarp0 + cs.lane] : empty_partial();
  b = warp_fold(b, metrics);
  if (cs.lane == 0) {
    sh.arrivals[slot][cs.gi] = 0;
    write_item_results(p, row, b, it, weighted, metrics);
  }
}

/// Halves: swap partials with the other block of the cluster through distributed shared memory;
/// both blocks merge rank 0's then rank 1's, so both hold the same bits of the row's statistics.
__device__ __forceinline__ RowPartial exchange_halves(const ReduceShared sh, uint32_t& hseq, RowPartial b, int crank,
                                                      bool metrics) {
  const int hslot = static_cast<int>(hseq & 1);
  const uint32_t use = hseq >> 1;
  ++hseq;
  const uint32_t peer = static_cast<uint32_t>(crank ^ 1);
  const uint32_t dst = map_to_rank(&sh.half_part[hslot], peer);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&b);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(RowPartial) / 4); ++i) store_cluster_u32(dst + 4 * i, words[i]);
  mbar_arrive_remote(map_to_rank(&sh.half_full[hslot], peer));
  mbar_wait_cluster(&sh.half_full[hslot], use & 1);
  const RowPartial o = sh.half_part[hslot];
  return crank == 0 ? merge_partial(b, o, metrics) : merge_partial(o, b, metrics);
}

/// Whether every warp of the group folds the row's partials itself (whole rows with the
/// gradient, not halves): then each holds the row's lse for the gradient sweep without a second
/// barrier and a round trip through row_part.
template <typename S>
__device__ __forceinline__ bool every_warp_folds(const StreamWalk& walk) {
  return grad_here<S>(walk.sp) && !walk.halves;
}

/// Synchronous reduction; returns the row's lse in every warp when every_warp_folds (same
/// inputs, same order: the same bits in every warp), else 0 (sync_row_lse then reads it). The
/// partials are double-buffered by row parity: a warp writes the next row's into the other
/// buffer, and this row's buffer again only after the next row's barrier, which every warp
/// reaches after reading this row's partials. `hseq` counts the rows exchanged with the other
/// half (halves).
template <typename S, typename T>
__device__ __forceinline__ float reduce_sync(const ReduceShared sh, const Consumer cs, uint32_t& hseq,
                                             const RowPartial mine, const StreamWalk walk, int64_t row, int split,
                                             const StreamItem<T> it, bool weighted, bool softcap, bool metrics) {
  const StreamParams& sp = walk.sp;
  const RowParams& p = sp.row;
  const bool grad = grad_here<S>(sp);
  const int slot = cs.parity;
  if (cs.lane == 0) sh.warp_part[slot][cs.warp] = mine;
  named_barrier(1 + cs.gi, S::gthreads);  // warp partials written (and the last row's row_part read)
  const bool every_warp = every_warp_folds<S>(walk);
  float lse_here = 0.0f;
  int split_last = 0;  // this split finished its row last (splits with finish)
  if (every_warp || cs.warp == cs.gwarp0) {
    RowPartial b = cs.lane < S::gwarps ? sh.warp_part[slot][cs.gwarp0 + cs.lane] : empty_partial();
    b = warp_fold(b, metrics);
    if (every_warp) lse_here = detail::lse_value(b.st);
    if (cs.warp == cs.gwarp0 && cs.lane == 0) {
      attach_target(b, it, softcap);
      if (walk.halves) b = exchange_halves(sh, hseq, b, walk.crank, metrics);
      if (sp.splits > 1) {
        // Publish this split's partial and move on: the row's last split to finish folds the
        // partials (below; or the split-merge pass after this kernel), so no block waits on
        // another's arrival.
        static_cast<RowPartial*>(sp.partials)[row * sp.splits + split] = b;
        if (sp.finish) {
          __threadfence();  // the partial is visible before the count that announces it
          split_last = arrive_tagged(&sp.counters[1 + row], sp.tag) == static_cast<uint32_t>(sp.splits);
        }
      } else if (walk.crank == 0) {  // one half writes the row's results
        write_item_results(p, row, b, it, weighted, metrics);
      }
      if (grad && !every_warp) *sh.row_part = b;  // the halves' gradient sweep's lse
    }
    if (!S::kGrad && sp.splits > 1 && cs.warp == cs.gwarp0 && shfl_idx(split_last, 0)) {
      // The row's last split: every partial is in (their counts announced them).
      __threadfence();
      __syncwarp();
      const RowPartial* parts = static_cast<const RowPartial*>(sp.partials) + row * sp.splits;
      const RowPartial a = fold_split_partials(parts, sp.splits, cs.lane, metrics);
      if (cs.lane == 0) {
        clear_tagged(&sp.counters[1 + row]);
        write_item_results(p, row, a, it, weighted, metrics);
      }
    }
  }
  return lse_here;
}

/// The row's lse for the gradient sweep after reduce_sync: its own where every warp folded,
/// else the one the group's first warp left in row_part (after a second barrier).
template <typename S>
__device__ __forceinline__ float sync_row_lse(const ReduceShared sh, const Consumer cs, const StreamWalk walk,
                                              float lse_here) {
  const bool every_warp = every_warp_folds<S>(walk);
  if (!every_warp) named_barrier(1 + cs.gi, S::gthreads);  // row_part visible
  return every_warp ? lse_here : detail::lse_value(sh.row_part->st);
}

}  // namespace cuda
}  // namespace fusedce
