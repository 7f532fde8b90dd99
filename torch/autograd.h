// ce_loss: fusedce.cross_entropy's common path as one op whose autograd lives in C++, so that a
// small call costs the host one dispatch forward and one backward node, as PyTorch's own loss
// does, instead of a Python autograd kernel on each side. This is the one op whose formula is
// not registered from Python beside its fake kernel (docs/architecture.md, "Autograd").
//
// Without grad (grad mode off, or logits that do not require grad) it runs its own device
// kernel, the forward alone. With grad, the
// forward runs ce_fwd_bwd (loss and dlogits for an upstream gradient of 1 in one sweep); dlogits
// never leaves the node, so the backward scales it in place by the upstream gradient
// (ce_rescale_) and hands it on. Only when the graph is kept for another backward is a copy
// scaled instead. The inner ops are called through the dispatcher below the autograd keys, so
// that under torch.compile they are traced (their fake kernels are Python's) and in eager mode
// they go straight to the CPU or CUDA kernel.
//
// The in-place form (inplace_backward, op ce_fwd_bwd_) and the vocabulary-parallel form keep their
// Python autograd.Functions (python/fusedce/ops.py, distributed.py): the first writes over a
// differentiable input, the second strings several ops and collectives together.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "ops_namespace.h"

namespace fusedce_torch {

#define FUSEDCE_STRINGIFY_(x) #x
#define FUSEDCE_STRINGIFY(x) FUSEDCE_STRINGIFY_(x)

// The typed dispatcher handle of this library's op `name` (looked up once per op).
template <class Signature>
c10::TypedOperatorHandle<Signature> library_op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string(FUSEDCE_STRINGIFY(FUSEDCE_TORCH_NAMESPACE)) + "::" + name).c_str(), "")
      .template typed<Signature>();
}

using CeOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using CeFwdSignature = CeOutputs(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t,
                                 c10::string_view, double, double, double, double, bool);
using CeFwdBwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t, c10::string_view, double,
    double, double, double, bool);
using CeRescaleSignature = void(const at::Tensor&, const at::Tensor&);

// A tensor of a traced graph (torch.compile's fake or functional tensors) rather than of an eager
// call: there the in-place scaling is functionalised, and a kept graph does not exist.
inline bool is_traced(const at::Tensor& t) {
  const c10::DispatchKeySet keys = t.key_set();
  return keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize);
}

struct CeLossFunction : public torch::autograd::Function<CeLossFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                                                const at::Tensor& target, const c10::optional<at::Tensor>& class_weight,
                                                int64_t ignore_index, c10::string_view reduction,
                                                double label_smoothing, double logit_scale, double softcap,
                                                double z_loss, bool return_metrics) {
    static const auto fwd_bwd = library_op<CeFwdBwdSignature>("ce_fwd_bwd");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, lse, num_correct, entropy_sum, dlogits] = fwd_bwd.call(
        logits, target, class_weight, ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss,
        return_metrics);
    ctx->save_for_backward({dlogits});
    ctx->mark_non_differentiable({lse, num_correct, entropy_sum});
    ctx->set_materialize_grads(false);
    return {loss, lse, num_correct, entropy_sum};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // One gradient per argument of forward: only the logits have one.
    torch::autograd::variable_list out(10);
    const at::Tensor& grad_loss = grads[0];
    if (!grad_loss.defined() || !ctx->needs_input_grad(0)) return out;
    static const auto rescale = library_op<CeRescaleSignature>("ce_rescale_");
    at::Tensor dlogits = ctx->get_saved_variables()[0];
    if (!is_traced(dlogits) && torch::autograd::get_current_graph_task_keep_graph()) {
      dlogits = dlogits.clone();  // the saved tensor may be read by a later backward
    }
    // float32 and with a real stride: `loss.sum().backward()` hands 'none' an expanded (stride 0)
    // gradient, which the core does not take.
    const at::Tensor upstream = grad_loss.to(at::kFloat).contiguous();
    {
      at::AutoDispatchBelowADInplaceOrView below;
      rescale.call(upstream, dlogits);
    }
    out[0] = dlogits;
    return out;
  }
};

// The Autograd kernel of ce_loss.
inline CeOutputs ce_loss_autograd(const at::Tensor& logits, const at::Tensor& target,
                                  const c10::optional<at::Tensor>& class_weight, int64_t ignore_index,
                                  c10::string_view reduction, double label_smoothing, double logit_scale,
                                  double softcap, double z_loss, bool return_metrics) {
  if (!(at::GradMode::is_enabled() && logits.requires_grad())) {
    static const auto fwd = library_op<CeFwdSignature>("ce_loss");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(logits, target, class_weight, ignore_index, reduction, label_smoothing, logit_scale, softcap,
                    z_loss, return_metrics);
  }
  torch::autograd::variable_list r = CeLossFunction::apply(logits, target, class_weight, ignore_index, reduction,
                                                           label_smoothing, logit_scale, softcap, z_loss,
                                                           return_metrics);
  return {r[0], r[1], r[2], r[3]};
}

}  // namespace fusedce_torch
