// fusedce: cross-entropy over a vocabulary split across ranks (docs/contract.md,
// "Vocabulary-parallel form"). Each rank holds logits[:, vocab_start : vocab_start + V_local].
// Three steps, with the communication between them left to the caller (torch.distributed in the
// Python front end):
//   1. cross_entropy_shard_stats: per-row partial statistics of the local shard, (N + 1, 9) floats;
//   2. the caller all-gathers them (only per-row scalars cross ranks), and every rank calls
//      cross_entropy_shard_merge on the gathered block, in rank order: the loss, lse and metrics,
//      bit-identical on every rank;
//   3. cross_entropy_shard_backward: each rank's slice of dlogits from the merged lse.
// The linear form (each rank holds rows [vocab_start, vocab_start + V_local) of the head's
// weight, hidden and target are the same on every rank) has three steps of its own, run by the
// linear cross-entropy backends, which never store the (N, V_local) logits beyond one chunk.
// They take the target as the whole-vocabulary linear call does (unshifted, with
// LinearOptions::shift_seq_len) and every linear option means what it means there:
//   1. linear_cross_entropy_shard_stats: the statistics of hidden @ weight.T (+ bias), as step 1
//      gives them for those logits;
//   2. linear_cross_entropy_shard_merge: step 2 over the effective (shifted) targets;
//   3. linear_cross_entropy_shard_backward: this rank's part of grad_hidden (float32; the sum
//      over ranks is the gradient) and its slices of grad_weight and grad_bias.
#pragma once

#include "fusedce/cross_entropy.h"
#include "fusedce/linear_cross_entropy.h"
#include "fusedce/types.h"

namespace fusedce {

/// Floats per row of shard statistics: max, sum of exps, entropy term, target z, holds-target
/// flag, smoothing sum, argmax value, argmax global index (int32 bits), target weight. Row N
/// carries the shard's class-weight sum in column 0.
constexpr int kShardStatsWidth = 9;

/// Where the local columns sit in the full vocabulary.
struct ShardSpec {
  int64_t vocab_start = 0;  ///< global index of the local first column
  int64_t vocab_total = 0;  ///< V of the full vocabulary
};

/// Step 1. logits (N, V_local); target (N,) global indices or ignore_index; options.class_weight,
/// if given, is the local slice (V_local,). stats: float32 (N + 1, kShardStatsWidth), contiguous.
Status cross_entropy_shard_stats(const Device& device, const MatrixView& logits, const VectorView& target,
                                 const ShardSpec& shard, const Options& options, const MatrixView& stats);

/// Step 2. gathered: float32 (world * (N + 1), kShardStatsWidth), rank r's stats at rows
/// [r (N + 1), (r + 1)(N + 1)). Writes `out` as cross_entropy_forward would for the full
/// vocabulary, plus what the backward needs: row_weight (N,) each row's target weight,
/// batch (2,) the mean's denominator and the class-weight sum.
Status cross_entropy_shard_merge(const Device& device, const MatrixView& gathered, int64_t world,
                                 const VectorView& target, const ShardSpec& shard, const Options& options,
                                 const ForwardOutputs& out, const VectorView& row_weight, const VectorView& batch);

/// Step 3. This rank's dlogits (N, V_local) from the merged lse (N,), row_weight and batch of
/// step 2, and the upstream gradient grad_loss ((1,) for sum / mean, (N,) for none).
Status cross_entropy_shard_backward(const Device& device, const MatrixView& logits, const VectorView& target,
                                    const ShardSpec& shard, const Options& options, const VectorView& lse,
                                    const VectorView& row_weight, const VectorView& batch,
                                    const VectorView& grad_loss, const MatrixView& dlogits);

/// Linear step 1. hidden (N, H), weight (V_local, H) this rank's rows of the head, bias
/// (V_local,) or empty, target (N,) global indices, unshifted: with linear.shift_seq_len, row i
/// is scored against target[i + 1] within sequences, as in linear_cross_entropy_forward;
/// options.class_weight the local slice. linear.chunk_budget_bytes, low_memory and skip_ignored
/// mean what they mean for linear_cross_entropy_forward on this backend: with skip_ignored the
/// CUDA backend runs the products over the rows whose (shifted) target is not ignored, reading
/// their count on the host once, except on a stream capturing a CUDA graph, where every row runs
/// (the same statistics; nothing waits). Every rank holds the same targets, so every rank keeps
/// the same rows. stats as for cross_entropy_shard_stats (the rows of ignored targets are
/// zeros: the merge never reads them).
Status linear_cross_entropy_shard_stats(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                        const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                                        const Options& options, const LinearOptions& linear,
                                        const MatrixView& stats, Workspace workspace = {});

/// Linear step 2: cross_entropy_shard_merge for the effective targets of the linear steps, the
/// target (N,) unshifted and shifted within sequences of linear.shift_seq_len rows (its other
/// fields are not read). The same bits on every rank.
Status linear_cross_entropy_shard_merge(const Device& device, const MatrixView& gathered, int64_t world,
                                        const VectorView& target, const ShardSpec& shard, const Options& options,
                                        const LinearOptions& linear, const ForwardOutputs& out,
                                        const VectorView& row_weight, const VectorView& batch);

/// Linear step 3. The gradients of this shard from step 2's lse, row_weight and batch and the
/// upstream grad_loss ((1,) for sum / mean, (N,) for none); target and linear as in step 1.
/// grads.grad_hidden, if asked for, is float32 (N, H): this rank's part, summed over ranks by
/// the caller (0 at rows of ignored targets); grad_weight (V_local, H) and grad_bias (V_local,)
/// have hidden's dtype and are this rank's slices.
Status linear_cross_entropy_shard_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                           const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                                           const Options& options, const LinearOptions& linear,
                                           const VectorView& lse, const VectorView& row_weight,
                                           const VectorView& batch, const VectorView& grad_loss,
                                           const LinearGrads& grads, Workspace workspace = {});

/// Bytes of device workspace a linear step needs (0 on the CPU): `step` 1 or 3, `grads` says
/// which gradients step 3 forms (pointers not read). Without a workspace the CUDA backend takes
/// stream-ordered scratch.
size_t linear_cross_entropy_shard_workspace_size(int step, const Device& device, int64_t rows, int64_t hidden_size,
                                                 int64_t local_vocab, DType dtype, const Options& options,
                                                 const LinearOptions& linear, const LinearGrads& grads);

}  // namespace fusedce
