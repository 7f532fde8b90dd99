// Host-visible handles of the CUDA kernels: the launcher picks one, the per-dtype translation
// units (row_f32.cu, row_bf16.cu, row_f16.cu) define them, so each dtype compiles in parallel.
#pragma once

#include <cuda_runtime.h>

#include "cuda/params.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

using RowKernel = void (*)(RowParams);
using RescaleKernel = void (*)(RescaleParams);

/// The fused row kernel for this dtype and feature set. items: 16-byte segments per thread
/// (1 or 4).
RowKernel select_row_kernel_f32(int items, bool forward, bool grad, bool extras);
RowKernel select_row_kernel_bf16(int items, bool forward, bool grad, bool extras);
RowKernel select_row_kernel_f16(int items, bool forward, bool grad, bool extras);
RescaleKernel rescale_kernel_f32();
RescaleKernel rescale_kernel_bf16();
RescaleKernel rescale_kernel_f16();

/// Largest block the row kernel is compiled for (with at most 64 registers a thread).
constexpr int max_row_threads(int) { return 1024; }

/// Segments per thread in the rescale kernel, and its block size.
constexpr int kRescaleItems = 4;
constexpr int kRescaleThreads = 256;

void launch_prepare(const BatchParams& p, cudaStream_t stream);
void launch_finalize(const BatchParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace fusedce
