// The linear log-probabilities (fusedce/logprobs.h) over N * V above 2^31 logits: 8193 rows of
// a 262144-entry vocabulary with a hidden size of 16, so row 8192's logits start exactly at
// element 2^31 of the (never stored) logit matrix. Steps 1-3 through the public API, temperature
// 0.9, 30% of the rows ignored. Checked against float64 recomputed from the same float32 inputs:
// logprob and entropy of rows at both ends and both sides of 2^31 (and a few random ones), every
// ignored row's zeros, and the gradients of a weighted objective g_lp * logprob + g_H * entropy
// whose weights are zero except on four rows (two of them past 2^31): grad_weight entirely, and
// grad_hidden of every row (zero off those four). The distribution statistics too (log of the sum
// of squared probabilities, mean logit, whether the target is the argmax; two checked rows'
// targets are their argmax).
//
// In float32 and in bfloat16. The bfloat16 inputs are exact in bf16 and so are their logits
// (hidden in {-1, 0, 1}, weight in eighths of [-2, 2]: every logit a multiple of 1/8 of at most
// 32), so the float64 reference needs no model of the product's rounding; on Hopper this form
// takes the fused products (statistics in the logits product's epilogue, dlogits in the
// recomputed one's). On a GPU the bf16 call's chunk budget holds every logit at once (4.3 GB), so
// the dlogits product writes one chunk of N * V elements, past element 2^31, rather than the
// default budget's chunks of a few hundred million. Its gradients carry bf16 dlogits (2^-9 of
// each term) and a bf16 grad_weight.
//
// Memory: weight and grad_weight 16 MiB each, hidden and grad_hidden 0.5 MiB each; the backend's
// logit chunks (128 MiB on the CPU; the GPU's bf16 call 4.3 GB). Time on two CPU cores, both
// dtypes: about 12 s.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/numeric.h"
#include "fusedce/fusedce.h"
#include "backend.h"

namespace fusedce_test {
namespace {

using fusedce::DType;

constexpr int64_t kRows = 8193;
constexpr int64_t kVocab = 262144;
constexpr int64_t kHidden = 16;
constexpr int64_t kIgnore = -100;
constexpr double kTemperature = 0.9;

/// One row's float64 results: z = hidden_i . weight^T / T, logprob of the target, entropy,
/// dz = d/dz of g_lp * logprob + g_H * entropy, and dz's magnitude before cancellation,
/// p_j (|g_lp| + |g_H| (|log p_j| + entropy)) (+ |g_lp| at the target): float32's z carries an
/// absolute error, which moves g_lp + g_H (log p_j + entropy) by that much however close to 0
/// the bracket is, so bounds scale with the magnitude, not with |dz|.
struct RowRef {
  double logprob = 0.0, entropy = 0.0;
  double log_sum_sq = 0.0, mean_logit = 0.0, mean_abs_logit = 0.0;
  int64_t argmax = 0;
  std::vector<double> dz, mag;
};

RowRef reference_row(const std::vector<float>& hidden, const std::vector<float>& weight, int64_t i, int64_t t,
                     double g_lp, double g_h) {
  std::vector<double> z(kVocab);
  double m = -INFINITY;
  for (int64_t j = 0; j < kVocab; ++j) {
    double acc = 0.0;
    for (int64_t k = 0; k < kHidden; ++k) acc += double(hidden[i * kHidden + k]) * double(weight[j * kHidden + k]);
    z[j] = acc / kTemperature;
    m = std::max(m, z[j]);
  }
  double s = 0.0;
  for (int64_t j = 0; j < kVocab; ++j) s += std::exp(z[j] - m);
  const double lse = m + std::log(s);
  RowRef r;
  double sum_sq = 0.0;
  for (int64_t j = 0; j < kVocab; ++j) {
    r.entropy -= std::exp(z[j] - lse) * (z[j] - lse);
    sum_sq += std::exp(2.0 * (z[j] - lse));
    r.mean_logit += z[j] / kVocab;
    r.mean_abs_logit += std::abs(z[j]) / kVocab;
    if (z[j] > z[r.argmax]) r.argmax = j;
  }
  r.log_sum_sq = std::log(sum_sq);
  r.logprob = z[t] - lse;
  r.dz.resize(kVocab);
  r.mag.resize(kVocab);
  for (int64_t j = 0; j < kVocab; ++j) {
    const double lp = z[j] - lse, p = std::exp(lp);
    r.dz[j] = g_lp * ((j == t ? 1.0 : 0.0) - p) - g_h * p * (lp + r.entropy);
    r.mag[j] = p * (std::abs(g_lp) + std::abs(g_h) * (std::abs(lp) + r.entropy)) + (j == t ? std::abs(g_lp) : 0.0);
  }
  return r;
}

void expect_close(double got, double want, double tol, const std::string& what) {
  EXPECT_LE(std::abs(got - want), tol) << what << ": got " << got << ", want " << want << " (allowed " << tol << ")";
}

class LargeLinearLogprobs : public ::testing::TestWithParam<std::tuple<BackendKind, DType>> {};

TEST_P(LargeLinearLogprobs, MoreThan2To31Logits) {
  std::string why;
  Backend* backend = find_backend(std::get<0>(GetParam()), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const DType dtype = std::get<1>(GetParam());
  const bool bf16 = dtype == DType::kBFloat16;
  ASSERT_GT(kRows * kVocab, int64_t(1) << 31);
  ASSERT_EQ((kRows - 1) * kVocab, int64_t(1) << 31) << "the last row starts at element 2^31";

  std::mt19937_64 rng(20240531);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> hidden(kRows * kHidden), weight(kVocab * kHidden);
  if (bf16) {
    // logits of standard deviation about 4 / T, exact in bf16
    for (float& x : hidden) x = static_cast<float>(static_cast<int>(rng() % 3) - 1);
    for (float& x : weight) x = static_cast<float>(static_cast<int>(rng() % 33) - 16) / 8.0f;
  } else {
    for (float& x : hidden) x = nd(rng);
    for (float& x : weight) x = 0.5f * nd(rng);  // logits of standard deviation about 2 / T
  }

  const std::vector<int64_t> checked{0, 1, 4095, 8191, 8192, 1234, 5678, 7777};
  const std::vector<int64_t> weighted{0, 5678, 8191, 8192};  // rows with a non-zero objective
  std::vector<int64_t> target(kRows);
  for (int64_t i = 0; i < kRows; ++i) {
    const uint64_t r = rng();
    const bool keep = std::find(checked.begin(), checked.end(), i) != checked.end();
    target[i] = (!keep && r % 10 < 3) ? kIgnore : static_cast<int64_t>((r >> 8) % kVocab);
  }
  for (int64_t i : {int64_t(1), int64_t(8192)}) target[i] = reference_row(hidden, weight, i, 0, 0.0, 0.0).argmax;
  std::vector<float> g_lp(kRows, 0.0f), g_h(kRows, 0.0f);
  for (int64_t i : weighted) {
    g_lp[i] = nd(rng);
    g_h[i] = nd(rng);
  }

  const fusedce::Device dev = backend->device();
  fusedce::LogprobOptions o;
  o.temperature = static_cast<float>(kTemperature);
  o.distribution_stats = true;
  const fusedce::ShardSpec whole{0, kVocab};
  const size_t budget = bf16 && std::get<0>(GetParam()) == BackendKind::kCuda ? size_t(5) << 30 : 0;
  auto upload = [&](const std::vector<float>& x) {
    if (!bf16) return DeviceBuffer::from_vector(*backend, x);
    std::vector<uint16_t> b(x.size());
    for (size_t k = 0; k < x.size(); ++k) b[k] = fusedce::detail::float_to_bf16(x[k]);
    return DeviceBuffer::from_vector(*backend, b);
  };
  DeviceBuffer hid = upload(hidden), w = upload(weight);
  DeviceBuffer tgt = DeviceBuffer::from_vector(*backend, target);
  const auto hv = fusedce::matrix(hid.data(), dtype, kRows, kHidden);
  const auto wv = fusedce::matrix(w.data(), dtype, kVocab, kHidden);
  const auto tv = fusedce::vector(tgt.data(), DType::kInt64, kRows);

  DeviceBuffer stats(*backend, (kRows + 1) * fusedce::kLogprobStatsWidth * 4);
  const auto sv = fusedce::matrix(stats.data(), DType::kFloat32, kRows + 1, fusedce::kLogprobStatsWidth);
  fusedce::Status s = fusedce::linear_logprobs_stats(dev, hv, wv, {}, tv, whole, o, budget, sv);
  ASSERT_TRUE(s.ok()) << s.message();
  DeviceBuffer out(*backend, 3 * kRows * 4);
  fusedce::LogprobOutputs lo;
  lo.logprob = fusedce::vector(out.at(0), DType::kFloat32, kRows);
  lo.entropy = fusedce::vector(out.at(kRows * 4), DType::kFloat32, kRows);
  lo.lse = fusedce::vector(out.at(2 * kRows * 4), DType::kFloat32, kRows);
  s = fusedce::logprobs_merge(dev, sv, 1, tv, whole, o, lo);
  ASSERT_TRUE(s.ok()) << s.message();
  DeviceBuffer dist(*backend, 3 * kRows * 4);
  fusedce::DistributionStats ds;
  ds.log_sum_sq_probs = fusedce::vector(dist.at(0), DType::kFloat32, kRows);
  ds.mean_logit = fusedce::vector(dist.at(kRows * 4), DType::kFloat32, kRows);
  ds.is_top1 = fusedce::vector(dist.at(2 * kRows * 4), DType::kFloat32, kRows);
  s = fusedce::logprobs_distribution_stats(dev, sv, 1, tv, whole, o, ds);
  ASSERT_TRUE(s.ok()) << s.message();

  DeviceBuffer glb = DeviceBuffer::from_vector(*backend, g_lp), ghb = DeviceBuffer::from_vector(*backend, g_h);
  DeviceBuffer gw(*backend, kVocab * kHidden * (bf16 ? 2 : 4)), gh(*backend, kRows * kHidden * 4);
  fusedce::LinearGrads grads;
  grads.grad_weight = fusedce::matrix(gw.data(), dtype, kVocab, kHidden);
  grads.grad_hidden = fusedce::matrix(gh.data(), DType::kFloat32, kRows, kHidden);
  s = fusedce::linear_logprobs_backward(dev, hv, wv, {}, tv, whole, o, budget, lo,
                                        fusedce::vector(glb.data(), DType::kFloat32, kRows),
                                        fusedce::vector(ghb.data(), DType::kFloat32, kRows), grads);
  ASSERT_TRUE(s.ok()) << s.message();
  backend->synchronize();

  const std::vector<float> got = out.to_host_as<float>();
  const std::vector<float> dist_h = dist.to_host_as<float>();
  int64_t bad = 0;
  for (int64_t i = 0; i < kRows; ++i) {
    const float lss = dist_h[i], mean = dist_h[kRows + i], top1 = dist_h[2 * kRows + i];
    const bool ok = target[i] == kIgnore
                        ? got[i] == 0.0f && got[kRows + i] == 0.0f && lss == 0.0f && mean == 0.0f && top1 == 0.0f
                        : std::isfinite(got[i]) && got[i] <= 0.0f && got[kRows + i] > 0.0f && lss <= 0.0f &&
                              std::isfinite(mean) && (top1 == 0.0f || top1 == 1.0f);
    if (!ok && bad++ < 5) {
      ADD_FAILURE() << "row " << i << " (target " << target[i] << "): logprob " << got[i] << ", entropy "
                    << got[kRows + i];
    }
  }
  EXPECT_EQ(bad, 0);

  // Forward values of the checked rows; the reference's dz of the weighted ones.
  std::vector<RowRef> refs;
  for (int64_t i : checked) {
    const double glp = g_lp[i], gent = g_h[i];
    RowRef r = reference_row(hidden, weight, i, target[i], glp, gent);
    const std::string tag = "row " + std::to_string(i);
    expect_close(got[i], r.logprob, 2e-5 * (1.0 + std::abs(r.logprob)), tag + " logprob");
    expect_close(got[kRows + i], r.entropy, 1e-4 * std::abs(r.entropy) + 2e-5, tag + " entropy");
    expect_close(dist_h[i], r.log_sum_sq, 4e-6 * (1.0 + std::abs(r.log_sum_sq)), tag + " log_sum_sq_probs");
    expect_close(dist_h[kRows + i], r.mean_logit, 1e-5 * r.mean_abs_logit, tag + " mean_logit");
    EXPECT_EQ(dist_h[2 * kRows + i], r.argmax == target[i] ? 1.0f : 0.0f) << tag << " is_top1";
    refs.push_back(std::move(r));
  }
  auto ref_of = [&](int64_t i) -> const RowRef& {
    return refs[std::find(checked.begin(), checked.end(), i) - checked.begin()];
  };

  // grad_weight[j, k] = sum over the weighted rows of dz[i, j] hidden[i, k] / T; bound: a relative
  // 1e-5 of the sum of the terms' magnitudes (RowRef::mag); in bf16 2^-8 of it and of the result
  // (dlogits and the output rounded to bf16 once each).
  std::vector<float> gwh;
  if (bf16) {
    for (uint16_t b : gw.to_host_as<uint16_t>()) gwh.push_back(fusedce::detail::bf16_to_float(b));
  } else {
    gwh = gw.to_host_as<float>();
  }
  const double rel = bf16 ? std::ldexp(1.0, -8) : 1e-5;
  int64_t bad_gw = 0;
  for (int64_t j = 0; j < kVocab; ++j) {
    for (int64_t k = 0; k < kHidden; ++k) {
      double want = 0.0, scale = 0.0;
      for (int64_t i : weighted) {
        const double h = hidden[i * kHidden + k] / kTemperature;
        want += ref_of(i).dz[j] * h;
        scale += ref_of(i).mag[j] * std::abs(h);
      }
      const double err = std::abs(gwh[j * kHidden + k] - want);
      const double tol = rel * (scale + (bf16 ? std::abs(want) : 0.0)) + 1e-30;
      if (!(err <= tol) && bad_gw++ < 5) {
        ADD_FAILURE() << "grad_weight[" << j << ", " << k << "]: got " << gwh[j * kHidden + k] << ", want " << want;
      }
    }
  }
  EXPECT_EQ(bad_gw, 0);

  // grad_hidden[i, k] = sum_j dz[i, j] weight[j, k] / T on the weighted rows, zero elsewhere.
  const std::vector<float> ghh = gh.to_host_as<float>();
  int64_t bad_gh = 0;
  for (int64_t i = 0; i < kRows; ++i) {
    if (std::find(weighted.begin(), weighted.end(), i) != weighted.end()) continue;
    for (int64_t k = 0; k < kHidden; ++k) {
      if (ghh[i * kHidden + k] != 0.0f && bad_gh++ < 5) {
        ADD_FAILURE() << "grad_hidden[" << i << ", " << k << "] = " << ghh[i * kHidden + k] << ", want 0";
      }
    }
  }
  EXPECT_EQ(bad_gh, 0);
  for (int64_t i : weighted) {
    const RowRef& r = ref_of(i);
    for (int64_t k = 0; k < kHidden; ++k) {
      double want = 0.0, scale = 0.0;
      for (int64_t j = 0; j < kVocab; ++j) {
        const double wk = weight[j * kHidden + k] / kTemperature;
        want += r.dz[j] * wk;
        scale += r.mag[j] * std::abs(wk);
      }
      expect_close(ghh[i * kHidden + k], want, rel * scale + 1e-30,
                   "grad_hidden[" + std::to_string(i) + ", " + std::to_string(k) + "]");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Long, LargeLinearLogprobs,
                         ::testing::Combine(::testing::ValuesIn(all_backends()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const ::testing::TestParamInfo<std::tuple<BackendKind, DType>>& info) {
                           return std::string(backend_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) == DType::kBFloat16 ? "_bf16" : "_float32");
                         });

}  // namespace
}  // namespace fusedce_test
