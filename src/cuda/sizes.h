// Plain-C++ sizes shared by the GPU kernels and the host-side planners: how a row is cut into
// 16-byte segments (vec.cuh has the loads and stores) and the workspace pieces' alignment.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/numeric.h"  // FUSEDCE_HD

namespace fusedce {
namespace cuda {

/// Segments covering a row of V elements starting `off` elements past a boundary.
FUSEDCE_HD int64_t row_segments(int64_t V, int off, int vec) { return (V + off + vec - 1) / vec; }

/// Workspace pieces start at this alignment (what vectorised loads and cuBLASLt like best).
constexpr size_t kWorkspaceAlign = 256;
inline size_t align_up(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

}  // namespace cuda
}  // namespace fusedce
