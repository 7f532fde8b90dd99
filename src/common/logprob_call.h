// One validated call of a log-probability entry point (fusedce/logprobs.h), as the backends
// receive it.
#pragma once

#include "fusedce/logprobs.h"

namespace fusedce {
namespace detail {

struct LogprobCall {
  int step;     // 1 statistics, 2 merge, 3 gradients, 4 distribution statistics (from step 2's input)
  bool linear;  // steps 1 and 3: hidden @ weight.T + bias instead of logits
  Device device;
  MatrixView logits;                  // logits form
  MatrixView hidden, weight;          // linear form
  VectorView bias;                    // linear form, or empty
  VectorView target;                  // (N,) global indices or ignore_index
  ShardSpec shard;
  LogprobOptions options;
  size_t chunk_budget_bytes = 0;      // linear form; 0 = default
  MatrixView stats;                   // step 1 output, steps 2 and 4 input (gathered)
  int64_t world = 1;                  // steps 2 and 4
  LogprobOutputs out;                 // step 2 output, step 3 input
  DistributionStats dist;             // step 4 output
  VectorView grad_logprob, grad_entropy;  // step 3; grad_entropy may be empty
  MatrixView dlogits;                 // step 3, logits form
  LinearGrads grads;                  // step 3, linear form
  Workspace workspace;

  int64_t rows() const { return target.size; }
  int64_t local_vocab() const { return linear ? weight.rows : logits.cols; }
};

Status validate_logprob_call(const LogprobCall& call);

}  // namespace detail

namespace cpu {
Status run_logprobs(const detail::LogprobCall& call);
}  // namespace cpu

namespace cuda {
/// Present in every build; without the CUDA backend it returns kUnsupported.
Status run_logprobs(const detail::LogprobCall& call);
size_t logprobs_workspace_size(const detail::LogprobCall& call);
}  // namespace cuda

}  // namespace fusedce
