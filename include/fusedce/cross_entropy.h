// fusedce: cross-entropy over logits (docs/contract.md). Every entry point validates its arguments
// once, returns a Status naming any bad argument, and runs on the device the handle names
// (CPU threads, or a CUDA stream with no host synchronisation).
#pragma once

#include "fusedce/types.h"

namespace fusedce {

/// Outputs of a forward sweep. Views left empty are not computed (except `loss`, required).
struct ForwardOutputs {
  /// float32. reduction kNone: (N,) per-row losses, 0 at ignored rows. kSum / kMean: (1,).
  VectorView loss;
  /// float32 (N,): per-row log-sum-exp of z (0 at ignored rows, whose logits are never read).
  /// Needed later by cross_entropy_backward.
  VectorView lse;
  /// int64 (1,): non-ignored rows whose argmax over z (lowest index on ties) equals the target.
  /// Written only with Options::return_metrics.
  VectorView num_correct;
  /// float32 (1,): sum over non-ignored rows of the softmax entropy lse - sum_j p_j z_j, nats.
  /// Written only with Options::return_metrics.
  VectorView entropy_sum;
};

/// The jobs, for workspace queries.
enum class Job : int32_t { kForward = 0, kBackward = 1, kForwardBackward = 2, kRescale = 3 };

/// Bytes of device workspace the job needs for these sizes and options (0 on the CPU). The size
/// for `rows` rows also serves any call with fewer rows (same job, vocab and options).
/// Entry points take the workspace as their last argument; given none (empty), the CUDA backend
/// takes stream-ordered scratch (cudaMallocAsync / cudaFreeAsync) for the call instead.
size_t cross_entropy_workspace_size(Job job, const Device& device, int64_t rows, int64_t vocab,
                                    const Options& options);

/// Forward: loss (reduced as options.reduction says), per-row lse, optional metrics.
/// @param logits (N, V) float32 / bfloat16 / float16, unit stride along V.
/// @param target (N,) int32 / int64, values in [0, V) or options.ignore_index.
Status cross_entropy_forward(const Device& device, const MatrixView& logits,
                             const VectorView& target, const Options& options,
                             const ForwardOutputs& out, Workspace workspace = {});

/// Backward: dlogits = dL/dlogits from the forward's lse and the upstream gradient.
/// @param grad_loss float32: (1,) for reductions kSum / kMean (dL/d loss), (N,) for kNone.
///        The reduction's chain factor (1 / denominator for kMean) is applied here.
/// @param dlogits (N, V) in the logits' dtype; may be the logits buffer itself (in place).
Status cross_entropy_backward(const Device& device, const MatrixView& logits,
                              const VectorView& target, const VectorView& lse,
                              const VectorView& grad_loss, const Options& options,
                              const MatrixView& dlogits, Workspace workspace = {});

/// Forward with gradient: the forward's outputs and dlogits formed in the same sweep.
/// @param grad_loss as in cross_entropy_backward, or empty for an upstream gradient of 1
///        (the usual case: rescale later with cross_entropy_rescale_grad if it is not 1).
/// @param dlogits (N, V) in the logits' dtype. With options.inplace_backward it must describe the
///        logits buffer itself (same pointer and stride); the logits are then overwritten.
Status cross_entropy_forward_backward(const Device& device, const MatrixView& logits,
                                      const VectorView& target, const Options& options,
                                      const ForwardOutputs& out, const VectorView& grad_loss,
                                      const MatrixView& dlogits, Workspace workspace = {});

/// dlogits[i, :] *= grad_loss[i] (grad_loss (N,)) or *= grad_loss[0] (grad_loss (1,)), for a
/// gradient formed by cross_entropy_forward_backward with an upstream gradient of 1. Rows whose
/// factor is exactly 1 are not touched, so a factor of 1 costs no memory traffic.
Status cross_entropy_rescale_grad(const Device& device, const VectorView& grad_loss,
                                  const MatrixView& dlogits, Workspace workspace = {});

}  // namespace fusedce
