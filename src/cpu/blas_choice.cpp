#include "cpu/blas_choice.h"

#include <initializer_list>
#include <strings.h>

namespace fusedce {
namespace cpu {
namespace {

bool one_of(const char* core, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (strcasecmp(core, n) == 0) return true;
  }
  return false;
}

}  // namespace

VectorIsa host_vector_isa() {
  VectorIsa isa;
#if defined(__x86_64__) && defined(__GNUC__)
  isa.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa;
}

bool openblas_core_fits(const char* core, VectorIsa isa) {
  if (!isa.avx2_fma) return true;
  // OpenBLAS's x86-64 core types whose sgemm kernels are AVX2 or AVX-512.
  return core != nullptr && one_of(core, {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"});
}

}  // namespace cpu
}  // namespace fusedce
