// The core's own products for the CPU linear path (GemmOps of gemm.h), built from the
// register-blocked tile kernels of kernels_impl.h: operands are packed into contiguous tiles of
// kRows x kCols, and each output element's sum runs over k tile by tile in order.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/kernels.h"

namespace fusedce {
namespace cpu {
namespace {

constexpr int64_t kRows = 16;   // rows of the short side of a tile
constexpr int64_t kCols = 128;  // rows of the long side of a tile

TileKernels tiles() {
#if defined(FUSEDCE_HAVE_AVX2_KERNELS)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  if (has) return avx2::tile_kernels();
#endif
  return generic::tile_kernels();
}

/// rows x cols of X (leading dimension ld) into out, contiguous.
void pack(const float* X, int64_t ld, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * cols, X + r * ld, cols * sizeof(float));
}

void unpack(const float* in, int64_t rows, int64_t cols, float* X, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(X + r * ld, in + r * cols, cols * sizeof(float));
}

void nt(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
        int64_t ldc) {
  const TileKernels t = tiles();
  std::vector<float> a(m * k), b(kCols * k), z(kRows * kCols);
  pack(A, lda, m, k, a.data());
  for (int64_t j0 = 0; j0 < n; j0 += kCols) {
    const int64_t nc = std::min(kCols, n - j0);
    pack(B + j0 * ldb, ldb, nc, k, b.data());
    for (int64_t i0 = 0; i0 < m; i0 += kRows) {
      const int64_t mr = std::min(kRows, m - i0);
      t.logits(a.data() + i0 * k, b.data(), mr, nc, k, z.data());
      unpack(z.data(), mr, nc, C + i0 * ldc + j0, ldc);
    }
  }
}

// The tile kernel dh: E (rc x H) += G (rc x vt) . B (vt x H), here with rc <- rows of A,
// vt <- a k tile, H <- n.
void nn(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
        int64_t ldc, bool accumulate) {
  const TileKernels t = tiles();
  std::vector<float> acc(m * n, 0.0f), g(kRows * kCols), b(kCols * n);
  if (accumulate) pack(C, ldc, m, n, acc.data());
  for (int64_t k0 = 0; k0 < k; k0 += kCols) {
    const int64_t kc = std::min(kCols, k - k0);
    pack(B + k0 * ldb, ldb, kc, n, b.data());
    for (int64_t i0 = 0; i0 < m; i0 += kRows) {
      const int64_t mr = std::min(kRows, m - i0);
      pack(A + i0 * lda + k0, lda, mr, kc, g.data());
      t.dh(g.data(), b.data(), mr, kc, n, acc.data() + i0 * n);
    }
  }
  unpack(acc.data(), m, n, C, ldc);
}

// The tile kernel dw: D (vt x H) += G (rc x vt)^T . X (rc x H), here with vt <- an m tile,
// rc <- a k tile, H <- n.
void tn(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
        int64_t ldc, bool accumulate) {
  const TileKernels t = tiles();
  std::vector<float> d(kCols * n), g(kRows * kCols), x(kRows * n);
  for (int64_t j0 = 0; j0 < m; j0 += kCols) {
    const int64_t mc = std::min(kCols, m - j0);
    if (accumulate) {
      pack(C + j0 * ldc, ldc, mc, n, d.data());
    } else {
      std::fill(d.begin(), d.begin() + mc * n, 0.0f);
    }
    for (int64_t k0 = 0; k0 < k; k0 += kRows) {
      const int64_t kr = std::min(kRows, k - k0);
      pack(A + k0 * lda + j0, lda, kr, mc, g.data());
      pack(B + k0 * ldb, ldb, kr, n, x.data());
      t.dw(g.data(), x.data(), kr, mc, n, d.data());
    }
    unpack(d.data(), mc, n, C + j0 * ldc, ldc);
  }
}

}  // namespace

GemmOps builtin_gemm() { return GemmOps{nt, nn, tn, "none", "tiles"}; }

const char* blas_name() { return gemm().blas; }

}  // namespace cpu
}  // namespace fusedce
