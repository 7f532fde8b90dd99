// fusedce: fused linear cross-entropy (docs/contract.md, "Fused linear cross-entropy"): the loss of
// logits = hidden @ weight.T (+ bias) without ever storing the (N, V) logits, and its gradients
// for hidden, weight and bias. Same conventions as cross_entropy.h: one validating entry point
// per job, a Status naming any bad argument, the device handle choosing the backend.
#pragma once

#include "fusedce/cross_entropy.h"
#include "fusedce/types.h"

namespace fusedce {

/// Options that only the linear form has.
struct LinearOptions {
  /// > 0: causal shift inside sequences of this many rows: row i predicts target[i + 1], and the
  /// last row of each sequence (i % shift_seq_len == shift_seq_len - 1) is ignored. hidden and
  /// target keep their (N, ...) shapes: nothing is copied. 0 = no shift.
  int64_t shift_seq_len = 0;
  /// Scratch for logit tiles and their gradients (bytes); 0 = the backend's default. On CUDA the
  /// default is the larger of 448 MiB and a float32 copy of the weight (less 64 MiB for the
  /// rest of the workspace): the extra memory stays within the larger of 512 MiB and that copy,
  /// plus the float32 grad_weight accumulator for a 16-bit weight. A smaller budget caps it at
  /// the price of more token chunks (each reads and writes that accumulator once). On the CPU
  /// it bounds one chunk's float32 logits; the default is 128 MiB (256 MiB at most with
  /// low_memory).
  size_t chunk_budget_bytes = 0;
  /// Bound the extra memory (including any float32 grad_weight accumulator) at 512 MiB, even at
  /// the cost of recomputation.
  bool low_memory = false;
  /// CUDA: run the matrix products over the rows whose target is not ignored only. Counting
  /// them needs their number on the host, so the call waits for the device once (one small
  /// copy) and cannot be captured in a CUDA graph; without it, ignored rows still cost their
  /// share of the products (their gradient is zero) and the call never synchronises. The CPU
  /// backend always drops ignored rows (it has nothing to wait for).
  bool skip_ignored = false;
};

/// Gradients to form; an empty view is not computed. Each has its input's dtype; grad_weight is
/// accumulated in float32 whatever that dtype is, and rounded once at the end.
struct LinearGrads {
  MatrixView grad_hidden;  ///< (N, H)
  MatrixView grad_weight;  ///< (V, H)
  VectorView grad_bias;    ///< (V,)
};

/// Bytes of device workspace a call needs (0 on the CPU). `job` is kForward or
/// kForwardBackward; `grads` says which gradients will be asked for (their pointers are not read).
/// The size for N rows serves any call with at most N rows and the same other arguments. Given no
/// workspace, the CUDA backend takes stream-ordered scratch (cudaMallocAsync) for the call.
size_t linear_cross_entropy_workspace_size(Job job, const Device& device, int64_t rows, int64_t hidden_size,
                                           int64_t vocab, DType dtype, const Options& options,
                                           const LinearOptions& linear, const LinearGrads& grads);

/// Forward: the loss of hidden @ weight.T (+ bias), reduced as options.reduction says, per-row
/// lse and optional metrics (ForwardOutputs as for cross_entropy_forward; the per-row vectors
/// have N entries, ignored and shifted-out rows hold 0).
/// @param hidden (N, H) float32 / bfloat16 / float16, unit stride along H.
/// @param weight (V, H), hidden's dtype, unit stride along H.
/// @param bias (V,) in hidden's dtype, or empty.
/// @param target (N,) int32 / int64 in [0, V) or options.ignore_index.
Status linear_cross_entropy_forward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                    const VectorView& bias, const VectorView& target, const Options& options,
                                    const LinearOptions& linear, const ForwardOutputs& out,
                                    Workspace workspace = {});

/// Forward with gradients: the forward's outputs and the gradients asked for in `grads`, with an
/// upstream gradient grad_loss ((1,) for sum / mean, (N,) for none; empty = 1). Rows whose
/// target is ignored never enter a matrix product.
Status linear_cross_entropy_forward_backward(const Device& device, const MatrixView& hidden,
                                             const MatrixView& weight, const VectorView& bias,
                                             const VectorView& target, const Options& options,
                                             const LinearOptions& linear, const ForwardOutputs& out,
                                             const VectorView& grad_loss, const LinearGrads& grads,
                                             Workspace workspace = {});

}  // namespace fusedce
