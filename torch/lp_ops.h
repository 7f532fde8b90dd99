// The kernels behind the log-probability torch ops (schemas in registry.h): wrap tensors into
// the core's views, check what the core cannot see (devices, dimensions), call the three steps of
// fusedce/logprobs.h. No arithmetic on tensor data and no communication here: the Python front
// end (python/fusedce/token_logprobs.py) calls step 2 on one rank's statistics for a single device, or
// on every rank's, all-gathered, for a vocabulary-parallel head.
//
// Each op is a template over a device context `Ctx`, as in ops.h.
#pragma once

#include <fusedce/logprobs.h>

#include <tuple>

#include "linear_ops.h"
#include "ops.h"

namespace fusedce_torch {

inline fusedce::LogprobOptions logprob_options_of(double temperature, int64_t ignore_index, bool distribution_stats) {
  fusedce::LogprobOptions o;
  o.temperature = static_cast<float>(temperature);
  o.ignore_index = ignore_index;
  o.distribution_stats = distribution_stats;
  return o;
}

inline Tensor empty_lp_stats(const Tensor& like, int64_t n) {
  return at::empty({n + 1, fusedce::kLogprobStatsWidth}, like.options().dtype(at::kFloat));
}

inline fusedce::MatrixView lp_stats_view(const Tensor& stats) {
  return fusedce::matrix(stats.data_ptr(), fusedce::DType::kFloat32, stats.size(0), fusedce::kLogprobStatsWidth);
}

inline size_t chunk_budget_of(int64_t chunk_budget_bytes) {
  TORCH_CHECK_VALUE(chunk_budget_bytes >= 0, "fusedce: chunk_budget_bytes must be >= 0 (0 = default), got ",
                    chunk_budget_bytes);
  return static_cast<size_t>(chunk_budget_bytes);
}

// step 2's outputs as step 3 reads them
inline fusedce::LogprobOutputs lp_outputs_of(const Tensor& like, const char* like_name, const Tensor& lse,
                                             const Tensor& logprob, const Tensor& entropy) {
  check_same_device(lse, "lse", like, like_name);
  check_same_device(logprob, "logprob", like, like_name);
  check_same_device(entropy, "entropy", like, like_name);
  fusedce::LogprobOutputs f;
  f.lse = vector_of(lse, "lse");
  f.logprob = vector_of(logprob, "logprob");
  f.entropy = vector_of(entropy, "entropy");
  return f;
}

inline fusedce::VectorView optional_vector(const OptTensor& t, const char* name, const Tensor& like,
                                           const char* like_name) {
  if (!t.has_value()) return fusedce::VectorView{};
  check_same_device(*t, name, like, like_name);
  return vector_of(*t, name);
}

// Step 1 over logits (N, V_local): float32 (N + 1, kLogprobStatsWidth).
template <class Ctx>
Tensor lp_stats(const Tensor& logits, const Tensor& target, int64_t vocab_start, int64_t vocab_total,
                double temperature, int64_t ignore_index, bool distribution_stats) {
  Ctx ctx(logits, "logits");
  const fusedce::MatrixView x = matrix_of(logits, "logits");
  check_inputs(logits, target);
  Tensor stats = empty_lp_stats(logits, logits.size(0));
  check_status(fusedce::logprobs_stats(ctx.device(), x, vector_of(target, "target"),
                                       fusedce::ShardSpec{vocab_start, vocab_total},
                                       logprob_options_of(temperature, ignore_index, distribution_stats), lp_stats_view(stats)),
               "lp_stats");
  return stats;
}

// Step 1 of the linear form: the statistics of hidden @ weight.T (+ bias), formed chunk by chunk.
template <class Ctx>
Tensor llp_stats(const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& target,
                 int64_t vocab_start, int64_t vocab_total, double temperature, int64_t ignore_index, bool distribution_stats,
                 int64_t chunk_budget_bytes) {
  Ctx ctx(hidden, "hidden");
  check_hidden_2d(hidden);
  const fusedce::MatrixView h = linear_matrix_of(hidden, "hidden", "(N, H)");
  check_linear_inputs(hidden, weight, bias, target);
  const fusedce::MatrixView w = linear_matrix_of(weight, "weight", "(V, H)");
  const size_t budget = chunk_budget_of(chunk_budget_bytes);
  Tensor stats = empty_lp_stats(hidden, hidden.size(0));
  const size_t bytes = fusedce::linear_logprobs_workspace_size(1, ctx.device(), h.rows, h.cols, w.rows, h.dtype,
                                                               budget, {});
  const Tensor ws = at::empty({static_cast<int64_t>(bytes)}, hidden.options().dtype(at::kByte));
  const Tensor bias_c = contiguous_bias(bias);
  check_status(fusedce::linear_logprobs_stats(
                   ctx.device(), h, w, bias_c.defined() ? vector_of(bias_c, "bias") : fusedce::VectorView{},
                   vector_of(target, "target"), fusedce::ShardSpec{vocab_start, vocab_total},
                   logprob_options_of(temperature, ignore_index, distribution_stats), budget, lp_stats_view(stats), workspace_of(ws)),
               "llp_stats");
  return stats;
}

// The gathered statistics (world * (N + 1), kLogprobStatsWidth) of steps 2 and 4; returns N.
inline int64_t check_gathered(const Tensor& gathered, const Tensor& target) {
  check_same_device(target, "target", gathered, "gathered");
  TORCH_CHECK_VALUE(gathered.dim() == 2 && gathered.size(1) == fusedce::kLogprobStatsWidth &&
                        gathered.scalar_type() == at::kFloat && gathered.is_contiguous(),
                    "fusedce: gathered must be a contiguous float32 (world * (N + 1), ",
                    fusedce::kLogprobStatsWidth, ") tensor, got ", gathered.scalar_type(), " of shape ",
                    gathered.sizes());
  TORCH_CHECK_VALUE(target.dim() == 1, "fusedce: target must be 1-D, got shape ", target.sizes());
  const int64_t n = target.size(0);
  TORCH_CHECK_VALUE(gathered.size(0) >= n + 1 && gathered.size(0) % (n + 1) == 0, "fusedce: gathered has ",
                    gathered.size(0), " rows, which is not world * (N + 1) for the target's N = ", n);
  return n;
}

// Step 2: the statistics of every rank (one rank's for a single device), in rank order, into
// logprob, entropy and lse, float32 (N,) each.
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> lp_merge(const Tensor& gathered, const Tensor& target, int64_t vocab_start,
                                            int64_t vocab_total, double temperature, int64_t ignore_index, bool distribution_stats) {
  Ctx ctx(gathered, "gathered");
  const int64_t n = check_gathered(gathered, target);
  const auto f32 = gathered.options().dtype(at::kFloat);
  Tensor logprob = at::empty({n}, f32), entropy = at::empty({n}, f32), lse = at::empty({n}, f32);
  fusedce::LogprobOutputs out;
  out.logprob = vector_of(logprob, "logprob");
  out.entropy = vector_of(entropy, "entropy");
  out.lse = vector_of(lse, "lse");
  check_status(fusedce::logprobs_merge(ctx.device(), lp_stats_view(gathered), gathered.size(0) / (n + 1),
                                       vector_of(target, "target"), fusedce::ShardSpec{vocab_start, vocab_total},
                                       logprob_options_of(temperature, ignore_index, distribution_stats), out),
               "lp_merge");
  return {logprob, entropy, lse};
}

// Step 4: from the same gathered statistics (step 1 run with distribution_stats), the
// distribution statistics log_sum_sq_probs, mean_logit and is_top1 (1 or 0), float32 (N,) each.
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> lp_distribution_stats(const Tensor& gathered, const Tensor& target,
                                                         int64_t vocab_start, int64_t vocab_total, double temperature,
                                                         int64_t ignore_index, bool distribution_stats) {
  Ctx ctx(gathered, "gathered");
  const int64_t n = check_gathered(gathered, target);
  const auto f32 = gathered.options().dtype(at::kFloat);
  Tensor lss = at::empty({n}, f32), mean = at::empty({n}, f32), top1 = at::empty({n}, f32);
  fusedce::DistributionStats out;
  out.log_sum_sq_probs = vector_of(lss, "log_sum_sq_probs");
  out.mean_logit = vector_of(mean, "mean_logit");
  out.is_top1 = vector_of(top1, "is_top1");
  check_status(fusedce::logprobs_distribution_stats(
                   ctx.device(), lp_stats_view(gathered), gathered.size(0) / (n + 1), vector_of(target, "target"),
                   fusedce::ShardSpec{vocab_start, vocab_total},
                   logprob_options_of(temperature, ignore_index, distribution_stats), out),
               "lp_distribution_stats");
  return {lss, mean, top1};
}

// Step 3 over logits into dlogits (N, V_local) in the logits' dtype, for the upstream gradients
// grad_logprob (N,) and grad_entropy (N,) or None, float32. dlogits may be the logits' own
// buffer (lp_bwd_): every backend reads each element before writing it, in the thread that
// writes it (src/cpu/kernels_impl.h lp_grad_rows_t: a row chunk loaded, then stored;
// src/cuda/logprobs/logprobs_kernels.cu lp_backward_kernel: element j read, then written).
template <class Ctx>
void lp_bwd_into(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& logprob,
                 const Tensor& entropy, const Tensor& grad_logprob, const OptTensor& grad_entropy,
                 int64_t vocab_start, int64_t vocab_total, double temperature, int64_t ignore_index, bool distribution_stats,
                 const Tensor& dlogits, const char* op) {
  Ctx ctx(logits, "logits");
  const fusedce::MatrixView x = matrix_of(logits, "logits");
  check_inputs(logits, target);
  const fusedce::LogprobOutputs fwd = lp_outputs_of(logits, "logits", lse, logprob, entropy);
  check_same_device(grad_logprob, "grad_logprob", logits);
  check_status(fusedce::logprobs_backward(ctx.device(), x, vector_of(target, "target"),
                                          fusedce::ShardSpec{vocab_start, vocab_total},
                                          logprob_options_of(temperature, ignore_index, distribution_stats), fwd,
                                          vector_of(grad_logprob, "grad_logprob"),
                                          optional_vector(grad_entropy, "grad_entropy", logits, "logits"),
                                          matrix_of(dlogits, "dlogits")),
               op);
}

// Step 3 over logits: a new dlogits tensor.
template <class Ctx>
Tensor lp_bwd(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& logprob,
              const Tensor& entropy, const Tensor& grad_logprob, const OptTensor& grad_entropy, int64_t vocab_start,
              int64_t vocab_total, double temperature, int64_t ignore_index, bool distribution_stats) {
  Tensor dlogits = at::empty(logits.sizes(), logits.options());
  lp_bwd_into<Ctx>(logits, target, lse, logprob, entropy, grad_logprob, grad_entropy, vocab_start, vocab_total,
                   temperature, ignore_index, distribution_stats, dlogits, "lp_bwd");
  return dlogits;
}

// Step 3 over logits, in place: the logits are overwritten with dlogits (no second (N, V)
// buffer). The caller owns the logits (fusedce.linear_logprobs(keep_logits=True) saves its own).
template <class Ctx>
void lp_bwd_(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& logprob,
             const Tensor& entropy, const Tensor& grad_logprob, const OptTensor& grad_entropy, int64_t vocab_start,
             int64_t vocab_total, double temperature, int64_t ignore_index, bool distribution_stats) {
  lp_bwd_into<Ctx>(logits, target, lse, logprob, entropy, grad_logprob, grad_entropy, vocab_start, vocab_total,
                   temperature, ignore_index, distribution_stats, logits, "lp_bwd_");
}

// Step 3 of the linear form: this rank's part of grad_hidden (float32 (N, H): the sum over ranks
// is the gradient) and its slices of grad_weight and grad_bias in the weight's dtype. Gradients
// not asked for come back as empty (0,) tensors.
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> llp_bwd(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                           const Tensor& target, const Tensor& lse, const Tensor& logprob,
                                           const Tensor& entropy, const Tensor& grad_logprob,
                                           const OptTensor& grad_entropy, int64_t vocab_start, int64_t vocab_total,
                                           double temperature, int64_t ignore_index, bool distribution_stats, int64_t chunk_budget_bytes,
                                           bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) {
  Ctx ctx(hidden, "hidden");
  check_hidden_2d(hidden);
  const fusedce::MatrixView h = linear_matrix_of(hidden, "hidden", "(N, H)");
  check_linear_inputs(hidden, weight, bias, target);
  const fusedce::MatrixView w = linear_matrix_of(weight, "weight", "(V, H)");
  TORCH_CHECK_VALUE(!need_grad_bias || bias.has_value(), "fusedce: need_grad_bias is set but bias is not given");
  const size_t budget = chunk_budget_of(chunk_budget_bytes);
  const fusedce::LogprobOutputs fwd = lp_outputs_of(hidden, "hidden", lse, logprob, entropy);
  check_same_device(grad_logprob, "grad_logprob", hidden, "hidden");
  auto none = [&] { return at::empty({0}, hidden.options()); };
  Tensor grad_hidden = need_grad_hidden ? at::empty(hidden.sizes(), hidden.options().dtype(at::kFloat)) : none();
  Tensor grad_weight = need_grad_weight ? at::empty(weight.sizes(), weight.options()) : none();
  Tensor grad_bias = need_grad_bias ? at::empty(bias->sizes(), bias->options()) : none();
  fusedce::LinearGrads grads;
  if (need_grad_hidden) grads.grad_hidden = matrix_of(grad_hidden, "grad_hidden");
  if (need_grad_weight) grads.grad_weight = matrix_of(grad_weight, "grad_weight");
  if (need_grad_bias) grads.grad_bias = vector_of(grad_bias, "grad_bias");
  const size_t bytes = fusedce::linear_logprobs_workspace_size(3, ctx.device(), h.rows, h.cols, w.rows, h.dtype,
                                                               budget, grads);
  const Tensor ws = at::empty({static_cast<int64_t>(bytes)}, hidden.options().dtype(at::kByte));
  const Tensor bias_c = contiguous_bias(bias);
  check_status(fusedce::linear_logprobs_backward(
                   ctx.device(), h, w, bias_c.defined() ? vector_of(bias_c, "bias") : fusedce::VectorView{},
                   vector_of(target, "target"), fusedce::ShardSpec{vocab_start, vocab_total},
                   logprob_options_of(temperature, ignore_index, distribution_stats), budget, fwd,
                   vector_of(grad_logprob, "grad_logprob"),
                   optional_vector(grad_entropy, "grad_entropy", hidden, "hidden"), grads, workspace_of(ws)),
               "llp_bwd");
  return {grad_hidden, grad_weight, grad_bias};
}

}  // namespace fusedce_torch
