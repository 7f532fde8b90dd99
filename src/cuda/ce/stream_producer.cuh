// The stream kernel's producer and its ring: one lane of the producer warp has the copy engine
// stream every item's 32 KB chunks into a ring of kStages shared-memory stages (cp.async.bulk
// with an mbarrier per stage: `full` when the bytes landed, `empty` when every consumer warp of
// the stage's group has read it), kStages chunks ahead of the consumers, across row boundaries.
// Only the chunks' interior bytes are copied; a row's ragged ends are read from global memory by
// the consumers (ItemGeometry::fetch).
#pragma once

#include <cstdint>

#include "cuda/ce/element_math.cuh"
#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/ce/stream_schedule.cuh"
#include "cuda/port.h"
#include "cuda/tma.cuh"

namespace fusedce {
namespace cuda {

/// A position in a ring of stages: the stage and the parity of its current round (no division
/// per chunk). With consumer groups each group has a ring of its own (a slice of the stages): a
/// waiter must have seen every round of the stage it waits on, or the round's parity is
/// ambiguous (a group that skipped another group's round could pass a wait for a round that has
/// not landed: groups over one shared ring gave a wrong lse on one row in 35, and hung).
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

/// The ring in shared memory: kStages chunk buffers, then their `full` and `empty` mbarriers.
struct StreamRing {
  unsigned char* smem;
  uint64_t* full;
  uint64_t* empty;
  __device__ __forceinline__ explicit StreamRing(unsigned char* base)
      : smem(base),
        full(reinterpret_cast<uint64_t*>(base + size_t(kStages) * kChunkBytes)),
        empty(reinterpret_cast<uint64_t*>(base + size_t(kStages) * kChunkBytes) + kStages) {}
  __device__ __forceinline__ unsigned char* stage(int i) const { return smem + size_t(i) * kChunkBytes; }
};

/// Hands a stage back to the producer once this warp's reads of it are in registers. The arrive
/// is made to depend on the loaded words (a predicate ptxas cannot fold: always true, as V >= 1),
/// so it issues only after the shared-memory loads have returned. Without the dependency ptxas
/// issued the arrive right behind the LDS, before its data came back; under load the copy
/// engine's next bulk write to the stage could land first, and the warp summed another chunk's
/// logits (fwd+grad: one row in a few hundred with a wrong lse, different rows each run). The
/// XORs cost about six instructions per chunk and thread. With consumer groups a warp reads a
/// chunk in several passes: `token` carries the words of the earlier passes (stage_token), so the
/// arrive waits on every load of the stage.
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

/// The producer (lane 0 of the producer warp): every item's chunks in the order the consumers
/// read them: once, or with the gradient twice (the second pass in the gradient sweep's order),
/// or once for a row kept in the ring. Ignored rows load nothing, but still take their turn in
/// the groups' rotation.
template <typename S, typename T>
__device__ __forceinline__ void produce(const StreamWalk& walk, const StreamRing& ring) {
  const StreamParams& sp = walk.sp;
  const RowParams& p = sp.row;
  const bool grad = grad_here<S>(sp);
  // The next chunk's stage in the ring of the group whose item is next, and in the other's
  // (items go to the groups in turn).
  RingPos at(0), other(S::ring_stages);
  int ring0 = 0;  // the first stage of `at`'s ring
  // With the gradient, the first sweep's lines should survive in L2 until the second sweep
  // re-reads them microseconds later; the second sweep's (and dlogits', stored .cs) go first.
  // (evict_normal here is 2-5% slower on the H200, and the L2's persisting set-aside makes no
  // difference.)
  const uint64_t keep = make_l2_policy(grad ? L2Policy::kEvictLast : L2Policy::kEvictFirst);
  // (rows kept in the ring are read once: their lines need not stay)
  const uint64_t drop = make_l2_policy(L2Policy::kEvictFirst);
  // Targets are fetched one item ahead: a global load's latency under full bandwidth is about
  // a microsecond, too long to sit in every item's critical path.
  int64_t t_next = walk.first < walk.items ? load_target_dev(p, walk.row_of(walk.first)) : 0;
  for (int64_t w = walk.first; w < walk.items; w += walk.step) {
    if (S::groups > 1 && w != walk.first) {
      const RingPos swap = at;
      at = other;
      other = swap;
      ring0 = S::ring_stages - ring0;
    }
    const int64_t row = walk.row_of(w);
    const int64_t t_cur = t_next;
    if (w + walk.step < walk.items) t_next = load_target_dev(p, walk.row_of(w + walk.step));
    if (t_cur == p.ignore_index) continue;
    const ItemGeometry<T> g(p, row, walk.split_of(w), sp.chunks_per_split);
    const char* aligned = reinterpret_cast<const char*>(g.x - g.off);
    const bool in_ring = kept_in_ring<S>(walk, g);
    for (int pass = 0; pass < (grad && !in_ring ? 2 : 1); ++pass) {
      for (int i = 0; i < g.c1 - g.c0; ++i, at.next(ring0, ring0 + S::ring_stages)) {
        const int c = pass == 1 && sp.grad_backwards ? g.c1 - 1 - i : g.c0 + i;
        const int stage = at.stage;
        mbar_wait(&ring.empty[stage], at.phase ^ 1u);  // consumers done with its last use
        const int lo = max(c * kChunkSegs, g.first_full);
        const int hi = min((c + 1) * kChunkSegs, g.last_full + 1);
        const uint32_t bytes = hi > lo ? static_cast<uint32_t>(hi - lo) * 16u : 0u;
        mbar_arrive_expect_tx(&ring.full[stage], bytes);
        if (bytes) {
          bulk_load_hint(ring.stage(stage) + size_t(lo - c * kChunkSegs) * 16, aligned + size_t(lo) * 16, bytes,
                         &ring.full[stage], pass == 0 && !in_ring ? keep : drop);
        }
      }
    }
  }
}

}  // namespace cuda
}  // namespace fusedce
