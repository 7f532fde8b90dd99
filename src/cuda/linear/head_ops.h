// The pieces the chunked linear heads on CUDA take their products from (the linear
// cross-entropy, its vocabulary-parallel steps, the linear log-probabilities, the
// distillation): a product on the call's stream and workspace, a block of a row-major matrix's
// rows as a product's operand, and the gradients of a head that no row reaches. Host code only;
// include it after <cuda_runtime.h>.
#pragma once

#include <cstdint>

#include "cuda/host_util.h"
#include "cuda/linear/gemm.h"
#include "cuda/linear/linear.h"
#include "fusedce/linear_cross_entropy.h"

namespace fusedce {
namespace cuda {

/// The leading dimension of a row-major matrix as a column-major operand: its row stride, or
/// its width when it has one row (whose stride a caller may leave at anything).
inline int64_t ld_of(const MatrixView& m) { return m.rows > 1 ? m.row_stride : m.cols; }

/// A product's call on `stream` with `workspace` (kGemmWorkspaceBytes); the caller fills in the
/// operands, D, the sizes and beta.
inline GemmCall gemm_on(void* workspace, cudaStream_t stream, int device) {
  GemmCall g{};
  g.workspace = workspace;
  g.stream = stream;
  g.device = device;
  return g;
}

/// Rows [r0, r0 + n) of the row-major (rows, cols) matrix m as the column-major cols x n operand
/// (hidden rows: H x n; rows of a head's weight: H x n).
inline GemmOperand rows_operand(const MatrixView& m, int64_t r0, int64_t n) {
  const char* base = static_cast<const char*>(m.data) + size_t(r0) * size_t(m.row_stride) * elem_size(m.dtype);
  return GemmOperand{base, m.dtype, m.cols, n, ld_of(m)};
}

/// The gradients of a (V, H) head of `dtype` that no row reaches: grad_weight zeros, grad_bias
/// zeros rounded from `scratch` (V float32, device), each where asked for.
inline Status clear_head_grads(const LinearGrads& g, int64_t V, int64_t H, DType dtype, float* scratch,
                               cudaStream_t stream) {
  const size_t el = elem_size(dtype);
  cudaError_t e = cudaSuccess;
  if (g.grad_weight.data) {
    e = cudaMemset2DAsync(g.grad_weight.data, size_t(ld_of(g.grad_weight)) * el, 0, size_t(H) * el, size_t(V), stream);
  }
  if (e == cudaSuccess && g.grad_bias.data) {
    e = cudaMemsetAsync(scratch, 0, size_t(V) * 4, stream);
    if (e == cudaSuccess) launch_convert(ConvertParams{scratch, g.grad_bias.data, V, 1, g.grad_bias.stride, dtype}, stream);
  }
  return e == cudaSuccess ? last_error("clearing the gradients") : device_error(e, "clearing the gradients");
}

}  // namespace cuda
}  // namespace fusedce
