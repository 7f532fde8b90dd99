// Argument checks shared by every backend: one place that knows what a well-formed call is.
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "common/call.h"

namespace fusedce {
namespace detail {
namespace {

Status invalid(const std::string& msg) { return Status(StatusCode::kInvalidArgument, msg); }

bool is_float_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
}
bool is_known_dtype(DType d) {
  return static_cast<int32_t>(d) >= 0 && static_cast<int32_t>(d) <= 4;
}

bool aligned(const void* p, DType d) {
  return reinterpret_cast<uintptr_t>(p) % dtype_size(d) == 0;
}

// Byte range [first, last) a matrix view touches; empty for an empty matrix.
void matrix_range(const MatrixView& m, uintptr_t* first, uintptr_t* last) {
  *first = reinterpret_cast<uintptr_t>(m.data);
  *last = *first;
  if (m.rows > 0 && m.cols > 0) {
    *last = *first + ((m.rows - 1) * m.row_stride + m.cols) * dtype_size(m.dtype);
  }
}

Status check_matrix(const char* name, const MatrixView& m) {
  std::ostringstream os;
  if (!is_known_dtype(m.dtype) || !is_float_dtype(m.dtype)) {
    os << name << " must be float32, bfloat16 or float16";
    return invalid(os.str());
  }
  if (m.rows < 0 || m.cols < 0) {
    os << name << " has a negative size (" << m.rows << " x " << m.cols << ")";
    return invalid(os.str());
  }
  if (m.cols < 1) {
    os << name << " must have at least one column (V >= 1), got V = " << m.cols;
    return invalid(os.str());
  }
  if (m.rows > 1 && m.row_stride < m.cols) {
    os << name << " row_stride (" << m.row_stride << ") must be >= its number of columns ("
       << m.cols << ")";
    return invalid(os.str());
  }
  if (m.rows > 0 && m.data == nullptr) {
    os << name << " is null but has " << m.rows << " rows";
    return invalid(os.str());
  }
  if (m.data != nullptr && !aligned(m.data, m.dtype)) {
    os << name << " is not aligned to its element size (" << dtype_size(m.dtype) << " bytes)";
    return invalid(os.str());
  }
  return Status::Ok();
}

Status check_vector(const char* name, const VectorView& v, DType want, int64_t size) {
  std::ostringstream os;
  if (v.dtype != want) {
    os << name << " must be " << dtype_name(want) << ", got "
       << (is_known_dtype(v.dtype) ? dtype_name(v.dtype) : "an unknown dtype");
    return invalid(os.str());
  }
  if (v.size != size) {
    os << name << " must have " << size << " elements, got " << v.size;
    return invalid(os.str());
  }
  if (size > 1 && v.stride < 1) {
    os << name << " stride must be >= 1, got " << v.stride;
    return invalid(os.str());
  }
  if (size > 0 && v.data == nullptr) {
    os << name << " is null";
    return invalid(os.str());
  }
  if (v.data != nullptr && !aligned(v.data, want)) {
    os << name << " is not aligned to its element size";
    return invalid(os.str());
  }
  return Status::Ok();
}

Status check_target(const VectorView& t, int64_t rows) {
  if (t.dtype != DType::kInt32 && t.dtype != DType::kInt64) {
    return invalid("target must be int32 or int64");
  }
  return check_vector("target", t, t.dtype, rows);
}

Status check_options(const Options& o, int64_t vocab) {
  std::ostringstream os;
  if (!(o.label_smoothing >= 0.0f && o.label_smoothing <= 1.0f)) {
    os << "label_smoothing must be in [0, 1], got " << o.label_smoothing;
    return invalid(os.str());
  }
  if (!std::isfinite(o.logit_scale) || o.logit_scale == 0.0f) {
    os << "logit_scale must be finite and non-zero, got " << o.logit_scale;
    return invalid(os.str());
  }
  if (!(o.softcap >= 0.0f) || !std::isfinite(o.softcap)) {
    os << "softcap must be finite and >= 0 (0 = off), got " << o.softcap;
    return invalid(os.str());
  }
  if (!(o.z_loss >= 0.0f) || !std::isfinite(o.z_loss)) {
    os << "z_loss must be finite and >= 0, got " << o.z_loss;
    return invalid(os.str());
  }
  const int32_t r = static_cast<int32_t>(o.reduction);
  if (r < 0 || r > 2) {
    os << "reduction must be none, sum or mean (got " << r << ")";
    return invalid(os.str());
  }
  if (!o.class_weight.empty() || o.class_weight.size != 0) {
    Status s = check_vector("class_weight", o.class_weight, DType::kFloat32, vocab);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status check_outputs(const CeCall& c) {
  const int64_t n = c.logits.rows;
  const Options& o = c.options;
  const int64_t loss_size = o.reduction == Reduction::kNone ? n : 1;
  Status s = check_vector("loss", c.out.loss, DType::kFloat32, loss_size);
  if (!s.ok()) return s;
  if (c.out.loss.data == nullptr && loss_size > 0) return invalid("loss is null");
  if (!c.out.lse.empty() || c.out.lse.size != 0) {
    s = check_vector("lse", c.out.lse, DType::kFloat32, n);
    if (!s.ok()) return s;
  }
  if (o.return_metrics) {
    s = check_vector("num_correct", c.out.num_correct, DType::kInt64, 1);
    if (!s.ok()) return s;
    s = check_vector("entropy_sum", c.out.entropy_sum, DType::kFloat32, 1);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status check_grad_loss(const VectorView& g, Reduction reduction, int64_t rows) {
  if (reduction == Reduction::kNone) return check_vector("grad_loss", g, DType::kFloat32, rows);
  return check_vector("grad_loss", g, DType::kFloat32, 1);
}

Status check_dlogits(const CeCall& c) {
  Status s = check_matrix("dlogits", c.dlogits);
  if (!s.ok()) return s;
  std::ostringstream os;
  if (c.dlogits.dtype != c.logits.dtype) {
    os << "dlogits must have the logits' dtype (" << dtype_name(c.logits.dtype) << "), got "
       << dtype_name(c.dlogits.dtype);
    return invalid(os.str());
  }
  if (c.dlogits.rows != c.logits.rows || c.dlogits.cols != c.logits.cols) {
    os << "dlogits must be " << c.logits.rows << " x " << c.logits.cols << ", got "
       << c.dlogits.rows << " x " << c.dlogits.cols;
    return invalid(os.str());
  }
  const bool same = c.dlogits.data == c.logits.data &&
                    (c.logits.rows <= 1 || c.dlogits.row_stride == c.logits.row_stride);
  if (c.options.inplace_backward && c.job == Job::kForwardBackward) {
    if (!same) {
      return invalid("options.inplace_backward is set but dlogits does not describe the logits buffer "
                     "(same data pointer and row_stride)");
    }
    return Status::Ok();
  }
  if (same && c.logits.rows > 0) {
    if (c.job == Job::kBackward) return Status::Ok();  // row by row, each element read then written
    return invalid("dlogits is the logits buffer: set options.inplace_backward to overwrite the logits");
  }
  uintptr_t a0, a1, b0, b1;
  matrix_range(c.logits, &a0, &a1);
  matrix_range(c.dlogits, &b0, &b1);
  if (a0 < b1 && b0 < a1 && c.logits.rows > 0) {
    return invalid("dlogits partly overlaps logits: give a separate buffer or the logits "
                   "buffer itself");
  }
  return Status::Ok();
}

}  // namespace

Status validate_call(const CeCall& c) {
  if (c.device.type != DeviceType::kCPU && c.device.type != DeviceType::kCUDA) {
    return invalid("device.type must be kCPU or kCUDA");
  }
  if (c.job == Job::kRescale) {
    Status s = check_matrix("dlogits", c.dlogits);
    if (!s.ok()) return s;
    if (c.grad_loss.size == 1) return check_vector("grad_loss", c.grad_loss, DType::kFloat32, 1);
    return check_vector("grad_loss", c.grad_loss, DType::kFloat32, c.dlogits.rows);
  }
  Status s = check_matrix("logits", c.logits);
  if (!s.ok()) return s;
  s = check_target(c.target, c.logits.rows);
  if (!s.ok()) return s;
  s = check_options(c.options, c.logits.cols);
  if (!s.ok()) return s;
  if (c.job == Job::kForward || c.job == Job::kForwardBackward) {
    s = check_outputs(c);
    if (!s.ok()) return s;
  }
  if (c.job == Job::kBackward) {
    s = check_vector("lse", c.lse_in, DType::kFloat32, c.logits.rows);
    if (!s.ok()) return s;
    s = check_grad_loss(c.grad_loss, c.options.reduction, c.logits.rows);
    if (!s.ok()) return s;
  }
  if (c.job == Job::kForwardBackward && (!c.grad_loss.empty() || c.grad_loss.size != 0)) {
    s = check_grad_loss(c.grad_loss, c.options.reduction, c.logits.rows);
    if (!s.ok()) return s;
  }
  if (c.job == Job::kBackward || c.job == Job::kForwardBackward) {
    s = check_dlogits(c);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

namespace {

/// The parts of a vocabulary-parallel linear step that differ from a whole-vocabulary call (the
/// inputs were checked by validate_linear_call, V being the shard's rows).
Status validate_linear_shard(const LinearCall& c) {
  std::ostringstream os;
  const int64_t N = c.hidden.rows, H = c.hidden.cols, V = c.weight.rows;
  if (c.shard.vocab_total < 1) return invalid("shard.vocab_total must be >= 1");
  if (c.shard.vocab_start < 0 || c.shard.vocab_start + V > c.shard.vocab_total) {
    os << "shard.vocab_start (" << c.shard.vocab_start << ") + the shard's " << V
       << " rows of weight must lie within shard.vocab_total (" << c.shard.vocab_total << ")";
    return invalid(os.str());
  }
  if (c.shard_step == 1) {
    const MatrixView& m = c.stats;
    if (m.dtype != DType::kFloat32 || m.rows != N + 1 || m.cols != kShardStatsWidth ||
        (m.rows > 1 && m.row_stride != kShardStatsWidth) || m.data == nullptr) {
      os << "stats must be a contiguous float32 (" << N + 1 << ", " << kShardStatsWidth << ") matrix";
      return invalid(os.str());
    }
    return Status::Ok();
  }
  if (c.shard_step != 3) return invalid("shard_step must be 1 or 3");
  Status s = check_vector("lse", c.lse_in, DType::kFloat32, N);
  if (!s.ok()) return s;
  s = check_vector("row_weight", c.row_weight, DType::kFloat32, N);
  if (!s.ok()) return s;
  s = check_vector("batch", c.batch, DType::kFloat32, 2);
  if (!s.ok()) return s;
  s = check_grad_loss(c.grad_loss, c.options.reduction, N);
  if (!s.ok()) return s;
  return check_linear_grads_arg(c.grads, N, V, H, c.hidden.dtype, DType::kFloat32);
}

}  // namespace

Status validate_linear_call(const LinearCall& c) {
  if (c.device.type != DeviceType::kCPU && c.device.type != DeviceType::kCUDA) {
    return invalid("device.type must be kCPU or kCUDA");
  }
  Status s = check_matrix("hidden", c.hidden);
  if (!s.ok()) return s;
  s = check_matrix("weight", c.weight);
  if (!s.ok()) return s;
  std::ostringstream os;
  if (c.weight.dtype != c.hidden.dtype) {
    os << "weight must have hidden's dtype (" << dtype_name(c.hidden.dtype) << "), got " << dtype_name(c.weight.dtype);
    return invalid(os.str());
  }
  if (c.weight.cols != c.hidden.cols) {
    os << "weight must be (V, H) with H = hidden's " << c.hidden.cols << " columns, got " << c.weight.cols;
    return invalid(os.str());
  }
  if (c.weight.rows < 1) return invalid("weight must have at least one row (V >= 1)");
  const int64_t N = c.hidden.rows, H = c.hidden.cols, V = c.weight.rows;
  if (!c.bias.empty() || c.bias.size != 0) {
    s = check_vector("bias", c.bias, c.hidden.dtype, V);
    if (!s.ok()) return s;
  }
  s = check_target(c.target, N);
  if (!s.ok()) return s;
  s = check_options(c.options, V);
  if (!s.ok()) return s;
  if (c.linear.shift_seq_len < 0 || (c.linear.shift_seq_len > 0 && N % c.linear.shift_seq_len != 0)) {
    os << "shift_seq_len must be 0 (no shift) or divide the " << N << " rows, got " << c.linear.shift_seq_len;
    return invalid(os.str());
  }
  if (c.shard_step != 0) return validate_linear_shard(c);
  CeCall as_ce{};
  as_ce.job = c.job;
  as_ce.logits = MatrixView{c.hidden.data, c.hidden.dtype, N, V, V};
  as_ce.options = c.options;
  as_ce.out = c.out;
  s = check_outputs(as_ce);
  if (!s.ok()) return s;
  if (c.job == Job::kForwardBackward) {
    if (!c.grad_loss.empty() || c.grad_loss.size != 0) {
      s = check_grad_loss(c.grad_loss, c.options.reduction, N);
      if (!s.ok()) return s;
    }
    s = check_linear_grads_arg(c.grads, N, V, H, c.hidden.dtype, c.hidden.dtype);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status validate_shard_call(const ShardCall& c) {
  if (c.device.type != DeviceType::kCPU && c.device.type != DeviceType::kCUDA) {
    return invalid("device.type must be kCPU or kCUDA");
  }
  std::ostringstream os;
  const int64_t N = c.target.size;
  Status s = check_target(c.target, N);
  if (!s.ok()) return s;
  if (c.shard.vocab_total < 1) return invalid("shard.vocab_total must be >= 1");
  if (c.shift_seq_len < 0 || (c.shift_seq_len > 0 && (c.step != 2 || N % c.shift_seq_len != 0))) {
    os << "shift_seq_len must be 0 (no shift) or, in the merge, divide the " << N << " rows, got " << c.shift_seq_len;
    return invalid(os.str());
  }
  if (c.step == 1 || c.step == 3) {
    s = check_matrix("logits", c.logits);
    if (!s.ok()) return s;
    if (c.logits.rows != N) {
      os << "logits must have the target's " << N << " rows, got " << c.logits.rows;
      return invalid(os.str());
    }
    if (c.shard.vocab_start < 0 || c.shard.vocab_start + c.logits.cols > c.shard.vocab_total) {
      os << "shard.vocab_start (" << c.shard.vocab_start << ") + the shard's " << c.logits.cols
         << " columns must lie within shard.vocab_total (" << c.shard.vocab_total << ")";
      return invalid(os.str());
    }
    s = check_options(c.options, c.logits.cols);
    if (!s.ok()) return s;
  } else {
    Options o = c.options;
    o.class_weight = VectorView{};  // step 2 reads the weights from the gathered statistics
    s = check_options(o, c.shard.vocab_total);
    if (!s.ok()) return s;
  }
  if (c.step == 1 || c.step == 2) {
    const int64_t rows = c.step == 1 ? N + 1 : c.world * (N + 1);
    if (c.step == 2 && c.world < 1) return invalid("world must be >= 1");
    const MatrixView& m = c.stats;
    if (m.dtype != DType::kFloat32 || m.rows != rows || m.cols != kShardStatsWidth ||
        (m.rows > 1 && m.row_stride != kShardStatsWidth) || m.data == nullptr) {
      os << (c.step == 1 ? "stats" : "gathered") << " must be a contiguous float32 (" << rows << ", "
         << kShardStatsWidth << ") matrix";
      return invalid(os.str());
    }
  }
  if (c.step == 2) {
    CeCall as_ce{};
    as_ce.job = Job::kForward;
    as_ce.logits = MatrixView{c.stats.data, DType::kFloat32, N, c.shard.vocab_total, c.shard.vocab_total};
    as_ce.options = c.options;
    as_ce.out = c.out;
    s = check_outputs(as_ce);
    if (!s.ok()) return s;
    s = check_vector("lse", c.out.lse, DType::kFloat32, N);  // the backward step needs it
    if (!s.ok()) return s;
  }
  if (c.step == 2 || c.step == 3) {
    s = check_vector("row_weight", c.row_weight, DType::kFloat32, N);
    if (!s.ok()) return s;
    s = check_vector("batch", c.batch, DType::kFloat32, 2);
    if (!s.ok()) return s;
  }
  if (c.step == 3) {
    s = check_vector("lse", c.lse, DType::kFloat32, N);
    if (!s.ok()) return s;
    s = check_grad_loss(c.grad_loss, c.options.reduction, N);
    if (!s.ok()) return s;
    CeCall as_ce{};
    as_ce.job = Job::kBackward;
    as_ce.logits = c.logits;
    as_ce.dlogits = c.dlogits;
    as_ce.options = c.options;
    s = check_dlogits(as_ce);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status check_targets_host(const VectorView& target, int64_t vocab, int64_t ignore_index, int64_t shift_seq_len) {
  for (int64_t i = 0; i < target.size; ++i) {
    const int64_t t = shifted_target(target, shift_seq_len, ignore_index, i);
    if (t != ignore_index && (t < 0 || t >= vocab)) {
      std::ostringstream os;
      os << "target[" << (shift_seq_len > 0 ? i + 1 : i) << "] = " << t << " is out of range [0, " << vocab
         << ") and is not ignore_index (" << ignore_index << ")";
      return Status(StatusCode::kTargetOutOfRange, os.str());
    }
  }
  return Status::Ok();
}

}  // namespace detail
}  // namespace fusedce

namespace fusedce {
namespace detail {

// The argument checks above, for the validators of other entry points (logprobs.cpp).
Status check_matrix_arg(const char* name, const MatrixView& m) { return check_matrix(name, m); }
Status check_vector_arg(const char* name, const VectorView& v, DType want, int64_t size) {
  return check_vector(name, v, want, size);
}
Status check_target_arg(const VectorView& t, int64_t rows) { return check_target(t, rows); }

Status check_linear_grads_arg(const LinearGrads& g, int64_t N, int64_t V, int64_t H, DType dtype,
                              DType grad_hidden_dtype) {
  const struct {
    const char* name;
    const MatrixView& m;
    int64_t rows;
    DType dtype;
  } mats[] = {{"grad_hidden", g.grad_hidden, N, grad_hidden_dtype}, {"grad_weight", g.grad_weight, V, dtype}};
  for (const auto& m : mats) {
    if (m.m.empty() && m.m.rows == 0) continue;
    Status s = check_matrix(m.name, m.m);
    if (!s.ok()) return s;
    if (m.m.dtype != m.dtype || m.m.rows != m.rows || m.m.cols != H) {
      std::ostringstream os;
      os << m.name << " must be " << m.rows << " x " << H << " " << dtype_name(m.dtype) << ", got " << m.m.rows
         << " x " << m.m.cols << " " << dtype_name(m.m.dtype);
      return invalid(os.str());
    }
  }
  if (!g.grad_bias.empty() || g.grad_bias.size != 0) return check_vector("grad_bias", g.grad_bias, dtype, V);
  return Status::Ok();
}

}  // namespace detail
}  // namespace fusedce
