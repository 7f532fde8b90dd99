// A CUDA build without the CUTLASS kernel (FUSEDCE_CUTLASS=OFF): the last grad_weight product goes
// through cuBLASLt and a rounding pass.
#include "cuda/linear/cutlass_products.h"

namespace fusedce {
namespace cuda {

bool cutlass_products_available(int) { return false; }

Status run_rounded_weight_product(const RoundedWeightProduct&) {
  return Status(StatusCode::kUnsupported, "built without the CUTLASS products (FUSEDCE_CUTLASS=OFF)");
}

}  // namespace cuda
}  // namespace fusedce
