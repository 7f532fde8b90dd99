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
// Kernels: a DYNAMIC_ARCH OpenBLAS picks its kernels by CPU model, and a release older than the
// CPU (Debian 12's 0.3.21 on Emerald Rapids, model 0xCF) falls back to its SSE3 "Prescott"
// kernels, 4-5x slower than its AVX-512 ones. For the private (static) copy only, a fallback
// below what the CPU's instruction set allows is corrected once, before the first product, by
// OpenBLAS's own re-initialisation with a forced core type. The process environment is never
// written: the build gives the private copy's two environment reads to
// fusedce_openblas_getenv (objcopy --redefine-sym getenv=..., CMakeLists.txt), which answers
// OPENBLAS_CORETYPE with the forced core and passes every other name to getenv. A value the user
// set is left alone.
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <strings.h>

#include "cpu/gemm.h"

extern "C" {
// CBLAS's enum values (cblas.h): row-major order 101, no transpose 111, transpose 112.
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc);
void openblas_set_num_threads(int n);
char* openblas_get_corename(void);
#if defined(FUSEDCE_OPENBLAS_PRIVATE)
void gotoblas_dynamic_init(void);
void gotoblas_dynamic_quit(void);
#endif
}

namespace fusedce {
namespace cpu {
namespace {

bool core_is_one_of(const char* core, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (strcasecmp(core, n) == 0) return true;
  }
  return false;
}

/// The OpenBLAS core type this CPU's instruction set allows for sgemm, or nullptr when the one
/// OpenBLAS chose already uses it (or the CPU has no AVX2).
const char* better_core(const char* current) {
#if defined(__x86_64__) && defined(__GNUC__)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && !core_is_one_of(current, {"SkylakeX", "Cooperlake", "SapphireRapids"})) return "SkylakeX";
  if (!avx512 && avx2 && !core_is_one_of(current, {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"})) {
    return "Haswell";
  }
#endif
  (void)current;
  return nullptr;
}

#if defined(FUSEDCE_OPENBLAS_PRIVATE)
/// The core type the private OpenBLAS is told at its next initialisation (nullptr: its own pick).
std::atomic<const char*> forced_core{nullptr};
#endif

void setup_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    openblas_set_num_threads(1);
#if defined(FUSEDCE_OPENBLAS_PRIVATE)
    const char* better = better_core(openblas_get_corename());
    if (better != nullptr && std::getenv("OPENBLAS_CORETYPE") == nullptr) {
      forced_core.store(better);
      gotoblas_dynamic_quit();
      gotoblas_dynamic_init();
    }
#endif
  });
}

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
  setup_once();
  static const char* const name = bound_library();
  return GemmOps{nt, nn, tn, name, openblas_get_corename()};
}

}  // namespace cpu
}  // namespace fusedce

#if defined(FUSEDCE_OPENBLAS_PRIVATE)
/// The private OpenBLAS's getenv (its references renamed to this at build time): the forced core
/// for OPENBLAS_CORETYPE unless the user set one, the environment for every other name.
extern "C" char* fusedce_openblas_getenv(const char* name) {
  char* value = std::getenv(name);
  if (value != nullptr || std::strcmp(name, "OPENBLAS_CORETYPE") != 0) return value;
  return const_cast<char*>(fusedce::cpu::forced_core.load());
}
#endif
