#include "option_sets.h"

#include "harness.h"

namespace fusedce_test {

const std::vector<OptionSet>& all_option_sets() {
  static const std::vector<OptionSet> sets = {
      OptionSet::kPlain,       OptionSet::kLabelSmoothing, OptionSet::kLogitScale, OptionSet::kSoftcap,
      OptionSet::kZLoss,       OptionSet::kClassWeight,    OptionSet::kReduceNone, OptionSet::kReduceSum,
      OptionSet::kMetrics,     OptionSet::kAll,            OptionSet::kAllReduceNone};
  return sets;
}

const char* option_set_name(OptionSet s) {
  switch (s) {
    case OptionSet::kPlain: return "plain";
    case OptionSet::kLabelSmoothing: return "label_smoothing";
    case OptionSet::kLogitScale: return "logit_scale";
    case OptionSet::kSoftcap: return "softcap";
    case OptionSet::kZLoss: return "z_loss";
    case OptionSet::kClassWeight: return "class_weight";
    case OptionSet::kReduceNone: return "reduce_none";
    case OptionSet::kReduceSum: return "reduce_sum";
    case OptionSet::kMetrics: return "metrics";
    case OptionSet::kAll: return "all";
    case OptionSet::kAllReduceNone: return "all_reduce_none";
  }
  return "unknown";
}

bool uses_class_weight(OptionSet s) {
  return s == OptionSet::kClassWeight || s == OptionSet::kAll || s == OptionSet::kAllReduceNone;
}

fusedce::Options make_options(OptionSet s) {
  fusedce::Options o;
  const bool all = s == OptionSet::kAll || s == OptionSet::kAllReduceNone;
  if (s == OptionSet::kLabelSmoothing || all) o.label_smoothing = 0.1f;
  if (s == OptionSet::kLogitScale || all) o.logit_scale = 1.5f;
  if (s == OptionSet::kSoftcap || all) o.softcap = 10.0f;
  if (s == OptionSet::kZLoss || all) o.z_loss = 1e-3f;
  if (s == OptionSet::kMetrics || all) o.return_metrics = true;
  if (s == OptionSet::kReduceNone || s == OptionSet::kAllReduceNone) o.reduction = fusedce::Reduction::kNone;
  if (s == OptionSet::kReduceSum) o.reduction = fusedce::Reduction::kSum;
  return o;
}

std::vector<Case> make_cases(const std::vector<fusedce::DType>& dtypes,
                             const std::vector<std::pair<int, const char*>>& variants) {
  std::vector<Case> cases;
  for (BackendKind b : all_backends()) {
    for (fusedce::DType d : dtypes) {
      if (variants.empty()) {
        cases.push_back({b, d, 0, ""});
      } else {
        for (const auto& v : variants) cases.push_back({b, d, v.first, v.second});
      }
    }
  }
  return cases;
}

std::vector<Case> make_option_cases(const std::vector<fusedce::DType>& dtypes, const std::vector<OptionSet>& sets) {
  std::vector<std::pair<int, const char*>> variants;
  for (OptionSet s : sets) variants.push_back({static_cast<int>(s), option_set_name(s)});
  return make_cases(dtypes, variants);
}

std::string case_name(const Case& c) {
  std::string n = std::string(backend_name(c.backend)) + "_" + dtype_tag(c.dtype);
  if (c.variant_name[0] != '\0') n += std::string("_") + c.variant_name;
  return n;
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

}  // namespace fusedce_test
