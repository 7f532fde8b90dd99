// The CUDA linear cross-entropy: the small kernels around the matrix products (linear_kernels.cu)
// and the host orchestration (linear_cuda.cpp). Device code sees only the plain structs here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/numeric.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// The rows' effective targets (after the causal shift), which rows enter the products, and the
/// batch scalars the reduction needs. One block; every sum in a fixed order.
struct LinearPrepareParams {
  const void* target;
  int64_t target_stride;
  bool target_i64;
  int64_t rows;
  int64_t shift;  // 0 = none
  int64_t ignore_index;
  int64_t vocab;
  const float* class_weight;  // or null
  int64_t weight_stride;
  bool compact;  // idx lists only the rows whose target is not ignored (else every row)
  // outputs
  int64_t* eff_target;  // (rows,)
  int64_t* idx;         // (rows,) row of each position
  int64_t* count;       // positions in idx
  float* denom;         // sum of the target weights of the counted rows (the mean's denominator)
  int64_t* bad_row;     // first row with a target outside [0, V) and not ignored, or INT64_MAX
  float* weight_sum;    // sum of the V class weights (V without weights): label smoothing's W
};

/// The prepare kernel's parameters for `rows` rows of `target`; the class weights and the
/// outputs are the caller's to fill in.
inline LinearPrepareParams prepare_params(const VectorView& target, int64_t rows, int64_t shift, int64_t ignore_index,
                                          int64_t vocab, bool compact) {
  LinearPrepareParams q{};
  q.target = target.data;
  q.target_stride = target.stride;
  q.target_i64 = target.dtype == DType::kInt64;
  q.rows = rows;
  q.shift = shift;
  q.ignore_index = ignore_index;
  q.vocab = vocab;
  q.compact = compact;
  return q;
}

/// The upstream gradient of a sum or mean, split between the rows' dlogits and the gradient
/// products: out = {alpha, 0, 1, row}. The dlogits of every row carry `row` and the products
/// multiply by `alpha` in float32 (their alpha and beta read from out, so nothing waits for the
/// host). The factor g (grad_loss[0], 1 if absent; over *denom for a mean) is the same for every
/// row, and folded into 16-bit dlogits it would round the same way in each: entries near -g (the
/// target of an unlikely row) would all carry bf16's error of g, up to 0.39%, and so would the
/// gradients. So alpha = g and row = 1, except where g is not finite (a mean over no counted
/// weight): there alpha = 1 and row = g, as if folded, so that the rows' dlogits (zeros where
/// ignored) are not multiplied by an infinite alpha. Reduction none: alpha = row = 1 (each row's
/// own upstream gradient stays in its dlogits). One thread.
struct ProductScaleParams {
  const float* grad_loss;  // (1,) or null
  int reduction;           // Reduction as int
  const float* denom;      // the mean's denominator
  float* out;              // (4,)
};

/// Per chunk of positions [p0, p0 + n): the targets and upstream gradients of its rows, and (when
/// compacting) its hidden rows gathered into a dense block.
struct LinearGatherParams {
  const int64_t* eff_target;
  const int64_t* idx;
  int64_t p0, n;
  // upstream gradient of each row's dlogits: reduction none: grad_loss[row] (1 if absent); sum and
  // mean: *row_grad (ProductScaleParams' `row`, the same for every row).
  const float* grad_loss;
  int64_t grad_stride;
  int reduction;  // Reduction as int
  const float* row_grad;
  const void* hidden;  // gathered only when hidden_out is not null
  int64_t hidden_stride, H;
  DType dtype;
  // outputs
  int64_t* target_out;  // (n,) or null
  float* grad_out;      // (n,) or null (forward only)
  void* hidden_out;     // (n, H) dense, or null
  // Device-sized chunks (skip_ignored under graph capture): positions at or past *count are
  // padding of the chunk's rung: target ignore_index, upstream gradient 0, hidden row zeros (so
  // they contribute exact zeros to every product). Null: every position is real.
  const int64_t* count;
  int64_t ignore_index;
};

/// Per chunk: each position's results back to its row.
struct LinearScatterParams {
  const int64_t* idx;
  int64_t p0, n;
  const float* lse_in;    // (n,)
  float* lse_out;         // or null
  int64_t lse_stride;
  const float* loss_in;   // (n,)
  float* row_loss;        // (rows,) contiguous
  const void* gh_in;      // (n, H) dense, or null
  void* gh_out;
  int64_t gh_stride, H;
  DType dtype;
  const int64_t* count;  // positions at or past *count are padding: nothing written. Null: none.
};

/// The end of a call: the reduced loss (rows in a fixed order), metric sums over chunks, and
/// grad_weight / grad_bias rounded from their float32 accumulators.
struct LinearFinishParams {
  const float* row_loss;  // (rows,)
  int64_t rows;
  int reduction;
  const float* denom;
  float* loss_out;  // (1,) for sum / mean, (rows,) strided for none
  int64_t loss_stride;
  const float* chunk_entropy;  // (chunks,) or null
  const int64_t* chunk_correct;
  int64_t chunks;
  float* entropy_out;
  int64_t* correct_out;
};

/// low_memory's vocabulary-sliced backward: the logits of positions [p0, p0 + n) over the
/// vocabulary columns [v0, v0 + cols), recomputed by a product, become dlogits in place from the
/// row statistics the token-chunked forward saved (lse and the upstream gradient per position).
/// The formula of the vocabulary-parallel backward (common/numeric.h: row_grad).
struct LinearSliceGradParams {
  void* logits;  // (n, cols) with row stride ld, 16-byte aligned rows
  int64_t ld, n, cols, v0, p0;
  const int64_t* eff_target;  // by row
  const int64_t* idx;         // row of each position
  const void* bias;           // (V,) dense, or null: added to the product's logits, then rounded
  const float* lse;           // by position
  const float* grad;          // by position: the row's upstream gradient (mean's 1/denom folded in)
  const float* class_weight;  // or null
  int64_t weight_stride;
  const float* weight_sum;    // device scalar (prepare)
  detail::LossConstants c;
  bool softcap;
  int64_t ignore_index, vocab;
  DType dtype;
};

/// skip_ignored in the vocabulary-parallel backward (linear_shard_cuda.cpp): per position k of a
/// chunk of positions [p0, p0 + n), the merged lse, target weight and (reduction none) upstream
/// gradient of row idx[p0 + k], gathered into dense (n,) vectors.
struct ShardGatherParams {
  const int64_t* idx;
  int64_t p0, n;
  const float* lse;
  int64_t lse_stride;
  float* lse_out;
  const float* row_weight;
  int64_t row_weight_stride;
  float* row_weight_out;
  const float* grad_loss;  // null: the upstream gradient is one scalar (sum, mean)
  int64_t grad_stride;
  float* grad_out;
};

/// Dense float32 rows (n, width) back to rows idx[p0 + k] of dst (row stride dst_stride),
/// written, or added to what dst holds. Each row appears once among the positions, so no two
/// blocks touch one row.
struct RowScatterParams {
  const int64_t* idx;
  int64_t p0, n;
  const float* src;
  int64_t width;
  float* dst;
  int64_t dst_stride;
  bool add;
};

struct ConvertParams {
  const float* src;  // (rows, cols) dense
  void* dst;
  int64_t rows, cols, dst_stride;
  DType dtype;
};

// Conditional graph nodes (CUDA 12.8+ SWITCH) for skip_ignored under capture; not on HIP, whose
// build has no linear path (linear_none.cpp), nor on older toolkits.
#if !defined(__HIP__) && defined(CUDART_VERSION) && CUDART_VERSION >= 12080
#define FUSEDCE_GRAPH_SWITCH 1
#else
#define FUSEDCE_GRAPH_SWITCH 0
#endif

#if FUSEDCE_GRAPH_SWITCH
/// What the tiny kernel before a conditional node reads to set the node's branch from the
/// device's count of valid rows (size_ladder.h).
struct LinearBranchParams {
  cudaGraphConditionalHandle handle;
  const int64_t* count;
  enum Kind : int {
    kChunk,   // LadderBranch::of(size, rungs, capacity, *count - p0)
    kFinish,  // 0: no valid row; 1: the valid rows fit in the first chunk (capacity); 2: more
  } kind;
  int64_t p0, capacity;
  int rungs;
  int64_t size[8];
};
void launch_linear_branch(const LinearBranchParams& p, cudaStream_t stream);
#endif

void launch_linear_prepare(const LinearPrepareParams& p, cudaStream_t stream);
void launch_product_scale(const ProductScaleParams& p, cudaStream_t stream);
void launch_linear_gather(const LinearGatherParams& p, cudaStream_t stream);
void launch_linear_scatter(const LinearScatterParams& p, cudaStream_t stream);
void launch_shard_gather(const ShardGatherParams& p, cudaStream_t stream);
void launch_row_scatter(const RowScatterParams& p, cudaStream_t stream);
void launch_linear_finish(const LinearFinishParams& p, cudaStream_t stream);
void launch_convert(const ConvertParams& p, cudaStream_t stream);
void launch_linear_slice_grad(const LinearSliceGradParams& p, cudaStream_t stream);
/// x[r][j] = round(x[r][j] + bias[j]) over (rows, cols) with row stride ld, in the dtype: the
/// bias as low_memory adds it in both passes (see linear_cuda.cpp).
void launch_add_bias(void* x, int64_t ld, int64_t rows, int64_t cols, const void* bias, DType dtype, cudaStream_t stream);
/// n copies of 1 in `dtype` (the ones vector that turns a product into grad_bias's column sums).
void launch_fill_ones(void* dst, int64_t n, DType dtype, cudaStream_t stream);
/// Clears a strided (n,) float vector (the lse of rows that the compacted products skip).
void launch_zero_strided(float* dst, int64_t n, int64_t stride, cudaStream_t stream);

/// The default logit-buffer bytes of a linear call with a (V, H) weight (this rank's part of it
/// for a shard); defined in linear_cuda.cpp, used by its plan and the shard plan.
size_t default_chunk_budget(int64_t V, int64_t H);

/// Rows per chunk for `positions` rows with at most `cap` a chunk: as few chunks as fit, of even
/// size (whole `granule`s where possible); defined in linear_cuda.cpp.
int64_t balanced_rows(int64_t positions, int64_t cap, int64_t granule = 128);

}  // namespace cuda
}  // namespace fusedce
