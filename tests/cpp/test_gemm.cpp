// The CPU linear path's matrix products (src/cpu/gemm.h) against float64: the build's choice
// (OpenBLAS when CMake found it) and the core's own tile products, on shapes no vector width or
// tile divides, with leading dimensions past the row length (whose gaps must stay untouched).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/blas_choice.h"
#include "cpu/gemm.h"
#include "fusedce/version.h"
#include "problem.h"

namespace fusedce_test {
namespace {

using fusedce::cpu::GemmOps;

enum class Op { kNT, kNN, kNNAccumulate, kTN, kTNAccumulate };

struct Shape {
  int64_t m, n, k;
};

const char* op_name(Op op) {
  switch (op) {
    case Op::kNT: return "nt";
    case Op::kNN: return "nn";
    case Op::kNNAccumulate: return "nn_accumulate";
    case Op::kTN: return "tn";
    default: return "tn_accumulate";
  }
}

constexpr float kPoison = -12345.0f;

// One product on random operands with leading dimensions ld = cols + 3, checked element by
// element: |got - ref| <= 4 k eps sum_k |a b| (+ |c| eps when accumulating), and the gaps of C.
void check(const GemmOps& ops, Op op, Shape s) {
  std::mt19937_64 rng = test_rng();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const bool a_trans = op == Op::kTN || op == Op::kTNAccumulate;
  const bool b_trans = op == Op::kNT;
  // A is (m x k), or (k x m) when transposed; B is (k x n), or (n x k) for nt.
  const int64_t a_rows = a_trans ? s.k : s.m, a_cols = a_trans ? s.m : s.k;
  const int64_t b_rows = b_trans ? s.n : s.k, b_cols = b_trans ? s.k : s.n;
  const int64_t lda = a_cols + 3, ldb = b_cols + 3, ldc = s.n + 3;
  std::vector<float> A(a_rows * lda + 1, kPoison), B(b_rows * ldb + 1, kPoison), C(s.m * ldc + 1, kPoison);
  for (int64_t r = 0; r < a_rows; ++r) {
    for (int64_t c = 0; c < a_cols; ++c) A[r * lda + c] = normal(rng);
  }
  for (int64_t r = 0; r < b_rows; ++r) {
    for (int64_t c = 0; c < b_cols; ++c) B[r * ldb + c] = normal(rng);
  }
  std::vector<float> C0(C.size(), kPoison);
  const bool accumulate = op == Op::kNNAccumulate || op == Op::kTNAccumulate;
  if (accumulate) {
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < s.n; ++j) C[i * ldc + j] = C0[i * ldc + j] = 4.0f * normal(rng);
    }
  }
  auto a = [&](int64_t i, int64_t p) { return static_cast<double>(a_trans ? A[p * lda + i] : A[i * lda + p]); };
  auto b = [&](int64_t p, int64_t j) { return static_cast<double>(b_trans ? B[j * ldb + p] : B[p * ldb + j]); };
  switch (op) {
    case Op::kNT: ops.nt(s.m, s.n, s.k, A.data(), lda, B.data(), ldb, C.data(), ldc); break;
    case Op::kNN: ops.nn(s.m, s.n, s.k, A.data(), lda, B.data(), ldb, C.data(), ldc, false); break;
    case Op::kNNAccumulate: ops.nn(s.m, s.n, s.k, A.data(), lda, B.data(), ldb, C.data(), ldc, true); break;
    case Op::kTN: ops.tn(s.m, s.n, s.k, A.data(), lda, B.data(), ldb, C.data(), ldc, false); break;
    case Op::kTNAccumulate: ops.tn(s.m, s.n, s.k, A.data(), lda, B.data(), ldb, C.data(), ldc, true); break;
  }
  const double eps = std::ldexp(1.0, -24);
  int bad = 0;
  for (int64_t i = 0; i < s.m && bad < 5; ++i) {
    for (int64_t j = 0; j < ldc && bad < 5; ++j) {
      const float got = C[i * ldc + j];
      if (j >= s.n) {
        if (std::memcmp(&got, &kPoison, sizeof(float)) != 0) {
          ADD_FAILURE() << op_name(op) << ": C[" << i << ", " << j << "] past n was written: " << got;
          ++bad;
        }
        continue;
      }
      double ref = accumulate ? C0[i * ldc + j] : 0.0, mag = std::fabs(ref);
      for (int64_t p = 0; p < s.k; ++p) {
        ref += a(i, p) * b(p, j);
        mag += std::fabs(a(i, p) * b(p, j));
      }
      const double tol = 4.0 * (s.k + 2) * eps * mag + 1e-30;
      if (!(std::fabs(got - ref) <= tol)) {
        ADD_FAILURE() << op_name(op) << " " << s.m << "x" << s.n << "x" << s.k << ": C[" << i << ", " << j
                      << "] = " << got << ", float64 " << ref << " (tolerance " << tol << ")";
        ++bad;
      }
    }
  }
}

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> v = {{1, 1, 1},   {3, 5, 7},     {17, 129, 67}, {37, 300, 19},
                                       {16, 128, 1}, {65, 33, 1001}, {2, 257, 130}};
  return v;
}

void check_all(const GemmOps& ops) {
  for (Op op : {Op::kNT, Op::kNN, Op::kNNAccumulate, Op::kTN, Op::kTNAccumulate}) {
    for (const Shape& s : shapes()) check(ops, op, s);
  }
}

TEST(CpuGemm, BuildsProductsMatchFloat64) { check_all(fusedce::cpu::gemm()); }

TEST(CpuGemm, BuiltinProductsMatchFloat64) { check_all(fusedce::cpu::builtin_gemm()); }

// The build says which products it took: the library CMake found (its message, passed here),
// unless that is OpenBLAS with kernels below this CPU's, where the core's tiles run.
TEST(CpuGemm, BuildNamesItsBlas) {
  const char* core = fusedce::cpu::openblas_core();
  const bool declined = core != nullptr && !fusedce::cpu::openblas_core_fits(core, fusedce::cpu::host_vector_isa());
  const char* expected = declined ? "none" : FUSEDCE_TEST_EXPECT_CPU_BLAS;
  EXPECT_STREQ(fusedce::cpu_blas(), expected);
  EXPECT_STREQ(fusedce::cpu::gemm().blas, expected);
  if (std::strcmp(FUSEDCE_TEST_EXPECT_CPU_BLAS, "OpenBLAS") == 0) {
    EXPECT_NE(core, nullptr);
  }
}

// OpenBLAS runs only with kernels of the CPU's vector unit; a generic fallback (a release older
// than the CPU) leaves the products to the tiles.
TEST(CpuGemm, OpenBlasRunsOnlyWithTheCpusVectorKernels) {
  const fusedce::cpu::GemmOps ops = fusedce::cpu::gemm();
  if (std::strcmp(ops.blas, "OpenBLAS") != 0) {
    EXPECT_STREQ(ops.kernels, "tiles");
    return;
  }
  EXPECT_TRUE(fusedce::cpu::openblas_core_fits(ops.kernels, fusedce::cpu::host_vector_isa())) << ops.kernels;
}

TEST(BlasChoice, AvxTwoCpuTakesOnlyVectorCores) {
  const fusedce::cpu::VectorIsa avx2{true};
  for (const char* core : {"Haswell", "zen", "SkylakeX", "Cooperlake", "SapphireRapids"}) {
    EXPECT_TRUE(fusedce::cpu::openblas_core_fits(core, avx2)) << core;
  }
  for (const char* core : {"Prescott", "Core2", "Nehalem", "Sandybridge", "Atom", "", "Haswellish"}) {
    EXPECT_FALSE(fusedce::cpu::openblas_core_fits(core, avx2)) << core;
  }
  EXPECT_FALSE(fusedce::cpu::openblas_core_fits(nullptr, avx2));
}

TEST(BlasChoice, CpuWithoutAvxTwoTakesAnyCore) {
  const fusedce::cpu::VectorIsa none{false};
  for (const char* core : {"Prescott", "Nehalem", "Haswell"}) EXPECT_TRUE(fusedce::cpu::openblas_core_fits(core, none));
}

}  // namespace
}  // namespace fusedce_test
