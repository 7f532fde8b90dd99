// The fused linear distillation (fusedce/distill.h) on each backend, through the public API:
// the full form (a teacher head) and the top-k form, forward and backward, against a float64
// reference written here from the header's definitions (its logit gradient checked by finite
// differences first). Awkward shapes: V = 1, odd V, V not a multiple of 128, N = 0, every row
// ignored, several token chunks forced by a small chunk budget; every divergence (beta 0, 0.5,
// 1), temperature != 1, the hard-loss mix and hard_weight 1, both heads' logit scale and
// softcap, each reduction; top-k with repeated ids, absent (-inf) entries and K = V, each
// topk_norm; float32 and bfloat16 inputs (and a float32 teacher beside a bfloat16 student).
//
// Tolerances (why each is what it is):
//  - values (loss, divergence, hard, entropy): the logits come from float32 products over H
//    terms (about sqrt(H) roundoffs each) and the row sums run over V entries; the divergence's
//    weights sum to 1, so its error is a few of those: 4 (sqrt(H + H_t) + sqrt(V)) u32 times the
//    largest of 1 and |value| (the rule of tests/python/test_distillation.py). A 1e-5 relative
//    error in a loss of O(1) is past it (planted: fails).
//  - gradients: formed in float32 from float32 logits, summed over V (grad_hidden) or N (the
//    others) terms: atol 4 sqrt(V + H + N) u32 times the largest |reference| (times 1 + the
//    largest |t| of a top-k teacher, whose entry gradients carry e^s's rounding times |s - t|),
//    rtol the output dtype's unit roundoff (grad_weight and grad_bias are rounded once to it).
//  - the CUDA backend with 16-bit inputs forms each logits chunk in the input dtype (one rounding
//    of every logit, as the linear cross-entropy) and its dlogits in that dtype too, which moves
//    results far more than float32 arithmetic. There the budget adds 3 times the largest change
//    that the same two roundings make in the float64 reference (the reference run on rounded
//    logits and rounded dlogits), per output: the rule of tests/python/test_logprobs.py. Its
//    16-bit grad_weight is summed over the token chunks in its own dtype (one rounding a chunk),
//    so grad_weight's budget adds the unit roundoff times the sum of |grad_weight so far| at
//    each chunk's end but the last (the chunks from the backend's plan, cuda_backward_rows).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend.h"
#include "common/numeric.h"
#include "fusedce/fusedce.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::StatusCode;
using fusedce::Reduction;
using fusedce::TopkNorm;

constexpr int64_t kIgnore = -100;
constexpr double kU32 = 1.0 / (1 << 24);
constexpr double kInf = std::numeric_limits<double>::infinity();

double unit_roundoff(DType d) {
  return d == DType::kFloat32 ? kU32 : d == DType::kBFloat16 ? 1.0 / 256 : 1.0 / 2048;
}

/// x rounded to `d` (float32: to float).
double round_to(double x, DType d) {
  const float f = static_cast<float>(x);
  if (d == DType::kFloat32) return f;
  if (d == DType::kBFloat16) return fusedce::detail::bf16_to_float(fusedce::detail::float_to_bf16(f));
  return fusedce::detail::fp16_to_float(fusedce::detail::float_to_fp16(f));
}

// ---- the float64 reference -------------------------------------------------------------------

struct Opts {
  double beta = 0.5, temperature = 1.0, hard_weight = 0.0;
  double s_scale = 1.0, s_cap = 0.0, t_scale = 1.0, t_cap = 0.0;
  TopkNorm norm = TopkNorm::kNone;
};

double transform(double x, double scale, double cap) { return cap > 0.0 ? cap * std::tanh(scale * x / cap) : scale * x; }
double transform_dx(double x, double scale, double cap) {
  if (cap <= 0.0) return scale;
  const double th = std::tanh(scale * x / cap);
  return scale * (1.0 - th * th);
}

std::vector<double> log_softmax(const std::vector<double>& z) {
  double m = -kInf;
  for (double v : z) m = std::max(m, v);
  double s = 0.0;
  for (double v : z) s += std::exp(v - m);
  std::vector<double> out(z.size());
  for (size_t j = 0; j < z.size(); ++j) out[j] = z[j] - m - std::log(s);
  return out;
}

/// One entry's divergence term f(s, t) and df/ds, derived here from the definitions (the
/// mixture's own derivative included, not simplified).
void term(double beta, double s, double t, double* f, double* fs) {
  const double ps = std::exp(s), pt = std::exp(t);
  if (beta == 0.0) {
    *f = pt == 0.0 ? 0.0 : pt * (t - s);
    *fs = -pt;
  } else if (beta == 1.0) {
    *f = ps == 0.0 ? 0.0 : ps * (s - t);
    *fs = ps == 0.0 ? 0.0 : ps * (s - t) + ps;
  } else {
    const double a = std::log1p(-beta) + s, b = std::log(beta) + t, top = std::max(a, b);
    const double l = top + std::log(std::exp(a - top) + std::exp(b - top));
    const double dl = std::exp(a - l);  // dl/ds
    *f = (pt == 0.0 ? 0.0 : beta * pt * (t - l)) + (ps == 0.0 ? 0.0 : (1 - beta) * ps * (s - l));
    *fs = -beta * pt * dl + (1 - beta) * (ps * (s - l) + ps * (1.0 - dl));
  }
}

double lse_of(const std::vector<double>& x, const std::vector<char>& valid) {
  double m = -kInf;
  for (size_t k = 0; k < x.size(); ++k) {
    if (valid[k]) m = std::max(m, x[k]);
  }
  if (m == -kInf) return m;
  double s = 0.0;
  for (size_t k = 0; k < x.size(); ++k) {
    if (valid[k]) s += std::exp(x[k] - m);
  }
  return m + std::log(s);
}

/// One row's results: the outputs and d(row loss)/d(student logit x_j).
struct RowRef {
  double divergence = 0.0, hard = 0.0, entropy = 0.0, loss = 0.0;
  std::vector<double> dx;
};

/// The row of student logits xs (V), the teacher's logits xt (V) or its top-k (ids, tlp).
RowRef reference_row(const std::vector<double>& xs, const std::vector<double>* xt, const int64_t* ids,
                     const float* tlp, int64_t K, int64_t label, const Opts& o) {
  const size_t V = xs.size();
  RowRef r;
  std::vector<double> ys(V), zs(V), dz(V, 0.0);
  for (size_t j = 0; j < V; ++j) {
    ys[j] = transform(xs[j], o.s_scale, o.s_cap);
    zs[j] = ys[j] / o.temperature;
  }
  const std::vector<double> ls = log_softmax(zs);
  for (size_t j = 0; j < V; ++j) r.entropy -= std::exp(ls[j]) * ls[j];
  if (xt != nullptr) {
    std::vector<double> zt(V);
    for (size_t j = 0; j < V; ++j) zt[j] = transform((*xt)[j], o.t_scale, o.t_cap) / o.temperature;
    const std::vector<double> lt = log_softmax(zt);
    std::vector<double> fs(V);
    double sum_fs = 0.0;
    for (size_t j = 0; j < V; ++j) {
      double f;
      term(o.beta, ls[j], lt[j], &f, &fs[j]);
      r.divergence += f;
      sum_fs += fs[j];
    }
    for (size_t j = 0; j < V; ++j) dz[j] = fs[j] - std::exp(ls[j]) * sum_fs;  // through the log-softmax
  } else {
    std::vector<double> q(K), t(K), s(K), tt(K), gq(K, 0.0);
    std::vector<char> valid(K);
    for (int64_t k = 0; k < K; ++k) {
      q[k] = ls[ids[k]];
      t[k] = tlp[k];
      valid[k] = tlp[k] != -INFINITY;
    }
    s = q;
    tt = t;
    if (o.norm == TopkNorm::kRenorm) {
      const double lq = lse_of(q, valid), lt = lse_of(t, valid);
      for (int64_t k = 0; k < K; ++k) {
        s[k] = q[k] - lq;
        tt[k] = t[k] - lt;
      }
    }
    std::vector<double> fs(K, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      if (!valid[k]) continue;
      double f;
      term(o.beta, s[k], tt[k], &f, &fs[k]);
      r.divergence += f;
    }
    if (o.norm == TopkNorm::kRenorm) {  // ds_k / dq_j = [k == j] - e^{s_j}
      double tot = 0.0;
      for (int64_t k = 0; k < K; ++k) tot += fs[k];
      for (int64_t k = 0; k < K; ++k) gq[k] = valid[k] ? fs[k] - std::exp(s[k]) * tot : 0.0;
    } else {
      gq = fs;
    }
    if (o.norm == TopkNorm::kTail) {  // TRL's tail: log(1 - sum e^q), its log-sum clamped
      const double lq = lse_of(q, valid), lt = lse_of(t, valid), cap = -1e-7;
      const double s_tail = std::log(-std::expm1(std::min(lq, cap))), t_tail = std::log(-std::expm1(std::min(lt, cap)));
      double f, f_tail;
      term(o.beta, s_tail, t_tail, &f, &f_tail);
      r.divergence += f;
      if (lq <= cap) {
        for (int64_t k = 0; k < K; ++k) {
          if (valid[k]) gq[k] -= f_tail * std::exp(q[k] - s_tail);
        }
      }
    }
    double tot = 0.0;  // q_k = ls[id_k]: dq_k / dz_j = [j == id_k] - p_j
    for (int64_t k = 0; k < K; ++k) {
      dz[ids[k]] += gq[k];
      tot += gq[k];
    }
    for (size_t j = 0; j < V; ++j) dz[j] -= std::exp(ls[j]) * tot;
  }
  const double w = o.hard_weight;
  std::vector<double> dy(V);
  for (size_t j = 0; j < V; ++j) dy[j] = (1.0 - w) * dz[j] / o.temperature;
  if (w > 0.0 && label >= 0) {
    const std::vector<double> lh = log_softmax(ys);
    r.hard = -lh[label];
    for (size_t j = 0; j < V; ++j) dy[j] += w * (std::exp(lh[j]) - (static_cast<int64_t>(j) == label ? 1.0 : 0.0));
  }
  r.loss = (w < 1.0 ? (1.0 - w) * r.divergence : 0.0) + w * r.hard;
  r.dx.resize(V);
  for (size_t j = 0; j < V; ++j) r.dx[j] = dy[j] * transform_dx(xs[j], o.s_scale, o.s_cap);
  return r;
}

// ---- problems ----------------------------------------------------------------------------------

struct Case {
  const char* name;
  int64_t n, h, h_t, v;
  double beta, temperature, hard_weight;
  Reduction reduction;
  bool labels, bias;
  double ignore_frac;
  size_t budget;  // chunk_budget_bytes (0: the default)
  double s_scale = 1.0, s_cap = 0.0, t_scale = 1.0, t_cap = 0.0;
  int64_t k = 0;  // top-k form: K >= 1
  TopkNorm norm = TopkNorm::kNone;
  bool repeats = false, absent = false;
  bool teacher_f32 = false;  // the teacher head in float32 whatever the student's dtype
};

/// A head's operands: values as the backend reads them (rounded to the dtype) and their bytes.
struct HeadData {
  DType dtype;
  int64_t rows, h, v;
  std::vector<double> hidden, weight, bias;  // rounded values
  std::vector<uint8_t> hidden_bytes, weight_bytes, bias_bytes;
};

std::vector<uint8_t> bytes_of(const std::vector<double>& x, DType d) {
  const size_t el = d == DType::kFloat32 ? 4 : 2;
  std::vector<uint8_t> out(std::max<size_t>(x.size(), 1) * el);
  for (size_t i = 0; i < x.size(); ++i) {
    if (d == DType::kFloat32) {
      const float f = static_cast<float>(x[i]);
      std::memcpy(out.data() + i * 4, &f, 4);
    } else {
      const float f = static_cast<float>(x[i]);
      const uint16_t b = d == DType::kBFloat16 ? fusedce::detail::float_to_bf16(f) : fusedce::detail::float_to_fp16(f);
      std::memcpy(out.data() + i * 2, &b, 2);
    }
  }
  return out;
}

HeadData make_head(int64_t n, int64_t h, int64_t v, double wscale, bool bias, DType d, std::mt19937& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  HeadData hd{d, n, h, v, std::vector<double>(n * h), std::vector<double>(v * h), {}, {}, {}, {}};
  for (double& x : hd.hidden) x = round_to(nd(rng), d);
  for (double& x : hd.weight) x = round_to(nd(rng) * wscale / std::sqrt(static_cast<double>(h)), d);
  if (bias) {
    hd.bias.resize(v);
    for (int64_t j = 0; j < v; ++j) hd.bias[j] = round_to(0.5 * nd(rng) + (j % 37 == 5 ? 5.0 : 0.0), d);  // outliers
  }
  hd.hidden_bytes = bytes_of(hd.hidden, d);
  hd.weight_bytes = bytes_of(hd.weight, d);
  hd.bias_bytes = bytes_of(hd.bias, d);
  return hd;
}

/// logits (n, v) of a head in float64, each rounded to `round` (float64: not rounded).
std::vector<double> logits_of(const HeadData& hd, bool round, DType d) {
  std::vector<double> x(hd.rows * hd.v);
  for (int64_t i = 0; i < hd.rows; ++i) {
    for (int64_t j = 0; j < hd.v; ++j) {
      double acc = hd.bias.empty() ? 0.0 : hd.bias[j];
      for (int64_t k = 0; k < hd.h; ++k) acc += hd.hidden[i * hd.h + k] * hd.weight[j * hd.h + k];
      x[i * hd.v + j] = round ? round_to(acc, d) : acc;
    }
  }
  return x;
}

struct Problem {
  Case c;
  Opts o;
  HeadData student, teacher;
  std::vector<int64_t> labels, ids;
  std::vector<float> tlp, grad_loss;
};

Problem make_problem(const Case& c, DType dtype) {
  std::mt19937 rng(static_cast<uint32_t>(c.n * 1009 + c.v * 31 + c.k * 7 + static_cast<int>(c.beta * 10)));
  Problem p{c, {}, {}, {}, {}, {}, {}, {}};
  p.o = Opts{c.beta, c.temperature, c.hard_weight, c.s_scale, c.s_cap, c.t_scale, c.t_cap, c.norm};
  p.student = make_head(c.n, c.h, c.v, 2.0, c.bias, dtype, rng);
  if (c.k == 0) p.teacher = make_head(c.n, c.h_t, c.v, 2.5, c.bias, c.teacher_f32 ? DType::kFloat32 : dtype, rng);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  if (c.labels) {
    for (int64_t i = 0; i < c.n; ++i) p.labels.push_back(ud(rng) < c.ignore_frac ? kIgnore : static_cast<int64_t>(rng() % c.v));
  }
  if (c.k > 0) {  // the top-k of a random peaked distribution
    std::normal_distribution<double> nd(0.0, 2.5);
    for (int64_t i = 0; i < c.n; ++i) {
      std::vector<double> z(c.v);
      for (double& x : z) x = nd(rng);
      const std::vector<double> lp = log_softmax(z);
      std::vector<int64_t> order(c.v);
      for (int64_t j = 0; j < c.v; ++j) order[j] = j;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lp[a] > lp[b]; });
      for (int64_t k = 0; k < c.k; ++k) {
        p.ids.push_back(order[k]);
        p.tlp.push_back(static_cast<float>(lp[order[k]]));
      }
      if (c.repeats && c.k > 1) {
        p.ids[i * c.k + c.k - 1] = p.ids[i * c.k];
        p.tlp[i * c.k + c.k - 1] = p.tlp[i * c.k];
      }
      if (c.repeats && c.k > 3) {  // a third copy of the same id, in the middle
        p.ids[i * c.k + 2] = p.ids[i * c.k];
        p.tlp[i * c.k + 2] = p.tlp[i * c.k];
      }
      if (c.absent && c.k > 1 && i % 2 == 0) p.tlp[i * c.k + 1] = -INFINITY;
    }
  }
  std::normal_distribution<double> gd(1.0, 0.5);
  p.grad_loss.resize(c.reduction == Reduction::kNone ? std::max<int64_t>(c.n, 1) : 1);
  for (float& g : p.grad_loss) g = static_cast<float>(gd(rng));
  return p;
}

/// The reference's outputs: per-row values, the reduced loss and the three gradients.
struct Ref {
  std::vector<double> divergence, hard, entropy, row_loss;
  double loss = 0.0;
  std::vector<double> gh, gw, gb;  // (n, h), (v, h), (v,)
  // sum over the token chunks but the last of |grad_weight summed to the chunk's end|: what a
  // backend that rounds grad_weight once a chunk may lose, in units of its unit roundoff
  std::vector<double> gw_partials;
};

/// The reference of p; `round` set: every logit rounded to dt (its head's dtype) and every
/// dlogit to the student's, as a backend that keeps its chunks in the input dtype does.
/// chunk_rows > 0: gw_partials over token chunks of that many rows.
Ref reference(const Problem& p, bool round, int64_t chunk_rows = 0) {
  const Case& c = p.c;
  const int64_t n = c.n, v = c.v, h = c.h;
  const std::vector<double> xs = logits_of(p.student, round, p.student.dtype);
  std::vector<double> xt;
  if (c.k == 0) xt = logits_of(p.teacher, round, p.teacher.dtype);
  Ref r{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n), std::vector<double>(n), 0.0,
        std::vector<double>(n * h, 0.0), std::vector<double>(v * h, 0.0), std::vector<double>(v, 0.0),
        std::vector<double>(v * h, 0.0)};
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += !c.labels || p.labels[i] != kIgnore;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t label = c.labels ? p.labels[i] : -1;
    if (c.labels && label == kIgnore) continue;
    const std::vector<double> rs(xs.begin() + i * v, xs.begin() + (i + 1) * v);
    std::vector<double> rt;
    if (c.k == 0) rt.assign(xt.begin() + i * v, xt.begin() + (i + 1) * v);
    const RowRef row = reference_row(rs, c.k == 0 ? &rt : nullptr, c.k ? p.ids.data() + i * c.k : nullptr,
                                     c.k ? p.tlp.data() + i * c.k : nullptr, c.k, c.hard_weight > 0 ? label : -1, p.o);
    r.divergence[i] = row.divergence;
    r.hard[i] = row.hard;
    r.entropy[i] = row.entropy;
    r.row_loss[i] = row.loss;
    sum += row.loss;
    const double g = c.reduction == Reduction::kNone ? p.grad_loss[i]
                     : c.reduction == Reduction::kSum ? p.grad_loss[0]
                                                       : p.grad_loss[0] / static_cast<double>(count);
    for (int64_t j = 0; j < v; ++j) {
      const double d = round ? round_to(g * row.dx[j], p.student.dtype) : g * row.dx[j];
      if (d == 0.0) continue;
      r.gb[j] += d;
      for (int64_t k = 0; k < h; ++k) {
        r.gh[i * h + k] += d * p.student.weight[j * h + k];
        r.gw[j * h + k] += d * p.student.hidden[i * h + k];
      }
    }
    if (chunk_rows > 0 && (i + 1) % chunk_rows == 0 && i + 1 < n) {
      for (size_t q = 0; q < r.gw.size(); ++q) r.gw_partials[q] += std::abs(r.gw[q]);
    }
  }
  r.loss = c.reduction == Reduction::kMean ? (count == 0 ? std::nan("") : sum / count) : sum;
  return r;
}

// ---- running a backend ----------------------------------------------------------------------

struct Got {
  StatusCode status = StatusCode::kOk;  // Ws::kShort: the first call's
  std::vector<float> loss, divergence, hard, entropy, gh;
  std::vector<double> gw, gb;
  bool ok = true;
};

std::vector<double> to_doubles(const std::vector<uint8_t>& b, DType d, size_t count) {
  std::vector<double> out(count);
  for (size_t i = 0; i < count; ++i) {
    if (d == DType::kFloat32) {
      float f;
      std::memcpy(&f, b.data() + 4 * i, 4);
      out[i] = f;
    } else {
      uint16_t u;
      std::memcpy(&u, b.data() + 2 * i, 2);
      out[i] = d == DType::kBFloat16 ? fusedce::detail::bf16_to_float(u) : fusedce::detail::fp16_to_float(u);
    }
  }
  return out;
}

/// The forward, then the backward from its stats and p.grad_loss; with `fused`, the two in one
/// call (linear_distill_forward_backward: the upstream gradient 1, whatever p.grad_loss holds).
/// How run_backend gives the calls their workspace: none (the backend's own scratch), one of the
/// size linear_distill_workspace_size reports (poisoned first), or one byte less than that.
enum class Ws { kOwn, kExact, kShort };

Got run_backend(Backend& be, const Problem& p, bool fused = false, Ws given = Ws::kOwn) {
  const Case& c = p.c;
  const int64_t n = c.n, v = c.v, h = c.h;
  const DType d = p.student.dtype;
  const size_t el = d == DType::kFloat32 ? 4 : 2;
  Got got;
  DeviceBuffer hs = DeviceBuffer::from_vector(be, p.student.hidden_bytes), ws = DeviceBuffer::from_vector(be, p.student.weight_bytes),
               bs = DeviceBuffer::from_vector(be, p.student.bias_bytes);
  const auto hv = fusedce::matrix(hs.data(), d, n, h), wv = fusedce::matrix(ws.data(), d, v, h);
  const fusedce::VectorView bv = c.bias ? fusedce::vector(bs.data(), d, v) : fusedce::VectorView{};
  DeviceBuffer th, tw, tb, ids, tlp, labels;
  fusedce::DistillTeacher teacher;
  if (c.k == 0) {
    const DType dt = p.teacher.dtype;
    th = DeviceBuffer::from_vector(be, p.teacher.hidden_bytes);
    tw = DeviceBuffer::from_vector(be, p.teacher.weight_bytes);
    tb = DeviceBuffer::from_vector(be, p.teacher.bias_bytes);
    teacher.hidden = fusedce::matrix(th.data(), dt, n, c.h_t);
    teacher.weight = fusedce::matrix(tw.data(), dt, v, c.h_t);
    if (c.bias) teacher.bias = fusedce::vector(tb.data(), dt, v);
  } else {
    std::vector<int64_t> id = p.ids;
    std::vector<float> lp = p.tlp;
    id.resize(std::max<size_t>(id.size(), 1));
    lp.resize(std::max<size_t>(lp.size(), 1));
    ids = DeviceBuffer::from_vector(be, id);
    tlp = DeviceBuffer::from_vector(be, lp);
    teacher.topk_ids = fusedce::matrix(ids.data(), DType::kInt64, n, c.k);
    teacher.topk_logprobs = fusedce::matrix(tlp.data(), DType::kFloat32, n, c.k);
  }
  fusedce::VectorView lv{};
  if (c.labels) {
    std::vector<int64_t> l = p.labels;
    l.resize(std::max<size_t>(l.size(), 1));
    labels = DeviceBuffer::from_vector(be, l);
    lv = fusedce::vector(labels.data(), DType::kInt64, n);
  }
  fusedce::DistillOptions o;
  o.beta = static_cast<float>(c.beta);
  o.temperature = static_cast<float>(c.temperature);
  o.hard_weight = static_cast<float>(c.hard_weight);
  o.ignore_index = kIgnore;
  o.reduction = c.reduction;
  o.student = fusedce::HeadTransform{static_cast<float>(c.s_scale), static_cast<float>(c.s_cap)};
  o.teacher = fusedce::HeadTransform{static_cast<float>(c.t_scale), static_cast<float>(c.t_cap)};
  o.topk_norm = c.norm;
  const int64_t nl = c.reduction == Reduction::kNone ? n : 1, n1 = std::max<int64_t>(n, 1);
  // poisoned outputs: whatever the backend leaves unwritten shows
  auto poisoned = [&](size_t floats) {
    DeviceBuffer b(be, floats * 4);
    b.fill(0x7f);
    return b;
  };
  DeviceBuffer loss = poisoned(std::max<int64_t>(nl, 1)), div = poisoned(n1), hard = poisoned(n1), ent = poisoned(n1),
               stats = poisoned(n1 * fusedce::kDistillStatsWidth);
  fusedce::DistillOutputs out;
  out.loss = fusedce::vector(loss.data(), DType::kFloat32, nl);
  out.divergence = fusedce::vector(div.data(), DType::kFloat32, n);
  out.hard = fusedce::vector(hard.data(), DType::kFloat32, n);
  out.entropy = fusedce::vector(ent.data(), DType::kFloat32, n);
  out.stats = fusedce::matrix(stats.data(), DType::kFloat32, n, fusedce::kDistillStatsWidth);
  DeviceBuffer gl = DeviceBuffer::from_vector(be, p.grad_loss), gh = poisoned(std::max<int64_t>(n * h, 1)),
               gw(be, v * h * el), gb(be, v * el);
  gw.fill(0x7f);
  gb.fill(0x7f);
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(gh.data(), DType::kFloat32, n, h);
  g.grad_weight = fusedce::matrix(gw.data(), d, v, h);
  if (c.bias) g.grad_bias = fusedce::vector(gb.data(), d, v);
  DeviceBuffer wsf, wsb;
  auto workspace = [&](fusedce::DistillJob job, DeviceBuffer* holder) {
    if (given == Ws::kOwn) return fusedce::Workspace{};
    size_t bytes = fusedce::linear_distill_workspace_size(job, be.device(), hv, wv, teacher, o, c.budget, g);
    if (given == Ws::kShort && bytes > 0) --bytes;
    *holder = DeviceBuffer(be, std::max<size_t>(bytes, 1));
    holder->fill(0x7f);
    return fusedce::Workspace{bytes > 0 ? holder->data() : nullptr, bytes};
  };
  const fusedce::Workspace wf =
      workspace(fused ? fusedce::DistillJob::kForwardBackward : fusedce::DistillJob::kForward, &wsf);
  const fusedce::Status fs =
      fused ? fusedce::linear_distill_forward_backward(be.device(), hv, wv, bv, teacher, lv, o, c.budget, out, g, wf)
            : fusedce::linear_distill_forward(be.device(), hv, wv, bv, teacher, lv, o, c.budget, out, wf);
  if (given == Ws::kShort && wf.data != nullptr) {
    got.ok = false;
    got.status = fs.code();
    return got;
  }
  EXPECT_TRUE(fs.ok()) << (fused ? "forward_backward: " : "forward: ") << fs.message();
  if (!fs.ok()) {
    got.ok = false;
    return got;
  }
  be.synchronize();
  got.loss = loss.to_host_as<float>();
  got.divergence = div.to_host_as<float>();
  got.hard = hard.to_host_as<float>();
  got.entropy = ent.to_host_as<float>();
  const fusedce::Workspace wb = fused ? fusedce::Workspace{} : workspace(fusedce::DistillJob::kBackward, &wsb);
  const fusedce::Status bs_ =
      fused ? fusedce::Status::Ok()
            : fusedce::linear_distill_backward(be.device(), hv, wv, bv, teacher, lv, o, c.budget, out.stats,
                                               fusedce::vector(gl.data(), DType::kFloat32, nl), g, wb);
  EXPECT_TRUE(bs_.ok()) << "backward: " << bs_.message();
  if (!bs_.ok()) {
    got.ok = false;
    return got;
  }
  be.synchronize();
  got.gh = gh.to_host_as<float>();
  got.gw = to_doubles(gw.to_host(), d, v * h);
  got.gb = to_doubles(gb.to_host(), d, v);
  return got;
}

// ---- comparing --------------------------------------------------------------------------------

double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double v : x) m = std::max(m, std::isnan(v) ? 0.0 : std::abs(v));
  return m;
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

/// Compares `got` (count values) with `want`: |got - want| <= atol + rtol |want| (+ rtol
/// extra[i] where given), NaN where want is NaN; reports the first few failures with the
/// tolerance's parts.
template <typename G>
void expect_all_close(const G& got, const std::vector<double>& want, double atol, double rtol, const std::string& what,
                      const std::vector<double>* extra = nullptr) {
  int bad = 0;
  for (size_t i = 0; i < want.size() && bad < 4; ++i) {
    const double g = got[i], w = want[i];
    if (std::isnan(w)) {
      if (!std::isnan(g)) {
        ADD_FAILURE() << what << "[" << i << "] = " << g << ", want NaN";
        ++bad;
      }
      continue;
    }
    const double tol = atol + rtol * (std::abs(w) + (extra ? (*extra)[i] : 0.0));
    if (!(std::abs(g - w) <= tol)) {
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << w << " (|diff| " << std::abs(g - w)
                    << " > tol " << tol << " = atol " << atol << " + rtol " << rtol << " * |want|)";
      ++bad;
    }
  }
}

/// Token rows per chunk of the CUDA backend's backward call for case c (its plan in
/// src/cuda/distill/distill_cuda.cpp: the logit rows of the heads it forms, in their dtypes at
/// 16-byte row strides, and the top-k backward's scratch, within the budget); the default budget
/// holds every row of these cases.
int64_t cuda_backward_rows(const Case& c, DType d) {
  const int64_t n = std::max<int64_t>(c.n, 1);
  if (c.budget == 0) return n;
  auto stride_bytes = [&](DType t) {
    const int64_t el = t == DType::kFloat32 ? 4 : 2, per16 = 16 / el;
    return size_t((c.v + per16 - 1) / per16 * per16 * el);
  };
  size_t row = stride_bytes(d);
  if (c.k == 0 && c.hard_weight < 1.0) row += stride_bytes(c.teacher_f32 ? DType::kFloat32 : d);
  if (c.k > 0) {
    int64_t kp = 1;
    while (kp < c.k) kp <<= 1;
    row += size_t(c.k) * 8 + size_t(kp) * 8;
  }
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(c.budget / row));
  if (cap < 256) return std::min(cap, n);
  const int64_t whole = cap / 128 * 128, chunks = (n + whole - 1) / whole;
  int64_t rows = (n + chunks - 1) / chunks;
  if (rows > 128) rows = std::min<int64_t>((rows + 127) / 128 * 128, whole);
  return rows;
}

void check_case(Backend& be, const Case& c, DType dtype) {
  SCOPED_TRACE(std::string(c.name) + " on " + backend_name(be.kind()) + ", " + fusedce::dtype_name(dtype));
  const Problem p = make_problem(c, dtype);
  const Got got = run_backend(be, p);
  if (!got.ok) return;
  // the CUDA backend's 16-bit logit chunks: the budget of rounding every logit and dlogit once;
  // and its 16-bit grad_weight, rounded once a chunk
  const bool rounded = be.kind() == BackendKind::kCuda && dtype != DType::kFloat32;
  const Ref ref = reference(p, false, rounded ? cuda_backward_rows(c, dtype) : 0);
  const Ref rr = rounded ? reference(p, true) : ref;
  const int64_t n = c.n, v = c.v, h = c.h;
  const double f32 = 4.0 * (std::sqrt(static_cast<double>(c.h + (c.k ? 0 : c.h_t))) + std::sqrt(static_cast<double>(v))) * kU32;
  auto value_tol = [&](const std::vector<double>& want, const std::vector<double>& want_r) {
    return f32 * std::max(1.0, max_abs(want)) + 3.0 * max_diff(want, want_r);
  };
  const std::vector<double> loss_ref = c.reduction == Reduction::kNone ? ref.row_loss : std::vector<double>{ref.loss};
  const std::vector<double> loss_r = c.reduction == Reduction::kNone ? rr.row_loss : std::vector<double>{rr.loss};
  // A reduced loss adds its rows' values (over the count for the mean): its rounding budget is the
  // sum of theirs (the triangle inequality), not its one reduced reference, where the rows'
  // rounding effects of either sign cancel by chance and a backend's different rounding (its own
  // product order moves logits across a rounding boundary) need not.
  double loss_tol = value_tol(loss_ref, loss_r);
  if (c.reduction != Reduction::kNone) {
    int64_t count = 0;
    double spread = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      if (c.labels && p.labels[i] == kIgnore) continue;
      ++count;
      spread += std::abs(ref.row_loss[i] - rr.row_loss[i]);
    }
    const double scale = c.reduction == Reduction::kMean ? 1.0 / static_cast<double>(std::max<int64_t>(count, 1)) : 1.0;
    loss_tol = f32 * std::max(1.0, max_abs(loss_ref)) + 3.0 * scale * spread;
  }
  expect_all_close(got.loss, loss_ref, loss_tol, 0.0, "loss");
  expect_all_close(got.divergence, ref.divergence, value_tol(ref.divergence, rr.divergence), 0.0, "divergence");
  expect_all_close(got.entropy, ref.entropy, value_tol(ref.entropy, rr.entropy), 0.0, "entropy");
  if (c.hard_weight > 0.0) expect_all_close(got.hard, ref.hard, value_tol(ref.hard, rr.hard), 0.0, "hard");
  double amp = 1.0;
  for (float t : p.tlp) amp = std::max(amp, 1.0 + (std::isinf(t) ? 0.0 : std::abs(t)));
  const double terms = static_cast<double>(v + h + n), ud = unit_roundoff(dtype);
  auto grad_atol = [&](const std::vector<double>& want, const std::vector<double>& want_r) {
    return 4.0 * std::sqrt(terms) * kU32 * max_abs(want) * amp + 3.0 * max_diff(want, want_r) + 1e-30;
  };
  expect_all_close(got.gh, ref.gh, grad_atol(ref.gh, rr.gh), 0.0, "grad_hidden");
  expect_all_close(got.gw, ref.gw, grad_atol(ref.gw, rr.gw), dtype == DType::kFloat32 ? 0.0 : ud, "grad_weight",
                   &ref.gw_partials);
  if (c.bias) expect_all_close(got.gb, ref.gb, grad_atol(ref.gb, rr.gb), dtype == DType::kFloat32 ? 0.0 : ud, "grad_bias");
  // ignored rows: zero grad_hidden rows and zero per-row outputs
  for (int64_t i = 0; c.labels && i < n; ++i) {
    if (p.labels[i] != kIgnore) continue;
    for (int64_t k = 0; k < h; ++k) {
      ASSERT_EQ(got.gh[i * h + k], 0.0f) << "grad_hidden of ignored row " << i;
    }
    ASSERT_EQ(got.divergence[i], 0.0f) << "divergence of ignored row " << i;
  }
}

// ---- the cases ----------------------------------------------------------------------------

/// Several chunks: a budget of `rows` rows of both heads' float32 logits at V (the CPU's rule;
/// the CUDA backend counts 16-bit chunks at 2 bytes, so it takes twice the rows there: still
/// several chunks).
size_t rows_budget(int64_t rows, int64_t v, int heads) { return size_t(rows) * size_t(v) * 4 * heads; }

std::vector<Case> full_cases() {
  std::vector<Case> cs;
  for (double beta : {0.0, 0.5, 1.0}) {
    cs.push_back({"odd V, T 0.7, hard 0.3, bias", 13, 24, 29, 301, beta, 0.7, 0.3, Reduction::kMean, true, true, 0.25, 0});
    cs.push_back({"V = 1", 7, 16, 21, 1, beta, 1.0, 0.0, Reduction::kMean, true, false, 0.25, 0});
    cs.push_back({"V 2053 in chunks of 3 rows, sum", 37, 40, 45, 2053, beta, 1.3, 0.0, Reduction::kSum, true, true, 0.2,
                  rows_budget(3, 2053, 2)});
    cs.push_back({"softcap and scale on both heads, no labels, none", 12, 20, 25, 97, beta, 1.5, 0.0, Reduction::kNone,
                  false, false, 0.0, rows_budget(5, 97, 2), 0.8, 6.0, 1.3, 9.0});
  }
  cs.push_back({"N = 0, mean", 0, 8, 13, 50, 0.5, 1.0, 0.0, Reduction::kMean, true, true, 0.0, 0});
  cs.push_back({"N = 0, sum", 0, 8, 13, 50, 0.5, 1.0, 0.0, Reduction::kSum, false, true, 0.0, 0});
  cs.push_back({"every row ignored, mean", 6, 8, 13, 50, 0.3, 1.0, 0.2, Reduction::kMean, true, true, 1.0, 0});
  cs.push_back({"hard_weight 1", 11, 16, 21, 130, 0.5, 0.9, 1.0, Reduction::kMean, true, true, 0.3, rows_budget(4, 130, 2)});
  Case mixed{"float32 teacher", 9, 16, 21, 211, 0.5, 1.2, 0.25, Reduction::kMean, true, true, 0.2, 0};
  mixed.teacher_f32 = true;
  cs.push_back(mixed);
  // Long rows, at vocabularies of real models and past them: a row's columns run through many of
  // a thread's unrolled iterations, then its plain ones and a partial last group; the student's
  // soft-cap alone; each divergence.
  cs.push_back({"V 40003, hard 0.3", 6, 16, 12, 40003, 0.5, 1.1, 0.3, Reduction::kMean, true, true, 0.2, 0});
  cs.push_back({"V 200001, student softcap, sum", 4, 8, 8, 200001, 0.0, 1.0, 0.0, Reduction::kSum, true, false, 0.0, 0,
                1.0, 20.0, 1.0, 0.0});
  cs.push_back({"V 420001, none", 3, 8, 8, 420001, 1.0, 0.8, 0.2, Reduction::kNone, true, true, 0.0, 0});
  return cs;
}

std::vector<Case> topk_cases() {
  std::vector<Case> cs;
  for (TopkNorm norm : {TopkNorm::kNone, TopkNorm::kRenorm, TopkNorm::kTail}) {
    for (double beta : {0.0, 0.5, 1.0}) {
      Case a{"K 8 of odd V", 13, 24, 0, 301, beta, beta == 0.5 ? 0.8 : 1.0, beta == 0.5 ? 0.2 : 0.0, Reduction::kMean,
             true, true, 0.25, 0};
      a.k = 8;
      a.norm = norm;
      cs.push_back(a);
      Case r{"repeated ids and absent entries, chunks of 2 rows", 11, 16, 0, 77, beta, 1.0, 0.0, Reduction::kNone, true,
             true, 0.2, rows_budget(2, 77, 1)};
      r.k = 6;
      r.norm = norm;
      r.repeats = r.absent = true;
      cs.push_back(r);
      Case f{"K = V", 9, 16, 0, 40, beta, 1.0, 0.0, Reduction::kSum, false, false, 0.0, 0};
      f.k = 40;
      f.norm = norm;
      cs.push_back(f);
    }
    Case one{"V = 1, K = 1", 7, 8, 0, 1, 0.0, 1.0, 0.0, Reduction::kMean, true, false, 0.2, 0};
    one.k = 1;
    one.norm = norm;
    cs.push_back(one);
  }
  Case none{"N = 0", 0, 8, 0, 50, 0.0, 1.0, 0.0, Reduction::kMean, true, true, 0.0, 0};
  none.k = 4;
  cs.push_back(none);
  Case many{"K 300 > one block of threads, repeats", 5, 16, 0, 700, 0.5, 1.0, 0.0, Reduction::kMean, false, false, 0.0, 0};
  many.k = 300;
  many.repeats = true;
  cs.push_back(many);
  return cs;
}

class Distill : public ::testing::TestWithParam<std::tuple<BackendKind, DType>> {
 protected:
  Backend* backend() {
    std::string why;
    Backend* be = find_backend(std::get<0>(GetParam()), &why);
    if (be == nullptr) skip_ = why;
    return be;
  }
  std::string skip_;
};

TEST_P(Distill, FullMatchesFloat64) {
  Backend* be = backend();
  if (be == nullptr) GTEST_SKIP() << skip_;
  for (const Case& c : full_cases()) check_case(*be, c, std::get<1>(GetParam()));
}

TEST_P(Distill, TopkMatchesFloat64) {
  Backend* be = backend();
  if (be == nullptr) GTEST_SKIP() << skip_;
  for (const Case& c : topk_cases()) check_case(*be, c, std::get<1>(GetParam()));
}

/// The same call twice gives the same bits (every reduction in a fixed order).
TEST_P(Distill, RunsAreBitwiseEqual) {
  Backend* be = backend();
  if (be == nullptr) GTEST_SKIP() << skip_;
  Case c{"V 2053 in chunks, bias, hard", 37, 40, 45, 2053, 0.5, 1.3, 0.3, Reduction::kMean, true, true, 0.2,
         rows_budget(3, 2053, 2)};
  const Problem p = make_problem(c, std::get<1>(GetParam()));
  const Got a = run_backend(*be, p), b = run_backend(*be, p);
  ASSERT_TRUE(a.ok && b.ok);
  EXPECT_EQ(0, std::memcmp(a.loss.data(), b.loss.data(), a.loss.size() * 4)) << "loss differs between runs";
  EXPECT_EQ(a.gh, b.gh) << "grad_hidden differs between runs";
  EXPECT_EQ(a.gw, b.gw) << "grad_weight differs between runs";
  EXPECT_EQ(a.gb, b.gb) << "grad_bias differs between runs";
}

/// A caller's workspace of the size linear_distill_workspace_size reports (poisoned first) gives
/// the same bits as the backend's own scratch, for every call and both forms; one byte less is
/// kWorkspaceTooSmall, naming the size to ask for. The CPU needs none (size 0).
TEST_P(Distill, CallersWorkspace) {
  Backend* be = backend();
  if (be == nullptr) GTEST_SKIP() << skip_;
  Case c{"V 2053 in chunks, bias, hard", 37, 40, 45, 2053, 0.5, 1.3, 0.3, Reduction::kMean, true, true, 0.2,
         rows_budget(3, 2053, 2)};
  for (int64_t k : {int64_t(0), int64_t(7)}) {
    c.k = k;
    Problem p = make_problem(c, std::get<1>(GetParam()));
    for (bool fused : {false, true}) {
      for (auto& g : p.grad_loss) g = fused ? 1.0f : g;
      const std::string what = std::string(k ? "top-k" : "head") + (fused ? ", forward_backward" : "");
      const Got own = run_backend(*be, p, fused), given = run_backend(*be, p, fused, Ws::kExact);
      ASSERT_TRUE(own.ok && given.ok) << what;
      EXPECT_EQ(0, std::memcmp(own.loss.data(), given.loss.data(), own.loss.size() * 4)) << what << ": loss";
      EXPECT_EQ(own.divergence, given.divergence) << what << ": divergence";
      EXPECT_EQ(own.gh, given.gh) << what << ": grad_hidden";
      EXPECT_EQ(own.gw, given.gw) << what << ": grad_weight";
      EXPECT_EQ(own.gb, given.gb) << what << ": grad_bias";
      const Got short_ws = run_backend(*be, p, fused, Ws::kShort);
      if (be->kind() == BackendKind::kCuda) {
        EXPECT_FALSE(short_ws.ok) << what;
        EXPECT_EQ(short_ws.status, StatusCode::kWorkspaceTooSmall) << what;
      } else {
        EXPECT_TRUE(short_ws.ok) << what << ": the CPU takes no workspace";
      }
    }
  }
}

/// The forward and backward in one call (each chunk's logits formed once on CUDA) against the
/// two calls with an upstream gradient of 1: the same bits, outputs and gradients, for both
/// forms, mean and sum, several chunks, no rows. (hard_weight 1 is left out: there the separate
/// backward forms no teacher logits, so its chunks hold more rows and grad_weight's sums run in
/// another order.)
TEST_P(Distill, ForwardBackwardMatchesTheTwoCalls) {
  Backend* be = backend();
  if (be == nullptr) GTEST_SKIP() << skip_;
  const Case cases[] = {
      {"mean, bias, hard, chunks", 37, 40, 45, 2053, 0.5, 1.3, 0.3, Reduction::kMean, true, true, 0.2,
       rows_budget(3, 2053, 2)},
      {"sum, forward KL, one chunk", 21, 24, 16, 301, 0.0, 0.9, 0.0, Reduction::kSum, false, false, 0.0, 0},
      {"no rows", 0, 24, 16, 301, 1.0, 1.0, 0.0, Reduction::kMean, true, true, 0.0, 0},
      {"long rows, odd V", 9, 16, 12, 40003, 0.5, 1.1, 0.3, Reduction::kMean, true, true, 0.2, 0},
  };
  for (Case c : cases) {
    for (int64_t k : {int64_t(0), int64_t(7)}) {
      c.k = k;
      Problem p = make_problem(c, std::get<1>(GetParam()));
      for (auto& g : p.grad_loss) g = 1.0f;
      const Got two = run_backend(*be, p), one = run_backend(*be, p, true);
      ASSERT_TRUE(two.ok && one.ok) << c.name;
      const std::string what = std::string(c.name) + (k ? " (top-k)" : "");
      EXPECT_EQ(0, std::memcmp(two.loss.data(), one.loss.data(), two.loss.size() * 4)) << what << ": loss";
      EXPECT_EQ(two.divergence, one.divergence) << what << ": divergence";
      EXPECT_EQ(two.entropy, one.entropy) << what << ": entropy";
      EXPECT_EQ(two.gh, one.gh) << what << ": grad_hidden";
      EXPECT_EQ(two.gw, one.gw) << what << ": grad_weight";
      if (c.bias) {
        EXPECT_EQ(two.gb, one.gb) << what << ": grad_bias";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Distill,
                         ::testing::Combine(::testing::ValuesIn(all_backends()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const auto& info) {
                           return std::string(backend_name(std::get<0>(info.param))) + "_" +
                                  (std::get<1>(info.param) == DType::kFloat32 ? "f32" : "bf16");
                         });

/// The reference's logit gradient against central differences of its own loss, in float64, for
/// every divergence, the top-k normalisations (repeated ids included), a softcap and the hard mix.
TEST(DistillReference, GradientMatchesFiniteDifferences) {
  std::mt19937 rng(5);
  std::normal_distribution<double> nd(0.0, 1.5);
  const int64_t V = 9;
  std::vector<double> xs(V), xt(V);
  for (double& x : xs) x = nd(rng);
  for (double& x : xt) x = nd(rng);
  const int64_t ids[4] = {3, 7, 3, 0};
  const float tlp[4] = {-0.7f, -1.9f, -0.7f, -2.6f};
  for (double beta : {0.0, 0.3, 1.0}) {
    for (int form = 0; form < 4; ++form) {  // full; top-k none, renorm, tail
      Opts o{beta, 0.8, 0.25, 0.9, 4.0, 1.1, 0.0, static_cast<TopkNorm>(std::max(form - 1, 0))};
      auto row = [&](const std::vector<double>& x) {
        return form == 0 ? reference_row(x, &xt, nullptr, nullptr, 0, 2, o) : reference_row(x, nullptr, ids, tlp, 4, 2, o);
      };
      const RowRef r = row(xs);
      for (int64_t j = 0; j < V; ++j) {
        const double eps = 1e-6;
        std::vector<double> up = xs, down = xs;
        up[j] += eps;
        down[j] -= eps;
        const double fd = (row(up).loss - row(down).loss) / (2 * eps);
        EXPECT_NEAR(r.dx[j], fd, 1e-7 * std::max(1.0, std::abs(fd)))
            << "beta " << beta << " form " << form << " column " << j;
      }
    }
  }
}

}  // namespace
}  // namespace fusedce_test

namespace fusedce_test {
namespace {

/// The forward and backward in one call takes reduction mean or sum only (none's per-row
/// upstream gradients are not known in the forward), and names its gradients' mistakes.
TEST(DistillBadInput, ForwardBackwardIsNamed) {
  const int64_t n = 3, h = 4, v = 5;
  std::vector<float> hid(n * h, 0.5f), w(v * h, 0.25f), th(n * h, 0.5f), tw(v * h, 0.1f), loss(n), div(n), hard(n),
      ent(n), stats(n * fusedce::kDistillStatsWidth), gh(n * h), gw(v * h), gb(v);
  fusedce::DistillTeacher teacher;
  teacher.hidden = fusedce::matrix(th.data(), DType::kFloat32, n, h);
  teacher.weight = fusedce::matrix(tw.data(), DType::kFloat32, v, h);
  fusedce::DistillOutputs out;
  out.divergence = fusedce::vector(div.data(), DType::kFloat32, n);
  out.entropy = fusedce::vector(ent.data(), DType::kFloat32, n);
  out.stats = fusedce::matrix(stats.data(), DType::kFloat32, n, fusedce::kDistillStatsWidth);
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(gh.data(), DType::kFloat32, n, h);
  auto run = [&](const fusedce::DistillOptions& o, const fusedce::LinearGrads& grads) {
    out.loss = fusedce::vector(loss.data(), DType::kFloat32, o.reduction == Reduction::kNone ? n : 1);
    return fusedce::linear_distill_forward_backward(fusedce::Device::cpu(), fusedce::matrix(hid.data(), DType::kFloat32, n, h),
                                                    fusedce::matrix(w.data(), DType::kFloat32, v, h), {}, teacher, {}, o,
                                                    0, out, grads);
  };
  fusedce::DistillOptions o;
  o.reduction = Reduction::kNone;
  fusedce::Status s = run(o, g);
  EXPECT_EQ(s.code(), fusedce::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("reduction must be mean or sum"), std::string::npos) << s.message();
  o.reduction = Reduction::kMean;
  EXPECT_TRUE(run(o, g).ok());
  fusedce::LinearGrads with_bias = g;
  with_bias.grad_bias = fusedce::vector(gb.data(), DType::kFloat32, v);
  s = run(o, with_bias);
  EXPECT_NE(s.message().find("grad_bias is given but bias is not"), std::string::npos) << s.message();
  fusedce::LinearGrads wrong = g;
  wrong.grad_weight = fusedce::matrix(gw.data(), DType::kFloat32, v - 1, h);
  s = run(o, wrong);
  EXPECT_NE(s.message().find("grad_weight"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace fusedce_test
