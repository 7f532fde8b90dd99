// A build without OpenBLAS: the CPU linear path's products are the core's own tile products.
#include "cpu/gemm.h"

namespace fusedce {
namespace cpu {

GemmOps gemm() { return builtin_gemm(); }

const char* openblas_core() { return nullptr; }

}  // namespace cpu
}  // namespace fusedce
