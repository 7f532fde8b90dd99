// The CUDA backend of fused linear cross-entropy (docs/architecture.md, "GPU backend"): token
// chunks, each
//   1. logits chunk (rows, V) = hidden_chunk . weight^T (+ bias), cuBLASLt, in the input dtype;
//   2. the cross-entropy kernel of the logits (reduction none, every option) turns it into the
//      rows' loss, lse, metrics and, in place, dlogits scaled by each row's upstream gradient
//      (a sum's or mean's upstream gradient g is applied by the products instead, their float32
//      alpha, read on the device: linear.h's ProductScaleParams says why);
//   3. grad_hidden_chunk = dlogits . weight; grad_weight += dlogits^T . hidden_chunk into a
//      float32 accumulator (the output itself for float32; the last chunk's product writes the
//      16-bit grad_weight straight from the accumulator where the CUTLASS kernel runs); grad_bias
//      += column sums (a product with a ones vector) into a float32 accumulator.
// The products run through cuBLASLt (gemm.h); on Hopper the last chunk's bfloat16 grad_weight
// product is a CUTLASS kernel (cutlass_products.h) that also rounds, else cuBLASLt and a rounding
// pass.
// The window form (Hopper, bf16, the options whose gradient is a per-row factor times softmax:
// window_eligible; taken where it pays: window_chosen) replaces steps 1 and 2: the logits product's epilogue stores E = exp(z - k)
// in the logit buffer (k = 0 for every 192-wide tile whose largest logit lies within about 44
// nats of 0) with per-(row, tile) sums and offsets; a merge forms each row's loss, lse and factor
// r (dlogits = r E, the target's entry of E rewritten; z-loss's per-row softmax factor rides r),
// a rebase brings the few rows whose tiles took different offsets (or whose z-loss and likelihood
// factors cancel) to one; then grad_weight (+)= E^T bf16(r h) and grad_hidden = bf16(r (E W))
// (cuBLASLt's float32 product, scaled and rounded once). No pass reads or writes the logits
// beyond the products (window_forward.h, window_kernels.h).
// low_memory (with grad_weight): the float32 (V, H) accumulator would break the 512 MiB bound, so
// step 3 leaves grad_weight out and a second pass forms it slice by slice of the vocabulary: for
// each slice, the logits of every position over the slice's columns are recomputed (a product),
// turned into dlogits from the lse and upstream gradient the first pass saved, and
// grad_weight's slice = dlogits^T . hidden is written once (float32 accumulation inside the
// product over all positions; a small float32 slice accumulator only when the positions need
// more than one token chunk). 8 N H V flops instead of 6: the price of the bound.
// The logits never exist beyond one chunk (chunk_budget_bytes). The reduction, the mean's
// denominator and every upstream-gradient factor live in device memory: no host sync, except
// with check_targets and with skip_ignored outside graph capture (below). Every sum has a fixed
// order: the loss sums the rows in row order, the products accumulate chunk after chunk, so
// results are the same bits run to run (they depend on the chunk size, which depends only on the
// arguments, and with skip_ignored on the count of valid rows).
//
// skip_ignored: the prepare kernel compacts the rows whose target is not ignored (idx, count on
// the device), and the products run over those positions only.
//   Eager (the stream is not capturing): the count is read back (one host sync) and the chunks
//   are sized on it: balanced_rows(count, chunk_rows) rows each.
//   Under CUDA graph capture (cudaStreamIsCapturing): no sync. The chunks are planned for the
//   worst case (every row valid, balanced_rows(N, chunk_rows) rows each) and each one is a
//   conditional SWITCH node (CUDA 12.8+) whose branch a one-thread kernel sets from the device's
//   count (size_ladder.h): no body when the chunk has no valid row, else the body captured for
//   the smallest rung of the chunk's size ladder (eighths of it in whole 128-row tiles) that
//   holds its rows, or the full body when later chunks follow. Positions past the count inside a
//   rung are padding: the gather gives them target ignore_index, upstream gradient 0 and zero
//   hidden rows, so their logits are finite, their dlogits exact zeros, and they add exact zeros
//   to grad_weight and grad_bias (the products' K) and nothing to the loss or metrics; the
//   scatter skips them. The finish (clear the unwritten sums, or round grad_weight from its
//   accumulator) is a SWITCH on the count too. The bodies are captured on a stream of our own
//   with cudaStreamBeginCaptureToGraph into the node's body graphs; every cuBLASLt product uses
//   the workspace's preallocated cuBLASLt workspace, and its heuristic runs on the host while the
//   body is captured (once per rung: a captured call pays 8 heuristic queries per product where
//   an eager one pays 1). Bits: a chunk that runs at rung r computes exactly what the synced path
//   computes for a chunk of r rows whose last positions are ignored rows; so where the synced
//   path's chunks have the rungs' sizes (count on a rung of a one-chunk plan, or every row valid)
//   the results are the same bits. Elsewhere the products and the cross-entropy pass run at
//   another row count than the synced path's, cuBLASLt may pick another kernel (tile, split-K)
//   for it, and the last bits of the logits, grad_hidden, grad_weight and grad_bias may differ
//   within the float32 rounding of a reordered sum (the padding's zeros add nothing).
//   check_targets (a host read) is refused under capture, naming it; low_memory's second pass is
//   sized on the host and refused under capture with skip_ignored.
//   Eager calls keep the synced path: a graph of their own would be captured (every rung's
//   bodies) and instantiated anew per call, since the pointers change from call to call
//   (bench/linear_bench.cu's skip_ignored rows time both).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <map>
#include <cstdint>
#include <sstream>
#include <string>

#include "common/call.h"
#include "common/constants.h"
#include "cuda/linear/cutlass_products.h"
#include "cuda/linear/gemm.h"
#include "cuda/linear/head_ops.h"
#include "cuda/host_util.h"
#include "cuda/linear/linear.h"
#include "cuda/linear/size_ladder.h"
#include "cuda/linear/window_forward.h"
#include "cuda/linear/window_kernels.h"
#include "cuda/linear/window_plan.h"

namespace fusedce {
namespace cuda {

/// Least default bytes of logits per chunk: with the cuBLASLt workspace and the per-row vectors
/// the extra memory stays within 512 MiB plus the float32 grad_weight accumulator.
constexpr size_t kDefaultChunkBudget = size_t(448) << 20;
/// What the cuBLASLt workspace, the per-row vectors and the logits kernel's workspace may take
/// beside the logit buffer.
constexpr size_t kChunkOverheadBytes = size_t(64) << 20;

/// The default logit budget: the larger of kDefaultChunkBudget and a float32 copy of the weight
/// (less the overhead), so the extra memory stays within the larger of 512 MiB and that copy,
/// plus the float32 grad_weight accumulator when the weight is 16-bit. Each token chunk reads
/// and writes that accumulator once: a budget that grows with the weight keeps the number of
/// chunks, and so the accumulator's traffic, from growing with V * H (at 16384 x 2304 x 256000,
/// 4 chunks instead of 19).
size_t default_chunk_budget(int64_t V, int64_t H) {
  const size_t weight_f32 = size_t(V) * size_t(H) * 4;
  return std::max(kDefaultChunkBudget, weight_f32 > kChunkOverheadBytes ? weight_f32 - kChunkOverheadBytes : 0);
}

/// Rows per chunk for `positions` rows with at most `cap` per chunk: as many chunks as needed, of
/// even size (whole tiles of 128 where possible), so that no chunk is a thin ragged remainder
/// whose products run far below the matrix units' rate (2048 rows in a 1792-row buffer:
/// 2 x 1024, not 1792 + 256). Never more than `cap`.
int64_t balanced_rows(int64_t positions, int64_t cap, int64_t granule) {
  if (positions <= cap) return std::max<int64_t>(positions, 1);
  const int64_t chunks = (positions + cap - 1) / cap;
  int64_t rows = (positions + chunks - 1) / chunks;
  if (rows > granule) rows = std::min<int64_t>((rows + granule - 1) / granule * granule, cap);
  return rows;
}

namespace {


/// low_memory: the logit buffer's default (the smaller one when the second pass needs a slice
/// accumulator), and the most that float32 accumulator may take; with the cuBLASLt workspace
/// and the per-row vectors the whole call stays under 512 MiB.
constexpr size_t kLowMemoryChunkBudget = size_t(384) << 20;
constexpr size_t kLowMemorySmallChunkBudget = size_t(256) << 20;
constexpr size_t kSliceAccBytes = size_t(128) << 20;
/// low_memory: a vocabulary slice spans at least this many columns (or the whole vocabulary)
/// when the buffer allows, so the slice products stay large.
constexpr int64_t kMinSliceVocab = 4096;

int64_t round_up(int64_t n, int64_t q) { return (n + q - 1) / q * q; }

/// low_memory's second pass: positions per token chunk and columns per vocabulary slice.
struct SlicePlan {
  int64_t rows;    // positions per token chunk (the last may have fewer)
  int64_t vocab;   // columns per slice (the last may have fewer)
  int64_t ld;      // row stride of the slice's logits
  size_t hidden;   // bytes at the buffer's start for the gathered hidden rows (skip_ignored)
  bool acc;        // more than one token chunk: 16-bit grad_weight goes through the accumulator
};

/// What one call computes, from its arguments alone (so the size query and the run agree).
struct LinearPlan {
  int64_t N, H, V;
  DType dtype;
  bool grad, grad_hidden, grad_weight, grad_bias, compact, metrics;
  bool low_memory;       // grad_weight by the vocabulary-sliced second pass
  bool gw_via_acc;       // 16-bit grad_weight summed over chunks in a float32 accumulator
  bool logits_in_gw;     // the logit buffer borrows the 16-bit grad_weight output (see plan_linear)
  bool pad_weight;       // grad_hidden from a copy of the weight padded to ld_logits rows
  bool window;           // the window form: allowed (window_eligible) and chosen (window_chosen)
  bool win_smooth;       // ... with label smoothing: its vectors and the products' extra K rows
  size_t buffer_bytes;   // the logit buffer
  size_t slice_acc_bytes;
  int64_t chunk_rows;  // rows the logit buffer holds: the most a chunk has
  int64_t ld_logits;   // row stride of the logits chunk: V rounded up to 16 bytes
  int64_t max_chunks;
  Options ce_options;  // the per-chunk cross-entropy call's options
  // workspace byte offsets
  size_t gemm_ws, logits, ce_ws, ce_ws_bytes, ones, gw_acc, gb_acc, eff_target, idx, scalars, target_c, grad_p,
      loss_c, lse_p, row_loss, chunk_entropy, chunk_correct, hidden_c, gh_c, slice_acc, weight_pad, win_sum,
      win_offset, win_r, win_r16, win_rescale, win_kmax, win_entry, win_flag, win_scratch, win_centred, win_top, win_top_col, win_entropy,
      win_correct, win_q, win_svec, win_u, win_partial, total;
};

struct Scalars {  // device-side batch scalars written by the prepare and product-scale kernels
  int64_t count;
  int64_t bad_row;
  float denom;
  float weight_sum;
  float scale[4];  // ProductScaleParams' out: {alpha, 0, 1, the rows' factor}
};

/// The second pass's shape for `positions` rows entering the products. Depends on the plan and
/// `positions` only; with positions <= N it never needs more than the plan reserved.
SlicePlan plan_slices(const LinearPlan& p, int64_t positions) {
  const size_t el = elem_size(p.dtype);
  const int64_t per16 = static_cast<int64_t>(16 / el);
  const int64_t hc = p.compact ? p.H : 0;  // hidden columns gathered per position
  // Narrowest slice worth having: kMinSliceVocab columns, fewer for a buffer too small to hold
  // a square-ish tile of them (tests' tiny budgets), never under one 16-byte segment.
  int64_t isq = 1;
  while ((isq + 1) * (isq + 1) <= static_cast<int64_t>(p.buffer_bytes / el)) ++isq;
  const int64_t vmin = std::max<int64_t>(per16, std::min<int64_t>({round_up(p.V, per16), kMinSliceVocab, isq / per16 * per16}));
  const size_t usable = p.buffer_bytes > kWorkspaceAlign ? p.buffer_bytes - (p.compact ? kWorkspaceAlign : 0) : p.buffer_bytes;
  int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(usable / (el * size_t(hc + vmin))));
  if (cap >= 256 && cap < positions) cap = cap / 128 * 128;  // as set_chunks: all rows fit = one chunk
  SlicePlan s{};
  s.rows = balanced_rows(std::max<int64_t>(positions, 1), cap);
  s.acc = positions > cap;
  s.hidden = p.compact ? align_up(size_t(s.rows) * hc * el) : 0;
  int64_t fit = static_cast<int64_t>((p.buffer_bytes - std::min(s.hidden, p.buffer_bytes)) / (size_t(s.rows) * el));
  if (s.acc && p.dtype != DType::kFloat32) fit = std::min<int64_t>(fit, static_cast<int64_t>(p.slice_acc_bytes / (size_t(p.H) * 4)));
  if (round_up(p.V, per16) <= fit) {
    s.vocab = p.V;
  } else {
    const int64_t q = fit >= 128 ? 128 : per16;  // whole tiles for the products where it fits
    const int64_t most = std::max<int64_t>(per16, fit / q * q);
    const int64_t slices = (p.V + most - 1) / most;
    s.vocab = std::min<int64_t>(most, round_up((p.V + slices - 1) / slices, q));
  }
  s.ld = round_up(s.vocab, per16);
  return s;
}

LinearPlan plan_linear(Job job, const Device& device, int64_t N, int64_t H, int64_t V, DType dtype, const Options& o,
                       const LinearOptions& lo, bool want_gh, bool want_gw, bool want_gb, detail::LinearForm form) {
  LinearPlan p{};
  p.N = N;
  p.H = H;
  p.V = V;
  p.dtype = dtype;
  p.grad_hidden = job == Job::kForwardBackward && want_gh;
  p.grad_weight = job == Job::kForwardBackward && want_gw;
  p.grad_bias = job == Job::kForwardBackward && want_gb;
  p.grad = p.grad_hidden || p.grad_weight || p.grad_bias;
  p.compact = lo.skip_ignored;
  p.metrics = o.return_metrics;
  p.low_memory = lo.low_memory && p.grad_weight;
  const size_t el = elem_size(dtype);
  const int64_t per16 = static_cast<int64_t>(16 / el);
  p.ld_logits = (V + per16 - 1) / per16 * per16;
  p.window = window_chosen(window_eligible(H, V, dtype, o, lo.low_memory,
                                           dtype == DType::kBFloat16 && cutlass_products_available(device.index)),
                           form, o, p.grad_bias);
  p.win_smooth = p.window && o.label_smoothing != 0.0f;
  // Label smoothing's extra rows of the gradient products' K (window_math::smooth_part): E's
  // after a chunk's rows, the scaled hidden operand's and bf16(r)'s after theirs.
  const int64_t smooth_rows = p.win_smooth && p.grad ? kSmoothRows : 0;
  // Per row of a chunk: its logits, and (compacting) its gathered hidden row and grad_hidden row;
  // in the window form its partials and factors, and the row of the scratch that holds
  // grad_weight's scaled hidden operand, then grad_hidden's float32 product.
  const size_t scratch_row = p.grad_hidden ? size_t(H) * 4 : p.grad_weight ? size_t(H) * 2 : 0;
  const size_t window_row =
      p.window ? size_t(window_tiles(V)) * (p.metrics ? 20 : 8) + 17 + (p.grad_bias ? 2 : 0) + (p.metrics ? 5 : 0) +
                     (smooth_rows ? 4 : 0) + scratch_row
               : 0;
  const size_t row_bytes =
      size_t(p.ld_logits) * el + (p.compact ? size_t(H) * el * (p.grad_hidden ? 2 : 1) : 0) + window_row;
  auto set_chunks = [&](size_t budget) {
    int64_t rows = static_cast<int64_t>(budget / row_bytes);
    // Whole tiles of 128 rows for the products when the rows need several chunks anyway; a
    // budget that holds every row is one chunk (8197 rows must not become 8192 + 5).
    if (rows >= 256 && rows < N) rows = rows / 128 * 128;
    p.chunk_rows = std::max<int64_t>(1, std::min<int64_t>(rows, std::max<int64_t>(N, 1)));
    p.max_chunks = (std::max<int64_t>(N, 1) + p.chunk_rows - 1) / p.chunk_rows;
    p.buffer_bytes = size_t(p.chunk_rows) * p.ld_logits * el;
  };
  const bool acc16 = p.grad_weight && !p.low_memory && dtype != DType::kFloat32;
  const size_t acc_bytes = size_t(V) * H * 4;
  if (lo.chunk_budget_bytes > 0) {
    set_chunks(lo.chunk_budget_bytes);
  } else if (p.low_memory) {
    // The larger buffer when the second pass then needs no slice accumulator, else the smaller
    // one beside the accumulator: under 512 MiB in all either way.
    p.slice_acc_bytes = std::max(kSliceAccBytes, size_t(128) * H * 4);
    set_chunks(kLowMemoryChunkBudget);
    if (dtype != DType::kFloat32 && plan_slices(p, N).acc) set_chunks(kLowMemorySmallChunkBudget);
  } else if (acc16 && size_t(std::max<int64_t>(N, 1)) * row_bytes <= default_chunk_budget(V, H) + acc_bytes) {
    // Every row's logits fit in the default budget plus the float32 accumulator's bytes: one
    // chunk, in that room instead. The products then run at full size, grad_weight is one
    // product over all rows (float32 accumulation inside it, rounded once) and nothing is read
    // back: the same memory bound, less time.
    set_chunks(size_t(std::max<int64_t>(N, 1)) * row_bytes);
  } else {
    set_chunks(default_chunk_budget(V, H));
  }
  p.buffer_bytes += size_t(smooth_rows) * p.ld_logits * el;
  // 16-bit grad_weight over several chunks sums them in a float32 accumulator.
  p.gw_via_acc = acc16 && p.max_chunks > 1;
  // Then the grad_weight output holds nothing until the accumulator is rounded into it after
  // the last chunk, so a logit buffer no larger than it lives there: the call's extra memory is
  // the accumulator alone. (The last chunk's product then cannot round straight into
  // grad_weight: it reads its dlogits from there.)
  p.logits_in_gw = p.gw_via_acc && p.buffer_bytes <= size_t(V) * size_t(H) * el;
  // grad_hidden sums over the vocabulary, which is contiguous in the logits: a V that is not a
  // whole number of 16-byte segments slows cuBLASLt several-fold, and splitting the sum would
  // round a 16-bit grad_hidden twice. So the sum runs over ld_logits columns instead, against a
  // copy of the weight with zero rows appended (and the logits' padding columns zeroed): one
  // product, rounded once, at the cost of the weight's size in memory (not with low_memory,
  // whose bound it would break; float32 splits exactly in the product itself).
  p.pad_weight = p.grad_hidden && !p.low_memory && dtype != DType::kFloat32 && p.ld_logits != V;

  p.ce_options = o;
  p.ce_options.reduction = Reduction::kNone;
  p.ce_options.inplace_backward = p.grad;
  p.ce_options.check_targets = false;

  const int64_t C = p.chunk_rows;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(bytes);
    return here;
  };
  p.gemm_ws = take(kGemmWorkspaceBytes);
  p.slice_acc_bytes = 0;
  if (p.low_memory && dtype != DType::kFloat32) {
    // Reserved only when N positions need more than one token chunk in the second pass.
    p.slice_acc_bytes = std::max(kSliceAccBytes, size_t(128) * H * 4);
    const SlicePlan worst = plan_slices(p, N);
    p.slice_acc_bytes = worst.acc ? std::min(p.slice_acc_bytes, size_t(round_up(V, per16)) * H * 4) : 0;
  }
  p.logits = p.logits_in_gw ? 0 : take(p.buffer_bytes);
  p.ce_ws_bytes = cross_entropy_workspace_size(p.grad ? Job::kForwardBackward : Job::kForward, device, C, V,
                                               p.ce_options);
  p.ce_ws = take(p.ce_ws_bytes);
  p.ones = p.grad_bias ? take(size_t(C) * el) : 0;
  p.gw_acc = p.gw_via_acc ? take(acc_bytes) : 0;
  p.gb_acc = p.grad_bias ? take(size_t(V) * 4) : 0;
  p.eff_target = take(size_t(N) * 8);
  p.idx = take(size_t(N) * 8);
  p.scalars = take(sizeof(Scalars));
  p.target_c = take(size_t(C) * 8);
  // By position (the second pass of low_memory reads them back): upstream gradient and lse.
  p.grad_p = take(size_t(std::max<int64_t>(N, 1)) * 4);
  p.loss_c = take(size_t(C) * 4);
  p.lse_p = take(size_t(std::max<int64_t>(N, 1)) * 4);
  p.row_loss = take(size_t(N) * 4);
  p.chunk_entropy = p.metrics ? take(size_t(p.max_chunks) * 4) : 0;
  p.chunk_correct = p.metrics ? take(size_t(p.max_chunks) * 8) : 0;
  p.hidden_c = p.compact ? take(size_t(C) * H * el) : 0;
  p.gh_c = p.compact && p.grad_hidden ? take(size_t(C) * H * el) : 0;
  p.slice_acc = p.slice_acc_bytes ? take(p.slice_acc_bytes) : 0;
  p.weight_pad = p.pad_weight ? take(size_t(p.ld_logits) * H * el) : 0;
  if (p.window) {
    p.win_sum = take(size_t(C) * window_tiles(V) * 4);
    p.win_offset = take(size_t(C) * window_tiles(V) * 4);
    p.win_r = take(size_t(C) * 4);
    p.win_rescale = take(size_t(C) * 4);
    p.win_r16 = p.grad_bias ? take(size_t(C + smooth_rows) * 2) : 0;
    p.win_kmax = take(size_t(C) * 4);
    p.win_entry = take(size_t(C) * 4);
    p.win_flag = take(size_t(C));
    p.win_scratch = scratch_row ? take(size_t(C) * scratch_row + size_t(smooth_rows) * H * 2) : 0;
    if (p.win_smooth) {
      p.win_svec = take(size_t(H + 1) * 4);
      p.win_partial = take(size_t(ColumnSumParams::kMaxSlices) * (H + 1) * 4);
      p.win_q = smooth_rows ? take(size_t(C) * 4) : 0;
      p.win_u = smooth_rows ? take(size_t(H + 1) * 4) : 0;
    }
    if (p.metrics) {
      p.win_centred = take(size_t(C) * window_tiles(V) * 4);
      p.win_top = take(size_t(C) * window_tiles(V) * 4);
      p.win_top_col = take(size_t(C) * window_tiles(V) * 4);
      p.win_entropy = take(size_t(C) * 4);
      p.win_correct = take(size_t(C));
    }
  }
  p.total = at;
  return p;
}

#define FUSEDCE_TRY(expr)         \
  do {                            \
    Status s_ = (expr);           \
    if (!s_.ok()) return s_;      \
  } while (0)

/// The run of one call over a workspace that fits its plan.
class LinearRun {
 public:
  /// `logits`: the logit buffer (in `ws` or, with plan.logits_in_gw, elsewhere: run_linear).
  LinearRun(const detail::LinearCall& call, const LinearPlan& plan, char* ws, char* logits)
      : c_(call),
        p_(plan),
        ws_(ws),
        logits_(logits),
        stream_(static_cast<cudaStream_t>(call.device.stream)),
        dev_(call.device),
        cutlass_(plan.dtype == DType::kBFloat16 && cutlass_products_available(call.device.index)),
        window_(plan.window) {}

  Status run() {
    if (p_.compact) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      const cudaError_t e = cudaStreamIsCapturing(stream_, &capture);
      if (e != cudaSuccess) return device_error(e, "asking whether the stream is capturing a CUDA graph");
      if (capture == cudaStreamCaptureStatusActive) return run_captured();
    }
    FUSEDCE_TRY(prepare());
    int64_t positions = p_.N;
    if (p_.compact) FUSEDCE_TRY(read_count(&positions));
    if (c_.options.check_targets) FUSEDCE_TRY(check_targets());
    if (p_.grad_bias) {
      launch_fill_ones(at(p_.ones), p_.chunk_rows, p_.dtype, stream_);
      FUSEDCE_TRY(last_error("filling the ones vector"));
    }
    if (p_.pad_weight) FUSEDCE_TRY(pad_weight());
    if (p_.win_smooth) FUSEDCE_TRY(smooth_vector());
    const int64_t step = balanced_rows(positions, p_.chunk_rows);
    int64_t chunk = 0;
    for (int64_t p0 = 0; p0 < positions; p0 += step, ++chunk) {
      FUSEDCE_TRY(run_chunk(p0, std::min(step, positions - p0), chunk, p0 + step >= positions));
    }
    if (p_.low_memory && positions > 0) FUSEDCE_TRY(weight_by_slices(positions));
    return finish(chunk);
  }

 private:
  void* at(size_t offset) const { return ws_ + offset; }
  template <typename T>
  T* at_as(size_t offset) const {
    return reinterpret_cast<T*>(ws_ + offset);
  }
  const char* hidden_row(int64_t row) const {
    return static_cast<const char*>(c_.hidden.data) + size_t(row) * c_.hidden.row_stride * elem_size(p_.dtype);
  }
  Scalars* scalars() const { return at_as<Scalars>(p_.scalars); }

  /// The weight's V rows, then ld_logits - V rows of zeros (plan_linear's pad_weight).
  Status pad_weight() {
    const size_t el = elem_size(p_.dtype), row = size_t(p_.H) * el;
    if (cudaMemcpy2DAsync(at(p_.weight_pad), row, c_.weight.data, size_t(c_.weight.row_stride) * el, row,
                          size_t(p_.V), cudaMemcpyDeviceToDevice, stream_) != cudaSuccess ||
        cudaMemsetAsync(static_cast<char*>(at(p_.weight_pad)) + p_.V * row, 0, size_t(p_.ld_logits - p_.V) * row,
                        stream_) != cudaSuccess) {
      return last_error("padding the weight");
    }
    return Status::Ok();
  }

  /// Label smoothing in the window form: sum_j v_j w_j (H) and sum_j v_j b_j into win_svec, v the
  /// class weights or 1 (the merge's row sums of the logits, grad_hidden's uniform term).
  Status smooth_vector() {
    ColumnSumParams c{};
    c.x = c_.weight.data;
    c.ld = c_.weight.row_stride;
    c.rows = p_.V;
    c.cols = p_.H;
    c.w = static_cast<const float*>(c_.options.class_weight.data);
    c.w_stride = c_.options.class_weight.stride;
    c.last = c_.bias.data;
    c.partial = at_as<float>(p_.win_partial);
    c.slices = static_cast<int>(std::min<int64_t>(ColumnSumParams::kMaxSlices, std::max<int64_t>(p_.V, 1)));
    c.out = at_as<float>(p_.win_svec);
    launch_column_sums(c, stream_);
    return last_error("label smoothing's weight sums");
  }

  Status prepare() {
    LinearPrepareParams q =
        prepare_params(c_.target, p_.N, c_.linear.shift_seq_len, c_.options.ignore_index, p_.V, p_.compact);
    q.class_weight = static_cast<const float*>(c_.options.class_weight.data);
    q.weight_stride = c_.options.class_weight.stride;
    q.eff_target = at_as<int64_t>(p_.eff_target);
    q.idx = at_as<int64_t>(p_.idx);
    q.count = &scalars()->count;
    q.denom = &scalars()->denom;
    q.bad_row = &scalars()->bad_row;
    q.weight_sum = &scalars()->weight_sum;
    launch_linear_prepare(q, stream_);
    FUSEDCE_TRY(last_error("the prepare kernel"));
    if (p_.grad) {
      launch_product_scale(ProductScaleParams{static_cast<const float*>(c_.grad_loss.data),
                                              static_cast<int>(c_.options.reduction), &scalars()->denom,
                                              scalars()->scale},
                           stream_);
      FUSEDCE_TRY(last_error("the product-scale kernel"));
    }
    if (p_.compact) {
      // Rows the products skip keep zeros: their loss, lse and grad_hidden.
      cudaError_t e = cudaMemsetAsync(at(p_.row_loss), 0, size_t(p_.N) * 4, stream_);
      if (e != cudaSuccess) return device_error(e, "clearing the row losses");
      if (c_.out.lse.data) launch_zero_strided(static_cast<float*>(c_.out.lse.data), p_.N, c_.out.lse.stride, stream_);
      if (p_.grad_hidden && p_.N > 0) {
        const MatrixView& g = c_.grads.grad_hidden;
        const size_t el = elem_size(p_.dtype);
        e = cudaMemset2DAsync(g.data, size_t(g.row_stride) * el, 0, size_t(p_.H) * el, size_t(p_.N), stream_);
        if (e != cudaSuccess) return device_error(e, "clearing grad_hidden");
      }
      FUSEDCE_TRY(last_error("clearing the skipped rows"));
    }
    return Status::Ok();
  }

  Status read_count(int64_t* positions) {
    // skip_ignored: the one wait of the call, for the number of rows that enter the products.
    cudaError_t e = cudaMemcpyAsync(positions, &scalars()->count, sizeof(int64_t), cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    return e == cudaSuccess ? Status::Ok() : device_error(e, "reading the count of rows to compute");
  }

  Status check_targets() {
    int64_t bad = INT64_MAX;
    cudaError_t e = cudaMemcpyAsync(&bad, &scalars()->bad_row, sizeof(bad), cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) return device_error(e, "reading the target check");
    if (bad == INT64_MAX) return Status::Ok();
    int64_t value = 0;
    e = cudaMemcpy(&value, at_as<int64_t>(p_.eff_target) + bad, sizeof(value), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) return device_error(e, "reading the bad target");
    std::ostringstream os;
    const int64_t src = c_.linear.shift_seq_len > 0 ? bad + 1 : bad;  // the target entry it came from
    os << "target[" << src << "] = " << value << " is out of range [0, " << p_.V << ") and is not ignore_index ("
       << c_.options.ignore_index << ")";
    return Status(StatusCode::kTargetOutOfRange, os.str());
  }

  /// The last chunk's grad_weight product with a float32 accumulator: where the CUTLASS kernel
  /// runs, accumulator + product rounded once straight into the 16-bit grad_weight (finish then
  /// has no rounding pass to run); else `into_acc` (cuBLASLt) as every other chunk. `alpha`: the
  /// product's factor on the device, as into_acc's scale (null: 1).
  Status last_weight_product(const GemmCall& into_acc, const void* hidden, int64_t ld_hidden, int64_t rows,
                             const float* alpha) {
    if (cutlass_ && !p_.logits_in_gw) {
      const MatrixView& gw = c_.grads.grad_weight;
      RoundedWeightProduct q{};
      q.rows = rows;
      q.V = p_.V;
      q.H = p_.H;
      q.dlogits = logits_;
      q.ld_dlogits = p_.ld_logits;
      q.hidden = hidden;
      q.ld_hidden = ld_hidden;
      q.acc = at_as<float>(p_.gw_acc);
      q.ld_acc = p_.H;
      q.grad_weight = gw.data;
      q.ld_grad_weight = gw.row_stride;
      q.alpha = alpha;
      q.stream = stream_;
      q.device = c_.device.index;
      Status s = run_rounded_weight_product(q);
      if (s.ok()) gw_rounded_ = true;
      if (s.code() != StatusCode::kUnsupported) return s;
    }
    return gemm(into_acc);
  }

  /// The logits product's cuBLASLt preference (algo_choice.h): bf16 only, and not under
  /// low_memory, whose two passes keep cuBLASLt's first candidates so that its second pass
  /// re-forms the logits by the same kind of kernel.
  GemmRole logits_role() const {
    return p_.dtype == DType::kBFloat16 && !p_.low_memory ? GemmRole::kLogits : GemmRole::kAny;
  }
  /// grad_weight's: measured for a bf16 grad_weight written directly (one chunk), not for the
  /// float32 accumulator's products.
  GemmRole grad_weight_role(bool direct) const {
    return p_.dtype == DType::kBFloat16 && direct ? GemmRole::kGradWeight : GemmRole::kAny;
  }

  GemmCall base_gemm() const { return gemm_on(at(p_.gemm_ws), stream_, c_.device.index); }

  /// A chunk's grad_weight product: grad_weight^T (H x V) (+)= hidden (H x rows) . dlogits (rows
  /// x V), times the device scalar alpha (null: 1); straight into grad_weight for float32 or one
  /// chunk, else into the float32 accumulator (the last chunk's by last_weight_product).
  Status weight_product(const GemmOperand& hidden, const GemmOperand& dlogits, int64_t chunk, bool last,
                        const float* alpha) {
    const MatrixView& gw = c_.grads.grad_weight;
    const bool direct = !p_.gw_via_acc;
    GemmCall w = base_gemm();
    w.scale = alpha;
    w.a = hidden;
    w.b = dlogits;
    w.transpose_b = true;
    w.d = direct ? gw.data : at(p_.gw_acc);
    w.d_dtype = direct ? p_.dtype : DType::kFloat32;
    w.m = p_.H;
    w.n = p_.V;
    w.ld_d = direct ? gw.row_stride : p_.H;
    w.beta = chunk == 0 ? 0.0f : 1.0f;
    w.role = grad_weight_role(direct);
    if (last && chunk > 0 && p_.gw_via_acc) return last_weight_product(w, hidden.data, hidden.ld, dlogits.cols, alpha);
    return gemm(w);
  }
  /// A gradient product: base_gemm scaled by the upstream gradient the dlogits do not carry.
  /// A chunk's grad_bias product: the float32 accumulator (V x 1) (+)= dlogits^T (V x rows) . vec
  /// (rows x 1), times the device scalar alpha (null: 1); the first chunk writes it.
  Status bias_product(const GemmOperand& dlogits, const GemmOperand& vec, int64_t chunk, const float* alpha) {
    GemmCall b = base_gemm();
    b.scale = alpha;
    b.a = dlogits;
    b.b = vec;
    b.d = at(p_.gb_acc);
    b.d_dtype = DType::kFloat32;
    b.m = p_.V;
    b.n = 1;
    b.ld_d = p_.V;
    b.beta = chunk == 0 ? 0.0f : 1.0f;
    return gemm(b);
  }

  GemmCall grad_gemm() const {
    GemmCall g = base_gemm();
    g.scale = scalars()->scale;
    return g;
  }

  /// A chunk in the window form (window_forward.h, window_kernels.h), its rows gathered: the
  /// logits product with E and the partials in its epilogue; the merge (loss, lse, each row's
  /// factor r, the target entries); then, with gradients, window_gradients.
  /// `done` false (nothing launched): the product cannot run here, and the call keeps the logits
  /// path from this chunk on.
  Status window_chunk(int64_t p0, int64_t nc, int64_t chunk, bool last, const void* hc, int64_t ldh, bool* done) {
    WindowForward f{};
    f.rows = nc;
    f.V = p_.V;
    f.H = p_.H;
    f.hidden = hc;
    f.ld_hidden = ldh;
    f.weight = c_.weight.data;
    f.ld_weight = c_.weight.row_stride;
    f.scale = c_.options.logit_scale;
    f.softcap = c_.options.softcap;
    f.bias = c_.bias.data;
    f.store_e = p_.grad;
    f.e = logits_;
    f.ld_e = p_.ld_logits;
    f.sum = at_as<float>(p_.win_sum);
    f.offset = at_as<float>(p_.win_offset);
    f.metrics = p_.metrics;
    f.centred = p_.metrics ? at_as<float>(p_.win_centred) : nullptr;
    f.top = p_.metrics ? at_as<float>(p_.win_top) : nullptr;
    f.top_col = p_.metrics ? at_as<int>(p_.win_top_col) : nullptr;
    f.stream = stream_;
    f.device = c_.device.index;
    const Status s = run_window_forward(f);
    if (s.code() == StatusCode::kUnsupported) {
      window_ = false;
      return Status::Ok();
    }
    FUSEDCE_TRY(s);
    *done = true;

    WindowMergeParams m{};
    m.sum = f.sum;
    m.offset = f.offset;
    m.n = nc;
    m.tiles = window_tiles(p_.V);
    m.V = p_.V;
    m.H = p_.H;
    m.hidden = hc;
    m.ld_hidden = ldh;
    m.weight = c_.weight.data;
    m.ld_weight = c_.weight.row_stride;
    m.target = at_as<int64_t>(p_.target_c);
    m.ignore_index = c_.options.ignore_index;
    m.class_weight = static_cast<const float*>(c_.options.class_weight.data);
    m.weight_stride = c_.options.class_weight.stride;
    m.lc = detail::make_loss_constants(c_.options, p_.V, 0.0f);
    m.weight_sum = &scalars()->weight_sum;
    m.smooth = p_.win_smooth ? at_as<float>(p_.win_svec) : nullptr;
    m.q = p_.grad && p_.win_smooth ? at_as<float>(p_.win_q) : nullptr;
    m.bias = c_.bias.data;
    m.r16 = p_.grad_bias ? at(p_.win_r16) : nullptr;
    m.centred = f.centred;
    m.top = f.top;
    m.top_col = f.top_col;
    m.entropy = p_.metrics ? at_as<float>(p_.win_entropy) : nullptr;
    m.correct = p_.metrics ? at_as<uint8_t>(p_.win_correct) : nullptr;
    m.grad = p_.grad ? at_as<float>(p_.grad_p) + p0 : nullptr;
    m.alpha = p_.grad ? &scalars()->scale[0] : nullptr;
    m.e = logits_;
    m.ld_e = p_.ld_logits;
    m.loss = at_as<float>(p_.loss_c);
    m.lse = at_as<float>(p_.lse_p) + p0;
    m.r = at_as<float>(p_.win_r);
    m.rescale = at_as<float>(p_.win_rescale);
    m.kmax = at_as<float>(p_.win_kmax);
    m.target_entry = at_as<float>(p_.win_entry);
    m.rebase = at_as<uint8_t>(p_.win_flag);
    launch_window_merge(m, stream_);
    FUSEDCE_TRY(last_error("the window merge kernel"));
    if (p_.metrics) {
      launch_window_metrics(WindowMetricsParams{m.entropy, m.correct, nc, at_as<float>(p_.chunk_entropy) + chunk,
                                                at_as<int64_t>(p_.chunk_correct) + chunk},
                            stream_);
      FUSEDCE_TRY(last_error("the window metrics kernel"));
    }
    if (!p_.grad) return Status::Ok();
    return window_gradients(p0, nc, chunk, last, hc, ldh, m);
  }

  /// The window form's gradients of a chunk after its merge `m`: the rebase of the flagged rows,
  /// label smoothing's extra rows, grad_weight (+)= E^T bf16(r h), grad_hidden = bf16(r (E W)) and
  /// grad_bias (+)= E^T bf16(r), the rows' factor riding the hidden operand and the float32
  /// product respectively, so that no pass forms dlogits.
  Status window_gradients(int64_t p0, int64_t nc, int64_t chunk, bool last, const void* hc, int64_t ldh,
                          const WindowMergeParams& m) {
    const DType d = p_.dtype;
    const size_t el = elem_size(d);
    WindowRebaseParams rb{};
    rb.e = logits_;
    rb.ld_e = p_.ld_logits;
    rb.n = nc;
    rb.V = p_.V;
    rb.tiles = m.tiles;
    rb.offset = m.offset;
    rb.kmax = m.kmax;
    rb.rescale = m.rescale;
    rb.rebase = m.rebase;
    rb.target = m.target;
    rb.target_entry = m.target_entry;
    launch_window_rebase(rb, stream_);
    FUSEDCE_TRY(last_error("the window rebase kernel"));

    void* scratch = at(p_.win_scratch);
    const GemmOperand weight_op{c_.weight.data, d, p_.H, p_.V, c_.weight.row_stride};  // H x V
    const GemmOperand e_op{logits_, d, p_.V, nc, p_.ld_logits};                       // V x nc
    // Label smoothing: grad_weight's and grad_bias's products run over ks more rows of K.
    const int64_t ks = p_.win_smooth ? kSmoothRows : 0;
    if (ks != 0 && (p_.grad_weight || p_.grad_bias)) FUSEDCE_TRY(smooth_extra_rows(nc, hc, ldh, m, scratch));
    const GemmOperand e_k{logits_, d, p_.V, nc + ks, p_.ld_logits};  // V x (nc + ks)
    if (p_.grad_weight) {
      // hidden' (nc x H, dense) = bf16(r h): the rows' factor on the other operand
      RowScaleParams hs{hc, false, ldh, m.r, scratch, p_.H, nc, p_.H, nullptr, nullptr};
      launch_row_scale(hs, stream_);
      FUSEDCE_TRY(last_error("scaling the hidden rows"));
      // grad_weight^T (H x V) (+)= hidden' (H x (nc + ks)) . E ((nc + ks) x V), alpha 1 (r rides
      // hidden')
      FUSEDCE_TRY(weight_product(GemmOperand{scratch, d, p_.H, nc + ks, p_.H}, e_k, chunk, last, nullptr));
    }
    if (p_.grad_hidden) {
      // (E W)^T (H x nc, float32) = weight (H x V) . E^T (V x nc), over ld_logits columns where
      // the weight is padded (E's padding columns zeroed), then bf16(r .) into grad_hidden
      GemmCall h = base_gemm();
      h.a = weight_op;
      h.b = e_op;
      if (p_.pad_weight) {
        if (cudaMemset2DAsync(static_cast<char*>(logits_) + p_.V * el, size_t(p_.ld_logits) * el, 0,
                              size_t(p_.ld_logits - p_.V) * el, size_t(nc), stream_) != cudaSuccess) {
          return last_error("zeroing E's padding");
        }
        h.a = GemmOperand{at(p_.weight_pad), d, p_.H, p_.ld_logits, p_.H};
        h.b = GemmOperand{logits_, d, p_.ld_logits, nc, p_.ld_logits};
      }
      h.d = scratch;
      h.d_dtype = DType::kFloat32;
      h.m = p_.H;
      h.n = nc;
      h.ld_d = p_.H;
      FUSEDCE_TRY(gemm(h));
      const MatrixView& gh = c_.grads.grad_hidden;
      void* out = p_.compact ? at(p_.gh_c) : static_cast<char*>(gh.data) + size_t(p0) * gh.row_stride * el;
      RowScaleParams rs{scratch, true, p_.H, m.r, out, p_.compact ? p_.H : gh.row_stride, nc, p_.H, m.q,
                        p_.win_smooth ? at_as<float>(p_.win_svec) : nullptr};
      launch_row_scale(rs, stream_);
      FUSEDCE_TRY(last_error("scaling grad_hidden's rows"));
    }
    if (p_.grad_bias) {
      // grad_bias (+)= E^T bf16(r): the column sums of the dlogits (alpha 1: r carries the
      // mean's scale)
      FUSEDCE_TRY(bias_product(e_k, GemmOperand{m.r16, d, nc + ks, 1, nc + ks}, chunk, nullptr));
    }
    return Status::Ok();
  }

  /// Label smoothing's kSmoothRows extra rows of the gradient products' K (window_math::smooth_part)
  /// after a chunk's nc rows: E's hold v's parts, the scaled hidden operand's (in `scratch`) those
  /// of u = sum_i q_i h_i, bf16(r)'s those of sum_i q_i.
  Status smooth_extra_rows(int64_t nc, const void* hc, int64_t ldh, const WindowMergeParams& m, void* scratch) {
    const size_t el = elem_size(p_.dtype);
    ColumnSumParams u{};
    u.x = hc;
    u.ld = ldh;
    u.rows = nc;
    u.cols = p_.H;
    u.w = m.q;
    u.w_stride = 1;
    u.last_ones = true;
    u.partial = at_as<float>(p_.win_partial);
    u.slices = static_cast<int>(std::min<int64_t>(ColumnSumParams::kMaxSlices, nc));
    u.out = at_as<float>(p_.win_u);
    u.split = p_.grad_weight ? static_cast<char*>(scratch) + size_t(nc) * p_.H * el : nullptr;
    u.ld_split = p_.H;
    u.split_last = p_.grad_bias ? static_cast<char*>(m.r16) + size_t(nc) * el : nullptr;
    launch_column_sums(u, stream_);
    FUSEDCE_TRY(last_error("label smoothing's row sums"));
    launch_smooth_rows(SmoothRowsParams{static_cast<char*>(logits_) + size_t(nc) * p_.ld_logits * el, p_.ld_logits,
                                        p_.V, m.class_weight, m.weight_stride},
                       stream_);
    return last_error("label smoothing's rows of E");
  }

  Status run_chunk(int64_t p0, int64_t nc, int64_t chunk, bool last) {
    const DType d = p_.dtype;
    const size_t el = elem_size(d);
    // Targets, upstream gradients and (compacting) the hidden rows of the chunk's positions.
    LinearGatherParams gq{};
    gq.eff_target = at_as<int64_t>(p_.eff_target);
    gq.idx = at_as<int64_t>(p_.idx);
    gq.p0 = p0;
    gq.n = nc;
    gq.grad_loss = static_cast<const float*>(c_.grad_loss.data);
    gq.grad_stride = c_.grad_loss.stride;
    gq.reduction = static_cast<int>(c_.options.reduction);
    gq.row_grad = &scalars()->scale[3];
    gq.hidden = c_.hidden.data;
    gq.hidden_stride = c_.hidden.row_stride;
    gq.H = p_.H;
    gq.dtype = d;
    gq.target_out = at_as<int64_t>(p_.target_c);
    gq.grad_out = p_.grad ? at_as<float>(p_.grad_p) + p0 : nullptr;
    gq.hidden_out = p_.compact ? at(p_.hidden_c) : nullptr;
    gq.count = padded_ ? &scalars()->count : nullptr;
    gq.ignore_index = c_.options.ignore_index;
    launch_linear_gather(gq, stream_);
    FUSEDCE_TRY(last_error("the gather kernel"));

    const void* hc = p_.compact ? at(p_.hidden_c) : hidden_row(p0);
    const int64_t ldh = p_.compact ? p_.H : c_.hidden.row_stride;
    if (window_) {
      bool done = false;
      FUSEDCE_TRY(window_chunk(p0, nc, chunk, last, hc, ldh, &done));
      if (done) return scatter(p0, nc);
    }
    const GemmOperand hidden_op{hc, d, p_.H, nc, ldh};                           // H x nc
    const GemmOperand weight_op{c_.weight.data, d, p_.H, p_.V, c_.weight.row_stride};  // H x V
    void* logits = logits_;
    const GemmOperand dlogits_op{logits, d, p_.V, nc, p_.ld_logits};             // V x nc

    // 1. logits^T (V x nc) = weight (H x V)^T . hidden_c (H x nc) (+ bias)
    GemmCall g = base_gemm();
    g.a = weight_op;
    g.transpose_a = true;
    g.b = hidden_op;
    g.d = logits;
    g.d_dtype = d;
    g.m = p_.V;
    g.n = nc;
    g.ld_d = p_.ld_logits;
    // low_memory adds the bias in a pass of its own, rounding as the second pass does; the
    // products' epilogues may round differently from one kernel to another, and the second pass
    // must see the very logits whose lse this pass saves (an lse one bf16 unit off a dominant
    // logit would move that class's probability by up to 6%).
    g.bias = p_.low_memory ? nullptr : c_.bias.data;
    g.bias_dtype = d;
    g.role = logits_role();
    FUSEDCE_TRY(gemm(g));
    if (p_.low_memory && c_.bias.data) {
      launch_add_bias(logits, p_.ld_logits, nc, p_.V, c_.bias.data, d, stream_);
      FUSEDCE_TRY(last_error("adding the bias"));
    }

    // 2. the cross-entropy sweep over the chunk; dlogits in place
    const MatrixView L = matrix(logits, d, nc, p_.V, p_.ld_logits);
    const VectorView t = vector(at(p_.target_c), DType::kInt64, nc);
    ForwardOutputs out;
    out.loss = vector(at(p_.loss_c), DType::kFloat32, nc);
    out.lse = vector(at_as<float>(p_.lse_p) + p0, DType::kFloat32, nc);
    if (p_.metrics) {
      out.entropy_sum = vector(at_as<float>(p_.chunk_entropy) + chunk, DType::kFloat32, 1);
      out.num_correct = vector(at_as<int64_t>(p_.chunk_correct) + chunk, DType::kInt64, 1);
    }
    const Workspace ce_ws{at(p_.ce_ws), p_.ce_ws_bytes};
    if (p_.grad) {
      FUSEDCE_TRY(cross_entropy_forward_backward(dev_, L, t, p_.ce_options, out,
                                                 vector(at_as<float>(p_.grad_p) + p0, DType::kFloat32, nc), L, ce_ws));
    } else {
      FUSEDCE_TRY(cross_entropy_forward(dev_, L, t, p_.ce_options, out, ce_ws));
    }

    // 3. gradients of the chunk
    if (p_.grad_hidden) {
      // grad_hidden_c^T (H x nc) = weight (H x V) . dlogits^T (V x nc)
      const MatrixView& gh = c_.grads.grad_hidden;
      GemmCall h = grad_gemm();
      h.a = weight_op;
      h.b = dlogits_op;
      if (p_.pad_weight) {  // over ld_logits columns: the padding's logits zeroed, its weight rows 0
        const size_t el = elem_size(d);
        if (cudaMemset2DAsync(static_cast<char*>(logits) + p_.V * el, size_t(p_.ld_logits) * el, 0,
                              size_t(p_.ld_logits - p_.V) * el, size_t(nc), stream_) != cudaSuccess) {
          return last_error("zeroing the logits' padding");
        }
        h.a = GemmOperand{at(p_.weight_pad), d, p_.H, p_.ld_logits, p_.H};
        h.b = GemmOperand{logits, d, p_.ld_logits, nc, p_.ld_logits};
      }
      h.d = p_.compact ? at(p_.gh_c) : static_cast<char*>(gh.data) + size_t(p0) * gh.row_stride * el;
      h.d_dtype = d;
      h.m = p_.H;
      h.n = nc;
      h.ld_d = p_.compact ? p_.H : gh.row_stride;
      FUSEDCE_TRY(gemm(h));
    }
    if (p_.grad_weight && !p_.low_memory) {
      // grad_weight^T (H x V) (+)= hidden_c (H x nc) . dlogits (nc x V)
      FUSEDCE_TRY(weight_product(hidden_op, dlogits_op, chunk, last, scalars()->scale));
    }
    if (p_.grad_bias) {
      // grad_bias (+)= dlogits^T ones, times the products' alpha
      FUSEDCE_TRY(bias_product(dlogits_op, GemmOperand{at(p_.ones), d, nc, 1, nc}, chunk, scalars()->scale));
    }

    return scatter(p0, nc);
  }

  /// The results of the chunk of positions [p0, p0 + nc) back to their rows.
  Status scatter(int64_t p0, int64_t nc) {
    const DType d = p_.dtype;
    LinearScatterParams sq{};
    sq.idx = at_as<int64_t>(p_.idx);
    sq.p0 = p0;
    sq.n = nc;
    sq.lse_in = at_as<float>(p_.lse_p) + p0;
    sq.lse_out = static_cast<float*>(c_.out.lse.data);
    sq.lse_stride = c_.out.lse.stride;
    sq.loss_in = at_as<float>(p_.loss_c);
    sq.row_loss = at_as<float>(p_.row_loss);
    sq.gh_in = p_.compact && p_.grad_hidden ? at(p_.gh_c) : nullptr;
    sq.gh_out = c_.grads.grad_hidden.data;
    sq.gh_stride = c_.grads.grad_hidden.row_stride;
    sq.H = p_.H;
    sq.dtype = d;
    sq.count = padded_ ? &scalars()->count : nullptr;
    launch_linear_scatter(sq, stream_);
    return last_error("the scatter kernel");
  }

  /// low_memory's second pass (see the top of the file): grad_weight slice by slice.
  Status weight_by_slices(int64_t positions) {
    const DType d = p_.dtype;
    const size_t el = elem_size(d);
    const SlicePlan sp = plan_slices(p_, positions);
    const MatrixView& gw = c_.grads.grad_weight;
    char* buffer = static_cast<char*>(logits_);
    void* hidden_buf = buffer;               // gathered hidden rows (skip_ignored)
    void* logits = buffer + sp.hidden;       // (rows, ld) logits, then dlogits, of a slice
    const bool one_chunk = sp.rows >= positions;
    if (p_.compact && one_chunk) FUSEDCE_TRY(gather_hidden(0, positions, hidden_buf));
    for (int64_t v0 = 0; v0 < p_.V; v0 += sp.vocab) {
      const int64_t vs = std::min(sp.vocab, p_.V - v0);
      const bool via_acc = sp.acc && d != DType::kFloat32;
      for (int64_t q0 = 0; q0 < positions; q0 += sp.rows) {
        const int64_t nr = std::min(sp.rows, positions - q0);
        if (p_.compact && !one_chunk) FUSEDCE_TRY(gather_hidden(q0, nr, hidden_buf));
        const void* hc = p_.compact ? hidden_buf : hidden_row(q0);
        const int64_t ldh = p_.compact ? p_.H : c_.hidden.row_stride;
        const GemmOperand hidden_op{hc, d, p_.H, nr, ldh};
        const char* wslice = static_cast<const char*>(c_.weight.data) + size_t(v0) * c_.weight.row_stride * el;

        // logits^T (vs x nr) = weight_slice (H x vs)^T . hidden (H x nr)
        GemmCall g = base_gemm();
        g.a = GemmOperand{wslice, d, p_.H, vs, c_.weight.row_stride};
        g.transpose_a = true;
        g.b = hidden_op;
        g.d = logits;
        g.d_dtype = d;
        g.m = vs;
        g.n = nr;
        g.ld_d = sp.ld;
        FUSEDCE_TRY(gemm(g));  // the bias is added by the slice kernel, as the first pass did

        LinearSliceGradParams q{};
        q.logits = logits;
        q.ld = sp.ld;
        q.n = nr;
        q.cols = vs;
        q.v0 = v0;
        q.p0 = q0;
        q.eff_target = at_as<int64_t>(p_.eff_target);
        q.idx = at_as<int64_t>(p_.idx);
        q.bias = c_.bias.data;
        q.lse = at_as<float>(p_.lse_p);
        q.grad = at_as<float>(p_.grad_p);
        q.class_weight = static_cast<const float*>(c_.options.class_weight.data);
        q.weight_stride = c_.options.class_weight.stride;
        q.weight_sum = &scalars()->weight_sum;
        q.c = detail::make_loss_constants(c_.options, p_.V, 0.0f);
        q.softcap = c_.options.softcap > 0.0f;
        q.ignore_index = c_.options.ignore_index;
        q.vocab = p_.V;
        q.dtype = d;
        launch_linear_slice_grad(q, stream_);
        FUSEDCE_TRY(last_error("the slice gradient kernel"));

        // grad_weight_slice^T (H x vs) (+)= hidden (H x nr) . dlogits (nr x vs)
        GemmCall w = grad_gemm();
        w.a = hidden_op;
        w.b = GemmOperand{logits, d, vs, nr, sp.ld};
        w.transpose_b = true;
        w.m = p_.H;
        w.n = vs;
        w.beta = q0 == 0 ? 0.0f : 1.0f;
        if (via_acc) {
          w.d = at(p_.slice_acc);
          w.d_dtype = DType::kFloat32;
          w.ld_d = p_.H;
        } else {  // float32 output, or one token chunk: straight into grad_weight, rounded once
          w.d = static_cast<char*>(gw.data) + size_t(v0) * gw.row_stride * el;
          w.d_dtype = d;
          w.ld_d = gw.row_stride;
        }
        FUSEDCE_TRY(gemm(w));
      }
      if (via_acc) {
        char* dst = static_cast<char*>(gw.data) + size_t(v0) * gw.row_stride * el;
        launch_convert(ConvertParams{at_as<float>(p_.slice_acc), dst, vs, p_.H, gw.row_stride, d}, stream_);
        FUSEDCE_TRY(last_error("rounding a grad_weight slice"));
      }
    }
    return Status::Ok();
  }

  /// The hidden rows of positions [q0, q0 + n), dense, for the second pass (skip_ignored).
  Status gather_hidden(int64_t q0, int64_t n, void* dst) {
    LinearGatherParams gq{};
    gq.eff_target = at_as<int64_t>(p_.eff_target);
    gq.idx = at_as<int64_t>(p_.idx);
    gq.p0 = q0;
    gq.n = n;
    gq.hidden = c_.hidden.data;
    gq.hidden_stride = c_.hidden.row_stride;
    gq.H = p_.H;
    gq.dtype = p_.dtype;
    gq.hidden_out = dst;
    launch_linear_gather(gq, stream_);
    return last_error("gathering hidden rows");
  }

  Status finish(int64_t chunks) {
    if (chunks == 0) {
      FUSEDCE_TRY(clear_unwritten_sums());
      if (p_.metrics) {
        cudaError_t e = cudaMemsetAsync(at(p_.chunk_entropy), 0, 4, stream_);
        if (e == cudaSuccess) e = cudaMemsetAsync(at(p_.chunk_correct), 0, 8, stream_);
        if (e != cudaSuccess) return device_error(e, "clearing the metrics");
      }
      if (!p_.compact && p_.N > 0) return Status(StatusCode::kDeviceError, "internal: rows but no chunk");
    }
    FUSEDCE_TRY(reduce_rows(std::max<int64_t>(chunks, 1)));
    if (chunks > 0 && !gw_rounded_) FUSEDCE_TRY(round_grad_weight());
    return round_grad_bias();
  }

  /// No row entered a product: zero gradients (the accumulators were never written).
  Status clear_unwritten_sums() {
    const size_t el = elem_size(p_.dtype);
    if (p_.grad_weight) {
      const MatrixView& gw = c_.grads.grad_weight;
      cudaError_t e = cudaMemset2DAsync(gw.data, size_t(gw.row_stride) * el, 0, size_t(p_.H) * el, size_t(p_.V), stream_);
      if (e != cudaSuccess) return device_error(e, "clearing grad_weight");
    }
    if (p_.grad_bias) {
      cudaError_t e = cudaMemsetAsync(at(p_.gb_acc), 0, size_t(p_.V) * 4, stream_);
      if (e != cudaSuccess) return device_error(e, "clearing grad_bias");
    }
    return Status::Ok();
  }

  /// The loss over the rows (in row order) and the metric sums over `chunks` chunk partials.
  Status reduce_rows(int64_t chunks) {
    LinearFinishParams f{};
    f.row_loss = at_as<float>(p_.row_loss);
    f.rows = p_.N;
    f.reduction = static_cast<int>(c_.options.reduction);
    f.denom = &scalars()->denom;
    f.loss_out = static_cast<float*>(c_.out.loss.data);
    f.loss_stride = c_.out.loss.stride;
    if (p_.metrics) {
      f.chunk_entropy = at_as<float>(p_.chunk_entropy);
      f.chunk_correct = at_as<int64_t>(p_.chunk_correct);
      f.chunks = chunks;
      f.entropy_out = static_cast<float*>(c_.out.entropy_sum.data);
      f.correct_out = static_cast<int64_t*>(c_.out.num_correct.data);
    }
    launch_linear_finish(f, stream_);
    return last_error("the finish kernel");
  }

  /// 16-bit grad_weight from its float32 accumulator (nothing to do without one).
  Status round_grad_weight() {
    if (!p_.gw_via_acc) return Status::Ok();
    const MatrixView& gw = c_.grads.grad_weight;
    launch_convert(ConvertParams{at_as<float>(p_.gw_acc), gw.data, p_.V, p_.H, gw.row_stride, p_.dtype}, stream_);
    return last_error("rounding grad_weight");
  }

  Status round_grad_bias() {
    if (!p_.grad_bias) return Status::Ok();
    const VectorView& gb = c_.grads.grad_bias;
    // A (V,) vector with stride s is a (V, 1) matrix with row stride s.
    launch_convert(ConvertParams{at_as<float>(p_.gb_acc), gb.data, p_.V, 1, gb.stride, p_.dtype}, stream_);
    return last_error("rounding grad_bias");
  }

  // ---- skip_ignored under CUDA graph capture (see the top of the file) ----

  Status run_captured() {
    if (c_.options.check_targets) {
      return Status(StatusCode::kInvalidArgument,
                    "check_targets: reading the target check back needs a host sync, which CUDA graph capture "
                    "forbids; check the targets before capturing, or capture without check_targets");
    }
    if (p_.low_memory) {
      return Status(StatusCode::kUnsupported,
                    "skip_ignored with low_memory under CUDA graph capture: the vocabulary-sliced grad_weight pass "
                    "is sized on the host; capture without one of them");
    }
#if FUSEDCE_GRAPH_SWITCH
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver < 12080) {
      (void)cudaGetLastError();
      return Status(StatusCode::kUnsupported,
                    "skip_ignored under CUDA graph capture needs conditional (SWITCH) graph nodes: a CUDA 12.8+ "
                    "driver (this one reports " + std::to_string(driver) + ")");
    }
    FUSEDCE_TRY(body_stream(c_.device.index, &body_stream_));
    padded_ = true;
    FUSEDCE_TRY(prepare());
    if (p_.grad_bias) {
      launch_fill_ones(at(p_.ones), p_.chunk_rows, p_.dtype, stream_);
      FUSEDCE_TRY(last_error("filling the ones vector"));
    }
    if (p_.pad_weight) FUSEDCE_TRY(pad_weight());
    if (p_.win_smooth) FUSEDCE_TRY(smooth_vector());
    // Chunks that do not run leave zero metric partials; finish sums every planned chunk's.
    const int64_t step = balanced_rows(std::max<int64_t>(p_.N, 1), p_.chunk_rows);
    const int64_t chunks = p_.N > 0 ? (p_.N + step - 1) / step : 0;
    if (p_.metrics) {
      cudaError_t e = cudaMemsetAsync(at(p_.chunk_entropy), 0, size_t(p_.max_chunks) * 4, stream_);
      if (e == cudaSuccess) e = cudaMemsetAsync(at(p_.chunk_correct), 0, size_t(p_.max_chunks) * 8, stream_);
      if (e != cudaSuccess) return device_error(e, "clearing the metric partials");
    }
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t p0 = chunk * step, capacity = std::min(step, p_.N - p0);
      const SizeLadder ladder = size_ladder(capacity);
      LinearBranchParams q{};
      q.count = &scalars()->count;
      q.kind = LinearBranchParams::kChunk;
      q.p0 = p0;
      q.capacity = capacity;
      q.rungs = ladder.rungs;
      for (int r = 0; r < ladder.rungs; ++r) q.size[r] = ladder.size[r];
      // Branch r < rungs: the chunk holds the last valid row, at rung r's rows; branch rungs:
      // full, and later chunks follow (the same bodies the synced path runs for those rows).
      FUSEDCE_TRY(add_switch(q, static_cast<unsigned>(ladder.rungs + 1), [&](unsigned b) {
        const bool full = b == static_cast<unsigned>(ladder.rungs);
        return run_chunk(p0, full ? capacity : ladder.size[b], chunk, !full);
      }));
    }
    // As finish(), on the device's count: 0 valid rows: the sums the products never wrote are
    // cleared; rows in the first chunk only: its product left grad_weight in the accumulator;
    // more: the last chunk's product rounded it itself where gw_rounded_ says so.
    LinearBranchParams q{};
    q.count = &scalars()->count;
    q.kind = LinearBranchParams::kFinish;
    q.capacity = step;
    const bool rounded_by_last = gw_rounded_;
    FUSEDCE_TRY(add_switch(q, 3, [&](unsigned b) {
      if (b == 0) return clear_unwritten_sums();
      if (b == 1 || !rounded_by_last) return round_grad_weight();
      return Status::Ok();
    }));
    FUSEDCE_TRY(reduce_rows(std::max<int64_t>(chunks, 1)));
    return round_grad_bias();
#else
    return Status(StatusCode::kUnsupported,
                  "skip_ignored under CUDA graph capture needs conditional (SWITCH) graph nodes, which this build "
                  "lacks (CUDA 12.8+ toolkit)");
#endif
  }

#if FUSEDCE_GRAPH_SWITCH
  /// The stream that captures the bodies of conditional nodes: one per thread and device, made
  /// on first use (in relaxed capture mode: creating a stream is not a stream operation, but a
  /// global-mode capture elsewhere would refuse it otherwise) and kept for the thread's life.
  static Status body_stream(int device, cudaStream_t* out) {
    struct Streams {
      std::map<int, cudaStream_t> by_device;
      ~Streams() {
        for (auto& s : by_device) (void)cudaStreamDestroy(s.second);
      }
    };
    thread_local Streams streams;
    auto it = streams.by_device.find(device);
    if (it != streams.by_device.end()) {
      *out = it->second;
      return Status::Ok();
    }
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode);
    if (e != cudaSuccess) return device_error(e, "relaxing the capture mode");
    cudaStream_t s = nullptr;
    e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    const cudaError_t back = cudaThreadExchangeStreamCaptureMode(&mode);
    if (e != cudaSuccess) return device_error(e, "creating the stream that captures conditional bodies");
    if (back != cudaSuccess) return device_error(back, "restoring the capture mode");
    streams.by_device[device] = s;
    *out = s;
    return Status::Ok();
  }

  /// The capture's graph and its current dependencies on `stream`.
  struct CaptureTail {
    cudaGraph_t graph = nullptr;
    const cudaGraphNode_t* deps = nullptr;
    const cudaGraphEdgeData* edges = nullptr;
    size_t count = 0;
  };
  static cudaError_t capture_tail(cudaStream_t stream, CaptureTail* t) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaStreamGetCaptureInfo(stream, &status, nullptr, &t->graph, &t->deps, &t->edges, &t->count);
#else
    cudaError_t e = cudaStreamGetCaptureInfo_v3(stream, &status, nullptr, &t->graph, &t->deps, &t->edges, &t->count);
#endif
    if (e == cudaSuccess && status != cudaStreamCaptureStatusActive) e = cudaErrorStreamCaptureInvalidated;
    return e;
  }

  /// Adds to the capture on stream_ a tiny kernel that sets a SWITCH condition from the device's
  /// count (q), then the SWITCH node with `branches` bodies, body b captured from what
  /// `body(b)` enqueues on the body stream; the caller's stream continues after the node.
  /// A body that fails ends its capture before the error is returned.
  template <typename Body>
  Status add_switch(LinearBranchParams q, unsigned branches, Body&& body) {
    CaptureTail tail;
    cudaError_t e = capture_tail(stream_, &tail);
    if (e != cudaSuccess) return device_error(e, "reading the stream's capture");
    e = cudaGraphConditionalHandleCreate(&q.handle, tail.graph, 0, 0);
    if (e != cudaSuccess) return device_error(e, "creating a conditional handle");
    launch_linear_branch(q, stream_);
    FUSEDCE_TRY(last_error("the branch kernel"));
    e = capture_tail(stream_, &tail);
    if (e != cudaSuccess) return device_error(e, "reading the stream's capture");
    cudaGraphNodeParams np{};
    np.type = cudaGraphNodeTypeConditional;
    np.conditional.handle = q.handle;
    np.conditional.type = cudaGraphCondTypeSwitch;
    np.conditional.size = branches;
    cudaGraphNode_t node = nullptr;
#if CUDART_VERSION >= 13000
    e = cudaGraphAddNode(&node, tail.graph, tail.deps, tail.edges, tail.count, &np);
#else
    e = cudaGraphAddNode_v2(&node, tail.graph, tail.deps, tail.edges, tail.count, &np);
#endif
    if (e != cudaSuccess) return device_error(e, "adding a conditional node");
    const cudaStream_t outer = stream_;
    for (unsigned b = 0; b < branches; ++b) {
      e = cudaStreamBeginCaptureToGraph(body_stream_, np.conditional.phGraph_out[b], nullptr, nullptr, 0,
                                        cudaStreamCaptureModeRelaxed);
      if (e != cudaSuccess) return device_error(e, "capturing a conditional body");
      stream_ = body_stream_;
      dev_.stream = body_stream_;
      const Status s = body(b);
      stream_ = outer;
      dev_.stream = outer;
      cudaGraph_t captured = nullptr;
      e = cudaStreamEndCapture(body_stream_, &captured);
      if (!s.ok()) return s;
      if (e != cudaSuccess) return device_error(e, "ending the capture of a conditional body");
    }
#if CUDART_VERSION >= 13000
    e = cudaStreamUpdateCaptureDependencies(stream_, &node, nullptr, 1, cudaStreamSetCaptureDependencies);
#else
    e = cudaStreamUpdateCaptureDependencies_v2(stream_, &node, nullptr, 1, cudaStreamSetCaptureDependencies);
#endif
    return e == cudaSuccess ? Status::Ok() : device_error(e, "continuing the capture after a conditional node");
  }
#endif

  const detail::LinearCall& c_;
  const LinearPlan& p_;
  char* ws_;
  char* const logits_;        // the logit buffer
  cudaStream_t stream_;       // where work is enqueued: the caller's, or a conditional body's
  Device dev_;                // the caller's device with stream_ (the cross-entropy calls')
  cudaStream_t body_stream_ = nullptr;
  bool padded_ = false;       // chunks at rungs of the size ladder: gather / scatter read the count
  const bool cutlass_;       // bfloat16 on a GPU the CUTLASS product runs on
  bool window_;              // the window form (off for the rest of the call where it cannot run)
  bool gw_rounded_ = false;  // the last product wrote the 16-bit grad_weight itself
};

LinearPlan plan_for(const detail::LinearCall& c) {
  return plan_linear(c.job, c.device, c.hidden.rows, c.hidden.cols, c.weight.rows, c.hidden.dtype, c.options,
                     c.linear, c.grads.grad_hidden.data != nullptr, c.grads.grad_weight.data != nullptr,
                     c.grads.grad_bias.data != nullptr, c.form);
}

}  // namespace

size_t linear_workspace_size(Job job, const Device& device, int64_t rows, int64_t hidden_size, int64_t vocab,
                             DType dtype, const Options& options, const LinearOptions& linear,
                             const LinearGrads& grads, detail::LinearForm form) {
  return plan_linear(job, device, rows, hidden_size, vocab, dtype, options, linear, !grads.grad_hidden.empty(),
                     !grads.grad_weight.empty(), !grads.grad_bias.empty(), form)
      .total;
}

namespace {

/// Runs the plan on workspace `ws`. A plan whose logit buffer borrows grad_weight needs the
/// output dense (rows of H) and aligned as a workspace region; the size query cannot see the
/// output, so another layout gets the buffer as stream-ordered scratch of its own.
Status run_on(const detail::LinearCall& call, const LinearPlan& plan, char* ws) {
  if (!plan.logits_in_gw) return LinearRun(call, plan, ws, ws + plan.logits).run();
  const MatrixView& gw = call.grads.grad_weight;
  if (gw.row_stride == plan.H && reinterpret_cast<uintptr_t>(gw.data) % kWorkspaceAlign == 0) {
    return LinearRun(call, plan, ws, static_cast<char*>(gw.data)).run();
  }
  return with_workspace(plan.buffer_bytes, static_cast<cudaStream_t>(call.device.stream),
                        [&](char* buffer) { return LinearRun(call, plan, ws, buffer).run(); });
}

}  // namespace

Status run_linear(const detail::LinearCall& call) {
  if (call.weight.rows >= (int64_t(1) << 31) - 64) {
    return Status(StatusCode::kInvalidArgument, "weight: the CUDA backend takes V < 2^31 - 64 rows");
  }
  if (call.bias.data != nullptr && call.bias.size > 1 && call.bias.stride != 1) {
    // cuBLASLt's bias epilogue reads a dense vector.
    return Status(StatusCode::kInvalidArgument, "bias: the CUDA backend needs stride 1, got " + std::to_string(call.bias.stride));
  }
  DeviceGuard guard(call.device.index);
  (void)cudaGetLastError();  // an earlier, unrelated error must not be reported as ours
  const LinearPlan plan = plan_for(call);
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  char* ws = static_cast<char*>(call.workspace.data);
  if (ws == nullptr) {
    // No workspace given: stream-ordered scratch for the call (no host sync, graph-capturable).
    return with_workspace(plan.total, stream, [&](char* scratch) { return run_on(call, plan, scratch); });
  }
  if (call.workspace.bytes < plan.total) {
    std::ostringstream os;
    os << "workspace has " << call.workspace.bytes << " bytes, this call needs " << plan.total
       << " (ask linear_cross_entropy_workspace_size)";
    return Status(StatusCode::kWorkspaceTooSmall, os.str());
  }
  return run_on(call, plan, ws);
}

}  // namespace cuda
}  // namespace fusedce
