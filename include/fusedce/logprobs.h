// fusedce: per-token log-probabilities and entropy with their gradients (docs/contract.md,
// "Log-probabilities"), for reinforcement-learning post-training: for each row i with target t,
//   z = (logits [+ bias]) / temperature,  lse = logsumexp(z),  p = softmax(z),
//   logprob_i = z_t - lse,  entropy_i = lse - sum_j p_j z_j,
// exact when the distribution collapses (the target's log-probability is formed from the sum of
// the exps of the other entries, not as a difference that rounds to 0), and the gradient of
// g_lp * logprob + g_H * entropy for per-row upstream gradients g_lp, g_H. Rows whose target is
// ignore_index have logprob 0, entropy 0 and no gradient.
//
// The same three steps as the vocabulary-parallel loss (vocab_parallel.h), and one
// implementation for both: a whole vocabulary is the shard {0, V} of a world of 1.
//   1. *_logprobs_stats: per-row statistics of this rank's columns, float32
//      (N + 1, kLogprobStatsWidth) (row N is spare: front ends carry their own records in it);
//   2. logprobs_merge: the gathered statistics of every rank, in rank order, into logprob,
//      entropy and lse (N,), bit-identical on every rank;
//   3. *_logprobs_backward: this rank's gradients from step 2's outputs.
// The logits form takes logits (N, V_local); the linear form takes hidden (N, H) and this rank's
// rows weight (V_local, H) (and bias (V_local,)) of the head and never stores more than one
// chunk of the logits: the backward forms them again.
#pragma once

#include "fusedce/linear_cross_entropy.h"
#include "fusedce/types.h"
#include "fusedce/vocab_parallel.h"

namespace fusedce {

/// Floats per row of log-probability statistics: max, rest sum (the exps of every entry but one
/// instance of the max), entropy sum, target z, holds-target flag; with distribution_stats also
/// the rest sum of squares (exp(2 (z - max)) over the same entries), the sum of z and the max of
/// z over the columns before the target's global index (-inf: none); the other columns and
/// row N are zero. The same shape as the loss's shard statistics, so a front end gathers either
/// alike.
constexpr int kLogprobStatsWidth = kShardStatsWidth;

struct LogprobOptions {
  float temperature = 1.0f;         ///< z = logits / temperature; finite and > 0
  int64_t ignore_index = -100;      ///< rows with this target: logprob 0, entropy 0, no gradient
  bool distribution_stats = false;  ///< step 1 also gathers what logprobs_distribution_stats needs
};

/// Per-row statistics of softmax(z) beside the log-probability (TRL's fused head's optional
/// outputs, its definitions), float32 (N,) each, 0 at ignored rows:
///   log_sum_sq_probs = log sum_j p_j^2;  mean_logit = sum_j z_j / vocab_total;
///   is_top1 = 1 if the target is z's first maximum (torch.argmax's rule on ties), else 0.
struct DistributionStats {
  VectorView log_sum_sq_probs, mean_logit, is_top1;
};

/// Step 2's outputs, float32 (N,) each; step 3 reads them back. entropy may be left empty in
/// step 2 (not written); step 3 needs it only when grad_entropy is given.
struct LogprobOutputs {
  VectorView logprob, entropy, lse;
};

/// Step 1 over logits (N, V_local) of the columns [shard.vocab_start, + V_local); target (N,)
/// global indices or ignore_index. stats: float32 (N + 1, kLogprobStatsWidth), contiguous.
Status logprobs_stats(const Device& device, const MatrixView& logits, const VectorView& target,
                      const ShardSpec& shard, const LogprobOptions& options, const MatrixView& stats);

/// Step 1 of the linear form: the statistics of (hidden @ weight.T + bias) over the shard's
/// rows of the head, formed chunk by chunk. chunk_budget_bytes bounds the logit buffer (0: the
/// linear cross-entropy's default).
Status linear_logprobs_stats(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                             const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                             const LogprobOptions& options, size_t chunk_budget_bytes, const MatrixView& stats,
                             Workspace workspace = {});

/// Step 2. gathered: float32 (world * (N + 1), kLogprobStatsWidth), rank r's statistics at rows
/// [r (N + 1), (r + 1)(N + 1)).
Status logprobs_merge(const Device& device, const MatrixView& gathered, int64_t world, const VectorView& target,
                      const ShardSpec& shard, const LogprobOptions& options, const LogprobOutputs& out);

/// Step 2's companion: the distribution statistics from the same gathered statistics, which
/// step 1 formed with options.distribution_stats (required here). Any of the outputs may be
/// empty (not written).
Status logprobs_distribution_stats(const Device& device, const MatrixView& gathered, int64_t world,
                                   const VectorView& target, const ShardSpec& shard, const LogprobOptions& options,
                                   const DistributionStats& out);

/// Step 3 over logits: dlogits (N, V_local) in the logits' dtype, of
/// sum_i grad_logprob[i] * logprob[i] + grad_entropy[i] * entropy[i]; grad_entropy may be empty
/// (0). `fwd` holds step 2's outputs.
Status logprobs_backward(const Device& device, const MatrixView& logits, const VectorView& target,
                         const ShardSpec& shard, const LogprobOptions& options, const LogprobOutputs& fwd,
                         const VectorView& grad_logprob, const VectorView& grad_entropy, const MatrixView& dlogits);

/// Step 3 of the linear form. grads.grad_hidden, if asked for, is float32 (N, H): this rank's
/// part (the sum over ranks is the gradient); grad_weight (V_local, H) and grad_bias (V_local,)
/// have hidden's dtype and are this rank's slices.
Status linear_logprobs_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                const VectorView& bias, const VectorView& target, const ShardSpec& shard,
                                const LogprobOptions& options, size_t chunk_budget_bytes, const LogprobOutputs& fwd,
                                const VectorView& grad_logprob, const VectorView& grad_entropy,
                                const LinearGrads& grads, Workspace workspace = {});

/// Bytes of device workspace a linear step needs (0 on the CPU): `step` 1 or 3; `grads` says
/// which gradients step 3 forms (pointers not read). Without a workspace the CUDA backend takes
/// stream-ordered scratch.
size_t linear_logprobs_workspace_size(int step, const Device& device, int64_t rows, int64_t hidden_size,
                                      int64_t local_vocab, DType dtype, size_t chunk_budget_bytes,
                                      const LinearGrads& grads);

}  // namespace fusedce
