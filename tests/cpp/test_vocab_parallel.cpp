// The vocabulary-parallel steps on each backend: a problem split into shards (even and uneven),
// the shard statistics gathered in rank order and merged, each shard's gradient from the merged
// lse, against the same problem unsplit on the CPU (cross_entropy_forward_backward), for every
// option.
#include <algorithm>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "fusedce/fusedce.h"
#include "backend.h"
#include "harness.h"
#include "problem.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

struct VpCase {
  std::string name;
  std::vector<int64_t> shards;  // columns per rank
  fusedce::Options o;
  bool weighted = false;
};

std::vector<VpCase> vp_cases() {
  std::vector<VpCase> v;
  const std::vector<std::vector<int64_t>> splits = {{500, 500}, {334, 333, 333}, {700, 250, 50}, {1000}};
  for (const auto& sp : splits) {
    std::string tag = "w" + std::to_string(sp.size()) + "_" + std::to_string(sp.back());
    auto add = [&](std::string name, auto tweak) {
      VpCase c;
      c.name = name + "_" + tag;
      c.shards = sp;
      tweak(c);
      v.push_back(c);
    };
    add("plain", [](VpCase&) {});
    add("label_smoothing", [](VpCase& c) { c.o.label_smoothing = 0.1f; });
    add("softcap_scale", [](VpCase& c) { c.o.softcap = 4.0f; c.o.logit_scale = 1.3f; });
    add("z_loss", [](VpCase& c) { c.o.z_loss = 1e-2f; });
    add("class_weight", [](VpCase& c) { c.weighted = true; c.o.label_smoothing = 0.05f; });
    add("sum", [](VpCase& c) { c.o.reduction = Reduction::kSum; });
    add("none", [](VpCase& c) { c.o.reduction = Reduction::kNone; });
    add("all", [](VpCase& c) {
      c.weighted = true;
      c.o.label_smoothing = 0.1f;
      c.o.softcap = 6.0f;
      c.o.z_loss = 1e-3f;
    });
  }
  return v;
}

class VocabParallel : public ::testing::TestWithParam<std::tuple<VpCase, BackendKind>> {};

TEST_P(VocabParallel, ShardedEqualsUnsharded) {
  const VpCase& vc = std::get<0>(GetParam());
  std::string why;
  Backend* backend = find_backend(std::get<1>(GetParam()), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const fusedce::Device dev = backend->device();
  std::mt19937_64 rng = test_rng();
  std::normal_distribution<float> normal(0.0f, 2.0f);
  int64_t V = 0;
  for (int64_t n : vc.shards) V += n;
  const int64_t N = 67, R = static_cast<int64_t>(vc.shards.size());
  std::vector<float> x(N * V), w;
  for (auto& e : x) e = normal(rng) + (rng() % 200 == 0 ? 9.0f : 0.0f);
  std::vector<int64_t> t(N);
  for (auto& e : t) e = rng() % 10 < 3 ? -100 : static_cast<int64_t>(rng() % V);
  t[0] = static_cast<int64_t>(rng() % V);
  // About half the counted rows aim at their argmax (a confident right answer), so that the
  // merged num_correct is tested: random targets over V classes almost never hit it.
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == -100 || rng() % 2 != 0) continue;
    const auto row = x.begin() + i * V;
    t[i] = std::max_element(row, row + V) - row;
  }
  if (vc.weighted) {
    w.resize(V);
    for (auto& e : w) e = 0.25f + static_cast<float>(rng() % 100) / 40.0f;
  }
  fusedce::Options o = vc.o;
  o.return_metrics = true;
  const auto T = fusedce::vector(t.data(), DType::kInt64, N);
  const int64_t loss_n = o.reduction == Reduction::kNone ? N : 1;
  std::vector<float> up(loss_n);
  for (auto& u : up) u = 0.5f + static_cast<float>(rng() % 100) / 100.0f;

  // Unsharded.
  std::vector<float> ref_loss(loss_n), ref_lse(N), ref_dx(N * V);
  float ref_ent = 0;
  int64_t ref_cor = 0;
  fusedce::Options ou = o;
  if (vc.weighted) ou.class_weight = fusedce::vector(w.data(), DType::kFloat32, V);
  fusedce::ForwardOutputs ro;
  ro.loss = fusedce::vector(ref_loss.data(), DType::kFloat32, loss_n);
  ro.lse = fusedce::vector(ref_lse.data(), DType::kFloat32, N);
  ro.num_correct = fusedce::vector(&ref_cor, DType::kInt64, 1);
  ro.entropy_sum = fusedce::vector(&ref_ent, DType::kFloat32, 1);
  fusedce::Status s = fusedce::cross_entropy_forward_backward(
      fusedce::Device::cpu(), fusedce::matrix(x.data(), DType::kFloat32, N, V), T, ou, ro,
      fusedce::vector(up.data(), DType::kFloat32, loss_n), fusedce::matrix(ref_dx.data(), DType::kFloat32, N, V));
  ASSERT_TRUE(s.ok()) << s.message();

  // Sharded, on the backend: step 1 on every rank, gathered in rank order, step 2 on every rank
  // (same bits), step 3.
  DeviceBuffer d_x = DeviceBuffer::from_vector(*backend, x), d_t = DeviceBuffer::from_vector(*backend, t),
               d_w = DeviceBuffer::from_vector(*backend, w), d_up = DeviceBuffer::from_vector(*backend, up);
  const auto TD = fusedce::vector(d_t.data(), DType::kInt64, N);
  float* xd = static_cast<float*>(d_x.data());
  float* wd = static_cast<float*>(d_w.data());
  DeviceBuffer d_gathered(*backend, R * (N + 1) * fusedce::kShardStatsWidth * 4);
  float* gathered = static_cast<float*>(d_gathered.data());
  std::vector<int64_t> start(R);
  for (int64_t r = 0, v0 = 0; r < R; v0 += vc.shards[r], ++r) start[r] = v0;
  auto shard_options = [&](int64_t r) {
    fusedce::Options so = o;
    if (vc.weighted) so.class_weight = fusedce::vector(wd + start[r], DType::kFloat32, vc.shards[r]);
    return so;
  };
  for (int64_t r = 0; r < R; ++r) {
    s = fusedce::cross_entropy_shard_stats(
        dev, fusedce::matrix(xd + start[r], DType::kFloat32, N, vc.shards[r], V), TD,
        fusedce::ShardSpec{start[r], V}, shard_options(r),
        fusedce::matrix(gathered + r * (N + 1) * fusedce::kShardStatsWidth, DType::kFloat32, N + 1,
                        fusedce::kShardStatsWidth));
    ASSERT_TRUE(s.ok()) << s.message();
  }
  std::vector<std::vector<float>> loss(R, std::vector<float>(loss_n)), lse(R, std::vector<float>(N)),
      rw(R, std::vector<float>(N)), batch(R, std::vector<float>(2));
  std::vector<float> ent(R);
  std::vector<int64_t> cor(R);
  // Per rank: loss, lse, row_weight, batch, entropy, correct on the backend.
  std::vector<DeviceBuffer> d_loss, d_lse, d_rw, d_batch, d_ent, d_cor;
  for (int64_t r = 0; r < R; ++r) {
    d_loss.emplace_back(*backend, loss_n * 4);
    d_lse.emplace_back(*backend, N * 4);
    d_rw.emplace_back(*backend, N * 4);
    d_batch.emplace_back(*backend, 8);
    d_ent.emplace_back(*backend, 4);
    d_cor.emplace_back(*backend, 8);
    fusedce::ForwardOutputs so;
    so.loss = fusedce::vector(d_loss[r].data(), DType::kFloat32, loss_n);
    so.lse = fusedce::vector(d_lse[r].data(), DType::kFloat32, N);
    so.num_correct = fusedce::vector(d_cor[r].data(), DType::kInt64, 1);
    so.entropy_sum = fusedce::vector(d_ent[r].data(), DType::kFloat32, 1);
    s = fusedce::cross_entropy_shard_merge(
        dev, fusedce::matrix(gathered, DType::kFloat32, R * (N + 1), fusedce::kShardStatsWidth), R, TD,
        fusedce::ShardSpec{start[r], V}, shard_options(r), so, fusedce::vector(d_rw[r].data(), DType::kFloat32, N),
        fusedce::vector(d_batch[r].data(), DType::kFloat32, 2));
    ASSERT_TRUE(s.ok()) << s.message();
    backend->synchronize();
    d_loss[r].download(loss[r].data(), loss_n * 4);
    d_lse[r].download(lse[r].data(), N * 4);
    d_rw[r].download(rw[r].data(), N * 4);
    d_batch[r].download(batch[r].data(), 8);
    d_ent[r].download(&ent[r], 4);
    d_cor[r].download(&cor[r], 8);
    EXPECT_EQ(loss[r], loss[0]) << "every rank merges to the same bits";
    EXPECT_EQ(cor[r], cor[0]);
  }
  const Tolerance lt = tolerance(DType::kFloat32, Quantity::kLoss), gt = tolerance(DType::kFloat32, Quantity::kGradient);
  Mismatches ml("loss"), mlse("lse"), mg("dlogits");
  for (int64_t i = 0; i < loss_n; ++i) ml.check(loss[0][i], ref_loss[i], std::fabs(ref_loss[i]) + 10.0, lt, i);
  for (int64_t i = 0; i < N; ++i) mlse.check(lse[0][i], ref_lse[i], std::fabs(ref_lse[i]) + 1.0, lt, i);
  EXPECT_EQ(cor[0], ref_cor);
  EXPECT_NEAR(ent[0], ref_ent, 1e-5 * (std::fabs(ref_ent) + N * 10.0));
  DeviceBuffer d_dx(*backend, N * V * 4);
  d_dx.fill(0xCD);
  for (int64_t r = 0; r < R; ++r) {
    s = fusedce::cross_entropy_shard_backward(
        dev, fusedce::matrix(xd + start[r], DType::kFloat32, N, vc.shards[r], V), TD,
        fusedce::ShardSpec{start[r], V}, shard_options(r), fusedce::vector(d_lse[r].data(), DType::kFloat32, N),
        fusedce::vector(d_rw[r].data(), DType::kFloat32, N), fusedce::vector(d_batch[r].data(), DType::kFloat32, 2),
        fusedce::vector(d_up.data(), DType::kFloat32, loss_n),
        fusedce::matrix(static_cast<float*>(d_dx.data()) + start[r], DType::kFloat32, N, vc.shards[r], V));
    ASSERT_TRUE(s.ok()) << s.message();
  }
  backend->synchronize();
  std::vector<float> dx = d_dx.to_host_as<float>();
  // Row i's gradient is g_i (p - onehot) and more, g_i its upstream gradient times its target's
  // weight (over the weight sum, for the mean). Its float32 error scales with g_i, not with its
  // largest entry: a confident row's entries are all small, and the target's p_t - 1 carries the
  // rounding of p_t near 1.
  auto target_weight = [&](int64_t i) { return vc.weighted ? static_cast<double>(w[t[i]]) : 1.0; };
  double weight_sum = 0.0;
  for (int64_t i = 0; i < N; ++i) weight_sum += t[i] == -100 ? 0.0 : target_weight(i);
  for (int64_t i = 0; i < N; ++i) {
    double scale = 0.0;
    for (int64_t j = 0; j < V; ++j) scale = std::max(scale, std::fabs(static_cast<double>(ref_dx[i * V + j])));
    if (t[i] != -100) {
      const double g = up[loss_n == N ? i : 0] * target_weight(i);
      scale = std::max(scale, o.reduction == Reduction::kMean ? g / weight_sum : g);
    }
    scale = std::max(scale, 1e-3);
    for (int64_t j = 0; j < V; ++j) mg.check(dx[i * V + j], ref_dx[i * V + j], scale, gt, i, j);
  }
  ml.report();
  mlse.report();
  mg.report();
}

INSTANTIATE_TEST_SUITE_P(Shards, VocabParallel,
                         ::testing::Combine(::testing::ValuesIn(vp_cases()), ::testing::ValuesIn(all_backends())),
                         [](const auto& info) {
                           return std::string(backend_name(std::get<1>(info.param))) + "_" + std::get<0>(info.param).name;
                         });

TEST(VocabParallelBadInput, ShardOutsideTheVocabularyIsNamed) {
  std::vector<float> x(4 * 10), stats(5 * fusedce::kShardStatsWidth);
  std::vector<int64_t> t(4, 3);
  const fusedce::Status s = fusedce::cross_entropy_shard_stats(
      fusedce::Device::cpu(), fusedce::matrix(x.data(), DType::kFloat32, 4, 10),
      fusedce::vector(t.data(), DType::kInt64, 4), fusedce::ShardSpec{15, 20}, {},
      fusedce::matrix(stats.data(), DType::kFloat32, 5, fusedce::kShardStatsWidth));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("vocab_start"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace fusedce_test
