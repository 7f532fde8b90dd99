// The stream kernel's work scheduler: which work items a block walks and where each one's bytes
// are. Persistent blocks (one per SM) walk the items first, first + step, ...: an item is a row,
// or a split of a row when there are few rows (StreamParams::splits), or with halves the half of
// a row that this block of a 2-block cluster streams (items then walk clusters, not blocks).
// With consumer groups the block's items go to the groups in turn, each on a ring of its own.
// Also the variant's compile-time shape (StreamShape) that every part of the kernel reads.
#pragma once

#include <cstdint>

#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/port.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {

/// A variant's compile-time shape. kOpts: a StreamOpts (the plain path, options, options with
/// the soft-cap). kGroups: consumer groups, 1 or 2: `groups` groups of gwarps warps, each folding
/// every groups-th item of the block on its own (its own ring stages, reduction slots and
/// barrier), a chunk in `groups` passes of kSegsPerThread segments a thread. The per-row costs
/// (item set-up, the warp and row folds) are paid by fewer warps per row: with 2 chunks a row
/// they are about as many instructions as the row's elements. Never with halves or splits (the
/// planner).
template <typename T, bool kGradT, int kOpts, int kGroups>
struct StreamShape {
  static constexpr bool kGrad = kGradT;
  static constexpr bool kExtras = kOpts != kStreamPlain;
  static constexpr bool kGeneral = kOpts == kStreamGeneral;
  static constexpr int kVec = Segment<T>::kVec;
  static constexpr int groups = kGroups;
  static_assert(kGroups == 1 || kGroups == kMaxStreamGroups, "consumer groups: 1 or 2");
  static constexpr int gwarps = kStreamConsumerWarps / groups;
  static constexpr int gthreads = gwarps * kWarpSize;
  static constexpr int pass_segs = kSegsPerThread * gthreads;  // a chunk's segments per pass
  // A group's ring is kStages / groups stages. With the gradient, a row of at most keep_max
  // chunks stays in the ring between its two sweeps (its stages are released by the gradient
  // sweep): no second copy from L2, and the stages left over prefetch the next rows; with
  // groups, a kept row leaves one to prefetch. Longer rows are streamed twice.
  static constexpr int ring_stages = kStages / groups;
  static constexpr int keep_max = groups == 1 ? kKeepChunks : ring_stages - 1;
};

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

/// The walk over a block's work items (the producer and the consumers take the same one).
struct StreamWalk {
  const StreamParams& sp;
  int64_t items;   // rows x splits
  bool halves;     // each row shared by the two blocks of a cluster (StreamParams::halves)
  int crank;       // this block's rank in its cluster (halves), else 0
  int64_t first;   // this block's (cluster's) first item
  int64_t step;    // blocks (clusters) in the grid

  __device__ __forceinline__ explicit StreamWalk(const StreamParams& params)
      : sp(params),
        items(params.row.rows * params.splits),
        halves(params.halves > 1),
        crank(halves ? static_cast<int>(cluster_rank()) : 0),
        first(halves ? blockIdx.x / 2 : blockIdx.x),
        step(halves ? gridDim.x / 2 : gridDim.x) {}
  /// Item w's row and split; whole rows (the common case) skip the 64-bit division.
  __device__ __forceinline__ int64_t row_of(int64_t w) const { return sp.splits == 1 ? w : w / sp.splits; }
  __device__ __forceinline__ int split_of(int64_t w) const {
    return halves ? crank : sp.splits == 1 ? 0 : static_cast<int>(w % sp.splits);
  }
};

/// The gradient is formed in the stream kernel only when a block (or a cluster) owns whole rows.
template <typename S>
__device__ __forceinline__ bool grad_here(const StreamParams& sp) {
  return S::kGrad && sp.splits == 1;
}

/// Whether an item's row stays in the ring between its two sweeps (see StreamShape::keep_max).
template <typename S, typename T>
__device__ __forceinline__ bool kept_in_ring(const StreamWalk& walk, const ItemGeometry<T>& g) {
  return grad_here<S>(walk.sp) && !walk.halves && g.c1 - g.c0 <= S::keep_max;
}

}  // namespace cuda
}  // namespace fusedce
