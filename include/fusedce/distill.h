// fusedce: fused linear knowledge distillation (docs/contract.md, "Distillation"): the divergence
// between a student head's next-token distribution and a teacher's, from the student's hidden
// states and head, without the (N, V) logits of either.
//
// Per row i whose label is not ignore_index (every row when no labels are given), with a head's
// logits x = hidden @ weight.T + bias, its transform
//   y = s * x                      (logit_scale s)
//   y = c * tanh(s * x / c)        instead, with softcap c > 0
// and z = y / temperature, p_s = softmax(z_student), p_t = softmax(z_teacher):
//   beta == 0:      D = KL(p_t || p_s) = sum_j p_t (log p_t - log p_s)             (forward KL)
//   beta == 1:      D = KL(p_s || p_t)                                              (reverse KL)
//   0 < beta < 1:   D = beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = (1 - beta) p_s + beta p_t
// (the generalized JSD of TRL's distillation trainers; it is 0 at both ends of beta, which are
// therefore the two KLs instead, as TRL defines them). No temperature^2 factor.
//   hard_i = logsumexp(y_student) - y_student[label]       cross-entropy at temperature 1
//   loss_i = (1 - hard_weight) D_i + hard_weight hard_i
// reduced as the cross-entropy is (none, sum, mean over the rows counted; mean of no rows is
// NaN with all-zero gradients). entropy_i is the student's entropy of softmax(z), a metric.
//
// The top-k form takes the teacher as its top-k token ids (N, K) and log-probabilities (N, K)
// (entries of -inf are absent) instead of a head. The student's side is its log-softmax over the
// whole vocabulary at those ids, q_k = z[id_k] - logsumexp(z); TopkNorm says which two sparse
// distributions the divergence then compares (D summed over their entries, same formulas).
//
// Gradients reach the student's hidden, weight and bias only. Nothing of size (N, V) is stored:
// the rows go in chunks (plan_linear_distill), each chunk's logits of both heads formed, used,
// dropped; the backward forms them again from the per-row statistics the forward saved.
#pragma once

#include "fusedce/linear_cross_entropy.h"
#include "fusedce/types.h"
#include "fusedce/vocab_parallel.h"

namespace fusedce {

/// Which sparse distributions the top-k form compares, for teacher entries k (those not -inf)
/// with log-probabilities t_k and the student's full-vocabulary log-probabilities q_k there.
enum class TopkNorm : int32_t {
  kNone = 0,    ///< q_k and t_k as they are (axolotl's KD loss without normalize_topk)
  kRenorm = 1,  ///< each renormalised over the K entries: q_k - logsumexp(q), t_k - logsumexp(t)
                ///< (TRL's server distillation without loss_add_tail; axolotl's normalize_topk
                ///< for a teacher whose K probabilities sum to 1)
  kTail = 2,    ///< K + 1 entries: the K, and the tail log(1 - sum_k exp(.)), its log-sum clamped
                ///< to at most -1e-7, for each side (TRL's server distillation, loss_add_tail)
};

/// A head's transform of its logits before the temperature (docs/contract.md, "Options").
struct HeadTransform {
  float logit_scale = 1.0f;  ///< finite, non-zero
  float softcap = 0.0f;      ///< 0 = off, else finite and > 0
};

struct DistillOptions {
  float beta = 0.5f;          ///< in [0, 1]: 0 forward KL, 1 reverse KL, between: generalized JSD
  float temperature = 1.0f;   ///< finite, > 0; divides both heads' transformed logits
  float hard_weight = 0.0f;   ///< in [0, 1]; > 0 needs labels
  int64_t ignore_index = -100;  ///< rows whose label is this are left out (no labels: none is)
  Reduction reduction = Reduction::kMean;
  HeadTransform student, teacher;          ///< teacher's: the full form only
  TopkNorm topk_norm = TopkNorm::kNone;    ///< the top-k form only
};

/// Floats per row of the statistics the forward saves for the backward: the student's
/// logsumexp of z, the teacher's (full form), the divergence's auxiliary sum (reverse KL: D;
/// JSD: KL(p_s || m)), the student's logsumexp at temperature 1 (hard term). 0 at ignored rows.
constexpr int kDistillStatsWidth = 4;

/// The teacher: a head (hidden (N, H_t), weight (V, H_t) in hidden's dtype, bias (V,) or empty),
/// or, for the top-k form, ids (N, K) int64 in [0, V) and logprobs (N, K) float32.
struct DistillTeacher {
  MatrixView hidden, weight;
  VectorView bias;
  MatrixView topk_ids, topk_logprobs;

  bool topk() const { return !topk_ids.empty() || topk_ids.rows != 0 || topk_ids.cols != 0; }
};

/// A forward's outputs. loss: float32 (N,) for none, (1,) otherwise. The others are float32 (N,)
/// per row and optional (empty: not written): divergence D, hard (0 without labels or with
/// hard_weight 0), entropy. stats: float32 (N, kDistillStatsWidth), contiguous, required.
struct DistillOutputs {
  VectorView loss, divergence, hard, entropy;
  MatrixView stats;
};

/// How the rows go through the core: chunks of `chunk_rows` rows (the last may be smaller),
/// each holding `heads` float32 logit rows of V per row within the budget (at least one row,
/// at most kMaxChunkRows); `scratch_bytes` of logits at once. Fixed by the arguments alone.
struct DistillPlan {
  int64_t chunk_rows = 0;
  int64_t chunks = 0;
  size_t scratch_bytes = 0;
};

/// The plan for `rows` valid rows of vocabulary `vocab`, `heads` (2 full form, 1 top-k) logit
/// chunks at once, within chunk_budget_bytes (0: kDistillDefaultBudget).
DistillPlan plan_linear_distill(int64_t rows, int64_t vocab, int heads, size_t chunk_budget_bytes);

constexpr size_t kDistillDefaultBudget = size_t(128) << 20;
constexpr int64_t kDistillMaxChunkRows = 256;

/// The forward: the student hidden (N, H), weight (V, H) and bias (V,) or empty, the teacher,
/// labels (N,) int64 / int32 or empty. On the CPU, or on a CUDA device with every tensor in its
/// memory (biases with unit stride). The CPU reads labels and top-k ids and reports one outside
/// [0, V) (labels: and not ignore_index) as kTargetOutOfRange; a CUDA device does not wait to read
/// them, and gives that row NaN outputs (and NaN gradients) instead. On a CUDA device
/// chunk_budget_bytes bounds the chunk's logits in the inputs' dtypes (both heads; the top-k
/// backward adds 8 K + 8 K' bytes a row, K' = K rounded up to a power of two), 0 meaning the
/// linear cross-entropy's default rule; plan_linear_distill is the CPU's plan.
Status linear_distill_forward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                              const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                              const DistillOptions& options, size_t chunk_budget_bytes, const DistillOutputs& out,
    Workspace workspace = {});

/// The backward, from the forward's stats and the upstream gradient of the loss (float32, (N,)
/// for none, (1,) otherwise): grads.grad_hidden (N, H) float32, grad_weight (V, H) and grad_bias
/// (V,) in hidden's dtype, each optional (empty: not formed).
Status linear_distill_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                               const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                               const DistillOptions& options, size_t chunk_budget_bytes, const MatrixView& stats,
                               const VectorView& grad_loss, const LinearGrads& grads,
    Workspace workspace = {});

/// The forward and, over the same chunk of logits, the backward for an upstream gradient of 1
/// (reduction mean or sum; none is refused: its per-row upstream gradients are not known yet):
/// what linear_distill_forward writes into `out`, and the gradients linear_distill_backward
/// would form from out.stats and grad_loss = 1. A caller whose upstream gradient g is another
/// scalar scales the gradients by g. On a CUDA device each chunk's logits are formed once for
/// both (the backward's second products saved); the CPU runs the two in turn, to the same bits.
Status linear_distill_forward_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                       const VectorView& bias, const DistillTeacher& teacher,
                                       const VectorView& labels, const DistillOptions& options,
                                       size_t chunk_budget_bytes, const DistillOutputs& out,
                                       const LinearGrads& grads,
    Workspace workspace = {});

/// The entry points that take a workspace, for linear_distill_workspace_size.
enum class DistillJob : int32_t {
  kForward = 0,
  kBackward = 1,
  kForwardBackward = 2,
  kShardStats = 3,
  kShardParts = 4,
  kShardBackward = 5,
};

/// Bytes of device workspace the job needs (0 on the CPU), from the call's own arguments: their
/// shapes and dtypes (data pointers not read, except that `grads` says by which of its views
/// are non-empty the gradients a backward forms). Every entry point above and the shard steps
/// stats, parts and backward take the workspace as their last argument; given none (empty), the
/// CUDA backend takes stream-ordered scratch (cudaMallocAsync) for the call, and one smaller
/// than this size is kWorkspaceTooSmall.
size_t linear_distill_workspace_size(DistillJob job, const Device& device, const MatrixView& hidden,
                                     const MatrixView& weight, const DistillTeacher& teacher,
                                     const DistillOptions& options, size_t chunk_budget_bytes,
                                     const LinearGrads& grads = {});

// ---- the vocabulary-parallel form ------------------------------------------------------------
//
// Each rank holds rows [shard.vocab_start, + V_local) of both heads' weights (and biases), the
// same split for student and teacher, and the full hidden states and labels (global indices).
// The communication between the steps is the caller's (python/fusedce/distillation.py):
//   1. linear_distill_shard_stats: per row, each head's running max and sum of exps of z over
//      the shard, the student's at temperature 1 and its label logit where the shard holds it;
//   2. the caller all-gathers them; linear_distill_shard_merge folds them in rank order into
//      the global log-sum-exps and the hard term, the same bits on every rank;
//   3. linear_distill_shard_parts: this rank's partial sums of the divergence, its auxiliary
//      sum and the entropy over its shard, given the global log-sum-exps;
//   4. the caller all-gathers the parts; linear_distill_shard_reduce adds them in rank order
//      and writes what linear_distill_forward writes for the whole vocabulary;
//   5. linear_distill_shard_backward: linear_distill_backward over the shard: grad_hidden is
//      this rank's float32 part (the caller sums it over ranks), grad_weight and grad_bias this
//      rank's rows.
// Nothing of size (N, V_local) beyond one chunk per head. On the CPU a label or top-k id outside
// [0, vocab_total) is kTargetOutOfRange, and a label no rank or several ranks hold (shards that
// do not tile the vocabulary) is kInvalidArgument at step 2; a CUDA device does not wait to read
// them and gives those rows NaN outputs instead.
//
// The top-k form over a vocabulary-parallel student head: the teacher is its (N, K) ids (global
// indices in [0, vocab_total)) and log-probabilities, the same on every rank. Steps 1, 2, 3 and 5
// are the same entry points with that teacher; step 1 writes the teacher's columns as the empty
// state (-inf, 0) and step 2 then writes 0 for the teacher's log-sum-exp. Step 3 adds K columns:
// the student's log-probability q_k at each id this shard holds (0 where another shard holds it:
// exactly one shard holds each id, so the ranks' columns add up to q exactly). Step 4 is
// linear_distill_topk_shard_reduce, which forms the divergence from the gathered q and the
// teacher's log-probabilities, and writes stats of kDistillStatsWidth + K columns (the q last),
// what step 5 reads.

/// Floats per row of step 1 (the shape of the other vocabulary-parallel statistics, so a front
/// end gathers them alike; row N is spare, for the front end's records): the student's max and
/// sum of exp(z - max), the teacher's, the student's at temperature 1, its y at the label and a
/// flag saying this shard holds the label (the last four 0 without a hard term); column 8 is 0.
constexpr int kDistillShardStatsWidth = kShardStatsWidth;

/// Floats per row of step 3: the divergence, its auxiliary sum and the entropy over the shard,
/// each a double carried as a float32 pair (hi, lo), hi + lo the double to ~2^-48 relative.
/// The top-k form writes the entropy's pair only (the first four 0), then its K columns.
constexpr int kDistillPartsWidth = 6;

/// Columns of step 3's parts and of step 4's stats for a teacher of K top-k ids (K 0: a head).
constexpr int64_t distill_shard_parts_width(int64_t K) { return kDistillPartsWidth + K; }
constexpr int64_t distill_shard_stats_width(int64_t K) { return kDistillStatsWidth + K; }

/// Step 1. As linear_distill_forward's arguments, the weights and biases this rank's rows;
/// labels global indices (checked against shard.vocab_total). stats: float32 (N + 1,
/// kDistillShardStatsWidth), contiguous; ignored rows and row N are written 0.
Status linear_distill_shard_stats(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                  const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                                  const ShardSpec& shard, const DistillOptions& options, size_t chunk_budget_bytes,
                                  const MatrixView& stats,
    Workspace workspace = {});

/// Step 2. gathered: float32 (world * (N + 1), kDistillShardStatsWidth), rank r's step 1 at rows
/// [r (N + 1), (r + 1)(N + 1)). row_stats: float32 (N, kDistillStatsWidth), contiguous: the
/// student's and teacher's logsumexp of z, 0 (step 4 writes the auxiliary sum), the student's
/// logsumexp at temperature 1; hard (N,) float32: the hard term (0 without one). 0 at ignored
/// rows.
Status linear_distill_shard_merge(const Device& device, const MatrixView& gathered, int64_t world,
                                  const VectorView& labels, const DistillOptions& options,
                                  const MatrixView& row_stats, const VectorView& hard);

/// Step 3. Step 1's arguments, step 2's row_stats; parts: float32 (N,
/// distill_shard_parts_width(K)), contiguous, 0 at ignored rows (K 0 for a teacher head).
Status linear_distill_shard_parts(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                  const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                                  const ShardSpec& shard, const DistillOptions& options, size_t chunk_budget_bytes,
                                  const MatrixView& row_stats, const MatrixView& parts,
    Workspace workspace = {});

/// Step 4. gathered: float32 (world * N, kDistillPartsWidth), rank r's step 3 at rows
/// [r N, (r + 1) N); row_stats and hard from step 2. Writes out as linear_distill_forward does
/// (out.stats: row_stats with the auxiliary sum, what step 5 reads).
Status linear_distill_shard_reduce(const Device& device, const MatrixView& gathered, int64_t world,
                                   const VectorView& labels, const DistillOptions& options,
                                   const MatrixView& row_stats, const VectorView& hard, const DistillOutputs& out);

/// Step 4 of the top-k form. gathered: float32 (world * N, distill_shard_parts_width(K)), rank
/// r's step 3 at rows [r N, (r + 1) N); teacher_logprobs (N, K) float32, the teacher's; row_stats
/// and hard from step 2. Writes out as linear_distill_forward does, out.stats float32 (N,
/// distill_shard_stats_width(K)), contiguous: row_stats, then the student's q at the K ids.
Status linear_distill_topk_shard_reduce(const Device& device, const MatrixView& gathered, int64_t world,
                                        const MatrixView& teacher_logprobs, const VectorView& labels,
                                        const DistillOptions& options, const MatrixView& row_stats,
                                        const VectorView& hard, const DistillOutputs& out);

/// Step 5. linear_distill_backward's arguments over this rank's rows of the heads, with step
/// 4's out.stats (the top-k form: distill_shard_stats_width(K) columns). grads.grad_hidden (N, H) float32 is this rank's part; grad_weight (V_local, H)
/// and grad_bias (V_local,) its rows.
Status linear_distill_shard_backward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                     const VectorView& bias, const DistillTeacher& teacher, const VectorView& labels,
                                     const ShardSpec& shard, const DistillOptions& options, size_t chunk_budget_bytes,
                                     const MatrixView& stats, const VectorView& grad_loss, const LinearGrads& grads,
    Workspace workspace = {});

}  // namespace fusedce
