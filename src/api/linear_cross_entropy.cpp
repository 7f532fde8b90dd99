// The entry points of linear_cross_entropy.h: build the call, validate it once, hand it to the
// backend the device handle names.
#include "fusedce/linear_cross_entropy.h"

#include "common/call.h"

namespace fusedce {
namespace detail {

Status run_linear_call(const LinearCall& call) {
  Status s = validate_linear_call(call);
  if (!s.ok()) return s;
  if (call.device.type == DeviceType::kCUDA) return cuda::run_linear(call);
  return cpu::run_linear(call);
}

LinearCall forward_backward_call(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                 const VectorView& bias, const VectorView& target, const Options& options,
                                 const LinearOptions& linear, const ForwardOutputs& out, const VectorView& grad_loss,
                                 const LinearGrads& grads, Workspace workspace) {
  LinearCall call{};
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
  return call;
}

}  // namespace detail

size_t linear_cross_entropy_workspace_size(Job job, const Device& device, int64_t rows, int64_t hidden_size,
                                           int64_t vocab, DType dtype, const Options& options,
                                           const LinearOptions& linear, const LinearGrads& grads) {
  if (device.type != DeviceType::kCUDA) return 0;
  return cuda::linear_workspace_size(job, device, rows, hidden_size, vocab, dtype, options, linear, grads);
}

Status linear_cross_entropy_forward(const Device& device, const MatrixView& hidden, const MatrixView& weight,
                                    const VectorView& bias, const VectorView& target, const Options& options,
                                    const LinearOptions& linear, const ForwardOutputs& out, Workspace workspace) {
  detail::LinearCall call =
      detail::forward_backward_call(device, hidden, weight, bias, target, options, linear, out, {}, {}, workspace);
  call.job = Job::kForward;
  return detail::run_linear_call(call);
}

Status linear_cross_entropy_forward_backward(const Device& device, const MatrixView& hidden,
                                             const MatrixView& weight, const VectorView& bias,
                                             const VectorView& target, const Options& options,
                                             const LinearOptions& linear, const ForwardOutputs& out,
                                             const VectorView& grad_loss, const LinearGrads& grads,
                                             Workspace workspace) {
  return detail::run_linear_call(
      detail::forward_backward_call(device, hidden, weight, bias, target, options, linear, out, grad_loss, grads, workspace));
}

}  // namespace fusedce
