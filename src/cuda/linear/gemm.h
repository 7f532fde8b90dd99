// The matrix products of the CUDA linear cross-entropy, through cuBLASLt. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/linear/algo_choice.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// Bytes of cuBLASLt workspace each product may use (what cuBLAS suggests for Hopper).
constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;

/// Bytes of one element of the products' dtypes (float32, or a 16-bit type).
inline size_t elem_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

/// One column-major operand: `rows` x `cols` of `dtype` with leading dimension `ld`
/// (a row-major (r, c) matrix with row stride s is the column-major c x r matrix with ld = s).
struct GemmOperand {
  const void* data;
  DType dtype;
  int64_t rows, cols, ld;
};

/// D (m x n) = alpha op(A) op(B) [+ bias over the m rows] + beta D, float32 accumulation
/// (float32 inputs stay float32: no TF32). `transpose_a` / `_b`: op is the transpose. D's dtype
/// may be float32 while A and B are 16-bit (an accumulator). alpha is 1, or read on the device
/// from `scale` (a device float[3] {alpha, 0, 1}, whence beta, 0 or 1, is read too).
struct GemmCall {
  GemmOperand a, b;
  bool transpose_a, transpose_b;
  void* d;
  DType d_dtype;
  int64_t m, n, ld_d;
  float beta;          // 0 or 1 when scale is set
  const float* scale;  // device {alpha, 0, 1}, or null: alpha 1
  const void* bias;  // (m,) in d_dtype's 16-bit partner or float32: the inputs' dtype; or null
  DType bias_dtype;
  void* workspace;  // kGemmWorkspaceBytes
  cudaStream_t stream;
  int device;
  GemmRole role;  // which candidate algorithm to prefer (algo_choice.h); kAny by default
};

/// Runs the product; Status names what cuBLASLt refused.
Status gemm(const GemmCall& call);

}  // namespace cuda
}  // namespace fusedce
