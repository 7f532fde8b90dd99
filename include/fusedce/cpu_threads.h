// Whose threads the CPU backend runs on.
#pragma once

#include <cstdint>

namespace fusedce {

/// Runs body(ctx, begin, end) over contiguous ranges that together cover [0, blocks) exactly once,
/// on up to `threads` threads (the calling thread among them), and returns when every range is
/// done. body is safe to call concurrently on disjoint ranges and does not throw.
using CpuParallelFor = void (*)(int64_t blocks, int threads, void* ctx,
                                void (*body)(void* ctx, int64_t begin, int64_t end));

/// By default the CPU backend runs its parallel loops on a pool of threads of its own. A host
/// that keeps a pool of its own for the same cores (PyTorch's intra-op threads, which spin for a
/// while after each of its operations) hands it over here, so that the two never compete for
/// the cores: a call that follows the host's work then starts on threads that are already awake
/// instead of sharing the cores with them. Results do not change: the work is cut into the same
/// blocks whichever threads run them. nullptr restores the core's own pool. Each parallel loop
/// reads the setting once when it starts.
void set_cpu_parallel_for(CpuParallelFor parallel_for);

}  // namespace fusedce
