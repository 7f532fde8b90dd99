// The fusedce torch library: every schema, and the CPU kernels. The CUDA kernels of the same ops
// are registered by binding_cuda.cpp when the extension is built with CUDA. Fake (meta)
// kernels and autograd formulas are registered from Python (python/fusedce/ops.py).
//
// Out variants (*_out, ce_fwd_bwd_inplace, ce_rescale_) only write into the buffers they are
// given, as their mutation annotations say; functional variants allocate their outputs and are
// the ones autograd and torch.compile see.
//
// Shared arguments: ignore_index, reduction ('none' | 'sum' | 'mean'), label_smoothing,
// logit_scale, softcap (0 = off), z_loss, as in docs/contract.md. logits are 2-D (N, V) with unit
// stride along V (rows may be strided); target is (N,) int64 / int32; weight is float32 (V,).
// loss is float32, (N,) for 'none' and 0-D otherwise; lse is float32 (N,); num_correct
// (int64) and entropy_sum (float32) are 0-D, and are written only when both are given (out
// variants) or compute_metrics is set (functional variants, which otherwise return them
// empty, of shape (0,)).
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops_namespace.h"

#include "linear_ops.h"
#include "ops.h"

namespace fusedce_torch {
namespace {

struct CpuContext {
  CpuContext(const Tensor&, const char*) {}
  // The core's thread pool, capped at torch's intra-op thread count.
  fusedce::Device device() const { return fusedce::Device::cpu(at::get_num_threads()); }
};

// ADInplaceOrView kernel of every op that writes into its arguments: run the op, then bump the
// version counter of each tensor it wrote (what PyTorch's own in-place ops do), so autograd
// notices when a tensor it saved for a backward has been overwritten.
void bump_versions_of_written(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                              torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  std::vector<Tensor> written;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    const c10::IValue& value = (*stack)[first + i];
    if (alias != nullptr && alias->isWrite() && value.isTensor()) written.push_back(value.toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const Tensor& t : written) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace
}  // namespace fusedce_torch

#define FUSEDCE_CE_ARGS                                                                     \
  "int ignore_index, str reduction, float label_smoothing, float logit_scale, float softcap, " \
  "float z_loss"

#define FUSEDCE_LCE_ARGS                                                                       \
  "Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, " FUSEDCE_CE_ARGS \
  ", int shift_seq_len, int chunk_budget_bytes, bool low_memory, bool skip_ignored"

FUSEDCE_TORCH_LIBRARY(m) {
  m.def("ce_fwd_out(Tensor logits, Tensor target, Tensor? weight, " FUSEDCE_CE_ARGS
        ", Tensor(a!) loss, Tensor(b!) lse, Tensor(c!)? num_correct, Tensor(d!)? entropy_sum) -> ()");
  m.def("ce_fwd_bwd_out(Tensor logits, Tensor target, Tensor? weight, " FUSEDCE_CE_ARGS
        ", Tensor(a!) loss, Tensor(b!) lse, Tensor(c!)? num_correct, Tensor(d!)? entropy_sum, "
        "Tensor(e!) dlogits) -> ()");
  m.def("ce_fwd_bwd_inplace(Tensor(e!) logits, Tensor target, Tensor? weight, " FUSEDCE_CE_ARGS
        ", Tensor(a!) loss, Tensor(b!) lse, Tensor(c!)? num_correct, Tensor(d!)? entropy_sum) -> ()");
  m.def("ce_bwd_out(Tensor logits, Tensor target, Tensor? weight, Tensor lse, Tensor grad_loss, "
        FUSEDCE_CE_ARGS ", Tensor(a!) dlogits) -> ()");
  m.def("ce_rescale_(Tensor grad_loss, Tensor(a!) dlogits) -> ()");

  m.def("ce_fwd(Tensor logits, Tensor target, Tensor? weight, " FUSEDCE_CE_ARGS
        ", bool compute_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum)");
  m.def("ce_fwd_bwd(Tensor logits, Tensor target, Tensor? weight, " FUSEDCE_CE_ARGS
        ", bool compute_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum, "
        "Tensor dlogits)");
  m.def("ce_bwd(Tensor logits, Tensor target, Tensor? weight, Tensor lse, Tensor grad_loss, "
        FUSEDCE_CE_ARGS ") -> Tensor");

  m.def("lce_fwd_out(" FUSEDCE_LCE_ARGS
        ", Tensor(a!) loss, Tensor(b!) lse, Tensor(c!)? num_correct, Tensor(d!)? entropy_sum) -> ()");
  m.def("lce_fwd_bwd_out(" FUSEDCE_LCE_ARGS
        ", Tensor? grad_loss, Tensor(a!) loss, Tensor(b!) lse, Tensor(c!)? num_correct, "
        "Tensor(d!)? entropy_sum, Tensor(e!)? grad_hidden, Tensor(f!)? grad_weight, Tensor(g!)? grad_bias) -> ()");
  m.def("lce_fwd(" FUSEDCE_LCE_ARGS
        ", bool compute_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum)");
  m.def("lce_fwd_bwd(" FUSEDCE_LCE_ARGS
        ", Tensor? grad_loss, bool compute_metrics, bool need_grad_hidden, bool need_grad_weight, "
        "bool need_grad_bias) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum, "
        "Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

FUSEDCE_TORCH_LIBRARY_IMPL(CPU, m) {
  using Ctx = fusedce_torch::CpuContext;
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
}

FUSEDCE_TORCH_LIBRARY_IMPL(ADInplaceOrView, m) {
  // lp_bwd_ is defined in lp_binding.cpp
  for (const char* op : {"ce_fwd_out", "ce_fwd_bwd_out", "ce_fwd_bwd_inplace", "ce_bwd_out", "ce_rescale_",
                         "lce_fwd_out", "lce_fwd_bwd_out", "lp_bwd_"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&fusedce_torch::bump_versions_of_written>());
  }
}
