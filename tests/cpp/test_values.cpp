// Special values: masked vocabulary (-inf), rows of -inf only, NaN and +inf propagation, every
// row ignored, logits of extreme magnitude, and argmax ties (metrics).
#include <cmath>
#include <limits>
#include <vector>

#include "fixture.h"
#include "harness.h"
#include "option_sets.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Forward with gradient under `options`, checked against the reference; returns the outputs.
Outputs run_and_check(Backend& b, const Problem& p, const fusedce::Options& options,
                      const std::vector<float>& grad_loss = {}) {
  RunSpec spec;
  spec.options = options;
  spec.gradient = true;
  spec.grad_loss = grad_loss;
  const Reference ref(p, options);
  Outputs out = run_forward(b, p, spec);
  EXPECT_TRUE(out.status.ok()) << out.status.message();
  if (!out.status.ok()) return out;
  expect_forward_matches(out, p, ref, spec);
  expect_grad_matches(out.grad, p, ref, grad_loss);
  return out;
}

fusedce::Options per_row(OptionSet set) {
  fusedce::Options o = make_options(set);
  o.reduction = Reduction::kNone;
  o.return_metrics = true;
  return o;
}

const std::vector<OptionSet> kSpecialValueSets = {OptionSet::kPlain, OptionSet::kLabelSmoothing, OptionSet::kSoftcap,
                                                  OptionSet::kZLoss, OptionSet::kAllReduceNone};

class SpecialValues : public BackendTest<Case> {
 protected:
  OptionSet set() const { return static_cast<OptionSet>(GetParam().variant); }
  // A generated problem with every logit x replaced by x * mul + add, checked with options `o`
  // per row (as given) and with the mean.
  void check_rescaled(int64_t rows, int64_t vocab, double mul, double add, fusedce::Options o) {
    std::mt19937_64 rng = test_rng();
    GenSpec gen;
    gen.dtype = GetParam().dtype;
    gen.rows = rows;
    gen.vocab = vocab;
    gen.class_weight = uses_class_weight(set());
    Problem p = make_problem(gen, rng);
    for (int64_t i = 0; i < p.rows; ++i) {
      for (int64_t j = 0; j < p.vocab; ++j) p.set(i, j, static_cast<float>(p.x(i, j) * mul + add));
    }
    run_and_check(backend(), p, o);
    o.reduction = Reduction::kMean;
    run_and_check(backend(), p, o);
  }
};

// A quarter of the vocabulary masked with -inf in every row (legal); row 2's target is masked
// (loss +inf as in PyTorch, finite gradient); row 5 has every entry but the target masked (p_t = 1,
// loss 0 without smoothing). With softcap, -inf becomes -softcap and nothing is masked.
TEST_P(SpecialValues, MaskedVocabularyNegativeInfinity) {
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = GetParam().dtype;
  gen.rows = 10;
  gen.vocab = 333;
  gen.class_weight = uses_class_weight(set());
  Problem p = make_problem(gen, rng);
  set_ignored_rows(p, {0, 7, 9});
  std::bernoulli_distribution mask(0.25);
  for (int64_t i = 0; i < p.rows; ++i) {
    for (int64_t j = 0; j < p.vocab; ++j) {
      if (j != p.target[i] && (mask(rng) || i == 5)) p.set(i, j, -kInf);
    }
  }
  p.set(2, p.target[2], -kInf);

  const Outputs out = run_and_check(backend(), p, per_row(set()));
  ASSERT_TRUE(out.status.ok());
  if (set() == OptionSet::kPlain) {
    EXPECT_EQ(out.loss[2], kInf) << "masked target: lse - (-inf)";
    EXPECT_EQ(out.loss[5], 0.0f) << "every other class masked";
    EXPECT_TRUE(std::isfinite(out.grad.at(2, p.target[2])));
  }
}

// A row of -inf only: log_softmax is NaN (-inf - -inf), so its loss and gradient are NaN as in
// PyTorch and its lse is -inf; the other rows are unaffected. argmax of the row is 0.
TEST_P(SpecialValues, RowOfNegativeInfinityOnly) {
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = GetParam().dtype;
  gen.rows = 7;
  gen.vocab = 100;
  gen.class_weight = uses_class_weight(set());
  Problem p = make_problem(gen, rng);
  set_ignored_rows(p, {3, 6});
  for (int64_t j = 0; j < p.vocab; ++j) p.set(1, j, -kInf);
  p.target[1] = 0;

  const Outputs out = run_and_check(backend(), p, per_row(set()));
  ASSERT_TRUE(out.status.ok());
  if (set() != OptionSet::kSoftcap && set() != OptionSet::kAllReduceNone) {
    EXPECT_TRUE(std::isnan(out.loss[1])) << out.loss[1];
    EXPECT_EQ(out.lse[1], -kInf);
    EXPECT_TRUE(std::isnan(out.grad.at(1, 0)));
  }
}

// NaN anywhere in a row makes that row's loss and gradient NaN (row 1: NaN off the target,
// row 6: NaN at the target), as does +inf without softcap (row 4: inf - inf in log_softmax).
// Row 8 is ignored and holds NaN: never read, so loss 0 and gradient 0 (rows 0 and 9 are
// ignored too). A mean over them is NaN.
// Metrics: torch.argmax counts NaN as the maximum, so row 6 is "correct"; the entropy sum is NaN.
TEST_P(SpecialValues, NanAndInfinityPropagateToTheirRow) {
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = GetParam().dtype;
  gen.rows = 10;
  gen.vocab = 515;
  gen.class_weight = uses_class_weight(set());
  Problem p = make_problem(gen, rng);
  set_ignored_rows(p, {0, 8, 9});
  auto other_than = [&](int64_t i, int64_t j) { return (p.target[i] + j) % p.vocab; };
  p.set(1, other_than(1, 100), kNaN);
  p.set(3, other_than(3, 7), -kInf);
  p.set(4, other_than(4, 200), kInf);
  p.set(6, p.target[6], kNaN);
  p.set(8, 11, kNaN);

  const fusedce::Options o = per_row(set());
  const Outputs out = run_and_check(backend(), p, o);
  ASSERT_TRUE(out.status.ok());
  EXPECT_TRUE(std::isnan(out.loss[1]));
  EXPECT_TRUE(std::isnan(out.loss[6]));
  EXPECT_FALSE(std::isnan(out.loss[3]));
  EXPECT_EQ(std::isnan(out.loss[4]), o.softcap == 0.0f) << "+inf is capped to softcap when softcap is on";
  EXPECT_EQ(out.loss[8], 0.0f);
  EXPECT_TRUE(std::isnan(out.entropy_sum));
  for (int64_t j = 0; j < p.vocab; ++j) {
    ASSERT_TRUE(std::isnan(out.grad.at(1, j))) << "row 1 col " << j;
    ASSERT_EQ(out.grad.at(8, j), 0.0) << "row 8 col " << j;
  }

  fusedce::Options mean = o;
  mean.reduction = Reduction::kMean;
  const Outputs m = run_and_check(backend(), p, mean);
  ASSERT_TRUE(m.status.ok());
  EXPECT_TRUE(std::isnan(m.loss[0])) << m.loss[0];
}

// Every target ignored: mean is NaN (0 / 0, as PyTorch), sum 0, per-row losses 0; every
// gradient exactly 0 (not NaN, although mean's chain factor is 1/0); no row counts for metrics.
TEST_P(SpecialValues, EveryRowIgnored) {
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = GetParam().dtype;
  gen.rows = 6;
  gen.vocab = 77;
  gen.ignore_fraction = 1.0;
  gen.class_weight = uses_class_weight(set());
  const Problem p = make_problem(gen, rng);
  ASSERT_EQ(p.num_ignored(), p.rows);
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    SCOPED_TRACE(fusedce::reduction_name(r));
    fusedce::Options o = make_options(set());
    o.reduction = r;
    o.return_metrics = true;
    const Outputs out = run_and_check(backend(), p, o);
    ASSERT_TRUE(out.status.ok());
    if (r == Reduction::kMean) {
      EXPECT_TRUE(std::isnan(out.loss[0])) << out.loss[0];
    }
    if (r == Reduction::kSum) {
      EXPECT_EQ(out.loss[0], 0.0f);
    }
    EXPECT_EQ(out.num_correct, 0);
    EXPECT_EQ(out.entropy_sum, 0.0f);
  }
}

// Logits in the thousands (outliers near 2e4, within float16's range): the max-shifted sums must
// neither overflow nor lose the row; softmax is then one-hot.
TEST_P(SpecialValues, ExtremeMagnitudes) {
  fusedce::Options o = per_row(set());
  o.z_loss = 0.0f;  // lse^2 ~ 1e9 would only test float32's range
  check_rescaled(11, 2049, 2000.0, 0.0, o);
}

// Every logit near one large value (100 + the generator's N(0, 2) and outliers): softmax
// stays spread over many classes while every exponent is formed from numbers that cancel (the
// CUDA kernels form x scale log2(e) - ref in one FMA and correct the float constants' rounding
// once per chunk or row: stream_kernel.cuh, plain_grad_exp). 20011 classes: three 32 KB chunks a
// row on the stream kernel, so the reference moves between chunks. Not larger: the gradient is
// formed from a float32 lse, whose rounding alone moves p by up to half an ulp of lse (1.2e-4
// relative at lse ~ 3000, where both backends fail float32's 1e-5; docs/performance.md).
TEST_P(SpecialValues, SoftmaxOverLargeLogits) {
  fusedce::Options o = per_row(set());
  o.softcap = 0.0f;  // tanh saturates near 100: float32 ties would move the argmax, not the point here
  check_rescaled(23, 20011, 1.0, 100.0, o);
}

INSTANTIATE_TEST_SUITE_P(Values, SpecialValues, ::testing::ValuesIn(make_option_cases(float_dtypes(), kSpecialValueSets)),
                         CaseName());

class OptionValues : public BackendTest<Case> {};

// Option values at the edges of their ranges, each with reduction none and mean, with gradient:
// a negative logit scale with softcap and smoothing (the argmax moves to the random bulk, where
// float32 rounding of the scaled values could tie neighbours, so no metrics), label smoothing 1
// (only the smoothing term is left), a softcap of 1 (most logits deep in tanh's saturation), and
// a z-loss of 0.5 (the lse^2 term dominates).
TEST_P(OptionValues, EdgesOfTheRanges) {
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = GetParam().dtype;
  gen.rows = 19;
  gen.vocab = 777;
  gen.class_weight = true;
  const Problem p = make_problem(gen, rng);
  fusedce::Options o;
  switch (GetParam().variant) {
    case 0:
      o.logit_scale = -0.7f;
      o.softcap = 5.0f;
      o.label_smoothing = 0.2f;
      break;
    case 1:
      o.label_smoothing = 1.0f;
      o.return_metrics = true;
      break;
    case 2:
      // No metrics: tanh saturates to exactly 1 in float32 for arguments above ~9 but not in
      // float64 until ~19, so the outliers tie in float32 only and argmax legitimately differs.
      o.softcap = 1.0f;
      o.logit_scale = 3.0f;
      break;
    default:
      o.z_loss = 0.5f;
      o.return_metrics = true;
      break;
  }
  for (Reduction r : {Reduction::kNone, Reduction::kMean}) {
    SCOPED_TRACE(fusedce::reduction_name(r));
    o.reduction = r;
    run_and_check(backend(), p, o);
  }
}

INSTANTIATE_TEST_SUITE_P(Values, OptionValues,
                         ::testing::ValuesIn(make_cases(float_dtypes(), {{0, "negative_logit_scale"},
                                                                         {1, "label_smoothing_one"},
                                                                         {2, "softcap_one"},
                                                                         {3, "z_loss_half"}})),
                         CaseName());

class Metrics : public BackendTest<Case> {};

struct TieRow {
  std::vector<int64_t> max_at;  // positions holding the row's maximum (equal values)
  int64_t target;
};

// Rows whose maximum appears more than once: argmax is the lowest such index (torch.argmax), so
// a target at a later copy is not counted. Ties inside one group of 8 lanes, across the
// 2048-element chunk boundary, at both ends of the row, and three-way; also in a 7-class row.
// The maximum 10 and the bulk in [-4, 4] are exact in every dtype, so ties stay ties under the
// logit scale and the softcap.
TEST_P(Metrics, ArgmaxTiesGoToTheLowestIndex) {
  std::mt19937_64 rng = test_rng();
  const bool transformed = GetParam().variant == 1;
  struct Layout {
    int64_t vocab;
    std::vector<TieRow> rows;
    int64_t expected;
  };
  const std::vector<Layout> layouts = {
      {5000,
       {{{3, 4}, 3}, {{3, 4}, 4}, {{2047, 2048}, 2048}, {{2047, 2048}, 2047}, {{0, 4999}, 4999}, {{0, 4999}, 0},
        {{100, 3000, 4500}, 100}, {{100, 3000, 4500}, 4500}, {{4000, 4001}, -100}, {{4000}, -100},
        {{10, 11}, -100}},
       4},
      {7, {{{2, 3}, 2}, {{0, 6}, 6}, {{1, 5}, 1}, {{1, 5}, 5}, {{4, 5, 6}, 4}, {{0}, -100}, {{2, 3}, -100}}, 3},
  };
  for (const Layout& layout : layouts) {
    SCOPED_TRACE("V = " + std::to_string(layout.vocab));
    GenSpec gen;
    gen.dtype = GetParam().dtype;
    gen.rows = static_cast<int64_t>(layout.rows.size());
    gen.vocab = layout.vocab;
    gen.ignore_fraction = 0.0;
    Problem p = make_problem(gen, rng);
    std::uniform_int_distribution<int> bulk(-64, 64);
    for (int64_t i = 0; i < p.rows; ++i) {
      for (int64_t j = 0; j < p.vocab; ++j) p.set(i, j, static_cast<float>(bulk(rng)) / 16.0f);
      for (int64_t j : layout.rows[i].max_at) p.set(i, j, 10.0f);
      p.target[i] = layout.rows[i].target;
    }
    RunSpec spec;
    spec.options.return_metrics = true;
    if (transformed) {
      spec.options.logit_scale = 1.5f;
      spec.options.softcap = 10.0f;
    }
    const Reference ref(p, spec.options);
    ASSERT_EQ(ref.num_correct(), layout.expected) << "the reference's own argmax";
    for (bool gradient : {false, true}) {
      SCOPED_TRACE(gradient ? "forward_backward" : "forward");
      spec.gradient = gradient;
      const Outputs out = run_forward(backend(), p, spec);
      ASSERT_TRUE(out.status.ok()) << out.status.message();
      EXPECT_EQ(out.num_correct, layout.expected);
      expect_forward_matches(out, p, ref, spec);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Metrics, Metrics,
                         ::testing::ValuesIn(make_cases(float_dtypes(), {{0, "plain"}, {1, "scale_softcap"}})),
                         CaseName());

}  // namespace
}  // namespace fusedce_test
