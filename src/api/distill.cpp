// The entry points of distill.h: the plan, and the forward and backward calls, each built,
// validated once (every message names the argument) and run.
#include "fusedce/distill.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "common/call.h"
#include "common/distill_call.h"

namespace fusedce {

DistillPlan plan_linear_distill(int64_t rows, int64_t vocab, int heads, size_t chunk_budget_bytes) {
  DistillPlan p;
  const size_t budget = chunk_budget_bytes != 0 ? chunk_budget_bytes : kDistillDefaultBudget;
  const size_t row_bytes = size_t(std::max<int64_t>(vocab, 1)) * sizeof(float) * size_t(std::max(heads, 1));
  const int64_t fit = static_cast<int64_t>(std::min<size_t>(budget / row_bytes, size_t(kDistillMaxChunkRows)));
  p.chunk_rows = std::max<int64_t>(1, std::min<int64_t>(fit, std::max<int64_t>(rows, 1)));
  p.chunks = rows <= 0 ? 0 : (rows + p.chunk_rows - 1) / p.chunk_rows;
  p.scratch_bytes = rows <= 0 ? 0 : size_t(p.chunk_rows) * row_bytes;
  return p;
}

namespace detail {
namespace {

Status invalid(const std::string& msg) { return Status(StatusCode::kInvalidArgument, msg); }

#define FUSEDCE_CHECK(expr)  \
  do {                       \
    Status s_ = (expr);      \
    if (!s_.ok()) return s_; \
  } while (0)

Status check_options(const DistillOptions& o) {
  std::ostringstream os;
  if (!(o.beta >= 0.0f && o.beta <= 1.0f)) {
    os << "beta must be in [0, 1], got " << o.beta;
  } else if (!(o.temperature > 0.0f) || !std::isfinite(o.temperature)) {
    os << "temperature must be finite and > 0, got " << o.temperature;
  } else if (!(o.hard_weight >= 0.0f && o.hard_weight <= 1.0f)) {
    os << "hard_weight must be in [0, 1], got " << o.hard_weight;
  } else if (o.reduction != Reduction::kNone && o.reduction != Reduction::kSum && o.reduction != Reduction::kMean) {
    os << "reduction must be kNone, kSum or kMean, got " << static_cast<int32_t>(o.reduction);
  } else if (o.topk_norm != TopkNorm::kNone && o.topk_norm != TopkNorm::kRenorm && o.topk_norm != TopkNorm::kTail) {
    os << "topk_norm must be kNone, kRenorm or kTail, got " << static_cast<int32_t>(o.topk_norm);
  } else {
    const struct {
      const char* name;
      const HeadTransform& h;
    } heads[] = {{"student", o.student}, {"teacher", o.teacher}};
    for (const auto& h : heads) {
      if (!std::isfinite(h.h.logit_scale) || h.h.logit_scale == 0.0f) {
        os << h.name << " logit_scale must be finite and non-zero, got " << h.h.logit_scale;
        break;
      }
      if (!(h.h.softcap >= 0.0f) || !std::isfinite(h.h.softcap)) {
        os << h.name << " softcap must be finite and >= 0 (0 = off), got " << h.h.softcap;
        break;
      }
    }
  }
  return os.str().empty() ? Status::Ok() : invalid(os.str());
}

/// A head's hidden (N, H), weight (V, H) in hidden's dtype, bias (V,) or empty.
Status check_head(const char* prefix, const MatrixView& hidden, const MatrixView& weight, const VectorView& bias,
                  int64_t N, int64_t V) {
  const std::string h = std::string(prefix) + "hidden", w = std::string(prefix) + "weight",
                    b = std::string(prefix) + "bias";
  FUSEDCE_CHECK(check_matrix_arg(h.c_str(), hidden));
  FUSEDCE_CHECK(check_matrix_arg(w.c_str(), weight));
  std::ostringstream os;
  if (hidden.rows != N) {
    os << h << " must have the student's " << N << " rows, got " << hidden.rows;
  } else if (weight.dtype != hidden.dtype) {
    os << w << " must have " << h << "'s dtype (" << dtype_name(hidden.dtype) << "), got " << dtype_name(weight.dtype);
  } else if (weight.cols != hidden.cols) {
    os << w << " must have " << h << "'s " << hidden.cols << " columns (H), got " << weight.cols;
  } else if (weight.rows != V) {
    os << w << " must have the student's vocabulary of " << V << " rows, got " << weight.rows;
  }
  if (!os.str().empty()) return invalid(os.str());
  if (!bias.empty() || bias.size != 0) FUSEDCE_CHECK(check_vector_arg(b.c_str(), bias, hidden.dtype, V));
  return Status::Ok();
}

/// A (N, K) matrix of the top-k teacher: dtype `want`, K >= 1, unit stride along K.
Status check_topk_matrix(const char* name, const MatrixView& m, DType want, int64_t N, int64_t K) {
  std::ostringstream os;
  if (m.dtype != want) {
    os << name << " must be " << dtype_name(want) << ", got " << dtype_name(m.dtype);
  } else if (m.rows != N || m.cols != K || m.cols < 1) {
    os << name << " must be (N, K) = (" << N << ", " << K << ") with K >= 1, got (" << m.rows << ", " << m.cols << ")";
  } else if (m.rows > 1 && m.row_stride < m.cols) {
    os << name << " row_stride (" << m.row_stride << ") must be >= K (" << m.cols << ")";
  } else if (m.rows > 0 && m.data == nullptr) {
    os << name << " is null but has " << m.rows << " rows";
  }
  return os.str().empty() ? Status::Ok() : invalid(os.str());
}

Status check_teacher(const DistillCall& c) {
  const DistillTeacher& t = c.teacher;
  const int64_t N = c.rows(), V = c.vocab();
  if (!t.topk()) return check_head("teacher_", t.hidden, t.weight, t.bias, N, V);
  if (!t.hidden.empty() || !t.weight.empty()) return invalid("teacher: give a head or top-k ids, not both");
  FUSEDCE_CHECK(check_topk_matrix("teacher_ids", t.topk_ids, DType::kInt64, N, t.topk_ids.cols));
  return check_topk_matrix("teacher_logprobs", t.topk_logprobs, DType::kFloat32, N, t.topk_ids.cols);
}

/// labels (N,) int32 / int64 or empty (N rows).
Status check_labels(const DistillCall& c, int64_t N) {
  const VectorView& l = c.labels;
  if (l.empty() && l.size == 0) {
    // (no rows: an empty labels view is indistinguishable from none, and nothing is read)
    if (c.options.hard_weight > 0.0f && N > 0) return invalid("hard_weight > 0 needs labels");
    return Status::Ok();
  }
  if (l.dtype != DType::kInt32 && l.dtype != DType::kInt64) return invalid("labels must be int32 or int64");
  return check_vector_arg("labels", l, l.dtype, N);
}

/// stats: contiguous float32 (N, width): kDistillStatsWidth, or, for the vocabulary-parallel
/// top-k form's step 4 and 5, distill_shard_stats_width(K).
Status check_stats(const MatrixView& m, int64_t N, int64_t width = kDistillStatsWidth) {
  if (m.dtype != DType::kFloat32 || m.rows != N || m.cols != width || (m.rows > 1 && m.row_stride != width) ||
      (N > 0 && m.data == nullptr)) {
    std::ostringstream os;
    os << "stats must be a contiguous float32 (" << N << ", " << width << ") matrix";
    return invalid(os.str());
  }
  return Status::Ok();
}

/// The forward's outputs, for N rows.
Status check_forward_outputs(const DistillCall& c, int64_t N, int64_t stats_width = kDistillStatsWidth) {
  const DistillOutputs& o = c.out;
  FUSEDCE_CHECK(check_vector_arg("loss", o.loss, DType::kFloat32, c.options.reduction == Reduction::kNone ? N : 1));
  const struct {
    const char* name;
    const VectorView& v;
  } per_row[] = {{"divergence", o.divergence}, {"hard", o.hard}, {"entropy", o.entropy}};
  for (const auto& r : per_row) {
    if (!r.v.empty() || r.v.size != 0) FUSEDCE_CHECK(check_vector_arg(r.name, r.v, DType::kFloat32, N));
  }
  return check_stats(o.stats, N, stats_width);
}

/// The gradients asked for: grad_hidden float32 (N, H), grad_weight and grad_bias hidden's dtype.
Status check_grads_args(const DistillCall& c) {
  if ((!c.grads.grad_bias.empty() || c.grads.grad_bias.size != 0) && c.bias.empty()) {
    return invalid("grad_bias is given but bias is not");
  }
  return check_linear_grads_arg(c.grads, c.rows(), c.vocab(), c.hidden.cols, c.hidden.dtype, DType::kFloat32);
}

Status check_backward_args(const DistillCall& c, int64_t stats_width = kDistillStatsWidth) {
  FUSEDCE_CHECK(check_stats(c.stats, c.rows(), stats_width));
  FUSEDCE_CHECK(check_vector_arg("grad_loss", c.grad_loss, DType::kFloat32,
                                 c.options.reduction == Reduction::kNone ? c.rows() : 1));
  return check_grads_args(c);
}

}  // namespace

Status validate_distill_call(const DistillCall& c) {
  if (c.device.type != DeviceType::kCPU && c.device.type != DeviceType::kCUDA) {
    return invalid("device.type must be kCPU or kCUDA");
  }
  FUSEDCE_CHECK(check_options(c.options));
  FUSEDCE_CHECK(check_matrix_arg("hidden", c.hidden));
  if (c.weight.rows < 1) return invalid("weight must have at least one row (V >= 1)");
  FUSEDCE_CHECK(check_head("", c.hidden, c.weight, c.bias, c.rows(), c.vocab()));
  FUSEDCE_CHECK(check_teacher(c));
  FUSEDCE_CHECK(check_labels(c, c.rows()));
  if (c.fused) {
    if (c.options.reduction == Reduction::kNone) {
      return invalid("reduction must be mean or sum for the forward and backward in one call (none needs the "
                     "per-row upstream gradients: call the backward with them)");
    }
    FUSEDCE_CHECK(check_forward_outputs(c, c.rows()));
    return check_grads_args(c);
  }
  return c.backward ? check_backward_args(c) : check_forward_outputs(c, c.rows());
}

namespace {

/// A contiguous float32 (rows, cols) matrix named `name`.
Status check_float_block(const char* name, const MatrixView& m, int64_t rows, int64_t cols) {
  if (m.dtype != DType::kFloat32 || m.rows != rows || m.cols != cols || (m.rows > 1 && m.row_stride != cols) ||
      (rows > 0 && m.data == nullptr)) {
    std::ostringstream os;
    os << name << " must be a contiguous float32 (" << rows << ", " << cols << ") matrix, got " << dtype_name(m.dtype)
       << " (" << m.rows << ", " << m.cols << ")";
    return invalid(os.str());
  }
  return Status::Ok();
}

Status check_shard(const ShardSpec& shard, int64_t local) {
  std::ostringstream os;
  if (shard.vocab_total < 1) {
    os << "shard.vocab_total must be >= 1, got " << shard.vocab_total;
  } else if (shard.vocab_start < 0 || shard.vocab_start + local > shard.vocab_total) {
    os << "shard.vocab_start (" << shard.vocab_start << ") + the shard's " << local
       << " rows of weight must lie within shard.vocab_total (" << shard.vocab_total << ")";
  }
  return os.str().empty() ? Status::Ok() : invalid(os.str());
}

/// The heads of steps 1, 3 and 5: the student's of the shard's V_local rows, and a teacher head
/// of the same rows or the teacher's top-k (global ids, range-checked by the backend).
Status check_shard_heads(const DistillCall& c) {
  FUSEDCE_CHECK(check_matrix_arg("hidden", c.hidden));
  if (c.weight.rows < 1) return invalid("weight must have at least one row (V_local >= 1)");
  FUSEDCE_CHECK(check_head("", c.hidden, c.weight, c.bias, c.rows(), c.vocab()));
  FUSEDCE_CHECK(check_teacher(c));
  FUSEDCE_CHECK(check_shard(c.shard, c.vocab()));
  return check_labels(c, c.rows());
}

}  // namespace

Status validate_distill_shard_call(const DistillCall& c) {
  if (c.device.type != DeviceType::kCPU && c.device.type != DeviceType::kCUDA) {
    return invalid("device.type must be kCPU or kCUDA");
  }
  FUSEDCE_CHECK(check_options(c.options));
  switch (c.shard_step) {
    case ShardStep::kStats:
      FUSEDCE_CHECK(check_shard_heads(c));
      return check_float_block("stats", c.shard_stats, c.rows() + 1, kDistillShardStatsWidth);
    case ShardStep::kParts:
      FUSEDCE_CHECK(check_shard_heads(c));
      FUSEDCE_CHECK(check_float_block("row_stats", c.row_stats, c.rows(), kDistillStatsWidth));
      return check_float_block("parts", c.parts, c.rows(), distill_shard_parts_width(c.topk_k()));
    case ShardStep::kBackward:
      FUSEDCE_CHECK(check_shard_heads(c));
      return check_backward_args(c, c.topk_k() > 0 ? distill_shard_stats_width(c.topk_k()) : kDistillStatsWidth);
    case ShardStep::kMerge:
    case ShardStep::kReduce:
    case ShardStep::kReduceTopk: {
      const int64_t N = c.row_stats.rows;
      if (c.world < 1) return invalid("world must be >= 1, got " + std::to_string(c.world));
      FUSEDCE_CHECK(check_float_block("row_stats", c.row_stats, N, kDistillStatsWidth));
      FUSEDCE_CHECK(check_vector_arg("hard", c.hard, DType::kFloat32, N));
      FUSEDCE_CHECK(check_labels(c, N));
      if (c.shard_step == ShardStep::kMerge) {
        return check_float_block("gathered", c.shard_stats, c.world * (N + 1), kDistillShardStatsWidth);
      }
      const int64_t K = c.topk_k();
      if (c.shard_step == ShardStep::kReduceTopk) {
        FUSEDCE_CHECK(check_topk_matrix("teacher_logprobs", c.teacher.topk_logprobs, DType::kFloat32, N, K));
      }
      FUSEDCE_CHECK(check_float_block("gathered", c.parts, c.world * N, distill_shard_parts_width(K)));
      return check_forward_outputs(c, N, K > 0 ? distill_shard_stats_width(K) : kDistillStatsWidth);
    }
    default:
      return invalid("shard_step must be one of the vocabulary-parallel steps");
  }
}

}  // namespace detail

namespace {

Status dispatch(const detail::DistillCall& call) {
  Status s = detail::validate_distill_call(call);
  if (!s.ok()) return s;
  if (call.device.type == DeviceType::kCUDA) return cuda::run_distill(call);
  if (!call.fused) return cpu::run_distill(call);
  // The CPU: the forward, then the backward from its stats with an upstream gradient of 1.
  detail::DistillCall forward = call;
  forward.fused = false;
  s = cpu::run_distill(forward);
  if (!s.ok()) return s;
  float one = 1.0f;
  detail::DistillCall backward = forward;
  backward.backward = true;
  backward.stats = call.out.stats;
  backward.grad_loss = VectorView{&one, DType::kFloat32, 1, 1};
  return cpu::run_distill(backward);
}

Status dispatch_shard(const detail::DistillCall& call) {
  Status s = detail::validate_distill_shard_call(call);
  if (!s.ok()) return s;
  return call.device.type == DeviceType::kCUDA ? cuda::run_distill_shard(call) : cpu::run_distill_shard(call);
}

detail::DistillCall make_call(bool backward, const Device& device, const MatrixView& hidden, const MatrixView& weight,
                              const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                              const DistillOptions& options, size_t chunk_budget_bytes) {
  detail::DistillCall c{};
  c.backward = backward;
  c.device = device;
  c.hidden = hidden;
  c.weight = weight;
  c.bias = bias;
  c.teacher = teacher;
  c.labels = labels;
  c.options = options;
  c.chunk_budget_bytes = chunk_budget_bytes;
  return c;
}

}  // namespace

Status linear_distill_forward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                              const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                              const DistillOptions& options, size_t chunk_budget_bytes, const DistillOutputs& out,
    Workspace workspace) {
  detail::DistillCall c = make_call(false, device, hidden, weight, bias, teacher, labels, options, chunk_budget_bytes);
  c.out = out;
  c.workspace = workspace;
  return dispatch(c);
}

Status linear_distill_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                               const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                               const DistillOptions& options, size_t chunk_budget_bytes, const MatrixView& stats,
                               const VectorView& grad_loss, const LinearGrads& grads,
    Workspace workspace) {
  detail::DistillCall c = make_call(true, device, hidden, weight, bias, teacher, labels, options, chunk_budget_bytes);
  c.stats = stats;
  c.grad_loss = grad_loss;
  c.grads = grads;
  c.workspace = workspace;
  return dispatch(c);
}

Status linear_distill_forward_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                       const VectorView& bias, const DistillTeacher& teacher,
                                       const VectorView& labels, const DistillOptions& options,
                                       size_t chunk_budget_bytes, const DistillOutputs& out,
                                       const LinearGrads& grads,
    Workspace workspace) {
  detail::DistillCall c = make_call(false, device, hidden, weight, bias, teacher, labels, options, chunk_budget_bytes);
  c.fused = true;
  c.out = out;
  c.grads = grads;
  c.workspace = workspace;
  return dispatch(c);
}

Status linear_distill_shard_stats(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                  const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                                  const ShardSpec& shard, const DistillOptions& options, size_t chunk_budget_bytes,
                                  const MatrixView& stats,
    Workspace workspace) {
  detail::DistillCall c = make_call(false, device, hidden, weight, bias, teacher, labels, options, chunk_budget_bytes);
  c.shard_step = detail::ShardStep::kStats;
  c.shard = shard;
  c.shard_stats = stats;
  c.workspace = workspace;
  return dispatch_shard(c);
}

Status linear_distill_shard_merge(const Device& device, const MatrixView& gathered, int64_t world,
                                  const VectorView& labels, const DistillOptions& options,
                                  const MatrixView& row_stats, const VectorView& hard) {
  detail::DistillCall c = make_call(false, device, {}, {}, {}, {}, labels, options, 0);
  c.shard_step = detail::ShardStep::kMerge;
  c.shard_stats = gathered;
  c.world = world;
  c.row_stats = row_stats;
  c.hard = hard;
  return dispatch_shard(c);
}

Status linear_distill_shard_parts(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                  const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                                  const ShardSpec& shard, const DistillOptions& options, size_t chunk_budget_bytes,
                                  const MatrixView& row_stats, const MatrixView& parts,
    Workspace workspace) {
  detail::DistillCall c = make_call(false, device, hidden, weight, bias, teacher, labels, options, chunk_budget_bytes);
  c.shard_step = detail::ShardStep::kParts;
  c.shard = shard;
  c.row_stats = row_stats;
  c.parts = parts;
  c.workspace = workspace;
  return dispatch_shard(c);
}

Status linear_distill_shard_reduce(const Device& device, const MatrixView& gathered, int64_t world,
                                   const VectorView& labels, const DistillOptions& options,
                                   const MatrixView& row_stats, const VectorView& hard, const DistillOutputs& out) {
  detail::DistillCall c = make_call(false, device, {}, {}, {}, {}, labels, options, 0);
  c.shard_step = detail::ShardStep::kReduce;
  c.parts = gathered;
  c.world = world;
  c.row_stats = row_stats;
  c.hard = hard;
  c.out = out;
  return dispatch_shard(c);
}

Status linear_distill_topk_shard_reduce(const Device& device, const MatrixView& gathered, int64_t world,
                                        const MatrixView& teacher_logprobs, const VectorView& labels,
                                        const DistillOptions& options, const MatrixView& row_stats,
                                        const VectorView& hard, const DistillOutputs& out) {
  detail::DistillCall c = make_call(false, device, {}, {}, {}, {}, labels, options, 0);
  c.shard_step = detail::ShardStep::kReduceTopk;
  c.teacher.topk_logprobs = teacher_logprobs;
  c.parts = gathered;
  c.world = world;
  c.row_stats = row_stats;
  c.hard = hard;
  c.out = out;
  return dispatch_shard(c);
}

Status linear_distill_shard_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                     const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                                     const ShardSpec& shard, const DistillOptions& options, size_t chunk_budget_bytes,
                                     const MatrixView& stats, const VectorView& grad_loss, const LinearGrads& grads,
    Workspace workspace) {
  detail::DistillCall c = make_call(true, device, hidden, weight, bias, teacher, labels, options, chunk_budget_bytes);
  c.shard_step = detail::ShardStep::kBackward;
  c.shard = shard;
  c.stats = stats;
  c.grad_loss = grad_loss;
  c.grads = grads;
  c.workspace = workspace;
  return dispatch_shard(c);
}

size_t linear_distill_workspace_size(DistillJob job, const Device& device, const MatrixView& hidden,
                                     const MatrixView& weight, const DistillTeacher& teacher,
                                     const DistillOptions& options, size_t chunk_budget_bytes,
                                     const LinearGrads& grads) {
  if (device.type != DeviceType::kCUDA) return 0;
  const bool backward = job == DistillJob::kBackward || job == DistillJob::kShardBackward;
  detail::DistillCall c = make_call(backward, device, hidden, weight, {}, teacher, {}, options, chunk_budget_bytes);
  c.fused = job == DistillJob::kForwardBackward;
  if (backward || c.fused) c.grads = grads;
  return cuda::distill_workspace_size(c);
}

}  // namespace fusedce
