// The judges judged: tolerances that cannot fail would make every other test meaningless. On
// the CPU backend: each option changes the results by more than the tolerance (a reference that
// forgot it would be caught), and small perturbations of a correct result (a few ulps of a 16-bit
// gradient, 1e-4 of a float32 one, 1e-4 of a loss, one count of num_correct) are caught too.
#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "harness.h"
#include "option_sets.h"

namespace fusedce_test {
namespace {

using fusedce::DType;

Problem small_problem(DType dtype, bool weights, std::mt19937_64& rng) {
  GenSpec gen;
  gen.dtype = dtype;
  gen.rows = 9;
  gen.vocab = 300;
  gen.class_weight = weights;
  return make_problem(gen, rng);
}

TEST(ToleranceCanFail, EachOptionChangesResultsBeyondTheTolerance) {
  std::mt19937_64 rng = test_rng();
  Backend& b = *cpu_test_backend();
  for (DType dtype : float_dtypes()) {
    for (OptionSet set : {OptionSet::kLabelSmoothing, OptionSet::kLogitScale, OptionSet::kSoftcap, OptionSet::kZLoss,
                          OptionSet::kClassWeight}) {
      SCOPED_TRACE(std::string(dtype_tag(dtype)) + " " + option_set_name(set));
      const Problem p = small_problem(dtype, set == OptionSet::kClassWeight, rng);
      RunSpec spec;
      spec.options = make_options(set);
      spec.options.reduction = fusedce::Reduction::kNone;
      spec.gradient = true;
      const Outputs out = run_forward(b, p, spec);
      ASSERT_TRUE(out.status.ok()) << out.status.message();
      expect_forward_matches(out, p, Reference(p, spec.options), spec);
      expect_grad_matches(out.grad, p, Reference(p, spec.options), {});

      // The reference without the option.
      Problem q = p;
      q.class_weight.clear();
      fusedce::Options plain;
      plain.reduction = fusedce::Reduction::kNone;
      const Reference forgot(q, plain);
      RunSpec plain_spec = spec;
      plain_spec.options = plain;
      plain_spec.lse = false;  // one failure per EXPECT_NONFATAL_FAILURE: the loss's
      EXPECT_NONFATAL_FAILURE(expect_forward_matches(out, q, forgot, plain_spec), "per-row loss");
      EXPECT_NONFATAL_FAILURE(expect_grad_matches(out.grad, q, forgot, {}), "dlogits");
    }
  }
}

TEST(ToleranceCanFail, SmallPerturbationsAreCaught) {
  std::mt19937_64 rng = test_rng();
  Backend& b = *cpu_test_backend();
  for (DType dtype : float_dtypes()) {
    SCOPED_TRACE(dtype_tag(dtype));
    const Problem p = small_problem(dtype, true, rng);
    RunSpec spec;
    spec.options = make_options(OptionSet::kAllReduceNone);
    spec.gradient = true;
    const Outputs out = run_forward(b, p, spec);
    ASSERT_TRUE(out.status.ok()) << out.status.message();
    const Reference ref(p, spec.options);
    expect_forward_matches(out, p, ref, spec);
    expect_grad_matches(out.grad, p, ref, {});

    // The largest gradient element of the batch: where the absolute part of the tolerance (for
    // the cancellation at a confident target) is smallest relative to the value.
    int64_t row = 0, col = 0;
    for (int64_t i = 0; i < p.rows; ++i) {
      for (int64_t j = 0; j < p.vocab; ++j) {
        if (std::fabs(out.grad.at(i, j)) > std::fabs(out.grad.at(row, col))) {
          row = i;
          col = j;
        }
      }
    }
    ASSERT_FALSE(p.ignored(row));

    // Gradient: 3 ulps of a 16-bit dtype (2^-7, 2^-10 relative), 1e-4 relative in float32.
    const double rel = dtype == DType::kBFloat16 ? 3.0 * 0x1p-7 : dtype == DType::kFloat16 ? 3.0 * 0x1p-10 : 1e-4;
    Outputs bent = out;
    const double v = bent.grad.at(row, col);
    store_value(bent.grad.bytes.data(), dtype, bent.grad.offset + row * bent.grad.stride + col,
                static_cast<float>(v * (1.0 + rel)));
    ASSERT_NE(bent.grad.at(row, col), v);
    {
      SCOPED_TRACE("gradient perturbed");
      EXPECT_NONFATAL_FAILURE(expect_grad_matches(bent.grad, p, ref, {}), "dlogits");
    }

    // A nonzero gradient on an ignored row.
    int64_t ignored = 0;
    while (!p.ignored(ignored)) ++ignored;
    bent = out;
    store_value(bent.grad.bytes.data(), dtype, bent.grad.offset + ignored * bent.grad.stride, 0x1p-20f);
    EXPECT_NONFATAL_FAILURE(expect_grad_matches(bent.grad, p, ref, {}), "ignored row");

    // Loss 1e-4 relative, num_correct by one, entropy 1e-4 relative.
    bent = out;
    bent.loss[row] *= 1.0f + 1e-4f;
    {
      SCOPED_TRACE("loss perturbed");
      EXPECT_NONFATAL_FAILURE(expect_forward_matches(bent, p, ref, spec), "per-row loss");
    }
    bent = out;
    bent.num_correct += 1;
    EXPECT_NONFATAL_FAILURE(expect_forward_matches(bent, p, ref, spec), "num_correct");
    bent = out;
    bent.entropy_sum *= 1.0f + 1e-4f;
    {
      SCOPED_TRACE("entropy perturbed");
      EXPECT_NONFATAL_FAILURE(expect_forward_matches(bent, p, ref, spec), "entropy_sum");
    }
  }
}

TEST(ToleranceCanFail, NanAndInfinityMasksMustMatch) {
  const Tolerance loose{1.0, 1.0, 1.0};
  EXPECT_TRUE(within(NAN, NAN, 1.0, loose));
  EXPECT_FALSE(within(0.0, NAN, 1.0, loose));
  EXPECT_FALSE(within(NAN, 0.0, 1.0, loose));
  EXPECT_TRUE(within(INFINITY, INFINITY, 1.0, loose));
  EXPECT_FALSE(within(-INFINITY, INFINITY, 1.0, loose));
  EXPECT_FALSE(within(1e30, INFINITY, 1.0, loose));
  EXPECT_FALSE(within(INFINITY, 1e30, 1.0, loose));
}

}  // namespace
}  // namespace fusedce_test
