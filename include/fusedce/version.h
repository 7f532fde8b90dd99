// fusedce version and build facts.
#pragma once

#define FUSEDCE_VERSION_MAJOR 0
#define FUSEDCE_VERSION_MINOR 1
#define FUSEDCE_VERSION_PATCH 0

namespace fusedce {
/// "MAJOR.MINOR.PATCH".
const char* version();
/// True when this build of the library contains the CUDA backend.
bool built_with_cuda();
/// The library doing the CPU linear path's matrix products: "OpenBLAS", or "none" when the
/// build found no OpenBLAS and uses the core's own tile products.
const char* cpu_blas();
}  // namespace fusedce
