// The launchers of the CUDA distillation kernels (distill_kernels.cu), for the host code that
// strings them between the matrix products (distill_cuda.cpp). Host code only; the kernels see
// the plain structs here, passed by value.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// What every row kernel of one call takes: which rows count, the chunk, the constants of
/// common/distill_math.h.
struct DistillRows {
  const void* labels;  // (N,) int64 / int32, or null: every row counts, no hard term
  int64_t label_stride;
  bool labels_i64;
  int64_t ignore_index;
  int64_t r0;    // the chunk's first row
  int64_t rows;  // rows in the chunk
  int64_t V;        // the vocabulary rows of the call's heads
  int64_t v0;       // the global index of row 0 (a vocabulary shard's start; 0 otherwise)
  int64_t v_total;  // the whole vocabulary, which labels and top-k ids index (V unless a shard)
  int kind;  // detail::DivergenceKind
  float beta, one_mb, log_1mb, log_b, inv_t, hard_weight;
  float s_scale, s_softcap, t_scale, t_softcap;  // each head's transform (softcap 0: off)
  int topk_norm;                                 // TopkNorm; the top-k form only
};

/// The teacher as the row kernels read it: its logits chunk (full form), or its top-k rows.
struct DistillTeacherRows {
  const void* logits;  // full form: (rows, V) with row stride ld in dtype; null where not read
  int64_t ld;
  DType dtype;
  const int64_t* ids;  // (N, K) by global row, row stride ids_stride; top-k form
  int64_t ids_stride;
  const float* logprobs;  // (N, K), row stride lp_stride
  int64_t lp_stride;
  int64_t K;  // top-k form: K >= 1; 0: the full form
};

/// The forward of one chunk: per-row outputs (by global row; null: not written) and the
/// statistics. row_loss: the row's loss, 0 at ignored rows (reduction none: the loss itself).
struct DistillForwardParams {
  DistillRows r;
  const void* logits;  // the student's chunk (rows, V), row stride ld, in dtype
  int64_t ld;
  DType dtype;
  DistillTeacherRows t;
  float* stats;  // (N, stats_width) contiguous, the row's statistics first
  int64_t stats_width;
  float* row_loss;
  int64_t row_loss_stride;
  float* divergence;
  int64_t divergence_stride;
  float* hard;
  int64_t hard_stride;
  float* entropy;
  int64_t entropy_stride;
};

/// The backward of one chunk: the student's logits become the gradient of the loss with respect
/// to them, in place (in their dtype). Top-k form: scratch of K floats twice and Kp (K rounded up
/// to a power of two) sort keys per chunk row.
struct DistillBackwardParams {
  DistillRows r;
  void* logits;
  int64_t ld;
  DType dtype;
  DistillTeacherRows t;
  const float* stats;  // (N, stats_width): the row's statistics, then (a shard's top-k form) its K q
  int64_t stats_width;
  const float* grad_loss;
  int64_t grad_stride;
  int reduction;        // Reduction as int
  const int64_t* count; // rows counted (the mean's denominator), device scalar
  float* entry_y;       // (rows, K) top-k: the student's transformed logit at each id
  float* entry_g;       // (rows, K) top-k: dD/dq at each entry
  uint64_t* keys;       // (rows, Kp) top-k: (id, k) sort keys
  int64_t Kp;
};

/// The reduced loss: sum (or mean over *count rows; NaN for none) of row_loss (N,) in row
/// order, in double, into loss[0]; and the count itself. One block.
struct DistillFinishParams {
  DistillRows r;  // labels and ignore_index; r0, rows unused
  int64_t N;
  const float* row_loss;  // (N,) contiguous, or null (reduction none: only the count)
  int reduction;
  float* loss;
  int64_t* count;
};

// ---- the vocabulary-parallel steps (fusedce/distill.h) ------------------------------------------

/// Step 1 over one chunk: each counted row's states over the shard (rows of
/// kDistillShardStatsWidth floats; the caller zeroes the (N + 1) rows first).
struct DistillShardStatsParams {
  DistillRows r;
  const void* logits;
  int64_t ld;
  DType dtype;
  DistillTeacherRows t;
  float* out;
};

/// Step 3 over one chunk: each counted row's parts over the shard given the global log-sum-exps
/// (rows of `width` floats; the caller zeroes them first).
struct DistillShardPartsParams {
  DistillRows r;
  const void* logits;
  int64_t ld;
  DType dtype;
  DistillTeacherRows t;
  const float* row_stats;  // (N, kDistillStatsWidth), step 2's
  float* parts;
  int64_t width;
};

/// Step 2: one thread per row folds the world's step-1 rows in rank order.
struct DistillShardMergeParams {
  DistillRows r;  // labels, ignore_index, hard_weight
  int64_t N, world;
  const float* gathered;  // (world (N + 1), kDistillShardStatsWidth)
  float* row_stats;       // (N, kDistillStatsWidth)
  float* hard;
  int64_t hard_stride;
};

/// Step 4: one block per row adds the world's step-3 rows in rank order and writes the forward's
/// outputs through `f` (f.stats of f.stats_width columns; the top-k form's q after the first
/// kDistillStatsWidth). The reduced loss is finish's, from f.row_loss.
struct DistillShardReduceParams {
  DistillForwardParams f;  // r, outputs; logits and t.logits unused
  int64_t N, world, K;     // K: the top-k form's ids, 0 for a teacher head
  const float* gathered;   // (world N, width)
  int64_t width;
  const float* teacher_logprobs;  // (N, K), row stride lp_stride; the top-k form
  int64_t lp_stride;
  const float* row_stats;  // (N, kDistillStatsWidth)
  const float* hard;
  int64_t hard_stride;
};

void launch_distill_shard_stats(const DistillShardStatsParams& p, cudaStream_t stream);
void launch_distill_shard_parts(const DistillShardPartsParams& p, cudaStream_t stream);
void launch_distill_shard_merge(const DistillShardMergeParams& p, cudaStream_t stream);
void launch_distill_shard_reduce(const DistillShardReduceParams& p, cudaStream_t stream);

void launch_distill_forward(const DistillForwardParams& p, cudaStream_t stream);
void launch_distill_backward(const DistillBackwardParams& p, cudaStream_t stream);
void launch_distill_finish(const DistillFinishParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace fusedce
