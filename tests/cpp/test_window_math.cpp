// The linear form's window arithmetic (src/cuda/linear/window_math.h) on the CPU, against float64:
// one row's logits split into 192-wide tiles as the window product's epilogue sees them (each
// tile's own offset m, the offset it takes, its sum of E and its centred entropy partial, in
// float32 as the epilogue forms them), merged by the functions the merge kernel calls, then the
// row's dlogits r E after the rebase. Rows: ordinary (logits N(0, 2.5^2)), peaked, hot (the
// target 60 nats up: its tile takes its own offset), cold (every logit 60 nats down), and V = 2.
// Tolerances: lse and entropy from float32 sums of V terms: 2e-6 (1 + |lse|) and 5e-6 absolute;
// dlogits from bf16 E (round to nearest: at most 2^-8 relative each) against float64 g (p -
// onehot): 1.01 2^-8 of each entry, and at the target 1e-7 g (1 + |z_t|) more: its entry is the
// float32 difference 2^(z_t log2 e - K) - S, a few float32 units of S (the epilogue's z log2 e
// carries |z| float32 units), times r = g / S; that is what a hot row's target carries where its
// true dlogit, g (p_t - 1), is ~1e-22 g. The mean signed relative error of the other entries
// within 1e-3 of 0 (rows of 100 entries or more), which a 0.5% error in r fails (checked).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "cuda/linear/window_math.h"

namespace fusedce_test {
namespace {

namespace wm = fusedce::cuda::window_math;
using fusedce::cuda::kWindowTile;
using fusedce::cuda::window_offset;
using fusedce::cuda::window_tiles;

struct RowResult {
  double lse, entropy;
  std::vector<double> dlogits;  // r E after the rebase and the target's rewrite
  bool apart;
};

/// The window form of one row: epilogue, merge and rebase as the kernels do them, with the host's
/// exp2f for the device's ex2.approx (both within a few float32 units) and bf16 E.
RowResult window_row(const std::vector<float>& z, int64_t t, float g, float plant = 1.0f) {
  const int64_t V = static_cast<int64_t>(z.size()), tiles = window_tiles(V);
  std::vector<float> sum(tiles), off(tiles), centred(tiles);
  std::vector<uint16_t> e(V);
  for (int64_t k = 0; k < tiles; ++k) {
    const int64_t c0 = k * kWindowTile, c1 = std::min(V, c0 + kWindowTile);
    float mx = -INFINITY;
    for (int64_t j = c0; j < c1; ++j) mx = std::max(mx, z[j] * wm::kLog2e);
    const float m = std::ceil(mx), kt = window_offset(m);
    float s = 0.0f, u = 0.0f;
    for (int64_t j = c0; j < c1; ++j) {
      const float y = z[j] * wm::kLog2e, ej = std::exp2(y - kt);
      s += ej;
      u = std::fma(ej, y - m, u);
      e[j] = fusedce::detail::float_to_bf16(ej);
    }
    sum[k] = s, off[k] = m, centred[k] = u * wm::kLn2;
  }
  float K = -INFINITY, Mx = -INFINITY;
  for (int64_t k = 0; k < tiles; ++k) K = std::max(K, window_offset(off[k])), Mx = std::max(Mx, off[k]);
  float S = 0.0f, U = 0.0f, C = 0.0f;
  bool apart = false;
  for (int64_t k = 0; k < tiles; ++k) {
    const float f = wm::factor(off[k], K);
    apart = apart || window_offset(off[k]) != K;
    S = std::fma(sum[k], f, S);
    U = std::fma(centred[k], f, U);
    C = std::fma(sum[k] * f, Mx - off[k], C);
  }
  RowResult r;
  r.lse = wm::lse(K, S);
  r.entropy = wm::entropy(S, K, Mx, C, U);
  r.apart = apart;
  const float rr = g / S * plant;
  r.dlogits.resize(V);
  for (int64_t j = 0; j < V; ++j) {
    // the rebase: each tile's E into the frame of K (exact: a power of two)
    const float f = wm::factor(off[j / kWindowTile], K);
    float ej = fusedce::detail::bf16_to_float(fusedce::detail::float_to_bf16(fusedce::detail::bf16_to_float(e[j]) * f));
    if (j == t) ej = fusedce::detail::bf16_to_float(fusedce::detail::float_to_bf16(wm::target_entry(z[t], K, S)));
    r.dlogits[j] = double(rr) * ej;
  }
  return r;
}

/// The checks of one row (header); `plant_must_fail`: the planted 0.5% in r must fail the row's
/// mean relative error (rows of hundreds of entries).
void expect_row(const std::string& what, const std::vector<float>& z, int64_t t, bool apart, bool plant_must_fail) {
  SCOPED_TRACE(what);
  const int64_t V = static_cast<int64_t>(z.size());
  const float g = 0.37f;
  double mx = -INFINITY;
  for (float x : z) mx = std::max(mx, double(x));
  double s = 0.0, sz = 0.0;
  for (float x : z) s += std::exp(double(x) - mx);
  const double lse = mx + std::log(s);
  for (float x : z) sz += std::exp(double(x) - lse) * double(x);
  const RowResult r = window_row(z, t, g);
  EXPECT_EQ(r.apart, apart);
  EXPECT_NEAR(r.lse, lse, 2e-6 * (1.0 + std::abs(lse)));
  EXPECT_NEAR(r.entropy, lse - sz, 5e-6);
  std::vector<double> want(V);
  for (int64_t j = 0; j < V; ++j) want[j] = g * (std::exp(double(z[j]) - lse) - (j == t ? 1.0 : 0.0));
  const double entry_abs = 1e-7 * g * (1.0 + std::abs(z[t]));
  auto allowed = [&](int64_t j) { return std::ldexp(1.0, -8) * 1.01 * std::abs(want[j]) + (j == t ? entry_abs : 0.0); };
  int bad = 0;
  for (int64_t j = 0; j < V; ++j) {
    if (!(std::abs(r.dlogits[j] - want[j]) <= allowed(j)) && ++bad <= 3) {
      ADD_FAILURE() << "dlogits[" << j << "] " << r.dlogits[j] << " against " << want[j] << " (allowed " << allowed(j) << ")";
    }
  }
  EXPECT_EQ(bad, 0);
  // The mean signed relative error of the entries other than the target: bf16's rounding is
  // unbiased (about 2^-8 / sqrt(3 n) of noise over n entries), a scale error is not.
  auto bias = [&](const RowResult& x) {
    double m = 0.0;
    for (int64_t j = 0; j < V; ++j)
      if (j != t) m += x.dlogits[j] / want[j] - 1.0;
    return m / double(V - 1);
  };
  if (V >= 100) {
    EXPECT_NEAR(bias(r), 0.0, 1e-3);
  }
  if (plant_must_fail) {
    EXPECT_GT(std::abs(bias(window_row(z, t, g, 1.005f))), 2e-3) << "a 0.5% error in r passes";
  }
}

TEST(WindowMath, RowMergeMatchesFloat64) {
  std::mt19937_64 rng(20261207);
  std::normal_distribution<float> normal(0.0f, 2.5f);
  for (const int64_t V : {int64_t(1000), int64_t(2), int64_t(385)}) {
    std::vector<float> z(V);
    for (auto& x : z) x = normal(rng);
    const int64_t t = V / 3;
    const bool wide = V >= 385;
    expect_row("ordinary, V " + std::to_string(V), z, t, false, wide);
    std::vector<float> peaked = z;
    peaked[t] += 12.0f;
    expect_row("peaked, V " + std::to_string(V), peaked, t, false, false);
    std::vector<float> hot = z;
    hot[t] = 60.0f;  // 87 powers of two: its tile takes its own offset
    expect_row("hot, V " + std::to_string(V), hot, t, V > kWindowTile, false);
    std::vector<float> cold = z;
    for (auto& x : cold) x -= 60.0f;
    // every tile its own offset: apart unless every tile's maximum rounds to the same one
    const RowResult c = window_row(cold, t, 1.0f);
    expect_row("cold, V " + std::to_string(V), cold, t, c.apart, wide);
  }
}

TEST(WindowMath, ArgmaxOrderIsTorchs) {
  EXPECT_TRUE(wm::ahead(2.0f, 5, 1.0f, 0));
  EXPECT_FALSE(wm::ahead(1.0f, 0, 2.0f, 5));
  EXPECT_TRUE(wm::ahead(1.0f, 3, 1.0f, 7)) << "ties: the lower column";
  EXPECT_FALSE(wm::ahead(1.0f, 7, 1.0f, 3));
  EXPECT_TRUE(wm::ahead(NAN, 9, INFINITY, 0)) << "a NaN before any number";
  EXPECT_TRUE(wm::ahead(NAN, 2, NAN, 9)) << "the first NaN";
  EXPECT_FALSE(wm::ahead(-INFINITY, 0, -INFINITY, 0));
}

}  // namespace
}  // namespace fusedce_test
