// The linear cross-entropy's logits product with the loss in its epilogue (Hopper, bf16): the
// window form of docs/architecture.md. For each (row, 192-wide vocabulary tile) the epilogue
// takes the tile's own offset m = ceil(max z log2 e) and stores, in place of the logits,
//   E = bf16(2^(z log2 e - k)),  k = 0 where |m| <= kWindowBits, else k = m,
// so that a row whose tiles all took 0 (every row whose logits stay within about +-44 nats) has
// one offset for its whole row: its dlogits are r E with one float32 factor r per row, and both
// gradient products are plain products of E (linear.h: the merge, the rebase of the other rows,
// the row scales). Beside E it writes per (row, tile) the sum of E (float32, from the unrounded
// values) and the tile's own offset m; with metrics also the entropy partial centred on m,
// ln 2 sum E (z log2 e - m) (at offset 0, sum E z would make the merge's lse - U / S cancel), and
// the tile's argmax (value z log2 e and column, torch.argmax's order). With the soft-cap z is the
// capped logit and the stored entry carries dz/dx's per-entry factor 1 - (z / c)^2, so that the
// dlogits stay r times the stored matrix (the sums take E itself).
// Host interface only: the kernel lives in window_forward.cu, compiled for sm_90a alone with the
// other CUTLASS kernels (cutlass_products_available says whether they run); a build without it,
// another GPU, or operands TMA cannot address answer kUnsupported, nothing launched.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/linear/window_plan.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// logits (rows x V) = scale * (hidden (rows x H) . weight (V x H)^T + bias), bf16 row-major with the
/// given row strides (elements), never stored: E (rows x V, bf16, row stride ld_e) where
/// store_e, and the partials, each (rows x tiles) row-major: sum[i tiles + t] and offset[i tiles
/// + t] (the tile's own m); with metrics centred, top and top_col.
struct WindowForward {
  int64_t rows, V, H;
  const void* hidden;
  int64_t ld_hidden;
  const void* weight;
  int64_t ld_weight;
  float scale;
  const void* bias;  // (V,) bf16, dense, added to the logits before the scale; or null
  float softcap;  // c > 0: z = c tanh(scale acc / c), and E stored as bf16(2^(z log2 e - k) (1 - (z / c)^2)); 0: off
  bool store_e;  // false: the partials only (a forward without gradients)
  void* e;
  int64_t ld_e;
  float* sum;
  float* offset;
  bool metrics;
  float* centred;
  float* top;
  int* top_col;
  cudaStream_t stream;
  int device;
};

/// Runs the product, or answers kUnsupported (nothing launched) when it cannot; other errors
/// are device errors.
Status run_window_forward(const WindowForward& p);

}  // namespace cuda
}  // namespace fusedce
