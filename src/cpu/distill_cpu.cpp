// The CPU backend of the fused linear distillation (fusedce/distill.h). Rows whose label is
// ignored are dropped first; the others go in chunks of plan_linear_distill's rows. Per chunk:
//   logits: each head's hidden rows (float32) times its weight (float32: in place, or a copy of a
//     16-bit weight made once per call) by blocks of kVocabBlock vocabulary rows through the
//     build's matrix products (cpu/gemm.h), plus the bias; float32 (rows, V) per head, the only
//     logits held, dropped with the chunk;
//   forward: per row, the transform in place, then passes over the row (max; sums of exps;
//     the divergence with both log-normalisers known; the hard term at temperature 1), sums in
//     double; per-row outputs and the statistics the backward reads;
//   backward: the chunk's logits again, each student row turned into its gradient in place
//     (common/distill_math.h), then grad_hidden rows = dX @ W (by blocks of hidden columns),
//     grad_weight += dX.T @ hidden rows (by blocks of the vocabulary, chunks added in order, into
//     a float32 accumulator rounded once), grad_bias += column sums.
// Every sum has an order fixed by the shapes (rows, chunks, blocks), so results do not depend on
// the thread count. FLOPs: 2 N V (H_s + H_t) forward (the top-k form: 2 N V H_s), the same again
// in the backward plus 4 N V H_s for the two gradient products.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "common/call.h"
#include "common/distill_call.h"
#include "common/distill_math.h"
#include "cpu/elements.h"
#include "cpu/gemm.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace fusedce {
namespace cpu {
namespace {

constexpr int64_t kVocabBlock = 256;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// TRL's tail bucket: the log of the K entries' total probability is clamped to at most this, so
// that the tail log(1 - total) stays finite (a K = V teacher, or repeated ids).
constexpr double kTailMaxLogSum = -1e-7;

int64_t label_at(const VectorView& v, int64_t i) { return load_target(v.data, v.dtype, v.stride, i); }
float& float_ref(const VectorView& v, int64_t i) { return static_cast<float*>(v.data)[i * v.stride]; }

/// The call's constants, as the row functions use them.
struct RowMath {
  detail::DivergenceKind kind;
  float beta, one_mb, log_1mb, log_b, inv_t;
  detail::Transform student, teacher;
  TopkNorm norm;
  float hard_weight;
};

RowMath row_math_of(const DistillOptions& o) {
  RowMath m{};
  m.kind = detail::divergence_kind(o.beta);
  m.beta = o.beta;
  m.one_mb = 1.0f - o.beta;
  m.log_1mb = std::log(1.0f - o.beta);
  m.log_b = std::log(o.beta);
  m.inv_t = 1.0f / o.temperature;
  m.student = detail::Transform{o.student.logit_scale, o.student.softcap};
  m.teacher = detail::Transform{o.teacher.logit_scale, o.teacher.softcap};
  m.norm = o.topk_norm;
  m.hard_weight = o.hard_weight;
  return m;
}

/// The call's valid rows and their labels as indices into the call's vocabulary rows (-1: no
/// labels given, or, over a shard, a label another shard holds).
struct Problem {
  const detail::DistillCall* call;
  RowMath math;
  int64_t N, V, K;
  int64_t v0 = 0;                          // the global index of vocabulary row 0 (a shard's start)
  int64_t stats_width = kDistillStatsWidth;  // the backward's stats: + K for a shard's top-k form
  bool has_labels;  // labels given: every counted row has a label (and a hard term if weighted)
  std::vector<int64_t> rows, labels;
};

/// The counted rows of labels (every row of n without labels), the ignored ones left out, and
/// their labels as they are (-1 without labels). The labels are not range-checked here.
void counted_rows(const VectorView& labels, int64_t n, int64_t ignore_index, std::vector<int64_t>* rows,
                  std::vector<int64_t>* label_of) {
  const bool has_labels = !labels.empty();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = has_labels ? label_at(labels, i) : -1;
    if (has_labels && l == ignore_index) continue;
    rows->push_back(i);
    label_of->push_back(l);
  }
}

Status build_problem(const detail::DistillCall& c, Problem* p) {
  p->call = &c;
  p->math = row_math_of(c.options);
  p->N = c.rows();
  p->V = c.vocab();
  p->K = c.teacher.topk() ? c.teacher.topk_ids.cols : 0;
  p->v0 = c.vocab_start();
  if (c.shard_step == detail::ShardStep::kBackward && p->K > 0) p->stats_width = distill_shard_stats_width(p->K);
  p->has_labels = !c.labels.empty();
  if (p->has_labels) {
    Status s = detail::check_targets_host(c.labels, c.vocab_total(), c.options.ignore_index);
    if (!s.ok()) return Status(s.code(), "labels" + s.message().substr(s.message().find('[')));
  }
  const int64_t v0 = c.vocab_start();
  for (int64_t i = 0; i < p->N; ++i) {
    int64_t l = p->has_labels ? label_at(c.labels, i) : -1;
    if (p->has_labels && l == c.options.ignore_index) continue;
    if (l >= 0) l = l >= v0 && l < v0 + p->V ? l - v0 : -1;
    if (p->K > 0) {  // the top-k ids of a counted row index the (whole) vocabulary
      const int64_t* ids = static_cast<const int64_t*>(c.teacher.topk_ids.data) + i * c.teacher.topk_ids.row_stride;
      const int64_t vt = c.vocab_total();
      for (int64_t k = 0; k < p->K; ++k) {
        if (ids[k] < 0 || ids[k] >= vt) {
          return Status(StatusCode::kTargetOutOfRange, "teacher_ids[" + std::to_string(i) + ", " + std::to_string(k) +
                                                           "] = " + std::to_string(ids[k]) + " is out of range [0, " +
                                                           std::to_string(vt) + ")");
        }
      }
    }
    p->rows.push_back(i);
    p->labels.push_back(l);
  }
  return Status::Ok();
}

/// One head's operands chunk by chunk: its weight as float32 (read in place, or converted once),
/// its bias, the chunk's hidden rows (float32) and the chunk's logits (rows x V).
class Head {
 public:
  Head(const MatrixView& hidden, const MatrixView& weight, const VectorView& bias, int64_t capacity, int threads)
      : hidden_(hidden), V_(weight.rows), H_(weight.cols), threads_(threads), ops_(gemm()) {
    if (weight.dtype == DType::kFloat32) {
      w_ = static_cast<const float*>(weight.data);
      ld_ = weight.row_stride;
    } else {
      w_copy_.resize(V_ * H_);
      parallel_for(V_, kVocabBlock, threads_, [&](int64_t b, int64_t e) {
        for (int64_t v = b; v < e; ++v) {
          for (int64_t h = 0; h < H_; ++h) w_copy_[v * H_ + h] = load_elem(weight.data, weight.dtype, v * weight.row_stride + h);
        }
      });
      w_ = w_copy_.data();
      ld_ = H_;
    }
    if (!bias.empty()) {
      bias_.resize(V_);
      for (int64_t v = 0; v < V_; ++v) bias_[v] = load_elem(bias.data, bias.dtype, v * bias.stride);
    }
    hc_.resize(capacity * H_);
    z_.resize(capacity * V_);
  }

  /// The logits (rc x V, row-major) of hidden rows rows[0 .. rc).
  float* form(const int64_t* rows, int64_t rc) {
    for (int64_t r = 0; r < rc; ++r) {
      const int64_t base = rows[r] * hidden_.row_stride;
      for (int64_t h = 0; h < H_; ++h) hc_[r * H_ + h] = load_elem(hidden_.data, hidden_.dtype, base + h);
    }
    const int64_t blocks = (V_ + kVocabBlock - 1) / kVocabBlock;
    parallel_for(blocks, 1, threads_, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t v0 = blk * kVocabBlock, vb = std::min(kVocabBlock, V_ - v0);
        ops_.nt(rc, vb, H_, hc_.data(), H_, w_ + v0 * ld_, ld_, z_.data() + v0, V_);
        if (bias_.empty()) continue;
        for (int64_t r = 0; r < rc; ++r) {
          for (int64_t v = 0; v < vb; ++v) z_[r * V_ + v0 + v] += bias_[v0 + v];
        }
      }
    });
    return z_.data();
  }

  const float* hidden_rows() const { return hc_.data(); }
  const float* weight() const { return w_; }
  int64_t weight_ld() const { return ld_; }
  const GemmOps& ops() const { return ops_; }

 private:
  const MatrixView hidden_;
  const int64_t V_, H_;
  const int threads_;
  const GemmOps ops_;
  const float* w_ = nullptr;
  int64_t ld_ = 0;
  std::vector<float> w_copy_, bias_, hc_, z_;
};

// ---- one row ---------------------------------------------------------------------------------

/// The per-row results of the forward.
struct RowOut {
  float divergence = 0.0f, hard = 0.0f, entropy = 0.0f;
  float stats[kDistillStatsWidth] = {0.0f, 0.0f, 0.0f, 0.0f};
};

void transform_row(float* y, int64_t V, const detail::Transform& h) {
  if (h.scale == 1.0f && h.softcap == 0.0f) return;
  for (int64_t j = 0; j < V; ++j) y[j] = detail::transform_y(h, y[j]);
}

/// log sum_j exp(scale * y_j) of a row (its max found first), in double.
double row_lse(const float* y, int64_t V, float scale) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < V; ++j) mx = std::max(mx, y[j] * scale);
  if (mx == -INFINITY || std::isinf(mx)) return mx;
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(y[j] * scale - mx);
  return mx + std::log(sum);
}

/// The student's entropy of softmax(inv_t * y), given its logsumexp.
double row_entropy(const float* y, int64_t V, float inv_t, double lse) {
  double pz = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    const float s = static_cast<float>(y[j] * inv_t - lse);
    const float p = std::exp(s);
    if (p != 0.0f) pz += static_cast<double>(p) * s;
  }
  return -pz;
}

/// The hard term's logsumexp at temperature 1 and its cross-entropy at `label` (row of y).
void row_hard(const float* y, int64_t V, int64_t label, RowOut* out) {
  const double lse = row_lse(y, V, 1.0f);
  out->stats[3] = static_cast<float>(lse);
  out->hard = static_cast<float>(lse - y[label]);
}

/// The full form's sums over the rows ys, yt (transformed, V entries) given both logsumexps (of
/// the whole vocabulary): the divergence D and KL(p_s || m) (the JSD's auxiliary sum; 0
/// otherwise), in double.
void full_sums(const float* ys, const float* yt, int64_t V, const RowMath& m, double lse_s, double lse_t, double* d,
               double* kl_s) {
  *d = 0.0;
  *kl_s = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    const float s = static_cast<float>(ys[j] * m.inv_t - lse_s), t = static_cast<float>(yt[j] * m.inv_t - lse_t);
    *d += detail::divergence_term(m.kind, s, t, m.beta, m.log_1mb, m.log_b);
    if (m.kind == detail::DivergenceKind::kJsd) {
      const float ps = std::exp(s);
      if (ps != 0.0f) *kl_s += static_cast<double>(ps) * (s - detail::mixture_log(s, t, m.log_1mb, m.log_b));
    }
  }
}

/// The auxiliary statistic the backward reads: D (reverse KL), KL(p_s || m) (JSD), 0 (forward KL).
float aux_of(const RowMath& m, double d, double kl_s) {
  return m.kind == detail::DivergenceKind::kReverseKl ? static_cast<float>(d)
         : m.kind == detail::DivergenceKind::kJsd     ? static_cast<float>(kl_s)
                                                      : 0.0f;
}

/// The full form's divergence of the rows ys, yt (transformed), with both logsumexps: D and aux.
void full_divergence(const float* ys, const float* yt, int64_t V, const RowMath& m, double lse_s, double lse_t,
                     RowOut* out) {
  double d = 0.0, kl_s = 0.0;
  full_sums(ys, yt, V, m, lse_s, lse_t, &d, &kl_s);
  out->divergence = static_cast<float>(d);
  out->stats[2] = aux_of(m, d, kl_s);
}

/// The top-k form's sparse distributions of one row: the student's entries s (and the teacher's
/// t) at the valid entries k (teacher log-probability not -inf), and for TopkNorm::kTail the tail
/// entry of each side (its log-sum clamped: then it does not move with the student).
struct Sparse {
  std::vector<float> s, t;
  std::vector<char> valid;
  float s_tail = 0.0f, t_tail = 0.0f;
  bool s_clamped = false;
};

double valid_lse(const std::vector<float>& x, const std::vector<char>& valid) {
  double mx = kNegInf;
  for (size_t k = 0; k < x.size(); ++k) {
    if (valid[k]) mx = std::max(mx, static_cast<double>(x[k]));
  }
  if (mx == kNegInf) return mx;
  double sum = 0.0;
  for (size_t k = 0; k < x.size(); ++k) {
    if (valid[k]) sum += std::exp(x[k] - mx);
  }
  return mx + std::log(sum);
}

/// q: the student's full-vocabulary log-probabilities at the K ids; tlp the teacher's.
void sparse_of(const float* q, const float* tlp, int64_t K, TopkNorm norm, Sparse* sp) {
  sp->s.assign(q, q + K);
  sp->t.assign(tlp, tlp + K);
  sp->valid.resize(K);
  for (int64_t k = 0; k < K; ++k) sp->valid[k] = tlp[k] != -INFINITY;
  if (norm == TopkNorm::kNone) return;
  const double ls = valid_lse(sp->s, sp->valid), lt = valid_lse(sp->t, sp->valid);
  if (norm == TopkNorm::kRenorm) {
    for (int64_t k = 0; k < K; ++k) {
      sp->s[k] = static_cast<float>(sp->s[k] - ls);
      sp->t[k] = static_cast<float>(sp->t[k] - lt);
    }
    return;
  }
  sp->s_clamped = ls > kTailMaxLogSum;
  sp->s_tail = static_cast<float>(std::log(-std::expm1(std::min(ls, kTailMaxLogSum))));
  sp->t_tail = static_cast<float>(std::log(-std::expm1(std::min(lt, kTailMaxLogSum))));
}

double sparse_divergence(const Sparse& sp, const RowMath& m) {
  double d = 0.0;
  for (size_t k = 0; k < sp.s.size(); ++k) {
    if (sp.valid[k]) d += detail::divergence_term(m.kind, sp.s[k], sp.t[k], m.beta, m.log_1mb, m.log_b);
  }
  if (m.norm == TopkNorm::kTail) d += detail::divergence_term(m.kind, sp.s_tail, sp.t_tail, m.beta, m.log_1mb, m.log_b);
  return d;
}

/// dD/dq_k of the top-k form (0 at invalid entries), through the normalisation.
void sparse_grad(const Sparse& sp, const RowMath& m, std::vector<float>* gq) {
  const size_t K = sp.s.size();
  gq->assign(K, 0.0f);
  double total = 0.0;
  for (size_t k = 0; k < K; ++k) {
    if (!sp.valid[k]) continue;
    (*gq)[k] = detail::divergence_dterm(m.kind, sp.s[k], sp.t[k], m.log_1mb, m.log_b, m.one_mb);
    total += (*gq)[k];
  }
  if (m.norm == TopkNorm::kRenorm) {  // s_k = q_k - logsumexp(q): ds_k/dq_j = [k == j] - e^{s_j}
    for (size_t k = 0; k < K; ++k) {
      if (sp.valid[k]) (*gq)[k] -= static_cast<float>(std::exp(sp.s[k]) * total);
    }
  } else if (m.norm == TopkNorm::kTail && !sp.s_clamped) {  // d s_tail / d q_k = -e^{q_k - s_tail}
    const float g_tail = detail::divergence_dterm(m.kind, sp.s_tail, sp.t_tail, m.log_1mb, m.log_b, m.one_mb);
    for (size_t k = 0; k < K; ++k) {
      if (sp.valid[k]) (*gq)[k] -= g_tail * std::exp(sp.s[k] - sp.s_tail);
    }
  }
}

/// The student's log-probabilities at the K ids, from its transformed row y and lse of z.
void topk_q(const float* y, const int64_t* ids, int64_t K, float inv_t, double lse, float* q) {
  for (int64_t k = 0; k < K; ++k) q[k] = static_cast<float>(y[ids[k]] * inv_t - lse);
}

// ---- the forward -----------------------------------------------------------------------------

/// One row of the forward: ys (and yt) the raw logits, transformed in place.
void forward_row(const Problem& p, float* ys, float* yt, int64_t row, int64_t label, RowOut* out, Sparse* sp,
                 std::vector<float>* q) {
  const RowMath& m = p.math;
  const int64_t V = p.V;
  transform_row(ys, V, m.student);
  const double lse_s = row_lse(ys, V, m.inv_t);
  out->stats[0] = static_cast<float>(lse_s);
  out->entropy = static_cast<float>(row_entropy(ys, V, m.inv_t, lse_s));
  if (p.K == 0) {
    transform_row(yt, V, m.teacher);
    const double lse_t = row_lse(yt, V, m.inv_t);
    out->stats[1] = static_cast<float>(lse_t);
    full_divergence(ys, yt, V, m, lse_s, lse_t, out);
  } else {
    const MatrixView& ids = p.call->teacher.topk_ids;
    const MatrixView& tlp = p.call->teacher.topk_logprobs;
    q->resize(p.K);
    topk_q(ys, static_cast<const int64_t*>(ids.data) + row * ids.row_stride, p.K, m.inv_t, lse_s, q->data());
    sparse_of(q->data(), static_cast<const float*>(tlp.data) + row * tlp.row_stride, p.K, m.norm, sp);
    out->divergence = static_cast<float>(sparse_divergence(*sp, m));
  }
  if (label >= 0 && m.hard_weight > 0.0f) row_hard(ys, V, label, out);
}

/// The loss of one row: (1 - w) D + w hard, a term whose factor is 0 left out.
double row_loss(const RowOut& r, float w) {
  double loss = 0.0;
  if (w < 1.0f) loss += (1.0 - w) * r.divergence;
  if (w > 0.0f) loss += static_cast<double>(w) * r.hard;
  return loss;
}

/// The forward's outputs: per-row values (0 at ignored rows), the loss reduced in double in row
/// order, the statistics (rows of `stats_width` floats, the columns past kDistillStatsWidth 0).
Status write_forward(const Problem& p, const std::vector<RowOut>& outs, int64_t stats_width = kDistillStatsWidth) {
  const DistillOutputs& o = p.call->out;
  const int64_t M = static_cast<int64_t>(outs.size());
  float* st = static_cast<float*>(o.stats.data);
  if (p.N > 0) std::fill(st, st + p.N * stats_width, 0.0f);
  for (int64_t k = 0; k < M; ++k) std::copy(outs[k].stats, outs[k].stats + kDistillStatsWidth, st + p.rows[k] * stats_width);
  const struct {
    const VectorView& v;
    float RowOut::*field;
  } per_row[] = {{o.divergence, &RowOut::divergence}, {o.hard, &RowOut::hard}, {o.entropy, &RowOut::entropy}};
  for (const auto& r : per_row) {
    if (r.v.empty()) continue;
    for (int64_t i = 0; i < p.N; ++i) float_ref(r.v, i) = 0.0f;
    for (int64_t k = 0; k < M; ++k) float_ref(r.v, p.rows[k]) = outs[k].*r.field;
  }
  const float w = p.call->options.hard_weight;
  const Reduction red = p.call->options.reduction;
  if (red == Reduction::kNone) {
    for (int64_t i = 0; i < p.N; ++i) float_ref(o.loss, i) = 0.0f;
    for (int64_t k = 0; k < M; ++k) float_ref(o.loss, p.rows[k]) = static_cast<float>(row_loss(outs[k], w));
    return Status::Ok();
  }
  double sum = 0.0;
  for (int64_t k = 0; k < M; ++k) sum += row_loss(outs[k], w);
  if (red == Reduction::kMean) sum = M == 0 ? std::numeric_limits<double>::quiet_NaN() : sum / static_cast<double>(M);
  float_ref(o.loss, 0) = static_cast<float>(sum);
  return Status::Ok();
}

Status forward(const Problem& p, const DistillPlan& plan) {
  const detail::DistillCall& c = *p.call;
  const int64_t M = static_cast<int64_t>(p.rows.size());
  std::vector<RowOut> outs(M);
  if (M > 0) {
    const int threads = c.device.num_threads;
    Head student(c.hidden, c.weight, c.bias, plan.chunk_rows, threads);
    std::unique_ptr<Head> teacher;
    if (p.K == 0) teacher.reset(new Head(c.teacher.hidden, c.teacher.weight, c.teacher.bias, plan.chunk_rows, threads));
    for (int64_t i0 = 0; i0 < M; i0 += plan.chunk_rows) {
      const int64_t rc = std::min(plan.chunk_rows, M - i0);
      float* zs = student.form(p.rows.data() + i0, rc);
      float* zt = teacher ? teacher->form(p.rows.data() + i0, rc) : nullptr;
      parallel_for(rc, 1, threads, [&](int64_t b, int64_t e) {
        Sparse sp;
        std::vector<float> q;
        for (int64_t r = b; r < e; ++r) {
          forward_row(p, zs + r * p.V, zt ? zt + r * p.V : nullptr, p.rows[i0 + r], p.labels[i0 + r], &outs[i0 + r],
                      &sp, &q);
        }
      });
    }
  }
  return write_forward(p, outs);
}

// ---- the backward ----------------------------------------------------------------------------

/// Row k's upstream gradient, the mean's 1 / count included.
float row_upstream(const Problem& p, int64_t k) {
  const detail::DistillCall& c = *p.call;
  const float* g = static_cast<const float*>(c.grad_loss.data);
  if (c.options.reduction == Reduction::kNone) return g[p.rows[k] * c.grad_loss.stride];
  const double scale = c.options.reduction == Reduction::kMean ? 1.0 / static_cast<double>(p.rows.size()) : 1.0;
  return static_cast<float>(g[0] * scale);
}

/// One row of the backward: xs, the student's raw logits, becomes their gradient (of the row's
/// loss times g); yt, the teacher's raw logits (full form), is transformed in place.
void backward_row(const Problem& p, float* xs, float* yt, int64_t row, int64_t label, const float* st, float g,
                  Sparse* sp, std::vector<float>* q, std::vector<float>* gq, std::vector<float>* dk) {
  const RowMath& m = p.math;
  const int64_t V = p.V;
  const float a = m.hard_weight < 1.0f ? (1.0f - m.hard_weight) * g * m.inv_t : 0.0f;  // per unit dz
  const float b = m.hard_weight > 0.0f && p.has_labels ? m.hard_weight * g : 0.0f;
  const double lse_s = st[0];
  transform_row(xs, V, m.student);  // now y
  float sum_gq = 0.0f;
  const int64_t* ids = nullptr;
  if (p.K == 0) {
    transform_row(yt, V, m.teacher);
  } else if (a != 0.0f) {
    const MatrixView& idm = p.call->teacher.topk_ids;
    const MatrixView& tlp = p.call->teacher.topk_logprobs;
    ids = static_cast<const int64_t*>(idm.data) + row * idm.row_stride;
    q->resize(p.K);
    if (p.stats_width > kDistillStatsWidth) {  // a shard: the q of every id, from step 4
      std::copy(st + kDistillStatsWidth, st + kDistillStatsWidth + p.K, q->data());
    } else {
      topk_q(xs, ids, p.K, m.inv_t, lse_s, q->data());
    }
    sparse_of(q->data(), static_cast<const float*>(tlp.data) + row * tlp.row_stride, p.K, m.norm, sp);
    sparse_grad(*sp, m, gq);
    dk->assign(p.K, 0.0f);
    for (int64_t k = 0; k < p.K; ++k) {
      sum_gq += (*gq)[k];
      const int64_t j = ids[k] - p.v0;
      if (j >= 0 && j < V) (*dk)[k] = detail::transform_dy_of_y(m.student, xs[j]);
    }
  }
  for (int64_t j = 0; j < V; ++j) {
    const float y = xs[j];
    float dy = 0.0f;
    if (a != 0.0f) {
      const float s = static_cast<float>(y * m.inv_t - lse_s);
      if (p.K == 0) {
        const float t = static_cast<float>(yt[j] * m.inv_t - st[1]);
        dy = a * detail::distill_logit_grad(m.kind, s, t, st[2], m.log_1mb, m.log_b, m.one_mb);
      } else {
        dy = -a * std::exp(s) * sum_gq;
      }
    }
    if (b != 0.0f) dy += b * (static_cast<float>(std::exp(y - static_cast<double>(st[3]))) - (j == label ? 1.0f : 0.0f));
    xs[j] = dy * detail::transform_dy_of_y(m.student, y);
  }
  if (ids != nullptr) {  // the ids this call's rows hold (all of them but over a shard)
    for (int64_t k = 0; k < p.K; ++k) {
      const int64_t j = ids[k] - p.v0;
      if (j >= 0 && j < V) xs[j] += a * (*gq)[k] * (*dk)[k];
    }
  }
}

/// Where the backward's sums go: grad_weight's float32 accumulator (V, H), grad_bias's (V,),
/// grad_hidden's float32 chunk rows (rows x H); each null when not wanted.
struct Sinks {
  float* gw = nullptr;
  float* gb = nullptr;
  float* gh = nullptr;
};

/// The chunk's three products from its gradient rows dx (rc x V).
void chunk_products(const Problem& p, const Head& student, const float* dx, int64_t rc, const Sinks& sinks) {
  const int64_t V = p.V, H = p.call->hidden.cols;
  const int threads = p.call->device.num_threads;
  const GemmOps& ops = student.ops();
  if (sinks.gh != nullptr) {
    const int64_t hb = grad_hidden_block(H), blocks = (H + hb - 1) / hb;
    parallel_for(blocks, 1, threads, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t h0 = blk * hb;
        ops.nn(rc, std::min(hb, H - h0), V, dx, V, student.weight() + h0, student.weight_ld(), sinks.gh + h0, H, false);
      }
    });
  }
  if (sinks.gw != nullptr || sinks.gb != nullptr) {
    const int64_t blocks = (V + kVocabBlock - 1) / kVocabBlock;
    parallel_for(blocks, 1, threads, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t v0 = blk * kVocabBlock, vb = std::min(kVocabBlock, V - v0);
        if (sinks.gw != nullptr) ops.tn(vb, H, rc, dx + v0, V, student.hidden_rows(), H, sinks.gw + v0 * H, H, true);
        if (sinks.gb == nullptr) continue;
        for (int64_t r = 0; r < rc; ++r) {
          for (int64_t v = 0; v < vb; ++v) sinks.gb[v0 + v] += dx[r * V + v0 + v];
        }
      }
    });
  }
}

/// The gradients into the call's outputs: grad_hidden rows (0 at ignored rows), grad_weight and
/// grad_bias rounded once from their float32 sums.
void store_grads(const Problem& p, const std::vector<float>& gh, const std::vector<float>& gw,
                 const std::vector<float>& gb) {
  const LinearGrads& g = p.call->grads;
  const int64_t H = p.call->hidden.cols, V = p.V;
  if (!g.grad_hidden.empty()) {
    for (int64_t i = 0; i < p.N; ++i) {
      for (int64_t h = 0; h < H; ++h) store_elem(g.grad_hidden.data, g.grad_hidden.dtype, i * g.grad_hidden.row_stride + h, 0.0f);
    }
    for (size_t k = 0; k < p.rows.size(); ++k) {
      for (int64_t h = 0; h < H; ++h) {
        store_elem(g.grad_hidden.data, g.grad_hidden.dtype, p.rows[k] * g.grad_hidden.row_stride + h, gh[k * H + h]);
      }
    }
  }
  if (!g.grad_weight.empty()) {
    parallel_for(V, kVocabBlock, p.call->device.num_threads, [&](int64_t b, int64_t e) {
      for (int64_t v = b; v < e; ++v) {
        for (int64_t h = 0; h < H; ++h) store_elem(g.grad_weight.data, g.grad_weight.dtype, v * g.grad_weight.row_stride + h, gw[v * H + h]);
      }
    });
  }
  if (!g.grad_bias.empty()) {
    for (int64_t v = 0; v < V; ++v) store_elem(g.grad_bias.data, g.grad_bias.dtype, v * g.grad_bias.stride, gb[v]);
  }
}

Status backward(const Problem& p, const DistillPlan& plan) {
  const detail::DistillCall& c = *p.call;
  const int64_t M = static_cast<int64_t>(p.rows.size()), H = c.hidden.cols, V = p.V;
  const LinearGrads& g = c.grads;
  std::vector<float> gh(g.grad_hidden.empty() ? 0 : M * H), gw(g.grad_weight.empty() ? 0 : V * H, 0.0f),
      gb(g.grad_bias.empty() ? 0 : V, 0.0f);
  if (M > 0) {
    const int threads = c.device.num_threads;
    Head student(c.hidden, c.weight, c.bias, plan.chunk_rows, threads);
    std::unique_ptr<Head> teacher;
    if (p.K == 0) teacher.reset(new Head(c.teacher.hidden, c.teacher.weight, c.teacher.bias, plan.chunk_rows, threads));
    const float* stats = static_cast<const float*>(c.stats.data);
    for (int64_t i0 = 0; i0 < M; i0 += plan.chunk_rows) {
      const int64_t rc = std::min(plan.chunk_rows, M - i0);
      float* xs = student.form(p.rows.data() + i0, rc);
      float* yt = teacher ? teacher->form(p.rows.data() + i0, rc) : nullptr;
      parallel_for(rc, 1, threads, [&](int64_t b, int64_t e) {
        Sparse sp;
        std::vector<float> q, gq, dk;
        for (int64_t r = b; r < e; ++r) {
          const int64_t k = i0 + r;
          backward_row(p, xs + r * V, yt ? yt + r * V : nullptr, p.rows[k], p.labels[k],
                       stats + p.rows[k] * p.stats_width, row_upstream(p, k), &sp, &q, &gq, &dk);
        }
      });
      const Sinks sinks{gw.empty() ? nullptr : gw.data(), gb.empty() ? nullptr : gb.data(),
                        gh.empty() ? nullptr : gh.data() + i0 * H};
      chunk_products(p, student, xs, rc, sinks);
    }
  }
  store_grads(p, gh, gw, gb);
  return Status::Ok();
}


// ---- the vocabulary-parallel steps -------------------------------------------------------------
//
// Step 1 gives each row's partial (max, sum of exps) per head over the shard; step 2 folds the
// ranks' partials in rank order (LseAccum: double sums, one rounding); step 3 sums the
// divergence, the JSD's KL(p_s || m) and the entropy over the shard in double, given the global
// log-sum-exps, and hands each sum on as a float32 pair (hi, lo); step 4 adds the ranks' pairs
// in double in rank order and rounds once. Every rank runs steps 2 and 4 on the same gathered
// bits in the same order, so every rank has the same results. Step 5 is the backward above over
// the shard's vocabulary rows (Problem::labels local to the shard).

constexpr int kSW = kDistillShardStatsWidth;
constexpr int kPW = kDistillPartsWidth;

/// A row's partial state over the shard: the max of scale * y_j and the sum of exp(scale * y_j -
/// max) (in double, as row_lse sums, rounded once). No finite entry: (-inf, 0); +inf: (+inf, 1).
detail::LseState row_state(const float* y, int64_t V, float scale) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < V; ++j) mx = std::max(mx, y[j] * scale);
  if (mx == -INFINITY) return detail::LseState{mx, 0.0f, 0.0f};
  if (std::isinf(mx)) return detail::LseState{mx, 1.0f, 0.0f};
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(y[j] * scale - mx);
  return detail::LseState{mx, static_cast<float>(sum), 0.0f};
}

/// Runs row_fn(k, ys, yt) for every counted row k (index into p.rows) with its two heads'
/// transformed logit rows over the shard, chunk by chunk (yt null for a top-k teacher).
template <class RowFn>
void for_each_transformed_row(const Problem& p, const DistillPlan& plan, RowFn&& row_fn) {
  const detail::DistillCall& c = *p.call;
  const int64_t M = static_cast<int64_t>(p.rows.size());
  if (M == 0) return;
  const int threads = c.device.num_threads;
  Head student(c.hidden, c.weight, c.bias, plan.chunk_rows, threads);
  std::unique_ptr<Head> teacher;
  if (p.K == 0) teacher.reset(new Head(c.teacher.hidden, c.teacher.weight, c.teacher.bias, plan.chunk_rows, threads));
  for (int64_t i0 = 0; i0 < M; i0 += plan.chunk_rows) {
    const int64_t rc = std::min(plan.chunk_rows, M - i0);
    float* zs = student.form(p.rows.data() + i0, rc);
    float* zt = teacher ? teacher->form(p.rows.data() + i0, rc) : nullptr;
    parallel_for(rc, 1, threads, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        float* ys = zs + r * p.V;
        float* yt = zt ? zt + r * p.V : nullptr;
        transform_row(ys, p.V, p.math.student);
        if (yt != nullptr) transform_row(yt, p.V, p.math.teacher);
        row_fn(i0 + r, ys, yt);
      }
    });
  }
}

/// Step 1: columns 0, 1 the student's state of z, 2, 3 the teacher's (a top-k teacher: the empty
/// state (-inf, 0)), 4, 5 the student's at temperature 1, 6 its y at the label and 7 the flag 1
/// where this shard holds the label (4..7 with a hard term only).
Status shard_stats(const Problem& p, const DistillPlan& plan) {
  float* out = static_cast<float*>(p.call->shard_stats.data);
  std::fill(out, out + (p.N + 1) * kSW, 0.0f);
  const bool hard = p.has_labels && p.math.hard_weight > 0.0f;
  for_each_transformed_row(p, plan, [&](int64_t k, const float* ys, const float* yt) {
    float* o = out + p.rows[k] * kSW;
    const detail::LseState s = row_state(ys, p.V, p.math.inv_t);
    const detail::LseState t = yt ? row_state(yt, p.V, p.math.inv_t) : detail::LseState{-INFINITY, 0.0f, 0.0f};
    o[0] = s.m;
    o[1] = s.s;
    o[2] = t.m;
    o[3] = t.s;
    if (!hard) return;
    const detail::LseState h = row_state(ys, p.V, 1.0f);
    o[4] = h.m;
    o[5] = h.s;
    if (p.labels[k] >= 0) {
      o[6] = ys[p.labels[k]];
      o[7] = 1.0f;
    }
  });
  return Status::Ok();
}

/// log-sum-exp of a fold, in double (the forward's hard term subtracts from it before rounding).
double accum_lse(const detail::LseAccum& a) { return static_cast<double>(a.m) + std::log(a.s); }

/// Step 2.
Status shard_merge(const detail::DistillCall& c) {
  const int64_t N = c.row_stats.rows, world = c.world;
  std::vector<int64_t> rows, labels;
  counted_rows(c.labels, N, c.options.ignore_index, &rows, &labels);
  float* rs = static_cast<float*>(c.row_stats.data);
  if (N > 0) std::fill(rs, rs + N * kDistillStatsWidth, 0.0f);
  for (int64_t i = 0; i < N; ++i) float_ref(c.hard, i) = 0.0f;
  const bool hard = !c.labels.empty() && c.options.hard_weight > 0.0f;
  const float* g = static_cast<const float*>(c.shard_stats.data);
  for (size_t k = 0; k < rows.size(); ++k) {
    const int64_t i = rows[k];
    detail::LseAccum s = detail::lse_accum_empty(), t = detail::lse_accum_empty(), h = detail::lse_accum_empty();
    double y = 0.0;
    int holders = 0;
    for (int64_t r = 0; r < world; ++r) {  // rank order: the same bits on every rank
      const float* o = g + (r * (N + 1) + i) * kSW;
      detail::lse_accum_add(s, detail::LseState{o[0], o[1], 0.0f});
      detail::lse_accum_add(t, detail::LseState{o[2], o[3], 0.0f});
      if (!hard) continue;
      detail::lse_accum_add(h, detail::LseState{o[4], o[5], 0.0f});
      if (o[7] != 0.0f) {
        y = o[6];
        ++holders;
      }
    }
    if (hard && holders != 1) {
      return Status(StatusCode::kInvalidArgument,
                    "gathered: row " + std::to_string(i) + "'s label " + std::to_string(labels[k]) + " is held by " +
                        std::to_string(holders) + " ranks, not 1 (do the shards tile the vocabulary?)");
    }
    float* o = rs + i * kDistillStatsWidth;
    o[0] = detail::lse_accum_value(s);
    // a top-k teacher's states are all empty: no teacher log-sum-exp (0, as the forward stores)
    o[1] = t.s == 0.0 ? 0.0f : detail::lse_accum_value(t);
    if (!hard) continue;
    const double lse_h = accum_lse(h);
    o[3] = static_cast<float>(lse_h);
    float_ref(c.hard, i) = static_cast<float>(lse_h - y);
  }
  return Status::Ok();
}

/// A double as a float32 pair whose sum in double is the double to about 2^-48 relative.
void split_double(double x, float* hi, float* lo) {
  *hi = static_cast<float>(x);
  *lo = std::isfinite(x) ? static_cast<float>(x - static_cast<double>(*hi)) : 0.0f;
}

/// Step 3: (D, KL(p_s || m), entropy) over the shard, each as a pair. A top-k teacher: the
/// entropy's pair, then q_k = z[id_k] - lse at the ids this shard holds (0 at the others).
Status shard_parts(const Problem& p, const DistillPlan& plan) {
  const detail::DistillCall& c = *p.call;
  const int64_t width = distill_shard_parts_width(p.K);
  float* out = static_cast<float*>(c.parts.data);
  if (p.N > 0) std::fill(out, out + p.N * width, 0.0f);
  const float* rs = static_cast<const float*>(c.row_stats.data);
  const MatrixView& idm = c.teacher.topk_ids;
  for_each_transformed_row(p, plan, [&](int64_t k, const float* ys, const float* yt) {
    const int64_t i = p.rows[k];
    const double lse_s = rs[i * kDistillStatsWidth], lse_t = rs[i * kDistillStatsWidth + 1];
    float* o = out + i * width;
    if (yt != nullptr) {
      double d = 0.0, kl_s = 0.0;
      full_sums(ys, yt, p.V, p.math, lse_s, lse_t, &d, &kl_s);
      split_double(d, o + 0, o + 1);
      split_double(kl_s, o + 2, o + 3);
    } else {
      const int64_t* ids = static_cast<const int64_t*>(idm.data) + i * idm.row_stride;
      for (int64_t t = 0; t < p.K; ++t) {
        const int64_t j = ids[t] - p.v0;
        if (j >= 0 && j < p.V) topk_q(ys, &j, 1, p.math.inv_t, lse_s, o + kPW + t);
      }
    }
    split_double(row_entropy(ys, p.V, p.math.inv_t, lse_s), o + 4, o + 5);
  });
  return Status::Ok();
}

/// Step 4: the ranks' pairs added in rank order in double, then the forward's outputs. The top-k
/// form: the ranks' q columns added in rank order (one rank's entry and zeros: exact), then the
/// divergence of the sparse distributions as the forward forms it; stats carry the q.
Status shard_reduce(const detail::DistillCall& c) {
  const int64_t K = c.topk_k(), width = distill_shard_parts_width(K),
                sw = K > 0 ? distill_shard_stats_width(K) : kDistillStatsWidth;
  Problem p;
  p.call = &c;
  p.math = row_math_of(c.options);
  p.N = c.row_stats.rows;
  p.V = 0;
  p.K = 0;
  p.has_labels = !c.labels.empty();
  counted_rows(c.labels, p.N, c.options.ignore_index, &p.rows, &p.labels);
  const float* g = static_cast<const float*>(c.parts.data);
  const float* rs = static_cast<const float*>(c.row_stats.data);
  std::vector<RowOut> outs(p.rows.size());
  std::vector<float> q(p.rows.size() * K, 0.0f);
  const MatrixView& tlp = c.teacher.topk_logprobs;
  Sparse sp;
  for (size_t k = 0; k < p.rows.size(); ++k) {
    const int64_t i = p.rows[k];
    double sums[3] = {0.0, 0.0, 0.0};
    float* qk = q.data() + k * K;
    for (int64_t r = 0; r < c.world; ++r) {  // rank order: the same bits on every rank
      const float* o = g + (r * p.N + i) * width;
      for (int s = 0; s < 3; ++s) sums[s] += static_cast<double>(o[2 * s]) + static_cast<double>(o[2 * s + 1]);
      for (int64_t t = 0; t < K; ++t) qk[t] += o[kPW + t];
    }
    RowOut& out = outs[k];
    out.entropy = static_cast<float>(sums[2]);
    out.hard = float_ref(c.hard, i);
    std::copy(rs + i * kDistillStatsWidth, rs + (i + 1) * kDistillStatsWidth, out.stats);
    if (K > 0) {
      sparse_of(qk, static_cast<const float*>(tlp.data) + i * tlp.row_stride, K, p.math.norm, &sp);
      out.divergence = static_cast<float>(sparse_divergence(sp, p.math));
    } else {
      out.divergence = static_cast<float>(sums[0]);
      out.stats[2] = aux_of(p.math, sums[0], sums[1]);
    }
  }
  Status s = write_forward(p, outs, sw);
  if (!s.ok() || K == 0) return s;
  float* st = static_cast<float*>(c.out.stats.data);  // the q after the row's statistics
  for (size_t k = 0; k < p.rows.size(); ++k) {
    std::copy(q.data() + k * K, q.data() + (k + 1) * K, st + p.rows[k] * sw + kDistillStatsWidth);
  }
  return Status::Ok();
}
}  // namespace

Status run_distill(const detail::DistillCall& call) {
  Problem p;
  Status s = build_problem(call, &p);
  if (!s.ok()) return s;
  const DistillPlan plan = plan_linear_distill(static_cast<int64_t>(p.rows.size()), p.V, p.K == 0 ? 2 : 1,
                                               call.chunk_budget_bytes);
  return call.backward ? backward(p, plan) : forward(p, plan);
}

Status run_distill_shard(const detail::DistillCall& call) {
  if (call.shard_step == detail::ShardStep::kMerge) return shard_merge(call);
  if (call.shard_step == detail::ShardStep::kReduce || call.shard_step == detail::ShardStep::kReduceTopk) {
    return shard_reduce(call);
  }
  Problem p;
  Status s = build_problem(call, &p);
  if (!s.ok()) return s;
  const DistillPlan plan = plan_linear_distill(static_cast<int64_t>(p.rows.size()), p.V, p.K == 0 ? 2 : 1,
                                               call.chunk_budget_bytes);
  switch (call.shard_step) {
    case detail::ShardStep::kStats:
      return shard_stats(p, plan);
    case detail::ShardStep::kParts:
      return shard_parts(p, plan);
    case detail::ShardStep::kBackward:
      return backward(p, plan);
    default:
      return Status(StatusCode::kInvalidArgument, "shard_step must be one of the vocabulary-parallel steps");
  }
}

}  // namespace cpu
}  // namespace fusedce
