// The fusedce torch library: every schema with its CPU kernel (the op list is in registry.h). The
// CUDA kernels of the same ops are registered by binding_cuda.cpp when the extension is built
// with CUDA.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops_namespace.h"

#include "registry.h"

namespace fusedce_torch {
namespace {

struct CpuContext {
  CpuContext(const Tensor&, const char*) {}
  // The core's thread pool, capped at torch's intra-op thread count.
  fusedce::Device device() const { return fusedce::Device::cpu(at::get_num_threads()); }
};

}  // namespace
}  // namespace fusedce_torch

FUSEDCE_TORCH_LIBRARY(m) { fusedce_torch::define_ops<fusedce_torch::CpuContext>(m); }
