// Whether the CPU linear path's products go through the OpenBLAS the build linked or through the
// core's own tile products: a pure decision on OpenBLAS's kernel choice and the CPU's vector unit.
//
// A DYNAMIC_ARCH OpenBLAS picks its kernels by CPU model. A release older than the CPU does not
// know the model and falls back to its SSE3 kernels, several times slower than the core's own
// AVX2 / AVX-512 tiles; the core then takes its tiles. It never tells OpenBLAS another core type
// (that would mean writing or intercepting the process environment): a user who wants OpenBLAS's
// newer kernels on such a CPU sets OpenBLAS's own OPENBLAS_CORETYPE, which OpenBLAS reads itself.
#pragma once

namespace fusedce {
namespace cpu {

/// The vector instructions a CPU has, as far as the choice cares.
struct VectorIsa {
  bool avx2_fma = false;  // AVX2 with FMA: the core's tiles run on them
};

/// The CPU this runs on.
VectorIsa host_vector_isa();

/// Whether OpenBLAS's kernels for its core type `core` (openblas_get_corename(), e.g.
/// "SkylakeX", "Haswell", "Prescott") are at least AVX2 ones where the CPU has AVX2 (where the
/// core's tiles are AVX2 too, and OpenBLAS's AVX2 or AVX-512 kernels are the faster). Without
/// AVX2 any core fits.
bool openblas_core_fits(const char* core, VectorIsa isa);

}  // namespace cpu
}  // namespace fusedce
