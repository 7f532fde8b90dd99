// Host-visible handles of the CUDA kernels: the launcher picks one, the per-dtype translation
// units (row_f32.cu, row_bf16.cu, row_f16.cu) define them, so each dtype compiles in parallel.
#pragma once

#include "cuda/port.h"  // first: the platform's runtime header defines __forceinline__ and friends

#include <cstddef>
#include <cstdint>

#include "cuda/params.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

using RowKernel = void (*)(RowParams);
using RescaleKernel = void (*)(RescaleParams);
using StreamKernel = void (*)(StreamParams);

/// The fused row kernel for this dtype and feature set. items: 16-byte segments per thread
/// (1 or 4).
RowKernel select_row_kernel_f32(int items, bool forward, bool grad, bool extras);
RowKernel select_row_kernel_bf16(int items, bool forward, bool grad, bool extras);
RowKernel select_row_kernel_f16(int items, bool forward, bool grad, bool extras);
/// The streaming kernel's option sets, compiled apart: the plain path (logit_scale > 0, no
/// options); options on the plain arithmetic (logit_scale > 0, no soft-cap: smoothing, class
/// weights, metrics; z-loss needs nothing per element); the general one (soft-cap or
/// logit_scale < 0: z, whose tanh costs two MUFU ops, formed once and kept in registers).
enum StreamOpts : int { kStreamPlain = 0, kStreamOptions = 1, kStreamGeneral = 2 };
/// The streaming kernel (sm_90 only: bulk copies and mbarriers) for forward jobs.
StreamKernel select_stream_kernel_f32(bool grad, StreamOpts opts, int groups);
StreamKernel select_stream_kernel_bf16(bool grad, StreamOpts opts, int groups);
StreamKernel select_stream_kernel_f16(bool grad, StreamOpts opts, int groups);
RescaleKernel rescale_kernel_f32();
RescaleKernel rescale_kernel_bf16();
RescaleKernel rescale_kernel_f16();

/// Largest block the row kernel is compiled for (with at most 64 registers a thread).
constexpr int max_row_threads(int) { return 1024; }

/// The streaming kernel's shape: 16 consumer warps and one producer warp per block, one block per
/// SM; 32 KB chunks in a ring of kStages shared-memory stages (192 KB of loads in flight). sm_90
/// only: a HIP build compiles the kernel as an empty shell and never launches it.
constexpr int kStreamConsumerWarps = 16;
constexpr int kStreamConsumers = kStreamConsumerWarps * kWarpSize;
constexpr int kStreamThreads = kStreamConsumers + kWarpSize;
constexpr int kChunkBytes = 32768;
constexpr int kChunkSegs = kChunkBytes / 16;
constexpr int kSegsPerThread = kChunkSegs / kStreamConsumers;
constexpr int kStages = 6;
// Warp-partial slots (with an arrival counter each) of the stream kernel's asynchronous
// reduction: more than the kStages + 1 items that can be in flight.
constexpr int kReduceSlots = 8;
static_assert(kReduceSlots > kStages + 1, "slots: in-flight items");
// With the gradient, rows of at most this many chunks stay in the ring between the two sweeps
// (leaving kStages - kKeepChunks stages to prefetch the next rows).
constexpr int kKeepChunks = 4;
static_assert(kKeepChunks < kStages, "a kept row leaves a stage to prefetch into");
// Consumer groups (StreamParams::groups): at most this many, each of 16 / groups warps with a
// ring of kStages / groups stages.
constexpr int kMaxStreamGroups = 2;
static_assert(kStages % kMaxStreamGroups == 0, "a group's ring: whole stages");
constexpr bool kAsyncReduceAllowed = true;
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

void launch_prepare(const BatchParams& p, cudaStream_t stream);
void launch_finalize(const BatchParams& p, cudaStream_t stream);
void launch_split_merge(const BatchParams& bp, const RowParams& rp, const void* partials, int splits,
                        cudaStream_t stream);

}  // namespace cuda
}  // namespace fusedce
