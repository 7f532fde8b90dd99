// The linear log-probabilities' logits product with the row pass in its epilogue (Hopper, bf16):
// the logits of a chunk, hidden rows . weight rows^T, rounded to bf16 in registers as the
// product's output would be, then instead of being stored for a row kernel to read back:
//  - the statistics product (step 1): per row and 192-wide vocabulary tile, the tile's
//    log-probability state (max, the rest sum, the entropy sum; fusedce/logprobs.h's statistics
//    row, of the tile alone) and the target's z where the tile holds it, as one float4 per (tile,
//    row); launch_lp_fold_tiles folds a row's tiles in order into its statistics row. The logits
//    never reach memory.
//  - the gradient product (step 3): dlogits of g_lp * logprob + g_H * entropy, the row kernel's
//    formula element for element (the same bf16 logits, the same arithmetic: the same bits),
//    stored where the logits would have been; the gradient products read them as before.
// So the forward reads no logits and writes none, and the backward neither writes logits nor
// reads them back. Host interface only: the kernels live in lp_fused_products.cu, compiled for
// sm_90a alone (CUTLASS's ping-pong main loop, 128 x 192 tiles, a cluster of two along M) with
// the linear path's CUTLASS kernel, so cutlass_products_available (cuda/linear/cutlass_products.h)
// says whether they run; a build without them, another GPU, or operands TMA cannot address
// answer kUnsupported, and the caller runs cuBLASLt and the row kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/logprobs/logprobs_kernels.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// The vocabulary tile of the fused products: a (tile, row) partial per 192 columns.
constexpr int64_t kLpFusedTile = 192;

/// Partials of a chunk of `cols` columns: one a 192-wide tile, the last one partial.
inline int64_t lp_fused_tiles(int64_t cols) { return (cols + kLpFusedTile - 1) / kLpFusedTile; }

/// The product's operands: logits (rows x cols) = hidden (rows x H) . weight (cols x H)^T, both
/// bf16 row-major with the given row strides (elements); `r` the rows' targets and constants,
/// r.rows == rows, r.vocab_start the global index of the chunk's first column.
struct LpFusedProduct {
  int64_t rows, cols, H;
  const void* hidden;
  int64_t ld_hidden;
  const void* weight;
  int64_t ld_weight;
  LpRows r;
  cudaStream_t stream;
  int device;
};

/// Step 3's per-row inputs (float32, strided; entropy and g_h null without an entropy gradient)
/// and the dlogits output (rows x cols, bf16, row stride ld_dlogits).
struct LpFusedGrad {
  const float *lse, *logprob, *entropy, *g_lp, *g_h;
  int64_t lse_stride, logprob_stride, entropy_stride, g_lp_stride, g_h_stride;
  void* dlogits;
  int64_t ld_dlogits;
};

/// Step 1's product: partials[tile * rows + i] = {max z, rest sum, entropy sum, z of the target
/// (where the tile holds it)} for tiles [0, lp_fused_tiles(cols)), rows i in [0, rows) whose
/// target is not ignored (others are not written); with p.r.dist a second plane of as many
/// after them, {the squares' rest sum, the sum of z, the max of z before the target's column}:
/// lp_fused_partial_bytes. kUnsupported: nothing launched.
Status run_lp_stats_product(const LpFusedProduct& p, float4* partials);

/// Bytes of step 1's partials for `rows` rows of `cols` columns.
inline size_t lp_fused_partial_bytes(int64_t rows, int64_t cols, bool dist) {
  return size_t(rows) * size_t(lp_fused_tiles(cols)) * sizeof(float4) * (dist ? 2 : 1);
}

/// Step 3's product: dlogits (rows x cols) as launch_lp_backward would write them from the
/// logits. kUnsupported: nothing launched.
Status run_lp_dlogits_product(const LpFusedProduct& p, const LpFusedGrad& g);

}  // namespace cuda
}  // namespace fusedce
