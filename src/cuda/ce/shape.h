// The cross-entropy kernels' fixed shape: chunk and ring sizes of the stream kernel, the row
// kernel's largest block, the rescale kernel's blocks, and the bounds that size the workspace.
// Plain C++ (no GPU header), so the planner (plan.cpp) compiles and is tested without nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fusedce {
namespace cuda {

/// The streaming kernel's option sets, compiled apart: the plain path (logit_scale > 0, no
/// options); options on the plain arithmetic (logit_scale > 0, no soft-cap: smoothing, class
/// weights, metrics; z-loss needs nothing per element); the general one (soft-cap or
/// logit_scale < 0: z, whose tanh costs two MUFU ops, formed once and kept in registers).
enum StreamOpts : int { kStreamPlain = 0, kStreamOptions = 1, kStreamGeneral = 2 };

/// Largest block the row kernel is compiled for (with at most 64 registers a thread).
constexpr int max_row_threads(int) { return 1024; }

/// The streaming kernel's shape: 16 consumer warps and one producer warp per block, one block per
/// SM; 32 KB chunks in a ring of kStages shared-memory stages (192 KB of loads in flight). sm_90
/// only: a HIP build compiles the kernel as an empty shell and never launches it.
constexpr int kStreamConsumerWarps = 16;
constexpr int kChunkBytes = 32768;
constexpr int kChunkSegs = kChunkBytes / 16;
constexpr int kStages = 6;
// Warp-partial slots (with an arrival counter each) of the stream kernel's asynchronous
// reduction: more than the kStages + 1 items that can be in flight.
constexpr int kReduceSlots = 8;
static_assert(kReduceSlots > kStages + 1, "slots: in-flight items");
// With the gradient, rows of at most this many chunks stay in the ring between the two sweeps
// (leaving kStages - kKeepChunks stages to prefetch the next rows).
constexpr int kKeepChunks = 4;
static_assert(kKeepChunks < kStages, "a kept row leaves a stage to prefetch into");
// Consumer groups: at most this many, each of 16 / groups warps with a ring of kStages / groups
// stages.
constexpr int kMaxStreamGroups = 2;
static_assert(kStages % kMaxStreamGroups == 0, "a group's ring: whole stages");
constexpr size_t kStreamSmemBytes = size_t(kStages) * kChunkBytes + 2 * kStages * sizeof(uint64_t);
/// Rows are split over several blocks only below this many rows (bounds the workspace).
constexpr int64_t kSplitRowsMax = 1024;
constexpr int kMaxSplits = 64;
/// The stream kernel finishes a call itself (finish.cuh) when its grid has at most this many
/// blocks (one per SM: every GPU so far), and counts the mean's denominator itself with the
/// gradient for at most this many rows (each block reads every target: 64 loads a thread here).
constexpr int kMaxFinishBlocks = 1024;
constexpr int64_t kCountDenRowsMax = 32768;

/// Segments per thread in the rescale kernel, and its block size.
constexpr int kRescaleItems = 4;
constexpr int kRescaleThreads = 256;
constexpr int kRescaleBlocksPerSm = 8;  // 2048 threads: a full SM

}  // namespace cuda
}  // namespace fusedce
