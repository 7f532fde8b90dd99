// The fusedce torch library: every schema with its CPU kernel (the op list is in registry.h). The
// CUDA kernels of the same ops are registered by binding_cuda.cpp when the extension is built
// with CUDA.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fusedce/cpu_threads.h"
#include "ops_namespace.h"

#include "registry.h"

namespace fusedce_torch {
namespace {

struct CpuContext {
  CpuContext(const Tensor&, const char*) {}
  // torch's intra-op thread count (the core's loops run on those threads: below).
  fusedce::Device device() const { return fusedce::Device::cpu(at::get_num_threads()); }
};

// The core's parallel loops on torch's intra-op threads rather than a pool of the core's own.
// torch's threads spin for a while after each of its operations, so a second pool on the same
// cores would share them with spinning threads (docs/performance.md, "CPU memory and threads").
// at::parallel_for splits [0, blocks) among torch's threads; each range is
// handed to the core, which runs its own fixed blocks in it, so results do not change.
// ATen's parallel_for is compiled here: under torch's OpenMP backend only an OpenMP build of this
// file runs it on torch's threads (torch/CMakeLists.txt); otherwise the core keeps its own pool.
#if !AT_PARALLEL_OPENMP || defined(_OPENMP)
void torch_parallel_for(int64_t blocks, int threads, void* ctx, void (*body)(void*, int64_t, int64_t)) {
  (void)threads;  // the core asks for torch's own count (device() above)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) { body(ctx, begin, end); });
}

[[maybe_unused]] const bool kUsesTorchThreads = [] {
  fusedce::set_cpu_parallel_for(&torch_parallel_for);
  return true;
}();
#endif

}  // namespace
}  // namespace fusedce_torch

FUSEDCE_TORCH_LIBRARY(m) { fusedce_torch::define_ops<fusedce_torch::CpuContext>(m); }
