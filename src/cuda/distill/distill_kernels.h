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
  int64_t V;
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
  float* stats;  // (N, kDistillStatsWidth) contiguous
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
  const float* stats;  // (N, kDistillStatsWidth)
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

void launch_distill_forward(const DistillForwardParams& p, cudaStream_t stream);
void launch_distill_backward(const DistillBackwardParams& p, cudaStream_t stream);
void launch_distill_finish(const DistillFinishParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace fusedce
