// The launchers of the CUDA log-probability kernels (logprobs_kernels.cu), for the host code
// that strings them together (logprobs_cuda.cpp). Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// The rows, target and constants every kernel of the log-probabilities takes.
struct LpRows {
  const void* target;
  int64_t target_stride;
  bool target_i64;
  int64_t ignore_index;
  int64_t rows;
  int64_t vocab_start;  // global index of the local first column
  int64_t vocab_total;  // the whole vocabulary (the mean logit's divisor)
  float inv_t;          // 1 / temperature
  bool dist;            // step 1 also gathers the distribution statistics' columns
};

/// Step 1 over logits (rows, V_local): float32 stats rows [0, rows] (row `rows` zeroed: the
/// next chunk's first row, or the spare row N).
void launch_lp_stats(const LpRows& r, const MatrixView& logits, float* stats, cudaStream_t stream);

/// Step 1 from the fused statistics product's partials (lp_fused_products.h) of a chunk of `cols`
/// columns: float4 (tile, row) partials, `tiles` of `tile_cols` columns each, tile-major (with
/// r.dist a second such plane after the first); stats rows [0, rows] as launch_lp_stats writes
/// them.
void launch_lp_fold_tiles(const LpRows& r, const float4* partials, int64_t tiles, int64_t tile_cols, int64_t cols,
                          float* stats, cudaStream_t stream);

/// Step 2: `world` blocks of (rows + 1) statistics rows, merged in rank order into logprob,
/// entropy (may be null) and lse.
void launch_lp_merge(const LpRows& r, const float* gathered, int64_t world, const VectorView& logprob,
                     const VectorView& entropy, const VectorView& lse, cudaStream_t stream);

/// Step 4: the distribution statistics (each output may be empty) from `world` blocks of
/// (rows + 1) statistics rows formed with r.dist, folded in rank order.
void launch_lp_distribution_stats(const LpRows& r, const float* gathered, int64_t world,
                                  const VectorView& log_sum_sq_probs, const VectorView& mean_logit,
                                  const VectorView& is_top1, cudaStream_t stream);

/// Step 3 over logits: dlogits (may be the logits buffer itself: each element is read before it
/// is written, by the same thread) from step 2's outputs and the upstream gradients
/// (grad_entropy may be empty).
void launch_lp_backward(const LpRows& r, const MatrixView& logits, const MatrixView& dlogits,
                        const VectorView& lse, const VectorView& logprob, const VectorView& entropy,
                        const VectorView& grad_logprob, const VectorView& grad_entropy, cudaStream_t stream);

}  // namespace cuda
}  // namespace fusedce
