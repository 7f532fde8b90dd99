// The linear cross-entropy in a given chunk form of the CUDA backend (detail::LinearForm),
// whatever its planner would pick: the public entry point's call and path with the form set. For the tests of a form the planner does not choose for their
// options (cuda/linear/window_plan.h: window_chosen).
#pragma once

#include "common/call.h"
#include "fusedce/linear_cross_entropy.h"

namespace fusedce_test {

inline fusedce::Status linear_forward_backward_in(fusedce::detail::LinearForm form, const fusedce::Device& device,
                                                  const fusedce::MatrixView& hidden, const fusedce::MatrixView& weight,
                                                  const fusedce::VectorView& bias, const fusedce::VectorView& target,
                                                  const fusedce::Options& options, const fusedce::LinearOptions& linear,
                                                  const fusedce::ForwardOutputs& out,
                                                  const fusedce::VectorView& grad_loss,
                                                  const fusedce::LinearGrads& grads) {
  fusedce::detail::LinearCall call = fusedce::detail::forward_backward_call(device, hidden, weight, bias, target, options,
                                                                            linear, out, grad_loss, grads, {});
  call.form = form;
  return fusedce::detail::run_linear_call(call);
}

}  // namespace fusedce_test
