// The linear cross-entropy's CUTLASS kernel for Hopper (TMA loads, WGMMA, warp-specialized and
// persistent): the last token chunk's grad_weight product, which adds the float32 accumulator of
// the earlier chunks and rounds to bfloat16 in its epilogue, so that no rounding pass reads the
// accumulator again. The other products stay with cuBLASLt (gemm.h), which ran them faster on
// an H200 with random bf16 data than the CUTLASS tile shapes measured (dev/cutlass_probe).
// Host interface only: the kernel lives in cutlass_products.cu, compiled for sm_90a alone; a
// build without it, another GPU, or operands TMA cannot address answer kUnsupported, and the
// caller takes cuBLASLt and the rounding pass.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// grad_weight (V x H, bf16) = round(acc (V x H, float32) + alpha dlogits^T . hidden), where dlogits is
/// (rows x V) and hidden (rows x H), both bf16; every matrix row-major with the given row stride
/// in elements; alpha read on the device from *alpha (1 where null). Accumulation in float32,
/// one rounding.
struct RoundedWeightProduct {
  int64_t rows, V, H;
  const void* dlogits;
  int64_t ld_dlogits;
  const void* hidden;
  int64_t ld_hidden;
  const float* acc;
  int64_t ld_acc;
  void* grad_weight;
  int64_t ld_grad_weight;
  const float* alpha;
  cudaStream_t stream;
  int device;
};

/// True when this build has the kernel and `device` runs it (compute capability 9.0).
bool cutlass_products_available(int device);

/// Runs the product, or answers kUnsupported (nothing launched) when it cannot; other errors
/// are device errors.
Status run_rounded_weight_product(const RoundedWeightProduct& p);

}  // namespace cuda
}  // namespace fusedce
