// The streaming cross-entropy pass for Hopper: forward statistics, and with them the gradient.
//
// What it fuses: persistent blocks (one per SM) walk the work items (a row, or a split of a row
// when there are few rows: each split publishes its partial statistics, and the last split of
// the row to finish folds them), and the block that finishes last forms the batch sums
// (stream_finish.cuh): one launch per call. A producer warp has the copy engine stream each item's 32 KB chunks
// into a ring of shared-memory stages (cp.async.bulk + mbarrier), kStages chunks ahead, across
// row boundaries; 16 consumer warps fold each chunk into per-thread online (max, sum of exps)
// states, then reduce the row (short rows: two groups of 8 warps, each with its own rows and its
// own half of the ring). With the gradient, the row is streamed a second time (from L2: the
// block read it microseconds before) and dlogits is written from the staged chunks. Nothing of
// size N x V is stored besides dlogits, and device memory sees each logit read once.
//
// Bytes: forward N*V*sizeof(T); with the gradient 2*N*V*sizeof(T) (plus the L2 re-read). The
// limit is device-memory bandwidth: kStages * 32 KB = 192 KB of loads in flight per SM covers it.
//
// Its parts, each in a header of its own:
//   stream_schedule.cuh  the work scheduler: the walk over items, an item's geometry, the variant's shape
//   stream_producer.cuh  the producer: the bulk-copy ring of stages and its handback protocol
//   stream_stats.cuh     the statistics sweep (plain and general arithmetic, argmax resolution)
//   stream_reduce.cuh    the reductions: warps, then asynchronous / synchronous / halves / splits
//   stream_grad.cuh      the gradient sweep
//   stream_finish.cuh    the end of the call: split rows merged, batch sums formed
#pragma once

#include <cstdint>

#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/port.h"
#if !FUSEDCE_PLATFORM_HIP
#include "cuda/ce/stream_finish.cuh"
#include "cuda/ce/stream_grad.cuh"
#include "cuda/ce/stream_producer.cuh"
#include "cuda/ce/stream_reduce.cuh"
#include "cuda/ce/stream_schedule.cuh"
#include "cuda/ce/stream_stats.cuh"
#include "cuda/tma.cuh"
#endif

namespace fusedce {
namespace cuda {

#if !FUSEDCE_PLATFORM_HIP  // sm_90 only: on HIP just the kernel's empty shell below, never launched

/// An ignored row's results: zeros (its loss and lse, and its metrics' terms), written once per
/// row (by its first split).
__device__ __forceinline__ void write_ignored_row(const RowParams& p, int64_t row, bool metrics) {
  p.row_loss[row * p.row_loss_stride] = 0.0f;
  if (p.lse_out) p.lse_out[row * p.lse_stride] = 0.0f;
  if (metrics) {
    p.row_entropy[row] = 0.0f;
    p.row_correct[row] = 0;
  }
}

/// The barriers' set-up (thread 0): the ring's full and empty mbarriers, the halves' exchange
/// barriers, the asynchronous reduction's counts and the finish's count of valid targets.
template <typename S>
__device__ __forceinline__ void init_block(const StreamRing& ring, const ReduceShared& red, unsigned int* den_count) {
  for (int i = 0; i < kStages; ++i) {
    mbar_init(&ring.full[i], 1);          // the producer's arrive (+ the copy's bytes)
    mbar_init(&ring.empty[i], S::gwarps);  // one arrive per warp of the group that reads it
  }
  for (int i = 0; i < 2; ++i) mbar_init(&red.half_full[i], 1);  // the other block's remote arrive
  for (int i = 0; i < kReduceSlots; ++i) {
    for (int j = 0; j < kMaxStreamGroups; ++j) red.arrivals[i][j] = 0;
  }
  *den_count = 0;
  mbar_init_fence();
}

#endif

/// The stream kernel: the producer warp fills the ring; each consumer group walks its items
/// (every groups-th of the block's), and for each: set-up, statistics sweep, reduction, and with
/// the gradient the gradient sweep; the block's consumers then finish the call. kOpts: a
/// StreamOpts; kGroups: consumer groups, 1 or 2 (a compile-time count: a runtime one slowed every
/// path, 8192 x 128256 bf16 fwd+grad by 17%).
template <typename T, bool kGrad, int kOpts, int kGroups = 1>
__global__ void __launch_bounds__(kStreamThreads, 1) ce_stream_kernel(const StreamParams sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = StreamShape<T, kGrad, kOpts, kGroups>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ RowPartial warp_part[kReduceSlots][kStreamConsumerWarps];
  __shared__ RowPartial row_part;
  __shared__ RowPartial half_part[2];
  __shared__ uint64_t half_full[2];
  __shared__ int arrivals[kReduceSlots][kMaxStreamGroups];
  const ReduceShared red = {warp_part, &row_part, half_part, half_full, arrivals};
  // The finish's per-warp sums (one buffer per team sum) and count of valid targets.
  __shared__ BatchSums finish_scratch[2][kStreamConsumerWarps];
  __shared__ unsigned int den_count;
  const StreamRing ring(smem);
  const RowParams& p = sp.row;
  const int V = static_cast<int>(p.vocab);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const StreamWalk walk(sp);
  const bool grad = grad_here<S>(sp);

  if (threadIdx.x == 0) init_block<S>(ring, red, &den_count);
  // Barriers initialised before anyone (in the cluster) waits on or arrives at them.
  if (walk.halves) {
    cluster_sync_all();
  } else {
    __syncthreads();
  }
  if (warp == kStreamConsumerWarps) {
    if (lane != 0) return;
    produce<S, T>(walk, ring);
    return;
  }

  // ---- consumers
  Consumer cs;
  cs.warp = warp;
  cs.lane = lane;
  cs.gi = S::groups == 1 ? 0 : warp / S::gwarps;
  cs.gtid = threadIdx.x - cs.gi * S::gthreads;
  cs.gwarp0 = cs.gi * S::gwarps;
  const int ring0 = cs.gi * S::ring_stages, ring1 = ring0 + S::ring_stages;  // this group's ring
  RingPos at(ring0);  // the next chunk's stage there
  // The asynchronous reduction: never in a gradient kernel (splits == 1 there means the gradient
  // is formed here; saying so at compile time drops the path from those kernels, and their
  // spills with it).
  const bool async = !kGrad && !grad && sp.splits == 1 && sp.async_reduce;
  const bool metrics = S::kExtras && p.metrics;
  int64_t t_next = walk.first < walk.items ? load_target_dev(p, walk.row_of(walk.first)) : 0;
  // The gradient's 1 / denominator: from the prepare pass, or (mean, no prepare pass) counted
  // here by every block, while the producer fills the ring: the same integer in each. (The count
  // stays in shared memory for the finish: a live double here cost the gradient kernels spills.)
  float g_chain = grad && p.batch ? p.batch->g_chain : 1.0f;
  if (kGrad && sp.count_den) {
    g_chain = static_cast<float>(1.0 / count_valid_targets(sp.fin, threadIdx.x, kStreamConsumers, &den_count,
                                                           kFinishBarrier));
  }
  uint32_t hseq = 0;  // rows exchanged with the other half (halves only; reduce_sync counts them)
  int turn = 0;  // the group whose item this is
  for (int64_t w = walk.first; w < walk.items; w += walk.step, turn = turn + 1 == S::groups ? 0 : turn + 1) {
    const int64_t row = walk.row_of(w);
    const int split = walk.split_of(w);
    const int64_t t64 = t_next;  // fetched one item ahead (see the producer)
    if (w + walk.step < walk.items) t_next = load_target_dev(p, walk.row_of(w + walk.step));
    const bool ours = turn == cs.gi;
    if (t64 == p.ignore_index) {
      if (!ours) continue;
      if (split == 0 && cs.gtid == 0) write_ignored_row(p, row, metrics);
      if (grad && walk.crank == 0) zero_row_grad<S, T>(p, row, cs.gtid);
      continue;
    }
    const ItemGeometry<T> g(p, row, split, sp.chunks_per_split);
    if (!ours) continue;  // another group's item (in its own ring)
    const bool weighted = weighted_of<S>(p), softcap = softcap_of<S>(p);
    const StreamItem<T> it = item_setup<S>(walk, g, row, t64, cs.gtid, weighted);
    const bool in_ring = kept_in_ring<S>(walk, g);
    const RingPos row_at = at;  // the row's first stage (a row kept in the ring is read there again)
    // Statistics sweep: each stage waited for, this thread's segments read (one pass, or one per
    // group), the stage handed back (unless the row stays in the ring for the gradient), folded.
    SweepState st;
    for (int ch = g.c0; ch < g.c1; ++ch, at.next(ring0, ring1)) {
      const unsigned char* buf = ring.stage(at.stage);
      mbar_wait(&ring.full[at.stage], at.phase);
      uint32_t token = 0;
      for (int q = 0; q < S::groups; ++q) {
        const int sb = q * S::pass_segs + cs.gtid;  // this thread's first segment of the pass, in the chunk
        Segment<T> seg[kSegsPerThread];
        g.fetch_chunk(seg, buf, ch, sb, S::gthreads, V, it.fill);
        token ^= stage_token(seg);
        if (!in_ring && q == S::groups - 1) release_stage(&ring.empty[at.stage], token, lane, V);
        fold_pass<S>(st, seg, g, it, p, V, ch, sb, weighted, softcap, metrics);
      }
    }
    RowPartial mine = sweep_partial<S>(st, g, it, V, cs.gtid, softcap, metrics);
    mine = warp_fold(mine, metrics);
    if (async) {
      reduce_async<S>(red, cs, mine, p, row, it, weighted, softcap, metrics);
      ++cs.seq;
      continue;
    }
    const float lse_here = reduce_sync<S>(red, cs, hseq, mine, walk, row, split, it, weighted, softcap, metrics);
    cs.parity ^= 1;
    if (!grad) continue;
    const float lse = sync_row_lse<S>(red, cs, walk, lse_here);
    if (per_element_grad<S>(p, softcap)) {
      gradient_sweep<S, T, true>(sp, row, g, it, softcap, lse, g_chain, ring, at, row_at, ring0, ring1, cs.gtid,
                                 lane, in_ring);
    } else {
      gradient_sweep<S, T, false>(sp, row, g, it, softcap, lse, g_chain, ring, at, row_at, ring0, ring1, cs.gtid,
                                  lane, in_ring);
    }
  }
  if (sp.finish && (sp.fin.loss_out || sp.fin.num_correct_out)) finish_batch(sp, &den_count, finish_scratch);
#endif
}

/// The stream kernel for one dtype (each row_<dtype>.cu instantiates it). Consumer groups exist
/// in the plain and options sets (kept alike so that metrics leave the loss bits unchanged); the
/// general set keeps one group (its z array would spill more).
template <typename T>
StreamKernel pick_stream_kernel(bool grad, StreamOpts opts, int groups) {
  const bool two = groups == 2 && opts != kStreamGeneral;
  switch (opts) {
    case kStreamPlain:
      if (two) return grad ? ce_stream_kernel<T, true, kStreamPlain, 2> : ce_stream_kernel<T, false, kStreamPlain, 2>;
      return grad ? ce_stream_kernel<T, true, kStreamPlain> : ce_stream_kernel<T, false, kStreamPlain>;
    case kStreamOptions:
      if (two) return grad ? ce_stream_kernel<T, true, kStreamOptions, 2> : ce_stream_kernel<T, false, kStreamOptions, 2>;
      return grad ? ce_stream_kernel<T, true, kStreamOptions> : ce_stream_kernel<T, false, kStreamOptions>;
    default: return grad ? ce_stream_kernel<T, true, kStreamGeneral> : ce_stream_kernel<T, false, kStreamGeneral>;
  }
}

}  // namespace cuda
}  // namespace fusedce
