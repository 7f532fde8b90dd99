// The CPU side of the vocabulary-parallel steps: shard statistics and shard gradients through the
// same row kernels as the whole-vocabulary path (a shard is a row with a column offset), and the
// merge of the gathered statistics, in rank order, folded as every row fold is (detail::LseAccum).
#include <cmath>
#include <cstring>
#include <vector>

#include "common/call.h"
#include "common/constants.h"
#include "cpu/kernels.h"

namespace fusedce {
namespace cpu {
namespace {

template <typename T>
T& at(const VectorView& v, int64_t i) {
  return static_cast<T*>(v.data)[i * v.stride];
}

Status check_global_targets(const detail::ShardCall& c) {
  return detail::check_targets_host(c.target, c.shard.vocab_total, c.options.ignore_index, c.shift_seq_len);
}

/// Row-kernel arguments for a shard (steps 1 and 3).
RowArgs shard_args(const detail::ShardCall& c, const std::vector<float>& weight, float weight_sum) {
  const Options& o = c.options;
  RowArgs a{};
  a.logits = static_cast<const char*>(c.logits.data);
  a.dtype = c.logits.dtype;
  a.vocab = c.logits.cols;
  a.logits_stride = c.logits.row_stride;
  a.target = c.target.data;
  a.target_dtype = c.target.dtype;
  a.target_stride = c.target.stride;
  a.ignore_index = o.ignore_index;
  a.class_weight = weight.empty() ? nullptr : weight.data();
  // Constants of the full vocabulary: eps / V and the smoothing mean are over all V columns.
  a.c = detail::make_loss_constants(o, c.shard.vocab_total, weight_sum);
  a.softcap = o.softcap > 0.0f;
  a.smoothing = o.label_smoothing != 0.0f;
  a.metrics = o.return_metrics;
  a.target_offset = c.shard.vocab_start;
  a.g_chain = 1.0f;
  return a;
}

std::vector<float> local_weights(const Options& o, int64_t n) {
  std::vector<float> w;
  if (o.class_weight.empty()) return w;
  w.resize(n);
  for (int64_t j = 0; j < n; ++j) w[j] = at<const float>(o.class_weight, j);
  return w;
}

Status stats(const detail::ShardCall& c) {
  Status s = check_global_targets(c);
  if (!s.ok()) return s;
  const int64_t N = c.target.size;
  const std::vector<float> w = local_weights(c.options, c.logits.cols);
  double wsum = static_cast<double>(c.logits.cols);
  if (!w.empty()) {
    wsum = 0.0;
    for (float x : w) wsum += x;
  }
  RowArgs a = shard_args(c, w, 0.0f);
  a.forward = true;
  a.partial_out = static_cast<float*>(c.stats.data);
  run_rows(a, N, c.device.num_threads);
  float* last = static_cast<float*>(c.stats.data) + N * kShardStatsWidth;
  for (int k = 0; k < kShardStatsWidth; ++k) last[k] = 0.0f;
  last[0] = static_cast<float>(wsum);
  return Status::Ok();
}

bool argmax_better(float av, int64_t ai, float bv, int64_t bi) {
  // torch.argmax: NaN is the largest value; ties go to the lowest index.
  const bool an = av != av, bn = bv != bv;
  if (an || bn) return an && (!bn || ai < bi);
  return av > bv || (av == bv && ai < bi);
}

Status merge(const detail::ShardCall& c) {
  Status s = check_global_targets(c);
  if (!s.ok()) return s;
  const Options& o = c.options;
  const int64_t N = c.target.size, R = c.world, V = c.shard.vocab_total;
  const float* g = static_cast<const float*>(c.stats.data);
  auto row = [&](int64_t r, int64_t i) { return g + (r * (N + 1) + i) * kShardStatsWidth; };
  double W = 0.0;
  for (int64_t r = 0; r < R; ++r) W += row(r, N)[0];
  const bool weighted = !o.class_weight.empty() || c.options.class_weight.size != 0;
  const detail::LossConstants k = detail::make_loss_constants(o, V, static_cast<float>(W));
  double total = 0.0, den = 0.0, entropy = 0.0;
  int64_t correct = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = detail::shifted_target(c.target, c.shift_seq_len, o.ignore_index, i);
    if (t == o.ignore_index) {
      if (o.reduction == Reduction::kNone) at<float>(c.out.loss, i) = 0.0f;
      at<float>(c.out.lse, i) = 0.0f;
      at<float>(c.row_weight, i) = 0.0f;
      continue;
    }
    detail::LseAccum st = detail::lse_accum_empty();
    double smooth = 0.0;
    float z_t = NAN, w_t = NAN, best = 0.0f;
    int64_t arg = INT64_MAX;
    for (int64_t r = 0; r < R; ++r) {
      const float* p = row(r, i);
      detail::lse_accum_add(st, detail::LseState{p[0], p[1], p[2]});
      smooth += p[5];
      if (p[4] != 0.0f) {
        z_t = p[3];
        w_t = p[8];
      }
      int32_t ai;
      std::memcpy(&ai, &p[7], sizeof(ai));
      if (arg == INT64_MAX || argmax_better(p[6], ai, best, arg)) {
        best = p[6];
        arg = ai;
      }
    }
    if (!weighted) w_t = 1.0f;
    const float lse = detail::lse_accum_value(st);
    const float loss = detail::row_loss(k, lse, z_t, w_t, static_cast<float>(smooth), weighted);
    if (o.reduction == Reduction::kNone) at<float>(c.out.loss, i) = loss;
    at<float>(c.out.lse, i) = lse;
    at<float>(c.row_weight, i) = w_t;
    total += loss;
    den += w_t;
    entropy += detail::lse_accum_entropy(st);
    correct += arg == t;
  }
  if (o.reduction != Reduction::kNone) {
    at<float>(c.out.loss, 0) = static_cast<float>(o.reduction == Reduction::kMean ? total / den : total);
  }
  if (o.return_metrics) {
    at<int64_t>(c.out.num_correct, 0) = correct;
    at<float>(c.out.entropy_sum, 0) = static_cast<float>(entropy);
  }
  at<float>(c.batch, 0) = static_cast<float>(den);
  at<float>(c.batch, 1) = static_cast<float>(W);
  return Status::Ok();
}

Status backward(const detail::ShardCall& c) {
  Status s = check_global_targets(c);
  if (!s.ok()) return s;
  const Options& o = c.options;
  const std::vector<float> w = local_weights(o, c.logits.cols);
  RowArgs a = shard_args(c, w, at<const float>(c.batch, 1));
  a.gradient = true;
  a.lse_in = static_cast<const float*>(c.lse.data);
  a.lse_in_stride = c.lse.stride;
  a.w_t_in = static_cast<const float*>(c.row_weight.data);  // contiguous: validated as (N,), stride 1 below
  a.grad_loss = static_cast<const float*>(c.grad_loss.data);
  a.grad_stride = c.grad_loss.stride;
  a.grad_scalar = o.reduction != Reduction::kNone;
  a.g_chain = o.reduction == Reduction::kMean ? 1.0f / at<const float>(c.batch, 0) : 1.0f;
  a.dlogits = static_cast<char*>(c.dlogits.data);
  a.dlogits_stride = c.dlogits.row_stride;
  std::vector<float> rw;
  if (c.row_weight.stride != 1) {
    rw.resize(c.target.size);
    for (int64_t i = 0; i < c.target.size; ++i) rw[i] = at<const float>(c.row_weight, i);
    a.w_t_in = rw.data();
  }
  run_rows(a, c.target.size, c.device.num_threads);
  return Status::Ok();
}

}  // namespace

Status run_shard(const detail::ShardCall& call) {
  switch (call.step) {
    case 1: return stats(call);
    case 2: return merge(call);
    default: return backward(call);
  }
}

}  // namespace cpu
}  // namespace fusedce
