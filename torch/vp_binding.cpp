// The vocabulary-parallel ops of the fusedce torch library: schemas and CPU kernels of the three
// steps of fusedce/vocab_parallel.h (kernels in vp_ops.h). Fake kernels are registered from
// Python (python/fusedce/vp_ops.py); the ops have no autograd formula of their own: the
// autograd.Functions of python/fusedce/distributed.py call ce_shard_bwd in their backward.
//
// All three are functional (they allocate their outputs). Arguments shared with binding.cpp:
// logits (N, V_local) with unit stride along V; target (N,) int64 / int32 of *global* class
// indices; weight the local slice (V_local,) of the class weights, float32; then vocab_start
// (global index of the local first column) and vocab_total (V of the full vocabulary), and the
// options (docs/contract.md, "Options") as in binding.cpp.
//
//   ce_shard_stats -> stats (N + 1, 9) float32: per-row partial statistics of the shard
//   ce_shard_merge(gathered = every rank's stats, concatenated in rank order)
//                  -> loss, lse, num_correct, entropy_sum (as ce_fwd returns them),
//                     row_weight (N,), batch (2,): what ce_shard_bwd needs
//   ce_shard_bwd   -> dlogits (N, V_local) in the logits' dtype
//
// The linear form (hidden (N, H), weight (V_local, H) this rank's rows of the head, bias
// (V_local,) or None, class_weight the local slice; then the shard and options as above and the
// linear options chunk_budget_bytes, low_memory, skip_ignored of the lce_* ops):
//   lce_shard_stats -> stats (N + 1, 9) float32, as ce_shard_stats of hidden @ weight.T + bias
//   lce_shard_bwd   -> grad_hidden (N, H) float32 (this rank's part), grad_weight, grad_bias
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops_namespace.h"

#include "vp_ops.h"

namespace fusedce_torch {
namespace {

struct VpCpuContext {
  VpCpuContext(const Tensor&, const char*) {}
  fusedce::Device device() const { return fusedce::Device::cpu(at::get_num_threads()); }
};

}  // namespace
}  // namespace fusedce_torch

#define FUSEDCE_VP_ARGS                                                                          \
  "int vocab_start, int vocab_total, int ignore_index, str reduction, float label_smoothing, " \
  "float logit_scale, float softcap, float z_loss"

FUSEDCE_TORCH_LIBRARY_FRAGMENT(m) {
  m.def("ce_shard_stats(Tensor logits, Tensor target, Tensor? weight, " FUSEDCE_VP_ARGS
        ", bool compute_metrics) -> Tensor");
  m.def("ce_shard_merge(Tensor gathered, Tensor target, Tensor? weight, " FUSEDCE_VP_ARGS
        ", bool compute_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum, "
        "Tensor row_weight, Tensor batch)");
  m.def("ce_shard_bwd(Tensor logits, Tensor target, Tensor? weight, Tensor lse, Tensor row_weight, "
        "Tensor batch, Tensor grad_loss, " FUSEDCE_VP_ARGS ") -> Tensor");
  m.def("lce_shard_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, "
        FUSEDCE_VP_ARGS ", int chunk_budget_bytes, bool low_memory, bool skip_ignored, bool compute_metrics) -> Tensor");
  m.def("lce_shard_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, "
        "Tensor lse, Tensor row_weight, Tensor batch, Tensor grad_loss, " FUSEDCE_VP_ARGS
        ", int chunk_budget_bytes, bool low_memory, bool skip_ignored, bool need_grad_hidden, "
        "bool need_grad_weight, bool need_grad_bias) -> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

FUSEDCE_TORCH_LIBRARY_IMPL(CPU, m) {
  using Ctx = fusedce_torch::VpCpuContext;
  m.impl("ce_shard_stats", &fusedce_torch::ce_shard_stats<Ctx>);
  m.impl("ce_shard_merge", &fusedce_torch::ce_shard_merge<Ctx>);
  m.impl("ce_shard_bwd", &fusedce_torch::ce_shard_bwd<Ctx>);
  m.impl("lce_shard_stats", &fusedce_torch::lce_shard_stats<Ctx>);
  m.impl("lce_shard_bwd", &fusedce_torch::lce_shard_bwd<Ctx>);
}
