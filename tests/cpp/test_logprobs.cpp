// The log-probability steps of fusedce/logprobs.h on each backend, through the public API: the
// logits form and the linear form, a whole vocabulary (a world of 1) and shards gathered in rank
// order, against a float64 reference written here (log p anchored at each row's max, so that it
// does not collapse itself); collapsed rows at 20-100 nats (80 at temperature 0.8), where
// float32's z_t - lse is 0 (past ~87 nats the values are float32 subnormals: absolute 1e-41); rows
// whose max occurs more than once; the gradient of g_lp * logprob + g_H * entropy; the
// distribution statistics (log sum p^2, the mean logit, whether the target is the first argmax:
// ties before, at and after the target, in one chunk and across chunks and shards); bad input
// named.
#include <gtest/gtest.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "fusedce/fusedce.h"
#include "backend.h"

namespace fusedce_test {
namespace {

using fusedce::DType;

constexpr int64_t kIgnore = -100;
constexpr int kW = fusedce::kLogprobStatsWidth;

struct Problem {
  int64_t n, v, h;
  std::vector<float> logits;  // (n, v) = hidden @ weight.T
  std::vector<float> hidden, weight;
  std::vector<int64_t> target;
  std::vector<float> g_lp, g_h;
};

/// Peaked rows (a dominant entry in most of them, some collapsed by `collapse` nats), ignored
/// rows, and logits that are exactly hidden @ weight.T (one-hot hidden rows, so the linear form
/// sees the same numbers).
Problem make_problem(int64_t n, int64_t v, float collapse, uint32_t seed) {
  Problem p{n, v, n, {}, {}, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  p.hidden.assign(n * n, 0.0f);
  for (int64_t i = 0; i < n; ++i) p.hidden[i * n + i] = 1.0f;
  p.weight.assign(v * n, 0.0f);
  p.logits.assign(n * v, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t top = static_cast<int64_t>(rng() % v);
    for (int64_t j = 0; j < v; ++j) {
      float x = std::round(nd(rng) * 4.0f) / 4.0f;
      if (j == top) x = 10.0f;
      if (collapse > 0.0f && i % 2 == 0) x = j == top ? 0.0f : -collapse - static_cast<float>(j % 3);
      p.logits[i * v + j] = x;
      p.weight[j * n + i] = x;
    }
    p.target.push_back(i % 5 == 4 ? kIgnore : (i % 3 == 0 ? static_cast<int64_t>(rng() % v) : top));
    p.g_lp.push_back(std::normal_distribution<float>(0.0f, 1.0f)(rng));
    p.g_h.push_back(std::normal_distribution<float>(0.0f, 1.0f)(rng));
  }
  return p;
}

/// A problem of the given logits (n, v) and targets: one-hot hidden rows and weight = logits^T,
/// upstream gradients drawn from `seed`.
Problem problem_of(int64_t n, int64_t v, const std::vector<float>& logits, const std::vector<int64_t>& target,
                   uint32_t seed) {
  Problem p{n, v, n, logits, std::vector<float>(n * n, 0.0f), std::vector<float>(v * n), target, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    p.hidden[i * n + i] = 1.0f;
    for (int64_t j = 0; j < v; ++j) p.weight[j * n + i] = logits[i * v + j];
    p.g_lp.push_back(nd(rng));
    p.g_h.push_back(nd(rng));
  }
  return p;
}

/// Rows whose max occurs more than once (the statistics leave one instance out of r and count
/// the others as exp(0) = 1), over 5000 columns (three of the CPU's 2048-column chunks, and
/// uneven shards): two maxima in one chunk; in different chunks (and shards); a collapsed row
/// whose two maxima lie 40 nats above the rest (logprob -log 2, not 0); a constant row (every
/// entry a max: logprob -log V, entropy log V); an ignored row.
Problem ties_problem() {
  const int64_t n = 5, v = 5000;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n * v);
  for (float& e : x) e = std::round(nd(rng) * 8.0f) / 8.0f;
  auto row = [&](int64_t i) { return x.data() + i * v; };
  row(0)[5] = row(0)[6] = 6.0f;
  row(1)[100] = row(1)[4000] = 6.0f;
  for (int64_t j = 0; j < v; ++j) row(2)[j] = j == 7 || j == 3000 ? 0.0f : -40.0f - static_cast<float>(j % 3);
  for (int64_t j = 0; j < v; ++j) row(3)[j] = 1.5f;
  return problem_of(n, v, x, {5, 4000, 7, 17, kIgnore}, 12u);
}

struct Ref {
  std::vector<double> lp, ent, dz;  // dz (n, v): d/dz of sum g_lp lp + g_h ent
  std::vector<double> log_sum_sq, mean;  // log sum_j p_j^2, mean_j z_j
  std::vector<bool> top1;                // the target is the first argmax of z
};

Ref reference(const Problem& p, double temperature) {
  Ref r{std::vector<double>(p.n), std::vector<double>(p.n), std::vector<double>(p.n * p.v, 0.0),
        std::vector<double>(p.n), std::vector<double>(p.n), std::vector<bool>(p.n)};
  for (int64_t i = 0; i < p.n; ++i) {
    if (p.target[i] == kIgnore) continue;
    std::vector<double> z(p.v), logp(p.v);
    int64_t a = 0;
    for (int64_t j = 0; j < p.v; ++j) {
      z[j] = p.logits[i * p.v + j] / temperature;
      if (z[j] > z[a]) a = j;
    }
    double rest = 0.0;
    for (int64_t j = 0; j < p.v; ++j) rest += j == a ? 0.0 : std::exp(z[j] - z[a]);
    double h = 0.0;
    for (int64_t j = 0; j < p.v; ++j) {
      logp[j] = z[j] - z[a] - std::log1p(rest);
      h -= std::exp(logp[j]) * logp[j];
    }
    const int64_t t = p.target[i];
    r.lp[i] = logp[t];
    r.ent[i] = h;
    double sq = 0.0, zsum = 0.0;  // log sum p^2 = 2 logp_a + log sum exp(2 (logp_j - logp_a))
    for (int64_t j = 0; j < p.v; ++j) {
      sq += std::exp(2.0 * (logp[j] - logp[a]));
      zsum += z[j];
    }
    r.log_sum_sq[i] = 2.0 * logp[a] + std::log(sq);
    r.mean[i] = zsum / static_cast<double>(p.v);
    r.top1[i] = a == t;  // a: the first index of the max (the scan above keeps the first)
    double others = 0.0;  // 1 - p_t without cancellation
    for (int64_t j = 0; j < p.v; ++j) others += j == t ? 0.0 : std::exp(logp[j]);
    for (int64_t j = 0; j < p.v; ++j) {
      const double pj = std::exp(logp[j]);
      double d = (j == t ? others : -pj) * p.g_lp[i] - p.g_h[i] * pj * (logp[j] + h);
      r.dz[i * p.v + j] = d / temperature;
    }
  }
  return r;
}

void expect_close(double got, double want, double rtol, double atol, const std::string& what) {
  EXPECT_LE(std::abs(got - want), atol + rtol * std::abs(want)) << what << ": got " << got << ", want " << want;
}

/// One problem through steps 1-3 in `world` uneven shards, compared with the float64 reference;
/// `collapsed` rows are held to a relative bound only (their values reach float32 subnormals).
/// With `dist`, step 1 also gathers the distribution statistics, and step 4 forms them.
void check_steps(Backend* backend, bool linear, int world, const Problem& p, float temperature, bool collapsed,
                 const std::string& tag, bool dist = false) {
  const Ref ref = reference(p, temperature);
  const fusedce::Device dev = backend->device();
  fusedce::LogprobOptions o;
  o.temperature = temperature;
  o.distribution_stats = dist;
  DeviceBuffer target = DeviceBuffer::from_vector(*backend, p.target);
  const auto tv = fusedce::vector(target.data(), DType::kInt64, p.n);
  std::vector<int64_t> bounds{0};
  for (int r = 0; r < world; ++r) bounds.push_back(p.v * (r + 1) * (r + 2) / (world * (world + 1)));
  DeviceBuffer gathered(*backend, world * (p.n + 1) * kW * 4);
  std::vector<DeviceBuffer> shards;
  for (int r = 0; r < world; ++r) {
    const int64_t v0 = bounds[r], vl = bounds[r + 1] - v0;
    const fusedce::ShardSpec s{v0, p.v};
    const auto stats = fusedce::matrix(gathered.at(r * (p.n + 1) * kW * 4), DType::kFloat32, p.n + 1, kW);
    if (linear) {
      std::vector<float> w(p.weight.begin() + v0 * p.h, p.weight.begin() + (v0 + vl) * p.h);
      DeviceBuffer hid = DeviceBuffer::from_vector(*backend, p.hidden), wb = DeviceBuffer::from_vector(*backend, w);
      ASSERT_TRUE(fusedce::linear_logprobs_stats(dev, fusedce::matrix(hid.data(), DType::kFloat32, p.n, p.h),
                                                 fusedce::matrix(wb.data(), DType::kFloat32, vl, p.h), {}, tv, s,
                                                 o, 0, stats)
                      .ok());
    } else {
      std::vector<float> x(p.n * vl);
      for (int64_t i = 0; i < p.n; ++i) {
        for (int64_t j = 0; j < vl; ++j) x[i * vl + j] = p.logits[i * p.v + v0 + j];
      }
      DeviceBuffer xb = DeviceBuffer::from_vector(*backend, x);
      ASSERT_TRUE(fusedce::logprobs_stats(dev, fusedce::matrix(xb.data(), DType::kFloat32, p.n, vl), tv, s, o, stats).ok());
    }
  }
  DeviceBuffer out(*backend, 3 * p.n * 4);
  fusedce::LogprobOutputs lo;
  lo.logprob = fusedce::vector(out.at(0), DType::kFloat32, p.n);
  lo.entropy = fusedce::vector(out.at(p.n * 4), DType::kFloat32, p.n);
  lo.lse = fusedce::vector(out.at(2 * p.n * 4), DType::kFloat32, p.n);
  ASSERT_TRUE(fusedce::logprobs_merge(dev, fusedce::matrix(gathered.data(), DType::kFloat32, world * (p.n + 1), kW),
                                      world, tv, {0, p.v}, o, lo)
                  .ok());
  const std::vector<float> got = out.to_host_as<float>();
  for (int64_t i = 0; i < p.n; ++i) {
    expect_close(got[i], ref.lp[i], 2e-5, 2e-5 * (!collapsed) + 1e-41, tag + " logprob row " + std::to_string(i));
    expect_close(got[p.n + i], ref.ent[i], 1e-4, 2e-5 * (!collapsed) + 1e-41, tag + " entropy row " + std::to_string(i));
  }
  if (dist) {
    // log sum p^2 = log1p(q) - 2 log1p(r), with r and q summed in float per chunk or lane (folded
    // in double) and stored in float32: each log1p within a few float32 roundoffs, so 2e-6 plus
    // 1e-6 of the value (a 1e-5 relative bias on it fails: planted in lp_dist_finish); the mean
    // to a few float32 roundoffs of the largest |z|; is_top1 exactly.
    DeviceBuffer ds(*backend, 3 * p.n * 4);
    fusedce::DistributionStats d;
    d.log_sum_sq_probs = fusedce::vector(ds.at(0), DType::kFloat32, p.n);
    d.mean_logit = fusedce::vector(ds.at(p.n * 4), DType::kFloat32, p.n);
    d.is_top1 = fusedce::vector(ds.at(2 * p.n * 4), DType::kFloat32, p.n);
    ASSERT_TRUE(fusedce::logprobs_distribution_stats(
                    dev, fusedce::matrix(gathered.data(), DType::kFloat32, world * (p.n + 1), kW), world, tv,
                    {0, p.v}, o, d)
                    .ok());
    const std::vector<float> dh = ds.to_host_as<float>();
    for (int64_t i = 0; i < p.n; ++i) {
      const std::string row = " row " + std::to_string(i);
      if (p.target[i] == kIgnore) {
        EXPECT_EQ(dh[i], 0.0f) << tag << row;
        EXPECT_EQ(dh[p.n + i], 0.0f) << tag << row;
        EXPECT_EQ(dh[2 * p.n + i], 0.0f) << tag << row;
        continue;
      }
      double zmax = 0.0;
      for (int64_t j = 0; j < p.v; ++j) zmax = std::max(zmax, std::abs(double(p.logits[i * p.v + j]) / temperature));
      expect_close(dh[i], ref.log_sum_sq[i], 1e-6, 2e-6, tag + " log_sum_sq_probs" + row);
      expect_close(dh[p.n + i], ref.mean[i], 0.0, 4e-7 * zmax, tag + " mean_logit" + row);
      EXPECT_EQ(dh[2 * p.n + i], ref.top1[i] ? 1.0f : 0.0f) << tag << " is_top1" << row;
    }
  }
  // step 3, per shard, against the reference's dz
  DeviceBuffer g = DeviceBuffer::from_vector(*backend, p.g_lp), gh = DeviceBuffer::from_vector(*backend, p.g_h);
  const auto glv = fusedce::vector(g.data(), DType::kFloat32, p.n), ghv = fusedce::vector(gh.data(), DType::kFloat32, p.n);
  std::vector<double> dh(p.n * p.h, 0.0);
  for (int r = 0; r < world; ++r) {
    const int64_t v0 = bounds[r], vl = bounds[r + 1] - v0;
    const fusedce::ShardSpec s{v0, p.v};
    if (linear) {
      std::vector<float> w(p.weight.begin() + v0 * p.h, p.weight.begin() + (v0 + vl) * p.h);
      DeviceBuffer hid = DeviceBuffer::from_vector(*backend, p.hidden), wb = DeviceBuffer::from_vector(*backend, w);
      DeviceBuffer gw(*backend, vl * p.h * 4), ghid(*backend, p.n * p.h * 4);
      fusedce::LinearGrads grads;
      grads.grad_weight = fusedce::matrix(gw.data(), DType::kFloat32, vl, p.h);
      grads.grad_hidden = fusedce::matrix(ghid.data(), DType::kFloat32, p.n, p.h);
      ASSERT_TRUE(fusedce::linear_logprobs_backward(dev, fusedce::matrix(hid.data(), DType::kFloat32, p.n, p.h),
                                                    fusedce::matrix(wb.data(), DType::kFloat32, vl, p.h), {}, tv, s,
                                                    o, 0, lo, glv, ghv, grads)
                      .ok());
      // hidden is one-hot: grad_weight[j, i] = dz[i, j]; grad_hidden[i, k] = sum_j dz[i, j] w[j, k]
      const std::vector<float> gwh = gw.to_host_as<float>(), ghh = ghid.to_host_as<float>();
      for (int64_t i = 0; i < p.n; ++i) {
        for (int64_t j = 0; j < vl; ++j) {
          const double want = ref.dz[i * p.v + v0 + j];
          expect_close(gwh[j * p.h + i], want, 1e-4, 1e-6, tag + " grad_weight");
        }
        for (int64_t k = 0; k < p.h; ++k) dh[i * p.h + k] += ghh[i * p.h + k];
      }
    } else {
      DeviceBuffer d(*backend, p.n * vl * 4);
      std::vector<float> x(p.n * vl);
      for (int64_t i = 0; i < p.n; ++i) {
        for (int64_t j = 0; j < vl; ++j) x[i * vl + j] = p.logits[i * p.v + v0 + j];
      }
      DeviceBuffer xb = DeviceBuffer::from_vector(*backend, x);
      ASSERT_TRUE(fusedce::logprobs_backward(dev, fusedce::matrix(xb.data(), DType::kFloat32, p.n, vl), tv, s, o, lo,
                                             glv, ghv, fusedce::matrix(d.data(), DType::kFloat32, p.n, vl))
                      .ok());
      const std::vector<float> dl = d.to_host_as<float>();
      for (int64_t i = 0; i < p.n; ++i) {
        for (int64_t j = 0; j < vl; ++j) expect_close(dl[i * vl + j], ref.dz[i * p.v + v0 + j], 1e-4, 1e-6, tag + " dlogits");
      }
    }
  }
  if (linear) {
    for (int64_t i = 0; i < p.n; ++i) {
      for (int64_t k = 0; k < p.h; ++k) {
        double want = 0.0, scale = 0.0;
        for (int64_t j = 0; j < p.v; ++j) {
          want += ref.dz[i * p.v + j] * p.weight[j * p.h + k];
          scale += std::abs(ref.dz[i * p.v + j] * p.weight[j * p.h + k]);
        }
        expect_close(dh[i * p.h + k], want, 0.0, 1e-5 * scale + 1e-30, tag + " grad_hidden");
      }
    }
  }
}

class Logprobs : public ::testing::TestWithParam<std::tuple<BackendKind, bool, int>> {};

/// Peaked and collapsed rows (20-100 nats), at two temperatures.
TEST_P(Logprobs, StepsMatchFloat64) {
  const auto [kind, linear, world] = GetParam();
  std::string why;
  Backend* backend = find_backend(kind, &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  for (float collapse : {0.0f, 20.0f, 45.0f, 80.0f}) {
    for (float temperature : {1.0f, 0.8f}) {
      const Problem p = make_problem(11, 203, collapse, 7u + static_cast<uint32_t>(collapse));
      for (bool dist : {false, true}) {
        check_steps(backend, linear, world, p, temperature, collapse != 0.0f,
                    "collapse " + std::to_string(collapse) + " T " + std::to_string(temperature) +
                        (dist ? " distribution stats" : ""),
                    dist);
      }
    }
  }
}

TEST_P(Logprobs, TiesAtTheMax) {
  const auto [kind, linear, world] = GetParam();
  std::string why;
  Backend* backend = find_backend(kind, &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const Problem p = ties_problem();
  for (float temperature : {1.0f, 0.8f}) {
    for (bool dist : {false, true}) {
      check_steps(backend, linear, world, p, temperature, false,
                  "ties T " + std::to_string(temperature) + (dist ? " distribution stats" : ""), dist);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, Logprobs,
                         ::testing::Combine(::testing::ValuesIn(all_backends()), ::testing::Bool(),
                                            ::testing::Values(1, 3)),
                         [](const auto& info) {
                           return std::string(backend_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_linear" : "_logits") + "_world" +
                                  std::to_string(std::get<2>(info.param));
                         });

// ---- the CPU linear backward, blocked over the vocabulary --------------------------------------
//
// The CPU forms the logits again in the backward, block by block of weight rows (at most 256;
// fewer past H = 1024, 1 MiB of them), and takes every gradient of a block while it is in cache;
// grad_hidden partials of groups of blocks (16 to 64 groups) are added in group order. These
// cases put the vocabulary below, at and past one block, past 64 blocks (groups of one and two
// blocks) and at one column; several token chunks; bias, entropy and temperature; 16-bit inputs (grad_weight
// and grad_bias in their dtype, accumulated in float32 and rounded once); strided views; no
// rows and all rows ignored. Each is run on one thread and on two, which must agree bit for
// bit, and against float64 formed from the same inputs.

struct BlockCase {
  const char* name;
  int64_t n, h, v;
  bool bias, entropy;
  float temperature;
  size_t budget;  // chunk_budget_bytes (0: the default)
  DType dtype;    // of hidden, weight, bias, grad_weight and grad_bias (grad_hidden: float32)
  bool all_ignored;
};

double to_double(const std::vector<uint16_t>& bits, size_t i, DType dtype) {
  return dtype == DType::kBFloat16 ? fusedce::detail::bf16_to_float(bits[i]) : fusedce::detail::fp16_to_float(bits[i]);
}

/// x rounded to a 16-bit dtype in place (the reference sees the values the backend reads), and
/// its bits; float32 leaves x as it is.
std::vector<uint16_t> round_to(std::vector<float>& x, DType dtype) {
  std::vector<uint16_t> bits;
  if (dtype == DType::kFloat32) return bits;
  for (float& e : x) {
    bits.push_back(dtype == DType::kBFloat16 ? fusedce::detail::float_to_bf16(e) : fusedce::detail::float_to_fp16(e));
    e = static_cast<float>(to_double(bits, bits.size() - 1, dtype));
  }
  return bits;
}

void* data_of(std::vector<float>& f, std::vector<uint16_t>& b) {
  return b.empty() ? static_cast<void*>(f.data()) : static_cast<void*>(b.data());
}

/// A gradient output of `count` elements in `dtype` (float32 or 16-bit), poisoned, with a gap of
/// `pad` elements after each row of `cols`.
struct GradOut {
  DType dtype;
  int64_t rows, cols, ld;
  std::vector<float> f;
  std::vector<uint16_t> b;
  GradOut(DType d, int64_t r, int64_t c, int64_t pad) : dtype(d), rows(r), cols(c), ld(c + pad) {
    if (d == DType::kFloat32) f.assign(std::max<int64_t>(r * ld, 1), -7.0f);
    else b.assign(std::max<int64_t>(r * ld, 1), 0x7777);
  }
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f.data()) : static_cast<void*>(b.data()); }
  double at(int64_t r, int64_t c) const {
    const size_t i = r * ld + c;
    return dtype == DType::kFloat32 ? f[i] : to_double(b, i, dtype);
  }
  bool same_bits(const GradOut& o) const { return f == o.f && b == o.b; }
};

struct BlockRun {
  GradOut gh, gw, gb;
};

/// A case's inputs: float32 values rounded to its dtype (what the reference reads) and their
/// 16-bit bits (what the backend reads), rows of h + pad (a strided view), one in four targets
/// ignored.
struct BlockInputs {
  static constexpr int64_t pad = 3;
  std::vector<float> hid, w, bias;
  std::vector<uint16_t> hid16, w16, bias16;
  std::vector<int64_t> target;
  std::vector<float> g_lp, g_h;
};

BlockInputs block_inputs(const BlockCase& c) {
  const int64_t n = c.n, h = c.h, v = c.v, pad = BlockInputs::pad;
  BlockInputs in;
  std::mt19937 rng(static_cast<uint32_t>(n * 131 + v * 7 + h));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  in.hid.resize(std::max<int64_t>(n * (h + pad), 1));
  in.w.resize(v * (h + pad));
  in.bias.resize(2 * v);
  for (float& x : in.hid) x = nd(rng);
  const float ws = 2.0f / std::sqrt(static_cast<float>(h));
  for (float& x : in.w) x = nd(rng) * ws;
  for (float& x : in.bias) x = nd(rng);
  in.hid16 = round_to(in.hid, c.dtype);
  in.w16 = round_to(in.w, c.dtype);
  in.bias16 = round_to(in.bias, c.dtype);
  in.target.assign(std::max<int64_t>(n, 1), 0);
  for (int64_t i = 0; i < n; ++i) in.target[i] = c.all_ignored || i % 4 == 3 ? kIgnore : static_cast<int64_t>(rng() % v);
  in.g_lp.assign(std::max<int64_t>(n, 1), 0.0f);
  in.g_h.assign(std::max<int64_t>(n, 1), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    in.g_lp[i] = nd(rng);
    in.g_h[i] = nd(rng);
  }
  return in;
}

/// The three gradients against float64 formed from the same inputs. Each element may be off by
/// 5e-6 of the magnitude of its summed terms (float32 products of float32 logits, 8 ulps), plus
/// the output's rounding (half an ulp of the dtype, relative). On a GPU (`gpu`) also: cuBLASLt's
/// float32 sums in its own order (2 sqrt(K) ulps of the magnitude, K the longest sum, doubled for
/// the sum across chunks), and the logits rounded to a 16-bit input dtype before the softmax
/// (half an ulp of |z| moves each z, and lse and the entropy with it: each dz by at most 4 such
/// errors of the largest |z| times its magnitude).
void check_block_grads(const BlockCase& c, const BlockInputs& in, const BlockRun& got, bool gpu) {
  const int64_t n = c.n, h = c.h, v = c.v, pad = BlockInputs::pad;
  const std::vector<float>&hid = in.hid, &w = in.w, &bias = in.bias;
  // float64: dz and its magnitude before cancellation (as in test_large_logprobs.cpp), then the
  // three products and their magnitudes.
  std::vector<double> dz(n * v, 0.0), mag(n * v, 0.0);
  double zmax = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (in.target[i] == kIgnore) continue;
    std::vector<double> z(v);
    double m = -INFINITY;
    for (int64_t j = 0; j < v; ++j) {
      double acc = c.bias ? bias[2 * j] : 0.0;
      for (int64_t k = 0; k < h; ++k) acc += double(hid[i * (h + pad) + k]) * double(w[j * (h + pad) + k]);
      z[j] = acc / c.temperature;
      m = std::max(m, z[j]);
      zmax = std::max(zmax, std::abs(z[j]));
    }
    double s = 0.0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(z[j] - m);
    const double lse = m + std::log(s);
    double ent = 0.0;
    for (int64_t j = 0; j < v; ++j) ent -= std::exp(z[j] - lse) * (z[j] - lse);
    const double glp = in.g_lp[i], gh = c.entropy ? in.g_h[i] : 0.0;
    for (int64_t j = 0; j < v; ++j) {
      const double lp = z[j] - lse, p = std::exp(lp), at_t = j == in.target[i] ? 1.0 : 0.0;
      dz[i * v + j] = (glp * (at_t - p) - gh * p * (lp + ent)) / c.temperature;
      mag[i * v + j] = (p * (std::abs(glp) + std::abs(gh) * (std::abs(lp) + ent)) + at_t * std::abs(glp)) / c.temperature;
    }
  }
  const double round = c.dtype == DType::kFloat32 ? 0.0 : c.dtype == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double longest = static_cast<double>(std::max({n, v, h}));
  const double logit_rel = !gpu ? 0.0 : 4.0 * std::sqrt(longest) * std::ldexp(1.0, -24) + 2.0 * round * zmax;
  auto close = [&](double g, double want, double scale, const std::string& what, bool rounded = true) {
    const double tol = (5e-6 + logit_rel) * scale + (rounded ? round * std::abs(want) : 0.0) +
                       (c.dtype == DType::kFloat16 ? std::ldexp(1.0, -24) : 1e-30);
    EXPECT_LE(std::abs(g - want), tol) << what << ": got " << g << ", want " << want;
    return std::abs(g - want) <= tol;
  };
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 5; ++i) {
    for (int64_t k = 0; k < h && bad < 5; ++k) {
      double want = 0.0, scale = 0.0;
      for (int64_t j = 0; j < v; ++j) {
        want += dz[i * v + j] * w[j * (h + pad) + k];
        scale += mag[i * v + j] * std::abs(w[j * (h + pad) + k]);
      }
      bad += !close(got.gh.at(i, k), want, scale, "grad_hidden[" + std::to_string(i) + ", " + std::to_string(k) + "]", false);
    }
  }
  for (int64_t j = 0; j < v && bad < 5; ++j) {
    for (int64_t k = 0; k < h && bad < 5; ++k) {
      double want = 0.0, scale = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        want += dz[i * v + j] * hid[i * (h + pad) + k];
        scale += mag[i * v + j] * std::abs(hid[i * (h + pad) + k]);
      }
      bad += !close(got.gw.at(j, k), want, scale, "grad_weight[" + std::to_string(j) + ", " + std::to_string(k) + "]");
    }
    if (c.bias) {
      double want = 0.0, scale = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        want += dz[i * v + j];
        scale += mag[i * v + j];
      }
      bad += !close(got.gb.at(j, 0), want, scale, "grad_bias[" + std::to_string(j) + "]");
    }
  }
}

void run_block_case(const BlockCase& c) {
  SCOPED_TRACE(c.name);
  const int64_t n = c.n, h = c.h, v = c.v, pad = BlockInputs::pad;
  BlockInputs in = block_inputs(c);
  const auto hv = fusedce::matrix(data_of(in.hid, in.hid16), c.dtype, n, h, h + pad);
  const auto wv = fusedce::matrix(data_of(in.w, in.w16), c.dtype, v, h, h + pad);
  const fusedce::VectorView bv = c.bias ? fusedce::vector(data_of(in.bias, in.bias16), c.dtype, v, 2) : fusedce::VectorView{};
  const auto tv = fusedce::vector(in.target.data(), DType::kInt64, n);
  fusedce::LogprobOptions o;
  o.temperature = c.temperature;
  std::vector<float> stats((n + 1) * kW), fwd(3 * std::max<int64_t>(n, 1));
  const auto sv = fusedce::matrix(stats.data(), DType::kFloat32, n + 1, kW);
  ASSERT_TRUE(fusedce::linear_logprobs_stats(fusedce::Device::cpu(2), hv, wv, bv, tv, {0, v}, o, c.budget, sv).ok());
  fusedce::LogprobOutputs lo;
  lo.logprob = fusedce::vector(fwd.data(), DType::kFloat32, n);
  lo.entropy = fusedce::vector(fwd.data() + n, DType::kFloat32, n);
  lo.lse = fusedce::vector(fwd.data() + 2 * n, DType::kFloat32, n);
  ASSERT_TRUE(fusedce::logprobs_merge(fusedce::Device::cpu(2), sv, 1, tv, {0, v}, o, lo).ok());

  auto backward = [&](int threads) {
    BlockRun r{GradOut(DType::kFloat32, n, h, pad), GradOut(c.dtype, v, h, pad), GradOut(c.dtype, v, 1, 1)};
    fusedce::LinearGrads g;
    g.grad_hidden = fusedce::matrix(r.gh.data(), DType::kFloat32, n, h, h + pad);
    g.grad_weight = fusedce::matrix(r.gw.data(), c.dtype, v, h, h + pad);
    if (c.bias) g.grad_bias = fusedce::vector(r.gb.data(), c.dtype, v, 2);
    const fusedce::VectorView ge = c.entropy ? fusedce::vector(in.g_h.data(), DType::kFloat32, n) : fusedce::VectorView{};
    EXPECT_TRUE(fusedce::linear_logprobs_backward(fusedce::Device::cpu(threads), hv, wv, bv, tv, {0, v}, o, c.budget,
                                                  lo, fusedce::vector(in.g_lp.data(), DType::kFloat32, n), ge, g)
                    .ok());
    return r;
  };
  const BlockRun one = backward(1), two = backward(2);
  EXPECT_TRUE(one.gh.same_bits(two.gh)) << "grad_hidden differs between 1 and 2 threads";
  EXPECT_TRUE(one.gw.same_bits(two.gw)) << "grad_weight differs between 1 and 2 threads";
  EXPECT_TRUE(one.gb.same_bits(two.gb)) << "grad_bias differs between 1 and 2 threads";
  check_block_grads(c, in, one, false);
}

TEST(LinearLogprobsCpuBlocks, GradientsMatchFloat64OnAnyThreadCount) {
  const size_t rows5 = 5 * 20000 * 4;  // 5 rows per chunk at V = 20000
  const BlockCase cases[] = {
      {"V below one block", 37, 24, 100, true, true, 0.7f, 0, DType::kFloat32, false},
      {"V of one block", 19, 24, 256, false, false, 1.0f, 0, DType::kFloat32, false},
      {"V one past a block", 19, 24, 257, true, false, 1.0f, 0, DType::kFloat32, false},
      {"79 blocks in 64 groups, chunks of 5 rows", 23, 24, 20000, true, true, 1.3f, rows5, DType::kFloat32, false},
      {"79 blocks, bfloat16", 23, 24, 20000, true, true, 1.3f, rows5, DType::kBFloat16, false},
      {"79 blocks, float16", 23, 24, 20000, true, true, 0.9f, 0, DType::kFloat16, false},
      {"wide hidden: blocks of 224 rows", 9, 1100, 500, true, true, 1.0f, 0, DType::kFloat32, false},
      {"one column", 6, 16, 1, true, true, 1.0f, 0, DType::kFloat32, false},
      {"no rows", 0, 16, 300, true, true, 1.0f, 0, DType::kFloat32, false},
      {"all rows ignored", 7, 16, 300, true, true, 1.0f, 0, DType::kBFloat16, true},
  };
  for (const BlockCase& c : cases) run_block_case(c);
}

/// The CUDA linear backward's three ways through the logits (logprobs_cuda.cpp, plan_of): one
/// chunk of every row, vocabulary chunks of every row (grad_weight rows written per chunk, the
/// float32 grad_hidden summed across them; bias slices; targets matched per chunk), and token
/// chunks (grad_weight summed across them, through a float32 accumulator when 16-bit). The
/// budgets below force each; the forward runs token chunks of the same budget.
TEST(LinearLogprobsCudaPlans, GradientsMatchFloat64) {
  std::string why;
  Backend* backend = find_backend(BackendKind::kCuda, &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const BlockCase cases[] = {
      {"one chunk", 37, 24, 1000, true, true, 0.7f, 0, DType::kFloat32, false},
      {"vocabulary chunks of 512, odd V", 300, 24, 2001, true, true, 1.0f, 300 * 4 * 600, DType::kFloat32, false},
      {"vocabulary chunks of 384, bfloat16", 300, 24, 2001, true, true, 1.3f, 100000, DType::kBFloat16, false},
      {"vocabulary chunks, float16, no bias", 300, 40, 1537, false, true, 1.0f, 150000, DType::kFloat16, false},
      {"token chunks of 28 rows", 300, 24, 2001, true, true, 0.9f, 300 * 4 * 200, DType::kFloat32, false},
      {"token chunks, bfloat16 accumulator", 600, 8, 2001, true, false, 1.0f, 100000, DType::kBFloat16, false},
      {"no rows", 0, 16, 300, true, true, 1.0f, 4096, DType::kFloat32, false},
  };
  for (const BlockCase& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t n = c.n, h = c.h, v = c.v, pad = BlockInputs::pad;
    BlockInputs in = block_inputs(c);
    const size_t el = c.dtype == DType::kFloat32 ? 4 : 2;
    auto upload = [&](std::vector<float>& f, std::vector<uint16_t>& b) {
      return DeviceBuffer::from_host(*backend, data_of(f, b), f.size() * el);
    };
    // The CUDA backend takes a bias of stride 1: every other entry of the strided one.
    std::vector<float> bias_f(v);
    std::vector<uint16_t> bias_b(in.bias16.empty() ? 0 : v);
    for (int64_t j = 0; j < v; ++j) {
      bias_f[j] = in.bias[2 * j];
      if (!bias_b.empty()) bias_b[j] = in.bias16[2 * j];
    }
    DeviceBuffer hid = upload(in.hid, in.hid16), w = upload(in.w, in.w16), bias = upload(bias_f, bias_b);
    DeviceBuffer target = DeviceBuffer::from_vector(*backend, in.target), g_lp = DeviceBuffer::from_vector(*backend, in.g_lp),
                 g_h = DeviceBuffer::from_vector(*backend, in.g_h);
    const fusedce::Device dev = backend->device();
    const auto hv = fusedce::matrix(hid.data(), c.dtype, n, h, h + pad);
    const auto wv = fusedce::matrix(w.data(), c.dtype, v, h, h + pad);
    const fusedce::VectorView bv = c.bias ? fusedce::vector(bias.data(), c.dtype, v) : fusedce::VectorView{};
    const auto tv = fusedce::vector(target.data(), DType::kInt64, n);
    fusedce::LogprobOptions o;
    o.temperature = c.temperature;
    DeviceBuffer stats(*backend, (n + 1) * kW * 4), fwd(*backend, 3 * std::max<int64_t>(n, 1) * 4);
    const auto sv = fusedce::matrix(stats.data(), DType::kFloat32, n + 1, kW);
    const fusedce::Status fs = fusedce::linear_logprobs_stats(dev, hv, wv, bv, tv, {0, v}, o, c.budget, sv);
    ASSERT_TRUE(fs.ok()) << fs.message();
    fusedce::LogprobOutputs lo;
    lo.logprob = fusedce::vector(fwd.at(0), DType::kFloat32, n);
    lo.entropy = fusedce::vector(fwd.at(n * 4), DType::kFloat32, n);
    lo.lse = fusedce::vector(fwd.at(2 * n * 4), DType::kFloat32, n);
    const fusedce::Status ms = fusedce::logprobs_merge(dev, sv, 1, tv, {0, v}, o, lo);
    ASSERT_TRUE(ms.ok()) << ms.message();
    BlockRun r{GradOut(DType::kFloat32, n, h, pad), GradOut(c.dtype, v, h, pad), GradOut(c.dtype, v, 1, 1)};
    auto poisoned = [&](GradOut& g) {
      return DeviceBuffer::from_host(*backend, g.data(), (g.dtype == DType::kFloat32 ? g.f.size() * 4 : g.b.size() * 2));
    };
    DeviceBuffer gh = poisoned(r.gh), gw = poisoned(r.gw), gb = poisoned(r.gb);
    fusedce::LinearGrads g;
    g.grad_hidden = fusedce::matrix(gh.data(), DType::kFloat32, n, h, h + pad);
    g.grad_weight = fusedce::matrix(gw.data(), c.dtype, v, h, h + pad);
    if (c.bias) g.grad_bias = fusedce::vector(gb.data(), c.dtype, v, 2);
    const fusedce::VectorView ge = c.entropy ? fusedce::vector(g_h.data(), DType::kFloat32, n) : fusedce::VectorView{};
    const fusedce::Status s = fusedce::linear_logprobs_backward(dev, hv, wv, bv, tv, {0, v}, o, c.budget, lo,
                                                               fusedce::vector(g_lp.data(), DType::kFloat32, n), ge, g);
    ASSERT_TRUE(s.ok()) << s.message();
    backend->copy_to_host(r.gh.data(), gh.data(), r.gh.f.size() * 4);
    backend->copy_to_host(r.gw.data(), gw.data(), c.dtype == DType::kFloat32 ? r.gw.f.size() * 4 : r.gw.b.size() * 2);
    backend->copy_to_host(r.gb.data(), gb.data(), c.dtype == DType::kFloat32 ? r.gb.f.size() * 4 : r.gb.b.size() * 2);
    check_block_grads(c, in, r, true);
    // The padding after each row of grad_hidden and grad_weight is not the output's: untouched.
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(r.gh.f[i * (h + pad) + h], -7.0f) << "grad_hidden padding, row " << i;
    for (int64_t j = 0; j + 1 < v; ++j) {
      const size_t at = j * (h + pad) + h;
      EXPECT_TRUE(c.dtype == DType::kFloat32 ? r.gw.f[at] == -7.0f : r.gw.b[at] == 0x7777) << "grad_weight padding, row " << j;
    }
  }
}

/// The CUDA linear form's fused products on Hopper (lp_fused_products.h: bf16, no bias, H and
/// row strides multiples of 8): the statistics in the logits product's epilogue, folded over
/// 192-wide tiles, and dlogits formed in the recomputed product's epilogue. Inputs whose logits
/// are exact in float32 (hidden in {-1, 0, 1}, weight in eighths), so the bf16 logits the
/// kernels round are the reference's own and every error left is the kernels' arithmetic: one
/// row, partial CTA tiles in rows (past a cluster's 256) and in columns (V = 1, 193, 2001, not a
/// multiple of 192), one whole tile, temperatures, with and without the entropy's gradient,
/// ignored rows, collapsed rows (the target's logit 60-200 nats above the rest: the log-
/// probability a float32 subnormal or 0), chunk budgets that split the forward into token
/// chunks and the backward into vocabulary chunks, and the distribution statistics (their
/// second plane of partials; at V = 8 it does not fit the logits buffer and the row kernel
/// takes them). On other GPUs the same calls take cuBLASLt and the row kernels, against the same
/// references.
TEST(LinearLogprobsCudaFused, MatchesFloat64OnExactLogits) {
  std::string why;
  Backend* backend = find_backend(BackendKind::kCuda, &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  struct Case {
    const char* name;
    int64_t n, h, v;
    float temperature;
    bool entropy;
    size_t budget;
    bool dist;  // the distribution statistics too
  };
  const Case cases[] = {
      {"3 row tiles, 11 column tiles", 300, 64, 2001, 1.0f, true, 0, false},
      {"a 1-column last tile, temperature 0.7", 37, 32, 193, 0.7f, true, 0, false},
      {"V = 1", 5, 8, 1, 1.0f, true, 0, false},
      {"one row, one whole tile, no entropy gradient", 1, 16, 192, 1.3f, false, 0, false},
      {"collapsed rows, token and vocabulary chunks", 260, 128, 5000, 1.0f, true, 400000, false},
      {"distribution statistics", 300, 64, 2001, 0.7f, true, 0, true},
      {"distribution statistics, collapsed rows, chunks", 260, 128, 5000, 1.0f, true, 400000, true},
      {"distribution statistics, V = 8", 37, 16, 8, 1.0f, true, 0, true},
      {"no rows: zero gradients", 0, 16, 300, 1.0f, true, 0, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t n = c.n, h = c.h, v = c.v;
    std::mt19937 rng(static_cast<uint32_t>(n * 17 + v * 3 + h));
    std::vector<float> w(v * h), hid(n * h);
    for (float& x : w) x = static_cast<float>(static_cast<int>(rng() % 33) - 16) / 8.0f;
    std::vector<int64_t> target(n);
    for (int64_t i = 0; i < n; ++i) {
      target[i] = i % 4 == 3 ? kIgnore : static_cast<int64_t>(rng() % v);
      const bool peaked = i % 3 == 0 && target[i] != kIgnore;
      for (int64_t k = 0; k < h; ++k) {
        // a peaked row follows its target's weight row: that logit is sum_k |w|, far above the rest
        const float wt = w[target[i] == kIgnore ? 0 : target[i] * h + k];
        hid[i * h + k] = peaked ? (wt > 0 ? 1.0f : wt < 0 ? -1.0f : 0.0f) : static_cast<float>(static_cast<int>(rng() % 3) - 1);
      }
    }
    std::vector<uint16_t> w16 = round_to(w, DType::kBFloat16), hid16 = round_to(hid, DType::kBFloat16);
    std::vector<float> g_lp(n), g_h(n);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      g_lp[i] = nd(rng);
      g_h[i] = nd(rng);
    }

    // float64: z = bf16(the exact dot) / T, then the contract's formulas
    std::vector<double> z(n * v), lp(n, 0.0), ent(n, 0.0), dz(n * v, 0.0), lse(n, 0.0), lss(n, 0.0), mean(n, 0.0);
    std::vector<bool> top1(n, false);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < v; ++j) {
        double dot = 0.0;
        for (int64_t k = 0; k < h; ++k) dot += double(hid[i * h + k]) * double(w[j * h + k]);
        z[i * v + j] = double(fusedce::detail::bf16_to_float(fusedce::detail::float_to_bf16(float(dot)))) / c.temperature;
      }
      if (target[i] == kIgnore) continue;
      // log-probabilities relative to the max, its first instance left out of the sum, so that a
      // collapsed row's (1e-15 and below) keep their digits: l_j = (z_j - m) - log1p(rest)
      int64_t a = 0;
      for (int64_t j = 1; j < v; ++j) a = z[i * v + j] > z[i * v + a] ? j : a;
      const double m = z[i * v + a];
      double rest = 0.0;
      for (int64_t j = 0; j < v; ++j)
        if (j != a) rest += std::exp(z[i * v + j] - m);
      const double l1 = std::log1p(rest);
      lse[i] = m + l1;
      auto logp = [&](int64_t j) { return j == a ? -l1 : (z[i * v + j] - m) - l1; };
      lp[i] = logp(target[i]);
      for (int64_t j = 0; j < v; ++j) ent[i] -= std::exp(logp(j)) * logp(j);
      double sq = 0.0;
      for (int64_t j = 0; j < v; ++j) {
        sq += std::exp(2.0 * logp(j));
        mean[i] += z[i * v + j] / double(v);
      }
      lss[i] = std::log(sq);
      top1[i] = a == target[i];
      const double gh = c.entropy ? g_h[i] : 0.0;
      for (int64_t j = 0; j < v; ++j) {
        // the target's 1 - p_t as -expm1 (a collapsed row's is below double's resolution of 1)
        const bool at_t = j == target[i];
        const double l = logp(j), p = std::exp(l);
        dz[i * v + j] = (g_lp[i] * (at_t ? -std::expm1(l) : -p) - gh * p * (l + ent[i])) / c.temperature;
      }
    }

    DeviceBuffer dh = DeviceBuffer::from_host(*backend, hid16.data(), hid16.size() * 2);
    DeviceBuffer dw = DeviceBuffer::from_host(*backend, w16.data(), w16.size() * 2);
    DeviceBuffer dt = DeviceBuffer::from_vector(*backend, target), dglp = DeviceBuffer::from_vector(*backend, g_lp),
                 dgh = DeviceBuffer::from_vector(*backend, g_h);
    const fusedce::Device dev = backend->device();
    const auto hv = fusedce::matrix(dh.data(), DType::kBFloat16, n, h);
    const auto wv = fusedce::matrix(dw.data(), DType::kBFloat16, v, h);
    const auto tv = fusedce::vector(dt.data(), DType::kInt64, n);
    fusedce::LogprobOptions o;
    o.temperature = c.temperature;
    o.distribution_stats = c.dist;
    DeviceBuffer stats(*backend, (n + 1) * kW * 4), fwd(*backend, 3 * std::max<int64_t>(n, 1) * 4);
    const auto sv = fusedce::matrix(stats.data(), DType::kFloat32, n + 1, kW);
    fusedce::Status st = fusedce::linear_logprobs_stats(dev, hv, wv, {}, tv, {0, v}, o, c.budget, sv);
    ASSERT_TRUE(st.ok()) << st.message();
    fusedce::LogprobOutputs lo;
    lo.logprob = fusedce::vector(fwd.at(0), DType::kFloat32, n);
    lo.entropy = fusedce::vector(fwd.at(n * 4), DType::kFloat32, n);
    lo.lse = fusedce::vector(fwd.at(2 * n * 4), DType::kFloat32, n);
    st = fusedce::logprobs_merge(dev, sv, 1, tv, {0, v}, o, lo);
    ASSERT_TRUE(st.ok()) << st.message();
    std::vector<float> out(3 * n);
    backend->copy_to_host(out.data(), fwd.data(), out.size() * 4);
    int bad = 0;
    for (int64_t i = 0; i < n && bad < 5; ++i) {
      // float32 arithmetic on logits up to ~250 / T: lse and z_t each carry a few ulps, which
      // a log-probability z_t - lse keeps unless the target is the row's max: then it is
      // -log1p of the other terms' sum, relative to itself (a collapsed row's: subnormal or 0).
      // The entropy is formed relative to the max (no cancellation against lse).
      double zmax = -INFINITY;
      for (int64_t j = 0; j < v; ++j) zmax = std::max(zmax, z[i * v + j]);
      const double zt = target[i] == kIgnore ? 0.0 : z[i * v + target[i]];
      const double scale = 1.0 + std::abs(lse[i]) + std::abs(zt);
      const double tol_lp = (zt == zmax ? 0.0 : 1e-6 * scale) + 2e-5 * std::abs(lp[i]) + 1e-40;
      const double tol_h = 2e-5 * std::abs(ent[i]) + 1e-7;
      const bool ok = std::abs(out[i] - lp[i]) <= tol_lp && std::abs(out[n + i] - ent[i]) <= tol_h &&
                      std::abs(out[2 * n + i] - lse[i]) <= 1e-6 * scale;
      EXPECT_TRUE(ok) << "row " << i << ": logprob " << out[i] << " (want " << lp[i] << "), entropy " << out[n + i]
                      << " (want " << ent[i] << "), lse " << out[2 * n + i] << " (want " << lse[i] << ")";
      bad += !ok;
    }
    if (c.dist) {
      // log sum p^2 from float32 sums relative to the max; the mean within float32 roundoff of
      // the largest |z|; is_top1 exactly (the logits are exact, ties included)
      DeviceBuffer dist(*backend, 3 * std::max<int64_t>(n, 1) * 4);
      fusedce::DistributionStats ds;
      ds.log_sum_sq_probs = fusedce::vector(dist.at(0), DType::kFloat32, n);
      ds.mean_logit = fusedce::vector(dist.at(n * 4), DType::kFloat32, n);
      ds.is_top1 = fusedce::vector(dist.at(2 * n * 4), DType::kFloat32, n);
      st = fusedce::logprobs_distribution_stats(dev, sv, 1, tv, {0, v}, o, ds);
      ASSERT_TRUE(st.ok()) << st.message();
      std::vector<float> d(3 * n);
      backend->copy_to_host(d.data(), dist.data(), d.size() * 4);
      double zabs = 0.0;
      for (double x : z) zabs = std::max(zabs, std::abs(x));
      for (int64_t i = 0; i < n && bad < 5; ++i) {
        const bool ignored = target[i] == kIgnore;
        const bool ok = ignored ? d[i] == 0.0f && d[n + i] == 0.0f && d[2 * n + i] == 0.0f
                                : std::abs(d[i] - lss[i]) <= 2e-6 + 1e-6 * std::abs(lss[i]) &&
                                      std::abs(d[n + i] - mean[i]) <= 4e-7 * zabs + 1e-30 &&
                                      d[2 * n + i] == (top1[i] ? 1.0f : 0.0f);
        EXPECT_TRUE(ok) << "row " << i << ": log_sum_sq_probs " << d[i] << " (want " << lss[i] << "), mean_logit "
                        << d[n + i] << " (want " << mean[i] << "), is_top1 " << d[2 * n + i] << " (want " << top1[i]
                        << ")";
        bad += !ok;
      }
    }

    // poisoned with NaN: every entry must be written (all zeros without rows)
    std::vector<float> gh_nan(std::max<int64_t>(n * h, 1), NAN);
    std::vector<uint16_t> gw_nan(v * h, 0x7fc0);
    DeviceBuffer gh = DeviceBuffer::from_host(*backend, gh_nan.data(), gh_nan.size() * 4);
    DeviceBuffer gw = DeviceBuffer::from_host(*backend, gw_nan.data(), gw_nan.size() * 2);
    fusedce::LinearGrads g;
    g.grad_hidden = fusedce::matrix(gh.data(), DType::kFloat32, n, h);
    g.grad_weight = fusedce::matrix(gw.data(), DType::kBFloat16, v, h);
    const fusedce::VectorView ge = c.entropy ? fusedce::vector(dgh.data(), DType::kFloat32, n) : fusedce::VectorView{};
    st = fusedce::linear_logprobs_backward(dev, hv, wv, {}, tv, {0, v}, o, c.budget, lo,
                                           fusedce::vector(dglp.data(), DType::kFloat32, n), ge, g);
    ASSERT_TRUE(st.ok()) << st.message();
    std::vector<float> ghost(n * h);
    std::vector<uint16_t> gwost(v * h);
    backend->copy_to_host(ghost.data(), gh.data(), ghost.size() * 4);
    backend->copy_to_host(gwost.data(), gw.data(), gwost.size() * 2);
    // dlogits are rounded to bf16 once (2^-9 of each term) and summed in float32; grad_weight is
    // rounded to bf16 once more
    const double r16 = std::ldexp(1.0, -8);
    for (int64_t i = 0; i < n && bad < 5; ++i)
      for (int64_t k = 0; k < h && bad < 5; ++k) {
        double want = 0.0, mag = 0.0;
        for (int64_t j = 0; j < v; ++j) {
          want += dz[i * v + j] * w[j * h + k];
          mag += std::abs(dz[i * v + j] * w[j * h + k]);
        }
        const bool ok = std::abs(ghost[i * h + k] - want) <= r16 * mag + 1e-30;
        EXPECT_TRUE(ok) << "grad_hidden[" << i << ", " << k << "] = " << ghost[i * h + k] << ", want " << want;
        bad += !ok;
      }
    for (int64_t j = 0; j < v && bad < 5; ++j)
      for (int64_t k = 0; k < h && bad < 5; ++k) {
        double want = 0.0, mag = 0.0;
        for (int64_t i = 0; i < n; ++i) {
          want += dz[i * v + j] * hid[i * h + k];
          mag += std::abs(dz[i * v + j] * hid[i * h + k]);
        }
        const double got = fusedce::detail::bf16_to_float(gwost[j * h + k]);
        const bool ok = std::abs(got - want) <= r16 * (mag + std::abs(want)) + 1e-30;
        EXPECT_TRUE(ok) << "grad_weight[" << j << ", " << k << "] = " << got << ", want " << want;
        bad += !ok;
      }
  }
}

/// A shard that holds none of the vocabulary's columns (weight of 0 rows): grad_hidden is zero on
/// every row, and nothing else is written.
TEST(LinearLogprobsCpuBlocks, ShardWithoutColumns) {
  const int64_t n = 5, h = 8, total = 10;
  std::vector<float> hid(n * h, 1.0f), w(1, 0.0f), gw(1, -7.0f), gh(n * h, -7.0f), g_lp(n, 1.0f), fwd(3 * n, 0.5f);
  std::vector<int64_t> target{0, 3, kIgnore, 9, 4};
  fusedce::LogprobOutputs lo;
  lo.logprob = fusedce::vector(fwd.data(), DType::kFloat32, n);
  lo.entropy = fusedce::vector(fwd.data() + n, DType::kFloat32, n);
  lo.lse = fusedce::vector(fwd.data() + 2 * n, DType::kFloat32, n);
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(gh.data(), DType::kFloat32, n, h);
  g.grad_weight = fusedce::matrix(gw.data(), DType::kFloat32, 0, h);
  for (int threads : {1, 2}) {
    const fusedce::Status s = fusedce::linear_logprobs_backward(
        fusedce::Device::cpu(threads), fusedce::matrix(hid.data(), DType::kFloat32, n, h),
        fusedce::matrix(w.data(), DType::kFloat32, 0, h), {}, fusedce::vector(target.data(), DType::kInt64, n),
        {total, total}, {}, 0, lo, fusedce::vector(g_lp.data(), DType::kFloat32, n), {}, g);
    ASSERT_TRUE(s.ok()) << s.message();
    for (float x : gh) EXPECT_EQ(x, 0.0f);
    EXPECT_EQ(gw[0], -7.0f);
  }
}

#if defined(__linux__)
/// A fresh anonymous mapping of at least `bytes` (never touched: its pages are not present).
struct FreshMapping {
  void* p = MAP_FAILED;
  size_t n = 0;
  explicit FreshMapping(size_t bytes) : n(bytes) {
    p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  ~FreshMapping() {
    if (p != MAP_FAILED) munmap(p, n);
  }
  float* floats() const { return static_cast<float*>(p); }
};

/// A float32 grad_weight that is a strided view (row stride past H) into a large buffer whose
/// first pages were never touched, as a fresh allocation's are, while the gaps between its
/// later rows hold the caller's data: the CPU linear backwards prepare a fresh grad_weight's
/// pages before their products, and must leave those gaps alone (they are not the output's).
TEST(LinearCpuFreshGradWeight, StridedGapsAreNotWritten) {
  const int64_t n = 4, h = 512, v = 16384, ld = h + 100;  // 40 MiB span: a "large and fresh" buffer
  const size_t span = size_t(v - 1) * ld + h;
  std::vector<float> hid(n * h), w(v * h), g_lp(n, 1.0f), fwd(3 * n, 0.0f), gh(n * h);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (float& x : hid) x = nd(rng);
  for (float& x : w) x = nd(rng);
  std::vector<int64_t> target{1, 17, 9000, 16383};
  const auto gap_value = [](int64_t r, int64_t j) { return float(r * 7 + j) + 0.25f; };
  for (int job = 0; job < 2; ++job) {
    FreshMapping buf(span * sizeof(float));
    ASSERT_NE(buf.p, MAP_FAILED);
    float* gw = buf.floats();
    for (int64_t r = v / 2; r < v - 1; ++r) {  // the caller's data, in the second half's gaps only
      for (int64_t j = h; j < ld; ++j) gw[r * ld + j] = gap_value(r, j);
    }
    fusedce::LinearGrads g;
    g.grad_hidden = fusedce::matrix(gh.data(), DType::kFloat32, n, h);
    g.grad_weight = fusedce::matrix(gw, DType::kFloat32, v, h, ld);
    const auto hv = fusedce::matrix(hid.data(), DType::kFloat32, n, h);
    const auto wv = fusedce::matrix(w.data(), DType::kFloat32, v, h);
    const auto tv = fusedce::vector(target.data(), DType::kInt64, n);
    fusedce::Status s;
    if (job == 0) {
      fusedce::LogprobOutputs lo;
      lo.logprob = fusedce::vector(fwd.data(), DType::kFloat32, n);
      lo.entropy = fusedce::vector(fwd.data() + n, DType::kFloat32, n);
      lo.lse = fusedce::vector(fwd.data() + 2 * n, DType::kFloat32, n);
      std::vector<float> stats((n + 1) * kW);
      const auto sv = fusedce::matrix(stats.data(), DType::kFloat32, n + 1, kW);
      ASSERT_TRUE(fusedce::linear_logprobs_stats(fusedce::Device::cpu(2), hv, wv, {}, tv, {0, v}, {}, 0, sv).ok());
      ASSERT_TRUE(fusedce::logprobs_merge(fusedce::Device::cpu(2), sv, 1, tv, {0, v}, {}, lo).ok());
      s = fusedce::linear_logprobs_backward(fusedce::Device::cpu(2), hv, wv, {}, tv, {0, v}, {}, 0, lo,
                                            fusedce::vector(g_lp.data(), DType::kFloat32, n), {}, g);
    } else {
      float loss = 0.0f;
      fusedce::ForwardOutputs out;
      out.loss = fusedce::vector(&loss, DType::kFloat32, 1);
      s = fusedce::linear_cross_entropy_forward_backward(fusedce::Device::cpu(2), hv, wv, {}, tv, {}, {}, out, {}, g);
    }
    ASSERT_TRUE(s.ok()) << s.message();
    int64_t changed = 0;
    for (int64_t r = v / 2; r < v - 1; ++r) {
      for (int64_t j = h; j < ld; ++j) changed += gw[r * ld + j] != gap_value(r, j);
    }
    EXPECT_EQ(changed, 0) << (job == 0 ? "linear_logprobs_backward" : "linear_cross_entropy_forward_backward");
    double norm = 0.0;
    for (int64_t j = 0; j < h; ++j) norm += std::fabs(gw[size_t(target[3]) * ld + j]);
    EXPECT_GT(norm, 0.0) << "the target's row of grad_weight was written";
  }
}
#endif

TEST(LogprobsBadInput, ArgumentsAreNamed) {
  std::vector<float> x(3 * 4, 0.0f), stats(4 * kW);
  std::vector<int64_t> t{0, 1, 9};
  const auto dev = fusedce::Device::cpu();
  const auto xv = fusedce::matrix(x.data(), DType::kFloat32, 3, 4);
  const auto tv = fusedce::vector(t.data(), DType::kInt64, 3);
  const auto sv = fusedce::matrix(stats.data(), DType::kFloat32, 4, kW);
  fusedce::LogprobOptions o;
  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    o.temperature = bad;
    const fusedce::Status s = fusedce::logprobs_stats(dev, xv, tv, {0, 4}, o, sv);
    EXPECT_EQ(s.code(), fusedce::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("temperature"), std::string::npos) << s.message();
  }
  o.temperature = 1.0f;
  fusedce::Status s = fusedce::logprobs_stats(dev, xv, tv, {0, 4}, o, sv);
  EXPECT_EQ(s.code(), fusedce::StatusCode::kTargetOutOfRange);
  EXPECT_NE(s.message().find("target[2] = 9"), std::string::npos) << s.message();
  s = fusedce::logprobs_stats(dev, xv, tv, {0, 4}, o, fusedce::matrix(stats.data(), DType::kFloat32, 3, kW));
  EXPECT_NE(s.message().find("stats must be"), std::string::npos) << s.message();
  s = fusedce::logprobs_stats(dev, xv, tv, {2, 4}, o, sv);
  EXPECT_NE(s.message().find("shard.vocab_start"), std::string::npos) << s.message();
  // step 4: only over statistics gathered with distribution_stats; each output (N,) float32
  std::vector<int64_t> ok_t{0, 1, 2};
  const auto okv = fusedce::vector(ok_t.data(), DType::kInt64, 3);
  std::vector<float> d(3, 0.0f);
  fusedce::DistributionStats ds;
  ds.is_top1 = fusedce::vector(d.data(), DType::kFloat32, 3);
  s = fusedce::logprobs_distribution_stats(dev, sv, 1, okv, {0, 4}, o, ds);
  EXPECT_NE(s.message().find("options.distribution_stats"), std::string::npos) << s.message();
  o.distribution_stats = true;
  EXPECT_TRUE(fusedce::logprobs_distribution_stats(dev, sv, 1, okv, {0, 4}, o, ds).ok());
  ds.mean_logit = fusedce::vector(d.data(), DType::kFloat32, 2);
  s = fusedce::logprobs_distribution_stats(dev, sv, 1, okv, {0, 4}, o, ds);
  EXPECT_NE(s.message().find("mean_logit"), std::string::npos) << s.message();
  ds.mean_logit = {};
  s = fusedce::logprobs_distribution_stats(dev, sv, 2, okv, {0, 4}, o, ds);
  EXPECT_NE(s.message().find("gathered must be"), std::string::npos) << s.message();
}

/// The linear backward's gradients: each of its shape and dtype (grad_hidden float32,
/// grad_weight and grad_bias the head's), grad_bias only with a bias.
TEST(LogprobsBadInput, LinearGradientsAreNamed) {
  const int64_t n = 3, h = 4, v = 5;
  std::vector<float> hid(n * h, 0.0f), w(v * h, 0.0f), b(v, 0.0f), fwd(3 * n, 0.0f), g_lp(n, 1.0f), gh(n * h),
      gw(v * h), gb(v);
  std::vector<int64_t> t{0, 1, 2};
  const auto dev = fusedce::Device::cpu();
  fusedce::LogprobOutputs lo;
  lo.logprob = fusedce::vector(fwd.data(), DType::kFloat32, n);
  lo.entropy = fusedce::vector(fwd.data() + n, DType::kFloat32, n);
  lo.lse = fusedce::vector(fwd.data() + 2 * n, DType::kFloat32, n);
  auto backward = [&](const fusedce::VectorView& bias, const fusedce::LinearGrads& g) {
    return fusedce::linear_logprobs_backward(dev, fusedce::matrix(hid.data(), DType::kFloat32, n, h),
                                             fusedce::matrix(w.data(), DType::kFloat32, v, h), bias,
                                             fusedce::vector(t.data(), DType::kInt64, n), {0, v}, {}, 0, lo,
                                             fusedce::vector(g_lp.data(), DType::kFloat32, n), {}, g);
  };
  const struct {
    const char* what;
    fusedce::LinearGrads g;
    bool bias;
  } cases[] = {
      {"grad_hidden must be 3 x 4 float32", {fusedce::matrix(gh.data(), DType::kBFloat16, n, h), {}, {}}, false},
      {"grad_hidden must be 3 x 4 float32", {fusedce::matrix(gh.data(), DType::kFloat32, n - 1, h), {}, {}}, false},
      {"grad_weight must be 5 x 4 float32", {{}, fusedce::matrix(gw.data(), DType::kFloat16, v, h), {}}, false},
      {"grad_weight must be 5 x 4 float32", {{}, fusedce::matrix(gw.data(), DType::kFloat32, v, h - 1), {}}, false},
      {"grad_bias is given but bias is not", {{}, {}, fusedce::vector(gb.data(), DType::kFloat32, v)}, false},
      {"grad_bias", {{}, {}, fusedce::vector(gb.data(), DType::kFloat32, v - 1)}, true},
  };
  for (const auto& c : cases) {
    const fusedce::Status s = backward(c.bias ? fusedce::vector(b.data(), DType::kFloat32, v) : fusedce::VectorView{}, c.g);
    EXPECT_EQ(s.code(), fusedce::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(s.message().find(c.what), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace fusedce_test
