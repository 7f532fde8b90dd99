// The CPU linear path's products through OpenBLAS's cblas_sgemm (row-major).
//
// Symbols: the products call cblas_sgemm, which torch's libraries do not export; they export
// MKL's sgemm_, which a link line with torch before OpenBLAS binds a Fortran-style call to
// (seen: the extension ran MKL). blas_name() checks where cblas_sgemm was bound (dladdr) and
// names the library only when it is the OpenBLAS linked.
//
// Threads: OpenBLAS is told to use one thread, once, before the first product; the core's pool
// runs the products on disjoint blocks, so the machine's cores are used once, not pool size x
// BLAS threads. CMake links the static archive when it exists, so that this copy of OpenBLAS,
// its thread setting and its symbols (hidden in the torch extension) are the core's alone and
// cannot meet the BLAS torch brings (MKL exports sgemm_ too). With the shared library instead,
// the setting applies to that library in the whole process.
//
// Kernels: a DYNAMIC_ARCH OpenBLAS picks its kernels by CPU model; where it fell back to kernels
// below the CPU's AVX2 (a release older than the CPU), the core's own tiles run instead
// (openblas_core_fits, blas_choice.h), decided once.
#include <dlfcn.h>

#include <cstring>

#include "cpu/blas_choice.h"
#include "cpu/gemm.h"

extern "C" {
// CBLAS's enum values (cblas.h): row-major order 101, no transpose 111, transpose 112.
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc);
void openblas_set_num_threads(int n);
char* openblas_get_corename(void);
}

namespace fusedce {
namespace cpu {
namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// Row-major C (m x n) = op(A) . op(B) + beta C, 32-bit BLAS integers (validation bounds V and H
// below 2^31; chunks of rows are far below).
void sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B,
           int64_t ldb, float beta, float* C, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(kRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, A,
              static_cast<int>(lda), B, static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

void nt(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
        int64_t ldc) {
  sgemm(kNoTrans, kTrans, m, n, k, A, lda, B, ldb, 0.0f, C, ldc);
}

void nn(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
        int64_t ldc, bool accumulate) {
  sgemm(kNoTrans, kNoTrans, m, n, k, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C, ldc);
}

void tn(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
        int64_t ldc, bool accumulate) {
  sgemm(kTrans, kNoTrans, m, n, k, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C, ldc);
}

/// "OpenBLAS" when the cblas_sgemm called here lives in the OpenBLAS linked: in the same object
/// as this code (the static archive), or in a library named after OpenBLAS (the shared one).
const char* bound_library() {
  Dl_info blas{}, self{};
  const bool found = dladdr(reinterpret_cast<void*>(&cblas_sgemm), &blas) != 0 &&
                     dladdr(reinterpret_cast<void*>(&bound_library), &self) != 0;
  if (!found) return "OpenBLAS";  // no loader information (a static executable): nothing else to bind
  if (blas.dli_fbase == self.dli_fbase) return "OpenBLAS";
  if (blas.dli_fname != nullptr && std::strstr(blas.dli_fname, "openblas") != nullptr) return "OpenBLAS";
  return "unknown (cblas_sgemm bound outside OpenBLAS)";
}

}  // namespace

GemmOps gemm() {
  static const GemmOps ops = [] {
    openblas_set_num_threads(1);
    const char* core = openblas_get_corename();
    if (!openblas_core_fits(core, host_vector_isa())) return builtin_gemm();
    return GemmOps{nt, nn, tn, bound_library(), core};
  }();
  return ops;
}

const char* openblas_core() { return openblas_get_corename(); }

}  // namespace cpu
}  // namespace fusedce
