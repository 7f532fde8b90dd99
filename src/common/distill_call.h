// One validated call of a distillation entry point (fusedce/distill.h), as the backends receive
// it.
#pragma once

#include "fusedce/distill.h"

namespace fusedce {
namespace detail {

/// Which step of the vocabulary-parallel form a call is (kNone: the whole-vocabulary forward or
/// backward, as `backward` says; kBackward: that backward over a shard).
enum class ShardStep : int { kNone = 0, kStats, kMerge, kParts, kReduce, kReduceTopk, kBackward };

struct DistillCall {
  bool backward;       // false: the forward
  bool fused = false;  // the forward and the backward with grad_loss 1 (out and grads; backward false)
  ShardStep shard_step = ShardStep::kNone;
  ShardSpec shard{};  // the rows of the heads this call holds; vocab_total 0: the whole vocabulary
  Device device;
  MatrixView hidden, weight;  // the student's head
  VectorView bias;            // or empty
  DistillTeacher teacher;
  VectorView labels;  // (N,) or empty (every row counts, no hard term)
  DistillOptions options;
  size_t chunk_budget_bytes = 0;  // 0 = kDistillDefaultBudget
  DistillOutputs out;             // forward
  MatrixView stats;               // backward: the forward's out.stats
  VectorView grad_loss;           // backward
  LinearGrads grads;              // backward
  MatrixView shard_stats;         // kStats: the output; kMerge: the gathered block
  int64_t world = 1;              // kMerge, kReduce, kReduceTopk: ranks in the gathered block
  MatrixView row_stats;           // kMerge: the output; kParts, kReduce: the input
  VectorView hard;                // kMerge: the output; kReduce: the input
  MatrixView parts;               // kParts: the output; kReduce: the gathered block
  Workspace workspace;            // or empty: the CUDA backend's own scratch

  int64_t rows() const { return hidden.rows; }
  /// K of a top-k teacher (kReduceTopk: of its log-probabilities alone), 0 for a teacher head.
  int64_t topk_k() const {
    if (shard_step == ShardStep::kReduceTopk) return teacher.topk_logprobs.cols;
    return teacher.topk() ? teacher.topk_ids.cols : 0;
  }
  int64_t vocab() const { return weight.rows; }
  /// V of the full vocabulary, which labels index.
  int64_t vocab_total() const { return shard.vocab_total > 0 ? shard.vocab_total : weight.rows; }
  /// The global index of this call's first vocabulary row.
  int64_t vocab_start() const { return shard.vocab_total > 0 ? shard.vocab_start : 0; }
};

Status validate_distill_call(const DistillCall& call);
/// The checks of a vocabulary-parallel step (call.shard_step != kNone).
Status validate_distill_shard_call(const DistillCall& call);

}  // namespace detail

namespace cpu {
Status run_distill(const detail::DistillCall& call);
/// A step of the vocabulary-parallel form (call.shard_step != kNone), validated.
Status run_distill_shard(const detail::DistillCall& call);
}  // namespace cpu

namespace cuda {
/// Present in every build; without the CUDA backend they return kUnsupported.
Status run_distill(const detail::DistillCall& call);
/// A step of the vocabulary-parallel form (call.shard_step != kNone), validated.
Status run_distill_shard(const detail::DistillCall& call);
/// Bytes of workspace the call takes (its data pointers not read); 0 without the CUDA backend.
size_t distill_workspace_size(const detail::DistillCall& call);
}  // namespace cuda

}  // namespace fusedce
