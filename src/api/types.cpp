#include "fusedce/types.h"
#include "fusedce/version.h"

#include "cpu/gemm.h"

namespace fusedce {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 1;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

const char* reduction_name(Reduction reduction) {
  switch (reduction) {
    case Reduction::kNone: return "none";
    case Reduction::kSum: return "sum";
    case Reduction::kMean: return "mean";
  }
  return "unknown";
}

#define FUSEDCE_STR2(x) #x
#define FUSEDCE_STR(x) FUSEDCE_STR2(x)
const char* version() {
  return FUSEDCE_STR(FUSEDCE_VERSION_MAJOR) "." FUSEDCE_STR(FUSEDCE_VERSION_MINOR) "." FUSEDCE_STR(
      FUSEDCE_VERSION_PATCH);
}

// A HIP build's GPU backend takes DeviceType::kCUDA devices too (AMD GPUs, as in PyTorch on ROCm).
bool built_with_cuda() {
#if defined(FUSEDCE_WITH_CUDA) || defined(FUSEDCE_WITH_HIP)
  return true;
#else
  return false;
#endif
}

const char* cpu_blas() { return cpu::blas_name(); }

}  // namespace fusedce
