// The passes around the window form's products (window_forward.h; docs/architecture.md, "The
// window form"), bf16: the merge of a chunk's (row, tile) partials into each row's loss, lse and
// gradient factor; the rebase of the rows whose tiles took different offsets; and the row scales
// that stand in for a dlogits pass. Device code sees only these plain structs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/numeric.h"

namespace fusedce {
namespace cuda {

/// One warp a position of the chunk: K = max_t k_t (k_t = window_offset(m_t)), S = sum_t S_t
/// 2^(k_t - K), lse = ln 2 (K + log2 S); the target's logit z_t = scale (h . w_t + b_t) (soft-capped
/// where the call caps: detail::transform_logit), from a float32 dot product of the bf16 operands (the loss's and the rewrite's, so that neither depends on the
/// product's rounding); loss = w_t (lse - z_t) + z_loss lse^2 (detail::row_loss). With gradients
/// the row's dlogits are r (c E - d onehot_t) (window_math::row_factor: r = g alpha scale a / S
/// with a = w_t + 2 z_loss lse, c = 1 and d = S w_t / a but where a nearly cancels), E's target
/// entry rewritten to c 2^(z_t log2 e - K) - d in the offset-K frame (always a finite bf16; with the
/// soft-cap times 1 - (z_t / cap)^2, as the epilogue stores every entry). A row
/// whose tiles all took offset 0 (K = 0 and no tile apart) and c = 1 has its entry written here;
/// the others are flagged for the rebase, which writes it after bringing the row to K and c. An
/// ignored row: loss 0, lse 0, r 0; a target outside [0, V) (unchecked): NaN loss and r, as the
/// logits path gives. With metrics: the row's entropy
/// ln(S 2^(K - Mx)) + (ln 2 sum_t f_t S_t (Mx - m_t) - sum_t f_t Uc_t) / S (Mx = max_t m_t, f_t =
/// 2^(k_t - K), Uc_t the centred partials: every term of the sum >= 0, no cancellation) and
/// whether the argmax over the tiles' argmaxes is the target; 0 for an ignored row. With label
/// smoothing (no soft-cap) the loss's sum over the row's logits is scale (h . smooth[0, H) +
/// smooth[H]) and the rows' dlogits gain q_i v_j (window_math::smooth_part: q_i = -scale g eps /
/// V, 0 for an ignored row).
struct WindowMergeParams {
  const float* sum;     // (n x tiles) row-major
  const float* offset;  // (n x tiles): each tile's own offset m_t
  int64_t n, tiles, V, H;
  const void* hidden;  // (n x H) bf16, row stride ld_hidden: the chunk's rows
  int64_t ld_hidden;
  const void* weight;  // (V x H) bf16
  int64_t ld_weight;
  const int64_t* target;  // (n,) the chunk's targets
  int64_t ignore_index;
  const float* class_weight;  // (V,) strided, or null
  int64_t weight_stride;
  const void* bias;           // (V,) bf16 added to the logits, or null
  detail::LossConstants lc;  // the loss's constants (weight_sum from the device's, below)
  const float* weight_sum;   // the class weights' sum (V without them), on the device
  // label smoothing (no soft-cap): (H + 1) float32, sum_j v_j w_j then sum_j v_j b_j (v the class
  // weights, or 1), from launch_column_sums over the weight; null without smoothing
  const float* smooth;
  const float* centred;  // metrics: (n x tiles) partials; null without metrics
  const float* top;
  const int* top_col;
  const float* grad;   // (n,) each position's upstream gradient; null: a forward without gradients
  const float* alpha;  // the factor the products would apply (linear.h's ProductScaleParams), or null
  void* e;             // (n x V) bf16 E, row stride ld_e (with gradients)
  int64_t ld_e;
  // outputs, (n,) each
  float* loss;
  float* lse;
  float* r;             // with gradients
  float* q;             // with gradients and smoothing: each row's factor of the uniform term
  void* r16;            // with grad_bias: bf16(r), grad_bias's other operand (E^T r); else null
  float* rescale;       // with gradients: c (1 but where a nearly cancels)
  float* kmax;          // with gradients: K
  float* target_entry;  // with gradients: the rewritten entry in the frame of K (NaN: none)
  uint8_t* rebase;      // with gradients: 1 where a row's tiles took offsets other than K
  float* entropy;       // metrics
  uint8_t* correct;     // metrics
};

/// The chunk's metrics: *entropy_sum = sum of the rows' entropies (in double, in row order),
/// *num_correct = count of the rows' correct flags. One block.
struct WindowMetricsParams {
  const float* entropy;
  const uint8_t* correct;
  int64_t n;
  float* entropy_sum;
  int64_t* num_correct;
};

/// Each flagged row's E brought to the row's one offset K and its factor c: E 2^(k_t - K) c per
/// 192-wide tile (with c = 1 a power of two: exact in bf16 but for terms 2^-62 and more under the
/// row's largest, which a tile that took offset 0 flushes at 2^-126), then its target entry written. One block a row;
/// an unflagged row reads its flag and leaves.
struct WindowRebaseParams {
  void* e;
  int64_t ld_e, n, V, tiles;
  const float* offset;
  const float* kmax;
  const float* rescale;  // each row's c (window_math::row_factor)
  const uint8_t* rebase;
  const int64_t* target;
  const float* target_entry;
};

/// out[i][j] = bf16(r[i] src[i][j] + q[i] vec[j]) over (n, H): src float32 dense (grad_hidden's
/// float32 product E W: one rounding, as the logits path's grad_hidden; q and vec label
/// smoothing's q_i sum_j v_j w_j), or src bf16 with row stride ld_src (grad_weight's other
/// operand, hidden' = bf16(r h)); q null: no second term.
struct RowScaleParams {
  const void* src;
  bool src_f32;
  int64_t ld_src;
  const float* r;
  void* out;  // bf16
  int64_t ld_out, n, H;
  const float* q;
  const float* vec;
};

/// Weighted column sums of a bf16 matrix x (rows x cols, row stride ld), in two fixed-order
/// stages (deterministic): out[c] = sum_i w_i x[i][c] for c < cols, and out[cols] = sum_i w_i
/// last_i (last a bf16 vector; or with last_ones the weights' own sum; else 0). w: float32 with
/// stride w_stride, null for 1. partial: slices x (cols + 1) float32, slices in [1, kMaxSlices].
/// split (optional): kSmoothRows bf16 rows of cols, row stride ld_split, row k =
/// window_math::smooth_part(split_bf16(out[c]), k, false); split_last (optional): the same kSmoothRows
/// parts of out[cols]. Label smoothing's sum_j v_j w_j over the weight (once a call) and its
/// u = sum_i q_i h_i over a chunk's rows (the products' extra rows).
struct ColumnSumParams {
  static constexpr int kMaxSlices = 128;
  const void* x;
  int64_t ld, rows, cols;
  const float* w;
  int64_t w_stride;
  const void* last;
  bool last_ones;
  float* partial;
  int slices;
  float* out;
  void* split;
  int64_t ld_split;
  void* split_last;
};

/// E's kSmoothRows extra rows (row stride ld_e, starting at e) over V columns: row k holds
/// window_math::smooth_part(split_bf16(v_j), k, true), v_j the class weight (strided) or 1.
struct SmoothRowsParams {
  void* e;
  int64_t ld_e, V;
  const float* class_weight;
  int64_t weight_stride;
};

void launch_window_merge(const WindowMergeParams& p, cudaStream_t stream);
void launch_window_rebase(const WindowRebaseParams& p, cudaStream_t stream);
void launch_row_scale(const RowScaleParams& p, cudaStream_t stream);
void launch_window_metrics(const WindowMetricsParams& p, cudaStream_t stream);
void launch_column_sums(const ColumnSumParams& p, cudaStream_t stream);
void launch_smooth_rows(const SmoothRowsParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace fusedce
