// The entry points of vocab_parallel.h: build the call, validate it once, run it.
#include "fusedce/vocab_parallel.h"

#include "common/call.h"

namespace fusedce {
namespace {

Status dispatch(const detail::ShardCall& call) {
  Status s = detail::validate_shard_call(call);
  if (!s.ok()) return s;
  if (call.device.type == DeviceType::kCUDA) return cuda::run_shard(call);
  return cpu::run_shard(call);
}

Status dispatch_linear(const detail::LinearCall& call) {
  Status s = detail::validate_linear_call(call);
  if (!s.ok()) return s;
  if (call.device.type == DeviceType::kCUDA) return cuda::run_linear_shard(call);
  return cpu::run_linear(call);
}

detail::LinearCall linear_shard_call(int step, const Device& device, const MatrixView& hidden,
                                     const MatrixView& weight, const VectorView& bias, const VectorView& target,
                                     const ShardSpec& shard, const Options& options, const LinearOptions& linear,
                                     Workspace workspace) {
  detail::LinearCall c{};
  c.job = step == 1 ? Job::kForward : Job::kForwardBackward;
  c.shard_step = step;
  c.device = device;
  c.hidden = hidden;
  c.weight = weight;
  c.bias = bias;
  c.target = target;
  c.shard = shard;
  c.options = options;
  c.linear = linear;
  c.workspace = workspace;
  return c;
}

}  // namespace

Status cross_entropy_shard_stats(const Device& device, const MatrixView& logits, const VectorView& target,
                                 const ShardSpec& shard, const Options& options, const MatrixView& stats) {
  detail::ShardCall c{};
  c.step = 1;
  c.device = device;
  c.logits = logits;
  c.target = target;
  c.shard = shard;
  c.options = options;
  c.stats = stats;
  return dispatch(c);
}

namespace {

/// Step 2 of either form; shift_seq_len is the linear form's.
Status merge(const Device& device, const MatrixView& gathered, int64_t world, const VectorView& target,
             const ShardSpec& shard, const Options& options, int64_t shift_seq_len, const ForwardOutputs& out,
             const VectorView& row_weight, const VectorView& batch) {
  detail::ShardCall c{};
  c.step = 2;
  c.device = device;
  c.stats = gathered;
  c.world = world;
  c.target = target;
  c.shard = shard;
  c.options = options;
  c.out = out;
  c.row_weight = row_weight;
  c.batch = batch;
  c.shift_seq_len = shift_seq_len;
  return dispatch(c);
}

}  // namespace

Status cross_entropy_shard_merge(const Device& device, const MatrixView& gathered, int64_t world,
                                 const VectorView& target, const ShardSpec& shard, const Options& options,
                                 const ForwardOutputs& out, const VectorView& row_weight, const VectorView& batch) {
  return merge(device, gathered, world, target, shard, options, 0, out, row_weight, batch);
}

Status linear_cross_entropy_shard_merge(const Device& device, const MatrixView& gathered, int64_t world,
                                        const VectorView& target, const ShardSpec& shard, const Options& options,
                                        const LinearOptions& linear, const ForwardOutputs& out,
                                        const VectorView& row_weight, const VectorView& batch) {
  return merge(device, gathered, world, target, shard, options, linear.shift_seq_len, out, row_weight, batch);
}

Status cross_entropy_shard_backward(const Device& device, const MatrixView& logits, const VectorView& target,
                                    const ShardSpec& shard, const Options& options, const VectorView& lse,
                                    const VectorView& row_weight, const VectorView& batch,
                                    const VectorView& grad_loss, const MatrixView& dlogits) {
  detail::ShardCall c{};
  c.step = 3;
  c.device = device;
  c.logits = logits;
  c.target = target;
  c.shard = shard;
  c.options = options;
  c.lse = lse;
  c.row_weight = row_weight;
  c.batch = batch;
  c.grad_loss = grad_loss;
  c.dlogits = dlogits;
  return dispatch(c);
}

Status linear_cross_entropy_shard_stats(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                        const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                                        const Options& options, const LinearOptions& linear,
                                        const MatrixView& stats, Workspace workspace) {
  detail::LinearCall c = linear_shard_call(1, device, hidden, weight, bias, target, shard, options, linear, workspace);
  c.stats = stats;
  return dispatch_linear(c);
}

Status linear_cross_entropy_shard_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                           const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                                           const Options& options, const LinearOptions& linear,
                                           const VectorView& lse, const VectorView& row_weight,
                                           const VectorView& batch, const VectorView& grad_loss,
                                           const LinearGrads& grads, Workspace workspace) {
  detail::LinearCall c = linear_shard_call(3, device, hidden, weight, bias, target, shard, options, linear, workspace);
  c.lse_in = lse;
  c.row_weight = row_weight;
  c.batch = batch;
  c.grad_loss = grad_loss;
  c.grads = grads;
  return dispatch_linear(c);
}

size_t linear_cross_entropy_shard_workspace_size(int step, const Device& device, int64_t rows, int64_t hidden_size,
                                                 int64_t local_vocab, DType dtype, const Options& options,
                                                 const LinearOptions& linear, const LinearGrads& grads) {
  if (device.type != DeviceType::kCUDA) return 0;
  detail::LinearCall c = linear_shard_call(step, device, MatrixView{nullptr, dtype, rows, hidden_size, hidden_size},
                                           MatrixView{nullptr, dtype, local_vocab, hidden_size, hidden_size},
                                           VectorView{}, VectorView{}, ShardSpec{}, options, linear, Workspace{});
  c.grads = grads;
  return cuda::linear_shard_workspace_size(c);
}

}  // namespace fusedce
