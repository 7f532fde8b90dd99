// A CUDA build without the CUTLASS kernels (FUSEDCE_CUTLASS=OFF): the last grad_weight product goes
// through cuBLASLt and a rounding pass, and the logits through cuBLASLt and the cross-entropy pass.
#include "cuda/linear/cutlass_products.h"
#include "cuda/linear/window_forward.h"

namespace fusedce {
namespace cuda {

bool cutlass_products_available(int) { return false; }

Status run_rounded_weight_product(const RoundedWeightProduct&) {
  return Status(StatusCode::kUnsupported, "built without the CUTLASS products (FUSEDCE_CUTLASS=OFF)");
}

Status run_window_forward(const WindowForward&) {
  return Status(StatusCode::kUnsupported, "built without the CUTLASS products (FUSEDCE_CUTLASS=OFF)");
}

}  // namespace cuda
}  // namespace fusedce
