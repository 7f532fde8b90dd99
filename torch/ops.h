// The kernels behind the fusedce torch ops: wrap tensors into the core's views, check what the
// core cannot see (devices, dimensions, strides of torch tensors), call the core, and turn a
// non-ok Status into a Python exception. No arithmetic on tensor data happens here.
//
// Each op is a template over a device context `Ctx` (binding.cpp: CPU, binding_cuda.cpp: CUDA;
// the op list and schemas in registry.h)
// that provides:
//   Ctx ctx(const at::Tensor& like, const char* name);  // device guard for `like`'s device,
//                                      // held for the call; `name` for error messages
//   fusedce::Device ctx.device();      // the core's device handle (CUDA: the current stream)
// Workspace comes from torch's allocator (the caching allocator on CUDA), sized by
// cross_entropy_workspace_size, and lives until the call returns; the caching allocator orders
// its reuse on the current stream.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <fusedce/fusedce.h>

#include <string>
#include <tuple>
#include <vector>

#include "options.h"

namespace fusedce_torch {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

// ---- conversions and checks ---------------------------------------------------------------

inline fusedce::DType dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return fusedce::DType::kFloat32;
    case at::kBFloat16: return fusedce::DType::kBFloat16;
    case at::kHalf: return fusedce::DType::kFloat16;
    case at::kInt: return fusedce::DType::kInt32;
    case at::kLong: return fusedce::DType::kInt64;
    default:
      TORCH_CHECK_VALUE(false, "fusedce: ", name, " has dtype ", t.scalar_type(),
                        ", which fusedce does not take");
  }
  return fusedce::DType::kFloat32;  // unreachable
}

inline void check_float(const Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK_VALUE(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, "fusedce: ", name,
                    " must be float32, bfloat16 or float16, got ", s);
}

inline void check_same_device(const Tensor& t, const char* name, const Tensor& ref,
                              const char* ref_name = "logits") {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "fusedce: ", name, " is on ", t.device(), " but ",
                    ref_name, " are on ", ref.device());
}

// (rows, V) with unit stride along V; rows may be strided.
inline fusedce::MatrixView matrix_of(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2, "fusedce: ", name, " must be 2-D (rows, V), got ", t.dim(),
                    "-D of shape ", t.sizes());
  check_float(t, name);
  const int64_t rows = t.size(0), cols = t.size(1);
  TORCH_CHECK_VALUE(cols <= 1 || t.stride(1) == 1, "fusedce: ", name,
                    " must have unit stride along its last dimension, got strides ", t.strides());
  const int64_t row_stride = rows > 1 ? t.stride(0) : cols;
  TORCH_CHECK_VALUE(rows <= 1 || row_stride >= cols, "fusedce: ", name, " rows overlap (strides ",
                    t.strides(), " for shape ", t.sizes(), ")");
  return fusedce::matrix(t.numel() > 0 ? const_cast<void*>(t.const_data_ptr()) : nullptr,
                         dtype_of(t, name), rows, cols, row_stride);
}

inline fusedce::VectorView vector_of(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() <= 1, "fusedce: ", name, " must be 0-D or 1-D, got shape ", t.sizes());
  const int64_t stride = t.dim() == 1 && t.numel() > 1 ? t.stride(0) : 1;
  return fusedce::vector(t.numel() > 0 ? const_cast<void*>(t.const_data_ptr()) : nullptr,
                         dtype_of(t, name), t.numel(), stride);
}

inline void check_status(const fusedce::Status& s, const char* op) {
  if (s.ok()) return;
  switch (s.code()) {
    case fusedce::StatusCode::kInvalidArgument:
    case fusedce::StatusCode::kTargetOutOfRange:
      TORCH_CHECK_VALUE(false, "fusedce.", op, ": ", s.message());
      break;
    default:
      TORCH_CHECK(false, "fusedce.", op, ": ", s.message());
  }
}

inline void check_inputs(const Tensor& logits, const Tensor& target) {
  check_same_device(target, "target", logits);
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
                    "fusedce: target must be int64 or int32 class indices, got ",
                    target.scalar_type());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == logits.size(0),
                    "fusedce: target must be 1-D with one entry per row of logits (",
                    logits.size(0), "), got shape ", target.sizes());
}

template <class Ctx>
fusedce::Workspace workspace_for(fusedce::Job job, Ctx& ctx, const Tensor& like, int64_t rows,
                                 int64_t vocab, const fusedce::Options& o, Tensor* holder) {
  const size_t bytes = fusedce::cross_entropy_workspace_size(job, ctx.device(), rows, vocab, o);
  if (bytes == 0) return {};
  *holder = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  return fusedce::Workspace{holder->data_ptr(), bytes};
}

// ---- helpers: run the core into given buffers ---------------------------------------------
//
// Every op that takes the options takes them as one fusedce::Options `o` (the schema's six
// arguments, converted by schema_kernel in options.h); the class weights are attached here.

// float32 loss of `rows` rows: (rows,) for 'none', 0-D otherwise.
inline Tensor empty_loss(const Tensor& like, int64_t rows, fusedce::Reduction reduction) {
  const auto opts = like.options().dtype(at::kFloat);
  return reduction == fusedce::Reduction::kNone ? at::empty({rows}, opts) : at::empty({}, opts);
}

// What the loss ops return besides a gradient: loss, lse (N,), and num_correct (int64) and
// entropy_sum (float32), 0-D when return_metrics is set, else empty (0,) tensors that cost
// nothing (a schema cannot return None).
struct LossOutputs {
  Tensor loss, lse, num_correct, entropy_sum;

  LossOutputs(const Tensor& like, int64_t rows, fusedce::Reduction reduction, bool return_metrics)
      : loss(empty_loss(like, rows, reduction)), lse(at::empty({rows}, like.options().dtype(at::kFloat))) {
    const std::vector<int64_t> shape = return_metrics ? std::vector<int64_t>{} : std::vector<int64_t>{0};
    num_correct = at::empty(shape, like.options().dtype(at::kLong));
    entropy_sum = at::empty(shape, like.options().dtype(at::kFloat));
  }

  // The core's view of them; sets o->return_metrics (the core's name for return_metrics).
  fusedce::ForwardOutputs views(bool return_metrics, fusedce::Options* o) const {
    fusedce::ForwardOutputs out;
    out.loss = vector_of(loss, "loss");
    out.lse = vector_of(lse, "lse");
    o->return_metrics = return_metrics;
    if (return_metrics) {
      out.num_correct = vector_of(num_correct, "num_correct");
      out.entropy_sum = vector_of(entropy_sum, "entropy_sum");
    }
    return out;
  }

  std::tuple<Tensor, Tensor, Tensor, Tensor> tuple() const { return {loss, lse, num_correct, entropy_sum}; }
};

inline void check_logits_2d(const Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "fusedce: logits must be 2-D (rows, V), got shape ", logits.sizes());
}

// Forward with the gradient for an upstream gradient of 1 in the same sweep, into `dlogits`:
// a buffer of the logits' shape, or (inplace_backward) the logits themselves.
template <class Ctx>
void ce_fwd_bwd_into(const Tensor& logits, const Tensor& target, const OptTensor& class_weight,
                     fusedce::Options o, bool return_metrics, const LossOutputs& outputs, const Tensor& dlogits,
                     bool inplace_backward, const char* op) {
  Ctx ctx(logits, "logits");
  const fusedce::MatrixView x = matrix_of(logits, "logits");
  check_inputs(logits, target);
  o = with_class_weight(o, class_weight, "class_weight", logits, "logits");
  o.inplace_backward = inplace_backward;
  const fusedce::ForwardOutputs out = outputs.views(return_metrics, &o);
  const fusedce::MatrixView dx = matrix_of(dlogits, "dlogits");
  Tensor ws_holder;
  const fusedce::Workspace ws =
      workspace_for(fusedce::Job::kForwardBackward, ctx, logits, x.rows, x.cols, o, &ws_holder);
  check_status(fusedce::cross_entropy_forward_backward(ctx.device(), x, vector_of(target, "target"),
                                                       o, out, /*grad_loss=*/{}, dx, ws),
               op);
}

// ---- the ops ---------------------------------------------------------------------------------

// ce_loss's device kernel: the forward alone (its Autograd kernel, autograd.h, runs ce_fwd_bwd
// instead when the logits require grad).
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor> ce_loss(const Tensor& logits, const Tensor& target,
                                                  const OptTensor& class_weight, fusedce::Options o,
                                                  bool return_metrics) {
  check_logits_2d(logits);
  const LossOutputs outputs(logits, logits.size(0), o.reduction, return_metrics);
  Ctx ctx(logits, "logits");
  const fusedce::MatrixView x = matrix_of(logits, "logits");
  check_inputs(logits, target);
  o = with_class_weight(o, class_weight, "class_weight", logits, "logits");
  const fusedce::ForwardOutputs out = outputs.views(return_metrics, &o);
  Tensor ws_holder;
  const fusedce::Workspace ws =
      workspace_for(fusedce::Job::kForward, ctx, logits, x.rows, x.cols, o, &ws_holder);
  check_status(fusedce::cross_entropy_forward(ctx.device(), x, vector_of(target, "target"), o, out, ws),
               "ce_loss");
  return outputs.tuple();
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> ce_fwd_bwd(const Tensor& logits, const Tensor& target,
                                                              const OptTensor& class_weight, fusedce::Options o,
                                                              bool return_metrics) {
  check_logits_2d(logits);
  const LossOutputs outputs(logits, logits.size(0), o.reduction, return_metrics);
  Tensor dlogits = at::empty(logits.sizes(), logits.options());
  ce_fwd_bwd_into<Ctx>(logits, target, class_weight, o, return_metrics, outputs, dlogits,
                       /*inplace_backward=*/false, "ce_fwd_bwd");
  return {outputs.loss, outputs.lse, outputs.num_correct, outputs.entropy_sum, dlogits};
}

// ce_fwd_bwd with the gradient written over the logits (the schema marks them mutated).
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor> ce_fwd_bwd_(const Tensor& logits, const Tensor& target,
                                                       const OptTensor& class_weight, fusedce::Options o,
                                                       bool return_metrics) {
  check_logits_2d(logits);
  const LossOutputs outputs(logits, logits.size(0), o.reduction, return_metrics);
  ce_fwd_bwd_into<Ctx>(logits, target, class_weight, o, return_metrics, outputs, logits,
                       /*inplace_backward=*/true, "ce_fwd_bwd_");
  return outputs.tuple();
}

// dlogits *= grad_loss (per row for (N,), else one factor), in place.
template <class Ctx>
void ce_rescale_(const Tensor& grad_loss, const Tensor& dlogits) {
  Ctx ctx(dlogits, "dlogits");
  check_same_device(grad_loss, "grad_loss", dlogits, "dlogits");
  const fusedce::MatrixView dx = matrix_of(dlogits, "dlogits");
  TORCH_CHECK_VALUE(grad_loss.scalar_type() == at::kFloat, "fusedce: grad_loss must be float32, got ",
                    grad_loss.scalar_type());
  Tensor ws_holder;
  const fusedce::Workspace ws =
      workspace_for(fusedce::Job::kRescale, ctx, dlogits, dx.rows, dx.cols, fusedce::Options{}, &ws_holder);
  check_status(fusedce::cross_entropy_rescale_grad(ctx.device(), vector_of(grad_loss, "grad_loss"), dx, ws),
               "ce_rescale_");
}

}  // namespace fusedce_torch
