// The window form's plan (window_forward.h): which calls take it, and the constants of its tiles
// and window. Plain C++ (no CUDA headers), so it is tested on every machine.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/call.h"
#include "common/numeric.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// The vocabulary tile of the window product: one (row, tile) partial per 192 columns.
constexpr int64_t kWindowTile = 192;
/// The window in powers of two. Above: E <= 2^64 keeps every sum of the gradient products finite
/// (V 2^64 |W| < 2^100 in float32). Below: a tile that took offset 0 with its maximum at 2^-64
/// or above loses only terms 2^-62 under that maximum (ex2's flush to zero at 2^-126), far below
/// the gradient's bf16 rounding.
constexpr float kWindowBits = 64.0f;

inline int64_t window_tiles(int64_t V) { return (V + kWindowTile - 1) / kWindowTile; }

/// The offset a (row, tile) took, from its own offset m (what the epilogue stores).
FUSEDCE_HD float window_offset(float m) { return m <= kWindowBits && m >= -kWindowBits ? 0.0f : m; }

/// The window product's tile order for CUTLASS's persistent scheduler: along M (consecutive CTAs
/// take consecutive row tiles of one vocabulary tile, so a weight tile is read once from memory
/// for all rows). Under 8192 rows the CTAs in flight walk every row tile of a vocabulary tile and
/// find the chunk's hidden rows in L2 (swizzle 1); from 8192 rows on, swizzle groups of row tiles
/// keep a group's rows in L2 while it walks the vocabulary: the largest group of 8, 4 or 2 that
/// divides the row tiles, because the scheduler pads the row tiles to a whole number of groups and
/// a padded tile holds an SM for nothing.
struct WindowTileOrder {
  bool along_m;
  int swizzle;
};
inline WindowTileOrder window_tile_order(int64_t rows) {
  if (rows < 8192) return {true, 1};
  const int64_t row_tiles = (rows + 127) / 128;
  for (int s = 8; s > 1; s /= 2)
    if (row_tiles % s == 0) return {true, s};
  return {true, 1};
}

/// The widest hidden size that takes the window form. The cross-entropy pass the form removes
/// costs in proportion to N V, the three products in proportion to N V H, and the epilogue adds a
/// few percent to the logits product: the trade pays while the pass is a large share of the call,
/// i.e. for the short-K heads (small models, GRPO policies); past this width the logits path
/// stays (docs/performance.md, "The window form in the library").
constexpr int64_t kWindowMaxHidden = 3072;

/// Label smoothing's extra rows of the gradient products' K (window_math::smooth_part): the
/// uniform term q_i v_j as v_hi u_hi + v_hi u_lo + v_lo u_hi, each factor split into two bf16.
constexpr int64_t kSmoothRows = 3;


/// Whether a call may take the window form: bf16 where the CUTLASS kernels run (`hopper`), with
/// the options whose gradient is a per-row factor times softmax minus a target term (logit scale,
/// class weights, z-loss, ignore_index, the shift, every reduction, skip_ignored, the metrics), the
/// soft-cap (its per-entry factor stored in the matrix the products read), a bias and grad_bias
/// (the bias added in the epilogue, its gradient E^T r), label smoothing without the soft-cap (its
/// uniform term is a rank-one matrix q v^T: its sum over a row is linear in the hidden row, its
/// share of the gradients rides kSmoothRows extra rows of the products' K). Label smoothing with
/// the soft-cap (its row sum is over capped logits, which only the epilogue sees) and
/// low_memory's vocabulary slices keep the logits path. H a multiple of 8 (the TMA's 16-byte rows)
/// and at most kWindowMaxHidden; any V.
inline bool window_eligible(int64_t H, int64_t V, DType dtype, const Options& o, bool low_memory, bool hopper) {
  if (!hopper || dtype != DType::kBFloat16 || low_memory) return false;
  if (o.label_smoothing != 0.0f && o.softcap != 0.0f) return false;
  if (!std::isfinite(o.logit_scale)) return false;
  return H % 8 == 0 && H <= kWindowMaxHidden && V >= 1;
}

/// Whether the planner picks the window form for an eligible call. The form pays where its
/// epilogue (an exponential, a maximum and a sum per accumulator, E's store) hides under the
/// other warpgroup's main loop: with no option, with the soft-cap (a tanh per accumulator), with
/// label smoothing, z-loss, the logit scale and class weights (they ride the merge and the
/// products), with a bias and grad_bias (a bias value per column of a tile, E's column sums a
/// pass over E, which the logits path's cross-entropy pass outweighs) (docs/performance.md,
/// "Which calls take the window form"). The metrics never decide the form: the contract keeps
/// the loss and every gradient bit-identical with metrics on or off, and the two forms round
/// differently.
inline bool window_pays(const Options& /*o*/, bool /*grad_bias*/) { return true; }

/// The form a call takes: `eligible` from window_eligible, `form` the call's choice.
inline bool window_chosen(bool eligible, detail::LinearForm form, const Options& o, bool grad_bias) {
  if (!eligible || form == detail::LinearForm::kLogits) return false;
  return form == detail::LinearForm::kWindow || window_pays(o, grad_bias);
}

}  // namespace cuda
}  // namespace fusedce
