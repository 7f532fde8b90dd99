// CUDA kernels of the fusedce torch ops (the op list in registry.h): the same wrappers as on the
// CPU, run under a device guard for the logits' GPU, on torch's current stream, with workspace
// from torch's caching allocator. Plain C++: torch's CUDA headers never meet nvcc.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops_namespace.h"

#include "registry.h"

namespace fusedce_torch {
namespace {

class CudaContext {
 public:
  CudaContext(const Tensor& like, const char* name)
      : guard_(require_cuda(like, name).device()),
        device_(fusedce::Device::cuda(like.get_device(),
                                      c10::cuda::getCurrentCUDAStream(like.get_device()).stream())) {}
  const fusedce::Device& device() const { return device_; }

 private:
  // Another argument is on a GPU (so the dispatcher chose this kernel) but `like` is not.
  static const Tensor& require_cuda(const Tensor& like, const char* name) {
    TORCH_CHECK_VALUE(like.is_cuda(), "fusedce: ", name, " is on ", like.device(),
                      " but another argument is on a CUDA device");
    return like;
  }

  c10::cuda::CUDAGuard guard_;
  fusedce::Device device_;
};

}  // namespace
}  // namespace fusedce_torch

FUSEDCE_TORCH_LIBRARY_IMPL(CUDA, m) { fusedce_torch::register_kernels<fusedce_torch::CudaContext>(m); }
