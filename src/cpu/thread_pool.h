// A small persistent pool for the CPU backend: parallel_for over row ranges. Work is handed out
// in fixed blocks of rows, and every row is computed by the same code whichever thread takes it,
// so results do not depend on the thread count.
#pragma once

#include <cstdint>
#include <functional>

namespace fusedce {
namespace cpu {

/// Hardware threads available to this process (at least 1).
int hardware_threads();

/// Runs fn(begin, end) over [0, n) split into blocks of `grain` items, on up to `max_threads`
/// threads (0 = all), the calling thread included: on the host's threads where one was handed
/// over (set_cpu_parallel_for), else on this pool. Returns when every block is done.
void parallel_for(int64_t n, int64_t grain, int max_threads,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace cpu
}  // namespace fusedce
