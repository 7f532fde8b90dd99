// The streaming cross-entropy pass for Hopper: forward statistics, and with them the gradient.
//
// What it fuses: persistent blocks (one per SM) walk the work items (a row, or a split of a row
// when there are few rows: each split publishes its partial statistics, and the last split of
// the row to finish folds them), and the block that finishes last forms the batch sums
// (finish.cuh): one launch per call. A producer warp has the copy engine stream each item's 32 KB chunks
// into a ring of shared-memory stages (cp.async.bulk + mbarrier), kStages chunks ahead, across
// row boundaries; 16 consumer warps fold each chunk into per-thread online (max, sum of exps)
// states, then reduce the row (short rows: two groups of 8 warps, each with its own rows and its
// own half of the ring). With the gradient, the row is streamed a second time (from L2: the
// block read it microseconds before) and dlogits is written from the staged chunks. Nothing of
// size N x V is stored besides dlogits, and device memory sees each logit read once.
//
// Bytes: forward N*V*sizeof(T); with the gradient 2*N*V*sizeof(T) (plus the L2 re-read). The
// limit is device-memory bandwidth: kStages * 32 KB = 192 KB of loads in flight per SM covers it.
#pragma once

#include <cstdint>

#include "common/argmax_track.h"
#include "cuda/port.h"
#include "cuda/row_kernel.cuh"
#if !FUSEDCE_PLATFORM_HIP
#include "cuda/finish.cuh"
#include "cuda/tma.cuh"
#endif

namespace fusedce {
namespace cuda {

#if !FUSEDCE_PLATFORM_HIP  // sm_90 only: on HIP just the kernel's empty shell below, never launched

/// The factor that moves a running sum from the running max `old_m` to the new reference `ref`
/// (exponents in base 2, scaled by `a`): 1 where the max did not move (no exp: the common
/// case), else 2^((old_m - ref) a) in double. A float factor rounded at every move of the max
/// compounds over a row whose max keeps growing (one rounding per chunk, thousands of chunks).
__device__ __forceinline__ double rescale_factor(float old_m, float ref, float a) {
  if (old_m == -INFINITY || old_m == ref) return 1.0;
  return exp2((double(old_m) - double(ref)) * double(a));
}

/// Where one work item's bytes are: its row, alignment and chunk range.
template <typename T>
struct ItemGeometry {
  static constexpr int kVec = Segment<T>::kVec;
  const T* x;      // the row
  int off;         // elements the row start lies past a 16-byte boundary
  int nseg;        // segments of the row
  int first_full;  // segments [first_full, last_full] lie wholly inside the row
  int last_full;
  int c0, c1;      // chunks [c0, c1) of this item

  __device__ __forceinline__ ItemGeometry(const RowParams& p, int64_t row, int split, int chunks_per_split) {
    const int V = static_cast<int>(p.vocab);
    x = static_cast<const T*>(p.logits) + row * p.logits_stride;
    off = row_offset(x);
    nseg = static_cast<int>(row_segments(V, off, kVec));
    first_full = off == 0 ? 0 : 1;
    last_full = (V + off) / kVec - 1;
    const int nchunks = (nseg + kChunkSegs - 1) / kChunkSegs;
    c0 = min(nchunks, split * chunks_per_split);
    c1 = min(nchunks, c0 + chunks_per_split);
  }
  /// Segment s, from the staged chunk when it lies wholly inside the row, else from global memory
  /// (the row's ragged ends) or `fill` past the row.
  __device__ __forceinline__ Segment<T> fetch(const unsigned char* stage, int c, int s, int V, T fill) const {
    Segment<T> seg;
    if (s >= first_full && s <= last_full) {
      seg.raw = *reinterpret_cast<const U32x4*>(stage + (s - c * kChunkSegs) * 16);
    } else if (s < nseg) {
      seg = load_segment(x, s, off, V, fill);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) seg.e[e] = fill;
    }
    return seg;
  }
  /// Whether chunk c lies wholly inside the row (every chunk but a ragged first or last one).
  __device__ __forceinline__ bool interior(int c) const {
    return c * kChunkSegs >= first_full && (c + 1) * kChunkSegs - 1 <= last_full;
  }
  /// This thread's segments of chunk c: segments base + k stride of the chunk. Interior chunks
  /// (all but the row's ends) are plain shared-memory loads, with no per-segment test of where
  /// the segment lies.
  __device__ __forceinline__ void fetch_chunk(Segment<T> (&seg)[kSegsPerThread], const unsigned char* stage, int c,
                                              int base, int stride, int V, T fill) const {
    if (interior(c)) {
#pragma unroll
      for (int k = 0; k < kSegsPerThread; ++k) {
        seg[k].raw = *reinterpret_cast<const U32x4*>(stage + (base + k * stride) * 16);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kSegsPerThread; ++k) seg[k] = fetch(stage, c, c * kChunkSegs + base + k * stride, V, fill);
    }
  }
};

/// A position in a ring of stages: the stage and the parity of its current round (no division
/// per chunk). With consumer groups each group has a ring of its own (a slice of the
/// stages): a waiter must have seen every round of the stage it waits on, or the round's parity
/// is ambiguous (a group that skipped another group's round could pass a wait for a round that
/// has not landed: the first try of groups over one shared ring, H200, 2026-11-30, gave wrong
/// lse on one row in 35 and hung).
/// (The ring's bounds are the caller's: a position is two registers, and a consumer holds three.)
struct RingPos {
  int stage;
  uint32_t phase = 0;
  __device__ __forceinline__ explicit RingPos(int first) : stage(first) {}
  __device__ __forceinline__ void next(int first, int end) {
    if (++stage == end) {
      stage = first;
      phase ^= 1u;
    }
  }
};

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

/// The consumers' named barrier for the call's finish (groups use 1 and 2).
constexpr int kFinishBarrier = 3;

/// The batch sums at the end of the stream kernel (consumer threads, after their last item):
/// each block sums the whole rows it owned (items first, first + step, ...; none for the second
/// block of a halves cluster, whose partner wrote the results) into block_sums, and the block
/// that arrives last sums those in block order, or with splits the rows themselves (merged by
/// their last splits, all finished once every block has arrived), and writes the outputs.
__device__ inline void finish_batch(const StreamParams& sp, const unsigned int* den_count,
                                    BatchSums (*scratch)[kStreamConsumerWarps]) {
  // The block's items again (recomputed, not kept live across the item loop: that cost the
  // gradient kernels spills).
  const bool halves = sp.halves > 1;
  const int64_t items = sp.row.rows * sp.splits;
  const int64_t first = halves ? blockIdx.x / 2 : blockIdx.x;
  const int64_t step = halves ? gridDim.x / 2 : gridDim.x;
  const bool no_rows = halves && cluster_rank() != 0;  // the other half wrote the results
  const int tid = threadIdx.x;
  __threadfence();  // this thread's row results, before the block's arrival announces them
  named_barrier(kFinishBarrier, kStreamConsumers);
  BatchSums s = {0.0, 0.0, 0.0, 0.0};
  if (sp.splits == 1 && !no_rows && first < items) {
    s = sum_rows(sp.fin, first, step, (items - first + step - 1) / step, tid, kStreamConsumers);
  }
  s = team_sum(s, scratch[0], tid, kStreamConsumers, kFinishBarrier);
  bool last = false;
  if (tid == 0) {
    sp.block_sums[blockIdx.x] = s;
    __threadfence();  // the block's sums (and, before the barrier, its rows) before its arrival
    last = arrive_tagged(&sp.counters[0], sp.tag) == gridDim.x;
  }
  if (!named_barrier_or(kFinishBarrier, kStreamConsumers, last)) return;
  __threadfence();  // every block's writes, announced by the count
  BatchSums total = {0.0, 0.0, 0.0, 0.0};
  if (sp.splits == 1) {
    for (int b = tid; b < static_cast<int>(gridDim.x); b += kStreamConsumers) {
      const double* q = reinterpret_cast<const double*>(sp.block_sums + b);
      total.loss += __ldcg(q);
      total.entropy += __ldcg(q + 1);
      total.correct += __ldcg(q + 2);
      total.den += __ldcg(q + 3);
    }
  } else {
    total = sum_rows(sp.fin, 0, 1, sp.fin.rows, tid, kStreamConsumers);
  }
  total = team_sum(total, scratch[1], tid, kStreamConsumers, kFinishBarrier);  // (the other buffer)
  if (tid == 0) {
    clear_tagged(&sp.counters[0]);
    write_batch_results(sp.fin, total, sp.count_den ? static_cast<double>(*den_count) : -1.0);
  }
}

/// Hands a stage back to the producer once this warp's reads of it are in registers. The arrive
/// is made to depend on the loaded words (a predicate ptxas cannot fold: always true, as V >= 1),
/// so it issues only after the shared-memory loads have returned. Without the dependency ptxas
/// issued the arrive right behind the LDS, before its data came back; under load the copy
/// engine's next bulk write to the stage could land first, and the warp summed another chunk's
/// logits (H200, 2026-11-29: fwd+grad, one row in a few hundred with a wrong lse, different rows
/// each run, once the argmax resolution put a global load between the sweep and the row
/// reduction; with the dependency, the same build passes CudaStream.MetricsLeave* and
/// CudaAgreement run after run). The XORs cost about six instructions per chunk and thread.
/// With consumer groups a warp reads a chunk in several passes: `token` carries the words of the
/// earlier passes (stage_token), so the arrive waits on every load of the stage.
template <typename T>
__device__ __forceinline__ uint32_t stage_token(const Segment<T> (&seg)[kSegsPerThread]) {
  uint32_t token = 0;
#pragma unroll
  for (int k = 0; k < kSegsPerThread; ++k) token ^= seg[k].raw.x ^ seg[k].raw.y ^ seg[k].raw.z ^ seg[k].raw.w;
  return token;
}
__device__ __forceinline__ void release_stage(uint64_t* empty, uint32_t token, int lane, int V) {
  __syncwarp();
  if (lane == 0 && ((token != 0x9E3779B9u) | (V > 0))) mbar_arrive(empty);
}

#endif

/// kOpts: a StreamOpts (the plain path, options, options with the soft-cap). kGroups: consumer
/// groups (below), 1 or 2; a compile-time count, as a runtime one slowed every path (H200,
/// 2026-11-30: 8192 x 128256 bf16 fwd+grad 1.17 -> 1.37 ms with one group).
template <typename T, bool kGrad, int kOpts, int kGroups = 1>
__global__ void __launch_bounds__(kStreamThreads, 1) ce_stream_kernel(const StreamParams sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kExtras = kOpts != kStreamPlain;
  constexpr bool kGeneral = kOpts == kStreamGeneral;
  using E = Elem<T>;
  constexpr int kVec = Segment<T>::kVec;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + size_t(kStages) * kChunkBytes);
  uint64_t* empty = full + kStages;
  // Warp partials. Synchronous reduction: double-buffered by row parity (a warp may start
  // writing the next row's partial while warp 0 still reads this row's; one barrier between
  // them). Asynchronous reduction: kReduceSlots slots, one named barrier each (see below).
  __shared__ RowPartial warp_part[kReduceSlots][kStreamConsumerWarps];
  __shared__ RowPartial row_part;
  // Halves of a row on a 2-block cluster: the other block's partial, written here through
  // distributed shared memory, and the mbarrier it arrives on; double-buffered by row parity.
  __shared__ RowPartial half_part[2];
  __shared__ uint64_t half_full[2];
  // Asynchronous reduction: warps that posted their partial of the item in slot i.
  __shared__ int arrivals[kReduceSlots][kMaxStreamGroups];
  // The call's finish (finish.cuh): per-warp sums (one buffer per team sum), the count of valid
  // targets.
  __shared__ BatchSums finish_scratch[2][kStreamConsumerWarps];
  __shared__ unsigned int den_count;

  const RowParams& p = sp.row;
  const int V = static_cast<int>(p.vocab);
  const int64_t items = p.rows * sp.splits;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  // With sp.halves == 2 each row is shared by the two blocks of a cluster (each streams half,
  // both sweeps), so that the rows in flight on all SMs take half the L2; items then walk
  // clusters, not blocks.
  const bool halves = sp.halves > 1;
  // Consumer groups (short rows): `groups` groups of gwarps warps, each folding every groups-th
  // item of the block on its own (its own ring stages, reduction slots and barrier), a chunk in
  // `groups` passes of kSegsPerThread segments a thread. The per-row costs (item set-up, the
  // warp and row folds) are paid by fewer warps per row: with 2 chunks a row they were about as
  // many instructions as the row's elements. Never with halves or splits (the launcher).
  constexpr int groups = kGroups;
  static_assert(kGroups == 1 || kGroups == kMaxStreamGroups, "consumer groups: 1 or 2");
  constexpr int gwarps = kStreamConsumerWarps / groups;
  constexpr int gthreads = gwarps * kWarpSize;
  const int crank = halves ? static_cast<int>(cluster_rank()) : 0;
  const int64_t first = halves ? blockIdx.x / 2 : blockIdx.x;
  const int64_t step = halves ? gridDim.x / 2 : gridDim.x;
  // The gradient is formed here only when a block (or a cluster) owns whole rows.
  const bool grad_here = kGrad && sp.splits == 1;
  // Item w's row and split; whole rows (the common case) skip the 64-bit division.
  auto row_of = [&](int64_t w) { return sp.splits == 1 ? w : w / sp.splits; };
  auto split_of = [&](int64_t w) { return sp.splits == 1 ? 0 : static_cast<int>(w % sp.splits); };
  // With the gradient, a row of at most kKeepChunks chunks stays in the ring between its two
  // sweeps (its stages are released by the gradient sweep): no second copy from L2, and the
  // stages left over prefetch the next rows. Longer rows are streamed twice.
  // A group's ring is kStages / groups stages: with groups, a kept row leaves one to prefetch.
  constexpr int ring_stages = kStages / groups;
  constexpr int keep_max = groups == 1 ? kKeepChunks : ring_stages - 1;
  auto kept = [&](const ItemGeometry<T>& g) {
    return grad_here && !halves && g.c1 - g.c0 <= keep_max;
  };

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&full[i], 1);                      // the producer's arrive (+ the copy's bytes)
      mbar_init(&empty[i], gwarps);  // one arrive per warp of the group that reads it
    }
    for (int i = 0; i < 2; ++i) mbar_init(&half_full[i], 1);  // the other block's remote arrive
    for (int i = 0; i < kReduceSlots; ++i) {
      for (int j = 0; j < kMaxStreamGroups; ++j) arrivals[i][j] = 0;
    }
    den_count = 0;
    mbar_init_fence();
  }
  // Barriers initialised before anyone (in the cluster) waits on or arrives at them.
  if (halves) {
    cluster_sync_all();
  } else {
    __syncthreads();
  }

  if (warp == kStreamConsumerWarps) {
    // ---- producer: one lane issues every bulk copy, kStages chunks ahead of the consumers.
    if (lane != 0) return;
    // The next chunk's stage in the ring of the group whose item is next, and in the other's
    // (items go to the groups in turn; ignored rows too, though they load nothing).
    RingPos at(0), other(ring_stages);
    int ring0 = 0;  // the first stage of `at`'s ring
    // With the gradient, the first sweep's lines should survive in L2 until the second sweep
    // re-reads them microseconds later; the second sweep's (and dlogits', stored .cs) go first.
    // (evict_normal here is 2-5% slower on the H200, and the L2's persisting set-aside makes no
    // difference.)
    const uint64_t keep = make_l2_policy(grad_here ? L2Policy::kEvictLast : L2Policy::kEvictFirst);
    // (rows kept in the ring are read once: their lines need not stay)
    const uint64_t drop = make_l2_policy(L2Policy::kEvictFirst);
    // Targets are fetched one item ahead: a global load's latency under full bandwidth is about
    // a microsecond, too long to sit in every item's critical path.
    int64_t t_next = first < items ? load_target_dev(p, row_of(first)) : 0;
    for (int64_t w = first; w < items; w += step) {
      if (groups > 1 && w != first) {
        const RingPos swap = at;
        at = other;
        other = swap;
        ring0 = ring_stages - ring0;
      }
      const int64_t row = row_of(w);
      const int64_t t_cur = t_next;
      if (w + step < items) t_next = load_target_dev(p, row_of(w + step));
      if (t_cur == p.ignore_index) continue;
      const ItemGeometry<T> g(p, row, halves ? crank : split_of(w), sp.chunks_per_split);
      const char* aligned = reinterpret_cast<const char*>(g.x - g.off);
      const bool in_ring = kept(g);
      for (int pass = 0; pass < (grad_here && !in_ring ? 2 : 1); ++pass) {
        for (int i = 0; i < g.c1 - g.c0; ++i, at.next(ring0, ring0 + ring_stages)) {
          const int c = pass == 1 && sp.grad_backwards ? g.c1 - 1 - i : g.c0 + i;
          const int stage = at.stage;
          mbar_wait(&empty[stage], at.phase ^ 1u);  // consumers done with its last use
          const int lo = max(c * kChunkSegs, g.first_full);
          const int hi = min((c + 1) * kChunkSegs, g.last_full + 1);
          const uint32_t bytes = hi > lo ? static_cast<uint32_t>(hi - lo) * 16u : 0u;
          mbar_arrive_expect_tx(&full[stage], bytes);
          if (bytes) {
            bulk_load_hint(smem + size_t(stage) * kChunkBytes + size_t(lo - c * kChunkSegs) * 16,
                           aligned + size_t(lo) * 16, bytes, &full[stage], pass == 0 && !in_ring ? keep : drop);
          }
        }
      }
    }
    return;
  }

  // ---- consumers
  const int gi = groups == 1 ? 0 : warp / gwarps;  // this thread's group
  const int gtid = threadIdx.x - gi * gthreads;  // and its index there
  const int gwarp0 = gi * gwarps;                // the group's first warp (folds, synchronous reduction)
  constexpr int pass_segs = kSegsPerThread * gthreads;  // a chunk's segments per pass
  const int ring0 = gi * ring_stages, ring1 = ring0 + ring_stages;  // this group's ring
  RingPos at(ring0);  // the next chunk's stage there
  int parity = 0;                // which warp_part buffer this row uses (synchronous reduction)
  uint32_t seq = 0;              // items reduced so far (ignored rows are not)
  // Asynchronous reduction (forward over whole rows; the default): each warp posts its partial
  // and counts itself in (a shared-memory atomic); the warp of the group that arrives last folds
  // the group's partials and writes the row's results. No warp ever waits for another: short
  // rows paid for a finalizing warp waiting at a per-item barrier (13% of all warp samples at
  // 16384 x 32000, ncu, 2026-11-29), and the last to arrive is the slowest warp anyway. Slots (partials and
  // counters, one set per group) are safe to reuse: every item has at least one chunk, and no
  // warp can run more than kStages chunks ahead of the slowest (the ring's empty barriers), so
  // at most kStages + 1 < kReduceSlots items are in flight; the folding warp is among the slowest.
  // (Never in a gradient kernel: splits == 1 there means grad_here. Saying so at compile time
  // drops the path from those kernels: bf16 spills 160 -> 136 B (general), 72 -> 24 (options).)
  const bool async = !kGrad && !grad_here && sp.splits == 1 && sp.async_reduce;
  const bool metrics = kExtras && p.metrics;
  int64_t t_next = first < items ? load_target_dev(p, row_of(first)) : 0;
  // The gradient's 1 / denominator: from the prepare pass, or (mean, no prepare pass) counted
  // here by every block, while the producer fills the ring: the same integer in each.
  // (The count stays in shared memory for the finish: a live double here cost the gradient
  // kernels spills.)
  float g_chain = grad_here && p.batch ? p.batch->g_chain : 1.0f;
  if (kGrad && sp.count_den) {
    g_chain = static_cast<float>(1.0 / count_valid_targets(sp.fin, threadIdx.x, kStreamConsumers, &den_count, kFinishBarrier));
  }
  uint32_t hseq = 0;  // rows exchanged with the other half (halves only)
  int turn = 0;  // the group whose item this is
  for (int64_t w = first; w < items; w += step, turn = turn + 1 == groups ? 0 : turn + 1) {
    const int64_t row = row_of(w);
    const int split = halves ? crank : split_of(w);
    const int64_t t64 = t_next;  // fetched one item ahead (see the producer)
    if (w + step < items) t_next = load_target_dev(p, row_of(w + step));
    const bool ours = turn == gi;
    if (t64 == p.ignore_index) {
      if (!ours) continue;
      if (split == 0 && gtid == 0) {
        p.row_loss[row * p.row_loss_stride] = 0.0f;
        if (p.lse_out) p.lse_out[row * p.lse_stride] = 0.0f;
        if (metrics) {
          p.row_entropy[row] = 0.0f;
          p.row_correct[row] = 0;
        }
      }
      if (grad_here && crank == 0) {
        T* dx = static_cast<T*>(p.dlogits) + row * p.dlogits_stride;
        const int doff = row_offset(dx);
        const int dseg = static_cast<int>(row_segments(V, doff, kVec));
        Segment<T> zero;
        zero.raw = u32x4_zero();
        for (int s = gtid; s < dseg; s += gthreads) store_segment(dx, s, doff, V, zero);
      }
      continue;
    }
    const ItemGeometry<T> g(p, row, split, sp.chunks_per_split);
    if (!ours) continue;  // another group's item (in its own ring)
    const bool valid_t = t64 >= 0 && t64 < V;
    const int t = valid_t ? static_cast<int>(t64) : -1;
    const bool weighted = kExtras && p.class_weight != nullptr;
    const bool softcap = kGeneral && p.softcap;  // the launcher picks the general variant for it
    const float w_t = !valid_t ? NAN : (weighted ? p.class_weight[t * p.weight_stride] : 1.0f);
    // The upstream gradient, loaded now so its latency hides behind the statistics sweep.
    const float g_up = grad_here && p.grad_loss ? p.grad_loss[p.grad_scalar ? 0 : row * p.grad_stride] : 1.0f;
    detail::LossConstants c = p.c;
    if (weighted && p.batch) c.weight_sum = p.batch->weight_sum;
    const T fill = E::from_float(c.logit_scale > 0.0f ? -INFINITY : INFINITY);
    const float a_log2 = __fmul_rn(c.logit_scale, kLog2e);  // exponents in base 2 (plain arithmetic)
    // The target logit, loaded by the one thread whose item holds it and only used at the end, so
    // its latency hides behind the sweep. Read before this row's barriers, hence before any of
    // its gradient stores (in place).
    const int item_lo = g.c0 * kChunkSegs * kVec - g.off, item_hi = g.c1 * kChunkSegs * kVec - g.off;
    const bool whole = sp.splits == 1 && !halves;
    const bool holds_t = gtid == 0 && valid_t && (whole || (t >= item_lo && t < item_hi));
    const T x_t = holds_t ? g.x[t] : fill;

    // ---- statistics sweep
    RowPartial mine = empty_partial();
    int split_last = 0;  // this split finished its row last (splits with finish)
    // run_m: the general variant's running max in z; run_xm: the others' in raw logits. The
    // running sums fold the item's chunks in double (rescale_factor): a split of 2^30 logits
    // folds 2048 chunks per thread.
    float run_m = -INFINITY, run_xm = -INFINITY, smooth = 0.0f;
    double run_s = 0.0, run_ez = 0.0;
    // The argmax along this thread, tracked per segment and resolved once per item
    // (common/argmax_track.h). The options variant works in raw-logit units (scale > 0 keeps the
    // order), the general one in z.
    detail::SegmentArgmax amax;
    // Segment sg's smoothing term: sum_j v_j or sum_j w_j v_j over the row's elements.
    auto smooth_of = [&](int sg, auto value_at) {
      const int j0 = sg * kVec - g.off;
      const bool interior = sg >= g.first_full && sg <= g.last_full;
      // Bitwise conditions (no short-circuit): selects, not a branch per element.
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
    };
    const bool in_ring = kept(g);
    const RingPos row_at = at;  // the row's first stage (a row kept in the ring is read there again)
    for (int ch = g.c0; ch < g.c1; ++ch, at.next(ring0, ring1)) {
      const unsigned char* buf = smem + size_t(at.stage) * kChunkBytes;
      mbar_wait(&full[at.stage], at.phase);
      uint32_t token = 0;
      for (int q = 0; q < groups; ++q) {  // the chunk's passes (one without groups)
        const int sb = q * pass_segs + gtid;  // this thread's first segment of the pass, in the chunk
        Segment<T> seg[kSegsPerThread];
        g.fetch_chunk(seg, buf, ch, sb, gthreads, V, fill);
        token ^= stage_token(seg);
        if (!in_ring && q == groups - 1) release_stage(&empty[at.stage], token, lane, V);

        if constexpr (!kGeneral) {
          // Plain arithmetic (logit_scale > 0): the max over raw logits (packed pairs for 16-bit
          // types), then one FFMA + one EX2 + one add per element. The options variant adds the
          // smoothing sum, the entropy term and the argmax in raw-logit units (each scaled once
          // per item below): a few more instructions per element, the same exps, so options that
          // do not change the math (metrics) leave the loss bit-identical.
          // The exponent is x a - r in one FFMA (a = scale log2(e), r = ref a rounded), taken
          // from the raw running max `ref`: the FFMA's exact product makes it (x - ref) a + cc,
          // where cc = ref a - r is the product's rounding residual, exact by one more FFMA and
          // the same for the whole chunk; the chunk's sums are multiplied by 2^-cc once. So the
          // sum is of 2^((x - ref) a) with one rounding per exponent, as precise as forming
          // x scale - ref first, at one FMUL per element less.
          float xmax[kSegsPerThread];
          float xm = -INFINITY;
#pragma unroll
          for (int k = 0; k < kSegsPerThread; ++k) {
            xmax[k] = seg_max(seg[k]);
            xm = fmaxf(xm, xmax[k]);
          }
          const float new_xm = fmaxf(run_xm, xm);
          const float ref = new_xm == -INFINITY ? 0.0f : new_xm;
          const float r = __fmul_rn(ref, a_log2);
          const float unshift = ex2(-fmaf(ref, a_log2, -r));
          const double scale = rescale_factor(run_xm, ref, a_log2);
          float acc[kSegsPerThread];
          float ez = 0.0f;
          const bool smooth_in_pairs = kExtras && p.smoothing && !weighted;
#pragma unroll
          for (int k = 0; k < kSegsPerThread; ++k) {
            const int sg = ch * kChunkSegs + sb + k * gthreads;
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
                smooth += !weighted && interior ? ss : smooth_of(sg, [&](int e) { return E::to_float(seg[k].e[e]); });
              }
              if (metrics) amax.add(sg, sg < g.nseg, xmax[k], acc[k]);
            }
          }
          static_assert(kSegsPerThread == 4, "the sum below pairs four segments");
          run_s = fma(double((acc[0] + acc[1]) + (acc[2] + acc[3])), double(unshift), run_s * scale);
          if (kExtras && metrics) run_ez = fma(double(ez), double(unshift), run_ez * scale);
          run_xm = new_xm;
          continue;
        }
        // General variant (soft-cap, or logit_scale < 0): z formed once per element and kept (the
        // soft-cap's tanh costs two MUFU ops), -inf outside the row; only the row's ragged end
        // segments check indices per element.
        // Branches are uniform and outside the element loops: per-element conditions around the
        // tanh made the compiler branch per element (SASS: BSSY/BSYNC pairs, ~20 instructions
        // per element).
        // 16-bit logits: the thread's segments in two halves, an online update each, so that only
        // half of z is live at once (the bf16 gradient kernel spilled 136 bytes with all of it).
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
            const int sg = ch * kChunkSegs + sb + (h * kPer + k) * gthreads;
            const int j0 = sg * kVec - g.off;
            if (sg < g.first_full || sg > g.last_full) {  // a ragged end (or past the row): mask
#pragma unroll
              for (int e = 0; e < kVec; ++e) {
                if (j0 + e < 0 || j0 + e >= V) zc[k][e] = -INFINITY;
              }
            }
            if (p.smoothing) smooth += smooth_of(sg, [&](int e) { return zc[k][e]; });
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
          const float new_m = fmaxf(run_m, cm);
          const float ref = detail::lse_ref(new_m);
          const double scale = rescale_factor(run_m, ref, kLog2e);
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
              const int sg = ch * kChunkSegs + sb + (h * kPer + k) * gthreads;
              amax.add(sg, sg < g.nseg, segmax[k], acc[k]);
            }
          }
          static_assert(kPer == 4 || kPer == 2, "the sums below pair two or four segments");
          if constexpr (kPer == 4) {
            run_s = run_s * scale + double((acc[0] + acc[1]) + (acc[2] + acc[3]));
            if (metrics) run_ez = run_ez * scale + double((acc_ez[0] + acc_ez[1]) + (acc_ez[2] + acc_ez[3]));
          } else {
            run_s = run_s * scale + double(acc[0] + acc[1]);
            if (metrics) run_ez = run_ez * scale + double(acc_ez[0] + acc_ez[1]);
          }
          run_m = new_m;
        }
      }
    }
    // The options variant's sums are in raw-logit units: z = x * scale.
    const float unit = kGeneral ? 1.0f : c.logit_scale;
    mine.st = detail::LseState{kGeneral ? run_m : run_xm * c.logit_scale, float(run_s), float(run_ez * unit)};
    mine.smooth = smooth * unit;
    if (metrics) {
      // The element: the first NaN at or after nan_seg (its sum can be NaN from a +inf logit
      // alone, then the search goes on), else the first element equal to the max in its
      // segment. The segments are read again from memory (L2): once per item and thread.
      auto values_of = [&](int sg) {
        const Segment<T> sgm = load_segment(g.x, sg, g.off, V, fill);
        return [=](int e) {
          const float x = E::to_float(sgm.e[e]);
          return kGeneral ? transform(x, c, softcap) : x;
        };
      };
      int best_i = -1;
      float best_v = -INFINITY;
      if (amax.nan_seg >= 0) {
        for (int ch = g.c0; ch < g.c1 && best_i < 0; ++ch) {
          for (int q = 0; q < groups && best_i < 0; ++q) {
            for (int k = 0; k < kSegsPerThread && best_i < 0; ++k) {
              const int sg = ch * kChunkSegs + q * pass_segs + gtid + k * gthreads;
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
      mine.amax_v = best_v;
      mine.amax_i = best_i;
    }

    // ---- the row's (or split's) statistics: warps, then one warp (warp 0, or the item's finalizer;
    // with the gradient every warp) over the warps
    mine = warp_fold(mine, metrics);
    const int slot = async ? static_cast<int>(seq % kReduceSlots) : parity;
    if (async) {
      ++seq;
      int last = 0;
      if (lane == 0) {
        if (holds_t) {  // the target rides in warp 0's partial (lane 0 keeps it through the fold)
          mine.z_target = transform(E::to_float(x_t), c, softcap);
          mine.has_target = 1;
        }
        warp_part[slot][warp] = mine;
        __threadfence_block();  // the partial is visible before the count that announces it
        last = atomicAdd(&arrivals[slot][gi], 1) == gwarps - 1;
      }
      if (!shfl_idx(last, 0)) continue;
      __threadfence_block();  // every other warp's partial, announced by its count...
      __syncwarp();           // ...and lane 0's observation of it ordered before every lane's reads
      RowPartial b = lane < gwarps ? warp_part[slot][gwarp0 + lane] : empty_partial();
      b = warp_fold(b, metrics);
      if (lane == 0) {
        arrivals[slot][gi] = 0;
        write_row_results(p, row, b, detail::lse_value(b.st), b.has_target ? b.z_target : NAN, c, w_t, t, weighted,
                          metrics);
      }
      continue;
    }
    if (lane == 0) warp_part[slot][warp] = mine;
    named_barrier(1 + gi, gthreads);  // warp partials written (and the last row's row_part read)
    ++seq;
    // With the gradient on whole rows every warp folds its group's partials itself (same inputs, same
    // order: the same bits in every warp), so the gradient sweep starts without a second barrier
    // and a round trip through row_part. The partials are double-buffered by row parity: a warp
    // writes the next row's into the other buffer, and this row's buffer again only after the
    // next row's barrier, which every warp reaches after reading this row's partials.
    const bool every_warp = grad_here && !halves;
    float lse_here = 0.0f;
    if (every_warp || warp == gwarp0) {
      RowPartial b = lane < gwarps ? warp_part[slot][gwarp0 + lane] : empty_partial();
      b = warp_fold(b, metrics);
      if (every_warp) lse_here = detail::lse_value(b.st);
      if (warp == gwarp0 && lane == 0) {
        if (holds_t) {
          b.z_target = transform(E::to_float(x_t), c, softcap);
          b.has_target = 1;
        }
        if (halves) {
          // Swap partials with the other half through distributed shared memory; both blocks
          // merge rank 0's then rank 1's, so both hold the same bits of the row's statistics.
          const int hslot = static_cast<int>(hseq & 1);
          const uint32_t use = hseq >> 1;
          ++hseq;
          const uint32_t peer = static_cast<uint32_t>(crank ^ 1);
          const uint32_t dst = map_to_rank(&half_part[hslot], peer);
          const uint32_t* words = reinterpret_cast<const uint32_t*>(&b);
#pragma unroll
          for (int i = 0; i < static_cast<int>(sizeof(RowPartial) / 4); ++i) store_cluster_u32(dst + 4 * i, words[i]);
          mbar_arrive_remote(map_to_rank(&half_full[hslot], peer));
          mbar_wait_cluster(&half_full[hslot], use & 1);
          const RowPartial o = half_part[hslot];
          b = crank == 0 ? merge_partial(b, o, metrics) : merge_partial(o, b, metrics);
        }
        if (sp.splits > 1) {
          // Publish this split's partial and move on: the row's last split to finish folds the
          // partials (below; or the split-merge pass after this kernel), so no block waits on
          // another's arrival.
          static_cast<RowPartial*>(sp.partials)[row * sp.splits + split] = b;
          if (sp.finish) {
            __threadfence();  // the partial is visible before the count that announces it
            split_last = arrive_tagged(&sp.counters[1 + row], sp.tag) == static_cast<uint32_t>(sp.splits);
          }
        } else if (crank == 0) {  // one half writes the row's results
          write_row_results(p, row, b, detail::lse_value(b.st), b.has_target ? b.z_target : NAN, c, w_t, t, weighted,
                            metrics);
        }
        if (grad_here && !every_warp) row_part = b;  // the halves' gradient sweep's lse
      }
      if (!kGrad && sp.splits > 1 && warp == gwarp0 && shfl_idx(split_last, 0)) {
        // The row's last split: every partial is in (their counts announced them).
        __threadfence();
        __syncwarp();
        const RowPartial a =
            fold_split_partials(static_cast<const RowPartial*>(sp.partials) + row * sp.splits, sp.splits, lane, metrics);
        if (lane == 0) {
          clear_tagged(&sp.counters[1 + row]);
          write_row_results(p, row, a, detail::lse_value(a.st), a.has_target ? a.z_target : NAN, c, w_t, t, weighted,
                            metrics);
        }
      }
    }
    parity ^= 1;
    if (!grad_here) continue;
    if (!every_warp) named_barrier(1 + gi, gthreads);  // row_part visible
    const float lse = every_warp ? lse_here : detail::lse_value(row_part.st);

    // ---- gradient sweep over the staged chunks (re-staged, or still in the ring)
    T* dx = static_cast<T*>(p.dlogits) + row * p.dlogits_stride;
    const bool same_layout = row_offset(dx) == g.off;
    const float gr = g_chain * g_up;
    const detail::RowGrad rg = detail::row_grad(c, lse, w_t, gr);
    // p's exponent in one FMA, its per-row factor folded into g a scale (the row kernel's
    // backward forms the same constants: same bits).
    const PlainGradExp pe = plain_grad_exp(lse, c);
    const float ga_s = __fmul_rn(__fmul_rn(rg.g_a, c.logit_scale), pe.factor), gc_s = rg.g_c * c.logit_scale;
    const int seg_t = valid_t ? (t + g.off) / kVec : -1;
    // A row kept in the ring: its stages again, already waited for (and not released since).
    RingPos gat = in_ring ? row_at : at;
    for (int i = 0; i < g.c1 - g.c0; ++i, gat.next(ring0, ring1)) {
      const int ch = in_ring || !sp.grad_backwards ? g.c0 + i : g.c1 - 1 - i;  // in the producer's order
      const unsigned char* buf = smem + size_t(gat.stage) * kChunkBytes;
      if (!in_ring) mbar_wait(&full[gat.stage], gat.phase);
      const bool inner = g.interior(ch);
      uint32_t token = 0;
      for (int q = 0; q < groups; ++q) {  // the chunk's passes (one without groups)
        const int sb = q * pass_segs + gtid;
        Segment<T> seg[kSegsPerThread];
        g.fetch_chunk(seg, buf, ch, sb, gthreads, V, fill);
        token ^= stage_token(seg);
        if (q == groups - 1) release_stage(&empty[gat.stage], token, lane, V);
#pragma unroll
        for (int k = 0; k < kSegsPerThread; ++k) {
          const int s = ch * kChunkSegs + sb + k * gthreads;
          if (!inner && s >= g.nseg) continue;
          const int j0 = s * kVec - g.off;
          Segment<T> out;
          if (kExtras && (softcap || (weighted && p.smoothing))) {
            // Per-element dz/dx (soft-cap) or per-class smoothing weight; class weights alone only
            // scale the row (through g_a, g_bt) and take the plain arithmetic below.
            out = options_grad_segment(seg[k], j0, p, lse, rg, c, softcap, weighted && p.smoothing);
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
                out.e[e] = E::from_float(grad_elem(E::to_float(seg[k].e[e]), lse, rg, w_t, rg.g_bt, c, softcap));
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
