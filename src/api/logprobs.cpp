// The entry points of logprobs.h: build the call, validate it once, run it.
#include "fusedce/logprobs.h"

#include <cmath>
#include <sstream>
#include <utility>

#include "common/call.h"
#include "common/logprob_call.h"

namespace fusedce {
namespace detail {
namespace {

Status invalid(const std::string& msg) { return Status(StatusCode::kInvalidArgument, msg); }

#define FUSEDCE_CHECK(expr)  \
  do {                       \
    Status s_ = (expr);      \
    if (!s_.ok()) return s_; \
  } while (0)

Status check_stats(const char* name, const MatrixView& m, int64_t rows) {
  if (m.dtype != DType::kFloat32 || m.rows != rows || m.cols != kLogprobStatsWidth ||
      (m.rows > 1 && m.row_stride != kLogprobStatsWidth) || m.data == nullptr) {
    std::ostringstream os;
    os << name << " must be a contiguous float32 (" << rows << ", " << kLogprobStatsWidth << ") matrix";
    return invalid(os.str());
  }
  return Status::Ok();
}

Status check_shard(const ShardSpec& shard, int64_t local, const char* what) {
  if (shard.vocab_total < 1) return invalid("shard.vocab_total must be >= 1");
  if (shard.vocab_start < 0 || shard.vocab_start + local > shard.vocab_total) {
    std::ostringstream os;
    os << "shard.vocab_start (" << shard.vocab_start << ") + the shard's " << local << " " << what
       << " must lie within shard.vocab_total (" << shard.vocab_total << ")";
    return invalid(os.str());
  }
  return Status::Ok();
}

/// The inputs of steps 1 and 3: logits, or hidden / weight / bias.
Status check_inputs(const LogprobCall& c) {
  const int64_t N = c.rows();
  std::ostringstream os;
  if (!c.linear) {
    FUSEDCE_CHECK(check_matrix_arg("logits", c.logits));
    if (c.logits.rows != N) {
      os << "logits must have the target's " << N << " rows, got " << c.logits.rows;
      return invalid(os.str());
    }
    return check_shard(c.shard, c.logits.cols, "columns");
  }
  FUSEDCE_CHECK(check_matrix_arg("hidden", c.hidden));
  FUSEDCE_CHECK(check_matrix_arg("weight", c.weight));
  if (c.hidden.rows != N) {
    os << "hidden must have the target's " << N << " rows, got " << c.hidden.rows;
    return invalid(os.str());
  }
  if (c.weight.dtype != c.hidden.dtype) {
    os << "weight must have hidden's dtype (" << dtype_name(c.hidden.dtype) << "), got " << dtype_name(c.weight.dtype);
    return invalid(os.str());
  }
  if (c.weight.cols != c.hidden.cols) {
    os << "weight must have hidden's " << c.hidden.cols << " columns (H), got " << c.weight.cols;
    return invalid(os.str());
  }
  if (!c.bias.empty() || c.bias.size != 0) {
    FUSEDCE_CHECK(check_vector_arg("bias", c.bias, c.hidden.dtype, c.weight.rows));
  }
  return check_shard(c.shard, c.weight.rows, "rows of weight");
}

Status check_out(const LogprobOutputs& o, int64_t N, bool need_entropy) {
  FUSEDCE_CHECK(check_vector_arg("logprob", o.logprob, DType::kFloat32, N));
  FUSEDCE_CHECK(check_vector_arg("lse", o.lse, DType::kFloat32, N));
  if (need_entropy || !o.entropy.empty() || o.entropy.size != 0) {
    FUSEDCE_CHECK(check_vector_arg("entropy", o.entropy, DType::kFloat32, N));
  }
  return Status::Ok();
}

/// Step 4's outputs: each float32 (N,) or empty.
Status check_dist(const DistributionStats& d, int64_t N) {
  const std::pair<const char*, const VectorView*> outs[] = {
      {"log_sum_sq_probs", &d.log_sum_sq_probs}, {"mean_logit", &d.mean_logit}, {"is_top1", &d.is_top1}};
  for (const auto& o : outs) {
    if (!o.second->empty() || o.second->size != 0) FUSEDCE_CHECK(check_vector_arg(o.first, *o.second, DType::kFloat32, N));
  }
  return Status::Ok();
}

Status check_grads(const LogprobCall& c) {
  const int64_t N = c.rows();
  FUSEDCE_CHECK(check_vector_arg("grad_logprob", c.grad_logprob, DType::kFloat32, N));
  if (!c.grad_entropy.empty() || c.grad_entropy.size != 0) {
    FUSEDCE_CHECK(check_vector_arg("grad_entropy", c.grad_entropy, DType::kFloat32, N));
  }
  std::ostringstream os;
  if (!c.linear) {
    FUSEDCE_CHECK(check_matrix_arg("dlogits", c.dlogits));
    if (c.dlogits.dtype != c.logits.dtype || c.dlogits.rows != N || c.dlogits.cols != c.logits.cols) {
      os << "dlogits must be " << N << " x " << c.logits.cols << " " << dtype_name(c.logits.dtype) << ", got "
         << c.dlogits.rows << " x " << c.dlogits.cols << " " << dtype_name(c.dlogits.dtype);
      return invalid(os.str());
    }
    return Status::Ok();
  }
  const int64_t H = c.hidden.cols, V = c.weight.rows;
  if ((!c.grads.grad_bias.empty() || c.grads.grad_bias.size != 0) && c.bias.empty()) {
    return invalid("grad_bias is given but bias is not");
  }
  return check_linear_grads_arg(c.grads, N, V, H, c.hidden.dtype, DType::kFloat32);
}

}  // namespace

Status validate_logprob_call(const LogprobCall& c) {
  if (c.device.type != DeviceType::kCPU && c.device.type != DeviceType::kCUDA) {
    return invalid("device.type must be kCPU or kCUDA");
  }
  const float T = c.options.temperature;
  if (!(T > 0.0f) || !std::isfinite(T)) {
    std::ostringstream os;
    os << "temperature must be finite and > 0, got " << T;
    return invalid(os.str());
  }
  const int64_t N = c.rows();
  FUSEDCE_CHECK(check_target_arg(c.target, N));
  if (c.step == 1) {
    FUSEDCE_CHECK(check_inputs(c));
    return check_stats("stats", c.stats, N + 1);
  }
  if (c.step == 2 || c.step == 4) {
    if (c.world < 1) return invalid("world must be >= 1");
    if (c.shard.vocab_total < 1) return invalid("shard.vocab_total must be >= 1");
    FUSEDCE_CHECK(check_stats("gathered", c.stats, c.world * (N + 1)));
    if (c.step == 2) return check_out(c.out, N, false);
    if (!c.options.distribution_stats) {
      return invalid("options.distribution_stats must be set: step 1 gathers what the distribution statistics "
                     "need only with it");
    }
    return check_dist(c.dist, N);
  }
  if (c.step != 3) return invalid("step must be 1, 2, 3 or 4");
  FUSEDCE_CHECK(check_inputs(c));
  FUSEDCE_CHECK(check_out(c.out, N, !c.grad_entropy.empty()));
  return check_grads(c);
}

}  // namespace detail

namespace {

Status dispatch(const detail::LogprobCall& call) {
  Status s = detail::validate_logprob_call(call);
  if (!s.ok()) return s;
  if (call.device.type == DeviceType::kCUDA) return cuda::run_logprobs(call);
  return cpu::run_logprobs(call);
}

detail::LogprobCall base_call(int step, const Device& device, const VectorView& target, const ShardSpec& shard,
                              const LogprobOptions& options) {
  detail::LogprobCall c{};
  c.step = step;
  c.device = device;
  c.target = target;
  c.shard = shard;
  c.options = options;
  return c;
}

detail::LogprobCall linear_call(int step, const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                                const LogprobOptions& options, size_t chunk_budget_bytes, Workspace workspace) {
  detail::LogprobCall c = base_call(step, device, target, shard, options);
  c.linear = true;
  c.hidden = hidden;
  c.weight = weight;
  c.bias = bias;
  c.chunk_budget_bytes = chunk_budget_bytes;
  c.workspace = workspace;
  return c;
}

}  // namespace

Status logprobs_stats(const Device& device, const MatrixView& logits, const VectorView& target,
                      const ShardSpec& shard, const LogprobOptions& options, const MatrixView& stats) {
  detail::LogprobCall c = base_call(1, device, target, shard, options);
  c.logits = logits;
  c.stats = stats;
  return dispatch(c);
}

Status linear_logprobs_stats(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                             const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                             const LogprobOptions& options, size_t chunk_budget_bytes, const MatrixView& stats,
                             Workspace workspace) {
  detail::LogprobCall c =
      linear_call(1, device, hidden, weight, bias, target, shard, options, chunk_budget_bytes, workspace);
  c.stats = stats;
  return dispatch(c);
}

Status logprobs_merge(const Device& device, const MatrixView& gathered, int64_t world, const VectorView& target,
                      const ShardSpec& shard, const LogprobOptions& options, const LogprobOutputs& out) {
  detail::LogprobCall c = base_call(2, device, target, shard, options);
  c.stats = gathered;
  c.world = world;
  c.out = out;
  return dispatch(c);
}

Status logprobs_distribution_stats(const Device& device, const MatrixView& gathered, int64_t world,
                                   const VectorView& target, const ShardSpec& shard, const LogprobOptions& options,
                                   const DistributionStats& out) {
  detail::LogprobCall c = base_call(4, device, target, shard, options);
  c.stats = gathered;
  c.world = world;
  c.dist = out;
  return dispatch(c);
}

Status logprobs_backward(const Device& device, const MatrixView& logits, const VectorView& target,
                         const ShardSpec& shard, const LogprobOptions& options, const LogprobOutputs& fwd,
                         const VectorView& grad_logprob, const VectorView& grad_entropy, const MatrixView& dlogits) {
  detail::LogprobCall c = base_call(3, device, target, shard, options);
  c.logits = logits;
  c.out = fwd;
  c.grad_logprob = grad_logprob;
  c.grad_entropy = grad_entropy;
  c.dlogits = dlogits;
  return dispatch(c);
}

Status linear_logprobs_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                                const LogprobOptions& options, size_t chunk_budget_bytes, const LogprobOutputs& fwd,
                                const VectorView& grad_logprob, const VectorView& grad_entropy,
                                const LinearGrads& grads, Workspace workspace) {
  detail::LogprobCall c =
      linear_call(3, device, hidden, weight, bias, target, shard, options, chunk_budget_bytes, workspace);
  c.out = fwd;
  c.grad_logprob = grad_logprob;
  c.grad_entropy = grad_entropy;
  c.grads = grads;
  return dispatch(c);
}

size_t linear_logprobs_workspace_size(int step, const Device& device, int64_t rows, int64_t hidden_size,
                                      int64_t local_vocab, DType dtype, size_t chunk_budget_bytes,
                                      const LinearGrads& grads) {
  if (device.type != DeviceType::kCUDA) return 0;
  detail::LogprobCall c = linear_call(step, device, MatrixView{nullptr, dtype, rows, hidden_size, hidden_size},
                                      MatrixView{nullptr, dtype, local_vocab, hidden_size, hidden_size}, VectorView{},
                                      VectorView{nullptr, DType::kInt64, rows, 1}, ShardSpec{}, LogprobOptions{},
                                      chunk_budget_bytes, Workspace{});
  c.grads = grads;
  return cuda::logprobs_workspace_size(c);
}

}  // namespace fusedce
