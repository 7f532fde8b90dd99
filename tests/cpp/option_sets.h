// The named option sets the parameterised suites run: each option alone, each reduction, the
// metrics, and all of them together. Shared so the grid, the feature suites and the gradient
// check mean the same thing by the same name.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "backend.h"
#include "fusedce/types.h"

namespace fusedce_test {

enum class OptionSet {
  kPlain,           // defaults: reduction mean, nothing else
  kLabelSmoothing,
  kLogitScale,
  kSoftcap,
  kZLoss,
  kClassWeight,
  kReduceNone,
  kReduceSum,       // (mean is kPlain)
  kMetrics,
  kAll,             // every option together, reduction mean (class-weight denominator)
  kAllReduceNone,   // every option together, per-row losses
};

const std::vector<OptionSet>& all_option_sets();
const char* option_set_name(OptionSet s);
bool uses_class_weight(OptionSet s);

/// Values large enough that each option changes the loss far beyond the tolerance: smoothing
/// 0.1, scale 1.5 (outliers at 12..18), softcap 10 (z of the outliers squeezed to about 8..9.5),
/// z-loss 1e-3 (about 0.1 to 0.3 at lse ~ 10..17).
fusedce::Options make_options(OptionSet s);

/// The parameter of most suites: a backend, a logits dtype and a suite-specific variant.
struct Case {
  BackendKind backend;
  fusedce::DType dtype;
  int variant;
  const char* variant_name;  // "" for none
};

/// backend x dtype x variants; variants are (value, name) pairs, empty for none.
std::vector<Case> make_cases(const std::vector<fusedce::DType>& dtypes,
                             const std::vector<std::pair<int, const char*>>& variants = {});
/// The same for option sets as the variants.
std::vector<Case> make_option_cases(const std::vector<fusedce::DType>& dtypes, const std::vector<OptionSet>& sets);
std::string case_name(const Case& c);
/// For INSTANTIATE_TEST_SUITE_P: "cpu_bfloat16_softcap".
struct CaseName {
  template <typename Info>
  std::string operator()(const Info& info) const {
    return case_name(info.param);
  }
};
// gtest prints every parameter while registering; the default is a byte dump.
void PrintTo(const Case& c, std::ostream* os);

}  // namespace fusedce_test
