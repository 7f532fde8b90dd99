// The CPU backend's row kernels (cross-entropy and per-token log-probabilities over rows of
// logits): the interface between their callers (cross_entropy_cpu.cpp, which also picks the
// instruction set, linear_cpu.cpp, logprobs_cpu.cpp) and the per-ISA translation units
// (kernels_avx512.cpp, kernels_avx2.cpp, kernels_generic.cpp) that compile the same code
// (kernels_impl.h) with different instruction sets.
#pragma once

#include <cstdint>

#include "common/logprob_math.h"
#include "common/numeric.h"
#include "fusedce/types.h"
#include "fusedce/vocab_parallel.h"

namespace fusedce {
namespace cpu {

/// Everything a row kernel needs; filled once per call by the host code.
struct RowArgs {
  // Inputs.
  const char* logits;       // row i starts at logits + i * logits_stride * elem bytes
  DType dtype;              // float32 / bfloat16 / float16 (logits and dlogits)
  int64_t vocab;            // V
  int64_t logits_stride;    // elements between row starts
  const void* target;
  DType target_dtype;       // int32 / int64
  int64_t target_stride;
  int64_t ignore_index;
  const float* class_weight;  // contiguous (V,), or nullptr
  detail::LossConstants c;

  // Features, as flags (the row loops branch on them once per chunk, not per element).
  bool softcap;
  bool smoothing;
  bool metrics;

  // Which sweeps run: the forward statistics, and/or the gradient.
  bool forward;             // compute lse / loss (/ metrics) from the logits
  bool gradient;            // write dlogits
  const float* lse_in;      // backward only: the forward's lse (stride lse_in_stride)
  int64_t lse_in_stride;

  // Upstream gradient of row i: g_chain * (grad_loss ? grad_loss[grad_scalar ? 0 : i * stride] : 1).
  const float* grad_loss;
  int64_t grad_stride;
  bool grad_scalar;
  float g_chain;

  char* dlogits;            // may equal logits (in place)
  int64_t dlogits_stride;

  // Vocabulary shard (vocabulary-parallel): the row holds global columns [target_offset,
  // target_offset + vocab); targets are global. 0 for a whole vocabulary.
  int64_t target_offset;
  const float* w_t_in;      // shard backward: each row's target weight (nullptr = from class_weight)
  float* partial_out;       // shard statistics: kShardStatsWidth floats per row instead of a loss

  // Per-row outputs (contiguous, length N); entries of ignored rows are written as 0.
  float* row_loss;
  float* row_lse;
  float* row_entropy;
  uint8_t* row_correct;
};

/// dlogits[i, :] *= factor(i), rows whose factor is 1 untouched.
struct RescaleArgs {
  char* dlogits;
  DType dtype;
  int64_t vocab;
  int64_t stride;
  const float* grad_loss;
  int64_t grad_stride;
  bool grad_scalar;
};

/// One row's log-probability statistics (common/logprob_math.h): its state over the columns
/// held here and, when they hold its target, the target's z.
struct LpRowStats {
  detail::LpState<double> st;
  float z_t;
  bool holds;
  double z_sum;      // with distribution_stats: the sum of z over the columns
  float max_before;  // with distribution_stats: max of z over the columns before the target (-inf: none)
};

/// Everything the log-probability row kernels (fusedce/logprobs.h, steps 1 and 3) need. Item k
/// is row rows[k] (or row k when rows is null) of x, and of dx.
struct LpRowArgs {
  const char* x;           // row r starts at x + r * stride elements
  DType dtype;             // float32 / bfloat16 / float16 (x and dx)
  int64_t vocab;           // columns held here
  int64_t stride;
  const int64_t* rows;     // or nullptr
  const int64_t* targets;  // item k's target in these columns (outside [0, vocab): another shard's)
  float scale;             // z = x * scale (1 / temperature), so dz/dx = scale
  bool distribution_stats; // step 1: also st.q, z_sum and max_before

  LpRowStats* stats;              // step 1: one per item
  const detail::LpRowGrad* grad;  // step 3: one per item
  char* dx;                       // step 3: d/dx of the item's objective; may equal x
  int64_t dx_stride;
};

/// A row kernel over items [begin, end) of its arguments.
template <typename Args>
using RowFn = void (*)(const Args& args, int64_t begin, int64_t end);

/// The row kernels one instruction set was built for.
struct RowKernels {
  RowFn<RowArgs> ce;             // cross-entropy rows: statistics and / or dlogits
  RowFn<RescaleArgs> rescale;    // dlogits rows times their upstream gradient
  RowFn<LpRowArgs> lp_stats;     // log-probability statistics of each row
  RowFn<LpRowArgs> lp_grad;      // log-probability gradient of each row
};

namespace generic {
RowKernels row_kernels();
}  // namespace generic
namespace avx2 {
RowKernels row_kernels();
}  // namespace avx2
namespace avx512 {
RowKernels row_kernels();
}  // namespace avx512

/// The row kernels of the best instruction set this CPU has.
const RowKernels& best_row_kernels();

/// Rows per task handed to a thread by the runners below: about 64K elements, at least one row.
int64_t row_grain(int64_t vocab);

/// A row kernel of best_row_kernels() over items [0, n) on the thread pool.
void run_rows(const RowArgs& args, int64_t n, int max_threads);
void run_lp_stats_rows(const LpRowArgs& args, int64_t n, int max_threads);
void run_lp_grad_rows(const LpRowArgs& args, int64_t n, int max_threads);

/// The target of row i widened to int64.
inline int64_t load_target(const void* target, DType dtype, int64_t stride, int64_t i) {
  return dtype == DType::kInt32 ? static_cast<const int32_t*>(target)[i * stride]
                                : static_cast<const int64_t*>(target)[i * stride];
}

}  // namespace cpu
}  // namespace fusedce

namespace fusedce {
namespace cpu {

/// Dense tile products of the linear cross-entropy CPU path, all float32, row-major, H contiguous:
///   logits: C[r * vt + v]  = sum_h A[r * H + h] * B[v * H + h]
///   dw:     D[v * H + h]  += sum_r G[r * vt + v] * A[r * H + h]
///   dh:     E[r * H + h]  += sum_v G[r * vt + v] * B[v * H + h]
/// Sums run in a fixed order (8 lanes along h, then a fixed tree), whatever the thread count.
struct TileKernels {
  void (*logits)(const float* A, const float* B, int64_t rc, int64_t vt, int64_t H, float* C);
  void (*dw)(const float* G, const float* A, int64_t rc, int64_t vt, int64_t H, float* D);
  void (*dh)(const float* G, const float* B, int64_t rc, int64_t vt, int64_t H, float* E);
};

namespace generic {
TileKernels tile_kernels();
}  // namespace generic
namespace avx2 {
TileKernels tile_kernels();
}  // namespace avx2
namespace avx512 {
TileKernels tile_kernels();
}  // namespace avx512

/// The tile kernels of the best instruction set this CPU has (defined in linear_cpu.cpp).
TileKernels best_tile_kernels();

}  // namespace cpu
}  // namespace fusedce
