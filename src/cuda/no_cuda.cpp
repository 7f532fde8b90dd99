// The CUDA backend's entry points in a build without CUDA: every call says so.
#include "common/call.h"

namespace fusedce {
namespace cuda {

Status run(const detail::CeCall&) {
  return Status(StatusCode::kUnsupported,
                "device is CUDA but this build of fusedce has no CUDA backend "
                "(configure with FUSEDCE_CUDA=ON where nvcc is available)");
}

size_t workspace_size(Job, int64_t, int64_t, const Options&) { return 0; }

Status run_shard(const detail::ShardCall&) {
  return Status(StatusCode::kUnsupported,
                "device is CUDA but this build of fusedce has no CUDA backend "
                "(configure with FUSEDCE_CUDA=ON where nvcc is available)");
}

}  // namespace cuda
}  // namespace fusedce
