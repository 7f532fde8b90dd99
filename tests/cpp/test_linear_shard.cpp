// The vocabulary-parallel steps of the linear form on each backend, with the options that change
// which rows enter the products (the causal shift, skip_ignored, chunks and low_memory's
// slices): the head split into shards, step 1 on every rank, the statistics gathered in rank
// order and merged by linear_cross_entropy_shard_merge, step 3 on every rank, the parts of
// grad_hidden summed; against the whole-vocabulary linear call on the CPU with the same options
// (float32; that call is checked against float64 in test_linear.cpp), and, for bfloat16, against
// the same backend's shard steps over pre-shifted targets without skip_ignored (every row
// through the products).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backend.h"
#include "fusedce/fusedce.h"
#include "harness.h"
#include "problem.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

constexpr int64_t kHidden = 40;

struct LsCase {
  std::string name;
  std::vector<int64_t> shards;  // rows of the head per rank
  int64_t sequences = 3, seq_len = 41;
  fusedce::Options o;
  fusedce::LinearOptions lo;
  bool bias = false, weighted = false;
  bool all_ignored = false;
  int64_t chunk_rows = 0;  // > 0: a chunk budget of about this many rows of the largest shard's logits
};

void PrintTo(const LsCase& c, std::ostream* os) { *os << c.name; }

std::vector<LsCase> ls_cases() {
  std::vector<LsCase> v;
  auto add = [&](std::string name, std::vector<int64_t> shards, auto tweak) {
    LsCase c;
    c.name = std::move(name);
    c.shards = std::move(shards);
    tweak(c);
    v.push_back(c);
  };
  add("plain", {170, 131}, [](LsCase&) {});
  add("shift", {170, 131}, [](LsCase& c) { c.lo.shift_seq_len = 41; });
  add("skip", {100, 101, 100}, [](LsCase& c) { c.lo.skip_ignored = true; });
  add("shift_skip", {170, 131}, [](LsCase& c) {
    c.lo.shift_seq_len = 41;
    c.lo.skip_ignored = true;
  });
  add("shift_skip_bias_weights_sum", {100, 101, 100}, [](LsCase& c) {
    c.lo.shift_seq_len = 41;
    c.lo.skip_ignored = true;
    c.bias = c.weighted = true;
    c.o.label_smoothing = 0.1f;
    c.o.reduction = Reduction::kSum;
  });
  add("skip_chunks_none", {170, 131}, [](LsCase& c) {
    c.lo.skip_ignored = true;
    c.o.reduction = Reduction::kNone;
    c.o.z_loss = 1e-3f;
    c.chunk_rows = 17;  // several chunks of positions
  });
  add("shift_skip_low_memory_chunks", {170, 131}, [](LsCase& c) {
    c.lo.shift_seq_len = 41;
    c.lo.skip_ignored = true;
    c.lo.low_memory = true;
    c.bias = true;
    c.chunk_rows = 29;
  });
  add("skip_all_ignored", {170, 131}, [](LsCase& c) {
    c.lo.skip_ignored = true;
    c.bias = true;
    c.all_ignored = true;
    c.o.reduction = Reduction::kSum;
  });
  add("shift_skip_no_rows", {170, 131}, [](LsCase& c) {
    c.sequences = 0;
    c.lo.shift_seq_len = 41;
    c.lo.skip_ignored = true;
  });
  return v;
}

struct LsProblem {
  int64_t N, V;
  std::vector<float> hidden, weight, bias, class_weight, up;  // values representable in the dtype
  std::vector<int64_t> target;
};

LsProblem make_ls_problem(const LsCase& c, DType dtype) {
  std::mt19937_64 rng = test_rng();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  LsProblem p;
  p.N = c.sequences * c.seq_len;
  p.V = 0;
  for (int64_t n : c.shards) p.V += n;
  p.hidden.resize(p.N * kHidden);
  p.weight.resize(p.V * kHidden);
  for (auto& e : p.hidden) e = round_to(dtype, normal(rng));
  // A few loud rows of the head: peaked, trained-looking rows of logits.
  for (int64_t j = 0; j < p.V; ++j) {
    const float gain = rng() % 25 == 0 ? 1.2f : 0.3f;
    for (int64_t h = 0; h < kHidden; ++h) p.weight[j * kHidden + h] = round_to(dtype, gain * normal(rng));
  }
  if (c.bias) {
    p.bias.resize(p.V);
    for (auto& e : p.bias) e = round_to(dtype, normal(rng));
  }
  if (c.weighted) {
    p.class_weight.resize(p.V);
    for (auto& e : p.class_weight) e = 0.25f + static_cast<float>(rng() % 100) / 40.0f;
  }
  p.target.resize(p.N);
  for (auto& t : p.target) t = static_cast<int64_t>(rng() % p.V);
  for (int64_t s = 0; s < c.sequences; ++s) {
    // A prompt-masked head of each sequence, and scattered ignored entries.
    const int64_t prompt = s * 7 % c.seq_len;
    for (int64_t i = 0; i < prompt; ++i) p.target[s * c.seq_len + i] = -100;
  }
  for (int64_t i = 0; i < p.N; ++i) {
    if (rng() % 9 == 0 || c.all_ignored) p.target[i] = -100;
  }
  const int64_t loss_n = c.o.reduction == Reduction::kNone ? p.N : 1;
  p.up.resize(loss_n);
  for (auto& u : p.up) u = 0.5f + static_cast<float>(rng() % 100) / 100.0f;
  return p;
}

/// The causal shift of the flat target, as the core applies it.
std::vector<int64_t> shifted(const std::vector<int64_t>& t, int64_t L) {
  std::vector<int64_t> s(t.size());
  for (size_t i = 0; i < t.size(); ++i) s[i] = (int64_t(i) % L == L - 1) ? -100 : t[i + 1];
  return s;
}

struct LsResult {
  std::vector<float> loss, lse, grad_hidden, grad_weight, grad_bias;  // gradients as float
  float entropy = 0;
  int64_t correct = 0;
};

std::vector<uint8_t> packed(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> out(std::max<size_t>(v.size(), 1) * elem_size(dtype));
  store_values(out.data(), dtype, 0, v.data(), static_cast<int64_t>(v.size()));
  return out;
}

std::vector<float> unpacked(const std::vector<uint8_t>& bytes, DType dtype, int64_t n) {
  std::vector<double> d(n);
  load_values(bytes.data(), dtype, 0, d.data(), n);
  return std::vector<float>(d.begin(), d.end());
}

DeviceBuffer buffer(Backend& b, size_t bytes) { return DeviceBuffer(b, std::max<size_t>(bytes, 16)); }

/// The three linear shard steps on `backend` for every rank; `target` as the steps take it.
LsResult run_sharded(Backend& backend, const LsCase& c, const LsProblem& p, DType dtype,
                     const std::vector<int64_t>& target, const fusedce::LinearOptions& lo, fusedce::Status* status) {
  const fusedce::Device dev = backend.device();
  const int64_t N = p.N, V = p.V, H = kHidden, R = static_cast<int64_t>(c.shards.size());
  const size_t el = elem_size(dtype);
  fusedce::Options o = c.o;
  o.return_metrics = true;
  const int64_t loss_n = o.reduction == Reduction::kNone ? N : 1;
  DeviceBuffer d_h = DeviceBuffer::from_vector(backend, packed(p.hidden, dtype));
  DeviceBuffer d_w = DeviceBuffer::from_vector(backend, packed(p.weight, dtype));
  DeviceBuffer d_b = DeviceBuffer::from_vector(backend, packed(p.bias, dtype));
  DeviceBuffer d_cw = buffer(backend, p.class_weight.size() * 4);
  if (!p.class_weight.empty()) d_cw.upload(p.class_weight.data(), p.class_weight.size() * 4);
  DeviceBuffer d_t = buffer(backend, N * 8);
  if (N > 0) d_t.upload(target.data(), N * 8);
  DeviceBuffer d_up = DeviceBuffer::from_vector(backend, p.up);
  const auto T = fusedce::vector(d_t.data(), DType::kInt64, N);
  const fusedce::MatrixView hid = fusedce::matrix(d_h.data(), dtype, N, H);
  std::vector<int64_t> start(R);
  for (int64_t r = 0, v0 = 0; r < R; v0 += c.shards[r], ++r) start[r] = v0;
  auto weight_of = [&](int64_t r) {
    return fusedce::matrix(static_cast<char*>(d_w.data()) + start[r] * H * el, dtype, c.shards[r], H);
  };
  auto bias_of = [&](int64_t r) {
    return p.bias.empty() ? fusedce::VectorView{}
                          : fusedce::vector(static_cast<char*>(d_b.data()) + start[r] * el, dtype, c.shards[r]);
  };
  auto options_of = [&](int64_t r) {
    fusedce::Options so = o;
    if (!p.class_weight.empty()) {
      so.class_weight = fusedce::vector(static_cast<float*>(d_cw.data()) + start[r], DType::kFloat32, c.shards[r]);
    }
    return so;
  };
  const fusedce::ShardSpec whole{0, V};
  auto spec_of = [&](int64_t r) { return fusedce::ShardSpec{start[r], V}; };

  const int64_t W = fusedce::kShardStatsWidth;
  DeviceBuffer d_gathered = buffer(backend, R * (N + 1) * W * 4);
  for (int64_t r = 0; r < R; ++r) {
    *status = fusedce::linear_cross_entropy_shard_stats(
        dev, hid, weight_of(r), bias_of(r), T, spec_of(r), options_of(r), lo,
        fusedce::matrix(static_cast<float*>(d_gathered.data()) + r * (N + 1) * W, DType::kFloat32, N + 1, W));
    if (!status->ok()) return {};
  }
  LsResult out;
  out.loss.resize(loss_n);
  out.lse.resize(N);
  DeviceBuffer d_loss = buffer(backend, loss_n * 4), d_lse = buffer(backend, N * 4), d_rw = buffer(backend, N * 4),
               d_batch = buffer(backend, 8), d_ent = buffer(backend, 4), d_cor = buffer(backend, 8);
  fusedce::ForwardOutputs fo;
  fo.loss = fusedce::vector(d_loss.data(), DType::kFloat32, loss_n);
  fo.lse = fusedce::vector(d_lse.data(), DType::kFloat32, N);
  fo.num_correct = fusedce::vector(d_cor.data(), DType::kInt64, 1);
  fo.entropy_sum = fusedce::vector(d_ent.data(), DType::kFloat32, 1);
  const auto rw = fusedce::vector(d_rw.data(), DType::kFloat32, N);
  const auto batch = fusedce::vector(d_batch.data(), DType::kFloat32, 2);
  *status = fusedce::linear_cross_entropy_shard_merge(
      dev, fusedce::matrix(d_gathered.data(), DType::kFloat32, R * (N + 1), W), R, T, whole, options_of(0), lo, fo,
      rw, batch);
  if (!status->ok()) return {};
  DeviceBuffer d_gh = buffer(backend, N * H * 4), d_gw = buffer(backend, V * H * el), d_gb = buffer(backend, V * el);
  std::vector<float> grad_hidden(N * H, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    d_gh.fill(0xCD);  // every entry must be written, the rows of ignored targets included
    fusedce::LinearGrads g;
    g.grad_hidden = fusedce::matrix(d_gh.data(), DType::kFloat32, N, H);
    g.grad_weight = fusedce::matrix(static_cast<char*>(d_gw.data()) + start[r] * H * el, dtype, c.shards[r], H);
    if (!p.bias.empty()) g.grad_bias = fusedce::vector(static_cast<char*>(d_gb.data()) + start[r] * el, dtype, c.shards[r]);
    *status = fusedce::linear_cross_entropy_shard_backward(dev, hid, weight_of(r), bias_of(r), T, spec_of(r),
                                                           options_of(r), lo, fo.lse, rw, batch,
                                                           fusedce::vector(d_up.data(), DType::kFloat32, loss_n), g);
    if (!status->ok()) return {};
    backend.synchronize();
    std::vector<float> part(N * H);
    if (N > 0) d_gh.download(part.data(), N * H * 4);
    for (int64_t k = 0; k < N * H; ++k) grad_hidden[k] += part[k];  // the all-reduce, in rank order
  }
  backend.synchronize();
  if (loss_n > 0) d_loss.download(out.loss.data(), loss_n * 4);
  if (N > 0) d_lse.download(out.lse.data(), N * 4);
  d_ent.download(&out.entropy, 4);
  d_cor.download(&out.correct, 8);
  out.grad_hidden = grad_hidden;
  std::vector<uint8_t> gw(V * H * el), gb(V * el);
  d_gw.download(gw.data(), gw.size());
  out.grad_weight = unpacked(gw, dtype, V * H);
  if (!p.bias.empty()) {
    d_gb.download(gb.data(), gb.size());
    out.grad_bias = unpacked(gb, dtype, V);
  }
  return out;
}

/// The whole-vocabulary linear call on the CPU, in float32, with the case's options.
LsResult run_whole_cpu(const LsCase& c, const LsProblem& p) {
  const int64_t N = p.N, V = p.V, H = kHidden;
  fusedce::Options o = c.o;
  o.return_metrics = true;
  std::vector<float> hidden = p.hidden, weight = p.weight, bias = p.bias, cw = p.class_weight, up = p.up;
  if (!cw.empty()) o.class_weight = fusedce::vector(cw.data(), DType::kFloat32, V);
  const int64_t loss_n = o.reduction == Reduction::kNone ? N : 1;
  LsResult out;
  out.loss.resize(loss_n);
  out.lse.resize(N);
  out.grad_hidden.resize(N * H);
  out.grad_weight.resize(V * H);
  fusedce::ForwardOutputs fo;
  fo.loss = fusedce::vector(out.loss.data(), DType::kFloat32, loss_n);
  fo.lse = fusedce::vector(out.lse.data(), DType::kFloat32, N);
  fo.num_correct = fusedce::vector(&out.correct, DType::kInt64, 1);
  fo.entropy_sum = fusedce::vector(&out.entropy, DType::kFloat32, 1);
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(out.grad_hidden.data(), DType::kFloat32, N, H);
  g.grad_weight = fusedce::matrix(out.grad_weight.data(), DType::kFloat32, V, H);
  if (!bias.empty()) {
    out.grad_bias.resize(V);
    g.grad_bias = fusedce::vector(out.grad_bias.data(), DType::kFloat32, V);
  }
  fusedce::LinearOptions lo = c.lo;
  lo.chunk_budget_bytes = 0;
  std::vector<int64_t> target = p.target;
  const fusedce::Status s = fusedce::linear_cross_entropy_forward_backward(
      fusedce::Device::cpu(), fusedce::matrix(hidden.data(), DType::kFloat32, N, H),
      fusedce::matrix(weight.data(), DType::kFloat32, V, H),
      bias.empty() ? fusedce::VectorView{} : fusedce::vector(bias.data(), DType::kFloat32, V),
      fusedce::vector(target.data(), DType::kInt64, N), o, lo, fo, fusedce::vector(up.data(), DType::kFloat32, loss_n),
      g);
  EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

/// got against ref: losses and lse within `lt`, gradients within `gt`, each gradient entry's
/// scale the largest entry of that gradient (a sum over rows or columns of terms no larger
/// than it).
void expect_close(const LsResult& got, const LsResult& ref, const Tolerance& lt, const Tolerance& gt,
                  const std::string& what) {
  Mismatches ml(what + ": loss"), mlse(what + ": lse");
  for (size_t i = 0; i < ref.loss.size(); ++i) ml.check(got.loss[i], ref.loss[i], std::fabs(ref.loss[i]) + 10.0, lt, i);
  for (size_t i = 0; i < ref.lse.size(); ++i) mlse.check(got.lse[i], ref.lse[i], std::fabs(ref.lse[i]) + 1.0, lt, i);
  EXPECT_EQ(got.correct, ref.correct) << what;
  EXPECT_NEAR(got.entropy, ref.entropy, 1e-5 * (std::fabs(ref.entropy) + 10.0 * ref.lse.size())) << what;
  auto grads = [&](const std::vector<float>& a, const std::vector<float>& b, int64_t cols, const char* name) {
    ASSERT_EQ(a.size(), b.size()) << what << ": " << name;
    double scale = 1e-6;
    for (float x : b) scale = std::max(scale, std::fabs(static_cast<double>(x)));
    Mismatches m(what + ": " + name);
    for (size_t k = 0; k < b.size(); ++k) m.check(a[k], b[k], scale, gt, static_cast<int64_t>(k) / cols, static_cast<int64_t>(k) % cols);
    m.report();
  };
  grads(got.grad_hidden, ref.grad_hidden, kHidden, "grad_hidden");
  grads(got.grad_weight, ref.grad_weight, kHidden, "grad_weight");
  grads(got.grad_bias, ref.grad_bias, 1, "grad_bias");
  ml.report();
  mlse.report();
}

class LinearShard : public ::testing::TestWithParam<std::tuple<LsCase, BackendKind>> {};

TEST_P(LinearShard, StepsEqualTheWholeVocabularyCall) {
  const LsCase& c = std::get<0>(GetParam());
  std::string why;
  Backend* backend = find_backend(std::get<1>(GetParam()), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const LsProblem p = make_ls_problem(c, DType::kFloat32);
  fusedce::LinearOptions lo = c.lo;
  if (c.chunk_rows > 0) lo.chunk_budget_bytes = size_t(c.chunk_rows) * size_t(c.shards[0]) * 4;
  fusedce::Status s;
  const LsResult got = run_sharded(*backend, c, p, DType::kFloat32, p.target, lo, &s);
  ASSERT_TRUE(s.ok()) << s.message();
  expect_close(got, run_whole_cpu(c, p), tolerance(DType::kFloat32, Quantity::kLoss),
               tolerance(DType::kFloat32, Quantity::kGradient), c.name);
}

TEST_P(LinearShard, Bf16ShiftAndSkipEqualTheirUnskippedSteps) {
  const LsCase& c = std::get<0>(GetParam());
  std::string why;
  Backend* backend = find_backend(std::get<1>(GetParam()), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  if (c.lo.shift_seq_len == 0 && !c.lo.skip_ignored) GTEST_SKIP() << "nothing shifted or skipped";
  const LsProblem p = make_ls_problem(c, DType::kBFloat16);
  fusedce::LinearOptions lo = c.lo;
  if (c.chunk_rows > 0) lo.chunk_budget_bytes = size_t(c.chunk_rows) * size_t(c.shards[0]) * 2;
  fusedce::LinearOptions plain = lo;
  plain.shift_seq_len = 0;
  plain.skip_ignored = false;
  fusedce::Status s;
  const LsResult got = run_sharded(*backend, c, p, DType::kBFloat16, p.target, lo, &s);
  ASSERT_TRUE(s.ok()) << s.message();
  const std::vector<int64_t> t = c.lo.shift_seq_len > 0 ? shifted(p.target, c.lo.shift_seq_len) : p.target;
  const LsResult ref = run_sharded(*backend, c, p, DType::kBFloat16, t, plain, &s);
  ASSERT_TRUE(s.ok()) << s.message();
  // Both sides round their logits to bfloat16 (on CUDA), from products over chunks of different
  // rows: a product of another shape may round a logit the other way, one bfloat16 step (2^-8
  // relative), which moves that row's loss and gradient entries by up to that much. The
  // tolerances allow two such steps; a row taken from the wrong position, a lost chunk or a
  // wrong shift moves them by their own size.
  const Tolerance two_steps{2.0 / 256, 2.0 / 256, 1e-6};
  expect_close(got, ref, two_steps, two_steps, c.name + " (bfloat16)");
}

INSTANTIATE_TEST_SUITE_P(Cases, LinearShard,
                         ::testing::Combine(::testing::ValuesIn(ls_cases()), ::testing::ValuesIn(all_backends())),
                         [](const auto& info) {
                           return std::string(backend_name(std::get<1>(info.param))) + "_" + std::get<0>(info.param).name;
                         });

TEST(LinearShardBadInput, MergeShiftMustDivideTheRows) {
  std::vector<float> gathered(2 * 6 * fusedce::kShardStatsWidth), loss(1), lse(5), rw(5), batch(2);
  std::vector<int64_t> t(5, 1);
  fusedce::ForwardOutputs fo;
  fo.loss = fusedce::vector(loss.data(), DType::kFloat32, 1);
  fo.lse = fusedce::vector(lse.data(), DType::kFloat32, 5);
  fusedce::LinearOptions lo;
  lo.shift_seq_len = 2;
  const fusedce::Status s = fusedce::linear_cross_entropy_shard_merge(
      fusedce::Device::cpu(), fusedce::matrix(gathered.data(), DType::kFloat32, 12, fusedce::kShardStatsWidth), 2,
      fusedce::vector(t.data(), DType::kInt64, 5), fusedce::ShardSpec{0, 10}, {}, lo, fo,
      fusedce::vector(rw.data(), DType::kFloat32, 5), fusedce::vector(batch.data(), DType::kFloat32, 2));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("shift_seq_len"), std::string::npos) << s.message();
}

TEST(LinearShardBadInput, MergeNamesTheShiftedTargetEntry) {
  const int64_t N = 6;
  std::vector<float> gathered((N + 1) * fusedce::kShardStatsWidth), loss(1), lse(N), rw(N), batch(2);
  std::vector<int64_t> t = {1, 2, 99, 3, 4, 5};  // entry 2 is row 1's target after the shift
  fusedce::ForwardOutputs fo;
  fo.loss = fusedce::vector(loss.data(), DType::kFloat32, 1);
  fo.lse = fusedce::vector(lse.data(), DType::kFloat32, N);
  fusedce::LinearOptions lo;
  lo.shift_seq_len = 3;
  const fusedce::Status s = fusedce::linear_cross_entropy_shard_merge(
      fusedce::Device::cpu(), fusedce::matrix(gathered.data(), DType::kFloat32, N + 1, fusedce::kShardStatsWidth), 1,
      fusedce::vector(t.data(), DType::kInt64, N), fusedce::ShardSpec{0, 10}, {}, lo, fo,
      fusedce::vector(rw.data(), DType::kFloat32, N), fusedce::vector(batch.data(), DType::kFloat32, 2));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("target[2] = 99"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace fusedce_test
