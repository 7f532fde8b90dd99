// The GPU log-probabilities where they are not built (no CUDA, or the HIP build, which has no
// cuBLASLt for the linear form): every call says so.
#include "common/logprob_call.h"

namespace fusedce {
namespace cuda {

Status run_logprobs(const detail::LogprobCall&) {
  return Status(StatusCode::kUnsupported,
                "device is CUDA but this build of fusedce has no CUDA log-probabilities "
                "(configure with FUSEDCE_CUDA=ON where nvcc and cuBLASLt are available)");
}

size_t logprobs_workspace_size(const detail::LogprobCall&) { return 0; }

}  // namespace cuda
}  // namespace fusedce
