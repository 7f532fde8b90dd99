// The end of a call inside the stream kernel: the pieces that let one launch do what the
// split-merge and finalize passes do after it (one-block launches, which cost a few-rows forward
// about a tenth of its time).
//
// - A split row's partials are merged by its last split to finish (a counter per row).
// - The batch sums (reduction and metrics) are formed by the block that finishes last (a counter
//   per call): each block first sums the rows it owns in a fixed order, the last block sums the
//   blocks' sums in block order, so the bits do not depend on which block finished when.
// - Counters live in the caller's workspace, which nobody clears (see arrive_tagged).
#pragma once

#include <cstdint>

#include "cuda/ce/element_math.cuh"
#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/port.h"
#include "cuda/tma.cuh"

namespace fusedce {
namespace cuda {

/// Arrivals at a counter shared by the blocks of one call, counted from zero whatever the slot
/// held before: the slot holds (tag << 24 | count), and a slot whose tag is not this call's counts
/// as empty. The host gives each call a tag of 40 hashed bits (next_call_tag), so stale or
/// uninitialised workspace matches with odds of 2^-40; the last arriver clears the slot
/// (clear_tagged), so a CUDA graph replaying the same tag starts from an empty slot too.
/// Only the first arrivals swap the tag in (compare-and-swap); the rest add. A CAS loop for every
/// arrival cost 17-30 us at the end of each call (132 blocks retrying on one word). Returns the
/// count including this arrival. Release: the caller fences its writes first.
__device__ __forceinline__ uint32_t arrive_tagged(unsigned long long* slot, unsigned long long tag) {
  unsigned long long cur = *reinterpret_cast<volatile unsigned long long*>(slot);
  while ((cur >> 24) != tag) {
    const unsigned long long seen = atomicCAS(slot, cur, (tag << 24) | 1ull);
    if (seen == cur) return 1;
    cur = seen;  // another arrival swapped the tag in first (or, once in 2^40, stale words moved)
  }
  return static_cast<uint32_t>((atomicAdd(slot, 1ull) + 1ull) & 0xFFFFFFull);
}
__device__ __forceinline__ void clear_tagged(unsigned long long* slot) { atomicExch(slot, 0ull); }

/// A partial another block wrote, read from L2 (an L1 line of an earlier call could be stale).
__device__ __forceinline__ RowPartial load_partial_l2(const RowPartial* q) {
  static_assert(sizeof(RowPartial) % 8 == 0 && alignof(RowPartial) == 8, "RowPartial: whole 8-byte words");
  RowPartial r;
  const uint2* src = reinterpret_cast<const uint2*>(q);
  uint2* dst = reinterpret_cast<uint2*>(&r);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(RowPartial) / 8); ++i) dst[i] = __ldcg(src + i);
  return r;
}

/// Folds a split row's partials (one warp, every lane) in a fixed tree: the row's statistics do
/// not depend on which split finished first. The result is in lane 0.
__device__ __forceinline__ RowPartial fold_split_partials(const RowPartial* q, int splits, int lane, bool metrics) {
  const int lanes = min(splits, kWarpSize);
  // Lanes past the last split hold a copy of it that the tree never merges.
  RowPartial a = load_partial_l2(q + min(lane, splits - 1));
  if (lane + kWarpSize < splits) a = merge_partial(a, load_partial_l2(q + lane + kWarpSize), metrics);
  for (int d = 1; d < kWarpSize; d *= 2) {
    const RowPartial o = shfl_down_partial(a, d, metrics, true);
    if ((lane & (2 * d - 1)) == 0 && lane + d < lanes) a = merge_partial(a, o, metrics);
  }
  return a;
}

__device__ __forceinline__ int64_t finish_target(const BatchParams& p, int64_t i) {
  return p.target_i64 ? static_cast<const int64_t*>(p.target)[i * p.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[i * p.target_stride]);
}

/// Rows first, first + step, ... (`count` of them) summed by `nthreads` threads, thread `tid`
/// taking every nthreads-th; results other blocks wrote are read from L2. Eight rows' loads in
/// flight per thread.
__device__ inline BatchSums sum_rows(const BatchParams& p, int64_t first, int64_t step, int64_t count, int tid, int nthreads) {
  constexpr int kUnroll = 8;
  BatchSums s = {0.0, 0.0, 0.0, 0.0};
  for (int64_t k0 = tid; k0 < count; k0 += int64_t(nthreads) * kUnroll) {
    float loss[kUnroll], ent[kUnroll];
    int corr[kUnroll], valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = k0 + int64_t(u) * nthreads;
      loss[u] = ent[u] = 0.0f;
      corr[u] = valid[u] = 0;
      if (k >= count) continue;
      const int64_t i = first + k * step;
      if (p.loss_out) loss[u] = __ldcg(p.row_loss + i);
      if (p.num_correct_out) {
        ent[u] = __ldcg(p.row_entropy + i);
        corr[u] = __ldcg(reinterpret_cast<const signed char*>(p.row_correct) + i);
      }
      if (p.count_rows) {
        const int64_t t = finish_target(p, i);
        valid[u] = t != p.ignore_index && t >= 0 && t < p.vocab;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      s.loss += loss[u];
      s.entropy += ent[u];
      s.correct += corr[u];
      s.den += valid[u];
    }
  }
  return s;
}

/// The sums of `nthreads` threads (whole warps, at most 32 of them; the block's first threads)
/// in a fixed order: a shuffle tree in each warp, then the warps in order. Valid in thread 0.
/// `scratch` holds a value per warp; `barrier` is a named barrier of those threads.
__device__ inline BatchSums team_sum(BatchSums v, BatchSums* scratch, int tid, int nthreads, int barrier) {
#pragma unroll
  for (int d = kWarpSize / 2; d > 0; d >>= 1) {
    v.loss += shfl_down(v.loss, d);
    v.entropy += shfl_down(v.entropy, d);
    v.correct += shfl_down(v.correct, d);
    v.den += shfl_down(v.den, d);
  }
  if (tid % kWarpSize == 0) scratch[tid / kWarpSize] = v;
  asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(nthreads) : "memory");
  if (tid == 0) {
    for (int w = 1; w < nthreads / kWarpSize; ++w) {
      v.loss += scratch[w].loss;
      v.entropy += scratch[w].entropy;
      v.correct += scratch[w].correct;
      v.den += scratch[w].den;
    }
  }
  return v;
}

/// The call's outputs from the batch sums (one thread). `den_known` >= 0: the mean's denominator
/// counted by the kernel itself; else counted here (count_rows) or from the prepare pass.
__device__ __forceinline__ void write_batch_results(const BatchParams& p, const BatchSums& s, double den_known) {
  if (p.loss_out && p.mean) {
    // 0 / 0 = NaN when every row is ignored, as PyTorch.
    const double den = p.count_rows ? s.den : den_known >= 0.0 ? den_known : p.batch->denominator;
    *p.loss_out = static_cast<float>(s.loss / den);
  } else if (p.loss_out) {
    *p.loss_out = static_cast<float>(s.loss);
  }
  if (p.num_correct_out) {
    *p.entropy_out = static_cast<float>(s.entropy);
    *p.num_correct_out = static_cast<int64_t>(s.correct);
  }
}

/// The mean's denominator (valid, non-ignored targets), counted by `nthreads` threads with an
/// integer sum (exact, so the same in every block and run). `counter` is a shared-memory
/// counter at 0; `barrier` a named barrier of those threads.
__device__ inline double count_valid_targets(const BatchParams& p, int tid, int nthreads, unsigned int* counter,
                                      int barrier) {
  constexpr int kUnroll = 8;
  unsigned int n = 0;
  for (int64_t i0 = tid; i0 < p.rows; i0 += int64_t(nthreads) * kUnroll) {
    int64_t t[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + int64_t(u) * nthreads;
      t[u] = i < p.rows ? finish_target(p, i) : p.ignore_index;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) n += t[u] != p.ignore_index && t[u] >= 0 && t[u] < p.vocab;
  }
#pragma unroll
  for (int d = kWarpSize / 2; d > 0; d >>= 1) n += shfl_down(n, d);
  if (tid % kWarpSize == 0) atomicAdd(counter, n);
  asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(nthreads) : "memory");
  return static_cast<double>(*counter);
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

}  // namespace cuda
}  // namespace fusedce
