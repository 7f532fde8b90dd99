// Fused linear cross-entropy (CPU backend) against a float64 reference built here from the SPEC
// formulas: logits = hidden . weight^T + bias in double, then the cross-entropy terms, then
// grad_hidden = dX . W, grad_weight = dX^T . hidden, grad_bias = colsum(dX).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fusedce/fusedce.h"
#include "problem.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

struct LinCase {
  std::string name;
  int64_t N, H, V;
  fusedce::Options o;
  bool bias = false;
  int64_t shift = 0;
};

struct RefResult {
  std::vector<double> loss_rows, lse;  // N
  double loss = 0.0, entropy = 0.0;
  int64_t correct = 0;
  std::vector<double> gh, gw, gb;
};

// The float64 reference. Inputs are the already rounded values (exact in double).
RefResult reference(const LinCase& lc, const std::vector<double>& hid, const std::vector<double>& w,
                    const std::vector<double>& b, const std::vector<int64_t>& tgt, const std::vector<double>& cw,
                    const std::vector<double>& up) {
  const int64_t N = lc.N, H = lc.H, V = lc.V;
  const fusedce::Options& o = lc.o;
  RefResult r;
  r.loss_rows.assign(N, 0.0);
  r.lse.assign(N, 0.0);
  r.gh.assign(N * H, 0.0);
  r.gw.assign(V * H, 0.0);
  r.gb.assign(V, 0.0);
  auto wc = [&](int64_t j) { return cw.empty() ? 1.0 : cw[j]; };
  double W = 0.0, den = 0.0;
  for (int64_t j = 0; j < V; ++j) W += wc(j);
  auto eff = [&](int64_t i) -> int64_t {
    if (lc.shift > 0) return i % lc.shift == lc.shift - 1 ? o.ignore_index : tgt[i + 1];
    return tgt[i];
  };
  for (int64_t i = 0; i < N; ++i)
    if (eff(i) != o.ignore_index) den += wc(eff(i));
  const double eps = o.label_smoothing;
  std::vector<double> z(V), x(V);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = eff(i);
    if (t == o.ignore_index) continue;
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) {
      double acc = lc.bias ? b[j] : 0.0;
      for (int64_t h = 0; h < H; ++h) acc += hid[i * H + h] * w[j * H + h];
      x[j] = acc;
      z[j] = o.softcap > 0 ? o.softcap * std::tanh(o.logit_scale * acc / o.softcap) : o.logit_scale * acc;
      m = std::max(m, z[j]);
    }
    double s = 0.0, pz = 0.0, smooth = 0.0;
    int64_t am = 0;
    for (int64_t j = 0; j < V; ++j) {
      s += std::exp(z[j] - m);
      smooth += wc(j) * z[j];
      if (z[j] > z[am]) am = j;
    }
    const double lse = m + std::log(s);
    for (int64_t j = 0; j < V; ++j) pz += std::exp(z[j] - lse) * z[j];
    double loss = (1 - eps) * wc(t) * (lse - z[t]);
    if (eps != 0) loss += eps / V * (W * lse - smooth);
    loss += o.z_loss * lse * lse;
    r.loss_rows[i] = loss;
    r.lse[i] = lse;
    r.entropy += lse - pz;
    r.correct += am == t;
    const double g = (o.reduction == Reduction::kMean ? 1.0 / den : 1.0) * (up.empty() ? 1.0 : up[o.reduction == Reduction::kNone ? i : 0]);
    const double a = (1 - eps) * wc(t) + eps / V * W + 2 * o.z_loss * lse;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(z[j] - lse);
      double dz = g * (a * p - (j == t ? (1 - eps) * wc(t) : 0.0) - eps / V * wc(j));
      const double dzdx = o.softcap > 0 ? o.logit_scale * (1 - std::pow(z[j] / o.softcap, 2)) : o.logit_scale;
      const double dx = dz * dzdx;
      r.gb[j] += dx;
      for (int64_t h = 0; h < H; ++h) {
        r.gh[i * H + h] += dx * w[j * H + h];
        r.gw[j * H + h] += dx * hid[i * H + h];
      }
    }
  }
  double total = 0.0;
  for (double l : r.loss_rows) total += l;
  r.loss = o.reduction == Reduction::kMean ? total / den : total;
  return r;
}

struct Tol {
  double rtol, atol;
};
Tol loss_tol(DType) { return {2e-5, 2e-6}; }
// Gradients: float32 sums over H or N terms, then one rounding to the dtype.
Tol grad_tol(DType d) { return d == DType::kFloat32 ? Tol{1e-4, 1e-5} : d == DType::kBFloat16 ? Tol{1e-2, 4e-3} : Tol{2e-3, 1e-3}; }

void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref, Tol t) {
  double scale = 0.0;
  for (double v : ref) scale = std::max(scale, std::fabs(v));
  int bad = 0;
  for (size_t k = 0; k < ref.size(); ++k) {
    const double allowed = t.rtol * std::fabs(ref[k]) + t.atol * scale;
    if (std::isnan(ref[k]) && std::isnan(got[k])) continue;  // NaN must meet NaN
    if (!(std::fabs(got[k] - ref[k]) <= allowed)) {
      if (++bad <= 3) ADD_FAILURE() << what << "[" << k << "]: got " << got[k] << ", reference " << ref[k] << " (allowed " << allowed << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " mismatch";
}

struct LinRun {
  std::vector<float> loss, lse;
  float entropy = 0;
  int64_t correct = 0;
  std::vector<uint8_t> gh, gw, gb;
};

LinRun run(const LinCase& lc, DType d, const std::vector<uint8_t>& hid, const std::vector<uint8_t>& w,
        const std::vector<uint8_t>& b, const std::vector<int64_t>& tgt, const std::vector<float>& cw,
        const std::vector<float>& up, bool metrics, fusedce::Status* status) {
  LinRun r;
  const int64_t N = lc.N, H = lc.H, V = lc.V;
  fusedce::Options o = lc.o;
  o.compute_metrics = metrics;
  if (!cw.empty()) o.class_weight = fusedce::vector(const_cast<float*>(cw.data()), DType::kFloat32, V);
  r.loss.assign(o.reduction == Reduction::kNone ? N : 1, 0.0f);
  r.lse.assign(N, 0.0f);
  r.gh.assign(N * H * elem_size(d), 0);
  r.gw.assign(V * H * elem_size(d), 0);
  r.gb.assign(V * elem_size(d), 0);
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(r.loss.data(), DType::kFloat32, r.loss.size());
  out.lse = fusedce::vector(r.lse.data(), DType::kFloat32, N);
  if (metrics) {
    out.num_correct = fusedce::vector(&r.correct, DType::kInt64, 1);
    out.entropy_sum = fusedce::vector(&r.entropy, DType::kFloat32, 1);
  }
  fusedce::LinearOptions lo;
  lo.shift_seq_len = lc.shift;
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(r.gh.data(), d, N, H);
  g.grad_weight = fusedce::matrix(r.gw.data(), d, V, H);
  if (lc.bias) g.grad_bias = fusedce::vector(r.gb.data(), d, V);
  *status = fusedce::linear_cross_entropy_forward_backward(
      fusedce::Device::cpu(), fusedce::matrix(const_cast<uint8_t*>(hid.data()), d, N, H),
      fusedce::matrix(const_cast<uint8_t*>(w.data()), d, V, H),
      lc.bias ? fusedce::vector(const_cast<uint8_t*>(b.data()), d, V) : fusedce::VectorView{},
      fusedce::vector(const_cast<int64_t*>(tgt.data()), DType::kInt64, N), o, lo, out,
      up.empty() ? fusedce::VectorView{} : fusedce::vector(const_cast<float*>(up.data()), DType::kFloat32, up.size()), g);
  return r;
}

std::vector<LinCase> cases() {
  std::vector<LinCase> v;
  // N=3, H=67, V=1001: odd everything (the shape); smaller shapes carry the option grid.
  for (auto shape : {std::array<int64_t, 3>{3, 67, 1001}, std::array<int64_t, 3>{37, 19, 300}}) {
    auto add = [&](std::string name, auto tweak) {
      LinCase c;
      c.N = shape[0];
      c.H = shape[1];
      c.V = shape[2];
      c.name = name + "_N" + std::to_string(c.N) + "_H" + std::to_string(c.H) + "_V" + std::to_string(c.V);
      tweak(c);
      v.push_back(c);
    };
    add("plain", [](LinCase&) {});
    add("label_smoothing", [](LinCase& c) { c.o.label_smoothing = 0.1f; });
    add("logit_scale", [](LinCase& c) { c.o.logit_scale = 0.7f; });
    add("softcap", [](LinCase& c) { c.o.softcap = 3.0f; });
    add("z_loss", [](LinCase& c) { c.o.z_loss = 1e-2f; });
    add("class_weight", [](LinCase& c) { c.o.label_smoothing = 0.05f; c.name += "_w"; });
    add("bias", [](LinCase& c) { c.bias = true; });
    add("sum", [](LinCase& c) { c.o.reduction = Reduction::kSum; });
    add("none", [](LinCase& c) { c.o.reduction = Reduction::kNone; });
    add("all", [](LinCase& c) {
      c.o.label_smoothing = 0.1f;
      c.o.logit_scale = 0.9f;
      c.o.softcap = 5.0f;
      c.o.z_loss = 1e-3f;
      c.bias = true;
    });
  }
  LinCase s;
  s.name = "shift_N40_H16_V97";
  s.N = 40;
  s.H = 16;
  s.V = 97;
  s.shift = 8;
  s.bias = true;
  v.push_back(s);
  return v;
}

class LinearGrid : public ::testing::TestWithParam<std::tuple<LinCase, DType>> {};

TEST_P(LinearGrid, MatchesFloat64Reference) {
  const LinCase& lc = std::get<0>(GetParam());
  const DType d = std::get<1>(GetParam());
  std::mt19937_64 rng = test_rng();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t N = lc.N, H = lc.H, V = lc.V;
  std::vector<uint8_t> hid(N * H * elem_size(d)), w(V * H * elem_size(d)), b(V * elem_size(d));
  std::vector<double> hd(N * H), wd(V * H), bd(V), cwd;
  // Logits of order a few units, with a few outliers so the softmax is not flat.
  for (int64_t k = 0; k < N * H; ++k) {
    store_value(hid.data(), d, k, normal(rng));
    hd[k] = load_value(hid.data(), d, k);
  }
  const float wscale = 2.0f / std::sqrt(static_cast<float>(H));
  for (int64_t k = 0; k < V * H; ++k) {
    store_value(w.data(), d, k, normal(rng) * wscale * (rng() % 50 == 0 ? 4.0f : 1.0f));
    wd[k] = load_value(w.data(), d, k);
  }
  for (int64_t j = 0; j < V; ++j) {
    store_value(b.data(), d, j, normal(rng));
    bd[j] = load_value(b.data(), d, j);
  }
  std::vector<int64_t> tgt(N);
  for (auto& t : tgt) t = rng() % 10 < 3 ? -100 : static_cast<int64_t>(rng() % V);
  tgt[lc.shift > 0 ? 1 : 0] = static_cast<int64_t>(rng() % V);  // at least one row counts
  std::vector<float> cw;
  if (lc.name.rfind("class_weight", 0) == 0) {
    cw.resize(V);
    for (auto& x : cw) x = 0.25f + static_cast<float>(rng() % 100) / 50.0f;
    cwd.assign(cw.begin(), cw.end());
  }
  std::vector<float> up;
  if (lc.o.reduction == Reduction::kNone) {
    up.resize(N);
    for (auto& u : up) u = 0.5f + static_cast<float>(rng() % 100) / 100.0f;
  } else {
    up = {1.75f};
  }
  const std::vector<double> upd(up.begin(), up.end());
  const RefResult ref = reference(lc, hd, wd, bd, tgt, cwd, upd);

  fusedce::Status st;
  const LinRun got = run(lc, d, hid, w, b, tgt, cw, up, true, &st);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<double> gl(got.loss.begin(), got.loss.end()), glse(got.lse.begin(), got.lse.end());
  expect_close("loss", gl, lc.o.reduction == Reduction::kNone ? ref.loss_rows : std::vector<double>{ref.loss}, loss_tol(d));
  expect_close("lse", glse, ref.lse, loss_tol(d));
  EXPECT_NEAR(got.entropy, ref.entropy, 2e-5 * (std::fabs(ref.entropy) + N));
  EXPECT_EQ(got.correct, ref.correct);
  auto widen = [&](const std::vector<uint8_t>& buf, int64_t n) {
    std::vector<double> v(n);
    for (int64_t k = 0; k < n; ++k) v[k] = load_value(buf.data(), d, k);
    return v;
  };
  expect_close("grad_hidden", widen(got.gh, N * H), ref.gh, grad_tol(d));
  expect_close("grad_weight", widen(got.gw, V * H), ref.gw, grad_tol(d));
  if (lc.bias) expect_close("grad_bias", widen(got.gb, V), ref.gb, grad_tol(d));

  // Metrics on or off: loss and every gradient bit for bit the same.
  const LinRun plain = run(lc, d, hid, w, b, tgt, cw, up, false, &st);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(0, std::memcmp(plain.loss.data(), got.loss.data(), got.loss.size() * sizeof(float)));
  EXPECT_EQ(plain.gh, got.gh);
  EXPECT_EQ(plain.gw, got.gw);
  EXPECT_EQ(plain.gb, got.gb);
}

INSTANTIATE_TEST_SUITE_P(CpuLinear, LinearGrid,
                         ::testing::Combine(::testing::ValuesIn(cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" + fusedce::dtype_name(std::get<1>(info.param));
                         });

TEST(LinearBadInput, NamesTheArgument) {
  std::vector<float> h(4 * 8), w(10 * 8), gw(10 * 8);
  std::vector<int64_t> t(4, 1);
  float loss = 0;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(&loss, DType::kFloat32, 1);
  auto call = [&](fusedce::MatrixView hv, fusedce::MatrixView wv, fusedce::LinearOptions lo, fusedce::LinearGrads g) {
    return fusedce::linear_cross_entropy_forward_backward(fusedce::Device::cpu(), hv, wv, {},
                                                          fusedce::vector(t.data(), DType::kInt64, 4), {}, lo, out, {}, g);
  };
  const auto H = fusedce::matrix(h.data(), DType::kFloat32, 4, 8);
  fusedce::Status s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 7), {}, {});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("weight"), std::string::npos) << s.message();
  s = call(H, fusedce::matrix(w.data(), DType::kBFloat16, 10, 8), {}, {});
  EXPECT_NE(s.message().find("weight"), std::string::npos) << s.message();
  fusedce::LinearOptions lo;
  lo.shift_seq_len = 3;
  s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 8), lo, {});
  EXPECT_NE(s.message().find("shift_seq_len"), std::string::npos) << s.message();
  fusedce::LinearGrads g;
  g.grad_weight = fusedce::matrix(gw.data(), DType::kFloat32, 9, 8);
  s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 8), {}, g);
  EXPECT_NE(s.message().find("grad_weight"), std::string::npos) << s.message();
  t[2] = 10;
  s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 8), {}, {});
  EXPECT_EQ(s.code(), fusedce::StatusCode::kTargetOutOfRange);
  EXPECT_NE(s.message().find("target[2] = 10"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace fusedce_test
