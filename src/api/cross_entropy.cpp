// The entry points of cross_entropy.h: build the call, validate it once, hand it to the backend
// the device handle names. Nothing numeric happens here.
#include "fusedce/cross_entropy.h"

#include "common/call.h"

namespace fusedce {
namespace {

Status dispatch(const detail::CeCall& call) {
  Status s = detail::validate_call(call);
  if (!s.ok()) return s;
  if (call.device.type == DeviceType::kCUDA) return cuda::run(call);
  return cpu::run(call);
}

}  // namespace

size_t cross_entropy_workspace_size(Job job, const Device& device, int64_t rows, int64_t vocab,
                                    const Options& options) {
  if (device.type != DeviceType::kCUDA) return 0;
  return cuda::workspace_size(job, rows, vocab, options);
}

Status cross_entropy_forward(const Device& device, const MatrixView& logits,
                             const VectorView& target, const Options& options,
                             const ForwardOutputs& out, Workspace workspace) {
  detail::CeCall call{};
  call.job = Job::kForward;
  call.device = device;
  call.logits = logits;
  call.target = target;
  call.options = options;
  call.out = out;
  call.workspace = workspace;
  return dispatch(call);
}

Status cross_entropy_backward(const Device& device, const MatrixView& logits,
                              const VectorView& target, const VectorView& lse,
                              const VectorView& grad_loss, const Options& options,
                              const MatrixView& dlogits, Workspace workspace) {
  detail::CeCall call{};
  call.job = Job::kBackward;
  call.device = device;
  call.logits = logits;
  call.target = target;
  call.options = options;
  call.lse_in = lse;
  call.grad_loss = grad_loss;
  call.dlogits = dlogits;
  call.workspace = workspace;
  return dispatch(call);
}

Status cross_entropy_forward_backward(const Device& device, const MatrixView& logits,
                                      const VectorView& target, const Options& options,
                                      const ForwardOutputs& out, const VectorView& grad_loss,
                                      const MatrixView& dlogits, Workspace workspace) {
  detail::CeCall call{};
  call.job = Job::kForwardBackward;
  call.device = device;
  call.logits = logits;
  call.target = target;
  call.options = options;
  call.out = out;
  call.grad_loss = grad_loss;
  call.dlogits = dlogits;
  call.workspace = workspace;
  return dispatch(call);
}

Status cross_entropy_rescale_grad(const Device& device, const VectorView& grad_loss,
                                  const MatrixView& dlogits, Workspace workspace) {
  detail::CeCall call{};
  call.job = Job::kRescale;
  call.device = device;
  call.grad_loss = grad_loss;
  call.dlogits = dlogits;
  call.workspace = workspace;
  return dispatch(call);
}

}  // namespace fusedce
