// A CUDA build without the CUTLASS products (FUSEDCE_CUTLASS=OFF): every product goes through
// cuBLASLt.
#include "cuda/cutlass_products.h"

namespace fusedce {
namespace cuda {

bool cutlass_products_available(int) { return false; }

Status run_product(const Product&) {
  return Status(StatusCode::kUnsupported, "built without the CUTLASS products (FUSEDCE_CUTLASS=OFF)");
}

}  // namespace cuda
}  // namespace fusedce
