// The entry points of linear_cross_entropy.h: build the call, validate it once, hand it to the
// backend the device handle names.
#include "fusedce/linear_cross_entropy.h"

#include "common/call.h"

namespace fusedce {
namespace {

Status dispatch(const detail::LinearCall& call) {
  Status s = detail::validate_linear_call(call);
  if (!s.ok()) return s;
  if (call.device.type == DeviceType::kCUDA) {
    return Status(StatusCode::kUnsupported,
                  "linear cross-entropy has no CUDA backend yet (issue 5): call it with Device::cpu()");
  }
  return cpu::run_linear(call);
}

}  // namespace

Status linear_cross_entropy_forward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                    const VectorView& bias, const VectorView& target, const Options& options,
                                    const LinearOptions& linear, const ForwardOutputs& out, Workspace workspace) {
  detail::LinearCall call{};
  call.job = Job::kForward;
  call.device = device;
  call.hidden = hidden;
  call.weight = weight;
  call.bias = bias;
  call.target = target;
  call.options = options;
  call.linear = linear;
  call.out = out;
  call.workspace = workspace;
  return dispatch(call);
}

Status linear_cross_entropy_forward_backward(const Device& device, const MatrixView& hidden,
                                             const MatrixView& weight, const VectorView& bias,
                                             const VectorView& target, const Options& options,
                                             const LinearOptions& linear, const ForwardOutputs& out,
                                             const VectorView& grad_loss, const LinearGrads& grads,
                                             Workspace workspace) {
  detail::LinearCall call{};
  call.job = Job::kForwardBackward;
  call.device = device;
  call.hidden = hidden;
  call.weight = weight;
  call.bias = bias;
  call.target = target;
  call.options = options;
  call.linear = linear;
  call.out = out;
  call.grad_loss = grad_loss;
  call.grads = grads;
  call.workspace = workspace;
  return dispatch(call);
}

}  // namespace fusedce
