// A CUDA build without the CUTLASS kernels (FUSEDCE_CUTLASS=OFF): the log-probabilities' logits go
// through cuBLASLt and the row kernels.
#include "cuda/logprobs/lp_fused_products.h"

namespace fusedce {
namespace cuda {

Status run_lp_stats_product(const LpFusedProduct&, float4*) {
  return Status(StatusCode::kUnsupported, "built without the CUTLASS products (FUSEDCE_CUTLASS=OFF)");
}

Status run_lp_dlogits_product(const LpFusedProduct&, const LpFusedGrad&) {
  return Status(StatusCode::kUnsupported, "built without the CUTLASS products (FUSEDCE_CUTLASS=OFF)");
}

}  // namespace cuda
}  // namespace fusedce
