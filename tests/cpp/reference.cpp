#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace fusedce_test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

}  // namespace

RefParams RefParams::from(const fusedce::Options& o, int64_t vocab, const std::vector<float>& class_weight) {
  RefParams p;
  p.vocab = vocab;
  p.eps = o.label_smoothing;
  p.logit_scale = o.logit_scale;
  p.softcap = o.softcap;
  p.z_loss = o.z_loss;
  p.weight.assign(class_weight.begin(), class_weight.end());
  p.reduction = o.reduction;
  p.ignore_index = o.ignore_index;
  p.metrics = o.return_metrics;
  return p;
}

double RefParams::weight_sum() const {
  if (weight.empty()) return static_cast<double>(vocab);
  double s = 0.0;
  for (double w : weight) s += w;
  return s;
}

double RefParams::weight_max() const {
  if (weight.empty()) return 1.0;
  return *std::max_element(weight.begin(), weight.end());
}

void ref_z(const RefParams& p, const double* x, double* z) {
  for (int64_t j = 0; j < p.vocab; ++j) {
    const double s = p.logit_scale * x[j];
    z[j] = p.softcap > 0.0 ? p.softcap * std::tanh(s / p.softcap) : s;
  }
}

RefRow ref_row(const RefParams& p, const double* z, int64_t t) {
  const int64_t V = p.vocab;
  RefRow r;
  r.ignored = false;
  r.target = t;
  r.w_t = p.w(t);

  bool has_nan = false, has_pinf = false;
  double m = -kInf;
  int64_t argmax = 0, first_nan = -1;
  for (int64_t j = 0; j < V; ++j) {
    if (std::isnan(z[j])) {
      has_nan = true;
      if (first_nan < 0) first_nan = j;
      continue;
    }
    if (z[j] == kInf) has_pinf = true;
    if (z[j] > m) {
      m = z[j];
      argmax = j;
    }
  }
  r.argmax = has_nan ? first_nan : argmax;

  if (has_nan || has_pinf) {
    r.lse = kNaN;
  } else if (m == -kInf) {
    r.lse = -kInf;
  } else {
    double s = 0.0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(z[j] - m);
    r.lse = m + std::log(s);
  }
  const double lse = r.lse;

  // loss = (1-eps) w_t (lse - z_t) + eps/V sum_j w_j (lse - z_j) + zl lse^2; a term whose
  // factor is 0 is absent (as in PyTorch, where it is never formed), so inf * 0 gives no NaN.
  // The rounding scale of lse is |lse| + 1: |max| for the rounding of max + log(s), and 1
  // because log(s) comes from a float32 sum whose largest term is exp(0) = 1, so its absolute
  // error is a multiple of float32's epsilon whatever the logits' magnitude.
  const double z_t = z[t];
  const double lse_scale = std::fabs(lse) + 1.0;
  r.loss = (1.0 - p.eps) * r.w_t * (lse - z_t);
  r.loss_scale = (1.0 - p.eps) * r.w_t * (lse_scale + std::fabs(z_t));
  if (p.eps != 0.0) {
    double smooth = 0.0, smooth_scale = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      smooth += p.w(j) * (lse - z[j]);
      smooth_scale += p.w(j) * (lse_scale + std::fabs(z[j]));
    }
    r.loss += p.eps / static_cast<double>(V) * smooth;
    r.loss_scale += p.eps / static_cast<double>(V) * smooth_scale;
  }
  if (p.z_loss != 0.0) {
    r.loss += p.z_loss * lse * lse;
    r.loss_scale += p.z_loss * 2.0 * std::fabs(lse) * lse_scale;
  }

  // Entropy: p_j = exp(z_j - lse); an entry with p_j = 0 (z_j = -inf) contributes nothing.
  if (!p.metrics) {
    r.entropy = 0.0;
  } else if (std::isnan(lse) || lse == -kInf) {
    r.entropy = kNaN;
  } else {
    double pz = 0.0, pz_abs = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      const double pj = std::exp(z[j] - lse);
      if (pj == 0.0) continue;
      pz += pj * z[j];
      pz_abs += pj * std::fabs(z[j]);
    }
    r.entropy = lse - pz;
    r.entropy_scale = std::fabs(lse) + 1.0 + pz_abs;
  }
  return r;
}

void ref_grad(const RefParams& p, const double* z, const RefRow& r, double g,
              double* grad, double* scale) {
  const int64_t V = p.vocab;
  const double eps_v = p.eps / static_cast<double>(V);
  const double b_t = (1.0 - p.eps) * r.w_t;
  const double a = b_t + eps_v * p.weight_sum() + 2.0 * p.z_loss * r.lse;
  double max_dzdx = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    double dzdx = p.logit_scale;
    if (p.softcap > 0.0) {
      const double th = z[j] / p.softcap;  // = tanh(logit_scale * x_j / softcap)
      dzdx = p.logit_scale * (1.0 - th * th);
    }
    if (!std::isnan(dzdx)) max_dzdx = std::max(max_dzdx, std::fabs(dzdx));
    const double pj = std::exp(z[j] - r.lse);
    double d = a * pj - eps_v * p.w(j);
    if (j == r.target) d -= b_t;
    grad[j] = g * d * dzdx;
  }
  *scale = std::fabs(g) * (std::fabs(a) + b_t + eps_v * p.weight_max()) * max_dzdx;
}

Reference::Reference(const Problem& problem, const fusedce::Options& options)
    : problem_(problem), params_(RefParams::from(options, problem.vocab, problem.class_weight)) {
  const int64_t N = problem.rows, V = problem.vocab;
  rows_.resize(N);
  std::vector<double> x(V), z(V);
  double total = 0.0, total_scale = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = problem.target[i];
    if (t == params_.ignore_index) continue;
    problem.load_row(i, x.data());
    ref_z(params_, x.data(), z.data());
    rows_[i] = ref_row(params_, z.data(), t);
    const RefRow& r = rows_[i];
    denominator_ += r.w_t;
    total += r.loss;
    total_scale += r.loss_scale;
    num_correct_ += r.argmax == t ? 1 : 0;
    entropy_sum_ += r.entropy;
    entropy_scale_ += r.entropy_scale;
  }
  if (params_.reduction == fusedce::Reduction::kMean) {
    reduced_loss_ = total / denominator_;  // 0 / 0 = NaN when every row is ignored
    reduced_loss_scale_ = denominator_ > 0.0 ? total_scale / denominator_ : 0.0;
  } else {
    reduced_loss_ = total;
    reduced_loss_scale_ = total_scale;
  }
}

double Reference::upstream(int64_t i, const std::vector<float>& grad_loss) const {
  if (params_.reduction == fusedce::Reduction::kNone) {
    return grad_loss.empty() ? 1.0 : static_cast<double>(grad_loss[i]);
  }
  const double g = grad_loss.empty() ? 1.0 : static_cast<double>(grad_loss[0]);
  return params_.reduction == fusedce::Reduction::kMean ? g / denominator_ : g;
}

void Reference::grad_row(int64_t i, double g, std::vector<double>* grad, double* scale) const {
  const int64_t V = problem_.vocab;
  grad->assign(V, 0.0);
  *scale = 0.0;
  const RefRow& r = rows_[i];
  if (r.ignored) return;
  std::vector<double> x(V), z(V);
  problem_.load_row(i, x.data());
  ref_z(params_, x.data(), z.data());
  ref_grad(params_, z.data(), r, g, grad->data(), scale);
}

double reference_objective(const RefParams& p, const std::vector<double>& x, int64_t rows,
                           const std::vector<int64_t>& target, const std::vector<float>& grad_loss) {
  const int64_t V = p.vocab;
  std::vector<double> z(V);
  double total = 0.0, denominator = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    if (target[i] == p.ignore_index) continue;
    ref_z(p, x.data() + i * V, z.data());
    const RefRow r = ref_row(p, z.data(), target[i]);
    denominator += r.w_t;
    const double g = p.reduction == fusedce::Reduction::kNone && !grad_loss.empty() ? grad_loss[i] : 1.0;
    total += g * r.loss;
  }
  if (p.reduction == fusedce::Reduction::kNone) return total;
  const double g = grad_loss.empty() ? 1.0 : grad_loss[0];
  return g * (p.reduction == fusedce::Reduction::kMean ? total / denominator : total);
}

}  // namespace fusedce_test
