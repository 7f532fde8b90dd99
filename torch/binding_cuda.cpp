// CUDA kernels of the fusedce torch ops (schemas in binding.cpp): the same wrappers as on the
// CPU, run under a device guard for the logits' GPU, on torch's current stream, with workspace
// from torch's caching allocator. Plain C++: torch's CUDA headers never meet nvcc.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops_namespace.h"

#include "linear_ops.h"
#include "lp_ops.h"
#include "ops.h"
#include "vp_ops.h"

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

FUSEDCE_TORCH_LIBRARY_IMPL(CUDA, m) {
  using Ctx = fusedce_torch::CudaContext;
  m.impl("ce_fwd_out", &fusedce_torch::ce_fwd_out<Ctx>);
  m.impl("ce_fwd_bwd_out", &fusedce_torch::ce_fwd_bwd_out<Ctx>);
  m.impl("ce_fwd_bwd_inplace", &fusedce_torch::ce_fwd_bwd_inplace<Ctx>);
  m.impl("ce_bwd_out", &fusedce_torch::ce_bwd_out<Ctx>);
  m.impl("ce_rescale_", &fusedce_torch::ce_rescale_<Ctx>);
  m.impl("ce_fwd", &fusedce_torch::ce_fwd<Ctx>);
  m.impl("ce_fwd_bwd", &fusedce_torch::ce_fwd_bwd<Ctx>);
  m.impl("ce_bwd", &fusedce_torch::ce_bwd<Ctx>);
  m.impl("lce_fwd_out", &fusedce_torch::lce_fwd_out<Ctx>);
  m.impl("lce_fwd_bwd_out", &fusedce_torch::lce_fwd_bwd_out<Ctx>);
  m.impl("lce_fwd", &fusedce_torch::lce_fwd<Ctx>);
  m.impl("lce_fwd_bwd", &fusedce_torch::lce_fwd_bwd<Ctx>);
  m.impl("ce_shard_stats", &fusedce_torch::ce_shard_stats<Ctx>);
  m.impl("ce_shard_merge", &fusedce_torch::ce_shard_merge<Ctx>);
  m.impl("ce_shard_bwd", &fusedce_torch::ce_shard_bwd<Ctx>);
  m.impl("lce_shard_stats", &fusedce_torch::lce_shard_stats<Ctx>);
  m.impl("lce_shard_bwd", &fusedce_torch::lce_shard_bwd<Ctx>);
  m.impl("lp_stats", &fusedce_torch::lp_stats<Ctx>);
  m.impl("llp_stats", &fusedce_torch::llp_stats<Ctx>);
  m.impl("lp_merge", &fusedce_torch::lp_merge<Ctx>);
  m.impl("lp_bwd", &fusedce_torch::lp_bwd<Ctx>);
  m.impl("lp_bwd_", &fusedce_torch::lp_bwd_<Ctx>);
  m.impl("llp_bwd", &fusedce_torch::llp_bwd<Ctx>);
}
