// The entry points of linear_cross_entropy.h: build the call, validate it once, hand it to the
// backend the device handle names.
#include "fusedce/linear_cross_entropy.h"

#include "common/call.h"

namespace fusedce {
namespace {

Status dispatch(const detail::LinearCall& call) {
  Status s = detail::validate_linear_call(call);
  if (!s.ok()) return s;
  if (call.device.type == DeviceType::kCUDA) return cuda::run_linear(call);
  return cpu::run_linear(call);
}

}  // namespace

size_t linear_cross_entropy_workspace_size(Job job, const Device& device, int64_t rows, int64_t hidden_size,
                                           int64_t vocab, DType dtype, const Options& options,
                                           const LinearOptions& linear, const LinearGrads& grads) {
  if (device.type != DeviceType::kCUDA) return 0;
  return cuda::linear_workspace_size(job, device, rows, hidden_size, vocab, dtype, options, linear, grads);
}

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
