// The CUDA linear cross-entropy where it is not built (no CUDA, or the HIP build, which has no
// cuBLASLt): every call says so.
#include "common/call.h"

namespace fusedce {
namespace cuda {

size_t linear_workspace_size(Job, const Device&, int64_t, int64_t, int64_t, DType, const Options&,
                             const LinearOptions&, const LinearGrads&, detail::LinearForm) {
  return 0;
}

Status run_linear(const detail::LinearCall&) {
  return Status(StatusCode::kUnsupported,
                "device is CUDA but this build of fusedce has no CUDA linear cross-entropy "
                "(configure with FUSEDCE_CUDA=ON where nvcc and cuBLASLt are available)");
}

size_t linear_shard_workspace_size(const detail::LinearCall&) { return 0; }

Status run_linear_shard(const detail::LinearCall& call) { return run_linear(call); }

}  // namespace cuda
}  // namespace fusedce
