// The linear cross-entropy's matrix products as CUTLASS kernels for Hopper (TMA loads, WGMMA,
// warp-specialized and persistent), beside the cuBLASLt ones of gemm.h. Host interface only: the
// kernels live in cutlass_products.cu, compiled for sm_90a alone; a build without them, another
// GPU, 16-bit types other than bfloat16 or operands TMA cannot address answer kUnsupported, and
// the caller takes cuBLASLt.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// Which of the three products, each row-major over (rows = tokens, V, H):
///   kLogits:     D (rows x V)  = hidden (rows x H) . weight^T           (A = hidden, B = weight)
///   kGradHidden: D (rows x H)  = dlogits (rows x V) . weight            (A = dlogits, B = weight)
///   kGradWeight: D (V x H)     = dlogits^T . hidden (+ C, float32)      (A = dlogits, B = hidden)
enum class ProductKind { kLogits, kGradHidden, kGradWeight };

/// One product. Every matrix is row-major with the given row stride in elements; `a` and `b`
/// are bfloat16; D is bfloat16, or float32 for kGradWeight's accumulator. `c` (kGradWeight only,
/// float32, row stride ldc, or null): D = product + C, accumulated in float32, then rounded to
/// D's type once (so the last token chunk writes the 16-bit grad_weight straight from the
/// float32 accumulator).
struct Product {
  ProductKind kind;
  int64_t rows, V, H;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  const float* c;
  int64_t ldc;
  void* d;
  DType d_dtype;
  int64_t ldd;
  cudaStream_t stream;
  int device;
};

/// True when this build has the kernels and `device` runs them (compute capability 9.0).
bool cutlass_products_available(int device);

/// Runs the product, or answers kUnsupported (nothing launched) when it cannot: the caller then
/// uses cuBLASLt. Other errors are device errors.
Status run_product(const Product& p);

}  // namespace cuda
}  // namespace fusedce
