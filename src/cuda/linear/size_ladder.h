// skip_ignored's device-sized work (linear_cuda.cpp, "Under CUDA graph capture"): the token
// chunks are planned for the worst case (every row valid) and each chunk runs, on the device's
// count of valid rows, at one of a fixed ladder of row counts, the smallest that holds its rows.
// Pure functions, shared by the host (which captures one body per rung) and the tiny kernel that
// picks the rung on the device; tested on the CPU (tests/cpp/test_size_ladder.cpp).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIP__)
#define FUSEDCE_HOST_DEVICE __host__ __device__
#else
#define FUSEDCE_HOST_DEVICE
#endif

namespace fusedce {
namespace cuda {

/// Rungs per chunk. Eighths of the chunk: a chunk whose valid rows fall just past a rung costs at
/// most an eighth of its capacity (plus the rounding to whole 128-row tiles) more than its rows,
/// so a half-ignored batch costs about 0.5 - 0.625 of the all-valid work, while the graph holds
/// only 8 captured bodies per chunk (powers of two would waste up to half; more rungs cost
/// capture and instantiation time per call).
constexpr int kLadderRungs = 8;
/// Rungs are whole tiles of this many rows (the products' tile height), where the chunk allows.
constexpr int64_t kLadderGranule = 128;

/// The rungs of a chunk of `capacity` rows, ascending, distinct, the last equal to capacity.
struct SizeLadder {
  int rungs = 0;
  int64_t size[kLadderRungs] = {};
};

/// Rung k (1..8): ceil(capacity * k / 8) rounded up to a multiple of 128, capped at capacity;
/// repeated values dropped (a chunk of 300 rows has rungs 128, 256, 300). capacity <= 0: none.
inline SizeLadder size_ladder(int64_t capacity) {
  SizeLadder l;
  if (capacity <= 0) return l;
  for (int k = 1; k <= kLadderRungs; ++k) {
    const int64_t want = (capacity * k + kLadderRungs - 1) / kLadderRungs;
    int64_t s = (want + kLadderGranule - 1) / kLadderGranule * kLadderGranule;
    if (s > capacity) s = capacity;
    if (l.rungs == 0 || s > l.size[l.rungs - 1]) l.size[l.rungs++] = s;
  }
  return l;
}

/// The branch a chunk takes, for the conditional (SWITCH) node of the chunk:
///   `rest` = valid rows from the chunk's first position on (count - p0, may be <= 0);
///   rest <= 0: `none()` (no body runs); 0 < rest <= capacity: the chunk holds the last valid row,
///   branch b = the smallest rung >= rest; rest > capacity: `full()`: the chunk is full and more
///   chunks follow (the body of capacity rows that is not the call's last product).
struct LadderBranch {
  FUSEDCE_HOST_DEVICE static int full(int rungs) { return rungs; }
  FUSEDCE_HOST_DEVICE static int none(int rungs) { return rungs + 1; }
  FUSEDCE_HOST_DEVICE static int of(const int64_t* size, int rungs, int64_t capacity, int64_t rest) {
    if (rest <= 0) return none(rungs);
    if (rest > capacity) return full(rungs);
    int b = 0;
    while (b + 1 < rungs && size[b] < rest) ++b;
    return b;
  }
};

}  // namespace cuda
}  // namespace fusedce
