// The main grid: dtype x V x rows x option set, on every backend. Each case runs the forward
// (loss, lse, metrics) and the forward with gradient, and compares everything with the float64
// reference. 30% of the targets are ignored in every case; logits carry outliers.
//
// Why these sizes:
//   V = 1        a single class: lse = z_0, nll = 0, every probability 1
//   V = 2, 7     shorter than any vector width: the tail paths only
//   V = 127      one short of a power of two: full vectors plus a ragged tail
//   V = 1024     a power of two, no tail
//   V = 50257    GPT-2's vocabulary: many chunks, odd tail
//   V = 128256   Llama 3's vocabulary
//   V = 262144   Gemma's 256K vocabulary: the longest rows, the most chunk merges
//   rows = 0     an empty batch (mean is NaN, sum 0, nothing written)
//   rows = 1, 3  fewer rows than threads / than any row block
//   rows = 257   more rows than a block of threads' work, not a multiple of anything
#include <cmath>
#include <string>
#include <vector>

#include "fixture.h"
#include "harness.h"
#include "option_sets.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

struct GridCase {
  BackendKind backend;
  DType dtype;
  int64_t vocab;
  int64_t rows;
  OptionSet options;
};

// Every backend x dtype x V x rows x option set, less one documented cut: for the three large
// vocabularies (V >= 50257) the 257-row cases run only with the plain and the all-options sets.
// A 257 x 262144 case costs about a second of reference work in float64 per option set and
// dtype; all eleven sets would take most of the suite's budget of about three minutes on two
// cores. The per-row arithmetic of each option is already covered at these V by the 1- and
// 3-row cases, and what 257 rows add (many row blocks over threads, the batch reductions) does
// not depend on the option set. Every V and every row count still appears with every dtype.
std::vector<GridCase> make_grid() {
  const std::vector<int64_t> vocabs = {1, 2, 7, 127, 1024, 50257, 128256, 262144};
  const std::vector<int64_t> row_counts = {0, 1, 3, 257};
  std::vector<GridCase> grid;
  for (BackendKind backend : all_backends()) {
    for (DType dtype : float_dtypes()) {
      for (int64_t vocab : vocabs) {
        for (int64_t rows : row_counts) {
          for (OptionSet s : all_option_sets()) {
            const bool large = vocab >= 50257 && rows == 257;
            if (large && s != OptionSet::kPlain && s != OptionSet::kAll) continue;
            grid.push_back({backend, dtype, vocab, rows, s});
          }
        }
      }
    }
  }
  return grid;
}

std::string case_name(const GridCase& c) {
  return std::string(backend_name(c.backend)) + "_" + dtype_tag(c.dtype) + "_V" + std::to_string(c.vocab) +
         "_N" + std::to_string(c.rows) + "_" + option_set_name(c.options);
}
std::string grid_name(const ::testing::TestParamInfo<GridCase>& info) { return case_name(info.param); }
// gtest prints every parameter while registering; the default is a byte dump.
void PrintTo(const GridCase& c, std::ostream* os) { *os << case_name(c); }

/// One case: the forward, then the forward with gradient, each against the float64 reference.
void expect_case_matches(Backend& backend, const GridCase& c) {
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = c.dtype;
  gen.rows = c.rows;
  gen.vocab = c.vocab;
  // Both target dtypes across the grid: int32 for every other option set.
  gen.target_dtype = static_cast<int>(c.options) % 2 == 0 ? DType::kInt64 : DType::kInt32;
  gen.class_weight = uses_class_weight(c.options);
  const Problem p = make_problem(gen, rng);

  RunSpec spec;
  spec.options = make_options(c.options);
  const Reference ref(p, spec.options);

  const Outputs fwd = run_forward(backend, p, spec);
  ASSERT_TRUE(fwd.status.ok()) << fwd.status.message();
  {
    SCOPED_TRACE("forward");
    expect_forward_matches(fwd, p, ref, spec);
  }

  spec.gradient = true;
  const Outputs fb = run_forward(backend, p, spec);
  ASSERT_TRUE(fb.status.ok()) << fb.status.message();
  SCOPED_TRACE("forward_backward");
  expect_forward_matches(fb, p, ref, spec);
  expect_grad_matches(fb.grad, p, ref, {});
}

class Grid : public BackendTest<GridCase> {};

TEST_P(Grid, MatchesReference) { expect_case_matches(backend(), GetParam()); }

INSTANTIATE_TEST_SUITE_P(CrossEntropy, Grid, ::testing::ValuesIn(make_grid()), grid_name);

// The contract's longest rows: V = 2^21 + 3 (odd, past every power of two the kernels plan
// with: 129 chunks of bf16, 257 of fp32 per row on the stream kernel). 1 and 3 rows split each
// row over many blocks; 20 rows too, with the gradient from a separate backward pass. Plain and
// all options, both float dtypes. About 42 M logits at 20 rows: seconds of float64 reference.
std::vector<GridCase> make_huge_vocab_cases() {
  constexpr int64_t kHugeVocab = (int64_t(1) << 21) + 3;
  std::vector<GridCase> cases;
  for (BackendKind backend : all_backends()) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      for (int64_t rows : {1, 3, 20}) {
        for (OptionSet s : {OptionSet::kPlain, OptionSet::kAll}) cases.push_back({backend, dtype, kHugeVocab, rows, s});
      }
    }
  }
  return cases;
}

class HugeVocab : public BackendTest<GridCase> {};

TEST_P(HugeVocab, MatchesReference) { expect_case_matches(backend(), GetParam()); }

INSTANTIATE_TEST_SUITE_P(CrossEntropy, HugeVocab, ::testing::ValuesIn(make_huge_vocab_cases()), grid_name);

}  // namespace
}  // namespace fusedce_test
