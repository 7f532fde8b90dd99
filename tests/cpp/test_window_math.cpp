// The linear form's window arithmetic (src/cuda/linear/window_math.h) on the CPU, against float64:
// one row's logits split into 192-wide tiles as the window product's epilogue sees them (each
// tile's own offset m, the offset it takes, its sum of E and its centred entropy partial, in
// float32 as the epilogue forms them), merged by the functions the merge kernel calls, then the
// row's dlogits r (c E - d onehot) after the rebase. Rows: ordinary (logits N(0, 2.5^2)), peaked,
// hot (the target 60 nats up: its tile takes its own offset), cold (every logit 60 nats down),
// and V = 2; with z-loss (a = w_t + 2 z_loss lse) also a negative a and an a that cancels to
// rounding (the row rescaled by c), and a class weight of 0.
// Tolerances: lse and entropy from float32 sums of V terms: 2e-6 (1 + |lse|) and 5e-6 absolute;
// dlogits from bf16 E (round to nearest: at most 2^-8 relative each) against float64 g (a p -
// w_t onehot): 1.01 2^-8 of each entry; at the target 1e-7 g (|w_t| + |a|) (1 + |z_t|) more: its
// entry is the float32 difference c 2^(z_t log2 e - K) - d, a few float32 units of d (the
// epilogue's z log2 e carries |z| float32 units), times r, with r d = g w_t; that is what a hot
// row's target carries where its true dlogit, g (p_t - 1), is ~1e-22 g. And g p_j times a's own
// float32 error (2 z_loss 2e-6 (1 + |lse|) from the lse, 1e-6 |w_t| from the sum), which is all an
// a that cancels to rounding holds. The mean signed relative error of the other entries within
// 1e-3 of 0 (rows of 100 entries or more where a does not cancel), which a 0.5% error in r fails
// (checked).
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
  std::vector<double> dlogits;  // r (c E - d onehot) after the rebase and the target's rewrite
  bool apart;
  float rescale;  // c
  float q;        // label smoothing's factor of the uniform term, -g eps / V (0 without)
};

/// The window form of one row: epilogue, merge and rebase as the kernels do them, with the host's
/// exp2f for the device's ex2.approx (both within a few float32 units) and bf16 E; class weight
/// wt, z-loss zl, soft-cap cap (z here the scaled logits before it), label smoothing eps with the
/// class weights' sum wsum (the dlogits leave out its uniform term: r.q carries it).
RowResult window_row(const std::vector<float>& z, int64_t t, float g, float wt = 1.0f, float zl = 0.0f,
                     float cap = 0.0f, float plant = 1.0f, float eps = 0.0f, float wsum = 0.0f) {
  const int64_t V = static_cast<int64_t>(z.size()), tiles = window_tiles(V);
  std::vector<float> sum(tiles), off(tiles), centred(tiles);
  std::vector<uint16_t> e(V);
  for (int64_t k = 0; k < tiles; ++k) {
    const int64_t c0 = k * kWindowTile, c1 = std::min(V, c0 + kWindowTile);
    auto y_of = [&](int64_t j) { return cap > 0.0f ? std::tanh(z[j] / cap) * (cap * wm::kLog2e) : z[j] * wm::kLog2e; };
    float mx = -INFINITY;
    for (int64_t j = c0; j < c1; ++j) mx = std::max(mx, y_of(j));
    const float m = std::ceil(mx), kt = window_offset(m);
    float s = 0.0f, u = 0.0f;
    for (int64_t j = c0; j < c1; ++j) {
      const float y = y_of(j), ej = std::exp2(y - kt);
      s += ej;
      u = std::fma(ej, y - m, u);
      const float tj = y * (1.0f / (cap * wm::kLog2e));
      e[j] = fusedce::detail::float_to_bf16(cap > 0.0f ? ej * std::fma(-tj, tj, 1.0f) : ej);
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
  fusedce::detail::LossConstants lc{};
  lc.one_minus_eps = 1.0f - eps;
  lc.eps = eps;
  lc.eps_over_v = static_cast<float>(double(eps) / double(V));
  lc.weight_sum = wsum;
  lc.z_loss = zl;
  lc.logit_scale = 1.0f;
  lc.softcap = cap;
  lc.inv_softcap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const float zt = fusedce::detail::transform_logit(z[t], lc, cap > 0.0f);
  const fusedce::detail::RowGrad rg = fusedce::detail::row_grad(lc, wm::lse(K, S), wt, g);
  const wm::RowFactor rf = wm::row_factor(rg.g_a, rg.g_bt, S);
  r.rescale = rf.rescale;
  r.q = -rg.g_c;
  const float rr = rf.r * plant;
  r.dlogits.resize(V);
  for (int64_t j = 0; j < V; ++j) {
    // the rebase: each tile's E into the frame of K (a power of two) and the row's factor c
    const float f = wm::factor(off[j / kWindowTile], K) * rf.rescale;
    float ej = fusedce::detail::bf16_to_float(fusedce::detail::float_to_bf16(fusedce::detail::bf16_to_float(e[j]) * f));
    if (j == t) ej = fusedce::detail::bf16_to_float(fusedce::detail::float_to_bf16(wm::target_entry(zt, K, rf, cap)));
    r.dlogits[j] = double(rr) * ej;
  }
  return r;
}

/// The checks of one row (header); `plant_must_fail`: the planted 0.5% in r must fail the row's
/// mean relative error (rows of hundreds of entries).
void expect_row(const std::string& what, const std::vector<float>& x, int64_t t, bool apart, bool plant_must_fail,
                float wt = 1.0f, float zl = 0.0f, float cap = 0.0f) {
  SCOPED_TRACE(what);
  const int64_t V = static_cast<int64_t>(x.size());
  const float g = 0.37f;
  // the logits after the soft-cap, and dz/dx (1 without it)
  std::vector<double> z(V), dz(V, 1.0);
  for (int64_t j = 0; j < V; ++j) {
    const double th = cap > 0.0f ? std::tanh(double(x[j]) / cap) : 0.0;
    z[j] = cap > 0.0f ? cap * th : double(x[j]);
    if (cap > 0.0f) dz[j] = 1.0 - th * th;
  }
  double mx = -INFINITY;
  for (double v : z) mx = std::max(mx, v);
  double s = 0.0, sz = 0.0;
  for (double v : z) s += std::exp(v - mx);
  const double lse = mx + std::log(s);
  for (double v : z) sz += std::exp(v - lse) * v;
  const RowResult r = window_row(x, t, g, wt, zl, cap);
  EXPECT_EQ(r.apart, apart);
  EXPECT_NEAR(r.lse, lse, 2e-6 * (1.0 + std::abs(lse)));
  EXPECT_NEAR(r.entropy, lse - sz, 5e-6);
  const double a = wt + 2.0 * zl * lse;
  std::vector<double> want(V);
  for (int64_t j = 0; j < V; ++j) want[j] = g * (a * std::exp(z[j] - lse) - (j == t ? wt : 0.0)) * dz[j];
  const double entry_abs = 1e-7 * g * (std::abs(wt) + std::abs(a)) * (1.0 + std::abs(z[t]));
  const double a_err = 2.0 * zl * 2e-6 * (1.0 + std::abs(lse)) + 1e-6 * std::abs(wt);
  auto allowed = [&](int64_t j) {
    return std::ldexp(1.0, -8) * 1.01 * std::abs(want[j]) + (j == t ? entry_abs : 0.0) +
           g * a_err * std::exp(z[j] - lse);
  };
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
  const bool cancels = std::abs(a) < 1e-3 * std::abs(wt);
  if (V >= 100 && !cancels) {
    EXPECT_NEAR(bias(r), 0.0, 1e-3);
  }
  if (plant_must_fail) {
    EXPECT_GT(std::abs(bias(window_row(x, t, g, wt, zl, cap, 1.005f))), 2e-3) << "a 0.5% error in r passes";
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

// z-loss: a = w_t + 2 z_loss lse scales the softmax, w_t the target term. Positive a (ordinary
// rows), negative a (cold rows, lse about -50, with z_loss 0.03), an a that cancels to rounding
// (the class weight set to -2 z_loss lse: the row rescaled by c = a / w_t, r = g w_t / S) and a
// class weight of 0 (no target term); without z-loss the factor is the plain one, d = S exactly.
TEST(WindowMath, ZLossRowFactorMatchesFloat64) {
  const wm::RowFactor plain = wm::row_factor(0.37f * 1.3f, 0.37f * 1.3f, 5.5f);
  EXPECT_EQ(plain.rescale, 1.0f);
  EXPECT_EQ(plain.shift, 5.5f);
  EXPECT_EQ(plain.r, 0.37f * 1.3f / 5.5f);
  const wm::RowFactor none = wm::row_factor(0.0f, 0.0f, 5.5f);
  EXPECT_EQ(none.r, 0.0f) << "g = 0: no gradient";
  EXPECT_EQ(none.shift, 0.0f);
  std::mt19937_64 rng(20261208);
  std::normal_distribution<float> normal(0.0f, 2.5f);
  for (const int64_t V : {int64_t(1000), int64_t(385)}) {
    std::vector<float> z(V);
    for (auto& x : z) x = normal(rng);
    const int64_t t = V / 3;
    const std::string v = ", V " + std::to_string(V);
    expect_row("z-loss, ordinary" + v, z, t, false, true, 1.3f, 1e-3f);
    std::vector<float> hot = z;
    hot[t] = 60.0f;
    expect_row("z-loss, hot" + v, hot, t, true, false, 0.7f, 1e-3f);
    std::vector<float> cold = z;
    for (auto& x : cold) x -= 60.0f;
    const RowResult c = window_row(cold, t, 1.0f);
    expect_row("z-loss, cold, negative a" + v, cold, t, c.apart, true, 1.0f, 0.03f);
    double mx = -INFINITY, s = 0.0;
    for (float x : cold) mx = std::max(mx, double(x));
    for (float x : cold) s += std::exp(double(x) - mx);
    const float wt = static_cast<float>(-2.0 * 0.01 * (mx + std::log(s)));
    EXPECT_NE(window_row(cold, t, 0.37f, wt, 0.01f).rescale, 1.0f) << "a cancelling a takes the rescale";
    expect_row("z-loss, cold, a cancels" + v, cold, t, c.apart, false, wt, 0.01f);
    expect_row("z-loss, class weight 0" + v, z, t, false, true, 0.0f, 1e-3f);
  }
}

// The soft-cap: z = c tanh(x / c), the stored entries E (1 - (z / c)^2) and the target's entry
// times its own factor; the sums, lse and entropy over the capped logits. Ordinary rows with a cap
// that bends them (c = 5 against logits N(0, 2.5^2)), a hot target (x = 60: capped to c, every
// tile within the window), with z-loss, and the cap wide open (c = 1e4: the plain row's numbers).
TEST(WindowMath, SoftcapRowMatchesFloat64) {
  EXPECT_EQ(wm::cap_factor(3.0f, 0.0f), 1.0f);
  EXPECT_FLOAT_EQ(wm::cap_factor(2.5f, 5.0f), 0.75f);
  std::mt19937_64 rng(20261209);
  std::normal_distribution<float> normal(0.0f, 2.5f);
  for (const int64_t V : {int64_t(1000), int64_t(385), int64_t(2)}) {
    std::vector<float> x(V);
    for (auto& v : x) v = normal(rng);
    const int64_t t = V / 3;
    const bool wide = V >= 385;
    const std::string v = ", V " + std::to_string(V);
    expect_row("soft-cap 5" + v, x, t, false, wide, 1.0f, 0.0f, 5.0f);
    std::vector<float> hot = x;
    hot[t] = 60.0f;
    expect_row("soft-cap 5, hot" + v, hot, t, false, false, 1.0f, 0.0f, 5.0f);
    expect_row("soft-cap 5, z-loss, class weight" + v, x, t, false, wide, 1.3f, 1e-3f, 5.0f);
    expect_row("soft-cap 1e4" + v, x, t, false, wide, 1.0f, 0.0f, 1e4f);
  }
}

// Label smoothing without the soft-cap: the rows' dlogits are r (c E - d onehot) + q_i v_j (q_i =
// -g eps / V, v the class weights or 1). The loss's row sum comes from scale (h . sum_j v_j w_j +
// sum_j v_j b_j); grad_weight's and grad_bias's share v u^T and v sum_i q_i (u = sum_i q_i h_i) ride
// kSmoothRows extra rows of the products' K, each factor split in two bf16 (smooth_part); grad_hidden's
// is q_i sum_j v_j w_j. A small head (24 rows, H 16, V 385, a bias; ordinary, hot and cold rows,
// ignored rows with q 0), eps 0.1 unweighted, and eps 0.2 with class weights (not bf16 numbers) and
// z-loss, against float64. Tolerances: the loss 2e-6 (1 + |lse| + max |z|) times its lse factor (the
// float32 sums); the rank-one share 2^-15 of sum_i |q_i h_i| |v_j| (the dropped v_lo u_lo is 2^-18,
// float32 sums far less); the whole gradients 1.01 2^-8 of the sum of their terms' magnitudes, |r E'|
// and |q v| apart (E's entries within 2^-8 of theirs: bf16, rebased), plus 1e-6 of the largest.
// Each planted fault fails: q's sign flipped, the third extra row dropped (v_lo u_hi: 2^-9 of the
// class-weighted share), the bias left out of the row sum.
enum class SmoothPlant { kNone, kQSign, kDropRow, kNoBias };

struct SmoothErrors {
  double loss = 0.0, rank1 = 0.0, grads = 0.0;  // the largest error over its allowance
};

SmoothErrors smoothing_head(bool weighted, SmoothPlant plant) {
  const int64_t N = 24, H = 16, V = 385;
  const float eps = weighted ? 0.2f : 0.1f, zl = weighted ? 1e-3f : 0.0f;
  std::mt19937_64 rng(weighted ? 20261210 : 20261211);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto bf = [](float x) { return fusedce::detail::bf16_to_float(fusedce::detail::float_to_bf16(x)); };
  std::vector<float> w(V * H), b(V), h(N * H), v(V, 1.0f), g(N);
  for (int64_t j = 0; j < V; ++j)
    for (int64_t k = 0; k < H; ++k) w[j * H + k] = bf(k == 0 ? 1.0f : normal(rng) * 2.0f / std::sqrt(float(H)));
  for (auto& x : b) x = bf(normal(rng));
  if (weighted)
    for (auto& x : v) x = 0.27f + static_cast<float>(rng() % 100) / 47.0f;
  std::vector<int64_t> tgt(N);
  for (int64_t i = 0; i < N; ++i) {
    tgt[i] = i % 6 == 4 ? -1 : static_cast<int64_t>(rng() % V);
    g[i] = 0.5f + static_cast<float>(rng() % 100) / 100.0f;
    for (int64_t k = 0; k < H; ++k) {
      float x = normal(rng);
      if (i % 5 == 2 && tgt[i] >= 0) x = 12.0f * w[tgt[i] * H + k];  // hot: z_t about 48
      if (i % 7 == 3 && k == 0) x = -60.0f;                          // cold: every logit about -60
      h[i * H + k] = bf(x);
    }
  }
  double wsum = 0.0;
  for (float x : v) wsum += x;
  // sum_j v_j w_j and sum_j v_j b_j as the column sums form them (float32, in row order)
  std::vector<float> vw(H, 0.0f);
  float vb = 0.0f;
  for (int64_t j = 0; j < V; ++j) {
    for (int64_t k = 0; k < H; ++k) vw[k] = std::fma(v[j], w[j * H + k], vw[k]);
    vb = std::fma(v[j], b[j], vb);
  }
  fusedce::detail::LossConstants lc{};
  lc.one_minus_eps = 1.0f - eps;
  lc.eps = eps;
  lc.eps_over_v = static_cast<float>(double(eps) / double(V));
  lc.inv_v = static_cast<float>(1.0 / double(V));
  lc.z_loss = zl;
  lc.logit_scale = 1.0f;
  lc.weight_sum = static_cast<float>(wsum);

  SmoothErrors err;
  std::vector<double> gw(V * H, 0.0), gb(V, 0.0), gh(N * H, 0.0);            // the window form's
  std::vector<double> gw_ref(V * H, 0.0), gb_ref(V, 0.0), gh_ref(N * H, 0.0);  // float64
  std::vector<double> gw_abs(V * H, 0.0), gb_abs(V, 0.0), gh_abs(N * H, 0.0);  // sums of |terms|
  std::vector<float> q(N, 0.0f);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = tgt[i];
    if (t < 0) continue;  // ignored: q 0, no dlogits
    std::vector<double> z(V);
    std::vector<float> zf(V);
    for (int64_t j = 0; j < V; ++j) {
      double x = b[j];
      for (int64_t k = 0; k < H; ++k) x += double(h[i * H + k]) * w[j * H + k];
      z[j] = x, zf[j] = static_cast<float>(x);
    }
    double mx = -INFINITY, s = 0.0, zmax = 0.0, sm = 0.0;
    for (double x : z) mx = std::max(mx, x), zmax = std::max(zmax, std::abs(x));
    for (double x : z) s += std::exp(x - mx);
    const double lse = mx + std::log(s);
    for (int64_t j = 0; j < V; ++j) sm += v[j] * (lse - z[j]);
    const double wt = v[t];
    const double a = (1.0 - eps) * wt + eps / V * wsum + 2.0 * zl * lse;
    const double loss_ref = (1.0 - eps) * wt * (lse - z[t]) + eps / V * sm + zl * lse * lse;

    const RowResult r = window_row(zf, t, g[i], v[t], zl, 0.0f, 1.0f, eps, static_cast<float>(wsum));
    q[i] = plant == SmoothPlant::kQSign ? -r.q : r.q;
    float hv = 0.0f;
    for (int64_t k = 0; k < H; ++k) hv = std::fma(h[i * H + k], vw[k], hv);
    const float ssum = wm::smooth_sum(1.0f, hv, plant == SmoothPlant::kNoBias ? 0.0f : vb);
    const float loss = fusedce::detail::row_loss(lc, static_cast<float>(r.lse), zf[t], v[t], ssum, weighted);
    const double lse_factor = (1.0 - eps) * wt + eps * wsum / V + 2.0 * zl * std::abs(lse);
    err.loss = std::max(err.loss, std::abs(loss - loss_ref) / (2e-6 * (1.0 + std::abs(lse) + zmax) * lse_factor));
    for (int64_t j = 0; j < V; ++j) {
      const double d = g[i] * (a * std::exp(z[j] - lse) - (j == t ? (1.0 - eps) * wt : 0.0) - eps / V * v[j]);
      // the terms' magnitudes: E's share and the uniform term's, each rounded on its own
      const double m = std::abs(r.dlogits[j]) + std::abs(double(r.q) * v[j]);
      gb_ref[j] += d, gb_abs[j] += m, gb[j] += r.dlogits[j];
      for (int64_t k = 0; k < H; ++k) {
        gw_ref[j * H + k] += d * h[i * H + k], gw_abs[j * H + k] += m * std::abs(h[i * H + k]);
        gw[j * H + k] += r.dlogits[j] * h[i * H + k];
        gh_ref[i * H + k] += d * w[j * H + k], gh_abs[i * H + k] += m * std::abs(w[j * H + k]);
        gh[i * H + k] += r.dlogits[j] * w[j * H + k];
      }
    }
    for (int64_t k = 0; k < H; ++k) gh[i * H + k] += double(q[i]) * vw[k];
  }
  // the products' extra rows: E's hold v's parts, the other operand's u's (and sum_i q_i's)
  std::vector<float> u(H + 1, 0.0f);
  std::vector<double> u_abs(H + 1, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t k = 0; k < H; ++k) u[k] = std::fma(q[i], h[i * H + k], u[k]), u_abs[k] += std::abs(double(q[i]) * h[i * H + k]);
    u[H] += q[i], u_abs[H] += std::abs(q[i]);
  }
  const int rows = plant == SmoothPlant::kDropRow ? static_cast<int>(fusedce::cuda::kSmoothRows) - 1
                                                  : static_cast<int>(fusedce::cuda::kSmoothRows);
  for (int64_t j = 0; j < V; ++j) {
    const wm::Split vs = wm::split_bf16(v[j]);
    for (int64_t k = 0; k <= H; ++k) {
      const wm::Split us = wm::split_bf16(u[k]);
      double share = 0.0;  // the K sum over the extra rows: float32 products of bf16 parts
      for (int e = 0; e < rows; ++e) share += double(bf(wm::smooth_part(vs, e, true))) * bf(wm::smooth_part(us, e, false));
      err.rank1 = std::max(err.rank1, std::abs(share - double(v[j]) * u[k]) / (std::ldexp(1.0, -15) * v[j] * u_abs[k]));
      (k < H ? gw[j * H + k] : gb[j]) += share;
    }
  }
  auto grads = [&](const std::vector<double>& got, const std::vector<double>& ref, const std::vector<double>& abs) {
    double mx = 0.0;
    for (double x : ref) mx = std::max(mx, std::abs(x));
    for (size_t k = 0; k < ref.size(); ++k)
      err.grads = std::max(err.grads, std::abs(got[k] - ref[k]) / (1.01 * std::ldexp(1.0, -8) * abs[k] + 1e-6 * mx));
  };
  grads(gw, gw_ref, gw_abs);
  grads(gb, gb_ref, gb_abs);
  grads(gh, gh_ref, gh_abs);
  return err;
}

TEST(WindowMath, SmoothingRowsMatchFloat64) {
  const wm::Split one = wm::split_bf16(1.0f);
  EXPECT_EQ(one.hi, 1.0f);
  EXPECT_EQ(one.lo, 0.0f);
  const wm::Split x = wm::split_bf16(0.27f);
  EXPECT_NE(x.lo, 0.0f);
  EXPECT_LE(std::abs(double(x.hi) + x.lo - 0.27f), std::ldexp(0.27, -17));
  for (const bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "eps 0.2, class weights, z-loss" : "eps 0.1");
    const SmoothErrors e = smoothing_head(weighted, SmoothPlant::kNone);
    EXPECT_LE(e.loss, 1.0);
    EXPECT_LE(e.rank1, 1.0);
    EXPECT_LE(e.grads, 1.0);
    EXPECT_GT(smoothing_head(weighted, SmoothPlant::kQSign).grads, 1.0) << "q's sign flipped passes";
    EXPECT_GT(smoothing_head(weighted, SmoothPlant::kNoBias).loss, 1.0) << "the row sum without the bias passes";
    if (weighted) {
      EXPECT_GT(smoothing_head(weighted, SmoothPlant::kDropRow).rank1, 1.0) << "a dropped extra row passes";
    }
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
