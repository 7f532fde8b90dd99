// The linear distillation (fusedce/distill.h) over N * V above 2^31 logits per head: 8193 rows
// of a 262144-entry vocabulary, a student of hidden size 16 and a teacher of 12, so row 8192's
// logits start exactly at element 2^31 of each (never stored) logit matrix. Forward KL at
// temperature 0.9 mixed with the hard cross-entropy (hard_weight 0.2), reduction none, 30% of
// the rows ignored; once on one device (forward, then backward) and once as the
// vocabulary-parallel steps 1-5 over two uneven shards of both heads. Checked against float64
// recomputed from the same float32 inputs: loss, divergence, hard term and entropy of rows at both
// ends and both sides of 2^31 (and a few others), every ignored row's zeros, and the gradients
// for an upstream gradient that is zero except on four rows (two past 2^31): grad_weight
// entirely, grad_hidden of every row (zero off those four; the ranks' parts summed).
//
// Tolerances: the logits are float32 dot products of 16 (12) terms (absolute error about 1e-6),
// sums over the vocabulary run in double from float32 terms; a log-sum-exp or divergence moves by
// at most a few such errors: loss, divergence and hard within 5e-6 (1 + |value|) (a 1e-5
// relative bias of the divergence fails it), entropy 1e-4 relative plus 2e-5 as
// test_large_logprobs.cpp. Gradients within 1e-5 of the sum of their terms' magnitudes
// (RowRef::mag): a float32 logit's absolute error moves each term by that much whatever the
// cancellation between p_s and p_t.
//
// Memory: the heads 16 + 12 MiB, grad_weight 16 MiB; the backend's logit chunks. Time on two CPU
// cores: about a minute.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend.h"
#include "fusedce/fusedce.h"

namespace fusedce_test {
namespace {

using fusedce::DType;

constexpr int64_t kRows = 8193;
constexpr int64_t kVocab = 262144;
constexpr int64_t kHs = 16, kHt = 12;
constexpr int64_t kIgnore = -100;
constexpr double kTemperature = 0.9, kHard = 0.2;
constexpr int64_t kSplit = 100003;  // the first rank's vocabulary rows: shards of uneven size

/// Inputs on the host (float32, as the kernels read them).
struct Inputs {
  std::vector<float> hs, ws, ht, wt;
  std::vector<int64_t> labels;
  std::vector<float> grad_loss;
};

/// One row's float64 values and d loss_i / d y_student (y: logits at temperature 1), with each
/// entry's magnitude before cancellation.
struct RowRef {
  double loss = 0.0, divergence = 0.0, hard = 0.0, entropy = 0.0;
  std::vector<double> dy, mag;
};

std::vector<double> logits(const std::vector<float>& h, const std::vector<float>& w, int64_t H, int64_t i) {
  std::vector<double> y(kVocab);
  for (int64_t j = 0; j < kVocab; ++j) {
    double acc = 0.0;
    for (int64_t k = 0; k < H; ++k) acc += double(h[i * H + k]) * double(w[j * H + k]);
    y[j] = acc;
  }
  return y;
}

double logsumexp(const std::vector<double>& z, double scale) {
  double m = -INFINITY, s = 0.0;
  for (double v : z) m = std::max(m, v * scale);
  for (double v : z) s += std::exp(v * scale - m);
  return m + std::log(s);
}

RowRef reference_row(const Inputs& in, int64_t i) {
  const std::vector<double> ys = logits(in.hs, in.ws, kHs, i), yt = logits(in.ht, in.wt, kHt, i);
  const double inv_t = 1.0 / kTemperature;
  const double lse_s = logsumexp(ys, inv_t), lse_t = logsumexp(yt, inv_t), lse1 = logsumexp(ys, 1.0);
  const int64_t label = in.labels[i];
  RowRef r;
  r.dy.resize(kVocab);
  r.mag.resize(kVocab);
  for (int64_t j = 0; j < kVocab; ++j) {
    const double lps = ys[j] * inv_t - lse_s, lpt = yt[j] * inv_t - lse_t;
    const double ps = std::exp(lps), pt = std::exp(lpt), p1 = std::exp(ys[j] - lse1);
    const double onehot = j == label ? 1.0 : 0.0;
    r.divergence += pt * (lpt - lps);
    r.entropy -= ps * lps;
    r.dy[j] = (1.0 - kHard) * inv_t * (ps - pt) + kHard * (p1 - onehot);
    r.mag[j] = (1.0 - kHard) * inv_t * (ps + pt) + kHard * (p1 + onehot);
  }
  r.hard = lse1 - ys[label];
  r.loss = (1.0 - kHard) * r.divergence + kHard * r.hard;
  return r;
}

void expect_close(double got, double want, double tol, const std::string& what) {
  EXPECT_LE(std::abs(got - want), tol) << what << ": got " << got << ", want " << want << " (allowed " << tol << ")";
}

/// A run's results on the host: loss, divergence, hard, entropy (N each), grad_weight (V, Hs),
/// grad_hidden (N, Hs).
struct Results {
  std::vector<float> values, grad_weight, grad_hidden;
};

fusedce::DistillOptions options() {
  fusedce::DistillOptions o;
  o.beta = 0.0f;
  o.temperature = static_cast<float>(kTemperature);
  o.hard_weight = static_cast<float>(kHard);
  o.ignore_index = kIgnore;
  o.reduction = fusedce::Reduction::kNone;
  return o;
}

/// The device copies of the inputs and the views of what every call shares.
struct DeviceInputs {
  DeviceBuffer hs, ws, ht, wt, labels, grad_loss;
  DeviceInputs(Backend& b, const Inputs& in)
      : hs(DeviceBuffer::from_vector(b, in.hs)),
        ws(DeviceBuffer::from_vector(b, in.ws)),
        ht(DeviceBuffer::from_vector(b, in.ht)),
        wt(DeviceBuffer::from_vector(b, in.wt)),
        labels(DeviceBuffer::from_vector(b, in.labels)),
        grad_loss(DeviceBuffer::from_vector(b, in.grad_loss)) {}
  fusedce::MatrixView hidden() const { return fusedce::matrix(hs.data(), DType::kFloat32, kRows, kHs); }
  /// Vocabulary rows [v0, v1) of the student's head, and the teacher with its head's same rows.
  fusedce::MatrixView weight(int64_t v0, int64_t v1) const {
    return fusedce::matrix(ws.at(v0 * kHs * 4), DType::kFloat32, v1 - v0, kHs);
  }
  fusedce::DistillTeacher teacher(int64_t v0, int64_t v1) const {
    fusedce::DistillTeacher t;
    t.hidden = fusedce::matrix(ht.data(), DType::kFloat32, kRows, kHt);
    t.weight = fusedce::matrix(wt.at(v0 * kHt * 4), DType::kFloat32, v1 - v0, kHt);
    return t;
  }
  fusedce::VectorView label_view() const { return fusedce::vector(labels.data(), DType::kInt64, kRows); }
  fusedce::VectorView grad_loss_view() const { return fusedce::vector(grad_loss.data(), DType::kFloat32, kRows); }
};

/// out: four (N,) float32 outputs back to back; stats (N, kDistillStatsWidth).
fusedce::DistillOutputs outputs_of(const DeviceBuffer& out, const DeviceBuffer& stats) {
  fusedce::DistillOutputs o;
  o.loss = fusedce::vector(out.at(0), DType::kFloat32, kRows);
  o.divergence = fusedce::vector(out.at(kRows * 4), DType::kFloat32, kRows);
  o.hard = fusedce::vector(out.at(2 * kRows * 4), DType::kFloat32, kRows);
  o.entropy = fusedce::vector(out.at(3 * kRows * 4), DType::kFloat32, kRows);
  o.stats = fusedce::matrix(stats.data(), DType::kFloat32, kRows, fusedce::kDistillStatsWidth);
  return o;
}

Results run_single(Backend& b, const DeviceInputs& d) {
  const fusedce::Device dev = b.device();
  const fusedce::DistillOptions o = options();
  DeviceBuffer out(b, 4 * kRows * 4), stats(b, kRows * fusedce::kDistillStatsWidth * 4);
  const fusedce::DistillOutputs outs = outputs_of(out, stats);
  fusedce::Status s = fusedce::linear_distill_forward(dev, d.hidden(), d.weight(0, kVocab), {}, d.teacher(0, kVocab),
                                                      d.label_view(), o, 0, outs);
  EXPECT_TRUE(s.ok()) << s.message();
  DeviceBuffer gw(b, kVocab * kHs * 4), gh(b, kRows * kHs * 4);
  fusedce::LinearGrads g;
  g.grad_weight = fusedce::matrix(gw.data(), DType::kFloat32, kVocab, kHs);
  g.grad_hidden = fusedce::matrix(gh.data(), DType::kFloat32, kRows, kHs);
  s = fusedce::linear_distill_backward(dev, d.hidden(), d.weight(0, kVocab), {}, d.teacher(0, kVocab),
                                       d.label_view(), o, 0, outs.stats, d.grad_loss_view(), g);
  EXPECT_TRUE(s.ok()) << s.message();
  b.synchronize();
  return Results{out.to_host_as<float>(), gw.to_host_as<float>(), gh.to_host_as<float>()};
}

/// Steps 1-5 with ranks 0 and 1 holding vocabulary rows [0, kSplit) and [kSplit, V); the gathers
/// are the ranks' blocks written back to back into one buffer, step 2 and 4 run once.
Results run_sharded(Backend& b, const DeviceInputs& d) {
  const fusedce::Device dev = b.device();
  const fusedce::DistillOptions o = options();
  const int64_t bounds[3] = {0, kSplit, kVocab};
  constexpr int kSW = fusedce::kDistillShardStatsWidth, kPW = fusedce::kDistillPartsWidth;
  constexpr int kRW = fusedce::kDistillStatsWidth;
  auto shard = [&](int r) { return fusedce::ShardSpec{bounds[r], kVocab}; };

  DeviceBuffer gathered(b, 2 * (kRows + 1) * kSW * 4);
  for (int r = 0; r < 2; ++r) {
    const auto block = fusedce::matrix(gathered.at(r * (kRows + 1) * kSW * 4), DType::kFloat32, kRows + 1, kSW);
    const fusedce::Status s =
        fusedce::linear_distill_shard_stats(dev, d.hidden(), d.weight(bounds[r], bounds[r + 1]), {},
                                            d.teacher(bounds[r], bounds[r + 1]), d.label_view(), shard(r), o, 0, block);
    EXPECT_TRUE(s.ok()) << "step 1, rank " << r << ": " << s.message();
  }
  DeviceBuffer row_stats(b, kRows * kRW * 4), hard(b, kRows * 4);
  const auto rs = fusedce::matrix(row_stats.data(), DType::kFloat32, kRows, kRW);
  const auto hv = fusedce::vector(hard.data(), DType::kFloat32, kRows);
  fusedce::Status s = fusedce::linear_distill_shard_merge(
      dev, fusedce::matrix(gathered.data(), DType::kFloat32, 2 * (kRows + 1), kSW), 2, d.label_view(), o, rs, hv);
  EXPECT_TRUE(s.ok()) << "step 2: " << s.message();

  DeviceBuffer parts(b, 2 * kRows * kPW * 4);
  for (int r = 0; r < 2; ++r) {
    const auto block = fusedce::matrix(parts.at(r * kRows * kPW * 4), DType::kFloat32, kRows, kPW);
    s = fusedce::linear_distill_shard_parts(dev, d.hidden(), d.weight(bounds[r], bounds[r + 1]), {},
                                            d.teacher(bounds[r], bounds[r + 1]), d.label_view(), shard(r), o, 0, rs,
                                            block);
    EXPECT_TRUE(s.ok()) << "step 3, rank " << r << ": " << s.message();
  }
  DeviceBuffer out(b, 4 * kRows * 4), stats(b, kRows * kRW * 4);
  const fusedce::DistillOutputs outs = outputs_of(out, stats);
  s = fusedce::linear_distill_shard_reduce(dev, fusedce::matrix(parts.data(), DType::kFloat32, 2 * kRows, kPW), 2,
                                           d.label_view(), o, rs, hv, outs);
  EXPECT_TRUE(s.ok()) << "step 4: " << s.message();

  DeviceBuffer gw(b, kVocab * kHs * 4), gh(b, 2 * kRows * kHs * 4);
  for (int r = 0; r < 2; ++r) {
    fusedce::LinearGrads g;
    g.grad_weight = fusedce::matrix(gw.at(bounds[r] * kHs * 4), DType::kFloat32, bounds[r + 1] - bounds[r], kHs);
    g.grad_hidden = fusedce::matrix(gh.at(r * kRows * kHs * 4), DType::kFloat32, kRows, kHs);
    s = fusedce::linear_distill_shard_backward(dev, d.hidden(), d.weight(bounds[r], bounds[r + 1]), {},
                                               d.teacher(bounds[r], bounds[r + 1]), d.label_view(), shard(r), o, 0,
                                               outs.stats, d.grad_loss_view(), g);
    EXPECT_TRUE(s.ok()) << "step 5, rank " << r << ": " << s.message();
  }
  b.synchronize();
  Results res{out.to_host_as<float>(), gw.to_host_as<float>(), {}};
  const std::vector<float> parts_h = gh.to_host_as<float>();
  res.grad_hidden.resize(kRows * kHs);
  for (int64_t e = 0; e < kRows * kHs; ++e) res.grad_hidden[e] = parts_h[e] + parts_h[kRows * kHs + e];
  return res;
}

const std::vector<int64_t> kChecked{0, 1, 4095, 8191, 8192, 1234, 5678, 7777};
const std::vector<int64_t> kWeighted{0, 5678, 8191, 8192};  // rows with a non-zero upstream gradient

Inputs make_inputs() {
  std::mt19937_64 rng(20261204);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Inputs in;
  in.hs.resize(kRows * kHs);
  in.ht.resize(kRows * kHt);
  in.ws.resize(kVocab * kHs);
  in.wt.resize(kVocab * kHt);
  for (float& x : in.hs) x = nd(rng);
  for (float& x : in.ht) x = nd(rng);
  for (float& x : in.ws) x = 0.5f * nd(rng);  // logits of standard deviation about 2 / T
  for (float& x : in.wt) x = 0.6f * nd(rng);
  in.labels.resize(kRows);
  for (int64_t i = 0; i < kRows; ++i) {
    const uint64_t r = rng();
    const bool keep = std::find(kChecked.begin(), kChecked.end(), i) != kChecked.end();
    in.labels[i] = (!keep && r % 10 < 3) ? kIgnore : static_cast<int64_t>((r >> 8) % kVocab);
  }
  in.grad_loss.assign(kRows, 0.0f);
  for (int64_t i : kWeighted) in.grad_loss[i] = nd(rng);
  return in;
}

void check(const Results& got, const Inputs& in, const std::vector<RowRef>& refs, const std::string& form) {
  const float* loss = got.values.data();
  const float* div = loss + kRows;
  const float* hard = div + kRows;
  const float* ent = hard + kRows;
  int64_t bad = 0;
  for (int64_t i = 0; i < kRows; ++i) {
    const bool ok = in.labels[i] == kIgnore
                        ? loss[i] == 0.0f && div[i] == 0.0f && hard[i] == 0.0f && ent[i] == 0.0f
                        : std::isfinite(loss[i]) && div[i] >= -1e-4f && hard[i] > 0.0f && ent[i] > 0.0f;
    if (!ok && bad++ < 5) {
      ADD_FAILURE() << form << " row " << i << " (label " << in.labels[i] << "): loss " << loss[i] << ", D " << div[i]
                    << ", hard " << hard[i] << ", entropy " << ent[i];
    }
  }
  EXPECT_EQ(bad, 0) << form;

  for (size_t c = 0; c < kChecked.size(); ++c) {
    const int64_t i = kChecked[c];
    const RowRef& r = refs[c];
    const std::string tag = form + " row " + std::to_string(i);
    expect_close(loss[i], r.loss, 5e-6 * (1.0 + std::abs(r.loss)), tag + " loss");
    expect_close(div[i], r.divergence, 5e-6 * (1.0 + std::abs(r.divergence)), tag + " divergence");
    expect_close(hard[i], r.hard, 5e-6 * (1.0 + std::abs(r.hard)), tag + " hard");
    expect_close(ent[i], r.entropy, 1e-4 * std::abs(r.entropy) + 2e-5, tag + " entropy");
  }
  auto ref_of = [&](int64_t i) -> const RowRef& {
    return refs[std::find(kChecked.begin(), kChecked.end(), i) - kChecked.begin()];
  };

  // grad_weight[j, k] = sum over the weighted rows of g_i dy[i, j] hs[i, k].
  int64_t bad_gw = 0;
  for (int64_t j = 0; j < kVocab; ++j) {
    for (int64_t k = 0; k < kHs; ++k) {
      double want = 0.0, scale = 0.0;
      for (int64_t i : kWeighted) {
        const double gh = double(in.grad_loss[i]) * in.hs[i * kHs + k];
        want += ref_of(i).dy[j] * gh;
        scale += ref_of(i).mag[j] * std::abs(gh);
      }
      const double err = std::abs(got.grad_weight[j * kHs + k] - want), tol = 1e-5 * scale + 1e-30;
      if (!(err <= tol) && bad_gw++ < 5) {
        ADD_FAILURE() << form << " grad_weight[" << j << ", " << k << "]: got " << got.grad_weight[j * kHs + k]
                      << ", want " << want;
      }
    }
  }
  EXPECT_EQ(bad_gw, 0) << form;

  // grad_hidden[i, k] = g_i sum_j dy[i, j] ws[j, k] on the weighted rows, zero elsewhere.
  int64_t bad_gh = 0;
  for (int64_t i = 0; i < kRows; ++i) {
    if (std::find(kWeighted.begin(), kWeighted.end(), i) != kWeighted.end()) continue;
    for (int64_t k = 0; k < kHs; ++k) {
      if (got.grad_hidden[i * kHs + k] != 0.0f && bad_gh++ < 5) {
        ADD_FAILURE() << form << " grad_hidden[" << i << ", " << k << "] = " << got.grad_hidden[i * kHs + k]
                      << ", want 0";
      }
    }
  }
  EXPECT_EQ(bad_gh, 0) << form;
  for (int64_t i : kWeighted) {
    const RowRef& r = ref_of(i);
    for (int64_t k = 0; k < kHs; ++k) {
      double want = 0.0, scale = 0.0;
      for (int64_t j = 0; j < kVocab; ++j) {
        const double wk = double(in.grad_loss[i]) * in.ws[j * kHs + k];
        want += r.dy[j] * wk;
        scale += r.mag[j] * std::abs(wk);
      }
      expect_close(got.grad_hidden[i * kHs + k], want, 1e-5 * scale + 1e-30,
                   form + " grad_hidden[" + std::to_string(i) + ", " + std::to_string(k) + "]");
    }
  }
}

class LargeLinearDistill : public ::testing::TestWithParam<BackendKind> {};

TEST_P(LargeLinearDistill, MoreThan2To31LogitsPerHead) {
  std::string why;
  Backend* backend = find_backend(GetParam(), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  ASSERT_EQ((kRows - 1) * kVocab, int64_t(1) << 31) << "the last row starts at element 2^31";

  const Inputs in = make_inputs();
  std::vector<RowRef> refs;
  for (int64_t i : kChecked) refs.push_back(reference_row(in, i));
  const DeviceInputs d(*backend, in);
  check(run_single(*backend, d), in, refs, "one device");
  check(run_sharded(*backend, d), in, refs, "two shards");
}

INSTANTIATE_TEST_SUITE_P(Long, LargeLinearDistill, ::testing::ValuesIn(all_backends()),
                         [](const ::testing::TestParamInfo<BackendKind>& info) {
                           return std::string(backend_name(info.param));
                         });

}  // namespace
}  // namespace fusedce_test
