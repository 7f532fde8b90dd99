// The GPU distillation where it is not built (no CUDA, or the HIP build, which has no cuBLASLt
// for its products): every call says so.
#include "common/distill_call.h"

namespace fusedce {
namespace cuda {

namespace {
Status unsupported() {
  return Status(StatusCode::kUnsupported,
                "device is CUDA but this build of fusedce has no CUDA distillation "
                "(configure with FUSEDCE_CUDA=ON where nvcc and cuBLASLt are available)");
}
}  // namespace

Status run_distill(const detail::DistillCall&) { return unsupported(); }
Status run_distill_shard(const detail::DistillCall&) { return unsupported(); }
size_t distill_workspace_size(const detail::DistillCall&) { return 0; }

}  // namespace cuda
}  // namespace fusedce
