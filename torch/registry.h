// Every op of the fusedce torch library, written once: its schema and its kernel, a template over
// the device context (binding.cpp: CPU, binding_cuda.cpp: CUDA). define_ops registers the schemas
// with the CPU kernels and the ADInplaceOrView kernels; register_kernels adds another device's.
// Fake (meta) kernels and autograd formulas are registered from Python, beside each other
// (python/fusedce/ops.py, linear_ops.py, vp_ops.py, lp_ops.py); ce_loss's autograd is C++
// (autograd.h, for host time: docs/architecture.md, "Autograd").
//
// Every op on a front end's path is here, and no other. The ops allocate their outputs; an op whose
// name ends in '_' also writes over its first tensor argument (its schema marks it mutated).
// Argument names are the glossary's (docs/architecture.md, "One name per concept").
//
// Shared arguments: the options FUSEDCE_CE_ARGS (options.h; docs/contract.md, "Options").
// logits are 2-D (N, V) with unit stride along V (rows may be strided); target is (N,) int64 /
// int32; class_weight is float32 (V,) or None. loss is float32, (N,) for 'none' and 0-D
// otherwise; lse is float32 (N,); num_correct (int64) and entropy_sum (float32) are 0-D when
// return_metrics is set, and empty, of shape (0,), otherwise.
//
//   ce_loss     -> loss, lse, num_correct, entropy_sum: fusedce.cross_entropy's op. Its Autograd
//                  kernel (autograd.h) runs ce_fwd_bwd when the logits require grad and keeps
//                  dlogits for its backward, which scales it with ce_rescale_.
//   ce_fwd_bwd  -> the same and dlogits (N, V), the gradient for an upstream gradient of 1
//   ce_fwd_bwd_ -> the same as ce_loss, dlogits written over the logits (inplace_backward)
//   ce_rescale_(grad_loss, dlogits): dlogits *= grad_loss, per row for 'none'
//
// The linear ops (lce_*) take hidden (N, H), weight (V, H) (the head), bias (V,) or None,
// target (N,), class_weight (V,) or None, the options, then the linear options shift_seq_len,
// chunk_budget_bytes, low_memory, skip_ignored.
//
// The vocabulary-parallel ops (the three steps of fusedce/vocab_parallel.h) take logits
// (N, V_local) and target (N,) of *global* class indices, class_weight the local slice
// (V_local,), then vocab_start (global index of the local first column), vocab_total (V of the
// full vocabulary) and the options:
//   ce_shard_stats -> stats (N + 1, 9) float32: per-row partial statistics of the shard
//   ce_shard_merge(gathered = every rank's stats, concatenated in rank order)
//                  -> loss, lse, num_correct, entropy_sum (as ce_loss returns them),
//                     row_weight (N,), batch (2,): what ce_shard_bwd needs
//   ce_shard_bwd   -> dlogits (N, V_local) in the logits' dtype
// The linear form (hidden (N, H), weight (V_local, H) this rank's rows of the head, bias
// (V_local,) or None, target (N,) unshifted, class_weight the local slice; then the shard, the
// options and the four linear options of the lce_* ops):
//   lce_shard_stats -> stats (N + 1, 9) float32, as ce_shard_stats of hidden @ weight.T + bias
//   lce_shard_merge -> as ce_shard_merge, over the effective (shifted) targets
//   lce_shard_bwd   -> grad_hidden (N, H) float32 (this rank's part), grad_weight, grad_bias
// They have no autograd formula: the autograd.Functions of python/fusedce/distributed.py call
// the step-3 ops in their backward, because a gradient needs every rank's merged statistics.
//
// The log-probability ops (the three steps of fusedce/logprobs.h) take target (N,) of global
// class indices (or ignore_index), vocab_start, vocab_total (0 and V for a whole vocabulary),
// temperature (z = logits / temperature), ignore_index and distribution_stats (step 1 also
// gathers what lp_distribution_stats reads):
//   lp_stats(logits (N, V_local))            -> stats (N + 1, 9) float32
//   llp_stats(hidden (N, H), weight (V_local, H), bias (V_local,)?, ..., chunk_budget_bytes)
//                                            -> stats (N + 1, 9) float32
//   lp_merge(gathered = every rank's stats in rank order)
//                                            -> logprob, entropy, lse: float32 (N,)
//   lp_distribution_stats(gathered, ...)     -> log_sum_sq_probs, mean_logit, is_top1 (1 / 0): float32 (N,)
//   lp_bwd(logits, ..., grad_logprob (N,), grad_entropy (N,)?) -> dlogits (N, V_local)
//   lp_bwd_(logits, ...)                     -> (): dlogits written over the logits
//   llp_bwd(hidden, weight, bias, ...)       -> grad_hidden (N, H) float32 (this rank's part),
//                                               grad_weight, grad_bias (or empty (0,))
// No autograd formula either: python/fusedce/token_logprobs.py calls lp_bwd / llp_bwd.
//
// The distillation ops (ld_fwd / ld_bwd / ld_fwd_bwd with a teacher head, ldk_* with its top-k,
// and the vocabulary-parallel steps ld_shard_stats / ld_shard_parts / ld_shard_reduce /
// ld_shard_bwd, ldk_shard_* for the top-k teacher): torch/distill_ops.h; their autograd is
// python/fusedce/distillation.py's.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "autograd.h"
#include "distill_ops.h"
#include "linear_ops.h"
#include "lp_ops.h"
#include "ops.h"
#include "options.h"
#include "vp_ops.h"

#define FUSEDCE_LINEAR_ARGS ", int shift_seq_len, int chunk_budget_bytes, bool low_memory, bool skip_ignored"

#define FUSEDCE_LCE_ARGS                                                                       \
  "Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, " FUSEDCE_CE_ARGS \
  FUSEDCE_LINEAR_ARGS

#define FUSEDCE_VP_ARGS "int vocab_start, int vocab_total, " FUSEDCE_CE_ARGS

#define FUSEDCE_LP_ARGS "int vocab_start, int vocab_total, float temperature, int ignore_index, bool distribution_stats"

namespace fusedce_torch {

// The dispatcher's handle on `kernel` (schema_kernel: the options as the schema spells them).
template <auto kernel>
torch::CppFunction cpp_function() {
  constexpr auto f = schema_kernel<kernel>();
  return torch::CppFunction(c10::CompileTimeFunctionPointer<std::remove_pointer_t<decltype(f)>, f>());
}

// Calls add(schema, kernel) for every op, in one list: the schemas and the kernels for Ctx.
template <class Ctx, class Add>
void for_each_op(Add&& add) {
  // cross-entropy over logits
  add("ce_loss(Tensor logits, Tensor target, Tensor? class_weight, " FUSEDCE_CE_ARGS
      ", bool return_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum)",
      cpp_function<&ce_loss<Ctx>>());
  add("ce_fwd_bwd(Tensor logits, Tensor target, Tensor? class_weight, " FUSEDCE_CE_ARGS
      ", bool return_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum, "
      "Tensor dlogits)",
      cpp_function<&ce_fwd_bwd<Ctx>>());
  add("ce_fwd_bwd_(Tensor(a!) logits, Tensor target, Tensor? class_weight, " FUSEDCE_CE_ARGS
      ", bool return_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum)",
      cpp_function<&ce_fwd_bwd_<Ctx>>());
  add("ce_rescale_(Tensor grad_loss, Tensor(a!) dlogits) -> ()", cpp_function<&ce_rescale_<Ctx>>());

  // linear cross-entropy
  add("lce_fwd(" FUSEDCE_LCE_ARGS
      ", bool return_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum)",
      cpp_function<&lce_fwd<Ctx>>());
  add("lce_fwd_bwd(" FUSEDCE_LCE_ARGS
      ", Tensor? grad_loss, bool return_metrics, bool need_grad_hidden, bool need_grad_weight, "
      "bool need_grad_bias) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum, "
      "Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)",
      cpp_function<&lce_fwd_bwd<Ctx>>());

  // vocabulary-parallel steps
  add("ce_shard_stats(Tensor logits, Tensor target, Tensor? class_weight, " FUSEDCE_VP_ARGS
      ", bool return_metrics) -> Tensor",
      cpp_function<&ce_shard_stats<Ctx>>());
  add("ce_shard_merge(Tensor gathered, Tensor target, Tensor? class_weight, " FUSEDCE_VP_ARGS
      ", bool return_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum, "
      "Tensor row_weight, Tensor batch)",
      cpp_function<&ce_shard_merge<Ctx>>());
  add("ce_shard_bwd(Tensor logits, Tensor target, Tensor? class_weight, Tensor lse, Tensor row_weight, "
      "Tensor batch, Tensor grad_loss, " FUSEDCE_VP_ARGS ") -> Tensor",
      cpp_function<&ce_shard_bwd<Ctx>>());
  add("lce_shard_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, "
      FUSEDCE_VP_ARGS FUSEDCE_LINEAR_ARGS ", bool return_metrics) -> Tensor",
      cpp_function<&lce_shard_stats<Ctx>>());
  add("lce_shard_merge(Tensor gathered, Tensor target, Tensor? class_weight, " FUSEDCE_VP_ARGS FUSEDCE_LINEAR_ARGS
      ", bool return_metrics) -> (Tensor loss, Tensor lse, Tensor num_correct, Tensor entropy_sum, "
      "Tensor row_weight, Tensor batch)",
      cpp_function<&lce_shard_merge<Ctx>>());
  add("lce_shard_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, "
      "Tensor lse, Tensor row_weight, Tensor batch, Tensor grad_loss, " FUSEDCE_VP_ARGS FUSEDCE_LINEAR_ARGS
      ", bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) -> (Tensor grad_hidden, "
      "Tensor grad_weight, Tensor grad_bias)",
      cpp_function<&lce_shard_bwd<Ctx>>());

  // log-probabilities
  add("lp_stats(Tensor logits, Tensor target, " FUSEDCE_LP_ARGS ") -> Tensor", cpp_function<&lp_stats<Ctx>>());
  add("llp_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, " FUSEDCE_LP_ARGS
      ", int chunk_budget_bytes) -> Tensor",
      cpp_function<&llp_stats<Ctx>>());
  add("lp_merge(Tensor gathered, Tensor target, " FUSEDCE_LP_ARGS ") -> (Tensor logprob, Tensor entropy, Tensor lse)",
      cpp_function<&lp_merge<Ctx>>());
  add("lp_distribution_stats(Tensor gathered, Tensor target, " FUSEDCE_LP_ARGS
      ") -> (Tensor log_sum_sq_probs, Tensor mean_logit, Tensor is_top1)",
      cpp_function<&lp_distribution_stats<Ctx>>());
  add("lp_bwd(Tensor logits, Tensor target, Tensor lse, Tensor logprob, Tensor entropy, Tensor grad_logprob, "
      "Tensor? grad_entropy, " FUSEDCE_LP_ARGS ") -> Tensor",
      cpp_function<&lp_bwd<Ctx>>());
  add("lp_bwd_(Tensor(a!) logits, Tensor target, Tensor lse, Tensor logprob, Tensor entropy, "
      "Tensor grad_logprob, Tensor? grad_entropy, " FUSEDCE_LP_ARGS ") -> ()",
      cpp_function<&lp_bwd_<Ctx>>());
  add("llp_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor lse, Tensor logprob, "
      "Tensor entropy, Tensor grad_logprob, Tensor? grad_entropy, " FUSEDCE_LP_ARGS
      ", int chunk_budget_bytes, bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) -> "
      "(Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)",
      cpp_function<&llp_bwd<Ctx>>());

  // distillation (distill_ops.h): a teacher head (ld_*) or its top-k (ldk_*)
  add("ld_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_hidden, Tensor teacher_weight, "
      "Tensor? teacher_bias, Tensor? labels, " FUSEDCE_DISTILL_ARGS ")" FUSEDCE_DISTILL_OUT,
      cpp_function<&ld_fwd<Ctx>>());
  add("ld_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_hidden, Tensor teacher_weight, "
      "Tensor? teacher_bias, Tensor? labels, Tensor stats, Tensor grad_loss, " FUSEDCE_DISTILL_ARGS FUSEDCE_DISTILL_GRADS,
      cpp_function<&ld_bwd<Ctx>>());
  add("ld_fwd_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_hidden, Tensor teacher_weight, "
      "Tensor? teacher_bias, Tensor? labels, " FUSEDCE_DISTILL_ARGS FUSEDCE_DISTILL_FWD_BWD_OUT,
      cpp_function<&ld_fwd_bwd<Ctx>>());
  add("ldk_fwd_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_ids, Tensor teacher_logprobs, "
      "Tensor? labels, " FUSEDCE_DISTILL_ARGS FUSEDCE_DISTILL_FWD_BWD_OUT,
      cpp_function<&ldk_fwd_bwd<Ctx>>());
  add("ldk_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_ids, Tensor teacher_logprobs, "
      "Tensor? labels, " FUSEDCE_DISTILL_ARGS ")" FUSEDCE_DISTILL_OUT,
      cpp_function<&ldk_fwd<Ctx>>());
  add("ldk_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_ids, Tensor teacher_logprobs, "
      "Tensor? labels, Tensor stats, Tensor grad_loss, " FUSEDCE_DISTILL_ARGS FUSEDCE_DISTILL_GRADS,
      cpp_function<&ldk_bwd<Ctx>>());
  add("ld_shard_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_hidden, Tensor teacher_weight, "
      "Tensor? teacher_bias, Tensor? labels, int vocab_start, int vocab_total, " FUSEDCE_DISTILL_ARGS ") -> Tensor",
      cpp_function<&ld_shard_stats<Ctx>>());
  add("ld_shard_parts(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_hidden, Tensor teacher_weight, "
      "Tensor? teacher_bias, Tensor? labels, Tensor gathered, int vocab_start, int vocab_total, " FUSEDCE_DISTILL_ARGS
      ") -> (Tensor row_stats, Tensor hard, Tensor parts)",
      cpp_function<&ld_shard_parts<Ctx>>());
  add("ld_shard_reduce(Tensor gathered, Tensor row_stats, Tensor hard, Tensor? labels, " FUSEDCE_DISTILL_ARGS
      ")" FUSEDCE_DISTILL_OUT,
      cpp_function<&ld_shard_reduce<Ctx>>());
  add("ld_shard_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_hidden, Tensor teacher_weight, "
      "Tensor? teacher_bias, Tensor? labels, Tensor stats, Tensor grad_loss, int vocab_start, int vocab_total, "
      FUSEDCE_DISTILL_ARGS FUSEDCE_DISTILL_GRADS,
      cpp_function<&ld_shard_bwd<Ctx>>());
  add("ldk_shard_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_ids, Tensor teacher_logprobs, "
      "Tensor? labels, int vocab_start, int vocab_total, " FUSEDCE_DISTILL_ARGS ") -> Tensor",
      cpp_function<&ldk_shard_stats<Ctx>>());
  add("ldk_shard_parts(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_ids, Tensor teacher_logprobs, "
      "Tensor? labels, Tensor gathered, int vocab_start, int vocab_total, " FUSEDCE_DISTILL_ARGS
      ") -> (Tensor row_stats, Tensor hard, Tensor parts)",
      cpp_function<&ldk_shard_parts<Ctx>>());
  add("ldk_shard_reduce(Tensor gathered, Tensor row_stats, Tensor hard, Tensor teacher_logprobs, Tensor? labels, "
      FUSEDCE_DISTILL_ARGS ")" FUSEDCE_DISTILL_OUT,
      cpp_function<&ldk_shard_reduce<Ctx>>());
  add("ldk_shard_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_ids, Tensor teacher_logprobs, "
      "Tensor? labels, Tensor stats, Tensor grad_loss, int vocab_start, int vocab_total, " FUSEDCE_DISTILL_ARGS
      FUSEDCE_DISTILL_GRADS,
      cpp_function<&ldk_shard_bwd<Ctx>>());
}

// ADInplaceOrView kernel of every op that writes into its arguments: run the op, then bump the
// version counter of each tensor it wrote (what PyTorch's own in-place ops do), so autograd
// notices when a tensor it saved for a backward has been overwritten.
inline void bump_versions_of_written(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
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

// The op's name: its schema up to the argument list.
inline std::string op_name(const char* schema) {
  const std::string s(schema);
  return s.substr(0, s.find('('));
}

// Every schema, with Ctx's kernels under the CPU key, for the ops that write into an argument the
// version-bumping ADInplaceOrView kernel, and ce_loss's C++ autograd.
template <class Ctx>
void define_ops(torch::Library& m) {
  for_each_op<Ctx>([&](const char* schema, torch::CppFunction kernel) {
    const std::string name = op_name(schema);
    m.def(schema);
    m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CPU, std::move(kernel)));
    if (torch::schema(schema).is_mutable()) {
      m.impl(name.c_str(),
             torch::dispatch(c10::DispatchKey::ADInplaceOrView,
                             torch::CppFunction::makeFromBoxedFunction<&bump_versions_of_written>()));
    }
  });
  m.impl("ce_loss", torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(ce_loss_autograd)));
}

// Ctx's kernels of every op, in a TORCH_LIBRARY_IMPL block of their dispatch key.
template <class Ctx>
void register_kernels(torch::Library& m) {
  for_each_op<Ctx>([&](const char* schema, torch::CppFunction kernel) {
    m.impl(op_name(schema).c_str(), std::move(kernel));
  });
}

}  // namespace fusedce_torch
