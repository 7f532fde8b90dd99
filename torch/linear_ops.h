// The kernels behind the fused linear cross-entropy torch ops (lce_*): wrap hidden (N, H),
// weight (V, H), bias (V,), target (N,) and the outputs into the core's views, check what the
// core cannot see (devices and dimensions of torch tensors), and call
// linear_cross_entropy_forward / _forward_backward. No arithmetic on tensor data happens here;
// the core validates dtypes, sizes and target values and names the bad argument.
//
// Same device-context template as ops.h (binding.cpp: CPU, binding_cuda.cpp: CUDA). The core's
// scratch (its size from linear_cross_entropy_workspace_size) comes from torch's allocator.
#pragma once

#include "ops.h"

namespace fusedce_torch {

// ---- checks and views -----------------------------------------------------------------------

// A 2-D operand of the linear form, with the layout it must have in the message.
inline fusedce::MatrixView linear_matrix_of(const Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == 2, "fusedce: ", name, " must be 2-D ", layout, ", got ", t.dim(),
                    "-D of shape ", t.sizes());
  return matrix_of(t, name);
}

// Every tensor argument must be on hidden's device (the dispatcher would otherwise pick a
// kernel for one device and hand it pointers of another).
inline void check_on_hidden_device(const OptTensor& t, const char* name, const Tensor& hidden) {
  if (t.has_value()) check_same_device(*t, name, hidden, "hidden");
}

inline void check_linear_inputs(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                const Tensor& target) {
  check_same_device(weight, "weight", hidden, "hidden");
  check_on_hidden_device(bias, "bias", hidden);
  check_same_device(target, "target", hidden, "hidden");
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
                    "fusedce: target must be int64 or int32 class indices, got ", target.scalar_type());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == hidden.size(0),
                    "fusedce: target must be 1-D with one entry per row of hidden (", hidden.size(0),
                    "), got shape ", target.sizes());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1, "fusedce: bias must be 1-D (V,), got shape ", bias->sizes());
  }
}

inline fusedce::LinearOptions linear_only_options(int64_t shift_seq_len, int64_t chunk_budget_bytes,
                                                  bool low_memory, bool skip_ignored) {
  TORCH_CHECK_VALUE(chunk_budget_bytes >= 0, "fusedce: chunk_budget_bytes must be >= 0 (0 = default), got ",
                    chunk_budget_bytes);
  fusedce::LinearOptions l;
  l.shift_seq_len = shift_seq_len;
  l.chunk_budget_bytes = static_cast<size_t>(chunk_budget_bytes);
  l.low_memory = low_memory;
  l.skip_ignored = skip_ignored;
  return l;
}

// The core's scratch (logit chunks, the float32 grad_weight accumulator, ...) taken from torch's
// allocator, so that it shows in torch's memory statistics and is reused by its cache; an empty
// tensor where the core needs none (the CPU backend).
inline Tensor linear_workspace(const Tensor& hidden, fusedce::Job job, const fusedce::Device& device,
                               const fusedce::MatrixView& h, const fusedce::MatrixView& w, const fusedce::Options& o,
                               const fusedce::LinearOptions& lo, const fusedce::LinearGrads& grads) {
  const size_t bytes = fusedce::linear_cross_entropy_workspace_size(job, device, h.rows, h.cols, w.rows, h.dtype, o,
                                                                    lo, grads);
  return at::empty({static_cast<int64_t>(bytes)}, hidden.options().dtype(at::kByte));
}

inline fusedce::Workspace workspace_of(const Tensor& ws) {
  return ws.numel() > 0 ? fusedce::Workspace{ws.data_ptr(), static_cast<size_t>(ws.numel())} : fusedce::Workspace{};
}

// The GPU adds the bias in the product's epilogue, which reads it densely: a strided bias (a
// slice of a larger tensor) is copied first. Undefined when there is none.
inline Tensor contiguous_bias(const OptTensor& bias) { return bias.has_value() ? bias->contiguous() : Tensor(); }

inline void check_hidden_2d(const Tensor& hidden) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "fusedce: hidden must be 2-D (N, H), got shape ", hidden.sizes());
}

// ---- the ops ---------------------------------------------------------------------------------

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor> lce_fwd(
    const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& target,
    const OptTensor& class_weight, fusedce::Options o, int64_t shift_seq_len, int64_t chunk_budget_bytes,
    bool low_memory, bool skip_ignored, bool return_metrics) {
  check_hidden_2d(hidden);
  const LossOutputs outputs(hidden, hidden.size(0), o.reduction, return_metrics);
  Ctx ctx(hidden, "hidden");
  const fusedce::MatrixView h = linear_matrix_of(hidden, "hidden", "(N, H)");
  check_linear_inputs(hidden, weight, bias, target);
  const fusedce::MatrixView w = linear_matrix_of(weight, "weight", "(V, H)");
  o = with_class_weight(o, class_weight, "class_weight", hidden, "hidden");
  const fusedce::ForwardOutputs out = outputs.views(return_metrics, &o);
  const fusedce::LinearOptions lo = linear_only_options(shift_seq_len, chunk_budget_bytes, low_memory, skip_ignored);
  const Tensor ws = linear_workspace(hidden, fusedce::Job::kForward, ctx.device(), h, w, o, lo, {});
  const Tensor bias_c = contiguous_bias(bias);
  check_status(fusedce::linear_cross_entropy_forward(
                   ctx.device(), h, w, bias_c.defined() ? vector_of(bias_c, "bias") : fusedce::VectorView{},
                   vector_of(target, "target"), o, lo, out, workspace_of(ws)),
               "lce_fwd");
  return outputs.tuple();
}

// Forward with the gradients asked for (need_grad_*), for the upstream gradient grad_loss ((N,)
// for 'none', 0-D or (1,) otherwise; absent = 1). Gradients not asked for come back as empty
// (0,) tensors (a schema cannot return None).
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lce_fwd_bwd(
    const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& target,
    const OptTensor& class_weight, fusedce::Options o, int64_t shift_seq_len, int64_t chunk_budget_bytes,
    bool low_memory, bool skip_ignored, const OptTensor& grad_loss, bool return_metrics, bool need_grad_hidden,
    bool need_grad_weight, bool need_grad_bias) {
  check_hidden_2d(hidden);
  TORCH_CHECK_VALUE(weight.dim() == 2, "fusedce: weight must be 2-D (V, H), got shape ", weight.sizes());
  TORCH_CHECK_VALUE(!need_grad_bias || bias.has_value(), "fusedce: need_grad_bias is set but bias is not given");
  const LossOutputs outputs(hidden, hidden.size(0), o.reduction, return_metrics);
  // Each its own tensor: outputs of a functional op must not alias one another.
  auto none = [&] { return at::empty({0}, hidden.options()); };
  Tensor grad_hidden = need_grad_hidden ? at::empty(hidden.sizes(), hidden.options()) : none();
  Tensor grad_weight = need_grad_weight ? at::empty(weight.sizes(), weight.options()) : none();
  Tensor grad_bias = need_grad_bias ? at::empty(bias->sizes(), bias->options()) : none();

  Ctx ctx(hidden, "hidden");
  const fusedce::MatrixView h = linear_matrix_of(hidden, "hidden", "(N, H)");
  check_linear_inputs(hidden, weight, bias, target);
  const fusedce::MatrixView w = linear_matrix_of(weight, "weight", "(V, H)");
  o = with_class_weight(o, class_weight, "class_weight", hidden, "hidden");
  const fusedce::ForwardOutputs out = outputs.views(return_metrics, &o);
  fusedce::VectorView g;
  if (grad_loss.has_value()) {
    check_same_device(*grad_loss, "grad_loss", hidden, "hidden");
    g = vector_of(*grad_loss, "grad_loss");
  }
  fusedce::LinearGrads grads;
  if (need_grad_hidden) grads.grad_hidden = linear_matrix_of(grad_hidden, "grad_hidden", "(N, H)");
  if (need_grad_weight) grads.grad_weight = linear_matrix_of(grad_weight, "grad_weight", "(V, H)");
  if (need_grad_bias) grads.grad_bias = vector_of(grad_bias, "grad_bias");
  const fusedce::LinearOptions lo = linear_only_options(shift_seq_len, chunk_budget_bytes, low_memory, skip_ignored);
  const Tensor ws = linear_workspace(hidden, fusedce::Job::kForwardBackward, ctx.device(), h, w, o, lo, grads);
  const Tensor bias_c = contiguous_bias(bias);
  check_status(fusedce::linear_cross_entropy_forward_backward(
                   ctx.device(), h, w, bias_c.defined() ? vector_of(bias_c, "bias") : fusedce::VectorView{},
                   vector_of(target, "target"), o, lo, out, g, grads, workspace_of(ws)),
               "lce_fwd_bwd");
  return {outputs.loss, outputs.lse, outputs.num_correct, outputs.entropy_sum, grad_hidden, grad_weight, grad_bias};
}

}  // namespace fusedce_torch
