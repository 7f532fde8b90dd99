// Plain parameter structs of the CUDA passes, passed to kernels by value. Host code fills them
// once per call; every index that can pass 2^31 (row x stride) is int64_t.
#pragma once

#include <cstdint>

#include "common/numeric.h"

namespace fusedce {
namespace cuda {

/// Batch-level scalars the prepare pass writes to the workspace before the row kernels run.
struct BatchScalars {
  double denominator;  // mean: non-ignored rows, or the sum of their target weights
  float weight_sum;    // sum of class weights (V without weights)
  float g_chain;       // 1 / denominator for mean, else 1
  int64_t bad_row;    // first row whose target is out of range, or INT64_MAX
  int64_t bad_value;  // its target
};

/// The fused row pass: forward statistics and/or the gradient, one row per thread-block cluster.
struct RowParams {
  const void* logits;        // (N, V) in T
  int64_t logits_stride;     // elements between row starts
  void* dlogits;             // (N, V) in T, may equal logits; nullptr without gradient
  int64_t dlogits_stride;
  const void* target;        // (N,) int32 or int64
  int64_t target_stride;
  bool target_i64;
  int64_t ignore_index;
  const float* class_weight; // (V,) or nullptr
  int64_t weight_stride;
  int64_t rows;              // N
  int64_t vocab;             // V
  detail::LossConstants c;   // weight_sum is read from batch when class weights are given
  const BatchScalars* batch; // from the prepare pass, or nullptr (then denominator 1, W = V)

  bool softcap, smoothing, metrics;

  // Forward outputs per row (strided), each optional except row_loss in forward jobs.
  float* row_loss;           // out.loss for reduction none, else workspace
  int64_t row_loss_stride;
  float* lse_out;
  int64_t lse_stride;
  float* row_entropy;        // workspace, metrics only
  uint8_t* row_correct;      // workspace, metrics only

  // Backward only: the forward's lse.
  const float* lse_in;
  int64_t lse_in_stride;

  // Upstream gradient of row i: g_chain * (grad_loss ? grad_loss[scalar ? 0 : i * stride] : 1).
  const float* grad_loss;
  int64_t grad_stride;
  bool grad_scalar;

  // Layout of the launch: `cluster` blocks share a row, each covering `pieces` consecutive
  // stretches of blockDim.x * kItems vectors.
  int cluster;
  int pieces;
};

/// A block's (or cluster's) partial statistics of one row.
struct RowPartial {
  detail::LseState st;
  float smooth;    // sum z (or sum w z)
  float amax_v;    // argmax value and index (metrics)
  int64_t amax_i;
  float z_target;  // the target's z, from the one thread that holds it
  int has_target;
};

/// Sums over rows for the batch results (finalize): loss, entropy, correct rows, and the mean's
/// denominator when the rows are counted there.
struct BatchSums {
  double loss, entropy, correct, den;
};

/// One-block passes over the batch: the prepare pass (targets, weights) and the finalize pass
/// (per-row results summed in a fixed order); the stream kernel finishes a call from the same
/// inputs itself (StreamParams::fin).
struct BatchParams {
  const void* target;
  int64_t target_stride;
  bool target_i64;
  int64_t ignore_index;
  int64_t rows;
  int64_t vocab;
  const float* class_weight;
  int64_t weight_stride;
  bool mean;
  BatchScalars* batch;

  // Finalize. count_rows: the mean's denominator is counted here (no prepare pass ran: a
  // forward without class weights needs the batch scalars only for the mean).
  bool count_rows;
  const float* row_loss;
  const float* row_entropy;
  const uint8_t* row_correct;
  float* loss_out;           // (1,)
  int64_t* num_correct_out;  // (1,) or nullptr
  float* entropy_out;        // (1,) or nullptr
};

/// The streaming (sm_90) pass: persistent blocks walk work items (row, split); the copy engine
/// streams each item's chunks into a ring of shared-memory stages.
struct StreamParams {
  RowParams row;
  int splits;            // blocks sharing one row; > 1 only for few rows (then no gradient here)
  int chunks_per_split;  // chunks of kChunkSegs segments per split
  void* partials;        // (N, splits) RowPartial, splits > 1 only (merged by the last split, or the split-merge pass)
  // The gradient sweep walks each row backwards (set when the rows in flight on all SMs outgrow
  // the L2): a forward re-scan would miss on every chunk (LRU evicts each row's start first);
  // backwards, the chunks loaded last, still in L2, come first. Rows that fit gain nothing and
  // keep the forward order.
  bool grad_backwards;
  // Forward over whole rows: fold each row's warp partials asynchronously (each warp posts its
  // partial; the last to arrive folds them). Off only when a test asks for the synchronous
  // reduction (PlanChoices::async_reduce): the same bits.
  bool async_reduce;
  // 2: each row is shared by the two blocks of a cluster (halves of chunks_per_split chunks,
  // statistics swapped through distributed shared memory, both sweeps fused), so the rows in
  // flight take half the L2 and the gradient sweep re-reads from it. Forward + gradient, rows
  // that would overflow L2. Else 1.
  int halves;
  // One launch per call (finish.cuh): with `finish`, each split row's partials are merged by its
  // last split (no split-merge pass), and the batch sums, when `fin` asks for any, are formed by
  // the block that finishes last (each block's sums of its own rows in block_sums first; no
  // finalize pass). counters: [0] blocks done, [1 + row] a split row's splits done, tagged with
  // `tag` (arrive_tagged).
  bool finish;
  BatchParams fin;
  unsigned long long* counters;
  unsigned long long tag;
  BatchSums* block_sums;  // (gridDim.x)
  // Mean with the gradient and no prepare pass: every block counts the valid targets itself
  // (BatchParams target fields of `fin`) for 1 / denominator.
  bool count_den;
};

/// dlogits[i, :] *= factor(i); rows whose factor is 1 skipped.
struct RescaleParams {
  void* dlogits;
  int64_t stride;
  int64_t rows;
  int64_t vocab;
  const float* grad_loss;
  int64_t grad_stride;
  bool grad_scalar;
  int chunks_per_row;  // blocks per row
};

}  // namespace cuda
}  // namespace fusedce
