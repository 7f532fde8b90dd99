// Host-visible handles of the CUDA kernels: the launcher picks one, the per-dtype translation
// units (row_f32.cu, row_bf16.cu, row_f16.cu) define them, so each dtype compiles in parallel.
#pragma once

#include "cuda/port.h"  // first: the platform's runtime header defines __forceinline__ and friends

#include <cstddef>
#include <cstdint>

#include "cuda/ce/params.h"
#include "cuda/ce/shape.h"
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
/// The streaming kernel (sm_90 only: bulk copies and mbarriers) for forward jobs.
StreamKernel select_stream_kernel_f32(bool grad, StreamOpts opts, int groups);
StreamKernel select_stream_kernel_bf16(bool grad, StreamOpts opts, int groups);
StreamKernel select_stream_kernel_f16(bool grad, StreamOpts opts, int groups);
RescaleKernel rescale_kernel_f32();
RescaleKernel rescale_kernel_bf16();
RescaleKernel rescale_kernel_f16();

/// The streaming kernel's block: 16 consumer warps (kStreamConsumerWarps, shape.h) and one
/// producer warp.
constexpr int kStreamConsumers = kStreamConsumerWarps * kWarpSize;
constexpr int kStreamThreads = kStreamConsumers + kWarpSize;
constexpr int kSegsPerThread = kChunkSegs / kStreamConsumers;

void launch_prepare(const BatchParams& p, cudaStream_t stream);
void launch_finalize(const BatchParams& p, cudaStream_t stream);
void launch_split_merge(const BatchParams& bp, const RowParams& rp, const void* partials, int splits,
                        cudaStream_t stream);

}  // namespace cuda
}  // namespace fusedce
