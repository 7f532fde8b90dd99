// The CPU linear path's matrix products: row-major float32, run on the calling thread (the
// caller spreads disjoint output blocks over its pool, so no product starts threads of its own).
// A build with OpenBLAS does them through it (gemm_openblas.cpp) unless its kernels are below
// the CPU's (blas_choice.h); otherwise, and in a build without it, the core's own tile products
// (gemm.cpp) do. blas_name() says which.
//
// The sum behind each output element runs over k in an order fixed by the shapes alone, so a
// block's results do not depend on which thread computes it or how many threads there are.
#pragma once

#include <cstdint>

namespace fusedce {
namespace cpu {

struct GemmOps {
  /// C (m x n) = A (m x k) . B^T, B (n x k). Leading dimensions in elements.
  void (*nt)(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
             int64_t ldc);
  /// C (m x n) = A (m x k) . B (k x n) (+ C when accumulate).
  void (*nn)(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
             int64_t ldc, bool accumulate);
  /// C (m x n) = A^T . B (+ C when accumulate), A (k x m), B (k x n).
  void (*tn)(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
             int64_t ldc, bool accumulate);
  /// "OpenBLAS", or "none" for the core's own tile products.
  const char* blas;
  /// The kernels behind them: OpenBLAS's core type (e.g. "SkylakeX", "Haswell"), or "tiles".
  const char* kernels;
};

/// The products this build uses on this CPU: OpenBLAS when it was linked and its kernels fit the
/// CPU (openblas_core_fits), else builtin_gemm(). Decided once.
GemmOps gemm();

/// The core type of the OpenBLAS linked (its own pick), or nullptr in a build without OpenBLAS.
const char* openblas_core();

/// The core's own tile products (AVX2 when the CPU has it), in every build.
GemmOps builtin_gemm();

/// Hidden columns per grad_hidden task (dlogits (rows x V) . weight (V x H), split over hidden
/// columns): an even number of blocks (the pool's two halves balance on two threads) of at most
/// 512 columns, a multiple of 16. Each task's product packs the chunk's dlogits anew, so narrow
/// blocks re-read them often: 128-column blocks measured 5-10% slower overall than 512 at
/// 64 x 1024 x 32000. The split is fixed by H, so results do not depend on the thread count.
inline int64_t grad_hidden_block(int64_t H) {
  constexpr int64_t kMaxBlock = 512;
  const int64_t pairs = (H + 2 * kMaxBlock - 1) / (2 * kMaxBlock);
  const int64_t block = (H + 2 * pairs - 1) / (2 * pairs);
  return block < 16 ? 16 : (block + 15) / 16 * 16;
}

/// gemm().blas: the library behind the CPU linear path's products.
const char* blas_name();

}  // namespace cpu
}  // namespace fusedce
