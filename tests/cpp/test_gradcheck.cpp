// The analytic gradient against central differences of the float64 reference loss, on small
// float32 problems for every option set. This checks the library's gradient against the loss
// itself, independently of the reference's own gradient formula, which is checked the same way
// (far more tightly, as both are float64).
#include <cmath>
#include <vector>

#include "fixture.h"
#include "harness.h"
#include "option_sets.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

class GradCheck : public BackendTest<Case> {};

TEST_P(GradCheck, GradientMatchesCentralDifferencesOfTheReferenceLoss) {
  const OptionSet set = static_cast<OptionSet>(GetParam().variant);
  std::mt19937_64 rng = test_rng();
  for (int64_t vocab : {7, 13}) {
    SCOPED_TRACE("V = " + std::to_string(vocab));
    GenSpec gen;
    gen.dtype = DType::kFloat32;
    gen.rows = 5;
    gen.vocab = vocab;
    gen.class_weight = uses_class_weight(set);
    const Problem p = make_problem(gen, rng);
    const fusedce::Options o = make_options(set);
    std::vector<float> grad_loss(o.reduction == Reduction::kNone ? p.rows : 1);
    std::uniform_real_distribution<float> g(0.5f, 2.0f);
    for (size_t k = 0; k < grad_loss.size(); ++k) grad_loss[k] = (k % 2 == 1 ? -1.0f : 1.0f) * g(rng);

    RunSpec spec;
    spec.options = o;
    spec.gradient = true;
    spec.grad_loss = grad_loss;
    const Outputs out = run_forward(backend(), p, spec);
    ASSERT_TRUE(out.status.ok()) << out.status.message();

    const Reference ref(p, o);
    const RefParams params = RefParams::from(o, vocab, p.class_weight);
    std::vector<double> x(p.rows * vocab);
    for (int64_t i = 0; i < p.rows; ++i) p.load_row(i, &x[i * vocab]);

    const Tolerance tol = tolerance(DType::kFloat32, Quantity::kGradient);
    const Tolerance tight{1e-6, 1e-7, 0.0};  // float64 vs float64 differences (error ~1e-9)
    Mismatches lib("fusedce dlogits vs central differences");
    Mismatches own("reference gradient vs central differences");
    std::vector<double> want;
    for (int64_t i = 0; i < p.rows; ++i) {
      double scale = 0.0;
      ref.grad_row(i, ref.upstream(i, grad_loss), &want, &scale);
      for (int64_t j = 0; j < vocab; ++j) {
        const int64_t k = i * vocab + j;
        const double x0 = x[k];
        const double h = 1e-5 * std::max(1.0, std::fabs(x0));
        x[k] = x0 + h;
        const double up = reference_objective(params, x, p.rows, p.target, grad_loss);
        x[k] = x0 - h;
        const double down = reference_objective(params, x, p.rows, p.target, grad_loss);
        x[k] = x0;
        const double fd = (up - down) / (2.0 * h);
        if (p.ignored(i)) {
          if (fd != 0.0) own.add("ignored row " + std::to_string(i) + " has a finite-difference gradient");
          if (out.grad.at(i, j) != 0.0) lib.add("ignored row " + std::to_string(i) + " has a gradient");
          continue;
        }
        lib.check(out.grad.at(i, j), fd, scale, tol, i, j);
        own.check(want[j], fd, scale, tight, i, j);
      }
    }
    EXPECT_EQ(lib.checked(), (p.rows - p.num_ignored()) * vocab);
    lib.report();
    own.report();
  }
}

const std::vector<OptionSet> kSets = {OptionSet::kPlain,      OptionSet::kLabelSmoothing, OptionSet::kLogitScale,
                                      OptionSet::kSoftcap,    OptionSet::kZLoss,          OptionSet::kClassWeight,
                                      OptionSet::kReduceNone, OptionSet::kReduceSum,      OptionSet::kAll,
                                      OptionSet::kAllReduceNone};

INSTANTIATE_TEST_SUITE_P(FiniteDifferences, GradCheck,
                         ::testing::ValuesIn(make_option_cases({DType::kFloat32}, kSets)), CaseName());

}  // namespace
}  // namespace fusedce_test
