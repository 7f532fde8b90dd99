// The log-probability ops of the fusedce torch library: schemas and CPU kernels of the three
// steps of fusedce/logprobs.h (kernels in lp_ops.h). Fake kernels are registered from Python
// (python/fusedce/lp_ops.py); the ops have no autograd formula of their own: the
// autograd.Functions of python/fusedce/token_logprobs.py call lp_bwd / llp_bwd in their backward,
// because a gradient needs the merged statistics, which the step-1 op does not see.
//
// Shared arguments: target (N,) int64 / int32 of global class indices (or ignore_index);
// vocab_start, vocab_total: where the local columns sit (0 and V for a whole vocabulary);
// temperature (z = logits / temperature); ignore_index.
//
//   lp_stats(logits (N, V_local))            -> stats (N + 1, 9) float32
//   llp_stats(hidden (N, H), weight (V_local, H), bias (V_local,)?, ..., chunk_budget_bytes)
//                                            -> stats (N + 1, 9) float32
//   lp_merge(gathered = every rank's stats in rank order)
//                                            -> logprob, entropy, lse: float32 (N,)
//   lp_bwd(logits, ..., grad_logprob (N,), grad_entropy (N,)?) -> dlogits (N, V_local)
//   lp_bwd_(logits, ...)                     -> (): dlogits written over the logits
//   llp_bwd(hidden, weight, bias, ...)       -> grad_hidden (N, H) float32 (this rank's part),
//                                               grad_weight, grad_bias (or empty (0,))
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops_namespace.h"

#include "lp_ops.h"

namespace fusedce_torch {
namespace {

struct LpCpuContext {
  LpCpuContext(const Tensor&, const char*) {}
  fusedce::Device device() const { return fusedce::Device::cpu(at::get_num_threads()); }
};

}  // namespace
}  // namespace fusedce_torch

#define FUSEDCE_LP_ARGS "int vocab_start, int vocab_total, float temperature, int ignore_index"

FUSEDCE_TORCH_LIBRARY_FRAGMENT(m) {
  m.def("lp_stats(Tensor logits, Tensor target, " FUSEDCE_LP_ARGS ") -> Tensor");
  m.def("llp_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, " FUSEDCE_LP_ARGS
        ", int chunk_budget_bytes) -> Tensor");
  m.def("lp_merge(Tensor gathered, Tensor target, " FUSEDCE_LP_ARGS
        ") -> (Tensor logprob, Tensor entropy, Tensor lse)");
  m.def("lp_bwd(Tensor logits, Tensor target, Tensor lse, Tensor logprob, Tensor entropy, Tensor grad_logprob, "
        "Tensor? grad_entropy, " FUSEDCE_LP_ARGS ") -> Tensor");
  m.def("lp_bwd_(Tensor(a!) logits, Tensor target, Tensor lse, Tensor logprob, Tensor entropy, "
        "Tensor grad_logprob, Tensor? grad_entropy, " FUSEDCE_LP_ARGS ") -> ()");
  m.def("llp_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor lse, Tensor logprob, "
        "Tensor entropy, Tensor grad_logprob, Tensor? grad_entropy, " FUSEDCE_LP_ARGS
        ", int chunk_budget_bytes, bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) -> "
        "(Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

FUSEDCE_TORCH_LIBRARY_IMPL(CPU, m) {
  using Ctx = fusedce_torch::LpCpuContext;
  m.impl("lp_stats", &fusedce_torch::lp_stats<Ctx>);
  m.impl("llp_stats", &fusedce_torch::llp_stats<Ctx>);
  m.impl("lp_merge", &fusedce_torch::lp_merge<Ctx>);
  m.impl("lp_bwd", &fusedce_torch::lp_bwd<Ctx>);
  m.impl("lp_bwd_", &fusedce_torch::lp_bwd_<Ctx>);
  m.impl("llp_bwd", &fusedce_torch::llp_bwd<Ctx>);
}
