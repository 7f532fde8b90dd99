// One validated call of a cross-entropy entry point, as the backends receive it.
#pragma once

#include "fusedce/cross_entropy.h"
#include "fusedce/linear_cross_entropy.h"  // LinearGrads

namespace fusedce {
namespace detail {

struct CeCall {
  Job job;
  Device device;
  MatrixView logits;
  VectorView target;
  Options options;
  ForwardOutputs out;    // kForward, kForwardBackward
  VectorView lse_in;     // kBackward
  VectorView grad_loss;  // kBackward (required), kForwardBackward (optional), kRescale
  MatrixView dlogits;    // kBackward, kForwardBackward, kRescale
  Workspace workspace;
};

/// Checks every argument of the call (docs/contract.md, "Bad input"); the message names the
/// argument. Target values are not read here (they may live on a device): see check_targets_host.
Status validate_call(const CeCall& call);

/// Reads host-resident targets and reports the first one outside [0, V) that is not
/// ignore_index, naming its entry and value; with shift_seq_len, the effective targets of the
/// causal shift (the entries a shift drops are not read).
Status check_targets_host(const VectorView& target, int64_t vocab, int64_t ignore_index,
                          int64_t shift_seq_len = 0);

/// validate_call's checks of one matrix / vector / target argument (the message names it).
Status check_matrix_arg(const char* name, const MatrixView& m);
Status check_vector_arg(const char* name, const VectorView& v, DType want, int64_t size);
Status check_target_arg(const VectorView& t, int64_t rows);
/// The gradients of a linear head's call over hidden (N, H) and weight (V, H) of `dtype`: each
/// one given has its shape, grad_hidden `grad_hidden_dtype` (the head's dtype or float32),
/// grad_weight and grad_bias the head's dtype; the message names the argument.
Status check_linear_grads_arg(const LinearGrads& g, int64_t N, int64_t V, int64_t H, DType dtype,
                              DType grad_hidden_dtype);

}  // namespace detail

namespace cpu {
Status run(const detail::CeCall& call);
}  // namespace cpu

namespace cuda {
/// Present in every build; without CUDA it returns kUnsupported.
Status run(const detail::CeCall& call);
size_t workspace_size(Job job, int64_t rows, int64_t vocab, const Options& options);
}  // namespace cuda

}  // namespace fusedce

#include "fusedce/linear_cross_entropy.h"
#include "fusedce/vocab_parallel.h"

namespace fusedce {
namespace detail {

/// One validated call of a linear cross-entropy entry point: the whole vocabulary, or one step
/// of the vocabulary-parallel form over a shard of the weight (vocab_parallel.h).
/// Which chunk form the CUDA backend's linear path takes on Hopper: the planner's choice
/// (kAuto), or one of the two forms where the call allows it, for tests and benchmarks that must
/// run a given form whatever the planner would pick (src/cuda/linear/window_plan.h).
enum class LinearForm { kAuto, kLogits, kWindow };

struct LinearCall {
  Job job;  // kForward or kForwardBackward
  Device device;
  MatrixView hidden, weight;
  VectorView bias, target;
  Options options;
  LinearOptions linear;
  ForwardOutputs out;
  VectorView grad_loss;
  LinearGrads grads;
  Workspace workspace;
  LinearForm form = LinearForm::kAuto;  // never set by the public entry points
  // Vocabulary-parallel steps: 0 = the whole vocabulary; 1 = the shard's statistics into
  // `stats` (job kForward); 3 = the shard's gradients from the merged lse, row_weight and batch
  // (job kForwardBackward; grad_hidden is float32, this rank's part of the sum over ranks).
  int shard_step = 0;
  ShardSpec shard;
  MatrixView stats;
  VectorView lse_in, row_weight, batch;
};

Status validate_linear_call(const LinearCall& call);

/// The call of linear_cross_entropy_forward_backward (linear_cross_entropy.h): these arguments,
/// the kAuto form, the whole vocabulary.
LinearCall forward_backward_call(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                 const VectorView& bias, const VectorView& target, const Options& options,
                                 const LinearOptions& linear, const ForwardOutputs& out, const VectorView& grad_loss,
                                 const LinearGrads& grads, Workspace workspace);
/// Validates the call once and hands it to the backend its device names.
Status run_linear_call(const LinearCall& call);

/// The effective target of row i of a host-resident target: with shift_seq_len L > 0, the
/// causal shift inside sequences of L rows (docs/contract.md, "Fused linear cross-entropy").
inline int64_t shifted_target(const VectorView& t, int64_t L, int64_t ignore_index, int64_t i) {
  if (L > 0) {
    if (i % L == L - 1) return ignore_index;
    ++i;
  }
  return t.dtype == DType::kInt32 ? static_cast<const int32_t*>(t.data)[i * t.stride]
                                  : static_cast<const int64_t*>(t.data)[i * t.stride];
}

inline int64_t linear_target(const LinearCall& c, int64_t i) {
  return shifted_target(c.target, c.linear.shift_seq_len, c.options.ignore_index, i);
}

}  // namespace detail

namespace cpu {
Status run_linear(const detail::LinearCall& call);
}  // namespace cpu

namespace cuda {
/// Present in every build; without the CUDA backend it returns kUnsupported.
Status run_linear(const detail::LinearCall& call);
/// The vocabulary-parallel steps of the linear form (call.shard_step 1 or 3); kUnsupported
/// without the CUDA backend.
Status run_linear_shard(const detail::LinearCall& call);
size_t linear_shard_workspace_size(const detail::LinearCall& call);
/// The workspace of a call in chunk form `form` (the public query's is kAuto's).
size_t linear_workspace_size(Job job, const Device& device, int64_t rows, int64_t hidden_size, int64_t vocab,
                             DType dtype, const Options& options, const LinearOptions& linear,
                             const LinearGrads& grads, detail::LinearForm form = detail::LinearForm::kAuto);
}  // namespace cuda

}  // namespace fusedce

#include "fusedce/vocab_parallel.h"

namespace fusedce {
namespace detail {

/// One validated call of a vocabulary-parallel step (1 stats, 2 merge, 3 backward).
struct ShardCall {
  int step;
  Device device;
  MatrixView logits;  // steps 1, 3
  VectorView target;
  ShardSpec shard;
  Options options;
  MatrixView stats;   // step 1 output, step 2 input (gathered)
  int64_t world;      // step 2
  ForwardOutputs out; // step 2
  VectorView row_weight, batch;  // step 2 outputs, step 3 inputs
  VectorView lse, grad_loss;     // step 3
  MatrixView dlogits;            // step 3
  int64_t shift_seq_len = 0;     // step 2 of the linear form: the targets' causal shift
};

Status validate_shard_call(const ShardCall& call);

}  // namespace detail

namespace cpu {
Status run_shard(const detail::ShardCall& call);
}  // namespace cpu
namespace cuda {
/// Present in every build; without a GPU backend it returns kUnsupported.
Status run_shard(const detail::ShardCall& call);
}  // namespace cuda

}  // namespace fusedce
