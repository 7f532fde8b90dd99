// The vocabulary-parallel linear distillation's steps (fusedce/distill.h, linear_distill_shard_*)
// on each test backend (the CPU; a CUDA device where built and present), with W = 1, 2 and 3
// ranks simulated in one process: the heads split by
// vocabulary rows (uneven shards, a shard of one row among them), each rank's steps 1, 3 and 5
// over its rows, the gathers done here in rank order, steps 2 and 4 run once per rank. Checked
// against linear_distill_forward / linear_distill_backward of the same inputs on one device, and
// every rank's steps 2 and 4 against each other bit for bit. Both forms: a teacher head (split
// as the student's), and the teacher's top-k (global ids, whole on every rank; step 4 is
// linear_distill_topk_shard_reduce). Then bad input, each named.
//
// Tolerances (why each is what it is): both calls compute the same float32 logits (the same
// products, by vocabulary blocks whose order the shard split may change) and sum over the
// vocabulary in double from float32 terms; the single-device call is within test_distill.cpp's
// float32 budget of the exact value, and so is the sharded one (its per-shard sums of exps are
// rounded to float32 once per shard and rank, a few roundoffs more), so the two differ by at most
// twice that budget:
//  - values: 2 * 4 (sqrt(H + H_t) + sqrt(V)) u32 times the largest of 1 and |value|;
//  - gradients: 2 * 4 sqrt(V + H + N) u32 times the largest |single-device value|, plus, for
//    bfloat16 grad_weight and grad_bias (each rounded once from a float32 sum), two units of
//    bfloat16 roundoff relative (the two float32 sums may round to neighbouring values);
//    grad_hidden is the float32 sum of the ranks' parts, in rank order (the caller's all-reduce);
//    for a top-k teacher times 1 + its largest |t| (test_distill.cpp's amplification).
// On a CUDA device with bfloat16 inputs each call holds its logits chunks in bfloat16, and the
// two calls' products (over the whole vocabulary or a shard's rows) may round a logit to
// neighbouring values: the values' tolerance adds 2 bfloat16 roundoffs of the largest |z|
// (a divergence, entropy or log-sum-exp moves by at most the largest change of a logit), and
// the gradients' rtol is the same two units. grad_weight and grad_bias add that largest change
// of a logit times their largest |entry|: a logit moved by d moves its row's probabilities by a
// factor within e^(+-2d), so every term of the sum over rows by up to about 2d of its size, and
// the sum cancels (an entry can be far below its terms, so a bound relative to it would not hold).
// Planted: step 4 skipping the last rank's parts fails every W = 2, 3 case with counted rows;
// step 5 of the top-k form summing dD/dq over the shard's own ids only fails every top-k case of
// W = 2, 3 with counted rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend.h"
#include "common/numeric.h"
#include "fusedce/fusedce.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

constexpr int64_t kIgnore = -100;
constexpr double kU32 = 1.0 / (1 << 24);
constexpr int kSW = fusedce::kDistillShardStatsWidth;
constexpr int kPW = fusedce::kDistillPartsWidth;
constexpr int kRW = fusedce::kDistillStatsWidth;

const fusedce::Device kCpu = fusedce::Device::cpu();

struct VpCase {
  const char* name;
  int64_t n, h, h_t, v;
  std::vector<int64_t> shard_rows;  // V_local per rank, in rank order; sums to v
  double beta, temperature, hard_weight;
  Reduction reduction;
  bool labels, bias;
  double ignore_frac;
  size_t budget = 0;
  float s_scale = 1.0f, s_cap = 0.0f, t_scale = 1.0f, t_cap = 0.0f;
  int64_t k = 0;  // the top-k form: K >= 1 teacher ids (global) and log-probabilities
  fusedce::TopkNorm norm = fusedce::TopkNorm::kNone;
  bool repeats = false, absent = false;  // an id repeated in a row; -inf entries
};

/// A head's operands in `dtype`: the bytes the calls read.
struct Head {
  DType dtype;
  int64_t h, v;
  std::vector<uint8_t> hidden, weight, bias;
  size_t el() const { return dtype == DType::kFloat32 ? 4 : 2; }
};

std::vector<uint8_t> encode(const std::vector<double>& x, DType d) {
  const size_t el = d == DType::kFloat32 ? 4 : 2;
  std::vector<uint8_t> out(std::max<size_t>(x.size(), 1) * el);
  for (size_t i = 0; i < x.size(); ++i) {
    const float f = static_cast<float>(x[i]);
    if (d == DType::kFloat32) {
      std::memcpy(out.data() + i * 4, &f, 4);
    } else {
      const uint16_t b = fusedce::detail::float_to_bf16(f);
      std::memcpy(out.data() + i * 2, &b, 2);
    }
  }
  return out;
}

std::vector<double> decode(const std::vector<uint8_t>& b, DType d, size_t count) {
  std::vector<double> out(count);
  for (size_t i = 0; i < count; ++i) {
    if (d == DType::kFloat32) {
      float f;
      std::memcpy(&f, b.data() + i * 4, 4);
      out[i] = f;
    } else {
      uint16_t u;
      std::memcpy(&u, b.data() + i * 2, 2);
      out[i] = fusedce::detail::bf16_to_float(u);
    }
  }
  return out;
}

Head make_head(int64_t n, int64_t h, int64_t v, double wscale, bool bias, DType d, std::mt19937& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> x(n * h), w(v * h), b;
  for (double& e : x) e = nd(rng);
  for (double& e : w) e = nd(rng) * wscale / std::sqrt(static_cast<double>(h));
  if (bias) {
    for (int64_t j = 0; j < v; ++j) b.push_back(0.5 * nd(rng) + (j % 37 == 5 ? 5.0 : 0.0));  // outliers
  }
  return Head{d, h, v, encode(x, d), encode(w, d), encode(b, d)};
}

struct Inputs {
  VpCase c;
  DType dtype;
  Head student, teacher;
  std::vector<int64_t> labels, ids;
  std::vector<float> tlp, grad_loss;
  fusedce::DistillOptions options;
};

/// The top-k teacher of each row: K ids of a random peaked distribution over the vocabulary,
/// largest first, and their log-probabilities; a repeated id and absent entries if asked.
void make_topk(const VpCase& c, std::mt19937& rng, Inputs* in) {
  std::normal_distribution<double> nd(0.0, 2.5);
  for (int64_t i = 0; i < c.n; ++i) {
    std::vector<double> z(c.v);
    double m = -1e300, sum = 0.0;
    for (double& x : z) m = std::max(m, x = nd(rng));
    for (double x : z) sum += std::exp(x - m);
    std::vector<int64_t> order(c.v);
    for (int64_t j = 0; j < c.v; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return z[a] > z[b]; });
    for (int64_t k = 0; k < c.k; ++k) {
      in->ids.push_back(order[k]);
      in->tlp.push_back(static_cast<float>(z[order[k]] - m - std::log(sum)));
    }
    if (c.repeats && c.k > 2) {
      in->ids[i * c.k + c.k - 1] = in->ids[i * c.k];
      in->tlp[i * c.k + c.k - 1] = in->tlp[i * c.k];
    }
    if (c.absent && c.k > 1 && i % 2 == 0) in->tlp[i * c.k + 1] = -INFINITY;
  }
  in->ids.resize(std::max<size_t>(in->ids.size(), 1));
  in->tlp.resize(std::max<size_t>(in->tlp.size(), 1));
}

Inputs make_inputs(const VpCase& c, DType dtype) {
  std::mt19937 rng(static_cast<uint32_t>(c.n * 131 + c.v * 7 + static_cast<int>(c.beta * 10)));
  Inputs in{c, dtype, make_head(c.n, c.h, c.v, 2.0, c.bias, dtype, rng),
            make_head(c.n, c.h_t, c.v, 2.5, c.bias, dtype, rng), {}, {}, {}, {}, {}};
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  for (int64_t i = 0; c.labels && i < c.n; ++i) {
    in.labels.push_back(ud(rng) < c.ignore_frac ? kIgnore : static_cast<int64_t>(rng() % c.v));
  }
  in.labels.resize(std::max<size_t>(in.labels.size(), 1));
  std::normal_distribution<double> gd(1.0, 0.5);
  in.grad_loss.resize(c.reduction == Reduction::kNone ? std::max<int64_t>(c.n, 1) : 1);
  for (float& g : in.grad_loss) g = static_cast<float>(gd(rng));
  if (c.k > 0) make_topk(c, rng, &in);
  fusedce::DistillOptions& o = in.options;
  o.beta = static_cast<float>(c.beta);
  o.temperature = static_cast<float>(c.temperature);
  o.hard_weight = static_cast<float>(c.hard_weight);
  o.ignore_index = kIgnore;
  o.reduction = c.reduction;
  o.student = fusedce::HeadTransform{c.s_scale, c.s_cap};
  o.teacher = fusedce::HeadTransform{c.t_scale, c.t_cap};
  o.topk_norm = c.norm;
  return in;
}

/// Where a run's buffers live: copies on the backend's device of the host vectors the test
/// holds. in() gives a vector's copy (made once per vector); out() a copy of its current
/// contents that fetch() brings back into the vector.
class Place {
 public:
  explicit Place(Backend& be) : be_(be) {}
  fusedce::Device device() const { return be_.device(); }

  template <typename T>
  uint8_t* in(const std::vector<T>& v) {
    for (const auto& e : inputs_) {
      if (e.first == static_cast<const void*>(v.data())) return static_cast<uint8_t*>(e.second.data());
    }
    inputs_.emplace_back(v.data(), DeviceBuffer::from_vector(be_, v));
    return static_cast<uint8_t*>(inputs_.back().second.data());
  }

  template <typename T>
  T* out(std::vector<T>& v) {
    outputs_.push_back(Output{DeviceBuffer::from_vector(be_, v), v.data(), v.size() * sizeof(T)});
    return static_cast<T*>(outputs_.back().buffer.data());
  }

  /// Every out() buffer back into its vector (after the backend finished).
  void fetch() {
    be_.synchronize();
    for (Output& o : outputs_) o.buffer.download(o.host, o.bytes);
  }

 private:
  struct Output {
    DeviceBuffer buffer;
    void* host;
    size_t bytes;
  };
  Backend& be_;
  std::vector<std::pair<const void*, DeviceBuffer>> inputs_;
  std::vector<Output> outputs_;
};

/// The views of rows [start, start + rows) of a head (rows = v: the whole head).
struct HeadViews {
  fusedce::MatrixView hidden, weight;
  fusedce::VectorView bias;
};

HeadViews views_of(Place& at, const Head& hd, int64_t n, int64_t start, int64_t rows, bool bias) {
  HeadViews hv;
  hv.hidden = fusedce::matrix(at.in(hd.hidden), hd.dtype, n, hd.h);
  hv.weight = fusedce::matrix(at.in(hd.weight) + start * hd.h * hd.el(), hd.dtype, rows, hd.h);
  if (bias) hv.bias = fusedce::vector(at.in(hd.bias) + start * hd.el(), hd.dtype, rows);
  return hv;
}

/// What a forward and backward give: the per-row outputs, the loss, the backward's statistics
/// and the gradients (grad_weight, grad_bias in the inputs' dtype, decoded).
struct Result {
  std::vector<float> loss, divergence, hard, entropy, stats, gh;
  std::vector<double> gw, gb;
};

fusedce::VectorView labels_view(Place& at, const Inputs& in) {
  return in.c.labels ? fusedce::vector(at.in(in.labels), DType::kInt64, in.c.n) : fusedce::VectorView{};
}

fusedce::VectorView grad_loss_view(Place& at, const Inputs& in) {
  return fusedce::vector(at.in(in.grad_loss), DType::kFloat32, in.c.reduction == Reduction::kNone ? in.c.n : 1);
}

int64_t loss_len(const VpCase& c) { return c.reduction == Reduction::kNone ? c.n : 1; }

/// Forward outputs over `r`'s buffers (their copies at `at`), sized for the case; stats of
/// `stats_width` columns.
fusedce::DistillOutputs outputs_of(Place& at, const VpCase& c, Result* r, int64_t stats_width = kRW) {
  const int64_t n1 = std::max<int64_t>(c.n, 1);
  r->loss.assign(std::max<int64_t>(loss_len(c), 1), -7.0f);
  r->divergence.assign(n1, -7.0f);
  r->hard.assign(n1, -7.0f);
  r->entropy.assign(n1, -7.0f);
  r->stats.assign(n1 * stats_width, -7.0f);
  fusedce::DistillOutputs out;
  out.loss = fusedce::vector(at.out(r->loss), DType::kFloat32, loss_len(c));
  out.divergence = fusedce::vector(at.out(r->divergence), DType::kFloat32, c.n);
  out.hard = fusedce::vector(at.out(r->hard), DType::kFloat32, c.n);
  out.entropy = fusedce::vector(at.out(r->entropy), DType::kFloat32, c.n);
  out.stats = fusedce::matrix(at.out(r->stats), DType::kFloat32, c.n, stats_width);
  return out;
}

/// Gradient buffers for `rows` vocabulary rows: grad_hidden float32 (n, h), grad_weight and
/// grad_bias in the inputs' dtype.
struct GradBufs {
  std::vector<float> gh;
  std::vector<uint8_t> gw, gb;
  fusedce::LinearGrads grads;
};

void make_grads(Place& at, const Inputs& in, int64_t rows, GradBufs* g) {
  const int64_t n = in.c.n, h = in.c.h;
  const size_t el = in.student.el();
  g->gh.assign(std::max<int64_t>(n * h, 1), -7.0f);
  g->gw.assign(std::max<int64_t>(rows * h, 1) * el, 0x7f);
  g->gb.assign(std::max<int64_t>(rows, 1) * el, 0x7f);
  g->grads.grad_hidden = fusedce::matrix(at.out(g->gh), DType::kFloat32, n, h);
  g->grads.grad_weight = fusedce::matrix(at.out(g->gw), in.dtype, rows, h);
  if (in.c.bias) g->grads.grad_bias = fusedce::vector(at.out(g->gb), in.dtype, rows);
}

/// The case's teacher: its head's views, or its top-k.
fusedce::DistillTeacher teacher_of(Place& at, const Inputs& in, const HeadViews& t) {
  fusedce::DistillTeacher teacher;
  if (in.c.k > 0) {
    teacher.topk_ids = fusedce::matrix(at.in(in.ids), DType::kInt64, in.c.n, in.c.k);
    teacher.topk_logprobs = fusedce::matrix(at.in(in.tlp), DType::kFloat32, in.c.n, in.c.k);
    return teacher;
  }
  teacher.hidden = t.hidden;
  teacher.weight = t.weight;
  teacher.bias = t.bias;
  return teacher;
}

/// The single-device forward and backward.
Result run_single(Backend& be, const Inputs& in) {
  const VpCase& c = in.c;
  Place at(be);
  Result r;
  const HeadViews s = views_of(at, in.student, c.n, 0, c.v, c.bias), t = views_of(at, in.teacher, c.n, 0, c.v, c.bias);
  const fusedce::DistillOutputs out = outputs_of(at, c, &r);
  const fusedce::Status fs = fusedce::linear_distill_forward(at.device(), s.hidden, s.weight, s.bias,
                                                             teacher_of(at, in, t), labels_view(at, in), in.options,
                                                             c.budget, out);
  EXPECT_TRUE(fs.ok()) << "forward: " << fs.message();
  GradBufs g;
  make_grads(at, in, c.v, &g);
  const fusedce::Status bs = fusedce::linear_distill_backward(at.device(), s.hidden, s.weight, s.bias,
                                                              teacher_of(at, in, t), labels_view(at, in), in.options,
                                                              c.budget, out.stats, grad_loss_view(at, in), g.grads);
  EXPECT_TRUE(bs.ok()) << "backward: " << bs.message();
  at.fetch();
  r.gh = g.gh;
  r.gw = decode(g.gw, in.dtype, c.v * c.h);
  r.gb = decode(g.gb, in.dtype, c.v);
  return r;
}

/// The five steps over the case's shards; every rank's steps 2 and 4 compared bit for bit with
/// rank 0's. Rank 0's forward outputs, grad_hidden the ranks' parts summed in rank order, the
/// ranks' grad_weight and grad_bias rows put together.
Result run_sharded(Backend& be, const Inputs& in) {
  const VpCase& c = in.c;
  Place at(be);
  const int64_t W = static_cast<int64_t>(c.shard_rows.size()), n = c.n;
  std::vector<int64_t> start(W, 0);
  for (int64_t r = 1; r < W; ++r) start[r] = start[r - 1] + c.shard_rows[r - 1];
  auto shard = [&](int64_t r) { return fusedce::ShardSpec{start[r], c.v}; };
  auto student = [&](int64_t r) { return views_of(at, in.student, n, start[r], c.shard_rows[r], c.bias); };
  auto teacher = [&](int64_t r) {
    return teacher_of(at, in, views_of(at, in.teacher, n, start[r], c.shard_rows[r], c.bias));
  };
  const int64_t pw = fusedce::distill_shard_parts_width(c.k), sw = c.k > 0 ? fusedce::distill_shard_stats_width(c.k) : kRW;
  const fusedce::VectorView lv = labels_view(at, in);
  const fusedce::Device dev = at.device();

  // step 1, and the all-gather in rank order
  std::vector<float> gathered(W * (n + 1) * kSW, -7.0f);
  float* const gd = at.out(gathered);
  for (int64_t r = 0; r < W; ++r) {
    const HeadViews s = student(r);
    const fusedce::Status st = fusedce::linear_distill_shard_stats(
        dev, s.hidden, s.weight, s.bias, teacher(r), lv, shard(r), in.options, c.budget,
        fusedce::matrix(gd + r * (n + 1) * kSW, DType::kFloat32, n + 1, kSW));
    EXPECT_TRUE(st.ok()) << "step 1 on rank " << r << ": " << st.message();
  }
  const fusedce::MatrixView gv = fusedce::matrix(gd, DType::kFloat32, W * (n + 1), kSW);

  // step 2 on every rank
  std::vector<std::vector<float>> row_stats(W, std::vector<float>(std::max<int64_t>(n, 1) * kRW, -7.0f)),
      hard(W, std::vector<float>(std::max<int64_t>(n, 1), -7.0f));
  std::vector<float*> rsd(W), hd(W);
  for (int64_t r = 0; r < W; ++r) {
    rsd[r] = at.out(row_stats[r]);
    hd[r] = at.out(hard[r]);
    const fusedce::Status st = fusedce::linear_distill_shard_merge(
        dev, gv, W, lv, in.options, fusedce::matrix(rsd[r], DType::kFloat32, n, kRW),
        fusedce::vector(hd[r], DType::kFloat32, n));
    EXPECT_TRUE(st.ok()) << "step 2 on rank " << r << ": " << st.message();
  }
  at.fetch();
  for (int64_t r = 0; r < W; ++r) {
    EXPECT_EQ(0, std::memcmp(row_stats[r].data(), row_stats[0].data(), row_stats[0].size() * 4))
        << "step 2's row_stats differ between rank " << r << " and rank 0";
    EXPECT_EQ(0, std::memcmp(hard[r].data(), hard[0].data(), hard[0].size() * 4))
        << "step 2's hard differs between rank " << r << " and rank 0";
  }

  // step 3, and the all-gather in rank order
  std::vector<float> parts(std::max<int64_t>(W * n, 1) * pw, -7.0f);
  float* const pd = at.out(parts);
  for (int64_t r = 0; r < W; ++r) {
    const HeadViews s = student(r);
    const fusedce::Status st = fusedce::linear_distill_shard_parts(
        dev, s.hidden, s.weight, s.bias, teacher(r), lv, shard(r), in.options, c.budget,
        fusedce::matrix(rsd[r], DType::kFloat32, n, kRW), fusedce::matrix(pd + r * n * pw, DType::kFloat32, n, pw));
    EXPECT_TRUE(st.ok()) << "step 3 on rank " << r << ": " << st.message();
  }
  const fusedce::MatrixView pv = fusedce::matrix(pd, DType::kFloat32, W * n, pw);

  // step 4 on every rank
  std::vector<Result> outs(W);
  std::vector<fusedce::MatrixView> stats4(W);
  for (int64_t r = 0; r < W; ++r) {
    const fusedce::DistillOutputs out = outputs_of(at, c, &outs[r], sw);
    stats4[r] = out.stats;
    const fusedce::MatrixView rs = fusedce::matrix(rsd[r], DType::kFloat32, n, kRW);
    const fusedce::VectorView hv = fusedce::vector(hd[r], DType::kFloat32, n);
    const fusedce::Status st =
        c.k > 0 ? fusedce::linear_distill_topk_shard_reduce(dev, pv, W, teacher(r).topk_logprobs, lv, in.options, rs, hv, out)
                : fusedce::linear_distill_shard_reduce(dev, pv, W, lv, in.options, rs, hv, out);
    EXPECT_TRUE(st.ok()) << "step 4 on rank " << r << ": " << st.message();
  }
  at.fetch();
  for (int64_t r = 0; r < W; ++r) {
    for (auto field : {&Result::loss, &Result::divergence, &Result::hard, &Result::entropy, &Result::stats}) {
      EXPECT_EQ(0, std::memcmp((outs[r].*field).data(), (outs[0].*field).data(), (outs[0].*field).size() * 4))
          << "step 4's outputs differ between rank " << r << " and rank 0";
    }
  }

  // step 5 on every rank, with its own step 4's stats
  Result res = outs[0];
  if (c.k > 0) {  // the statistics linear_distill_forward writes: the first kRW columns
    res.stats.clear();
    for (int64_t i = 0; i < std::max<int64_t>(n, 1); ++i) {
      res.stats.insert(res.stats.end(), outs[0].stats.begin() + i * sw, outs[0].stats.begin() + i * sw + kRW);
    }
  }
  res.gh.assign(std::max<int64_t>(n * c.h, 1), 0.0f);
  std::vector<GradBufs> grads(W);
  for (int64_t r = 0; r < W; ++r) {
    const HeadViews s = student(r);
    make_grads(at, in, c.shard_rows[r], &grads[r]);
    const fusedce::Status st = fusedce::linear_distill_shard_backward(
        dev, s.hidden, s.weight, s.bias, teacher(r), lv, shard(r), in.options, c.budget, stats4[r],
        grad_loss_view(at, in), grads[r].grads);
    EXPECT_TRUE(st.ok()) << "step 5 on rank " << r << ": " << st.message();
  }
  at.fetch();
  for (int64_t r = 0; r < W; ++r) {
    const GradBufs& g = grads[r];
    for (int64_t i = 0; i < n * c.h; ++i) res.gh[i] += g.gh[i];  // the all-reduce, in rank order
    const std::vector<double> gw = decode(g.gw, in.dtype, c.shard_rows[r] * c.h), gb = decode(g.gb, in.dtype, c.shard_rows[r]);
    res.gw.insert(res.gw.end(), gw.begin(), gw.end());
    res.gb.insert(res.gb.end(), gb.begin(), gb.end());
  }
  return res;
}

double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double v : x) m = std::max(m, std::isnan(v) ? 0.0 : std::abs(v));
  return m;
}

template <typename T>
std::vector<double> doubles(const std::vector<T>& x, size_t count) {
  return std::vector<double>(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(count));
}

/// |got - want| <= atol + rtol |want| entry by entry, NaN where want is NaN; the first few
/// failures reported with the tolerance's parts.
void expect_close(const std::vector<double>& got, const std::vector<double>& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < want.size() && bad < 4; ++i) {
    const double g = got[i], w = want[i];
    if (std::isnan(w) ? !std::isnan(g) : !(std::abs(g - w) <= atol + rtol * std::abs(w))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << w << " (|diff| " << std::abs(g - w)
                    << ", tol atol " << atol << " + rtol " << rtol << " * |want|)";
      ++bad;
    }
  }
}

/// The largest |logit| of a head over the n rows (bias included), from its bytes.
double max_logit(const Head& hd, int64_t n, bool bias) {
  const std::vector<double> x = decode(hd.hidden, hd.dtype, n * hd.h), w = decode(hd.weight, hd.dtype, hd.v * hd.h),
                            b = bias ? decode(hd.bias, hd.dtype, hd.v) : std::vector<double>(hd.v, 0.0);
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < hd.v; ++j) {
      double z = b[j];
      for (int64_t k = 0; k < hd.h; ++k) z += x[i * hd.h + k] * w[j * hd.h + k];
      m = std::max(m, std::abs(z));
    }
  }
  return m;
}

void check_case(Backend& be, const VpCase& c, DType dtype) {
  SCOPED_TRACE(std::string(c.name) + ", beta " + std::to_string(c.beta) + ", norm " + std::to_string(static_cast<int>(c.norm)) +
               ", W = " + std::to_string(c.shard_rows.size()) + ", " +
               fusedce::dtype_name(dtype));
  Inputs in = make_inputs(c, dtype);
  const Result want = run_single(be, in), got = run_sharded(be, in);
  const size_t n = static_cast<size_t>(c.n), ll = static_cast<size_t>(loss_len(c));
  // 16-bit logits chunks on a GPU (see the top of the file): 2 roundoffs of the largest |z| or |y|
  const bool chunks16 = be.kind() == BackendKind::kCuda && dtype != DType::kFloat32;
  double zmax = 0.0;
  if (chunks16) {
    const double y = std::max(std::abs(c.s_scale) * max_logit(in.student, c.n, c.bias),
                              c.k ? 0.0 : std::abs(c.t_scale) * max_logit(in.teacher, c.n, c.bias));
    zmax = y * std::max(1.0, 1.0 / c.temperature);
  }
  const double rounding = chunks16 ? 2.0 / 256 : 0.0;
  const double values = 2.0 * 4.0 * (std::sqrt(static_cast<double>(c.h + (c.k ? 0 : c.h_t))) + std::sqrt(static_cast<double>(c.v))) * kU32;
  auto value_check = [&](const std::vector<float>& g, const std::vector<float>& w, size_t count, const char* what) {
    const std::vector<double> wd = doubles(w, count);
    expect_close(doubles(g, count), wd, values * std::max(1.0, max_abs(wd)) + rounding * zmax, 0.0, what);
  };
  value_check(got.loss, want.loss, ll, "loss");
  value_check(got.divergence, want.divergence, n, "divergence");
  value_check(got.entropy, want.entropy, n, "entropy");
  value_check(got.hard, want.hard, n, "hard");
  value_check(got.stats, want.stats, n * kRW, "stats");  // the log-sum-exps and the auxiliary sum
  // (times 1 + the largest |t| of a top-k teacher: its entries' gradients carry e^s's rounding
  // times |s - t|, test_distill.cpp's rule)
  double amp = 1.0;
  for (float t : in.tlp) amp = std::max(amp, 1.0 + (std::isinf(t) ? 0.0 : std::abs(t)));
  const double grads = 2.0 * 4.0 * std::sqrt(static_cast<double>(c.v + c.h + c.n)) * kU32 * amp;
  const double rtol = dtype == DType::kFloat32 ? 0.0 : 2.0 / 256;
  const std::vector<double> gh = doubles(want.gh, n * c.h);
  expect_close(doubles(got.gh, n * c.h), gh, (grads + rounding) * max_abs(gh) + 1e-30, rounding, "grad_hidden");
  const double moved = rounding * zmax;  // the largest change of a logit between the two calls
  expect_close(got.gw, want.gw, (grads + moved) * max_abs(want.gw) + 1e-30, rtol, "grad_weight");
  if (c.bias) expect_close(got.gb, want.gb, (grads + moved) * max_abs(want.gb) + 1e-30, rtol, "grad_bias");
}

/// Each case with W = 1, 2 and 3 ranks: even, uneven, and a one-row shard between two others.
std::vector<VpCase> vp_cases() {
  std::vector<VpCase> base;
  for (double beta : {0.0, 0.5, 1.0}) {
    base.push_back({"odd V, T 0.7, hard 0.3, bias, mean", 13, 24, 29, 301, {}, beta, 0.7, 0.3, Reduction::kMean, true,
                    true, 0.25});
    base.push_back({"softcap and scale on both heads, no labels, none", 12, 20, 25, 97, {}, beta, 1.5, 0.0,
                    Reduction::kNone, false, false, 0.0, size_t(5) * 97 * 4 * 2, 0.8f, 6.0f, 1.3f, 9.0f});
  }
  base.push_back({"V 1031 in chunks of 3 rows, sum", 37, 40, 45, 1031, {}, 0.5, 1.3, 0.2, Reduction::kSum, true, true,
                  0.2, size_t(3) * 1031 * 4 * 2});
  base.push_back({"hard_weight 1", 11, 16, 21, 130, {}, 0.5, 0.9, 1.0, Reduction::kMean, true, true, 0.3});
  base.push_back({"every row ignored, mean", 6, 8, 13, 50, {}, 0.3, 1.0, 0.2, Reduction::kMean, true, true, 1.0});
  base.push_back({"N = 0, sum", 0, 8, 13, 50, {}, 0.5, 1.0, 0.0, Reduction::kSum, true, true, 0.0});
  std::vector<VpCase> cs;
  for (const VpCase& b : base) {
    const int64_t v = b.v;
    for (const std::vector<int64_t>& rows :
         {std::vector<int64_t>{v}, std::vector<int64_t>{v / 2, v - v / 2}, std::vector<int64_t>{v / 2, 1, v - v / 2 - 1}}) {
      VpCase c = b;
      c.shard_rows = rows;
      cs.push_back(c);
    }
  }
  return cs;
}

/// The top-k form's cases, each with W = 1, 2, 3 as vp_cases splits them.
std::vector<VpCase> topk_vp_cases() {
  std::vector<VpCase> base;
  for (fusedce::TopkNorm norm : {fusedce::TopkNorm::kNone, fusedce::TopkNorm::kRenorm, fusedce::TopkNorm::kTail}) {
    for (double beta : {0.0, 0.5, 1.0}) {
      VpCase a{"K 8 of odd V, hard 0.2, bias, mean", 13, 24, 0, 301, {}, beta, 0.8, 0.2, Reduction::kMean, true, true,
               0.25};
      a.k = 8;
      a.norm = norm;
      base.push_back(a);
    }
    VpCase r{"repeated ids, absent entries, softcap, chunks of 2 rows, none", 11, 16, 0, 77, {}, 0.5, 1.3, 0.0,
             Reduction::kNone, true, true, 0.2, size_t(2) * 77 * 4, 0.9f, 7.0f};
    r.k = 6;
    r.norm = norm;
    r.repeats = r.absent = true;
    base.push_back(r);
    VpCase f{"K = V, no labels, sum", 9, 16, 0, 40, {}, 0.3, 1.0, 0.0, Reduction::kSum, false, false, 0.0};
    f.k = 40;
    f.norm = norm;
    base.push_back(f);
  }
  VpCase none{"every row ignored", 6, 8, 0, 50, {}, 0.5, 1.0, 0.3, Reduction::kMean, true, true, 1.0};
  none.k = 4;
  base.push_back(none);
  std::vector<VpCase> cs;
  for (const VpCase& b : base) {
    const int64_t v = b.v;
    for (const std::vector<int64_t>& rows :
         {std::vector<int64_t>{v}, std::vector<int64_t>{v / 2, v - v / 2}, std::vector<int64_t>{v / 2, 1, v - v / 2 - 1}}) {
      VpCase c = b;
      c.shard_rows = rows;
      cs.push_back(c);
    }
  }
  return cs;
}

class DistillVp : public ::testing::TestWithParam<std::tuple<BackendKind, DType>> {
 protected:
  Backend* backend() {
    Backend* be = find_backend(std::get<0>(GetParam()), &skip_);
    return be;
  }
  std::string skip_;
};

TEST_P(DistillVp, ShardedMatchesSingleDevice) {
  Backend* be = backend();
  if (be == nullptr) GTEST_SKIP() << skip_;
  for (const VpCase& c : vp_cases()) check_case(*be, c, std::get<1>(GetParam()));
}

TEST_P(DistillVp, TopkShardedMatchesSingleDevice) {
  Backend* be = backend();
  if (be == nullptr) GTEST_SKIP() << skip_;
  for (const VpCase& c : topk_vp_cases()) check_case(*be, c, std::get<1>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Backends, DistillVp,
                         ::testing::Combine(::testing::ValuesIn(all_backends()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const auto& info) {
                           return std::string(backend_name(std::get<0>(info.param))) + "_" +
                                  (std::get<1>(info.param) == DType::kFloat32 ? "f32" : "bf16");
                         });

// ---- bad input ----------------------------------------------------------------------------------

/// A small problem of two ranks' worth (V 10, shard rows [0, 5)), its buffers held here.
struct Small {
  static constexpr int64_t N = 4, H = 3, V = 10, VL = 5;
  std::vector<float> hidden = std::vector<float>(N * H, 0.5f), weight = std::vector<float>(V * H, 0.25f);
  std::vector<int64_t> labels = {1, 7, kIgnore, 9};
  std::vector<float> stats = std::vector<float>((N + 1) * kSW), row_stats = std::vector<float>(N * kRW),
                     hard = std::vector<float>(N), parts = std::vector<float>(2 * N * kPW);
  fusedce::DistillOptions options;
  fusedce::MatrixView x() { return fusedce::matrix(hidden.data(), DType::kFloat32, N, H); }
  fusedce::MatrixView w(int64_t rows = VL) { return fusedce::matrix(weight.data(), DType::kFloat32, rows, H); }
  fusedce::DistillTeacher teacher(int64_t rows = VL) {
    fusedce::DistillTeacher t;
    t.hidden = x();
    t.weight = w(rows);
    return t;
  }
  fusedce::VectorView lv() { return fusedce::vector(labels.data(), DType::kInt64, N); }
  fusedce::Status step1(const fusedce::ShardSpec& shard, int64_t stats_rows = N + 1, int64_t rows = VL) {
    return fusedce::linear_distill_shard_stats(kCpu, x(), w(rows), {}, teacher(rows), lv(), shard, options, 0,
                                               fusedce::matrix(stats.data(), DType::kFloat32, stats_rows, kSW));
  }
};

void expect_named(const fusedce::Status& s, const std::string& name) {
  EXPECT_FALSE(s.ok()) << "accepted; want an error naming " << name;
  EXPECT_NE(s.message().find(name), std::string::npos) << "error does not name " << name << ": " << s.message();
}

TEST(DistillVpBadInput, ShardOutsideTheVocabularyIsNamed) {
  Small p;
  expect_named(p.step1(fusedce::ShardSpec{6, Small::V}), "vocab_start");   // rows [6, 11) of 10
  expect_named(p.step1(fusedce::ShardSpec{-1, Small::V}), "vocab_start");  // before the vocabulary
  expect_named(p.step1(fusedce::ShardSpec{0, 0}), "vocab_total");
  EXPECT_TRUE(p.step1(fusedce::ShardSpec{5, Small::V}).ok()) << "the last shard, exactly";
}

TEST(DistillVpBadInput, WrongStatsShapesAreNamed) {
  Small p;
  expect_named(p.step1(fusedce::ShardSpec{0, Small::V}, Small::N), "stats");  // N rows, not N + 1
  const fusedce::Status bad_width = fusedce::linear_distill_shard_stats(
      kCpu, p.x(), p.w(), {}, p.teacher(), p.lv(), fusedce::ShardSpec{0, Small::V}, p.options, 0,
      fusedce::matrix(p.stats.data(), DType::kFloat32, Small::N + 1, kSW - 1));
  expect_named(bad_width, "stats");
  // step 2: one rank's block gathered where two are declared
  const fusedce::Status merge = fusedce::linear_distill_shard_merge(
      kCpu, fusedce::matrix(p.stats.data(), DType::kFloat32, Small::N + 1, kSW), 2, p.lv(), p.options,
      fusedce::matrix(p.row_stats.data(), DType::kFloat32, Small::N, kRW),
      fusedce::vector(p.hard.data(), DType::kFloat32, Small::N));
  expect_named(merge, "gathered");
  // step 3: row_stats of the wrong width
  const fusedce::Status parts = fusedce::linear_distill_shard_parts(
      kCpu, p.x(), p.w(), {}, p.teacher(), p.lv(), fusedce::ShardSpec{0, Small::V}, p.options, 0,
      fusedce::matrix(p.row_stats.data(), DType::kFloat32, Small::N, kRW - 1),
      fusedce::matrix(p.parts.data(), DType::kFloat32, Small::N, kPW));
  expect_named(parts, "row_stats");
  // step 4: the parts of one rank where two are declared
  std::vector<float> loss(1);
  fusedce::DistillOutputs out;
  out.loss = fusedce::vector(loss.data(), DType::kFloat32, 1);
  out.stats = fusedce::matrix(p.row_stats.data(), DType::kFloat32, Small::N, kRW);
  const fusedce::Status reduce = fusedce::linear_distill_shard_reduce(
      kCpu, fusedce::matrix(p.parts.data(), DType::kFloat32, Small::N, kPW), 2, p.lv(), p.options,
      fusedce::matrix(p.row_stats.data(), DType::kFloat32, Small::N, kRW),
      fusedce::vector(p.hard.data(), DType::kFloat32, Small::N), out);
  expect_named(reduce, "gathered");
  const fusedce::Status world = fusedce::linear_distill_shard_reduce(
      kCpu, fusedce::matrix(p.parts.data(), DType::kFloat32, 0, kPW), 0, p.lv(), p.options,
      fusedce::matrix(p.row_stats.data(), DType::kFloat32, Small::N, kRW),
      fusedce::vector(p.hard.data(), DType::kFloat32, Small::N), out);
  expect_named(world, "world");
}

TEST(DistillVpBadInput, TopkShapesAndIdsOutsideAreRefused) {
  Small p;
  std::vector<int64_t> ids(Small::N * 2, 7);  // global ids: another shard's, not this one's
  std::vector<float> lp(Small::N * 2, -1.0f);
  fusedce::DistillTeacher topk;
  topk.topk_ids = fusedce::matrix(ids.data(), DType::kInt64, Small::N, 2);
  topk.topk_logprobs = fusedce::matrix(lp.data(), DType::kFloat32, Small::N, 2);
  auto step1 = [&] {
    return fusedce::linear_distill_shard_stats(kCpu, p.x(), p.w(), {}, topk, p.lv(), fusedce::ShardSpec{0, Small::V},
                                               p.options, 0,
                                               fusedce::matrix(p.stats.data(), DType::kFloat32, Small::N + 1, kSW));
  };
  EXPECT_TRUE(step1().ok()) << "ids in another shard: " << step1().message();
  ids[3] = Small::V;  // one past the vocabulary
  EXPECT_EQ(step1().code(), fusedce::StatusCode::kTargetOutOfRange) << step1().message();
  EXPECT_NE(step1().message().find("teacher_ids"), std::string::npos) << step1().message();
  ids[3] = 7;
  // step 3's parts without the K columns
  const fusedce::Status parts = fusedce::linear_distill_shard_parts(
      kCpu, p.x(), p.w(), {}, topk, p.lv(), fusedce::ShardSpec{0, Small::V}, p.options, 0,
      fusedce::matrix(p.row_stats.data(), DType::kFloat32, Small::N, kRW),
      fusedce::matrix(p.parts.data(), DType::kFloat32, Small::N, kPW));
  expect_named(parts, "parts");
  // step 4: logprobs of another K than the gathered columns; stats without the q columns
  std::vector<float> loss(1), stats(Small::N * fusedce::distill_shard_stats_width(2)),
      gathered(2 * Small::N * fusedce::distill_shard_parts_width(2));
  fusedce::DistillOutputs out;
  out.loss = fusedce::vector(loss.data(), DType::kFloat32, 1);
  out.stats = fusedce::matrix(stats.data(), DType::kFloat32, Small::N, fusedce::distill_shard_stats_width(2));
  auto reduce = [&](int64_t k_logprobs, const fusedce::DistillOutputs& o) {
    return fusedce::linear_distill_topk_shard_reduce(
        kCpu, fusedce::matrix(gathered.data(), DType::kFloat32, 2 * Small::N, fusedce::distill_shard_parts_width(2)), 2,
        fusedce::matrix(lp.data(), DType::kFloat32, Small::N, k_logprobs), p.lv(), p.options,
        fusedce::matrix(p.row_stats.data(), DType::kFloat32, Small::N, kRW),
        fusedce::vector(p.hard.data(), DType::kFloat32, Small::N), o);
  };
  EXPECT_TRUE(reduce(2, out).ok()) << reduce(2, out).message();
  expect_named(reduce(1, out), "gathered");
  fusedce::DistillOutputs narrow = out;
  narrow.stats = fusedce::matrix(stats.data(), DType::kFloat32, Small::N, kRW);
  expect_named(reduce(2, narrow), "stats");
}

TEST(DistillVpBadInput, LabelOutsideTheVocabularyIsRefused) {
  Small p;
  p.labels[3] = Small::V;  // one past the vocabulary (not merely past the shard)
  const fusedce::Status label = p.step1(fusedce::ShardSpec{0, Small::V});
  EXPECT_EQ(label.code(), fusedce::StatusCode::kTargetOutOfRange) << label.message();
}

}  // namespace
}  // namespace fusedce_test
