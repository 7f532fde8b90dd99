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

Status cross_entropy_shard_merge(const Device& device, const MatrixView& gathered, int64_t world,
                                 const VectorView& target, const ShardSpec& shard, const Options& options,
                                 const ForwardOutputs& out, const VectorView& row_weight, const VectorView& batch) {
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
  return dispatch(c);
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

}  // namespace fusedce
